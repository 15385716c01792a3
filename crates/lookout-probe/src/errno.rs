//! Naming errnos the way people search for them.

/// The symbolic name of an errno (`EPERM`), or `errno N`.
pub fn errno_name(errno: i32) -> String {
    let name = match errno {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EINTR => "EINTR",
        libc::EIO => "EIO",
        libc::EBADF => "EBADF",
        libc::EAGAIN => "EAGAIN",
        libc::ENOMEM => "ENOMEM",
        libc::EACCES => "EACCES",
        libc::EFAULT => "EFAULT",
        libc::EBUSY => "EBUSY",
        libc::EEXIST => "EEXIST",
        libc::EXDEV => "EXDEV",
        libc::ENODEV => "ENODEV",
        libc::ENOTDIR => "ENOTDIR",
        libc::EINVAL => "EINVAL",
        libc::EMFILE => "EMFILE",
        libc::ENOSPC => "ENOSPC",
        libc::EROFS => "EROFS",
        libc::ENOSYS => "ENOSYS",
        libc::ELOOP => "ELOOP",
        libc::ENOTSUP => "EOPNOTSUPP",
        libc::E2BIG => "E2BIG",
        libc::ENOEXEC => "ENOEXEC",
        _ => return format!("errno {errno}"),
    };
    name.to_owned()
}

/// `EPERM (Operation not permitted)` for an OS error, or its text otherwise.
pub fn describe(err: &std::io::Error) -> String {
    match err.raw_os_error() {
        Some(n) => {
            let text = std::io::Error::from_raw_os_error(n).to_string();
            // io::Error renders "Operation not permitted (os error 1)".
            let text = text.split(" (os error").next().unwrap_or(&text).to_owned();
            format!("{} ({text})", errno_name(n))
        }
        None => err.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_common_errnos() {
        assert_eq!(errno_name(libc::ENOSYS), "ENOSYS");
        assert_eq!(errno_name(9999), "errno 9999");
        let d = describe(&std::io::Error::from_raw_os_error(libc::EPERM));
        assert_eq!(d, "EPERM (Operation not permitted)");
    }
}
