//! BPF checks: the embedded object, BTF, a ring buffer map, and a
//! tracepoint program that must deliver one event end to end. Everything
//! loaded here is unloaded (fds closed) before the check returns.

use std::path::Path;
use std::time::{Duration, Instant};

use aya::maps::RingBuf;
use aya::programs::TracePoint;
use lookout_ebpf_common::{
    PROBE_EVENTS_MAP, PROBE_MAGIC, PROBE_PROGRAM, PROBE_TGID_GLOBAL, PROBE_TRACEPOINT,
    PROBE_TRACEPOINT_CATEGORY, ProbeEvent,
};

use crate::chain;
use crate::report::Fail;

/// The results of the BPF checks.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct BpfFacts {
    /// Whether the agent carries its BPF object.
    pub object: Result<String, Fail>,
    /// `/sys/kernel/btf/vmlinux`.
    pub btf: Result<String, Fail>,
    /// Creating a `BPF_MAP_TYPE_RINGBUF` map (as part of loading the object).
    pub ringbuf: Result<String, Fail>,
    /// Loading and attaching the tracepoint program, and receiving its event.
    pub tracepoint: Result<String, Fail>,
}

impl BpfFacts {
    /// Whether BPF argv capture can run; `Err` holds the first failure
    /// (later checks only say they were not tried).
    pub fn usable(&self) -> Result<(), String> {
        [&self.object, &self.ringbuf, &self.tracepoint]
            .into_iter()
            .find_map(|r| r.as_ref().err())
            .map_or(Ok(()), |f| Err(f.reason.clone()))
    }
}

fn hint(text: &str) -> &'static str {
    if text.contains("Operation not permitted") || text.contains("EPERM") {
        " (missing CAP_BPF/CAP_PERFMON or CAP_SYS_ADMIN, kernel.unprivileged_bpf_disabled, or a lockdown/LSM policy)"
    } else if text.contains("Function not implemented") {
        " (kernel built without CONFIG_BPF_SYSCALL, or a seccomp filter blocks bpf())"
    } else if text.contains("No such file") {
        " (tracefs not mounted at /sys/kernel/tracing, or the kernel lacks CONFIG_FTRACE_SYSCALLS)"
    } else {
        ""
    }
}

/// Runs the BPF checks with the agent's embedded object (`None` when the
/// agent was built without `cargo xtask build-ebpf`).
pub fn probe(object: Option<&[u8]>) -> BpfFacts {
    let btf = if Path::new("/sys/kernel/btf/vmlinux").exists() {
        Ok("/sys/kernel/btf/vmlinux present".to_owned())
    } else {
        Err(Fail::unsupported(
            "/sys/kernel/btf/vmlinux missing (kernel without CONFIG_DEBUG_INFO_BTF)",
        ))
    };
    let Some(object) = object.filter(|o| !o.is_empty()) else {
        let missing = "BPF object missing: this lookout was built without `cargo xtask build-ebpf`";
        let skipped = || Err(Fail::unsupported("not tried: BPF object missing"));
        return BpfFacts {
            object: Err(Fail::unsupported(missing)),
            btf,
            ringbuf: skipped(),
            tracepoint: skipped(),
        };
    };
    let object_ok = Ok(format!("embedded, {} bytes", object.len()));

    let tgid = std::process::id();
    let mut loader = aya::EbpfLoader::new();
    loader.override_global(PROBE_TGID_GLOBAL, &tgid, true);
    let mut ebpf = match loader.load(object) {
        Ok(e) => e,
        Err(e) => {
            let text = chain(&e);
            let reason = format!(
                "loading the BPF object (maps incl. a ring buffer): {text}{}",
                hint(&text)
            );
            return BpfFacts {
                object: object_ok,
                btf,
                ringbuf: Err(Fail::unsupported(reason)),
                tracepoint: Err(Fail::unsupported("not tried: the object did not load")),
            };
        }
    };
    let ringbuf = Ok("BPF_MAP_TYPE_RINGBUF map created".to_owned());
    let tracepoint = match crate::tracefs::ensure_tracefs() {
        Err(reason) => Err(Fail::unsupported(reason)),
        Ok(tfs) => run_tracepoint(&mut ebpf, tgid).map(|detail| match tfs {
            crate::Tracefs::Mounted(p) => format!("{detail} (mounted tracefs at {})", p.display()),
            crate::Tracefs::Present(_) => detail,
        }),
    };
    // Detaching the tracepoint waits for an RCU grace period (70 ms
    // measured on 2 vCPUs, a quarter of `lookout run`'s start-up): the
    // programs and maps are let go on a thread of their own, and the
    // probe's answer does not wait for that.
    // (A thread that cannot start drops them here, with the closure.)
    let _ = std::thread::Builder::new()
        .name("lookout-probe-bpf".into())
        .spawn(move || drop(ebpf));
    BpfFacts {
        object: object_ok,
        btf,
        ringbuf,
        tracepoint,
    }
}

fn run_tracepoint(ebpf: &mut aya::Ebpf, tgid: u32) -> Result<String, Fail> {
    let unsupported = |what: &str, e: &(dyn std::error::Error + 'static)| {
        let text = chain(e);
        Fail::unsupported(format!("{what}: {text}{}", hint(&text)))
    };
    let program: &mut TracePoint = ebpf
        .program_mut(PROBE_PROGRAM)
        .ok_or_else(|| Fail::error(format!("program {PROBE_PROGRAM} not in the object")))?
        .try_into()
        .map_err(|e| unsupported("program type", &e))?;
    program
        .load()
        .map_err(|e| unsupported("loading the tracepoint program", &e))?;
    program
        .attach(PROBE_TRACEPOINT_CATEGORY, PROBE_TRACEPOINT)
        .map_err(|e| {
            unsupported(
                &format!("attaching to {PROBE_TRACEPOINT_CATEGORY}/{PROBE_TRACEPOINT}"),
                &e,
            )
        })?;
    let map = ebpf
        .map_mut(PROBE_EVENTS_MAP)
        .ok_or_else(|| Fail::error(format!("map {PROBE_EVENTS_MAP} not in the object")))?;
    let mut ring = RingBuf::try_from(map).map_err(|e| unsupported("ring buffer map", &e))?;

    let start = Instant::now();
    // SAFETY: getppid has no preconditions; it is the trigger.
    unsafe { libc::getppid() };
    let deadline = start + Duration::from_millis(500);
    loop {
        if let Some(item) = ring.next() {
            let ev = ProbeEvent::from_bytes(&item);
            drop(item);
            return match ev {
                Some(ev) if ev.magic == PROBE_MAGIC && ev.tgid == tgid => Ok(format!(
                    "tracepoint {PROBE_TRACEPOINT_CATEGORY}/{PROBE_TRACEPOINT} loaded, attached, event delivered through the ring buffer in {} us",
                    start.elapsed().as_micros()
                )),
                other => Err(Fail::error(format!(
                    "unexpected ring buffer record {other:?}"
                ))),
            };
        }
        if Instant::now() > deadline {
            return Err(Fail::unsupported(
                "tracepoint attached but no event arrived within 500 ms",
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}
