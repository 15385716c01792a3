//! `bpf:pinned-maps`: whether the agent can pin its container maps (the
//! `--bpf-pin-dir` of `lookout run`) here. Nothing is created or pinned.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use lookout_ebpf_common::{CONTAINERS_BY_CGROUP_MAP, CONTAINERS_BY_MNTNS_MAP};

use crate::report::Fail;

/// `statfs(2)`'s `f_type` of the BPF file system.
const BPF_FS_MAGIC: libc::c_long = 0xcafe_4a11;

/// Checks `dir`: on a BPF file system (the directory, or its parent when
/// it does not exist yet), root's if it exists, and a BPF map can be
/// created (one hash map of one entry, closed at once).
pub(crate) fn check(dir: &Path) -> Result<String, Fail> {
    let meta = match std::fs::symlink_metadata(dir) {
        Ok(m) => Some(m),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(Fail::error(format!("stat {}: {e}", dir.display()))),
    };
    let on = match &meta {
        Some(_) => dir,
        None => dir.parent().unwrap_or(dir),
    };
    let magic = crate::system::statfs_magic(on)
        .map_err(|e| Fail::unsupported(format!("statfs {}: {e}", on.display())))?;
    if magic != BPF_FS_MAGIC {
        return Err(Fail::unsupported(format!(
            "{} is not on a BPF file system (mount one: `mount -t bpf bpf /sys/fs/bpf`; in a \
             pod, mount the host's /sys/fs/bpf): no pinned container maps",
            on.display()
        )));
    }
    if let Some(m) = &meta {
        if m.file_type().is_symlink() || !m.is_dir() {
            return Err(Fail::unsupported(format!(
                "{} is not a directory: no pinned container maps",
                dir.display()
            )));
        }
        if m.uid() != 0 {
            return Err(Fail::unsupported(format!(
                "{} belongs to uid {}, not root: the agent refuses it (no pinned container maps)",
                dir.display(),
                m.uid()
            )));
        }
    }
    aya::maps::HashMap::<aya::maps::MapData, u64, u64>::create(1, 0).map_err(|e| {
        Fail::unsupported(format!(
            "cannot create a BPF map: {} (needs CAP_BPF, or CAP_SYS_ADMIN before Linux 5.8): no \
             pinned container maps",
            crate::chain(&e)
        ))
    })?;
    let pinned: Vec<&str> = [CONTAINERS_BY_CGROUP_MAP, CONTAINERS_BY_MNTNS_MAP]
        .into_iter()
        .filter(|name| meta.is_some() && dir.join(name).exists())
        .collect();
    Ok(if pinned.is_empty() {
        format!("{} on bpffs (nothing pinned yet)", dir.display())
    } else {
        format!("{} on bpffs (pinned: {})", dir.display(), pinned.join(", "))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_outside_bpffs_is_unsupported_and_says_why() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = check(&dir.path().join("lookout")).expect_err("tmp is not bpffs");
        assert_eq!(f.status, crate::Status::Unsupported);
        assert!(
            f.reason.contains("is not on a BPF file system"),
            "{}",
            f.reason
        );
    }
}
