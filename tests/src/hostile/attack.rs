//! What an attacker does to a node's transport. Each function is one move; the test and the
//! long run compose them.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keyhome::pki::{self, Identity};
use keyhome::wire::{self, ApiError, MAX_CLIENT_FRAME, Request, Response};
use keyhome_epoch::NodeId;
use quinn::crypto::rustls::QuicClientConfig;
use quinn::rustls;
use quinn::{ClientConfig, Connection, ConnectionError, Endpoint};
use tokio::net::UdpSocket;
use tokio::task::JoinSet;

use super::Target;
use crate::cluster::PATIENCE;

/// A client endpoint on `ip` (a loopback address; any port), for connections from that address.
pub fn endpoint(ip: IpAddr) -> Endpoint {
    Endpoint::client(SocketAddr::new(ip, 0)).expect("a client socket on loopback")
}

/// The client configuration presenting `identity` to `target` (it verifies the node).
pub fn client_config(target: &Target, identity: &Identity) -> ClientConfig {
    pki::client_config(identity, &target.ca, pki::ALPN_CLIENT).expect("a client configuration")
}

/// A client configuration that verifies the node but presents no certificate at all.
pub fn no_cert_config(target: &Target) -> ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    for cert in &target.ca {
        roots.add(cert.clone()).expect("a CA certificate");
    }
    let mut tls = rustls::ClientConfig::builder_with_provider(pki::crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![pki::ALPN_CLIENT.to_vec()];
    ClientConfig::new(Arc::new(QuicClientConfig::try_from(tls).expect("a QUIC TLS configuration")))
}

/// How a connection attempt ended.
#[derive(Debug)]
pub enum Outcome {
    /// Open, and answering requests.
    Open(Connection),
    /// Closed by the node with this application close code and reason.
    Closed { code: u64, reason: String },
    /// Failed otherwise (a refused handshake, a timeout, …).
    Failed(String),
}

impl Outcome {
    pub fn is_open(&self) -> bool {
        matches!(self, Outcome::Open(_))
    }
}

fn outcome_of(e: ConnectionError) -> Outcome {
    match e {
        ConnectionError::ApplicationClosed(close) => Outcome::Closed {
            code: close.error_code.into_inner(),
            reason: String::from_utf8_lossy(&close.reason).into_owned(),
        },
        other => Outcome::Failed(other.to_string()),
    }
}

/// Connects to `target` with `config` and asks for the node's status, to learn whether the node
/// kept the connection (a connection over a cap is closed before any request is served).
pub async fn open(endpoint: &Endpoint, target: &Target, config: &ClientConfig) -> Outcome {
    let conn = match connect(endpoint, target, config).await {
        Ok(conn) => conn,
        Err(outcome) => return outcome,
    };
    match tokio::time::timeout(PATIENCE, call(&conn, &Request::Status)).await {
        Ok(Ok(_)) => Outcome::Open(conn),
        Ok(Err(_)) => match tokio::time::timeout(PATIENCE, conn.closed()).await {
            Ok(e) => outcome_of(e),
            Err(_) => Outcome::Failed("the request failed but the connection stayed open".into()),
        },
        Err(_) => Outcome::Failed("no answer".into()),
    }
}

/// A QUIC connection to `target` with `config`, its handshake done (whether the node keeps it is
/// not known yet: see [`open`]). Its stream credit is untouched.
pub async fn connect(
    endpoint: &Endpoint,
    target: &Target,
    config: &ClientConfig,
) -> Result<Connection, Outcome> {
    let name = pki::server_name(NodeId(target.node));
    let connecting = endpoint
        .connect_with(config.clone(), target.addr, &name)
        .map_err(|e| Outcome::Failed(e.to_string()))?;
    connecting.await.map_err(outcome_of)
}

/// A connection of [`Target::mallory`] from 127.0.0.1, and its endpoint (which must outlive it).
pub async fn mallory(target: &Target) -> (Endpoint, Connection) {
    let endpoint = endpoint("127.0.0.1".parse().expect("loopback"));
    match open(&endpoint, target, &client_config(target, &target.mallory)).await {
        Outcome::Open(conn) => (endpoint, conn),
        other => panic!("mallory cannot connect: {other:?}"),
    }
}

/// A peer connection to `target` from `ip` presenting `identity` (a node's): what a second
/// process running as that node opens.
pub async fn peer_connection(target: &Target, identity: &Identity, ip: IpAddr) -> (Endpoint, Connection) {
    let config = pki::client_config(identity, &target.ca, pki::ALPN_PEER).expect("a peer configuration");
    let endpoint = endpoint(ip);
    let conn = endpoint
        .connect_with(config, target.addr, &pki::server_name(NodeId(target.node)))
        .expect("a connection attempt")
        .await
        .expect("a peer connection");
    (endpoint, conn)
}

/// Opens `n` connections, `concurrency` at a time, from `endpoint`.
pub async fn open_many(
    endpoint: &Endpoint,
    target: &Arc<Target>,
    config: &ClientConfig,
    n: usize,
    concurrency: usize,
) -> Vec<Outcome> {
    let mut outcomes = Vec::with_capacity(n);
    let mut tasks = JoinSet::new();
    for _ in 0..n {
        if tasks.len() >= concurrency.max(1)
            && let Some(done) = tasks.join_next().await
        {
            outcomes.push(done.expect("a connection task"));
        }
        let (endpoint, target, config) = (endpoint.clone(), Arc::clone(target), config.clone());
        tasks.spawn(async move { open(&endpoint, &target, &config).await });
    }
    while let Some(done) = tasks.join_next().await {
        outcomes.push(done.expect("a connection task"));
    }
    outcomes
}

/// Sends one request and reads its answer.
pub async fn call(conn: &Connection, request: &Request) -> Result<Response, String> {
    let frame = wire::encode(request, MAX_CLIENT_FRAME).map_err(|e| e.to_string())?;
    send_raw(conn, &frame).await
}

/// Sends `bytes` on a new request stream, finishes it, and reads the node's answer.
pub async fn send_raw(conn: &Connection, bytes: &[u8]) -> Result<Response, String> {
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
    send.write_all(bytes).await.map_err(|e| e.to_string())?;
    let _ = send.finish();
    match wire::read_frame::<Response>(&mut recv, MAX_CLIENT_FRAME).await {
        Ok(Some(response)) => Ok(response),
        Ok(None) => Err("no answer".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// The first `prefix` bytes (1 to 4) of a length prefix claiming `claimed` bytes, then `body`
/// bytes of that body: a request that never completes.
pub fn stalling(claimed: u32, prefix: usize, body: usize) -> Arc<[u8]> {
    let mut bytes = claimed.to_be_bytes()[..prefix.clamp(1, 4)].to_vec();
    if prefix >= 4 {
        bytes.resize(4 + body, 0);
    }
    bytes.into()
}

/// A request stream that sends `bytes` and then nothing, not even its end; resolves to the
/// node's answer (the error it was refused with) or why there was none.
pub async fn stall(conn: Connection, bytes: Arc<[u8]>) -> Result<ApiError, String> {
    let (send, recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
    stall_on(send, recv, bytes).await
}

async fn stall_on(
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    bytes: Arc<[u8]>,
) -> Result<ApiError, String> {
    // Stopped by the node when it gives up on the request (the write may be blocked by flow
    // control until then).
    let _ = send.write_all(&bytes).await;
    let answer = wire::read_frame::<Response>(&mut recv, MAX_CLIENT_FRAME).await;
    drop(send);
    match answer {
        Ok(Some(Response::Error(e))) => Ok(e),
        other => Err(format!("{other:?}")),
    }
}

/// Stalls request streams of `bytes` on `conn` one after another (a new one as soon as the
/// node gives up on the last) until `end`; returns how many the node refused.
pub async fn keep_stalling(conn: Connection, bytes: Arc<[u8]>, end: Instant) -> u64 {
    let mut refused = 0;
    while let Some(left) = end.checked_duration_since(Instant::now()) {
        match tokio::time::timeout(left, stall(conn.clone(), Arc::clone(&bytes))).await {
            Ok(Ok(_)) => refused += 1,
            Ok(Err(_)) | Err(_) => break,
        }
    }
    refused
}

/// Opens `streams` request streams on each of `conns` (returning once all are open, so the
/// connections' stream credit is taken) and stalls each with `bytes`; the tasks resolve as
/// [`stall`]'s do.
pub async fn stall_many(
    conns: &[Connection],
    streams: usize,
    bytes: &Arc<[u8]>,
) -> Result<JoinSet<Result<ApiError, String>>, ConnectionError> {
    let mut tasks = JoinSet::new();
    for conn in conns {
        for _ in 0..streams {
            let (send, recv) = conn.open_bi().await?;
            tasks.spawn(stall_on(send, recv, Arc::clone(bytes)));
        }
    }
    Ok(tasks)
}

/// A frame of `request` with `extra` bytes after the value, the prefix counting them.
pub fn with_trailing_bytes(request: &Request, extra: usize) -> Vec<u8> {
    let mut frame = wire::encode(request, MAX_CLIENT_FRAME).expect("a small request");
    frame.resize(frame.len() + extra, 0);
    let len = u32::try_from(frame.len() - 4).expect("a small frame");
    frame[..4].copy_from_slice(&len.to_be_bytes());
    frame
}

/// A frame whose body is no request at all.
pub fn garbage_frame() -> Vec<u8> {
    vec![0, 0, 0, 3, 0xff, 0xff, 0xff]
}

/// Sends malformed requests on `conn`, one after another, until `duration` has passed; returns
/// how many the node answered with an error.
pub async fn malformed_flood(conn: &Connection, duration: Duration) -> u64 {
    let end = Instant::now() + duration;
    let frame = garbage_frame();
    let mut answered = 0;
    while Instant::now() < end {
        if let Ok(Response::Error(_)) = send_raw(conn, &frame).await {
            answered += 1;
        }
    }
    answered
}

/// What a handshake flood did.
#[derive(Clone, Copy, Debug, Default)]
pub struct Flood {
    /// Handshakes started.
    pub attempts: u64,
    /// Handshakes that the client saw complete (the node then refused the certificate).
    pub completed: u64,
    /// Handshakes given up on, unanswered within the flood's patience.
    pub abandoned: u64,
}

/// Handshakes with `configs` in turn (certificates the node refuses), from `endpoints` in turn,
/// `concurrency` at a time, until `duration` has passed. An attempt the node does not answer
/// within `patience` is given up for a new one, and a completed handshake is dropped at once:
/// the attacker waits for nothing.
pub async fn handshake_flood(
    endpoints: &[Endpoint],
    target: &Target,
    configs: &[ClientConfig],
    concurrency: usize,
    duration: Duration,
    patience: Duration,
) -> Flood {
    let end = tokio::time::Instant::now() + duration;
    let name = pki::server_name(NodeId(target.node));
    let mut tasks = JoinSet::new();
    for worker in 0..concurrency.max(1) {
        let endpoint = endpoints[worker % endpoints.len()].clone();
        let configs = configs.to_vec();
        let (addr, name) = (target.addr, name.clone());
        tasks.spawn(async move {
            let mut flood = Flood::default();
            for i in worker.. {
                let Some(config) = configs.get(i % configs.len().max(1)) else { break };
                let Ok(connecting) = endpoint.connect_with(config.clone(), addr, &name) else { break };
                flood.attempts += 1;
                let give_up = end.min(tokio::time::Instant::now() + patience);
                match tokio::time::timeout_at(give_up, connecting).await {
                    Ok(Ok(conn)) => {
                        flood.completed += 1;
                        conn.close(0u32.into(), b"");
                    }
                    Ok(Err(_)) => {}
                    Err(_) => flood.abandoned += 1,
                }
                if tokio::time::Instant::now() >= end {
                    break;
                }
            }
            flood
        });
    }
    let mut total = Flood::default();
    while let Some(done) = tasks.join_next().await {
        let flood = done.expect("a flood task");
        total.attempts += flood.attempts;
        total.completed += flood.completed;
        total.abandoned += flood.abandoned;
    }
    total
}

/// `n` QUIC Initial packets a client sends to open a connection to `target` with `config`, each
/// with its own connection id, caught on a local socket before they reach the node. Replayed to
/// the node ([`replay_initials`]), each starts a handshake whose client never answers.
pub async fn record_initials(target: &Target, config: &ClientConfig, n: usize) -> Vec<Vec<u8>> {
    let recorder = UdpSocket::bind("127.0.0.1:0").await.expect("a recorder socket");
    let at = recorder.local_addr().expect("the recorder's address");
    let name = pki::server_name(NodeId(target.node));
    let mut initials = Vec::with_capacity(n);
    // Kept open until every packet is caught, so that none of them sends a close meanwhile.
    let mut pending = Vec::with_capacity(n);
    for _ in 0..n {
        let endpoint = endpoint(at.ip());
        let from = endpoint.local_addr().expect("the endpoint's address");
        let connecting = endpoint.connect_with(config.clone(), at, &name).expect("a connection attempt");
        let mut buf = vec![0u8; 4096];
        let packet = tokio::time::timeout(PATIENCE, async {
            loop {
                let (len, source) = recorder.recv_from(&mut buf).await.expect("the recorder reads");
                if source == from {
                    return buf[..len].to_vec();
                }
            }
        })
        .await
        .expect("the client sends its Initial");
        initials.push(packet);
        pending.push((endpoint, connecting));
    }
    for (endpoint, _) in &pending {
        endpoint.close(0u32.into(), b"");
    }
    initials
}

/// Sends each of `initials` to `to` from its own new socket on `ip`: the node sees as many
/// connection attempts from `ip` whose clients never answer. The sockets are returned so that
/// they stay open (the node's answers are never read).
pub async fn replay_initials(initials: &[Vec<u8>], ip: IpAddr, to: SocketAddr) -> Vec<UdpSocket> {
    let mut sockets = Vec::with_capacity(initials.len());
    for packet in initials {
        let socket = UdpSocket::bind(SocketAddr::new(ip, 0)).await.expect("an attack socket on loopback");
        socket.send_to(packet, to).await.expect("send an Initial");
        sockets.push(socket);
    }
    sockets
}
