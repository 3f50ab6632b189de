//! Cluster benchmark: a 3-node keyhome cluster on loopback, in this process, measured side by
//! side with a bare QUIC round trip on the same machine in the same run.
//!
//!     cargo bench -p keyhome --bench cluster            # full run, about a minute
//!     cargo bench -p keyhome --bench cluster -- --quick # shorter, for a smoke test
//!
//! Each node has its own QUIC endpoint on 127.0.0.1 and its own redb file; they share this
//! process's tokio runtime (two worker threads). Figures:
//!
//! - `quic rtt`: request/response on a fresh bidirectional stream of an open connection (what
//!   one client API call costs at least), against an echo server with the same TLS set-up.
//! - `client re-lock`: `lock` through the client API of node 1 for a key whose delegation node 1
//!   already holds (then `unlock`, not timed).
//! - `http re-lock`: the same through node 1's HTTP API (`POST /v1/lock`, one keep-alive HTTP/1.1
//!   connection, bearer token; the `unlock` is not timed).
//! - `embedded re-lock`: `Node::try_lock` + dropping the guard, on node 1, same key: one pair.
//! - `first lock, remote home`: `Node::lock` on node 1 of a key never locked before whose home
//!   is node 2 or 3 (request + grant).
//! - `hot-key handoff`: every node locks and unlocks one key in a loop; handoffs per second is
//!   the number of delegations granted (each moves the key to another node).
//! - `epoch change`: propose (a timing change) on node 1 until every node learned the epoch.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use keyhome::config::{ClientProfile, LockSettings, NodeConfig};
use keyhome::pki::{self, Identity, Role};
use keyhome::{Node, setup};
use keyhome_epoch::{Change, NodeId, Timing};

const NODES: u64 = 3;

struct Params {
    rounds: usize,
    handoff_for: Duration,
    epoch_changes: usize,
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let params = if quick {
        Params { rounds: 300, handoff_for: Duration::from_secs(1), epoch_changes: 5 }
    } else {
        Params { rounds: 5000, handoff_for: Duration::from_secs(5), epoch_changes: 30 }
    };
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(run(params));
}

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    let i = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[i.min(samples.len() - 1)]
}

fn report(name: &str, samples: &mut [Duration]) -> Duration {
    let p50 = percentile(samples, 0.5);
    let p99 = percentile(samples, 0.99);
    println!("{name:<28} p50 {:>9.1} µs   p99 {:>9.1} µs   (n = {})", us(p50), us(p99), samples.len());
    p50
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn free_port_base(count: u16) -> u16 {
    // Probe a run of consecutive free UDP ports.
    for base in (20_000..60_000).step_by(97) {
        if (0..count).all(|i| std::net::UdpSocket::bind(("127.0.0.1", base + i)).is_ok()) {
            return base;
        }
    }
    panic!("no free port range")
}

async fn run(params: Params) {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port_base(NODES as u16);
    let timing = Timing {
        home_lease: Duration::from_secs(2),
        max_delegation_lease: Duration::from_secs(5),
        clock_rate_ppm: 10_000,
    };
    let configs =
        setup::dev_cluster(dir.path(), NODES, port, timing, &LockSettings::default()).expect("layout");
    let mut nodes = Vec::new();
    for path in &configs {
        let mut config = NodeConfig::load(path).expect("config");
        // Any free TCP port for the HTTP API (the QUIC ports were only checked free for UDP).
        if let Some(http) = &mut config.http {
            http.listen = Some("127.0.0.1:0".parse().expect("addr"));
        }
        nodes.push(Node::start(config).await.expect("node starts"));
    }
    let nodes = Arc::new(nodes);
    // Wait until every node holds a home lease and its start-up quarantine is over.
    let ready = Instant::now();
    while !nodes.iter().all(|n| {
        let s = n.status();
        s.home_lease_left.is_some() && s.quarantine_left.is_zero()
    }) {
        assert!(ready.elapsed() < Duration::from_secs(30), "cluster did not settle");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("3-node cluster on 127.0.0.1:{port}.., {} rounds per latency figure", params.rounds);
    println!();

    let rtt = quic_rtt(dir.path(), params.rounds).await;
    let relock = client_relock(dir.path(), params.rounds).await;
    let http =
        http_relock(dir.path(), nodes[0].http_addr().expect("node 1 serves HTTP"), params.rounds).await;
    let embedded = embedded_relock(&nodes[0], params.rounds * 20).await;
    let first = first_lock_remote(&nodes, params.rounds.min(2000)).await;
    let handoffs = hot_key_handoff(&nodes, params.handoff_for).await;
    epoch_changes(&nodes, params.epoch_changes).await;
    println!();
    println!("client re-lock / quic rtt          {:.2}", relock.as_secs_f64() / rtt.as_secs_f64());
    println!("http re-lock / client re-lock      {:.2}", http.as_secs_f64() / relock.as_secs_f64());
    println!("first lock remote / quic rtt       {:.2}", first.as_secs_f64() / rtt.as_secs_f64());
    println!("embedded re-lock                   {:.0} ns", embedded.as_secs_f64() * 1e9);
    println!("hot-key handoffs                   {handoffs:.0} /s");

    if let Ok(nodes) = Arc::try_unwrap(nodes) {
        for node in nodes {
            node.shutdown(Duration::from_millis(100)).await;
        }
    }
}

/// Bare QUIC request/response against an echo server using the cluster's certificates.
async fn quic_rtt(cluster: &std::path::Path, rounds: usize) -> Duration {
    let ca = pki::load_ca(cluster.join("ca.pem")).expect("ca");
    let ca_pair = setup::load_ca(cluster).expect("ca key");
    let server_id =
        pki::issue(&ca_pair, &Role::Node(NodeId(99))).expect("cert").identity().expect("identity");
    let server = pki::server_config(&server_id, &ca).expect("server config");
    let endpoint = quinn::Endpoint::server(server, "127.0.0.1:0".parse().expect("addr")).expect("endpoint");
    let addr = endpoint.local_addr().expect("addr");
    let echo = tokio::spawn(async move {
        while let Some(incoming) = endpoint.accept().await {
            let Ok(conn) = incoming.await else { continue };
            tokio::spawn(async move {
                while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                    tokio::spawn(async move {
                        if let Ok(data) = recv.read_to_end(1 << 16).await {
                            let _ = send.write_all(&data).await;
                            let _ = send.finish();
                        }
                    });
                }
            });
        }
    });
    let client_id =
        Identity::load(cluster.join("client-app/cert.pem"), cluster.join("client-app/key.pem")).expect("id");
    let config = pki::client_config(&client_id, &ca, pki::ALPN_CLIENT).expect("client config");
    let client = quinn::Endpoint::client("127.0.0.1:0".parse().expect("addr")).expect("client endpoint");
    let conn = client
        .connect_with(config, addr, &pki::server_name(NodeId(99)))
        .expect("connect")
        .await
        .expect("handshake");
    let payload = vec![7u8; 48];
    let mut samples = Vec::with_capacity(rounds);
    for i in 0..rounds + rounds / 10 {
        let start = Instant::now();
        let (mut send, mut recv) = conn.open_bi().await.expect("stream");
        send.write_all(&payload).await.expect("write");
        send.finish().expect("finish");
        let back = recv.read_to_end(1 << 16).await.expect("read");
        assert_eq!(back.len(), payload.len());
        if i >= rounds / 10 {
            samples.push(start.elapsed());
        }
    }
    echo.abort();
    report("quic rtt (loopback)", &mut samples)
}

async fn client_relock(cluster: &std::path::Path, rounds: usize) -> Duration {
    let profile = ClientProfile::load(&cluster.join("client-app/profile.toml")).expect("profile");
    let client = keyhome::client::Client::connect(&profile).await.expect("client connects");
    let key = b"bench/client-relock";
    let ttl = Duration::from_secs(10);
    let wait = Duration::from_secs(10);
    // The first lock brings the delegation to node 1.
    client.lock(key, ttl, wait).await.expect("first lock").unlock(None).await.expect("unlock");
    let mut samples = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let start = Instant::now();
        let held = client.lock(key, ttl, wait).await.expect("lock");
        samples.push(start.elapsed());
        held.unlock(None).await.expect("unlock");
    }
    let status = client.status().await.expect("status");
    assert!(status.counters.locks_immediate as usize >= rounds, "re-locks were admitted without messages");
    report("client re-lock", &mut samples)
}

/// `POST /v1/lock` of one key through node 1's HTTP API over one keep-alive connection.
async fn http_relock(cluster: &std::path::Path, addr: std::net::SocketAddr, rounds: usize) -> Duration {
    use http_body_util::{BodyExt, Full};
    use hyper::body::Bytes;
    let token = std::fs::read_to_string(cluster.join("client-app").join(keyhome::http::tokens::TOKEN_FILE))
        .expect("http token");
    let bearer = format!("Bearer {}", token.trim());
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream.set_nodelay(true).expect("nodelay");
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await.expect("handshake");
    tokio::spawn(conn);
    let mut call = async |path: &str, body: String| -> serde_json::Value {
        let request = hyper::Request::post(path)
            .header(hyper::header::HOST, addr.to_string())
            .header(hyper::header::AUTHORIZATION, &bearer)
            .body(Full::new(Bytes::from(body)))
            .expect("request");
        send.ready().await.expect("the connection takes another request");
        let response = send.send_request(request).await.expect("send");
        assert!(response.status().is_success(), "{path}: {}", response.status());
        let bytes = response.into_body().collect().await.expect("body").to_bytes();
        serde_json::from_slice(&bytes).expect("JSON")
    };
    let lock = r#"{"key": "bench/http-relock", "ttl_ms": 10000, "wait_ms": 10000}"#;
    let unlock = |answer: &serde_json::Value| format!(r#"{{"handle": {}}}"#, answer["handle"]);
    // The first lock brings the delegation to node 1.
    let first = call("/v1/lock", lock.into()).await;
    call("/v1/unlock", unlock(&first)).await;
    let mut samples = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let start = Instant::now();
        let held = call("/v1/lock", lock.into()).await;
        samples.push(start.elapsed());
        call("/v1/unlock", unlock(&held)).await;
    }
    report("http re-lock", &mut samples)
}

async fn embedded_relock(node: &Node, pairs: usize) -> Duration {
    let key = b"bench/embedded-relock";
    let ttl = Duration::from_secs(10);
    node.lock(key, ttl, Duration::from_secs(10)).await.expect("first lock").unlock(None).expect("unlock");
    // Batches of pairs, so the clock read per sample does not dominate.
    const BATCH: usize = 100;
    let mut samples = Vec::with_capacity(pairs / BATCH);
    for _ in 0..pairs / BATCH {
        let start = Instant::now();
        for _ in 0..BATCH {
            let guard = node.try_lock(key, ttl).expect("re-lock needs no message");
            drop(guard);
        }
        samples.push(start.elapsed() / BATCH as u32);
    }
    let p50 = percentile(&mut samples, 0.5);
    println!(
        "{:<28} p50 {:>9.0} ns per lock+unlock pair (batches of {BATCH})",
        "embedded re-lock",
        p50.as_secs_f64() * 1e9
    );
    p50
}

async fn first_lock_remote(nodes: &[Node], rounds: usize) -> Duration {
    let node = &nodes[0];
    let ring = node.epoch().ring();
    let ttl = Duration::from_secs(10);
    let mut samples = Vec::with_capacity(rounds);
    let mut i = 0u64;
    while samples.len() < rounds {
        i += 1;
        let key = format!("bench/first/{i}");
        if ring.home(key.as_bytes()) == Some(node.id()) {
            continue;
        }
        let start = Instant::now();
        let guard = node.lock(key.as_bytes(), ttl, Duration::from_secs(10)).await.expect("first lock");
        samples.push(start.elapsed());
        drop(guard);
    }
    report("first lock, remote home", &mut samples)
}

async fn hot_key_handoff(nodes: &Arc<Vec<Node>>, run_for: Duration) -> f64 {
    let key = b"bench/hot";
    let stop = Arc::new(AtomicBool::new(false));
    let grants = Arc::new(AtomicU64::new(0));
    let locks = Arc::new(AtomicU64::new(0));
    // Mutual exclusion, checked in real time: set while some worker holds the key.
    let inside = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for n in 0..nodes.len() {
        let (nodes, stop, grants, locks, inside) = (
            Arc::clone(nodes),
            Arc::clone(&stop),
            Arc::clone(&grants),
            Arc::clone(&locks),
            Arc::clone(&inside),
        );
        workers.push(tokio::spawn(async move {
            let node = &nodes[n];
            let mut last = None;
            while !stop.load(Ordering::Relaxed) {
                let Ok(guard) = node.lock(key, Duration::from_secs(1), Duration::from_secs(5)).await else {
                    continue;
                };
                let t = guard.token();
                if last != Some((t.epoch, t.incarnation, t.counter)) {
                    last = Some((t.epoch, t.incarnation, t.counter));
                    grants.fetch_add(1, Ordering::Relaxed);
                }
                locks.fetch_add(1, Ordering::Relaxed);
                assert!(!inside.swap(true, Ordering::AcqRel), "two nodes admitted the hot key at once");
                inside.store(false, Ordering::Release);
                drop(guard);
                // A re-lock under the held delegation completes without ever suspending: without a
                // yield, a worker that keeps winning holds its runtime thread and starves the
                // tasks that carry the nodes' messages (the Recall it should answer among them).
                tokio::task::yield_now().await;
            }
        }));
    }
    let start = Instant::now();
    tokio::time::sleep(run_for).await;
    stop.store(true, Ordering::Relaxed);
    let elapsed = start.elapsed();
    for w in workers {
        let _ = w.await;
    }
    let handoffs = grants.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64();
    println!(
        "{:<28} {handoffs:>9.0} handoffs/s, {:.0} locks/s, over {:.1} s",
        "hot-key handoff (3 nodes)",
        locks.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64(),
        elapsed.as_secs_f64()
    );
    handoffs
}

async fn epoch_changes(nodes: &[Node], changes: usize) {
    let mut samples = Vec::with_capacity(changes);
    let base = nodes[0].epoch().timing;
    for i in 0..changes {
        let mut timing = base;
        timing.home_lease = base.home_lease + Duration::from_millis(if i % 2 == 0 { 1 } else { 0 });
        if timing == nodes[0].epoch().timing {
            timing.home_lease += Duration::from_millis(2);
        }
        let start = Instant::now();
        let epoch = nodes[0].propose(Change::SetTiming(timing)).await.expect("change applied");
        while !nodes.iter().all(|n| n.epoch().number >= epoch) {
            tokio::time::sleep(Duration::from_micros(100)).await;
        }
        samples.push(start.elapsed());
    }
    report("epoch change (all learned)", &mut samples);
}
