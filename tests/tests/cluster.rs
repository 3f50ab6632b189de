//! Multi-process tests: clusters of real `keyhome run` processes on loopback, driven through the
//! Rust client, the CLI and raw QUIC connections. Every test lays out its own cluster in a fresh
//! temporary directory on its own ports; the harness kills every process it started when the test
//! ends, passes or panics.

use std::time::{Duration, Instant};

use keyhome::pki::{self, Role};
use keyhome::status::Status;
use keyhome::wire::{
    self, CloseCode, ErrorKind, MAX_CLIENT_FRAME, MAX_PEER_FRAME, PeerFrame, Request, Response,
};
use keyhome_delegation::FencingToken;
use keyhome_epoch::{Change, NodeId};
use keyhome_sim::cluster::{self as harness, Cluster, Options, PATIENCE, home_of, key_homed_on};
use keyhome_sim::fake_node;

/// A ttl long enough that no test's handle runs out while the test uses it.
const TTL: Duration = Duration::from_secs(20);

/// Starts a cluster and waits until every node serves epoch 1.
async fn started(options: Options) -> Cluster {
    let cluster = Cluster::start(options);
    cluster.wait_ready(&cluster.ids(), 1).await;
    cluster
}

// ---- 1 ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_form_a_cluster_from_genesis() {
    let cluster = started(Options::default()).await;
    // The CLI's view, as an operator would read it: `keyhome status --json` on every node (polled,
    // as the lease of a loaded node may lapse for a moment between renewals).
    for id in cluster.ids() {
        let profile = cluster.profile_file(&Role::Client("app".into()), id);
        let status =
            harness::eventually(PATIENCE, &format!("node {id}'s CLI status shows it serving"), || {
                let out = cluster.cli(&["status", "--json", "--profile", profile.to_str().unwrap()]);
                assert!(
                    out.status.success(),
                    "keyhome status failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                let status: Status = serde_json::from_slice(&out.stdout).expect("status --json parses");
                std::future::ready(harness::ready(&status, 1).then_some(status))
            })
            .await;
        assert_eq!(status.id, id);
        assert_eq!(status.epoch, 1);
        assert_eq!(status.incarnation, 1, "node {id}: a first start is incarnation 1");
        assert_eq!(status.members.iter().map(|m| m.id).collect::<Vec<_>>(), vec![1, 2, 3]);
        assert!(status.members.iter().all(|m| m.connected), "node {id}: {status:?}");
        let lease = status.home_lease_left.expect("a home lease");
        assert!(
            lease <= cluster.options.timing.home_lease,
            "node {id}: lease {lease:?} longer than the epoch's"
        );
    }
    let profile = cluster.profile_file(&Role::Operator, 2);
    let out = cluster.cli(&["epoch", "show", "--json", "--profile", profile.to_str().unwrap()]);
    assert!(out.status.success(), "keyhome epoch show failed: {}", String::from_utf8_lossy(&out.stderr));
    let epoch: serde_json::Value = serde_json::from_slice(&out.stdout).expect("epoch show --json parses");
    assert_eq!(epoch["number"], 1);
    assert_eq!(epoch["members"].as_array().map(Vec::len), Some(3));
}

// ---- 2 ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_hands_off_between_nodes_with_the_note() {
    // Node 1 gives its idle delegation back (with the note) 400 ms after the unlock; a 2 s lease
    // leaves a wide margin before the home could expire it instead (which would drop the note).
    let options = Options::with_delegation_lease(Duration::from_secs(2));
    let cluster = started(options).await;
    let key = b"orders/handoff";
    let (n1, n2) = (cluster.client(1).await, cluster.client(2).await);

    let first = n1.lock(key, TTL, PATIENCE).await.expect("lock through node 1");
    let t1 = first.token();
    first.unlock(Some(b"n1".to_vec())).await.expect("unlock through node 1");

    let second = n2.lock(key, TTL, PATIENCE).await.expect("lock through node 2");
    assert_eq!(second.note(), Some(&b"n1"[..]), "node 2's holder sees node 1's handoff note");
    assert!(!second.recovered(), "a clean unlock is not a recovery");
    assert!(second.token() > t1, "tokens increase: {} then {}", t1, second.token());
    second.unlock(None).await.expect("unlock through node 2");
}

// ---- 3 ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_relock_sends_no_cluster_message() {
    // A delegation long enough that it is not renewed during the measurement (the holder renews a
    // busy delegation half-way through its lease: 1.5 s after the first request here; the re-locks
    // take milliseconds), and kept while idle for longer than that.
    let mut options = Options::with_delegation_lease(Duration::from_secs(3));
    options.locks.idle_release_ms = 2000;
    let cluster = started(options).await;
    // Homed on node 2, locked through node 1: any delegation traffic would cross the network.
    let key = key_homed_on("cached", &[1, 2, 3], 2);
    let n1 = cluster.client(1).await;
    n1.lock(&key, TTL, PATIENCE).await.expect("first lock").unlock(None).await.expect("first unlock");

    let before = [cluster.status(1).await.counters, cluster.status(2).await.counters];
    const RELOCKS: u64 = 20;
    for i in 0..RELOCKS {
        let held =
            n1.try_lock(&key, TTL).await.unwrap_or_else(|e| panic!("re-lock {i} was not immediate: {e}"));
        held.unlock(None).await.expect("unlock");
    }
    let after = [cluster.status(1).await.counters, cluster.status(2).await.counters];

    assert_eq!(
        after[0].locks_immediate,
        before[0].locks_immediate + RELOCKS,
        "every re-lock admitted at once"
    );
    assert_eq!(after[0].locks, before[0].locks + RELOCKS);
    assert_eq!(after[0].delegation_sent, before[0].delegation_sent, "the holder sent no delegation message");
    assert_eq!(after[0].delegation_received, before[0].delegation_received, "the holder received none");
    assert_eq!(after[0].local_delivered, before[0].local_delivered, "nor did it talk to itself");
    assert_eq!(after[1].delegation_received, before[1].delegation_received, "the home heard nothing");
    assert_eq!(after[1].delegation_sent, before[1].delegation_sent, "the home sent nothing");
}

// ---- 4 ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_holder_key_passes_on_after_the_lease_as_recovered() {
    let mut cluster = started(Options::default()).await;
    let key = key_homed_on("holder-dies", &[1, 2, 3], 1);
    let n2 = cluster.client(2).await;
    let sent = Instant::now();
    let held = n2.lock(&key, TTL, PATIENCE).await.expect("lock through node 2");
    let told = sent + held.valid_for();
    let t2 = held.token();
    let _ = held.forget();

    cluster.kill(2);

    let n3 = cluster.client(3).await;
    let next = n3.lock(&key, TTL, PATIENCE).await.expect("lock through node 3 once node 2's lease ran out");
    // Node 2's client may still be working (it need not know its node died) until its deadline.
    let admitted = Instant::now();
    assert!(admitted >= told, "admitted {:?} before the deadline node 2's client was told", told - admitted);
    assert!(next.recovered(), "the previous holder died holding the key: the next holder must be told");
    assert_eq!(next.note(), None);
    assert!(next.token() > t2, "tokens increase: {} then {}", t2, next.token());
}

/// A client whose connection ends keeps its lock until the deadline it was told: the client may
/// still be working inside it, so no other client is admitted before then. Afterwards the next
/// holder gets the key, told `recovered` (the client may have stopped halfway), with a larger
/// token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_client_session_keeps_its_locks_until_their_deadline() {
    let cluster = started(Options::default()).await;
    let key = key_homed_on("session", &[1, 2, 3], 2);
    let gone = cluster.client(1).await;
    let ttl = Duration::from_secs(3);
    let sent = Instant::now();
    let held = gone.lock(&key, ttl, PATIENCE).await.expect("lock through node 1");
    let told = sent + held.valid_for();
    let first = held.token();
    let _ = held.forget();
    drop(gone);

    let next = cluster.client(3).await;
    let lock = next.lock(&key, TTL, PATIENCE).await.expect("the key passes on after its deadline");
    let admitted = Instant::now();
    assert!(admitted >= told, "admitted {:?} before the deadline the first client was told", told - admitted);
    assert!(lock.recovered(), "the session ended without an unlock");
    assert!(lock.token() > first, "tokens increase: {} then {}", first, lock.token());
}

/// A lock call whose future the application drops while it waits (the client resets its half of
/// the QUIC stream) is withdrawn at its node: the node lists it waiting, then not, and when the holder
/// unlocks, the key goes to the next waiter at once, cleanly, not to the dropped call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_lock_call_is_withdrawn_at_its_node() {
    // The node the dropped call waits on asks for the key, so the holder is recalled: its handle
    // lasts until its delegation ends. 5 s delegations keep that end far past the unlock below.
    let options = Options::with_delegation_lease(Duration::from_secs(5));
    let cluster = started(options).await;
    let key = key_homed_on("withdrawn", &[1, 2, 3], 2);
    let shown = keyhome::status::show_key(&key);
    // The dropped call's ttl and wait outlive every wait below: had it stayed queued, node 1
    // would have admitted it once the holder's recalled delegation ran out, and the holder's
    // unlock would find its handle gone.
    const OUTLIVES: Duration = Duration::from_secs(600);
    let holder = cluster.client(3).await.lock(&key, TTL, PATIENCE).await.expect("hold the key");
    // The dropped call's client reads on for a late answer as long as its timeout: only its reset
    // of the request can withdraw the call within the waits below.
    let quitter = cluster.client(1).await.with_timeout(OUTLIVES);
    let call = {
        // A clone shares the connection, which outlives the call: only its stream is reset.
        let (quitter, key) = (quitter.clone(), key.clone());
        tokio::spawn(async move { quitter.lock(&key, OUTLIVES, OUTLIVES).await.map(|_| ()) })
    };
    let observer = cluster.client(1).await;
    let waits_on_1 = |expected: bool| {
        let (observer, shown) = (&observer, &shown);
        async move {
            let status = observer.status().await.ok()?;
            (status.waiting.iter().any(|w| &w.key == shown) == expected).then_some(())
        }
    };
    harness::eventually(PATIENCE, "node 1 lists the lock call waiting", || waits_on_1(true)).await;
    call.abort();
    let _ = call.await;
    harness::eventually(PATIENCE, "node 1 withdraws the dropped lock call", || waits_on_1(false)).await;
    holder.unlock(None).await.expect("the holder still holds the key: the dropped call took nothing");
    let next =
        cluster.client(2).await.lock(&key, TTL, PATIENCE).await.expect("the dropped call holds nothing");
    assert!(!next.recovered(), "the key was handed on cleanly, not left to run out");
    next.unlock(None).await.expect("unlock");
    quitter.status().await.expect("the connection of the dropped call still serves");
}

/// Lock calls waiting on a key cannot hold up the unlock that ends their wait when they share the
/// holder's QUIC connection (a `Client` cloned across a worker pool): more lock calls than the
/// node lets a connection open streams wait on the key, and a `try_lock` is still answered at
/// once, the holder's relock (its unlock) goes through, and every waiter is admitted in turn, each
/// unlock going through while the others wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_locks_leave_room_on_their_connection_for_the_unlock() {
    const WAITERS: usize = keyhome::pki::CLIENT_STREAMS as usize + 8;
    let cluster = started(Options::default()).await;
    let key = key_homed_on("crowded", &[1, 2, 3], 2);
    let shown = keyhome::status::show_key(&key);
    let client = cluster.client(1).await;
    let holder = client.lock(&key, TTL, PATIENCE).await.expect("hold the key");
    let mut waiters = tokio::task::JoinSet::new();
    for _ in 0..WAITERS {
        let (client, key) = (client.clone(), key.clone());
        waiters.spawn(async move { client.lock(&key, TTL, PATIENCE).await.map(|l| l.forget()) });
    }
    // Every stream the client may take for waiting locks is in use.
    let observer = cluster.client(1).await;
    let slots = keyhome::client::LOCK_STREAMS;
    harness::eventually(PATIENCE, "the node lists every lock slot waiting", || {
        let (observer, shown) = (&observer, &shown);
        async move {
            let status = observer.status().await.ok()?;
            status.waiting.iter().any(|w| &w.key == shown && w.locks == slots).then_some(())
        }
    })
    .await;
    // A lock that does not wait is answered at once, without a slot.
    let busy = client.try_lock(&key, TTL).await.map(|l| l.forget()).expect_err("the key is held");
    assert_eq!(busy.kind(), Some(ErrorKind::Timeout), "{busy}");
    // The holder moves on to another key: the relock's unlock goes out at once, without a slot;
    // its lock then waits for a slot like any other (behind the lock calls queued before it).
    let other = key_homed_on("crowded-other", &[1, 2, 3], 3);
    let moved = tokio::spawn(async move { holder.relock(None, &other, TTL, PATIENCE).await });
    let mut admitted = 0;
    while let Some(done) = waiters.join_next().await {
        let handle = done.expect("task").expect("each waiter is admitted in turn");
        client.unlock(handle, None).await.unwrap_or_else(|e| panic!("unlock {admitted}: {e}"));
        admitted += 1;
    }
    assert_eq!(admitted, WAITERS);
    let moved = moved.await.expect("task").expect("the relock's lock of the other key");
    moved.unlock(None).await.expect("unlock the other key");
}

/// The Rust client gives back a lock its caller stopped waiting for, when the answer crosses the
/// withdrawal over QUIC: a fake node answers one lock only after the client reset the call's
/// stream, and another one (acknowledged by the client's connection) before the caller, still
/// waiting but no longer polled, drops its future. Both come back as `GiveBack`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_gives_back_a_lock_answered_over_quic_after_its_caller_left() {
    use tokio::sync::oneshot;

    async fn next_request(conn: &quinn::Connection) -> (quinn::SendStream, quinn::RecvStream, Request) {
        let (send, mut recv) = conn.accept_bi().await.expect("a request stream");
        let request =
            wire::read_frame(&mut recv, MAX_CLIENT_FRAME).await.expect("a frame").expect("a request");
        (send, recv, request)
    }
    async fn answer(send: &mut quinn::SendStream, response: &Response) {
        wire::write_frame(send, response, MAX_CLIENT_FRAME).await.expect("answer");
        send.finish().expect("finish");
    }
    /// Reads the client's give-back, answers it, and returns the handle it names.
    async fn given_back(conn: &quinn::Connection) -> u64 {
        let (mut send, _recv, request) = next_request(conn).await;
        let Request::GiveBack { handle } = request else { panic!("expected a give-back, got {request:?}") };
        answer(&mut send, &Response::Unlocked).await;
        handle
    }

    let ca = pki::generate_ca("fake cluster").expect("ca");
    let node = pki::issue(&ca, &Role::Node(NodeId(1))).expect("node cert").identity().expect("identity");
    let app =
        pki::issue(&ca, &Role::Client("app".into())).expect("client cert").identity().expect("identity");
    let trusted = vec![ca.cert_der()];
    let config = pki::server_config(&node, &trusted).expect("server config");
    let endpoint = quinn::Endpoint::server(config, "127.0.0.1:0".parse().unwrap()).expect("endpoint");
    let addr = endpoint.local_addr().expect("addr");
    let (seen_tx, seen_rx) = oneshot::channel::<()>();
    let (seen2_tx, seen2_rx) = oneshot::channel::<()>();
    let (sent2_tx, sent2_rx) = oneshot::channel::<()>();
    let (first_tx, first_rx) = oneshot::channel::<u64>();
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let fake = tokio::spawn(async move {
        let conn = endpoint.accept().await.expect("a connection").await.expect("handshake");
        // 1. Answered after the client reset the call's stream.
        let (mut send, mut recv, request) = next_request(&conn).await;
        assert!(matches!(request, Request::Lock { .. }), "expected a lock, got {request:?}");
        let _ = seen_tx.send(());
        let reset = recv.received_reset().await.expect("the stream");
        assert_eq!(reset, Some(wire::RESET_WITHDRAW.into()), "the call is withdrawn by a reset");
        answer(&mut send, &fake_node::locked(41, TTL)).await;
        let _ = first_tx.send(given_back(&conn).await);
        // 2. Answered while its caller still waits, and received by the client's connection before
        // the caller goes: the answer's stream is acknowledged whole.
        let (mut send, mut recv, request) = next_request(&conn).await;
        assert!(matches!(request, Request::Lock { .. }), "expected a lock, got {request:?}");
        let _ = seen2_tx.send(());
        go_rx.await.expect("the test goes on");
        answer(&mut send, &fake_node::locked(42, TTL)).await;
        assert_eq!(send.stopped().await.expect("the stream"), None, "the client received the answer");
        let _ = sent2_tx.send(());
        let reset = recv.received_reset().await.expect("the stream");
        assert_eq!(reset, Some(wire::RESET_WITHDRAW.into()), "the caller left before reading it");
        (given_back(&conn).await, conn)
    });

    let client =
        keyhome::client::Client::connect_with(NodeId(1), addr, &app, &trusted).await.expect("connect");
    // Dropped once the fake node has it: the client resets the call's stream.
    fake_node::pending_until_seen(std::pin::pin!(client.lock(b"k", TTL, PATIENCE)), seen_rx).await;
    let first =
        tokio::time::timeout(PATIENCE, first_rx).await.expect("the client gave back").expect("the fake");
    assert_eq!(first, 41, "a lock answered after its caller left");
    {
        let mut lock = std::pin::pin!(client.lock(b"k", TTL, PATIENCE));
        fake_node::pending_until_seen(lock.as_mut(), seen2_rx).await;
        let _ = go_tx.send(());
        sent2_rx.await.expect("the fake node answered");
    } // dropped, its answer received but unread
    let (second, _conn) =
        tokio::time::timeout(PATIENCE, fake).await.expect("the client gave back").expect("the fake node");
    assert_eq!(second, 42, "a lock answered before its caller left, unread");
}

// ---- 5 ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_home_stalls_its_keys_only() {
    let mut cluster = started(Options::default()).await;
    let stalled = key_homed_on("stalls", &[1, 2, 3], 3);
    let other = key_homed_on("works", &[1, 2, 3], 2);

    cluster.kill(3);

    let n1 = cluster.client(1).await;
    let wait = Duration::from_millis(500);
    let started = Instant::now();
    let err = n1.lock(&stalled, TTL, wait).await.err().expect("a key whose home is dead cannot be locked");
    assert_eq!(err.kind(), Some(ErrorKind::Timeout), "{err}");
    assert!(started.elapsed() < wait + Duration::from_secs(10), "the wait was not respected");

    let held = n1.lock(&other, TTL, PATIENCE).await.expect("a key homed on a live node still locks");
    held.unlock(None).await.expect("unlock");
}

// ---- 6 ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_dead_node_rehomes_its_keys() {
    let mut cluster = started(Options::default()).await;
    let key = key_homed_on("rehomed", &[1, 2, 3], 3);
    cluster.kill(3);
    let n1 = cluster.client(1).await;
    let err =
        n1.lock(&key, TTL, Duration::from_millis(200)).await.err().expect("stalled while node 3 is dead");
    assert_eq!(err.kind(), Some(ErrorKind::Timeout), "{err}");

    let operator = cluster.operator(1).await;
    let proposed = Instant::now();
    let epoch = operator.propose(Change::Remove(NodeId(3))).await.expect("the operator removes node 3");
    assert_eq!(epoch, 2);
    let record = operator.epoch().await.expect("epoch show");
    assert_eq!(record.number, 2);
    assert_eq!(record.members.iter().map(|m| m.id.0).collect::<Vec<_>>(), vec![1, 2]);
    assert!(!record.activation_wait.is_zero());

    let held = n1.lock(&key, TTL, PATIENCE).await.expect("the key locks again under its new home");
    let elapsed = proposed.elapsed();
    println!(
        "dead node removed: the key locked {elapsed:?} after the proposal; activation wait {:?}",
        record.activation_wait
    );
    // Node 3 is dead, so nothing was handed over: the new home waited the activation wait after it
    // learned epoch 2, which was after the proposal started.
    assert!(
        elapsed >= record.activation_wait.mul_f64(0.95),
        "granted {elapsed:?} after the proposal, before the activation wait {:?} ran out",
        record.activation_wait
    );
    assert_ne!(home_of(&key, &[1, 2]), 3);
    held.unlock(None).await.expect("unlock");
    cluster.wait_ready(&[1, 2], 2).await;

    // Node 3's certificate, in whatever hands, cannot install an epoch: epoch 2 retires node 3.
    assert_eq!(record.retired, vec![NodeId(3)]);
    let genesis = keyhome::config::GenesisFile::load(&cluster.dir.join("genesis.toml"))
        .and_then(|g| g.record(&cluster.dir.join("genesis.toml")))
        .expect("the genesis");
    let node3 = cluster.node_dir(3);
    let identity = pki::Identity::load(node3.join("cert.pem"), node3.join("key.pem")).unwrap();
    let ca = pki::load_ca(cluster.dir.join("ca.pem")).expect("cluster CA");
    let config = pki::client_config(&identity, &ca, pki::ALPN_PEER).unwrap();
    let endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).expect("endpoint");
    let hello = |epoch| {
        let hello = PeerFrame::Hello {
            genesis_digest: genesis.digest(),
            ring_version: keyhome_ring::ROUTING_VERSION,
            epoch,
        };
        wire::encode(&hello, MAX_PEER_FRAME).unwrap()
    };
    // Epoch 3: node 3 back in, and no activation wait (a home may grant at once).
    let mut forged = Change::Add(keyhome_epoch::Member { id: NodeId(3), addr: cluster.addr(3).to_string() })
        .apply(&record)
        .expect("a valid record");
    forged.activation_wait = Duration::ZERO;
    let chosen =
        PeerFrame::Epoch(keyhome_epoch::Message { epoch: 3, body: keyhome_epoch::Body::Chosen(forged) });
    let chosen = wire::encode(&chosen, MAX_PEER_FRAME).unwrap();
    // A stream whose hello claims the later epoch is closed at once.
    let conn = endpoint.connect_with(config.clone(), cluster.addr(1), &pki::server_name(NodeId(1))).unwrap();
    let conn = conn.await.expect("connect as node 3");
    let (code, reason) =
        application_close(&raw_peer_stream(&conn, &[hello(3), chosen.clone()].concat(), true).await);
    assert_eq!(code, CloseCode::NotMember as u64, "closed with {code}: {reason}");
    assert!(reason.contains("removed"), "{reason}");
    // One that says it is behind (node 3 is told of the epoch that removed it) is heard, but its
    // record is not adopted: the malformed frame after it closes the stream once it was handled.
    let conn = endpoint.connect_with(config, cluster.addr(1), &pki::server_name(NodeId(1))).unwrap();
    let conn = conn.await.expect("connect as node 3");
    let garbage = [0, 0, 0, 4, 0xff, 0xff, 0xff, 0xff];
    let stream = [hello(2), chosen, garbage.to_vec()].concat();
    let (code, reason) = application_close(&raw_peer_stream(&conn, &stream, true).await);
    assert_eq!(code, CloseCode::BadFrame as u64, "closed with {code}: {reason}");
    let now = operator.epoch().await.expect("epoch show");
    assert_eq!((now.number, now.retired), (2, vec![NodeId(3)]), "a retired node's record was adopted");
}

/// A node that heard from a member of an epoch it had not learned yet (no address known for it
/// then) reaches that member once it learns the epoch (review: the link's task had ended at
/// once, and every later frame to the member was dropped for the rest of the run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_heard_of_before_its_epoch_is_reached_once_it_is_learned() {
    let mut cluster = started(Options::default()).await;
    cluster.kill(1);
    // Epoch 2 adds node 4, which never starts: nothing answers at its address.
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").expect("an address for node 4");
    let addr4 = silent.local_addr().unwrap();
    let member4 = keyhome_epoch::Member { id: NodeId(4), addr: addr4.to_string() };
    let forced = keyhome::wire::Proposal::forced(Change::Add(member4));
    let epoch = cluster.operator(2).await.propose(forced).await.expect("node 4 added");
    assert_eq!(epoch, 2);
    // Node 1 comes back while nobody can tell it of epoch 2.
    cluster.pause(2);
    cluster.pause(3);
    cluster.start_node(1);
    let status = cluster.wait_status(1, "node 1 serving", |_| true).await;
    assert_eq!(status.epoch, 1);
    // Node 4's certificate tells node 1 of epoch 2: node 1 asks it to catch it up, with no address
    // to reach it at.
    let ca = keyhome::setup::load_ca(&cluster.dir).expect("the CA");
    let identity = pki::issue(&ca, &Role::Node(NodeId(4))).unwrap().identity().unwrap();
    let config =
        pki::client_config(&identity, &pki::load_ca(cluster.dir.join("ca.pem")).unwrap(), pki::ALPN_PEER)
            .unwrap();
    let genesis = keyhome::config::GenesisFile::load(&cluster.dir.join("genesis.toml"))
        .and_then(|g| g.record(&cluster.dir.join("genesis.toml")))
        .expect("the genesis");
    let frames = [
        PeerFrame::Hello {
            genesis_digest: genesis.digest(),
            ring_version: keyhome_ring::ROUTING_VERSION,
            epoch: 2,
        },
        PeerFrame::Epoch(keyhome_epoch::Message {
            epoch: 2,
            body: keyhome_epoch::Body::LeaseRequest { incarnation: 1, seq: 1 },
        }),
    ];
    let mut stream: Vec<u8> = frames.iter().flat_map(|f| wire::encode(f, MAX_PEER_FRAME).unwrap()).collect();
    stream.extend([0, 0, 0, 4, 0xff, 0xff, 0xff, 0xff]); // closes the connection once the rest is handled
    let endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).expect("endpoint");
    let conn = endpoint.connect_with(config, cluster.addr(1), &pki::server_name(NodeId(1))).unwrap();
    let conn = conn.await.expect("connect as node 4");
    let (code, reason) = application_close(&raw_peer_stream(&conn, &stream, true).await);
    assert_eq!(code, CloseCode::BadFrame as u64, "closed with {code}: {reason}");
    // Node 1 learns epoch 2 from the others, then tries node 4's address (its lease requests).
    cluster.resume(2);
    cluster.resume(3);
    cluster.wait_status(1, "node 1 at epoch 2", |s| s.epoch == 2).await;
    cluster
        .wait_status(1, "node 1 tries to reach node 4", |s| {
            s.members.iter().any(|m| m.id == 4 && m.unreachable_for.is_some())
        })
        .await;
    drop(silent);
}

/// A first start that stopped before its store's first commit leaves an empty file; the next
/// start creates the store from the genesis (review: every later start failed with "not
/// initialised" until someone deleted the file).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_store_left_by_a_first_start_is_created_again() {
    let mut cluster = Cluster::layout(Options::default());
    let config = keyhome::config::NodeConfig::load(&cluster.node_config(1)).expect("node 1's config");
    std::fs::create_dir_all(&config.data_dir).expect("data directory");
    std::fs::File::create(config.store_path()).expect("an empty store file");
    for id in cluster.ids() {
        cluster.start_node(id);
    }
    cluster.wait_ready(&cluster.ids(), 1).await;
}

// ---- 7 ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_node_keeps_tokens_increasing() {
    let mut cluster = started(Options::default()).await;
    let key = key_homed_on("restart", &[1, 2, 3], 1);
    let n1 = cluster.client(1).await;
    let held = n1.lock(&key, TTL, PATIENCE).await.expect("lock through node 1, the key's home");
    let before = held.token();
    // A handle the node's crash left behind: its number, kept by its owner to clean up with.
    let old_handle = held.forget();
    let incarnation = cluster.status(1).await.incarnation;

    cluster.kill(1);
    cluster.start_node(1);
    let status = cluster.wait_status(1, "restarted and serving", |s| harness::ready(s, 1)).await;
    assert!(status.incarnation > incarnation, "a restart is a new incarnation: {status:?}");

    let n1 = cluster.client(1).await;
    let other = n1.lock(b"restart/other", TTL, PATIENCE).await.expect("lock another key");
    let held = n1.lock(&key, TTL, PATIENCE).await.expect("lock through the restarted node");
    assert!(held.token() > before, "tokens increase across the restart: {before} then {}", held.token());
    assert!(held.token().incarnation > before.incarnation);
    // The old number names no handle of the new run (the same identity holds two), so cleaning up
    // with it cannot end a lock taken since.
    assert!(![other.handle(), held.handle()].contains(&old_handle), "handle {old_handle} given out again");
    let err = n1.unlock(old_handle, None).await.expect_err("a handle of the run before is gone");
    assert_eq!(err.kind(), Some(ErrorKind::Lost), "{err}");
    held.unlock(None).await.expect("unlock");
    other.unlock(None).await.expect("the other key was still held");
}

// ---- 8 ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planned_removal_rehomes_keys_without_the_lease_wait() {
    // Long delegations, so the activation wait (home lease + delegation lease, widened) is seconds
    // while a handover takes milliseconds. Idle delegations go back quickly.
    let mut options = Options::with_delegation_lease(Duration::from_secs(4));
    options.locks.idle_release_ms = 200;
    let cluster = started(options).await;
    let key = key_homed_on("planned", &[1, 2, 3], 3);

    let n3 = cluster.client(3).await;
    let held = n3.lock(&key, TTL, PATIENCE).await.expect("lock through node 3, the key's home");
    let before = held.token();
    held.unlock(Some(b"n3".to_vec())).await.expect("unlock");
    // The idle delegation goes back to the home; no delegation of the key is live.
    cluster
        .wait_status(3, "no delegation held or granted", |s| s.holder_keys == 0 && s.homed_delegations == 0)
        .await;

    let operator = cluster.operator(1).await;
    let n1 = cluster.client(1).await;
    let proposed = Instant::now();
    let epoch = operator.propose(Change::Remove(NodeId(3))).await.expect("the operator removes node 3");
    assert_eq!(epoch, 2);
    let held = n1.lock(&key, TTL, PATIENCE).await.expect("lock under the key's new home");
    let elapsed = proposed.elapsed();

    let record = operator.epoch().await.expect("epoch show");
    println!(
        "live node removed: the key locked {elapsed:?} after the proposal; activation wait {:?}",
        record.activation_wait
    );
    assert_eq!(record.number, 2);
    assert!(record.activation_wait >= Duration::from_secs(4), "{record:?}");
    assert!(
        elapsed < record.activation_wait / 2,
        "the key took {elapsed:?} to move; the handover should spare the activation wait {:?}",
        record.activation_wait
    );
    assert_eq!(held.note(), Some(&b"n3"[..]), "the handover carries the note");
    assert!(!held.recovered(), "the handover vouches for a clean release");
    assert!(held.token() > before, "tokens increase across the move: {before} then {}", held.token());
    held.unlock(None).await.expect("unlock");
}

// ---- 9 ----

/// Connects to node `node` at `addr` with `config`: `Ok` once the node confirmed the handshake,
/// `Err` with the reason if it refused it. (A TLS 1.3 client completes its side of the handshake
/// before the server has checked the client's certificate; the server's HANDSHAKE_DONE is the
/// confirmation.)
async fn attempt(
    config: quinn::ClientConfig,
    node: u64,
    addr: std::net::SocketAddr,
) -> Result<quinn::Connection, String> {
    let endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).expect("endpoint");
    let conn =
        match endpoint.connect_with(config, addr, &pki::server_name(NodeId(node))).expect("connect").await {
            Ok(conn) => conn,
            Err(e) => return Err(format!("handshake: {e}")),
        };
    let deadline = Instant::now() + PATIENCE;
    while Instant::now() < deadline {
        if conn.stats().frame_rx.handshake_done > 0 {
            return Ok(conn);
        }
        if let Some(e) = conn.close_reason() {
            return Err(format!("closed: {e}"));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    panic!("node {node} neither confirmed nor refused the handshake within {PATIENCE:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_from_another_ca_are_refused() {
    let cluster = started(Options::default()).await;
    let ca = pki::load_ca(cluster.dir.join("ca.pem")).expect("cluster CA");
    let addr = cluster.addr(1);

    // Control: node 2's own certificate is accepted on the peer protocol.
    let own = pki::Identity::load(cluster.node_dir(2).join("cert.pem"), cluster.node_dir(2).join("key.pem"))
        .unwrap();
    let config = pki::client_config(&own, &ca, pki::ALPN_PEER).unwrap();
    let conn = attempt(config, 1, addr).await.expect("the cluster's own node certificate");
    conn.close(0u32.into(), b"done");

    // Another cluster: its own CA, a certificate for node 2 from it.
    let other = tempfile::tempdir().unwrap();
    keyhome::setup::init(other.path(), &[(NodeId(2), addr.to_string())], cluster.options.timing).unwrap();
    let other_ca = keyhome::setup::load_ca(other.path()).unwrap();
    let foreign = pki::issue(&other_ca, &Role::Node(NodeId(2))).unwrap().identity().unwrap();
    let config = pki::client_config(&foreign, &ca, pki::ALPN_PEER).unwrap();
    let refused =
        attempt(config, 1, addr).await.expect_err("a node certificate from another CA was accepted");
    println!("node certificate from another CA: {refused}");
    assert!(refused.contains("certificate"), "the reason names the certificate: {refused}");

    // A client certificate from another CA: the client API refuses it.
    let dir = keyhome::setup::issue(other.path(), &other_ca, &Role::Client("app".into())).unwrap();
    let mut profile = cluster.client_profile(1);
    profile.cert = dir.join("cert.pem");
    profile.key = dir.join("key.pem");
    let refused = keyhome::client::Client::connect(&profile)
        .await
        .err()
        .expect("a foreign client certificate connected");
    println!("client certificate from another CA: {refused}");
    assert!(refused.to_string().contains("certificate"), "the error names the certificate: {refused}");

    // The node still serves its own cluster.
    cluster.wait_ready(&[1], 1).await;
}

// ---- 10 ----

/// A handle passes only between connections of the certificate identity that locked it: another
/// certificate cannot renew or unlock it even once its connection is gone, whatever serial it
/// guesses; a new connection of the same certificate can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_belongs_to_its_certificate_identity() {
    let cluster = started(Options::default()).await;
    let key = key_homed_on("owned", &[1, 2, 3], 2);
    let owner = cluster.client(1).await;
    let held = owner.lock(&key, TTL, PATIENCE).await.expect("lock through node 1");
    let serial = held.forget();
    drop(owner);

    let other = cluster.operator(1).await;
    let err = other.renew(serial, TTL).await.expect_err("another identity renewed the handle");
    assert_eq!(err.kind(), Some(ErrorKind::Forbidden), "{err}");
    let err = other.unlock(serial, Some(b"stolen".to_vec())).await.expect_err("another identity unlocked it");
    assert_eq!(err.kind(), Some(ErrorKind::Forbidden), "{err}");

    let again = cluster.client(1).await;
    again.renew(serial, TTL).await.expect("the same certificate takes its handle over");
    again.unlock(serial, Some(b"done".to_vec())).await.expect("and unlocks it");
    let next = cluster.client(3).await.lock(&key, TTL, PATIENCE).await.expect("the key passes on");
    assert_eq!(next.note(), Some(&b"done"[..]), "the owner's note, not the other identity's");
    assert!(!next.recovered());
}

/// A node asked to stop (SIGTERM) while a client holds a key does not pass the key on before the
/// deadline the client was told, and the next holder is told `recovered`: the client was cut off
/// mid-work, not unlocked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_hands_over_uncleanly_and_never_inside_a_told_deadline() {
    let mut cluster = started(Options::default()).await;
    let key = key_homed_on("shutdown", &[1, 2, 3], 2);
    let client = cluster.client(1).await;
    let sent = Instant::now();
    let held = client.lock(&key, Duration::from_secs(3), PATIENCE).await.expect("lock through node 1");
    let told = sent + held.valid_for();
    let first = held.token();
    let _ = held.forget();
    cluster.terminate(1);

    let next = cluster.client(3).await.lock(&key, TTL, PATIENCE).await.expect("the key passes on");
    let admitted = Instant::now();
    assert!(admitted >= told, "admitted {:?} before the first client's deadline", told - admitted);
    assert!(next.recovered(), "a shutdown ended the first handle, not its client");
    assert_eq!(next.note(), None);
    assert!(next.token() > first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificate_cannot_propose() {
    let cluster = started(Options::default()).await;
    let client = cluster.client(1).await;
    let err =
        client.propose(Change::Remove(NodeId(3))).await.expect_err("a client certificate proposed a change");
    assert_eq!(err.kind(), Some(ErrorKind::Forbidden), "{err}");
    assert_eq!(client.epoch().await.expect("epoch show").number, 1, "nothing changed");
    // The same request through the CLI with the client profile fails too.
    let profile = cluster.dir.join("client-app/profile.toml");
    let out = cluster.cli(&["epoch", "propose", "--remove", "3", "--profile", profile.to_str().unwrap()]);
    assert!(!out.status.success(), "keyhome epoch propose with a client profile succeeded");
    assert_eq!(cluster.status(2).await.epoch, 1);
}

// ---- 11 ----

/// Sends `bytes` as one client-API request on a new stream of `conn`; returns the node's answer.
async fn raw_request(conn: &quinn::Connection, bytes: &[u8]) -> Response {
    let (mut send, mut recv) = conn.open_bi().await.expect("open a stream");
    send.write_all(bytes).await.expect("write");
    send.finish().expect("finish");
    let answer = tokio::time::timeout(PATIENCE, wire::read_frame::<Response>(&mut recv, MAX_CLIENT_FRAME));
    answer
        .await
        .expect("an answer in time")
        .expect("a well-formed answer")
        .expect("an answer, not the end of the stream")
}

/// Opens a peer stream on `conn`, sends `bytes`, and returns how the node closed the connection.
/// Writes `bytes` on a new peer stream, ends it if `finish` (else leaves it open, waiting for
/// more), and waits for the node to close the connection.
async fn raw_peer_stream(conn: &quinn::Connection, bytes: &[u8], finish: bool) -> quinn::ConnectionError {
    let mut send = conn.open_uni().await.expect("open a peer stream");
    send.write_all(bytes).await.expect("write");
    if finish {
        let _ = send.finish();
    }
    tokio::time::timeout(PATIENCE, conn.closed()).await.expect("the node closes the connection")
}

fn application_close(e: &quinn::ConnectionError) -> (u64, String) {
    match e {
        quinn::ConnectionError::ApplicationClosed(close) => {
            (close.error_code.into_inner(), String::from_utf8_lossy(&close.reason).into_owned())
        }
        other => panic!("expected an application close, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_oversized_frames_are_refused_and_the_node_keeps_serving() {
    let cluster = started(Options::default()).await;
    let addr = cluster.addr(1);
    let ca = pki::load_ca(cluster.dir.join("ca.pem")).expect("cluster CA");
    let endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).expect("endpoint");

    // Client API: a malformed body, an oversized length prefix, a truncated frame.
    let app = keyhome::setup::identity_dir(&cluster.dir, &Role::Client("app".into()));
    let identity = pki::Identity::load(app.join("cert.pem"), app.join("key.pem")).unwrap();
    let config = pki::client_config(&identity, &ca, pki::ALPN_CLIENT).unwrap();
    let conn =
        endpoint.connect_with(config, addr, &pki::server_name(NodeId(1))).unwrap().await.expect("connect");
    let garbage = [0, 0, 0, 4, 0xff, 0xff, 0xff, 0xff];
    let oversized = (MAX_CLIENT_FRAME as u32 + 1).to_be_bytes();
    let truncated = [0, 0, 0, 100, 1, 2, 3];
    for (what, bytes) in
        [("malformed", &garbage[..]), ("oversized", &oversized[..]), ("truncated", &truncated[..])]
    {
        match raw_request(&conn, bytes).await {
            Response::Error(e) => {
                assert_eq!(e.kind, ErrorKind::Invalid, "{what}: {e:?}");
                assert!(e.message.contains("malformed request"), "{what}: {e:?}");
                println!("{what} request: {}", e.message);
            }
            other => panic!("{what} request answered {other:?}"),
        }
    }
    // The same connection still serves a well-formed request.
    let lock =
        wire::encode(&Request::Lock { key: b"frames".to_vec(), ttl: TTL, wait: PATIENCE }, MAX_CLIENT_FRAME)
            .unwrap();
    let handle = match raw_request(&conn, &lock).await {
        Response::Locked(locked) => locked.handle,
        other => panic!("a lock after bad frames answered {other:?}"),
    };
    let unlock = wire::encode(&Request::Unlock { handle, note: None }, MAX_CLIENT_FRAME).unwrap();
    assert!(matches!(raw_request(&conn, &unlock).await, Response::Unlocked));
    conn.close(0u32.into(), b"done");

    // Peer protocol, with node 2's own certificate: a garbage Hello, an oversized frame, a Hello
    // from another cluster. Each closes that connection with a reason.
    let node2 = cluster.node_dir(2);
    let identity = pki::Identity::load(node2.join("cert.pem"), node2.join("key.pem")).unwrap();
    let peer_config = pki::client_config(&identity, &ca, pki::ALPN_PEER).unwrap();
    let foreign_hello = wire::encode(
        &PeerFrame::Hello { genesis_digest: [7; 32], ring_version: keyhome_ring::ROUTING_VERSION, epoch: 1 },
        MAX_PEER_FRAME,
    )
    .unwrap();
    let oversized = (MAX_PEER_FRAME as u32 + 1).to_be_bytes();
    // Whoever holds a node certificate may not hold a large frame, or a stream, before its hello
    // is heard: a first frame over 64 bytes is refused at once, and a stream whose hello does not
    // come is closed after the request timeout (5 s).
    let over_a_hello = [0, 0, 0, 65];
    let half_a_prefix = [0, 0];
    for (what, bytes, finish, code) in [
        ("malformed hello", &garbage[..], true, CloseCode::BadFrame),
        ("oversized frame", &oversized[..], true, CloseCode::BadFrame),
        ("a first frame larger than a hello", &over_a_hello[..], false, CloseCode::BadFrame),
        ("a hello that never comes", &half_a_prefix[..], false, CloseCode::BadFrame),
        ("hello of another cluster", &foreign_hello[..], true, CloseCode::Mismatch),
    ] {
        let conn = endpoint
            .connect_with(peer_config.clone(), addr, &pki::server_name(NodeId(1)))
            .unwrap()
            .await
            .expect("connect");
        let (got, reason) = application_close(&raw_peer_stream(&conn, bytes, finish).await);
        assert_eq!(got, code as u64, "{what}: closed with code {got} ({reason})");
        assert!(!reason.is_empty(), "{what}: no reason given");
        println!("{what}: closed with code {got}: {reason}");
    }

    // Node 1 still talks to its real peers and serves clients: everyone connected, and a key
    // homed on node 2 locks through node 1 (delegation messages both ways).
    cluster.wait_ready(&cluster.ids(), 1).await;
    let key = key_homed_on("after-frames", &[1, 2, 3], 2);
    let held = cluster.client(1).await.lock(&key, TTL, PATIENCE).await.expect("lock through node 1");
    held.unlock(None).await.expect("unlock");
}

// ---- 12 ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_lock_runs_the_command_with_its_token_and_exit_status() {
    let cluster = started(Options::default()).await;
    let profile = cluster.dir.join("client-app/profile.toml");
    let profile = profile.to_str().unwrap();
    let first = cluster.dir.join("first-token");
    let script = format!("printf %s \"$KEYHOME_TOKEN\" > '{}'; exit 7", first.display());
    let out =
        cluster.cli(&["lock", "cli/key", "--profile", profile, "--wait", "20s", "--", "sh", "-c", &script]);
    assert_eq!(out.status.code(), Some(7), "keyhome lock exits with the command's status: {out:?}");
    let t1: FencingToken =
        std::fs::read_to_string(&first).unwrap().parse().expect("KEYHOME_TOKEN is a fencing token");

    let second = cluster.dir.join("second-token");
    let script =
        format!("test \"$KEYHOME_KEY\" = cli/key && printf %s \"$KEYHOME_TOKEN\" > '{}'", second.display());
    let out =
        cluster.cli(&["lock", "cli/key", "--profile", profile, "--wait", "20s", "--", "sh", "-c", &script]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let t2: FencingToken = std::fs::read_to_string(&second).unwrap().parse().expect("a fencing token");
    assert!(t2 > t1, "tokens increase: {t1} then {t2}");
}
