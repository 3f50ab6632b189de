//! Exhaustive model checking of `keyhome_epoch::paxos` with stateright: breadth-first search over every
//! reachable state of a small cluster that runs the real [`AcceptorState`] and [`Proposer`] code. The
//! model owns only what the Paxos module leaves to its driver: the network, crashes, round starts,
//! persistence, and a ghost history for the properties. See `docs/model-checking.md`.
//!
//! # The cluster
//!
//! - Acceptors `n1`, `n2`, `n3`, each an `AcceptorState<u8>` in memory plus a copy on disk. A change
//!   goes to disk (when `changed` says so) in the same step that handles the message and produces the
//!   vote, as keyhome persists before replying. A restart reloads the disk: the durable acceptor wrote
//!   every change there; the amnesiac one never writes, so it restarts from `AcceptorState::default()`;
//!   the forgetful one writes what prepares change but not what accepts change.
//! - Proposers `n11` (wants value 1) and `n12` (wants value 2) on their own nodes. Either may start a
//!   new round at any time, abandoning the last, at a round above its previous one and above any ballot
//!   an `Outbid` reported; on `Step::Accept(v)` it sends accepts for `v` to every acceptor; on
//!   `Step::Chosen(v)` it records that it learned `v`.
//! - Network ([`Network`]). By default a set of requests (prepares and accepts): delivering one leaves it
//!   in the set, so any request is reordered, delayed, duplicated or never delivered (lost) at will. A
//!   vote reaches its proposer in the step that produced it, or is lost. With
//!   [`Network::ReorderingVotes`] votes are in flight too, and every message is delivered at most once.
//! - Ghost history: every `(ballot, value)` ever accepted and by which acceptors; it never shrinks, even
//!   when an acceptor forgets. A value is chosen once a majority accepted it at one ballot.
//!
//! # Properties
//!
//! - always [`SAFETY`] (at most one value is chosen), [`LEARNED_WAS_CHOSEN`] (every `Step::Chosen`
//!   names a value the ghost history shows chosen) and [`LEARNERS_AGREE`];
//! - sometimes [`SOME_CHOSEN`] and [`CARRIED_FORWARD`] (a proposer learns the other's value, so the
//!   carry-forward path ran): a model that cannot make progress fails.
//!
//! # Bounds
//!
//! - `durable_acceptors_never_choose_two_values`: rounds `[2, 1]` and `[1, 2]` (round starts allowed
//!   to `n11`, `n12`), duplicating request network: about 100 000 states each.
//! - `durable_acceptors_never_choose_two_values_with_reordered_votes`: rounds `[1, 1]`, votes in
//!   flight: about 380 000 states.
//! - Both offer every acceptor a restart at every step; none is a transition, because the disk always
//!   holds what memory does (which is what durability means, and what a wrong `changed` would break).
//! - The counterexample tests use the smallest bounds each bug needs and one BFS thread, so each trace
//!   is a shortest one. `reused_ballot_forks_even_without_delayed_messages` replays one fixed run.
//!
//! Proposer crashes are left out of the durable runs: with the round counter kept, a crash only
//! abandons the round, which losing its votes already covers. Explicit drops are left out: a dropped
//! message is one never delivered, and the in-flight subsets drops create add no acceptor, proposer or
//! ghost state while taking rounds `[1, 1]` from 3 124 states to over 1.5 million.

use std::fmt;
use std::time::Instant;

use keyhome_epoch::NodeId;
use keyhome_epoch::paxos::{AcceptorState, Ballot, Proposer, Step, Vote};
use stateright::{Checker, HasDiscoveries, Model, Path, Property};

type Value = u8;

const ACCEPTORS: [NodeId; 3] = [NodeId(1), NodeId(2), NodeId(3)];
/// Each proposer's node id and the value it wants.
const PROPOSERS: [(NodeId, Value); 2] = [(NodeId(11), 1), (NodeId(12), 2)];
const MAJORITY: u32 = 2;

const SAFETY: &str = "at most one value is chosen";
const LEARNED_WAS_CHOSEN: &str = "a learned value was chosen";
const LEARNERS_AGREE: &str = "proposers learn at most one value";
const SOME_CHOSEN: &str = "a value is chosen";
const CARRIED_FORWARD: &str = "a proposer learns the other's value";

/// What an acceptor restarts from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AcceptorRestart {
    /// Every change is on disk before the vote leaves (keyhome's rule).
    Durable,
    /// Nothing is written: a restart forgets promises and acceptances (the bug the design rules out).
    Amnesiac,
    /// Only what a prepare changed is written (an acceptance reaches disk only with a later promise): a
    /// restart forgets recent acceptances.
    ForgetsAcceptances,
}

/// What a proposer sends after a majority of promises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ValueRule {
    /// The value `Step::Accept` names: the highest-ballot accepted one reported, else its own.
    CarryForward,
    /// Always its own value, ignoring what the promises reported (a bug).
    OwnValue,
}

/// What a proposer keeps across a crash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RoundMemory {
    /// The round counter survives, so a restarted proposer never reuses a ballot.
    Durable,
    /// The round counter restarts from 1, so a restarted proposer may reuse a ballot.
    Volatile,
}

/// How messages travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Network {
    /// Requests stay in flight once sent: each may be delivered any number of times, in any order, or
    /// never. A vote reaches its proposer in the step that produced it, or is lost.
    DuplicatingRequests,
    /// Every message, votes included, is in flight until delivered, at most once, in any order.
    ReorderingVotes,
}

#[derive(Clone, Debug)]
struct PaxosModel {
    acceptor_restart: AcceptorRestart,
    value_rule: ValueRule,
    round_memory: RoundMemory,
    network: Network,
    /// Round starts allowed to each proposer, over all its incarnations.
    rounds: [u8; 2],
    /// Acceptor restarts allowed, in total.
    acceptor_crashes: u8,
    /// Proposer restarts allowed, in total.
    proposer_crashes: u8,
}

impl PaxosModel {
    /// keyhome's rules.
    fn correct(rounds: [u8; 2]) -> Self {
        PaxosModel {
            acceptor_restart: AcceptorRestart::Durable,
            value_rule: ValueRule::CarryForward,
            round_memory: RoundMemory::Durable,
            network: Network::DuplicatingRequests,
            rounds,
            acceptor_crashes: 1,
            proposer_crashes: 0,
        }
    }

    /// Hands `m` to its recipient. A request's vote goes into the network, or with
    /// `Network::DuplicatingRequests` to its proposer right away when `vote_arrives`.
    fn deliver(&self, s: &mut State, m: Msg, vote_arrives: bool) {
        if self.network == Network::ReorderingVotes {
            let i = s.network.binary_search(&m).expect("delivered from the network");
            s.network.remove(i);
        }
        let (from, vote) = match m {
            Msg::Prepare { to, ballot } => {
                let node = &mut s.acceptors[acceptor_index(to)];
                let (vote, changed) = node.state.on_prepare(ballot);
                self.persist(node, changed, false);
                (to, vote)
            }
            Msg::Accept { to, ballot, value } => {
                let a = acceptor_index(to);
                let node = &mut s.acceptors[a];
                let (vote, changed) = node.state.on_accept(ballot, &value);
                self.persist(node, changed, true);
                if let Vote::Accepted { ballot: b } = vote {
                    assert_eq!(b, ballot, "an acceptor accepts the ballot it was asked to");
                    s.record_accepted(ballot, value, a);
                }
                (to, vote)
            }
            Msg::Vote { from, vote } => return self.on_vote(s, from, vote),
        };
        match self.network {
            Network::DuplicatingRequests if vote_arrives => self.on_vote(s, from, vote),
            Network::DuplicatingRequests => {}
            Network::ReorderingVotes => s.send(Msg::Vote { from, vote }),
        }
    }

    /// Makes a handled message's state change durable before its vote leaves, trusting `changed` as
    /// keyhome does; the amnesiac acceptor never writes, the forgetful one skips acceptances.
    fn persist(&self, node: &mut AcceptorNode, changed: bool, accept: bool) {
        let writes = match self.acceptor_restart {
            AcceptorRestart::Durable => true,
            AcceptorRestart::Amnesiac => false,
            AcceptorRestart::ForgetsAcceptances => !accept,
        };
        if changed && writes {
            node.disk = node.state.clone();
        }
    }

    /// Hands a vote to the proposer named in its ballot.
    fn on_vote(&self, s: &mut State, from: NodeId, vote: Vote<Value>) {
        let Some(p) = proposer_index(vote_ballot(&vote).proposer) else { return };
        let (_, own) = PROPOSERS[p];
        let Some(round) = s.proposers[p].round.as_mut() else { return };
        match round.on_vote(from, vote) {
            Step::Wait => {}
            Step::Accept(carried) => {
                let ballot = round.ballot();
                let value = match self.value_rule {
                    ValueRule::CarryForward => carried,
                    ValueRule::OwnValue => own,
                };
                for to in ACCEPTORS {
                    s.send(Msg::Accept { to, ballot, value });
                }
            }
            Step::Chosen(v) => s.proposers[p].learned |= bit(v),
            Step::Outbid(promised) => {
                let node = &mut s.proposers[p];
                node.next_round = node.next_round.max(promised.round + 1);
            }
        }
    }
}

/// A message in flight. Votes go to the proposer named in their ballot.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Msg {
    Prepare { to: NodeId, ballot: Ballot },
    Accept { to: NodeId, ballot: Ballot, value: Value },
    Vote { from: NodeId, vote: Vote<Value> },
}

/// A total order for the network set, consistent with `Eq` (`Vote` itself is not `Ord`).
type MsgKey = (u8, NodeId, Ballot, u8, Option<(Ballot, Value)>, Option<Ballot>);

impl Msg {
    fn key(&self) -> MsgKey {
        match self {
            Msg::Prepare { to, ballot } => (0, *to, *ballot, 0, None, None),
            Msg::Accept { to, ballot, value } => (1, *to, *ballot, *value, None, None),
            Msg::Vote { from, vote } => match vote {
                Vote::Promise { ballot, accepted } => (2, *from, *ballot, 0, *accepted, None),
                Vote::Accepted { ballot } => (2, *from, *ballot, 1, None, None),
                Vote::Reject { ballot, promised } => (2, *from, *ballot, 2, None, Some(*promised)),
            },
        }
    }
}

impl Ord for Msg {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.key().cmp(&other.key())
    }
}

impl PartialOrd for Msg {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

fn vote_ballot(vote: &Vote<Value>) -> Ballot {
    match vote {
        Vote::Promise { ballot, .. } | Vote::Accepted { ballot } | Vote::Reject { ballot, .. } => *ballot,
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
struct AcceptorNode {
    /// The state in memory, which every message is handled with.
    state: AcceptorState<Value>,
    /// The state on disk, which a restart reloads.
    disk: AcceptorState<Value>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct ProposerNode {
    /// Round starts so far, over all incarnations (the bound).
    rounds_started: u8,
    /// The round the next round start uses.
    next_round: u64,
    /// The round in progress, if any.
    round: Option<Proposer<Value>>,
    /// Values this node saw chosen (`Step::Chosen`) in any of its rounds, a bit per value.
    learned: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    acceptors: [AcceptorNode; 3],
    proposers: [ProposerNode; 2],
    /// Messages in flight, sorted and without duplicates.
    network: Vec<Msg>,
    acceptor_crashes: u8,
    proposer_crashes: u8,
    /// Ghost: every `(ballot, value)` ever accepted, sorted, with a bit per acceptor that accepted it.
    history: Vec<(Ballot, Value, u8)>,
}

fn bit(v: Value) -> u8 {
    1 << v
}

fn values(bits: u8) -> Vec<Value> {
    (0..8).filter(|v| bits & bit(*v) != 0).collect()
}

impl State {
    /// The chosen values, a bit per value.
    fn chosen(&self) -> u8 {
        self.history
            .iter()
            .filter(|(_, _, who)| who.count_ones() >= MAJORITY)
            .fold(0, |c, (_, v, _)| c | bit(*v))
    }

    fn send(&mut self, m: Msg) {
        if let Err(i) = self.network.binary_search(&m) {
            self.network.insert(i, m);
        }
    }

    fn record_accepted(&mut self, ballot: Ballot, value: Value, acceptor: usize) {
        match self.history.binary_search_by(|(b, v, _)| (*b, *v).cmp(&(ballot, value))) {
            Ok(i) => self.history[i].2 |= 1 << acceptor,
            Err(i) => self.history.insert(i, (ballot, value, 1 << acceptor)),
        }
    }
}

fn acceptor_index(id: NodeId) -> usize {
    ACCEPTORS.iter().position(|a| *a == id).expect("an acceptor")
}

fn proposer_index(id: NodeId) -> Option<usize> {
    PROPOSERS.iter().position(|(p, _)| *p == id)
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Action {
    /// A proposer (by index) starts its next round.
    StartRound(usize),
    /// Deliver a message.
    Deliver(Msg),
    /// Deliver a request and lose the vote it produces (`Network::DuplicatingRequests`).
    DeliverLoseVote(Msg),
    /// An acceptor (by index) crashes and restarts from its disk.
    CrashAcceptor(usize),
    /// A proposer (by index) crashes and restarts, losing its round.
    CrashProposer(usize),
}

impl Model for PaxosModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let proposer = ProposerNode { rounds_started: 0, next_round: 1, round: None, learned: 0 };
        vec![State {
            acceptors: Default::default(),
            proposers: [proposer.clone(), proposer],
            network: Vec::new(),
            acceptor_crashes: 0,
            proposer_crashes: 0,
            history: Vec::new(),
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        for (p, node) in state.proposers.iter().enumerate() {
            if node.rounds_started < self.rounds[p] {
                actions.push(Action::StartRound(p));
            }
        }
        for m in &state.network {
            actions.push(Action::Deliver(m.clone()));
            if self.network == Network::DuplicatingRequests {
                actions.push(Action::DeliverLoseVote(m.clone()));
            }
        }
        if state.acceptor_crashes < self.acceptor_crashes {
            actions.extend((0..ACCEPTORS.len()).map(Action::CrashAcceptor));
        }
        if state.proposer_crashes < self.proposer_crashes {
            actions.extend((0..PROPOSERS.len()).map(Action::CrashProposer));
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::StartRound(p) => {
                let (id, own) = PROPOSERS[p];
                let node = &mut s.proposers[p];
                let ballot = Ballot { round: node.next_round, proposer: id };
                node.rounds_started += 1;
                node.next_round += 1;
                node.round = Some(Proposer::new(ballot, own, ACCEPTORS));
                for to in ACCEPTORS {
                    s.send(Msg::Prepare { to, ballot });
                }
            }
            Action::Deliver(m) => self.deliver(&mut s, m, true),
            Action::DeliverLoseVote(m) => self.deliver(&mut s, m, false),
            Action::CrashAcceptor(a) => {
                let node = &mut s.acceptors[a];
                if node.state == node.disk {
                    // The disk holds all the memory does: the restart changes nothing, which is the
                    // durable acceptor's case after every step (so its restarts cost no bound).
                    return None;
                }
                node.state = node.disk.clone();
                s.acceptor_crashes += 1;
            }
            Action::CrashProposer(p) => {
                s.proposer_crashes += 1;
                let node = &mut s.proposers[p];
                node.round = None;
                if self.round_memory == RoundMemory::Volatile {
                    node.next_round = 1;
                }
            }
        }
        // A step that changes nothing (a stale vote, a repeated request) is no transition.
        (s != *last).then_some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(SAFETY, |_, s: &State| s.chosen().count_ones() <= 1),
            Property::always(LEARNED_WAS_CHOSEN, |_, s: &State| {
                let chosen = s.chosen();
                s.proposers.iter().all(|p| p.learned & !chosen == 0)
            }),
            Property::always(LEARNERS_AGREE, |_, s: &State| {
                s.proposers.iter().fold(0, |l, p| l | p.learned).count_ones() <= 1
            }),
            Property::sometimes(SOME_CHOSEN, |_, s: &State| s.chosen() != 0),
            Property::sometimes(CARRIED_FORWARD, |_, s: &State| {
                s.proposers.iter().zip(PROPOSERS).any(|(p, (_, own))| p.learned & !bit(own) != 0)
            }),
        ]
    }
}

// ---- reporting ----

/// Displays a ballot as `(round, proposer)`.
struct B(Ballot);

impl fmt::Display for B {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "({}, {})", self.0.round, self.0.proposer)
    }
}

/// Displays a vote with its sender and recipient.
struct V<'a>(NodeId, &'a Vote<Value>);

impl fmt::Display for V<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let V(from, vote) = *self;
        let to = vote_ballot(vote).proposer;
        match vote {
            Vote::Promise { ballot, accepted: None } => {
                write!(f, "{from} -> {to}: promise {}, nothing accepted", B(*ballot))
            }
            Vote::Promise { ballot, accepted: Some((b, v)) } => {
                write!(f, "{from} -> {to}: promise {}, accepted {v} at {}", B(*ballot), B(*b))
            }
            Vote::Accepted { ballot } => write!(f, "{from} -> {to}: accepted {}", B(*ballot)),
            Vote::Reject { ballot, promised } => {
                write!(f, "{from} -> {to}: reject {}, promised {}", B(*ballot), B(*promised))
            }
        }
    }
}

impl fmt::Display for Msg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Msg::Prepare { to, ballot } => write!(f, "prepare {} to {to}", B(*ballot)),
            Msg::Accept { to, ballot, value } => write!(f, "accept {} value {value} to {to}", B(*ballot)),
            Msg::Vote { from, vote } => write!(f, "vote {}", V(*from, vote)),
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::StartRound(p) => write!(f, "{} starts a round", PROPOSERS[*p].0),
            Action::Deliver(m) => write!(f, "deliver {m}"),
            Action::DeliverLoseVote(m) => write!(f, "deliver {m} (its vote is lost)"),
            Action::CrashAcceptor(a) => write!(f, "{} crashes and restarts from disk", ACCEPTORS[*a]),
            Action::CrashProposer(p) => write!(f, "{} crashes and restarts", PROPOSERS[*p].0),
        }
    }
}

fn describe(a: &AcceptorState<Value>) -> String {
    format!(
        "promised {}, accepted {}",
        a.promised.map_or("none".into(), |b| B(b).to_string()),
        a.accepted.map_or("none".into(), |(b, v)| format!("{v} at {}", B(b))),
    )
}

/// The vote `before`'s acceptor produced for request `m` (recomputed for the trace).
fn vote_for(before: &State, m: &Msg) -> Option<(NodeId, Vote<Value>)> {
    match m {
        Msg::Prepare { to, ballot } => {
            Some((*to, before.acceptors[acceptor_index(*to)].state.clone().on_prepare(*ballot).0))
        }
        Msg::Accept { to, ballot, value } => {
            Some((*to, before.acceptors[acceptor_index(*to)].state.clone().on_accept(*ballot, value).0))
        }
        Msg::Vote { .. } => None,
    }
}

/// Prints a trace: each step with the vote it produced, and the acceptor states, learned values and
/// choices it changed; then the ghost history.
fn print_trace(model: &PaxosModel, path: &Path<State, Action>) {
    let steps = path.clone().into_vec();
    for (i, pair) in steps.windows(2).enumerate() {
        let ((before, Some(action)), (after, _)) = (&pair[0], &pair[1]) else { continue };
        println!("  {:>2}. {action}", i + 1);
        if model.network == Network::DuplicatingRequests
            && let Action::Deliver(m) | Action::DeliverLoseVote(m) = action
            && let Some((from, vote)) = vote_for(before, m)
        {
            let lost = if matches!(action, Action::DeliverLoseVote(_)) { " (lost)" } else { "" };
            println!("        vote {}{lost}", V(from, &vote));
        }
        for ((id, b), a) in ACCEPTORS.iter().zip(&before.acceptors).zip(&after.acceptors) {
            if b.state != a.state {
                println!("        {id} now {}", describe(&a.state));
            }
        }
        for ((id, _), (b, a)) in PROPOSERS.iter().zip(before.proposers.iter().zip(&after.proposers)) {
            if a.learned != b.learned {
                println!("        {id} learns that {:?} is chosen", values(a.learned & !b.learned));
            }
        }
        if after.chosen() != before.chosen() {
            println!("        => chosen (a majority accepted at one ballot): {:?}", values(after.chosen()));
        }
    }
    println!("  ghost history (value at ballot: acceptors that accepted it):");
    for (b, v, who) in &path.last_state().history {
        let who: Vec<String> = ACCEPTORS
            .iter()
            .enumerate()
            .filter(|(i, _)| who & (1 << i) != 0)
            .map(|(_, a)| a.to_string())
            .collect();
        let chosen = if who.len() as u32 >= MAJORITY { "  <- chosen" } else { "" };
        println!("    {v} at {}: {}{chosen}", B(*b), who.join(", "));
    }
}

/// Runs BFS until `finish_when` holds or every reachable state is explored, and prints the counts.
fn check(
    name: &str,
    model: &PaxosModel,
    threads: usize,
    finish_when: HasDiscoveries,
) -> impl Checker<PaxosModel> + use<> {
    let started = Instant::now();
    let checker = model.clone().checker().threads(threads).finish_when(finish_when).spawn_bfs().join();
    println!(
        "{name}: {} unique states ({} generated), max depth {}, {:.2?}",
        checker.unique_state_count(),
        checker.state_count(),
        checker.max_depth(),
        started.elapsed(),
    );
    checker
}

/// Checks `model` exhaustively and asserts both `always` properties hold and both `sometimes`
/// properties have examples.
fn check_exhaustively(name: &str, model: &PaxosModel, min_states: usize) {
    let checker = check(name, model, 2, HasDiscoveries::All);
    assert!(checker.is_done(), "{name}: BFS stopped early");
    // Panics on a counterexample to an `always` property or a `sometimes` property without example,
    // and (via `is_done`) unless the search is complete.
    checker.assert_properties();
    assert!(
        checker.unique_state_count() >= min_states,
        "{name}: only {} states; a model this small checks little",
        checker.unique_state_count()
    );
    let example = checker.assert_any_discovery(CARRIED_FORWARD);
    println!("{name}: example of carry-forward, {} steps:", example.clone().into_actions().len());
    print_trace(model, &example);
}

/// Searches `model` for counterexamples to `properties` with one BFS thread (so each is a shortest
/// one), prints them, and checks each ends with both values chosen (and, for [`LEARNERS_AGREE`],
/// learned). Returns their actions.
fn find_forks<const N: usize>(
    name: &str,
    model: &PaxosModel,
    properties: [&'static str; N],
) -> [Vec<Action>; N] {
    let checker = check(name, model, 1, HasDiscoveries::AllOf(properties.into()));
    properties.map(|property| {
        let path = checker.assert_any_discovery(property);
        println!("{name}: counterexample to \"{property}\", {} steps:", path.clone().into_actions().len());
        print_trace(model, &path);
        let last = path.last_state();
        assert_eq!(values(last.chosen()), [1, 2], "both values chosen");
        if property == LEARNERS_AGREE {
            let learned: Vec<Vec<Value>> = last.proposers.iter().map(|p| values(p.learned)).collect();
            assert_eq!(learned, [[1], [2]], "each proposer learned its own value");
        }
        path.into_actions()
    })
}

#[test]
fn durable_acceptors_never_choose_two_values() {
    // n11 may retry, (1, n11) < (1, n12) < (2, n11); then n12 may, (1, n11) < (1, n12) < (2, n12).
    check_exhaustively("durable, rounds [2, 1]", &PaxosModel::correct([2, 1]), 50_000);
    check_exhaustively("durable, rounds [1, 2]", &PaxosModel::correct([1, 2]), 50_000);
}

#[test]
fn durable_acceptors_never_choose_two_values_with_reordered_votes() {
    let model = PaxosModel { network: Network::ReorderingVotes, ..PaxosModel::correct([1, 1]) };
    check_exhaustively("durable, votes in flight, rounds [1, 1]", &model, 200_000);
}

#[test]
fn amnesiac_acceptor_forks_the_epoch() {
    let model = PaxosModel { acceptor_restart: AcceptorRestart::Amnesiac, ..PaxosModel::correct([1, 1]) };
    for trace in find_forks("amnesiac acceptor", &model, [SAFETY, LEARNERS_AGREE]) {
        assert!(trace.iter().any(|a| matches!(a, Action::CrashAcceptor(_))), "the fork needs the restart");
    }
}

#[test]
fn acceptor_forgetting_acceptances_forks_the_epoch() {
    // Promises are durable, acceptances are not.
    let model =
        PaxosModel { acceptor_restart: AcceptorRestart::ForgetsAcceptances, ..PaxosModel::correct([1, 1]) };
    let [trace] = find_forks("acceptor forgetting acceptances", &model, [LEARNERS_AGREE]);
    assert!(trace.iter().any(|a| matches!(a, Action::CrashAcceptor(_))), "the fork needs the restart");
}

#[test]
fn proposer_ignoring_accepted_values_forks_the_epoch() {
    let model =
        PaxosModel { value_rule: ValueRule::OwnValue, acceptor_crashes: 0, ..PaxosModel::correct([1, 1]) };
    find_forks("proposer ignoring accepted values", &model, [SAFETY]);
}

#[test]
fn proposer_reusing_a_ballot_after_restart_forks_the_epoch() {
    // n12 restarts and starts over at round 1, reusing (1, n12) with another value.
    let model = PaxosModel {
        round_memory: RoundMemory::Volatile,
        acceptor_crashes: 0,
        proposer_crashes: 1,
        ..PaxosModel::correct([1, 2])
    };
    let [trace] = find_forks("proposer with a volatile round counter", &model, [SAFETY]);
    assert!(trace.iter().any(|a| matches!(a, Action::CrashProposer(1))), "the fork needs n12's restart");
}

#[test]
fn reused_ballot_forks_even_without_delayed_messages() {
    // A fixed run of the volatile-round model (each step must be enabled and change the state). Before
    // its restart n12 gets 2 accepted at (1, n12) by n1; after it, it reuses (1, n12), carries n11's 1
    // and has it chosen by n2 and n3. n11's retry then sees two values at the same ballot (1, n12),
    // keeps the first reported (n1's 2) and has 2 chosen too. No message of the first incarnation is
    // delivered after the restart.
    let model = PaxosModel {
        round_memory: RoundMemory::Volatile,
        acceptor_crashes: 0,
        proposer_crashes: 1,
        ..PaxosModel::correct([2, 2])
    };
    let b = |round, proposer| Ballot { round, proposer: NodeId(proposer) };
    let prepare = |ballot, to| Action::DeliverLoseVote(Msg::Prepare { to: NodeId(to), ballot });
    let accept = |ballot, value, to| Action::DeliverLoseVote(Msg::Accept { to: NodeId(to), ballot, value });
    let vote = |action: Action| match action {
        Action::DeliverLoseVote(m) => Action::Deliver(m),
        other => other,
    };
    let actions = [
        Action::StartRound(0),
        vote(prepare(b(1, 11), 3)),
        vote(prepare(b(1, 11), 2)),
        accept(b(1, 11), 1, 3),
        Action::StartRound(1),
        vote(prepare(b(1, 12), 1)),
        vote(prepare(b(1, 12), 2)),
        accept(b(1, 12), 2, 1),
        Action::CrashProposer(1),
        Action::StartRound(1),
        vote(prepare(b(1, 12), 2)),
        vote(prepare(b(1, 12), 3)),
        vote(accept(b(1, 12), 1, 2)),
        vote(accept(b(1, 12), 1, 3)),
        Action::StartRound(0),
        vote(prepare(b(2, 11), 1)),
        vote(prepare(b(2, 11), 2)),
        vote(accept(b(2, 11), 2, 1)),
        vote(accept(b(2, 11), 2, 2)),
    ];
    let init = model.init_states().remove(0);
    let path =
        Path::from_actions(&model, init, &actions).expect("every step is enabled and changes the state");
    println!("reused ballot, no delayed message, {} steps:", actions.len());
    print_trace(&model, &path);
    let last = path.last_state();
    assert_eq!(values(last.chosen()), [1, 2], "both values chosen");
    let learned: Vec<Vec<Value>> = last.proposers.iter().map(|p| values(p.learned)).collect();
    assert_eq!(learned, [[2], [1]], "n11 learned 2, n12 learned 1");
}
