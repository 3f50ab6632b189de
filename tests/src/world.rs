//! The simulated world: nodes running the node's own core ([`keyhome::core::Core`], the code
//! `keyhome run` drives, here with no lock traffic), their disks, their clocks and the network
//! between them, advanced one event at a time in simulated real time.
//!
//! Faithful to the core's driver contract, as the node's runtime carries it out: its outputs are
//! carried out in the order it produced them; transmissions leave at once; the writes of a
//! `Persist` reach the disk after a simulated sync latency (in order, one node's disk at a time),
//! and only then is `persisted` called, which lets the messages that waited for them leave. A
//! crash loses the process and every write not yet synced. Only the network, the disks and the
//! clocks are simulated.

use std::collections::VecDeque;
use std::time::Duration;

use keyhome::core::{Core, Output, PeerMessage};
use keyhome_delegation::{HolderConfig, HomeConfig};
use keyhome_epoch::{Body, Change, Config, Durable, EpochNode, EpochRecord, Instant, Message, ProposeError};
use keyhome_ring::NodeId;

use crate::check::{Checker, Kind};
use crate::clock::Clock;
use crate::disk::Disk;
use crate::queue::EventQueue;
use crate::rng::Rng;
use crate::scenario::{Fault, Links, Scenario};

/// Simulated real time, in nanoseconds.
pub type Real = u64;

/// Converts a duration to simulated nanoseconds.
pub fn nanos(d: Duration) -> Real {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[derive(Debug)]
enum Ev {
    Deliver { from: NodeId, to: NodeId, message: Message },
    Timer { node: usize, generation: u64 },
    Sync { node: usize, run: u64 },
    Fault(Fault),
}

/// One node slot: the process (when up), its disk and clock.
struct Slot {
    id: NodeId,
    clock: Clock,
    /// Synced state: what survives a crash.
    durable: Durable,
    core: Option<Core>,
    /// What the core produced and the world has not carried out yet, in order.
    out: VecDeque<Output>,
    /// Counts process starts, so events for an earlier run are ignored.
    run: u64,
    /// Writes handed to the disk and not yet synced.
    disk: Disk,
    timer_generation: u64,
    /// When this node's pending operator change was proposed (for latency statistics).
    proposed_at: Option<Real>,
}

/// Counters a run reports.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub events: u64,
    pub messages: u64,
    pub acceptor_writes: u64,
    pub epochs_chosen: u64,
    /// Simulated time from an operator's proposal to the proposer seeing it applied.
    pub change_latencies: Vec<Duration>,
    pub proposals_failed: u64,
}

/// Where the liveness check stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Liveness {
    /// Before healing.
    Waiting,
    /// Healed; the change is proposed at `node` once it accepts it.
    Proposing,
    /// The change was accepted for proposal at `node`.
    Proposed { node: usize },
    /// The change was applied.
    Applied,
}

/// A whole simulated cluster under one scenario.
pub struct World {
    now: Real,
    queue: EventQueue<Ev>,
    slots: Vec<Slot>,
    rng: Rng,
    scenario: Scenario,
    links: Links,
    /// Network faults in force (zero after healing).
    loss: f64,
    duplication: f64,
    lose_chosen: f64,
    crash_after_vote: f64,
    pub checker: Checker,
    pub stats: Stats,
    liveness: Liveness,
}

impl World {
    pub fn new(seed: u64, scenario: Scenario) -> World {
        let mut rng = Rng::new(seed);
        let genesis = scenario.genesis.clone();
        let bound = i64::from(genesis.timing.clock_rate_ppm);
        let slots = (0..scenario.nodes)
            .map(|i| Slot {
                id: NodeId(i as u64 + 1),
                clock: Clock::new(rng.range(0, 1 << 50), rng.range(0, 2 * bound as u64) as i64 - bound),
                durable: Durable::genesis(genesis.clone()),
                core: None,
                out: VecDeque::new(),
                run: 0,
                disk: Disk::default(),
                timer_generation: 0,
                proposed_at: None,
            })
            .collect();
        let n = scenario.nodes;
        let mut world = World {
            now: 0,
            queue: EventQueue::default(),
            slots,
            loss: scenario.loss,
            duplication: scenario.duplication,
            lose_chosen: scenario.lose_chosen,
            crash_after_vote: scenario.crash_after_vote,
            links: Links::new(n),
            checker: Checker::new(n, &scenario),
            rng,
            scenario,
            stats: Stats::default(),
            liveness: Liveness::Waiting,
        };
        for fault in world.scenario.faults.clone() {
            world.schedule(fault.at(), Ev::Fault(fault));
        }
        for i in 0..n {
            world.start(i);
        }
        world
    }

    /// Runs the scenario to its end; the checker holds what was found.
    pub fn run(&mut self) {
        let end = self.scenario.end;
        while let Some((at, ev)) = self.queue.pop() {
            if at > end {
                break;
            }
            self.now = at;
            self.stats.events += 1;
            if self.scenario.trace {
                println!("{:>12.6} {ev:?}", at as f64 / 1e9);
            }
            self.dispatch(ev);
            if self.checker.stop_early() {
                return;
            }
        }
        self.now = end;
        self.check_liveness_at_end();
    }

    fn schedule(&mut self, at: Real, ev: Ev) {
        self.queue.push(at, ev);
    }

    fn index(&self, id: NodeId) -> Option<usize> {
        let i = usize::try_from(id.0).ok()?.checked_sub(1)?;
        (i < self.slots.len()).then_some(i)
    }

    fn local(&self, i: usize) -> Instant {
        self.slots[i].clock.local(self.now)
    }

    fn dispatch(&mut self, ev: Ev) {
        match ev {
            Ev::Deliver { from, to, message } => {
                let (Some(f), Some(t)) = (self.index(from), self.index(to)) else { return };
                if self.links.is_cut(f, t) {
                    return;
                }
                let now = self.local(t);
                let slot = &mut self.slots[t];
                let Some(core) = slot.core.as_ref() else { return };
                core.handle_message(now, from, PeerMessage::Epoch(message), &mut slot.out);
                self.after_input(t);
            }
            Ev::Timer { node, generation } => {
                if self.slots[node].timer_generation != generation {
                    return;
                }
                let now = self.local(node);
                let slot = &mut self.slots[node];
                let Some(core) = slot.core.as_ref() else { return };
                core.handle_timeout(now, &mut slot.out);
                self.drain(node, true);
            }
            Ev::Sync { node, run } => self.sync(node, run),
            Ev::Fault(fault) => self.apply_fault(fault),
        }
    }

    // ---- processes ----

    fn start(&mut self, i: usize) {
        let now = self.local(i);
        let slot = &mut self.slots[i];
        slot.run += 1;
        let mut config = Config::new(slot.id, self.scenario.seed ^ (slot.id.0 << 32) ^ slot.run);
        config.round_timeout = self.scenario.round_timeout;
        config.catch_up_interval = self.scenario.round_timeout;
        config.bugs = self.scenario.bugs;
        let epoch = EpochNode::start(config, slot.durable.clone(), now);
        self.checker.started(i, epoch.incarnation());
        let (home, holder) = (HomeConfig::new(slot.id), HolderConfig::new(slot.id));
        slot.core = Some(Core::new(epoch, home, holder, 1, now, &mut slot.out));
        self.after_input(i);
    }

    fn crash(&mut self, i: usize) {
        let slot = &mut self.slots[i];
        if slot.core.take().is_some() {
            slot.out.clear();
            slot.disk.lose();
            slot.proposed_at = None;
            slot.timer_generation += 1;
            self.checker.crashed(i);
        }
    }

    /// Drains what the core produced after an input, re-arms its timer and runs the checks.
    fn after_input(&mut self, i: usize) {
        self.drain(i, false);
    }

    /// [`World::after_input`]; `timer` when the input was the node's timer.
    fn drain(&mut self, i: usize, timer: bool) {
        while let Some(output) = self.slots[i].out.pop_front() {
            match output {
                Output::Transmit { to, message: PeerMessage::Epoch(message) } => self.send(i, to, message),
                Output::Persist { number, writes } => {
                    let was_idle = self.slots[i].disk.push(number, writes);
                    if was_idle {
                        self.schedule_sync(i);
                    }
                }
                Output::ProposalDone { result } => {
                    if self.scenario.trace {
                        println!("{:>12.6} node {i}: proposal done: {result:?}", self.now as f64 / 1e9);
                    }
                    self.proposal_done(i, result);
                }
                // No locks, keys or clients here: nothing else has a receiver.
                _ => {}
            }
        }
        let slot = &mut self.slots[i];
        slot.timer_generation += 1;
        let Some(core) = slot.core.as_ref() else { return };
        if let Some(at) = core.poll_timeout() {
            let generation = slot.timer_generation;
            let real = slot.clock.real_at(at).max(self.now);
            self.schedule(real, Ev::Timer { node: i, generation });
        }
        let now = self.local(i);
        let Some(core) = self.slots[i].core.as_ref() else { return };
        if self.checker.after_event(self.now, i, now, timer, &core.epoch()) {
            let guards: Vec<_> = (self.slots.iter().enumerate())
                .filter(|(j, _)| *j != i)
                .filter_map(|(j, s)| s.core.as_ref().map(|c| (j, s.clock.local(self.now), c.epoch())))
                .collect();
            let others: Vec<(usize, Instant, &EpochNode)> =
                guards.iter().map(|(j, t, e)| (*j, *t, &**e)).collect();
            self.checker.check_homes(self.now, i, now, &core.epoch(), &others);
        }
    }

    fn schedule_sync(&mut self, i: usize) {
        let (lo, hi) = self.scenario.disk_latency;
        let at = self.now + self.rng.range(lo, hi);
        let run = self.slots[i].run;
        self.schedule(at, Ev::Sync { node: i, run });
    }

    fn sync(&mut self, i: usize, run: u64) {
        let slot = &mut self.slots[i];
        if slot.run != run || slot.core.is_none() {
            return;
        }
        let now = slot.clock.local(self.now);
        let Some(synced) = slot.disk.sync(&mut slot.durable) else { return };
        self.stats.acceptor_writes += synced.acceptor_writes;
        if let Some(core) = slot.core.as_ref() {
            core.persisted(now, synced.number, &mut slot.out);
        }
        if self.slots[i].disk.busy() {
            self.schedule_sync(i);
        }
        self.after_input(i);
    }

    fn send(&mut self, i: usize, to: NodeId, message: Message) {
        self.stats.messages += 1;
        if let Some(core) = self.slots[i].core.as_ref() {
            let promised = self.slots[i].durable.acceptor.promised;
            self.checker.sent(self.now, i, core.epoch().incarnation(), promised, &message);
        }
        match message.body {
            Body::Chosen(_) if self.rng.chance(self.lose_chosen) => return,
            Body::Vote { .. } if self.rng.chance(self.crash_after_vote) => {
                let back = self.now + self.rng.range(1_000_000, 30_000_000);
                self.schedule(self.now, Ev::Fault(Fault::Crash { at: self.now, node: i }));
                self.schedule(back, Ev::Fault(Fault::Restart { at: back, node: i }));
            }
            _ => {}
        }
        let copies = if self.rng.chance(self.duplication) { 2 } else { 1 };
        for _ in 0..copies {
            if self.rng.chance(self.loss) {
                continue;
            }
            let (lo, hi) = self.scenario.net_delay;
            let mut delay = self.rng.range(lo, hi);
            if self.rng.chance(self.scenario.reorder) {
                delay += self.rng.range(hi, hi * 20);
            }
            let from = self.slots[i].id;
            self.schedule(self.now + delay, Ev::Deliver { from, to, message: message.clone() });
        }
    }

    fn proposal_done(&mut self, i: usize, result: Result<u64, ProposeError>) {
        match result {
            Ok(_) => {
                if let Some(at) = self.slots[i].proposed_at.take() {
                    self.stats.change_latencies.push(Duration::from_nanos(self.now - at));
                }
                if self.liveness == (Liveness::Proposed { node: i }) {
                    self.liveness = Liveness::Applied;
                }
            }
            Err(_) => {
                self.slots[i].proposed_at = None;
                self.stats.proposals_failed += 1;
                if self.liveness == (Liveness::Proposed { node: i }) {
                    self.liveness = Liveness::Proposing;
                    self.schedule(self.now, Ev::Fault(Fault::LivenessPropose { at: self.now }));
                }
            }
        }
    }

    // ---- faults and operators ----

    fn apply_fault(&mut self, fault: Fault) {
        match fault {
            Fault::Crash { node, .. } => self.crash(node),
            Fault::Restart { node, .. } => {
                if self.slots[node].core.is_none() {
                    self.start(node);
                }
            }
            Fault::Partition { ref side, one_way, .. } => self.links.partition(side, one_way),
            Fault::HealPartition { .. } => self.links.heal(),
            Fault::Propose { node, .. } => {
                let change = self.random_change();
                self.propose(node, change);
            }
            Fault::Heal { .. } => {
                self.links.heal();
                self.loss = 0.0;
                self.duplication = 0.0;
                self.lose_chosen = 0.0;
                self.crash_after_vote = 0.0;
                self.scenario.reorder = 0.0;
                for i in 0..self.slots.len() {
                    if self.slots[i].core.is_none() {
                        self.start(i);
                    }
                }
                self.liveness = Liveness::Proposing;
            }
            Fault::LivenessPropose { .. } => self.liveness_propose(),
        }
    }

    /// The newest epoch any node knows, in memory or on its disk.
    fn newest(&self) -> EpochRecord {
        let current = self.slots.iter().filter_map(|s| s.core.as_ref().map(|c| c.current()));
        self.scenario.newest(current.chain(self.slots.iter().map(|s| s.durable.current.clone())))
    }

    /// A change an operator might ask for, judged against the newest epoch.
    fn random_change(&mut self) -> Change {
        let newest = self.newest();
        self.scenario.random_change(&mut self.rng, &newest, self.slots.iter().map(|s| s.id))
    }

    /// Asks node `i` for `change`; true when it took it. A one-member epoch decides inside the
    /// call, so the proposal is recorded before and forgotten again on refusal.
    fn propose(&mut self, i: usize, change: Change) -> bool {
        let now = self.local(i);
        let slot = &mut self.slots[i];
        let Some(core) = slot.core.as_ref() else { return false };
        let previous = slot.proposed_at.replace(self.now);
        let result = core.propose(now, change, &mut slot.out);
        if self.scenario.trace {
            println!("{:>12.6} node {i}: propose: {result:?}", self.now as f64 / 1e9);
        }
        let ok = result.is_ok();
        if !ok {
            self.slots[i].proposed_at = previous;
        }
        self.after_input(i);
        ok
    }

    /// After healing: an operator asks a member of the newest epoch for a timing change, and asks
    /// again every round timeout until a node takes it.
    fn liveness_propose(&mut self) {
        if self.liveness != Liveness::Proposing {
            return;
        }
        let newest = self.newest();
        let members: Vec<usize> = newest.member_ids().filter_map(|id| self.index(id)).collect();
        if let Some(node) = self.rng.pick(&members) {
            let change = Change::SetTiming(self.scenario.other_timing(&newest.timing));
            self.liveness = Liveness::Proposed { node };
            if self.propose(node, change) {
                return;
            }
            self.liveness = Liveness::Proposing;
        }
        let at = self.now + nanos(self.scenario.round_timeout);
        self.schedule(at, Ev::Fault(Fault::LivenessPropose { at }));
    }

    /// With faults healed for the liveness bound: the operator's change is applied, every live
    /// member of the newest epoch knows it and holds a home lease.
    fn check_liveness_at_end(&mut self) {
        if self.liveness != Liveness::Applied {
            self.checker.violation(
                self.now,
                Kind::NoProgress,
                format!("operator change not applied: {:?}", self.liveness),
            );
            return;
        }
        let newest = self.newest();
        self.stats.epochs_chosen = newest.number - 1;
        for (i, slot) in self.slots.iter().enumerate() {
            if !newest.is_member(slot.id) {
                continue;
            }
            let now = slot.clock.local(self.now);
            match slot.core.as_ref() {
                Some(core) if core.current().number != newest.number => self.checker.violation(
                    self.now,
                    Kind::NoProgress,
                    format!("node {i} knows epoch {} of {}", core.current().number, newest.number),
                ),
                Some(core) if !core.epoch().holds_lease(now) => self.checker.violation(
                    self.now,
                    Kind::NoProgress,
                    format!("node {i} holds no home lease"),
                ),
                _ => {}
            }
        }
    }
}
