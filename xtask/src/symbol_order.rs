//! `cargo xtask symbol-order`: makes the list of the functions the agent's
//! start-up and a few containers touch (`deploy/symbol-order.x86_64`), on
//! a running agent whose binary was dropped from the page cache with the
//! disk's readahead off, so that the pages resident after are exactly the
//! ones touched; `--check` measures what the current list costs. Why, and
//! how the list is used at link time: [`crate::link_order`].

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::link_order::{ORDER_FILE, key, linker_order, listed_bodies, text_symbols};
use crate::util::{is_root, output, say, workspace_root};

#[derive(Debug, clap::Args)]
pub struct Options {
    /// Containers run through the agent after start-up (their code is laid
    /// out with it).
    #[arg(long, default_value_t = 30)]
    containers: u32,
    /// Write nothing: run the image's agent (readahead as it is) and fail
    /// when more than [`STALE_KIB`] of its text is resident outside the
    /// region the list laid out: the list is stale.
    #[arg(long)]
    check: bool,
}

/// Puts the disk's readahead back when dropped.
struct Readahead {
    path: PathBuf,
    old: String,
    /// Where `path` and `old` are kept until restored.
    saved: PathBuf,
}

impl Readahead {
    /// Turns readahead off for the disk that holds `file`. What it was is
    /// written to `saved` first: a run killed before it restored it
    /// (SIGKILL, or a signal xtask does not catch) is restored by the next.
    fn off_for(file: &Path, saved: &Path) -> anyhow::Result<Readahead> {
        if let Ok(text) = std::fs::read_to_string(saved)
            && let Some((path, old)) = text.split_once('\n')
        {
            say(
                "symbol-order",
                &format!("restoring {path} to {old}, which an earlier run left off"),
            );
            std::fs::write(path, old.trim()).with_context(|| format!("restoring {path}"))?;
            std::fs::remove_file(saved)?;
        }
        use std::os::unix::fs::MetadataExt;
        let dev = std::fs::metadata(file)?.dev();
        let (major, minor) = (libc::major(dev), libc::minor(dev));
        let block = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
        // A partition's queue is its disk's.
        let path = [block.join("queue"), block.join("../queue")]
            .into_iter()
            .map(|q| q.join("read_ahead_kb"))
            .find(|p| p.exists())
            .with_context(|| {
                format!(
                    "no read_ahead_kb for {} (device {major}:{minor}): the target directory must be \
                     on a block device's file system (not tmpfs, overlay, btrfs or NFS)",
                    file.display()
                )
            })?;
        let old = std::fs::read_to_string(&path)?.trim().to_owned();
        if old == "0" {
            bail!(
                "{} is 0 already: set it back to what it was (often 128) and run again",
                path.display()
            );
        }
        std::fs::write(saved, format!("{}\n{old}", path.display()))?;
        std::fs::write(&path, "0").with_context(|| format!("writing {}", path.display()))?;
        Ok(Readahead {
            path,
            old,
            saved: saved.to_path_buf(),
        })
    }
}

impl Drop for Readahead {
    fn drop(&mut self) {
        match std::fs::write(&self.path, &self.old) {
            Ok(()) => {
                let _ = std::fs::remove_file(&self.saved);
            }
            Err(e) => say(
                "symbol-order",
                &format!(
                    "could not restore {} to {} (the next run will): {e}",
                    self.path.display(),
                    self.old
                ),
            ),
        }
    }
}

/// The agent `generate` runs: stopped when dropped, whatever went wrong.
struct Agent(std::process::Child);

impl Drop for Agent {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_some() {
            return;
        }
        // SAFETY: a signal to our own child, not reaped yet.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.0.try_wait().ok().flatten().is_none() {
            if Instant::now() > deadline {
                let _ = self.0.kill();
                let _ = self.0.wait();
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// A container `generate` made: deleted when dropped (a step failed).
struct Deleted<'a>(&'a str);

impl Drop for Deleted<'_> {
    fn drop(&mut self) {
        let _ = Command::new("runc")
            .args(["delete", "-f", self.0])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// Drops `file` from the page cache.
fn evict(file: &Path) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(file)?;
    f.sync_all()?;
    // SAFETY: an open descriptor, and advice that only drops cached pages.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        bail!("posix_fadvise: {}", std::io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

/// The addresses (in the binary's own terms) of the resident pages of
/// `binary`'s executable mapping in process `pid`.
fn resident_text(pid: u32, binary: &Path) -> anyhow::Result<Vec<u64>> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    let name = binary.file_name().context("a file name")?;
    let mut bias = None;
    let mut text = None;
    for line in maps.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 6 || Path::new(f[5]).file_name() != Some(name) {
            continue;
        }
        let (lo, hi) = f[0].split_once('-').context("a range")?;
        let (lo, hi) = (u64::from_str_radix(lo, 16)?, u64::from_str_radix(hi, 16)?);
        // A PIE's first segment has address 0: where it is mapped is the
        // load bias.
        if f[2].trim_start_matches('0').is_empty() {
            bias.get_or_insert(lo);
        }
        if f[1] == "r-xp" {
            text = Some((lo, hi));
        }
    }
    let (bias, (lo, hi)) = (
        bias.context("no mapping at offset 0")?,
        text.context("no text mapping")?,
    );
    let mut pagemap = std::fs::File::open(format!("/proc/{pid}/pagemap"))?;
    pagemap.seek(SeekFrom::Start(lo / 4096 * 8))?;
    let mut entries = vec![0u8; ((hi - lo) / 4096 * 8) as usize];
    pagemap.read_exact(&mut entries)?;
    Ok(entries
        .chunks_exact(8)
        .enumerate()
        .filter(|(_, e)| e[7] & 0x80 != 0)
        .map(|(i, _)| lo + i as u64 * 4096 - bias)
        .collect())
}

/// `cargo xtask symbol-order`: builds the image's agent (laid out with the
/// list there is, if any), runs it as above, and writes the list anew.
/// Each run on a laid-out binary narrows the list: the functions were
/// chosen by the page they sat on, and laid out together, the untouched
/// pages among them now drop theirs. With `--check`, writes nothing and
/// fails when the list is stale ([`check`]).
pub fn generate(opts: &Options) -> anyhow::Result<()> {
    if !is_root() {
        bail!(
            "run as root: the agent runs, its binary is dropped from the page cache, and the \
             disk's readahead is changed for a minute (not with --check)"
        );
    }
    crate::build_ebpf::build_ebpf(&crate::build_ebpf::Options {
        toolchain: "nightly".into(),
    })?;
    crate::image::build(&crate::image::Options::default(), "build")?;
    let root = workspace_root();
    // The x86_64 binary with its symbols (the image holds it stripped).
    let binary = root.join("target/image/build/x86_64-unknown-linux-gnu/release/lookout");
    let work = root.join("target/symbol-order");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;

    if opts.check {
        return check(&binary, &work, opts.containers);
    }
    let pages = resident_pages(&binary, &work, opts.containers, false)?;

    let syms = text_symbols("nm", &binary)?;
    let touched: std::collections::HashSet<u64> = pages.iter().map(|p| p / 4096).collect();
    let mut keys = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for s in &syms {
        let (first, last) = (s.addr / 4096, (s.addr + s.size.max(1) - 1) / 4096);
        if (first..=last).any(|p| touched.contains(&p)) && seen.insert(key(&s.name)) {
            keys.push(key(&s.name));
        }
    }
    let mut text = format!(
        "# Functions on the {} text pages ({} KiB) that `lookout run` touched in start-up and\n\
         # {} containers, as FNV-1a hashes of their v0 names without crate hashes: see\n\
         # xtask/src/link_order.rs.\n\
         # Made by `cargo xtask symbol-order` (root); {} keys.\n",
        touched.len(),
        touched.len() * 4,
        opts.containers,
        keys.len()
    );
    for k in &keys {
        text.push_str(&format!("{k:016x}\n"));
    }
    let out = root.join(ORDER_FILE);
    std::fs::write(&out, text)?;
    say(
        "symbol-order",
        &format!(
            "{} text pages touched ({} KiB); {} functions written to {}",
            touched.len(),
            touched.len() * 4,
            keys.len(),
            out.display()
        ),
    );
    Ok(())
}

/// Above this much of the agent's text resident outside the region the
/// list laid out, `--check` fails: the list is stale. Measured on the
/// image's agent after start-up and 30 containers, page cache dropped,
/// readahead as the node has it (docs/benchmarks.md, fifteenth pass): a
/// list made for the build leaves 108-176 KiB outside (the fault-around
/// window past the region's end, and a few paths a run may or may not
/// take); the list made before three commits to the answering thread left
/// 680-1020 KiB (0.6-0.8 MB more idle RSS); the one before that 1.3-1.4 MB.
pub const STALE_KIB: u64 = 512;

/// `--check`: runs the laid-out `binary` as a node would (readahead on)
/// and fails when more than [`STALE_KIB`] of its text is resident outside
/// the region the list laid out, naming the functions on those pages.
/// Readahead makes that figure vary from run to run (680 and 1020 KiB for
/// the same stale list), so a run above the limit is followed by a second
/// one, and the smaller figure decides: a list is called stale only when
/// two runs say so.
fn check(binary: &Path, work: &Path, containers: u32) -> anyhow::Result<()> {
    let Some(order) = linker_order("nm", binary, work)? else {
        bail!("no {ORDER_FILE}: run `sudo -E cargo xtask symbol-order` to make it");
    };
    let (start, bodies) = listed_bodies("nm", binary, &order.file)?;
    let end = start + bodies.values().sum::<u64>();
    let run = || -> anyhow::Result<Vec<u64>> {
        let pages = resident_pages(binary, work, containers, true)?;
        let outside: Vec<u64> = pages
            .iter()
            .copied()
            .filter(|p| *p + 4096 <= start || *p >= end)
            .collect();
        say(
            "symbol-order",
            &format!(
                "{} KiB of text resident; the list ({} of its {} keys found) laid out {} KiB; \
                 {} KiB resident outside it (the check fails above {STALE_KIB} KiB)",
                pages.len() * 4,
                order.keys_found,
                order.keys,
                (end - start) / 1024,
                outside.len() * 4,
            ),
        );
        Ok(outside)
    };
    let mut outside = run()?;
    if outside.len() as u64 * 4 > STALE_KIB {
        say("symbol-order", "above the limit: a second run decides");
        let again = run()?;
        if again.len() < outside.len() {
            outside = again;
        }
    }
    let outside_kib = outside.len() as u64 * 4;
    if outside.is_empty() {
        return Ok(());
    }
    // Name what runs outside: the demangled functions on those pages.
    let demangled = output(
        Command::new("nm")
            .args(["-n", "-S", "--defined-only", "-C"])
            .arg(binary),
    )
    .context("nm -C")?;
    let pages: std::collections::HashSet<u64> = outside.iter().map(|p| p / 4096).collect();
    let mut names = Vec::new();
    for line in demangled.lines() {
        let mut f = line.splitn(4, ' ');
        if let (Some(addr), Some(size), Some(_), Some(name)) =
            (f.next(), f.next(), f.next(), f.next())
            && let (Ok(addr), Ok(size)) =
                (u64::from_str_radix(addr, 16), u64::from_str_radix(size, 16))
            && (addr / 4096..=(addr + size.max(1) - 1) / 4096).any(|p| pages.contains(&p))
        {
            names.push(name.to_owned());
        }
    }
    names.dedup();
    let shown = 20.min(names.len());
    if outside_kib <= STALE_KIB {
        say(
            "symbol-order",
            &format!(
                "{} functions on the pages outside (not all of them ran), the first {shown}:\n  {}",
                names.len(),
                names[..shown].join("\n  ")
            ),
        );
        return Ok(());
    }
    bail!(
        "{ORDER_FILE} is stale: {outside_kib} KiB of the agent's text was resident outside the \
         region it lays out (limit {STALE_KIB}), memory every agent pays. Make the list again: \
         `sudo -E cargo xtask symbol-order`, and commit it. {} functions on those pages (a page \
         holds several; not all of them ran), the first {shown}:\n  {}",
        names.len(),
        names[..shown].join("\n  ")
    )
}

/// The text pages (addresses in `binary`'s own terms) of the agent
/// `binary` resident after start-up and `containers` containers, with the
/// binary dropped from the page cache first. With `readahead` false the
/// disk's readahead is off meanwhile, so that each fault maps exactly the
/// page it needs: the pages touched. With it true, what a node pays.
fn resident_pages(
    binary: &Path,
    work: &Path,
    containers: u32,
    readahead: bool,
) -> anyhow::Result<Vec<u64>> {
    let root = workspace_root();
    let bundle = work.join("bundle");
    lookout_bench::busybox_bundle(&bundle, &["true"])?;
    let _readahead = if readahead {
        None
    } else {
        Some(Readahead::off_for(
            binary,
            &root.join("target/symbol-order.readahead"),
        )?)
    };
    evict(binary)?;
    // The agent pins its container maps as on a node (a BPF file system of
    // this run's own), so that their code is laid out with the rest.
    let _pins = PrivateBpffs::mount(&work.join("bpffs"));
    let err = work.join("agent.err");
    let mut agent = Agent(
        Command::new(binary)
            .args(["run", "--output", "json"])
            .env("LOOKOUT_BPF_PIN_DIR", work.join("bpffs/lookout"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&err)?)
            .spawn()
            .context("starting the agent")?,
    );
    let agent = &mut agent.0;
    (|| {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !std::fs::read_to_string(&err)?.contains("::run: ready") {
            if Instant::now() > deadline || agent.try_wait()?.is_some() {
                bail!(
                    "the agent never became ready:\n{}",
                    std::fs::read_to_string(&err)?
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let bs = bundle.to_str().context("UTF-8 path")?;
        for i in 0..containers {
            let id = format!("symbol-order-{}-{i}", std::process::id());
            let gone = Deleted(&id);
            for args in [
                &["create", "--bundle", bs, &id][..],
                &["start", &id],
                &["delete", "-f", &id],
            ] {
                let st = Command::new("runc")
                    .args(args)
                    .stdout(Stdio::null())
                    .status()?;
                if !st.success() {
                    bail!("runc {args:?} failed");
                }
            }
            // Deleted by its own `delete`.
            std::mem::forget(gone);
        }
        // The last exits and their events.
        std::thread::sleep(Duration::from_millis(500));
        resident_text(agent.id(), binary)
    })()
}

/// A BPF file system mounted at a directory of the run's own, unmounted
/// when dropped; nothing if it cannot be mounted (the agent then runs
/// without maps, as it says).
struct PrivateBpffs(Option<std::path::PathBuf>);

impl PrivateBpffs {
    fn mount(dir: &std::path::Path) -> PrivateBpffs {
        let _ = std::fs::create_dir_all(dir);
        let ok = Command::new("mount")
            .args(["-t", "bpf", "bpf"])
            .arg(dir)
            .status()
            .is_ok_and(|s| s.success());
        PrivateBpffs(ok.then(|| dir.to_path_buf()))
    }
}

impl Drop for PrivateBpffs {
    fn drop(&mut self) {
        if let Some(dir) = self.0.take() {
            let _ = Command::new("umount").arg("-l").arg(&dir).status();
        }
    }
}
