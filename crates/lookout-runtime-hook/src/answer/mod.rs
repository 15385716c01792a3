//! The answering thread: one dedicated thread that reads the fanotify
//! group and answers runtime execs ("gate" is the consumers' word, for
//! the API's holds; this thread is the answerer).
//!
//! Most runtime execs (`state`, `kill`, `exec`, `delete`, `runc init`, the
//! kubelet's probes through `runc exec`) need nothing from the container
//! state machine: the answerer pairs the event with its BPF argv record, parses
//! it and allows it on the spot, with a blocking `read` like the smallest
//! possible responder. Only `create`, `run` and `start` go to the
//! hook's task, which answers them after it has done what must precede the
//! exec (reading config.json; reporting `Added` before `start`).
//!
//! N.B. why a thread of its own, not the tokio task that runs the state
//! machine: the reactor's epoll round trip, its timer bookkeeping and the
//! work after each answer would cost every runtime exec 10-20 us more than
//! a blocking responder on these 2-CPU machines.
//!
//! N.B. the thread blocks in `read(2)` on the group, with no `poll` before
//! it: the extra system call and wake-up cost each exec 1.4 us of latency
//! and 1.7 us of CPU here (docs/benchmarks.md, thirteenth pass). To stop
//! it, a private memfd is marked `FAN_MODIFY` in the same group and written
//! to: the event ends the read. Where that cannot be set up (proved once at
//! spawn), the thread polls the group and an eventfd instead.

use std::collections::HashSet;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lookout_fanotify::{Event, Fanotify, MIN_READ_BUFFER, MarkFlags, Mask, Permission};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::eventfd::{EfdFlags, EventFd};
use tokio::sync::mpsc;

use crate::argv::{self, Command, Invocation};

mod held;
use crate::capture::ArgvRing;
use crate::stats::Counters;
pub(crate) use held::Held;
use held::allow;

/// What the answerer hands to the hook's task.
pub(crate) enum Exec {
    /// `create`, `run` or `start`: the task answers `perm`.
    Command {
        pid: u32,
        inv: Box<Invocation>,
        perm: Held,
    },
    /// fanotify-only mode: an exec that was allowed without argv; the task
    /// reads it from /proc once the new image runs.
    Unseen(Unseen),
    /// An allowed `delete`, for the task to note (a sandboxed container's
    /// end; see the hook's `Notice::Deleted`). Sent for runsc, and for
    /// other runtimes only while some tracked containers share an init
    /// (`Lifecycle::shared_pids`).
    Deleted(Box<Invocation>),
}

/// A runtime exec allowed without its argv (fanotify-only mode): what the
/// hook's task needs to read the argv from /proc once the new image runs.
pub(crate) struct Unseen {
    /// The thread that exec'd (the process id once the exec is through).
    pub tid: u32,
    /// The runtime binary's file name.
    pub binary: String,
    /// Device and inode of the runtime binary: once `/proc/<tid>/exe` is
    /// this file, the exec went through and `cmdline` is the runtime's.
    pub exe: Option<(u64, u64)>,
    /// The exec'ing process, to tell its exit (and pid reuse) apart from a
    /// slow exec. `None` when it could not be opened (a non-leader thread).
    pub pidfd: Option<std::os::fd::OwnedFd>,
    /// BPF argv capture runs, yet this exec has no record.
    pub bpf: bool,
}

/// The marked runtime binaries, to recognise a runtime re-executing itself
/// (`runc init`). Written by the hook when it marks a binary, read by the
/// permission thread.
#[derive(Default)]
pub(crate) struct Marked {
    /// Their paths, as this process opens them.
    pub paths: RwLock<HashSet<PathBuf>>,
    /// Their device and inode numbers: in a container with the host at
    /// `/host`, the marked path is `/host/usr/sbin/runc` while
    /// `/proc/<tid>/exe` says `/usr/sbin/runc`.
    pub files: RwLock<HashSet<(u64, u64)>>,
}

impl Marked {
    /// Whether thread `tid` is a runtime re-executing itself (`runc init`
    /// through `/proc/self/exe`): its current image is a marked binary.
    fn is_reexec(&self, tid: u32) -> bool {
        // The file itself, whatever path this mount namespace gives it.
        if let Ok(st) = nix::sys::stat::stat(format!("/proc/{tid}/exe").as_str())
            && self
                .files
                .read()
                .is_ok_and(|m| m.contains(&(st.st_dev, st.st_ino)))
        {
            return true;
        }
        let Ok(exe) = std::fs::read_link(format!("/proc/{tid}/exe")) else {
            return false;
        };
        let exe = exe.to_string_lossy();
        let exe = exe.trim_end_matches(" (deleted)");
        self.paths
            .read()
            .is_ok_and(|m| m.iter().any(|p| p.as_os_str() == exe))
    }
}

/// The running answering thread. Dropping it stops the thread, which answers
/// everything still queued before it exits.
pub(crate) struct Answerer {
    stopping: Arc<AtomicBool>,
    wake: Wake,
    /// Another handle on the group, to take the marks away should the
    /// thread not wake.
    group: Fanotify,
    /// Whose probe (see [`crate::Health::reads_stalled`]) ends with the
    /// thread.
    counters: Arc<Counters>,
    thread: Option<JoinHandle<()>>,
}

/// How [`Answerer::stop`] wakes the thread.
enum Wake {
    /// The thread blocks in `read`; a write to this file (a memfd marked
    /// `FAN_MODIFY` in the group) queues an event that ends the read.
    /// Health checks write to it too, to see that reads go on.
    Event(Arc<File>),
    /// The thread polls the group and this eventfd.
    Poll(Arc<EventFd>),
}

impl Answerer {
    /// Starts the thread on `group`, a blocking handle with no marks yet.
    /// `shared`: how many init pids tracked containers share (`delete`s
    /// are handed over only while that is not 0). `slice`: the scheduler
    /// time slice the thread asks for (see [`crate::Builder::scheduler_slice`]).
    pub fn spawn(
        group: Fanotify,
        ring: Option<ArgvRing>,
        counters: Arc<Counters>,
        marked: Arc<Marked>,
        shared: Arc<AtomicUsize>,
        tx: mpsc::Sender<Exec>,
        slice: Option<std::time::Duration>,
    ) -> std::io::Result<Answerer> {
        let wake = wake_file(&group);
        Self::start(
            Worker {
                group,
                ring,
                counters,
                marked,
                shared,
                tx,
                slice,
            },
            wake,
        )
    }

    /// Starts `worker`'s thread, woken to stop through `wake` (or by
    /// polling, without it).
    fn start(mut worker: Worker, wake: std::io::Result<File>) -> std::io::Result<Answerer> {
        let (wake, poll) = match wake {
            Ok(file) => {
                // Blocking, whatever the caller gave: a non-blocking read
                // that finds nothing would have this loop spin.
                worker
                    .group
                    .set_nonblocking(false)
                    .map_err(std::io::Error::other)?;
                let file = Arc::new(file);
                worker.counters.probe.set_file(Some(Arc::clone(&file)));
                (Wake::Event(file), None)
            }
            Err(e) => {
                tracing::info!(
                    error = %e,
                    "the answering thread polls its group (no wake-up event)"
                );
                // Reads follow a poll, and a queued event can vanish in
                // between (its process killed): never block in one.
                worker
                    .group
                    .set_nonblocking(true)
                    .map_err(std::io::Error::other)?;
                let efd = Arc::new(EventFd::from_flags(
                    EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK,
                )?);
                (Wake::Poll(Arc::clone(&efd)), Some(efd))
            }
        };
        let stopping = Arc::new(AtomicBool::new(false));
        let thread_stopping = Arc::clone(&stopping);
        let handle = worker.group.share();
        let counters = Arc::clone(&worker.counters);
        let thread = std::thread::Builder::new()
            .name("lookout-answer".into())
            .spawn(move || {
                if let Some(slice) = worker.slice {
                    crate::ask_for_slice("answering", slice);
                }
                worker.run(&thread_stopping, poll.as_deref());
            })
            .inspect_err(|_| counters.probe.set_file(None))?;
        Ok(Answerer {
            stopping,
            wake,
            group: handle,
            counters,
            thread: Some(thread),
        })
    }

    /// Whether the thread blocks in `read` (not `poll`), for tests.
    #[cfg(test)]
    fn blocks_in_read(&self) -> bool {
        matches!(self.wake, Wake::Event(_))
    }

    /// Stops the thread and waits for it.
    pub fn stop(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        // No thread to probe from here on, whatever follows.
        self.counters.probe.set_file(None);
        self.stopping.store(true, Ordering::Release);
        let woken = match &self.wake {
            Wake::Event(file) => file.write_all_at(b"x", 0),
            Wake::Poll(efd) => efd.write(1).map(drop).map_err(std::io::Error::from),
        };
        if let Err(e) = woken {
            // Not seen: the thread goes on answering what it reads. Take
            // the marks away so that no runtime exec waits on a group
            // about to be left, and let the thread be.
            tracing::error!(%e, "cannot wake the answering thread; leaving it");
            let _ = self.group.flush_inode_marks();
            return;
        }
        if thread.join().is_err() {
            tracing::error!("the permission thread panicked (its events were allowed)");
        }
    }
}

impl Drop for Answerer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A file whose writes wake a `read` on `group`: a memfd marked
/// `FAN_MODIFY`, written once here to prove that the event arrives.
/// `group` must have no other marks yet.
fn wake_file(group: &Fanotify) -> std::io::Result<File> {
    let memfd = nix::sys::memfd::memfd_create(
        c"lookout-answer-wake",
        nix::sys::memfd::MFdFlags::MFD_CLOEXEC,
    )?;
    // N.B. since Linux 6.14 a file from memfd_create itself raises no
    // fsnotify events (alloc_file_pseudo sets FMODE_NONOTIFY); the same
    // file opened again through /proc does.
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/proc/self/fd/{}", memfd.as_raw_fd()))?;
    drop(memfd);
    group
        .add_mark_fd(file.as_fd(), MarkFlags::empty(), Mask::MODIFY)
        .map_err(std::io::Error::other)?;
    let proved = (|| {
        file.write_all_at(b"x", 0)?;
        let mut buf = vec![0u8; MIN_READ_BUFFER];
        let mut events = Vec::new();
        let mut fds = [PollFd::new(group.as_fd(), PollFlags::POLLIN)];
        if poll(&mut fds, PollTimeout::ZERO)? == 1 {
            group
                .read_events(&mut buf, &mut events)
                .map_err(std::io::Error::other)?;
        }
        if events.iter().any(|e| e.mask().contains(Mask::MODIFY)) {
            Ok(())
        } else {
            Err(std::io::Error::other(
                "a write to a marked memfd raised no event",
            ))
        }
    })();
    match proved {
        Ok(()) => Ok(file),
        Err(e) => {
            // The group has no other mark yet.
            let _ = group.flush_inode_marks();
            Err(e)
        }
    }
}

struct Worker {
    group: Fanotify,
    ring: Option<ArgvRing>,
    counters: Arc<Counters>,
    marked: Arc<Marked>,
    shared: Arc<AtomicUsize>,
    tx: mpsc::Sender<Exec>,
    slice: Option<std::time::Duration>,
}

impl Worker {
    /// Reads and answers until `stopping`. With `poll`, waits for the group
    /// or that eventfd; without, blocks in `read` (see [`wake_file`]).
    fn run(&mut self, stopping: &AtomicBool, poll_on: Option<&EventFd>) {
        let mut buf = vec![0u8; MIN_READ_BUFFER * 4];
        let mut events: Vec<Event> = Vec::new();
        while !stopping.load(Ordering::Acquire) {
            if let Some(efd) = poll_on {
                if !self.wait(efd) {
                    continue;
                }
                // Polling, the group has events: the read is work, and
                // one stuck while the kernel opens an event's file (a
                // stalled FUSE or NFS mount) counts for /healthz.
                self.counters.begin_batch();
            }
            // The wake-up event (not a permission event) is read here too,
            // and dropped by `handle`.
            if let Err(e) = self.group.read_events(&mut buf, &mut events) {
                tracing::error!(error = %lookout_model::Chain(&e), "reading fanotify events");
                self.counters.error("read");
                std::thread::sleep(Duration::from_millis(10));
            }
            // N.B. blocking in `read`, busy from here, not before it: the
            // thread waits in it, and a wait counted as work would fail
            // /healthz on a quiet node. A read stuck inside the kernel is
            // seen by the probe instead (`Health::reads_stalled`).
            if events.is_empty() {
                self.counters.end_batch();
                continue;
            }
            if poll_on.is_none() {
                self.counters.begin_batch();
            }
            for ev in events.drain(..) {
                self.handle(ev);
            }
            self.counters.end_batch();
        }
        // No new events: a start still held (a task decides it) keeps the
        // group open, and with marks left every runtime exec would queue
        // in it with nobody reading. This removes the wake-up mark too.
        if let Err(e) = self.group.flush_inode_marks() {
            tracing::warn!(error = %lookout_model::Chain(&e), "removing the runtime binaries' marks");
        }
        // Answer whatever is queued before the group closes.
        let _ = self.group.drain();
    }

    /// Polls the group and `efd`; whether the group has events to read.
    fn wait(&self, efd: &EventFd) -> bool {
        let mut fds = [
            PollFd::new(self.group.as_fd(), PollFlags::POLLIN),
            PollFd::new(efd.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => {
                tracing::error!(%e, "polling the fanotify group");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        // N.B. a read finding nothing (an event gone with its killed
        // process) returns at once: the group is non-blocking in this mode.
        fds[0].any().unwrap_or(false)
    }

    fn handle(&mut self, mut ev: Event) {
        if ev.is_overflow() {
            tracing::warn!("fanotify queue overflow: some runtime execs were not seen");
            self.counters.error("overflow");
            // A probe's event may be among those lost; reads go on.
            self.counters.probe.read();
            return;
        }
        let Some(perm) = ev.take_permission() else {
            // The wake-up file's event (the only `FAN_MODIFY` mark): a
            // health probe, or a stop.
            if ev.mask().contains(Mask::MODIFY) {
                self.counters.probe.read();
            }
            return;
        };
        let since = Instant::now();
        let tid = ev.pid().max(0) as u32;
        let mut record = self.ring.as_mut().and_then(|r| r.take(tid));
        // runc re-executing itself (`runc init`, once per container) has no
        // record by design: answer it at once, with one readlink.
        if record.is_none() && self.marked.is_reexec(tid) {
            allow(&self.counters, perm, since);
            self.note_waiting();
            return;
        }
        // N.B. the ring buffer hands out records in order, so a record that
        // another CPU reserved but has not committed yet hides the ones
        // behind it, ours included, for a few microseconds. Look again
        // briefly before treating the exec as one without argv, but only
        // for host root: the programs record no other caller, and waiting
        // for a record that never comes would let any user who can run
        // the runtime cost this thread 2 ms an exec, and root's next exec
        // the sum of those queued before it. A caller whose status cannot
        // be read is not waited for either: it is gone (its exec with it),
        // or invisible here (tid 0), and any user can make its own exec's
        // thread vanish. (`status` takes no lock another process can hold:
        // task_lock, sighand, RCU, and a reference on the caller's memory.)
        if let Some(ring) = self.ring.as_mut()
            && record.is_none()
            && lookout_host::proc::caller(tid).is_some_and(|c| c.real_uid == 0 && !c.nested_pid_ns)
        {
            if let Some(o) = &self.counters.observer {
                o.argv_wait();
            }
            let give_up = Instant::now() + Duration::from_millis(2);
            while record.is_none() && Instant::now() < give_up {
                std::thread::sleep(Duration::from_micros(20));
                record = ring.take(tid);
            }
        }
        self.note_waiting();
        let Some(r) = record else {
            self.without_argv(tid, perm, since);
            return;
        };
        // Only host root makes rootful containers. Any other caller (a
        // user, root inside an unprivileged user namespace) may run the
        // runtime, but what it claims is never taken as a container: no
        // report, no hook run as root, no Kubernetes identity, no way to
        // replace a tracked container (docs/security.md).
        if r.uid != 0 {
            allow(&self.counters, perm, since);
            self.counters.ignored("non-root");
            tracing::debug!(
                tid,
                uid = r.uid,
                "runtime exec by a non-root caller: not a container"
            );
            return;
        }
        // After execve the process id is the tgid even when another thread
        // called it. The binary's name comes from the exec'd path.
        let binary = basename(&r.filename);
        match argv::parse(&r.argv, &binary) {
            Ok(inv) if needs_state(&inv) => {
                let msg = Exec::Command {
                    pid: r.tgid,
                    inv: Box::new(inv),
                    perm: Held::new(perm, since, &self.counters),
                };
                // A closed channel (shutting down) hands the message back:
                // dropping it allows the exec.
                if self.tx.blocking_send(msg).is_err() {
                    self.counters.answered(since);
                }
            }
            Ok(inv) => {
                allow(&self.counters, perm, since);
                // Never waits: a full queue loses only this note. Only a
                // container that shares its init is ended by its delete:
                // with none, the hook's task is not woken for nothing.
                // runsc's are always handed over: its pods share an init,
                // and one the task has not tracked yet (a scan or a pid
                // read in flight) is not in the count.
                if matches!(inv.command, Command::Delete { .. })
                    && (inv.runtime == lookout_model::RuntimeKind::Runsc
                        || self.shared.load(Ordering::Acquire) > 0)
                {
                    let _ = self.tx.try_send(Exec::Deleted(Box::new(inv)));
                }
            }
            Err(e) => {
                allow(&self.counters, perm, since);
                self.counters.error("argv");
                tracing::warn!(%e, argv = ?r.argv, "cannot parse runtime command line; allowed it");
            }
        }
    }

    /// Leaves the argv table's size for `lookout_argv_records_waiting`.
    fn note_waiting(&self) {
        if let Some(ring) = &self.ring {
            self.counters
                .argv_waiting
                .store(ring.waiting() as u64, Ordering::Relaxed);
        }
    }

    /// A runtime exec without a BPF record: no BPF (fanotify-only mode), or
    /// an exec path the programs do not see. Allow it and learn about it
    /// from /proc and the runtime's state.
    fn without_argv(&mut self, tid: u32, perm: Permission, since: Instant) {
        self.counters.missing_argv.fetch_add(1, Ordering::Relaxed);
        if let Some(o) = &self.counters.observer {
            o.without_argv();
        }
        // No argv now: fanotify-only mode, or, with BPF, a caller other
        // than host root (the programs record only root's execs) or an
        // exec path the programs do not see. Allow it, and let the task
        // follow it: it reads the caller's uid and, once the exec is
        // through, its argv from /proc, so that a root container is still
        // reported (late), never dropped in silence.
        //
        // At this point /proc/<tid>/cmdline is still the parent's. Note
        // what lets the task recognise the runtime's own argv later (the
        // binary's identity, a pidfd), with nothing that reads another
        // process's memory: a hostile parent must not be able to stall this
        // thread.
        let fd = perm.fd();
        let binary = std::fs::read_link(format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(&fd)
        ))
        .map(|p| basename(&p.to_string_lossy()))
        .unwrap_or_default();
        let exe = nix::sys::stat::fstat(fd)
            .ok()
            .map(|st| (st.st_dev, st.st_ino));
        let pidfd = crate::pidfd::pidfd_open(tid).ok();
        allow(&self.counters, perm, since);
        // Never wait for the task here (an exec flood must not stall this
        // thread): a full queue is counted, and the task reconciles.
        let unseen = Exec::Unseen(Unseen {
            tid,
            binary,
            exe,
            pidfd,
            bpf: self.ring.is_some(),
        });
        if self.tx.try_send(unseen).is_err() {
            self.counters.unseen_dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Whether the hook's task must see this command before the exec goes on.
fn needs_state(inv: &Invocation) -> bool {
    matches!(
        inv.command,
        Command::Create(_) | Command::Run(_) | Command::Start { .. }
    )
}

pub(crate) fn basename(path: &str) -> String {
    path.rsplit('/').next().unwrap_or(path).to_owned()
}

#[cfg(test)]
mod tests;
