//! A lock scenario: the epoch harness's cluster, network and faults (on a shorter schedule), plus
//! holder pauses, the client workload and the delegation settings, all drawn from one seed.

use std::time::Duration;

use keyhome_epoch::{EpochRecord, Member, Timing};
use keyhome_ring::NodeId;

use crate::rng::Rng;
use crate::scenario::{CLOCK_RATE_PPM, Chaos, Fault, Scenario, ms, timing_cycle};
use crate::world::{Real, nanos};

use super::{LockOptions, SimBugs};

/// Simulated time with faults, before healing.
pub const CHAOS: Duration = Duration::from_millis(1500);
/// After healing: clients stop starting locks this long after the heal...
pub const QUIET_AFTER_HEAL: Duration = Duration::from_millis(500);
/// ...and the liveness probes run this long after the heal.
pub const PROBE_AFTER_HEAL: Duration = Duration::from_millis(1500);

/// Home leases the genesis picks from (the first two) and operators switch among.
const HOME_LEASES: [Duration; 3] =
    [Duration::from_millis(200), Duration::from_millis(300), Duration::from_millis(500)];
/// Delegation leases the genesis picks from (the first three) and operators switch among. With
/// the longest home lease the activation wait is then at most `rate_margin(700 ms)`, 714 ms.
const DELEGATION_LEASES: [Duration; 4] = [
    Duration::from_millis(20),
    Duration::from_millis(50),
    Duration::from_millis(100),
    Duration::from_millis(200),
];

/// The holder settings of every node in a run.
#[derive(Clone, Debug)]
pub struct HolderParams {
    pub idle_release: Duration,
    pub min_useful: Duration,
    pub retry: Duration,
    pub resend: Duration,
}

/// How the driver paces the epoch walks of every node in a run (see
/// `keyhome_delegation::walk`).
#[derive(Clone, Copy, Debug)]
pub struct WalkParams {
    /// Slots per step, for the home and the holder alike.
    pub step: u32,
    /// How long after a timer call the driver takes the next step at the earliest, as a busy
    /// runtime would: other inputs run in between, and an epoch may come before the walk is over.
    pub lag: Real,
}

impl WalkParams {
    /// What a node does: steps as the node takes them, back to back.
    pub const SHIPPED: WalkParams = WalkParams { step: keyhome_delegation::DEFAULT_WALK_STEP, lag: 0 };
}

/// Everything one seeded lock run does.
#[derive(Clone, Debug)]
pub struct LockScenario {
    /// The epoch part: cluster, timing, network, disks, crashes, partitions, operator changes.
    pub base: Scenario,
    pub bugs: keyhome_delegation::Bugs,
    /// Holder pauses: `(at, node, duration)`; the process handles nothing meanwhile.
    pub pauses: Vec<(Real, usize, Real)>,
    /// Clients per node.
    pub clients: usize,
    /// The first `hot` keys of `base.keys` form the Zipf-hot set.
    pub hot: usize,
    /// Share of lock calls that pick from the hot set.
    pub hot_share: f64,
    pub holder: HolderParams,
    pub walk: WalkParams,
    /// Key shards per node (see `keyhome::core`): 1 to 3, drawn per seed.
    pub shards: usize,
    /// Share of recalled clients that hurry (stop writing and unlock at their next step); the
    /// others hold on to the deadline they were told, as unresponsive clients would.
    pub responsive: f64,
    /// Latency from a client's deadline check to its write reaching the resource.
    pub write_delay: (Real, Real),
    pub heal_at: Real,
    pub quiet_at: Real,
    /// When the liveness probes start; `None` for scripted runs.
    pub probe_at: Option<Real>,
    /// Whether clients run the random workload (scripted runs drive locks themselves).
    pub workload: bool,
    /// Every clock runs at one end of the rate bound (hostile runs): margins are then exact.
    pub extreme_clocks: bool,
    /// No faults at all: the epoch-change checks of [`super::handover`] are enforced.
    pub calm: bool,
    /// Epoch-change rules the simulation's authority wrapper switches off.
    pub sim_bugs: SimBugs,
}

impl LockScenario {
    pub fn generate(seed: u64, options: &LockOptions) -> LockScenario {
        let mut rng = Rng::new(seed ^ 0x10c5_5eed);
        let members = options.members.unwrap_or_else(|| rng.range(3, 5) as usize);
        let nodes = members + 2;
        let lease = DELEGATION_LEASES[rng.range(0, 2) as usize];
        let timing = Timing {
            home_lease: HOME_LEASES[rng.range(0, 1) as usize],
            max_delegation_lease: lease,
            clock_rate_ppm: CLOCK_RATE_PPM,
        };
        // From a generator of its own, so the rest of the scenario is drawn as before.
        let timings = timing_cycle(&mut Rng::new(seed ^ 0x7141_96c5), &HOME_LEASES, &DELEGATION_LEASES);
        let genesis = genesis(members, timing);
        let chaos = nanos(CHAOS);
        let mut faults = Vec::new();
        let mut proposal_times = Vec::new();
        let changes = if options.hostile { rng.range(3, 6) } else { rng.range(1, 4) };
        for _ in 0..changes {
            let at = rng.range(ms(100), chaos - ms(100));
            let node = rng.range(0, nodes as u64 - 1) as usize;
            faults.push(Fault::Propose { at, node });
            proposal_times.push(at);
        }
        let phase = Chaos { end: chaos, proposals: &proposal_times };
        for node in 0..nodes {
            if rng.chance(if options.hostile { 0.6 } else { 0.35 }) {
                faults.extend(phase.crash(&mut rng, node, 0.3, (ms(1), ms(60)), (ms(5), ms(500))));
            }
        }
        for _ in 0..rng.range(0, 2) {
            faults.extend(phase.partition(&mut rng, nodes, (ms(30), ms(600))));
        }
        faults.push(Fault::Heal { at: chaos });

        // Pauses: longer than the delegation's deadlines (and sometimes the home lease).
        let lease_ns = nanos(lease);
        let mut pauses = Vec::new();
        let count = if options.hostile { rng.range(2, 4) } else { rng.range(0, 2) };
        for _ in 0..count {
            let node = rng.range(0, nodes as u64 - 1) as usize;
            let at = rng.range(ms(50), chaos - ms(50));
            let long = rng.range(lease_ns + lease_ns / 2, 4 * lease_ns + ms(50));
            pauses.push((at, node, long.min(chaos - at)));
        }

        let keys = 12;
        let base = Scenario {
            seed,
            nodes,
            genesis,
            round_timeout: Duration::from_millis(40),
            net_delay: (100_000, ms(2)),
            reorder: 0.02,
            loss: rng.range(0, 50) as f64 / 1000.0,
            duplication: rng.range(0, 30) as f64 / 1000.0,
            lose_chosen: if options.hostile { 0.5 } else { [0.0, 0.3][rng.range(0, 1) as usize] },
            crash_after_vote: if options.hostile { 0.1 } else { [0.0, 0.05][rng.range(0, 1) as usize] },
            disk_latency: (50_000, ms(1)),
            faults,
            end: chaos + nanos(PROBE_AFTER_HEAL) + ms(1200),
            bugs: options.epoch_bugs,
            trace: options.trace,
            keys: (0..keys).map(|i| format!("k{i}").into_bytes()).collect(),
            timings,
        };
        let responsive = rng.range(0, 1000) as f64 / 1000.0;
        // From a generator of its own, so the rest of the scenario is drawn as before. Half the
        // runs walk a slot or two per step, slowly, so that keys are met before the walk reaches
        // them and epochs come while a walk is in progress.
        let mut pace = Rng::new(seed ^ 0x3a1c_5eed);
        let walk = if pace.chance(0.5) {
            WalkParams { step: pace.range(1, 2) as u32, lag: pace.range(0, ms(40)) }
        } else {
            WalkParams::SHIPPED
        };
        let shards = pace.range(1, 3) as usize;
        LockScenario {
            base,
            bugs: options.bugs,
            pauses,
            clients: if options.hostile { 3 } else { 2 },
            hot: 3,
            hot_share: 0.5,
            responsive,
            holder: HolderParams {
                idle_release: Duration::from_nanos(rng.range(ms(5), 4 * lease_ns)),
                min_useful: lease / 10,
                retry: Duration::from_millis(5),
                resend: Duration::from_millis(20),
            },
            walk,
            shards,
            write_delay: (50_000, ms(1)),
            heal_at: chaos,
            quiet_at: chaos + nanos(QUIET_AFTER_HEAL),
            probe_at: Some(chaos + nanos(PROBE_AFTER_HEAL)),
            workload: true,
            extreme_clocks: options.hostile,
            calm: false,
            sim_bugs: options.sim_bugs,
        }
    }

    /// A calm run: the cluster, timing, holder settings and workload of [`LockScenario::generate`]
    /// (from a generator of its own, so the seeds of other runs are unaffected), but no loss,
    /// duplication, reordering, crash, partition or pause. Three operator changes, at 0.2, 1.0
    /// and 1.8 s (each up to 0.1 s later), each asked of a running member of the newest epoch:
    /// 0.8 s apart, more than any activation wait (at most 612 ms: a 500 ms home lease and a
    /// 100 ms delegation lease, widened by the rate bound) plus handover rounds, so every change
    /// has settled before the next. Clients stop starting locks at 2.6 s; probes run at 2.8 s.
    /// Timing changes switch the home lease only: after a change that lengthens delegations a
    /// home waits for a lease of the new epoch before it grants a key that kept it (see
    /// `EpochNode::home_active`), which the checks of calm runs would count as a pause.
    pub fn calm(seed: u64, options: &LockOptions) -> LockScenario {
        let mut rng = Rng::new(seed ^ 0xca1_5eed);
        let members = options.members.unwrap_or_else(|| rng.range(3, 5) as usize);
        let nodes = members + 2;
        let lease = DELEGATION_LEASES[rng.range(0, 2) as usize];
        let timing = Timing {
            home_lease: HOME_LEASES[rng.range(0, 1) as usize],
            max_delegation_lease: lease,
            clock_rate_ppm: CLOCK_RATE_PPM,
        };
        let timings = timing_cycle(&mut Rng::new(seed ^ 0x7141_96c5), &HOME_LEASES, &[lease]);
        let faults = (0..3)
            .map(|i| Fault::LivenessPropose { at: ms(200 + 800 * i) + rng.range(0, ms(100)) })
            .collect();
        let lease_ns = nanos(lease);
        let quiet = ms(2600);
        let base = Scenario {
            seed,
            nodes,
            genesis: genesis(members, timing),
            round_timeout: Duration::from_millis(40),
            net_delay: (100_000, ms(2)),
            reorder: 0.0,
            loss: 0.0,
            duplication: 0.0,
            lose_chosen: 0.0,
            crash_after_vote: 0.0,
            disk_latency: (50_000, ms(1)),
            faults,
            end: ms(4000),
            bugs: options.epoch_bugs,
            trace: options.trace,
            keys: (0..12).map(|i| format!("k{i}").into_bytes()).collect(),
            timings,
        };
        let responsive = rng.range(0, 1000) as f64 / 1000.0;
        LockScenario {
            base,
            bugs: options.bugs,
            pauses: Vec::new(),
            clients: 2,
            hot: 3,
            hot_share: 0.5,
            responsive,
            holder: HolderParams {
                idle_release: Duration::from_nanos(rng.range(ms(5), 4 * lease_ns)),
                min_useful: lease / 10,
                retry: Duration::from_millis(5),
                resend: Duration::from_millis(20),
            },
            walk: WalkParams::SHIPPED,
            shards: 2,
            write_delay: (50_000, ms(1)),
            heal_at: 0,
            quiet_at: quiet,
            probe_at: Some(ms(2800)),
            workload: true,
            extreme_clocks: false,
            calm: true,
            sim_bugs: options.sim_bugs,
        }
    }

    /// A fault-free run of `members` nodes (no spares) with fixed timing, for scripted tests:
    /// no loss, duplication, reordering, crash, pause or operator change, and no random workload.
    pub fn quiet(seed: u64, members: usize, lease: Duration) -> LockScenario {
        let timing = Timing {
            home_lease: Duration::from_millis(300),
            max_delegation_lease: lease,
            clock_rate_ppm: CLOCK_RATE_PPM,
        };
        LockScenario::quiet_with(seed, members, timing)
    }

    /// [`LockScenario::quiet`] with the genesis timing `timing` (delegations as long as it allows).
    pub fn quiet_with(seed: u64, members: usize, timing: Timing) -> LockScenario {
        let lease = timing.max_delegation_lease;
        let base = Scenario {
            seed,
            nodes: members,
            genesis: genesis(members, timing),
            round_timeout: Duration::from_millis(40),
            net_delay: (500_000, 1_000_000),
            reorder: 0.0,
            loss: 0.0,
            duplication: 0.0,
            lose_chosen: 0.0,
            crash_after_vote: 0.0,
            disk_latency: (50_000, ms(1)),
            faults: Vec::new(),
            end: u64::MAX / 4,
            bugs: Default::default(),
            trace: false,
            keys: (0..12).map(|i| format!("k{i}").into_bytes()).collect(),
            timings: vec![timing],
        };
        LockScenario {
            base,
            bugs: Default::default(),
            pauses: Vec::new(),
            clients: 1,
            hot: 0,
            hot_share: 0.0,
            responsive: 1.0,
            holder: HolderParams {
                idle_release: lease * 4,
                min_useful: lease / 10,
                retry: Duration::from_millis(5),
                resend: Duration::from_millis(20),
            },
            walk: WalkParams::SHIPPED,
            shards: 2,
            write_delay: (50_000, ms(1)),
            heal_at: 0,
            quiet_at: 0,
            probe_at: None,
            workload: false,
            extreme_clocks: false,
            calm: false,
            sim_bugs: SimBugs::default(),
        }
    }
}

fn genesis(members: usize, timing: Timing) -> EpochRecord {
    let genesis_members = (1..=members as u64)
        .map(|id| Member { id: NodeId(id), addr: format!("127.0.0.1:{}", 7000 + id) })
        .collect();
    EpochRecord::genesis(genesis_members, timing).expect("the simulation's genesis is valid")
}
