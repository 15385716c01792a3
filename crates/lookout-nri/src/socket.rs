//! Finding the runtime's socket as the host sees it, and refusing one that
//! the wrong user made.
//!
//! In a pod, the host's file system is mounted somewhere (`/host`), and the
//! default socket path goes through a symlink: `/var/run` is `/run` on
//! every systemd host. Joined to the mount point, that absolute symlink
//! would resolve in the pod's own `/run`. So the path is resolved inside
//! the host root with `openat2(RESOLVE_IN_ROOT)`, to an `O_PATH` handle of
//! the socket, and the connection goes through `/proc/self/fd/<fd>`, which
//! names that very inode. It is resolved again at every connection, so a
//! runtime that recreates its socket (or its directory) is found again.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat2};
use nix::sys::stat::{Mode, SFlag, fstat};
use tokio::net::UnixStream;

use crate::Error;

/// Where and how to connect.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    /// The socket's path on the host.
    pub(crate) socket: PathBuf,
    /// The host's root, when it is not `/`.
    pub(crate) host_root: Option<PathBuf>,
    /// The uid that must own the socket.
    pub(crate) owner: Option<u32>,
}

impl Target {
    /// The path shown in errors and logs: where the socket is looked for.
    pub(crate) fn display_path(&self) -> PathBuf {
        match &self.host_root {
            Some(root) => root.join(relative(&self.socket)),
            None => self.socket.clone(),
        }
    }

    /// Connects to the runtime's socket.
    pub(crate) async fn connect(&self) -> Result<UnixStream, Error> {
        let path = self.display_path();
        let connect_error = |source| Error::Connect {
            path: path.clone(),
            source,
        };
        if self.host_root.is_none() && self.owner.is_none() {
            return UnixStream::connect(&self.socket)
                .await
                .map_err(connect_error);
        }
        let target = self.clone();
        // A few syscalls on a local file system; off the runtime's threads
        // all the same.
        let fd = tokio::task::spawn_blocking(move || target.resolve())
            .await
            .map_err(|e| connect_error(std::io::Error::other(e)))??;
        let via = format!("/proc/self/fd/{}", fd.as_raw_fd());
        let stream = UnixStream::connect(&via).await.map_err(connect_error)?;
        drop(fd);
        Ok(stream)
    }

    /// The socket, resolved under the host root, checked: a socket, and
    /// owned by the owner asked for.
    fn resolve(&self) -> Result<OwnedFd, Error> {
        let path = self.display_path();
        let root = self.host_root.as_deref().unwrap_or(Path::new("/"));
        let errno = |e: nix::errno::Errno| Error::Connect {
            path: path.clone(),
            source: std::io::Error::from(e),
        };
        let dir = nix::fcntl::open(
            root,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(errno)?;
        let rel = relative(&self.socket);
        // O_PATH | O_NOFOLLOW: a symlink as the last component is opened
        // as itself, and refused below as not a socket.
        let flags = OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let how = OpenHow::new()
            .flags(flags)
            .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
        let fd = match openat2(&dir, rel.as_path(), how) {
            // Kernels before 5.6 have no openat2: `..` is still resolved
            // lexically, but an absolute symlink leaves the root.
            Err(nix::errno::Errno::ENOSYS) => {
                nix::fcntl::openat(&dir, rel.as_path(), flags, Mode::empty())
            }
            other => other,
        }
        .map_err(errno)?;
        let st = fstat(&fd).map_err(errno)?;
        if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFSOCK {
            return Err(Error::NotASocket { path });
        }
        if let Some(want) = self.owner
            && st.st_uid != want
        {
            return Err(Error::SocketOwner {
                path,
                uid: st.st_uid,
                want,
            });
        }
        Ok(fd)
    }
}

/// `path` relative to the root: leading `/` and `.` dropped, `..` resolved
/// lexically without going above the root.
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

#[cfg(test)]
#[allow(
    clippy::unwrap_used,
    reason = "test setup: a panic is how it reports a failure"
)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, symlink};

    fn target(socket: &str, root: &Path, owner: Option<u32>) -> Target {
        Target {
            socket: socket.into(),
            host_root: Some(root.to_path_buf()),
            owner,
        }
    }

    #[tokio::test]
    async fn an_absolute_symlink_resolves_inside_the_host_root() {
        // host/var/run -> /run, as on the host; the socket in host/run/nri.
        let host = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(host.path().join("run/nri")).unwrap();
        std::fs::create_dir_all(host.path().join("var")).unwrap();
        symlink("/run", host.path().join("var/run")).unwrap();
        let listener =
            tokio::net::UnixListener::bind(host.path().join("run/nri/nri.sock")).unwrap();
        let t = target("/var/run/nri/nri.sock", host.path(), None);
        let (conn, accepted) = tokio::join!(t.connect(), listener.accept());
        conn.unwrap();
        accepted.unwrap();
        // `..` does not leave the root either.
        let t = target("/../../var/run/nri/nri.sock", host.path(), None);
        let (conn, accepted) = tokio::join!(t.connect(), listener.accept());
        conn.unwrap();
        accepted.unwrap();
    }

    #[tokio::test]
    async fn a_socket_of_another_owner_a_file_and_a_symlink_are_refused() {
        let host = tempfile::tempdir().unwrap();
        let sock = host.path().join("nri.sock");
        let _listener = tokio::net::UnixListener::bind(&sock).unwrap();
        let mine = std::fs::metadata(&sock).unwrap().uid();
        let e = target("/nri.sock", host.path(), Some(mine.wrapping_add(1)))
            .connect()
            .await
            .unwrap_err();
        assert!(
            matches!(e, Error::SocketOwner { uid, .. } if uid == mine),
            "{e:?}"
        );
        assert!(e.to_string().contains("owned by uid"), "{e}");
        target("/nri.sock", host.path(), Some(mine))
            .connect()
            .await
            .unwrap();

        std::fs::write(host.path().join("file"), b"").unwrap();
        let e = target("/file", host.path(), None)
            .connect()
            .await
            .unwrap_err();
        assert!(matches!(e, Error::NotASocket { .. }), "{e:?}");

        symlink("/nri.sock", host.path().join("link")).unwrap();
        let e = target("/link", host.path(), None)
            .connect()
            .await
            .unwrap_err();
        assert!(matches!(e, Error::NotASocket { .. }), "{e:?}");
        let e = target("/absent", host.path(), None)
            .connect()
            .await
            .unwrap_err();
        assert!(e.is_absent(), "{e:?}");
    }
}
