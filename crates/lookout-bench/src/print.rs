//! The tables and lines each part prints from the report.

use serde_json::Value;

use crate::consumers;

/// Prints the inode-map table.
pub(crate) fn print_inode(v: &Value) {
    let g = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let m = &v["map"];
    println!(
        "\ninode map, {} entries per mode (a bare hash map lookup here: {:.0} ns)\n",
        g(m, "entries"),
        g(m, "bare_hashmap_lookup_ns")
    );
    println!(
        "| mode | insert (ns) | lookup (ns) | lookup, random order (ns) | bytes/entry | snapshot save (ms) | restore (ms) |"
    );
    println!("|---|---|---|---|---|---|---|");
    for mode in ["passthrough", "xino", "allocated", "hashed"] {
        let x = &m["modes"][mode];
        let opt = |k: &str| {
            x.get(k)
                .and_then(Value::as_f64)
                .map_or("-".to_owned(), |f| format!("{f:.0}"))
        };
        println!(
            "| {mode} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} |",
            g(x, "insert_ns"),
            g(x, "lookup_ns"),
            g(x, "lookup_random_ns"),
            g(x, "bytes_per_entry"),
            opt("snapshot_save_ms"),
            opt("snapshot_restore_ms")
        );
    }
    let l = &v["listing_50k"];
    println!(
        "\nlisting {} entries: raw {:.1} ms, through stablefs (passthrough) {:.1} ms, ratio {:.2}",
        l["entries"],
        g(l, "raw_ms_p50"),
        g(l, "stablefs_passthrough_ms_p50"),
        g(l, "ratio")
    );
}

/// The exec overhead over no listener, and where the agent's share goes.
pub(crate) fn print_exec_split(x: &Value) {
    let g = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    println!(
        "exec overhead over no listener (p50): floor {:.1} us, lookout {:.1} us; of lookout's: \
         its BPF programs {:.2} us per watched exec ({:.2} us on every other exec), \
         its answering thread's CPU {:.2} us per exec (the allow-all responder's: {:.2} us)",
        g(x, "overhead_floor_p50_us"),
        g(x, "overhead_lookout_p50_us"),
        g(&x["bpf"], "watched_ns") / 1e3,
        g(&x["bpf"], "other_ns") / 1e3,
        g(x, "answer_thread_cpu_us_per_exec"),
        g(x, "floor_cpu_us_per_exec"),
    );
    if x["work_floor"].is_object() {
        println!(
            "exec overhead of the work floor (the BPF record taken and argv parsed on one thread, as the agent's answering thread does): {:.1} us p50 over no listener, {:.1} us beyond the allow-all floor; its CPU {:.2} us per exec",
            g(x, "overhead_work_floor_p50_us"),
            g(x, "overhead_work_floor_p50_us") - g(x, "overhead_floor_p50_us"),
            g(x, "work_floor_cpu_us_per_exec"),
        );
    }
}

/// Prints the `agent` part's table and lines, then the consumers'.
/// The discovery rows of a report's `discovery_us`, as table rows.
pub(crate) fn print_discovery_rows(d: &Value) {
    let g = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let p50_p99 = |name: &str, v: &Value| {
        println!("| {name} | {:.0} | {:.0} |", g(v, "p50"), g(v, "p99"));
    };
    for (name, key) in [
        ("runc create exec -> Added (us)", "create_exec_to_added"),
        ("runc create exit -> Added (us)", "create_exit_to_added"),
        ("container exit -> Removed (us)", "exit_to_removed"),
    ] {
        p50_p99(name, &d[key]);
    }
    for (name, key) in [
        (
            "work floor: create exit -> its added line (us)",
            "create_exit_to_added",
        ),
        (
            "work floor: container exit -> its removed line (us)",
            "exit_to_removed",
        ),
    ] {
        if d["work_floor"].is_object() {
            p50_p99(name, &d["work_floor"][key]);
        }
    }
    for (name, key) in [
        (
            "floor: create exit -> another thread read the state (us)",
            "create_exit_to_state_read",
        ),
        (
            "floor: container exit -> another thread woke (us)",
            "exit_to_woken",
        ),
    ] {
        p50_p99(name, &d["floor"][key]);
    }
    // From the kernel's time of each exit (`sched_process_exit`), which
    // the rows above, timed from the benchmark's own wake-up, leave out.
    let k = &d["from_kernel_exit"];
    if k.is_object() {
        for (name, key) in [
            (
                "from the kernel: runc create began to exit -> Added (us)",
                "create_exit_to_added",
            ),
            (
                "from the kernel: container began to exit -> Removed (us)",
                "exit_to_removed",
            ),
            (
                "from the kernel: container began to exit -> the benchmark's reference woke (us)",
                "exit_to_reference",
            ),
            (
                "from the kernel: container began to exit -> the floor's thread woke (us)",
                "exit_to_floor_woken",
            ),
        ] {
            p50_p99(name, &k[key]);
        }
        let wk = &d["work_floor"]["from_kernel_exit"];
        if wk.is_object() {
            p50_p99(
                "from the kernel: container began to exit -> the work floor's removed line (us)",
                &wk["exit_to_removed"],
            );
        }
    }
    println!(
        "| discovery events missing after 5 s (added, removed) | {} | {} |",
        d["missing"]["added"], d["missing"]["removed"]
    );
    if k["lost_samples"].as_u64().is_some_and(|n| n > 0) {
        println!(
            "kernel exit samples lost: {} (the kernel rows are short)",
            k["lost_samples"]
        );
    }
}

pub(crate) fn print_agent(report: &Value) {
    let g = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let p50_p99 = |name: &str, v: &Value| {
        println!("| {name} | {:.0} | {:.0} |", g(v, "p50"), g(v, "p99"));
    };
    let x = &report["exec_us"];
    println!("\n| measurement | p50 | p99 |\n|---|---|---|");
    for (name, key) in [
        ("exec, no listener (us)", "none"),
        ("exec, allow-all floor (us)", "floor"),
        ("exec, work floor (us)", "work_floor"),
        ("exec, lookout (us)", "lookout"),
    ] {
        p50_p99(name, &x[key]);
    }
    print_discovery_rows(&report["discovery_us"]);
    println!(
        "| start-up to ready (ms) | {:.0} | {:.0} |",
        g(&report["startup_ms"], "p50"),
        g(&report["startup_ms"], "max")
    );
    println!();
    if let Some(phases) = report["startup_ms"]["phases_p50"]
        .as_object()
        .filter(|p| !p.is_empty())
    {
        let line: Vec<String> = phases
            .iter()
            .map(|(name, ms)| format!("{name} {:.1}", ms.as_f64().unwrap_or(f64::NAN)))
            .collect();
        println!("start-up phases, p50 (ms): {}", line.join(", "));
    }
    print_exec_split(x);
    let i = &report["idle_5s"];
    println!(
        "idle 5 s: {} CPU ticks, {} wakeups, RSS {} kB (anonymous {} kB, file {} kB)",
        i["cpu_ticks"],
        i["voluntary_ctxt_switches"],
        i["rss_kb"],
        i["rss_anon_kb"],
        i["rss_file_kb"]
    );
    let ch = &report["churn"];
    println!(
        "churn {}: {:.1} containers/s, missed {}, stuck {}, duplicates {}, tracked at once {}, agent CPU {:.2} s, peak RSS {} kB",
        ch["containers"],
        g(ch, "create_start_per_s"),
        ch["missed_added"],
        ch["missing_removed"],
        ch["duplicates"],
        ch["tracked_at_end_of_creation"],
        g(ch, "cpu_s"),
        ch["peak_rss_kb"]
    );
    let fl = &report["churn_floor"];
    println!(
        "churn floor: {} containers under the allow-all responder alone: {:.3} ms per container, the lower of {:.3} and {:.3} (the agent, CPU clock: {:.3} ms)",
        fl["containers"],
        g(fl, "cpu_per_container_ms"),
        g(&fl["samples"][0], "cpu_per_container_ms"),
        g(&fl["samples"][1], "cpu_per_container_ms"),
        g(ch, "cpu_clock_s") * 1e3 / g(ch, "containers"),
    );
    println!(
        "churn work floor: the same containers under the work floor alone (the agent's work on one thread, no safety boundaries): {:.3} ms per container, the lower of {:.3} and {:.3} ({} and {} added lines)",
        g(fl, "work_cpu_per_container_ms"),
        g(&fl["samples"][0]["work"], "cpu_per_container_ms"),
        g(&fl["samples"][1]["work"], "cpu_per_container_ms"),
        fl["samples"][0]["work"]["added_lines"],
        fl["samples"][1]["work"]["added_lines"],
    );
    let m = &report["memory_heavy_annotations"];
    println!(
        "memory: {} containers with 64 KiB of annotations each, {} tracked at once: RSS {} kB (anonymous {} kB, file {} kB), peak {} kB",
        m["containers"],
        m["tracked"],
        m["rss_all_tracked_kb"],
        m["rss_anon_kb"],
        m["rss_file_kb"],
        m["peak_rss_kb"]
    );
    consumers::print(&report["consumers"]);
}
