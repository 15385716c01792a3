//! `stablefs`: mounts a host directory read-only through FUSE, serving
//! inode numbers from `lookout-inode-map`. The proof that the numbers stay
//! put across remounts (and what happens without a snapshot).
//!
//! ```sh
//! sudo cargo run -p lookout-inode-map --example stablefs -- \
//!     --mode xino --snapshot /var/lib/stablefs.snap /var/log /mnt/logs
//! # ... `umount /mnt/logs` ends it (and saves the snapshot)
//! ```
//!
//! Modes: `passthrough`, `xino`, `allocated`, `hashed`. `--snapshot FILE`
//! is read at start (if it exists) and written at unmount.
//!
//! N.B. FUSE presents one `st_dev` for the whole mount, so what tells
//! devices apart is the inode number alone: Xino, Allocated and Hashed are
//! unique across host devices; Passthrough is not (two host files with the
//! same number on two devices would share a node id: the second gets EIO,
//! logged).
//!
//! Directory listings cost one `getdents` per batch and no `stat` per
//! entry (in Passthrough and Xino, the entry's number comes from `d_ino`;
//! mount points, whose `d_ino` is the covered directory's, are the
//! exception and are stat'ed).

use std::collections::{HashMap, HashSet};
use std::ffi::{CString, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner,
    MountOption, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEntry, ReplyOpen, Request,
};
use lookout_inode_map::{
    ConflictPolicy, FileKey, InodeMap, Limits, Mode, Overflow, Snapshot, Stamp, probe_device,
};

const TTL: Duration = Duration::from_secs(1);

struct Listing {
    entries: Vec<(u64, FileType, std::ffi::OsString)>,
}

struct State {
    map: InodeMap,
    /// Node id (the presented number) -> path relative to the root.
    nodes: HashMap<u64, PathBuf>,
    devs: HashSet<u64>,
    open_files: HashMap<u64, std::fs::File>,
    listings: HashMap<u64, Listing>,
    next_fh: u64,
}

struct StableFs {
    root: PathBuf,
    /// Host mount points under the root (their `d_ino` is not their inode).
    mountpoints: HashSet<PathBuf>,
    snapshot: Option<PathBuf>,
    state: Mutex<State>,
}

fn file_handle(path: &Path) -> Option<Vec<u8>> {
    const MAX_HANDLE_SZ: usize = 128;
    let c = CString::new(path.as_os_str().as_bytes()).ok()?;
    // struct file_handle { u32 handle_bytes; i32 handle_type; u8 f_handle[]; }
    let mut buf = vec![0u8; 8 + MAX_HANDLE_SZ];
    buf[..4].copy_from_slice(&(MAX_HANDLE_SZ as u32).to_ne_bytes());
    let mut mount_id: libc::c_int = 0;
    // SAFETY: `buf` is a file_handle with room for MAX_HANDLE_SZ bytes;
    // `c` is NUL-terminated; mount_id is a valid out-pointer.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_name_to_handle_at,
            libc::AT_FDCWD,
            c.as_ptr(),
            buf.as_mut_ptr(),
            &mut mount_id,
            // No AT_SYMLINK_FOLLOW: a symlink's own handle.
            0,
        )
    };
    if rc != 0 {
        return None;
    }
    let n = u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    buf.truncate(8 + n.min(MAX_HANDLE_SZ));
    Some(buf)
}

fn kind(ft: std::fs::FileType) -> FileType {
    FileType::from_std(ft).unwrap_or(FileType::RegularFile)
}

fn stamp(m: &std::fs::Metadata) -> Stamp {
    let t = m
        .created()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or((m.ctime(), m.ctime_nsec() as u32), |d| {
            (d.as_secs() as i64, d.subsec_nanos())
        });
    Stamp::new(t.0, t.1, m.mode())
}

fn attr(m: &std::fs::Metadata, ino: u64) -> FileAttr {
    let t = |s: i64, ns: i64| UNIX_EPOCH + Duration::new(s.max(0) as u64, ns as u32);
    FileAttr {
        ino: INodeNo(ino),
        size: m.size(),
        blocks: m.blocks(),
        atime: t(m.atime(), m.atime_nsec()),
        mtime: t(m.mtime(), m.mtime_nsec()),
        ctime: t(m.ctime(), m.ctime_nsec()),
        crtime: m.created().unwrap_or(SystemTime::UNIX_EPOCH),
        kind: kind(m.file_type()),
        perm: (m.mode() & 0o7777) as u16,
        nlink: m.nlink() as u32,
        uid: m.uid(),
        gid: m.gid(),
        rdev: m.rdev() as u32,
        flags: 0,
        blksize: m.blksize() as u32,
    }
}

impl StableFs {
    fn host(&self, rel: &Path) -> PathBuf {
        self.root.join(rel)
    }

    fn rel(&self, st: &State, node: INodeNo) -> Option<PathBuf> {
        if node == INodeNo::ROOT {
            return Some(PathBuf::new());
        }
        st.nodes.get(&u64::from(node)).cloned()
    }

    fn ensure_dev(&self, st: &mut State, dev: u64, path: &Path) -> Result<(), Errno> {
        if st.devs.contains(&dev) {
            return Ok(());
        }
        let (_, identity) = probe_device(path).map_err(|_| Errno::EIO)?;
        st.map.register_device(dev, identity).map_err(|e| {
            eprintln!("stablefs: {e}");
            Errno::EIO
        })?;
        st.devs.insert(dev);
        Ok(())
    }

    /// The presented number of a host file we have its metadata of.
    fn number(&self, st: &mut State, path: &Path, m: &std::fs::Metadata) -> Result<u64, Errno> {
        self.mapped(st, path, m).map(|x| x.ino)
    }

    fn mapped(
        &self,
        st: &mut State,
        path: &Path,
        m: &std::fs::Metadata,
    ) -> Result<lookout_inode_map::Mapped, Errno> {
        self.ensure_dev(st, m.dev(), path)?;
        let handle = match st.map.mode() {
            Mode::Hashed => file_handle(path),
            _ => None,
        };
        st.map
            .map(
                FileKey {
                    dev: m.dev(),
                    ino: m.ino(),
                },
                stamp(m),
                handle.as_deref(),
            )
            .map_err(|e| {
                eprintln!("stablefs: {}: {e}", path.display());
                Errno::EIO
            })
    }

    fn bind(&self, st: &mut State, n: u64, rel: &Path) -> Result<(), Errno> {
        match st.nodes.get(&n) {
            Some(p) if p != rel => {
                eprintln!(
                    "stablefs: {} and {} both map to {n}: passthrough cannot tell devices apart under one st_dev",
                    p.display(),
                    rel.display()
                );
                Err(Errno::EIO)
            }
            Some(_) => Ok(()),
            None if n == 1 => {
                eprintln!("stablefs: {} maps to 1, the FUSE root's id", rel.display());
                Err(Errno::EIO)
            }
            None => {
                st.nodes.insert(n, rel.to_path_buf());
                Ok(())
            }
        }
    }
}

impl Filesystem for StableFs {
    fn destroy(&mut self) {
        let Some(path) = &self.snapshot else { return };
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let tmp = path.with_extension("tmp");
        let saved = std::fs::File::create(&tmp)
            .map_err(|e| e.to_string())
            .and_then(|f| {
                let mut w = std::io::BufWriter::new(f);
                st.map.snapshot().save(&mut w).map_err(|e| e.to_string())?;
                std::io::Write::flush(&mut w).map_err(|e| e.to_string())
            })
            .and_then(|()| std::fs::rename(&tmp, path).map_err(|e| e.to_string()));
        if let Err(e) = saved {
            eprintln!("stablefs: saving the snapshot {}: {e}", path.display());
        }
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(prel) = self.rel(&st, parent) else {
            return reply.error(Errno::ENOENT);
        };
        let rel = prel.join(name);
        let path = self.host(&rel);
        let m = match std::fs::symlink_metadata(&path) {
            Ok(m) => m,
            Err(_) => return reply.error(Errno::ENOENT),
        };
        let result = self
            .number(&mut st, &path, &m)
            .and_then(|n| self.bind(&mut st, n, &rel).map(|()| n));
        match result {
            Ok(n) => reply.entry(&TTL, &attr(&m, n), Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(rel) = self.rel(&st, ino) else {
            return reply.error(Errno::ENOENT);
        };
        let path = self.host(&rel);
        match std::fs::symlink_metadata(&path) {
            Ok(m) => match self.number(&mut st, &path, &m) {
                Ok(n) => reply.attr(&TTL, &attr(&m, n)),
                Err(e) => reply.error(e),
            },
            Err(_) => reply.error(Errno::ENOENT),
        }
    }

    /// FUSE shows one `st_dev` per mount (the kernel's anonymous device,
    /// which changes between mounts); the device the map gives a file is
    /// readable as the `trusted.stablefs.dev` attribute.
    fn getxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        size: u32,
        reply: fuser::ReplyXattr,
    ) {
        if name != "trusted.stablefs.dev" {
            return reply.error(Errno::ENODATA);
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(rel) = self.rel(&st, ino) else {
            return reply.error(Errno::ENOENT);
        };
        let path = self.host(&rel);
        let Ok(m) = std::fs::symlink_metadata(&path) else {
            return reply.error(Errno::ENOENT);
        };
        match self.mapped(&mut st, &path, &m) {
            Ok(x) => {
                let v = x.dev.to_string();
                if size == 0 {
                    reply.size(v.len() as u32);
                } else if (size as usize) < v.len() {
                    reply.error(Errno::ERANGE);
                } else {
                    reply.data(v.as_bytes());
                }
            }
            Err(e) => reply.error(e),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match self
            .rel(&st, ino)
            .map(|r| std::fs::read_link(self.host(&r)))
        {
            Some(Ok(t)) => reply.data(t.as_os_str().as_bytes()),
            _ => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(rel) = self.rel(&st, ino) else {
            return reply.error(Errno::ENOENT);
        };
        match std::fs::File::open(self.host(&rel)) {
            Ok(f) => {
                st.next_fh += 1;
                let fh = st.next_fh;
                st.open_files.insert(fh, f);
                reply.opened(FileHandle(fh), FopenFlags::empty());
            }
            Err(_) => reply.error(Errno::EACCES),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(f) = st.open_files.get(&u64::from(fh)) else {
            return reply.error(Errno::EBADF);
        };
        let mut buf = vec![0u8; size as usize];
        match f.read_at(&mut buf, offset) {
            Ok(n) => reply.data(&buf[..n]),
            Err(_) => reply.error(Errno::EIO),
        }
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: fuser::ReplyEmpty,
    ) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.open_files.remove(&u64::from(fh));
        reply.ok();
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(rel) = self.rel(&st, ino) else {
            return reply.error(Errno::ENOENT);
        };
        let dir = self.host(&rel);
        let Ok(dm) = std::fs::metadata(&dir) else {
            return reply.error(Errno::ENOENT);
        };
        let own = match self.number(&mut st, &dir, &dm) {
            Ok(n) => n,
            Err(e) => return reply.error(e),
        };
        let parent = match rel.parent() {
            Some(p) => {
                let pp = self.host(p);
                match std::fs::metadata(&pp) {
                    Ok(pm) => self.number(&mut st, &pp, &pm).unwrap_or(own),
                    Err(_) => own,
                }
            }
            None => own,
        };
        let mut entries = vec![
            (own, FileType::Directory, OsStr::new(".").to_os_string()),
            (parent, FileType::Directory, OsStr::new("..").to_os_string()),
        ];
        let Ok(rd) = std::fs::read_dir(&dir) else {
            return reply.error(Errno::EACCES);
        };
        let mode = st.map.mode();
        for e in rd.flatten() {
            // d_ino and d_type from getdents: no stat per entry...
            let name = e.file_name();
            let ft = e.file_type().map(kind).unwrap_or(FileType::RegularFile);
            let hashed = matches!(mode, Mode::Hashed);
            let stat_it = hashed
                || (ft == FileType::Directory
                    && !self.mountpoints.is_empty()
                    && self.mountpoints.contains(&dir.join(&name)));
            let n = if stat_it {
                let path = dir.join(&name);
                // ... except for mount points (d_ino is the covered
                // directory's) and Hashed (a handle per new file).
                match std::fs::symlink_metadata(&path) {
                    Ok(m) => self.number(&mut st, &path, &m),
                    Err(_) => continue,
                }
            } else {
                let key = FileKey {
                    dev: dm.dev(),
                    ino: std::os::unix::fs::DirEntryExt::ino(&e),
                };
                st.map
                    .map(key, Stamp::UNKNOWN, None)
                    .map(|x| x.ino)
                    .map_err(|_| Errno::EIO)
            };
            if let Ok(n) = n {
                entries.push((n, ft, name));
            }
        }
        st.next_fh += 1;
        let fh = st.next_fh;
        st.listings.insert(fh, Listing { entries });
        reply.opened(FileHandle(fh), FopenFlags::empty());
    }

    fn readdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(l) = st.listings.get(&u64::from(fh)) else {
            return reply.error(Errno::EBADF);
        };
        for (i, (n, ft, name)) in l.entries.iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(*n), (i + 1) as u64, *ft, name) {
                break;
            }
        }
        reply.ok();
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: fuser::ReplyEmpty,
    ) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.listings.remove(&u64::from(fh));
        reply.ok();
    }
}

fn mountpoints_under(root: &Path) -> HashSet<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(p.replace("\\040", " ")))
        .filter(|p| p.starts_with(root) && p != root)
        .collect()
}

fn usage() -> ! {
    eprintln!(
        "usage: stablefs [--mode passthrough|xino|allocated|hashed] [--snapshot FILE] SOURCE MOUNTPOINT"
    );
    std::process::exit(2)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut mode = Mode::Xino {
        bits: 8,
        overflow: Overflow::Fallback,
    };
    let mut snapshot = None;
    let mut pos = Vec::new();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--mode" => {
                mode = match args.next().as_deref() {
                    Some("passthrough") => Mode::Passthrough,
                    Some("xino") => Mode::Xino {
                        bits: 8,
                        overflow: Overflow::Fallback,
                    },
                    Some("allocated") => Mode::Allocated,
                    Some("hashed") => Mode::Hashed,
                    _ => usage(),
                }
            }
            "--snapshot" => snapshot = Some(PathBuf::from(args.next().unwrap_or_else(|| usage()))),
            _ => pos.push(PathBuf::from(a)),
        }
    }
    let [source, mountpoint] = pos.as_slice() else {
        usage()
    };
    let root = match source.canonicalize() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("stablefs: {}: {e}", source.display());
            std::process::exit(1)
        }
    };
    let mut map = InodeMap::new(mode, Limits::default());
    if let Some(path) = &snapshot
        && path.exists()
    {
        let loaded = std::fs::File::open(path)
            .map_err(|e| e.to_string())
            .and_then(|f| Snapshot::load(std::io::BufReader::new(f)).map_err(|e| e.to_string()))
            .and_then(|s| {
                map.restore(&s, ConflictPolicy::Fail)
                    .map_err(|e| e.to_string())
            });
        match loaded {
            Ok(r) => eprintln!(
                "stablefs: restored {} entries from {}",
                r.restored,
                path.display()
            ),
            Err(e) => {
                eprintln!("stablefs: {}: {e}", path.display());
                std::process::exit(1)
            }
        }
    }
    let fs = StableFs {
        mountpoints: mountpoints_under(&root),
        root,
        snapshot,
        state: Mutex::new(State {
            map,
            nodes: HashMap::new(),
            devs: HashSet::new(),
            open_files: HashMap::new(),
            listings: HashMap::new(),
            next_fh: 0,
        }),
    };
    let mut cfg = fuser::Config::default();
    cfg.mount_options = vec![
        MountOption::RO,
        MountOption::FSName("stablefs".into()),
        MountOption::Subtype("stablefs".into()),
    ];
    eprintln!("stablefs: serving {:?}", mode);
    if let Err(e) = fuser::mount(fs, mountpoint, &cfg) {
        eprintln!("stablefs: mounting {}: {e}", mountpoint.display());
        std::process::exit(1)
    }
}
