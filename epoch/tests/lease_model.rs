//! Exhaustive model checking of the lease and activation rules with stateright: breadth-first search
//! over every reachable state of three nodes that go through three epochs (a timing change, then the
//! removal of a key's home, or the other way round) on abstract time. The model runs the real rules
//! of `keyhome_epoch::activation` ([`may_grant`], [`next_activation_wait`], [`restart_wait`]) on
//! the real records ([`Change::apply`], [`EpochRecord::ring`]). See `docs/model-checking.md`.
//!
//! # What is modelled
//!
//! - **Time** is a tick counter; a tick is one second of `Duration`, every clock runs at the same
//!   rate (`clock_rate_ppm` 0, so `rate_margin` is the identity: rates are the simulation's and the
//!   proof's business). All that happens at one instant happens between two ticks, in any order.
//! - **Epochs**: the genesis (members 1, 2, 3) and the records the schedule's changes make of it.
//!   Epoch `e + 1` may be chosen at any instant by a member that knows epoch `e` (the newest
//!   chosen); its activation wait is [`next_activation_wait`] of that proposer's epoch record,
//!   given whether the proposer's own activation instant for it has passed.
//! - **Leases**: a member whose current epoch `e` is the newest chosen may gain, at instant `t`, a
//!   lease of `e` lasting until `t + home_lease(e)`: the model lets a majority grant whenever the
//!   cut-off rule allows it (no acceptor grants leases of `e` once `e + 1` is chosen; the Paxos model
//!   and Lemma 1 cover why). A node that takes no lease step is cut off.
//! - **Learning**: a node may learn any chosen epoch above its own at any instant (so it may skip
//!   one). As `EpochNode::learn` does, it keeps the lease it held for the epoch it leaves in its
//!   history, records its activation instant `t + activation_wait`, and starts without a lease of
//!   the new epoch.
//! - **Restarts**: up to [`LeaseModel::restarts`] times a node restarts at its current epoch: it
//!   forgets its history and leases and waits [`restart_wait`].
//! - **Grants** (ghost): a node for which [`may_grant`] holds at instant `t` may grant the key a
//!   delegation of its current epoch's `max_delegation_lease` `D` at any instant before the next
//!   tick, live until `t + 1 + D` at the latest: `Home` clamps every grant's lease to `D`, and the
//!   credit a grant adds for the request's wait in line is at most the time from the request's
//!   send to the grant, so the delegation ends no later than `D` after the grant (a successor
//!   credited again counts as granted then; the model has no clock rates, so it does not check
//!   the credit's shrink by the rate bound, which the lock simulation does). The state
//!   keeps each node's latest such end, its *reach*, which survives restarts.
//!
//! # Property
//!
//! - always [`ONE_GRANTER`]: whenever a node may grant the key, no other node's reach is ahead, that
//!   is no delegation another node may have granted is still live (this includes two nodes that may
//!   grant at once);
//! - sometimes [`NEW_HOME_GRANTS`] (the key's home after the move grants it) and
//!   [`ON_OLDER_LEASE`] (the key's home holds a valid lease of an earlier epoch only, where the
//!   rule must decide whether that lease lets it grant), so a model that never reaches the
//!   interesting states fails.

use std::time::{Duration, Instant as Clock};

use keyhome_epoch::activation::{Standing, may_grant, next_activation_wait, restart_wait};
use keyhome_epoch::{Bugs, Change, EpochRecord, Instant, Member, NodeId, Timing};
use keyhome_ring::KeyDigest;
use stateright::{Checker, HasDiscoveries, Model, Property};

const NODES: [NodeId; 3] = [NodeId(1), NodeId(2), NodeId(3)];
/// The key's home in the genesis.
const HOME: NodeId = NodeId(3);

/// Last instant, in ticks, of every run: past the longest activation wait (4) plus a lease (3).
const HORIZON: u8 = 8;

/// The horizon of the runs with a restart.
const RESTART_HORIZON: u8 = 6;

const ONE_GRANTER: &str = "at most one node can grant the key at any instant";
const NEW_HOME_GRANTS: &str = "the key's new home grants it";
const ON_OLDER_LEASE: &str = "the key's home holds only an earlier epoch's lease";

/// Long home leases and short delegations.
const LONG_LEASES: Timing = Timing { home_lease: secs(3), max_delegation_lease: secs(1), clock_rate_ppm: 0 };
/// Short home leases and long delegations.
const LONG_DELEGATIONS: Timing =
    Timing { home_lease: secs(1), max_delegation_lease: secs(3), clock_rate_ppm: 0 };

const fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn tick(t: u8) -> Instant {
    Instant::from_nanos(u64::from(t) * 1_000_000_000)
}

/// Whole ticks in `d`, rounded up (every duration here is whole seconds).
fn ticks(d: Duration) -> u8 {
    u8::try_from(d.as_secs() + u64::from(d.subsec_nanos() > 0)).unwrap_or(u8::MAX)
}

/// One epoch a node learned in its current run.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Learned {
    /// Index into the model's records (epoch number − 1).
    epoch: usize,
    fence_until: u8,
    /// End of its lease of this epoch, once the node moved past it.
    lease_until: Option<u8>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct NodeState {
    /// The durable current epoch (index).
    current: usize,
    /// This run's learned epochs, oldest first; the last is `current`.
    history: Vec<Learned>,
    /// End of the lease of `current`, if it holds one.
    lease_until: Option<u8>,
    /// Ghost: the latest end of a delegation this node may have granted.
    reach: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    t: u8,
    /// Epochs chosen so far (the genesis counts): indices `0..chosen`.
    chosen: usize,
    /// Activation wait of each chosen epoch, in ticks.
    waits: Vec<u8>,
    nodes: [NodeState; 3],
    restarts: u8,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Action {
    Tick,
    /// A node (by index) gains a lease of its current epoch.
    Lease(usize),
    /// A node (by index) gets the next epoch chosen.
    Choose(usize),
    /// A node (by index) learns a chosen epoch (by index).
    Learn(usize, usize),
    Restart(usize),
}

#[derive(Clone)]
struct LeaseModel {
    /// The genesis and the records the schedule's changes make of it (activation waits are the
    /// model's, per state).
    records: Vec<EpochRecord>,
    /// Per epoch, per node: whether the node is the key's home.
    homes: Vec<[bool; 3]>,
    /// The nodes that act: those that are the key's home in some epoch. The third only grants
    /// leases, which the model abstracts, and could propose, which the actors can do alike.
    actors: [bool; 3],
    /// Last instant (in ticks) the model runs to.
    horizon: u8,
    restarts: u8,
    bugs: Bugs,
}

impl LeaseModel {
    fn new(genesis: Timing, changes: &[Change], horizon: u8, restarts: u8, bugs: Bugs) -> LeaseModel {
        let members =
            NODES.iter().map(|&id| Member { id, addr: format!("127.0.0.1:{}", 7000 + id.0) }).collect();
        let mut records = vec![EpochRecord::genesis(members, genesis).expect("a valid genesis")];
        for change in changes {
            let next = change.apply(records.last().expect("the genesis")).expect("the change applies");
            records.push(next);
        }
        // A key homed at `HOME` in the genesis that has another home in the last epoch.
        let rings: Vec<_> = records.iter().map(EpochRecord::ring).collect();
        let first = rings.first().expect("the genesis");
        let last = rings.last().expect("the genesis");
        let key = (0u32..)
            .map(|i| KeyDigest::of(format!("key-{i}").as_bytes()))
            .find(|&k| first.home_of(k) == Some(HOME) && last.home_of(k) != Some(HOME))
            .expect("some key moves");
        let homes: Vec<[bool; 3]> =
            rings.iter().map(|ring| NODES.map(|id| ring.home_of(key) == Some(id))).collect();
        let actors = std::array::from_fn(|i| homes.iter().any(|h| h[i]));
        LeaseModel { records, homes, actors, horizon, restarts, bugs }
    }

    /// `at`, or the first instant past the horizon if later: all instants past it are alike to a
    /// run that ends at the horizon, and capping them keeps the state space small.
    fn cap(&self, at: u8) -> u8 {
        at.min(self.horizon + 1)
    }

    fn timing(&self, epoch: usize) -> Timing {
        self.records[epoch].timing
    }

    fn homes(&self, epoch: usize, node: usize) -> bool {
        self.homes[epoch][node]
    }

    /// The record of `epoch` as chosen in `s` (with its activation wait).
    fn record(&self, s: &State, epoch: usize) -> EpochRecord {
        let mut record = self.records[epoch].clone();
        record.activation_wait = secs(u64::from(s.waits[epoch]));
        record
    }

    /// Whether `node` may grant the key in `s`: the real rule on the node's history.
    fn may_grant(&self, s: &State, node: usize) -> bool {
        let n = &s.nodes[node];
        let standings = n.history.iter().rev().enumerate().map(|(i, l)| Standing {
            number: l.epoch as u64 + 1,
            homes_key: self.homes(l.epoch, node),
            lease_until: if i == 0 { n.lease_until } else { l.lease_until }.map(tick),
            fence_until: tick(l.fence_until),
            max_delegation_lease: self.timing(l.epoch).max_delegation_lease,
        });
        may_grant(standings, tick(s.t), self.bugs)
    }

    /// Whether `node` is the key's home in `s` with no lease of its current epoch but a valid
    /// lease of an earlier one (where [`may_grant`] must decide whether that lease carries).
    fn on_older_lease(&self, s: &State, node: usize) -> bool {
        let n = &s.nodes[node];
        let valid = |until: Option<u8>| until.is_some_and(|until| s.t < until);
        self.homes(n.current, node) && !valid(n.lease_until) && n.history.iter().any(|l| valid(l.lease_until))
    }

    /// Widens each node's reach by what it may grant in `s`.
    fn grant(&self, s: &mut State) {
        for node in 0..NODES.len() {
            if self.may_grant(s, node) {
                let d = ticks(self.timing(s.nodes[node].current).max_delegation_lease);
                let n = &mut s.nodes[node];
                n.reach = n.reach.max(self.cap(s.t + 1 + d));
            }
        }
    }
}

impl Model for LeaseModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let node = NodeState {
            current: 0,
            history: vec![Learned { epoch: 0, fence_until: 0, lease_until: None }],
            lease_until: None,
            reach: 0,
        };
        vec![State {
            t: 0,
            chosen: 1,
            waits: vec![0],
            nodes: [node.clone(), node.clone(), node],
            restarts: 0,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        if s.t < self.horizon {
            actions.push(Action::Tick);
        }
        for (i, n) in s.nodes.iter().enumerate().filter(|&(i, _)| self.actors[i]) {
            let member = self.records[n.current].is_member(NODES[i]);
            if member && n.current + 1 == s.chosen {
                // A lease counts for the key only in an epoch whose home the node is.
                if self.homes(n.current, i) {
                    actions.push(Action::Lease(i));
                }
                if s.chosen < self.records.len() {
                    actions.push(Action::Choose(i));
                }
            }
            actions.extend((n.current + 1..s.chosen).map(|e| Action::Learn(i, e)));
            if s.restarts < self.restarts {
                actions.push(Action::Restart(i));
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Tick => s.t += 1,
            Action::Lease(i) => {
                let until = self.cap(s.t + ticks(self.timing(s.nodes[i].current).home_lease));
                let n = &mut s.nodes[i];
                n.lease_until = Some(n.lease_until.map_or(until, |u| u.max(until)));
            }
            Action::Choose(i) => {
                let n = &s.nodes[i];
                let fence_passed = n.history.last().is_some_and(|l| s.t >= l.fence_until);
                let wait = next_activation_wait(&self.record(&s, n.current), fence_passed);
                s.waits.push(ticks(wait));
                s.chosen += 1;
            }
            Action::Learn(i, epoch) => {
                let fence_until = self.cap(s.t + s.waits[epoch]);
                let n = &mut s.nodes[i];
                if let Some(previous) = n.history.last_mut() {
                    previous.lease_until = n.lease_until;
                }
                n.history.push(Learned { epoch, fence_until, lease_until: None });
                n.current = epoch;
                n.lease_until = None;
            }
            Action::Restart(i) => {
                let wait = restart_wait(&self.record(&s, s.nodes[i].current));
                let fence_until = self.cap(s.t + ticks(wait));
                let n = &mut s.nodes[i];
                n.history = vec![Learned { epoch: n.current, fence_until, lease_until: None }];
                n.lease_until = None;
                s.restarts += 1;
            }
        }
        self.grant(&mut s);
        (s != *last).then_some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(ONE_GRANTER, |m: &LeaseModel, s: &State| {
                (0..NODES.len())
                    .filter(|&x| m.may_grant(s, x))
                    .all(|x| (0..NODES.len()).all(|y| y == x || s.nodes[y].reach <= s.t))
            }),
            Property::sometimes(NEW_HOME_GRANTS, |m: &LeaseModel, s: &State| {
                let last = m.records.len() - 1;
                (0..NODES.len()).any(|x| NODES[x] != HOME && m.homes(last, x) && m.may_grant(s, x))
            }),
            Property::sometimes(ON_OLDER_LEASE, |m: &LeaseModel, s: &State| {
                (0..NODES.len()).any(|x| m.on_older_lease(s, x))
            }),
        ]
    }
}

/// Runs a BFS over `model`; returns the finished checker.
fn check(
    name: &str,
    model: &LeaseModel,
    threads: usize,
    finish_when: HasDiscoveries,
) -> impl Checker<LeaseModel> {
    let started = Clock::now();
    let checker = model.clone().checker().threads(threads).finish_when(finish_when).spawn_bfs().join();
    println!("{name}: {} unique states in {:.2?}", checker.unique_state_count(), started.elapsed());
    checker
}

fn timing_change(to: Timing) -> Change {
    Change::SetTiming(to)
}

/// The schedules checked: a timing change that shortens home leases and lengthens delegations (or
/// the other way round), then the removal of the key's home; and the removal first.
fn schedules() -> Vec<(&'static str, Timing, Vec<Change>)> {
    let remove = Change::Remove(HOME);
    vec![
        (
            "longer delegations, then remove",
            LONG_LEASES,
            vec![timing_change(LONG_DELEGATIONS), remove.clone()],
        ),
        (
            "shorter delegations, then remove",
            LONG_DELEGATIONS,
            vec![timing_change(LONG_LEASES), remove.clone()],
        ),
        ("remove, then longer delegations", LONG_LEASES, vec![remove, timing_change(LONG_DELEGATIONS)]),
    ]
}

/// Checks `model` exhaustively: the `always` property holds, both `sometimes` ones have examples.
fn check_exhaustively(name: &str, model: &LeaseModel, min_states: usize) {
    let checker = check(name, model, 2, HasDiscoveries::All);
    assert!(checker.is_done(), "{name}: BFS stopped early");
    checker.assert_properties();
    let states = checker.unique_state_count();
    assert!(states >= min_states, "{name}: only {states} states; a model this small checks little");
}

#[test]
fn one_node_at_a_time_can_grant_across_timing_changes_and_moves() {
    for (name, genesis, changes) in schedules() {
        check_exhaustively(name, &LeaseModel::new(genesis, &changes, HORIZON, 0, Bugs::default()), 50_000);
    }
}

#[test]
fn one_node_at_a_time_can_grant_with_a_restart() {
    // Shorter runs: a restart multiplies the states by ten.
    for (name, genesis, changes) in schedules() {
        check_exhaustively(
            name,
            &LeaseModel::new(genesis, &changes, RESTART_HORIZON, 1, Bugs::default()),
            20_000,
        );
    }
}

#[test]
fn an_older_lease_carrying_the_new_epochs_longer_delegations_lets_two_nodes_grant() {
    let bugs = Bugs { delegation_lease_of_current_epoch: true, ..Bugs::default() };
    let (name, genesis, changes) = schedules().remove(0);
    let model = LeaseModel::new(genesis, &changes, HORIZON, 0, bugs);
    let checker = check(name, &model, 1, HasDiscoveries::AnyFailures);
    let path = checker.assert_any_discovery(ONE_GRANTER);
    let actions = path.clone().into_actions();
    println!("{name}, rule off: counterexample, {} steps: {actions:?}", actions.len());
    let last = path.last_state().clone();
    let home = NODES.iter().position(|&n| n == HOME).expect("a node");
    assert!(
        path.into_states().iter().any(|s| model.on_older_lease(s, home) && model.may_grant(s, home)),
        "the old home granted on its older lease"
    );
    assert!(last.nodes[home].reach > last.t, "the old home's delegation is live at the end");
}
