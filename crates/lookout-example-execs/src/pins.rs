//! lookout's pinned maps, checked before loading and watched after.
//!
//! N.B. aya's loader, given `map_pin_path`, opens the pin if there is one
//! and otherwise *creates* a map from the object's declaration and pins it
//! at that path, without a word. At lookout's path, that map would be
//! nobody's: the agent would never fill it, or would find a stranger's pin
//! where its own belongs. So the example loads only after [`check`] found
//! both of lookout's pins, and [`same_map`] then makes sure the loader
//! took the very map that was checked.

use std::path::Path;

use anyhow::{Context, bail};
use aya::maps::{MapData, MapInfo, MapType};
use lookout_ebpf_common::{
    CONTAINERS_BY_CGROUP_KERNEL_NAME, CONTAINERS_BY_CGROUP_MAP, CONTAINERS_BY_MNTNS_MAP,
    ContainerEntry,
};

/// What [`check`] found: the id of the map pinned as
/// `containers_by_cgroup` when it was checked.
#[derive(Debug)]
pub struct Checked {
    cgroup_map_id: u32,
}

/// Checks that `dir` holds both of lookout's pins (`containers_by_cgroup`
/// and `containers_by_mntns`), each a `BPF_MAP_TYPE_HASH` from 8-byte keys
/// to [`ContainerEntry::SIZE`]-byte values. Creates nothing.
pub fn check(dir: &Path) -> anyhow::Result<Checked> {
    let mut cgroup_map_id = 0;
    for name in [CONTAINERS_BY_CGROUP_MAP, CONTAINERS_BY_MNTNS_MAP] {
        let path = dir.join(name);
        let info = open(&path, dir)?;
        let map_type = info
            .map_type()
            .with_context(|| format!("{}: a map of a type aya does not know", path.display()))?;
        if !matches!(map_type, MapType::Hash) {
            bail!(
                "{} is a {map_type:?} map, not a hash map: not lookout's",
                path.display()
            );
        }
        if info.key_size() != 8 || info.value_size() as usize != ContainerEntry::SIZE {
            bail!(
                "{} has {}-byte keys and {}-byte values, lookout's have 8 and {}: a lookout of \
                 another layout, or not lookout's",
                path.display(),
                info.key_size(),
                info.value_size(),
                ContainerEntry::SIZE
            );
        }
        if name == CONTAINERS_BY_CGROUP_MAP {
            cgroup_map_id = info.id();
        }
    }
    Ok(Checked { cgroup_map_id })
}

/// The map pinned at `path` (in lookout's pin directory `dir`).
fn open(path: &Path, dir: &Path) -> anyhow::Result<MapInfo> {
    match path.try_exists() {
        Ok(true) => {}
        Ok(false) => bail!(
            "no pinned map at {}: is lookout running with --bpf-pin-dir {}?",
            path.display(),
            dir.display()
        ),
        Err(error) => {
            return Err(error).with_context(|| {
                format!(
                    "looking for the pinned map {} (lookout's pin directory is mode 0700: run \
                     as root)",
                    path.display()
                )
            });
        }
    }
    let map = MapData::from_pin(path)
        .with_context(|| format!("opening the pinned map {}", path.display()))?;
    map.info()
        .with_context(|| format!("reading the pinned map {}", path.display()))
}

/// Checks that the loader used the map [`check`] found at `path`, and not
/// one that replaced it meanwhile or that it created because the pin had
/// gone (lookout stopped or restarted between the check and the load). A
/// map the loader created is unpinned again, so that lookout's path stays
/// as it was.
pub fn same_map(path: &Path, checked: &Checked, loaded: &MapData) -> anyhow::Result<()> {
    let loaded = loaded
        .info()
        .context("reading the loaded containers_by_cgroup map")?;
    if loaded.id() == checked.cgroup_map_id {
        return Ok(());
    }
    // lookout names its map CONTAINERS_BY_CGROUP_KERNEL_NAME; aya names one
    // it creates after the declaration (cut to 15 bytes).
    let pinned_now = pinned_id(path);
    if pinned_now == Some(loaded.id())
        && loaded.name_as_str() != Some(CONTAINERS_BY_CGROUP_KERNEL_NAME)
    {
        std::fs::remove_file(path).with_context(|| {
            format!(
                "removing the map the loader pinned at {} (remove it by hand before lookout \
                 starts)",
                path.display()
            )
        })?;
    }
    bail!(
        "the map pinned at {} changed while the program was loading (lookout stopped or \
         restarted?): start again",
        path.display()
    )
}

/// Fails once `path` no longer pins the map [`check`] found: lookout
/// stopped (and removed its pins) or restarted with new maps, and this
/// program's copy is no longer kept up to date.
pub fn still_pinned(path: &Path, checked: &Checked) -> anyhow::Result<()> {
    match pinned_id(path) {
        Some(id) if id == checked.cgroup_map_id => Ok(()),
        Some(id) => bail!(
            "{} now pins another map (id {id}, was {}): lookout restarted; start again",
            path.display(),
            checked.cgroup_map_id
        ),
        None => bail!(
            "{} is gone: lookout stopped; start again once it runs",
            path.display()
        ),
    }
}

/// The id of the map pinned at `path`, if one is.
fn pinned_id(path: &Path) -> Option<u32> {
    let map = MapData::from_pin(path).ok()?;
    map.info().ok().map(|info| info.id())
}
