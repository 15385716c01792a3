//! Watches runtime binaries and prints container events, without the agent.
//!
//! ```sh
//! cargo xtask build-ebpf
//! sudo cargo run -p lookout-runtime-hook --example watch_runtimes -- target/bpf/lookout-ebpf.o /usr/sbin/runc
//! ```

use std::path::PathBuf;

use lookout_runtime_hook::RuntimeHook;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let object = args
        .next()
        .ok_or("usage: watch BPF_OBJECT RUNTIME_BINARY...")?;
    let binaries: Vec<PathBuf> = args.map(PathBuf::from).collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut hook = RuntimeHook::builder()
            .binaries(binaries)
            .bpf_object(std::fs::read(&object)?)
            .build()?;
        let mut print = |e: lookout_model::ContainerEvent| println!("{e:?}");
        hook.scan(&mut print);
        eprintln!("ready");
        let stats = hook
            .run(&mut print, async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await;
        eprintln!("{stats:?}");
        Ok::<_, Box<dyn std::error::Error>>(())
    })
}
