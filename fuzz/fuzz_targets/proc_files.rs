//! What the agent reads of a container's init in /proc to report it:
//! `uid_map` and `gid_map` (written by whoever made the user namespace,
//! within the kernel's rules) and the `cgroup` file (whose paths hold
//! cgroup names a delegated user may choose).
//!
//! Input: a first byte (odd: a map file, even: a cgroup file), then the
//! file's bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lookout_host::kernel::{IdMapError, parse_cgroup_v2, parse_id_map};
use lookout_host::proc::parse_cgroup;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest);
    if mode % 2 == 1 {
        match parse_id_map(&text, "uid_map") {
            Ok(maps) => {
                assert!(maps.len() <= text.lines().count());
                for m in maps {
                    // No range passes the 32-bit id space on either side.
                    assert!(u64::from(m.container_id) + u64::from(m.size) <= 1 << 32);
                    assert!(u64::from(m.host_id) + u64::from(m.size) <= 1 << 32);
                }
            }
            Err(IdMapError::Malformed { line, .. }) => {
                assert!(line >= 1 && line <= text.lines().count());
            }
            Err(e) => panic!("a parse fails only on a malformed line: {e}"),
        }
    } else {
        // Both paths are a line's own text, after its prefix.
        if let Some(v2) = parse_cgroup_v2(&text) {
            assert!(text.lines().any(|l| l.strip_prefix("0::") == Some(v2)));
        }
        if let Some(path) = parse_cgroup(&text) {
            assert!(path != "/");
            assert!(text.lines().any(|l| l.ends_with(path.as_str())));
        }
    }
});
