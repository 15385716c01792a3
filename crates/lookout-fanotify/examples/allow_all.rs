//! The smallest useful fanotify permission responder: marks the files
//! given as arguments with `FAN_OPEN_EXEC_PERM` and allows every exec.
//! lookout's benchmark uses it as the floor (the cost of any exec-permission
//! listener), next to no listener and the real agent.
//!
//! ```sh
//! sudo cargo run --example allow_all -- /usr/bin/runc
//! ```

use lookout_fanotify::{Class, Fanotify, MIN_READ_BUFFER, MarkFlags, Mask};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let paths: Vec<String> = std::env::args().skip(1).collect();
    if paths.is_empty() {
        return Err("usage: allow_all FILE...".into());
    }
    let group = Fanotify::builder()
        .class(Class::Content)
        .nonblock(false)
        .init()?;
    for p in &paths {
        group.add_mark(p.as_ref(), MarkFlags::empty(), Mask::OPEN_EXEC_PERM)?;
    }
    eprintln!("ready: allowing execs of {}", paths.join(", "));
    let mut buf = vec![0u8; MIN_READ_BUFFER];
    let mut events = Vec::new();
    loop {
        events.clear();
        group.read_events(&mut buf, &mut events)?;
        for mut e in events.drain(..) {
            if let Some(p) = e.take_permission() {
                p.allow()?;
            }
        }
    }
}
