//! The long run of `keyhome-hostile`: each probe of issue 12's table against a fresh local
//! cluster (three nodes, the default limits) while a control client locks on node 1 every
//! 100 ms, with what it cost node 1.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keyhome::pki::Role;
use keyhome::wire::{CloseCode, Request, Response};
use keyhome_epoch::NodeId;

use super::Target;
use super::attack::{self, Outcome};
use super::measure::{self, Control, Memory};
use crate::cluster::{Cluster, Options, key_homed_on};

/// The probes, in the order they run.
pub const PROBES: [&str; 8] = [
    "stalled-requests",
    "idle-connections",
    "unauthenticated-handshakes",
    "malformed-requests",
    "idle-streams",
    "trailing-bytes",
    "second-subscribe",
    "second-node-id",
];

/// One row of the table.
#[derive(Clone, Debug)]
pub struct Row {
    pub probe: &'static str,
    /// Node 1's resident memory before the probe, at its peak, and once the probe's connections
    /// and handshakes have ended.
    pub before: Memory,
    pub peak_kib: u64,
    pub after: Memory,
    /// Bytes node 1 logged during the probe.
    pub log_bytes: u64,
    /// The control client's lock latencies during the probe, and its failures.
    pub p50: Option<Duration>,
    pub p99: Option<Duration>,
    pub failures: usize,
    /// What the probe saw.
    pub outcome: String,
}

impl Row {
    /// The table's header (Markdown).
    pub const HEADER: &str = "| probe | RSS before → peak → after (MiB) | log bytes | control p50 / p99 (ms) | failures | outcome |\n| --- | --- | --- | --- | --- | --- |";
}

impl std::fmt::Display for Row {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |kib: u64| kib as f64 / 1024.0;
        let ms = |d: Option<Duration>| d.map_or("-".into(), |d| format!("{:.2}", d.as_secs_f64() * 1000.0));
        write!(
            f,
            "| {} | {:.0} → {:.0} → {:.0} | {} | {} / {} | {} | {} |",
            self.probe,
            mib(self.before.rss_kib),
            mib(self.peak_kib),
            mib(self.after.rss_kib),
            self.log_bytes,
            ms(self.p50),
            ms(self.p99),
            self.failures,
            self.outcome
        )
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("an IP address")
}

/// Runs `probe` (one of [`PROBES`]) for `hold` against a fresh cluster.
pub async fn run_probe(probe: &'static str, hold: Duration) -> Row {
    let cluster = Cluster::start(Options::default());
    cluster.wait_ready(&cluster.ids(), 1).await;
    let pid = cluster.pid(1).expect("node 1 runs");
    let target = Arc::new(Target::new(&cluster, 1));
    let control = Control::start(
        cluster.client(1).await,
        key_homed_on("control", &[1, 2, 3], 1),
        Duration::from_millis(100),
    );
    control.wait_locks(5).await;
    let baseline = cluster.status(1).await.load.client_connections;
    control.take();
    let before = measure::memory(pid).expect("node 1's memory");
    let log_before = measure::log_bytes(&cluster, 1);
    let outcome = match probe {
        "stalled-requests" => stalled_requests(&target, hold).await,
        "idle-connections" => idle_connections(&target, hold).await,
        "unauthenticated-handshakes" => unauthenticated_handshakes(&cluster, &target, hold).await,
        "malformed-requests" => malformed_requests(&target, hold).await,
        "idle-streams" => idle_streams(&target).await,
        "trailing-bytes" => trailing_bytes(&target).await,
        "second-subscribe" => second_subscribe(&cluster).await,
        "second-node-id" => second_node_id(&cluster, &target).await,
        other => format!("unknown probe {other:?}"),
    };
    let seen = control.take();
    let peak_kib = measure::memory(pid).map_or(0, |m| m.peak_kib);
    let log_bytes = measure::log_bytes(&cluster, 1).saturating_sub(log_before);
    cluster
        .wait_status(1, "the probe's connections and handshakes ended", |s| {
            s.load.client_connections <= baseline && s.load.handshakes == 0
        })
        .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = measure::memory(pid).expect("node 1's memory");
    let failures = seen.failures.len() + control.stop().await.failures.len();
    Row {
        probe,
        before,
        peak_kib,
        after,
        log_bytes,
        p50: seen.percentile(50),
        p99: seen.percentile(99),
        failures,
        outcome,
    }
}

/// 100 connections × 100 streams from one certificate, each stream a 64 KiB length prefix and
/// 64 KiB − 1 of body, stalled again as soon as the node gives up on it.
async fn stalled_requests(target: &Arc<Target>, hold: Duration) -> String {
    let endpoint = attack::endpoint(ip("127.0.0.1"));
    let config = attack::client_config(target, &target.mallory);
    let outcomes = attack::open_many(&endpoint, target, &config, 100, 8).await;
    let refused = closed_with(&outcomes, CloseCode::TooManyForIdentity);
    let conns: Vec<_> = open_conns(outcomes);
    let claimed = 64u32 << 10;
    let bytes = attack::stalling(claimed, 4, claimed as usize - 1);
    let end = Instant::now() + hold;
    let mut tasks = tokio::task::JoinSet::new();
    for conn in &conns {
        for _ in 0..100 {
            tasks.spawn(attack::keep_stalling(conn.clone(), Arc::clone(&bytes), end));
        }
    }
    let mut timed_out = 0;
    while let Some(done) = tasks.join_next().await {
        timed_out += done.unwrap_or(0);
    }
    close_all(&conns);
    format!(
        "{} connections kept, {refused} closed (per-identity cap); {timed_out} requests timed out",
        conns.len()
    )
}

/// 10 000 connection attempts from one certificate, kept open while the node allows.
async fn idle_connections(target: &Arc<Target>, hold: Duration) -> String {
    let endpoint = attack::endpoint(ip("127.0.0.1"));
    let config = attack::client_config(target, &target.mallory);
    let outcomes = attack::open_many(&endpoint, target, &config, 10_000, 8).await;
    let refused = closed_with(&outcomes, CloseCode::TooManyForIdentity);
    let conns = open_conns(outcomes);
    tokio::time::sleep(hold).await;
    close_all(&conns);
    format!("{} kept, {refused} closed (per-identity cap)", conns.len())
}

/// How long a flooding attacker waits for an answer before it tries again: a loopback handshake
/// takes a few milliseconds.
const FLOOD_PATIENCE: Duration = Duration::from_millis(50);

/// Handshakes with no certificate or one of another CA from four addresses, as fast as they go.
async fn unauthenticated_handshakes(cluster: &Cluster, target: &Arc<Target>, hold: Duration) -> String {
    let before = cluster.status(1).await.counters;
    let endpoints: Vec<_> = (2..6).map(|i| attack::endpoint(ip(&format!("127.0.0.{i}")))).collect();
    let configs = [attack::no_cert_config(target), attack::client_config(target, &target.stranger)];
    let flood = attack::handshake_flood(&endpoints, target, &configs, 32, hold, FLOOD_PATIENCE).await;
    let after = cluster.status(1).await.counters;
    format!(
        "{} attempts ({} given up after {} ms): {} refused, {} of them after a handshake, {} dropped \
         unanswered, {} retried",
        flood.attempts,
        flood.abandoned,
        FLOOD_PATIENCE.as_millis(),
        after.handshakes_refused - before.handshakes_refused,
        after.handshakes_failed - before.handshakes_failed,
        after.handshakes_throttled - before.handshakes_throttled,
        after.handshakes_retried - before.handshakes_retried
    )
}

/// Malformed requests from one client, one after another.
async fn malformed_requests(target: &Arc<Target>, hold: Duration) -> String {
    let (_endpoint, conn) = attack::mallory(target).await;
    let answered = attack::malformed_flood(&conn, hold).await;
    conn.close(0u32.into(), b"done");
    format!("{answered} refused with an error")
}

/// 100 streams with two bytes of a length prefix on one connection, then a request on it.
async fn idle_streams(target: &Arc<Target>) -> String {
    let endpoint = attack::endpoint(ip("127.0.0.1"));
    let Ok(conn) = attack::connect(&endpoint, target, &attack::client_config(target, &target.mallory)).await
    else {
        return "mallory cannot connect".into();
    };
    let bytes = attack::stalling(64 << 10, 2, 0);
    let stalled: Vec<_> =
        (0..100).map(|_| tokio::spawn(attack::stall(conn.clone(), Arc::clone(&bytes)))).collect();
    // The stalled streams take what stream credit the node gives before the request asks for one.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let sent = Instant::now();
    let answer = attack::call(&conn, &Request::Status).await;
    for task in stalled {
        task.abort();
    }
    let took = sent.elapsed();
    conn.close(0u32.into(), b"done");
    match answer {
        Ok(Response::Status(_)) => {
            format!("a request on that connection answered after {} ms", took.as_millis())
        }
        other => format!("a request on that connection failed: {other:?}"),
    }
}

async fn trailing_bytes(target: &Arc<Target>) -> String {
    let (_endpoint, conn) = attack::mallory(target).await;
    let answer = attack::send_raw(&conn, &attack::with_trailing_bytes(&Request::Status, 2)).await;
    conn.close(0u32.into(), b"done");
    match answer {
        Ok(Response::Error(e)) => format!("refused: {}", e.message),
        other => format!("NOT refused: {other:?}"),
    }
}

async fn second_subscribe(cluster: &Cluster) -> String {
    let client = cluster.client(1).await;
    let _first = client.events().await;
    match client.events().await {
        Err(e) => format!("refused: {e}"),
        Ok(_) => "NOT refused".into(),
    }
}

/// A connection presenting node 2's certificate from another address while node 2 runs.
async fn second_node_id(cluster: &Cluster, target: &Arc<Target>) -> String {
    let node2 = super::identity(cluster, &Role::Node(NodeId(2)));
    let (_endpoint, conn) = attack::peer_connection(target, &node2, ip("127.0.0.7")).await;
    let status = cluster.wait_status(1, "node 2 claimed twice", |s| !s.duplicate_ids.is_empty()).await;
    conn.close(0u32.into(), b"done");
    let claims: Vec<_> = status
        .duplicate_ids
        .iter()
        .map(|d| format!("node {} claimed by {}", d.id, d.addrs.join(" and ")))
        .collect();
    format!("shown in status: {}", claims.join("; "))
}

fn closed_with(outcomes: &[Outcome], code: CloseCode) -> usize {
    outcomes.iter().filter(|o| matches!(o, Outcome::Closed { code: c, .. } if *c == code as u64)).count()
}

fn open_conns(outcomes: Vec<Outcome>) -> Vec<quinn::Connection> {
    outcomes
        .into_iter()
        .filter_map(|o| match o {
            Outcome::Open(conn) => Some(conn),
            _ => None,
        })
        .collect()
}

fn close_all(conns: &[quinn::Connection]) {
    for conn in conns {
        conn.close(0u32.into(), b"done");
    }
}
