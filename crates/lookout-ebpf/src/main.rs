//! lookout's BPF programs. Built by `cargo xtask build-ebpf` into
//! `target/bpf/lookout-ebpf.o` and embedded into the agent.
//!
//! Only tracepoints are used: the kernels we target have no kprobes and
//! refuse fentry/fexit, and tracepoint arguments need no CO-RE.
#![no_std]
#![no_main]

use aya_ebpf::helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns};
use aya_ebpf::macros::{map, tracepoint};
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

/// Capability probe: attached to `syscalls/sys_enter_getppid`, writes one
/// [`ProbeEvent`] when the probing process calls `getppid(2)`.
#[tracepoint]
pub fn lookout_probe(_ctx: TracePointContext) -> u32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    // SAFETY: a read of a constant global; volatile so that the compiler
    // does not fold the loader-patched value to its initial 0.
    let want = unsafe { core::ptr::read_volatile(&PROBE_TGID) };
    if want == 0 || tgid != want {
        return 0;
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
    0
}

/// argv capture at `syscalls/sys_enter_execve`.
#[tracepoint]
pub fn lookout_execve(ctx: TracePointContext) -> u32 {
    let _ = exec::capture(&ctx, exec::EXECVE_FILENAME, exec::EXECVE_ARGV, exec::FLAGS_EXECVE);
    0
}

/// argv capture at `syscalls/sys_enter_execveat` (runc re-executes itself
/// this way, and some runtimes are started through an fd).
#[tracepoint]
pub fn lookout_execveat(ctx: TracePointContext) -> u32 {
    let _ = exec::capture(&ctx, exec::EXECVEAT_FILENAME, exec::EXECVEAT_ARGV, exec::FLAGS_EXECVEAT);
    0
}

/// Exit codes of watched container processes, at `sched/sched_process_exit`.
#[tracepoint]
pub fn lookout_exit(_ctx: TracePointContext) -> u32 {
    let _ = exit::record();
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
