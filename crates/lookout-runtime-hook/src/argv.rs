//! Parsing the command lines of OCI runtimes (runc, crun, runsc, youki) and
//! of conmon.
//!
//! The runtimes use urfave/cli (runc), getopt/argp (crun, youki) and Go's
//! `flag` package (runsc), so every flag may come as `--flag value`,
//! `--flag=value`, `-flag value` or `-flag=value`, plus a few short forms
//! (`-b`, `-d`). Unknown flags are tolerated: an unknown flag takes the
//! next word as its value unless that word is the command (before the
//! command) or the container id (the last word).

use std::path::{Path, PathBuf};

use lookout_model::RuntimeKind;

/// What a runtime invocation does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// `create`: set the container up, leave it in the created state.
    Create(CreateArgs),
    /// `run`: create and start in one go (`detach` for `-d`).
    Run(CreateArgs),
    /// `start <id>`: let a created container run its process.
    Start {
        /// The container id.
        id: String,
    },
    /// `delete <id>`.
    Delete {
        /// The container id.
        id: String,
    },
    /// The runtime re-executing itself (`runc init`, `/proc/self/exe`,
    /// a memfd copy): not a new container.
    ReExec,
    /// Anything else (`state`, `kill`, `exec`, `ps`, `--version`, ...).
    Other(String),
}

/// The arguments of `create` and `run`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CreateArgs {
    /// The container id.
    pub id: String,
    /// `--bundle`; `None` means the working directory.
    pub bundle: Option<PathBuf>,
    /// `--pid-file`.
    pub pid_file: Option<PathBuf>,
    /// `--console-socket`.
    pub console_socket: Option<PathBuf>,
    /// `--config` (crun): a config file other than `<bundle>/config.json`.
    pub config: Option<PathBuf>,
    /// `run -d`.
    pub detach: bool,
}

/// A parsed runtime command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invocation {
    /// Which runtime (from argv\[0\]'s file name, or the binary's).
    pub runtime: RuntimeKind,
    /// Global `--root` (the state directory root).
    pub root: Option<PathBuf>,
    /// Global `--log`.
    pub log: Option<PathBuf>,
    /// Global `--log-format`.
    pub log_format: Option<String>,
    /// Global `--systemd-cgroup`.
    pub systemd_cgroup: bool,
    /// The command.
    pub command: Command,
}

impl Invocation {
    /// The bundle of a create/run, with the working directory as the
    /// default and relative paths made absolute against it.
    pub fn bundle(&self, cwd: Option<&Path>) -> Option<PathBuf> {
        let args = match &self.command {
            Command::Create(a) | Command::Run(a) => a,
            _ => return None,
        };
        match (&args.bundle, cwd) {
            (Some(b), _) if b.is_absolute() => Some(b.clone()),
            (Some(b), Some(cwd)) => Some(cwd.join(b)),
            (Some(b), None) => Some(b.clone()),
            (None, cwd) => cwd.map(Path::to_path_buf),
        }
    }
}

/// A command line that cannot be understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ArgvError {
    /// argv is empty.
    #[error("empty argv")]
    Empty,
    /// `create`/`run`/`start`/`delete` without a container id.
    #[error("`{command}` without a container id")]
    MissingId {
        /// The command.
        command: String,
    },
    /// A flag that needs a value was last.
    #[error("flag {flag} needs a value")]
    MissingValue {
        /// The flag.
        flag: String,
    },
    /// The container id has characters runtimes reject.
    #[error("invalid container id {0:?}")]
    InvalidId(String),
}

const COMMANDS: &[&str] = &[
    "create",
    "run",
    "start",
    "delete",
    "kill",
    "state",
    "exec",
    "init",
    "ps",
    "pause",
    "resume",
    "events",
    "update",
    "list",
    "spec",
    "checkpoint",
    "restore",
    "features",
    "do",
    "boot",
    "gofer",
    "sandbox",
    "wait",
    "debug",
    "help",
    "mount",
    "umount",
    "exec-process",
    "kill-all",
];

const GLOBAL_BOOL: &[&str] = &[
    "debug",
    "systemd-cgroup",
    "help",
    "h",
    "version",
    "v",
    "rootless",
];
const GLOBAL_VALUE: &[&str] = &[
    "root",
    "log",
    "log-format",
    "criu",
    "cgroup-manager",
    "debug-log",
    "platform",
    "network",
    "log-level",
];
const CMD_BOOL: &[&str] = &[
    "detach",
    "d",
    "no-pivot",
    "no-new-keyring",
    "keep",
    "force",
    "f",
    "no-subreaper",
    "systemd-cgroup",
];
const CMD_VALUE: &[&str] = &[
    "bundle",
    "b",
    "pid-file",
    "console-socket",
    "preserve-fds",
    "config",
    "user-log",
    "detach-keys",
];

/// Splits `-x`, `--x`, `-x=v`, `--x=v` into (`x`, inline value).
fn flag(word: &str) -> Option<(&str, Option<&str>)> {
    let body = word.strip_prefix("--").or_else(|| word.strip_prefix('-'))?;
    if body.is_empty() {
        return None;
    }
    Some(match body.split_once('=') {
        Some((k, v)) => (k, Some(v)),
        None => (body, None),
    })
}

pub use lookout_model::valid_container_id;

/// Parses `argv` of a runtime exec. `binary_name` is the file name of the
/// binary the kernel opened (used when argv\[0\] says nothing useful).
pub fn parse(argv: &[String], binary_name: &str) -> Result<Invocation, ArgvError> {
    let arg0 = argv.first().ok_or(ArgvError::Empty)?;
    let arg0_name = Path::new(arg0)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("");
    let mut inv = Invocation {
        runtime: RuntimeKind::from_binary_name(binary_name),
        root: None,
        log: None,
        log_format: None,
        systemd_cgroup: false,
        command: Command::Other(String::new()),
    };
    if arg0 == "/proc/self/exe" || arg0.starts_with("/memfd:") || arg0_name == "runc:[2:INIT]" {
        inv.command = Command::ReExec;
        return Ok(inv);
    }

    // Global flags up to the command word.
    let mut i = 1;
    let command = loop {
        let Some(word) = argv.get(i) else {
            inv.command = Command::Other(String::new());
            return Ok(inv);
        };
        i += 1;
        let Some((name, inline)) = flag(word) else {
            break word.as_str();
        };
        if GLOBAL_BOOL.contains(&name) {
            if name == "systemd-cgroup" {
                inv.systemd_cgroup = inline.is_none_or(|v| v != "false");
            }
            continue;
        }
        let takes_value = GLOBAL_VALUE.contains(&name)
            || argv
                .get(i)
                .is_some_and(|next| !COMMANDS.contains(&next.as_str()) && flag(next).is_none());
        let value = match (inline, takes_value) {
            (Some(v), _) => Some(v.to_owned()),
            (None, true) => {
                let v = argv
                    .get(i)
                    .ok_or_else(|| ArgvError::MissingValue { flag: word.clone() })?;
                i += 1;
                Some(v.clone())
            }
            (None, false) => None,
        };
        match (name, value) {
            ("root", Some(v)) => inv.root = Some(PathBuf::from(v)),
            ("log", Some(v)) => inv.log = Some(PathBuf::from(v)),
            ("log-format", Some(v)) => inv.log_format = Some(v),
            ("cgroup-manager", Some(v)) => inv.systemd_cgroup = v == "systemd",
            _ => {}
        }
    };

    let rest = &argv[i..];
    inv.command = match command {
        "init" => Command::ReExec,
        "create" | "run" => {
            let mut args = parse_create(rest, command)?;
            if command == "run" {
                Command::Run(std::mem::take(&mut args))
            } else {
                Command::Create(args)
            }
        }
        "start" | "delete" => {
            let id = positional_id(rest, command)?;
            if command == "start" {
                Command::Start { id }
            } else {
                Command::Delete { id }
            }
        }
        other => Command::Other(other.to_owned()),
    };
    if let Command::Create(_) | Command::Run(_) = inv.command {
        // argv[0] may be a wrapper name; the binary decides the runtime.
        if matches!(inv.runtime, RuntimeKind::Other(_)) && !arg0_name.is_empty() {
            inv.runtime = RuntimeKind::from_binary_name(arg0_name);
        }
    }
    Ok(inv)
}

fn parse_create(rest: &[String], command: &str) -> Result<CreateArgs, ArgvError> {
    let mut args = CreateArgs::default();
    let mut positional = Vec::new();
    let mut j = 0;
    while j < rest.len() {
        let word = &rest[j];
        j += 1;
        if word == "--" {
            positional.extend(rest[j..].iter().cloned());
            break;
        }
        let Some((name, inline)) = flag(word) else {
            positional.push(word.clone());
            continue;
        };
        if CMD_BOOL.contains(&name) {
            if matches!(name, "detach" | "d") {
                args.detach = inline.is_none_or(|v| v != "false");
            }
            continue;
        }
        // A known value flag always takes a value; an unknown one takes the
        // next word unless that word is the last (the container id).
        let known = CMD_VALUE.contains(&name);
        let value = match inline {
            Some(v) => Some(v.to_owned()),
            None if known => {
                let v = rest
                    .get(j)
                    .ok_or_else(|| ArgvError::MissingValue { flag: word.clone() })?;
                j += 1;
                Some(v.clone())
            }
            None if j + 1 < rest.len() && flag(&rest[j]).is_none() => {
                j += 1;
                None
            }
            None => None,
        };
        match (name, value) {
            ("bundle" | "b", Some(v)) => args.bundle = Some(PathBuf::from(v)),
            ("pid-file", Some(v)) => args.pid_file = Some(PathBuf::from(v)),
            ("console-socket", Some(v)) => args.console_socket = Some(PathBuf::from(v)),
            ("config", Some(v)) => args.config = Some(PathBuf::from(v)),
            _ => {}
        }
    }
    let id = positional
        .first()
        .cloned()
        .ok_or_else(|| ArgvError::MissingId {
            command: command.to_owned(),
        })?;
    if !valid_container_id(&id) {
        return Err(ArgvError::InvalidId(id));
    }
    args.id = id;
    Ok(args)
}

fn positional_id(rest: &[String], command: &str) -> Result<String, ArgvError> {
    let id = rest
        .iter()
        .rev()
        .find(|w| flag(w).is_none())
        .cloned()
        .ok_or_else(|| ArgvError::MissingId {
            command: command.to_owned(),
        })?;
    if !valid_container_id(&id) {
        return Err(ArgvError::InvalidId(id));
    }
    Ok(id)
}

/// The fields lookout uses from a conmon command line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConmonArgs {
    /// `-c`/`--cid`.
    pub id: Option<String>,
    /// `-n`/`--name`.
    pub name: Option<String>,
    /// `-b`/`--bundle`.
    pub bundle: Option<PathBuf>,
    /// `-p`/`--container-pidfile`.
    pub pid_file: Option<PathBuf>,
    /// `-r`/`--runtime`.
    pub runtime: Option<PathBuf>,
}

/// Parses a conmon command line (glib option style: `--x v`, `--x=v`, `-x v`).
pub fn parse_conmon(argv: &[String]) -> ConmonArgs {
    let mut out = ConmonArgs::default();
    let mut i = 1;
    while i < argv.len() {
        let word = &argv[i];
        i += 1;
        let Some((name, inline)) = flag(word) else {
            continue;
        };
        let takes = matches!(
            name,
            "c" | "cid"
                | "n"
                | "name"
                | "b"
                | "bundle"
                | "p"
                | "container-pidfile"
                | "r"
                | "runtime"
        );
        if !takes {
            continue;
        }
        let value = match inline {
            Some(v) => v.to_owned(),
            None => match argv.get(i) {
                Some(v) => {
                    i += 1;
                    v.clone()
                }
                None => break,
            },
        };
        match name {
            "c" | "cid" => out.id = Some(value),
            "n" | "name" => out.name = Some(value),
            "b" | "bundle" => out.bundle = Some(value.into()),
            "p" | "container-pidfile" => out.pid_file = Some(value.into()),
            _ => out.runtime = Some(value.into()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_owned).collect()
    }

    fn create(inv: &Invocation) -> &CreateArgs {
        match &inv.command {
            Command::Create(a) | Command::Run(a) => a,
            other => panic!("not create/run: {other:?}"),
        }
    }

    #[test]
    fn containerd_shim_runc_create() {
        let a = argv(
            "runc --root /run/containerd/runc/default --log /b/log.json --log-format json create \
             --bundle /b --pid-file /b/init.pid c1",
        );
        let inv = parse(&a, "runc").expect("parses");
        assert_eq!(inv.runtime, RuntimeKind::Runc);
        assert_eq!(
            inv.root.as_deref(),
            Some(Path::new("/run/containerd/runc/default"))
        );
        assert_eq!(inv.log.as_deref(), Some(Path::new("/b/log.json")));
        assert_eq!(inv.log_format.as_deref(), Some("json"));
        let c = create(&inv);
        assert!(matches!(inv.command, Command::Create(_)));
        assert_eq!(c.id, "c1");
        assert_eq!(c.bundle.as_deref(), Some(Path::new("/b")));
        assert_eq!(c.pid_file.as_deref(), Some(Path::new("/b/init.pid")));
    }

    #[test]
    fn equals_and_short_forms() {
        let inv = parse(
            &argv("runc --root=/r create --bundle=/b --pid-file=/p c2"),
            "runc",
        )
        .expect("parses");
        assert_eq!(inv.root.as_deref(), Some(Path::new("/r")));
        assert_eq!(create(&inv).bundle.as_deref(), Some(Path::new("/b")));
        let inv = parse(&argv("runc run -d -b /bb c3"), "runc").expect("parses");
        assert!(matches!(inv.command, Command::Run(_)));
        assert!(create(&inv).detach);
        assert_eq!(create(&inv).bundle.as_deref(), Some(Path::new("/bb")));
        // Go flag style with one dash (runsc).
        let inv = parse(
            &argv("runsc -root=/var/run/runsc -platform kvm create -bundle /x -pid-file /x/p c4"),
            "runsc",
        )
        .expect("parses");
        assert_eq!(inv.root.as_deref(), Some(Path::new("/var/run/runsc")));
        assert_eq!(create(&inv).bundle.as_deref(), Some(Path::new("/x")));
        assert_eq!(create(&inv).id, "c4");
    }

    #[test]
    fn bundle_defaults_to_cwd_and_relative_is_joined() {
        let inv = parse(&argv("runc run c5"), "runc").expect("parses");
        assert_eq!(
            inv.bundle(Some(Path::new("/work"))),
            Some(PathBuf::from("/work"))
        );
        let inv = parse(&argv("runc create -b rel c6"), "runc").expect("parses");
        assert_eq!(
            inv.bundle(Some(Path::new("/work"))),
            Some(PathBuf::from("/work/rel"))
        );
        assert!(!create(&inv).detach);
    }

    #[test]
    fn globals_and_crun_spellings() {
        let inv = parse(
            &argv("crun --debug --systemd-cgroup --cgroup-manager=systemd --log=journald:x create --config /c.json --bundle /b c7"),
            "crun",
        )
        .expect("parses");
        assert!(inv.systemd_cgroup);
        assert_eq!(inv.runtime, RuntimeKind::Crun);
        assert_eq!(create(&inv).config.as_deref(), Some(Path::new("/c.json")));
    }

    #[test]
    fn unknown_flags_do_not_eat_the_id() {
        let inv =
            parse(&argv("runc create --bundle /b --some-new-bool c8"), "runc").expect("parses");
        assert_eq!(create(&inv).id, "c8");
        let inv =
            parse(&argv("runc create --some-new-opt v --bundle /b c9"), "runc").expect("parses");
        assert_eq!(create(&inv).id, "c9");
        let inv = parse(&argv("runc --some-global-bool create c10"), "runc").expect("parses");
        assert_eq!(create(&inv).id, "c10");
    }

    #[test]
    fn reexecs_and_other_commands() {
        assert_eq!(
            parse(&argv("runc init"), "runc").expect("p").command,
            Command::ReExec
        );
        assert_eq!(
            parse(&argv("/proc/self/exe init"), "runc")
                .expect("p")
                .command,
            Command::ReExec
        );
        assert_eq!(
            parse(&argv("runc --root /r start c1"), "runc")
                .expect("p")
                .command,
            Command::Start { id: "c1".into() }
        );
        assert_eq!(
            parse(&argv("runc delete --force c1"), "runc")
                .expect("p")
                .command,
            Command::Delete { id: "c1".into() }
        );
        assert_eq!(
            parse(&argv("runc state c1"), "runc").expect("p").command,
            Command::Other("state".into())
        );
        assert_eq!(
            parse(&argv("runc --version"), "runc").expect("p").command,
            Command::Other(String::new())
        );
    }

    #[test]
    fn malformed_argv_is_an_error() {
        assert_eq!(parse(&[], "runc"), Err(ArgvError::Empty));
        assert!(matches!(
            parse(&argv("runc create --bundle /b"), "runc"),
            Err(ArgvError::MissingId { .. })
        ));
        assert!(matches!(
            parse(&argv("runc create --bundle"), "runc"),
            Err(ArgvError::MissingValue { .. })
        ));
        assert!(matches!(
            parse(&argv("runc create ../../etc"), "runc"),
            Err(ArgvError::InvalidId(_))
        ));
        assert!(matches!(
            parse(&argv("runc start"), "runc"),
            Err(ArgvError::MissingId { .. })
        ));
    }

    #[test]
    fn conmon_arguments() {
        let c = parse_conmon(&argv(
            "conmon --api-version 1 -c abc -n k8s_x --bundle=/b -p /b/pidfile -r /usr/bin/runc --exit-dir /e",
        ));
        assert_eq!(c.id.as_deref(), Some("abc"));
        assert_eq!(c.name.as_deref(), Some("k8s_x"));
        assert_eq!(c.bundle.as_deref(), Some(Path::new("/b")));
        assert_eq!(c.pid_file.as_deref(), Some(Path::new("/b/pidfile")));
        assert_eq!(c.runtime.as_deref(), Some(Path::new("/usr/bin/runc")));
    }
}
