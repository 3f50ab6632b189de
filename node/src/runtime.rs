//! The node runtime: drives one [`Core`] on tokio, with QUIC links to every peer, a persistence
//! thread in front of redb, and a timer task.
//!
//! # Threads and locks
//!
//! The core locks its own parts (its membership and each key shard: see [`crate::core`]). Every
//! input (a peer frame, a client request, an embedded call, a timer, a finished write) calls into
//! the core with a fresh reading of the [`BootClock`] and a [`Carrier`], which carries out every
//! [`Output`] under the lock of the part that produced it: frames go to the links (by `try_send`
//! into each peer's bounded queue), writes to the persistence thread (in the order the core
//! produced them), outcomes to the callers waiting for them ([`Replies`]; a lock's through
//! [`callers`], which the simulation runs too, with a caller's going away interleaved with the
//! core's decision). Nothing under a lock waits for I/O. This is the only glue the simulation does
//! not run: it replaces exactly these sockets, disks and clocks.
//!
//! # Fail-stop
//!
//! In the `keyhome` binary a panic anywhere stops the process (it installs an aborting panic hook,
//! and release builds abort on panic). A program that embeds the node with unwinding gets less: a
//! panicking task ends alone, though a core part whose lock a panicking thread held is never used
//! again (`core::lock` aborts on a poisoned mutex); docs/api.md asks embedders for
//! `panic = "abort"`.
//!
//! # Durability
//!
//! The first epoch `Ready` of a run (the new incarnation) is committed before the node opens its
//! port, so no grant under an incarnation that might not survive a crash can leave. Afterwards the
//! persistence thread commits each job with an fsync and only then queues its messages and calls
//! `advance`. A failed commit stops the node: the core sends nothing more and the process exits.
//!
//! # Peer links
//!
//! Each node dials each peer it has something to send to, once, and keeps that connection and one
//! unidirectional stream open for everything it sends; frames it receives arrive on the peers'
//! own connections. (Two connections per pair, one per direction, so no dial race ever has to be
//! resolved.) A link that fails drops the frames queued behind it, since the cores resend what
//! matters, and reconnects after a jittered exponential backoff (50 ms doubling to 2 s).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyhome_delegation::{Handle, HolderConfig, HomeConfig, LockError, Ticket};
use keyhome_epoch::{EpochNode, Instant, NodeId, ProposeError, Storage, Write};
use keyhome_ring::ROUTING_VERSION;
use tokio::sync::{Notify, mpsc, oneshot, watch};

use crate::admission::{Admission, Incident, Limits, Verdict};
use crate::busy_poll::BusyPoll;
use crate::clock::{BootClock, MAX_SLEEP};
use crate::config::{ConfigError, GenesisFile, NodeConfig};
use crate::core::callers::{self, LockCallers, LockResult, Reply};
pub(crate) use crate::core::lock;
use crate::core::{Core, Output, Sink};
use crate::pki::{self, Identity, Role};
use crate::store::{RedbStore, StoreError};
use crate::wire::{self, CloseCode, MAX_HELLO_FRAME, MAX_PEER_FRAME, PeerFrame};

/// Frames queued per peer link before further frames to that peer are dropped.
const LINK_QUEUE: usize = 4096;
/// Bytes quinn buffers for one connection attempt before the node decides on it (beyond its
/// first packet): a client's handshake flight, with room to spare.
const INCOMING_BUFFER: u64 = 16 << 10;
/// Reconnection backoff bounds.
const BACKOFF_MIN: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// Why a node could not start or had to stop.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Pki(#[from] pki::PkiError),
    #[error(
        "the certificate {path} is {found}'s, but this node is node {expected}: give node {expected}'s certificate (keyhome certs issue --node {expected})"
    )]
    WrongIdentity { path: std::path::PathBuf, found: Role, expected: NodeId },
    #[error("the store {path} belongs to node {found}, but the configuration says node {expected}")]
    StoreIdentity { path: std::path::PathBuf, found: NodeId, expected: NodeId },
    #[error(
        "the store {store} was created from another genesis (digest {found}) than {genesis} (digest {expected}): is the data directory another cluster's, or was the genesis file changed?"
    )]
    StoreGenesis { store: std::path::PathBuf, genesis: std::path::PathBuf, found: String, expected: String },
    #[error("cannot create the data directory {path}: {source}")]
    DataDir { path: std::path::PathBuf, source: std::io::Error },
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: SocketAddr, source: std::io::Error },
    #[error("the local socket: {0}")]
    Local(#[from] crate::socket_file::SocketFileError),
    #[error("a durable write failed, so the node stopped: {0}")]
    WriteFailed(String),
    #[error(transparent)]
    Http(#[from] crate::http::StartError),
    #[cfg(feature = "bug-injection")]
    #[error("{0}")]
    InjectBug(String),
}

/// Where the outcome of a pending lock goes.
pub(crate) type LockReply = oneshot::Sender<LockResult>;

impl Reply for LockReply {
    fn send(self, result: LockResult) -> Result<(), LockResult> {
        oneshot::Sender::send(self, result)
    }
}

/// A persistence job: make `writes` durable, then tell the core `number` is.
struct PersistJob {
    number: u64,
    writes: Vec<Write>,
}

/// Where the answer to a token check goes.
pub(crate) type CheckSender = oneshot::Sender<Option<crate::core::CheckReply>>;
/// Where the outcome of an operator change goes.
pub(crate) type ProposalReply = oneshot::Sender<Result<u64, ProposeError>>;

/// The callers waiting for the core's outcomes. A caller's entry goes in under the lock of the
/// core's part that will decide it ([`Sink::lock_pending`] and its kin), so no outcome can come
/// before it.
#[derive(Default)]
pub(crate) struct Replies {
    /// Pending locks' callers.
    locks: LockCallers<LockReply>,
    /// Pending token checks' callers, by check id.
    checks: HashMap<u64, CheckSender>,
    /// The caller of the operator change in progress.
    proposal: Option<ProposalReply>,
    /// The node has stopped: callers are dropped rather than kept (they see their node closed),
    /// since nothing would decide them any more.
    stopped: bool,
}

/// Where a call that may leave its outcome pending sends it: the one caller of that call.
enum Caller {
    Lock(LockReply),
    Check(CheckSender),
    Proposal(ProposalReply),
}

/// One call's [`Sink`]: carries out the core's outputs as they come (see the module docs), and
/// what must wait until no part of the core is locked when the call is over.
pub(crate) struct Carrier<'a> {
    shared: &'a Arc<Shared>,
    now: Instant,
    /// The caller's reply, for the call that may leave its outcome pending.
    caller: Option<Caller>,
    /// What waits until the call is over, allocated by the first call that leaves any (a re-lock
    /// or an unlock leaves none).
    later: Option<Box<Later>>,
    /// A part is due before the timer task planned to wake.
    wake: bool,
    /// The persistence thread is gone: the core fails once the call is over.
    failed: bool,
}

/// What a call leaves for once no part of the core is locked.
#[derive(Default)]
struct Later {
    /// Notices for client sessions.
    notices: Vec<(crate::core::ClientOwner, keyhome_delegation::HandleId, Vec<u8>, crate::core::Notice)>,
    /// Handles admitted for callers that gave up meanwhile: given back ([`callers::give_back`]).
    unclaimed: Vec<Handle>,
}

impl Sink for Carrier<'_> {
    fn output(&mut self, output: Output) {
        let shared = self.shared;
        match output {
            Output::Transmit { to, message } => {
                shared.peer_traffic(self.now);
                let mut links = lock(&shared.links);
                let link = links.entry(to).or_insert_with(|| shared.spawn_link(to));
                // Its task ended (the peer had no known address then: a node of a later epoch
                // this node had not learned): a new one, which finds the address if it is known now
                // (and else ends at once, counting what it was given as dropped).
                if link.tx.is_closed() {
                    *link = shared.spawn_link(to);
                }
                if link.tx.try_send(message.into()).is_err() {
                    shared.core.count_dropped(1);
                }
            }
            Output::Persist { number, writes } => {
                if shared.persist.send(PersistJob { number, writes }).is_err() {
                    self.failed = true;
                }
            }
            Output::LockDone { ticket, result } => {
                // A caller that gave up meanwhile leaves the handle to be given back.
                if let Some(handle) = lock(&shared.replies).locks.decided(ticket, result) {
                    self.later().unclaimed.push(handle);
                }
            }
            Output::CheckDone { id, answer } => {
                if let Some(reply) = lock(&shared.replies).checks.remove(&id) {
                    let _ = reply.send(answer);
                }
            }
            Output::ProposalDone { result } => {
                if let Some(reply) = lock(&shared.replies).proposal.take() {
                    let _ = reply.send(result);
                }
            }
            Output::EpochLearned { members, .. } => {
                lock(&shared.links).retain(|id, _| members.contains(id));
            }
            Output::Observed { .. } => {}
            Output::Notice { owner, handle, key, notice } => {
                self.later().notices.push((owner, handle, key, notice))
            }
        }
    }

    fn lock_pending(&mut self, ticket: Ticket) {
        if let Some(Caller::Lock(reply)) = self.caller.take() {
            self.keep(|replies| replies.locks.wait(ticket, reply));
        }
    }

    fn check_pending(&mut self, id: u64) {
        if let Some(Caller::Check(reply)) = self.caller.take() {
            self.keep(|replies| drop(replies.checks.insert(id, reply)));
        }
    }

    fn proposal_pending(&mut self) {
        if let Some(Caller::Proposal(reply)) = self.caller.take() {
            self.keep(|replies| replies.proposal = Some(reply));
        }
    }

    #[inline]
    fn due(&mut self, at: Option<Instant>) {
        if at.is_some_and(|at| at.as_nanos() < self.shared.planned.load(Ordering::Acquire)) {
            self.wake = true;
        }
    }
}

impl<'a> Carrier<'a> {
    fn new(shared: &'a Arc<Shared>, now: Instant) -> Carrier<'a> {
        Carrier { shared, now, caller: None, later: None, wake: false, failed: false }
    }

    /// Keeps a pending call's caller with `put`, unless the node has stopped: then the caller is
    /// dropped, and sees its node closed (see [`Shared::stop`]).
    fn keep(&self, put: impl FnOnce(&mut Replies)) {
        let mut replies = lock(&self.shared.replies);
        if !replies.stopped {
            put(&mut replies);
        }
    }

    /// What waits until the call is over: giving back handles nobody claimed, failing the core,
    /// waking the timer task, telling the sessions. Most calls (a re-lock, and an unlock that
    /// moves no deadline earlier) leave none of it: they return after one test.
    #[inline]
    fn finish(self) {
        if self.later.is_some() || self.failed || self.wake {
            self.finish_slow();
        } else if self.caller.is_none() {
            // Nothing to drop (both `Option`s are `None`): skips the drop glue on the fast path.
            std::mem::forget(self);
        }
    }

    /// [`Carrier::finish`] when the call left something: `finish` tests every field this acts on
    /// (`later`, `failed`, `wake`).
    #[inline(never)]
    fn finish_slow(mut self) {
        let shared = self.shared;
        while let Some(handle) = self.later.as_mut().and_then(|later| later.unclaimed.pop()) {
            callers::give_back(&shared.core, self.now, handle, &mut self);
        }
        if self.failed {
            shared.core.fail();
        }
        if self.wake {
            shared.timer.notify_one();
        }
        if let Some(later) = self.later.take()
            && !later.notices.is_empty()
        {
            let ppm = shared.core.current().timing.clock_rate_ppm;
            shared.api.report(&shared.clock, ppm, later.notices);
        }
    }

    fn later(&mut self) -> &mut Later {
        self.later.get_or_insert_with(Box::default)
    }
}

/// Everything the runtime's tasks share.
pub(crate) struct Shared {
    pub id: NodeId,
    pub clock: BootClock,
    pub core: Core,
    /// The callers waiting for the core's outcomes.
    replies: Mutex<Replies>,
    /// Wakes the timer task when an input made the next deadline earlier than it planned for.
    timer: Notify,
    /// The instant (nanos) the timer task will wake at; `u64::MAX` while it computes.
    planned: AtomicU64,
    links: Mutex<HashMap<NodeId, Link>>,
    persist: std::sync::mpsc::Sender<PersistJob>,
    /// The peer endpoint (`listen`), which also serves clients when they share it.
    pub endpoint: quinn::Endpoint,
    /// The client API's own endpoint, when it has one (see [`NodeConfig::client_endpoint`]).
    client_endpoint: Option<quinn::Endpoint>,
    peer_client: quinn::ClientConfig,
    genesis_digest: [u8; 32],
    pub shutdown: watch::Sender<bool>,
    /// Why the node stopped by itself, if it did.
    failure: Mutex<Option<String>>,
    pub config: NodeConfig,
    pub api: crate::api::Sessions,
    /// Accepted peer connections, to notice two processes claiming one id.
    peer_conns: crate::peers::PeerConnections,
    /// What the runtime measures itself, for `/metrics` and the status page.
    pub metrics: crate::metrics::RuntimeMetrics,
    /// Caps on handshakes, connections and request bytes, and what they refused.
    pub admission: Arc<Admission>,
    /// The longest key the holder accepts (fixed at start): read without the core's lock.
    pub max_key_len: usize,
    /// Busy polling, when `busy_poll_us` turns it on: told of every message to or from a peer.
    pub busy_poll: Option<Arc<BusyPoll>>,
    rt: tokio::runtime::Handle,
}

/// The sending side of one peer link.
struct Link {
    tx: mpsc::Sender<PeerFrame>,
    state: Arc<LinkState>,
}

/// Whether a peer link is up, and since when.
struct LinkState {
    /// [`LINK_UNTRIED`], [`LINK_UP`] or [`LINK_DOWN`].
    state: AtomicU8,
    /// This node's clock (nanos) at the last change of `state`.
    since: AtomicU64,
    /// The peer's reason, when it closed the last connection refusing this node.
    refused: Mutex<Option<String>>,
}

const LINK_UNTRIED: u8 = 0;
const LINK_UP: u8 = 1;
const LINK_DOWN: u8 = 2;

impl LinkState {
    /// Sets the state at `now`; returns whether it changed.
    fn set(&self, state: u8, now: Instant) -> bool {
        let changed = self.state.swap(state, Ordering::Relaxed) != state;
        if changed {
            self.since.store(now.as_nanos(), Ordering::Relaxed);
        }
        changed
    }

    fn up(&self) -> bool {
        self.state.load(Ordering::Relaxed) == LINK_UP
    }

    /// Records why the connection to `peer` ended, if the peer refused this node ([`refusal`]); logs
    /// a refusal when it is new, so that a node the cluster no longer hears says why. Returns
    /// whether it was refused.
    fn closed(&self, peer: NodeId, addr: &str, end: Option<quinn::ConnectionError>) -> bool {
        let now = end.as_ref().and_then(refusal);
        let was_refused = now.is_some();
        let mut refused = lock(&self.refused);
        if *refused != now {
            if let Some(why) = &now {
                tracing::warn!(%peer, %addr, "node {peer} refuses this node: {why}");
            }
            *refused = now;
        }
        was_refused
    }

    fn refused(&self) -> bool {
        lock(&self.refused).is_some()
    }

    /// How long the link has been down at `now`; `None` while up or not tried yet.
    fn down_for(&self, now: Instant) -> Option<Duration> {
        (self.state.load(Ordering::Relaxed) == LINK_DOWN)
            .then(|| now.saturating_duration_since(Instant::from_nanos(self.since.load(Ordering::Relaxed))))
    }
}

/// The peer's reason, when it closed a connection because of who this node is or what it sent
/// (not a member it knows, removed, another cluster, a frame it cannot read).
fn refusal(end: &quinn::ConnectionError) -> Option<String> {
    let quinn::ConnectionError::ApplicationClosed(close) = end else { return None };
    let refusals = [CloseCode::NotMember, CloseCode::Mismatch, CloseCode::BadFrame, CloseCode::WrongRole];
    refusals
        .iter()
        .any(|&code| close.error_code == code.into())
        .then(|| String::from_utf8_lossy(&close.reason).into_owned())
}

/// A running node. Dropping it does not stop it; call [`Node::shutdown`].
pub struct Node {
    pub(crate) shared: Arc<Shared>,
    persist_thread: Option<std::thread::JoinHandle<()>>,
    /// The HTTP API's TCP address, when it has one.
    http_addr: Option<SocketAddr>,
}

impl Node {
    /// Starts the node described by `config` on the current tokio runtime: creates its store from
    /// the genesis file on the first start, commits the new incarnation, opens the QUIC endpoint
    /// and begins talking to its peers.
    pub async fn start(config: NodeConfig) -> Result<Node, NodeError> {
        let id = config.node_id();
        let identity = Identity::load(&config.cert, &config.key)?;
        let ca = pki::load_ca(&config.ca)?;
        match identity.role()? {
            Role::Node(found) if found == id => {}
            found => return Err(NodeError::WrongIdentity { path: config.cert.clone(), found, expected: id }),
        }
        let mut store = open_store(&config)?;
        if store.identity() != id {
            return Err(NodeError::StoreIdentity {
                path: store.path().to_path_buf(),
                found: store.identity(),
                expected: id,
            });
        }
        let durable =
            store.load()?.ok_or_else(|| StoreError::Missing { path: store.path().to_path_buf() })?;
        config.check_listen(&durable.current)?;
        let genesis_digest = durable.genesis_digest;

        let clock = BootClock::new();
        let now = clock.now();
        let seed =
            u64::from_le_bytes(genesis_digest[..8].try_into().unwrap_or_default()) ^ id.0 ^ now.as_nanos();
        #[allow(unused_mut)] // only the `bug-injection` build changes it
        let mut epoch_config = keyhome_epoch::Config::new(id, seed);
        let settings = &config.locks;
        let mut home = HomeConfig::new(id);
        home.lock_delay = Duration::from_millis(settings.lock_delay_ms);
        let mut holder = HolderConfig::new(id);
        holder.lease = Duration::from_millis(settings.delegation_lease_ms);
        holder.idle_release = Duration::from_millis(settings.idle_release_ms);
        #[cfg(feature = "bug-injection")]
        if let Some(bug) =
            crate::bugs::apply(&mut epoch_config, &mut home, &mut holder).map_err(NodeError::InjectBug)?
        {
            tracing::warn!(bug, "a safety rule is switched off (bug injection)");
        }
        let epoch = EpochNode::start(epoch_config, durable, now);
        let max_key_len = holder.limits.max_key_len;
        let mut outputs = std::collections::VecDeque::new();
        let core = Core::new(epoch, home, holder, config.shard_count(), now, &mut outputs);
        // The incarnation (and anything else the start wrote) is durable before the port opens;
        // what else the start produced is carried out by the first `with_core` below.
        let mut early = Vec::new();
        while let Some(output) = outputs.pop_front() {
            match output {
                Output::Persist { number, writes } => {
                    store.commit(&writes)?;
                    core.persisted(clock.now(), number, &mut outputs);
                }
                other => early.push(other),
            }
        }

        let server = server_config(&identity, &ca, &config.limits)?;
        let peer_client = pki::client_config(&identity, &ca, pki::ALPN_PEER)?;
        let endpoint = quinn::Endpoint::server(server, config.listen)
            .map_err(|source| NodeError::Listen { addr: config.listen, source })?;
        let client_endpoint = match config.client_endpoint() {
            Some(addr) => Some(
                quinn::Endpoint::server(server_config(&identity, &ca, &config.limits)?, addr)
                    .map_err(|source| NodeError::Listen { addr, source })?,
            ),
            None => None,
        };
        let http = crate::http::Listeners::bind(&config).await?;
        let local = config.local.as_ref().map(crate::local::LocalListener::bind).transpose()?;
        let (persist_tx, persist_rx) = std::sync::mpsc::channel();
        let (shutdown, _) = watch::channel(false);
        let shared = Arc::new(Shared {
            id,
            clock,
            core,
            replies: Mutex::new(Replies::default()),
            timer: Notify::new(),
            planned: AtomicU64::new(u64::MAX),
            links: Mutex::new(HashMap::new()),
            persist: persist_tx,
            endpoint,
            client_endpoint,
            peer_client,
            genesis_digest,
            shutdown,
            failure: Mutex::new(None),
            api: crate::api::Sessions::new(),
            peer_conns: crate::peers::PeerConnections::default(),
            metrics: crate::metrics::RuntimeMetrics::default(),
            admission: Admission::new(config.limits.clone()),
            max_key_len,
            busy_poll: BusyPoll::for_runtime(
                Duration::from_micros(config.busy_poll_us),
                tokio::runtime::Handle::current().metrics().num_workers(),
            ),
            config,
            rt: tokio::runtime::Handle::current(),
        });
        let persist_thread = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("keyhome-persist-{id}"))
                .spawn(move || persist_loop(shared, store, persist_rx))
                .map_err(|e| NodeError::WriteFailed(format!("cannot start the persistence thread: {e}")))?
        };
        tokio::spawn(timer_loop(Arc::clone(&shared)));
        if let Some(poller) = &shared.busy_poll {
            tokio::spawn(Arc::clone(poller).run(shared.clock, shared.shutdown.subscribe()));
        }
        tokio::spawn(crate::metrics::sample_loop(Arc::clone(&shared)));
        tokio::spawn(log_summaries(Arc::clone(&shared)));
        let shares_clients = shared.client_endpoint.is_none();
        tokio::spawn(accept_loop(
            Arc::clone(&shared),
            shared.endpoint.clone(),
            Serves { peers: true, clients: shares_clients },
        ));
        if let Some(endpoint) = shared.client_endpoint.clone() {
            tokio::spawn(accept_loop(Arc::clone(&shared), endpoint, Serves { peers: false, clients: true }));
        }
        if let Some(listener) = local {
            tokio::spawn(crate::local::accept_loop(Arc::clone(&shared), listener));
        }
        shared.with_core(|core, now, out| {
            for output in early {
                out.output(output);
            }
            core.handle_timeout(now, out)
        });
        let http_addr = http.and_then(|http| {
            let addr = http.tcp_addr();
            http.serve(&shared);
            addr
        });
        tracing::info!(node = %id, addr = %shared.config.listen, "node started");
        crate::machine::log_notes();
        Ok(Node { shared, persist_thread: Some(persist_thread), http_addr })
    }

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.shared.id
    }

    /// The address of the client API (the peer endpoint's, when clients share it).
    pub fn client_addr(&self) -> Option<SocketAddr> {
        self.shared.client_endpoint.as_ref().unwrap_or(&self.shared.endpoint).local_addr().ok()
    }

    /// The TCP address of the HTTP API, when it serves one.
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http_addr
    }

    /// The address the node's QUIC endpoint is bound to.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.shared.endpoint.local_addr().ok()
    }

    /// Resolves when the node has stopped by itself (a failed write) or was asked to stop.
    pub async fn stopped(&self) {
        let mut rx = self.shared.shutdown.subscribe();
        let _ = rx.wait_for(|stop| *stop).await;
    }

    /// Why the node stopped by itself, if it did.
    pub fn failure(&self) -> Option<String> {
        lock(&self.shared.failure).clone()
    }

    /// Stops the node: admits nothing more and gives back every delegation this node holds, so
    /// their keys pass on. A key under a live handle passes on only once the handle is unlocked
    /// or passes the deadline its owner was told; the node waits up to `drain` for that and for
    /// the releases to leave, then closes every connection (keys still held then pass on when
    /// their delegations expire at their homes).
    pub async fn shutdown(mut self, drain: Duration) {
        let shared = Arc::clone(&self.shared);
        shared.with_core(|core, now, out| core.shutdown(now, out));
        // `None`: a drain too long to count (`Duration::MAX`) waits for the handles alone.
        let deadline = tokio::time::Instant::now().checked_add(drain);
        while deadline.is_none_or(|d| tokio::time::Instant::now() < d)
            && (shared.core.has_handles() || shared.core.has_held() || !shared.links_idle())
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(20).min(drain)).await;
        shared.stop(None);
        shared.endpoint.close(CloseCode::Shutdown.into(), b"node shutting down");
        if let Some(endpoint) = &shared.client_endpoint {
            endpoint.close(CloseCode::Shutdown.into(), b"node shutting down");
        }
        let _ = tokio::time::timeout(Duration::from_secs(1), shared.endpoint.wait_idle()).await;
        if let Some(thread) = self.persist_thread.take() {
            // It notices the stop within `MAX_SLEEP`; a commit in progress finishes first.
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
    }
}

/// The node's QUIC server configuration ([`pki::server_config`]), with quinn's own queue of
/// connection attempts bounded to what [`Limits::max_handshakes`] lets the node take on.
fn server_config(
    identity: &Identity,
    ca: &[rustls::pki_types::CertificateDer<'static>],
    limits: &Limits,
) -> Result<quinn::ServerConfig, NodeError> {
    let mut server = pki::server_config(identity, ca)?;
    server
        .max_incoming(limits.max_handshakes.saturating_mul(2))
        .incoming_buffer_size(INCOMING_BUFFER)
        .incoming_buffer_size_total(INCOMING_BUFFER.saturating_mul(limits.max_handshakes as u64));
    Ok(server)
}

fn open_store(config: &NodeConfig) -> Result<RedbStore, NodeError> {
    let path = config.store_path();
    // A first start that stopped before its first commit (which writes every field at once) left
    // an empty file, or a database without a table: nothing was promised or sent, so it starts
    // over (`create` refuses a file holding any table).
    if let Ok(meta) = std::fs::metadata(&path) {
        if meta.len() > 0 {
            match RedbStore::open(&path) {
                Err(crate::store::StoreError::NotInitialised { .. }) => {}
                opened => {
                    let store = opened?;
                    check_genesis(config, &store)?;
                    return Ok(store);
                }
            }
        }
        tracing::warn!(path = %path.display(), "the store holds nothing (a first start stopped early)");
    }
    crate::store::create_dir_durably(&config.data_dir)
        .map_err(|source| NodeError::DataDir { path: config.data_dir.clone(), source })?;
    let genesis = GenesisFile::load(&config.genesis)?.record(&config.genesis)?;
    tracing::info!(path = %path.display(), "first start: creating the store from the genesis");
    Ok(RedbStore::create(&path, &genesis, config.node_id())?)
}

/// A store opened again must come from the genesis the configuration names, when that file is
/// still there (later starts need nothing else from it, so a removed one is not an error): a data
/// directory of another cluster, or a genesis file rewritten since, would otherwise show only as
/// every peer closing the connection ("another cluster").
fn check_genesis(config: &NodeConfig, store: &RedbStore) -> Result<(), NodeError> {
    if std::fs::symlink_metadata(&config.genesis).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound) {
        return Ok(());
    }
    // A file that no longer reads as a genesis (rules tightened since it was written, say) proves
    // nothing either way: the start goes on, as it did before this check.
    let expected = match GenesisFile::load(&config.genesis).and_then(|g| g.record(&config.genesis)) {
        Ok(genesis) => genesis.digest(),
        Err(e) => {
            tracing::warn!("cannot compare the store's genesis with {}: {e}", config.genesis.display());
            return Ok(());
        }
    };
    let found = store.genesis_digest();
    if found == expected {
        return Ok(());
    }
    let short = |d: [u8; 32]| d[..8].iter().map(|b| format!("{b:02x}")).collect::<String>();
    Err(NodeError::StoreGenesis {
        store: store.path().to_path_buf(),
        genesis: config.genesis.clone(),
        found: short(found),
        expected: short(expected),
    })
}

impl Shared {
    /// Runs `f` on the core at the current instant with a [`Carrier`] for what it produces (see
    /// the module docs); notices for clients are handed to the sessions once the call is over.
    #[inline]
    pub fn with_core<R>(self: &Arc<Self>, f: impl FnOnce(&Core, Instant, &mut Carrier<'_>) -> R) -> R {
        let now = self.clock.now();
        let mut carrier = Carrier::new(self, now);
        let result = f(&self.core, now, &mut carrier);
        carrier.finish();
        result
    }

    /// Tells the busy poller, if there is one, that a message went to or came from another node
    /// at `now`: the answer, or the next message of the exchange, is likely to follow soon. Calls
    /// that stay on this node (a re-lock under a held delegation) do not make it poll.
    #[inline]
    fn peer_traffic(&self, now: Instant) {
        if let Some(poller) = &self.busy_poll {
            poller.touch(now);
        }
    }

    /// Locks `key` for `owner`; `reply` gets the outcome if the lock is left pending.
    pub(crate) fn lock_call(
        self: &Arc<Self>,
        key: &[u8],
        ttl: Duration,
        wait: Duration,
        owner: crate::core::Owner,
        reply: LockReply,
    ) -> Result<keyhome_delegation::LockOutcome, LockError> {
        self.with_core(|core, now, out| {
            out.caller = Some(Caller::Lock(reply));
            core.lock(now, key, ttl, wait, owner, out)
        })
    }

    /// Starts a token check; `reply` gets the answer.
    pub(crate) fn check_call(
        self: &Arc<Self>,
        key: Vec<u8>,
        token: keyhome_delegation::FencingToken,
        timeout: Duration,
        reply: CheckSender,
    ) -> Result<u64, LockError> {
        self.with_core(|core, now, out| {
            out.caller = Some(Caller::Check(reply));
            core.check(now, key, token, timeout, out)
        })
    }

    /// Starts an operator change; `reply` gets its outcome.
    pub(crate) fn propose_call(
        self: &Arc<Self>,
        change: keyhome_epoch::Change,
        reply: ProposalReply,
    ) -> Result<(), ProposeError> {
        self.with_core(|core, now, out| {
            out.caller = Some(Caller::Proposal(reply));
            core.propose(now, change, out)
        })
    }

    fn spawn_link(self: &Arc<Self>, peer: NodeId) -> Link {
        let (tx, rx) = mpsc::channel(LINK_QUEUE);
        let state = Arc::new(LinkState {
            state: AtomicU8::new(LINK_UNTRIED),
            since: AtomicU64::new(0),
            refused: Mutex::new(None),
        });
        self.rt.spawn(run_link(Arc::clone(self), peer, rx, Arc::clone(&state)));
        Link { tx, state }
    }

    /// Whether every link has written everything queued on it.
    fn links_idle(&self) -> bool {
        lock(&self.links).values().all(|l| l.tx.capacity() == l.tx.max_capacity())
    }

    /// Checks that node `peer` answers at `addr` within `timeout`, as a peer link would reach it:
    /// the handshake completes and the certificate presented proves `peer`'s id. Fails with the
    /// reason, for a message.
    pub async fn probe(self: &Arc<Self>, peer: NodeId, addr: &str, timeout: Duration) -> Result<(), String> {
        match tokio::time::timeout(timeout, dial(self, peer, addr)).await {
            Ok(Ok(conn)) => {
                conn.close(0u32.into(), b"probe done");
                Ok(())
            }
            Ok(Err(e)) if pki::names_another_node(&e.to_string()) => {
                Err(format!("something answers there, but its certificate is not node {peer}'s ({e})"))
            }
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {}", crate::duration::Human(timeout))),
        }
    }

    /// Whether this node has an open connection to `peer`.
    pub fn connected(&self, peer: NodeId) -> bool {
        lock(&self.links).get(&peer).is_some_and(|l| l.state.up())
    }

    /// A durable write failed: nothing leaves this node any more, it admits nothing more (its
    /// waiting lock calls fail [`LockError::Closed`]), and it stops.
    pub(crate) fn write_failed(self: &Arc<Self>, e: &dyn std::fmt::Display) {
        self.core.fail();
        self.with_core(|core, now, out| core.shutdown(now, out));
        self.stop(Some(format!("a durable write failed, so the node stopped: {e}")));
    }

    /// Stops every task; `failure` says why, if the node stops by itself. Every caller still
    /// waiting (a lock, a token check, an operator change) is dropped, and so are later ones: it
    /// sees its node closed at once, where it would otherwise wait on a node that decides nothing
    /// more (an embedding program outlives its node's failure).
    pub fn stop(&self, failure: Option<String>) {
        if let Some(f) = failure {
            tracing::error!("{f}");
            lock(&self.failure).get_or_insert(f);
        }
        self.shutdown.send_replace(true);
        let stopped = Replies { stopped: true, ..Replies::default() };
        drop(std::mem::replace(&mut *lock(&self.replies), stopped));
    }

    /// The node's status, for `keyhome status`.
    pub fn status(self: &Arc<Self>) -> crate::status::Status {
        let mut status = self.core.status(self.clock.now());
        let now = self.clock.now();
        let links = lock(&self.links);
        for m in status.members.iter_mut().filter(|m| m.id != self.id.0) {
            if let Some(link) = links.get(&NodeId(m.id)) {
                m.connected = link.state.up();
                m.unreachable_for = link.state.down_for(now);
                m.refused = lock(&link.state.refused).clone();
            }
        }
        drop(links);
        self.admission.incidents.fill(&mut status.counters);
        status.load = self.admission.load();
        status.duplicate_ids = self.peer_conns.duplicates();
        status.mark_stalled();
        status
    }

    fn hello(&self) -> PeerFrame {
        let epoch = self.core.current().number;
        PeerFrame::Hello { genesis_digest: self.genesis_digest, ring_version: ROUTING_VERSION, epoch }
    }
}

/// Locks `key` for `owner`; waits for a pending lock. If the caller stops waiting (the future
/// is dropped), the lock is cancelled, or given back at once if it was admitted meanwhile.
pub(crate) async fn lock_key(
    shared: &Arc<Shared>,
    key: &[u8],
    ttl: Duration,
    wait: Duration,
    owner: crate::core::Owner,
) -> Result<Handle, LockError> {
    let (tx, rx) = oneshot::channel();
    let outcome = shared.lock_call(key, ttl, wait, owner, tx)?;
    let ticket = match outcome {
        keyhome_delegation::LockOutcome::Locked(handle) => return Ok(handle),
        keyhome_delegation::LockOutcome::Pending(ticket) => ticket,
    };
    struct Pending<'a> {
        shared: &'a Arc<Shared>,
        ticket: Ticket,
        reply: Option<oneshot::Receiver<LockResult>>,
    }
    impl Drop for Pending<'_> {
        fn drop(&mut self) {
            let Some(mut reply) = self.reply.take() else { return };
            reply.close();
            let admitted = reply.try_recv().ok();
            lock(&self.shared.replies).locks.forget(self.ticket);
            self.shared.with_core(|core, now, out| callers::withdraw(core, now, self.ticket, admitted, out));
        }
    }
    let mut pending = Pending { shared, ticket, reply: Some(rx) };
    let result = match pending.reply.as_mut() {
        Some(reply) => reply.await,
        None => return Err(LockError::Timeout),
    };
    pending.reply = None;
    // The sender is only dropped when the node stops ([`Shared::stop`]).
    result.unwrap_or(Err(LockError::Closed))
}

/// Resolves once the node is stopping.
pub(crate) async fn stopping(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

// ---- tasks ----

fn persist_loop(shared: Arc<Shared>, mut store: RedbStore, jobs: std::sync::mpsc::Receiver<PersistJob>) {
    let stop = shared.shutdown.subscribe();
    loop {
        if *stop.borrow() {
            return;
        }
        let job = match jobs.recv_timeout(MAX_SLEEP) {
            Ok(job) => job,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
        };
        let started = shared.clock.now();
        let committed = store.commit(&job.writes);
        crate::activity::observe_span(&shared.metrics.fsync, started, shared.clock.now());
        match committed {
            Ok(()) => shared.with_core(|core, now, out| core.persisted(now, job.number, out)),
            Err(e) => return shared.write_failed(&e),
        }
    }
}

async fn timer_loop(shared: Arc<Shared>) {
    let mut stop = shared.shutdown.subscribe();
    loop {
        let next = shared.core.poll_timeout();
        let now = shared.clock.now();
        // Exactly the core's deadline when it is the earlier one, so that an input that leaves
        // that deadline as it is does not wake this task.
        let planned = next.map_or(now + MAX_SLEEP, |t| t.min(now + MAX_SLEEP));
        let wait = planned.saturating_duration_since(now);
        shared.planned.store(planned.as_nanos(), Ordering::Release);
        if wait.is_zero() {
            // Due now (paced work, such as an epoch walk, stays due until it is done): let other
            // tasks in, then take the next share at once. A zero sleep would wait for the timer
            // wheel's next millisecond tick.
            tokio::select! {
                biased;
                _ = stopping(&mut stop) => return,
                _ = tokio::task::yield_now() => {}
            }
        } else {
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shared.timer.notified() => {}
                _ = stopping(&mut stop) => return,
            }
        }
        // This task's own call must not wake it again (with `planned` at `u64::MAX` it stored a
        // permit on every round, so the task never slept); an input that runs meanwhile is seen by
        // the `poll_timeout` at the top of the loop, which reads it after `planned` is `u64::MAX`.
        shared.planned.store(0, Ordering::Release);
        shared.with_core(|core, now, out| core.handle_timeout(now, out));
        shared.planned.store(u64::MAX, Ordering::Release);
    }
}

/// Which protocols an endpoint serves.
#[derive(Clone, Copy)]
struct Serves {
    peers: bool,
    clients: bool,
}

async fn accept_loop(shared: Arc<Shared>, endpoint: quinn::Endpoint, serves: Serves) {
    let mut stop = shared.shutdown.subscribe();
    loop {
        let incoming = tokio::select! {
            incoming = endpoint.accept() => incoming,
            _ = stopping(&mut stop) => return,
        };
        let Some(incoming) = incoming else { return };
        let remote = incoming.remote_address();
        let incidents = &shared.admission.incidents;
        let now = std::time::Instant::now();
        match shared.admission.incoming(
            now,
            remote,
            incoming.remote_address_validated(),
            incoming.may_retry(),
        ) {
            Verdict::Handshake(slot) => {
                tokio::spawn(serve_connection(Arc::clone(&shared), incoming, slot, serves));
            }
            Verdict::Retry => {
                incidents.report(Incident::HandshakeRetried, remote, "");
                // Only fails when a retry is not possible, which `may_retry` ruled out.
                let _ = incoming.retry();
            }
            Verdict::Throttle => {
                incidents.report(
                    Incident::HandshakeThrottled,
                    remote,
                    "this address failed too many handshakes lately (limits.failed_handshakes_per_addr): \
                     dropped unanswered",
                );
                incoming.ignore();
            }
            Verdict::Refuse => {
                incidents.report(
                    Incident::HandshakeRefused,
                    remote,
                    "too many handshakes in progress from this address (limits.max_handshakes_per_addr)",
                );
                incoming.refuse();
            }
            Verdict::Ignore => {
                incidents.report(
                    Incident::HandshakeRefused,
                    remote,
                    "too many handshakes in progress (limits.max_handshakes): dropped unanswered",
                );
                incoming.ignore();
            }
        }
    }
}

async fn serve_connection(
    shared: Arc<Shared>,
    incoming: quinn::Incoming,
    handshake: crate::admission::HandshakeSlot,
    serves: Serves,
) {
    let remote = incoming.remote_address();
    let incidents = &shared.admission.incidents;
    let validated = incoming.remote_address_validated();
    let failed = |proven| shared.admission.handshake_failed(std::time::Instant::now(), remote.ip(), proven);
    let refuse = |conn: &quinn::Connection, code: CloseCode, reason: &str| {
        failed(true);
        incidents.report(Incident::HandshakeFailed, remote, reason);
        conn.close(code.into(), reason.as_bytes());
    };
    let conn = match incoming.await {
        Ok(conn) => conn,
        Err(e) => {
            if !matches!(e, quinn::ConnectionError::TimedOut) {
                failed(validated || pki::refused_certificate(&e));
            }
            return incidents.report(Incident::HandshakeFailed, remote, format!("handshake failed: {e}"));
        }
    };
    drop(handshake);
    let alpn = pki::negotiated_alpn(&conn);
    let role = match pki::peer_role(&conn) {
        Ok(role) => role,
        Err(e) => {
            return refuse(&conn, CloseCode::WrongRole, &format!("certificate names no keyhome role: {e}"));
        }
    };
    let allowed = match (alpn.as_deref(), &role) {
        (Some(pki::ALPN_PEER), Role::Node(_)) => serves.peers,
        (Some(pki::ALPN_CLIENT), Role::Client(_) | Role::Operator) => serves.clients,
        _ => false,
    };
    if !allowed {
        return refuse(
            &conn,
            CloseCode::WrongRole,
            "this certificate's role may not use this protocol on this port (clients: use the client address)",
        );
    }
    let slot = match shared.admission.connection(&role) {
        Ok(slot) => slot,
        Err(cap) => {
            incidents.report(Incident::ConnectionRefused, remote, format!("{role}: {cap}"));
            conn.close(cap.close_code().into(), cap.to_string().as_bytes());
            return;
        }
    };
    pki::fit_to_role(&conn, &role);
    match role {
        Role::Node(peer) => serve_peer(shared, conn, peer).await,
        role => crate::api::serve(shared, conn, role, slot.budget.clone()).await,
    }
    drop(slot);
}

async fn serve_peer(shared: Arc<Shared>, conn: quinn::Connection, peer: NodeId) {
    let remote = conn.remote_address();
    let registered = shared.peer_conns.register(peer, remote);
    if let Some(other) = registered.other {
        shared.admission.incidents.report(
            Incident::DuplicateId,
            remote,
            format_args!(
                "TWO PROCESSES CLAIM TO BE NODE {peer}: live connections from {other} and {remote} both \
                 present its certificate. Stop the one that should not run (a copy of node {peer}'s \
                 configuration?); while both run, keyhome's guarantees do not hold"
            ),
        );
    }
    while let Ok(recv) = conn.accept_uni().await {
        tokio::spawn(read_peer_stream(Arc::clone(&shared), conn.clone(), peer, recv));
    }
}

/// Ends each rate-limited log's window every [`crate::ratelog::WINDOW`], logging its summary.
async fn log_summaries(shared: Arc<Shared>) {
    let mut stop = shared.shutdown.subscribe();
    let mut tick = tokio::time::interval(crate::ratelog::WINDOW);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => shared.admission.incidents.flush_logs(),
            _ = stopping(&mut stop) => return,
        }
    }
}

async fn read_peer_stream(
    shared: Arc<Shared>,
    conn: quinn::Connection,
    peer: NodeId,
    mut recv: quinn::RecvStream,
) {
    let close = |code: CloseCode, reason: String| {
        let detail = format!("closing node {peer}'s connection: {reason}");
        shared.admission.incidents.report(Incident::PeerLinkClosed, conn.remote_address(), detail);
        conn.close(code.into(), reason.as_bytes());
    };
    // The hello comes first, small and soon: a certificate no epoch admits (a retired node's, one
    // issued ahead of an --add) may not hold a megabyte frame, or a stream, before it is heard.
    let limit = shared.admission.limits.request_timeout();
    let hello = wire::read_frame::<PeerFrame>(&mut recv, MAX_HELLO_FRAME);
    let Ok(hello) = tokio::time::timeout(limit, hello).await else {
        return close(
            CloseCode::BadFrame,
            format!("no hello within {limit:?} of opening a stream (limits.request_timeout_ms)"),
        );
    };
    match hello {
        Ok(Some(PeerFrame::Hello { genesis_digest, ring_version, epoch })) => {
            if let Err(reason) = shared.core.hears(peer, epoch) {
                return close(CloseCode::NotMember, reason);
            }
            if genesis_digest != shared.genesis_digest {
                return close(
                    CloseCode::Mismatch,
                    "the peer belongs to another cluster (genesis digest differs)".into(),
                );
            }
            if ring_version != ROUTING_VERSION {
                return close(
                    CloseCode::Mismatch,
                    format!("the peer routes by ring version {ring_version}, this node by {ROUTING_VERSION}"),
                );
            }
        }
        Ok(Some(_)) => return close(CloseCode::BadFrame, "the first frame of a stream must be Hello".into()),
        Ok(None) => return,
        Err(e) => return close(CloseCode::BadFrame, format!("bad frame: {e}")),
    }
    loop {
        match wire::read_frame::<PeerFrame>(&mut recv, MAX_PEER_FRAME).await {
            Ok(Some(frame)) => match frame.into_message() {
                Some(message) => shared.with_core(|core, now, out| {
                    shared.peer_traffic(now);
                    core.handle_message(now, peer, message, out)
                }),
                None => return close(CloseCode::BadFrame, "a second Hello on one stream".into()),
            },
            Ok(None) => return,
            Err(wire::WireError::Read(_)) => return,
            Err(e) => return close(CloseCode::BadFrame, format!("bad frame: {e}")),
        }
    }
}

async fn run_link(
    shared: Arc<Shared>,
    peer: NodeId,
    mut rx: mpsc::Receiver<PeerFrame>,
    link: Arc<LinkState>,
) {
    let mut stop = shared.shutdown.subscribe();
    let mut backoff = Backoff::new(shared.id.0 ^ peer.0.rotate_left(32));
    loop {
        if *stop.borrow() {
            return;
        }
        // Retired (the peer left the current epoch) with nothing left to send: the link ends; a
        // later frame starts a new one.
        if rx.is_closed() && rx.is_empty() {
            return;
        }
        // A node removed from the current epoch is still reached at its last address: it must
        // hear of the epoch that removed it (to hand its keys over), and it asks until it does.
        let addr = shared.core.link_addr(peer);
        let Some(addr) = addr else {
            shared.core.count_dropped(rx.len() as u64);
            return;
        };
        match connect(&shared, peer, &addr).await {
            Ok((conn, mut send)) => {
                link.set(LINK_UP, shared.clock.now());
                // A peer that refused this node is retried with backoff, and quietly.
                if link.refused() {
                    tracing::debug!(%peer, %addr, "peer up");
                } else {
                    tracing::info!(%peer, %addr, "peer up");
                }
                loop {
                    tokio::select! {
                        frame = rx.recv() => match frame {
                            Some(frame) => {
                                if let Err(e) = wire::write_frame(&mut send, &frame, MAX_PEER_FRAME).await {
                                    tracing::debug!(%peer, "link write failed: {e}");
                                    break;
                                }
                            }
                            None => {
                                // Retired: let what was written reach the peer before the
                                // connection is dropped (dropping it discards unsent data).
                                let _ = send.finish();
                                let _ = tokio::time::timeout(Duration::from_secs(1), send.stopped()).await;
                                return;
                            }
                        },
                        _ = conn.closed() => break,
                        _ = stopping(&mut stop) => return,
                    }
                }
                link.set(LINK_DOWN, shared.clock.now());
                // A write fails, too, once the peer closed the connection.
                if link.closed(peer, &addr, conn.close_reason()) {
                    tracing::debug!(%peer, %addr, "peer down: it refuses this node");
                } else {
                    backoff.reset();
                    tracing::info!(%peer, %addr, "peer down");
                }
            }
            Err(e) => {
                if link.set(LINK_DOWN, shared.clock.now()) {
                    tracing::info!(%peer, %addr, error = %e, "peer unreachable");
                } else {
                    tracing::debug!(%peer, %addr, "cannot connect: {e}");
                }
            }
        }
        // What queued while the link was down is dropped: the cores resend what matters.
        let mut dropped = 0;
        while rx.try_recv().is_ok() {
            dropped += 1;
        }
        if dropped > 0 {
            shared.core.count_dropped(dropped);
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff.next()) => {}
            _ = stopping(&mut stop) => return,
        }
    }
}

/// Why a link could not be set up.
#[derive(Debug, thiserror::Error)]
enum ConnectError {
    #[error("{0}")]
    Resolve(String),
    #[error(transparent)]
    Connect(#[from] quinn::ConnectError),
    #[error(transparent)]
    Connection(#[from] quinn::ConnectionError),
    #[error(transparent)]
    Wire(#[from] wire::WireError),
}

async fn connect(
    shared: &Arc<Shared>,
    peer: NodeId,
    addr: &str,
) -> Result<(quinn::Connection, quinn::SendStream), ConnectError> {
    let conn = dial(shared, peer, addr).await?;
    let mut send = conn.open_uni().await?;
    wire::write_frame(&mut send, &shared.hello(), MAX_PEER_FRAME).await?;
    Ok((conn, send))
}

/// A peer connection to node `peer` at `addr`, its handshake done: the certificate `peer`
/// presented proves its id.
async fn dial(shared: &Arc<Shared>, peer: NodeId, addr: &str) -> Result<quinn::Connection, ConnectError> {
    // Resolved again on every (re)connection: a name may point somewhere new.
    let resolved = crate::addr::resolve(addr).await.map_err(ConnectError::Resolve)?;
    let local = shared.endpoint.local_addr().map_err(|e| ConnectError::Resolve(e.to_string()))?;
    let sock = crate::addr::reachable_from(&resolved, local).ok_or_else(|| {
        ConnectError::Resolve(format!("{addr:?} resolves to no address this node's {local} socket can reach"))
    })?;
    Ok(shared.endpoint.connect_with(shared.peer_client.clone(), sock, &pki::server_name(peer))?.await?)
}

/// Jittered exponential backoff.
struct Backoff {
    next: Duration,
    rng: u64,
}

impl Backoff {
    fn new(seed: u64) -> Backoff {
        Backoff { next: BACKOFF_MIN, rng: seed | 1 }
    }

    fn reset(&mut self) {
        self.next = BACKOFF_MIN;
    }

    /// The next delay: uniformly within [d/2, d], where d doubles per call up to the maximum.
    fn next(&mut self) -> Duration {
        // xorshift64
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let d = self.next;
        self.next = (self.next * 2).min(BACKOFF_MAX);
        let half = d / 2;
        half + Duration::from_nanos(self.rng % (half.as_nanos() as u64).max(1))
    }
}
