//! A scenario: the cluster, its timing, the network's and disks' behaviour and the schedule of
//! faults and operator changes, all drawn from one seed.

use std::time::Duration;

use keyhome_epoch::{Bugs, Change, EpochRecord, Member, Timing};
use keyhome_ring::NodeId;

use crate::rng::Rng;
use crate::world::{Real, nanos};

/// How long after healing the checker waits for progress: the operator's change applied, every
/// live member on the newest epoch and holding a home lease.
pub const LIVENESS_BOUND: Duration = Duration::from_secs(3);
/// Simulated time with faults, before healing.
pub const CHAOS: Duration = Duration::from_secs(5);
/// Home leases the scenarios pick from (operators switch among them too).
const HOME_LEASES: [Duration; 3] =
    [Duration::from_millis(200), Duration::from_millis(300), Duration::from_millis(500)];

/// Delegation leases the scenarios pick from (operators switch among them too).
const DELEGATION_LEASES: [Duration; 3] =
    [Duration::from_millis(20), Duration::from_millis(100), Duration::from_millis(1000)];

/// Delegation leases operators switch among in hostile runs: short ones only (see
/// [`Scenario::generate`]).
const HOSTILE_DELEGATION_LEASES: [Duration; 2] = [Duration::from_millis(20), Duration::from_millis(40)];

/// The clock-rate bound of every simulated epoch.
pub const CLOCK_RATE_PPM: u32 = 10_000;

/// Choices the caller may fix instead of the seed.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Number of genesis members (3 to 7 when not fixed); two spare nodes are added.
    pub members: Option<usize>,
    /// Safety rules to switch off.
    pub bugs: Bugs,
    /// Print every event (for replaying one seed).
    pub trace: bool,
    /// The nemeses at full strength in every seed, and twice the operator changes: what the
    /// injected-bug tests use to find rare interleavings quickly.
    pub hostile: bool,
}

/// The names of the safety rules a run can switch off, as `--bug` takes them.
pub const BUG_NAMES: [&str; 6] = [
    "acceptor-durability",
    "renewal-cutoff",
    "activation-wait",
    "epoch-floor",
    "incarnation",
    "stranger-majority",
];

/// The switch for the rule named `name` (one of [`BUG_NAMES`]).
pub fn bug_switch(name: &str) -> Option<Bugs> {
    let mut bugs = Bugs::default();
    match name {
        "acceptor-durability" => bugs.amnesiac_acceptor = true,
        "renewal-cutoff" => bugs.renew_after_accept = true,
        "activation-wait" => bugs.skip_activation_wait = true,
        "epoch-floor" => bugs.no_epoch_floor = true,
        "incarnation" => bugs.volatile_incarnation = true,
        "stranger-majority" => bugs.stranger_majority = true,
        _ => return None,
    }
    Some(bugs)
}

/// Epoch seeds pinned by `tests/simulation.rs`
/// (`a_spare_learns_its_epoch_from_a_member_of_the_epoch_before`): a spare added to a 2-member
/// epoch learns it only from a member of the epoch before, a stranger to it. Each fails with
/// `--bug stranger-majority` (`NoProgress`), which `tests/injected_bugs.rs` checks, so the pin
/// can fail.
pub const SPARE_LEARNS_FROM_A_STRANGER: [u64; 1] = [1169];

/// One scheduled happening.
#[derive(Clone, Debug)]
pub enum Fault {
    Crash {
        at: Real,
        node: usize,
    },
    Restart {
        at: Real,
        node: usize,
    },
    /// Nodes on different sides stop hearing each other; with `one_way`, only messages from the
    /// `true` side to the `false` side are lost.
    Partition {
        at: Real,
        side: Vec<bool>,
        one_way: bool,
    },
    HealPartition {
        at: Real,
    },
    /// An operator asks `node` for a random change.
    Propose {
        at: Real,
        node: usize,
    },
    /// End of faults: partitions, loss, duplication and reordering stop, crashed nodes restart.
    Heal {
        at: Real,
    },
    /// After healing, an operator asks a member for a change, and again until one takes it.
    LivenessPropose {
        at: Real,
    },
}

impl Fault {
    pub fn at(&self) -> Real {
        match self {
            Fault::Crash { at, .. }
            | Fault::Restart { at, .. }
            | Fault::Partition { at, .. }
            | Fault::HealPartition { at }
            | Fault::Propose { at, .. }
            | Fault::Heal { at }
            | Fault::LivenessPropose { at } => *at,
        }
    }
}

/// Everything one seeded run does.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub seed: u64,
    /// Node slots; the first `genesis.members.len()` are the genesis members, the rest spares.
    pub nodes: usize,
    pub genesis: EpochRecord,
    pub round_timeout: Duration,
    /// One-way message delay range, in nanoseconds.
    pub net_delay: (Real, Real),
    /// Probability that a message is held back up to 20 times the longest delay (reordering).
    pub reorder: f64,
    pub loss: f64,
    pub duplication: f64,
    /// Extra loss of `Chosen` messages only, which slows learning (a nemesis).
    pub lose_chosen: f64,
    /// Probability that an acceptor crashes right after sending a vote, back 1 to 30 ms later
    /// (a nemesis).
    pub crash_after_vote: f64,
    /// Time for a disk to sync one batch, in nanoseconds.
    pub disk_latency: (Real, Real),
    pub faults: Vec<Fault>,
    pub end: Real,
    pub bugs: Bugs,
    pub trace: bool,
    /// Keys whose homes the checker watches.
    pub keys: Vec<Vec<u8>>,
    /// The timings operators switch among, in the order they switch (see
    /// [`Scenario::other_timing`]); at least two, the genesis timing among them.
    pub timings: Vec<Timing>,
}

/// Every timing with a home lease from `home_leases` and a delegation lease from
/// `delegation_leases`, in an order drawn from `rng`: an operator's timing changes, in turn, then
/// shorten and lengthen each lease in every combination.
pub fn timing_cycle(rng: &mut Rng, home_leases: &[Duration], delegation_leases: &[Duration]) -> Vec<Timing> {
    let mut all: Vec<Timing> = home_leases
        .iter()
        .flat_map(|&home_lease| {
            delegation_leases.iter().map(move |&max_delegation_lease| Timing {
                home_lease,
                max_delegation_lease,
                clock_rate_ppm: CLOCK_RATE_PPM,
            })
        })
        .collect();
    // Fisher-Yates.
    for i in (1..all.len()).rev() {
        all.swap(i, rng.range(0, i as u64) as usize);
    }
    all
}

/// Where faults may fall in a run: its fault phase, and the instants operators propose changes
/// at (crashes and partitions cluster there, where they hurt most).
pub struct Chaos<'a> {
    /// End of the fault phase.
    pub end: Real,
    pub proposals: &'a [Real],
}

impl Chaos<'_> {
    /// A crash of `node` and, when it falls in the fault phase, its restart. With probability
    /// `near` the crash strikes within 10 ms after a proposal and lasts `short`; otherwise it
    /// strikes anywhere and lasts `long` (nanosecond ranges).
    pub fn crash(
        &self,
        rng: &mut Rng,
        node: usize,
        near: f64,
        short: (Real, Real),
        long: (Real, Real),
    ) -> Vec<Fault> {
        let (at, down) = match rng.pick(self.proposals) {
            Some(t) if rng.chance(near) => (t + rng.range(0, ms(10)), rng.range(short.0, short.1)),
            _ => (rng.range(0, self.end), rng.range(long.0, long.1)),
        };
        let mut faults = vec![Fault::Crash { at, node }];
        if at + down < self.end {
            faults.push(Fault::Restart { at: at + down, node });
        }
        faults
    }

    /// A partition of `nodes` into two non-empty random sides (one-way with probability 0.3),
    /// healed after `lasts` (a nanosecond range) or at the end of the fault phase. Half of them
    /// strike within 20 ms after a proposal.
    pub fn partition(&self, rng: &mut Rng, nodes: usize, lasts: (Real, Real)) -> [Fault; 2] {
        let at = match rng.pick(self.proposals) {
            Some(t) if rng.chance(0.5) => t + rng.range(0, ms(20)),
            _ => rng.range(0, self.end),
        };
        let mut side: Vec<bool> = (0..nodes).map(|_| rng.chance(0.5)).collect();
        if side.iter().all(|&s| s) || side.iter().all(|&s| !s) {
            side[0] = !side[0];
        }
        let partition = Fault::Partition { at, side, one_way: rng.chance(0.3) };
        [partition, Fault::HealPartition { at: (at + rng.range(lasts.0, lasts.1)).min(self.end) }]
    }
}

/// Which directed links drop everything, as partitions leave them.
#[derive(Clone, Debug)]
pub struct Links {
    /// `cut[from][to]`.
    cut: Vec<Vec<bool>>,
}

impl Links {
    pub fn new(nodes: usize) -> Links {
        Links { cut: vec![vec![false; nodes]; nodes] }
    }

    /// Whether messages from `from` to `to` are lost.
    pub fn is_cut(&self, from: usize, to: usize) -> bool {
        self.cut[from][to]
    }

    /// Cuts every link between the two sides (with `one_way`, only from the `true` side), in
    /// addition to what is cut already.
    pub fn partition(&mut self, side: &[bool], one_way: bool) {
        for (a, row) in self.cut.iter_mut().enumerate() {
            for (b, cell) in row.iter_mut().enumerate() {
                if side[a] != side[b] && (!one_way || side[a]) {
                    *cell = true;
                }
            }
        }
    }

    /// Restores every link.
    pub fn heal(&mut self) {
        self.cut.iter_mut().for_each(|row| row.fill(false));
    }
}

pub(crate) fn ms(n: u64) -> Real {
    n * 1_000_000
}

impl Scenario {
    pub fn generate(seed: u64, options: &Options) -> Scenario {
        let mut rng = Rng::new(seed ^ 0x5ce7_a410);
        let members = options.members.unwrap_or_else(|| rng.range(3, 7) as usize);
        let nodes = members + 2;
        let timing = Timing {
            home_lease: HOME_LEASES[rng.range(0, 2) as usize],
            // Short delegations in hostile runs: the activation wait covers home lease and
            // delegation lease, and a long delegation lease would hide a broken lease cut-off
            // behind its margin in a run that grants no delegations.
            max_delegation_lease: if options.hostile {
                DELEGATION_LEASES[0]
            } else {
                DELEGATION_LEASES[rng.range(0, 2) as usize]
            },
            clock_rate_ppm: CLOCK_RATE_PPM,
        };
        // From a generator of their own, so the rest of the scenario is drawn as before.
        let delegation_leases: &[Duration] =
            if options.hostile { &HOSTILE_DELEGATION_LEASES } else { &DELEGATION_LEASES };
        let timings = timing_cycle(&mut Rng::new(seed ^ 0x7141_96c5), &HOME_LEASES, delegation_leases);
        let genesis_members = (1..=members as u64)
            .map(|id| Member { id: NodeId(id), addr: format!("127.0.0.1:{}", 7000 + id) })
            .collect();
        let genesis =
            EpochRecord::genesis(genesis_members, timing).expect("the simulation's genesis is valid");
        let chaos = nanos(CHAOS);
        let mut faults = Vec::new();

        let mut proposal_times = Vec::new();
        let changes = if options.hostile { rng.range(8, 14) } else { rng.range(3, 8) };
        for _ in 0..changes {
            let at = rng.range(ms(200), chaos - ms(200));
            let node = rng.range(0, nodes as u64 - 1) as usize;
            faults.push(Fault::Propose { at, node });
            proposal_times.push(at);
            if rng.chance(0.5) {
                let other = (node + 1 + rng.range(0, nodes as u64 - 2) as usize) % nodes;
                faults.push(Fault::Propose { at: at + rng.range(0, ms(3)), node: other });
            }
        }
        let phase = Chaos { end: chaos, proposals: &proposal_times };
        for node in 0..nodes {
            for _ in 0..rng.range(0, 2) {
                faults.extend(phase.crash(&mut rng, node, 0.4, (ms(1), ms(100)), (ms(20), ms(1500))));
            }
        }
        for _ in 0..rng.range(0, 3) {
            faults.extend(phase.partition(&mut rng, nodes, (ms(50), ms(1500))));
        }
        faults.push(Fault::Heal { at: chaos });
        faults.push(Fault::LivenessPropose { at: chaos + ms(300) });

        Scenario {
            seed,
            nodes,
            genesis,
            round_timeout: Duration::from_millis(40),
            net_delay: (100_000, ms(2)),
            reorder: 0.02,
            loss: rng.range(0, 80) as f64 / 1000.0,
            duplication: rng.range(0, 40) as f64 / 1000.0,
            lose_chosen: if options.hostile { 0.9 } else { [0.0, 0.3, 0.8][rng.range(0, 2) as usize] },
            crash_after_vote: if options.hostile { 0.3 } else { [0.0, 0.05, 0.2][rng.range(0, 2) as usize] },
            disk_latency: (50_000, ms(1)),
            faults,
            end: chaos + nanos(LIVENESS_BOUND),
            bugs: options.bugs,
            trace: options.trace,
            keys: (0..24).map(|i| format!("key-{i}").into_bytes()).collect(),
            timings,
        }
    }

    /// The newest of the epochs the nodes know (`known`, in slot order: on a tie, the last), or
    /// the genesis when there is none.
    pub fn newest(&self, known: impl Iterator<Item = EpochRecord>) -> EpochRecord {
        known.max_by_key(|r| r.number).unwrap_or_else(|| self.genesis.clone())
    }

    /// A change an operator might ask for, judged against `newest`: adding one of `nodes` (every
    /// node of the run, in slot order) that is no member, removing a member of an epoch of more
    /// than two, replacing a member, or else switching to [`Scenario::other_timing`].
    pub fn random_change(
        &self,
        rng: &mut Rng,
        newest: &EpochRecord,
        nodes: impl Iterator<Item = NodeId>,
    ) -> Change {
        let members: Vec<NodeId> = newest.member_ids().collect();
        let spares: Vec<NodeId> = nodes.filter(|id| !newest.is_member(*id)).collect();
        let member = |id: NodeId| Member { id, addr: format!("127.0.0.1:{}", 7000 + id.0) };
        match rng.range(0, 3) {
            0 if !spares.is_empty() => Change::Add(member(rng.pick(&spares).unwrap_or(NodeId(1)))),
            1 if members.len() > 2 => Change::Remove(rng.pick(&members).unwrap_or(NodeId(1))),
            2 if !spares.is_empty() => Change::Replace {
                old: rng.pick(&members).unwrap_or(NodeId(1)),
                new: member(rng.pick(&spares).unwrap_or(NodeId(1))),
            },
            _ => Change::SetTiming(self.other_timing(&newest.timing)),
        }
    }

    /// The timing an operator switches to from `t`: the one after `t` in [`Scenario::timings`]
    /// (after the last, the first; the first if `t` is not listed).
    pub fn other_timing(&self, t: &Timing) -> Timing {
        let next = self.timings.iter().position(|x| x == t).map_or(0, |i| (i + 1) % self.timings.len());
        self.timings.get(next).copied().unwrap_or(*t)
    }
}
