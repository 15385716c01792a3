//! Container images without a registry: OCI image layout archives, written
//! here, of a root file system with Debian's static busybox, for `ctr
//! image import`.

use std::io;
use std::path::Path;
use std::sync::OnceLock;

use serde_json::json;
use sha2::{Digest, Sha256};

/// The pod sandbox image (the CRI plugin's `sandbox_image`): busybox's
/// `sleep infinity` stands in for `pause`.
pub const PAUSE_IMAGE: &str = "localhost/pause:1";

/// An image with busybox and its applets in `/bin`, no entrypoint and
/// `sh` as its command; containers give their own command.
pub const BUSYBOX_IMAGE: &str = "localhost/busybox:1";

/// The OCI archive of [`PAUSE_IMAGE`], built once per test process.
pub fn pause_archive() -> io::Result<&'static [u8]> {
    static ARCHIVE: OnceLock<Result<Vec<u8>, String>> = OnceLock::new();
    cached(&ARCHIVE, || {
        oci_archive(
            &busybox_layer()?,
            json!({ "Entrypoint": ["/bin/sleep", "infinity"], "Env": [PATH_ENV] }),
        )
    })
}

/// The OCI archive of [`BUSYBOX_IMAGE`], built once per test process.
pub fn busybox_archive() -> io::Result<&'static [u8]> {
    static ARCHIVE: OnceLock<Result<Vec<u8>, String>> = OnceLock::new();
    cached(&ARCHIVE, || {
        oci_archive(
            &busybox_layer()?,
            json!({ "Cmd": ["sh"], "Env": [PATH_ENV] }),
        )
    })
}

const PATH_ENV: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

fn cached(
    cell: &'static OnceLock<Result<Vec<u8>, String>>,
    build: impl FnOnce() -> io::Result<Vec<u8>>,
) -> io::Result<&'static [u8]> {
    cell.get_or_init(|| build().map_err(|e| e.to_string()))
        .as_deref()
        .map_err(|e| io::Error::other(e.clone()))
}

/// Applets linked into the images' `/bin`.
const APPLETS: &[&str] = &[
    "sh", "sleep", "echo", "cat", "true", "false", "date", "ls", "touch", "env", "id", "ps",
    "hostname", "kill", "wc", "grep", "test", "[",
];

/// The single layer: `/bin/busybox` (Debian's busybox-static), its applets
/// as symbolic links, and the usual top-level directories. An uncompressed
/// tar, owner 0:0, time 0, sorted: the same bytes for the same busybox.
fn busybox_layer() -> io::Result<Vec<u8>> {
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.exists())
        .ok_or_else(|| {
            io::Error::new(io::ErrorKind::NotFound, "busybox-static is not installed")
        })?;
    let bytes = std::fs::read(busybox)?;
    let mut tar = tar::Builder::new(Vec::new());
    tar.mode(tar::HeaderMode::Deterministic);
    let header = |kind: tar::EntryType, mode: u32, size: u64| {
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_size(size);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h
    };
    for (dir, mode) in [
        ("bin/", 0o755),
        ("dev/", 0o755),
        ("etc/", 0o755),
        ("proc/", 0o555),
        ("root/", 0o700),
        ("sys/", 0o555),
        ("tmp/", 0o1777),
        ("var/", 0o755),
    ] {
        let mut h = header(tar::EntryType::Directory, mode, 0);
        tar.append_data(&mut h, dir, io::empty())?;
    }
    let mut h = header(tar::EntryType::Regular, 0o755, bytes.len() as u64);
    tar.append_data(&mut h, "bin/busybox", bytes.as_slice())?;
    let mut applets = APPLETS.to_vec();
    applets.sort_unstable();
    for a in applets {
        let mut h = header(tar::EntryType::Symlink, 0o777, 0);
        tar.append_link(&mut h, format!("bin/{a}"), "busybox")?;
    }
    for (path, text) in [
        ("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"),
        ("etc/group", "root:x:0:\n"),
    ] {
        let mut h = header(tar::EntryType::Regular, 0o644, text.len() as u64);
        tar.append_data(&mut h, path, text.as_bytes())?;
    }
    tar.into_inner()
}

/// An OCI image layout (`oci-layout`, `index.json`, `blobs/sha256/…`) as a
/// tar: one uncompressed `layer`, an image config whose `config` section
/// is `config`, linux/amd64 (the host's architecture). Unnamed: `ctr image
/// import --index-name NAME` names it.
fn oci_archive(layer: &[u8], config: serde_json::Value) -> io::Result<Vec<u8>> {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    let layer_digest = digest(layer);
    let config = serde_json::to_vec(&json!({
        "architecture": arch,
        "os": "linux",
        "config": config,
        "rootfs": { "type": "layers", "diff_ids": [layer_digest] },
        "history": [{ "created_by": "lookout-testsupport" }],
    }))?;
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": digest(&config),
            "size": config.len(),
        },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": layer_digest,
            "size": layer.len(),
        }],
    }))?;
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": digest(&manifest),
            "size": manifest.len(),
            "platform": { "architecture": arch, "os": "linux" },
        }],
    }))?;
    let mut tar = tar::Builder::new(Vec::new());
    tar.mode(tar::HeaderMode::Deterministic);
    let mut add = |path: String, bytes: &[u8]| -> io::Result<()> {
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_mode(0o644);
        h.set_size(bytes.len() as u64);
        h.set_mtime(0);
        tar.append_data(&mut h, path, bytes)
    };
    add("oci-layout".into(), br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    add("index.json".into(), &index)?;
    for blob in [&manifest[..], &config[..], layer] {
        let d = digest(blob);
        let hex = d.trim_start_matches("sha256:");
        add(format!("blobs/sha256/{hex}"), blob)?;
    }
    tar.into_inner()
}

/// `sha256:<hex>` of `bytes`.
fn digest(bytes: &[u8]) -> String {
    let sum = Sha256::digest(bytes);
    let mut s = String::with_capacity(71);
    s.push_str("sha256:");
    for b in sum {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn digest_is_sha256_hex() {
        assert_eq!(
            digest(b""),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[test]
    fn archive_is_an_oci_layout_whose_blobs_match_their_digests() {
        let archive = oci_archive(b"layer bytes", json!({ "Cmd": ["sh"] })).expect("archive");
        let mut files = BTreeMap::new();
        for e in tar::Archive::new(archive.as_slice())
            .entries()
            .expect("entries")
        {
            let mut e = e.expect("entry");
            let path = e.path().expect("path").to_string_lossy().into_owned();
            let mut bytes = Vec::new();
            io::Read::read_to_end(&mut e, &mut bytes).expect("read");
            files.insert(path, bytes);
        }
        assert!(files.contains_key("oci-layout"));
        for (path, bytes) in &files {
            if let Some(hex) = path.strip_prefix("blobs/sha256/") {
                assert_eq!(digest(bytes), format!("sha256:{hex}"), "{path}");
            }
        }
        let index: serde_json::Value =
            serde_json::from_slice(&files["index.json"]).expect("index.json");
        let m = index["manifests"][0]["digest"].as_str().expect("digest");
        let manifest: serde_json::Value = serde_json::from_slice(
            &files[&format!("blobs/sha256/{}", m.trim_start_matches("sha256:"))],
        )
        .expect("manifest");
        assert_eq!(manifest["layers"][0]["digest"], digest(b"layer bytes"));
    }
}
