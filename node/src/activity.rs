//! What a node's [`Core`](crate::core::Core) records for observability beyond its
//! [`Counters`](crate::status::Counters): how long locks waited and were held ([`Activity`]),
//! cluster messages by kind ([`MessageCounts`]) and the latest epoch changes ([`EpochLog`]); the
//! hottest keys are in [`crate::hotkeys`].
//!
//! Plain data the core owns and updates with the instants it is given (no clock, no globals, no
//! I/O); the runtime reads it for `/metrics`, `keyhome status` and the status page. Everything is
//! bounded: histograms have fixed buckets, message kinds are a fixed set, [`EpochLog`] keeps a
//! fixed number of entries.

use std::collections::VecDeque;
use std::time::Duration;

use keyhome_delegation::{Body as DBody, Message as DMessage};
use keyhome_epoch::{Body as EBody, Instant, Message as EpochMessage};
use prometheus_client::metrics::histogram::Histogram;

use crate::core::PeerMessage;

/// Upper bounds (seconds) of the lock wait and hold histograms' buckets: 1 ms to about 65 s.
pub fn lock_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.001, 2.0, 17)
}

/// How long locks waited and were held. Every key shard of a node records into the same
/// histograms (a histogram's clone shares its counts).
pub struct Activity {
    /// Seconds from a lock call to its admission, for locks that had to wait for a message
    /// (locks admitted at once are counted, not timed: `Counters::locks_immediate`).
    pub lock_wait: Histogram,
    /// Seconds from admission to unlock or expiry, for client handles (embedded handles are not
    /// timed: their guard holds them without the core keeping an entry).
    pub lock_hold: Histogram,
}

impl Default for Activity {
    fn default() -> Activity {
        Activity { lock_wait: Histogram::new(lock_buckets()), lock_hold: Histogram::new(lock_buckets()) }
    }
}

/// Records `since..now` in `histogram`, in seconds.
pub fn observe_span(histogram: &Histogram, since: Instant, now: Instant) {
    histogram.observe(now.saturating_duration_since(since).as_secs_f64());
}

/// Every kind of message between nodes, as the `kind` label of `keyhome_messages_total`.
pub const MESSAGE_KINDS: [&str; 18] = [
    "epoch_prepare",
    "epoch_accept",
    "epoch_vote",
    "epoch_chosen",
    "epoch_catch_up",
    "epoch_lease_request",
    "epoch_lease_grant",
    "delegation_request",
    "delegation_grant",
    "delegation_refuse",
    "delegation_recall",
    "delegation_release",
    "delegation_check",
    "delegation_probe",
    "delegation_check_reply",
    "delegation_handover",
    "delegation_handover_ack",
    "delegation_pass",
];

/// The index of `message`'s kind in [`MESSAGE_KINDS`].
fn kind_of(message: &PeerMessage) -> usize {
    match message {
        PeerMessage::Epoch(m) => epoch_kind(m),
        PeerMessage::Delegation(m) => delegation_kind(m),
    }
}

/// The index of an epoch message's kind in [`MESSAGE_KINDS`].
pub fn epoch_kind(message: &EpochMessage) -> usize {
    match message.body {
        EBody::Prepare { .. } => 0,
        EBody::Accept { .. } => 1,
        EBody::Vote { .. } => 2,
        EBody::Chosen(_) => 3,
        EBody::CatchUp => 4,
        EBody::LeaseRequest { .. } => 5,
        EBody::LeaseGrant { .. } => 6,
    }
}

/// The index of a delegation message's kind in [`MESSAGE_KINDS`].
pub fn delegation_kind(message: &DMessage) -> usize {
    match message.body {
        DBody::Request { .. } => 7,
        DBody::Grant { .. } => 8,
        DBody::Refuse { .. } => 9,
        DBody::Recall { .. } => 10,
        DBody::Release { .. } => 11,
        DBody::Check { .. } => 12,
        DBody::Probe { .. } => 13,
        DBody::CheckReply { .. } => 14,
        DBody::Handover { .. } => 15,
        DBody::HandoverAck { .. } => 16,
        DBody::Pass { .. } => 17,
    }
}

/// Messages to and from other nodes (not this node's deliveries to itself), by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MessageCounts {
    /// Queued for other nodes, by index in [`MESSAGE_KINDS`].
    pub sent: [u64; MESSAGE_KINDS.len()],
    /// Received from other nodes, by index in [`MESSAGE_KINDS`].
    pub received: [u64; MESSAGE_KINDS.len()],
}

impl MessageCounts {
    pub fn sent(&mut self, message: &PeerMessage) {
        self.sent[kind_of(message)] += 1;
    }

    /// Adds `other`'s counts (another part of the node).
    pub fn add(&mut self, other: &MessageCounts) {
        for (sum, n) in self.sent.iter_mut().zip(other.sent) {
            *sum += n;
        }
        for (sum, n) in self.received.iter_mut().zip(other.received) {
            *sum += n;
        }
    }
}

/// Epoch changes kept in [`EpochLog`].
pub const EPOCH_LOG: usize = 16;

/// An epoch this node learned, and when.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EpochChange {
    pub epoch: u64,
    pub members: Vec<u64>,
    /// This node's clock when it learned the epoch.
    pub at: Instant,
}

/// The last [`EPOCH_LOG`] epochs this node learned in this run, oldest first.
#[derive(Clone, Debug, Default)]
pub struct EpochLog {
    changes: VecDeque<EpochChange>,
}

impl EpochLog {
    pub fn learned(&mut self, change: EpochChange) {
        if self.changes.len() == EPOCH_LOG {
            self.changes.pop_front();
        }
        self.changes.push_back(change);
    }

    /// Oldest first.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = &EpochChange> {
        self.changes.iter()
    }
}

/// How long ago `at` was, at `now` (zero if not earlier).
pub fn ago(at: Instant, now: Instant) -> Duration {
    now.saturating_duration_since(at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_epoch_log_keeps_the_latest_changes() {
        let mut log = EpochLog::default();
        for epoch in 1..=(EPOCH_LOG as u64 + 5) {
            log.learned(EpochChange { epoch, members: vec![1], at: Instant::from_nanos(epoch) });
        }
        let epochs: Vec<u64> = log.iter().map(|c| c.epoch).collect();
        assert_eq!(epochs, (6..=EPOCH_LOG as u64 + 5).collect::<Vec<_>>());
    }
}
