//! A small, bounded, read-only client for the Docker Engine API over its
//! Unix socket.
//!
//! Docker does not copy a container's name, image or labels into the OCI
//! `config.json` that runc reads: they live in dockerd. This crate asks
//! dockerd for them, and for its version, and for nothing else:
//!
//! - three calls only: `GET /containers/json` filtered by one id
//!   ([`Client::find`], which dockerd answers at once, even while it starts
//!   the container), `GET /containers/{id}/json` ([`Client::inspect`],
//!   which waits for a start to end) and `GET /version`
//!   ([`Client::version`]), at dockerd's own API version (unversioned
//!   paths), so it works with every Engine from 20.10 on;
//! - bounded: every call has one deadline for connecting, writing and
//!   reading (a stopped or hung dockerd costs at most that), and a size
//!   limit on the answer;
//! - dockerd's bytes are untrusted: [`parse_response`],
//!   [`ContainerInfo::from_json`] and [`ContainerInfo::from_list_json`] take any input and return an error, never
//!   panic (they are fuzzed).
//!
//! The client is synchronous (std's `UnixStream` with timeouts): run it on
//! a blocking thread in async code. One call is one connection
//! (`HTTP/1.0`, closed by dockerd after its answer).
//!
//! ```no_run
//! use std::time::Duration;
//! let docker = lookout_docker::Client::new("/run/docker.sock").timeout(Duration::from_secs(2));
//! let v = docker.version()?;
//! println!("Docker {} (API {})", v.version, v.api_version);
//! let id = "7c5a0f2d9c3e4b1a8f6e5d4c3b2a19087f6e5d4c3b2a19087f6e5d4c3b2a1908";
//! match docker.inspect(id)? {
//!     Some(c) => println!("{id} is {:?}, image {:?}, labels {:?}", c.name, c.image, c.labels),
//!     None => println!("dockerd does not know {id}"),
//! }
//! # Ok::<(), lookout_docker::Error>(())
//! ```

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Deserialize;

/// Where dockerd listens unless told otherwise (`-H`).
pub const DEFAULT_SOCKET: &str = "/run/docker.sock";

/// How long a call may take, unless [`Client::timeout`] says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// The largest answer read, unless [`Client::max_body`] says otherwise. An
/// inspect answer is 5-20 KiB; labels make it larger.
pub const DEFAULT_MAX_BODY: usize = 1 << 20;

/// Room for the status line and headers, beside the body's limit.
const MAX_HEAD: usize = 16 << 10;

/// Why a call gave no answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The socket could not be connected to: dockerd is not running (or not
    /// there), or this process may not use its socket.
    #[error("cannot connect to dockerd at {}: {source}", socket.display())]
    Connect {
        /// The socket.
        socket: PathBuf,
        /// The connect's error.
        #[source]
        source: std::io::Error,
    },
    /// Writing the request or reading the answer failed.
    #[error("talking to dockerd at {}: {source}", socket.display())]
    Io {
        /// The socket.
        socket: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// No whole answer within the deadline: dockerd is hung or busy.
    #[error("dockerd at {} gave no whole answer within {after:?} (hung or busy)", socket.display())]
    Timeout {
        /// The socket.
        socket: PathBuf,
        /// The deadline.
        after: Duration,
    },
    /// The answer is larger than the limit.
    #[error("dockerd's answer is larger than {limit} bytes")]
    TooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The answer is not HTTP as dockerd speaks it.
    #[error("malformed HTTP answer: {0}")]
    Http(String),
    /// dockerd answered with an error status (a 404 is not an error for
    /// [`Client::inspect`]).
    #[error("dockerd answered {code}: {message}")]
    Status {
        /// The HTTP status.
        code: u16,
        /// dockerd's `message`, or the start of the body.
        message: String,
    },
    /// The body is not the JSON expected.
    #[error("malformed JSON from dockerd: {0}")]
    Json(#[from] serde_json::Error),
    /// The socket is not owned by the uid required
    /// ([`Client::owner`]): whoever owns it could answer for dockerd.
    #[error("{} is owned by uid {found}, not {wanted}: refused (whoever owns it could answer for dockerd)", socket.display())]
    Owner {
        /// The socket.
        socket: PathBuf,
        /// Its owner.
        found: u32,
        /// The owner required.
        wanted: u32,
    },
    /// Not a Docker container id (64 lowercase hex digits): never put in
    /// a request path.
    #[error("not a Docker container id: {0:?}")]
    BadId(String),
}

impl Error {
    /// Whether dockerd is absent, hung or unreachable (as opposed to an
    /// answer that was wrong): a caller may stop asking for a while.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            Error::Connect { .. } | Error::Io { .. } | Error::Timeout { .. } | Error::Owner { .. }
        )
    }
}

/// A parsed HTTP answer: its status and its body (de-chunked).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Response {
    /// The HTTP status code.
    pub status: u16,
    /// The body.
    pub body: Vec<u8>,
}

/// Parses a whole HTTP/1.x answer as read until the connection closed: the
/// status line, headers, and a body delimited by `Content-Length`, by
/// chunked transfer coding, or by the end of the input.
///
/// ```
/// let r = lookout_docker::parse_response(
///     b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
/// )?;
/// assert_eq!((r.status, &r.body[..]), (200, &b"{}"[..]));
/// # Ok::<(), lookout_docker::Error>(())
/// ```
pub fn parse_response(bytes: &[u8]) -> Result<Response, Error> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut parsed = httparse::Response::new(&mut headers);
    let head = match parsed.parse(bytes) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => {
            return Err(Error::Http("the answer ends inside its headers".into()));
        }
        Err(e) => return Err(Error::Http(e.to_string())),
    };
    let status = parsed
        .code
        .ok_or_else(|| Error::Http("no status code".into()))?;
    let mut length = None;
    let mut chunked = false;
    for h in parsed.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            let n = std::str::from_utf8(h.value)
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
                .ok_or_else(|| Error::Http("a malformed Content-Length".into()))?;
            if length.is_some_and(|l| l != n) {
                return Err(Error::Http("two different Content-Lengths".into()));
            }
            length = Some(n);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = h
                .value
                .split(|b| *b == b',')
                .any(|v| v.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        }
    }
    let rest = &bytes[head..];
    let body = if chunked {
        dechunk(rest)?
    } else if let Some(n) = length {
        rest.get(..n)
            .ok_or_else(|| {
                Error::Http(format!(
                    "the body ends after {} of its {n} bytes",
                    rest.len()
                ))
            })?
            .to_vec()
    } else {
        rest.to_vec()
    };
    Ok(Response { status, body })
}

/// Decodes a chunked body (chunk extensions and trailers ignored).
fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>, Error> {
    let mut body = Vec::new();
    loop {
        let line_end = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or_else(|| Error::Http("a chunk without its size line".into()))?;
        let line = &rest[..line_end];
        let size = line.split(|b| *b == b';').next().unwrap_or_default();
        let size = std::str::from_utf8(size)
            .ok()
            .and_then(|s| usize::from_str_radix(s.trim(), 16).ok())
            .ok_or_else(|| Error::Http("a malformed chunk size".into()))?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Ok(body);
        }
        let chunk = rest
            .get(..size)
            .ok_or_else(|| Error::Http("a chunk ends early".into()))?;
        body.extend_from_slice(chunk);
        rest = rest
            .get(size..)
            .and_then(|r| r.strip_prefix(b"\r\n"))
            .ok_or_else(|| Error::Http("a chunk without its CRLF".into()))?;
    }
}

/// What dockerd says of a container (`GET /containers/{id}/json`, or its
/// entry in `GET /containers/json`): the part lookout reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ContainerInfo {
    /// The container's full id.
    pub id: String,
    /// Its name, without Docker's leading `/` (`web1`).
    pub name: Option<String>,
    /// The image as it was asked for (`Config.Image`: `nginx:1.27`,
    /// `localhost/bb:1`).
    pub image: Option<String>,
    /// The image's id (`Image`: `sha256:...`).
    pub image_id: Option<String>,
    /// The container's labels (`Config.Labels`), cri-dockerd's
    /// `io.kubernetes.*` among them.
    pub labels: BTreeMap<String, String>,
    /// `State.Status`: `created`, `running`, `exited`, ...
    pub status: Option<String>,
    /// `State.Pid`, when it runs (0 is none; the list has no pid).
    pub pid: Option<u32>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct RawListed {
    id: String,
    #[serde(default)]
    names: Option<Vec<String>>,
    #[serde(default)]
    image: Option<String>,
    #[serde(default, rename = "ImageID")]
    image_id: Option<String>,
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
    #[serde(default)]
    state: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct RawInspect {
    id: String,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    image: Option<String>,
    #[serde(default)]
    config: Option<RawConfig>,
    #[serde(default)]
    state: Option<RawState>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct RawConfig {
    #[serde(default)]
    image: Option<String>,
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct RawState {
    #[serde(default)]
    status: Option<String>,
    #[serde(default)]
    pid: Option<i64>,
}

fn non_empty(s: Option<String>) -> Option<String> {
    s.filter(|s| !s.is_empty())
}

impl ContainerInfo {
    /// Reads an inspect answer's body. Unknown fields are ignored; `Id` is
    /// required.
    ///
    /// ```
    /// let c = lookout_docker::ContainerInfo::from_json(br#"{"Id":"abc","Name":"/web1",
    ///     "Image":"sha256:42","Config":{"Image":"nginx","Labels":{"app":"shop"}},
    ///     "State":{"Status":"running","Pid":4242}}"#)?;
    /// assert_eq!(c.name.as_deref(), Some("web1"));
    /// assert_eq!(c.labels["app"], "shop");
    /// assert_eq!(c.pid, Some(4242));
    /// # Ok::<(), lookout_docker::Error>(())
    /// ```
    pub fn from_json(body: &[u8]) -> Result<ContainerInfo, Error> {
        let raw: RawInspect = serde_json::from_slice(body)?;
        let (image, labels) = match raw.config {
            Some(c) => (c.image, c.labels.unwrap_or_default()),
            None => (None, BTreeMap::new()),
        };
        let (status, pid) = match raw.state {
            Some(s) => (s.status, s.pid),
            None => (None, None),
        };
        Ok(ContainerInfo {
            id: raw.id,
            name: non_empty(
                raw.name
                    .map(|n| n.strip_prefix('/').unwrap_or(&n).to_owned()),
            ),
            image: non_empty(image),
            image_id: non_empty(raw.image),
            labels,
            status: non_empty(status),
            pid: pid.and_then(|p| u32::try_from(p).ok()).filter(|p| *p > 0),
        })
    }
}

impl ContainerInfo {
    /// Reads a container list's body (`GET /containers/json`): every
    /// entry, `Id` required in each.
    ///
    /// ```
    /// let l = lookout_docker::ContainerInfo::from_list_json(br#"[{"Id":"abc",
    ///     "Names":["/web1"],"Image":"nginx","ImageID":"sha256:42",
    ///     "Labels":{"app":"shop"},"State":"created"}]"#)?;
    /// assert_eq!(l[0].name.as_deref(), Some("web1"));
    /// assert_eq!(l[0].status.as_deref(), Some("created"));
    /// # Ok::<(), lookout_docker::Error>(())
    /// ```
    pub fn from_list_json(body: &[u8]) -> Result<Vec<ContainerInfo>, Error> {
        let raw: Vec<RawListed> = serde_json::from_slice(body)?;
        Ok(raw
            .into_iter()
            .map(|r| ContainerInfo {
                id: r.id,
                name: non_empty(
                    r.names
                        .and_then(|n| n.into_iter().next())
                        .map(|n| n.strip_prefix('/').unwrap_or(&n).to_owned()),
                ),
                image: non_empty(r.image),
                image_id: non_empty(r.image_id),
                labels: r.labels.unwrap_or_default(),
                status: non_empty(r.state),
                pid: None,
            })
            .collect())
    }
}

/// dockerd's version (`GET /version`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "PascalCase")]
#[non_exhaustive]
pub struct Version {
    /// The Engine's version (`20.10.24+dfsg1`, `26.1.5+dfsg1`).
    #[serde(default)]
    pub version: String,
    /// Its API version (`1.41`).
    #[serde(default)]
    pub api_version: String,
    /// The oldest API version it serves.
    #[serde(default, rename = "MinAPIVersion")]
    pub min_api_version: Option<String>,
    /// `linux`.
    #[serde(default)]
    pub os: String,
    /// `amd64`, `arm64`.
    #[serde(default)]
    pub arch: String,
}

impl Version {
    /// Reads a version answer's body.
    pub fn from_json(body: &[u8]) -> Result<Version, Error> {
        Ok(serde_json::from_slice(body)?)
    }
}

/// Whether `id` is a Docker container id: 64 lowercase hex digits.
pub fn is_container_id(id: &str) -> bool {
    id.len() == 64
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Whether a runtime state root (runc's `--root`) is Docker's:
/// `<exec-root>/runtime-<runtime>/moby` (`/run/docker/runtime-runc/moby`;
/// a rootless or private daemon's exec root elsewhere).
///
/// ```
/// use std::path::Path;
/// assert!(lookout_docker::is_docker_root(Path::new("/run/docker/runtime-runc/moby")));
/// assert!(!lookout_docker::is_docker_root(Path::new("/run/containerd/runc/k8s.io")));
/// ```
pub fn is_docker_root(root: &Path) -> bool {
    root.file_name().is_some_and(|n| n == "moby")
        && root
            .parent()
            .and_then(Path::file_name)
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("runtime-"))
}

/// A client for one dockerd socket. Cheap to clone; every call connects
/// anew.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Client {
    socket: PathBuf,
    timeout: Duration,
    max_body: usize,
    owner: Option<u32>,
}

impl Client {
    /// A client of the dockerd listening on `socket`.
    pub fn new(socket: impl Into<PathBuf>) -> Client {
        Client {
            socket: socket.into(),
            timeout: DEFAULT_TIMEOUT,
            max_body: DEFAULT_MAX_BODY,
            owner: None,
        }
    }

    /// Connects only to a socket file owned by `uid` (root: 0), checked
    /// before each call. dockerd's socket is root's; one owned by anybody
    /// else (a misconfigured path in a directory others may write to) is
    /// refused with [`Error::Owner`].
    pub fn owner(mut self, uid: u32) -> Client {
        self.owner = Some(uid);
        self
    }

    /// The deadline of each call: connecting, writing and reading together.
    pub fn timeout(mut self, timeout: Duration) -> Client {
        self.timeout = timeout;
        self
    }

    /// The largest body read; a larger answer is [`Error::TooLarge`].
    pub fn max_body(mut self, bytes: usize) -> Client {
        self.max_body = bytes;
        self
    }

    /// The socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// dockerd's version.
    pub fn version(&self) -> Result<Version, Error> {
        let r = self.get("/version")?;
        if r.status != 200 {
            return Err(status_error(&r));
        }
        Version::from_json(&r.body)
    }

    /// What dockerd's container list says of container `id` (`GET
    /// /containers/json?all=1` filtered by the id); `None` when it does
    /// not know it. Unlike [`Client::inspect`], dockerd answers this at
    /// once while it creates or starts the container (measured with 20.10
    /// and 26.1: 20 ms against the whole start), so the name, image and
    /// labels are known before the start. It has no pid.
    pub fn find(&self, id: &str) -> Result<Option<ContainerInfo>, Error> {
        if !is_container_id(id) {
            return Err(Error::BadId(id.chars().take(80).collect()));
        }
        // filters={"id":["<id>"]}, percent-encoded. The id filter matches
        // prefixes: only the entry with the whole id is taken.
        let r = self.get(&format!(
            "/containers/json?all=1&filters=%7B%22id%22%3A%5B%22{id}%22%5D%7D"
        ))?;
        if r.status != 200 {
            return Err(status_error(&r));
        }
        Ok(ContainerInfo::from_list_json(&r.body)?
            .into_iter()
            .find(|c| c.id == id))
    }

    /// What dockerd knows of container `id`; `None` when it does not know
    /// it (404: not one of its containers). dockerd answers for a
    /// container it is starting only once the start is over (it holds the
    /// container's lock meanwhile), so this may wait for the start.
    pub fn inspect(&self, id: &str) -> Result<Option<ContainerInfo>, Error> {
        if !is_container_id(id) {
            return Err(Error::BadId(id.chars().take(80).collect()));
        }
        let r = self.get(&format!("/containers/{id}/json"))?;
        match r.status {
            200 => ContainerInfo::from_json(&r.body).map(Some),
            404 => Ok(None),
            _ => Err(status_error(&r)),
        }
    }

    /// One `GET` of `path`, within the deadline and the size limit.
    fn get(&self, path: &str) -> Result<Response, Error> {
        let deadline = Instant::now() + self.timeout;
        let io = |source| Error::Io {
            socket: self.socket.clone(),
            source,
        };
        let timeout = || Error::Timeout {
            socket: self.socket.clone(),
            after: self.timeout,
        };
        let mut stream = connect(&self.socket, self.owner, self.timeout).map_err(|e| match e {
            Connect::Owner(found) => Error::Owner {
                socket: self.socket.clone(),
                found,
                wanted: self.owner.unwrap_or_default(),
            },
            Connect::Io(source) if source.kind() == std::io::ErrorKind::TimedOut => timeout(),
            Connect::Io(source) => Error::Connect {
                socket: self.socket.clone(),
                source,
            },
        })?;
        let left = |deadline: Instant| {
            deadline
                .checked_duration_since(Instant::now())
                .filter(|d| !d.is_zero())
        };
        let request = format!(
            "GET {path} HTTP/1.0\r\nHost: docker\r\nUser-Agent: lookout\r\nAccept: application/json\r\n\r\n"
        );
        stream
            .set_write_timeout(Some(left(deadline).ok_or_else(timeout)?))
            .map_err(io)?;
        stream
            .write_all(request.as_bytes())
            .map_err(|e| if is_timeout(&e) { timeout() } else { io(e) })?;
        let cap = self.max_body.saturating_add(MAX_HEAD);
        let mut answer = Vec::with_capacity(16 << 10);
        let mut chunk = [0u8; 16 << 10];
        loop {
            stream
                .set_read_timeout(Some(left(deadline).ok_or_else(timeout)?))
                .map_err(io)?;
            match stream.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => {
                    if answer.len() + n > cap {
                        return Err(Error::TooLarge {
                            limit: self.max_body,
                        });
                    }
                    answer.extend_from_slice(&chunk[..n]);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if is_timeout(&e) => return Err(timeout()),
                Err(e) => return Err(io(e)),
            }
        }
        let r = parse_response(&answer)?;
        if r.body.len() > self.max_body {
            return Err(Error::TooLarge {
                limit: self.max_body,
            });
        }
        Ok(r)
    }
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// dockerd's `{"message": ...}`, or the start of the body.
fn status_error(r: &Response) -> Error {
    #[derive(Deserialize)]
    struct Message {
        message: String,
    }
    let message = serde_json::from_slice::<Message>(&r.body)
        .map(|m| m.message)
        .unwrap_or_else(|_| String::from_utf8_lossy(&r.body).into_owned());
    Error::Status {
        code: r.status,
        message: message.trim().chars().take(200).collect(),
    }
}

/// Why [`connect`] failed.
enum Connect {
    /// The socket file's owner was not the one required.
    Owner(u32),
    Io(std::io::Error),
}

impl From<std::io::Error> for Connect {
    fn from(e: std::io::Error) -> Connect {
        Connect::Io(e)
    }
}

impl From<nix::errno::Errno> for Connect {
    fn from(e: nix::errno::Errno) -> Connect {
        Connect::Io(e.into())
    }
}

/// Connects to a Unix socket within `timeout`.
///
/// With an `owner`, the socket file is opened first (`O_PATH |
/// O_NOFOLLOW`), its owner checked on that very inode, and the connection
/// made through `/proc/self/fd/<fd>`: a file swapped in after the check
/// (by whoever may write to its directory) is not the one connected to.
///
/// A blocking connect would wait as long as the listener's backlog is full
/// (a stopped or hung dockerd that does not accept), so the socket connects
/// non-blocking: a Unix socket then fails with EAGAIN at once instead, and
/// the connect is tried again every few milliseconds until the deadline.
fn connect(path: &Path, owner: Option<u32>, timeout: Duration) -> Result<UnixStream, Connect> {
    use nix::fcntl::OFlag;
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr};
    use std::os::fd::AsRawFd;
    const RETRY: Duration = Duration::from_millis(10);
    let deadline = Instant::now() + timeout;
    let file = match owner {
        Some(wanted) => {
            let fd = nix::fcntl::open(
                path,
                OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                nix::sys::stat::Mode::empty(),
            )?;
            let st = nix::sys::stat::fstat(&fd)?;
            if st.st_uid != wanted {
                return Err(Connect::Owner(st.st_uid));
            }
            use nix::sys::stat::SFlag;
            if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFSOCK {
                return Err(Connect::Io(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "not a socket",
                )));
            }
            Some(fd)
        }
        None => None,
    };
    let addr = match &file {
        Some(fd) => UnixAddr::new(format!("/proc/self/fd/{}", fd.as_raw_fd()).as_str())?,
        None => UnixAddr::new(path)?,
    };
    let socket = nix::sys::socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )?;
    loop {
        match nix::sys::socket::connect(socket.as_raw_fd(), &addr) {
            Ok(()) => break,
            Err(nix::errno::Errno::EAGAIN) => {
                let now = Instant::now();
                if now >= deadline {
                    return Err(std::io::Error::from(std::io::ErrorKind::TimedOut).into());
                }
                std::thread::sleep(RETRY.min(deadline - now));
            }
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    drop(file);
    let stream = UnixStream::from(socket);
    stream.set_nonblocking(false)?;
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_length_chunked_and_close_delimited_bodies() {
        let r =
            parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabcdef").expect("parses");
        assert_eq!(r.body, b"abc");
        let r = parse_response(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        )
        .expect("parses");
        assert_eq!(r.body, b"abcde");
        let r =
            parse_response(b"HTTP/1.0 404 Not Found\r\n\r\n{\"message\":\"no\"}").expect("parses");
        assert_eq!((r.status, &r.body[..]), (404, &b"{\"message\":\"no\"}"[..]));
    }

    #[test]
    fn malformed_answers_are_errors() {
        for bad in [
            &b""[..],
            b"HTTP/1.1 200 OK\r\nContent-Length: 3",
            b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nabc",
            b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\nabc",
            b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\nab",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcX",
            b"SSH-2.0-OpenSSH\r\n\r\n",
        ] {
            assert!(
                parse_response(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn inspect_needs_an_id_and_tolerates_nulls() {
        assert!(ContainerInfo::from_json(b"{}").is_err());
        assert!(ContainerInfo::from_json(b"[]").is_err());
        let c = ContainerInfo::from_json(
            br#"{"Id":"x","Name":"","Image":"","Config":{"Labels":null,"Image":null},"State":{"Pid":-1}}"#,
        )
        .expect("parses");
        assert_eq!(
            c,
            ContainerInfo {
                id: "x".into(),
                ..ContainerInfo::default()
            }
        );
    }

    #[test]
    fn ids_and_roots() {
        assert!(is_container_id(&"a".repeat(64)));
        assert!(!is_container_id(&"A".repeat(64)));
        assert!(!is_container_id("../../version"));
        assert!(!is_container_id(&"a".repeat(63)));
        assert!(is_docker_root(Path::new("/tmp/d/exec/runtime-crun/moby")));
        assert!(!is_docker_root(Path::new("/moby")));
        assert!(!is_docker_root(Path::new("/run/runc")));
    }
}
