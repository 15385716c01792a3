//! A guest's root file system, as an initramfs: its Debian binaries and
//! the libraries they load, the image's agent for its platform, and the
//! scripts it runs (`vm/init.sh`, `vm/stage2.sh`).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;
use serde_json::{Value, json};

use crate::debian::Debian;
use crate::util::output;
use crate::{Arch, Guest};

/// The binaries taken from those packages.
pub(crate) const GUEST_BINARIES: &[&str] = &[
    "bin/busybox",
    "usr/sbin/runc",
    "usr/bin/runc",
    "usr/bin/crun",
];

/// The guest's root file system in `root`. (Its executables are copied
/// with `std::fs::copy`: they run in the guest, never here, so the ETXTBSY
/// race the lint is about cannot happen.)
#[allow(clippy::disallowed_methods)]
pub(crate) fn assemble(
    guest: &Guest,
    debian: &Debian,
    archive: &Path,
    root: &Path,
) -> anyhow::Result<()> {
    for d in ["usr/bin", "usr/sbin", "usr/lib", "usr/lib64"] {
        std::fs::create_dir_all(root.join(d))?;
    }
    for d in ["bin", "sbin", "lib", "lib64"] {
        std::os::unix::fs::symlink(format!("usr/{d}"), root.join(d))?;
    }
    for d in [
        "dev",
        "proc",
        "sys",
        "run",
        "tmp",
        "etc/lookout/hooks.d",
        "opt/lookout",
        "rootfs/bin",
        "rootfs/proc",
        "rootfs/dev",
    ] {
        std::fs::create_dir_all(root.join(d))?;
    }
    // The runtimes and busybox, with the libraries they load.
    let mut wanted: Vec<String> = GUEST_BINARIES
        .iter()
        .filter(|b| debian.tree.join(b).is_file())
        .map(|b| (*b).to_owned())
        .collect();
    let mut copied = std::collections::BTreeSet::new();
    while let Some(rel) = wanted.pop() {
        if !copied.insert(rel.clone()) {
            continue;
        }
        let from = debian.tree.join(&rel);
        // The packages' links are absolute (`/lib64/ld-linux-x86-64.so.2 ->
        // /lib/x86_64-linux-gnu/ld-2.31.so`): followed inside the tree.
        let real = lookout_host::resolve_in_root(&debian.tree, Path::new(&rel))
            .with_context(|| format!("{} is missing", from.display()))?;
        let to = root.join(&rel);
        if let Some(p) = to.parent() {
            std::fs::create_dir_all(p)?;
        }
        std::fs::copy(&real, &to).with_context(|| format!("copying {}", real.display()))?;
        wanted.extend(needs(&debian.tree, &real)?);
    }
    // The containers' root: busybox alone.
    std::fs::copy(
        debian.tree.join("bin/busybox"),
        root.join("rootfs/bin/busybox"),
    )?;
    std::os::unix::fs::symlink("busybox", root.join("rootfs/bin/sh"))?;
    std::os::unix::fs::symlink("busybox", root.join("rootfs/bin/sleep"))?;
    for (name, script) in [
        ("exit3", "exit 3"),
        ("exit5", "exit 5"),
        ("sleep-exit3", "sleep 3; exit 3"),
        ("sleep-exit5", "sleep 3; exit 5"),
    ] {
        let b = root.join("bundles").join(name);
        std::fs::create_dir_all(&b)?;
        std::fs::write(b.join("config.json"), bundle_config(script))?;
    }
    std::fs::write(
        root.join("etc/lookout/hooks.d/vm.json"),
        serde_json::to_vec_pretty(&json!({
            "version": "1.0.0",
            "hook": {"path": "/bin/sh", "args": ["sh", "-c", "cat >> /tmp/hook.out; echo >> /tmp/hook.out"]},
            "when": {"always": true},
            "stages": ["prestart"],
        }))?,
    )?;
    // The agent: the image's files for this platform.
    unpack_image(archive, guest.arch, &root.join("opt/lookout"))?;
    for (name, text) in [
        ("init", include_str!("../vm/init.sh")),
        ("stage2", include_str!("../vm/stage2.sh")),
    ] {
        std::fs::write(root.join(name), text)?;
        set_mode(&root.join(name), 0o755)?;
    }
    Ok(())
}

pub(crate) fn set_mode(path: &Path, mode: u32) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// The config.json of a container that runs `sh -c SCRIPT` in /rootfs
/// (read-only, shared): what every runtime release in the matrix accepts.
pub(crate) fn bundle_config(script: &str) -> Vec<u8> {
    let config = json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": ["/bin/sh", "-c", script],
            "env": ["PATH=/bin"],
            "cwd": "/",
            "noNewPrivileges": true,
        },
        "root": {"path": "/rootfs", "readonly": true},
        "hostname": "vm",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        ],
        "linux": {
            "namespaces": [{"type": "pid"}, {"type": "mount"}, {"type": "ipc"}, {"type": "uts"}],
        },
    });
    serde_json::to_vec_pretty(&config).unwrap_or_default()
}

/// The libraries (and the ELF interpreter) `binary` loads, as paths
/// relative to `tree`, from `readelf` (which reads any architecture).
pub(crate) fn needs(tree: &Path, binary: &Path) -> anyhow::Result<Vec<String>> {
    let text = output(Command::new("readelf").args(["-d", "-l", "-W"]).arg(binary))
        .with_context(|| format!("readelf {} failed (install binutils)", binary.display()))?;
    let mut out = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.split("[Requesting program interpreter: ").nth(1) {
            out.push(
                rest.trim_end_matches(']')
                    .trim_start_matches('/')
                    .to_owned(),
            );
        }
        if line.contains("(NEEDED)")
            && let Some(name) = line.split('[').nth(1).map(|s| s.trim_end_matches(']'))
        {
            let found = ["usr/lib", "usr/lib64"]
                .iter()
                .flat_map(|d| {
                    let mut v = vec![format!("{d}/{name}")];
                    for multiarch in ["x86_64-linux-gnu", "aarch64-linux-gnu"] {
                        v.push(format!("{d}/{multiarch}/{name}"));
                    }
                    v
                })
                .find(|rel| tree.join(rel).exists())
                .with_context(|| {
                    format!("{} needs {name}, not in its packages", binary.display())
                })?;
            out.push(found);
        }
    }
    Ok(out)
}

/// Unpacks the image's layer for `arch` from the OCI archive into `dest`.
pub(crate) fn unpack_image(archive: &Path, arch: Arch, dest: &Path) -> anyhow::Result<()> {
    let blobs = read_tar(archive)
        .with_context(|| format!("reading {} (run `cargo xtask image`)", archive.display()))?;
    let blob = |digest: &str| -> anyhow::Result<&Vec<u8>> {
        let name = format!("blobs/sha256/{}", digest.trim_start_matches("sha256:"));
        blobs
            .get(&name)
            .with_context(|| format!("the archive has no {name}"))
    };
    let index: Value = serde_json::from_slice(
        blobs
            .get("index.json")
            .context("the archive has no index.json")?,
    )?;
    // index.json names the image; a multi-platform image is itself an
    // index of one manifest per platform.
    let mut manifests = index["manifests"].as_array().cloned().unwrap_or_default();
    if let [only] = manifests.as_slice()
        && only["mediaType"] == "application/vnd.oci.image.index.v1+json"
    {
        let inner: Value =
            serde_json::from_slice(blob(only["digest"].as_str().context("index digest")?)?)?;
        manifests = inner["manifests"].as_array().cloned().unwrap_or_default();
    }
    let entry = manifests
        .iter()
        .find(|m| m["platform"]["architecture"].as_str() == Some(arch.name()))
        .with_context(|| format!("the image has no linux/{} manifest", arch.name()))?;
    let manifest: Value =
        serde_json::from_slice(blob(entry["digest"].as_str().context("manifest digest")?)?)?;
    for layer in manifest["layers"].as_array().into_iter().flatten() {
        let gz = blob(layer["digest"].as_str().context("layer digest")?)?;
        let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(gz.as_slice()));
        tar.set_preserve_permissions(true);
        tar.unpack(dest)
            .with_context(|| format!("unpacking the image's layer into {}", dest.display()))?;
    }
    Ok(())
}

/// Every regular file of a tar archive, by path.
pub(crate) fn read_tar(path: &Path) -> anyhow::Result<BTreeMap<String, Vec<u8>>> {
    let mut tar = tar::Archive::new(std::fs::File::open(path)?);
    let mut files = BTreeMap::new();
    for entry in tar.entries()? {
        let mut entry = entry?;
        if entry.header().entry_type() != tar::EntryType::Regular {
            continue;
        }
        let name = entry
            .path()?
            .to_string_lossy()
            .trim_start_matches("./")
            .to_owned();
        let mut bytes = Vec::new();
        entry.read_to_end(&mut bytes)?;
        files.insert(name, bytes);
    }
    Ok(files)
}

/// `tree` as an uncompressed initramfs (cpio "newc"): the kernel unpacks
/// it as the guest's first root.
pub(crate) fn cpio(tree: &Path) -> anyhow::Result<Vec<u8>> {
    use std::os::unix::fs::MetadataExt;
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
        let mut entries: Vec<_> = std::fs::read_dir(dir)?
            .flatten()
            .map(|e| e.path())
            .collect();
        entries.sort();
        for p in entries {
            out.push(p.clone());
            if p.is_dir() && !p.is_symlink() {
                walk(&p, out)?;
            }
        }
        Ok(())
    }
    let mut paths = Vec::new();
    walk(tree, &mut paths)?;
    let mut out = Vec::new();
    let mut push = |name: &str, mode: u32, ino: u32, data: &[u8]| {
        let header = format!(
            "070701{ino:08x}{mode:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            0,
            0,
            1,
            0,
            data.len(),
            0,
            0,
            0,
            0,
            name.len() + 1,
            0
        );
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        while out.len() % 4 != 0 {
            out.push(0);
        }
        out.extend_from_slice(data);
        while out.len() % 4 != 0 {
            out.push(0);
        }
    };
    for (i, p) in paths.iter().enumerate() {
        let name = p.strip_prefix(tree)?.to_string_lossy().into_owned();
        let meta = std::fs::symlink_metadata(p)?;
        let ino = i as u32 + 1;
        if meta.is_symlink() {
            let target = std::fs::read_link(p)?;
            push(&name, 0o120777, ino, target.to_string_lossy().as_bytes());
        } else if meta.is_dir() {
            push(&name, 0o040000 | (meta.mode() & 0o7777), ino, &[]);
        } else {
            push(
                &name,
                0o100000 | (meta.mode() & 0o7777),
                ino,
                &std::fs::read(p)?,
            );
        }
    }
    push("TRAILER!!!", 0, 0, &[]);
    Ok(out)
}
