//! lookout's BPF programs. Built by `cargo xtask build-ebpf` into
//! `target/bpf/lookout-ebpf.o` and embedded into the agent.
//!
//! Only tracepoints are used: the kernels we target have no kprobes and
//! refuse fentry/fexit, and tracepoint arguments need no CO-RE.
#![no_std]
#![no_main]

use aya_ebpf::helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns};
use aya_ebpf::macros::map;
use aya_ebpf::maps::RingBuf;
use aya_ebpf::programs::TracePointContext;
use lookout_ebpf_common::{PROBE_MAGIC, ProbeEvent};

mod exec;
mod exit;

/// The tgid the probe reports on; set by the loader (0 = nobody).
#[unsafe(no_mangle)]
static PROBE_TGID: u32 = 0;

#[map]
static PROBE_EVENTS: RingBuf = RingBuf::with_byte_size(4096, 0);

/// What every program here returns: keep the event.
///
/// N.B. Not 0. A tracepoint's BPF programs also filter its perf events:
/// when they return 0, the kernel (`perf_trace_run_bpf_submit`) drops the
/// sample for every perf event on that tracepoint, everyone's (bpftrace
/// returns 1 for the same reason). aya's `#[tracepoint]` macro returns 0
/// whatever the function returns, which hid `sys_enter_execve`,
/// `sys_enter_execveat` and `sched_process_exit` from `perf record`,
/// `perf trace` and every other perf reader on the node for as long as the
/// agent ran (measured: a perf sampler of `sched_process_exit` saw 20
/// exits of 20 without the agent, 0 with it). Hence [`tracepoint!`]. With
/// no perf event on the tracepoint, 1 costs nothing.
const KEEP_EVENT: u32 = 1;

/// A tracepoint program as aya's `#[tracepoint]` makes one (same section,
/// same symbol, the context as a [`TracePointContext`]), except that it
/// returns [`KEEP_EVENT`].
macro_rules! tracepoint {
    ($(#[$doc:meta])* fn $name:ident($ctx:ident) $body:block) => {
        $(#[$doc])*
        #[unsafe(no_mangle)]
        #[unsafe(link_section = "tracepoint")]
        pub fn $name(ctx: *mut core::ffi::c_void) -> u32 {
            let $ctx = TracePointContext::new(ctx);
            $body
            KEEP_EVENT
        }
    };
}

tracepoint! {
    /// Capability probe: attached to `syscalls/sys_enter_getppid`, writes one
    /// [`ProbeEvent`] when the probing process calls `getppid(2)`.
    fn lookout_probe(_ctx) {
        probe();
    }
}

/// The probe's work: one [`ProbeEvent`] if the caller is the prober.
#[inline(always)]
fn probe() {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    // SAFETY: a read of a constant global; volatile so that the compiler
    // does not fold the loader-patched value to its initial 0.
    let want = unsafe { core::ptr::read_volatile(&PROBE_TGID) };
    if want == 0 || tgid != want {
        return;
    }
    if let Some(mut slot) = PROBE_EVENTS.reserve::<ProbeEvent>(0) {
        slot.write(ProbeEvent {
            magic: PROBE_MAGIC,
            tgid,
            // SAFETY: the helper has no preconditions.
            ktime_ns: unsafe { bpf_ktime_get_ns() },
        });
        slot.submit(0);
    }
}

tracepoint! {
    /// argv capture at `syscalls/sys_enter_execve`.
    fn lookout_execve(ctx) {
        let _ = exec::capture(&ctx, exec::EXECVE_FILENAME, exec::EXECVE_ARGV, exec::FLAGS_EXECVE);
    }
}

tracepoint! {
    /// argv capture at `syscalls/sys_enter_execveat` (runc re-executes itself
    /// this way, and some runtimes are started through an fd).
    fn lookout_execveat(ctx) {
        let _ = exec::capture(
            &ctx,
            exec::EXECVEAT_FILENAME,
            exec::EXECVEAT_ARGV,
            exec::FLAGS_EXECVEAT,
        );
    }
}

tracepoint! {
    /// Exit codes of watched container processes, at `sched/sched_process_exit`.
    fn lookout_exit(ctx) {
        let _ = exit::record(&ctx);
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
