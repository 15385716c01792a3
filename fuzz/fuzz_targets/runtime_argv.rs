//! The runtime and conmon command-line parsers: argv comes from whoever
//! exec'd the runtime binary.
//!
//! Input: a first byte, then either (even) argv as `/proc/PID/cmdline`
//! has it, NUL-separated, the binary's name from argv[0]; or (odd) a
//! structured input (`arbitrary`).
#![no_main]

use std::path::Path;

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use lookout_runtime_hook::argv::{self, Command};

#[derive(Arbitrary, Debug)]
struct Input {
    binary: String,
    argv: Vec<String>,
    cwd: Option<String>,
}

fn check(binary: &str, args: &[String], cwd: Option<&str>) {
    if let Ok(inv) = argv::parse(args, binary) {
        match &inv.command {
            Command::Create(c) | Command::Run(c) => {
                // An id that reaches the hook is one runc would accept: it
                // becomes a path component of the state directory.
                assert!(argv::valid_container_id(&c.id), "{:?}", c.id);
                let cwd = cwd.map(Path::new);
                if let Some(b) = inv.bundle(cwd)
                    && cwd.is_some_and(Path::is_absolute)
                {
                    assert!(b.is_absolute(), "{b:?}");
                }
            }
            Command::Start { id } | Command::Delete { id } => {
                assert!(argv::valid_container_id(id), "{id:?}");
            }
            _ => {}
        }
    }
    let _ = argv::parse_conmon(args);
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 2 == 0 {
        let args: Vec<String> = rest
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let binary = args
            .first()
            .and_then(|a| Path::new(a).file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        check(&binary, &args, Some("/run/bundle"));
    } else if let Ok(i) = Input::arbitrary_take_rest(Unstructured::new(rest)) {
        check(&i.binary, &i.argv, i.cwd.as_deref());
    }
});
