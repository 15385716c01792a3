//! Reading files that runtime execs and runtime state point at.
//!
//! A bundle's `config.json`, a `--pid-file`, a state file: any of them may
//! sit in a directory another user can write to, and so may have been
//! replaced by a FIFO (an `open(2)` that never returns), a symlink out of
//! the host root, a device, or a file of gigabytes. Every read here:
//!
//! - resolves the path under the host root with `openat2(2)` and
//!   `RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS`: `..` and absolute symlinks
//!   stay inside the host root, `/proc/<pid>/fd/*` tricks are refused;
//! - does not follow a symlink in the last component (`O_NOFOLLOW`);
//! - opens with `O_NONBLOCK`, so a FIFO or a device cannot block the open,
//!   then checks with `fstat` that it is a regular file, not larger than
//!   the limit, and, when asked, owned by root;
//! - reads at most the limit;
//! - leaves the file's access time alone (`O_NOATIME`): an observer's read
//!   of a runtime's state is no write to the host's disk.
//!
//! What it cannot prevent alone is a file system that hangs (a dead NFS
//! server, a stopped FUSE daemon): `open` or `read` then blocks in the
//! kernel. Callers on a path that a runtime waits for run these reads on a
//! helper thread bounded by the answer deadline (see
//! [`read_config_within`](crate::oci::read_config_within)).

use std::io::Read;
use std::os::fd::OwnedFd;
use std::path::{Component, Path, PathBuf};

use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat2};
use nix::sys::stat::{Mode, SFlag, fstat};

/// Why an untrusted file was not read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Refused {
    /// The host root itself could not be opened.
    #[error("host root {}", path.display())]
    HostRoot {
        /// The host root.
        path: PathBuf,
        /// Why.
        #[source]
        source: nix::errno::Errno,
    },
    /// The last component is a symlink: not followed.
    #[error("{}: a symlink (not followed)", path.display())]
    Symlink {
        /// The path asked for.
        path: PathBuf,
    },
    /// The path resolves outside the host root (or the directory it was
    /// opened in).
    #[error("{}: resolves outside the host root", path.display())]
    Outside {
        /// The path asked for.
        path: PathBuf,
    },
    /// Opening the path failed.
    #[error("{}", path.display())]
    Open {
        /// The path asked for.
        path: PathBuf,
        /// Why.
        #[source]
        source: nix::errno::Errno,
    },
    /// `fstat` of the open file failed.
    #[error("fstat")]
    Stat(#[source] nix::errno::Errno),
    /// A FIFO, device, socket or directory.
    #[error("not a regular file (a FIFO, device, socket or directory)")]
    NotRegular,
    /// Not owned by root, where root must have written it.
    #[error("owned by uid {uid}, not root: runtime state of a rootful runtime is written by root")]
    NotRootOwned {
        /// The owner.
        uid: u32,
    },
    /// Larger than the policy allows.
    #[error("{size} bytes, larger than the limit of {limit}")]
    TooLarge {
        /// The size seen (at least `limit + 1` when it grew while read).
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// Reading the open file failed.
    #[error("reading")]
    Read(#[source] std::io::Error),
}

/// What a file must be to be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// The largest size read; a larger file is an error.
    pub max_bytes: u64,
    /// The file must be owned by root (runtime state of rootful
    /// runtimes, pid files they write).
    pub root_owned: bool,
}

/// Opens the directory `path` (a host path) under `host_root`, resolved
/// as in [`open`], as an `O_PATH` handle for [`open_in`].
pub fn open_dir(host_root: &Path, path: &Path) -> Result<OwnedFd, Refused> {
    let root = open_root(host_root)?;
    resolve(
        &root,
        path,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
    )
}

/// Opens `path` (a host path, absolute or relative to the host root) under
/// `host_root` as described in the module docs, and returns the open,
/// checked file.
pub fn open(host_root: &Path, path: &Path, policy: Policy) -> Result<std::fs::File, Refused> {
    open_in(&*open_root(host_root)?, path, policy)
}

/// [`open`], with `dir` (from [`open_dir`]) as the root: `path` cannot
/// leave `dir` either (absolute symlinks and `..` resolve inside it).
pub fn open_in(dir: &OwnedFd, path: &Path, policy: Policy) -> Result<std::fs::File, Refused> {
    open_sized(dir, path, policy).map(|(file, _)| file)
}

/// [`open_in`], and the size `fstat` saw.
fn open_sized(dir: &OwnedFd, path: &Path, policy: Policy) -> Result<(std::fs::File, u64), Refused> {
    let flags = OFlag::O_RDONLY
        | OFlag::O_NONBLOCK
        | OFlag::O_NOFOLLOW
        | OFlag::O_NOCTTY
        | OFlag::O_CLOEXEC;
    // N.B. O_NOATIME. runc writes a new state.json for every container,
    // and the first read of a file whose atime is not past its mtime
    // updates the atime (relatime): on ext4 a journal transaction on the
    // reading thread (touch_atime -> ext4_dirty_inode in the readers'
    // profile, /run on ext4), for every container, and a write to a disk
    // that the agent only observes. The kernel grants O_NOATIME to the
    // file's owner and to CAP_FOWNER; for another user's file (EPERM) the
    // open is made again without it.
    let fd = match resolve(dir, path, flags | OFlag::O_NOATIME) {
        Err(Refused::Open {
            source: nix::errno::Errno::EPERM,
            ..
        }) => resolve(dir, path, flags)?,
        other => other?,
    };
    let st = fstat(&fd).map_err(Refused::Stat)?;
    if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFREG {
        return Err(Refused::NotRegular);
    }
    if policy.root_owned && st.st_uid != 0 {
        return Err(Refused::NotRootOwned { uid: st.st_uid });
    }
    if st.st_size < 0 || st.st_size as u64 > policy.max_bytes {
        return Err(Refused::TooLarge {
            size: st.st_size.max(0) as u64,
            limit: policy.max_bytes,
        });
    }
    Ok((std::fs::File::from(fd), st.st_size as u64))
}

/// Opens the host root's handle now and keeps it (see [`open_root`]): the
/// hook does this when it is built, so that the handle is one of the fds
/// it holds from the start rather than one the first container adds, and
/// no exec waits for its open.
pub(crate) fn keep_root(host_root: &Path) {
    if let Err(e) = open_root(host_root) {
        tracing::debug!(error = %lookout_model::Chain(&e), "the host root is opened at the first read instead");
    }
}

/// The host root's `O_PATH` handle, opened once and kept: opened and
/// closed by every read, it would cost two system calls on the path from a
/// `create`'s exec (its config.json) and from its exit (its state) to the
/// container's report. The agent reads under one host root for its life
/// (`/`, or `/host` in its pod), so one handle is kept, of the last root
/// asked for; a handle that could not be opened is not kept.
fn open_root(host_root: &Path) -> Result<std::sync::Arc<OwnedFd>, Refused> {
    static LAST: std::sync::Mutex<Option<(PathBuf, std::sync::Arc<OwnedFd>)>> =
        std::sync::Mutex::new(None);
    let lock = || {
        LAST.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    };
    if let Some((path, fd)) = lock().as_ref()
        && path == host_root
    {
        return Ok(std::sync::Arc::clone(fd));
    }
    // Opened without the lock held: a path walk may wait on a file system.
    let fd = std::sync::Arc::new(
        nix::fcntl::open(
            host_root,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|source| Refused::HostRoot {
            path: host_root.to_path_buf(),
            source,
        })?,
    );
    *lock() = Some((host_root.to_path_buf(), std::sync::Arc::clone(&fd)));
    Ok(fd)
}

fn resolve(dir: &OwnedFd, path: &Path, flags: OFlag) -> Result<OwnedFd, Refused> {
    let rel = relative(path);
    match openat2(
        dir,
        rel.as_path(),
        OpenHow::new()
            .flags(flags)
            .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS),
    ) {
        Ok(fd) => Ok(fd),
        // Kernels before 5.6: no openat2. Still no FIFO, no last-component
        // symlink; `..` is resolved lexically by `relative`.
        Err(nix::errno::Errno::ENOSYS) => {
            nix::fcntl::openat(dir, rel.as_path(), flags, Mode::empty())
                .map_err(|e| describe(e, path))
        }
        Err(e) => Err(describe(e, path)),
    }
}

/// [`read`] of `path` inside `dir` (see [`open_in`]).
pub fn read_in(dir: &OwnedFd, path: &Path, policy: Policy) -> Result<Vec<u8>, Refused> {
    let (file, size) = open_sized(dir, path, policy)?;
    read_all(file, size, policy)
}

/// Reads `path` under `host_root` (see [`open`]), at most
/// `policy.max_bytes` bytes.
pub fn read(host_root: &Path, path: &Path, policy: Policy) -> Result<Vec<u8>, Refused> {
    let (file, size) = open_sized(&*open_root(host_root)?, path, policy)?;
    read_all(file, size, policy)
}

/// The most a read reserves before the file gives its bytes.
const PREALLOCATED_AT_MOST: u64 = 64 * 1024;

/// Reads `file`, `size` bytes when `fstat` was right. The buffer starts
/// with room for those and one more (at most 64 KiB + 1: a read held by a
/// hung file system reserves no more than that), so a runtime's config or
/// state file is read in one call, which returns less than it asked for
/// and all `fstat` saw: for a regular file (the only kind opened here)
/// that is its end, and no second read is made to see it. A file that grew since `fstat` fills the
/// buffer, which then doubles, up to the limit and one byte more. (From an
/// empty buffer, `read_to_end` probes with 32 bytes and doubles up, eight
/// reads for a 2 KB config.json, and always reads once more for the end.)
/// `size` was checked against the limit at open.
fn read_all(mut file: std::fs::File, size: u64, policy: Policy) -> Result<Vec<u8>, Refused> {
    let limit = policy.max_bytes.saturating_add(1);
    let room = size.min(policy.max_bytes).min(PREALLOCATED_AT_MOST) + 1;
    let mut bytes = vec![0; usize::try_from(room).unwrap_or(1)];
    let mut len = 0;
    loop {
        let n = match file.read(&mut bytes[len..]) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(Refused::Read(e)),
        };
        len += n;
        if n == 0 || len as u64 >= limit {
            break;
        }
        // Short, with all that fstat saw: the end. Short of it, it may be
        // an I/O error part way (the page cache hands out what it read
        // before it) or a FUSE reply cut short: read again, and see.
        if len < bytes.len() {
            if len as u64 >= size {
                break;
            }
            continue;
        }
        let more = (bytes.len() as u64).saturating_mul(2).min(limit);
        bytes.resize(usize::try_from(more).unwrap_or(usize::MAX), 0);
    }
    bytes.truncate(len);
    // The size was checked at open; a file that grew since is refused too.
    if len as u64 > policy.max_bytes {
        return Err(Refused::TooLarge {
            size: len as u64,
            limit: policy.max_bytes,
        });
    }
    Ok(bytes)
}

/// `path` relative to the root: leading `/` dropped, `.` dropped, `..`
/// resolved lexically without going above the root.
fn relative(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Normal(s) => out.push(s),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    if out.as_os_str().is_empty() {
        out.push(".");
    }
    out
}

fn describe(e: nix::errno::Errno, path: &Path) -> Refused {
    let path = path.to_path_buf();
    match e {
        nix::errno::Errno::ELOOP => Refused::Symlink { path },
        nix::errno::Errno::EXDEV => Refused::Outside { path },
        source => Refused::Open { path, source },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    const ANY: Policy = Policy {
        max_bytes: 1024,
        root_owned: false,
    };

    fn mkfifo(p: &Path) {
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).expect("no NUL");
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0);
    }

    #[test]
    fn regular_files_are_read_under_the_root() {
        let root = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(root.path().join("run/x")).expect("mkdir");
        std::fs::write(root.path().join("run/x/state.json"), b"{}").expect("write");
        assert_eq!(
            read(root.path(), Path::new("/run/x/state.json"), ANY).expect("read"),
            b"{}"
        );
        // `..` cannot climb above the root.
        assert_eq!(
            read(root.path(), Path::new("/../../run/x/state.json"), ANY).expect("read"),
            b"{}"
        );
    }

    #[test]
    fn fifos_devices_and_directories_are_refused_at_once() {
        let root = tempfile::tempdir().expect("tempdir");
        mkfifo(&root.path().join("fifo"));
        let t = std::time::Instant::now();
        let e = read(root.path(), Path::new("/fifo"), ANY).expect_err("a fifo");
        assert!(e.to_string().contains("not a regular file"), "{e}");
        assert!(t.elapsed() < std::time::Duration::from_secs(1));
        let e = read(Path::new("/"), Path::new("/dev/zero"), ANY).expect_err("a device");
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let e = read(root.path(), Path::new("/"), ANY).expect_err("a directory");
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }

    #[test]
    fn symlinks_are_not_followed_out_of_the_root() {
        let root = tempfile::tempdir().expect("tempdir");
        let outside = tempfile::NamedTempFile::new().expect("tmp");
        std::fs::write(outside.path(), b"secret").expect("write");
        // The last component: not followed at all.
        symlink(outside.path(), root.path().join("last")).expect("symlink");
        let e = read(root.path(), Path::new("/last"), ANY).expect_err("symlink");
        assert!(e.to_string().contains("symlink"), "{e}");
        // A directory symlink pointing at / resolves inside the root: the
        // outside file is not reached.
        symlink("/", root.path().join("up")).expect("symlink");
        let through = Path::new("/up").join(outside.path().strip_prefix("/").expect("abs"));
        assert!(read(root.path(), &through, ANY).is_err());
    }

    #[test]
    fn a_file_that_changed_size_after_fstat_is_read_as_it_is_now() {
        // The buffer is sized from fstat; what is read is what the file
        // holds when read, and the limit still holds.
        let root = tempfile::tempdir().expect("tempdir");
        let dir = open_root(root.path()).expect("root");
        let path = root.path().join("f");
        let limit = Policy {
            max_bytes: 64,
            root_owned: false,
        };
        let append = |bytes: &[u8]| {
            use std::io::Write;
            std::fs::OpenOptions::new()
                .append(true)
                .open(&path)
                .and_then(|mut f| f.write_all(bytes))
                .expect("append");
        };
        std::fs::write(&path, b"0123456789").expect("write");
        let (file, size) = open_sized(&dir, Path::new("/f"), limit).expect("open");
        assert_eq!(size, 10);
        append(b"abcdefghij");
        assert_eq!(
            read_all(file, size, limit).expect("still under the limit"),
            b"0123456789abcdefghij"
        );
        let (file, size) = open_sized(&dir, Path::new("/f"), limit).expect("open");
        append(&[b'x'; 64]);
        let e = read_all(file, size, limit).expect_err("grew past the limit");
        assert!(
            matches!(
                e,
                Refused::TooLarge {
                    size: 65,
                    limit: 64
                }
            ),
            "{e}"
        );
        std::fs::write(&path, b"0123456789").expect("write");
        let (file, size) = open_sized(&dir, Path::new("/f"), limit).expect("open");
        std::fs::write(&path, b"01").expect("truncate");
        assert_eq!(read_all(file, size, limit).expect("shrank"), b"01");
        // Larger than what is reserved up front: read whole all the same.
        let big: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &big).expect("write");
        let roomy = Policy {
            max_bytes: 1 << 20,
            root_owned: false,
        };
        let (file, size) = open_sized(&dir, Path::new("/f"), roomy).expect("open");
        assert_eq!(read_all(file, size, roomy).expect("100 KB"), big);
    }

    /// The access time of `path`.
    fn atime(path: &Path) -> std::time::SystemTime {
        std::fs::metadata(path)
            .and_then(|m| m.accessed())
            .expect("atime")
    }

    /// `path`'s atime set back to 2020, its mtime now: the next plain read
    /// updates the atime, even under `relatime`.
    fn make_atime_stale(path: &Path) -> std::time::SystemTime {
        let old = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_600_000_000);
        let times = std::fs::FileTimes::new()
            .set_accessed(old)
            .set_modified(std::time::SystemTime::now());
        std::fs::File::options()
            .write(true)
            .open(path)
            .and_then(|f| f.set_times(times))
            .expect("set times");
        old
    }

    #[test]
    fn a_read_leaves_the_access_time_as_it_was() {
        let root = tempfile::tempdir().expect("tempdir");
        let file = root.path().join("state.json");
        std::fs::write(&file, b"{}").expect("write");
        // Whether this file system updates atimes at all (not under
        // `noatime`): a plain read must.
        let old = make_atime_stale(&file);
        std::fs::read(&file).expect("plain read");
        if atime(&file) == old {
            eprintln!(
                "!!! SKIPPED a_read_leaves_the_access_time_as_it_was: {} is mounted without \
                 access times, so there is nothing to leave alone",
                root.path().display()
            );
            return;
        }
        let old = make_atime_stale(&file);
        assert_eq!(
            read(root.path(), Path::new("/state.json"), ANY).expect("read"),
            b"{}"
        );
        assert_eq!(atime(&file), old, "the read updated the access time");
    }

    #[test]
    fn another_users_file_is_read_without_o_noatime() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!(
                "!!! SKIPPED another_users_file_is_read_without_o_noatime: needs root, to read \
                 a root-owned file as another fsuid"
            );
            return;
        }
        let root = tempfile::tempdir().expect("tempdir");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        let file = root.path().join("state.json");
        std::fs::write(&file, b"{}").expect("write");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let dir = root.path().to_path_buf();
        // A thread of its own: the fsuid is per thread, and a non-zero one
        // also drops CAP_FOWNER from it, so O_NOATIME on root's file is
        // EPERM there, as it is for an agent without CAP_FOWNER reading
        // another user's state.
        let got = std::thread::spawn(move || {
            // SAFETY: setfsuid changes this thread's file-system uid only.
            unsafe { libc::setfsuid(65534) };
            read(&dir, Path::new("/state.json"), ANY)
        })
        .join()
        .expect("the reading thread");
        assert_eq!(got.expect("read without O_NOATIME"), b"{}");
    }

    #[test]
    fn size_and_owner_limits() {
        let root = tempfile::tempdir().expect("tempdir");
        std::fs::write(root.path().join("big"), vec![b'x'; 2048]).expect("write");
        let e = read(root.path(), Path::new("/big"), ANY).expect_err("too big");
        assert!(e.to_string().contains("larger than"), "{e}");
        std::fs::write(root.path().join("small"), b"1").expect("write");
        // SAFETY: geteuid has no preconditions.
        let root_owned = unsafe { libc::geteuid() } == 0;
        let strict = Policy {
            max_bytes: 16,
            root_owned: true,
        };
        // Created by the test's own user: accepted only when that is root.
        assert_eq!(
            read(root.path(), Path::new("/small"), strict).is_ok(),
            root_owned
        );
        if root_owned {
            std::os::unix::fs::chown(root.path().join("small"), Some(65534), None).expect("chown");
            let e = read(root.path(), Path::new("/small"), strict).expect_err("not root's");
            assert!(e.to_string().contains("owned by uid 65534"), "{e}");
        }
    }
}
