//! What `keyhome status` shows: one node's view of the cluster, as plain data.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use keyhome_epoch::{EpochRecord, Member, NodeId};

use crate::duration::Human;

/// Cluster messages in and out of this node, for `keyhome status` and the tests that assert a
/// cached re-lock sends nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Frames queued for other nodes.
    pub peer_sent: u64,
    /// Frames received from other nodes.
    pub peer_received: u64,
    /// Frames dropped: a peer's queue was full or its link was down, a key shard held more than
    /// it may while an epoch write was not durable, or (incoming epoch frames) the disk was
    /// behind.
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
    /// `limits.max_handshakes` (`handshakes_failed` included).
    #[serde(default)]
    pub handshakes_refused: u64,
    /// Of `handshakes_refused`, those the node ran (its TLS cryptography) before they failed: a
    /// certificate refused, a role on the wrong protocol, the client's close, the idle timeout.
    /// The rest cost no cryptography. A failing address's bucket
    /// (`limits.failed_handshakes_per_addr`) bounds these, not the cheap refusals.
    #[serde(default)]
    pub handshakes_failed: u64,
    /// Connection attempts asked to validate their address first (QUIC retry), above
    /// `limits.retry_handshakes_above` handshakes in progress.
    #[serde(default)]
    pub handshakes_retried: u64,
    /// Connection attempts dropped unanswered, before any cryptography, because their address
    /// failed `limits.failed_handshakes_per_addr` handshakes lately (not in `handshakes_refused`).
    #[serde(default)]
    pub handshakes_throttled: u64,
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

impl Counters {
    /// Adds the fields a part of the core counts (messages and locks) from `other`: how a node's
    /// membership and key shards make one set of counters. The runtime fills in the rest.
    pub fn add_core(&mut self, other: &Counters) {
        self.peer_sent += other.peer_sent;
        self.peer_received += other.peer_received;
        self.peer_dropped += other.peer_dropped;
        self.local_delivered += other.local_delivered;
        self.locks += other.locks;
        self.locks_immediate += other.locks_immediate;
        self.delegation_sent += other.delegation_sent;
        self.delegation_received += other.delegation_received;
    }
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
    /// Whether this node is a member of the current epoch (a removed node is not, and homes
    /// and grants nothing).
    pub member: bool,
    /// The keys this node contended for most, hottest first (at most [`LISTED`]).
    pub hot_keys: Vec<HotKey>,
    /// Keys this node homes that are in lock-delay, soonest free first (at most [`LISTED`]).
    pub lock_delayed: Vec<DelayedKey>,
    /// Keys with lock calls waiting on this node, longest waiting first (at most [`LISTED`]).
    pub waiting: Vec<WaitingKey>,
    /// The latest epochs this node learned in this run, newest first.
    pub recent_epochs: Vec<RecentEpoch>,
    /// Node ids that live peer connections from more than one address claim at once: two
    /// processes run with one node's certificate (docs/operations.md, "One process per node id").
    #[serde(default)]
    pub duplicate_ids: Vec<DuplicateId>,
    /// What the transport holds now (see docs/operations.md, "Limits and hostile load").
    #[serde(default)]
    pub load: Load,
}

/// Entries each list of [`Status`] shows at most.
pub const LISTED: usize = 20;

/// Most bytes of a key that status shows: its lists stay far below a client frame
/// ([`crate::wire::MAX_CLIENT_FRAME`]) whatever keys clients lock.
pub const SHOWN_KEY_BYTES: usize = 128;

/// A key as status shows it: its bytes, with anything but printable ASCII escaped (`\xNN`); past
/// [`SHOWN_KEY_BYTES`] bytes, its start followed by `…` and its length.
pub fn show_key(key: &[u8]) -> String {
    match key.get(..SHOWN_KEY_BYTES) {
        Some(start) if start.len() < key.len() => format!("{}…({} bytes)", start.escape_ascii(), key.len()),
        _ => key.escape_ascii().to_string(),
    }
}

/// A contended key (see [`crate::hotkeys`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HotKey {
    pub key: String,
    /// Locks of the key on this node that had to wait for a message.
    pub waits: u64,
    /// Recalls of the key this node received as its holder.
    pub recalls: u64,
}

/// A key in lock-delay at this node, its home.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DelayedKey {
    pub key: String,
    /// Until the key may be granted again.
    #[serde(rename = "left_ms", with = "crate::duration::as_millis")]
    pub left: Duration,
}

/// A key with lock calls waiting on this node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaitingKey {
    pub key: String,
    /// The key's home in the current epoch (`None` when no epoch names one).
    pub home: Option<u64>,
    /// Lock calls waiting for it.
    pub locks: usize,
    /// How long the oldest of them has waited.
    #[serde(rename = "waiting_for_ms", with = "crate::duration::as_millis")]
    pub waiting_for: Duration,
    /// The key's home is unreachable from this node: the locks wait until it is back, or until
    /// an operator removes it from the epoch (which moves the key to another home).
    pub stalled: bool,
}

/// An epoch this node learned.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecentEpoch {
    pub epoch: u64,
    pub members: Vec<u64>,
    /// How long ago this node learned it.
    #[serde(rename = "ago_ms", with = "crate::duration::as_millis")]
    pub ago: Duration,
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
    /// How long the member has been unreachable: since this node's link to it went down or,
    /// if it never came up, since this node first tried it. `None` when connected, or when this
    /// node has not tried to reach the member yet.
    #[serde(rename = "unreachable_for_ms", with = "crate::duration::as_millis_opt")]
    pub unreachable_for: Option<Duration>,
    /// Why the member closed this node's last connection, when it refused it (this node is not
    /// a member it knows, was removed, belongs to another cluster, or sent what it cannot read):
    /// the member's own words. Shown while not connected.
    pub refused: Option<String>,
}

impl Status {
    /// Marks the waiting keys whose home is a member this node has no connection to.
    pub fn mark_stalled(&mut self) {
        for w in &mut self.waiting {
            w.stalled = w.home.is_some_and(|home| self.members.iter().any(|m| m.id == home && !m.connected));
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "node {} (incarnation {}), epoch {}", self.id, self.incarnation, self.epoch)?;
        writeln!(f, "members:")?;
        for m in &self.members {
            let state = match (m.id == self.id, m.connected, m.unreachable_for, &m.refused) {
                (true, ..) => "self".to_string(),
                (_, true, ..) => "connected".to_string(),
                (_, false, _, Some(why)) => format!("REFUSES THIS NODE: {why}"),
                (_, false, Some(d), None) => format!("UNREACHABLE for {}", Human(d)),
                (_, false, None, None) => "unreachable (not tried yet)".to_string(),
            };
            writeln!(f, "  {:>6}  {:<24} {state}", m.id, m.addr)?;
        }
        if !self.member {
            writeln!(
                f,
                "THIS NODE IS NOT A MEMBER of epoch {}: it homes and grants nothing (add it back with \
                 `keyhome epoch propose --add {}=HOST:PORT`, or stop it)",
                self.epoch, self.id
            )?;
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
            "refused: {} handshakes ({} after running, {} retried, {} more dropped from failing addresses), {} connections over a cap, {} malformed and {} timed-out \
             requests, {} peer connections closed",
            c.handshakes_refused,
            c.handshakes_failed,
            c.handshakes_retried,
            c.handshakes_throttled,
            c.connections_refused,
            c.requests_malformed,
            c.requests_timed_out,
            c.peer_links_closed
        )?;
        self.fmt_lists(f)
    }
}

impl Status {
    /// The lists of [`Status`] as text: stalled and waiting keys, hot keys, lock-delay, epochs.
    fn fmt_lists(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let stalled: Vec<_> = self.waiting.iter().filter(|w| w.stalled).collect();
        if !stalled.is_empty() {
            write!(f, "\nSTALLED: these keys wait for a home this node cannot reach:")?;
            for w in &stalled {
                let (home, locks, waited) = (w.home.unwrap_or_default(), w.locks, Human(w.waiting_for));
                write!(f, "\n  {}  home {home}, {locks} lock(s) waiting for {waited}", w.key)?;
            }
            let mut homes: Vec<u64> = stalled.iter().filter_map(|w| w.home).collect();
            homes.sort_unstable();
            homes.dedup();
            for home in homes {
                write!(
                    f,
                    "\n  if node {home} is gone for good, move its keys to other homes: \
                     keyhome epoch propose --remove {home}"
                )?;
            }
        }
        let waiting = self.waiting.iter().filter(|w| !w.stalled).count();
        if waiting > 0 {
            write!(f, "\nwaiting: {waiting} key(s) with pending locks")?;
        }
        if !self.hot_keys.is_empty() {
            write!(f, "\nhot keys (waits, recalls):")?;
            for h in &self.hot_keys {
                write!(f, "\n  {:<32} {:>6} {:>6}", h.key, h.waits, h.recalls)?;
            }
        }
        if !self.lock_delayed.is_empty() {
            write!(f, "\nin lock-delay:")?;
            for d in &self.lock_delayed {
                write!(f, "\n  {:<32} {} left", d.key, Human(d.left))?;
            }
        }
        if let Some(latest) = self.recent_epochs.first() {
            write!(
                f,
                "\nlast epoch change: epoch {} ({} ago), members {:?}",
                latest.epoch,
                Human(latest.ago),
                latest.members
            )?;
        }
        Ok(())
    }
}

/// A status with an unreachable member, a stalled key and a hot key whose name needs escaping.
#[cfg(test)]
pub(crate) fn example() -> Status {
    Status {
        id: 1,
        incarnation: 3,
        epoch: 7,
        members: vec![
            MemberStatus {
                id: 1,
                addr: "127.0.0.1:7101".into(),
                connected: true,
                unreachable_for: None,
                refused: None,
            },
            MemberStatus {
                id: 2,
                addr: "127.0.0.1:7102".into(),
                connected: false,
                unreachable_for: Some(Duration::from_secs(42)),
                refused: None,
            },
        ],
        home_lease_left: Some(Duration::from_millis(1500)),
        quarantine_left: Duration::ZERO,
        holder_keys: 2,
        homed_delegations: 1,
        lock_delay_keys: 0,
        counters: Counters { locks: 10, locks_immediate: 8, ..Counters::default() },
        member: false,
        hot_keys: vec![HotKey { key: "<script>".into(), waits: 5, recalls: 2 }],
        lock_delayed: vec![],
        waiting: vec![WaitingKey {
            key: "orders".into(),
            home: Some(2),
            locks: 1,
            waiting_for: Duration::from_secs(3),
            stalled: true,
        }],
        recent_epochs: vec![RecentEpoch { epoch: 7, members: vec![1, 2], ago: Duration::from_secs(5) }],
        duplicate_ids: Vec::new(),
        load: Load::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Any client can make a node list its keys (contend for them, queue on them): with every
    /// list full of the longest binary keys a node takes, the status answer still fits a frame.
    #[test]
    fn a_status_full_of_the_longest_binary_keys_fits_a_client_frame() {
        let longest = vec![0xff_u8; keyhome_delegation::Limits::default().max_key_len];
        let shown = show_key(&longest);
        assert!(shown.starts_with("\\xff\\xff") && shown.ends_with("…(1024 bytes)"), "{shown}");
        assert_eq!(show_key(&longest[..SHOWN_KEY_BYTES]), "\\xff".repeat(SHOWN_KEY_BYTES), "shown whole");
        let mut status = example();
        status.hot_keys = vec![HotKey { key: shown.clone(), waits: u64::MAX, recalls: u64::MAX }; LISTED];
        status.lock_delayed =
            vec![DelayedKey { key: shown.clone(), left: Duration::from_secs(1 << 40) }; LISTED];
        let waiting = WaitingKey {
            key: shown,
            home: Some(u64::MAX),
            locks: usize::MAX,
            waiting_for: Duration::from_secs(1 << 40),
            stalled: true,
        };
        status.waiting = vec![waiting; LISTED];
        let answer = crate::wire::Response::Status(Box::new(status));
        let frame = crate::wire::encode(&answer, crate::wire::MAX_CLIENT_FRAME);
        assert!(frame.is_ok(), "{:?}", frame.map(|f| f.len()));
    }

    #[test]
    fn the_text_names_the_problems_and_their_fixes() {
        let text = super::example().to_string();
        assert!(text.contains("UNREACHABLE for 42 s"), "{text}");
        assert!(text.contains("THIS NODE IS NOT A MEMBER of epoch 7"), "{text}");
        assert!(
            text.contains("STALLED") && text.contains("orders  home 2, 1 lock(s) waiting for 3 s"),
            "{text}"
        );
        assert!(text.contains("keyhome epoch propose --remove 2"), "{text}");
        assert!(text.contains("last epoch change: epoch 7 (5 s ago), members [1, 2]"), "{text}");
    }
}

/// An epoch as `keyhome epoch show --json` and `GET /v1/epoch` show it: durations in
/// milliseconds.
#[derive(Serialize)]
pub struct EpochJson<'a> {
    number: u64,
    ring_version: u32,
    members: &'a [Member],
    home_lease_ms: u64,
    max_delegation_lease_ms: u64,
    clock_rate_ppm: u32,
    activation_wait_ms: u64,
    retired: &'a [NodeId],
}

impl<'a> From<&'a EpochRecord> for EpochJson<'a> {
    fn from(epoch: &'a EpochRecord) -> EpochJson<'a> {
        EpochJson {
            number: epoch.number,
            ring_version: epoch.ring_version,
            members: &epoch.members,
            home_lease_ms: crate::duration::millis(epoch.timing.home_lease),
            max_delegation_lease_ms: crate::duration::millis(epoch.timing.max_delegation_lease),
            clock_rate_ppm: epoch.timing.clock_rate_ppm,
            activation_wait_ms: crate::duration::millis(epoch.activation_wait),
            retired: &epoch.retired,
        }
    }
}
