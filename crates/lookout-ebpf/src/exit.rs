//! Exit codes of watched container init processes, at
//! `sched/sched_process_exit` (after do_exit stored `task->exit_code`, before
//! the task turns zombie and its pidfd becomes readable).

use aya_ebpf::helpers::{bpf_get_current_pid_tgid, bpf_get_current_task, bpf_probe_read_kernel};
use aya_ebpf::macros::map;
use aya_ebpf::maps::HashMap;
use aya_ebpf::programs::TracePointContext;
use aya_log_ebpf::warn;
use lookout_ebpf_common::EXIT_CAPACITY;

/// Offset of `exit_code` in `struct task_struct`; set by the loader from
/// the kernel's BTF (rustc emits no CO-RE relocations).
#[unsafe(no_mangle)]
static TASK_EXIT_CODE_OFFSET: u32 = 0;

#[map]
static WATCHED_PIDS: HashMap<u32, u8> = HashMap::with_max_entries(EXIT_CAPACITY, 0);

#[map]
static EXIT_CODES: HashMap<u32, i32> = HashMap::with_max_entries(EXIT_CAPACITY, 0);

#[inline(always)]
pub fn record(ctx: &TracePointContext) -> Result<(), i64> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if pid_tgid as u32 != tgid {
        return Ok(()); // a thread, not the process
    }
    // SAFETY: a lookup in our own map; the value is not kept.
    if unsafe { WATCHED_PIDS.get(&tgid) }.is_none() {
        return Ok(());
    }
    // SAFETY: a read of a loader-patched constant.
    let off = unsafe { core::ptr::read_volatile(&TASK_EXIT_CODE_OFFSET) } as usize;
    if off == 0 {
        return Ok(());
    }
    // SAFETY: the helper has no preconditions; the pointer is only passed
    // to bpf_probe_read_kernel.
    let task = unsafe { bpf_get_current_task() } as *const u8;
    // SAFETY: bpf_probe_read_kernel checks the address; the offset comes
    // from this kernel's BTF.
    let code: i32 = unsafe { bpf_probe_read_kernel(task.wrapping_add(off) as *const i32) }?;
    if let Err(e) = EXIT_CODES.insert(&tgid, &code, 0) {
        warn!(ctx, "exit code of container init {} not recorded ({}): the exit map is full", tgid, e);
        return Err(i64::from(e));
    }
    Ok(())
}
