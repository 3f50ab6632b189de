//! Admission under hostile load: how many handshakes and connections a node takes on at once,
//! and how many request bytes it buffers for each connection and certificate identity.
//!
//! - **Failed handshakes per address**: each IP address has a bucket of
//!   [`Limits::failed_handshakes_per_addr`] failures, refilled at one per
//!   [`Limits::failed_handshake_refill_ms`]. A handshake fails when it ends without a connection
//!   (no certificate, one of another CA, the client closed it halfway) or its certificate's role
//!   may not use the protocol; timeouts do not count. A failure counts against the bucket only
//!   if the client *proved its address*: the failure came from the client's certificate (sent in
//!   packets only the address's owner can make), or the attempt had passed a QUIC retry. Any
//!   other failure (a close that a spoofed packet can cause) only makes the address validate
//!   itself from then on, which costs a real client one round trip. While an address's bucket is
//!   empty its attempts are dropped unanswered before any cryptography (`Incoming::ignore`). So
//!   one attacker costs the node a TLS handshake per refill interval, not one per attempt, and
//!   spoofed packets cannot shut an address's owner out.
//! - **Handshakes in progress** (an `Incoming` accepted, its handshake not yet done): above
//!   [`Limits::retry_handshakes_above`] a client must first prove it receives at its address
//!   (a QUIC retry, which costs the node one stateless packet); at [`Limits::max_handshakes`]
//!   new ones are dropped unanswered; one IP address may have at most
//!   [`Limits::max_handshakes_per_addr`] in progress, beyond which it is refused (QUIC
//!   `CONNECTION_REFUSED`).
//! - **Connections**: at most [`Limits::max_client_connections`] client and operator connections
//!   in all, and [`Limits::max_connections_per_identity`] per certificate identity (a client
//!   name, the operator, a node). A connection over a cap is closed at once with
//!   [`CloseCode::TooManyConnections`] or [`CloseCode::TooManyForIdentity`] and a reason naming
//!   the setting.
//! - **Request bytes**: a client request's body is read as its bytes arrive, and the bytes held
//!   by requests still arriving count against a budget of the connection
//!   ([`Limits::request_bytes_per_connection`]) and of its identity
//!   ([`Limits::request_bytes_per_identity`]); a request that would exceed one waits (and its
//!   sender is held back by QUIC flow control) until others complete or time out. A request
//!   that has not arrived whole within [`Limits::request_timeout_ms`] of its stream opening is
//!   answered with an error and its stream stopped.
//!
//! Everything refused is counted ([`Incidents`], shown in `keyhome status`) and logged at a
//! bounded rate ([`crate::ratelog`]). docs/operations.md, "Limits and hostile load", gives the
//! memory each setting allows.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use crate::pki::Role;
use crate::ratelog::{RateLog, Source};
use crate::runtime::lock;
use crate::status::{Counters, Load};
use crate::wire::{CloseCode, MAX_CLIENT_FRAME};

/// The `[limits]` table of `node.toml`. Defaults in brackets.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Client and operator connections open at once, all identities together [1024].
    pub max_client_connections: usize,
    /// Connections open at once per certificate identity [64].
    pub max_connections_per_identity: usize,
    /// Handshakes in progress from one IP address [16].
    pub max_handshakes_per_addr: usize,
    /// Handshakes in progress above which a client must validate its address (QUIC retry) [32].
    pub retry_handshakes_above: usize,
    /// Handshakes in progress at which new ones are dropped unanswered [256].
    pub max_handshakes: usize,
    /// Failed handshakes one IP address may have in a burst before its attempts are dropped
    /// unanswered [8].
    pub failed_handshakes_per_addr: u32,
    /// An address earns back one failed handshake per this long, ms [1000].
    #[serde(deserialize_with = "crate::duration::ms_or_text")]
    pub failed_handshake_refill_ms: u64,
    /// A client request must arrive whole within this long of its stream opening, ms [5000]; a
    /// peer stream's hello too (keep it well above a round trip between nodes).
    #[serde(deserialize_with = "crate::duration::ms_or_text")]
    pub request_timeout_ms: u64,
    /// Bytes of requests still arriving held at once per client connection [262144]; at least
    /// the largest request (65536).
    pub request_bytes_per_connection: usize,
    /// Bytes of requests still arriving held at once per certificate identity [4194304]; at least
    /// `request_bytes_per_connection`.
    pub request_bytes_per_identity: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_client_connections: 1024,
            max_connections_per_identity: 64,
            max_handshakes_per_addr: 16,
            retry_handshakes_above: 32,
            max_handshakes: 256,
            failed_handshakes_per_addr: 8,
            failed_handshake_refill_ms: 1000,
            request_timeout_ms: 5000,
            request_bytes_per_connection: 256 << 10,
            request_bytes_per_identity: 4 << 20,
        }
    }
}

/// IP addresses whose failed handshakes are remembered, at most (the least recently failed are
/// forgotten first).
pub const FAILED_ADDRS_TRACKED: usize = 4096;

/// Largest byte budget: tokio's semaphores count permits in `u32` ranges per acquisition and
/// `usize::MAX >> 3` in all.
const MAX_BUDGET: usize = 1 << 30;

impl Limits {
    /// Says what is wrong with the settings, if anything.
    pub fn check(&self) -> Result<(), String> {
        let positive = [
            ("max_client_connections", self.max_client_connections as u64),
            ("max_connections_per_identity", self.max_connections_per_identity as u64),
            ("max_handshakes_per_addr", self.max_handshakes_per_addr as u64),
            ("max_handshakes", self.max_handshakes as u64),
            ("failed_handshakes_per_addr", u64::from(self.failed_handshakes_per_addr)),
            ("failed_handshake_refill_ms", self.failed_handshake_refill_ms),
            ("request_timeout_ms", self.request_timeout_ms),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("limits.{name} must be at least 1"));
        }
        if !(MAX_CLIENT_FRAME..=MAX_BUDGET).contains(&self.request_bytes_per_connection) {
            return Err(format!(
                "limits.request_bytes_per_connection must be from {MAX_CLIENT_FRAME} (the largest request) \
                 to {MAX_BUDGET}"
            ));
        }
        if !(self.request_bytes_per_connection..=MAX_BUDGET).contains(&self.request_bytes_per_identity) {
            return Err(format!(
                "limits.request_bytes_per_identity must be from limits.request_bytes_per_connection to \
                 {MAX_BUDGET}"
            ));
        }
        Ok(())
    }

    pub fn is_default(&self) -> bool {
        *self == Limits::default()
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }

    fn failed_handshake_refill(&self) -> Duration {
        Duration::from_millis(self.failed_handshake_refill_ms)
    }
}

/// What to do with a connection attempt (an `Incoming`).
#[derive(Debug)]
pub enum Verdict {
    /// Go on with the handshake; the slot counts it as in progress until dropped.
    Handshake(HandshakeSlot),
    /// Ask the client to validate its address first (QUIC retry).
    Retry,
    /// Drop it unanswered: this address failed too many handshakes lately.
    Throttle,
    /// Refuse (this address has too many handshakes in progress).
    Refuse,
    /// Drop it unanswered (too many handshakes in progress in all).
    Ignore,
}

/// A connection over a cap.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Cap {
    #[error("the node has {0} client connections, its limit (limits.max_client_connections)")]
    Total(usize),
    #[error("this certificate identity has {0} connections, its limit (limits.max_connections_per_identity)")]
    Identity(usize),
}

impl Cap {
    pub fn close_code(self) -> CloseCode {
        match self {
            Cap::Total(_) => CloseCode::TooManyConnections,
            Cap::Identity(_) => CloseCode::TooManyForIdentity,
        }
    }
}

/// The admission state of one node.
pub struct Admission {
    pub limits: Limits,
    slots: Mutex<Slots>,
    pub incidents: Incidents,
}

struct Slots {
    handshakes: usize,
    handshakes_by_addr: HashMap<IpAddr, usize>,
    /// The failed-handshake bucket of each source (see [`failing_source`]) that failed lately.
    failures: lru::LruCache<IpAddr, Bucket>,
    clients: usize,
    /// Open connections and their shared request budget, per identity.
    identities: HashMap<Role, (usize, Arc<Semaphore>)>,
}

impl Default for Slots {
    fn default() -> Slots {
        Slots {
            handshakes: 0,
            handshakes_by_addr: HashMap::new(),
            failures: lru::LruCache::new(NonZeroUsize::new(FAILED_ADDRS_TRACKED).expect("not zero")),
            clients: 0,
            identities: HashMap::new(),
        }
    }
}

/// Whose bucket a failed handshake from `ip` counts against: the IPv4 address, or the IPv6 /64
/// (one host usually has a whole /64 to pick addresses from).
fn failing_source(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => IpAddr::V6(std::net::Ipv6Addr::from(u128::from(v6) & !u128::from(u64::MAX))),
    }
}

/// One source's failed handshakes still allowed, as of `at`.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    left: u32,
    at: Instant,
    /// A failure that did not prove the address was seen: attempts must validate it (retry).
    validate: bool,
}

impl Bucket {
    /// A full bucket, as of `now`.
    fn full(now: Instant, limits: &Limits) -> Bucket {
        Bucket { left: limits.failed_handshakes_per_addr, at: now, validate: false }
    }

    /// The bucket refilled up to `now` (one failure per refill interval, at most full).
    fn refilled(self, now: Instant, limits: &Limits) -> Bucket {
        let (full, refill) = (limits.failed_handshakes_per_addr, limits.failed_handshake_refill());
        let earned = now.saturating_duration_since(self.at).as_nanos() / refill.as_nanos().max(1);
        let earned = u32::try_from(earned).unwrap_or(u32::MAX);
        if self.left.saturating_add(earned) >= full {
            return Bucket { left: full, at: now, ..self };
        }
        // Keep the part of an interval not earned yet.
        Bucket { left: self.left + earned, at: self.at + refill * earned, ..self }
    }
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission").field("limits", &self.limits).finish_non_exhaustive()
    }
}

impl Admission {
    pub fn new(limits: Limits) -> Arc<Admission> {
        Arc::new(Admission { limits, slots: Mutex::default(), incidents: Incidents::default() })
    }

    /// Decides on a connection attempt from `remote` at `now`; `validated`: its address is
    /// proven (it came back with a retry token); `may_retry`: a retry is possible (not already
    /// retried).
    pub fn incoming(
        self: &Arc<Self>,
        now: Instant,
        remote: SocketAddr,
        validated: bool,
        may_retry: bool,
    ) -> Verdict {
        let ip = remote.ip();
        let mut slots = lock(&self.slots);
        if let Some(bucket) = slots.failures.peek_mut(&failing_source(ip)) {
            *bucket = bucket.refilled(now, &self.limits);
            if bucket.left == 0 {
                return Verdict::Throttle;
            }
            if bucket.validate && !validated && may_retry {
                return Verdict::Retry;
            }
        }
        if slots.handshakes >= self.limits.max_handshakes {
            return Verdict::Ignore;
        }
        if slots.handshakes >= self.limits.retry_handshakes_above && !validated && may_retry {
            return Verdict::Retry;
        }
        let by_addr = slots.handshakes_by_addr.entry(ip).or_default();
        if *by_addr >= self.limits.max_handshakes_per_addr {
            return Verdict::Refuse;
        }
        *by_addr += 1;
        slots.handshakes += 1;
        Verdict::Handshake(HandshakeSlot { admission: Arc::clone(self), ip })
    }

    /// A handshake from `ip` failed at `now` (not by a timeout); `proven`: the client had proved
    /// its address (see the module docs). A proven failure takes one from the address's bucket,
    /// any other makes the address validate itself from then on.
    pub fn handshake_failed(&self, now: Instant, ip: IpAddr, proven: bool) {
        let mut slots = lock(&self.slots);
        let bucket = slots.failures.get_or_insert_mut(failing_source(ip), || Bucket::full(now, &self.limits));
        let refilled = bucket.refilled(now, &self.limits);
        *bucket = if proven {
            Bucket { left: refilled.left.saturating_sub(1), ..refilled }
        } else {
            Bucket { validate: true, ..refilled }
        };
    }

    /// Admits an established connection of `role` (a client or operator one counts against the
    /// total), or says which cap it is over.
    pub fn connection(self: &Arc<Self>, role: &Role) -> Result<ConnectionSlot, Cap> {
        let client = !matches!(role, Role::Node(_));
        let mut slots = lock(&self.slots);
        if client && slots.clients >= self.limits.max_client_connections {
            return Err(Cap::Total(slots.clients));
        }
        let budget = self.limits.request_bytes_per_identity;
        let (open, identity) =
            slots.identities.entry(role.clone()).or_insert_with(|| (0, Arc::new(Semaphore::new(budget))));
        if *open >= self.limits.max_connections_per_identity {
            return Err(Cap::Identity(*open));
        }
        *open += 1;
        let identity = Arc::clone(identity);
        if client {
            slots.clients += 1;
        }
        Ok(ConnectionSlot {
            admission: Arc::clone(self),
            role: role.clone(),
            client,
            budget: Budget {
                connection: Arc::new(Semaphore::new(self.limits.request_bytes_per_connection)),
                identity,
            },
        })
    }
}

impl Admission {
    /// What the transport holds now, for `keyhome status`.
    pub fn load(&self) -> Load {
        let slots = lock(&self.slots);
        let budget = self.limits.request_bytes_per_identity;
        let held: usize =
            slots.identities.values().map(|(_, sem)| budget.saturating_sub(sem.available_permits())).sum();
        Load {
            client_connections: slots.clients as u64,
            handshakes: slots.handshakes as u64,
            request_bytes: held as u64,
        }
    }
}

/// A handshake in progress; dropping it ends it.
#[derive(Debug)]
pub struct HandshakeSlot {
    admission: Arc<Admission>,
    ip: IpAddr,
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        let mut slots = lock(&self.admission.slots);
        slots.handshakes = slots.handshakes.saturating_sub(1);
        if let Some(n) = slots.handshakes_by_addr.get_mut(&self.ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                slots.handshakes_by_addr.remove(&self.ip);
            }
        }
    }
}

/// An open connection counted against the caps; dropping it (when the connection ends) frees
/// its place.
pub struct ConnectionSlot {
    admission: Arc<Admission>,
    role: Role,
    client: bool,
    /// The request-byte budget of this connection and its identity.
    pub budget: Budget,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        let mut slots = lock(&self.admission.slots);
        if self.client {
            slots.clients = slots.clients.saturating_sub(1);
        }
        if let Some((open, _)) = slots.identities.get_mut(&self.role) {
            *open = open.saturating_sub(1);
            if *open == 0 {
                slots.identities.remove(&self.role);
            }
        }
    }
}

/// Bytes a connection's requests may hold while they arrive: each byte buffered holds one permit
/// of both semaphores until its request is read whole (or abandoned).
#[derive(Clone)]
pub struct Budget {
    pub connection: Arc<Semaphore>,
    pub identity: Arc<Semaphore>,
}

/// What hostile load caused, counted for `keyhome status` and logged at a bounded rate.
pub struct Incidents {
    /// Refused before any cryptography; [`Incidents::fill`] adds `handshakes_failed`.
    handshakes_refused: AtomicU64,
    handshakes_failed: AtomicU64,
    handshakes_retried: AtomicU64,
    handshakes_throttled: AtomicU64,
    connections_refused: AtomicU64,
    requests_malformed: AtomicU64,
    requests_timed_out: AtomicU64,
    peer_links_closed: AtomicU64,
    duplicate_id_connections: AtomicU64,
    /// Refused handshakes and connections.
    pub handshake_log: RateLog,
    /// Malformed and timed-out client requests.
    pub request_log: RateLog,
    /// Peer connections closed for what the peer sent.
    pub link_log: RateLog,
    /// Peer connections claiming an id another live connection holds (errors).
    pub duplicate_log: RateLog,
}

/// One kind of incident.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Incident {
    /// An attempt was refused before any cryptography (per-address cap, hard limit).
    HandshakeRefused,
    /// A handshake ran (the node did its TLS cryptography) and ended without a connection: a
    /// certificate refused, a role on the wrong protocol, the client's close, the idle timeout.
    HandshakeFailed,
    /// A retry was sent to validate an address.
    HandshakeRetried,
    /// An attempt was dropped unanswered: its address failed too many handshakes lately.
    HandshakeThrottled,
    /// An established connection was closed by a connection cap.
    ConnectionRefused,
    /// A client request was malformed or oversized.
    RequestMalformed,
    /// A client request did not arrive whole within the request timeout.
    RequestTimedOut,
    /// A peer connection was closed for what the peer sent.
    PeerLinkClosed,
    /// A peer connection claimed an id another live connection from another address holds.
    DuplicateId,
}

impl Default for Incidents {
    fn default() -> Incidents {
        Incidents {
            handshakes_refused: AtomicU64::new(0),
            handshakes_failed: AtomicU64::new(0),
            handshakes_retried: AtomicU64::new(0),
            handshakes_throttled: AtomicU64::new(0),
            connections_refused: AtomicU64::new(0),
            requests_malformed: AtomicU64::new(0),
            requests_timed_out: AtomicU64::new(0),
            peer_links_closed: AtomicU64::new(0),
            duplicate_id_connections: AtomicU64::new(0),
            handshake_log: RateLog::new("handshakes refused"),
            request_log: RateLog::new("bad client requests"),
            link_log: RateLog::new("peer connections closed"),
            duplicate_log: RateLog::errors("connections claiming a live node's id"),
        }
    }
}

impl Incidents {
    fn counter(&self, incident: Incident) -> &AtomicU64 {
        match incident {
            Incident::HandshakeRefused => &self.handshakes_refused,
            Incident::HandshakeFailed => &self.handshakes_failed,
            Incident::HandshakeRetried => &self.handshakes_retried,
            Incident::HandshakeThrottled => &self.handshakes_throttled,
            Incident::ConnectionRefused => &self.connections_refused,
            Incident::RequestMalformed => &self.requests_malformed,
            Incident::RequestTimedOut => &self.requests_timed_out,
            Incident::PeerLinkClosed => &self.peer_links_closed,
            Incident::DuplicateId => &self.duplicate_id_connections,
        }
    }

    /// The rate-limited log an incident is reported in (`None`: counted only).
    fn log(&self, incident: Incident) -> Option<&RateLog> {
        match incident {
            Incident::HandshakeRefused
            | Incident::HandshakeFailed
            | Incident::HandshakeThrottled
            | Incident::ConnectionRefused => Some(&self.handshake_log),
            Incident::RequestMalformed | Incident::RequestTimedOut => Some(&self.request_log),
            Incident::PeerLinkClosed => Some(&self.link_log),
            Incident::DuplicateId => Some(&self.duplicate_log),
            Incident::HandshakeRetried => None,
        }
    }

    /// Counts `incident` from `source` (a peer's address, or a local peer), and logs `detail` at
    /// a bounded rate.
    pub fn report(&self, incident: Incident, source: impl Into<Source>, detail: impl std::fmt::Display) {
        self.counter(incident).fetch_add(1, Ordering::Relaxed);
        if let Some(log) = self.log(incident) {
            log.note(source.into(), detail);
        }
    }

    /// Ends every log's summary window (see [`crate::ratelog`]).
    pub fn flush_logs(&self) {
        for log in [&self.handshake_log, &self.request_log, &self.link_log, &self.duplicate_log] {
            log.flush();
        }
    }

    /// Copies the counts into `counters`.
    pub fn fill(&self, counters: &mut Counters) {
        let get = |i| self.counter(i).load(Ordering::Relaxed);
        counters.handshakes_failed = get(Incident::HandshakeFailed);
        counters.handshakes_refused = get(Incident::HandshakeRefused) + counters.handshakes_failed;
        counters.handshakes_retried = get(Incident::HandshakeRetried);
        counters.handshakes_throttled = get(Incident::HandshakeThrottled);
        counters.connections_refused = get(Incident::ConnectionRefused);
        counters.requests_malformed = get(Incident::RequestMalformed);
        counters.requests_timed_out = get(Incident::RequestTimedOut);
        counters.peer_links_closed = get(Incident::PeerLinkClosed);
        counters.duplicate_id_connections = get(Incident::DuplicateId);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_handshakes_are_refused_ones_that_ran() {
        let incidents = Incidents::default();
        let remote: SocketAddr = "127.0.0.9:4000".parse().unwrap();
        incidents.report(Incident::HandshakeRefused, remote, "over the per-address cap");
        incidents.report(Incident::HandshakeFailed, remote, "no certificate");
        incidents.report(Incident::HandshakeFailed, remote, "closed halfway");
        let mut counters = Counters::default();
        incidents.fill(&mut counters);
        assert_eq!((counters.handshakes_refused, counters.handshakes_failed), (3, 2));
    }

    fn limits() -> Limits {
        Limits {
            max_client_connections: 3,
            max_connections_per_identity: 2,
            max_handshakes_per_addr: 2,
            retry_handshakes_above: 3,
            max_handshakes: 4,
            ..Limits::default()
        }
    }

    #[test]
    fn handshakes_are_retried_then_refused_then_ignored() {
        let admission = Admission::new(limits());
        let now = Instant::now();
        let a: SocketAddr = "127.0.0.1:1000".parse().unwrap();
        let b: SocketAddr = "127.0.0.2:1000".parse().unwrap();
        let c: SocketAddr = "127.0.0.3:1000".parse().unwrap();
        let slot = |v| match v {
            Verdict::Handshake(s) => s,
            other => panic!("expected a handshake, got {other:?}"),
        };
        let a1 = slot(admission.incoming(now, a, false, true));
        let _a2 = slot(admission.incoming(now, a, false, true));
        assert!(matches!(admission.incoming(now, a, false, true), Verdict::Refuse), "per address");
        let _b1 = slot(admission.incoming(now, b, false, true));
        assert!(
            matches!(admission.incoming(now, c, false, true), Verdict::Retry),
            "over the retry threshold"
        );
        let _c1 = slot(admission.incoming(now, c, true, false));
        assert!(matches!(admission.incoming(now, c, true, false), Verdict::Ignore), "at the hard limit");
        drop(a1);
        assert!(matches!(admission.incoming(now, a, true, false), Verdict::Handshake(_)), "a slot came free");
    }

    #[test]
    fn an_address_that_fails_handshakes_is_dropped_until_it_earns_one_back() {
        let limits = Limits { failed_handshakes_per_addr: 3, failed_handshake_refill_ms: 1000, ..limits() };
        let admission = Admission::new(limits);
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let a: SocketAddr = "127.0.0.1:1000".parse().unwrap();
        let b: SocketAddr = "127.0.0.2:1000".parse().unwrap();
        let verdict = |ms, addr| admission.incoming(at(ms), addr, true, false);
        for ms in [0, 10, 20] {
            assert!(matches!(verdict(ms, a), Verdict::Handshake(_)), "failure {ms}");
            admission.handshake_failed(at(ms), a.ip(), true);
        }
        assert!(matches!(verdict(30, a), Verdict::Throttle), "the bucket is empty");
        assert!(matches!(verdict(30, b), Verdict::Handshake(_)), "other addresses are not affected");
        let v6 = |s: &str| -> SocketAddr { s.parse().unwrap() };
        for i in 0..3 {
            admission.handshake_failed(at(30), v6(&format!("[2001:db8::{i}]:1000")).ip(), true);
        }
        assert!(
            matches!(verdict(30, v6("[2001:db8::ffff:1]:1000")), Verdict::Throttle),
            "an IPv6 /64 shares one bucket"
        );
        assert!(matches!(verdict(30, v6("[2001:db8:0:1::1]:1000")), Verdict::Handshake(_)), "another /64");
        assert!(matches!(verdict(999, a), Verdict::Throttle), "not a whole interval yet");
        assert!(matches!(verdict(1000, a), Verdict::Handshake(_)), "one earned back");
        admission.handshake_failed(at(1000), a.ip(), true);
        assert!(matches!(verdict(1001, a), Verdict::Throttle), "and spent");
        assert!(matches!(verdict(10_000, a), Verdict::Handshake(_)), "refilled");
        for ms in [10_000, 10_001, 10_002] {
            admission.handshake_failed(at(ms), a.ip(), true);
        }
        assert!(matches!(verdict(10_003, a), Verdict::Throttle), "a bucket holds no more than its size");
    }

    #[test]
    fn a_failure_that_does_not_prove_the_address_asks_for_a_retry_and_nothing_more() {
        let limits = Limits { failed_handshakes_per_addr: 1, ..limits() };
        let admission = Admission::new(limits);
        let now = Instant::now();
        let a: SocketAddr = "127.0.0.1:1000".parse().unwrap();
        for _ in 0..10 {
            admission.handshake_failed(now, a.ip(), false);
        }
        assert!(matches!(admission.incoming(now, a, false, true), Verdict::Retry), "validate first");
        let validated = admission.incoming(now, a, true, false);
        assert!(matches!(validated, Verdict::Handshake(_)), "a validated attempt goes on: {validated:?}");
        drop(validated);
        admission.handshake_failed(now, a.ip(), true);
        assert!(
            matches!(admission.incoming(now, a, true, false), Verdict::Throttle),
            "a proven failure counts"
        );
    }

    #[test]
    fn connections_are_capped_in_all_and_per_identity() {
        let admission = Admission::new(limits());
        let app = Role::Client("app".into());
        let other = Role::Client("other".into());
        let first = admission.connection(&app).unwrap();
        let _second = admission.connection(&app).unwrap();
        assert_eq!(admission.connection(&app).err(), Some(Cap::Identity(2)));
        let _third = admission.connection(&other).unwrap();
        assert_eq!(admission.connection(&Role::Operator).err(), Some(Cap::Total(3)));
        let _node = admission.connection(&Role::Node(keyhome_epoch::NodeId(2))).unwrap();
        drop(first);
        assert!(admission.connection(&Role::Operator).is_ok(), "a closed connection frees its place");
    }

    #[test]
    fn default_limits_are_valid_and_bad_ones_say_why() {
        Limits::default().check().unwrap();
        let bad = Limits { request_bytes_per_connection: 1000, ..Limits::default() };
        assert!(bad.check().unwrap_err().contains("request_bytes_per_connection"));
        let bad = Limits { max_handshakes: 0, ..Limits::default() };
        assert!(bad.check().unwrap_err().contains("max_handshakes"));
        let bad = Limits { failed_handshake_refill_ms: 0, ..Limits::default() };
        assert!(bad.check().unwrap_err().contains("failed_handshake_refill_ms"));
    }
}
