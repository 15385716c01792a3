//! The work floor of lookout's benchmark: what discovering a container
//! costs when everything the agent must do for it runs on one thread, with
//! none of the agent's safety boundaries.
//!
//! It marks the runtime binary given (`FAN_OPEN_EXEC_PERM`) and, on the one
//! thread that answers the execs:
//!
//! - takes each exec's argv from the agent's BPF programs (the argv
//!   capture, loaded from the object given) and parses it;
//! - for a `create`, reads and parses the bundle's config.json before it
//!   allows the exec, and watches the `create` process with a pidfd;
//! - when that process exits, reads and parses the state file, checks the
//!   init process, reads its namespaces and cgroup, and prints `added`;
//! - watches the init process with a pidfd and prints `removed`.
//!
//! Every read, parse and write runs where the execs are answered: a hung
//! file system, a process holding its `mmap_lock`, or a reader that stops
//! reading stdout stops this thread, and every exec of the runtime with it.
//! The agent keeps those off its answering thread (a thread that only
//! answers, readers with a deadline, a stdout writer); beside the agent, this
//! measures what that costs. It is not a container monitor: it knows only
//! `create`, takes a runtime it does not know by name for runc, and trusts
//! what it reads.
//!
//! With `--gate=SOCKET` it also serves one start-gate subscriber (see
//! `gate.rs`): each created container is held until the subscriber
//! decides, as the agent's gate holds it.
//!
//! ```sh
//! cargo xtask build-ebpf
//! sudo cargo run --release -p lookout-bench --bin work_floor -- \
//!     target/bpf/lookout-ebpf.o [--gate=/run/floor.sock] /usr/sbin/runc
//! ```

use std::collections::HashMap;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use lookout_fanotify::{Class, Fanotify, MIN_READ_BUFFER, MarkFlags, Mask, Report};
use lookout_host::proc;
use lookout_model::{Container, ContainerEvent, RuntimeKind, Source, Status};
use lookout_runtime_hook::argv::{self, Command};
use lookout_runtime_hook::oci::{self, OciConfig};
use lookout_runtime_hook::{ExecCapture, state};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

mod gate;

/// What a pidfd watches.
enum Watch {
    /// A `create` that has not exited: the container it makes.
    Create {
        id: String,
        runtime: RuntimeKind,
        root: PathBuf,
        bundle: Option<PathBuf>,
        config: Option<OciConfig>,
    },
    /// A container's init process.
    Init(Box<Container>),
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (gated, mut args): (Vec<String>, Vec<String>) = std::env::args()
        .skip(1)
        .partition(|a| a.starts_with("--gate="));
    let gate = match gated.last() {
        Some(g) => Some(gate::Gate::serve(Path::new(&g["--gate=".len()..]))?),
        None => None,
    };
    if args.is_empty() {
        return Err(USAGE.into());
    }
    let object = args.remove(0);
    let marked = args;
    if marked.is_empty() {
        return Err(USAGE.into());
    }
    let names: Vec<String> = marked.iter().map(|p| file_name(p).to_owned()).collect();
    let object = std::fs::read(&object).map_err(|e| format!("reading {object}: {e}"))?;
    let mut capture = ExecCapture::load(&object, &names)?;
    let group = Fanotify::builder()
        .class(Class::Content)
        .report(Report::TID)
        .nonblock(true)
        .init()?;
    for p in &marked {
        group.add_mark(p.as_ref(), MarkFlags::empty(), Mask::OPEN_EXEC_PERM)?;
    }
    eprintln!(
        "ready: allowing execs of {} and doing their containers' work on one thread",
        marked.join(", ")
    );
    let mut buf = vec![0u8; MIN_READ_BUFFER];
    let mut events = Vec::new();
    let mut watches: HashMap<i32, (OwnedFd, Watch)> = HashMap::new();
    let mut line = Vec::with_capacity(4096);
    let stdout = std::io::stdout();
    loop {
        let mut fds = vec![PollFd::new(group.as_fd(), PollFlags::POLLIN)];
        let order: Vec<i32> = watches.keys().copied().collect();
        fds.extend(
            order
                .iter()
                .filter_map(|k| watches.get(k))
                .map(|(fd, _)| PollFd::new(fd.as_fd(), PollFlags::POLLIN)),
        );
        poll(&mut fds, PollTimeout::NONE)?;
        let exited: Vec<i32> = fds[1..]
            .iter()
            .zip(&order)
            .filter(|(p, _)| p.revents().is_some_and(|r| !r.is_empty()))
            .map(|(_, k)| *k)
            .collect();
        let execs = fds[0].revents().is_some_and(|r| !r.is_empty());
        drop(fds);
        // Exits first: a `start` read in the same round as its `create`'s
        // exit finds the container reported (and held).
        for k in exited {
            let Some((_, w)) = watches.remove(&k) else {
                continue;
            };
            let event = match w {
                Watch::Create {
                    id,
                    runtime,
                    root,
                    bundle,
                    config,
                } => {
                    let Some(c) = created(&id, runtime, &root, bundle, config) else {
                        continue;
                    };
                    let Some(pid) = c.pid else { continue };
                    if let Some(g) = &gate {
                        g.hold(&c);
                    }
                    let event = ContainerEvent::added(Source::RuntimeHook, c.clone());
                    if let Some(fd) = pidfd(pid as i32) {
                        watches.insert(fd.as_raw_fd(), (fd, Watch::Init(Box::new(c))));
                    }
                    event
                }
                Watch::Init(c) => ContainerEvent::removed(Source::RuntimeHook, *c, None),
            };
            line.clear();
            serde_json::to_writer(&mut line, &event)?;
            line.push(b'\n');
            let mut out = stdout.lock();
            out.write_all(&line)?;
            out.flush()?;
        }
        if execs {
            events.clear();
            match group.read_events(&mut buf, &mut events) {
                Ok(_) => {}
                Err(e) if e.errno() == Some(libc::EAGAIN) => {}
                Err(e) => return Err(e.into()),
            }
            for mut e in events.drain(..) {
                let Some(perm) = e.take_permission() else {
                    continue;
                };
                // Paired by thread id; the process is the record's.
                let record = capture.take(e.pid() as u32);
                match record.and_then(|r| on_exec(r.tgid as i32, &r.argv)) {
                    Some(Exec::Create(pid, w)) => {
                        if let Some(fd) = pidfd(pid) {
                            watches.insert(fd.as_raw_fd(), (fd, w));
                        }
                    }
                    Some(Exec::Start(id)) => {
                        if let Some(g) = &gate {
                            // Held: the subscriber's decision answers it.
                            if let Some(p) = g.start(&id, perm) {
                                p.allow()?;
                                g.answered(&id);
                            }
                            continue;
                        }
                    }
                    None => {}
                }
                perm.allow()?;
            }
        }
    }
}

const USAGE: &str = "usage: work_floor BPF_OBJECT [--gate=SOCKET] RUNTIME_BINARY...";

/// A path's last component.
fn file_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// An exec the work floor acts on.
enum Exec {
    /// A `create` (its pid): what its pidfd should watch for.
    Create(i32, Watch),
    /// A `start` of this container.
    Start(String),
}

/// Parses the argv of exec `pid` and, for a `create`, reads its
/// config.json.
fn on_exec(pid: i32, argv: &[String]) -> Option<Exec> {
    let binary = argv.first().map(|a| file_name(a))?;
    let mut inv = argv::parse(argv, binary).ok()?;
    // A copy of runc under another name (so that an agent beside it does
    // not capture its execs) is still runc.
    if let RuntimeKind::Other(_) = inv.runtime {
        inv.runtime = RuntimeKind::Runc;
    }
    let args = match &inv.command {
        Command::Create(args) => args,
        Command::Start { id } => return Some(Exec::Start(id.clone())),
        _ => return None,
    };
    let cwd = proc::cwd(pid as u32);
    let bundle = inv.bundle(cwd.as_deref());
    let config = bundle
        .as_deref()
        .and_then(|b| oci::read_config_under(Path::new("/"), b, args.config.as_deref()).ok());
    let root = inv
        .root
        .clone()
        .unwrap_or_else(|| state::default_root(&inv.runtime));
    Some(Exec::Create(
        pid,
        Watch::Create {
            id: args.id.clone(),
            runtime: inv.runtime,
            root,
            bundle,
            config,
        },
    ))
}

/// The container a `create` that exited made, from its state file and its
/// init process.
fn created(
    id: &str,
    runtime: RuntimeKind,
    root: &Path,
    bundle: Option<PathBuf>,
    config: Option<OciConfig>,
) -> Option<Container> {
    let s = state::read_state_under(Path::new("/"), &runtime, root, id).ok()?;
    let init = proc::container_init(s.pid, s.start_time).ok()?;
    let mut c = Container::new(id, runtime);
    c.bundle = bundle;
    c.runtime_root = Some(root.to_path_buf());
    lookout_runtime_hook::fill_container_init(&mut c, &init, config, Status::Created);
    Some(c)
}

/// A pidfd for `pid`, or `None` when it is gone.
fn pidfd(pid: i32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd, or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    // SAFETY: a non-negative return is a new fd that nothing else owns.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
}
