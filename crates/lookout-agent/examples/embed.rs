//! lookout embedded in a program of your own: follows the node's
//! containers and holds each created container's start until the program
//! has looked at it (here: printed its init pid and mount namespace).
//!
//! ```sh
//! sudo cargo run -p lookout-agent --example embed
//! ```
//! then, in another shell, `runc create` and `runc start` a container.

use std::time::Duration;

use lookout_agent::{Discovery, FailurePolicy, Filter, Subscription, Verdict, WatchItem};

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let discovery = Discovery::builder().no_socket().start()?;
    let hub = discovery.hub().clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let result: anyhow::Result<()> = rt.block_on(async move {
        let mut gate = hub.gate(Subscription {
            name: "embed-example".into(),
            filter: Filter::default(),
            deadline: Duration::from_secs(2),
            on_failure: FailurePolicy::Open,
        })?;
        let mut watch = hub.watch(0, Filter::default())?;
        loop {
            tokio::select! {
                item = watch.next() => match item {
                    Ok(WatchItem::Snapshot { revision, containers }) => {
                        println!("{} containers at revision {revision}", containers.len());
                    }
                    Ok(WatchItem::Change(c)) => println!(
                        "{:>20} {:?} {} ({})",
                        c.revision, c.kind, c.live.container.id, c.live.container.runtime
                    ),
                    Err(e) => return Err(e.into()),
                },
                hold = gate.holds.recv() => {
                    let Some(h) = hold else { return Ok(()) };
                    let c = &h.live.container;
                    let mnt = c.pid.and_then(|p| std::fs::read_link(format!("/proc/{p}/ns/mnt")).ok());
                    println!("before the first instruction of {}: pid {:?}, {mnt:?}", c.id, c.pid);
                    if let Some(answer) = h.respond {
                        let _ = answer.send(Verdict::Allow);
                    }
                }
                _ = tokio::signal::ctrl_c() => return Ok(()),
            }
        }
    });
    discovery.stop()?;
    result
}
