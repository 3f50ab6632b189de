//! What `keyhome status` shows: one node's view of the cluster, as plain data.

use std::time::Duration;

use serde::{Deserialize, Serialize};

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
    /// Handshakes refused: a certificate the node does not accept, a certificate role on the
    /// wrong protocol, an address over `limits.max_handshakes_per_addr`, or dropped unanswered at
    /// `limits.max_handshakes`.
    #[serde(default)]
    pub handshakes_refused: u64,
    /// Connection attempts asked to validate their address first (QUIC retry), above
    /// `limits.retry_handshakes_above` handshakes in progress.
    #[serde(default)]
    pub handshakes_retried: u64,
    /// Established connections closed at once by a connection cap (`limits.max_client_connections`
    /// or `limits.max_connections_per_identity`).
    #[serde(default)]
    pub connections_refused: u64,
    /// Client requests refused as malformed or oversized.
    #[serde(default)]
    pub requests_malformed: u64,
    /// Client requests that did not arrive whole within `limits.request_timeout_ms`: answered
    /// with an error, their stream stopped.
    #[serde(default)]
    pub requests_timed_out: u64,
    /// Peer connections this node closed for what the peer sent (a bad frame, another cluster,
    /// not a member).
    #[serde(default)]
    pub peer_links_closed: u64,
    /// Peer connections accepted while another live connection from another address claimed the
    /// same node id (see [`Status::duplicate_ids`]).
    #[serde(default)]
    pub duplicate_id_connections: u64,
}

/// One node's status. Durations are measured from the moment the node answered.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Status {
    pub id: u64,
    /// This run's incarnation (grows on every restart).
    pub incarnation: u64,
    pub epoch: u64,
    pub members: Vec<MemberStatus>,
    /// Time left on this node's home lease for the current epoch; `None` without one.
    pub home_lease_left: Option<Duration>,
    /// Restart quarantine left: the node grants no delegation before it ends.
    pub quarantine_left: Duration,
    /// Keys this node holds a delegation of, or tracks for local lockers.
    pub holder_keys: usize,
    /// Live delegations this node has granted as home.
    pub homed_delegations: usize,
    /// Keys this node homes that are in lock-delay.
    pub lock_delay_keys: usize,
    pub counters: Counters,
    /// Node ids that live peer connections from more than one address claim at once: two
    /// processes run with one node's certificate (docs/operations.md, "One process per node id").
    #[serde(default)]
    pub duplicate_ids: Vec<DuplicateId>,
    /// What the transport holds now (see docs/operations.md, "Limits and hostile load").
    #[serde(default)]
    pub load: Load,
}

/// What a node's transport holds at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Load {
    /// Client and operator connections open.
    pub client_connections: u64,
    /// Handshakes in progress.
    pub handshakes: u64,
    /// Bytes held by client requests still arriving (bounded by `limits.request_bytes_per_identity`
    /// per identity).
    pub request_bytes: u64,
}

/// A node id claimed by live connections from several addresses.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DuplicateId {
    pub id: u64,
    /// The addresses of the connections claiming it, in the order they connected.
    pub addrs: Vec<String>,
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
            Some(left) => writeln!(f, "home lease: {} ms left", left.as_millis())?,
            None => writeln!(f, "home lease: none (this node grants no delegation)")?,
        }
        if !self.quarantine_left.is_zero() {
            writeln!(f, "restart quarantine: {} ms left", self.quarantine_left.as_millis())?;
        }
        writeln!(
            f,
            "delegations: {} held here, {} granted as home; {} keys in lock-delay",
            self.holder_keys, self.homed_delegations, self.lock_delay_keys
        )?;
        for d in &self.duplicate_ids {
            writeln!(
                f,
                "WARNING: node {} is claimed by live connections from {}: two processes run as one node",
                d.id,
                d.addrs.join(" and ")
            )?;
        }
        let l = &self.load;
        writeln!(
            f,
            "transport: {} client connections, {} handshakes in progress, {} request bytes arriving",
            l.client_connections, l.handshakes, l.request_bytes
        )?;
        let c = &self.counters;
        writeln!(
            f,
            "messages: {} sent, {} received, {} dropped, {} local; locks: {} ({} with no message)",
            c.peer_sent, c.peer_received, c.peer_dropped, c.local_delivered, c.locks, c.locks_immediate
        )?;
        write!(
            f,
            "refused: {} handshakes ({} retried), {} connections over a cap, {} malformed and {} timed-out \
             requests, {} peer connections closed",
            c.handshakes_refused,
            c.handshakes_retried,
            c.connections_refused,
            c.requests_malformed,
            c.requests_timed_out,
            c.peer_links_closed
        )
    }
}
