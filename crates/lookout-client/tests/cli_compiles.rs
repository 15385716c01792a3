//! Builds the agent's `lookout get` / `lookout watch` module
//! (`crates/lookout-agent/src/cli.rs`) against this crate, runs its unit
//! tests (the rendering checks in its `mod tests`), and runs the commands
//! against `common::FakeAgent`. It documents, from the client's side, that
//! the agent's CLI renders correctly against the client's types: a change
//! here that breaks the CLI fails this test, not only the agent's build.

mod common;

#[path = "../../lookout-agent/src/cli.rs"]
mod cli;

use std::io::{self, Write};

use common::{FakeAgent, container, within};
use lookout_client::{Client, ConnectOptions, Filter};

#[tokio::test]
async fn get_lists_the_agents_containers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("lookout.sock");
    let agent = FakeAgent::start(&socket, 100);
    agent.add(container("a", "runc", "default", "web"));
    let get = |output| {
        let socket = socket.clone();
        async move {
            let mut out = Vec::new();
            within("lookout get", cli::write_get(&socket, output, &mut out))
                .await
                .expect("lookout get");
            String::from_utf8(out).expect("UTF-8")
        }
    };
    let table = get(cli::GetOutput::Table).await;
    let lines: Vec<Vec<&str>> = table
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(lines[0][..3], ["ID", "RUNTIME", "NAMESPACE/POD"]);
    assert_eq!(lines[1][..5], ["a", "runc", "default/web", "main", "4242"]);
    assert_eq!(lines.len(), 2);
    let wide = get(cli::GetOutput::Wide).await;
    assert!(
        wide.starts_with("ID ") && wide.contains(" BUNDLE\n"),
        "{wide}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&get(cli::GetOutput::Json).await).expect("valid JSON");
    assert_eq!(json["revision"], 1);
    assert_eq!(json["containers"][0]["id"], "a");
}

#[tokio::test]
async fn get_watch_and_gate_say_when_the_agent_is_not_there() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("lookout.sock");
    let gate_options = cli::GateOptions {
        name: "cli-test".into(),
        deadline: std::time::Duration::from_secs(2),
        fail_closed: false,
        hold: std::time::Duration::ZERO,
        deny: None,
        output: cli::WatchOutput::Json,
    };
    let (get, watch, gate) = within("lookout get, watch and gate to give up", async {
        tokio::join!(
            cli::get(&socket, cli::GetOutput::Table),
            cli::watch(&socket, cli::WatchOutput::Text, 0),
            cli::gate(&socket, gate_options),
        )
    })
    .await;
    for error in [
        get.expect_err("no agent"),
        watch.expect_err("no agent"),
        gate.expect_err("no agent"),
    ] {
        assert!(format!("{error:#}").contains("does not exist"), "{error:#}");
    }
}

/// Takes `lines` lines, then fails like stdout does when `head` has
/// exited.
struct Head {
    text: String,
    lines: usize,
}

impl Write for Head {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.text.matches('\n').count() >= self.lines {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        self.text.push_str(&String::from_utf8_lossy(buf));
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn watch_prints_events_until_stdout_closes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("lookout.sock");
    let agent = FakeAgent::start(&socket, 100);
    agent.add(container("a", "runc", "default", "web"));
    let client = Client::connect_with(&socket, ConnectOptions::new())
        .await
        .expect("connect");
    let watcher = client.watch(Filter::all()).await.expect("watch");
    agent.add(container("b", "crun", "payments", "api"));
    agent.remove("a", 137);
    // The write of this one finds the pipe closed.
    agent.add(container("c", "runc", "default", "web"));

    // `lookout watch | head -n 4`: snapshot line, its end, two changes.
    let mut out = Head {
        text: String::new(),
        lines: 4,
    };
    within(
        "lookout watch to stop",
        cli::print_events(watcher, cli::WatchOutput::Text, &mut out),
    )
    .await
    .expect("a closed pipe is not an error");
    assert_eq!(
        out.text,
        "1 SNAPSHOT a runc default/web 4242\n\
         1 SNAPSHOT_END 1\n\
         2 ADDED b crun payments/api 4242\n\
         3 REMOVED a runc default/web 4242 exit=137\n"
    );
}
