//! What a sandbox's file server (a gVisor-style gofer, a FUSE server)
//! answers for `st_ino` with each mode, across a restart and across a
//! checkpoint/restore.
//!
//! gVisor numbers host files in the order they are first touched, so a
//! restarted sandbox that meets them in another order shows other numbers
//! (`tests/gvisor.rs` shows a real runsc doing so). Here, two runs of a
//! server meet the same host files in two orders; a third run restores the
//! first run's snapshot (what a checkpoint/restore carries) before meeting
//! them. No root needed:
//!
//! ```sh
//! cargo run -p lookout-inode-map --example sandbox_modes
//! ```

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use lookout_inode_map::{
    ConflictPolicy, FileKey, InodeMap, Limits, Mode, Overflow, Snapshot, Stamp, file_handle_at,
    probe_device,
};

/// One run of the server: a fresh map (or one restored from `restore`)
/// meets the files of `dir` in `order`. Returns each file's `st_ino` and the
/// map's snapshot.
fn serve(
    mode: Mode,
    dir: &Path,
    order: &[String],
    restore: Option<&Snapshot>,
) -> Result<(BTreeMap<String, u64>, Snapshot), Box<dyn std::error::Error>> {
    let mut map = InodeMap::new(mode, Limits::default());
    // The device by identity (UUID, fsid, ...), not by its st_dev number.
    let (dev, identity) = probe_device(dir)?;
    map.register_device(dev, identity)?;
    if let Some(s) = restore {
        map.restore(s, ConflictPolicy::Fail)?;
    }
    let parent = std::fs::File::open(dir)?;
    let mut numbers = BTreeMap::new();
    for name in order {
        let meta = std::fs::symlink_metadata(dir.join(name))?;
        let key = FileKey {
            dev: meta.dev(),
            ino: meta.ino(),
        };
        // Only Hashed needs the file handle.
        let handle = match mode {
            Mode::Hashed => file_handle_at(parent.as_fd(), &CString::new(name.as_bytes())?),
            _ => None,
        };
        let stamp = Stamp::new(meta.ctime(), meta.ctime_nsec() as u32, meta.mode());
        numbers.insert(name.clone(), map.map(key, stamp, handle.as_deref())?.ino);
    }
    Ok((numbers, map.snapshot()))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let names: Vec<String> = (1..=6).map(|i| format!("f{i}")).collect();
    for n in &names {
        std::fs::write(dir.path().join(n), n)?;
    }
    let mut other_order = names.clone();
    other_order.reverse();

    println!("| mode | same numbers after a restart | same after a checkpoint/restore |");
    println!("|---|---|---|");
    for mode in [
        Mode::Passthrough,
        Mode::Xino {
            bits: 8,
            overflow: Overflow::Fallback,
        },
        Mode::Allocated,
        Mode::Hashed,
    ] {
        let (one, saved) = serve(mode, dir.path(), &names, None)?;
        let (restart, _) = serve(mode, dir.path(), &other_order, None)?;
        let (restored, _) = serve(mode, dir.path(), &other_order, Some(&saved))?;
        let word = |same: bool| if same { "yes" } else { "no" };
        println!(
            "| {mode:?} | {} | {} |",
            word(one == restart),
            word(one == restored)
        );
        // What each mode guarantees (the crate docs' table).
        assert_eq!(one, restored, "{mode:?}: a snapshot carries every number");
        if mode == Mode::Allocated {
            assert_ne!(one, restart, "Allocated numbers by first sight, as gVisor");
        } else {
            assert_eq!(one, restart, "{mode:?}: numbers from the host file itself");
        }
    }
    Ok(())
}
