//! The client API on a node's Unix socket (node/src/local.rs), against real `keyhome run`
//! processes: identity from the peer's uid, refused peers, bad frames, many requests in flight,
//! pipelined unlocks and relocks, casts, withdrawn calls, lock answers nobody takes given back,
//! sessions and lost-lock events as on QUIC, and nodes that busy-poll.
//!
//! The harness lays every node out with a socket on which this test's uid is the client `app`
//! (the identity of the `app` certificate on QUIC); tests that need other mappings rewrite a
//! node's `[local]` table before starting it.

use std::io::{Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use keyhome::client::{Client, ClientError};
use keyhome::config::{LocalAllow, LocalRole, LocalSettings, NodeConfig, write_toml};
use keyhome::wire::{ErrorKind, EventKind, LocalFrame, LocalRequest, MAX_CLIENT_FRAME, Request, Response};
use keyhome_epoch::{Change, NodeId};
use keyhome_sim::cluster::{Cluster, Options, PATIENCE, key_homed_on};
use keyhome_sim::fake_node;
use keyhome_sim::hostile::measure::{cpu_time, log_lines};

/// A ttl long enough that no test's handle runs out while the test uses it.
const TTL: Duration = Duration::from_secs(20);
/// A uid no account of the test machine uses.
const STRANGER: u32 = 54_321;

/// Lays a cluster out, lets `edit` change each node's `[local]` table, starts it and waits until
/// every node serves epoch 1.
async fn started_with(options: Options, edit: impl Fn(u64, &mut LocalSettings)) -> Cluster {
    started_with_config(options, |id, config| {
        edit(id, config.local.as_mut().expect("the harness configures a local socket"))
    })
    .await
}

async fn started_with_config(options: Options, edit: impl Fn(u64, &mut NodeConfig)) -> Cluster {
    let mut cluster = Cluster::layout(options);
    for id in cluster.ids() {
        let path = cluster.node_config(id);
        let mut config = NodeConfig::load(&path).expect("node.toml");
        edit(id, &mut config);
        write_toml(&path, &config).expect("rewrite node.toml");
        cluster.start_node(id);
    }
    cluster.wait_ready(&cluster.ids(), 1).await;
    cluster
}

async fn started() -> Cluster {
    started_with(Options::default(), |_, _| {}).await
}

fn own_uid() -> u32 {
    rustix::process::getuid().as_raw()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peer_uid_decides_the_identity() {
    // Node 1: the harness's mapping (this uid is the client `app`); node 2: no entries, so this
    // uid (the node's own) is the operator; node 3: only a stranger's uid is mapped.
    let cluster = started_with(Options::default(), |id, local| match id {
        2 => local.allow.clear(),
        3 => {
            local.allow =
                vec![LocalAllow { uid: Some(STRANGER), gid: None, role: LocalRole::Operator, name: None }]
        }
        _ => {}
    })
    .await;
    let app = cluster.local_client(1).await;
    let hello = app.local_identity().expect("a local connection");
    assert_eq!((hello.node, hello.identity.as_str()), (NodeId(1), "client-app.keyhome"));
    // A profile's socket must lead to the node the profile names.
    let profile = |node: u64| keyhome::config::ClientProfile {
        socket: Some(cluster.local_socket(1)),
        ..cluster.client_profile(node)
    };
    assert!(Client::connect(&profile(1)).await.is_ok_and(|c| c.local_identity().is_some()));
    let err = Client::connect(&profile(2)).await.err().expect("node 1's socket taken for node 2");
    assert!(err.to_string().contains("the node on it is node 1, not node 2 as the profile says"), "{err}");

    // A handle locked on the socket belongs to the identity, whichever transport: the `app`
    // certificate takes it over on QUIC, the operator certificate may not.
    let key = key_homed_on("local-owned", &[1, 2, 3], 2);
    let serial = app.lock(&key, TTL, PATIENCE).await.expect("lock on the socket").forget();
    let operator = cluster.operator(1).await;
    let err = operator.renew(serial, TTL).await.expect_err("another identity renewed the handle");
    assert_eq!(err.kind(), Some(ErrorKind::Forbidden), "{err}");
    let quic_app = cluster.client(1).await;
    quic_app.unlock(serial, Some(b"over quic".to_vec())).await.expect("the same identity on QUIC unlocks it");
    let next = app.lock(&key, TTL, PATIENCE).await.expect("lock again on the socket");
    assert_eq!(next.note(), Some(&b"over quic"[..]));
    next.unlock(None).await.expect("unlock");

    // A client may not change the membership; the operator identity may (here: it is refused by
    // the epoch layer, not for its identity).
    let err = app.propose(Change::Remove(NodeId(3))).await.expect_err("a client proposed a change");
    assert_eq!(err.kind(), Some(ErrorKind::Forbidden), "{err}");
    let op = cluster.local_client(2).await;
    assert_eq!(op.local_identity().map(|h| h.identity.as_str()), Some("operator.keyhome"));
    let err = op.propose(Change::Remove(NodeId(9))).await.expect_err("removing a non-member");
    assert_ne!(err.kind(), Some(ErrorKind::Forbidden), "the operator was refused for its identity: {err}");

    // An unmapped uid is refused at connect, with the reason.
    let err = Client::connect_local(&cluster.local_socket(3)).await.err().expect("an unmapped uid connected");
    let text = err.to_string();
    assert!(matches!(err, ClientError::LocalConnect { .. }), "{text}");
    assert!(text.contains(&format!("uid {} ", own_uid())) && text.contains("not allowed"), "{text}");
}

/// Runs the built `keyhome status` as the uid [`STRANGER`] (with `setpriv`) against the profile
/// at `profile`; returns its stderr, or `None` where `setpriv` is missing.
fn status_as_stranger(cluster: &Cluster, profile: &Path) -> Option<String> {
    let setpriv = ["/usr/bin/setpriv", "/bin/setpriv"].into_iter().find(|p| Path::new(p).exists())?;
    let keyhome = cluster.cli_command(&[]).get_program().to_owned();
    let out = std::process::Command::new(setpriv)
        .args(["--reuid", &STRANGER.to_string(), "--regid", &STRANGER.to_string(), "--clear-groups"])
        .arg(keyhome)
        .args(["status", "--profile"])
        .arg(profile)
        .current_dir("/")
        .output()
        .expect("run setpriv");
    assert!(!out.status.success(), "the stranger read the status");
    Some(String::from_utf8_lossy(&out.stderr).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_without_permission_or_mapping_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let cluster = started().await;
    let socket = cluster.local_socket(1);
    let mode = std::fs::metadata(&socket).expect("the socket file").permissions().mode();
    assert_eq!(mode & 0o777, 0o660, "created with the configured mode");

    // Let the stranger reach the socket file and read a profile that names it.
    let mut dir = socket.parent().map(Path::to_path_buf);
    while let Some(d) = dir.filter(|d| d.starts_with(std::env::temp_dir()) && *d != std::env::temp_dir()) {
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).expect("open the directory");
        dir = d.parent().map(Path::to_path_buf);
    }
    let mut profile = cluster.client_profile(1);
    profile.socket = Some(socket.clone());
    let profile_path = cluster.dir.join("stranger.toml");
    write_toml(&profile_path, &profile).expect("write the profile");
    std::fs::set_permissions(&profile_path, std::fs::Permissions::from_mode(0o644)).expect("chmod");

    // No write permission on the socket file (mode 0660, owned by this uid): the kernel refuses.
    let Some(stderr) = status_as_stranger(&cluster, &profile_path) else {
        eprintln!("setpriv not found: the permission and other-uid checks were skipped");
        return;
    };
    assert!(stderr.contains("local socket") && stderr.contains("Permission denied"), "{stderr}");
    // With the file open to everyone, the node refuses the unmapped uid itself.
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).expect("chmod the socket");
    let stderr = status_as_stranger(&cluster, &profile_path).expect("setpriv ran before");
    assert!(stderr.contains(&format!("uid {STRANGER} ")) && stderr.contains("not allowed"), "{stderr}");
    // The mapped uid is still served.
    cluster.local_client(1).await.status().await.expect("status on the socket");
}

/// A raw connection to `socket`, past the node's hello.
fn raw_connection(socket: &Path) -> std::os::unix::net::UnixStream {
    let mut stream = std::os::unix::net::UnixStream::connect(socket).expect("connect");
    stream.set_read_timeout(Some(PATIENCE)).expect("read timeout");
    let hello = read_frame(&mut stream);
    assert!(
        matches!(&hello, Some(LocalFrame::Hello(h)) if h.protocols == keyhome::wire::LOCAL_PROTOCOLS),
        "the hello names the local protocols the node serves: {hello:?}"
    );
    stream
}

/// A node whose hello names only local protocol versions this client does not speak: the client
/// refuses it, naming both, before it sends a single frame.
#[tokio::test]
async fn a_client_refuses_a_node_of_another_local_protocol() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("node.sock");
    let listener = tokio::net::UnixListener::bind(&socket).expect("bind");
    let newer = keyhome::wire::LocalProtocols {
        oldest: keyhome::wire::LOCAL_PROTOCOL + 1,
        newest: keyhome::wire::LOCAL_PROTOCOL + 2,
    };
    let hello = LocalFrame::Hello(keyhome::wire::LocalHello {
        node: NodeId(1),
        identity: "client-app.keyhome".into(),
        protocols: newer,
    });
    let node = tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut stream, _) = listener.accept().await.expect("accept");
        let frame = keyhome::wire::encode(&hello, MAX_CLIENT_FRAME).expect("encode the hello");
        stream.write_all(&frame).await.expect("send the hello");
        let mut heard = Vec::new();
        stream.read_to_end(&mut heard).await.expect("read until the client closes");
        heard
    });
    let error = match Client::connect_local(&socket).await {
        Ok(_) => panic!("a client connected to a node of another local protocol"),
        Err(e) => e,
    };
    let message = error.to_string();
    assert!(
        matches!(&error, ClientError::LocalProtocol { node, client, .. }
            if *node == newer && *client == keyhome::wire::LOCAL_PROTOCOLS),
        "{message}"
    );
    let theirs = format!("versions {} to {}", newer.oldest, newer.newest);
    assert!(message.contains(&theirs), "{message}");
    assert!(message.contains(&keyhome::wire::LOCAL_PROTOCOLS.to_string()), "{message}");
    let heard =
        tokio::time::timeout(PATIENCE, node).await.expect("the client closed").expect("the fake node");
    assert!(heard.is_empty(), "the client sent a frame to a node it cannot speak to");
}

/// The next frame from the peer (a node's `LocalFrame`, or a client's `LocalRequest` for a fake
/// node); `None` at the end of the stream.
fn read_frame<T: serde::de::DeserializeOwned>(stream: &mut std::os::unix::net::UnixStream) -> Option<T> {
    let mut prefix = [0u8; 4];
    stream.read_exact(&mut prefix).ok()?;
    let mut body = vec![0u8; u32::from_be_bytes(prefix) as usize];
    stream.read_exact(&mut body).expect("a whole frame");
    Some(keyhome::wire::decode(&body).expect("a frame the peer sent decodes"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_frames_end_the_connection_and_the_node_keeps_serving() {
    let cluster = started().await;
    let socket = cluster.local_socket(1);
    let oversized = (MAX_CLIENT_FRAME as u32 + 1).to_be_bytes().to_vec();
    let garbage = vec![0, 0, 0, 4, 0xff, 0xff, 0xff, 0xff];
    let trailing = {
        let call = keyhome::wire::LocalRequest::Call { id: 1, request: keyhome::wire::Request::Status };
        let mut frame = keyhome::wire::encode(&call, MAX_CLIENT_FRAME).expect("encode");
        frame[3] += 1;
        frame.push(0);
        frame
    };
    let before = cluster.status(1).await.counters.requests_malformed;
    for (what, bytes, says) in [
        ("oversized", oversized, "frame size too big"),
        ("malformed", garbage, "malformed frame"),
        ("trailing bytes", trailing, "left over"),
    ] {
        let mut stream = raw_connection(&socket);
        stream.write_all(&bytes).expect("send");
        match read_frame(&mut stream) {
            Some(LocalFrame::Refused(e)) => {
                assert_eq!(e.kind, ErrorKind::Invalid, "{what}: {e:?}");
                assert!(e.message.contains(says), "{what}: {e:?}");
                println!("{what} frame: {}", e.message);
            }
            other => panic!("{what} frame answered {other:?}"),
        }
        assert!(read_frame::<LocalFrame>(&mut stream).is_none(), "{what}: the node closes the connection");
    }
    // Counted (and logged at a bounded rate) as QUIC's malformed requests are.
    let after = cluster.status(1).await.counters.requests_malformed;
    assert_eq!(after, before + 3, "malformed local frames counted");
    // A frame cut short, then the end of the stream: the node just closes.
    let mut stream = raw_connection(&socket);
    stream.write_all(&[0, 0, 0, 100, 1, 2, 3]).expect("send");
    stream.shutdown(std::net::Shutdown::Write).expect("shutdown");
    assert!(matches!(read_frame(&mut stream), Some(LocalFrame::Refused(_)) | None));
    cluster.local_client(1).await.status().await.expect("the node still serves");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_requests_in_flight_on_one_connection_within_its_bound() {
    const MAX: usize = 4;
    let cluster = started_with(Options::default(), |id, local| {
        if id == 2 {
            local.max_in_flight = MAX;
        }
    })
    .await;

    // 64 locks on distinct keys at once on one connection: all admitted, tokens distinct.
    let client = cluster.local_client(1).await;
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..64 {
        let client = client.clone();
        calls.spawn(async move { client.lock(format!("many-{i}").as_bytes(), TTL, PATIENCE).await });
    }
    let mut held = Vec::new();
    while let Some(done) = calls.join_next().await {
        held.push(done.expect("task").expect("lock in flight"));
    }
    let mut tokens: Vec<_> = held.iter().map(|h| (h.token(), h.handle())).collect();
    tokens.sort();
    tokens.dedup();
    assert_eq!(tokens.len(), 64, "one handle and token each");
    for h in held {
        h.unlock(None).await.expect("unlock");
    }

    // Past the bound: with the key held on the same connection, MAX waiting locks are in flight
    // on it, and the ones after them are refused at once; the holder's unlock, answered at once,
    // takes no slot, so it ends their wait.
    let key = key_homed_on("bounded", &[1, 2, 3], 3);
    let client = cluster.local_client(2).await;
    let holder = client.lock(&key, TTL, PATIENCE).await.expect("hold the key");
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..MAX + 2 {
        let (client, key) = (client.clone(), key.clone());
        calls.spawn(async move { client.lock(&key, TTL, PATIENCE).await.map(|l| l.forget()) });
    }
    for _ in 0..2 {
        let err =
            calls.join_next().await.expect("a call").expect("task").expect_err("admitted past the bound");
        assert_eq!(err.kind(), Some(ErrorKind::Unavailable), "{err}");
        assert!(err.to_string().contains("too many requests waiting"), "{err}");
    }
    assert!(calls.try_join_next().is_none(), "the other calls still wait");
    holder.unlock(None).await.expect("an unlock while every slot waits");
    let next = calls.join_next().await.expect("a call").expect("task");
    next.expect("a waiter is admitted once the key is unlocked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipelined_unlock_is_seen_by_the_next_request_and_relock_is_one_call() {
    let cluster = started().await;
    let key = key_homed_on("pipelined", &[1, 2, 3], 2);
    let client = cluster.local_client(1).await;
    let mut last = client.lock(&key, TTL, PATIENCE).await.expect("first lock");
    for i in 0..200 {
        let token = last.token();
        last.unlock_nowait(None).await.expect("send the unlock");
        // Not waiting: the unlock was started before this lock is read, so it is admitted at once.
        last = client
            .try_lock(&key, TTL)
            .await
            .unwrap_or_else(|e| panic!("re-lock {i} did not see the unlock: {e}"));
        assert!(last.token() > token, "tokens increase");
    }
    for relocking in [client.clone(), cluster.client(1).await] {
        let first = relocking.lock(b"relocked", TTL, PATIENCE).await.expect("lock");
        let before = first.token();
        let again =
            first.relock(Some(b"n".to_vec()), b"relocked", TTL, Duration::ZERO).await.expect("relock");
        assert!(again.token() > before, "a new handle");
        assert_eq!(again.note(), Some(&b"n"[..]), "the unlock's note is handed to the relock");
        again.unlock(None).await.expect("unlock");
    }
    last.unlock(None).await.expect("unlock");
}

/// Writes `request` as one frame on a raw connection.
fn send_frame<T: serde::Serialize>(stream: &mut std::os::unix::net::UnixStream, value: &T) {
    let frame = keyhome::wire::encode(value, MAX_CLIENT_FRAME).expect("encode");
    stream.write_all(&frame).expect("send");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cast_gets_no_answer_and_locks_and_subscriptions_cannot_be_casts() {
    // The lock taken by the raw connection outlives every wait below: a cast that failed to
    // unlock would hold its key past the other client's PATIENCE.
    const OUTLIVES: Duration = Duration::from_secs(600);
    let cluster = started().await;
    let held = key_homed_on("cast-held", &[1, 2, 3], 3);
    let mut stream = raw_connection(&cluster.local_socket(1));
    send_frame(
        &mut stream,
        &LocalRequest::Call {
            id: 1,
            request: Request::Lock { key: held.clone(), ttl: OUTLIVES, wait: PATIENCE },
        },
    );
    let handle = match read_frame(&mut stream) {
        Some(LocalFrame::Answer { id: 1, response: Response::Locked(locked) }) => locked.handle,
        other => panic!("lock answered {other:?}"),
    };
    let casts = [
        Request::Unlock { handle: handle + 1000, note: None }, // fails: no such handle
        Request::Unlock { handle, note: None },
    ];
    for request in casts {
        send_frame(&mut stream, &LocalRequest::Cast { request });
    }
    // The node takes frames in order: the first frame back answers the call sent after the casts.
    send_frame(&mut stream, &LocalRequest::Call { id: 7, request: Request::Status });
    match read_frame(&mut stream) {
        Some(LocalFrame::Answer { id: 7, response: Response::Status(_) }) => {}
        other => panic!("the first frame after two casts is {other:?}"),
    }
    // The cast unlock freed its key, cleanly (a handle left to run out would pass it on
    // `recovered` once its delegation, recalled, ran out).
    let other = cluster.client(2).await;
    let freed = other.lock(&held, TTL, PATIENCE).await.expect("the cast unlock freed the key");
    assert!(!freed.recovered(), "the cast unlock did not end the handle");
    let freed_token = freed.token();
    // A call id already in flight is refused, and the connection ends: the call waiting under it
    // is withdrawn (its answer could not be told from the second one's, nor could it be cancelled).
    let mut twice = raw_connection(&cluster.local_socket(1));
    let waiting = LocalRequest::Call {
        id: 5,
        request: Request::Lock { key: held.clone(), ttl: OUTLIVES, wait: PATIENCE },
    };
    send_frame(&mut twice, &waiting);
    send_frame(&mut twice, &waiting);
    match read_frame(&mut twice) {
        Some(LocalFrame::Refused(e)) => {
            assert!(e.message.contains("call id 5 is already in flight"), "{e:?}")
        }
        other => panic!("a second call 5 answered {other:?}"),
    }
    assert!(read_frame::<LocalFrame>(&mut twice).is_none(), "the node closes the connection");
    freed.unlock(None).await.expect("unlock");
    let next = other
        .lock(&held, TTL, Duration::from_secs(2))
        .await
        .expect("the withdrawn call did not take the key");
    next.unlock(None).await.expect("unlock");

    // A cast Subscribe could never be answered, nor a cast lock name its handle; a cast takes no
    // in-flight slot, so a check (a message to the key's home, a pending entry) or a status (every
    // shard locked) could be cast without bound: the node refuses the frame and closes.
    let lock = Request::Lock { key: held.clone(), ttl: OUTLIVES, wait: PATIENCE };
    let relock = Request::Relock { handle, note: None, key: held.clone(), ttl: OUTLIVES, wait: PATIENCE };
    let check = Request::Check { key: held.clone(), token: freed_token };
    for request in [Request::Subscribe, lock, relock, check, Request::Status] {
        let name = request.name();
        send_frame(&mut stream, &LocalRequest::Cast { request });
        match read_frame(&mut stream) {
            Some(LocalFrame::Refused(e)) => assert!(e.message.contains("cannot be a Cast"), "{name}: {e:?}"),
            other => panic!("a cast {name} answered {other:?}"),
        }
        assert!(read_frame::<LocalFrame>(&mut stream).is_none(), "the node closes the connection");
        stream = raw_connection(&cluster.local_socket(1));
    }
}

/// A lock call withdrawn with `Cancel` (what the Rust client sends when a lock future is dropped)
/// while it waits at the home leaves nothing behind: it is never answered, and when the holder
/// unlocks, the key goes to the next waiter at once, cleanly, not to the withdrawn call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_lock_is_never_answered_and_holds_nothing() {
    // The withdrawn call's ttl outlives every wait below: had it been admitted, the other
    // client's lock would fail after PATIENCE.
    const OUTLIVES: Duration = Duration::from_secs(600);
    // Node 1 asks for the key, so the holder is recalled: its handle lasts until its delegation
    // ends. 5 s delegations keep that end far past the unlock below.
    let options = Options::with_delegation_lease(Duration::from_secs(5));
    let cluster = started_with(options, |_, _| {}).await;
    let key = key_homed_on("cancelled", &[1, 2, 3], 2);
    let holder = cluster.client(3).await.lock(&key, TTL, PATIENCE).await.expect("hold the key");
    let mut stream = raw_connection(&cluster.local_socket(1));
    let lock = Request::Lock { key: key.clone(), ttl: OUTLIVES, wait: PATIENCE };
    send_frame(&mut stream, &LocalRequest::Call { id: 1, request: lock });
    // Frames are started in order: once the status is answered, the lock waits (node 1 has
    // asked the key's home for it).
    let status = |stream: &mut std::os::unix::net::UnixStream, id: u64| {
        send_frame(stream, &LocalRequest::Call { id, request: Request::Status });
        match read_frame(stream) {
            Some(LocalFrame::Answer { id: answered, response: Response::Status(_) }) if answered == id => {}
            other => panic!("the first frame back after status call {id} is {other:?}"),
        }
    };
    status(&mut stream, 2);
    send_frame(&mut stream, &LocalRequest::Cancel { id: 1 });
    status(&mut stream, 3);
    holder.unlock(None).await.expect("the holder still holds the key: the withdrawn call took nothing");
    let other = cluster.client(2).await;
    let next = other.lock(&key, TTL, PATIENCE).await.expect("the withdrawn lock does not hold the key");
    assert!(!next.recovered(), "the key was handed on cleanly, not left to run out");
    next.unlock(None).await.expect("unlock");
    // Nothing was sent for the withdrawn call meanwhile: the next frame answers the next call.
    status(&mut stream, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_and_lost_lock_events_work_as_on_quic() {
    let cluster = started().await;
    let key = key_homed_on("recalled", &[1, 2, 3], 2);
    let client = cluster.local_client(1).await;
    let mut events = client.events().await.expect("subscribe");
    // One event stream per connection: a second is refused and leaves the first its events.
    let second = client.events().await.err().expect("a second subscription is refused");
    assert!(second.to_string().contains("already has an event stream"), "{second}");

    // Another node's client wants the key: the holder is told to hurry (event 1).
    let held = client.lock(&key, TTL, PATIENCE).await.expect("lock");
    let other = cluster.client(3).await;
    let waiter = tokio::spawn(async move { other.lock(&key, TTL, PATIENCE).await.map(|l| l.token()) });
    let event =
        tokio::time::timeout(PATIENCE, events.next()).await.expect("an event in time").expect("event");
    assert_eq!((event.seq, event.handle), (1, held.handle()));
    assert!(matches!(event.kind, EventKind::Recalled { .. }), "{event:?}");
    let token = held.token();
    held.unlock(None).await.expect("unlock");
    assert!(waiter.await.expect("task").expect("the waiter gets the key") > token);

    // A handle left to its deadline expires (event 2).
    let short = client.lock(b"expiring", Duration::from_millis(300), PATIENCE).await.expect("lock");
    let event =
        tokio::time::timeout(PATIENCE, events.next()).await.expect("an event in time").expect("event");
    assert_eq!((event.seq, event.handle, event.kind), (2, short.handle(), EventKind::Expired));
    let err = short.unlock(None).await.expect_err("unlock after the deadline");
    assert_eq!(err.kind(), Some(ErrorKind::Lost), "{err}");

    // Once the stream is dropped, a new one takes the connection's events, as on QUIC (event 3).
    drop(events);
    let mut events = client.events().await.expect("a new stream once the first is dropped");
    let short = client.lock(b"expiring", Duration::from_millis(300), PATIENCE).await.expect("lock");
    let event =
        tokio::time::timeout(PATIENCE, events.next()).await.expect("an event in time").expect("event");
    assert_eq!((event.seq, event.handle, event.kind), (3, short.handle(), EventKind::Expired));

    // A closed connection's handles live on; a new connection of the identity takes them over.
    let serial = client.lock(b"kept", TTL, PATIENCE).await.expect("lock").forget();
    drop((events, client));
    let sent = Instant::now();
    let again = cluster.local_client(1).await;
    let valid_for = again.renew(serial, TTL).await.expect("the identity renews its handle");
    assert!(valid_for > Duration::ZERO && sent.elapsed() < TTL);
    again.unlock(serial, None).await.expect("and unlocks it");
}

/// `worker_threads` in `node.toml` sizes `keyhome run`'s runtime: the harness, like `keyhome dev`,
/// gives each of the nodes sharing this host an equal share of its cores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_sharing_a_host_run_their_share_of_worker_threads() {
    let cluster = started().await;
    let workers = keyhome::setup::shared_host_workers(cluster.options.nodes);
    for id in cluster.ids() {
        let config = NodeConfig::load(&cluster.node_config(id)).expect("node.toml");
        assert_eq!(config.worker_threads, workers);
        let pid = cluster.pid(id).expect("running");
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the node's threads");
        let runtime_workers = tasks
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            // tokio names its workers `tokio-rt-worker` (older versions `tokio-runtime-worker`,
            // which `comm` cuts to 15 characters).
            .filter(|name| name.starts_with("tokio-rt-worker") || name.starts_with("tokio-runtime-w"))
            .count();
        assert_eq!(runtime_workers, workers, "node {id}");
    }
}

/// `busy_poll_us` (node/src/busy_poll.rs): nodes that busy-poll their sockets after each message
/// between them still hand a key over in order, poll while the key moves, and sleep once
/// messages stop: over an idle stretch all three use a small part of the CPU time one poller that
/// never slept would burn. A node of two worker threads, where polling cannot reach the sockets,
/// says that it does not poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_polling_nodes_hand_keys_over_and_sleep_once_messages_stop() {
    const IDLE: Duration = Duration::from_secs(2);
    let mut cluster = Cluster::layout(Options::default());
    for id in cluster.ids() {
        cluster.edit_config(id, |config| {
            config.busy_poll_us = 500;
            config.worker_threads = if id == 3 { 2 } else { 1 };
        });
        cluster.start_node(id);
    }
    cluster.wait_ready(&cluster.ids(), 1).await;
    let key = key_homed_on("polled", &[1, 2, 3], 3);
    let clients = [cluster.local_client(1).await, cluster.local_client(2).await];
    let mut last = None;
    for i in 0..200 {
        let handle = clients[i % 2].lock(&key, TTL, PATIENCE).await.expect("lock");
        assert!(last.is_none_or(|token| handle.token() > token), "tokens increase");
        last = Some(handle.token());
        handle.unlock(None).await.expect("unlock");
    }
    let polled = |id| {
        let (code, metrics) = cluster.http_get(id, "/metrics", "*/*");
        assert_eq!(code, 200, "node {id}'s /metrics");
        let line = metrics.lines().find_map(|l| l.strip_prefix("keyhome_busy_poll_seconds_total "));
        line.map(|v| v.parse::<f64>().expect("seconds"))
    };
    for id in [1, 2] {
        let seconds = polled(id).expect("a busy-polling node reports its polling");
        assert!(seconds > 0.0, "node {id} polled while the key moved between nodes");
    }
    assert_eq!(polled(3), None, "node 3 has two workers: it does not poll");
    assert!(log_lines(&cluster, 3, "busy polling is off") > 0, "and says so");
    assert_eq!(log_lines(&cluster, 1, "busy polling is off"), 0);
    let pids: Vec<u32> = cluster.ids().into_iter().map(|id| cluster.pid(id).expect("running")).collect();
    let cpu = || -> Duration { pids.iter().map(|&pid| cpu_time(pid).expect("the node runs")).sum() };
    let (before, slept) = (cpu(), Instant::now());
    tokio::time::sleep(IDLE).await;
    let (used, idle) = (cpu().saturating_sub(before), slept.elapsed());
    // A poller that never slept would keep a CPU busy the whole stretch (less only if the
    // machine gave it less); idle nodes with timers due now and then use a few per cent of one.
    assert!(used < idle / 8, "three idle nodes used {used:?} of CPU time in {idle:?}");
}

/// A lock answer the client's caller never takes is given back, not left to hold its key: the
/// key is free at once, and its next holder gets the handoff the unseen handle got (the note, not
/// a clean slate).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_given_back_frees_its_key_with_the_handoff_it_got() {
    // Had the given-back handle stayed held, the next lock would wait past PATIENCE.
    const OUTLIVES: Duration = Duration::from_secs(600);
    let cluster = started().await;
    let key = key_homed_on("given-back", &[1, 2, 3], 2);
    let first = cluster.client(3).await.lock(&key, TTL, PATIENCE).await.expect("lock");
    first.unlock(Some(b"wal=7".to_vec())).await.expect("unlock with a note");

    let mut stream = raw_connection(&cluster.local_socket(1));
    let mut call = |id: u64, request: Request| {
        send_frame(&mut stream, &LocalRequest::Call { id, request });
        match read_frame(&mut stream) {
            Some(LocalFrame::Answer { id: answered, response }) if answered == id => response,
            other => panic!("call {id} answered {other:?}"),
        }
    };
    let unseen = match call(1, Request::Lock { key: key.clone(), ttl: OUTLIVES, wait: PATIENCE }) {
        Response::Locked(locked) => locked,
        other => panic!("lock answered {other:?}"),
    };
    assert_eq!(unseen.note.as_deref(), Some(&b"wal=7"[..]));
    match call(2, Request::GiveBack { handle: unseen.handle + 1000 }) {
        Response::Error(e) => assert_eq!(e.kind, ErrorKind::Lost, "{e:?}"),
        other => panic!("giving back a handle nobody holds answered {other:?}"),
    }
    assert!(matches!(call(3, Request::GiveBack { handle: unseen.handle }), Response::Unlocked));
    match call(4, Request::GiveBack { handle: unseen.handle }) {
        Response::Error(e) => assert_eq!(e.kind, ErrorKind::Lost, "given back once: {e:?}"),
        other => panic!("a second give-back answered {other:?}"),
    }
    let next = cluster.client(2).await.lock(&key, TTL, PATIENCE).await.expect("the key is free at once");
    assert_eq!(next.note(), Some(&b"wal=7"[..]), "the handoff passes through the unseen handle");
    assert!(!next.recovered());
    next.unlock(None).await.expect("unlock");
}

/// The hello a fake node greets with: node 1, the client `app`.
fn fake_hello() -> LocalFrame {
    LocalFrame::Hello(keyhome::wire::LocalHello {
        node: NodeId(1),
        identity: "client-app.keyhome".into(),
        protocols: keyhome::wire::LOCAL_PROTOCOLS,
    })
}

/// A fake node's side of a connection from the Rust client: accepted, greeted with a hello.
fn fake_node_accepts(listener: &std::os::unix::net::UnixListener) -> std::os::unix::net::UnixStream {
    let (mut stream, _) = listener.accept().expect("accept");
    stream.set_read_timeout(Some(PATIENCE)).expect("read timeout");
    send_frame(&mut stream, &fake_hello());
    stream
}

/// The Rust client gives back a lock its caller stopped waiting for, whenever the answer comes: a
/// fake node answers one lock only after the client cancelled it, and another one before the
/// caller, still waiting but no longer polled, drops its future.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_gives_back_a_lock_answered_after_its_caller_left() {
    use tokio::sync::oneshot;

    fn request(stream: &mut std::os::unix::net::UnixStream) -> LocalRequest {
        read_frame(stream).expect("a frame from the client")
    }
    fn lock_id(request: LocalRequest) -> u64 {
        match request {
            LocalRequest::Call { id, request: Request::Lock { .. } } => id,
            other => panic!("expected a lock call, got {other:?}"),
        }
    }

    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("node.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).expect("bind");
    let (seen_tx, seen_rx) = oneshot::channel::<()>();
    let (seen2_tx, seen2_rx) = oneshot::channel::<()>();
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let (first_tx, first_rx) = oneshot::channel::<LocalRequest>();
    let node = tokio::task::spawn_blocking(move || {
        let mut stream = fake_node_accepts(&listener);
        // 1. Answered after the client's Cancel: the answer's id is no longer pending.
        let id = lock_id(request(&mut stream));
        let _ = seen_tx.send(());
        match request(&mut stream) {
            LocalRequest::Cancel { id: cancelled } => assert_eq!(cancelled, id),
            other => panic!("expected the cancel of call {id}, got {other:?}"),
        }
        send_frame(&mut stream, &LocalFrame::Answer { id, response: fake_node::locked(41, TTL) });
        let _ = first_tx.send(request(&mut stream));
        // 2. Answered while its caller still waits; the unlock call after it shows the client's
        // reader has handed the answer over before the caller goes.
        let id = lock_id(request(&mut stream));
        let _ = seen2_tx.send(());
        go_rx.blocking_recv().expect("the test goes on");
        send_frame(&mut stream, &LocalFrame::Answer { id, response: fake_node::locked(42, TTL) });
        let unlock = match request(&mut stream) {
            LocalRequest::Call { id, request: Request::Unlock { .. } } => id,
            other => panic!("expected an unlock call, got {other:?}"),
        };
        send_frame(&mut stream, &LocalFrame::Answer { id: unlock, response: Response::Unlocked });
        (id, [request(&mut stream), request(&mut stream)])
    });

    let client = Client::connect_local(&socket).await.expect("connect to the fake node");
    // Dropped once the fake node has it: the client cancels the call.
    fake_node::pending_until_seen(std::pin::pin!(client.lock(b"k", TTL, PATIENCE)), seen_rx).await;
    let give_back = |handle: u64| LocalRequest::Cast { request: Request::GiveBack { handle } };
    let first =
        tokio::time::timeout(PATIENCE, first_rx).await.expect("the client spoke").expect("the fake node");
    assert_eq!(format!("{first:?}"), format!("{:?}", give_back(41)), "a lock answered after its cancel");
    {
        let mut lock = std::pin::pin!(client.lock(b"k", TTL, PATIENCE));
        fake_node::pending_until_seen(lock.as_mut(), seen2_rx).await;
        let _ = go_tx.send(());
        client.unlock(7, None).await.expect("the fake node answers the unlock");
    } // dropped, its answer unread
    let (second, heard) =
        tokio::time::timeout(PATIENCE, node).await.expect("the client spoke").expect("the fake node");
    let mut rest: Vec<String> = heard.iter().map(|r| format!("{r:?}")).collect();
    rest.sort();
    let mut expected =
        vec![format!("{:?}", give_back(42)), format!("{:?}", LocalRequest::Cancel { id: second })];
    expected.sort();
    assert_eq!(rest, expected, "a lock answered before its caller left: cancelled and given back");
}

/// A renew that shortens a lock is applied by the node as it reads it: the client's deadline
/// shortens when the renew is sent, so a renew whose answer never comes (the call dropped here)
/// leaves no deadline later than the node's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renew_left_unanswered_already_shortened_the_deadline() {
    use tokio::sync::oneshot;

    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("node.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).expect("bind");
    let (seen_tx, seen_rx) = oneshot::channel::<()>();
    let node = tokio::task::spawn_blocking(move || {
        let mut stream = fake_node_accepts(&listener);
        match read_frame(&mut stream) {
            Some(LocalRequest::Call { id, request: Request::Lock { .. } }) => {
                send_frame(&mut stream, &LocalFrame::Answer { id, response: fake_node::locked(41, TTL) });
            }
            other => panic!("expected a lock call, got {other:?}"),
        }
        match read_frame(&mut stream) {
            Some(LocalRequest::Call { request: Request::Renew { handle: 41, .. }, .. }) => {}
            other => panic!("expected the renew of handle 41, got {other:?}"),
        }
        let _ = seen_tx.send(()); // and never answered
        while read_frame::<LocalRequest>(&mut stream).is_some() {}
    });

    let client = Client::connect_local(&socket).await.expect("connect to the fake node");
    let mut lock = client.lock(b"k", TTL, PATIENCE).await.expect("the fake node's lock");
    assert!(lock.remaining() > Duration::from_secs(10), "{:?}", lock.remaining());
    let shorter = Duration::from_secs(1);
    fake_node::pending_until_seen(std::pin::pin!(lock.renew(shorter)), seen_rx).await;
    assert!(lock.remaining() <= shorter, "{:?} left after a renew to {shorter:?}", lock.remaining());
    let _ = lock.forget();
    drop(client);
    tokio::time::timeout(PATIENCE, node).await.expect("the client went").expect("the fake node");
}

/// The socket a stranger's fake node binds, for [`fake_node_of_a_stranger`].
const STRANGER_SOCKET: &str = "KEYHOME_TEST_STRANGER_SOCKET";

/// Not a test of its own: [`a_socket_bound_by_a_stranger_is_not_taken_for_the_node`] runs it as
/// the uid [`STRANGER`]. Binds the socket `STRANGER_SOCKET` names and greets whoever connects as a
/// node would, until it is killed.
#[test]
#[ignore = "run by a_socket_bound_by_a_stranger_is_not_taken_for_the_node"]
fn fake_node_of_a_stranger() {
    let Some(path) = std::env::var_os(STRANGER_SOCKET) else { return };
    let listener = std::os::unix::net::UnixListener::bind(path).expect("bind");
    let frame = keyhome::wire::encode(&fake_hello(), MAX_CLIENT_FRAME).expect("a hello");
    let mut open = Vec::new();
    // A client that refuses the node closes at once: the hello's write may fail, and that is fine.
    while let Ok((mut stream, _)) = listener.accept() {
        if stream.write_all(&frame).is_ok() {
            open.push(stream);
        }
    }
}

/// A process of another uid that takes the socket path (here a link in a directory anyone may
/// write to, to a socket in its own directory; also the moment a restarting node has removed its
/// socket), or that binds in directories it made where anyone may make one, or is reached through
/// a link where anyone may make one, is not taken for the node: the client refuses it before
/// reading its hello, where it could have made up tokens and deadlines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_bound_by_a_stranger_is_not_taken_for_the_node() {
    use std::os::unix::fs::PermissionsExt;
    let setpriv = ["/usr/bin/setpriv", "/bin/setpriv"].into_iter().find(|p| Path::new(p).exists());
    let Some(setpriv) = setpriv.filter(|_| rustix::process::geteuid().is_root()) else {
        eprintln!("skipped: running a process as another uid needs root and setpriv");
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).expect("a shared directory");
    // The stranger binds in a directory of its own and links the node's socket name to it: the
    // directory judged is the one holding the name, not the link's target.
    let own = dir.path().join("stranger");
    let inner = own.join("inner");
    for d in [&own, &inner] {
        std::fs::create_dir(d).expect("the stranger's directories");
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        std::os::unix::fs::chown(d, Some(STRANGER), Some(STRANGER)).expect("chown");
    }
    let target = inner.join("node.sock");
    let socket = dir.path().join("node.sock");
    std::os::unix::fs::symlink(&target, &socket).expect("a link at the node's socket name");
    let mut fake = std::process::Command::new(setpriv)
        .args(["--reuid", &STRANGER.to_string(), "--regid", &STRANGER.to_string(), "--clear-groups"])
        .arg(std::env::current_exe().expect("this test binary"))
        .args(["--exact", "fake_node_of_a_stranger", "--ignored"])
        .env(STRANGER_SOCKET, &target)
        .current_dir("/")
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("run setpriv");
    let bound = Instant::now();
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(bound.elapsed() < PATIENCE, "the stranger's fake node did not bind {}", socket.display());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let result = Client::connect_local(&socket).await;
    // Nor is it through its own directories' names: it owns them, but anyone could have made the
    // first in the shared directory, and own it.
    let direct = Client::connect_local(&target).await;
    // Nor through a link, in the shared directory, to a directory root made and gave it: the
    // link's directory counts too.
    let given = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(given.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let its = given.path().join("its");
    std::fs::create_dir(&its).expect("a directory for the stranger");
    std::os::unix::fs::chown(&its, Some(STRANGER), Some(STRANGER)).expect("chown");
    std::fs::hard_link(&target, its.join("node.sock")).expect("the stranger's socket, named there too");
    std::os::unix::fs::symlink(&its, dir.path().join("link")).expect("a link to it");
    let linked = Client::connect_local(&dir.path().join("link").join("node.sock")).await;
    // A profile may name the uid its node runs as: then that uid, and only it, is the node.
    let profile = |node_uid| keyhome::config::ClientProfile {
        node: 1,
        addr: "127.0.0.1:9".into(),
        ca: "ca.pem".into(),
        cert: "cert.pem".into(),
        key: "key.pem".into(),
        socket: Some(socket.clone()),
        node_uid: Some(node_uid),
    };
    let named = Client::connect(&profile(STRANGER)).await;
    let other = Client::connect(&profile(STRANGER + 1)).await;
    let _ = fake.kill();
    let _ = fake.wait();
    assert!(named.as_ref().is_ok_and(|c| c.local_identity().is_some()), "{:?}", named.err());
    let err = other.err().expect("a node of another uid than the profile names");
    assert!(err.to_string().contains(&format!("runs as uid {STRANGER}, not uid {}", STRANGER + 1)), "{err}");
    for (result, name) in
        [(result, "the link"), (direct, "its own directories"), (linked, "a link to a directory given to it")]
    {
        let err = result
            .err()
            .unwrap_or_else(|| panic!("the stranger's socket was taken for the node through {name}"));
        let text = err.to_string();
        assert!(matches!(err, ClientError::LocalConnect { .. }), "{text}");
        assert!(
            text.contains(&format!("runs as uid {STRANGER}"))
                && text.contains("not taken for a keyhome node"),
            "{text}"
        );
    }
}

/// A `ClientLock` dropped while its thread panics (the critical section stopped halfway) is not
/// unlocked, which would tell the next holder of a clean handoff: it runs out at its deadline and
/// the next holder is told `recovered`. The fake node hears no unlock of it before the client goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_dropped_in_a_panic_is_not_unlocked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("node.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).expect("bind");
    let node = tokio::task::spawn_blocking(move || {
        let mut stream = fake_node_accepts(&listener);
        let mut heard = Vec::new();
        while let Some(request) = read_frame::<LocalRequest>(&mut stream) {
            if let LocalRequest::Call { id, request } = &request {
                let response = match request {
                    Request::Lock { .. } => fake_node::locked(41, TTL),
                    _ => Response::Unlocked,
                };
                send_frame(&mut stream, &LocalFrame::Answer { id: *id, response });
            }
            heard.push(request);
        }
        heard
    });

    let client = Client::connect_local(&socket).await.expect("connect to the fake node");
    let lock = client.lock(b"k", TTL, PATIENCE).await.expect("the fake node's lock");
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        let _held = lock;
        panic!("the critical section stopped halfway");
    }));
    assert!(panicked.is_err());
    client.unlock(7, None).await.expect("the fake node answers");
    drop(client); // the fake node reads on until every clone of the client (a background unlock's too) is gone
    let heard = tokio::time::timeout(PATIENCE, node).await.expect("the client went").expect("the fake node");
    let unlocks: Vec<u64> = heard
        .iter()
        .filter_map(|r| match r {
            LocalRequest::Call { request: Request::Unlock { handle, .. }, .. } => Some(*handle),
            _ => None,
        })
        .collect();
    assert_eq!(unlocks, vec![7], "the lock dropped in the panic was unlocked");
}

/// Local connections count with their identity's QUIC ones against the node's
/// `limits.max_connections_per_identity`: one mapped uid (a broad gid entry, say) cannot take every
/// slot of the socket. A closed connection frees its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_identity_cannot_take_every_local_connection() {
    const PER_IDENTITY: usize = 3;
    let cluster = started_with_config(Options::default(), |id, config| {
        if id == 1 {
            config.limits.max_connections_per_identity = PER_IDENTITY;
            let solo = LocalAllow {
                uid: Some(own_uid()),
                gid: None,
                role: LocalRole::Client,
                name: Some("solo".into()),
            };
            config.local.as_mut().expect("a local socket").allow = vec![solo];
        }
    })
    .await;
    // Connected and greeted (raw_connection reads the hello): the identity's connections.
    let mut held: Vec<_> = (0..PER_IDENTITY).map(|_| raw_connection(&cluster.local_socket(1))).collect();
    let first_frame = || {
        let mut stream = std::os::unix::net::UnixStream::connect(cluster.local_socket(1)).expect("connect");
        stream.set_read_timeout(Some(PATIENCE)).expect("read timeout");
        read_frame::<LocalFrame>(&mut stream)
    };
    match first_frame() {
        Some(LocalFrame::Refused(e)) => {
            assert!(e.message.contains("limits.max_connections_per_identity"), "{e:?}")
        }
        other => panic!("a connection over the cap got {other:?}"),
    }
    drop(held.pop());
    let patience = Instant::now();
    while !matches!(first_frame(), Some(LocalFrame::Hello(_))) {
        assert!(patience.elapsed() < PATIENCE, "a closed connection did not free its place");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A client that sends calls, never reads their answers and closes its sending half ends its
/// connection: the node's writer, stuck on the full socket, goes with it (within the close's
/// flush time), so the socket is closed when the connection's places are freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_does_not_keep_its_socket() {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    // A queue of answers (max_in_flight + 1) that takes every answer, so that the node reads on
    // to the close while the socket's buffer is full.
    let cluster = started_with(Options::default(), |_, local| local.max_in_flight = 1 << 16).await;
    let mut stream = raw_connection(&cluster.local_socket(1));
    for id in 0..3000 {
        send_frame(&mut stream, &LocalRequest::Call { id, request: Request::Status });
    }
    stream.shutdown(std::net::Shutdown::Write).expect("close the sending half");
    let wait = Timespec::try_from(PATIENCE).expect("a timespec");
    let mut fds = [PollFd::new(&stream, PollFlags::RDHUP)];
    let ready = poll(&mut fds, Some(&wait)).expect("poll");
    assert!(
        ready == 1 && fds[0].revents().intersects(PollFlags::RDHUP | PollFlags::HUP),
        "the node kept the socket of a client that never reads ({:?})",
        fds[0].revents()
    );
}
