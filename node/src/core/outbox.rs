//! [`Outbox`]: where one part of the core (its membership, or one key shard) queues what it wants
//! done, and counts the messages it sends.

use std::collections::VecDeque;

use keyhome_delegation::Message as DMessage;
use keyhome_epoch::{Message as EpochMessage, NodeId};

use super::{Output, PeerMessage};
use crate::activity::{MessageCounts, delegation_kind, epoch_kind};
use crate::status::Counters;

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
}

impl Outbox {
    #[inline]
    pub fn push(&mut self, output: Output) {
        self.queue.push_back(output);
    }

    /// Queues `message` for `to`, unless the node failed.
    pub fn send(&mut self, to: NodeId, message: PeerMessage) {
        if self.failed {
            return;
        }
        self.counters.peer_sent += 1;
        self.messages.sent(&message);
        if matches!(message, PeerMessage::Delegation(_)) {
            self.counters.delegation_sent += 1;
        }
        let output = Output::Transmit { to, message };
        if self.holding {
            self.held.push(output);
        } else {
            self.queue.push_back(output);
        }
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
