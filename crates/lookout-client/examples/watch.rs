//! Prints this node's containers, then every change, and keeps a mirror of
//! the set as a consumer would. Survives agent restarts.
//!
//! ```sh
//! cargo run -p lookout-client --example watch [SOCKET]
//! ```

use std::collections::BTreeMap;

use lookout_client::{Client, Event, Filter, proto::Container};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), lookout_client::Error> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let socket = std::env::args()
        .nth(1)
        .unwrap_or_else(|| lookout_client::DEFAULT_SOCKET.to_owned());
    let client = Client::connect(&socket).await?;
    let mut watcher = client.watch(Filter::all()).await?;
    // The consumer's state: replaced by a snapshot, updated by changes.
    let mut mirror: BTreeMap<String, Container> = BTreeMap::new();
    // `None` only after an error that would repeat, which this loop
    // returns first: the watcher outlives agent restarts.
    while let Some(event) = watcher.next().await {
        let event = match event {
            Ok(event) => event,
            // The agent has been gone longer than the retry window; keep
            // trying (a watcher resumes where it was).
            Err(error) if error.is_retryable() => {
                // The message says what failed; its sources say why.
                let mut text = error.to_string();
                let mut cause = std::error::Error::source(&error);
                while let Some(c) = cause {
                    text = format!("{text}: {c}");
                    cause = c.source();
                }
                eprintln!("{text}; still trying");
                continue;
            }
            Err(error) => return Err(error),
        };
        match event {
            Event::Snapshot {
                revision,
                containers,
            } => {
                mirror = containers.into_iter().map(|c| (c.id.clone(), c)).collect();
                println!("{revision} snapshot: {} containers", mirror.len());
                for c in mirror.values() {
                    println!("{revision}   {} {} pid {}", c.runtime, c.id, c.pid);
                }
            }
            Event::Added {
                revision,
                container,
                ..
            } => {
                println!(
                    "{revision} + {} {} pid {}",
                    container.runtime, container.id, container.pid
                );
                mirror.insert(container.id.clone(), container);
            }
            Event::Removed {
                revision,
                container,
                exit_code,
                reason,
                ..
            } => {
                println!("{revision} - {} exit {exit_code:?} {reason}", container.id);
                mirror.remove(&container.id);
            }
            _ => {}
        }
    }
    Ok(())
}
