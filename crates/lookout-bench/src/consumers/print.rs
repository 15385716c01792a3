//! The consumers' table and lines.

use serde_json::Value;

use super::SUBSCRIBERS;

/// Prints the consumers' table and lines: the gates', then the
/// watchers'.
pub(crate) fn print(v: &Value) {
    let g = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let gs = &v["gate_start_us"];
    println!(
        "\nconsumers: `runc start` with gate subscribers that allow at once, {} interleaved rounds\n",
        gs["rounds"]
    );
    println!("| runc start | p50 (us) | p99 (us) | added p50 | added p99 | added, paired p50 |");
    println!("|---|---|---|---|---|---|");
    for n in SUBSCRIBERS {
        let x = &gs[format!("subscribers_{n}")];
        println!(
            "| {n} subscriber(s) | {:.0} | {:.0} | {:+.0} | {:+.0} | {:+.0} |",
            g(&x["start_us"], "p50"),
            g(&x["start_us"], "p99"),
            g(x, "added_p50_us"),
            g(x, "added_p99_us"),
            g(x, "added_paired_p50_us"),
        );
    }
    println!(
        "\n`runc start` right after `create` exits (back to back), the same rounds\n\n\
         | runc start | p50 (us) | p99 (us) | added p50 | added p99 | added, paired p50 |\n|---|---|---|---|---|---|"
    );
    for n in SUBSCRIBERS {
        let x = &gs[format!("subscribers_{n}")];
        println!(
            "| {n} subscriber(s) | {:.0} | {:.0} | {:+.0} | {:+.0} | {:+.0} |",
            g(&x["back_to_back_start_us"], "p50"),
            g(&x["back_to_back_start_us"], "p99"),
            g(x, "back_to_back_added_p50_us"),
            g(x, "back_to_back_added_p99_us"),
            g(x, "back_to_back_added_paired_p50_us"),
        );
    }
    for n in &SUBSCRIBERS[1..] {
        let x = &gs[format!("subscribers_{n}")];
        println!(
            "{n} subscriber(s): {} holds answered (warm-up included), {:.0} not allowed (timeouts, disconnects); \
             an answer came {:.0} us after its hold on average, which took {:.0} us to reach the subscriber \
             (p50 {:.0}, p99 {:.0}); {:.0} held starts waited {:.1} us on average for answers still missing",
            x["holds_answered"],
            g(x, "decisions_not_allow"),
            g(x, "agent_hold_mean_us"),
            g(x, "hold_to_subscriber_mean_us"),
            g(&x["hold_to_subscriber_us"], "p50"),
            g(&x["hold_to_subscriber_us"], "p99"),
            g(x, "held_starts"),
            g(x, "start_wait_mean_us"),
        );
    }
    let f = &gs["gate_floor"];
    println!(
        "the gate floor (the work floor holding each start for one subscriber): added, paired p50 {:+.0} us; \
         back to back {:+.0} us; {} holds answered, p50 {:.0} us from hold to subscriber; \
         {} held starts waited {:.1} us on average (p50 {:.0}, p99 {:.0})",
        g(f, "added_paired_p50_us"),
        g(f, "back_to_back_added_paired_p50_us"),
        f["holds_answered"],
        g(&f["hold_to_subscriber_us"], "p50"),
        f["held_starts"],
        g(f, "start_wait_mean_us"),
        g(&f["start_wait_us"], "p50"),
        g(&f["start_wait_us"], "p99"),
    );
    println!(
        "a `List` round trip (the API's floor): after 2 ms idle p50 {:.0} us, p99 {:.0} us; \
         right after another p50 {:.0} us, p99 {:.0} us",
        g(&gs["list_round_trip_idle_us"], "p50"),
        g(&gs["list_round_trip_idle_us"], "p99"),
        g(&gs["list_round_trip_busy_us"], "p50"),
        g(&gs["list_round_trip_busy_us"], "p99"),
    );
    print_watchers(&v["watchers"]);
}

/// The watchers' lines.
fn print_watchers(w: &Value) {
    let g = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let (a, b) = (&w["with_watchers"], &w["without"]);
    println!(
        "\nwatchers: {} containers through each agent ({} and {} events), {} watchers read {} of {} changes ({} snapshots, {:.0} dropped)",
        w["containers"],
        a["events"],
        b["events"],
        w["watchers"],
        w["watcher_changes_read"],
        w["watcher_changes_expected"],
        w["watcher_snapshots"],
        g(w, "watchers_dropped")
    );
    println!(
        "\n| agent | CPU per event (us) | CPU clock per event (us) | RSS before (kB) | RSS end (kB) | peak RSS (kB) |"
    );
    println!("|---|---|---|---|---|---|");
    for (name, x) in [
        (format!("{} watchers", w["watchers"]), a),
        ("no watcher".to_owned(), b),
    ] {
        println!(
            "| {name} | {:.0} | {:.0} | {} | {} | {} |",
            g(x, "cpu_per_event_us"),
            g(x, "cpu_clock_per_event_us"),
            x["rss_before_kb"],
            x["rss_end_kb"],
            x["peak_rss_kb"]
        );
    }
    println!(
        "added by the watchers: {:.0} us per event (CPU clock: {:.0} us, {:.2} us per watcher and event)",
        g(w, "added_cpu_per_event_us"),
        g(w, "added_cpu_clock_per_event_us"),
        g(w, "added_cpu_clock_per_watcher_event_us"),
    );
    println!(
        "floor: the allow-all responder alone on the same containers: {:.0} us per container event (CPU clock)",
        g(&w["floor"], "cpu_clock_per_container_event_us"),
    );
    let sw = |x: &Value| {
        let c = &x["context_switches"];
        let threads: Vec<String> = c["voluntary_per_container_by_thread"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| format!("{k} {:.1}", v.as_f64().unwrap_or(f64::NAN)))
                    .collect()
            })
            .unwrap_or_default();
        format!(
            "{:.1} voluntary ({}), {:.1} involuntary",
            g(c, "voluntary_per_container"),
            threads.join(", "),
            g(c, "involuntary_per_container")
        )
    };
    println!(
        "floor of a watcher: one {}-byte write per watcher and event to a socket of its own, its reader woken: {:.2} us per watcher and event (CPU clock)",
        w["frame_floor"]["frame_bytes"],
        g(&w["frame_floor"], "cpu_clock_per_watcher_event_us"),
    );
    for (key, how) in [
        ("grpc_floor", "registered for reading, as the agent"),
        ("grpc_floor_tokio_registration", "tokio's registration"),
    ] {
        if w[key].is_object() {
            println!(
                "floor of a gRPC watch stream ({how}): a tonic server that only queues each event to every stream: {:.2} us per watcher and event (CPU clock: {:.2} serving, {:.2} queueing from another thread)",
                g(&w[key], "cpu_clock_per_watcher_event_us"),
                g(&w[key], "server_cpu_clock_per_watcher_event_us"),
                g(&w[key], "queueing_cpu_clock_per_watcher_event_us"),
            );
        }
    }
    println!("context switches per container, no watcher: {}", sw(b));
    println!("context switches per container, floor: {}", sw(&w["floor"]));
    let wf = &w["work_floor"];
    if wf.is_object() {
        println!(
            "work floor: the agent's work for each container on one thread, no safety boundaries: {:.0} us per container event (CPU clock; {} added and {} removed lines)",
            g(wf, "cpu_clock_per_container_event_us"),
            wf["added_lines"],
            wf["removed_lines"],
        );
        println!("context switches per container, work floor: {}", sw(wf));
    }
}
