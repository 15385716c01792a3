//! dockerd's answers (`GET /containers/json`, `GET /containers/{id}/json`,
//! `GET /version`): the
//! HTTP head, the body (Content-Length, chunked or to the end), and the
//! JSON in it. A hostile or broken dockerd, or whatever listens on its
//! socket, writes these bytes.
//!
//! Input: a whole HTTP answer as read until the connection closed.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(r) = lookout_docker::parse_response(data) else {
        return;
    };
    assert!(r.body.len() <= data.len());
    if let Ok(c) = lookout_docker::ContainerInfo::from_json(&r.body) {
        assert!(c.pid != Some(0));
        assert!(!c.name.as_deref().is_some_and(str::is_empty));
    }
    if let Ok(l) = lookout_docker::ContainerInfo::from_list_json(&r.body) {
        assert!(l.iter().all(|c| c.pid.is_none()));
    }
    let _ = lookout_docker::Version::from_json(&r.body);
});
