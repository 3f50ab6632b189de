//! The client API, server side: requests from applications and operators on ALPN
//! `keyhome-client/1`, one bidirectional stream per request. [`answer`] serves both this and the
//! local socket ([`crate::local`]), whose connections are sessions here too.
//!
//! # Sessions
//!
//! A handle belongs to the client connection that locked it and to that connection's
//! certificate identity. When the connection ends, its handles are **not** ended early: the
//! client may still be working inside the deadline it was told, so each handle keeps its key
//! until it is unlocked or passes that deadline (its successor is then told `recovered`). A new
//! connection with the same certificate identity may renew or unlock them meanwhile (which moves
//! them to the new connection); a connection of any other identity is refused.
//!
//! # Events
//!
//! Recalls (another client wants the key: unlock soon) and expiries are reported on the owning
//! connection's event stream ([`Request::Subscribe`]), numbered per connection so a client sees
//! when it missed one. They are advisory: the deadline the client was told is what it relies on.
//!
//! # Authorisation
//!
//! Client and operator certificates may lock, renew, unlock, check and read status; only an
//! operator certificate may change the membership. Node certificates are refused on this protocol.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use keyhome_delegation::{Ending, Handle, HandleId, LockError};
use keyhome_epoch::time::rate_shrink;
use keyhome_epoch::{Instant, ProposeError};
use tokio::sync::{mpsc, oneshot};

use crate::admission::{Budget, Incident};
use crate::clock::BootClock;
use crate::core::{ClaimError, ClientOwner, Notice, Owner};
use crate::pki::Role;
use crate::proposal::ProposalError;
use crate::runtime::{Shared, lock};
use crate::wire::{
    self, ApiError, ClientEvent, ErrorKind, EventKind, Locked, MAX_CLIENT_FRAME, PROPOSE_TIMEOUT, Request,
    Response,
};

/// Lost-handle events queued per subscribed connection before further ones are dropped.
const EVENT_QUEUE: usize = 1024;
/// The stop code of a request stream whose request was malformed or did not arrive in time.
const STOP_BAD_REQUEST: u32 = 1;
/// How long a token check waits for the key's home (or its holder) to answer.
const CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// The client connections of one node.
pub struct Sessions {
    next: AtomicU64,
    state: std::sync::Mutex<SessionState>,
}

#[derive(Default)]
struct SessionState {
    conns: HashMap<u64, Conn>,
    /// Certificate identities, numbered: handles pass only between connections of one number.
    identities: HashMap<Role, u64>,
}

/// One client connection: its event stream, if it subscribed.
struct Conn {
    events: Option<mpsc::Sender<ClientEvent>>,
    /// The last event number given out on this connection (dropped ones included).
    seq: u64,
}

impl Default for Sessions {
    fn default() -> Sessions {
        Sessions::new()
    }
}

/// The refusal of a second event stream while a connection's first is open.
pub(crate) fn second_event_stream() -> ApiError {
    ApiError::new(ErrorKind::Invalid, "this connection already has an event stream (one per connection)")
}

impl Sessions {
    pub fn new() -> Sessions {
        Sessions { next: AtomicU64::new(1), state: std::sync::Mutex::new(SessionState::default()) }
    }

    /// A new connection of `role` (on either transport), as the core's owner of the handles it
    /// locks.
    pub(crate) fn open(&self, role: Role) -> ClientOwner {
        let conn = self.next.fetch_add(1, Ordering::Relaxed);
        let mut state = lock(&self.state);
        let fresh = state.identities.len() as u64 + 1;
        let identity = *state.identities.entry(role).or_insert(fresh);
        state.conns.insert(conn, Conn { events: None, seq: 0 });
        ClientOwner { conn, identity }
    }

    /// Open client connections.
    pub fn count(&self) -> usize {
        lock(&self.state).conns.len()
    }

    pub(crate) fn close(&self, conn: u64) {
        lock(&self.state).conns.remove(&conn);
    }

    /// The event stream of connection `conn` (QUIC and the local socket). A connection has one
    /// live event stream at most: while it has one, a new subscription is refused. A connection
    /// that is gone gets a stream that never yields.
    pub(crate) fn subscribe(&self, conn: u64) -> Result<mpsc::Receiver<ClientEvent>, ApiError> {
        let mut state = lock(&self.state);
        if state.conns.get(&conn).and_then(|c| c.events.as_ref()).is_some_and(|events| !events.is_closed()) {
            return Err(second_event_stream());
        }
        Ok(Sessions::open_events(&mut state, conn))
    }

    /// The event stream of connection `conn`, ending the one it had (the HTTP API's: its
    /// clients reconnect).
    pub(crate) fn resubscribe(&self, conn: u64) -> mpsc::Receiver<ClientEvent> {
        Sessions::open_events(&mut lock(&self.state), conn)
    }

    fn open_events(state: &mut SessionState, conn: u64) -> mpsc::Receiver<ClientEvent> {
        let (tx, rx) = mpsc::channel(EVENT_QUEUE);
        if let Some(c) = state.conns.get_mut(&conn) {
            c.events = Some(tx);
        }
        rx
    }

    /// Sends each notice to the owning connection's event stream, if it has one. A full queue
    /// drops the event but not its number, so the client sees the gap. `ppm`: the epoch's
    /// clock-rate bound, the margin taken off a recall's time left.
    pub fn report(
        &self,
        clock: &BootClock,
        ppm: u32,
        notices: impl IntoIterator<Item = (ClientOwner, HandleId, Vec<u8>, Notice)>,
    ) {
        let mut state = lock(&self.state);
        let now = clock.now();
        for (owner, handle, key, notice) in notices {
            let Some(conn) = state.conns.get_mut(&owner.conn) else { continue };
            let Some(tx) = &conn.events else { continue };
            conn.seq += 1;
            let kind = match notice {
                // Counted from now, when the event is queued, with the rate margin: no later than
                // the handle's deadline in real time. The client still counts its deadline from
                // its last lock or renewal; this only tells it to hurry.
                Notice::Recalled { deadline } => EventKind::Recalled {
                    valid_for: rate_shrink(deadline.saturating_duration_since(now), ppm),
                },
                Notice::Expired => EventKind::Expired,
            };
            let _ = tx.try_send(ClientEvent { seq: conn.seq, handle: handle.serial(), key, kind });
        }
    }
}

/// Serves one client connection until it closes. Its handles live on to their deadlines (see
/// the module docs).
pub(crate) async fn serve(shared: Arc<Shared>, conn: quinn::Connection, role: Role, budget: Budget) {
    let owner = shared.api.open(role.clone());
    tracing::debug!(conn = owner.conn, %role, remote = %conn.remote_address(), "client connected");
    let mut stop = shared.shutdown.subscribe();
    loop {
        let stream = tokio::select! {
            s = conn.accept_bi() => s,
            _ = crate::runtime::stopping(&mut stop) => break,
        };
        match stream {
            Ok((send, recv)) => {
                let remote = conn.remote_address();
                let budget = budget.clone();
                tokio::spawn(serve_stream(
                    Arc::clone(&shared),
                    owner,
                    role.clone(),
                    remote,
                    budget,
                    send,
                    recv,
                ));
            }
            Err(_) => break,
        }
    }
    shared.api.close(owner.conn);
}

/// Serves one request stream. The request must arrive whole within the request timeout, its
/// bytes counted against `budget` while it arrives (see [`crate::admission`]); else the client is
/// answered with an [`ErrorKind::Invalid`] error and the stream stopped.
async fn serve_stream(
    shared: Arc<Shared>,
    owner: ClientOwner,
    role: Role,
    remote: std::net::SocketAddr,
    budget: Budget,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
) {
    let conn = owner.conn;
    let limit = shared.admission.limits.request_timeout();
    let budgets = [&*budget.connection, &*budget.identity];
    let read = wire::read_frame_within::<Request>(&mut recv, MAX_CLIENT_FRAME, &budgets);
    let (incident, message) = match tokio::time::timeout(limit, read).await {
        Ok(Ok(Some(request))) => return serve_request(shared, owner, role, request, send, recv).await,
        Ok(Ok(None)) | Ok(Err(wire::WireError::Read(_) | wire::WireError::Closed)) => return,
        Ok(Err(e)) => (Incident::RequestMalformed, format!("malformed request: {e}")),
        Err(_) => (
            Incident::RequestTimedOut,
            format!("the request did not arrive whole within {limit:?} (limits.request_timeout_ms)"),
        ),
    };
    shared.admission.incidents.report(incident, remote, format_args!("connection {conn}: {message}"));
    let _ = recv.stop(STOP_BAD_REQUEST.into());
    let error = Response::Error(ApiError::new(ErrorKind::Invalid, message));
    let _ = wire::write_frame(&mut send, &error, MAX_CLIENT_FRAME).await;
    let _ = send.finish();
}

async fn serve_request(
    shared: Arc<Shared>,
    owner: ClientOwner,
    role: Role,
    request: Request,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
) {
    let conn = owner.conn;
    if let Request::Subscribe = request {
        return subscribe(shared, conn, send).await;
    }
    // A client that gives up withdraws what was pending (the drop of `answer`'s future): a lock
    // call by resetting its half of the stream (`wire::RESET_WITHDRAW`), reading on for an answer
    // sent before that to give it back; any call by no longer reading (stopping this half).
    // `answer` is polled first: its first poll carries out what needs no waiting (a relock's
    // unlock).
    let response = tokio::select! {
        biased;
        r = answer(&shared, owner, &role, request) => r,
        Ok(Some(_)) = recv.received_reset() => {
            let _ = send.finish();
            return;
        }
        _ = send.stopped() => return,
    };
    let response = response.unwrap_or_else(Response::Error);
    let undelivered = Undelivered::new(&shared, owner, &response);
    match answer_frame(&response) {
        Ok(frame) => match send.write_all(&frame).await {
            Ok(()) => undelivered.delivered(),
            Err(e) => tracing::debug!(conn, "cannot answer the client: {e}"),
        },
        // The client is told why; a lock in the answer it does not get is given back.
        Err(error) => {
            tracing::warn!(conn, "an answer is not sent: {error}");
            let _ = wire::write_frame(&mut send, &Response::Error(error), MAX_CLIENT_FRAME).await;
        }
    }
    let _ = send.finish();
}

/// The frame of `response`, or, for one that does not fit a client frame (an epoch of very many
/// members with long addresses), the error the client gets instead, naming the cause.
fn answer_frame(response: &Response) -> Result<Vec<u8>, ApiError> {
    wire::encode(response, MAX_CLIENT_FRAME)
        .map_err(|e| ApiError::new(ErrorKind::Unavailable, format!("the answer cannot be sent: {e}")))
}

/// Answers one request of connection `owner`, whose identity is `role`, whichever transport it
/// came on (QUIC, the local socket, or the HTTP API). [`Request::Subscribe`] is the transport's
/// own. Its first poll carries out everything that needs no waiting (an unlock, or a lock
/// admitted at once).
pub(crate) async fn answer(
    shared: &Arc<Shared>,
    owner: ClientOwner,
    role: &Role,
    request: Request,
) -> Result<Response, ApiError> {
    match request {
        Request::Lock { key, ttl, wait } => {
            check_lock(shared, &key, ttl)?;
            lock_answer(shared, owner, &key, ttl, wait).await
        }
        Request::Relock { handle, note, key, ttl, wait } => {
            // Before the unlock, which could not be undone.
            check_lock(shared, &key, ttl)?;
            unlock_handle(shared, owner, handle, note)?;
            lock_answer(shared, owner, &key, ttl, wait).await
        }
        Request::Renew { handle, ttl } => {
            let ppm = shared.core.current().timing.clock_rate_ppm;
            let valid_for = shared.with_core(|core, now, out| {
                let h = core.claim(handle, owner).map_err(claim_error)?;
                core.renew(now, h, ttl, out)
                    .map(|deadline| rate_shrink(deadline.saturating_duration_since(now), ppm))
                    .map_err(lock_error)
            })?;
            Ok(Response::Renewed { valid_for })
        }
        Request::Unlock { handle, note } => {
            unlock_handle(shared, owner, handle, note)?;
            Ok(Response::Unlocked)
        }
        Request::GiveBack { handle } => {
            give_back_handle(shared, owner, handle)?;
            Ok(Response::Unlocked)
        }
        Request::Check { key, token } => {
            check_key(shared, &key)?;
            let (tx, rx) = oneshot::channel();
            shared.check_call(key, token, CHECK_TIMEOUT, tx).map_err(lock_error)?;
            match rx.await {
                Ok(Some(Ok(answer))) => Ok(Response::Checked { answer }),
                Ok(Some(Err(refusal))) => Err(lock_error(LockError::Refused(refusal))),
                Ok(None) => Err(ApiError::new(
                    ErrorKind::Unavailable,
                    "the key's home or holder did not answer in time",
                )),
                Err(_) => Err(lock_error(LockError::Closed)),
            }
        }
        Request::Status => Ok(Response::Status(Box::new(shared.status()))),
        Request::EpochShow => Ok(Response::Epoch(Box::new(shared.core.current()))),
        Request::Propose(proposal) => {
            if *role != Role::Operator {
                return Err(ApiError::new(
                    ErrorKind::Forbidden,
                    "changing the membership needs an operator certificate",
                ));
            }
            if let keyhome_epoch::Change::Add(m) | keyhome_epoch::Change::Replace { new: m, .. } =
                &proposal.change
            {
                crate::addr::check(&m.addr).map_err(|e| ApiError::new(ErrorKind::Invalid, e))?;
            }
            match tokio::time::timeout(PROPOSE_TIMEOUT, crate::proposal::propose(shared, proposal)).await {
                Ok(Ok(epoch)) => Ok(Response::Proposed { epoch }),
                Ok(Err(ProposalError::Epoch(ProposeError::Stopped))) => Err(ApiError::new(
                    ErrorKind::Unavailable,
                    "the node stopped before the change was decided; check `keyhome epoch show`",
                )),
                Ok(Err(e)) => Err(ApiError::new(ErrorKind::Epoch, e.to_string())),
                Err(_) => {
                    Err(ApiError::new(ErrorKind::Unavailable, "no decision yet; check `keyhome epoch show`"))
                }
            }
        }
        Request::RecoverUnsafe { members, stopped, skip } => {
            if *role != Role::Operator {
                return Err(ApiError::new(ErrorKind::Forbidden, "recovery needs an operator certificate"));
            }
            for m in &members {
                crate::addr::check(&m.addr).map_err(|e| ApiError::new(ErrorKind::Invalid, e))?;
            }
            let epoch = shared.with_core(|core, now, out| {
                let mut left_out: Vec<_> =
                    core.current().member_ids().filter(|id| !members.iter().any(|m| m.id == *id)).collect();
                if left_out.is_empty() {
                    return Err(ApiError::new(
                        ErrorKind::Invalid,
                        "a recovery leaves out the members lost for good, and this one leaves out none: with \
                         every member at hand, propose a change instead",
                    ));
                }
                let mut confirmed = stopped.clone();
                left_out.sort();
                confirmed.sort();
                confirmed.dedup();
                if left_out != confirmed {
                    let list = |v: &[keyhome_epoch::NodeId]| {
                        v.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(",")
                    };
                    return Err(ApiError::new(
                        ErrorKind::Invalid,
                        format!(
                            "--confirm-stopped must list exactly the members left out ({}), not ({})",
                            list(&left_out),
                            list(&confirmed)
                        ),
                    ));
                }
                core.recover_unsafe(now, members, skip, out)
                    .map_err(|e| ApiError::new(ErrorKind::Epoch, e.to_string()))
            })?;
            tracing::warn!(epoch, "UNSAFE recovery installed a new epoch without agreement");
            Ok(Response::Proposed { epoch })
        }
        Request::Subscribe => Err(ApiError::new(ErrorKind::Invalid, "subscribe on its own stream")),
    }
}

/// Refuses a lock the core would refuse for its arguments (a zero `ttl`, a bad key), before
/// anything of the request is carried out.
fn check_lock(shared: &Arc<Shared>, key: &[u8], ttl: Duration) -> Result<(), ApiError> {
    check_key(shared, key)?;
    if ttl.is_zero() {
        return Err(lock_error(LockError::ZeroTtl));
    }
    Ok(())
}

/// Refuses an empty key, and a key longer than this node accepts, saying what the limit is.
fn check_key(shared: &Arc<Shared>, key: &[u8]) -> Result<(), ApiError> {
    let max = shared.max_key_len;
    if key.is_empty() {
        return Err(ApiError::new(
            ErrorKind::Invalid,
            format!("the key is empty: a key has 1 to {max} bytes"),
        ));
    }
    if key.len() > max {
        return Err(ApiError::new(
            ErrorKind::Invalid,
            format!("the key is {} bytes, longer than the {max} bytes this node accepts", key.len()),
        ));
    }
    Ok(())
}

async fn lock_answer(
    shared: &Arc<Shared>,
    owner: ClientOwner,
    key: &[u8],
    ttl: Duration,
    wait: Duration,
) -> Result<Response, ApiError> {
    let handle =
        crate::runtime::lock_key(shared, key, ttl, wait, Owner::Client(owner)).await.map_err(lock_error)?;
    let now = shared.clock.now();
    let ppm = shared.core.current().timing.clock_rate_ppm;
    Ok(Response::Locked(locked(&handle, now, ppm)))
}

fn unlock_handle(
    shared: &Arc<Shared>,
    owner: ClientOwner,
    handle: u64,
    note: Option<Vec<u8>>,
) -> Result<(), ApiError> {
    shared.with_core(|core, now, out| {
        let h = core.claim(handle, owner).map_err(claim_error)?;
        core.end(now, h, Ending::Unlocked(note), out).map_err(lock_error)
    })
}

/// Ends handle `handle` of `owner`'s identity, which no caller saw: see [`Request::GiveBack`].
fn give_back_handle(shared: &Arc<Shared>, owner: ClientOwner, handle: u64) -> Result<(), ApiError> {
    shared.with_core(|core, now, out| {
        let h = core.claim(handle, owner).map_err(claim_error)?;
        core.end(now, h, Ending::GivenBack, out).map_err(lock_error)
    })
}

/// Gives back handle `handle` of `owner`, named by a lock answer none of whose bytes reached the
/// client (see [`Undelivered`]).
pub(crate) fn give_back_unsent(shared: &Arc<Shared>, owner: ClientOwner, handle: u64) {
    tracing::debug!(conn = owner.conn, handle, "a lock answer reached nobody: given back");
    let _ = give_back_handle(shared, owner, handle);
}

/// A call's answer on its way to the client. If it is a lock's and is dropped before
/// [`Undelivered::delivered`] (the connection ended, or the task carrying it was aborted, before
/// the transport took the whole answer), its handle is given back: no caller can have learned it,
/// and the key would otherwise stay taken until the handle's deadline.
///
/// Only an answer the transport never took whole may be given back: one written to the socket
/// may have been read, and its caller may hold the key.
pub(crate) struct Undelivered<'a> {
    shared: &'a Arc<Shared>,
    owner: ClientOwner,
    handle: Option<u64>,
}

impl<'a> Undelivered<'a> {
    pub(crate) fn new(shared: &'a Arc<Shared>, owner: ClientOwner, response: &Response) -> Undelivered<'a> {
        Undelivered { shared, owner, handle: response.locked_handle() }
    }

    /// The transport took the whole answer.
    pub(crate) fn delivered(mut self) {
        self.handle = None;
    }
}

impl Drop for Undelivered<'_> {
    fn drop(&mut self) {
        if let Some(handle) = self.handle {
            give_back_unsent(self.shared, self.owner, handle);
        }
    }
}

fn claim_error(e: ClaimError) -> ApiError {
    match e {
        ClaimError::NotHeld(_) => ApiError::new(ErrorKind::Lost, e.to_string()),
        ClaimError::Forbidden(_) => ApiError::new(ErrorKind::Forbidden, e.to_string()),
    }
}

/// Streams the connection's events. A connection has at most one live event stream: a second
/// `Subscribe` while the first is open is answered with an [`ErrorKind::Invalid`] error (the
/// first goes on); once the first has ended, a new one may start.
async fn subscribe(shared: Arc<Shared>, conn: u64, mut send: quinn::SendStream) {
    let mut rx = match shared.api.subscribe(conn) {
        Ok(rx) => rx,
        Err(error) => {
            let _ = wire::write_frame(&mut send, &Response::Error(error), MAX_CLIENT_FRAME).await;
            let _ = send.finish();
            return;
        }
    };
    if wire::write_frame(&mut send, &Response::Subscribed, MAX_CLIENT_FRAME).await.is_err() {
        return;
    }
    loop {
        tokio::select! {
            event = rx.recv() => match event {
                Some(event) => {
                    if wire::write_frame(&mut send, &event, MAX_CLIENT_FRAME).await.is_err() {
                        return;
                    }
                }
                None => return,
            },
            _ = send.stopped() => return,
        }
    }
}

/// The wire form of a handle admitted, answered at `now` under a clock-rate bound of `ppm`: the
/// client counts `valid_for` from its own send instant, on its own clock.
pub fn locked(handle: &Handle, now: Instant, ppm: u32) -> Locked {
    Locked {
        handle: handle.id.serial(),
        token: handle.token,
        valid_for: rate_shrink(handle.deadline.saturating_duration_since(now), ppm),
        note: handle.note.clone(),
        recovered: handle.recovered,
    }
}

/// How a lock error reads to a client.
pub fn lock_error(e: LockError) -> ApiError {
    let kind = match e {
        LockError::WouldBlock | LockError::Timeout => ErrorKind::Timeout,
        LockError::Expired | LockError::UnknownHandle => ErrorKind::Lost,
        LockError::KeyTooLong | LockError::ZeroTtl | LockError::NoteTooLarge => ErrorKind::Invalid,
        LockError::QueueFull
        | LockError::TooManyKeys
        | LockError::NoHome
        | LockError::Refused(_)
        | LockError::Closed => ErrorKind::Unavailable,
    };
    ApiError::new(kind, e.to_string())
}

#[cfg(test)]
mod tests {
    use keyhome_epoch::{EpochRecord, Member, NodeId, Timing};

    use super::*;

    /// An epoch the rules allow (1024 members with 63-byte addresses) does not fit a client frame:
    /// its client is told so, in an error that does.
    #[test]
    fn an_answer_too_large_for_a_frame_becomes_an_error_naming_why() {
        let host = "h".repeat(56);
        let members = (1..=1024).map(|i| Member { id: NodeId(i), addr: format!("{host}:{}", 10_000 + i) });
        let record = EpochRecord::genesis(members.collect(), Timing::DEFAULT).expect("a valid epoch");
        let error = answer_frame(&Response::Epoch(Box::new(record))).expect_err("too large for a frame");
        assert_eq!(error.kind, ErrorKind::Unavailable);
        assert!(error.message.contains("exceeds the limit of 65536"), "{}", error.message);
        assert!(wire::encode(&Response::Error(error), MAX_CLIENT_FRAME).is_ok());
        assert!(answer_frame(&Response::Unlocked).is_ok());
    }
}
