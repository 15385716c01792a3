//! The BPF side of `lookout-example-execs`: counts the execs of each
//! container that lookout knows, keyed by cgroup.
//!
//! One tracepoint program, `count_execs` on `sched/sched_process_exec`
//! (after an exec succeeded, in the task that now runs the new program):
//!
//! 1. `bpf_get_current_cgroup_id()`: the id of the task's cgroup v2
//!    directory (its inode number).
//! 2. If that id is a key of `containers_by_cgroup`, the map that lookout
//!    pins under `/sys/fs/bpf/lookout/`, the task runs in a container that
//!    lookout reported: add 1 to the cgroup's counter in `EXECS_BY_CGROUP`.
//!    Anything else (the host, a container lookout does not know) costs a
//!    hash lookup and nothing more.
//!
//! The program never writes to lookout's map. User space
//! (`crates/lookout-example-execs`) reads the counters and names each
//! cgroup's container from the same pinned map.
//!
//! Built by `cargo xtask build-ebpf` into
//! `target/bpf/lookout-example-execs.o`.
#![no_std]
#![no_main]
// `AtomicU64::fetch_add` does not exist on bpfel-unknown-none (its target
// spec says `atomic-cas: false`, which hides every read-modify-write
// method), but the instruction set has an atomic add: the intrinsic
// behind `fetch_add` emits it. See `add_one`.
#![feature(core_intrinsics)]
#![expect(
    internal_features,
    reason = "core_intrinsics: the only atomic add there is for this target"
)]

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::bindings::{BPF_F_NO_PREALLOC, BPF_NOEXIST};
use aya_ebpf::helpers::bpf_get_current_cgroup_id;
use aya_ebpf::macros::map;
use aya_ebpf::maps::HashMap;
use aya_ebpf::programs::TracePointContext;
use lookout_ebpf_common::{CONTAINER_MAPS_FLAGS, CONTAINER_MAPS_MAX_ENTRIES, ContainerEntry};

/// lookout's map from a cgroup v2 id to its container, declared exactly as
/// the agent creates it (type, key and value sizes, `max_entries`,
/// `BPF_F_NO_PREALLOC`) and marked pinned. User space loads this object with
/// `EbpfLoader::map_pin_path("containers_by_cgroup", <dir>/containers_by_cgroup)`,
/// so aya opens the agent's pin instead of creating a map.
///
/// N.B. aya does not compare a pinned map with this declaration, and it
/// creates (and pins) a map of its own when the pin is missing: user space
/// checks the pin before it loads.
#[map(name = "containers_by_cgroup")]
static CONTAINERS_BY_CGROUP: HashMap<u64, ContainerEntry> =
    HashMap::pinned(CONTAINER_MAPS_MAX_ENTRIES, CONTAINER_MAPS_FLAGS);

/// Execs per cgroup id, for the cgroups found in [`CONTAINERS_BY_CGROUP`].
/// Private to this program (not pinned). Counters stay after the container
/// exits, so user space can still print them: the map holds as many
/// cgroups as lookout's, and a cgroup that finds it full is not counted.
/// `BPF_F_NO_PREALLOC`: an element is freed only after an RCU grace
/// period, so a pointer from a lookup stays valid while the program runs.
#[map(name = "EXECS_BY_CGROUP")]
static EXECS_BY_CGROUP: HashMap<u64, Counted> =
    HashMap::with_max_entries(CONTAINER_MAPS_MAX_ENTRIES, BPF_F_NO_PREALLOC);

/// What the program returns: keep the event.
///
/// N.B. Not 0. A tracepoint's BPF programs also filter its perf events:
/// when they return 0, the kernel (`perf_trace_run_bpf_submit`) drops the
/// sample for every perf event on that tracepoint, everyone's. aya's
/// `#[tracepoint]` macro returns 0 whatever the function returns, so this
/// program is written out by [`tracepoint!`], as lookout's own are (see
/// `crates/lookout-ebpf/src/main.rs`).
/// A counter, and the entry of the container it counts, copied at its
/// first exec: user space learns whose cgroup it was even when the
/// container has exited (and its entry gone) by the time it reads.
/// `execs` first, then the 128-byte [`ContainerEntry`]: 136 bytes.
#[repr(C)]
#[derive(Clone, Copy)]
struct Counted {
    execs: u64,
    entry: ContainerEntry,
}

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
    /// Counts one exec at `sched/sched_process_exec` if the task's cgroup is
    /// a container's that lookout reported.
    fn count_execs(_ctx) {
        // SAFETY: the helper has no preconditions.
        let cgroup_id = unsafe { bpf_get_current_cgroup_id() };
        if let Some(entry) = CONTAINERS_BY_CGROUP.get_ptr(cgroup_id) {
            // SAFETY: a value of our map's type, copied at once (the agent
            // may remove it meanwhile; the copy is what was there).
            let entry = unsafe { *entry };
            count(cgroup_id, entry);
        }
    }
}

/// Adds 1 to the counter of `cgroup_id`, creating it at 1 when missing.
///
/// Two CPUs can exec the cgroup's first program at once: both miss the
/// lookup, one insert wins and the other fails with `EEXIST`
/// (`BPF_NOEXIST`), so the loser looks up once more and adds to the
/// winner's counter. A second failure means the map is full (or the entry
/// went again): the exec is not counted.
#[inline(always)]
fn count(cgroup_id: u64, entry: ContainerEntry) {
    if add_one(cgroup_id) {
        return;
    }
    if EXECS_BY_CGROUP
        .insert(cgroup_id, Counted { execs: 1, entry }, u64::from(BPF_NOEXIST))
        .is_ok()
    {
        return;
    }
    let _ = add_one(cgroup_id);
}

/// Atomically adds 1 to the counter of `cgroup_id` if it exists.
#[inline(always)]
fn add_one(cgroup_id: u64) -> bool {
    let Some(counter) = EXECS_BY_CGROUP.get_ptr_mut(cgroup_id) else {
        return false;
    };
    // SAFETY: the pointer is the kernel's, to a live value of our map,
    // whose first field is an 8-byte aligned u64 (`Counted` is repr(C)), valid while this program runs (BPF_F_NO_PREALLOC:
    // see EXECS_BY_CGROUP). Other CPUs update it only through this atomic
    // add too, and user space only reads it. The result is unused, so LLVM
    // emits the plain atomic add (`lock *(u64 *)(r + 0) += r`, XADD) that
    // every kernel with BPF takes, not the fetching form.
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(&raw mut (*counter).execs, 1) };
    true
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
