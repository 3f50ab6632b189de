//! Hostile load against a real node (issue 12; docs/operations.md, "Limits and hostile load"):
//! stalled requests, a connection flood from one certificate, half-open and unauthenticated
//! handshake floods, malformed requests, a second subscription and a second process claiming a
//! node id; in a test of its own, the hard limit on handshakes in progress. Each asserts that its
//! cap or timeout fired (status counters, close codes and reasons, the error answered) while a
//! control client keeps locking. Small limits keep it to seconds.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use keyhome::pki::{CLIENT_STREAMS, Role};
use keyhome::status::{Counters, Status};
use keyhome::wire::{CloseCode, ErrorKind, MAX_CLIENT_FRAME, Request, Response};
use keyhome_epoch::NodeId;
use keyhome_sim::cluster::{Cluster, Options, PATIENCE, POLL, eventually, key_homed_on};
use keyhome_sim::hostile::attack::{self, Outcome};
use keyhome_sim::hostile::measure::{Control, log_lines};
use keyhome_sim::hostile::{Target, identity};

/// Node 1's limits in this test (node 2 keeps the defaults).
const PER_IDENTITY: usize = 8;
const TOTAL: usize = 12;
const PER_ADDR_HANDSHAKES: usize = 3;
const RETRY_ABOVE: usize = 4;
const FAILED_PER_ADDR: u32 = 4;
const REQUEST_TIMEOUT: Duration = Duration::from_millis(1000);
const BYTES_PER_CONNECTION: usize = MAX_CLIENT_FRAME;
const BYTES_PER_IDENTITY: usize = 2 * MAX_CLIENT_FRAME;
/// Client connections node 1 has besides the attacks': the control client's and the harness's
/// status connection.
const BASELINE: usize = 2;

fn limits_toml() -> String {
    format!(
        "\n[limits]\nmax_client_connections = {TOTAL}\nmax_connections_per_identity = {PER_IDENTITY}\n\
         max_handshakes_per_addr = {PER_ADDR_HANDSHAKES}\nretry_handshakes_above = {RETRY_ABOVE}\n\
         max_handshakes = 64\nfailed_handshakes_per_addr = {FAILED_PER_ADDR}\nrequest_timeout_ms = {}\nrequest_bytes_per_connection = {BYTES_PER_CONNECTION}\n\
         request_bytes_per_identity = {BYTES_PER_IDENTITY}\n",
        REQUEST_TIMEOUT.as_millis()
    )
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("an IP address")
}

async fn counters(cluster: &Cluster) -> Counters {
    cluster.status(1).await.counters
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transport_holds_under_hostile_load() {
    let mut cluster = Cluster::layout(Options { nodes: 2, ..Options::default() });
    let config = cluster.node_config(1);
    let mut toml = std::fs::read_to_string(&config).expect("node 1's configuration");
    toml.push_str(&limits_toml());
    std::fs::write(&config, toml).expect("write node 1's limits");
    for id in cluster.ids() {
        cluster.start_node(id);
    }
    cluster.wait_ready(&cluster.ids(), 1).await;
    let target = Arc::new(Target::new(&cluster, 1));
    let control = Control::start(
        cluster.client(1).await,
        key_homed_on("control", &[1, 2], 1),
        Duration::from_millis(20),
    );
    control.wait_locks(3).await;

    stalled_streams_do_not_wedge_a_connection(&cluster, &target).await;
    request_bytes_are_bounded_per_identity(&cluster, &target).await;
    connections_are_capped(&cluster, &target).await;
    half_open_handshakes_are_capped_and_retried(&cluster, &target).await;
    unauthenticated_handshakes_are_refused_quietly(&cluster, &target).await;
    malformed_requests_and_trailing_bytes_are_refused(&cluster, &target).await;
    a_second_subscription_is_refused(&cluster).await;
    a_second_process_claiming_a_node_id_is_shown(&cluster, &target).await;

    control.take();
    control.wait_locks(3).await;
    let seen = control.stop().await;
    assert!(seen.failures.is_empty(), "the control client failed: {:?}", seen.failures);
}

/// A connection whose every stream stalls inside a request (two bytes of a length prefix) still
/// serves a request once the stalled ones time out; each stalled one is answered with why.
async fn stalled_streams_do_not_wedge_a_connection(cluster: &Cluster, target: &Arc<Target>) {
    let before = counters(cluster).await;
    // A fresh connection: its whole stream credit goes to the stalled streams.
    let endpoint = attack::endpoint(ip("127.0.0.1"));
    let conn = attack::connect(&endpoint, target, &attack::client_config(target, &target.mallory))
        .await
        .expect("mallory connects");
    let streams = CLIENT_STREAMS as usize;
    let mut stalled =
        attack::stall_many(std::slice::from_ref(&conn), streams, &attack::stalling(64 << 10, 2, 0))
            .await
            .expect("open the stalled streams");
    let answer = tokio::time::timeout(PATIENCE, attack::call(&conn, &Request::Status))
        .await
        .expect("a request on a connection full of stalled streams is answered once they time out");
    assert!(matches!(answer, Ok(Response::Status(_))), "{answer:?}");
    while let Some(done) = stalled.join_next().await {
        let error = done.expect("a stall task").expect("a stalled request is answered");
        assert_eq!(error.kind, ErrorKind::Invalid, "{error:?}");
        assert!(error.message.contains("did not arrive whole within"), "{error:?}");
    }
    let after = counters(cluster).await;
    assert!(
        after.requests_timed_out >= before.requests_timed_out + streams as u64,
        "{streams} requests timed out: {after:?}"
    );
    conn.close(0u32.into(), b"done");
}

/// Many connections of one identity, each with stalled requests of 64 KiB prefixes: the bytes
/// the node holds for them never exceed the identity's budget, and every request times out.
async fn request_bytes_are_bounded_per_identity(cluster: &Cluster, target: &Arc<Target>) {
    let endpoint = attack::endpoint(ip("127.0.0.1"));
    let config = attack::client_config(target, &target.mallory);
    let conns: Vec<_> = attack::open_many(&endpoint, target, &config, 4, PER_ADDR_HANDSHAKES)
        .await
        .into_iter()
        .map(|o| match o {
            Outcome::Open(conn) => conn,
            other => panic!("mallory's connection: {other:?}"),
        })
        .collect();
    let claimed = 64 << 10;
    let mut stalled = attack::stall_many(&conns, 16, &attack::stalling(claimed, 4, claimed as usize - 1))
        .await
        .expect("open the stalled streams");
    let mut most = 0;
    let mut statuses = 0;
    while !stalled.is_empty() {
        tokio::select! {
            done = stalled.join_next() => {
                let Some(done) = done else { break };
                let error = done.expect("a stall task").expect("a stalled request is answered");
                assert!(error.message.contains("did not arrive whole within"), "{error:?}");
            }
            status = polled(cluster) => {
                if let Ok(status) = status {
                    statuses += 1;
                    most = most.max(status.load.request_bytes);
                }
            }
        }
    }
    println!("request bytes held at most: {most} (budget {BYTES_PER_IDENTITY}), {statuses} polls");
    assert!(most > 0, "the stalled requests were seen holding bytes");
    assert!(most <= BYTES_PER_IDENTITY as u64, "{most} request bytes held for one identity");
    for conn in conns {
        conn.close(0u32.into(), b"done");
    }
}

/// One identity's connections beyond its cap, and everyone's beyond the total, are closed at
/// once with a code and a reason naming the setting; closed ones free their places.
async fn connections_are_capped(cluster: &Cluster, target: &Arc<Target>) {
    // Mallory's connections from the earlier steps may still be closing.
    let clients_before = BASELINE;
    wait_load(cluster, "earlier connections closed", |s| s.load.client_connections as usize == BASELINE)
        .await;
    let before = counters(cluster).await;
    let endpoint = attack::endpoint(ip("127.0.0.1"));
    let config = attack::client_config(target, &target.mallory);
    let flood = PER_IDENTITY + 4;
    let outcomes = attack::open_many(&endpoint, target, &config, flood, PER_ADDR_HANDSHAKES).await;
    let (open, closed) = split(outcomes);
    assert_eq!(open.len(), PER_IDENTITY, "connections kept: {closed:?}");
    assert_eq!(closed.len(), flood - PER_IDENTITY);
    for (code, reason) in &closed {
        assert_eq!(*code, CloseCode::TooManyForIdentity as u64, "{reason}");
        assert!(reason.contains("limits.max_connections_per_identity"), "{reason}");
    }
    // The operator fills the node up to its total.
    let operator = identity(cluster, &Role::Operator);
    let room = TOTAL - (clients_before + PER_IDENTITY);
    let outcomes =
        attack::open_many(&endpoint, target, &attack::client_config(target, &operator), room + 2, 1).await;
    let (open_ops, closed_ops) = split(outcomes);
    assert_eq!(open_ops.len(), room, "{closed_ops:?}");
    for (code, reason) in &closed_ops {
        assert_eq!(*code, CloseCode::TooManyConnections as u64, "{reason}");
        assert!(reason.contains("limits.max_client_connections"), "{reason}");
    }
    let after = counters(cluster).await;
    assert_eq!(after.connections_refused - before.connections_refused, (flood - PER_IDENTITY + 2) as u64);
    for conn in open.iter().chain(&open_ops) {
        conn.close(0u32.into(), b"done");
    }
    wait_load(cluster, "closed connections free their places", |s| {
        s.load.client_connections as usize <= clients_before
    })
    .await;
    assert!(attack::open(&endpoint, target, &config).await.is_open(), "mallory connects again");
}

/// Node 1's status, then a pause of the harness's poll interval.
async fn polled(cluster: &Cluster) -> Result<Status, String> {
    let status = cluster.try_status(1).await;
    tokio::time::sleep(POLL).await;
    status
}

fn split(outcomes: Vec<Outcome>) -> (Vec<quinn::Connection>, Vec<(u64, String)>) {
    let mut open = Vec::new();
    let mut closed = Vec::new();
    for outcome in outcomes {
        match outcome {
            Outcome::Open(conn) => open.push(conn),
            Outcome::Closed { code, reason } => closed.push((code, reason)),
            Outcome::Failed(e) => panic!("a connection failed instead of being kept or closed: {e}"),
        }
    }
    (open, closed)
}

async fn wait_load(cluster: &Cluster, what: &str, pred: impl Fn(&Status) -> bool) -> Status {
    cluster.wait_status(1, what, pred).await
}

/// Replayed Initial packets (clients that never answer) hold handshakes in progress: one address
/// gets at most its cap, then is refused; above the retry threshold a new address must validate
/// itself, and a real client still gets in (through the retry).
async fn half_open_handshakes_are_capped_and_retried(cluster: &Cluster, target: &Arc<Target>) {
    let config = attack::client_config(target, &target.mallory);
    let initials = attack::record_initials(target, &config, PER_ADDR_HANDSHAKES + 3).await;
    let before = counters(cluster).await;
    let (first, rest) = initials.split_at(PER_ADDR_HANDSHAKES);
    let _held = attack::replay_initials(first, ip("127.0.0.2"), target.addr).await;
    wait_load(cluster, "one address's half-open handshakes in progress", |s| {
        s.load.handshakes as usize == PER_ADDR_HANDSHAKES
    })
    .await;
    let _refused = attack::replay_initials(&rest[..1], ip("127.0.0.2"), target.addr).await;
    let status = wait_load(cluster, "a handshake over the per-address cap refused", |s| {
        s.counters.handshakes_refused == before.handshakes_refused + 1
    })
    .await;
    assert_eq!(
        status.counters.handshakes_failed, before.handshakes_failed,
        "refused before any cryptography"
    );
    let _other = attack::replay_initials(&rest[1..2], ip("127.0.0.3"), target.addr).await;
    wait_load(cluster, "another address's handshake in progress", |s| {
        s.load.handshakes as usize == RETRY_ABOVE
    })
    .await;
    let _retried = attack::replay_initials(&rest[2..3], ip("127.0.0.4"), target.addr).await;
    let status = wait_load(cluster, "a retry asked of an unvalidated address", |s| {
        s.counters.handshakes_retried == before.handshakes_retried + 1
    })
    .await;
    assert_eq!(status.load.handshakes as usize, RETRY_ABOVE, "a retried attempt holds no handshake");
    // A real client validates its address through the retry and connects.
    let client = cluster.client(1).await;
    client.status().await.expect("a client connects during the half-open flood");
    let status = cluster.status(1).await;
    assert!(status.counters.handshakes_retried > before.handshakes_retried + 1, "{:?}", status.counters);
    // Half-open handshakes end at the idle timeout and free their places.
    wait_load(cluster, "half-open handshakes time out", |s| s.load.handshakes == 0).await;
}

/// Handshakes with no certificate or one of another CA, as fast as one attacker can: all
/// refused, counted, and logged in a few summary lines, not one line each.
async fn unauthenticated_handshakes_are_refused_quietly(cluster: &Cluster, target: &Arc<Target>) {
    let before = counters(cluster).await;
    let lines_before = log_lines(cluster, 1, "handshakes refused");
    let endpoints = [attack::endpoint(ip("127.0.0.5")), attack::endpoint(ip("127.0.0.6"))];
    let configs = [attack::no_cert_config(target), attack::client_config(target, &target.stranger)];
    let flood = attack::handshake_flood(
        &endpoints,
        target,
        &configs,
        // As many at a time as the two addresses may have in progress: every refusal is a
        // failed handshake.
        2 * PER_ADDR_HANDSHAKES,
        Duration::from_millis(1500),
        Duration::from_millis(100),
    )
    .await;
    let status = wait_load(cluster, "the flood's handshakes ended", |s| s.load.handshakes == 0).await;
    let refused = status.counters.handshakes_refused - before.handshakes_refused;
    // Of those, the handshakes the node ran (refusals at the per-address cap cost none: how many
    // there are depends on how fast the node frees a slot against how fast the attacker retries).
    let failed = status.counters.handshakes_failed - before.handshakes_failed;
    let throttled = status.counters.handshakes_throttled - before.handshakes_throttled;
    let lines = log_lines(cluster, 1, "handshakes refused") - lines_before;
    println!(
        "handshake flood: {flood:?}, {refused} refused ({failed} after running), {throttled} dropped unanswered, \
         {lines} log lines"
    );
    assert!(flood.attempts >= 20, "the flood made too few attempts to show anything: {flood:?}");
    assert!(refused + throttled >= flood.attempts / 2, "{refused} + {throttled} of {flood:?} refused");
    // Each address gets its bucket of failures and one more per second of the flood, plus the
    // attempts in progress when its bucket ran out and those that ended by the attacker's close
    // before it had to validate its address; every attempt after that costs no handshake.
    let most = endpoints.len() as u64 * (u64::from(FAILED_PER_ADDR) + 2 + 2 * PER_ADDR_HANDSHAKES as u64);
    assert!(failed <= most, "{failed} handshakes ran and failed (at most {most}): {flood:?}");
    assert!(throttled > 0, "addresses that kept failing were dropped: {flood:?}");
    assert!(lines <= 4, "{lines} log lines for {refused} refused handshakes");
}

/// A malformed request and a valid one with trailing bytes are answered with an error and
/// counted; the connection goes on serving.
async fn malformed_requests_and_trailing_bytes_are_refused(cluster: &Cluster, target: &Arc<Target>) {
    let before = counters(cluster).await;
    let (_endpoint, conn) = attack::mallory(target).await;
    for (what, frame, says) in [
        ("trailing bytes", attack::with_trailing_bytes(&Request::Status, 2), "2 bytes left over"),
        ("garbage", attack::garbage_frame(), "malformed request"),
    ] {
        match attack::send_raw(&conn, &frame).await {
            Ok(Response::Error(e)) => assert!(e.message.contains(says), "{what}: {e:?}"),
            other => panic!("{what}: answered {other:?}"),
        }
    }
    assert!(matches!(attack::call(&conn, &Request::Status).await, Ok(Response::Status(_))));
    assert_eq!(counters(cluster).await.requests_malformed, before.requests_malformed + 2);
    conn.close(0u32.into(), b"done");
}

/// A connection has one event stream: a second `Subscribe` while the first is open is refused
/// with a clear error; once the first ends, a new one may start.
async fn a_second_subscription_is_refused(cluster: &Cluster) {
    let client = cluster.client(1).await;
    let first = client.events().await.expect("the first subscription");
    let second = client.events().await.err().expect("a second subscription is refused");
    assert_eq!(second.kind(), Some(ErrorKind::Invalid), "{second}");
    assert!(second.to_string().contains("already has an event stream"), "{second}");
    drop(first);
    let client = &client;
    eventually(PATIENCE, "a subscription after the first ended", move || async move {
        client.events().await.ok()
    })
    .await;
}

/// A connection presenting node 2's certificate from another address while node 2 is connected:
/// `keyhome status` names the id and both addresses until it ends.
async fn a_second_process_claiming_a_node_id_is_shown(cluster: &Cluster, target: &Arc<Target>) {
    let node2 = identity(cluster, &Role::Node(NodeId(2)));
    let (endpoint, conn) = attack::peer_connection(target, &node2, ip("127.0.0.7")).await;
    let impostor = endpoint.local_addr().expect("the impostor's address").to_string();
    let status = wait_load(cluster, "two addresses claim node 2", |s| {
        s.duplicate_ids.iter().any(|d| d.id == 2 && d.addrs.len() == 2 && d.addrs.contains(&impostor))
    })
    .await;
    assert!(status.counters.duplicate_id_connections >= 1, "{:?}", status.counters);
    assert!(status.to_string().contains("node 2 is claimed by live connections from"), "{status}");
    conn.close(0u32.into(), b"done");
    wait_load(cluster, "the second claim ended", |s| s.duplicate_ids.is_empty()).await;
}

/// At `max_handshakes` in progress, a further attempt is dropped unanswered (no packet back, so
/// it costs the node nothing more), counted; once the half-open handshakes time out, clients get
/// in again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_hard_limit_attempts_are_dropped_unanswered() {
    const MAX: usize = 4;
    let mut cluster = Cluster::layout(Options { nodes: 1, ..Options::default() });
    let config = cluster.node_config(1);
    let mut toml = std::fs::read_to_string(&config).expect("node 1's configuration");
    // No retry below the hard limit, so that replayed Initials fill it.
    toml.push_str(&format!(
        "\n[limits]\nmax_handshakes = {MAX}\nretry_handshakes_above = {}\nmax_handshakes_per_addr = 2\n",
        MAX + 1
    ));
    std::fs::write(&config, toml).expect("write node 1's limits");
    cluster.start_node(1);
    cluster.wait_ready(&[1], 1).await;
    let target = Target::new(&cluster, 1);
    let initials =
        attack::record_initials(&target, &attack::client_config(&target, &target.mallory), MAX + 1).await;
    let mut held = attack::replay_initials(&initials[..2], ip("127.0.0.2"), target.addr).await;
    held.extend(attack::replay_initials(&initials[2..MAX], ip("127.0.0.3"), target.addr).await);
    wait_load(&cluster, "the hard limit of handshakes in progress", |s| s.load.handshakes as usize == MAX)
        .await;
    // An admitted attempt is answered (the node's first flight)...
    let mut buf = [0u8; 2048];
    let answered = tokio::time::timeout(PATIENCE, held[0].recv(&mut buf)).await;
    assert!(
        matches!(answered, Ok(Ok(n)) if n > 0),
        "an admitted attempt gets the node's Initial: {answered:?}"
    );
    // ...the one over the limit is not, and only counted.
    let before = counters(&cluster).await;
    let over = attack::replay_initials(&initials[MAX..], ip("127.0.0.4"), target.addr).await;
    let status = wait_load(&cluster, "the attempt over the limit counted", |s| {
        s.counters.handshakes_refused == before.handshakes_refused + 1
    })
    .await;
    assert_eq!(status.load.handshakes as usize, MAX, "it holds no handshake");
    assert_eq!(status.counters.handshakes_failed, before.handshakes_failed, "it ran none");
    assert_eq!(status.counters.handshakes_retried, 0, "and was not retried");
    let silence = tokio::time::timeout(Duration::from_millis(500), over[0].recv(&mut buf)).await;
    assert!(silence.is_err(), "the node answered an attempt over its hard limit: {silence:?}");
    // The half-open handshakes end at the idle timeout; a new client then connects.
    wait_load(&cluster, "half-open handshakes time out", |s| s.load.handshakes == 0).await;
    let client = cluster.client(1).await;
    client.status().await.expect("a client connects once the handshakes ended");
}
