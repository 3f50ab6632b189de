//! [`EpochView`]: what the delegation layer reads of an [`EpochNode`](crate::EpochNode), as an
//! owned snapshot, so that cores that do not share the epoch core's lock (a node's key shards)
//! can decide grants on their own.
//!
//! A view is taken with [`EpochNode::view`](crate::EpochNode::view) and stays as it was: a node
//! takes a new one whenever [`EpochNode::view_stamp`](crate::EpochNode::view_stamp) changes (a new
//! epoch, or a home lease gained, renewed or lost). Between two views a view is only ever more
//! cautious than the epoch core: its home lease ends no later than the core's, and everything
//! else it holds changes only with the epoch, when the node hands out a new view before it
//! delivers anything of the new epoch.

use std::collections::VecDeque;
use std::time::Duration;

use keyhome_ring::{KeyDigest, NodeId, Ring};

use crate::activation::{self, Standing};
use crate::node::Bugs;
use crate::record::EpochRecord;
use crate::time::Instant;

/// An epoch this run learned, with the instant from which it may act as a new home under it.
#[derive(Clone, Debug)]
pub(crate) struct Learned {
    pub number: u64,
    pub ring: Ring,
    /// The epoch's `max_delegation_lease`.
    pub max_delegation_lease: Duration,
    /// Before this instant, some node may still hold a home lease of an earlier epoch.
    pub fence_until: Instant,
    /// End of this node's home lease under this epoch, once the node has moved past it. (The
    /// lease of the current epoch is kept apart, by the epoch core and by a view.)
    pub lease_until: Option<Instant>,
}

/// The epochs one run learned, oldest first; the last one is the current epoch. The grant rules
/// over them live here, once, for the epoch core and its views.
#[derive(Clone, Debug, Default)]
pub(crate) struct History {
    pub learned: VecDeque<Learned>,
}

impl History {
    /// The home of `key` under the current epoch.
    pub fn home_of(&self, key: &[u8]) -> Option<NodeId> {
        self.learned.back().and_then(|learned| learned.ring.home(key))
    }

    /// The home of `key` under `epoch`, if this run learned that epoch and still remembers it.
    pub fn home_in(&self, epoch: u64, key: &[u8]) -> Option<NodeId> {
        let learned = self.learned.iter().find(|l| l.number == epoch)?;
        learned.ring.home(key)
    }

    /// Whether the current epoch's activation instant has passed at `now` (see
    /// [`EpochNode::activation_passed`](crate::EpochNode::activation_passed)).
    pub fn activation_passed(&self, now: Instant) -> bool {
        self.learned.back().is_some_and(|learned| now >= learned.fence_until)
    }

    /// The home of `key` under the epoch before `current` (see
    /// [`EpochNode::previous_home_of`](crate::EpochNode::previous_home_of)).
    pub fn previous_home_of(&self, current: u64, key: &[u8], bugs: Bugs) -> Option<NodeId> {
        if bugs.no_handover {
            return None;
        }
        self.home_in(current.checked_sub(1)?, key)
    }

    /// Whether node `id` may grant `key` at `now`, its current epoch's home lease ending at
    /// `lease_until` (see [`EpochNode::home_active`](crate::EpochNode::home_active)).
    pub fn home_active(
        &self,
        id: NodeId,
        lease_until: Option<Instant>,
        now: Instant,
        key: KeyDigest,
        bugs: Bugs,
    ) -> bool {
        if bugs.same_home_wait && self.learned.back().is_some_and(|l| now < l.fence_until) {
            return false;
        }
        let standings = self.learned.iter().rev().enumerate().map(|(i, learned)| Standing {
            number: learned.number,
            homes_key: learned.ring.home_of(key) == Some(id),
            lease_until: if i == 0 { lease_until } else { learned.lease_until },
            fence_until: learned.fence_until,
            max_delegation_lease: learned.max_delegation_lease,
        });
        activation::may_grant(standings, now, bugs)
    }
}

/// Identifies what a view holds: a node takes a new [`EpochView`] when this changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ViewStamp {
    pub(crate) epoch: u64,
    pub(crate) lease: Option<Instant>,
}

/// A snapshot of one node's epoch core; see the module docs.
#[derive(Clone, Debug)]
pub struct EpochView {
    pub(crate) id: NodeId,
    pub(crate) incarnation: u64,
    pub(crate) current: EpochRecord,
    pub(crate) history: History,
    /// End of this node's home lease for `current`, if it held one when the view was taken.
    pub(crate) lease: Option<Instant>,
    pub(crate) bugs: Bugs,
}

impl EpochView {
    /// The node the view is of.
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// The node's run incarnation.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The node's current epoch when the view was taken.
    pub fn current(&self) -> &EpochRecord {
        &self.current
    }

    /// What this view holds (equal to the node's stamp when it was taken).
    pub fn stamp(&self) -> ViewStamp {
        ViewStamp { epoch: self.current.number, lease: self.lease }
    }

    /// The end of the home lease for the current epoch at `now`, if the view holds one.
    pub fn lease_until(&self, now: Instant) -> Option<Instant> {
        self.lease.filter(|&until| now < until)
    }

    /// Whether the view holds a home lease at `now`.
    pub fn holds_lease(&self, now: Instant) -> bool {
        self.lease_until(now).is_some()
    }

    /// Whether the current epoch's activation instant had passed at `now`, by this view.
    pub fn activation_passed(&self, now: Instant) -> bool {
        self.history.activation_passed(now)
    }

    /// The home of `key` under the current epoch.
    pub fn home_of(&self, key: &[u8]) -> Option<NodeId> {
        self.history.home_of(key)
    }

    /// The home of `key` under the epoch before the current one, if the run remembers it.
    pub fn previous_home_of(&self, key: &[u8]) -> Option<NodeId> {
        self.history.previous_home_of(self.current.number, key, self.bugs)
    }

    /// Whether the node may grant `key` at `now`, by this view.
    pub fn home_active(&self, now: Instant, key: &[u8]) -> bool {
        self.history.home_active(self.id, self.lease_until(now), now, KeyDigest::of(key), self.bugs)
    }
}
