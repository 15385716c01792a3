//! Prints the pods and containers of an NRI runtime as they come and go.
//!
//! ```sh
//! sudo cargo run -p lookout-nri --example watch -- /var/run/nri/nri.sock
//! ```
//!
//! The runtime must have NRI enabled (containerd 1.7: `disable = false`
//! under `[plugins."io.containerd.nri.v1.nri"]`; on by default in
//! containerd 2.x and CRI-O).

use lookout_nri::{DEFAULT_SOCKET, Event, Plugin};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let socket = std::env::args()
        .nth(1)
        .unwrap_or_else(|| DEFAULT_SOCKET.into());
    let (plugin, mut events) = Plugin::builder().socket(socket).build()?;
    let stats = plugin.stats();
    tokio::spawn(plugin.run());
    loop {
        let delivery = tokio::select! {
            d = events.recv() => match d { Some(d) => d, None => break },
            _ = tokio::signal::ctrl_c() => break,
        };
        match &delivery.event {
            Event::Synchronized(s) => println!(
                "synchronized with {} {}: {} pods, {} containers ({} new, {} gone since the last time)",
                s.runtime.name,
                s.runtime.version,
                s.pods.len(),
                s.containers.len(),
                s.new_containers.len(),
                s.gone_containers.len()
            ),
            Event::Pod { phase, pod } => {
                println!("pod {phase:?} {}/{} ({})", pod.namespace, pod.name, pod.id)
            }
            Event::Container {
                phase,
                pod,
                container,
            } => {
                let pod = pod
                    .as_ref()
                    .map(|p| format!("{}/{}", p.namespace, p.name))
                    .unwrap_or_default();
                println!(
                    "container {phase:?} {pod} {} ({}) pid {:?} {:?}",
                    container.name, container.id, container.pid, container.args
                );
            }
            Event::Disconnected(e) => println!("disconnected ({e}); reconnecting"),
            other => println!("{other:?}"),
        }
        // CreateContainer and StartContainer wait until here.
        delivery.ack.release();
    }
    eprintln!(
        "held {} requests, {} late, {} events dropped",
        stats.held(),
        stats.late(),
        stats.dropped()
    );
    Ok(())
}
