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

/// Default directory of the BPF file system where the agent pins the
/// container maps ([`CONTAINERS_BY_CGROUP_MAP`], [`CONTAINERS_BY_MNTNS_MAP`]).
pub const CONTAINER_MAPS_DIR: &str = "/sys/fs/bpf/lookout";
/// Pin name (and kernel name) of the `BPF_MAP_TYPE_HASH` from a cgroup v2
/// id (`u64`, what `bpf_get_current_cgroup_id()` returns) to a
/// [`ContainerEntry`].
pub const CONTAINERS_BY_CGROUP_MAP: &str = "containers_by_cgroup";
/// Pin name (and kernel name) of the `BPF_MAP_TYPE_HASH` from a mount
/// namespace's inode number (`u64`: `task->nsproxy->mnt_ns->ns.inum`, the
/// inode of `/proc/<pid>/ns/mnt`) to a [`ContainerEntry`].
pub const CONTAINERS_BY_MNTNS_MAP: &str = "containers_by_mntns";
/// The name the kernel keeps for [`CONTAINERS_BY_CGROUP_MAP`]
/// (`BPF_OBJ_NAME_LEN` is 16 with its NUL): what `bpftool map list` shows.
pub const CONTAINERS_BY_CGROUP_KERNEL_NAME: &str = "lookout_by_cgrp";
/// The name the kernel keeps for [`CONTAINERS_BY_MNTNS_MAP`].
pub const CONTAINERS_BY_MNTNS_KERNEL_NAME: &str = "lookout_by_mnt";
/// Default `max_entries` of each container map. Both maps are created
/// with `BPF_F_NO_PREALLOC`, so the kernel allocates an entry when it is
/// written: the maximum bounds the memory, it does not reserve it.
pub const CONTAINER_MAPS_MAX_ENTRIES: u32 = 16384;
/// `map_flags` of both container maps: `BPF_F_NO_PREALLOC |
/// BPF_F_RDONLY_PROG`. Programs only read them (the verifier refuses a
/// program's write); the agent writes through `bpf(2)`.
pub const CONTAINER_MAPS_FLAGS: u32 = 1 | (1 << 7);

/// [`ContainerEntry::version`] of the layout in this crate.
///
/// A later layout only uses bytes that are [`ContainerEntry::reserved`]
/// here, and raises the version: the entry keeps its size, and a reader of
/// version 1 reads a later entry correctly (it ignores the new fields).
/// An entry's size never changes under the same pin name.
pub const CONTAINER_ENTRY_VERSION: u16 = 1;
/// Bytes of the container id kept in [`ContainerEntry::id`]. Runtimes'
/// ids are 64 hex digits; a longer id is cut to its first 64 bytes and
/// flagged [`CONTAINER_ENTRY_ID_TRUNCATED`].
pub const CONTAINER_ID_LEN: usize = 64;
/// [`ContainerEntry::flags`]: the id is longer than [`CONTAINER_ID_LEN`]
/// bytes; `id` holds its first 64.
pub const CONTAINER_ENTRY_ID_TRUNCATED: u8 = 1;

/// [`ContainerEntry::kind`]: not known (a container outside Kubernetes, or
/// one whose pod is not known yet).
pub const CONTAINER_KIND_UNKNOWN: u8 = 0;
/// [`ContainerEntry::kind`]: one of the pod's `spec.containers`.
pub const CONTAINER_KIND_REGULAR: u8 = 1;
/// [`ContainerEntry::kind`]: one of `spec.initContainers` (sidecars too).
pub const CONTAINER_KIND_INIT: u8 = 2;
/// [`ContainerEntry::kind`]: one of `spec.ephemeralContainers`.
pub const CONTAINER_KIND_EPHEMERAL: u8 = 3;
/// [`ContainerEntry::kind`]: the pod's sandbox (pause) container.
pub const CONTAINER_KIND_SANDBOX: u8 = 4;

/// [`ContainerEntry::runtime`]: another runtime, or not known.
pub const RUNTIME_OTHER: u8 = 0;
/// [`ContainerEntry::runtime`]: runc.
pub const RUNTIME_RUNC: u8 = 1;
/// [`ContainerEntry::runtime`]: crun.
pub const RUNTIME_CRUN: u8 = 2;
/// [`ContainerEntry::runtime`]: gVisor's runsc (its processes run in the
/// sandbox's kernel: the host sees only the sandbox's own).
pub const RUNTIME_RUNSC: u8 = 3;
/// [`ContainerEntry::runtime`]: youki.
pub const RUNTIME_YOUKI: u8 = 4;
/// [`ContainerEntry::runtime`]: started through conmon (CRI-O, podman).
pub const RUNTIME_CONMON: u8 = 5;

/// The value of both container maps: which container a cgroup or mount
/// namespace belongs to.
///
/// 128 bytes, the same on every architecture (no pointers, fields at
/// their natural alignment, no implicit padding). `lookout.h` in this
/// crate declares the same struct for C (libbpf) and Go (cilium/ebpf)
/// programs, and a test compiles it and compares every offset.
///
/// It names the container and nothing else: no environment, no
/// annotation, no label, no secret. A program that wants the pod or the
/// image asks the agent's API for the id.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContainerEntry {
    /// [`CONTAINER_ENTRY_VERSION`] when written (at least 1).
    pub version: u16,
    /// `CONTAINER_KIND_*`.
    pub kind: u8,
    /// `RUNTIME_*`.
    pub runtime: u8,
    /// Bytes of `id` in use (at most [`CONTAINER_ID_LEN`]).
    pub id_len: u8,
    /// `CONTAINER_ENTRY_*` flags.
    pub flags: u8,
    /// Zero.
    pub pad: [u8; 2],
    /// The inode number of the container's pid namespace (0: not known).
    pub pid_ns: u64,
    /// The container's cgroup id (0: not known): the key of its entry in
    /// [`CONTAINERS_BY_CGROUP_MAP`].
    pub cgroup_id: u64,
    /// The inode number of its mount namespace (0: not known): the key of
    /// its entry in [`CONTAINERS_BY_MNTNS_MAP`].
    pub mnt_ns: u64,
    /// The runtime's container id, `id_len` bytes, NUL-padded.
    pub id: [u8; CONTAINER_ID_LEN],
    /// Zero; for fields of later versions.
    pub reserved: [u8; 32],
}

impl ContainerEntry {
    /// Size in bytes of an entry: the maps' `value_size`.
    pub const SIZE: usize = core::mem::size_of::<ContainerEntry>();

    /// An entry for the container `id`, everything else unknown. The id is
    /// cut to [`CONTAINER_ID_LEN`] bytes (and flagged) if longer.
    pub fn new(id: &[u8]) -> ContainerEntry {
        let mut entry = ContainerEntry {
            version: CONTAINER_ENTRY_VERSION,
            kind: CONTAINER_KIND_UNKNOWN,
            runtime: RUNTIME_OTHER,
            id_len: 0,
            flags: 0,
            pad: [0; 2],
            pid_ns: 0,
            cgroup_id: 0,
            mnt_ns: 0,
            id: [0; CONTAINER_ID_LEN],
            reserved: [0; 32],
        };
        let kept = id.len().min(CONTAINER_ID_LEN);
        entry.id[..kept].copy_from_slice(&id[..kept]);
        // `kept` is at most 64.
        entry.id_len = kept as u8;
        if id.len() > CONTAINER_ID_LEN {
            entry.flags |= CONTAINER_ENTRY_ID_TRUNCATED;
        }
        entry
    }

    /// The id's bytes (`id_len` of them, at most [`CONTAINER_ID_LEN`]).
    pub fn id(&self) -> &[u8] {
        &self.id[..usize::from(self.id_len).min(CONTAINER_ID_LEN)]
    }

    /// The entry as the map stores it (native byte order).
    pub fn to_bytes(&self) -> [u8; ContainerEntry::SIZE] {
        let mut b = [0u8; ContainerEntry::SIZE];
        b[0..2].copy_from_slice(&self.version.to_ne_bytes());
        b[2] = self.kind;
        b[3] = self.runtime;
        b[4] = self.id_len;
        b[5] = self.flags;
        b[6..8].copy_from_slice(&self.pad);
        b[8..16].copy_from_slice(&self.pid_ns.to_ne_bytes());
        b[16..24].copy_from_slice(&self.cgroup_id.to_ne_bytes());
        b[24..32].copy_from_slice(&self.mnt_ns.to_ne_bytes());
        b[32..96].copy_from_slice(&self.id);
        b[96..128].copy_from_slice(&self.reserved);
        b
    }

    /// Decodes an entry read from a map (which need not be aligned).
    /// `None` when `bytes` is shorter than [`ContainerEntry::SIZE`] or the
    /// version is 0 (not an entry).
    pub fn from_bytes(bytes: &[u8]) -> Option<ContainerEntry> {
        let b: &[u8; ContainerEntry::SIZE] = bytes.get(..ContainerEntry::SIZE)?.try_into().ok()?;
        let u64_at = |o: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[o..o + 8]);
            u64::from_ne_bytes(w)
        };
        let version = u16::from_ne_bytes([b[0], b[1]]);
        if version == 0 {
            return None;
        }
        let mut id = [0u8; CONTAINER_ID_LEN];
        id.copy_from_slice(&b[32..96]);
        let mut reserved = [0u8; 32];
        reserved.copy_from_slice(&b[96..128]);
        Some(ContainerEntry {
            version,
            kind: b[2],
            runtime: b[3],
            id_len: b[4],
            flags: b[5],
            pad: [b[6], b[7]],
            pid_ns: u64_at(8),
            cgroup_id: u64_at(16),
            mnt_ns: u64_at(24),
            id,
            reserved,
        })
    }
}

#[cfg(test)]
mod entry_tests {
    use super::*;

    #[test]
    fn layout_is_the_documented_one() {
        use core::mem::offset_of;
        assert_eq!(ContainerEntry::SIZE, 128);
        assert_eq!(core::mem::align_of::<ContainerEntry>(), 8);
        assert_eq!(offset_of!(ContainerEntry, kind), 2);
        assert_eq!(offset_of!(ContainerEntry, runtime), 3);
        assert_eq!(offset_of!(ContainerEntry, id_len), 4);
        assert_eq!(offset_of!(ContainerEntry, flags), 5);
        assert_eq!(offset_of!(ContainerEntry, pid_ns), 8);
        assert_eq!(offset_of!(ContainerEntry, cgroup_id), 16);
        assert_eq!(offset_of!(ContainerEntry, mnt_ns), 24);
        assert_eq!(offset_of!(ContainerEntry, id), 32);
        assert_eq!(offset_of!(ContainerEntry, reserved), 96);
    }

    #[test]
    fn bytes_round_trip_and_match_memory() {
        let mut e = ContainerEntry::new(b"abc123");
        e.kind = CONTAINER_KIND_INIT;
        e.runtime = RUNTIME_CRUN;
        e.pid_ns = 4026532000;
        e.cgroup_id = 1 << 40 | 7;
        e.mnt_ns = 4026531999;
        let bytes = e.to_bytes();
        // The hand-written encoding is the struct's own memory.
        // SAFETY: `e` is a live, initialised `repr(C)` value with no
        // padding (the layout test), so its bytes may be read as u8.
        let raw = unsafe {
            core::slice::from_raw_parts(
                (&e as *const ContainerEntry).cast::<u8>(),
                ContainerEntry::SIZE,
            )
        };
        assert_eq!(&bytes[..], raw);
        let mut unaligned = [0u8; ContainerEntry::SIZE + 1];
        unaligned[1..].copy_from_slice(&bytes);
        assert_eq!(ContainerEntry::from_bytes(&unaligned[1..]), Some(e));
        assert_eq!(e.id(), b"abc123");
        assert!(ContainerEntry::from_bytes(&bytes[..127]).is_none());
        assert!(ContainerEntry::from_bytes(&[0u8; 128]).is_none());
    }

    #[test]
    fn long_ids_are_cut_and_flagged() {
        let long = [b'a'; 80];
        let e = ContainerEntry::new(&long);
        assert_eq!(e.id(), &long[..64]);
        assert_eq!(
            e.flags & CONTAINER_ENTRY_ID_TRUNCATED,
            CONTAINER_ENTRY_ID_TRUNCATED
        );
        let mut bad = e;
        bad.id_len = 200;
        assert_eq!(bad.id().len(), 64);
    }
}
