//! One node's Prometheus metrics (`GET /metrics`, OpenMetrics text), and a short history of a few
//! of them for the status page's sparklines.
//!
//! Nothing is counted here: the core counts what it does ([`Counters`], [`HomeCounters`],
//! [`Activity`]) and the runtime what it measures itself ([`RuntimeMetrics`]). A scrape reads
//! them all under the core's lock once ([`Snapshot`]) and encodes a registry built for that
//! scrape, so every field the core adds to [`Counters`] appears as a counter with no change here.
//! No metric has a per-key label (their number would be unbounded); peer labels are bounded by the
//! membership, message kinds by the protocol (see docs/operations.md for the list).

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyhome_delegation::HomeCounters;
use keyhome_epoch::Instant;
use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::activity::{MESSAGE_KINDS, MessageCounts};
use crate::core::Core;
use crate::runtime::{Shared, lock, stopping};
use crate::status::Counters;

/// The content type of [`encode`]'s text: OpenMetrics.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The content type of [`to_classic`]'s text: the Prometheus text format, for scrapers that do
/// not ask for OpenMetrics (`curl`, `promtool check metrics`).
pub const CONTENT_TYPE_CLASSIC: &str = "text/plain; version=0.0.4; charset=utf-8";

/// How often [`sample_loop`] samples, and how many samples it keeps (five minutes).
pub const SAMPLE_EVERY: Duration = Duration::from_secs(2);
pub const SAMPLES: usize = 150;

/// What the runtime measures itself.
pub struct RuntimeMetrics {
    /// Seconds per durable commit of epoch writes (a redb commit with its fsync).
    pub fsync: Histogram,
    /// The latest [`SAMPLES`] samples, oldest first.
    samples: Mutex<VecDeque<Sample>>,
}

impl Default for RuntimeMetrics {
    fn default() -> RuntimeMetrics {
        RuntimeMetrics {
            // 100 µs to about 3 s.
            fsync: Histogram::new(exponential_buckets(0.0001, 2.0, 16)),
            samples: Mutex::new(VecDeque::with_capacity(SAMPLES)),
        }
    }
}

impl RuntimeMetrics {
    /// The samples kept, oldest first.
    pub fn samples(&self) -> Vec<Sample> {
        lock(&self.samples).iter().copied().collect()
    }

    fn push(&self, sample: Sample) {
        let mut samples = lock(&self.samples);
        if samples.len() == SAMPLES {
            samples.pop_front();
        }
        samples.push_back(sample);
    }
}

/// A few values at one instant, for sparklines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    /// This node's clock.
    pub at: Instant,
    pub locks: u64,
    pub locks_immediate: u64,
    pub peer_sent: u64,
    pub peer_dropped: u64,
    pub delegations_held: usize,
    pub delegations_homed: usize,
    pub pending_locks: usize,
}

/// Takes a [`Sample`] every [`SAMPLE_EVERY`] until the node stops.
pub(crate) async fn sample_loop(shared: Arc<Shared>) {
    let mut stop = shared.shutdown.subscribe();
    loop {
        let sample = {
            let core = &shared.core;
            let (c, totals) = (core.counters(), core.totals());
            Sample {
                at: shared.clock.now(),
                locks: c.locks,
                locks_immediate: c.locks_immediate,
                peer_sent: c.peer_sent,
                peer_dropped: c.peer_dropped,
                delegations_held: totals.held,
                delegations_homed: totals.homed,
                pending_locks: totals.pending_locks,
            }
        };
        shared.metrics.push(sample);
        tokio::select! {
            _ = tokio::time::sleep(SAMPLE_EVERY) => {}
            _ = stopping(&mut stop) => return,
        }
    }
}

/// Everything a scrape reports, read at one instant.
pub struct Snapshot {
    pub counters: Counters,
    pub home: HomeCounters,
    pub messages: MessageCounts,
    pub lock_wait: Histogram,
    pub lock_hold: Histogram,
    pub epoch: u64,
    pub member: bool,
    pub members: Vec<u64>,
    pub home_lease_left: Option<Duration>,
    pub quarantine_left: Duration,
    pub delegations_held: usize,
    pub delegations_homed: usize,
    pub lock_delay_keys: usize,
    pub pending_locks: usize,
}

impl Snapshot {
    pub fn of(core: &Core, now: Instant) -> Snapshot {
        let current = core.current();
        let activity = core.activity();
        let totals = core.totals();
        Snapshot {
            counters: core.counters(),
            home: core.home_counters(),
            messages: core.messages(),
            lock_wait: activity.lock_wait.clone(),
            lock_hold: activity.lock_hold.clone(),
            epoch: current.number,
            member: current.is_member(core.id()),
            members: current.member_ids().map(|m| m.0).collect(),
            home_lease_left: core.epoch().lease_until(now).map(|until| until.saturating_duration_since(now)),
            quarantine_left: core.quarantine_end(&current.timing).saturating_duration_since(now),
            delegations_held: totals.held,
            delegations_homed: totals.homed,
            lock_delay_keys: totals.lock_delay_keys,
            pending_locks: totals.pending_locks,
        }
    }
}

/// What the runtime adds to a [`Snapshot`].
pub struct Live {
    /// Each other member of the current epoch, and whether this node has a connection to it.
    pub peers: Vec<(u64, bool)>,
    pub client_sessions: usize,
    /// How long the busy poller has polled, if the node busy-polls.
    pub busy_polled: Option<Duration>,
}

/// The node's metrics as OpenMetrics text ([`CONTENT_TYPE`]).
pub(crate) fn encode(shared: &Arc<Shared>) -> Result<String, fmt::Error> {
    let snapshot = Snapshot::of(&shared.core, shared.clock.now());
    let peers = snapshot
        .members
        .iter()
        .filter(|m| **m != shared.id.0)
        .map(|&m| (m, shared.connected(keyhome_epoch::NodeId(m))));
    let live = Live {
        peers: peers.collect(),
        client_sessions: shared.api.count(),
        busy_polled: shared.busy_poll.as_ref().map(|p| p.polled()),
    };
    encode_snapshot(&snapshot, &live, &shared.metrics.fsync)
}

/// [`encode`] for given values (tests use it without a node).
pub fn encode_snapshot(s: &Snapshot, live: &Live, fsync: &Histogram) -> Result<String, fmt::Error> {
    let mut r = Registry::with_prefix("keyhome");
    let status_counters = serde_json::to_value(s.counters).map_err(|_| fmt::Error)?;
    register_counters(&mut r, "", &status_counters);
    let h = s.home;
    for (name, help, value) in [
        ("grants", "Delegations this node granted as a home (renewals included)", h.grants),
        ("handoffs", "Grants to a requester that queued behind another delegation of the key", h.handoffs),
        ("recalls", "Delegations this node recalled as a home (once per delegation)", h.recalls),
        ("expiries", "Delegations that expired at this home without a release (revocations)", h.expiries),
        ("lock_delays", "Expiries that put the key into lock-delay (entries into lock-delay)", h.lock_delays),
        ("passes", "Delegations granted ahead in a chain, passed on by the holder before each", h.passes),
    ] {
        r.register(name, help, ConstCounter::new(value));
    }
    let messages = ByLabel {
        kind: MetricType::Counter,
        values: [("sent", &s.messages.sent), ("received", &s.messages.received)]
            .into_iter()
            .flat_map(|(direction, counts)| {
                MESSAGE_KINDS.iter().zip(counts.iter()).map(move |(kind, n)| {
                    (
                        vec![("direction", direction.to_string()), ("kind", kind.to_string())],
                        ConstCounter::new(*n),
                    )
                })
            })
            .collect(),
    };
    r.register("messages", "Messages to and from other nodes, by direction and kind", messages);
    r.register(
        "lock_wait_seconds",
        "Seconds from a lock call to admission, for locks that waited",
        s.lock_wait.clone(),
    );
    r.register(
        "lock_hold_seconds",
        "Seconds from admission to unlock or expiry (client handles)",
        s.lock_hold.clone(),
    );
    r.register(
        "fsync_seconds",
        "Seconds per durable commit of epoch writes (redb commit, fsync)",
        fsync.clone(),
    );
    let secs = |d: Duration| ConstGauge::new(d.as_secs_f64());
    r.register("epoch", "The current epoch's number", ConstGauge::new(s.epoch));
    r.register(
        "member",
        "1 if this node is a member of the current epoch, else 0",
        ConstGauge::new(u64::from(s.member)),
    );
    r.register("members", "Members of the current epoch", ConstGauge::new(s.members.len() as u64));
    let connected = ByLabel {
        kind: MetricType::Gauge,
        values: (live.peers.iter())
            .map(|(peer, up)| (vec![("peer", peer.to_string())], ConstGauge::new(u64::from(*up))))
            .collect(),
    };
    r.register("peer_connected", "1 if this node has a connection to the member, else 0", connected);
    r.register(
        "home_lease_left_seconds",
        "Seconds left on this node's home lease (0: none, it grants nothing)",
        secs(s.home_lease_left.unwrap_or_default()),
    );
    r.register("quarantine_left_seconds", "Seconds of restart quarantine left", secs(s.quarantine_left));
    r.register(
        "delegations_held",
        "Keys this node holds a delegation of or tracks",
        ConstGauge::new(s.delegations_held as u64),
    );
    r.register(
        "delegations_homed",
        "Live delegations this node granted as home",
        ConstGauge::new(s.delegations_homed as u64),
    );
    r.register(
        "lock_delay_keys",
        "Keys this node homes that are in lock-delay",
        ConstGauge::new(s.lock_delay_keys as u64),
    );
    r.register("pending_locks", "Lock calls waiting on this node", ConstGauge::new(s.pending_locks as u64));
    r.register(
        "client_sessions",
        "Open client API connections",
        ConstGauge::new(live.client_sessions as u64),
    );
    if let Some(polled) = live.busy_polled {
        r.register(
            "busy_poll_seconds",
            "Seconds the busy poller (busy_poll_us) spent polling the sockets, a worker busy throughout",
            ConstCounter::new(polled.as_secs_f64()),
        );
    }
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &r)?;
    Ok(out)
}

/// [`encode`]'s OpenMetrics text in the Prometheus text format. The two differ, for the metrics
/// [`encode`] writes (no units, no exemplars), only in that a counter's family is named with its
/// `_total` suffix and that there is no `# EOF` line.
pub fn to_classic(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    let mut counters = std::collections::HashSet::new();
    for line in openmetrics.lines() {
        if let Some(name) = line.strip_prefix("# TYPE ").and_then(|rest| rest.strip_suffix(" counter")) {
            counters.insert(name);
        }
    }
    for line in openmetrics.lines().filter(|l| *l != "# EOF") {
        let family = ["# HELP ", "# TYPE "].into_iter().find_map(|tag| {
            let rest = line.strip_prefix(tag)?;
            let (name, tail) = rest.split_once(' ')?;
            counters.contains(name).then(|| format!("{tag}{name}_total {tail}"))
        });
        out.push_str(family.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

/// Registers every unsigned number in `value` (the serialised [`Counters`], nested objects
/// flattened with `_`) as a counter.
fn register_counters(r: &mut Registry, prefix: &str, value: &serde_json::Value) {
    match value {
        serde_json::Value::Object(fields) => {
            for (name, v) in fields {
                let name = if prefix.is_empty() { name.clone() } else { format!("{prefix}_{name}") };
                register_counters(r, &name, v);
            }
        }
        v => {
            if let Some(n) = v.as_u64() {
                let help = format!("Status counter `{prefix}` (see `keyhome status` and docs/operations.md)");
                r.register(prefix, help, ConstCounter::new(n));
            }
        }
    }
}

/// A metric family built for one scrape: one value per label set.
#[derive(Debug)]
struct ByLabel<L, M> {
    kind: MetricType,
    values: Vec<(L, M)>,
}

impl<L, M> EncodeMetric for ByLabel<L, M>
where
    L: EncodeLabelSet + fmt::Debug,
    M: EncodeMetric,
{
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), fmt::Error> {
        for (labels, metric) in &self.values {
            metric.encode(encoder.encode_family(labels)?)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        self.kind
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::activity::lock_buckets;

    #[test]
    fn a_scrape_has_every_family_and_bounded_labels() {
        let mut messages = MessageCounts::default();
        messages.sent[8] = 3;
        let snapshot = Snapshot {
            counters: Counters { locks: 5, locks_immediate: 4, ..Counters::default() },
            home: HomeCounters { grants: 2, handoffs: 1, ..HomeCounters::default() },
            messages,
            lock_wait: Histogram::new(lock_buckets()),
            lock_hold: Histogram::new(lock_buckets()),
            epoch: 3,
            member: true,
            members: vec![1, 2, 3],
            home_lease_left: Some(Duration::from_millis(1500)),
            quarantine_left: Duration::ZERO,
            delegations_held: 1,
            delegations_homed: 2,
            lock_delay_keys: 0,
            pending_locks: 0,
        };
        snapshot.lock_wait.observe(0.003);
        let live = Live {
            peers: vec![(2, true), (3, false)],
            client_sessions: 1,
            busy_polled: Some(Duration::from_millis(250)),
        };
        let text = encode_snapshot(&snapshot, &live, &Histogram::new(lock_buckets())).unwrap();
        for line in [
            "keyhome_locks_total 5",
            "keyhome_locks_immediate_total 4",
            "keyhome_handoffs_total 1",
            "keyhome_messages_total{direction=\"sent\",kind=\"delegation_grant\"} 3",
            "keyhome_peer_connected{peer=\"3\"} 0",
            "keyhome_home_lease_left_seconds 1.5",
            "keyhome_lock_wait_seconds_count 1",
            "keyhome_epoch 3",
            "keyhome_busy_poll_seconds_total 0.25",
            "# EOF",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} missing from\n{text}");
        }
        let series = text.lines().filter(|l| !l.starts_with('#')).count();
        assert!(series < 200, "{series} series: labels are bounded");
        let classic = to_classic(&text);
        assert!(classic.lines().any(|l| l == "# TYPE keyhome_locks_total counter"));
        assert!(!classic.contains("# EOF"));
        println!("{classic}");
    }
}
