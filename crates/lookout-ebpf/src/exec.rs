//! argv capture for the runtime hook: `sys_enter_execve` and
//! `sys_enter_execveat`, filtered by the exec'd file's name in the kernel.

use aya_ebpf::bindings::bpf_pidns_info;
use aya_ebpf::cty::c_void;
use aya_ebpf::helpers::generated::bpf_get_ns_current_pid_tgid;
use aya_ebpf::helpers::{
    bpf_get_current_pid_tgid, bpf_get_current_uid_gid, bpf_ktime_get_ns, bpf_probe_read_user, bpf_probe_read_user_str_bytes,
};
use aya_ebpf::macros::map;
use aya_ebpf::maps::{HashMap, PerCpuArray, RingBuf};
use aya_ebpf::programs::TracePointContext;
use aya_log_ebpf::{trace, warn};
use lookout_ebpf_common::{
    ARG_LEN, ARGS_SIZE, EXEC_EVENTS_BYTES, EXEC_FILTER_CAPACITY, EXEC_FLAG_EXECVEAT, EXEC_FLAG_TRUNCATED,
    ExecEvent, ExecFilterKey, FILENAME_LEN, MAX_ARGS,
};

/// Ring buffer flag: do not wake up readers. Nobody polls this ring (user
/// space drains it when the fanotify event arrives), and a wakeup costs an
/// irq_work (an IPI, expensive in a VM) in the exec'ing process.
const BPF_RB_NO_WAKEUP: u64 = 1;

/// The device and inode number of the pid namespace whose execs are
/// recorded (the agent's own, which is the node's: the DaemonSet runs with
/// `hostPID`); set by the loader. The device is the kernel's `dev_t`
/// (major << 20 | minor), not stat(2)'s encoding. 0/0 records nothing.
#[unsafe(no_mangle)]
static HOST_PIDNS_DEV: u64 = 0;
#[unsafe(no_mangle)]
static HOST_PIDNS_INO: u64 = 0;

#[map]
static EXEC_EVENTS: RingBuf = RingBuf::with_byte_size(EXEC_EVENTS_BYTES, 0);

/// Per-CPU scratch record: the filter runs on its file name before
/// anything is written to the ring buffer (reserving first and discarding
/// cost ring space for *every* exec on the host until user space consumed
/// it, so a busy host filled the ring between runtime execs and runtime
/// execs lost their records), and only its used bytes are copied to the
/// ring (`bpf_ringbuf_output`): a runtime's argv is a few hundred bytes of
/// the record's 4 KiB.
#[map]
static SCRATCH: PerCpuArray<ExecEvent> = PerCpuArray::with_max_entries(1, 0);

#[map]
static EXEC_FILTER: HashMap<ExecFilterKey, u8> = HashMap::with_max_entries(EXEC_FILTER_CAPACITY, 0);

/// Offsets of the arguments in the tracepoint records (see
/// /sys/kernel/tracing/events/syscalls/sys_enter_execve[at]/format).
pub const EXECVE_FILENAME: usize = 16;
pub const EXECVE_ARGV: usize = 24;
pub const EXECVEAT_FILENAME: usize = 24;
pub const EXECVEAT_ARGV: usize = 32;

#[inline(always)]
pub fn capture(ctx: &TracePointContext, filename_off: usize, argv_off: usize, flags: u32) -> Result<(), i64> {
    // Only host root's execs are recorded: no other caller can make a
    // rootful container (user space allows theirs at once), and so no
    // unprivileged process, at any exec rate, can fill the ring and crowd
    // out a root runtime's record. The helper's uid is the caller's real
    // uid in the initial user namespace: root in an unprivileged user
    // namespace is its mapped, non-zero uid.
    let uid = bpf_get_current_uid_gid() as u32;
    if uid != 0 {
        return Ok(());
    }
    // SAFETY: offsets come from the tracepoint format; read_at checks them.
    let filename: u64 = unsafe { ctx.read_at(filename_off) }?;
    // SAFETY: as above.
    let argv: u64 = unsafe { ctx.read_at(argv_off) }?;

    let Some(ev) = SCRATCH.get_ptr_mut(0) else {
        return Err(-1);
    };
    // SAFETY: `ev` points to this CPU's scratch record, which only this
    // program uses and which cannot be preempted away mid-program (the
    // tracepoint runs with preemption off).
    let name = unsafe { &raw mut (*ev).filename };
    // SAFETY: as above.
    let name_len = match unsafe { bpf_probe_read_user_str_bytes(filename as *const u8, &mut *name) } {
        Ok(s) => s.len(),
        Err(e) => return Err(e as i64),
    };
    // The filter key is the last (up to) 16 bytes of the basename. Scan
    // backwards at most 17 bytes for the last '/', and stop at the first
    // one: a loop whose only branch exits keeps the verifier's work linear
    // (a forward scan that remembers every '/' explodes its state space).
    let mut start = if name_len > 16 { name_len - 16 } else { 0 };
    let mut back = 0usize;
    while back < 17 {
        if back >= name_len {
            break;
        }
        let idx = (name_len - 1 - back) & (FILENAME_LEN - 1);
        // SAFETY: idx < FILENAME_LEN by the mask.
        if unsafe { (*name)[idx] } == b'/' {
            start = idx + 1;
            break;
        }
        back += 1;
    }
    let mut key: ExecFilterKey = [0; 16];
    let mut k = 0usize;
    while k < 16 {
        let idx = start + k;
        if idx >= name_len || idx >= FILENAME_LEN {
            break;
        }
        // SAFETY: idx < FILENAME_LEN.
        key[k] = unsafe { (*name)[idx] };
        k += 1;
    }
    // SAFETY: a lookup in our own map; the value is not kept.
    if unsafe { EXEC_FILTER.get(&key) }.is_none() {
        return Ok(());
    }
    // A runtime's name, but is the caller host root? Root in a container
    // without a user namespace (the Kubernetes default) passed the uid
    // check above as well, but runs in a pid namespace of its own. Its
    // records would crowd the runtime's out of the ring (docs/security.md).
    // Only callers in the node's pid namespace are recorded: the helper
    // fails for a task whose active pid namespace is any other. Checked
    // after the name filter, so that only runtime execs pay for it (0.3 us
    // a run here).
    //
    // SAFETY: reads of loader-patched constants, volatile so that the
    // compiler does not fold them to their initial 0.
    let (dev, ino) = unsafe {
        (
            core::ptr::read_volatile(&HOST_PIDNS_DEV),
            core::ptr::read_volatile(&HOST_PIDNS_INO),
        )
    };
    let mut ns = bpf_pidns_info { pid: 0, tgid: 0 };
    // SAFETY: the helper writes at most `size` bytes to `ns`, a local of
    // that size.
    let in_node_ns = unsafe {
        bpf_get_ns_current_pid_tgid(dev, ino, &mut ns, core::mem::size_of::<bpf_pidns_info>() as u32)
    };
    if in_node_ns != 0 {
        return Ok(());
    }

    // A watched runtime: fill the rest of the record.
    let pid_tgid = bpf_get_current_pid_tgid();
    let mut off = 0usize;
    let mut argc = 0u32;
    let mut fl = flags;
    let argv = argv as *const u64;
    let mut n = 0usize;
    while n < MAX_ARGS {
        // SAFETY: a user-space read through a checked helper.
        let p = match unsafe { bpf_probe_read_user(argv.wrapping_add(n)) } {
            Ok(p) => p,
            Err(_) => break,
        };
        if p == 0 {
            break;
        }
        let o = off & (ARGS_SIZE - 1);
        // SAFETY: o < ARGS_SIZE and the array has ARGS_SIZE + ARG_LEN bytes.
        let dst = unsafe { &mut (&mut (*ev).args)[o..o + ARG_LEN] };
        // SAFETY: a user-space string read by the helper into `dst`, at
        // most ARG_LEN bytes with the NUL.
        let ret = unsafe {
            aya_ebpf::helpers::generated::bpf_probe_read_user_str(
                dst.as_mut_ptr().cast(),
                ARG_LEN as u32,
                p as *const c_void,
            )
        };
        if !(0..=ARG_LEN as i64).contains(&ret) {
            break;
        }
        // The helper's count includes the NUL, except for an empty string:
        // 0, with the NUL written. One byte at least, then, and without a
        // branch: a branch that does not leave the loop (such as
        // `saturating_sub` in aya's `_str_bytes` wrapper) doubles the
        // verifier's states per argument.
        let len = ret as usize;
        off += len + (len.wrapping_sub(1) >> 63);
        argc += 1;
        if off >= ARGS_SIZE {
            fl |= EXEC_FLAG_TRUNCATED;
            off = ARGS_SIZE;
            break;
        }
        n += 1;
    }
    if n == MAX_ARGS {
        fl |= EXEC_FLAG_TRUNCATED;
    }
    // SAFETY: fixed fields of the scratch record.
    unsafe {
        (*ev).tgid = (pid_tgid >> 32) as u32;
        (*ev).tid = pid_tgid as u32;
        (*ev).ktime_ns = bpf_ktime_get_ns();
        (*ev).argc = argc;
        (*ev).args_len = off as u32;
        (*ev).flags = fl;
        (*ev).uid = uid;
    }
    // Only the used bytes. N.B. the clamp is what the verifier reads as
    // the size's bound (at most the scratch value's size).
    let used = ExecEvent::HEADER + if off < ARGS_SIZE { off } else { ARGS_SIZE };
    // SAFETY: `used` <= ExecEvent::SIZE bytes of the scratch record.
    let bytes = unsafe { core::slice::from_raw_parts(ev.cast::<u8>(), used) };
    let tgid = (pid_tgid >> 32) as u32;
    match EXEC_EVENTS.output::<[u8]>(bytes, BPF_RB_NO_WAKEUP) {
        Ok(()) => {
            trace!(ctx, "runtime exec recorded: tgid {}, {} arguments, {} bytes", tgid, argc, used);
            Ok(())
        }
        Err(e) => {
            // User space pairs the exec without its argv (and counts it);
            // this says why.
            warn!(ctx, "runtime exec of tgid {} not recorded: the exec ring buffer is full ({})", tgid, e);
            Err(i64::from(e))
        }
    }
}

pub const FLAGS_EXECVE: u32 = 0;
pub const FLAGS_EXECVEAT: u32 = EXEC_FLAG_EXECVEAT;
