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
//! is read at start (if it exists) and written at unmount, both with
//! [`Snapshot::read_file`] and [`Snapshot::write_file`]: a symlink at that
//! path is never followed (at start it is an error; at unmount it is
//! replaced by the new file).
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
//!
//! # A tree someone else writes to
//!
//! The served tree may belong to a hostile user (a pod's volume on a shared
//! node), who can swap any name for a symlink at any moment, for example
//! between the kernel's `LOOKUP` of a file and its `OPEN`. So the server
//! never resolves a host path by name from `/`:
//!
//! - the root is held as an `O_PATH` fd, and each node as an `O_PATH` fd of
//!   its own file, opened relative to its parent's fd with `openat2(2)`,
//!   `O_NOFOLLOW` and `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
//!   RESOLVE_NO_MAGICLINKS` (a single component, never `..`);
//! - `getattr` (`statx(AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW)`), `readlink`
//!   (`readlinkat(fd, "")`) and listings work on those fds;
//! - `open` opens the node's name again in its parent's fd the same way,
//!   and checks that it is still the node's file: a name now holding a
//!   symlink or another file gets `ESTALE` (the kernel then looks the name
//!   up again, and resolves a symlink itself, in the client's namespace);
//! - symlinks are served as symlinks and never followed by the server.
//!
//! The kernel counts its references to each node (`LOOKUP` adds one,
//! `FORGET` takes some away); a node whose count reaches zero closes its
//! fds and is released in the map ([`InodeMap::release`]), which may then
//! evict it first. The root's `trusted.stablefs.nodes` attribute is the
//! number of live nodes (the root excluded).

use std::collections::{HashMap, HashSet};
use std::ffi::{CStr, CString, OsStr, OsString};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner,
    MountOption, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEntry, ReplyOpen, Request,
};
use lookout_inode_map::{
    ConflictPolicy, FileKey, InodeMap, Limits, Mapped, Mode, Overflow, Snapshot, Stamp,
    probe_device,
};
use nix::fcntl::{OFlag, OpenHow, ResolveFlag};

const TTL: Duration = Duration::from_secs(1);

/// The device the map gave a file (FUSE shows one `st_dev` per mount).
const DEV_XATTR: &str = "trusted.stablefs.dev";
/// On the root: the number of live nodes, the root excluded.
const NODES_XATTR: &str = "trusted.stablefs.nodes";

/// Opens `name`, one component, in the directory `dir` without following
/// any symlink and without leaving `dir`.
fn open_beneath(dir: BorrowedFd<'_>, name: &CStr, flags: OFlag) -> Result<OwnedFd, Errno> {
    let flags = flags | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let how = OpenHow::new().flags(flags).resolve(
        ResolveFlag::RESOLVE_BENEATH
            | ResolveFlag::RESOLVE_NO_SYMLINKS
            | ResolveFlag::RESOLVE_NO_MAGICLINKS,
    );
    match nix::fcntl::openat2(dir, name, how) {
        Ok(fd) => Ok(fd),
        // Kernels before 5.6: `name` is a single component other than
        // `..`, so O_NOFOLLOW alone keeps `openat` inside `dir`.
        Err(nix::errno::Errno::ENOSYS) => {
            nix::fcntl::openat(dir, name, flags, nix::sys::stat::Mode::empty())
                .map_err(|e| Errno::from_i32(e as i32))
        }
        Err(e) => Err(Errno::from_i32(e as i32)),
    }
}

/// A name the kernel asked for, as one path component (never `.`, `..`
/// or anything with a `/`).
fn component(name: &OsStr) -> Result<CString, Errno> {
    let b = name.as_bytes();
    if b.is_empty() || b == b"." || b == b".." || b.contains(&b'/') {
        return Err(Errno::EINVAL);
    }
    CString::new(b).map_err(|_| Errno::EINVAL)
}

/// `statx` of a host file, never following a symlink.
struct HostStat(libc::statx);

impl HostStat {
    /// `name` (one component) in the directory `dir`, or the file `dir`
    /// itself when `name` is empty.
    fn at(dir: BorrowedFd<'_>, name: &CStr) -> Result<HostStat, Errno> {
        let mut flags =
            libc::AT_SYMLINK_NOFOLLOW | libc::AT_NO_AUTOMOUNT | libc::AT_STATX_SYNC_AS_STAT;
        if name.is_empty() {
            flags |= libc::AT_EMPTY_PATH;
        }
        // SAFETY: an all-zero statx is a valid value for the kernel to fill.
        let mut stx: libc::statx = unsafe { std::mem::zeroed() };
        // SAFETY: `dir` is an open fd, `name` is NUL-terminated and `stx`
        // is a valid out-pointer.
        let rc = unsafe {
            libc::statx(
                dir.as_raw_fd(),
                name.as_ptr(),
                flags,
                libc::STATX_BASIC_STATS | libc::STATX_BTIME,
                &mut stx,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        Ok(HostStat(stx))
    }

    fn of(fd: BorrowedFd<'_>) -> Result<HostStat, Errno> {
        HostStat::at(fd, c"")
    }

    fn key(&self) -> FileKey {
        FileKey {
            dev: libc::makedev(self.0.stx_dev_major, self.0.stx_dev_minor),
            ino: self.0.stx_ino,
        }
    }

    fn mode(&self) -> u32 {
        u32::from(self.0.stx_mode)
    }

    fn kind(&self) -> FileType {
        kind_of(self.mode())
    }

    fn stamp(&self) -> Stamp {
        let t = if self.0.stx_mask & libc::STATX_BTIME != 0 {
            self.0.stx_btime
        } else {
            self.0.stx_ctime
        };
        Stamp::new(t.tv_sec, t.tv_nsec, self.mode())
    }

    fn attr(&self, ino: u64) -> FileAttr {
        let s = &self.0;
        let t = |t: libc::statx_timestamp| {
            UNIX_EPOCH + Duration::new(t.tv_sec.max(0) as u64, t.tv_nsec)
        };
        FileAttr {
            ino: INodeNo(ino),
            size: s.stx_size,
            blocks: s.stx_blocks,
            atime: t(s.stx_atime),
            mtime: t(s.stx_mtime),
            ctime: t(s.stx_ctime),
            crtime: if s.stx_mask & libc::STATX_BTIME != 0 {
                t(s.stx_btime)
            } else {
                UNIX_EPOCH
            },
            kind: self.kind(),
            perm: (self.mode() & 0o7777) as u16,
            nlink: s.stx_nlink,
            uid: s.stx_uid,
            gid: s.stx_gid,
            rdev: libc::makedev(s.stx_rdev_major, s.stx_rdev_minor) as u32,
            flags: 0,
            blksize: s.stx_blksize,
        }
    }
}

fn kind_of(mode: u32) -> FileType {
    match mode & libc::S_IFMT {
        libc::S_IFDIR => FileType::Directory,
        libc::S_IFLNK => FileType::Symlink,
        libc::S_IFIFO => FileType::NamedPipe,
        libc::S_IFSOCK => FileType::Socket,
        libc::S_IFCHR => FileType::CharDevice,
        libc::S_IFBLK => FileType::BlockDevice,
        _ => FileType::RegularFile,
    }
}

/// A host file the kernel holds a reference to.
struct Node {
    /// The host file (its identity when looked up).
    key: FileKey,
    /// The number presented (the node id, but for the root).
    number: u64,
    /// The device the map gave it.
    mapped_dev: u64,
    kind: FileType,
    /// `O_PATH` fd of the file itself, opened without following: stat,
    /// readlink and, for a directory, the base its children are opened in.
    fd: Arc<OwnedFd>,
    /// `O_PATH` fd of the directory it was looked up in, and its name
    /// there: what `open` opens again (the root: its own fd and `.`).
    parent: Arc<OwnedFd>,
    name: CString,
    /// The number presented for its parent (`..` in listings).
    parent_number: u64,
    /// Its path under the root when looked up: for spotting host mount
    /// points and for log lines, never opened.
    rel: PathBuf,
    /// The kernel's references (lookups not yet forgotten).
    lookups: u64,
}

struct Listing {
    entries: Vec<(u64, FileType, OsString)>,
}

struct State {
    map: InodeMap,
    /// Node id -> node; the root is `INodeNo::ROOT`, the others their
    /// presented number.
    nodes: HashMap<u64, Node>,
    devs: HashSet<u64>,
    open_files: HashMap<u64, std::fs::File>,
    listings: HashMap<u64, Listing>,
    next_fh: u64,
    /// Nodes dropped after the kernel forgot them.
    forgotten: u64,
}

struct StableFs {
    /// Host mount points under the root, relative to it (their `d_ino` is
    /// not their inode).
    mountpoints: HashSet<PathBuf>,
    snapshot: Option<PathBuf>,
    state: Mutex<State>,
}

/// Registers the device of `name` in `dir` (of `dir` itself when `name`
/// is empty), if new.
fn ensure_dev(st: &mut State, dev: u64, dir: BorrowedFd<'_>, name: &CStr) -> Result<(), Errno> {
    if st.devs.contains(&dev) {
        return Ok(());
    }
    let own;
    let fd = if name.is_empty() {
        dir
    } else {
        own = open_beneath(dir, name, OFlag::O_PATH)?;
        own.as_fd()
    };
    // The probe takes a path: our own fd's magic link names exactly the
    // file already opened (a symlink's fd names the symlink itself), with
    // nothing in the served tree resolved again.
    let proc = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
    let (_, identity) = probe_device(&proc).map_err(|e| {
        eprintln!("stablefs: probing device {dev:#x}: {}", chain(&e));
        Errno::EIO
    })?;
    st.map.register_device(dev, identity).map_err(|e| {
        eprintln!("stablefs: {}", chain(&e));
        Errno::EIO
    })?;
    st.devs.insert(dev);
    Ok(())
}

/// The mapping of `name` in `dir` (of `dir` itself when `name` is empty),
/// stat'ed as `s`; `what` names it in log lines.
fn map_file(
    st: &mut State,
    dir: BorrowedFd<'_>,
    name: &CStr,
    s: &HostStat,
    what: &Path,
) -> Result<Mapped, Errno> {
    let key = s.key();
    ensure_dev(st, key.dev, dir, name)?;
    let handle = match st.map.mode() {
        Mode::Hashed => lookout_inode_map::file_handle_at(dir, name),
        _ => None,
    };
    st.map.map(key, s.stamp(), handle.as_deref()).map_err(|e| {
        eprintln!("stablefs: {}: {}", what.display(), chain(&e));
        Errno::EIO
    })
}

impl StableFs {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Looks `name` up in the directory node `parent`: opens it beneath
    /// the parent's fd, maps it, and adds a reference to its node.
    fn lookup_in(&self, st: &mut State, parent: INodeNo, name: &OsStr) -> Result<FileAttr, Errno> {
        let cname = component(name)?;
        let p = st.nodes.get(&u64::from(parent)).ok_or(Errno::ENOENT)?;
        if p.kind != FileType::Directory {
            return Err(Errno::ENOTDIR);
        }
        let (pfd, parent_number, rel) = (p.fd.clone(), p.number, p.rel.join(name));
        // O_PATH | O_NOFOLLOW: a symlink is opened as itself.
        let fd = open_beneath(pfd.as_fd(), &cname, OFlag::O_PATH)?;
        let s = HostStat::of(fd.as_fd())?;
        let m = map_file(st, fd.as_fd(), c"", &s, &rel)?;
        let n = m.ino;
        let fd = Arc::new(fd);
        if n == u64::from(INodeNo::ROOT) {
            eprintln!("stablefs: {} maps to 1, the FUSE root's id", rel.display());
            return Err(Errno::EIO);
        }
        match st.nodes.get_mut(&n) {
            Some(node) if node.key != s.key() => {
                eprintln!(
                    "stablefs: {} and {} both map to {n}: passthrough cannot tell devices apart under one st_dev",
                    node.rel.display(),
                    rel.display()
                );
                return Err(Errno::EIO);
            }
            Some(node) => {
                // The same file, perhaps under another name now: open it
                // by the name just seen.
                node.fd = fd;
                node.parent = pfd;
                node.name = cname;
                node.parent_number = parent_number;
                node.rel = rel;
                node.kind = s.kind();
                node.mapped_dev = m.dev;
                node.lookups += 1;
            }
            None => {
                st.nodes.insert(
                    n,
                    Node {
                        key: s.key(),
                        number: n,
                        mapped_dev: m.dev,
                        kind: s.kind(),
                        fd,
                        parent: pfd,
                        name: cname,
                        parent_number,
                        rel,
                        lookups: 1,
                    },
                );
            }
        }
        Ok(s.attr(n))
    }

    /// Takes `n` references off node `ino`; at zero, the node goes.
    fn forget_node(st: &mut State, ino: INodeNo, n: u64) {
        if ino == INodeNo::ROOT {
            return;
        }
        let id = u64::from(ino);
        let Some(node) = st.nodes.get_mut(&id) else {
            return;
        };
        node.lookups = node.lookups.saturating_sub(n);
        if node.lookups == 0
            && let Some(node) = st.nodes.remove(&id)
        {
            // Its fds close here; the map may now evict its entry first.
            st.map.release(node.key);
            st.forgotten += 1;
        }
    }

    /// Lists the directory node `ino` with one `getdents` per batch.
    fn list(&self, st: &mut State, ino: INodeNo) -> Result<Listing, Errno> {
        let node = st.nodes.get(&u64::from(ino)).ok_or(Errno::ENOENT)?;
        if node.kind != FileType::Directory {
            return Err(Errno::ENOTDIR);
        }
        let (dfd, own, parent, rel, dev) = (
            node.fd.clone(),
            node.number,
            node.parent_number,
            node.rel.clone(),
            node.key.dev,
        );
        let readable = open_beneath(dfd.as_fd(), c".", OFlag::O_RDONLY | OFlag::O_DIRECTORY)?;
        let mut dir = nix::dir::Dir::from_fd(readable).map_err(|e| Errno::from_i32(e as i32))?;
        let mut entries = vec![
            (own, FileType::Directory, OsString::from(".")),
            (parent, FileType::Directory, OsString::from("..")),
        ];
        let hashed = matches!(st.map.mode(), Mode::Hashed);
        for e in dir.iter() {
            let Ok(e) = e else { break };
            let cname = e.file_name();
            if cname == c"." || cname == c".." {
                continue;
            }
            let name = OsString::from_vec(cname.to_bytes().to_vec());
            // d_ino and d_type from getdents: no stat per entry...
            let ft = e.file_type().map(|t| {
                use nix::dir::Type;
                match t {
                    Type::Directory => FileType::Directory,
                    Type::Symlink => FileType::Symlink,
                    Type::Fifo => FileType::NamedPipe,
                    Type::Socket => FileType::Socket,
                    Type::CharacterDevice => FileType::CharDevice,
                    Type::BlockDevice => FileType::BlockDevice,
                    Type::File => FileType::RegularFile,
                }
            });
            let stat_it = hashed
                || ft.is_none()
                || (ft == Some(FileType::Directory)
                    && !self.mountpoints.is_empty()
                    && self.mountpoints.contains(&rel.join(&name)));
            let (n, ft) = if stat_it {
                // ... except for Hashed (a handle per new file), mount
                // points (d_ino is the covered directory's) and file
                // systems without d_type. Relative to the directory's fd,
                // one component, not followed.
                let Ok(s) = HostStat::at(dfd.as_fd(), cname) else {
                    continue;
                };
                let Ok(m) = map_file(st, dfd.as_fd(), cname, &s, &rel.join(&name)) else {
                    continue;
                };
                (m.ino, s.kind())
            } else {
                let key = FileKey { dev, ino: e.ino() };
                let Ok(m) = st.map.map(key, Stamp::UNKNOWN, None) else {
                    continue;
                };
                (m.ino, ft.unwrap_or(FileType::RegularFile))
            };
            entries.push((n, ft, name));
        }
        Ok(Listing { entries })
    }

    /// Opens the regular file of node `ino` for reading, by its name in
    /// its parent's fd, checking it is still the node's file.
    fn open_file(&self, st: &State, ino: INodeNo) -> Result<std::fs::File, Errno> {
        let node = st.nodes.get(&u64::from(ino)).ok_or(Errno::ENOENT)?;
        if node.kind != FileType::RegularFile {
            return Err(Errno::EACCES);
        }
        // O_NONBLOCK: a FIFO swapped in cannot hold the open.
        let fd = open_beneath(
            node.parent.as_fd(),
            &node.name,
            OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_NOCTTY,
        )
        .map_err(|e| {
            if e.code() == libc::ELOOP {
                // The name now holds a symlink: not this node any more.
                Errno::ESTALE
            } else {
                e
            }
        })?;
        let s = HostStat::of(fd.as_fd())?;
        if s.key() != node.key || s.kind() != FileType::RegularFile {
            // Another file under the node's name: the kernel looks the
            // name up again on ESTALE.
            return Err(Errno::ESTALE);
        }
        Ok(std::fs::File::from(fd))
    }

    fn save_snapshot(&self) {
        let Some(path) = &self.snapshot else { return };
        let st = self.lock();
        if let Err(e) = st.map.snapshot().write_file(path) {
            eprintln!(
                "stablefs: saving the snapshot {}: {}",
                path.display(),
                chain(&e)
            );
        }
    }
}

impl Filesystem for StableFs {
    fn destroy(&mut self) {
        {
            let st = self.lock();
            eprintln!(
                "stablefs: {} nodes live, {} forgotten",
                st.nodes.len() - 1,
                st.forgotten
            );
        }
        self.save_snapshot();
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let mut st = self.lock();
        match self.lookup_in(&mut st, parent, name) {
            Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    // N.B. fuser 0.18 does not export `ForgetOne`, so `batch_forget`
    // cannot be overridden; its default calls this once per node.
    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        let mut st = self.lock();
        StableFs::forget_node(&mut st, ino, nlookup);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let st = self.lock();
        let Some(node) = st.nodes.get(&u64::from(ino)) else {
            return reply.error(Errno::ENOENT);
        };
        match HostStat::of(node.fd.as_fd()) {
            Ok(s) => reply.attr(&TTL, &s.attr(node.number)),
            Err(e) => reply.error(e),
        }
    }

    /// FUSE shows one `st_dev` per mount (the kernel's anonymous device,
    /// which changes between mounts); the device the map gives a file is
    /// readable as the `trusted.stablefs.dev` attribute. The root's
    /// `trusted.stablefs.nodes` is the number of live nodes.
    fn getxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        size: u32,
        reply: fuser::ReplyXattr,
    ) {
        let st = self.lock();
        let Some(node) = st.nodes.get(&u64::from(ino)) else {
            return reply.error(Errno::ENOENT);
        };
        let v = if name == DEV_XATTR {
            node.mapped_dev.to_string()
        } else if name == NODES_XATTR && ino == INodeNo::ROOT {
            (st.nodes.len() - 1).to_string()
        } else {
            return reply.error(Errno::ENODATA);
        };
        if size == 0 {
            reply.size(v.len() as u32);
        } else if (size as usize) < v.len() {
            reply.error(Errno::ERANGE);
        } else {
            reply.data(v.as_bytes());
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let st = self.lock();
        let Some(node) = st.nodes.get(&u64::from(ino)) else {
            return reply.error(Errno::ENOENT);
        };
        if node.kind != FileType::Symlink {
            return reply.error(Errno::EINVAL);
        }
        // The symlink's own fd: its target as written, not followed.
        match nix::fcntl::readlinkat(node.fd.as_fd(), c"") {
            Ok(t) => reply.data(t.as_bytes()),
            Err(e) => reply.error(Errno::from_i32(e as i32)),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let mut st = self.lock();
        match self.open_file(&st, ino) {
            Ok(f) => {
                st.next_fh += 1;
                let fh = st.next_fh;
                st.open_files.insert(fh, f);
                reply.opened(FileHandle(fh), FopenFlags::empty());
            }
            Err(e) => reply.error(e),
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
        let st = self.lock();
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
        let mut st = self.lock();
        st.open_files.remove(&u64::from(fh));
        reply.ok();
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let mut st = self.lock();
        match self.list(&mut st, ino) {
            Ok(l) => {
                st.next_fh += 1;
                let fh = st.next_fh;
                st.listings.insert(fh, l);
                reply.opened(FileHandle(fh), FopenFlags::empty());
            }
            Err(e) => reply.error(e),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let st = self.lock();
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
        let mut st = self.lock();
        st.listings.remove(&u64::from(fh));
        reply.ok();
    }
}

/// Host mount points strictly under `root`, relative to it.
fn mountpoints_under(root: &Path) -> HashSet<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(p.replace("\\040", " ")))
        .filter_map(|p| p.strip_prefix(root).ok().map(Path::to_path_buf))
        .filter(|p| !p.as_os_str().is_empty())
        .collect()
}

/// Each node holds an fd: as many as the hard limit allows.
fn raise_fd_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && soft < hard
        && let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard)
    {
        eprintln!("stablefs: raising RLIMIT_NOFILE to {hard}: {e}");
    }
}

fn usage() -> ! {
    eprintln!(
        "usage: stablefs [--mode passthrough|xino|allocated|hashed] [--snapshot FILE] SOURCE MOUNTPOINT"
    );
    std::process::exit(2)
}

fn os_error(e: Errno) -> std::io::Error {
    std::io::Error::from_raw_os_error(e.code())
}

fn fail(what: impl std::fmt::Display) -> ! {
    eprintln!("stablefs: {what}");
    std::process::exit(1)
}

/// The snapshot at `path`, `None` if there is none. A symlink, a FIFO, a
/// file too large or corrupt is an error: the caller stops rather than
/// renumber silently.
fn load_snapshot(path: &Path) -> Result<Option<Snapshot>, lookout_inode_map::Error> {
    match Snapshot::read_file(path) {
        Ok(s) => Ok(Some(s)),
        Err(lookout_inode_map::Error::Io { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            Ok(None)
        }
        Err(e) => Err(e),
    }
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
    raise_fd_limit();
    // SOURCE is the operator's: it may be reached through symlinks. What
    // is under it is never.
    let root_fd = nix::fcntl::open(
        source.as_path(),
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .unwrap_or_else(|e| fail(format_args!("{}: {e}", source.display())));
    // The path the fd names (for the mount table), not SOURCE again.
    let root = std::fs::read_link(format!("/proc/self/fd/{}", root_fd.as_raw_fd()))
        .unwrap_or_else(|e| fail(format_args!("{}: {e}", source.display())));
    let mut map = InodeMap::new(mode, Limits::default());
    if let Some(path) = &snapshot {
        let restored = load_snapshot(path)
            .and_then(|s| s.map(|s| map.restore(&s, ConflictPolicy::Fail)).transpose());
        match restored {
            Ok(Some(r)) => eprintln!(
                "stablefs: restored {} entries from {}",
                r.restored,
                path.display()
            ),
            Ok(None) => eprintln!("stablefs: no snapshot at {} yet", path.display()),
            Err(e) => fail(format_args!("{}: {}", path.display(), chain(&e))),
        }
    }
    let mut st = State {
        map,
        nodes: HashMap::new(),
        devs: HashSet::new(),
        open_files: HashMap::new(),
        listings: HashMap::new(),
        next_fh: 0,
        forgotten: 0,
    };
    let s = HostStat::of(root_fd.as_fd())
        .unwrap_or_else(|e| fail(format_args!("{}: {}", root.display(), os_error(e))));
    let m = map_file(&mut st, root_fd.as_fd(), c"", &s, &root)
        .unwrap_or_else(|e| fail(format_args!("{}: {}", root.display(), os_error(e))));
    let root_fd = Arc::new(root_fd);
    st.nodes.insert(
        u64::from(INodeNo::ROOT),
        Node {
            key: s.key(),
            number: m.ino,
            mapped_dev: m.dev,
            kind: FileType::Directory,
            fd: root_fd.clone(),
            parent: root_fd,
            name: c".".to_owned(),
            parent_number: m.ino,
            rel: PathBuf::new(),
            lookups: 1,
        },
    );
    let fs = StableFs {
        mountpoints: mountpoints_under(&root),
        snapshot,
        state: Mutex::new(st),
    };
    let mut cfg = fuser::Config::default();
    cfg.mount_options = vec![
        MountOption::RO,
        MountOption::FSName("stablefs".into()),
        MountOption::Subtype("stablefs".into()),
    ];
    eprintln!("stablefs: serving {:?}", mode);
    if let Err(e) = fuser::mount(fs, mountpoint, &cfg) {
        fail(format_args!("mounting {}: {e}", mountpoint.display()));
    }
}

/// `e` and its causes, `outer: cause: root` (the crate's errors leave
/// their causes to `source()`).
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s = format!("{s}: {c}");
        cause = c.source();
    }
    s
}
