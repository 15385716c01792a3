//! 1. What gate subscribers add to `runc start`, beside the gate floor.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use lookout_client::{Client, Filter};
use serde_json::{Value, json};

use super::{
    LIST_CALLS, SUBSCRIBERS, WARMUP, Watched, metric_sum, runc_copy, subscribe, wait_metric,
};
use crate::containers::{busybox_bundle, runtime};
use crate::floor::{Floor, Floors};
use crate::host::drop_page_cache;
use crate::stats::{pct, shuffle, stats};
use crate::util::say;

/// The work floor serving the least start gate (its `--gate`), on a copy
/// of runc of its own: the gated start's floor.
pub(super) struct GateFloor {
    runc: PathBuf,
    socket: PathBuf,
    out: PathBuf,
    /// Its log: a `held ID MICROSECONDS` line per start of a held container.
    err: PathBuf,
    _floor: Floor,
}

impl GateFloor {
    fn start(floors: &Floors, dir: &Path) -> anyhow::Result<GateFloor> {
        // Not named `runc`: the agents' BPF programs, which pick execs by
        // file name, then capture none of its execs, nor it theirs.
        let runc = runc_copy(dir, "runc-wf")?;
        let socket = dir.join("floor.sock");
        let gate = format!("--gate={}", socket.to_str().context("utf-8 path")?);
        let out = dir.join("floor.out");
        let floor = Floor::start_with(
            &floors.work,
            &[&floors.bpf_object, Path::new(&gate), &runc],
            dir,
            Some(&out),
        )?;
        Ok(GateFloor {
            runc,
            socket,
            out,
            err: dir.join("floor.err"),
            _floor: floor,
        })
    }

    /// How long each start of a held container waited (microseconds).
    fn start_waits(&self) -> Vec<f64> {
        std::fs::read_to_string(&self.err)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.strip_prefix("held ")?.rsplit(' ').next()?.parse().ok())
            .collect()
    }
}

/// What a gate round does with an agent or a floor.
pub(crate) trait Gated {
    /// Runs its copy of runc with `args`; whether it succeeded.
    fn run(&self, args: &[&str]) -> bool;
    /// Waits until it reported container `id`.
    fn wait_reported(&self, id: &str) -> anyhow::Result<()>;
}

impl Gated for Watched {
    fn run(&self, args: &[&str]) -> bool {
        Watched::run(self, args)
    }

    fn wait_reported(&self, id: &str) -> anyhow::Result<()> {
        Watched::wait_reported(self, id)
    }
}

impl Gated for GateFloor {
    fn run(&self, args: &[&str]) -> bool {
        runtime(&self.runc, args)
    }

    fn wait_reported(&self, id: &str) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let quoted = format!("\"{id}\"");
        while !std::fs::read_to_string(&self.out)
            .unwrap_or_default()
            .contains(&quoted)
        {
            if Instant::now() > deadline {
                bail!(
                    "the gate floor on {} never reported {id}",
                    self.runc.display()
                );
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }
}

/// 1. `runc start` with 0, 1 and 10 gate subscribers that allow at once,
///    and, in the same rounds, through the gate floor with 0 and 1.
pub(super) fn gates(
    lookout: &Path,
    floors: &Floors,
    work: &Path,
    rt: &tokio::runtime::Runtime,
    rounds: usize,
) -> anyhow::Result<Value> {
    say(
        "bench",
        &format!(
            "gates: {rounds} rounds of `runc start` with {SUBSCRIBERS:?} subscribers, interleaved"
        ),
    );
    let agents = SUBSCRIBERS
        .iter()
        .map(|n| Watched::start(lookout, &work.join(format!("gate-{n}"))))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let delivered: Vec<Arc<Mutex<Vec<f64>>>> = agents.iter().map(|_| Arc::default()).collect();
    for ((a, &n), delivered) in agents.iter().zip(&SUBSCRIBERS).zip(&delivered) {
        for j in 0..n {
            rt.block_on(subscribe(
                a.socket.clone(),
                format!("bench-{n}-{j}"),
                Arc::clone(delivered),
            ))?;
        }
        wait_metric(a, "lookout_gate_subscribers", n as f64)?;
    }
    // The gate floor, without a subscriber and with one (connected when
    // `subscribe` returns: the floor registers it before it says so).
    let gate_floors = [
        GateFloor::start(floors, &work.join("gate-floor-0"))?,
        GateFloor::start(floors, &work.join("gate-floor-1"))?,
    ];
    let floor_delivered: Arc<Mutex<Vec<f64>>> = Arc::default();
    rt.block_on(subscribe(
        gate_floors[1].socket.clone(),
        "bench-floor".into(),
        Arc::clone(&floor_delivered),
    ))?;
    let targets: Vec<&dyn Gated> = agents
        .iter()
        .map(|a| a as &dyn Gated)
        .chain(gate_floors.iter().map(|f| f as &dyn Gated))
        .collect();
    let labels: Vec<String> = SUBSCRIBERS
        .iter()
        .map(|n| n.to_string())
        .chain(["f0".into(), "f1".into()])
        .collect();
    let bundle = work.join("bundle-gate");
    busybox_bundle(&bundle, &["sleep", "30"])?;
    let bs = bundle.to_str().context("utf-8 path")?;
    // Same page-cache state for the three copies (see the exec overhead).
    for a in &agents {
        drop_page_cache(&a.runc)?;
    }
    for f in &gate_floors {
        drop_page_cache(&f.runc)?;
    }
    let (times, back_to_back) = gate_rounds(&targets, &labels, bs, rounds)?;
    let pages: Vec<String> = agents.iter().map(Watched::metrics).collect();
    // The floor of any answer through the API on this machine: a `List`
    // round trip on an idle agent (threads parked, as when a hold begins),
    // and back to back (threads awake).
    let (list_idle_us, list_busy_us) = list_round_trips(rt, &agents[0].socket)?;
    drop(targets);
    let floor_waits = gate_floors[1].start_waits();
    drop(gate_floors);
    drop(agents);

    let p = |v: &[f64], q: f64| pct(&mut v.to_vec(), q);
    let paired =
        |a: &[f64], b: &[f64]| -> Vec<f64> { a.iter().zip(b).map(|(a, b)| a - b).collect() };
    let (f0, f1) = (SUBSCRIBERS.len(), SUBSCRIBERS.len() + 1);
    let floor_delivered = floor_delivered
        .lock()
        .map(|d| d.clone())
        .unwrap_or_default();
    let mut out = json!({ "rounds": rounds, "list_round_trip_idle_us": stats(&list_idle_us),
        "list_round_trip_busy_us": stats(&list_busy_us),
        // The work floor with the least gate and one subscriber, minus the
        // same without one: what any gate that holds a start until one
        // subscriber answers through lookout.v1 adds here.
        "gate_floor": {
            "start_us": stats(&times[f1]),
            "start_ungated_us": stats(&times[f0]),
            "added_paired_p50_us": p(&paired(&times[f1], &times[f0]), 0.5),
            "back_to_back_start_us": stats(&back_to_back[f1]),
            "back_to_back_start_ungated_us": stats(&back_to_back[f0]),
            "back_to_back_added_paired_p50_us": p(&paired(&back_to_back[f1], &back_to_back[f0]), 0.5),
            "holds_answered": floor_delivered.len(),
            "hold_to_subscriber_us": stats(&floor_delivered),
            // As the agent's lookout_gate_start_wait_seconds: every start
            // of a held container, 0 for one decided before it came.
            "start_wait_us": stats(&floor_waits),
            "start_wait_mean_us": floor_waits.iter().sum::<f64>() / floor_waits.len().max(1) as f64,
            "held_starts": floor_waits.len(),
        } });
    for (k, n) in SUBSCRIBERS.iter().enumerate() {
        let page = &pages[k];
        let hold_s = metric_sum(page, "lookout_gate_hold_seconds_sum", "");
        let hold_n = metric_sum(page, "lookout_gate_hold_seconds_count", "");
        // Start k minus start 0 of the same round: the pair shares the
        // round's machine state.
        let pairs = paired(&times[k], &times[0]);
        let hold_mean_us = if hold_n > 0.0 {
            hold_s / hold_n * 1e6
        } else {
            0.0
        };
        let wait_s = metric_sum(page, "lookout_gate_start_wait_seconds_sum", "");
        let wait_n = metric_sum(page, "lookout_gate_start_wait_seconds_count", "");
        let b2b_paired = paired(&back_to_back[k], &back_to_back[0]);
        let delivered = delivered[k].lock().map(|d| d.clone()).unwrap_or_default();
        let out_mean_us = delivered.iter().sum::<f64>() / delivered.len().max(1) as f64;
        out[format!("subscribers_{n}")] = json!({
            "start_us": stats(&times[k]),
            "added_p50_us": p(&times[k], 0.5) - p(&times[0], 0.5),
            "added_p99_us": p(&times[k], 0.99) - p(&times[0], 0.99),
            "added_paired_p50_us": p(&pairs, 0.5),
            "holds_answered": delivered.len(),
            "decisions_allow": metric_sum(page, "lookout_gate_decisions_total", "outcome=\"allow\""),
            "decisions_not_allow": metric_sum(page, "lookout_gate_decisions_total", "")
                - metric_sum(page, "lookout_gate_decisions_total", "outcome=\"allow\""),
            "agent_hold_mean_us": hold_mean_us,
            "start_wait_mean_us": if wait_n > 0.0 { wait_s / wait_n * 1e6 } else { 0.0 },
            "held_starts": wait_n,
            "back_to_back_start_us": stats(&back_to_back[k]),
            "back_to_back_added_p50_us": p(&back_to_back[k], 0.5) - p(&back_to_back[0], 0.5),
            "back_to_back_added_p99_us": p(&back_to_back[k], 0.99) - p(&back_to_back[0], 0.99),
            "back_to_back_added_paired_p50_us": p(&b2b_paired, 0.5),
            "hold_to_subscriber_us": stats(&delivered),
            "hold_to_subscriber_mean_us": out_mean_us,
        });
    }
    Ok(out)
}

/// `rounds` timed `runc start`s through each of `targets` (after
/// [`WARMUP`] rounds not counted), each after its `create` was reported;
/// then as many back to back (`start` right after `create`). Each target
/// in a new random order every time. Microseconds, per target.
#[allow(clippy::type_complexity)]
pub(crate) fn gate_rounds(
    targets: &[&dyn Gated],
    labels: &[String],
    bs: &str,
    rounds: usize,
) -> anyhow::Result<(Vec<Vec<f64>>, Vec<Vec<f64>>)> {
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); targets.len()];
    let mut back_to_back: Vec<Vec<f64>> = vec![Vec::new(); targets.len()];
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    for r in 0..WARMUP + rounds {
        let ids: Vec<String> = labels
            .iter()
            // This run's own ids: a run that failed half-way leaves its
            // containers in runc's root.
            .map(|n| format!("bench-gate{n}-{r}-{}", std::process::id()))
            .collect();
        let mut order: Vec<usize> = (0..targets.len()).collect();
        shuffle(&mut rng, &mut order);
        for &k in &order {
            if !targets[k].run(&["create", "--bundle", bs, &ids[k]]) {
                bail!("{} create {} failed", labels[k], ids[k]);
            }
        }
        for (a, id) in targets.iter().zip(&ids) {
            a.wait_reported(id)?;
        }
        shuffle(&mut rng, &mut order);
        for &k in &order {
            let t = Instant::now();
            let ok = targets[k].run(&["start", &ids[k]]);
            let us = t.elapsed().as_secs_f64() * 1e6;
            if !ok {
                bail!("{} start {} failed", labels[k], ids[k]);
            }
            if r >= WARMUP {
                times[k].push(us);
            }
        }
        for (a, id) in targets.iter().zip(&ids) {
            a.run(&["delete", "--force", id]);
        }
        // Back to back: `start` right after `create` exits, as a script
        // would; the subscribers have only the gap between the two execs
        // to answer before the start waits.
        shuffle(&mut rng, &mut order);
        for &k in &order {
            let id = format!("{}-b", ids[k]);
            if !targets[k].run(&["create", "--bundle", bs, &id]) {
                bail!("{} create {id} failed", labels[k]);
            }
            let t = Instant::now();
            let ok = targets[k].run(&["start", &id]);
            let us = t.elapsed().as_secs_f64() * 1e6;
            if !ok {
                bail!("{} start {id} failed", labels[k]);
            }
            if r >= WARMUP {
                back_to_back[k].push(us);
            }
            targets[k].run(&["delete", "--force", &id]);
        }
    }
    Ok((times, back_to_back))
}

/// `List` round trips (us) on the agent serving `socket`: idle (threads
/// parked, as when a hold begins), and back to back (threads awake).
fn list_round_trips(
    rt: &tokio::runtime::Runtime,
    socket: &Path,
) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    rt.block_on(async {
        let client = Client::connect(socket).await?;
        let (mut idle, mut busy) = (Vec::new(), Vec::new());
        for i in 0..2 * LIST_CALLS {
            if i % 2 == 0 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let t = Instant::now();
            client.list(Filter::all()).await?;
            let us = t.elapsed().as_secs_f64() * 1e6;
            if i % 2 == 0 { &mut idle } else { &mut busy }.push(us);
        }
        anyhow::Ok((idle, busy))
    })
}
