//! Holds each container start just long enough to look at it: prints its
//! init pid and the inode of each of its namespaces (from `/proc/<pid>/ns`,
//! next to what the agent reported), then allows it.
//!
//! The gate is root-only, and a held start waits for the answer (up to the
//! deadline asked for here, 1 s), so run this where a slow start is
//! harmless:
//!
//! ```sh
//! cargo build -p lookout-client --example gate
//! sudo target/debug/examples/gate [SOCKET]
//! ```

use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use lookout_client::{Client, Filter, GateOptions, OnFailure};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), lookout_client::Error> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let socket = std::env::args()
        .nth(1)
        .unwrap_or_else(|| lookout_client::DEFAULT_SOCKET.to_owned());
    let client = Client::connect(&socket).await?;
    let options = GateOptions::new("example-gate")
        .filter(Filter::all())
        .deadline(Duration::from_secs(1))
        // If this example dies, starts go on.
        .on_failure(OnFailure::FailOpen);
    let mut gate = client.gate(options).await?;
    println!(
        "subscribed as {:?}; the agent waits {:?} for each answer",
        gate.name(),
        gate.deadline()
    );
    while let Some(hold) = gate.next().await {
        let hold = hold?;
        let c = hold.container();
        let held = if hold.held() { "held" } else { "not held" };
        println!("{} ({}, {held}): pid {}", c.id, c.runtime, c.pid);
        if c.pid != 0 {
            let reported = c.namespaces.unwrap_or_default();
            for (name, agent_says) in [
                ("mnt", reported.mnt),
                ("pid", reported.pid),
                ("net", reported.net),
                ("user", reported.user),
                ("uts", reported.uts),
                ("ipc", reported.ipc),
                ("cgroup", reported.cgroup),
            ] {
                // stat(2) follows the ns link: its inode is the namespace's.
                match std::fs::metadata(format!("/proc/{}/ns/{name}", c.pid)) {
                    Ok(meta) => println!("  {name:<6} {} (agent: {agent_says})", meta.ino()),
                    Err(error) => println!("  {name:<6} unreadable: {error}"),
                }
            }
        }
        // Answers a held start; does nothing for one that was not held.
        // (Dropping `hold` unanswered would allow it too, with a warning.)
        hold.allow()?;
    }
    // `None`: the agent ended the gate and none took it again in time.
    println!("the agent ended the gate");
    Ok(())
}
