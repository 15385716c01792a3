//! The `pinned-maps` part: what the container maps cost the kernel (memory
//! at 0, 1024 and `max_entries` entries, as the map's fdinfo accounts it)
//! and what one write or removal costs the agent (a `bpf(2)` call each),
//! on a map made as the agent makes them (hash, `BPF_F_NO_PREALLOC`, u64
//! keys, 128-byte entries).

use std::os::fd::{AsFd, AsRawFd};
use std::time::Instant;

use anyhow::Context;
use aya::maps::{HashMap, IterableMap, MapData};
use lookout_ebpf_common::{CONTAINER_MAPS_FLAGS, CONTAINER_MAPS_MAX_ENTRIES, ContainerEntry};
use serde_json::{Value, json};

use crate::stats::stats;

type Entries = HashMap<MapData, u64, [u8; ContainerEntry::SIZE]>;

/// The map's `memlock:` line in this process's fdinfo, in bytes.
fn memlock(map: &Entries) -> anyhow::Result<u64> {
    let fd = map.map().fd().as_fd().as_raw_fd();
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))
        .context("reading the map's fdinfo")?;
    info.lines()
        .find_map(|l| l.strip_prefix("memlock:"))
        .and_then(|v| v.trim().parse().ok())
        .context("no memlock line in the map's fdinfo")
}

/// Measures; the report's `pinned_maps` key.
pub(crate) fn measure() -> anyhow::Result<Value> {
    let max = CONTAINER_MAPS_MAX_ENTRIES;
    let mut map = Entries::create(max, CONTAINER_MAPS_FLAGS)
        .context("creating a BPF hash map (root, and a kernel that allows BPF maps)")?;
    let entry = ContainerEntry::new(&[b'a'; 64]).to_bytes();
    let mut memory = serde_json::Map::new();
    memory.insert("empty".into(), json!(memlock(&map)?));
    let (mut insert_us, mut remove_us) = (Vec::new(), Vec::new());
    for key in 0..u64::from(max) {
        let t = Instant::now();
        map.insert(key, entry, 0).context("filling the map")?;
        insert_us.push(t.elapsed().as_secs_f64() * 1e6);
        if key + 1 == 1024 {
            memory.insert("1024".into(), json!(memlock(&map)?));
        }
    }
    memory.insert("max_entries".into(), json!(memlock(&map)?));
    // One more is refused (E2BIG): the agent counts it as `full`.
    let full = map.insert(u64::from(max), entry, 0).is_err();
    for key in 0..u64::from(max) {
        let t = Instant::now();
        map.remove(&key).context("emptying the map")?;
        remove_us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(json!({
        "max_entries": max,
        "memlock_bytes": memory,
        "full_refused": full,
        "insert_us": stats(&insert_us),
        "remove_us": stats(&remove_us),
    }))
}

/// Prints the part's table.
pub(crate) fn print(r: &Value) {
    let mib = |k: &str| r["memlock_bytes"][k].as_f64().unwrap_or(f64::NAN) / (1024.0 * 1024.0);
    println!(
        "\npinned container map (hash, no prealloc, {} max entries of {} bytes), one of two:",
        r["max_entries"],
        ContainerEntry::SIZE
    );
    println!("| entries | kernel memory (memlock) |\n|---|---|");
    for (k, label) in [
        ("empty", "0"),
        ("1024", "1024"),
        ("max_entries", "max_entries"),
    ] {
        println!("| {label} | {:.2} MiB |", mib(k));
    }
    for (k, label) in [
        ("insert_us", "write (bpf map update)"),
        ("remove_us", "removal (bpf map delete)"),
    ] {
        println!(
            "{label}: p50 {:.2} us, p99 {:.2} us",
            r[k]["p50"].as_f64().unwrap_or(f64::NAN),
            r[k]["p99"].as_f64().unwrap_or(f64::NAN)
        );
    }
    println!("a write past max_entries refused: {}", r["full_refused"]);
}
