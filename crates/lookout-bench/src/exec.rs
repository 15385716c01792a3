//! The exec overhead: a static no-op's fork+exec+wait with no listener,
//! under the floors, and watched by the agent; and where the agent's share
//! goes (its BPF programs, its answering thread).

use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};

use crate::agent::Agent;
use crate::floor::Floor;
use crate::host::{drop_page_cache, exec_times, thread_cpu_ns};
use crate::stats::{pct, shuffle, stats};
use crate::util::{exec, say, utf8};
use crate::{Options, Paths};

/// Exec overhead: the time (us) to fork, exec and wait for a static no-op
/// with no listener, under the allow-all floor responder, and watched by
/// lookout (named `runc`), interleaved in a new random order every round.
pub(crate) fn exec_overhead(
    opts: &Options,
    paths: &Paths,
    lookout: &Path,
) -> anyhow::Result<Value> {
    let work = &paths.work;
    std::fs::create_dir_all(work.join("bin"))?;
    // A no-op static binary named like a runtime: its exec cost is all
    // fork+exec, so a listener's share is visible.
    let src = work.join("noop.c");
    std::fs::write(&src, "int main(void) { return 0; }\n")?;
    let fake = work.join("bin/runc");
    exec(
        "build noop",
        Command::new("gcc")
            .args(["-O2", "-static", "-o"])
            .arg(&fake)
            .arg(&src),
        "install gcc and libc6-dev",
    )?;
    let fake_s = utf8(&fake)?;

    // Three copies of the no-op (three inodes): one unmarked, one marked by
    // the allow-all floor responder, one watched by lookout. Both listeners
    // run at once and the execs are interleaved, so machine noise hits all
    // three configurations alike.
    std::fs::create_dir_all(work.join("floor"))?;
    std::fs::create_dir_all(work.join("none"))?;
    let floor_noop = work.join("floor/noop");
    let none_noop = work.join("none/noop");
    lookout_testsupport::install_executable(&fake, &floor_noop)?;
    lookout_testsupport::install_executable(&fake, &none_noop)?;
    say(
        "bench",
        &format!(
            "exec overhead: {} interleaved execs per configuration",
            opts.rounds * opts.execs
        ),
    );
    // The work floor takes the BPF record and parses argv as the agent
    // does; named apart, so that neither's programs capture the other's
    // execs (the agent's filter has every default runtime's name).
    std::fs::create_dir_all(work.join("work-floor"))?;
    let work_noop = work.join("work-floor/runc-wf");
    lookout_testsupport::install_executable(&fake, &work_noop)?;
    let f = Floor::start(&paths.floors.allow_all, &[&floor_noop], &work.join("floor"))?;
    let wf = Floor::start_work(&paths.floors, &work_noop, &work.join("work-floor"))?;
    let (a, _) = Agent::start(lookout, work, &["--runtime-path", fake_s])?;
    // The three files must be in the same page-cache state: a file that
    // `cp` or the linker just wrote sits in the cache in other folio sizes
    // than one that exec faulted in, and that alone moved an exec by
    // +-30 us here (more than the listeners cost). Drop them, then let
    // exec fault all three in the same way.
    for p in [&none_noop, &floor_noop, &work_noop, &fake] {
        drop_page_cache(p)?;
    }
    for _ in 0..50 {
        for p in [&none_noop, &floor_noop, &work_noop, &fake] {
            let _ = exec_times(p, 1); // warm up
        }
    }
    let (mut none, mut floor, mut work_t, mut agent_t) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let answer_cpu_ns = thread_cpu_ns(a.pid(), "lookout-answer");
    let floor_cpu_ns = thread_cpu_ns(f.pid(), "");
    let work_cpu_ns = thread_cpu_ns(wf.pid(), "");
    // A new random order every iteration (see `shuffle`).
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..opts.rounds * opts.execs {
        let mut order = [0usize, 1, 2, 3];
        shuffle(&mut rng, &mut order);
        for k in order {
            match k {
                0 => none.extend(exec_times(&none_noop, 1)),
                1 => floor.extend(exec_times(&floor_noop, 1)),
                2 => work_t.extend(exec_times(&work_noop, 1)),
                _ => agent_t.extend(exec_times(&fake, 1)),
            }
        }
    }
    let answer_cpu_ns =
        answer_cpu_ns.and_then(|before| Some(thread_cpu_ns(a.pid(), "lookout-answer")? - before));
    let floor_cpu_ns = floor_cpu_ns.and_then(|before| Some(thread_cpu_ns(f.pid(), "")? - before));
    let work_cpu_ns = work_cpu_ns.and_then(|before| Some(thread_cpu_ns(wf.pid(), "")? - before));
    let n = agent_t.len().max(1) as f64;
    drop(f);
    drop(wf);
    // Where the agent's share goes, off the timed loop: its BPF programs
    // in the exec'ing process (kernel statistics, on only for this), and
    // the answering thread's CPU above.
    let bpf = bpf_cost_per_exec(a.pid(), &fake, &none_noop, opts.execs.max(200) * 10);
    a.stop();
    let med = |v: &[f64]| pct(&mut v.to_vec(), 0.5);
    Ok(json!({
        "none": stats(&none), "floor": stats(&floor), "lookout": stats(&agent_t),
        "work_floor": stats(&work_t),
        "overhead_floor_p50_us": med(&floor) - med(&none),
        "overhead_work_floor_p50_us": med(&work_t) - med(&none),
        "overhead_lookout_p50_us": med(&agent_t) - med(&none),
        "work_floor_cpu_us_per_exec": work_cpu_ns.map(|ns| ns as f64 / work_t.len().max(1) as f64 / 1e3),
        "lookout_vs_floor_total_p50": med(&agent_t) / med(&floor),
        "answer_thread_cpu_us_per_exec": answer_cpu_ns.map(|ns| ns as f64 / n / 1e3),
        "floor_cpu_us_per_exec": floor_cpu_ns.map(|ns| ns as f64 / floor.len().max(1) as f64 / 1e3),
        "bpf": bpf,
    }))
}

/// Run time (ns) and runs of the tracepoint programs agent `pid` holds,
/// summed, from `/proc/<pid>/fdinfo` (kernel.bpf_stats_enabled must be on).
pub(crate) fn bpf_prog_stats(pid: u32) -> (u64, u64) {
    let mut total = (0, 0);
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fdinfo")) else {
        return total;
    };
    for fd in fds.flatten() {
        let info = std::fs::read_to_string(fd.path()).unwrap_or_default();
        let field = |k: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(k))
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        // 5: BPF_PROG_TYPE_TRACEPOINT.
        if field("prog_type:") == Some(5) {
            total.0 += field("run_time_ns:").unwrap_or(0);
            total.1 += field("run_cnt:").unwrap_or(0);
        }
    }
    total
}

/// The agent's BPF programs' kernel time per exec (ns): `n` execs of
/// `watched` (a runtime's name: the argv is captured) and `n` of `other`
/// (any other exec on the node: the programs leave early), each with its
/// exit. Statistics are switched on for this only and set back after.
/// `null` when the kernel keeps none.
pub(crate) fn bpf_cost_per_exec(pid: u32, watched: &Path, other: &Path, n: usize) -> Value {
    const KNOB: &str = "/proc/sys/kernel/bpf_stats_enabled";
    let Ok(was) = std::fs::read_to_string(KNOB) else {
        return Value::Null;
    };
    if std::fs::write(KNOB, "1").is_err() {
        return Value::Null;
    }
    let per_exec = |bin: &Path| {
        let (t0, _) = bpf_prog_stats(pid);
        let _ = exec_times(bin, n);
        let (t1, _) = bpf_prog_stats(pid);
        t1.saturating_sub(t0) as f64 / n as f64
    };
    let watched_ns = per_exec(watched);
    let other_ns = per_exec(other);
    let _ = std::fs::write(KNOB, was.trim());
    json!({ "execs": n, "watched_ns": watched_ns, "other_ns": other_ns })
}
