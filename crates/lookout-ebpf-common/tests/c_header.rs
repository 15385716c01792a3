//! `include/lookout.h` against the Rust definitions: the C compiler says
//! what every size, offset and constant is, and each must equal ours.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use lookout_ebpf_common as common;

/// What the C side says, as `name value` lines.
const PROGRAM: &str = r#"
#include <stddef.h>
#include <stdio.h>
#include "lookout.h"
#define SHOW(name, value) printf("%s %llu\n", name, (unsigned long long)(value))
#define FIELD(f) SHOW("offset." #f, offsetof(struct lookout_container, f)); \
                 SHOW("size." #f, sizeof(((struct lookout_container *)0)->f))
int main(void) {
    SHOW("size", sizeof(struct lookout_container));
    SHOW("align", _Alignof(struct lookout_container));
    FIELD(version); FIELD(kind); FIELD(runtime); FIELD(id_len); FIELD(flags); FIELD(pad);
    FIELD(pid_ns); FIELD(cgroup_id); FIELD(mnt_ns); FIELD(id); FIELD(reserved);
    SHOW("LOOKOUT_CONTAINER_VERSION", LOOKOUT_CONTAINER_VERSION);
    SHOW("LOOKOUT_CONTAINER_ID_LEN", LOOKOUT_CONTAINER_ID_LEN);
    SHOW("LOOKOUT_CONTAINER_ID_TRUNCATED", LOOKOUT_CONTAINER_ID_TRUNCATED);
    SHOW("LOOKOUT_CONTAINER_MAPS_MAX_ENTRIES", LOOKOUT_CONTAINER_MAPS_MAX_ENTRIES);
    SHOW("LOOKOUT_CONTAINER_MAPS_FLAGS", LOOKOUT_CONTAINER_MAPS_FLAGS);
    SHOW("LOOKOUT_KIND_UNKNOWN", LOOKOUT_KIND_UNKNOWN);
    SHOW("LOOKOUT_KIND_REGULAR", LOOKOUT_KIND_REGULAR);
    SHOW("LOOKOUT_KIND_INIT", LOOKOUT_KIND_INIT);
    SHOW("LOOKOUT_KIND_EPHEMERAL", LOOKOUT_KIND_EPHEMERAL);
    SHOW("LOOKOUT_KIND_SANDBOX", LOOKOUT_KIND_SANDBOX);
    SHOW("LOOKOUT_RUNTIME_OTHER", LOOKOUT_RUNTIME_OTHER);
    SHOW("LOOKOUT_RUNTIME_RUNC", LOOKOUT_RUNTIME_RUNC);
    SHOW("LOOKOUT_RUNTIME_CRUN", LOOKOUT_RUNTIME_CRUN);
    SHOW("LOOKOUT_RUNTIME_RUNSC", LOOKOUT_RUNTIME_RUNSC);
    SHOW("LOOKOUT_RUNTIME_YOUKI", LOOKOUT_RUNTIME_YOUKI);
    SHOW("LOOKOUT_RUNTIME_CONMON", LOOKOUT_RUNTIME_CONMON);
    printf("dir %s\n", LOOKOUT_CONTAINER_MAPS_DIR);
    printf("by_cgroup %s\n", LOOKOUT_CONTAINERS_BY_CGROUP);
    printf("by_mntns %s\n", LOOKOUT_CONTAINERS_BY_MNTNS);
    return 0;
}
"#;

fn in_ci() -> bool {
    std::env::var_os("CI").is_some_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// Compiles and runs [`PROGRAM`]; `None` (after a loud SKIPPED line, and a
/// failure under CI) when there is no C compiler.
fn c_says() -> Option<BTreeMap<String, String>> {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let dir = std::env::temp_dir().join(format!("lookout-h-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temporary directory");
    let src = dir.join("check.c");
    let bin = dir.join("check");
    std::fs::write(&src, PROGRAM).expect("write check.c");
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("include");
    let built = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Werror", "-Wpadded", "-I"])
        .arg(&include)
        .arg(&src)
        .arg("-o")
        .arg(&bin)
        .output();
    let built = match built {
        Ok(out) => out,
        Err(e) => {
            let why = format!("no C compiler `{cc}` ({e}): install gcc");
            assert!(!in_ci(), "c_header: prerequisite missing under CI: {why}");
            eprintln!("\n!!! SKIPPED c_header: {why}\n");
            return None;
        }
    };
    assert!(
        built.status.success(),
        "lookout.h does not compile cleanly (-Wall -Werror -Wpadded):\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let out = Command::new(&bin).output().expect("run the check program");
    assert!(out.status.success());
    let _ = std::fs::remove_dir_all(&dir);
    let text = String::from_utf8(out.stdout).expect("ASCII output");
    Some(
        text.lines()
            .filter_map(|l| l.split_once(' '))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
    )
}

#[test]
fn header_matches_the_rust_struct() {
    use common::ContainerEntry as E;
    use std::mem::{offset_of, size_of, size_of_val};
    let Some(c) = c_says() else { return };
    let e = E::new(b"");
    let mut want: Vec<(&str, u64)> = vec![
        ("size", E::SIZE as u64),
        ("align", std::mem::align_of::<E>() as u64),
    ];
    macro_rules! field {
        ($f:ident) => {
            want.push((concat!("offset.", stringify!($f)), offset_of!(E, $f) as u64));
            want.push((concat!("size.", stringify!($f)), size_of_val(&e.$f) as u64));
        };
    }
    field!(version);
    field!(kind);
    field!(runtime);
    field!(id_len);
    field!(flags);
    field!(pad);
    field!(pid_ns);
    field!(cgroup_id);
    field!(mnt_ns);
    field!(id);
    field!(reserved);
    want.extend([
        (
            "LOOKOUT_CONTAINER_VERSION",
            u64::from(common::CONTAINER_ENTRY_VERSION),
        ),
        ("LOOKOUT_CONTAINER_ID_LEN", common::CONTAINER_ID_LEN as u64),
        (
            "LOOKOUT_CONTAINER_ID_TRUNCATED",
            u64::from(common::CONTAINER_ENTRY_ID_TRUNCATED),
        ),
        (
            "LOOKOUT_CONTAINER_MAPS_MAX_ENTRIES",
            u64::from(common::CONTAINER_MAPS_MAX_ENTRIES),
        ),
        (
            "LOOKOUT_CONTAINER_MAPS_FLAGS",
            u64::from(common::CONTAINER_MAPS_FLAGS),
        ),
        (
            "LOOKOUT_KIND_UNKNOWN",
            u64::from(common::CONTAINER_KIND_UNKNOWN),
        ),
        (
            "LOOKOUT_KIND_REGULAR",
            u64::from(common::CONTAINER_KIND_REGULAR),
        ),
        ("LOOKOUT_KIND_INIT", u64::from(common::CONTAINER_KIND_INIT)),
        (
            "LOOKOUT_KIND_EPHEMERAL",
            u64::from(common::CONTAINER_KIND_EPHEMERAL),
        ),
        (
            "LOOKOUT_KIND_SANDBOX",
            u64::from(common::CONTAINER_KIND_SANDBOX),
        ),
        ("LOOKOUT_RUNTIME_OTHER", u64::from(common::RUNTIME_OTHER)),
        ("LOOKOUT_RUNTIME_RUNC", u64::from(common::RUNTIME_RUNC)),
        ("LOOKOUT_RUNTIME_CRUN", u64::from(common::RUNTIME_CRUN)),
        ("LOOKOUT_RUNTIME_RUNSC", u64::from(common::RUNTIME_RUNSC)),
        ("LOOKOUT_RUNTIME_YOUKI", u64::from(common::RUNTIME_YOUKI)),
        ("LOOKOUT_RUNTIME_CONMON", u64::from(common::RUNTIME_CONMON)),
    ]);
    assert_eq!(size_of::<E>(), E::SIZE);
    for (name, value) in want {
        assert_eq!(
            c.get(name).map(String::as_str),
            Some(value.to_string().as_str()),
            "lookout.h and ContainerEntry differ in {name}"
        );
    }
    assert_eq!(c["dir"], common::CONTAINER_MAPS_DIR);
    assert_eq!(c["by_cgroup"], common::CONTAINERS_BY_CGROUP_MAP);
    assert_eq!(c["by_mntns"], common::CONTAINERS_BY_MNTNS_MAP);
}
