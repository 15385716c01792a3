//! The agent's start-up and per-container code laid out together in its
//! binary (`cargo xtask symbol-order`, and the link step of `cargo xtask
//! image`).
//!
//! Why: most of the idle agent's resident memory is its own binary's text.
//! The kernel maps an executable's pages 64 KiB at a time around each page
//! fault (fault-around), and the few thousand functions that start-up and a
//! container run are scattered over 14 MB of text, so about 8 MB of it ends
//! up resident although about 3 MB is ever executed. lld's
//! `--symbol-ordering-file` puts listed functions first in `.text`, in the
//! order given: the executed code then sits in a few hundred pages.
//!
//! The list (`deploy/symbol-order.x86_64`) is made on a running agent: its
//! binary is dropped from the page cache and the disk's readahead turned
//! off, so that each fault maps the one page it needs, and the pages
//! resident after start-up and a few containers are exactly the ones
//! touched. The functions on those pages are stored as 64-bit FNV-1a hashes
//! of their v0-mangled names with the crate hashes taken out (see [`key`]),
//! and mapped to the symbols of each build at link time. A function the
//! list does not name is laid out as before, and a list that names nothing
//! of a build, or a linker that is not lld, only skips the layout (with a
//! warning): a stale list costs memory, never a build or correctness.
//!
//! How well a list survives (docs/benchmarks.md, tenth pass): a
//! `cargo update` of 12 packages (clap, h2, hyper among them) kept 98.8 % of
//! its keys (98.9 % for the build it was made from); a toolchain two
//! releases newer (nightly 1.97 against stable 1.95) kept 84.8 %. The image
//! build says how many of the list's keys it found, and warns below
//! [`STALE_BELOW`]: make the list again when the toolchain moves.
//!
//! That share says little about the cost, though: each hot function the
//! list misses is faulted in with the 64 KiB around it, wherever it lies.
//! A list that still found 7165 of its 7228 keys (99.1 %) after two
//! passes of changes to the answering thread left the idle agent at
//! 10.2-10.4 MB; made again, 7.6 MB (docs/benchmarks.md, fourteenth pass).
//! Make it again after any change to code that start-up or a container
//! runs. `cargo xtask symbol-order --check` (CI runs it) measures what a
//! list costs instead: the agent's text resident outside the region the
//! list laid out, after start-up and 30 containers. It fails above
//! [`STALE_KIB`] and names the functions on those pages.

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::util::{is_root, output, say, workspace_root};

/// The list for x86_64 builds, relative to the workspace root. (arm64's
/// agent is linked by GNU ld, which has no `--symbol-ordering-file`.)
pub const ORDER_FILE: &str = "deploy/symbol-order.x86_64";

/// The symbol mangling every build that uses the list needs: v0 names keep
/// a generic function's type arguments, so each instance has a name of its
/// own (legacy names tell instances apart only by hash).
pub const MANGLING: &str = "-Csymbol-mangling-version=v0";

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

/// A function in a binary: address, size, name.
struct Symbol {
    addr: u64,
    size: u64,
    name: String,
}

/// The text symbols of `binary`, by address (`nm`).
fn text_symbols(nm: &str, binary: &Path) -> anyhow::Result<Vec<Symbol>> {
    let out = output(
        Command::new(nm)
            .args(["-n", "-S", "--defined-only"])
            .arg(binary),
    )
    .with_context(|| format!("{nm} {} (install binutils)", binary.display()))?;
    let mut syms = Vec::new();
    for line in out.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if let [addr, size, kind, name] = f[..]
            && matches!(kind, "t" | "T" | "w" | "W")
            && let (Ok(addr), Ok(size)) =
                (u64::from_str_radix(addr, 16), u64::from_str_radix(size, 16))
        {
            syms.push(Symbol {
                addr,
                size,
                name: name.to_owned(),
            });
        }
    }
    Ok(syms)
}

/// What a symbol is known by in the list: its name without what changes
/// from build to build, hashed (64-bit FNV-1a). For a v0 name, its crate
/// hashes (`Cs<base-62>_`) go; the rest still tells apart two instances
/// of a generic function with the same demangled name (instantiated in
/// two crates). A legacy name (the standard library's own functions) loses
/// its trailing hash, any name its `.llvm.<n>` suffix.
fn key(symbol: &str) -> u64 {
    let symbol = symbol.split_once(".llvm.").map_or(symbol, |(s, _)| s);
    let stable = if symbol.starts_with("_R") {
        without_crate_hashes(symbol)
    } else if let Some(path) = symbol
        .strip_suffix('E')
        .and_then(|s| s.get(..s.len().checked_sub(19)?))
        .filter(|_| symbol.starts_with("_ZN") && symbol[symbol.len() - 20..].starts_with("17h"))
    {
        format!("{path}E")
    } else {
        symbol.to_owned()
    };
    fnv(stable.as_bytes())
}

/// 64-bit FNV-1a.
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// `name` with every `Cs<base-62>_` made `Cs_`. (An identifier that
/// itself holds such a run, `Cs9_x`, is changed too: two such names may
/// share a key, which costs at most a function laid out with the hot ones.)
fn without_crate_hashes(name: &str) -> String {
    let b = name.as_bytes();
    let mut out = String::with_capacity(name.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"Cs") {
            let digits = b[i + 2..]
                .iter()
                .take_while(|c| c.is_ascii_alphanumeric())
                .count();
            if digits > 0 && b.get(i + 2 + digits) == Some(&b'_') {
                out.push_str("Cs_");
                i += 3 + digits;
                continue;
            }
        }
        out.push(char::from(b[i]));
        i += 1;
    }
    out
}

/// The list's keys, in order. `None` when there is no list.
fn read_list(root: &Path) -> anyhow::Result<Option<Vec<u64>>> {
    let path = root.join(ORDER_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let mut keys = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        keys.push(
            u64::from_str_radix(line, 16).with_context(|| {
                format!("{}:{}: not a hex key: {line:?}", path.display(), n + 1)
            })?,
        );
    }
    Ok(Some(keys))
}

/// Below this share of the list's keys found in a build, the image build
/// warns that the list is stale.
pub const STALE_BELOW: f64 = 0.9;

/// The linker's ordering file for one build ([`linker_order`]).
#[derive(Debug)]
pub struct LinkerOrder {
    /// The file.
    pub file: PathBuf,
    /// The symbols it names (a key may name several).
    pub symbols: usize,
    /// The list's keys that name a function of the build.
    pub keys_found: usize,
    /// The list's keys.
    pub keys: usize,
}

impl LinkerOrder {
    /// The share of the list's keys found in the build.
    pub fn coverage(&self) -> f64 {
        self.keys_found as f64 / self.keys.max(1) as f64
    }
}

/// Writes the linker's ordering file for `binary` (a build of the same
/// sources) into `dir`: the symbols the list names, in its order. `None`
/// when there is no list. The file is named after its contents: cargo
/// tells link arguments apart, not the files they name, so a new list must
/// be a new argument.
pub fn linker_order(nm: &str, binary: &Path, dir: &Path) -> anyhow::Result<Option<LinkerOrder>> {
    let Some(keys) = read_list(&workspace_root())? else {
        return Ok(None);
    };
    let rank: HashMap<u64, usize> = keys.iter().enumerate().map(|(i, k)| (*k, i)).collect();
    let mut found: Vec<(usize, String)> = text_symbols(nm, binary)?
        .into_iter()
        .filter_map(|s| rank.get(&key(&s.name)).map(|r| (*r, s.name)))
        .collect();
    found.sort();
    let mut keys_found = 0;
    let mut text = String::new();
    for (i, (rank, name)) in found.iter().enumerate() {
        if i == 0 || found[i - 1].0 != *rank {
            keys_found += 1;
        }
        text.push_str(name);
        text.push('\n');
    }
    let file = dir.join(format!("symbol-order-{:016x}.txt", fnv(text.as_bytes())));
    std::fs::write(&file, text).with_context(|| format!("writing {}", file.display()))?;
    Ok(Some(LinkerOrder {
        file,
        symbols: found.len(),
        keys_found,
        keys: keys.len(),
    }))
}

/// Whether `binary` was linked with ordering file `order`: nine in ten of
/// the functions it names lie at the start of the text, within their own
/// total size of it. (Not all: LLVM merges identical functions into one
/// body with several names, and a name the file does not give can share
/// the body of one it does.)
pub fn is_laid_out(nm: &str, binary: &Path, order: &Path) -> anyhow::Result<bool> {
    let (start, bodies) = listed_bodies(nm, binary, order)?;
    let size: u64 = bodies.values().sum();
    let first = bodies.keys().filter(|a| **a < start + size).count();
    Ok(!bodies.is_empty() && first * 10 >= bodies.len() * 9)
}

/// The start of `binary`'s text, and the bodies (address, size) of the
/// functions the list `order` names: one per address, since identical
/// code folding gives one body several names.
fn listed_bodies(
    nm: &str,
    binary: &Path,
    order: &Path,
) -> anyhow::Result<(u64, HashMap<u64, u64>)> {
    let listed: std::collections::HashSet<String> = std::fs::read_to_string(order)?
        .lines()
        .map(str::to_owned)
        .collect();
    let syms = text_symbols(nm, binary)?;
    let start = syms.iter().map(|s| s.addr).min().unwrap_or(0);
    let bodies = syms
        .iter()
        .filter(|s| listed.contains(&s.name))
        .map(|s| (s.addr, s.size))
        .collect();
    Ok((start, bodies))
}

/// Whether `binary` was linked by lld (`.comment`), the only linker of the
/// toolchain's that takes `--symbol-ordering-file`: rustup's x86_64 Linux
/// toolchains link with their own rust-lld since 1.90; a distribution's
/// rustc, or a `linker` set in cargo's configuration, may use GNU ld.
pub fn linked_by_lld(binary: &Path) -> bool {
    output(Command::new("readelf").args(["-p", ".comment"]).arg(binary))
        .is_some_and(|c| c.contains("Linker: LLD"))
}

/// The `rustc` arguments that link with ordering file `order`.
pub fn link_args(order: &Path) -> [String; 4] {
    [
        "-C".into(),
        format!("link-arg=-Wl,--symbol-ordering-file={}", order.display()),
        "-C".into(),
        // Symbols of the list that this build inlined or does not have.
        "link-arg=-Wl,--no-warn-symbol-ordering".into(),
    ]
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
         # xtask/src/symbol_order.rs.\n\
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
    let err = work.join("agent.err");
    let mut agent = Agent(
        Command::new(binary)
            .args(["run", "--output", "json"])
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

#[cfg(test)]
mod tests {
    use super::key;

    #[test]
    fn a_function_keeps_its_key_across_crate_hashes() {
        // `lookout_agent::main` under two crate hashes (another toolchain or
        // dependency set), and with an LTO suffix.
        let a = key("_RNvCsiLD7B24s1o9_13lookout_agent4main");
        assert_eq!(a, key("_RNvCs9GbgdHAUHgX_13lookout_agent4main"));
        assert_eq!(a, key("_RNvCs9GbgdHAUHgX_13lookout_agent4main.llvm.123"));
        assert_ne!(a, key("_RNvCsiLD7B24s1o9_13lookout_agent5other"));
        // A legacy name without its hash.
        assert_eq!(
            key("_ZN3std2io5stdio6_print17h0123456789abcdefE"),
            key("_ZN3std2io5stdio6_print17hfedcba9876543210E")
        );
        assert_ne!(
            key("_ZN3std2io5stdio6_print17h0123456789abcdefE"),
            key("_ZN3std2io5stdio7_eprint17h0123456789abcdefE")
        );
    }
}
