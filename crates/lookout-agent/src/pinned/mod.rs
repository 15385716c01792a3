//! The node's containers as pinned BPF maps: `containers_by_cgroup` and
//! `containers_by_mntns` under `--bpf-pin-dir`, for tracers and security
//! tools that filter in the kernel.
//!
//! - here: the pin directory (checked, never trusted), the maps (opened
//!   from their pins, or created and pinned), their metrics;
//! - [`sink`]: the sink under the merger that writes a container's entries
//!   when it is added, before the hub sees it (so before its start is
//!   released), and removes them when it is removed;
//! - [`sweep`]: entries that no live container of this agent wrote and
//!   whose cgroup is gone (left by an earlier agent, or by one that ran
//!   beside this one), removed; a tracer's map is never emptied.
//!
//! The layout of the entries is `lookout_ebpf_common::ContainerEntry`
//! (docs/ebpf.md).

mod sink;
mod sweep;

use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use aya::maps::{HashMap, Map, MapData, MapError, MapType};
use lookout_ebpf_common::{
    CONTAINER_MAPS_FLAGS, CONTAINERS_BY_CGROUP_KERNEL_NAME, CONTAINERS_BY_CGROUP_MAP,
    CONTAINERS_BY_MNTNS_KERNEL_NAME, CONTAINERS_BY_MNTNS_MAP, ContainerEntry,
};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

pub(crate) use sink::{PinSink, Pinned};
pub(crate) use sweep::{Sweep, spawn as spawn_sweep};

/// `statfs(2)`'s `f_type` of the BPF file system.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
/// `BPF_MAP_TYPE_HASH`.
const BPF_MAP_TYPE_HASH: u32 = 1;

/// One container map, as aya holds it: u64 keys, [`ContainerEntry`] bytes.
pub(crate) type EntryMap = HashMap<MapData, u64, [u8; ContainerEntry::SIZE]>;

/// Which of the two maps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Which {
    /// `containers_by_cgroup`.
    Cgroup,
    /// `containers_by_mntns`.
    Mntns,
}

impl Which {
    pub(crate) const BOTH: [Which; 2] = [Which::Cgroup, Which::Mntns];

    /// The pin's file name.
    pub(crate) fn pin_name(self) -> &'static str {
        match self {
            Which::Cgroup => CONTAINERS_BY_CGROUP_MAP,
            Which::Mntns => CONTAINERS_BY_MNTNS_MAP,
        }
    }

    fn kernel_name(self) -> &'static str {
        match self {
            Which::Cgroup => CONTAINERS_BY_CGROUP_KERNEL_NAME,
            Which::Mntns => CONTAINERS_BY_MNTNS_KERNEL_NAME,
        }
    }
}

/// Why the agent runs without pinned maps.
#[derive(Debug, thiserror::Error)]
pub(crate) enum OpenError {
    #[error(
        "{dir} is not on a BPF file system (mount one: `mount -t bpf bpf /sys/fs/bpf`; in a pod, \
         mount the host's /sys/fs/bpf)"
    )]
    NotBpffs { dir: PathBuf },
    #[error("cannot use {dir}: {why}")]
    Dir { dir: PathBuf, why: String },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error(
        "cannot create the BPF map {name}: {source} (creating BPF maps needs CAP_BPF, or \
         CAP_SYS_ADMIN before Linux 5.8)"
    )]
    Create {
        name: &'static str,
        source: MapError,
    },
    #[error("cannot pin {path}: {source}")]
    Pin {
        path: PathBuf,
        source: aya::pin::PinError,
    },
    #[error(
        "{path} is pinned, but is not this agent's map: {what} (another tool's, or a later \
         lookout's layout); left as it is: remove it, or give this agent another --bpf-pin-dir"
    )]
    Incompatible { path: PathBuf, what: String },
    #[error("cannot open the pinned map {path}: {source}")]
    Open { path: PathBuf, source: MapError },
    #[error(
        "cannot open or create BPF maps at {path}: not permitted (BPF maps need CAP_BPF, or \
         CAP_SYS_ADMIN before Linux 5.8, and no seccomp or LSM policy that denies bpf(2))"
    )]
    Denied { path: PathBuf, source: MapError },
}

/// The two maps, opened from their pins (or created and pinned).
pub(crate) struct Maps {
    pub(crate) by_cgroup: EntryMap,
    pub(crate) by_mntns: EntryMap,
}

impl Maps {
    /// The map for `which`.
    pub(crate) fn get(&self, which: Which) -> &EntryMap {
        match which {
            Which::Cgroup => &self.by_cgroup,
            Which::Mntns => &self.by_mntns,
        }
    }

    /// The map for `which`, to write.
    pub(crate) fn get_mut(&mut self, which: Which) -> &mut EntryMap {
        match which {
            Which::Cgroup => &mut self.by_cgroup,
            Which::Mntns => &mut self.by_mntns,
        }
    }
}

/// The maps and their sweep: under `dir` (none: `--no-pinned-maps`), unless
/// they cannot be had here; then the log says why, and discovery runs
/// without them.
pub(crate) fn start(
    dir: Option<&Path>,
    max_entries: u32,
    host_root: &Path,
    metrics: PinMetrics,
) -> Option<(std::sync::Arc<std::sync::Mutex<Pinned>>, Sweep)> {
    let Some(dir) = dir else {
        tracing::info!("pinned container maps off (--no-pinned-maps)");
        return None;
    };
    let cgroup_root = lookout_host::kernel::find_cgroup2_root(host_root)
        .ok()
        .map(Path::to_path_buf);
    match open(dir, max_entries, cgroup_root, metrics) {
        Ok(pinned) => Some(pinned),
        Err(e) => {
            tracing::warn!(
                dir = %dir.display(),
                "no pinned container maps: {}",
                lookout_model::Chain(&e)
            );
            None
        }
    }
}

/// Opens the maps under `dir` for the sink, and a second handle for the
/// sweep (which judges entries against the cgroup tree under
/// `cgroup_root`), logging what it found.
fn open(
    dir: &Path,
    max_entries: u32,
    cgroup_root: Option<PathBuf>,
    metrics: PinMetrics,
) -> Result<(std::sync::Arc<std::sync::Mutex<Pinned>>, Sweep), OpenError> {
    let (maps, opened) = open_maps(dir, max_entries)?;
    let reader = open_pins(dir)?;
    if let Some(kept) = opened.kept_size {
        tracing::warn!(
            dir = %dir.display(),
            pinned = kept,
            asked = max_entries,
            "the pinned maps keep their max_entries (a new size needs a new, empty map under \
             every tracer: remove the pins while no tracer runs to change it)"
        );
    }
    tracing::info!(
        dir = %dir.display(),
        reused = ?opened.reused,
        "container maps pinned: {CONTAINERS_BY_CGROUP_MAP}, {CONTAINERS_BY_MNTNS_MAP}"
    );
    let pinned = std::sync::Arc::new(std::sync::Mutex::new(Pinned::new(maps, metrics)));
    let sweep = Sweep::new(reader, &pinned, cgroup_root);
    Ok((pinned, sweep))
}

/// What [`open_maps`] found.
#[derive(Debug, Default)]
pub(crate) struct Opened {
    /// Maps that were pinned already (an earlier agent's): reused, never
    /// emptied.
    pub(crate) reused: Vec<&'static str>,
    /// A reused map whose `max_entries` is not the one asked for: it is
    /// kept (resizing means a new, empty map under tracers).
    pub(crate) kept_size: Option<u32>,
}

/// Opens both maps under `dir`, creating (mode 0700) and checking the
/// directory first, and creating and pinning a map that is not there.
///
/// The directory must be on a BPF file system, a directory (not a
/// symlink) and owned by root; its mode is narrowed to 0700 if it is
/// wider. Anyone who could write there could swap a map under every tracer
/// that trusts it.
fn open_maps(dir: &Path, max_entries: u32) -> Result<(Maps, Opened), OpenError> {
    prepare_dir(dir)?;
    let mut opened = Opened::default();
    let by_cgroup = open_map(dir, Which::Cgroup, max_entries, &mut opened)?;
    let by_mntns = open_map(dir, Which::Mntns, max_entries, &mut opened)?;
    Ok((
        Maps {
            by_cgroup,
            by_mntns,
        },
        opened,
    ))
}

/// Opens both maps from their pins only (a second handle for the sweep).
fn open_pins(dir: &Path) -> Result<Maps, OpenError> {
    let pin = |which: Which| {
        let path = dir.join(which.pin_name());
        let data = MapData::from_pin(&path).map_err(|source| OpenError::Open {
            path: path.clone(),
            source,
        })?;
        check_pinned(&path, &data)?;
        EntryMap::try_from(Map::HashMap(data)).map_err(|source| OpenError::Open { path, source })
    };
    Ok(Maps {
        by_cgroup: pin(Which::Cgroup)?,
        by_mntns: pin(Which::Mntns)?,
    })
}

fn prepare_dir(dir: &Path) -> Result<(), OpenError> {
    let refuse = |why: String| OpenError::Dir {
        dir: dir.to_owned(),
        why,
    };
    let parent = dir
        .parent()
        .ok_or_else(|| refuse("it has no parent directory".into()))?;
    // Whatever is in the way and not root's own directory (on a bpffs
    // root that is 1777, anyone can make it first, at every boot) is moved
    // aside, not used and not deleted; a few times at most, if it comes
    // back while this runs.
    let mut attempts = 0;
    let meta = loop {
        // Nothing is made outside a BPF file system (a mount of one at
        // `dir` itself is fine).
        if std::fs::symlink_metadata(dir).is_err() {
            check_bpffs(parent)?;
        }
        match std::fs::DirBuilder::new().mode(0o700).create(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(source) => {
                return Err(OpenError::Io {
                    what: "cannot create",
                    path: dir.to_owned(),
                    source,
                });
            }
        }
        let meta = std::fs::symlink_metadata(dir).map_err(|source| OpenError::Io {
            what: "cannot stat",
            path: dir.to_owned(),
            source,
        })?;
        let wrong = if meta.file_type().is_symlink() {
            "a symbolic link"
        } else if !meta.is_dir() {
            "not a directory"
        } else if meta.uid() != 0 {
            "not root's"
        } else {
            break meta;
        };
        attempts += 1;
        if attempts > 3 {
            return Err(refuse(format!(
                "it is {wrong} (uid {}), and came back each time it was moved aside",
                meta.uid()
            )));
        }
        check_bpffs(parent)?;
        move_aside(dir, &meta, wrong)?;
    };
    check_bpffs(dir)?;
    if meta.mode() & 0o077 != 0 {
        tracing::info!(
            dir = %dir.display(),
            mode = format!("{:o}", meta.mode() & 0o7777),
            "pin directory narrowed to mode 0700"
        );
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(
            |source| OpenError::Io {
                what: "cannot chmod",
                path: dir.to_owned(),
                source,
            },
        )?;
    }
    Ok(())
}

/// Renames what is at `dir` (never following it) to a new name beside it,
/// `<name>-refused-uid<uid>-<ns>`, and says so.
fn move_aside(dir: &Path, meta: &std::fs::Metadata, wrong: &str) -> Result<(), OpenError> {
    use nix::fcntl::{AT_FDCWD, RenameFlags, renameat2};
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut aside = dir.as_os_str().to_owned();
    // (No dot: bpffs refuses names with one.)
    aside.push(format!("-refused-uid{}-{nanos}", meta.uid()));
    let aside = PathBuf::from(aside);
    renameat2(
        AT_FDCWD,
        dir,
        AT_FDCWD,
        &aside,
        RenameFlags::RENAME_NOREPLACE,
    )
    .map_err(|e| OpenError::Dir {
        dir: dir.to_owned(),
        why: format!(
            "it is {wrong} (uid {}), and cannot be moved aside: {e}",
            meta.uid()
        ),
    })?;
    tracing::warn!(
        dir = %dir.display(),
        aside = %aside.display(),
        uid = meta.uid(),
        "the pin directory was {wrong}: whoever owns it could replace the maps tracers read; \
         moved aside, and the agent's own made"
    );
    Ok(())
}

/// Whether `path` is on a BPF file system.
pub(crate) fn is_bpffs(path: &Path) -> io::Result<bool> {
    let fs = nix::sys::statfs::statfs(path).map_err(io::Error::from)?;
    Ok(fs.filesystem_type().0 as i64 == BPF_FS_MAGIC)
}

fn check_bpffs(path: &Path) -> Result<(), OpenError> {
    match is_bpffs(path) {
        Ok(true) => Ok(()),
        Ok(false) => Err(OpenError::NotBpffs {
            dir: path.to_owned(),
        }),
        Err(source) => Err(OpenError::Io {
            what: "cannot statfs",
            path: path.to_owned(),
            source,
        }),
    }
}

/// Whether `e` is bpf(2) refused: `EPERM` or `EACCES`.
fn denied(e: &MapError) -> bool {
    let io = match e {
        MapError::SyscallError(s) => &s.io_error,
        MapError::CreateError { io_error, .. } => io_error,
        _ => return false,
    };
    matches!(io.raw_os_error(), Some(libc::EPERM | libc::EACCES))
}

/// A pinned object is one of our maps only if its shape is ours.
fn check_pinned(path: &Path, data: &MapData) -> Result<aya::maps::MapInfo, OpenError> {
    let info = data.info().map_err(|source| OpenError::Open {
        path: path.to_owned(),
        source,
    })?;
    let incompatible = |what: String| OpenError::Incompatible {
        path: path.to_owned(),
        what,
    };
    if !matches!(info.map_type(), Ok(MapType::Hash)) {
        return Err(incompatible(format!("map type {:?}", info.map_type())));
    }
    if info.key_size() != 8 || info.value_size() as usize != ContainerEntry::SIZE {
        return Err(incompatible(format!(
            "key size {} and value size {} (this agent's are 8 and {})",
            info.key_size(),
            info.value_size(),
            ContainerEntry::SIZE
        )));
    }
    Ok(info)
}

fn open_map(
    dir: &Path,
    which: Which,
    max_entries: u32,
    opened: &mut Opened,
) -> Result<EntryMap, OpenError> {
    let path = dir.join(which.pin_name());
    // Two attempts: another agent (a surge's) may pin between our look
    // and our pin; then its map is the one.
    for _ in 0..2 {
        // Root's pin, not a link to some other object: the directory was
        // perhaps wider before it was narrowed.
        if let Ok(m) = std::fs::symlink_metadata(&path)
            && (m.file_type().is_symlink() || m.uid() != 0)
        {
            return Err(OpenError::Incompatible {
                path,
                what: format!("a symbolic link, or not root's (uid {})", m.uid()),
            });
        }
        match MapData::from_pin(&path) {
            Ok(data) => {
                let info = check_pinned(&path, &data)?;
                opened.reused.push(which.pin_name());
                if info.max_entries() != max_entries {
                    opened.kept_size = Some(info.max_entries());
                }
                return EntryMap::try_from(Map::HashMap(data))
                    .map_err(|source| OpenError::Open { path, source });
            }
            Err(MapError::SyscallError(e)) if e.io_error.kind() == io::ErrorKind::NotFound => {}
            Err(source) if denied(&source) => return Err(OpenError::Denied { path, source }),
            Err(source) => return Err(OpenError::Open { path, source }),
        }
        let def = aya_obj::Map::new_from_params(
            BPF_MAP_TYPE_HASH,
            8,
            ContainerEntry::SIZE as u32,
            max_entries,
            CONTAINER_MAPS_FLAGS,
        );
        let data = MapData::create(def, which.kernel_name(), None).map_err(|source| {
            if denied(&source) {
                OpenError::Denied {
                    path: path.clone(),
                    source,
                }
            } else {
                OpenError::Create {
                    name: which.pin_name(),
                    source,
                }
            }
        })?;
        match data.pin(&path) {
            Ok(()) => {
                return EntryMap::try_from(Map::HashMap(data))
                    .map_err(|source| OpenError::Open { path, source });
            }
            Err(aya::pin::PinError::SyscallError(e))
                if e.io_error.kind() == io::ErrorKind::AlreadyExists => {}
            Err(source) => return Err(OpenError::Pin { path, source }),
        }
    }
    Err(OpenError::Dir {
        dir: dir.to_owned(),
        why: format!(
            "{} appeared and went again twice while it was being pinned",
            which.pin_name()
        ),
    })
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MapLabels {
    map: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FailureLabels {
    map: &'static str,
    reason: &'static str,
}

/// The pinned maps' metrics.
#[derive(Clone)]
pub(crate) struct PinMetrics {
    entries: Family<MapLabels, Gauge>,
    writes: Family<MapLabels, Counter>,
    failures: Family<FailureLabels, Counter>,
    stale: Family<MapLabels, Counter>,
}

impl PinMetrics {
    /// Registers the metrics in `r`.
    pub(crate) fn register(r: &mut Registry) -> PinMetrics {
        use crate::metrics::register;
        PinMetrics {
            entries: register(
                r,
                "pinned_map_entries",
                "Entries this agent wrote and holds in each pinned container map",
                Family::default(),
            ),
            writes: register(
                r,
                "pinned_map_writes",
                "Container entries written (a new container, or a new key or entry of one)",
                Family::default(),
            ),
            failures: register(
                r,
                "pinned_map_write_failures",
                "Container entries not written, by map and reason (full: the map is at \
                 max_entries; conflict: the key belongs to another live container; error)",
                Family::default(),
            ),
            stale: register(
                r,
                "pinned_map_stale_removed",
                "Entries of gone containers removed by the sweep (left by an earlier agent)",
                Family::default(),
            ),
        }
    }

    fn set_entries(&self, which: Which, n: usize) {
        self.entries
            .get_or_create(&MapLabels {
                map: which.pin_name(),
            })
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    fn written(&self, which: Which) {
        self.writes
            .get_or_create(&MapLabels {
                map: which.pin_name(),
            })
            .inc();
    }

    fn failed(&self, which: Which, reason: &'static str) {
        self.failures
            .get_or_create(&FailureLabels {
                map: which.pin_name(),
                reason,
            })
            .inc();
    }

    fn stale_removed(&self, which: Which) {
        self.stale
            .get_or_create(&MapLabels {
                map: which.pin_name(),
            })
            .inc();
    }
}
