//! The client against a socket that answers as a test wants: dockerd's
//! answers, an answer too large, a daemon that accepts and says nothing,
//! and one whose backlog is full (it never accepts). A real dockerd is in
//! lookout-agent's tests/docker.rs.

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::time::{Duration, Instant};

use lookout_docker::{Client, Error};

const ID: &str = "7c5a0f2d9c3e4b1a8f6e5d4c3b2a19087f6e5d4c3b2a19087f6e5d4c3b2a1908";

/// Serves each connection with `answer(request line)`, on a thread.
fn serve(answer: impl Fn(&str) -> Vec<u8> + Send + 'static) -> (tempfile::TempDir, Client) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("docker.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(mut s) = s else { return };
            let mut req = Vec::new();
            let mut buf = [0u8; 1024];
            while !req.ends_with(b"\r\n\r\n") {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => req.extend_from_slice(&buf[..n]),
                }
            }
            let line = String::from_utf8_lossy(&req)
                .lines()
                .next()
                .unwrap_or("")
                .to_owned();
            let _ = s.write_all(&answer(&line));
        }
    });
    // Far above a loaded VM's stalls: these tests are about answers, and
    // the timeout tests below make clients of their own.
    let client = Client::new(path).timeout(Duration::from_secs(5));
    (dir, client)
}

#[test]
fn inspect_and_version_as_dockerd_answers_them() {
    let (_dir, client) = serve(|line| match line {
        l if l == format!("GET /containers/{ID}/json HTTP/1.0") => format!(
            "HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nApi-Version: 1.41\r\n\r\n\
             {{\"Id\":\"{ID}\",\"Name\":\"/web1\",\"Image\":\"sha256:5b0\",\
             \"Config\":{{\"Image\":\"localhost/bb:1\",\"Labels\":{{\"app\":\"shop\"}}}},\
             \"State\":{{\"Status\":\"running\",\"Pid\":77}}}}"
        )
        .into_bytes(),
        l if l.starts_with("GET /containers/json?all=1&filters=") => format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n\
             [{{\"Id\":\"{ID}0\",\"Names\":[\"/prefix-only\"]}},\
             {{\"Id\":\"{ID}\",\"Names\":[\"/web1\"],\"Image\":\"localhost/bb:1\",\
             \"ImageID\":\"sha256:5b0\",\"Labels\":{{\"app\":\"shop\"}},\"State\":\"created\"}}]"
        )
        .into_bytes(),
        "GET /version HTTP/1.0" => {
            let body = r#"{"Version":"20.10.24","ApiVersion":"1.41","MinAPIVersion":"1.12"}"#;
            format!(
                "HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .into_bytes()
        }
        _ => b"HTTP/1.0 404 Not Found\r\n\r\n{\"message\":\"No such container\"}".to_vec(),
    });
    let c = client.inspect(ID).expect("inspect").expect("known");
    assert_eq!(c.name.as_deref(), Some("web1"));
    assert_eq!(c.image.as_deref(), Some("localhost/bb:1"));
    assert_eq!(c.image_id.as_deref(), Some("sha256:5b0"));
    assert_eq!(c.labels.get("app").map(String::as_str), Some("shop"));
    assert_eq!((c.status.as_deref(), c.pid), (Some("running"), Some(77)));
    assert_eq!(client.inspect(&"b".repeat(64)).expect("inspect"), None);
    let f = client.find(ID).expect("find").expect("listed");
    assert_eq!(
        (f.name.as_deref(), f.image.as_deref(), f.image_id.as_deref()),
        (Some("web1"), Some("localhost/bb:1"), Some("sha256:5b0"))
    );
    assert_eq!(
        (f.labels.len(), f.status.as_deref(), f.pid),
        (1, Some("created"), None)
    );
    let v = client.version().expect("version");
    assert_eq!(
        (v.version.as_str(), v.api_version.as_str()),
        ("20.10.24", "1.41")
    );
    assert_eq!(v.min_api_version.as_deref(), Some("1.12"));
    assert!(matches!(client.inspect("../version"), Err(Error::BadId(_))));
    // A socket owned by anybody but the owner required is not asked.
    let me = nix::unistd::getuid().as_raw();
    assert!(client.clone().owner(me).version().is_ok());
    match client.owner(me + 1).version() {
        Err(Error::Owner { found, wanted, .. }) => assert_eq!((found, wanted), (me, me + 1)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_error_status_carries_dockerds_message() {
    let (_dir, client) = serve(|_| {
        b"HTTP/1.0 500 Internal Server Error\r\n\r\n{\"message\":\"disk on fire\"}".to_vec()
    });
    match client.inspect(ID) {
        Err(Error::Status { code: 500, message }) => assert_eq!(message, "disk on fire"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_answer_over_the_limit_is_refused() {
    let (_dir, client) = serve(|_| {
        let mut a = b"HTTP/1.0 200 OK\r\n\r\n".to_vec();
        a.resize(a.len() + 300_000, b' ');
        a
    });
    let client = client.max_body(100_000);
    assert!(matches!(
        client.version(),
        Err(Error::TooLarge { limit: 100_000 })
    ));
}

#[test]
fn a_daemon_that_says_nothing_costs_the_deadline_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("docker.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    // Accepts and keeps every connection, never answering.
    std::thread::spawn(move || {
        let mut kept = Vec::new();
        for s in listener.incoming().flatten() {
            kept.push(s);
        }
    });
    let client = Client::new(&path).timeout(Duration::from_millis(300));
    let t = Instant::now();
    let e = client.version().expect_err("no answer");
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(e.is_unavailable());
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
}

#[test]
fn a_full_backlog_costs_the_deadline_only() {
    use nix::sys::socket::{AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("docker.sock");
    // A listener that never accepts (a stopped dockerd), with the smallest
    // backlog: one pending connection fills it, and a blocking connect
    // after it would wait for ever.
    let listener = nix::sys::socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .expect("socket");
    nix::sys::socket::bind(
        std::os::fd::AsRawFd::as_raw_fd(&listener),
        &UnixAddr::new(&path).expect("addr"),
    )
    .expect("bind");
    nix::sys::socket::listen(&listener, Backlog::new(0).expect("backlog")).expect("listen");
    let _pending = std::os::unix::net::UnixStream::connect(&path).expect("the one pending");
    let client = Client::new(&path).timeout(Duration::from_millis(300));
    let t = Instant::now();
    let e = client.version().expect_err("never accepted");
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
}

#[test]
fn no_daemon_is_a_connect_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let e = Client::new(dir.path().join("docker.sock"))
        .version()
        .expect_err("no socket");
    assert!(
        matches!(e, Error::Connect { .. }) && e.is_unavailable(),
        "{e}"
    );
    assert!(e.to_string().contains("cannot connect to dockerd"), "{e}");
}
