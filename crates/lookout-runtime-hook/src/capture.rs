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

/// The consumer side of the argv ring buffer, movable to the thread that
/// answers permission events (see [`ExecCapture::take_ring`]).
pub struct ArgvRing {
    ring: RingBuf<MapData>,
    pending: HashMap<u32, ExecRecord>,
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
        self.drain_until(None);
    }

    /// Drains the ring into the pending table, stopping early at (and
    /// returning) a record of thread `want`.
    fn drain_until(&mut self, want: Option<u32>) -> Option<ExecRecord> {
        let mut found = None;
        while let Some(item) = self.ring.next() {
            if let Some(rec) = ExecRecord::from_bytes(&item) {
                if Some(rec.tid) == want {
                    found = Some(rec);
                    break;
                }
                self.pending.insert(rec.tid, rec);
            }
        }
        if self.pending.len() > MAX_PENDING {
            // Execs whose fanotify event never came (failed PATH lookups,
            // execs of an unmarked file with a watched name): drop the oldest.
            let mut times: Vec<u64> = self.pending.values().map(|r| r.ktime_ns).collect();
            times.sort_unstable();
            let cut = times[self.pending.len() - MAX_PENDING / 2];
            self.pending.retain(|_, r| r.ktime_ns >= cut);
        }
        found
    }

    /// The latest record of thread `tid`, if any.
    pub fn take(&mut self, tid: u32) -> Option<ExecRecord> {
        // A thread execs one file at a time, and its record is written
        // before its fanotify event: a record of `tid` still in the ring is
        // newer than one in the table.
        match self.drain_until(Some(tid)) {
            Some(rec) => {
                self.pending.remove(&tid);
                Some(rec)
            }
            None => self.pending.remove(&tid),
        }
    }
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
                pending: HashMap::new(),
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
