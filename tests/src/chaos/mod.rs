//! Jepsen-style runs against real clusters: 3 to 5 `keyhome run` processes behind UDP relays
//! ([`relay`]), client tasks locking a handful of keys through every node ([`workload`]) and
//! writing to a fenced resource ([`resource`]), a nemesis ([`nemesis`]) that partitions, drops,
//! delays, kills, pauses and removes nodes, and a checker ([`check`]) that judges the guarantees
//! from outside, on the test process's one clock ([`history`]).
//!
//! A run is bounded: the nemesis strikes for [`ChaosOptions::duration`], heals everything, the
//! clients stop, and then every key must lock again within [`RELOCK_BOUND`]. Used by
//! tests/tests/chaos.rs (short seeded runs) and by the `keyhome-chaos` binary (long runs).

pub mod check;
pub mod history;
pub mod nemesis;
pub mod relay;
pub mod resource;
pub mod workload;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use check::Violation;
use history::History;
use nemesis::{Fault, Nemesis};
use relay::Relay;
use resource::{Resource, WriteStats};
use workload::{Counts, Shared, Workload};

use crate::cluster::{self, Cluster, Options};
use crate::rng::Rng;

/// After the last fault is healed, every key must lock again within this long. It covers a
/// restarted node's quarantine and a re-homed key's activation wait (each under 2 s with the
/// run's 500 ms home lease and 1 s delegations), the clients' last ttls and a loaded machine.
pub const RELOCK_BOUND: Duration = Duration::from_secs(15);

/// The variable a node built with the `bug-injection` feature reads (node/src/bugs.rs).
const BUG_VAR: &str = "KEYHOME_INJECT_BUG";

/// What a chaos run does.
#[derive(Clone, Debug)]
pub struct ChaosOptions {
    /// Fixes the nemesis' schedule and the clients' choices (not the processes' timing).
    pub seed: u64,
    /// How long the nemesis strikes.
    pub duration: Duration,
    /// Cluster size, 3 to 5.
    pub nodes: u64,
    pub clients_per_node: usize,
    pub keys: usize,
    /// Runs nodes built with the `bug-injection` feature, with this rule switched off.
    pub bug: Option<String>,
    /// Where the history goes; kept only if the run fails or `keep_history` is set.
    pub history: PathBuf,
    pub keep_history: bool,
}

impl ChaosOptions {
    /// Three nodes, two clients per node, four keys, the history in the
    /// system's temporary directory.
    pub fn new(seed: u64, duration: Duration) -> ChaosOptions {
        ChaosOptions {
            seed,
            duration,
            nodes: 3,
            clients_per_node: 2,
            keys: 4,
            bug: None,
            history: std::env::temp_dir().join(format!("keyhome-chaos-{seed}.history")),
            keep_history: false,
        }
    }
}

/// The outcome of a run.
#[derive(Debug)]
pub struct ChaosReport {
    pub options: ChaosOptions,
    /// Faults struck, per kind of [`Fault::KINDS`].
    pub faults: [u64; Fault::KINDS.len()],
    pub admissions: u64,
    pub recovered: u64,
    pub writes: WriteStats,
    pub lock_errors: u64,
    pub clean_unlocks: u64,
    pub refused_unlocks: u64,
    pub renewals: u64,
    pub stalls: u64,
    pub killed_clients: u64,
    /// The longest any key took to lock again after the last fault was healed.
    pub relock: Duration,
    pub violations: Vec<Violation>,
}

impl ChaosReport {
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }

    /// The one-line summary.
    pub fn summary(&self) -> String {
        let o = &self.options;
        let faults: Vec<String> =
            Fault::KINDS.iter().zip(self.faults).map(|(name, count)| format!("{name} {count}")).collect();
        let mut line = format!(
            "keyhome-chaos seed={} nodes={} duration={}s faults={} [{}] admissions={} recovered={} \
             clean-unlocks={} refused-unlocks={} renewals={} stalls={} killed-clients={} lock-errors={} \
             writes={} fenced-out={} relock-max={:.2}s violations={}",
            o.seed,
            o.nodes,
            o.duration.as_secs(),
            self.faults.iter().sum::<u64>(),
            faults.join(", "),
            self.admissions,
            self.recovered,
            self.clean_unlocks,
            self.refused_unlocks,
            self.renewals,
            self.stalls,
            self.killed_clients,
            self.lock_errors,
            self.writes.accepted + self.writes.refused,
            self.writes.refused,
            self.relock.as_secs_f64(),
            self.violations.len(),
        );
        if let Some(bug) = &o.bug {
            line.push_str(&format!(" bug={bug}"));
        }
        if !self.passed() {
            line.push_str(&format!(" history={}", o.history.display()));
        }
        line
    }
}

/// Runs one chaos run to its end. Panics only if the cluster cannot be set up at all.
pub async fn run(options: &ChaosOptions) -> ChaosReport {
    assert!((3..=5).contains(&options.nodes), "a chaos run has 3 to 5 nodes");
    let mut cluster = Cluster::layout_relayed(Options { nodes: options.nodes, ..Options::default() });
    if let Some(bug) = &options.bug {
        cluster.set_binary(cluster::keyhome_binary_with_bugs(), vec![(BUG_VAR.into(), bug.clone())]);
    }
    let ids = cluster.ids();
    let links: Vec<_> = ids.iter().map(|&i| (i, cluster.addr(i), cluster.take_relay_socket(i))).collect();
    let relay = Relay::start(links, options.seed).await.expect("start the relays");
    for &id in &ids {
        cluster.start_node(id);
    }
    cluster.wait_ready(&ids, 1).await;

    let history = Arc::new(History::create(&options.history).expect("create the history file"));
    history.log(format!("START {options:?}"));
    let shared = Arc::new(Shared {
        history: Arc::clone(&history),
        resource: Resource::default(),
        workload: Workload {
            keys: (0..options.keys).map(|k| format!("k{k}")).collect(),
            ttl_ms: (150, 600),
            wait: Duration::from_secs(1),
        },
        stop: Default::default(),
        counts: Counts::default(),
    });
    let mut clients = Vec::new();
    for (index, (node, _)) in
        ids.iter().flat_map(|&n| (0..options.clients_per_node).map(move |c| (n, c))).enumerate()
    {
        let seed = options.seed.wrapping_mul(0x9e37_79b9).wrapping_add(index as u64);
        let profile = cluster.client_profile(node);
        clients.push(tokio::spawn(workload::client(Arc::clone(&shared), index, profile, seed)));
    }

    let mut nemesis =
        Nemesis { cluster: &mut cluster, relay: &relay, history: &history, failures: Vec::new() };
    let mut faults = [0u64; Fault::KINDS.len()];
    let mut rng = Rng::new(options.seed);
    while history.now() < options.duration {
        tokio::time::sleep(Duration::from_millis(rng.range(300, 1500))).await;
        let fault = Fault::draw(&mut rng, options.nodes);
        // A pause outlasts a delegation lease (1 s) with its rate margin.
        let hold = match fault {
            Fault::Pause(_) => rng.range(1500, 3000),
            _ => rng.range(800, 4000),
        };
        faults[fault.kind()] += 1;
        nemesis.strike(&fault, Duration::from_millis(hold)).await;
        for (id, status) in nemesis.cluster.exited() {
            nemesis.failures.push(format!("node {id} exited by itself ({status})"));
            nemesis.cluster.start_node(id);
        }
    }
    let mut failures = std::mem::take(&mut nemesis.failures);
    history.log("NEMESIS done: every fault healed");

    shared.stop.store(true, Ordering::Relaxed);
    for client in clients {
        // Each client finishes the section it is in (bounded by its calls' timeouts).
        if tokio::time::timeout(Duration::from_secs(30), client).await.is_err() {
            failures.push("a client task did not stop within 30 s".into());
        }
    }
    let relock = relock_every_key(&cluster, &shared, &mut failures).await;
    for (id, status) in cluster.exited() {
        failures.push(format!("node {id} exited by itself ({status})"));
    }

    let admissions = history.admissions();
    let mut violations = check::check(&admissions);
    let writes = shared.resource.stats();
    if writes.refused_in_window > 0 {
        violations.push(Violation {
            kind: "fenced out inside its deadline",
            detail: format!("{} writes (see REFUSED in the history)", writes.refused_in_window),
        });
    }
    violations.extend(failures.into_iter().map(|detail| Violation { kind: "run", detail }));
    for v in &violations {
        history.log(format!("VIOLATION {v}"));
    }
    history.flush();
    if violations.is_empty() && !options.keep_history {
        let _ = std::fs::remove_file(history.path());
    }
    let c = &shared.counts;
    let count = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    ChaosReport {
        options: options.clone(),
        faults,
        admissions: admissions.len() as u64,
        recovered: admissions.iter().filter(|a| a.recovered).count() as u64,
        writes,
        lock_errors: count(&c.lock_errors),
        clean_unlocks: count(&c.clean_unlocks),
        refused_unlocks: count(&c.refused_unlocks),
        renewals: count(&c.renewals),
        stalls: count(&c.stalls),
        killed_clients: count(&c.killed),
        relock,
        violations,
    }
    // The relays stop as `relay` is dropped here, the nodes (SIGKILL, by PID) as `cluster` is.
}

/// Locks every key once more, all at once, each through a node chosen by the key; returns the
/// longest time one took. A key that does not lock within [`RELOCK_BOUND`] is a failure.
async fn relock_every_key(cluster: &Cluster, shared: &Arc<Shared>, failures: &mut Vec<String>) -> Duration {
    let history = &shared.history;
    let healed = history.now();
    history.log("RELOCK every key");
    let mut tasks = Vec::new();
    for (k, key) in shared.workload.keys.iter().enumerate() {
        let node = 1 + k as u64 % cluster.options.nodes;
        let profile = cluster.client_profile(node);
        let (shared, key) = (Arc::clone(shared), key.clone());
        // Client ids after the workload's.
        let id = 1000 + k;
        tasks.push(tokio::spawn(async move {
            let history = &shared.history;
            while history.now() < healed + RELOCK_BOUND {
                let Some(client) = workload::connect(&profile).await else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                let wait = Duration::from_secs(1);
                match workload::lock(history, &client, id, node, &key, Duration::from_secs(1), wait).await {
                    Ok((handle, a, index)) => {
                        let _ = workload::unlock(history, &client, handle, &a, index).await;
                        return Ok(a.admitted - healed);
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            }
            Err(format!("key {key} did not lock within {RELOCK_BOUND:?} after the faults healed"))
        }));
    }
    let mut longest = Duration::ZERO;
    for task in tasks {
        match task.await {
            Ok(Ok(took)) => longest = longest.max(took),
            Ok(Err(failure)) => failures.push(failure),
            Err(e) => failures.push(format!("a relock task failed: {e}")),
        }
    }
    longest
}
