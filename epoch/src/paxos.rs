//! Single-decree Paxos, as pure data: one acceptor's state for one slot, and one proposer's round.
//!
//! Nothing here knows about time, epochs or the network, so the model checker drives exactly this
//! code. The [`crate::node`] core wires it to epoch numbers, persistence and retries.
//!
//! Safety rests on two rules that callers must keep:
//! - an acceptor's state change is durable before the reply it produced is sent;
//! - a proposer that sees any accepted value in its promises proposes the one with the highest
//!   ballot instead of its own;
//! - a proposer never reuses a ballot, not even after a restart: [`AcceptorState::on_accept`]
//!   overwrites an acceptance at an equal ballot, and an `Accepted` vote does not name its value,
//!   so one ballot with two values can choose both (the node core starts every run's rounds above
//!   its own stored promise).

use keyhome_ring::NodeId;
use serde::{Deserialize, Serialize};

/// A proposal number: `(round, proposer)`, ordered lexicographically, so two proposers never share
/// one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Ballot {
    pub round: u64,
    pub proposer: NodeId,
}

/// An acceptor's durable state for one slot.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct AcceptorState<V> {
    /// The highest ballot promised; no lower ballot's prepare or accept succeeds.
    pub promised: Option<Ballot>,
    /// The value accepted at the highest ballot so far.
    pub accepted: Option<(Ballot, V)>,
}

impl<V> Default for AcceptorState<V> {
    fn default() -> Self {
        AcceptorState { promised: None, accepted: None }
    }
}

/// An acceptor's answer to a prepare or an accept.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Vote<V> {
    /// Phase 1b: promise to refuse ballots below `ballot`, reporting what was accepted.
    Promise { ballot: Ballot, accepted: Option<(Ballot, V)> },
    /// Phase 2b: `ballot`'s value is accepted.
    Accepted { ballot: Ballot },
    /// `ballot` is below what was promised.
    Reject { ballot: Ballot, promised: Ballot },
}

impl<V: Clone + PartialEq> AcceptorState<V> {
    /// Handles a prepare. Returns the vote and whether the state changed (then the change must be
    /// durable before the vote is sent).
    pub fn on_prepare(&mut self, ballot: Ballot) -> (Vote<V>, bool) {
        match self.promised {
            Some(p) if p > ballot => (Vote::Reject { ballot, promised: p }, false),
            Some(p) if p == ballot => (Vote::Promise { ballot, accepted: self.accepted.clone() }, false),
            _ => {
                self.promised = Some(ballot);
                (Vote::Promise { ballot, accepted: self.accepted.clone() }, true)
            }
        }
    }

    /// Handles an accept of `value` at `ballot`. Returns the vote and whether the state changed.
    pub fn on_accept(&mut self, ballot: Ballot, value: &V) -> (Vote<V>, bool) {
        if let Some(p) = self.promised
            && p > ballot
        {
            return (Vote::Reject { ballot, promised: p }, false);
        }
        if matches!(&self.accepted, Some((b, v)) if *b == ballot && v == value) {
            return (Vote::Accepted { ballot }, false);
        }
        self.promised = Some(ballot);
        self.accepted = Some((ballot, value.clone()));
        (Vote::Accepted { ballot }, true)
    }
}

/// Where a proposer's round stands.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Phase<V> {
    /// Waiting for a majority of promises.
    Preparing,
    /// Accepts sent with this value; waiting for a majority of accepted votes.
    Accepting(V),
    /// A majority accepted this value: it is chosen.
    Chosen(V),
}

/// One round of one proposer for one slot.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Proposer<V> {
    ballot: Ballot,
    /// The value this proposer wants, used unless a promise reports an accepted one.
    own: V,
    /// Acceptors of the slot, sorted.
    acceptors: Vec<NodeId>,
    /// Acceptors that promised or accepted in this round (sorted, so equal states compare equal).
    votes: Vec<NodeId>,
    /// The highest-ballot accepted value reported in the promises so far.
    highest: Option<(Ballot, V)>,
    phase: Phase<V>,
}

impl<V: Clone + PartialEq> Proposer<V> {
    /// Starts a round at `ballot` for `own` among `acceptors`.
    pub fn new(ballot: Ballot, own: V, acceptors: impl IntoIterator<Item = NodeId>) -> Self {
        let mut acceptors: Vec<NodeId> = acceptors.into_iter().collect();
        acceptors.sort();
        acceptors.dedup();
        Proposer { ballot, own, acceptors, votes: Vec::new(), highest: None, phase: Phase::Preparing }
    }

    pub fn ballot(&self) -> Ballot {
        self.ballot
    }

    pub fn phase(&self) -> &Phase<V> {
        &self.phase
    }

    pub fn acceptors(&self) -> &[NodeId] {
        &self.acceptors
    }

    /// The value this proposer was started with.
    pub fn own_value(&self) -> &V {
        &self.own
    }

    fn majority(&self) -> usize {
        self.acceptors.len() / 2 + 1
    }

    /// Counts `from`'s vote once; true when it is new.
    fn count(&mut self, from: NodeId) -> bool {
        if self.acceptors.binary_search(&from).is_err() {
            return false;
        }
        match self.votes.binary_search(&from) {
            Ok(_) => false,
            Err(i) => {
                self.votes.insert(i, from);
                true
            }
        }
    }

    /// Handles a vote from `from`. Returns what to do next, if anything.
    pub fn on_vote(&mut self, from: NodeId, vote: Vote<V>) -> Step<V> {
        match vote {
            Vote::Promise { ballot, accepted } if ballot == self.ballot => {
                if self.phase != Phase::Preparing || !self.count(from) {
                    return Step::Wait;
                }
                if let Some((b, v)) = accepted
                    && self.highest.as_ref().is_none_or(|(hb, _)| b > *hb)
                {
                    self.highest = Some((b, v));
                }
                if self.votes.len() < self.majority() {
                    return Step::Wait;
                }
                let value = self.highest.as_ref().map_or_else(|| self.own.clone(), |(_, v)| v.clone());
                self.votes.clear();
                self.phase = Phase::Accepting(value.clone());
                Step::Accept(value)
            }
            Vote::Accepted { ballot } if ballot == self.ballot => {
                let Phase::Accepting(value) = &self.phase else { return Step::Wait };
                let value = value.clone();
                if !self.count(from) || self.votes.len() < self.majority() {
                    return Step::Wait;
                }
                self.phase = Phase::Chosen(value.clone());
                Step::Chosen(value)
            }
            Vote::Reject { ballot, promised } if ballot == self.ballot && promised > self.ballot => {
                if matches!(self.phase, Phase::Chosen(_)) {
                    return Step::Wait;
                }
                Step::Outbid(promised)
            }
            _ => Step::Wait,
        }
    }
}

/// What a proposer asks its driver to do after a vote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step<V> {
    /// Nothing yet.
    Wait,
    /// A majority promised: send accepts for this value to every acceptor.
    Accept(V),
    /// A majority accepted: the value is chosen.
    Chosen(V),
    /// An acceptor promised a higher ballot: this round cannot succeed.
    Outbid(Ballot),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(round: u64, p: u64) -> Ballot {
        Ballot { round, proposer: NodeId(p) }
    }

    #[test]
    fn acceptor_rules() {
        let mut a = AcceptorState::<u8>::default();
        assert_eq!(a.on_prepare(b(1, 1)), (Vote::Promise { ballot: b(1, 1), accepted: None }, true));
        assert!(!a.on_prepare(b(1, 1)).1, "a repeated prepare changes nothing");
        assert_eq!(a.on_prepare(b(0, 9)).0, Vote::Reject { ballot: b(0, 9), promised: b(1, 1) });
        assert_eq!(a.on_accept(b(1, 1), &7), (Vote::Accepted { ballot: b(1, 1) }, true));
        assert_eq!(a.on_accept(b(1, 1), &7), (Vote::Accepted { ballot: b(1, 1) }, false));
        assert_eq!(
            a.on_prepare(b(2, 2)),
            (Vote::Promise { ballot: b(2, 2), accepted: Some((b(1, 1), 7)) }, true)
        );
        assert!(matches!(a.on_accept(b(1, 1), &8).0, Vote::Reject { .. }));
    }

    #[test]
    fn proposer_carries_forward_the_highest_accepted_value() {
        let mut p = Proposer::new(b(3, 1), 1u8, [NodeId(1), NodeId(2), NodeId(3)]);
        let promise = |accepted| Vote::Promise { ballot: b(3, 1), accepted };
        assert_eq!(p.on_vote(NodeId(2), promise(Some((b(1, 2), 5)))), Step::Wait);
        assert_eq!(p.on_vote(NodeId(2), promise(None)), Step::Wait, "duplicates count once");
        assert_eq!(p.on_vote(NodeId(3), promise(Some((b(2, 3), 6)))), Step::Accept(6));
        assert_eq!(p.on_vote(NodeId(1), Vote::Accepted { ballot: b(3, 1) }), Step::Wait);
        assert_eq!(p.on_vote(NodeId(9), Vote::Accepted { ballot: b(3, 1) }), Step::Wait, "not an acceptor");
        assert_eq!(p.on_vote(NodeId(3), Vote::Accepted { ballot: b(3, 1) }), Step::Chosen(6));
    }

    #[test]
    fn proposer_uses_its_own_value_when_nothing_was_accepted() {
        let mut p = Proposer::new(b(1, 1), 4u8, [NodeId(1), NodeId(2), NodeId(3)]);
        p.on_vote(NodeId(1), Vote::Promise { ballot: b(1, 1), accepted: None });
        assert_eq!(p.on_vote(NodeId(2), Vote::Promise { ballot: b(1, 1), accepted: None }), Step::Accept(4));
        assert_eq!(
            p.on_vote(NodeId(3), Vote::Reject { ballot: b(1, 1), promised: b(2, 3) }),
            Step::Outbid(b(2, 3))
        );
        assert_eq!(
            p.on_vote(NodeId(3), Vote::Reject { ballot: b(0, 1), promised: b(2, 3) }),
            Step::Wait,
            "stale"
        );
    }
}
