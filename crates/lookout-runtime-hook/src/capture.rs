//! User side of the BPF argv capture: loads the programs, fills the name
//! filter, and pairs ring buffer records with fanotify events by thread id.

use std::collections::HashMap;

use aya::maps::{HashMap as BpfHashMap, MapData, RingBuf};
use aya::programs::TracePoint;
use lookout_ebpf_common::{
    ARGS_SIZE, EXEC_EVENTS_MAP, EXEC_FILTER_MAP, EXEC_FLAG_TRUNCATED, EXECVE_PROGRAM,
    EXECVEAT_PROGRAM, EXIT_CODES_MAP, EXIT_PROGRAM, ExecEvent, ExecFilterKey, FILENAME_LEN,
    HOST_PIDNS_DEV_GLOBAL, HOST_PIDNS_INO_GLOBAL, TASK_EXIT_CODE_OFFSET_GLOBAL, WATCHED_PIDS_MAP,
    exec_filter_key,
};

use crate::Error;

/// Records kept waiting for their fanotify event at most (the oldest go).
const MAX_PENDING: usize = 4096;

/// One exec of a watched binary, as captured at syscall entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecRecord {
    /// Process id.
    pub tgid: u32,
    /// Thread id (what fanotify reports with `FAN_REPORT_TID`).
    pub tid: u32,
    /// CLOCK_MONOTONIC at syscall entry.
    pub ktime_ns: u64,
    /// The caller's real uid in the initial user namespace (0: host root).
    pub uid: u32,
    /// The path passed to exec.
    pub filename: String,
    /// The arguments.
    pub argv: Vec<String>,
    /// Whether argv was cut (too many or too long arguments).
    pub truncated: bool,
}

impl ExecRecord {
    /// Decodes a ring buffer record in place: [`ExecEvent::HEADER`] bytes,
    /// then the `args_len` bytes of argv. `None` for a record shorter than
    /// that.
    pub fn from_bytes(bytes: &[u8]) -> Option<ExecRecord> {
        use std::mem::offset_of;
        if bytes.len() < ExecEvent::HEADER {
            return None;
        }
        let u32_at = |off: usize| -> Option<u32> {
            Some(u32::from_ne_bytes(
                bytes.get(off..off + 4)?.try_into().ok()?,
            ))
        };
        let u64_at = |off: usize| -> Option<u64> {
            Some(u64::from_ne_bytes(
                bytes.get(off..off + 8)?.try_into().ok()?,
            ))
        };
        let name_at = offset_of!(ExecEvent, filename);
        let name = bytes.get(name_at..name_at + FILENAME_LEN)?;
        let nul = name.iter().position(|&b| b == 0).unwrap_or(name.len());
        let filename = String::from_utf8_lossy(&name[..nul]).into_owned();
        let len = (u32_at(offset_of!(ExecEvent, args_len))? as usize).min(ARGS_SIZE);
        let args_at = offset_of!(ExecEvent, args);
        let argc = u32_at(offset_of!(ExecEvent, argc))? as usize;
        let argv = bytes
            .get(args_at..args_at + len)?
            .split(|&b| b == 0)
            .take(argc)
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect();
        Some(ExecRecord {
            tgid: u32_at(offset_of!(ExecEvent, tgid))?,
            tid: u32_at(offset_of!(ExecEvent, tid))?,
            ktime_ns: u64_at(offset_of!(ExecEvent, ktime_ns))?,
            uid: u32_at(offset_of!(ExecEvent, uid))?,
            filename,
            argv,
            truncated: u32_at(offset_of!(ExecEvent, flags))? & EXEC_FLAG_TRUNCATED != 0,
        })
    }
}

/// A record older than this is paired with an exec only if its thread
/// already existed when it was written: an orphan (an exec that failed,
/// or of an unmarked file with a watched name) may have a thread id that a
/// later process got after a pid wrap. Younger records are paired as they
/// are (no `/proc` read on the answering path).
const CHECK_OLDER_THAN_NS: u64 = 1_000_000_000;

/// Orphans older than this are swept, at most once a second, while more
/// than [`SWEEP_ABOVE`] records wait.
const MAX_AGE_NS: u64 = 30_000_000_000;

/// Above this many records waiting, orphans older than [`MAX_AGE_NS`] are
/// swept.
const SWEEP_ABOVE: usize = 256;

/// How often the sweep runs at most.
const SWEEP_EVERY_NS: u64 = 1_000_000_000;

/// The consumer side of the argv ring buffer, movable to the thread that
/// answers permission events (see [`ExecCapture::take_ring`]).
pub struct ArgvRing {
    ring: RingBuf<MapData>,
    pending: Pending,
}

impl std::fmt::Debug for ArgvRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArgvRing")
            .field("pending", &self.pending.len())
            .finish_non_exhaustive()
    }
}

impl ArgvRing {
    /// Records taken from the ring that wait for their exec's permission
    /// event (see [`ArgvRing::take`]).
    pub fn waiting(&self) -> usize {
        self.pending.len()
    }

    /// Moves every record from the ring buffer into the pending table.
    pub fn drain(&mut self) {
        self.drain_at(lookout_model::monotonic_ns());
    }

    /// [`ArgvRing::drain`], `now_ns` being CLOCK_MONOTONIC (the clock of
    /// `ExecRecord::ktime_ns`).
    fn drain_at(&mut self, now_ns: u64) {
        while let Some(item) = self.ring.next() {
            if let Some(rec) = ExecRecord::from_bytes(&item) {
                self.pending.insert(rec);
            }
        }
        self.pending.bound(now_ns);
    }

    /// The latest record of thread `tid`, if any (and, for a record older
    /// than a second, if the thread existed when it was written).
    ///
    /// The whole ring is drained first: a thread's records are all older
    /// than the exec being answered (the thread waits in that exec), and
    /// the last one is that exec's. A `PATH` search (`execvp` tries each
    /// directory in turn, and every attempt is captured at syscall entry)
    /// leaves one record per directory tried; the first is not the exec
    /// that happened, and the others must not stay behind as orphans.
    pub fn take(&mut self, tid: u32) -> Option<ExecRecord> {
        let now = lookout_model::monotonic_ns();
        self.drain_at(now);
        self.pending.take(tid, now, thread_start_ns)
    }
}

/// Records waiting for their fanotify event, the latest per thread.
#[derive(Default)]
struct Pending {
    records: HashMap<u32, ExecRecord>,
    /// When orphans were last swept (CLOCK_MONOTONIC, ns).
    swept_ns: u64,
}

impl Pending {
    fn len(&self) -> usize {
        self.records.len()
    }

    /// Adds `rec`, which replaces any older record of its thread.
    fn insert(&mut self, rec: ExecRecord) {
        match self.records.entry(rec.tid) {
            std::collections::hash_map::Entry::Occupied(mut o) => {
                if rec.ktime_ns >= o.get().ktime_ns {
                    o.insert(rec);
                }
            }
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(rec);
            }
        }
    }

    /// Thread `tid`'s record at `now_ns` (CLOCK_MONOTONIC). One older than
    /// [`CHECK_OLDER_THAN_NS`] is kept only if `started_ns(tid)`, the
    /// thread's start on the same clock, is not after it (or unknown).
    fn take(
        &mut self,
        tid: u32,
        now_ns: u64,
        started_ns: impl FnOnce(u32) -> Option<u64>,
    ) -> Option<ExecRecord> {
        let rec = self.records.remove(&tid)?;
        if now_ns.saturating_sub(rec.ktime_ns) <= CHECK_OLDER_THAN_NS {
            return Some(rec);
        }
        match started_ns(tid) {
            // N.B. `/proc`'s start time has clock-tick precision (10 ms):
            // a thread started up to a tick after its record is its own.
            Some(start) if start > rec.ktime_ns.saturating_add(TICK_SLACK_NS) => None,
            _ => Some(rec),
        }
    }

    /// Drops orphans: at most once a second, while more than
    /// [`SWEEP_ABOVE`] wait, those older than [`MAX_AGE_NS`]; and past
    /// [`MAX_PENDING`], the oldest half whatever their age.
    fn bound(&mut self, now_ns: u64) {
        if self.records.len() > SWEEP_ABOVE
            && now_ns.saturating_sub(self.swept_ns) >= SWEEP_EVERY_NS
        {
            self.swept_ns = now_ns;
            self.records
                .retain(|_, r| now_ns.saturating_sub(r.ktime_ns) <= MAX_AGE_NS);
        }
        if self.records.len() > MAX_PENDING {
            let mut times: Vec<u64> = self.records.values().map(|r| r.ktime_ns).collect();
            times.sort_unstable();
            let cut = times[self.records.len() - MAX_PENDING / 2];
            self.records.retain(|_, r| r.ktime_ns >= cut);
        }
    }
}

/// Two clock ticks of `/proc/<pid>/stat` at 100 Hz.
const TICK_SLACK_NS: u64 = 20_000_000;

/// When thread `tid` started, on CLOCK_MONOTONIC (ns): `/proc/<tid>/stat`
/// counts clock ticks on the boot-time clock, which runs ahead of the
/// monotonic one by the time the machine was suspended. `None` when it
/// cannot be read.
fn thread_start_ns(tid: u32) -> Option<u64> {
    use nix::time::{ClockId, clock_gettime};
    let ticks = lookout_host::proc::start_time(tid)?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .filter(|&hz| hz > 0)? as u64;
    let boot = clock_gettime(ClockId::CLOCK_BOOTTIME).ok()?;
    let boot_ns = (boot.tv_sec() as u64).saturating_mul(1_000_000_000) + boot.tv_nsec() as u64;
    let suspended = boot_ns.saturating_sub(lookout_model::monotonic_ns());
    Some(
        ticks
            .saturating_mul(1_000_000_000 / hz)
            .saturating_sub(suspended),
    )
}

/// This process's pid namespace as `bpf_get_ns_current_pid_tgid` names it:
/// the kernel's `dev_t` of the nsfs (major << 20 | minor; stat(2) encodes
/// it the same way only for a major of 0 and a minor below 256) and the
/// namespace's inode number.
fn own_pid_namespace() -> Result<(u64, u64), Error> {
    let st = nix::sys::stat::stat("/proc/self/ns/pid").map_err(|e| Error::Bpf {
        what: "reading this process's pid namespace (/proc/self/ns/pid)".into(),
        source: Some(Box::new(e)),
    })?;
    Ok((kernel_dev(st.st_dev), st.st_ino))
}

/// stat(2)'s device number as the kernel's internal `dev_t`.
fn kernel_dev(dev: libc::dev_t) -> u64 {
    (u64::from(libc::major(dev)) << 20) | u64::from(libc::minor(dev))
}

/// The loaded argv-capture programs.
pub struct ExecCapture {
    // Keeps the programs attached; dropping it detaches them.
    _ebpf: aya::Ebpf,
    ring: Option<ArgvRing>,
    filter: BpfHashMap<MapData, ExecFilterKey, u8>,
    exit: Option<ExitCodes>,
    log: Option<crate::bpf_log::BpfLog>,
}

/// The maps of the exit-code program.
struct ExitCodes {
    watched: BpfHashMap<MapData, u32, u8>,
    codes: BpfHashMap<MapData, u32, i32>,
}

impl std::fmt::Debug for ExecCapture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecCapture")
            .field("ring", &self.ring)
            .finish_non_exhaustive()
    }
}

fn bpf_err(what: &str, e: impl std::error::Error + Send + Sync + 'static) -> Error {
    Error::Bpf {
        what: what.to_owned(),
        source: Some(Box::new(e)),
    }
}

/// A program or map the object should have and has not.
fn missing(what: String) -> Error {
    Error::Bpf { what, source: None }
}

/// Loads program `prog` from the object and attaches it to tracepoint
/// `category/name`.
fn attach_tracepoint(
    ebpf: &mut aya::Ebpf,
    prog: &str,
    category: &str,
    name: &str,
) -> Result<(), Error> {
    let p: &mut TracePoint = ebpf
        .program_mut(prog)
        .ok_or_else(|| missing(format!("program {prog} missing from the object")))?
        .try_into()
        .map_err(|e| bpf_err(prog, e))?;
    // Loaded already when `load_side_by_side` verified it.
    if p.fd().is_err() {
        p.load()
            .map_err(|e| bpf_err(&format!("loading {prog}"), e))?;
    }
    p.attach(category, name)
        .map_err(|e| bpf_err(&format!("attaching {prog} to {category}/{name}"), e))?;
    Ok(())
}

/// Loads (has the kernel verify) the tracepoint programs `names`, each on
/// a thread of its own. The verifier is most of lookout's start-up: the
/// two argv programs take 100-300 ms each on 2 vCPUs, and it runs in the
/// loading thread, so two loads side by side take the time of the longer.
/// Attaching stays in [`attach_tracepoint`], in order.
fn load_side_by_side(ebpf: &mut aya::Ebpf, names: &[&str]) -> Result<(), Error> {
    let mut programs: Vec<(&str, &mut TracePoint)> = Vec::with_capacity(names.len());
    for (name, p) in ebpf.programs_mut() {
        if names.contains(&name) {
            programs.push((name, p.try_into().map_err(|e| bpf_err(name, e))?));
        }
    }
    if let Some(absent) = names
        .iter()
        .find(|n| !programs.iter().any(|(name, _)| name == *n))
    {
        return Err(missing(format!("program {absent} missing from the object")));
    }
    std::thread::scope(|scope| {
        let mut loads = Vec::with_capacity(programs.len());
        for (name, p) in programs {
            let load = move || p.load().map_err(|e| bpf_err(&format!("loading {name}"), e));
            // A thread that cannot start: load here instead.
            match std::thread::Builder::new()
                .name("lookout-bpf-load".into())
                .spawn_scoped(scope, load)
            {
                Ok(h) => loads.push((name, h)),
                Err(e) => {
                    tracing::debug!(%e, program = name, "loading on the caller's thread");
                    // N.B. `load` moved into the failed spawn; attach
                    // loads it later, on this thread.
                }
            }
        }
        loads
            .into_iter()
            .map(|(name, h)| {
                h.join().unwrap_or_else(|_| {
                    Err(missing(format!("loading {name}: the thread panicked")))
                })
            })
            .collect::<Result<Vec<()>, Error>>()
    })?;
    Ok(())
}

impl ExecCapture {
    /// Loads and attaches the programs; only execs of files called one of
    /// `names` are captured.
    pub fn load(object: &[u8], names: &[String]) -> Result<ExecCapture, Error> {
        // Exit codes need one kernel struct offset; find it in the running
        // kernel's BTF (0 disables the exit-code program's work).
        let exit_offset = crate::btf::task_exit_code_offset().unwrap_or(0);
        // Only execs in our own pid namespace are recorded: the node's,
        // since the agent runs with `hostPID` (docs/security.md).
        let (pidns_dev, pidns_ino) = own_pid_namespace()?;
        let mut loader = aya::EbpfLoader::new();
        loader.override_global(TASK_EXIT_CODE_OFFSET_GLOBAL, &exit_offset, true);
        loader.override_global(HOST_PIDNS_DEV_GLOBAL, &pidns_dev, true);
        loader.override_global(HOST_PIDNS_INO_GLOBAL, &pidns_ino, true);
        // The programs' diagnostics: only the levels the log shows are
        // written at all.
        let log_level = crate::bpf_log::level();
        loader.override_global(aya_log::LEVEL, &log_level, false);
        // aya-log's ring is 128 KiB, mapped twice in the agent: the
        // programs write a few rare records, rate-limited on the way out.
        loader.map_max_entries(crate::bpf_log::RING, crate::bpf_log::RING_BYTES);
        let mut ebpf = loader
            .load(object)
            .map_err(|e| bpf_err("loading the BPF object", e))?;
        load_side_by_side(&mut ebpf, &[EXECVE_PROGRAM, EXECVEAT_PROGRAM])?;
        attach_tracepoint(&mut ebpf, EXECVE_PROGRAM, "syscalls", "sys_enter_execve")?;
        attach_tracepoint(
            &mut ebpf,
            EXECVEAT_PROGRAM,
            "syscalls",
            "sys_enter_execveat",
        )?;
        let ring = RingBuf::try_from(
            ebpf.take_map(EXEC_EVENTS_MAP)
                .ok_or_else(|| missing(format!("map {EXEC_EVENTS_MAP} missing")))?,
        )
        .map_err(|e| bpf_err(EXEC_EVENTS_MAP, e))?;
        let filter = BpfHashMap::try_from(
            ebpf.take_map(EXEC_FILTER_MAP)
                .ok_or_else(|| missing(format!("map {EXEC_FILTER_MAP} missing")))?,
        )
        .map_err(|e| bpf_err(EXEC_FILTER_MAP, e))?;
        let exit = if exit_offset == 0 {
            tracing::warn!("task_struct.exit_code not found in the kernel's BTF: no exit codes");
            None
        } else {
            match Self::load_exit(&mut ebpf) {
                Ok(e) => Some(e),
                Err(e) => {
                    tracing::warn!(error = %lookout_model::Chain(&e), "exit codes unavailable");
                    None
                }
            }
        };
        let log = crate::bpf_log::BpfLog::take(&mut ebpf);
        let mut capture = ExecCapture {
            log,
            _ebpf: ebpf,
            ring: Some(ArgvRing {
                ring,
                pending: Pending::default(),
            }),
            filter,
            exit,
        };
        for n in names {
            capture.watch_name(n)?;
        }
        Ok(capture)
    }

    fn load_exit(ebpf: &mut aya::Ebpf) -> Result<ExitCodes, Error> {
        attach_tracepoint(ebpf, EXIT_PROGRAM, "sched", "sched_process_exit")?;
        let take = |ebpf: &mut aya::Ebpf, name: &str| {
            ebpf.take_map(name)
                .ok_or_else(|| missing(format!("map {name} missing")))
        };
        Ok(ExitCodes {
            watched: BpfHashMap::try_from(take(ebpf, WATCHED_PIDS_MAP)?)
                .map_err(|e| bpf_err(WATCHED_PIDS_MAP, e))?,
            codes: BpfHashMap::try_from(take(ebpf, EXIT_CODES_MAP)?)
                .map_err(|e| bpf_err(EXIT_CODES_MAP, e))?,
        })
    }

    /// Records the exit code of process `pid` when it exits.
    pub fn watch_exit(&mut self, pid: u32) {
        if let Some(x) = &mut self.exit
            && let Err(e) = x.watched.insert(pid, 1, 0)
        {
            tracing::debug!(pid, %e, "cannot watch for an exit code");
        }
    }

    /// The exit code of `pid` (shell style: status, or 128 + signal), if
    /// it was recorded; forgets `pid` either way.
    pub fn take_exit_code(&mut self, pid: u32) -> Option<i32> {
        let code = self.exit_code(pid);
        self.forget_exit(pid);
        code
    }

    /// The recorded exit code of `pid`, if any, without forgetting it: one
    /// map lookup, all that a `removed` event waits for (the hook forgets
    /// the pid once the event is out, [`ExecCapture::forget_exit`]).
    pub(crate) fn exit_code(&self, pid: u32) -> Option<i32> {
        let x = self.exit.as_ref()?;
        x.codes.get(&pid, 0).ok().map(crate::btf::shell_exit_code)
    }

    /// Forgets `pid`: its watch and its recorded exit code.
    pub(crate) fn forget_exit(&mut self, pid: u32) {
        if let Some(x) = self.exit.as_mut() {
            let _ = x.watched.remove(&pid);
            let _ = x.codes.remove(&pid);
        }
    }

    /// Captures execs of files called `name` from now on.
    pub fn watch_name(&mut self, name: &str) -> Result<(), Error> {
        self.filter
            .insert(exec_filter_key(name.as_bytes()), 1, 0)
            .map_err(|e| bpf_err(&format!("adding {name} to the exec filter"), e))
    }

    /// Moves the ring buffer's consumer out, to be read on another
    /// thread. Afterwards [`ExecCapture::take`] finds nothing.
    pub fn take_ring(&mut self) -> Option<ArgvRing> {
        self.ring.take()
    }

    /// The reader of the programs' diagnostics, to run as a task of its
    /// own ([`BpfLog::run`](crate::bpf_log::BpfLog::run)); once.
    pub fn take_log(&mut self) -> Option<crate::bpf_log::BpfLog> {
        self.log.take()
    }

    /// The latest record of thread `tid`, if any (drains the ring first).
    pub fn take(&mut self, tid: u32) -> Option<ExecRecord> {
        self.ring.as_mut()?.take(tid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(tid: u32, ktime_ns: u64, filename: &str) -> ExecRecord {
        ExecRecord {
            tgid: tid,
            tid,
            ktime_ns,
            uid: 0,
            filename: filename.to_owned(),
            argv: vec!["runc".to_owned(), "start".to_owned(), "c1".to_owned()],
            truncated: false,
        }
    }

    const S: u64 = 1_000_000_000;

    /// A thread's start as `/proc` would give it: unknown.
    fn unknown(_: u32) -> Option<u64> {
        None
    }

    #[test]
    fn a_path_search_leaves_its_last_attempt_and_no_orphan() {
        let mut p = Pending::default();
        // execvp("runc") from a caller whose PATH starts with two
        // directories without it: three records of one thread, in order.
        for (i, dir) in ["/root/bin", "/usr/local/sbin", "/usr/sbin"]
            .iter()
            .enumerate()
        {
            p.insert(record(7, 100 * S + i as u64, &format!("{dir}/runc")));
        }
        assert_eq!(p.len(), 1);
        let got = p
            .take(7, 100 * S + 10, unknown)
            .expect("the thread's record");
        assert_eq!(got.filename, "/usr/sbin/runc");
        assert_eq!(p.len(), 0, "no attempt left behind");
        // An older record arriving late never replaces a newer one.
        p.insert(record(8, 200 * S, "/usr/sbin/runc"));
        p.insert(record(8, 199 * S, "/usr/local/sbin/runc"));
        let got = p.take(8, 200 * S, unknown).map(|r| r.filename);
        assert_eq!(got.as_deref(), Some("/usr/sbin/runc"));
    }

    #[test]
    fn an_old_record_is_paired_only_with_a_thread_that_predates_it() {
        let mut p = Pending::default();
        // An exec that never produced a fanotify event (it failed) at 10 s;
        // at 500 s a new thread that got its id after a pid wrap (started
        // at 400 s) execs runc itself (`runc init`, no record by design).
        p.insert(record(9, 10 * S, "/usr/local/bin/runc"));
        assert_eq!(p.take(9, 500 * S, |_| Some(400 * S)), None);
        assert_eq!(p.len(), 0);
        // An answering thread 60 s behind: the record is old, but its
        // thread started before it, so it is the exec being answered.
        p.insert(record(9, 600 * S, "/usr/sbin/runc"));
        assert!(p.take(9, 660 * S, |_| Some(599 * S)).is_some());
        // Within a clock tick of /proc's precision, and when /proc cannot
        // tell, the record is paired.
        p.insert(record(9, 700 * S, "/usr/sbin/runc"));
        assert!(
            p.take(9, 760 * S, |_| Some(700 * S + TICK_SLACK_NS))
                .is_some()
        );
        p.insert(record(9, 800 * S, "/usr/sbin/runc"));
        assert!(p.take(9, 860 * S, unknown).is_some());
        // A young record is paired without asking.
        p.insert(record(9, 900 * S, "/usr/sbin/runc"));
        let asked = std::cell::Cell::new(false);
        assert!(
            p.take(9, 900 * S + CHECK_OLDER_THAN_NS, |_| {
                asked.set(true);
                None
            })
            .is_some()
        );
        assert!(!asked.get(), "no /proc read for a young record");
    }

    #[test]
    fn orphans_are_swept_by_age_and_bounded_by_count() {
        let mut p = Pending::default();
        for tid in 0..SWEEP_ABOVE as u32 {
            p.insert(record(tid, S, "/usr/local/bin/runc"));
        }
        p.bound(S + MAX_AGE_NS + 1);
        assert_eq!(p.len(), SWEEP_ABOVE, "not above the sweep size yet");
        p.insert(record(100_000, 40 * S, "/usr/sbin/runc"));
        p.bound(40 * S);
        assert_eq!(p.len(), 1, "the old orphans went, the fresh record stayed");
        // After a sweep that found nothing to drop, a later one still runs.
        for tid in 0..SWEEP_ABOVE as u32 {
            p.insert(record(tid, 41 * S, "/usr/local/bin/runc"));
        }
        p.bound(41 * S);
        assert_eq!(p.len(), SWEEP_ABOVE + 1, "all young");
        p.bound(41 * S + SWEEP_EVERY_NS / 2);
        p.bound(41 * S + MAX_AGE_NS + 1);
        assert_eq!(p.len(), 0, "swept a second time");
        // Fresh records past the count bound: the oldest half goes.
        let mut p = Pending::default();
        let now = 1000 * S;
        for tid in 0..=MAX_PENDING as u32 {
            p.insert(record(tid, now + u64::from(tid), "/usr/sbin/runc"));
            p.bound(now + u64::from(tid));
        }
        assert!(p.len() <= MAX_PENDING);
        assert!(
            p.take(MAX_PENDING as u32, now + MAX_PENDING as u64, unknown)
                .is_some()
        );
        assert!(
            p.take(0, now + MAX_PENDING as u64, unknown).is_none(),
            "the oldest went"
        );
    }

    #[test]
    fn a_threads_start_is_read_on_the_monotonic_clock() {
        // This thread started before now, and not before boot.
        let tid = nix::unistd::gettid().as_raw() as u32;
        let start = thread_start_ns(tid).expect("this thread's start");
        let now = lookout_model::monotonic_ns();
        assert!(
            start <= now + TICK_SLACK_NS,
            "start {start} after now {now}"
        );
    }

    #[test]
    fn device_numbers_are_given_to_bpf_in_the_kernels_encoding() {
        // stat(2) keeps minors above 255 in high bits; the kernel's dev_t
        // is major << 20 | minor.
        assert_eq!(kernel_dev(libc::makedev(0, 4)), 4);
        assert_eq!(kernel_dev(libc::makedev(0, 300)), 300);
        assert_eq!(kernel_dev(libc::makedev(8, 1)), (8 << 20) | 1);
        assert_ne!(libc::makedev(0, 300), 300, "the encodings differ here");
        let (_, ino) = own_pid_namespace().expect("our own pid namespace");
        let link = std::fs::read_link("/proc/self/ns/pid").expect("readlink");
        assert_eq!(link.to_string_lossy(), format!("pid:[{ino}]"));
    }

    #[test]
    fn decodes_a_record() {
        let mut ev = ExecEvent {
            tgid: 10,
            tid: 11,
            ktime_ns: 12,
            argc: 3,
            args_len: 0,
            flags: EXEC_FLAG_TRUNCATED,
            uid: 1000,
            filename: [0; lookout_ebpf_common::FILENAME_LEN],
            args: [0; ARGS_SIZE + lookout_ebpf_common::ARG_LEN],
        };
        ev.filename[..9].copy_from_slice(b"/bin/runc");
        let args = b"runc\0start\0c1\0";
        ev.args[..args.len()].copy_from_slice(args);
        ev.args_len = args.len() as u32;
        // SAFETY: viewing a repr(C) value as bytes for the test.
        let bytes =
            unsafe { std::slice::from_raw_parts((&raw const ev).cast::<u8>(), ExecEvent::SIZE) };
        let mut shifted = vec![0u8; 1];
        shifted.extend_from_slice(bytes);
        let rec = ExecRecord::from_bytes(&shifted[1..]).expect("full record");
        assert_eq!(rec.filename, "/bin/runc");
        assert_eq!(rec.argv, ["runc", "start", "c1"]);
        assert_eq!((rec.tgid, rec.tid, rec.truncated), (10, 11, true));
        assert_eq!(rec.uid, 1000);
        // What the program writes: the header and the used bytes of argv.
        let used = 1 + ExecEvent::HEADER + args.len();
        let short = ExecRecord::from_bytes(&shifted[1..used]).expect("used bytes only");
        assert_eq!(short.argv, ["runc", "start", "c1"]);
        // A record cut inside its argv, or inside the header, is refused.
        assert!(ExecRecord::from_bytes(&shifted[1..used - 1]).is_none());
        assert!(ExecRecord::from_bytes(&shifted[1..100]).is_none());
    }
}
