//! What the delegation layer asks of the epoch layer, as a trait so tests can script it.

use keyhome_epoch::{EpochNode, EpochView, Instant, NodeId, Timing};

/// The epoch layer's view, as of one instant.
pub trait Authority {
    /// This node's current epoch number.
    fn epoch(&self) -> u64;
    /// This node's run incarnation (durable before anything was sent).
    fn incarnation(&self) -> u64;
    /// The current epoch's timing.
    fn timing(&self) -> Timing;
    /// Whether `node` is a member of the current epoch.
    fn is_member(&self, node: NodeId) -> bool;
    /// The home of `key` under the current epoch.
    fn home_of(&self, key: &[u8]) -> Option<NodeId>;
    /// Whether this node may grant `key` at `now` (see [`EpochNode::home_active`]).
    fn home_active(&self, now: Instant, key: &[u8]) -> bool;

    /// Whether this node holds a home lease for its current epoch at `now` (see
    /// [`EpochNode::holds_lease`]). A home grants a key handed over to it by the key's previous
    /// home on the lease alone, without the activation wait (see [`crate::home`]).
    ///
    /// The default, `false`, is the safe answer: handed-over keys then wait for
    /// [`Authority::home_active`] like any other.
    fn holds_lease(&self, now: Instant) -> bool {
        let _ = now;
        false
    }

    /// The home of `key` under epoch `self.epoch() - 1`, if this node learned that epoch and
    /// remembers its ring; `None` otherwise. A home adopts a handed-over key only from this node.
    ///
    /// The default, `None`, is the safe answer: no handover is adopted, so moved keys wait for
    /// [`Authority::home_active`].
    fn previous_home_of(&self, key: &[u8]) -> Option<NodeId> {
        let _ = key;
        None
    }

    /// Whether the current epoch's activation instant has passed at `now` (see
    /// [`EpochNode::activation_passed`]). A home adopts no handover afterwards: it may have been
    /// active for the key already, granted it and dropped its record, and the handed state is
    /// older than that.
    ///
    /// The default, `true`, is the safe answer: no handover is adopted.
    fn activation_passed(&self, now: Instant) -> bool {
        let _ = now;
        true
    }
}

impl Authority for EpochNode {
    fn epoch(&self) -> u64 {
        self.current().number
    }

    fn incarnation(&self) -> u64 {
        EpochNode::incarnation(self)
    }

    fn timing(&self) -> Timing {
        self.current().timing
    }

    fn is_member(&self, node: NodeId) -> bool {
        self.current().is_member(node)
    }

    fn home_of(&self, key: &[u8]) -> Option<NodeId> {
        EpochNode::home_of(self, key)
    }

    fn home_active(&self, now: Instant, key: &[u8]) -> bool {
        EpochNode::home_active(self, now, key)
    }

    fn holds_lease(&self, now: Instant) -> bool {
        EpochNode::holds_lease(self, now)
    }

    fn previous_home_of(&self, key: &[u8]) -> Option<NodeId> {
        EpochNode::previous_home_of(self, key)
    }

    fn activation_passed(&self, now: Instant) -> bool {
        EpochNode::activation_passed(self, now)
    }
}

/// A snapshot of the epoch core answers as the core did when it was taken (see
/// [`keyhome_epoch::view`]), so shards that do not share the epoch core's lock decide alike.
impl Authority for EpochView {
    fn epoch(&self) -> u64 {
        self.current().number
    }

    fn incarnation(&self) -> u64 {
        EpochView::incarnation(self)
    }

    fn timing(&self) -> Timing {
        self.current().timing
    }

    fn is_member(&self, node: NodeId) -> bool {
        self.current().is_member(node)
    }

    fn home_of(&self, key: &[u8]) -> Option<NodeId> {
        EpochView::home_of(self, key)
    }

    fn home_active(&self, now: Instant, key: &[u8]) -> bool {
        EpochView::home_active(self, now, key)
    }

    fn holds_lease(&self, now: Instant) -> bool {
        EpochView::holds_lease(self, now)
    }

    fn previous_home_of(&self, key: &[u8]) -> Option<NodeId> {
        EpochView::previous_home_of(self, key)
    }

    fn activation_passed(&self, now: Instant) -> bool {
        EpochView::activation_passed(self, now)
    }
}
