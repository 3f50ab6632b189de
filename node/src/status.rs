//! What `keyhome status` shows: one node's view of the cluster, as plain data.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::duration::Human;

/// Cluster messages in and out of this node, for `keyhome status` and the tests that assert a
/// cached re-lock sends nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Frames queued for other nodes.
    pub peer_sent: u64,
    /// Frames received from other nodes.
    pub peer_received: u64,
    /// Frames dropped: a peer's queue was full or its link was down, or (incoming epoch frames)
    /// the disk was behind.
    pub peer_dropped: u64,
    /// Delegation messages this node sent to itself (holder to own home and back): no network.
    pub local_delivered: u64,
    /// Locks admitted (local and remote clients, embedded callers).
    pub locks: u64,
    /// Locks admitted at once, without any message.
    pub locks_immediate: u64,
    /// Delegation messages queued for other nodes (requests, grants, recalls, releases, checks,
    /// handovers): unlike `peer_sent`, background epoch traffic (home-lease renewals) is not
    /// counted, so a cached re-lock shows up as no change here.
    pub delegation_sent: u64,
    /// Delegation messages received from other nodes.
    pub delegation_received: u64,
}

/// One node's status. Durations are measured from the moment the node answered.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Status {
    pub id: u64,
    /// This run's incarnation (grows on every restart).
    pub incarnation: u64,
    pub epoch: u64,
    pub members: Vec<MemberStatus>,
    /// Time left on this node's home lease for the current epoch; `None` without one. (JSON:
    /// `home_lease_left_ms`, whole milliseconds, like every duration here.)
    #[serde(rename = "home_lease_left_ms", with = "crate::duration::as_millis_opt")]
    pub home_lease_left: Option<Duration>,
    /// Restart quarantine left: the node grants no delegation before it ends.
    #[serde(rename = "quarantine_left_ms", with = "crate::duration::as_millis")]
    pub quarantine_left: Duration,
    /// Keys this node holds a delegation of, or tracks for local lockers.
    pub holder_keys: usize,
    /// Live delegations this node has granted as home.
    pub homed_delegations: usize,
    /// Keys this node homes that are in lock-delay.
    pub lock_delay_keys: usize,
    pub counters: Counters,
}

/// A member of the current epoch, as this node sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberStatus {
    pub id: u64,
    pub addr: String,
    /// This node has an open connection to the member (always true for itself).
    pub connected: bool,
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "node {} (incarnation {}), epoch {}", self.id, self.incarnation, self.epoch)?;
        writeln!(f, "members:")?;
        for m in &self.members {
            let state = if m.id == self.id {
                "self"
            } else if m.connected {
                "connected"
            } else {
                "unreachable"
            };
            writeln!(f, "  {:>6}  {:<24} {state}", m.id, m.addr)?;
        }
        match self.home_lease_left {
            Some(left) => writeln!(f, "home lease: {} left", Human(left))?,
            None => writeln!(f, "home lease: none (this node grants no delegation)")?,
        }
        if !self.quarantine_left.is_zero() {
            writeln!(f, "restart quarantine: {} left", Human(self.quarantine_left))?;
        }
        writeln!(
            f,
            "delegations: {} held here, {} granted as home; {} keys in lock-delay",
            self.holder_keys, self.homed_delegations, self.lock_delay_keys
        )?;
        let c = &self.counters;
        write!(
            f,
            "messages: {} sent, {} received, {} dropped, {} local; locks: {} ({} with no message)",
            c.peer_sent, c.peer_received, c.peer_dropped, c.local_delivered, c.locks, c.locks_immediate
        )
    }
}
