//! The inode-map part of the benchmark: the map's own numbers
//! (`examples/bench_map`), and listing a 50k-entry directory through the
//! `stablefs` FUSE mount against the raw directory, interleaved.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

use crate::Paths;
use crate::util::say;

fn list(dir: &Path) -> anyhow::Result<(usize, f64)> {
    let t = Instant::now();
    let mut n = 0;
    // getdents only, as `ls -f` does: d_ino and d_type, no stat.
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        std::hint::black_box(std::os::unix::fs::DirEntryExt::ino(&e));
        n += 1;
    }
    Ok((n, t.elapsed().as_secs_f64() * 1e3))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Runs both measurements, in the scratch directory `paths.work`.
pub(crate) fn bench_inode_map(paths: &Paths, entries: u64) -> anyhow::Result<Value> {
    let (bench, stablefs, work) = (&paths.bench_map, &paths.stablefs, &paths.work);

    say("bench", &format!("inode map: {entries} entries per mode"));
    let out = Command::new(bench)
        .arg(entries.to_string())
        .output()
        .context("running bench_map")?;
    if !out.status.success() {
        bail!("bench_map failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let map: Value = serde_json::from_slice(&out.stdout).context("bench_map output")?;

    say(
        "bench",
        "inode map: listing 50k entries, raw vs through stablefs (passthrough)",
    );
    let dir = work.join("inode-src");
    let big = dir.join("big");
    std::fs::create_dir_all(&big)?;
    for i in 0..50_000 {
        let p = big.join(format!("f{i:05}"));
        if !p.exists() {
            std::fs::File::create(&p)?;
        }
    }
    let mnt = work.join("inode-mnt");
    std::fs::create_dir_all(&mnt)?;
    let _ = Command::new("umount")
        .arg(&mnt)
        .stderr(Stdio::null())
        .status();
    let mut child = Command::new(stablefs)
        .args(["--mode", "passthrough"])
        .arg(&dir)
        .arg(&mnt)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting stablefs")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string("/proc/self/mountinfo")?.contains(mnt.to_str().context("utf-8")?)
    {
        if Instant::now() > deadline {
            let _ = child.kill();
            bail!("stablefs did not mount");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let through = mnt.join("big");
    // Warm both (the kernel caches neither FUSE listings nor, here, the
    // raw one beyond the dentry cache), then alternate.
    let _ = list(&big)?;
    let _ = list(&through)?;
    let (mut raw, mut fuse) = (Vec::new(), Vec::new());
    for i in 0..10 {
        if i % 2 == 0 {
            raw.push(list(&big)?.1);
            fuse.push(list(&through)?.1);
        } else {
            fuse.push(list(&through)?.1);
            raw.push(list(&big)?.1);
        }
    }
    let (n_raw, _) = list(&big)?;
    let (n_fuse, _) = list(&through)?;
    let _ = Command::new("umount").arg(&mnt).status();
    let _ = child.wait();
    if n_raw != n_fuse {
        bail!("the mount listed {n_fuse} entries, the directory has {n_raw}");
    }
    let (r, f) = (median(&mut raw), median(&mut fuse));
    Ok(json!({
        "map": map,
        "listing_50k": {
            "entries": n_raw,
            "raw_ms_p50": r,
            "stablefs_passthrough_ms_p50": f,
            "ratio": f / r,
        },
    }))
}
