//! The consumer socket: bound with its permissions before it appears, taken
//! over from a previous agent in one rename, and left alone at exit when a
//! newer agent holds it.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use anyhow::Context;

/// Binds the socket: its directory is created 0750, and the socket is made
/// 0660, group `group` when given, **before** it appears at `path`: it is
/// bound at a temporary name beside `path`, then renamed over `path` in one
/// step (rename(2)).
///
/// So a new agent takes the socket over at once, whether the one there is
/// stale (an agent that crashed) or live (the old agent of a rolling
/// update, which keeps serving the connections it has until it exits and,
/// at exit, leaves the new socket alone: [`unbind`]). No consumer ever
/// finds the path missing, or a socket there with other permissions.
pub fn bind(path: &Path, group: Option<u32>) -> anyhow::Result<std::os::unix::net::UnixListener> {
    let dir = path.parent().unwrap_or(Path::new("/"));
    if !dir.exists() {
        create_socket_dir(dir, group)?;
    }
    let previous = match std::fs::symlink_metadata(path) {
        Ok(meta) => {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                anyhow::bail!(
                    "{} exists and is not a socket; not replacing it",
                    path.display()
                );
            }
            Some(previous_owner(path))
        }
        Err(_) => None,
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "lookout.sock".into());
    let temporary = dir.join(format!(".{name}.{}", std::process::id()));
    let _ = std::fs::remove_file(&temporary);
    let l = std::os::unix::net::UnixListener::bind(&temporary)
        .with_context(|| format!("binding {}", temporary.display()))?;
    let ready = (|| -> anyhow::Result<()> {
        std::fs::set_permissions(&temporary, std::fs::Permissions::from_mode(0o660))
            .with_context(|| format!("chmod 0660 {}", temporary.display()))?;
        if let Some(g) = group {
            nix::unistd::chown(&temporary, None, Some(nix::unistd::Gid::from_raw(g)))
                .with_context(|| {
                    format!(
                        "chgrp {g} {} (needs CAP_CHOWN or membership of the group)",
                        temporary.display()
                    )
                })?;
        }
        l.set_nonblocking(true)
            .with_context(|| format!("O_NONBLOCK on {}", temporary.display()))?;
        std::fs::rename(&temporary, path)
            .with_context(|| format!("renaming {} to {}", temporary.display(), path.display()))
    })();
    if let Err(e) = ready {
        // Leave no socket that nobody serves.
        let _ = std::fs::remove_file(&temporary);
        return Err(e);
    }
    match previous {
        Some(Some(pid)) => tracing::info!(
            socket = %path.display(),
            previous_pid = pid,
            "took the consumer socket over from a running process; it keeps its connections until it exits"
        ),
        Some(None) => tracing::info!(socket = %path.display(), "replaced a stale consumer socket"),
        None => {}
    }
    Ok(l)
}

/// Creates the socket's directory, 0750, group `group` when given.
pub fn create_socket_dir(dir: &Path, group: Option<u32>) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o750))
        .with_context(|| format!("chmod 0750 {}", dir.display()))?;
    if let Some(g) = group {
        nix::unistd::chown(dir, None, Some(nix::unistd::Gid::from_raw(g)))
            .with_context(|| format!("chgrp {g} {}", dir.display()))?;
    }
    Ok(())
}

/// The pid of the process serving the socket at `path`, if one does
/// (`SO_PEERCRED` of a connection; `None` for a stale socket).
fn previous_owner(path: &Path) -> Option<i32> {
    let conn = std::os::unix::net::UnixStream::connect(path).ok()?;
    let cred =
        nix::sys::socket::getsockopt(&conn, nix::sys::socket::sockopt::PeerCredentials).ok()?;
    Some(cred.pid())
}

/// Removes the socket at shutdown, if it is still the one this process
/// bound (another agent may have replaced it meanwhile).
pub fn unbind(path: &Path, bound: Option<(u64, u64)>) {
    use std::os::unix::fs::MetadataExt;
    if let (Some((dev, ino)), Ok(m)) = (bound, std::fs::symlink_metadata(path))
        && (m.dev(), m.ino()) == (dev, ino)
    {
        let _ = std::fs::remove_file(path);
    }
}
