//! The invariants, held against simulated real time after every event.

use std::collections::HashMap;
use std::fmt;

use keyhome_epoch::paxos::{Ballot, Vote};
use keyhome_epoch::{Body, EpochNode, EpochRecord, Instant, Message};
use keyhome_ring::KeyDigest;

use crate::scenario::Scenario;
use crate::world::Real;

/// Which invariant broke.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Two different records were chosen (accepted by a majority) or learned for one epoch number.
    Fork,
    /// Two nodes could grant the same key at the same real instant.
    TwoHomes,
    /// A node acted under an epoch lower than one it acted under before.
    BelowFloor,
    /// A run of a node acted with an incarnation no larger than an earlier run's.
    ReusedIncarnation,
    /// After healing, the cluster did not finish a change, learn it everywhere and hold leases.
    NoProgress,
}

/// One broken invariant, at a simulated real instant.
#[derive(Clone, Debug)]
pub struct Violation {
    /// Simulated real time, nanoseconds.
    pub at: Real,
    pub kind: Kind,
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} at {:.6} s: {}", self.kind, self.at as f64 / 1e9, self.detail)
    }
}

/// Ghost state about every node, kept outside the nodes so crashes cannot erase it.
pub struct Checker {
    /// The record first seen learned or chosen for each epoch number.
    chosen: HashMap<u64, EpochRecord>,
    /// The value each proposer sent accepts for, by (slot, ballot).
    proposed: HashMap<(u64, Ballot), EpochRecord>,
    /// Acceptors that voted `Accepted` for each (slot, ballot).
    accepted: HashMap<(u64, Ballot), Vec<usize>>,
    /// Per node: the epoch number last checked against `chosen`.
    seen_epoch: Vec<u64>,
    /// Per node: epoch and lease end at its last home check.
    seen_rights: Vec<(u64, Option<Instant>)>,
    /// Per node: for an epoch, which watched keys it homes in that epoch. A node can grant only
    /// keys it homes in its current epoch, so the others need no look-up.
    homed: Vec<(u64, Vec<bool>)>,
    /// Per node: the highest epoch it acted under (sent a lease request or grant for).
    floor: Vec<u64>,
    /// Per node: the highest incarnation of any earlier run that acted.
    used_incarnation: Vec<u64>,
    /// Per node: the current run's incarnation and whether it has acted.
    run: Vec<(u64, bool)>,
    /// The watched keys, with their digests (hashed once per run).
    keys: Vec<(Vec<u8>, KeyDigest)>,
    pub violations: Vec<Violation>,
}

impl Checker {
    pub fn new(nodes: usize, scenario: &Scenario) -> Checker {
        Checker {
            chosen: HashMap::from([(1, scenario.genesis.clone())]),
            proposed: HashMap::new(),
            accepted: HashMap::new(),
            seen_epoch: vec![0; nodes],
            seen_rights: vec![(0, None); nodes],
            homed: vec![(0, Vec::new()); nodes],
            floor: vec![0; nodes],
            used_incarnation: vec![0; nodes],
            run: vec![(0, false); nodes],
            keys: scenario.keys.iter().map(|k| (k.clone(), KeyDigest::of(k))).collect(),
            violations: Vec::new(),
        }
    }

    pub fn violation(&mut self, at: Real, kind: Kind, detail: String) {
        self.violations.push(Violation { at, kind, detail });
    }

    /// A run stops at its first violation: what follows would only repeat it.
    pub fn stop_early(&self) -> bool {
        !self.violations.is_empty()
    }

    pub fn started(&mut self, node: usize, incarnation: u64) {
        self.run[node] = (incarnation, false);
    }

    pub fn crashed(&mut self, node: usize) {
        let (incarnation, acted) = self.run[node];
        if acted {
            self.used_incarnation[node] = self.used_incarnation[node].max(incarnation);
        }
    }

    /// Records `record` as the one for its epoch number, or reports a fork.
    fn decided(&mut self, at: Real, record: &EpochRecord, how: &str) {
        match self.chosen.get(&record.number) {
            None => {
                self.chosen.insert(record.number, record.clone());
            }
            Some(first) if first != record => {
                let detail = format!("epoch {} {how} differs from the one decided first", record.number);
                self.violation(at, Kind::Fork, detail);
            }
            Some(_) => {}
        }
    }

    /// Follows the Paxos messages: a value is chosen the moment a majority of the slot's
    /// acceptors has voted for one ballot, whether or not anybody learns it.
    fn watch_votes(&mut self, at: Real, node: usize, message: &Message) {
        match &message.body {
            Body::Accept { slot, ballot, value } => {
                self.proposed.entry((*slot, *ballot)).or_insert_with(|| value.clone());
            }
            Body::Vote { slot, vote: Vote::Accepted { ballot } } => {
                let voters = self.accepted.entry((*slot, *ballot)).or_default();
                if voters.contains(&node) {
                    return;
                }
                voters.push(node);
                let votes = voters.len();
                // The acceptors of `slot` are the members of epoch `slot - 1`, which was decided.
                let majority = self.chosen.get(&(slot - 1)).map(|r| r.majority());
                let value = self.proposed.get(&(*slot, *ballot)).cloned();
                if let (Some(majority), Some(value)) = (majority, value)
                    && votes >= majority
                {
                    self.decided(at, &value, "chosen by votes");
                }
            }
            _ => {}
        }
    }

    /// `node` (running as `incarnation`, its disk holding the promise `promised`) sent `message`.
    pub fn sent(
        &mut self,
        at: Real,
        node: usize,
        incarnation: u64,
        promised: Option<Ballot>,
        message: &Message,
    ) {
        self.watch_votes(at, node, message);
        // An accept leaves only after the proposer's own promise of its ballot is durable, so a
        // restarted proposer never reuses the ballot with another value.
        if let Body::Accept { ballot, .. } = &message.body
            && promised < Some(*ballot)
        {
            let detail =
                format!("node {node} sent an accept at {ballot:?} with {promised:?} durably promised");
            self.violation(at, Kind::Fork, detail);
        }
        // Lease requests and grants act under the epoch they carry.
        let acting = matches!(message.body, Body::LeaseRequest { .. } | Body::LeaseGrant { .. })
            .then_some(message.epoch);
        if !self.run[node].1 {
            self.run[node].1 = true;
            if incarnation <= self.used_incarnation[node] {
                let used = self.used_incarnation[node];
                self.violation(
                    at,
                    Kind::ReusedIncarnation,
                    format!("node {node} acts as incarnation {incarnation} after {used}"),
                );
            }
        }
        if let Some(epoch) = acting {
            if epoch < self.floor[node] {
                let floor = self.floor[node];
                self.violation(
                    at,
                    Kind::BelowFloor,
                    format!("node {node} acts under epoch {epoch} after {floor}"),
                );
            }
            self.floor[node] = self.floor[node].max(epoch);
        }
    }

    /// After `node` handled an event at real time `at` (its clock read `now`); `timer` when the
    /// event was its timer.
    ///
    /// Only that node can have gained the right to grant a key: every other node's rights only
    /// shrink with time until its own next event. And its rights grow only when its epoch or its
    /// lease end changes, or at an activation instant, where the core sets a timer; other events
    /// need no home check.
    ///
    /// Checks the learned epoch, and returns whether [`Checker::check_homes`] must run.
    pub fn after_event(
        &mut self,
        at: Real,
        node: usize,
        now: Instant,
        timer: bool,
        core: &EpochNode,
    ) -> bool {
        let current = core.current();
        if self.seen_epoch[node] != current.number {
            self.seen_epoch[node] = current.number;
            self.decided(at, current, &format!("learned by node {node}"));
        }
        let rights = (current.number, core.lease_until(now));
        let changed = std::mem::replace(&mut self.seen_rights[node], rights) != rights;
        changed || timer
    }

    /// Whether `node` (running `core`) homes watched key `k` in its current epoch.
    fn homes(&mut self, node: usize, core: &EpochNode, k: usize) -> bool {
        let epoch = core.current().number;
        if self.homed[node].0 != epoch || self.homed[node].1.is_empty() {
            let homed = self.keys.iter().map(|(key, _)| core.home_of(key) == Some(core.id())).collect();
            self.homed[node] = (epoch, homed);
        }
        self.homed[node].1[k]
    }

    /// No key `node` may grant at `now` may be granted by any of `others` (each with its own
    /// clock reading) at the same real instant `at`.
    pub fn check_homes(
        &mut self,
        at: Real,
        node: usize,
        now: Instant,
        core: &EpochNode,
        others: &[(usize, Instant, &EpochNode)],
    ) {
        let current = core.current();
        for k in 0..self.keys.len() {
            let digest = self.keys[k].1;
            if !self.homes(node, core, k) || !core.home_active_digest(now, digest) {
                continue;
            }
            for &(other, other_now, other_core) in others {
                if self.homes(other, other_core, k) && other_core.home_active_digest(other_now, digest) {
                    let key = String::from_utf8_lossy(&self.keys[k].0).into_owned();
                    let detail = format!(
                        "nodes {node} (epoch {}) and {other} (epoch {}) both home of {key}",
                        current.number,
                        other_core.current().number
                    );
                    self.violation(at, Kind::TwoHomes, detail);
                    return;
                }
            }
        }
    }
}
