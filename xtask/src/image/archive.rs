//! The OCI image archive: each platform's layer (the binary, the glibc
//! libraries it links, passwd and group), its config and manifest, and the
//! index, written reproducibly.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use serde_json::json;
use sha2::{Digest, Sha256};

use super::*;
use crate::util::{output, say, workspace_root};

/// The files of `platform`'s layer: the binary, its libraries, the users
/// and the mount points.
pub(super) fn layer_files(platform: &Platform, stripped: &Path) -> anyhow::Result<Files> {
    let mut files = Files::default();
    files.file(BINARY, 0o755, std::fs::read(stripped)?);
    let libs = shared_libraries(platform, stripped)?;
    // N.B. The agent does without libm: loading it costs about 0.45 MiB of
    // resident pages (docs/benchmarks.md, twelfth pass). Something that
    // calls a libm function (`f64::powf`, tokio's multi-thread scheduler)
    // brings it back; say so where the image is made.
    if let Some((lib, _)) = libs.iter().find(|(lib, _)| {
        lib.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("libm.so"))
    }) {
        say(
            "image",
            &format!(
                "warning: the {} agent loads {} (about 0.45 MiB more resident memory); \
                 `nm -D --undefined-only` on it names what it takes from there",
                platform.arch,
                lib.display()
            ),
        );
    }
    for (lib, at) in libs {
        let bytes = std::fs::read(&lib).with_context(|| format!("reading {}", lib.display()))?;
        let path = at.to_str().context("library path is not UTF-8")?;
        files.file(path.trim_start_matches('/'), 0o755, bytes);
    }
    files.file(
        "etc/passwd",
        0o644,
        b"root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n"
            .to_vec(),
    );
    files.file(
        "etc/group",
        0o644,
        b"root:x:0:\nnonroot:x:65532:\n".to_vec(),
    );
    // Mount points the DaemonSet uses, so that a read-only root needs no
    // new directory.
    for dir in [
        "host",
        "tmp",
        "run/lookout",
        "sys/kernel/tracing",
        "proc",
        "dev",
    ] {
        files.dir(dir, if dir == "tmp" { 0o1777 } else { 0o755 });
    }
    files.dir("home/nonroot", 0o755);
    Ok(files)
}

/// The commit's time, or `$SOURCE_DATE_EPOCH`.
pub(super) fn source_date_epoch() -> u64 {
    if let Some(e) = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        return e;
    }
    output(
        Command::new("git")
            .current_dir(workspace_root())
            .args(["log", "-1", "--format=%ct"]),
    )
    .and_then(|s| s.trim().parse().ok())
    .unwrap_or(0)
}

pub(super) fn rfc3339(epoch: u64) -> String {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_secs(epoch))
        .to_string()
}

/// The shared libraries `binary` loads: where to read each, and where it
/// goes in the image. This machine's own from `ldd`; a cross-built
/// binary's from `readelf` (its `NEEDED` entries and interpreter) in the
/// cross toolchain's sysroot, placed where Debian's `libc6` of that
/// architecture has them.
pub(super) fn shared_libraries(
    platform: &Platform,
    binary: &Path,
) -> anyhow::Result<Vec<(PathBuf, PathBuf)>> {
    let Some(prefix) = platform.cross else {
        let text = output(Command::new("ldd").arg(binary))
            .with_context(|| format!("ldd {} failed", binary.display()))?;
        let mut libs = Vec::new();
        for line in text.lines() {
            // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or
            // "/lib64/ld-linux-x86-64.so.2 (0x...)" or "linux-vdso.so.1 (0x...)".
            let path = match line.split_once("=>") {
                Some((_, right)) => right.split_whitespace().next(),
                None => line.split_whitespace().next(),
            };
            if let Some(p) = path.filter(|p| p.starts_with('/')) {
                libs.push((PathBuf::from(p), PathBuf::from(p)));
            }
        }
        if libs.is_empty() {
            bail!("ldd found no library in {}:\n{text}", binary.display());
        }
        libs.sort();
        libs.dedup();
        return Ok(libs);
    };
    let sysroot = PathBuf::from(format!("/usr/{prefix}/lib"));
    let mut libs = Vec::new();
    let mut todo = vec![binary.to_path_buf()];
    let mut seen = std::collections::BTreeSet::new();
    while let Some(file) = todo.pop() {
        let text = output(Command::new("readelf").args(["-d", "-l", "-W"]).arg(&file))
            .with_context(|| format!("readelf {} failed (install binutils)", file.display()))?;
        for line in text.lines() {
            if let Some(rest) = line.split("[Requesting program interpreter: ").nth(1) {
                let at = PathBuf::from(rest.trim_end_matches(']'));
                let name = at.file_name().context("interpreter path")?;
                if seen.insert(at.clone()) {
                    libs.push((sysroot.join(name), at));
                }
            }
            if line.contains("(NEEDED)")
                && let Some(name) = line.split('[').nth(1).map(|s| s.trim_end_matches(']'))
            {
                let from = sysroot.join(name);
                if !from.is_file() {
                    bail!(
                        "{} needs {name}, not in {}",
                        file.display(),
                        sysroot.display()
                    );
                }
                let at = PathBuf::from(format!("/lib/{prefix}/{name}"));
                if seen.insert(at.clone()) {
                    todo.push(from.clone());
                    libs.push((from, at));
                }
            }
        }
    }
    libs.sort();
    Ok(libs)
}

/// The layer's contents: path (no leading `/`) to entry, sorted.
#[derive(Default)]
pub struct Files(BTreeMap<String, Entry>);

enum Entry {
    Dir(u32),
    File(u32, Vec<u8>),
}

impl Files {
    /// A file (its parent directories are added, 0755).
    pub fn file(&mut self, path: &str, mode: u32, bytes: Vec<u8>) {
        self.parents(path);
        self.0.insert(path.to_owned(), Entry::File(mode, bytes));
    }

    /// A directory (and its parents).
    pub fn dir(&mut self, path: &str, mode: u32) {
        self.parents(path);
        self.0.insert(path.to_owned(), Entry::Dir(mode));
    }

    fn parents(&mut self, path: &str) {
        let mut p = Path::new(path).parent();
        while let Some(dir) = p.filter(|d| !d.as_os_str().is_empty()) {
            let key = dir.to_string_lossy().into_owned();
            self.0.entry(key).or_insert(Entry::Dir(0o755));
            p = dir.parent();
        }
    }
}

/// The layer as an uncompressed tar: sorted, owner 0:0, time `epoch`.
pub(super) fn layer_tar(files: &Files, epoch: u64) -> anyhow::Result<Vec<u8>> {
    let mut tar = tar::Builder::new(Vec::new());
    tar.mode(tar::HeaderMode::Deterministic);
    for (path, entry) in &files.0 {
        let mut h = tar::Header::new_ustar();
        h.set_mtime(epoch);
        h.set_uid(0);
        h.set_gid(0);
        match entry {
            Entry::Dir(mode) => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(*mode);
                h.set_size(0);
                tar.append_data(&mut h, format!("{path}/"), std::io::empty())?;
            }
            Entry::File(mode, bytes) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(*mode);
                h.set_size(bytes.len() as u64);
                tar.append_data(&mut h, path, bytes.as_slice())?;
            }
        }
    }
    Ok(tar.into_inner()?)
}

pub(super) fn sha256(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    let mut s = String::with_capacity(7 + 64);
    s.push_str("sha256:");
    for b in d {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// Writes the OCI image layout as a tar archive, one manifest per
/// platform under one index; returns the index's digest (the image's
/// identity, what a registry would record for the tag) and each platform's
/// manifest digest, in `images`' order.
pub fn write_archive(
    archive: &Path,
    images: &[(Platform, Files)],
    epoch: u64,
    reference: &str,
    labels: serde_json::Value,
) -> anyhow::Result<(String, Vec<String>)> {
    let created = rfc3339(epoch);
    let mut blobs = Files::default();
    let mut entries = Vec::new();
    let mut manifests = Vec::new();
    for (platform, files) in images {
        let layer = layer_tar(files, epoch)?;
        let diff_id = sha256(&layer);
        let mut gz = flate2::GzBuilder::new()
            .mtime(0)
            .write(Vec::new(), flate2::Compression::best());
        gz.write_all(&layer)?;
        let layer_gz = gz.finish()?;
        let mut config = json!({
            "architecture": platform.arch,
            "os": "linux",
            "created": created,
            "config": {
                "Entrypoint": [format!("/{BINARY}")],
                "Cmd": ["run"],
                "Env": ["PATH=/usr/local/bin:/usr/bin:/bin"],
                "WorkingDir": "/",
                "Labels": labels,
            },
            "rootfs": { "type": "layers", "diff_ids": [diff_id] },
            "history": [{ "created": created, "created_by": "cargo xtask image" }],
        });
        let mut os_platform = json!({"architecture": platform.arch, "os": "linux"});
        if let Some(v) = platform.variant {
            config["variant"] = json!(v);
            os_platform["variant"] = json!(v);
        }
        let config = serde_json::to_vec(&config)?;
        let manifest = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": sha256(&config),
                "size": config.len(),
            },
            "layers": [{
                "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                "digest": sha256(&layer_gz),
                "size": layer_gz.len(),
            }],
            "annotations": { "org.opencontainers.image.created": created },
        }))?;
        manifests.push(sha256(&manifest));
        entries.push(json!({
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": sha256(&manifest),
            "size": manifest.len(),
            "platform": os_platform,
        }));
        for blob in [config, manifest, layer_gz] {
            let name = format!("blobs/sha256/{}", &sha256(&blob)["sha256:".len()..]);
            blobs.file(&name, 0o644, blob);
        }
    }
    // The image: an index of the platforms' manifests, as a registry
    // serves a multi-platform tag.
    let image_index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": entries,
    }))?;
    let digest = sha256(&image_index);
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "digest": digest,
            "size": image_index.len(),
            "annotations": {
                "io.containerd.image.name": reference,
                "org.opencontainers.image.ref.name": reference.rsplit_once(':').map_or("latest", |(_, t)| t),
            },
        }],
    }))?;
    blobs.file(
        &format!("blobs/sha256/{}", &digest["sha256:".len()..]),
        0o644,
        image_index,
    );
    blobs.file(
        "oci-layout",
        0o644,
        br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec(),
    );
    blobs.file("index.json", 0o644, index);
    let tmp = archive.with_extension("tar.tmp");
    std::fs::write(&tmp, layer_tar(&blobs, epoch)?)?;
    std::fs::rename(&tmp, archive)?;
    Ok((digest, manifests))
}
