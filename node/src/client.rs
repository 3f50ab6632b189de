//! The Rust client: talks to a node's client API over QUIC with a client (or operator)
//! certificate, or, on the node's host, over its local Unix socket ([`crate::local`]), where the
//! node knows the caller by its uid. [`Client::connect`] takes the socket when the profile names
//! one that exists.
//!
//! ```no_run
//! # async fn demo() -> Result<(), keyhome::client::ClientError> {
//! use std::time::Duration;
//! let profile = keyhome::config::ClientProfile::load("keyhome-dev/client-app/profile.toml".as_ref())?;
//! let client = keyhome::client::Client::connect(&profile).await?;
//! let lock = client.lock(b"orders/42", Duration::from_secs(10), Duration::from_secs(5)).await?;
//! println!("holding orders/42 with token {}", lock.token());
//! lock.unlock(Some(b"done up to row 1200".to_vec())).await?;
//! # Ok(()) }
//! ```
//!
//! # Timeouts
//!
//! Every call gives up after the client's timeout ([`DEFAULT_TIMEOUT`], or
//! [`Client::with_timeout`]) with [`ClientError::TimedOut`], so a frozen node cannot hang its
//! caller until QUIC's idle timeout. A lock call waits its `wait` plus that timeout; a
//! membership change the node's [`PROPOSE_TIMEOUT`] plus that timeout. A lock call that timed
//! out, or whose future was dropped, is withdrawn at the node, and a lock answer that comes
//! after its caller left is given back, on either transport (`quic`, `local`).
//!
//! # Pipelining
//!
//! On the local socket, [`ClientLock::unlock_nowait`] sends the unlock as a cast, which the node
//! does not answer: the next request on the connection sees its effect. [`ClientLock::relock`] unlocks
//! and locks again in one round trip (on either transport).
//!
//! # Deadlines
//!
//! A lock is valid until [`ClientLock::deadline`]: the instant this client *sent* the lock (or
//! its latest renewal) request plus the `valid_for` the node answered, on this client's
//! [`BootClock`] (which keeps counting through a suspend). The node counts `valid_for` from
//! its answer, which comes later, so this deadline never lies after the node's.

mod local;
mod quic;

pub use quic::LOCK_STREAMS;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use keyhome_delegation::{CheckAnswer, FencingToken};
use keyhome_epoch::{EpochRecord, Instant, NodeId};
use rustls::pki_types::CertificateDer;

use crate::clock::BootClock;
use crate::config::{ClientProfile, ConfigError};
use crate::duration::Human;
use crate::pki::{self, Identity, PkiError, Role};
use crate::status::Status;
use crate::wire::{
    self, ApiError, ClientEvent, ErrorKind, LocalHello, Locked, MAX_CLIENT_FRAME, PROPOSE_TIMEOUT, Proposal,
    Request, Response,
};

/// How long a call waits for its answer unless [`Client::with_timeout`] says otherwise (a lock
/// call waits its `wait` on top of it).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Pki(#[from] PkiError),
    #[error("cannot open a local socket: {0}")]
    Socket(std::io::Error),
    #[error("cannot connect to node {node} at {addr}: {reason}")]
    Connect { node: u64, addr: SocketAddr, reason: String },
    #[error("cannot reach node {node}: {reason}")]
    Resolve { node: u64, reason: String },
    #[error(
        "the certificate is {0}'s: a node certificate serves the peer protocol only. Clients need a \
         client or operator certificate (keyhome certs issue --dir DIR --client NAME, or --operator)"
    )]
    NodeCertificate(Role),
    #[error("cannot connect to the node's local socket {path}: {reason}")]
    LocalConnect { path: PathBuf, reason: String },
    #[error(
        "the node's local socket {path} serves local protocol {node}, and this client speaks {client}: \
         upgrade the older of the two (or drop `socket` from the profile to use QUIC)"
    )]
    LocalProtocol { path: PathBuf, node: wire::LocalProtocols, client: wire::LocalProtocols },
    #[error("the local connection to the node ended: {0}")]
    Closed(String),
    #[error("the connection to the node failed: {0}")]
    Connection(#[from] quinn::ConnectionError),
    #[error("talking to the node failed: {0}")]
    Wire(#[from] wire::WireError),
    #[error("the node closed the stream without an answer")]
    NoAnswer,
    #[error("the node answered something unexpected")]
    Unexpected,
    #[error("the node did not answer the {request} request within {}", Human(*.after))]
    TimedOut { request: &'static str, after: Duration },
    #[error("{}", .0.message)]
    Api(ApiError),
}

impl ClientError {
    /// The API error kind, if the node refused the request.
    pub fn kind(&self) -> Option<ErrorKind> {
        match self {
            ClientError::Api(e) => Some(e.kind),
            _ => None,
        }
    }
}

/// A connection to one node's client API. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct Client {
    transport: Transport,
    /// The clock lock deadlines are counted on.
    clock: BootClock,
    /// How long a call waits for its answer (beyond a lock's `wait`).
    timeout: Duration,
}

/// How a [`Client`] reaches its node.
#[derive(Clone)]
enum Transport {
    Quic { conn: quic::Conn, _endpoint: quinn::Endpoint },
    Local(Arc<local::LocalConn>),
}

impl Client {
    /// Connects with the files a profile names: through its local socket when it names one
    /// that exists, else over QUIC, to the first address its `addr` resolves to that answers (a
    /// name is resolved now; see [`crate::addr`]).
    pub async fn connect(profile: &ClientProfile) -> Result<Client, ClientError> {
        if let Some(socket) = &profile.socket
            && std::fs::symlink_metadata(socket).is_ok()
        {
            let conn = local::LocalConn::connect(socket, DEFAULT_TIMEOUT, profile.node_uid).await?;
            let client = Client::over(Transport::Local(Arc::new(conn)));
            let node = client.local_identity().map(|hello| hello.node.0);
            if node != Some(profile.node) {
                let reason = format!(
                    "the node on it is node {}, not node {} as the profile says",
                    node.unwrap_or_default(),
                    profile.node
                );
                return Err(ClientError::LocalConnect { path: socket.clone(), reason });
            }
            return Ok(client);
        }
        let identity = Identity::load(&profile.cert, &profile.key)?;
        let ca = pki::load_ca(&profile.ca)?;
        let node = NodeId(profile.node);
        let resolved = crate::addr::resolve(&profile.addr)
            .await
            .map_err(|reason| ClientError::Resolve { node: profile.node, reason })?;
        let mut failure = None;
        for addr in resolved {
            match Client::connect_with(node, addr, &identity, &ca).await {
                Ok(client) => return Ok(client),
                Err(e) => failure = Some(e),
            }
        }
        Err(failure.unwrap_or(ClientError::Unexpected))
    }

    /// Connects to node `node` at `addr`, presenting `identity`, trusting `ca`.
    pub async fn connect_with(
        node: NodeId,
        addr: SocketAddr,
        identity: &Identity,
        ca: &[CertificateDer<'static>],
    ) -> Result<Client, ClientError> {
        if let Ok(role @ Role::Node(_)) = identity.role() {
            return Err(ClientError::NodeCertificate(role));
        }
        let (endpoint, conn) = handshake(node, addr, identity, ca).await?;
        // A TLS 1.3 client completes its handshake before the node has checked the client's
        // certificate: wait for the node's confirmation, so that a refused certificate fails
        // here, with the node's reason, rather than as a lost connection on the first request.
        confirmed(&conn).await.map_err(|e| ClientError::Connect {
            node: node.0,
            addr,
            reason: explain(node, addr, &e.to_string()),
        })?;
        Ok(Client::over(Transport::Quic { conn: quic::Conn::new(conn), _endpoint: endpoint }))
    }

    /// Connects to the node's local socket at `socket`; the node identifies this process by its
    /// uid (or gid), as its `[[local.allow]]` entries map them, and must run as root, as this
    /// process's uid or as the owner of the socket's directory ([`Client::connect`] with a
    /// profile's `node_uid` names the node's uid instead).
    pub async fn connect_local(socket: &Path) -> Result<Client, ClientError> {
        let conn = local::LocalConn::connect(socket, DEFAULT_TIMEOUT, None).await?;
        Ok(Client::over(Transport::Local(Arc::new(conn))))
    }

    fn over(transport: Transport) -> Client {
        Client { transport, clock: BootClock::new(), timeout: DEFAULT_TIMEOUT }
    }

    /// On the local socket: the node's id and the identity it took this process for.
    pub fn local_identity(&self) -> Option<&LocalHello> {
        match &self.transport {
            Transport::Local(conn) => Some(&conn.hello),
            Transport::Quic { .. } => None,
        }
    }

    /// This client with calls timing out after `timeout` (a lock call: after its `wait` plus
    /// `timeout`).
    pub fn with_timeout(mut self, timeout: Duration) -> Client {
        self.timeout = timeout;
        self
    }

    /// How long a call waits for its answer.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The clock [`ClientLock::deadline`] is read on.
    pub fn clock(&self) -> BootClock {
        self.clock
    }

    /// Whether the connection to the node has ended (every further call fails).
    pub fn is_closed(&self) -> bool {
        match &self.transport {
            Transport::Quic { conn, .. } => conn.conn.close_reason().is_some(),
            Transport::Local(conn) => conn.is_closed(),
        }
    }

    /// Sends `request` and reads its answer, giving up after `timeout`.
    async fn call(&self, request: Request, timeout: Duration) -> Result<Response, ClientError> {
        let name = request.name();
        let exchange = async {
            let response = match &self.transport {
                // A lock answer that crosses the withdrawal of its call is read on for as long as
                // a call may wait, however short this client's timeout.
                Transport::Quic { conn, .. } => {
                    quic::call(conn, request, self.timeout.max(DEFAULT_TIMEOUT)).await?
                }
                Transport::Local(conn) => conn.call(request).await?,
            };
            match response {
                Response::Error(e) => Err(ClientError::Api(e)),
                response => Ok(response),
            }
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| ClientError::TimedOut { request: name, after: timeout })?
    }

    /// Sends `request` without waiting for its answer. On the local socket the next request
    /// sees its effect; over QUIC it goes on its own stream in the background, unordered.
    async fn send(&self, request: Request) -> Result<(), ClientError> {
        match &self.transport {
            Transport::Local(conn) => conn.send(request).await,
            Transport::Quic { .. } => {
                let client = self.clone();
                tokio::spawn(async move {
                    let timeout = client.timeout;
                    let _ = client.call(request, timeout).await;
                });
                Ok(())
            }
        }
    }

    /// A lock answer to a request sent at `sent`, as a guard.
    fn admitted(&self, response: Response, sent: Instant) -> Result<ClientLock, ClientError> {
        match response {
            Response::Locked(info) => {
                let deadline = sent + info.valid_for;
                Ok(ClientLock { client: self.clone(), info, deadline, done: false })
            }
            _ => Err(ClientError::Unexpected),
        }
    }

    /// Locks `key` for `ttl`, waiting at most `wait` (and the client's timeout on top for the
    /// answer). The guard unlocks when dropped.
    pub async fn lock(&self, key: &[u8], ttl: Duration, wait: Duration) -> Result<ClientLock, ClientError> {
        let sent = self.clock.now();
        let request = Request::Lock { key: key.to_vec(), ttl, wait };
        let response = self.call(request, wait.saturating_add(self.timeout)).await?;
        self.admitted(response, sent)
    }

    /// Locks `key` only if the node can admit it at once.
    pub async fn try_lock(&self, key: &[u8], ttl: Duration) -> Result<ClientLock, ClientError> {
        self.lock(key, ttl, Duration::ZERO).await
    }

    /// Extends handle `handle` to `ttl` from now; returns how long it is valid from the node's
    /// answer (count it from the send instant: see [`ClientLock::renew`]).
    pub async fn renew(&self, handle: u64, ttl: Duration) -> Result<Duration, ClientError> {
        match self.call(Request::Renew { handle, ttl }, self.timeout).await? {
            Response::Renewed { valid_for } => Ok(valid_for),
            _ => Err(ClientError::Unexpected),
        }
    }

    /// Ends handle `handle`, leaving `note` for the next holder.
    pub async fn unlock(&self, handle: u64, note: Option<Vec<u8>>) -> Result<(), ClientError> {
        match self.call(Request::Unlock { handle, note }, self.timeout).await? {
            Response::Unlocked => Ok(()),
            _ => Err(ClientError::Unexpected),
        }
    }

    /// Whether `key` is held with `token` now, and if not, whether it was superseded (see
    /// [`CheckAnswer`]).
    pub async fn check(&self, key: &[u8], token: FencingToken) -> Result<CheckAnswer, ClientError> {
        match self.call(Request::Check { key: key.to_vec(), token }, self.timeout).await? {
            Response::Checked { answer } => Ok(answer),
            _ => Err(ClientError::Unexpected),
        }
    }

    pub async fn status(&self) -> Result<Status, ClientError> {
        match self.call(Request::Status, self.timeout).await? {
            Response::Status(status) => Ok(*status),
            _ => Err(ClientError::Unexpected),
        }
    }

    pub async fn epoch(&self) -> Result<EpochRecord, ClientError> {
        match self.call(Request::EpochShow, self.timeout).await? {
            Response::Epoch(record) => Ok(*record),
            _ => Err(ClientError::Unexpected),
        }
    }

    /// Proposes a membership change (operator certificate); returns the epoch that includes it.
    /// The node checks a plain [`keyhome_epoch::Change`] first and refuses one that names a new member that
    /// does not answer, or that leaves no majority it reaches; [`Proposal::forced`] skips that.
    pub async fn propose(&self, proposal: impl Into<Proposal>) -> Result<u64, ClientError> {
        let request = Request::Propose(proposal.into());
        match self.call(request, PROPOSE_TIMEOUT.saturating_add(self.timeout)).await? {
            Response::Proposed { epoch } => Ok(epoch),
            _ => Err(ClientError::Unexpected),
        }
    }

    /// **Unsafe** recovery of a cluster that lost its majority for good (operator certificate);
    /// returns the new epoch's number. See docs/operations.md, "Disaster recovery".
    pub async fn recover_unsafe(
        &self,
        members: Vec<keyhome_epoch::Member>,
        stopped: Vec<NodeId>,
        skip: u64,
    ) -> Result<u64, ClientError> {
        match self.call(Request::RecoverUnsafe { members, stopped, skip }, self.timeout).await? {
            Response::Proposed { epoch } => Ok(epoch),
            _ => Err(ClientError::Unexpected),
        }
    }

    /// Lost-handle events for the handles of this connection, once the node confirmed the
    /// subscription. One live event stream per connection: a second fails
    /// ([`ErrorKind::Invalid`]) while the first is open.
    pub async fn events(&self) -> Result<Events, ClientError> {
        let open = async {
            match &self.transport {
                Transport::Quic { conn, .. } => {
                    let (mut send, mut recv) = conn.conn.open_bi().await?;
                    wire::write_frame(&mut send, &Request::Subscribe, MAX_CLIENT_FRAME).await?;
                    match wire::read_frame(&mut recv, MAX_CLIENT_FRAME).await? {
                        Some(Response::Subscribed) => {
                            let frames = tokio_util::codec::FramedRead::new(recv, crate::local::codec());
                            Ok(Events(EventSource::Quic { _send: send, frames }))
                        }
                        Some(Response::Error(e)) => Err(ClientError::Api(e)),
                        Some(_) => Err(ClientError::Unexpected),
                        None => Err(ClientError::NoAnswer),
                    }
                }
                Transport::Local(conn) => Ok(Events(EventSource::Local(conn.subscribe().await?))),
            }
        };
        tokio::time::timeout(self.timeout, open)
            .await
            .map_err(|_| ClientError::TimedOut { request: Request::Subscribe.name(), after: self.timeout })?
    }
}

/// A QUIC connection to node `node` at `addr`, its certificate checked against `node`'s id.
async fn handshake(
    node: NodeId,
    addr: SocketAddr,
    identity: &Identity,
    ca: &[CertificateDer<'static>],
) -> Result<(quinn::Endpoint, quinn::Connection), ClientError> {
    let config = pki::client_config(identity, ca, pki::ALPN_CLIENT)?;
    let bind: SocketAddr =
        if addr.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" }.parse().map_err(|_| ClientError::Unexpected)?;
    let endpoint = quinn::Endpoint::client(bind).map_err(ClientError::Socket)?;
    let connect_err =
        |reason: String| ClientError::Connect { node: node.0, addr, reason: explain(node, addr, &reason) };
    let conn = endpoint
        .connect_with(config, addr, &pki::server_name(node))
        .map_err(|e| connect_err(e.to_string()))?
        .await
        .map_err(|e| connect_err(e.to_string()))?;
    Ok((endpoint, conn))
}

/// A connection failure's `reason`, with what to do about the common ones: nothing answers at
/// `addr`, or something answers whose certificate is not node `node`'s.
fn explain(node: NodeId, addr: SocketAddr, reason: &str) -> String {
    if reason.contains("timed out") {
        format!("{reason}: is a node running at {addr}? (keyhome run --config …, or keyhome dev)")
    } else if pki::names_another_node(reason) {
        format!(
            "the node at {addr} is not node {node} (its certificate names another node): check the node id \
             (`node = …` in the profile) against the node at that address ({reason})"
        )
    } else {
        reason.to_string()
    }
}

/// Resolves once the node has confirmed the handshake (QUIC HANDSHAKE_DONE, sent after it verified
/// the client's certificate), or fails with why the connection closed (at the latest at the idle
/// timeout).
async fn confirmed(conn: &quinn::Connection) -> Result<(), quinn::ConnectionError> {
    let mut wait = Duration::from_millis(1);
    loop {
        if conn.stats().frame_rx.handshake_done > 0 {
            return Ok(());
        }
        if let Some(e) = conn.close_reason() {
            return Err(e);
        }
        tokio::select! {
            e = conn.closed() => return Err(e),
            _ = tokio::time::sleep(wait) => {}
        }
        wait = (wait * 2).min(Duration::from_millis(20));
    }
}

/// A stream of [`ClientEvent`]s.
pub struct Events(EventSource);

enum EventSource {
    /// Framed with a buffer of its own, so a `next` dropped halfway through a frame loses nothing.
    Quic {
        _send: quinn::SendStream,
        frames: tokio_util::codec::FramedRead<quinn::RecvStream, tokio_util::codec::LengthDelimitedCodec>,
    },
    Local(tokio::sync::mpsc::Receiver<ClientEvent>),
}

impl Events {
    /// The next event; `None` once the connection ends. Cancel-safe on both transports (a
    /// `select!` may drop it): an event half read stays for the next call.
    pub async fn next(&mut self) -> Option<ClientEvent> {
        use futures_util::StreamExt;
        match &mut self.0 {
            EventSource::Quic { frames, .. } => wire::decode(&frames.next().await?.ok()?).ok(),
            EventSource::Local(rx) => rx.recv().await,
        }
    }
}

/// A lock held through a [`Client`]. Dropping it unlocks in the background (without a note),
/// except while its thread panics (see its `Drop`).
#[must_use = "dropping the lock unlocks it"]
pub struct ClientLock {
    client: Client,
    info: Locked,
    /// The send instant of the latest lock or renewal request plus its `valid_for`.
    deadline: Instant,
    done: bool,
}

impl ClientLock {
    /// The handle number, for [`Client::renew`] and [`Client::unlock`].
    pub fn handle(&self) -> u64 {
        self.info.handle
    }

    pub fn token(&self) -> FencingToken {
        self.info.token
    }

    /// How long the lock was valid when the node answered (the lock or the latest renewal).
    pub fn valid_for(&self) -> Duration {
        self.info.valid_for
    }

    /// Until when the lock is surely valid, on [`Client::clock`]: the send instant of the lock
    /// or latest renewal request plus the `valid_for` answered. No other holder of the key is
    /// admitted before it (guarantees.md, 6); after it, the lock may have passed on.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// How long until [`ClientLock::deadline`] (zero once it has passed).
    pub fn remaining(&self) -> Duration {
        self.client.clock.until(self.deadline)
    }

    pub fn note(&self) -> Option<&[u8]> {
        self.info.note.as_deref()
    }

    pub fn recovered(&self) -> bool {
        self.info.recovered
    }

    /// Extends the lock to `ttl` from now; the deadline becomes this request's send instant
    /// plus the answered `valid_for`, which may be no later than before (the delegation has not
    /// been renewed yet, or the key was recalled).
    ///
    /// A renew may also shorten the lock (a `ttl` shorter than the time left), and the node
    /// applies it as it reads the request: until the answer comes (and if it never does, the call
    /// failing or dropped) the deadline counts on no more than `ttl` from the send instant, less
    /// the largest clock-rate margin an epoch may set.
    pub async fn renew(&mut self, ttl: Duration) -> Result<Duration, ClientError> {
        let sent = self.client.clock.now();
        let shortest = sent + keyhome_epoch::time::rate_shrink(ttl, keyhome_epoch::MAX_CLOCK_RATE_PPM);
        self.deadline = self.deadline.min(shortest);
        let valid_for = self.client.renew(self.info.handle, ttl).await?;
        self.info.valid_for = valid_for;
        self.deadline = sent + valid_for;
        Ok(valid_for)
    }

    /// Unlocks, leaving `note` for the next holder. A note the node refuses as too large
    /// (`Invalid`) leaves the lock held: unlock it by number ([`Client::unlock`] with
    /// [`ClientLock::handle`], read before) with a shorter note.
    pub async fn unlock(mut self, note: Option<Vec<u8>>) -> Result<(), ClientError> {
        self.done = true;
        self.client.unlock(self.info.handle, note).await
    }

    /// Ends the lock as if it had never been admitted, for a holder that did nothing under it:
    /// the key's next holder gets the note and `recovered` flag this lock got
    /// ([`Request::GiveBack`]), where [`ClientLock::unlock`] would tell it of a clean handoff.
    pub async fn give_back(mut self) -> Result<(), ClientError> {
        self.done = true;
        let request = Request::GiveBack { handle: self.info.handle };
        match self.client.call(request, self.client.timeout).await? {
            Response::Unlocked => Ok(()),
            _ => Err(ClientError::Unexpected),
        }
    }

    /// Unlocks without waiting for the node's answer (its errors are not seen). On the local
    /// socket it goes as a cast, which the node does not answer at all, and the next request on
    /// the connection sees the key unlocked; over QUIC the unlock goes in the background.
    pub async fn unlock_nowait(mut self, note: Option<Vec<u8>>) -> Result<(), ClientError> {
        self.done = true;
        self.client.send(Request::Unlock { handle: self.info.handle, note }).await
    }

    /// Unlocks (leaving `note`) and locks `key` as [`Client::lock`] does, in one round trip.
    /// If the unlock fails, nothing is locked. The guard is used up either way (after a failed
    /// call the old handle may still hold its key until its deadline).
    pub async fn relock(
        mut self,
        note: Option<Vec<u8>>,
        key: &[u8],
        ttl: Duration,
        wait: Duration,
    ) -> Result<ClientLock, ClientError> {
        self.done = true;
        let client = self.client.clone();
        let sent = client.clock.now();
        let request = Request::Relock { handle: self.info.handle, note, key: key.to_vec(), ttl, wait };
        let response = client.call(request, wait.saturating_add(client.timeout)).await?;
        client.admitted(response, sent)
    }

    /// Keeps the lock held after the guard is gone (until its ttl, or an explicit unlock by
    /// handle); returns the handle number.
    pub fn forget(mut self) -> u64 {
        self.done = true;
        self.info.handle
    }
}

impl Drop for ClientLock {
    /// Unlocks in the background, without a note; while the thread panics (the critical section
    /// stopped halfway), leaves the lock to run out at its deadline instead, so that the next
    /// holder is told `recovered` rather than of a clean handoff.
    fn drop(&mut self) {
        if self.done || std::thread::panicking() {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let client = self.client.clone();
            let handle = self.info.handle;
            rt.spawn(async move {
                let _ = client.unlock(handle, None).await;
            });
        }
    }
}
