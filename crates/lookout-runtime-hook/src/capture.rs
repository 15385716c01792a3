//! User side of the BPF argv capture: loads the programs, fills the name
//! filter, and pairs ring buffer records with fanotify events by thread id.

use std::collections::HashMap;

use aya::maps::{HashMap as BpfHashMap, MapData, RingBuf};
use aya::programs::TracePoint;
use lookout_ebpf_common::{
    ARGS_SIZE, EXEC_EVENTS_MAP, EXEC_FILTER_MAP, EXEC_FLAG_TRUNCATED, EXECVE_PROGRAM,
    EXECVEAT_PROGRAM, EXIT_CODES_MAP, EXIT_PROGRAM, ExecEvent, ExecFilterKey, FILENAME_LEN,
    TASK_EXIT_CODE_OFFSET_GLOBAL, WATCHED_PIDS_MAP, exec_filter_key,
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

/// Records older than this are never paired with an exec: a record waits
/// for its fanotify event only as long as the answering thread is behind,
/// and an older one is an orphan (an exec that failed, or of an unmarked
/// file with a watched name) whose thread id may since belong to another
/// process.
const MAX_AGE_NS: u64 = 30_000_000_000;

/// Above this many records waiting, the table drops orphans older than
/// [`MAX_AGE_NS`] (then not again before it has doubled).
const SWEEP_ABOVE: usize = 256;

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
    /// Moves every record from the ring buffer into the pending table.
    pub fn drain(&mut self) {
        while let Some(item) = self.ring.next() {
            if let Some(rec) = ExecRecord::from_bytes(&item) {
                self.pending.insert(rec);
            }
        }
        self.pending.bound(monotonic_ns());
    }

    /// The latest record of thread `tid`, if any and not older than
    /// [`MAX_AGE_NS`].
    ///
    /// The whole ring is drained first: a thread's records are all older
    /// than the exec being answered (the thread waits in that exec), and
    /// the last one is that exec's. A `PATH` search (`execvp` tries each
    /// directory in turn, and every attempt is captured at syscall entry)
    /// leaves one record per directory tried; the first is not the exec
    /// that happened, and the others must not stay behind as orphans.
    pub fn take(&mut self, tid: u32) -> Option<ExecRecord> {
        self.drain();
        self.pending.take(tid, monotonic_ns())
    }
}

/// Records waiting for their fanotify event, the latest per thread.
#[derive(Default)]
struct Pending {
    records: HashMap<u32, ExecRecord>,
    /// The size above which orphans are swept next.
    sweep_at: usize,
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

    /// Thread `tid`'s record, unless it is older than [`MAX_AGE_NS`] at
    /// `now_ns` (CLOCK_MONOTONIC).
    fn take(&mut self, tid: u32, now_ns: u64) -> Option<ExecRecord> {
        self.records
            .remove(&tid)
            .filter(|r| now_ns.saturating_sub(r.ktime_ns) <= MAX_AGE_NS)
    }

    /// Drops orphans: those older than [`MAX_AGE_NS`] once the table has
    /// grown past [`SWEEP_ABOVE`] (or twice its size after the last sweep),
    /// and the oldest half past [`MAX_PENDING`], whatever their age.
    fn bound(&mut self, now_ns: u64) {
        if self.records.len() > self.sweep_at.max(SWEEP_ABOVE) {
            self.records
                .retain(|_, r| now_ns.saturating_sub(r.ktime_ns) <= MAX_AGE_NS);
            self.sweep_at = 2 * self.records.len();
        }
        if self.records.len() > MAX_PENDING {
            let mut times: Vec<u64> = self.records.values().map(|r| r.ktime_ns).collect();
            times.sort_unstable();
            let cut = times[self.records.len() - MAX_PENDING / 2];
            self.records.retain(|_, r| r.ktime_ns >= cut);
        }
    }
}

/// CLOCK_MONOTONIC in nanoseconds: the clock of `ExecRecord::ktime_ns`.
fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| (t.tv_sec() as u64).saturating_mul(1_000_000_000) + t.tv_nsec() as u64)
        // N.B. Never fails for CLOCK_MONOTONIC; a 0 would only keep
        // every record (none counts as old).
        .unwrap_or(0)
}

/// The loaded argv-capture programs.
pub struct ExecCapture {
    // Keeps the programs attached; dropping it detaches them.
    _ebpf: aya::Ebpf,
    ring: Option<ArgvRing>,
    filter: BpfHashMap<MapData, ExecFilterKey, u8>,
    exit: Option<ExitCodes>,
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
        let mut loader = aya::EbpfLoader::new();
        loader.override_global(TASK_EXIT_CODE_OFFSET_GLOBAL, &exit_offset, true);
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
        let mut capture = ExecCapture {
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
        let x = self.exit.as_mut()?;
        let _ = x.watched.remove(&pid);
        let raw = x.codes.get(&pid, 0).ok();
        let _ = x.codes.remove(&pid);
        raw.map(crate::btf::shell_exit_code)
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
        let got = p.take(7, 100 * S + 10).expect("the thread's record");
        assert_eq!(got.filename, "/usr/sbin/runc");
        assert_eq!(p.len(), 0, "no attempt left behind");
        // An older record arriving late never replaces a newer one.
        p.insert(record(8, 200 * S, "/usr/sbin/runc"));
        p.insert(record(8, 199 * S, "/usr/local/sbin/runc"));
        assert_eq!(
            p.take(8, 200 * S).map(|r| r.filename).as_deref(),
            Some("/usr/sbin/runc")
        );
    }

    #[test]
    fn an_orphan_is_not_paired_with_a_later_process_of_its_thread_id() {
        let mut p = Pending::default();
        // An exec that never produced a fanotify event (it failed).
        p.insert(record(9, 10 * S, "/usr/local/bin/runc"));
        // Much later a new process has thread id 9 and execs runc itself
        // (`runc init`, no record by design).
        assert_eq!(p.take(9, 10 * S + MAX_AGE_NS + 1), None);
        assert_eq!(p.len(), 0);
        p.insert(record(9, 50 * S, "/usr/sbin/runc"));
        assert!(p.take(9, 50 * S + MAX_AGE_NS).is_some(), "at the age bound");
    }

    #[test]
    fn orphans_are_swept_by_age_and_bounded_by_count() {
        let mut p = Pending::default();
        for tid in 0..SWEEP_ABOVE as u32 {
            p.insert(record(tid, S, "/usr/local/bin/runc"));
        }
        p.bound(S + MAX_AGE_NS + 1);
        assert_eq!(p.len(), SWEEP_ABOVE, "not above the sweep size yet");
        p.insert(record(100_000, S + MAX_AGE_NS, "/usr/sbin/runc"));
        p.bound(S + MAX_AGE_NS + 1);
        assert_eq!(p.len(), 1, "the old orphans went, the fresh record stayed");
        // Fresh records past the count bound: the oldest half goes.
        let mut p = Pending::default();
        let now = 1000 * S;
        for tid in 0..=MAX_PENDING as u32 {
            p.insert(record(tid, now + u64::from(tid), "/usr/sbin/runc"));
            p.bound(now + u64::from(tid));
        }
        assert!(p.len() <= MAX_PENDING);
        assert!(
            p.take(MAX_PENDING as u32, now + MAX_PENDING as u64)
                .is_some()
        );
        assert!(
            p.take(0, now + MAX_PENDING as u64).is_none(),
            "the oldest went"
        );
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
