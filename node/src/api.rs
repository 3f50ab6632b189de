//! The client API, server side: requests from applications and operators on ALPN
//! `keyhome-client/1`, one bidirectional stream per request.
//!
//! # Sessions
//!
//! A handle belongs to the client connection that locked it. When that connection ends, its
//! handles are unlocked after the configured grace (`locks.session_grace_ms`), unless a new
//! connection with the same certificate identity renewed or unlocked them first (which moves them
//! to the new connection). Lost handles are reported on the owning connection's event stream
//! ([`Request::Subscribe`]), if it opened one.
//!
//! # Authorisation
//!
//! Client and operator certificates may lock, renew, unlock, check and read status; only an
//! operator certificate may change the membership. Node certificates are refused on this protocol.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use keyhome_delegation::{Handle, LockError, RevokeReason};
use keyhome_epoch::Instant;
use tokio::sync::{mpsc, oneshot};

use crate::core::{Lost, Owner};
use crate::pki::Role;
use crate::runtime::{Shared, lock};
use crate::wire::{
    self, ApiError, ClientEvent, ErrorKind, Locked, LostReason, MAX_CLIENT_FRAME, Request, Response,
};

/// Lost-handle events queued per subscribed connection before further ones are dropped.
const EVENT_QUEUE: usize = 1024;
/// How long a token check waits for the key's home (or its holder) to answer.
const CHECK_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an operator change may take before the client is told to look again.
const PROPOSE_TIMEOUT: Duration = Duration::from_secs(60);

/// The client connections of one node.
pub struct Sessions {
    grace: Duration,
    next: AtomicU64,
    conns: std::sync::Mutex<HashMap<u64, Conn>>,
}

/// One client connection: its certificate's role and its event stream, if it subscribed.
struct Conn {
    role: Role,
    events: Option<mpsc::Sender<ClientEvent>>,
}

impl Sessions {
    pub fn new(grace: Duration) -> Sessions {
        Sessions { grace, next: AtomicU64::new(1), conns: std::sync::Mutex::new(HashMap::new()) }
    }

    /// Sends each loss to the owning connection's event stream, if it has one.
    pub fn report_lost(&self, lost: impl IntoIterator<Item = Lost>) {
        let conns = lock(&self.conns);
        for l in lost {
            if let Some(Conn { events: Some(tx), .. }) = conns.get(&l.owner) {
                let reason = match l.reason {
                    RevokeReason::Recalled => LostReason::Recalled,
                    RevokeReason::Expired => LostReason::Expired,
                };
                let _ = tx.try_send(ClientEvent::Lost { handle: l.handle.serial(), key: l.key, reason });
            }
        }
    }

    fn role_of(&self, conn: u64) -> Option<Role> {
        lock(&self.conns).get(&conn).map(|c| c.role.clone())
    }
}

/// Serves one client connection until it closes, then schedules the release of its handles.
pub(crate) async fn serve(shared: Arc<Shared>, conn: quinn::Connection, role: Role) {
    let id = shared.api.next.fetch_add(1, Ordering::Relaxed);
    lock(&shared.api.conns).insert(id, Conn { role: role.clone(), events: None });
    tracing::debug!(conn = id, ?role, remote = %conn.remote_address(), "client connected");
    let mut stop = shared.shutdown.subscribe();
    loop {
        let stream = tokio::select! {
            s = conn.accept_bi() => s,
            _ = crate::runtime::stopping(&mut stop) => break,
        };
        match stream {
            Ok((send, recv)) => {
                tokio::spawn(serve_stream(Arc::clone(&shared), id, role.clone(), send, recv));
            }
            Err(_) => break,
        }
    }
    lock(&shared.api.conns).remove(&id);
    let grace = shared.api.grace;
    tokio::spawn(async move {
        tokio::time::sleep(grace).await;
        shared.with_core(|core, now| {
            for handle in core.handles_of(Owner::Client(id)) {
                let _ = core.abandon(now, handle);
            }
        });
    });
}

async fn serve_stream(
    shared: Arc<Shared>,
    conn: u64,
    role: Role,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
) {
    let request = match wire::read_frame::<Request>(&mut recv, MAX_CLIENT_FRAME).await {
        Ok(Some(request)) => request,
        Ok(None) => return,
        Err(e) => {
            tracing::info!(conn, "malformed client request: {e}");
            let error = ApiError::new(ErrorKind::Invalid, format!("malformed request: {e}"));
            let _ = wire::write_frame(&mut send, &Response::Error(error), MAX_CLIENT_FRAME).await;
            let _ = send.finish();
            return;
        }
    };
    if let Request::Subscribe = request {
        return subscribe(shared, conn, send).await;
    }
    let response = tokio::select! {
        r = answer(&shared, conn, &role, request) => r,
        // The client gave up (reset the stream): whatever was pending was cancelled by the drop.
        _ = send.stopped() => return,
    };
    let response = response.unwrap_or_else(Response::Error);
    if let Err(e) = wire::write_frame(&mut send, &response, MAX_CLIENT_FRAME).await {
        tracing::debug!(conn, "cannot answer the client: {e}");
    }
    let _ = send.finish();
}

async fn answer(
    shared: &Arc<Shared>,
    conn: u64,
    role: &Role,
    request: Request,
) -> Result<Response, ApiError> {
    let owner = Owner::Client(conn);
    match request {
        Request::Lock { key, ttl, wait } => {
            let (tx, rx) = oneshot::channel();
            let outcome = shared.with_core(|core, now| {
                core.lock(now, &key, ttl, wait, owner, || tx).map(|r| r.map(|h| locked(&h, now)))
            });
            match outcome.map_err(lock_error)? {
                Ok(locked) => Ok(Response::Locked(locked)),
                Err(ticket) => {
                    let handle = crate::runtime::await_lock(shared, ticket, rx).await.map_err(lock_error)?;
                    Ok(Response::Locked(locked(&handle, shared.clock.now())))
                }
            }
        }
        Request::Renew { handle, ttl } => {
            let remaining = shared.with_core(|core, now| {
                let h = claim(core, &shared.api, conn, role, handle)?;
                core.renew(now, h, ttl)
                    .map(|deadline| deadline.saturating_duration_since(now))
                    .map_err(lock_error)
            })?;
            Ok(Response::Renewed { valid_for: remaining })
        }
        Request::Unlock { handle, note } => {
            shared.with_core(|core, now| {
                let h = claim(core, &shared.api, conn, role, handle)?;
                core.unlock(now, h, note).map_err(lock_error)
            })?;
            Ok(Response::Unlocked)
        }
        Request::Check { key, token } => {
            let (tx, rx) = oneshot::channel();
            shared.with_core(|core, now| core.check(now, key, token, tx)).map_err(lock_error)?;
            match tokio::time::timeout(CHECK_TIMEOUT, rx).await {
                Ok(Ok(Ok(answer))) => Ok(Response::Checked { answer }),
                Ok(Ok(Err(refusal))) => Err(lock_error(LockError::Refused(refusal))),
                _ => Err(ApiError::new(
                    ErrorKind::Unavailable,
                    "the key's home or holder did not answer in time",
                )),
            }
        }
        Request::Status => Ok(Response::Status(Box::new(shared.status()))),
        Request::EpochShow => {
            Ok(Response::Epoch(Box::new(shared.with_core(|core, _| core.epoch.current().clone()))))
        }
        Request::Propose(change) => {
            if *role != Role::Operator {
                return Err(ApiError::new(
                    ErrorKind::Forbidden,
                    "changing the membership needs an operator certificate",
                ));
            }
            let (tx, rx) = oneshot::channel();
            shared
                .with_core(|core, now| core.propose(now, change, tx))
                .map_err(|e| ApiError::new(ErrorKind::Epoch, e.to_string()))?;
            match tokio::time::timeout(PROPOSE_TIMEOUT, rx).await {
                Ok(Ok(Ok(epoch))) => Ok(Response::Proposed { epoch }),
                Ok(Ok(Err(e))) => Err(ApiError::new(ErrorKind::Epoch, e.to_string())),
                _ => {
                    Err(ApiError::new(ErrorKind::Unavailable, "no decision yet; check `keyhome epoch show`"))
                }
            }
        }
        Request::RecoverUnsafe { members, stopped, skip } => {
            if *role != Role::Operator {
                return Err(ApiError::new(ErrorKind::Forbidden, "recovery needs an operator certificate"));
            }
            let epoch = shared.with_core(|core, now| {
                let mut left_out: Vec<_> = core
                    .epoch
                    .current()
                    .member_ids()
                    .filter(|id| !members.iter().any(|m| m.id == *id))
                    .collect();
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
                core.recover_unsafe(now, members, skip)
                    .map_err(|e| ApiError::new(ErrorKind::Epoch, e.to_string()))
            })?;
            tracing::warn!(epoch, "UNSAFE recovery installed a new epoch without agreement");
            Ok(Response::Proposed { epoch })
        }
        Request::Subscribe => Err(ApiError::new(ErrorKind::Invalid, "subscribe on its own stream")),
    }
}

/// The handle `serial`, if this connection, or one with the same certificate identity, owns it;
/// it then belongs to this connection.
fn claim(
    core: &mut crate::core::Core,
    sessions: &Sessions,
    conn: u64,
    role: &Role,
    serial: u64,
) -> Result<keyhome_delegation::HandleId, ApiError> {
    let unknown = || {
        ApiError::new(
            ErrorKind::Lost,
            format!("handle {serial} is not held (unlocked, lost or never issued)"),
        )
    };
    let (handle, owner) = core.handle(serial).ok_or_else(unknown)?;
    match owner {
        Owner::Client(c) if c == conn => Ok(handle),
        Owner::Client(c) if sessions.role_of(c).is_none_or(|r| r == *role) => {
            core.set_owner(handle, Owner::Client(conn));
            Ok(handle)
        }
        _ => Err(ApiError::new(ErrorKind::Forbidden, format!("handle {serial} belongs to another client"))),
    }
}

async fn subscribe(shared: Arc<Shared>, conn: u64, mut send: quinn::SendStream) {
    let (tx, mut rx) = mpsc::channel(EVENT_QUEUE);
    if let Some(c) = lock(&shared.api.conns).get_mut(&conn) {
        c.events = Some(tx);
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

/// The wire form of a handle admitted at `now`.
pub fn locked(handle: &Handle, now: Instant) -> Locked {
    Locked {
        handle: handle.id.serial(),
        token: handle.token,
        valid_for: handle.deadline.saturating_duration_since(now),
        note: handle.note.clone(),
        recovered: handle.recovered,
    }
}

/// How a lock error reads to a client.
pub fn lock_error(e: LockError) -> ApiError {
    let kind = match e {
        LockError::WouldBlock | LockError::Timeout => ErrorKind::Timeout,
        LockError::Revoked | LockError::Expired | LockError::UnknownHandle => ErrorKind::Lost,
        LockError::KeyTooLong | LockError::ZeroTtl | LockError::NoteTooLarge => ErrorKind::Invalid,
        LockError::QueueFull | LockError::NoHome | LockError::Refused(_) | LockError::Closed => {
            ErrorKind::Unavailable
        }
    };
    ApiError::new(kind, e.to_string())
}
