//! Types shared by lookout's BPF programs (`lookout-ebpf`) and user space.
//!
//! Everything here is `#[repr(C)]`, `Copy` and free of pointers, so the
//! same bytes mean the same thing on both sides of a ring buffer. The crate
//! is `no_std` and has no dependencies, so the BPF build can use it.
//!
//! The names of programs and maps are constants here as well, so a rename
//! on one side fails to compile instead of failing to load.
#![no_std]
#![deny(missing_docs)]

/// Name of the capability-probe tracepoint program.
pub const PROBE_PROGRAM: &str = "lookout_probe";
/// Tracepoint category the probe program attaches to.
pub const PROBE_TRACEPOINT_CATEGORY: &str = "syscalls";
/// Tracepoint the probe program attaches to. `getppid` is called rarely on a
/// node, and the program filters by tgid first, so other callers pay a few
/// instructions.
pub const PROBE_TRACEPOINT: &str = "sys_enter_getppid";
/// Name of the probe's ring buffer map.
pub const PROBE_EVENTS_MAP: &str = "PROBE_EVENTS";
/// Name of the global that holds the tgid the probe program reports on.
pub const PROBE_TGID_GLOBAL: &str = "PROBE_TGID";
/// Marker written by the probe program, so user space can tell a real
/// record from stray bytes.
pub const PROBE_MAGIC: u32 = 0x6c6f_6f6b; // "look"

/// The record the probe program writes when the probing process calls
/// `getppid(2)`: proof that a tracepoint program ran and a ring buffer
/// delivered its output.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeEvent {
    /// Always [`PROBE_MAGIC`].
    pub magic: u32,
    /// The tgid that triggered the program.
    pub tgid: u32,
    /// `bpf_ktime_get_ns()` at the tracepoint (CLOCK_MONOTONIC).
    pub ktime_ns: u64,
}

impl ProbeEvent {
    /// Size in bytes of the record in the ring buffer.
    pub const SIZE: usize = core::mem::size_of::<ProbeEvent>();

    /// Decodes a ring buffer record (which need not be aligned).
    pub fn from_bytes(bytes: &[u8]) -> Option<ProbeEvent> {
        if bytes.len() < Self::SIZE {
            return None;
        }
        let u32_at =
            |o: usize| u32::from_ne_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]);
        let mut k = [0u8; 8];
        k.copy_from_slice(&bytes[8..16]);
        Some(ProbeEvent {
            magic: u32_at(0),
            tgid: u32_at(4),
            ktime_ns: u64::from_ne_bytes(k),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_unaligned_record() {
        let mut buf = [0u8; 17];
        buf[1..5].copy_from_slice(&PROBE_MAGIC.to_ne_bytes());
        buf[5..9].copy_from_slice(&77u32.to_ne_bytes());
        buf[9..17].copy_from_slice(&5u64.to_ne_bytes());
        let e = ProbeEvent::from_bytes(&buf[1..]).expect("16 bytes");
        assert_eq!(
            e,
            ProbeEvent {
                magic: PROBE_MAGIC,
                tgid: 77,
                ktime_ns: 5
            }
        );
        assert!(ProbeEvent::from_bytes(&buf[..8]).is_none());
    }

    #[test]
    fn filter_keys_keep_the_tail() {
        assert_eq!(&exec_filter_key(b"runc")[..5], b"runc\0");
        let long = exec_filter_key(b"containerd-shim-runc-v2");
        assert_eq!(&long, b"erd-shim-runc-v2");
    }
}

/// Name of the `sys_enter_execve` argv-capture program.
pub const EXECVE_PROGRAM: &str = "lookout_execve";
/// Name of the `sys_enter_execveat` argv-capture program.
pub const EXECVEAT_PROGRAM: &str = "lookout_execveat";
/// Name of the ring buffer the argv-capture programs write [`ExecEvent`]s to.
pub const EXEC_EVENTS_MAP: &str = "EXEC_EVENTS";
/// Name of the hash map of binary file names ([`ExecFilterKey`]) whose
/// execs are captured. Everything else is discarded in the kernel.
pub const EXEC_FILTER_MAP: &str = "EXEC_FILTER";
/// Capacity of [`EXEC_FILTER_MAP`].
pub const EXEC_FILTER_CAPACITY: u32 = 64;
/// Size of the exec ring buffer in bytes (a power of two, page multiple).
/// A record is [`ExecEvent::HEADER`] bytes and its argv: about 1 KiB for a
/// kubelet's `runc create`, 4.4 KiB at most, so the ring holds about 250
/// runtime execs that user space has not read yet (59 at the least). The
/// kernel maps its pages twice (for records that wrap), so a ring costs
/// the agent twice its size in RSS.
pub const EXEC_EVENTS_BYTES: u32 = 256 * 1024;

/// Global: the kernel `dev_t` (major << 20 | minor) of the nsfs holding
/// the pid namespace whose execs the argv programs record.
pub const HOST_PIDNS_DEV_GLOBAL: &str = "HOST_PIDNS_DEV";
/// Global: the inode number of that pid namespace. Both 0: the programs
/// record nothing.
pub const HOST_PIDNS_INO_GLOBAL: &str = "HOST_PIDNS_INO";

/// Bytes kept of the exec'd file name.
pub const FILENAME_LEN: usize = 256;
/// Bytes kept of one argument (including its NUL).
pub const ARG_LEN: usize = 256;
/// Arguments kept at most.
pub const MAX_ARGS: usize = 48;
/// Bytes of the argument area (a power of two; see [`ExecEvent::args`]).
pub const ARGS_SIZE: usize = 4096;

/// `ExecEvent::flags`: argv had more than [`MAX_ARGS`] arguments or more
/// than [`ARGS_SIZE`] bytes. (An argument longer than [`ARG_LEN`] is cut
/// without a flag; it shows as a 255-byte argument.)
pub const EXEC_FLAG_TRUNCATED: u32 = 1;
/// `ExecEvent::flags`: the record comes from `execveat(2)`.
pub const EXEC_FLAG_EXECVEAT: u32 = 2;

/// The key of [`EXEC_FILTER_MAP`]: the last (up to) 16 bytes of a binary's
/// file name, NUL-padded.
pub type ExecFilterKey = [u8; 16];

/// Builds the filter key of a binary file name (no directory part): its
/// last 16 bytes, NUL-padded. The BPF side computes the same from the path
/// passed to exec.
pub fn exec_filter_key(name: &[u8]) -> ExecFilterKey {
    let mut key = [0u8; 16];
    let tail = &name[name.len().saturating_sub(16)..];
    key[..tail.len()].copy_from_slice(tail);
    key
}

/// One captured exec of a watched binary, written at `sys_enter_execve[at]`,
/// that is, before the kernel opens the file and before any fanotify
/// permission event for it.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ExecEvent {
    /// Process id of the caller.
    pub tgid: u32,
    /// Thread id of the caller: what fanotify reports with `FAN_REPORT_TID`.
    pub tid: u32,
    /// `bpf_ktime_get_ns()` (CLOCK_MONOTONIC) at syscall entry.
    pub ktime_ns: u64,
    /// Arguments captured.
    pub argc: u32,
    /// Bytes used in `args`.
    pub args_len: u32,
    /// `EXEC_FLAG_*`.
    pub flags: u32,
    /// The caller's real uid as the initial user namespace sees it
    /// (`bpf_get_current_uid_gid`): 0 only for host root. Root inside an
    /// unprivileged user namespace is its mapped host uid.
    pub uid: u32,
    /// The path passed to exec, NUL-terminated.
    pub filename: [u8; FILENAME_LEN],
    /// The arguments, each NUL-terminated, back to back. The extra
    /// [`ARG_LEN`] bytes let the program write at any offset below
    /// [`ARGS_SIZE`] without a bounds check the verifier cannot follow.
    pub args: [u8; ARGS_SIZE + ARG_LEN],
}

impl ExecEvent {
    /// Size in bytes of the whole record.
    pub const SIZE: usize = core::mem::size_of::<ExecEvent>();
    /// Size in bytes of the record before [`ExecEvent::args`]: a ring
    /// buffer record is this and [`ExecEvent::args_len`] bytes.
    pub const HEADER: usize = core::mem::offset_of!(ExecEvent, args);
}

/// Name of the `sched/sched_process_exit` program that records exit codes.
pub const EXIT_PROGRAM: &str = "lookout_exit";
/// Hash map of container init pids (tgid → 1) whose exit code is wanted.
pub const WATCHED_PIDS_MAP: &str = "WATCHED_PIDS";
/// Hash map tgid → raw `task_struct.exit_code` (a `wait(2)` status).
pub const EXIT_CODES_MAP: &str = "EXIT_CODES";
/// Capacity of [`WATCHED_PIDS_MAP`] and [`EXIT_CODES_MAP`].
pub const EXIT_CAPACITY: u32 = 16384;
/// Global: byte offset of `exit_code` in `struct task_struct`, found by user
/// space in the kernel's BTF (0 = unknown: the program records nothing).
pub const TASK_EXIT_CODE_OFFSET_GLOBAL: &str = "TASK_EXIT_CODE_OFFSET";
