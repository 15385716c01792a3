//! The agent's start-up and per-container code laid out together in its
//! binary: the list's keys, and the link step of `cargo xtask image` that
//! uses it (`cargo xtask symbol-order` makes and checks the list).
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
//! `STALE_KIB` (`crate::symbol_order`) and names the functions on those pages.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;

use crate::util::{output, workspace_root};

/// The list for x86_64 builds, relative to the workspace root. (arm64's
/// agent is linked by GNU ld, which has no `--symbol-ordering-file`.)
pub(crate) const ORDER_FILE: &str = "deploy/symbol-order.x86_64";

/// The symbol mangling every build that uses the list needs: v0 names keep
/// a generic function's type arguments, so each instance has a name of its
/// own (legacy names tell instances apart only by hash).
pub(crate) const MANGLING: &str = "-Csymbol-mangling-version=v0";

/// A function in a binary: address, size, name.
pub(crate) struct Symbol {
    pub(crate) addr: u64,
    pub(crate) size: u64,
    pub(crate) name: String,
}

/// The text symbols of `binary`, by address (`nm`).
pub(crate) fn text_symbols(nm: &str, binary: &Path) -> anyhow::Result<Vec<Symbol>> {
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
pub(crate) fn key(symbol: &str) -> u64 {
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
pub(crate) fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// `name` with every `Cs<base-62>_` made `Cs_`. (An identifier that
/// itself holds such a run, `Cs9_x`, is changed too: two such names may
/// share a key, which costs at most a function laid out with the hot ones.)
pub(crate) fn without_crate_hashes(name: &str) -> String {
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
pub(crate) fn read_list(root: &Path) -> anyhow::Result<Option<Vec<u64>>> {
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
pub(crate) const STALE_BELOW: f64 = 0.9;

/// The linker's ordering file for one build ([`linker_order`]).
#[derive(Debug)]
pub(crate) struct LinkerOrder {
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
pub(crate) fn linker_order(
    nm: &str,
    binary: &Path,
    dir: &Path,
) -> anyhow::Result<Option<LinkerOrder>> {
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
pub(crate) fn is_laid_out(nm: &str, binary: &Path, order: &Path) -> anyhow::Result<bool> {
    let (start, bodies) = listed_bodies(nm, binary, order)?;
    let size: u64 = bodies.values().sum();
    let first = bodies.keys().filter(|a| **a < start + size).count();
    Ok(!bodies.is_empty() && first * 10 >= bodies.len() * 9)
}

/// The start of `binary`'s text, and the bodies (address, size) of the
/// functions the list `order` names: one per address, since identical
/// code folding gives one body several names.
pub(crate) fn listed_bodies(
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
pub(crate) fn linked_by_lld(binary: &Path) -> bool {
    output(Command::new("readelf").args(["-p", ".comment"]).arg(binary))
        .is_some_and(|c| c.contains("Linker: LLD"))
}

/// The `rustc` arguments that link with ordering file `order`.
pub(crate) fn link_args(order: &Path) -> [String; 4] {
    [
        "-C".into(),
        format!("link-arg=-Wl,--symbol-ordering-file={}", order.display()),
        "-C".into(),
        // Symbols of the list that this build inlined or does not have.
        "link-arg=-Wl,--no-warn-symbol-ordering".into(),
    ]
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
