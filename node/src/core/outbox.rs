//! [`Outbox`]: where one part of the core (its membership, or one key shard) queues what it wants
//! done, and counts the messages it sends.

use std::collections::VecDeque;

use keyhome_delegation::Message as DMessage;
use keyhome_epoch::{Message as EpochMessage, NodeId};

use super::{Output, PeerMessage};
use crate::activity::{MessageCounts, delegation_kind, epoch_kind};
use crate::status::Counters;

/// Most bytes of messages one part holds while an epoch write is not durable ([`Outbox::hold`]),
/// counted as their encoded size plus an [`Output`]'s. A write takes one disk flush; past this
/// budget (a disk that stalls while peers and clients keep asking) further ones are dropped,
/// counted in [`Counters::peer_dropped`], as the network may drop any: the delegation protocol
/// resends what it needs, and a token check's answer that never comes times out.
pub(super) const MAX_HELD_BYTES: usize = 1 << 20;

/// The outputs of one part of the core, in the order it produced them, and what it counted.
#[derive(Default)]
pub(super) struct Outbox {
    queue: VecDeque<Output>,
    /// The part's share of the node's counters (the core's own fields only).
    pub counters: Counters,
    pub messages: MessageCounts,
    /// Once set (a write failed), nothing leaves this part any more.
    failed: bool,
    /// While set, messages for other nodes wait in `held`, in order: they carry an epoch whose
    /// write is not durable yet (see [`Outbox::hold`]).
    holding: bool,
    held: Vec<Output>,
    /// The bytes `held` counts against [`MAX_HELD_BYTES`].
    held_bytes: usize,
}

impl Outbox {
    #[inline]
    pub fn push(&mut self, output: Output) {
        self.queue.push_back(output);
    }

    /// Queues `message` for `to`, unless the node failed; returns whether it is held (see
    /// [`Outbox::hold`]), rather than queued or dropped.
    pub fn send(&mut self, to: NodeId, message: PeerMessage) -> bool {
        if self.failed {
            return false;
        }
        self.counters.peer_sent += 1;
        self.messages.sent(&message);
        if matches!(message, PeerMessage::Delegation(_)) {
            self.counters.delegation_sent += 1;
        }
        if !self.holding {
            self.queue.push_back(Output::Transmit { to, message });
            return false;
        }
        let bytes = held_size(&message);
        if self.held_bytes + bytes > MAX_HELD_BYTES {
            self.counters.peer_dropped += 1;
            return false;
        }
        self.held_bytes += bytes;
        self.held.push(Output::Transmit { to, message });
        true
    }

    /// Whether any message for another node is held now.
    pub fn has_held(&self) -> bool {
        !self.held.is_empty()
    }

    /// Whether messages for other nodes are being held.
    pub fn holding(&self) -> bool {
        self.holding
    }

    /// From now on holds the messages for other nodes (`true`: a key shard works under an epoch
    /// not yet durable, and a crash could take the node back below what they carry), or lets
    /// them go, those held first.
    pub fn hold(&mut self, hold: bool) {
        self.holding = hold;
        if !hold {
            self.queue.extend(self.held.drain(..));
            self.held_bytes = 0;
        }
    }

    /// Counts an epoch message received from another node.
    pub fn received_epoch(&mut self, message: &EpochMessage) {
        self.counters.peer_received += 1;
        self.messages.received[epoch_kind(message)] += 1;
    }

    /// Counts a delegation message received from another node.
    pub fn received_delegation(&mut self, message: &DMessage) {
        self.counters.peer_received += 1;
        self.counters.delegation_received += 1;
        self.messages.received[delegation_kind(message)] += 1;
    }

    /// A durable write failed: what is queued for other nodes or the disk is dropped, and nothing
    /// more is sent.
    pub fn fail(&mut self) {
        self.failed = true;
        self.held.clear();
        self.held_bytes = 0;
        self.queue.retain(|o| !matches!(o, Output::Transmit { .. } | Output::Persist { .. }));
    }

    pub fn failed(&self) -> bool {
        self.failed
    }

    #[inline]
    pub fn pop(&mut self) -> Option<Output> {
        self.queue.pop_front()
    }
}

/// What holding `message` costs, as [`MAX_HELD_BYTES`] counts it.
fn held_size(message: &PeerMessage) -> usize {
    let encoded = postcard::serialize_with_flavor(message, postcard::ser_flavors::Size::default());
    std::mem::size_of::<Output>() + encoded.unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use keyhome_epoch::Body;

    use super::*;

    fn catch_up() -> PeerMessage {
        PeerMessage::Epoch(EpochMessage { epoch: 7, body: Body::CatchUp })
    }

    /// A part that holds its messages (its epoch's write not durable yet) keeps at most
    /// [`MAX_HELD_BYTES`] of them, in order, counting the rest as dropped; they leave once it
    /// stops holding, and later ones are not held.
    #[test]
    fn held_messages_are_bounded_and_leave_in_order() {
        let mut out = Outbox::default();
        out.hold(true);
        let fits = (MAX_HELD_BYTES / held_size(&catch_up())) as u64;
        for n in 0..fits + 10 {
            assert_eq!(out.send(NodeId(n), catch_up()), n < fits);
        }
        assert_eq!(out.counters.peer_dropped, 10);
        assert!(out.pop().is_none(), "nothing leaves while held");
        out.hold(false);
        assert!(!out.send(NodeId(u64::MAX), catch_up()), "queued, not held");
        let to: Vec<u64> = std::iter::from_fn(|| out.pop())
            .map(|o| match o {
                Output::Transmit { to, .. } => to.0,
                other => panic!("{other:?}"),
            })
            .collect();
        let expected: Vec<u64> = (0..fits).chain([u64::MAX]).collect();
        assert_eq!(to, expected);
        assert_eq!(out.counters.peer_sent, fits + 11);
    }
}
