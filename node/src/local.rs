//! The client API on a Unix domain socket, for applications on the node's host: the same
//! requests as on QUIC ([`crate::api`] answers both), without TLS or a handshake.
//!
//! # Frames
//!
//! Length-prefixed postcard frames as on QUIC ([`crate::wire`]), at most [`MAX_CLIENT_FRAME`]
//! bytes: the client sends [`LocalRequest`]s, the node [`LocalFrame`]s. The node first sends a
//! [`LocalFrame::Hello`] naming the local protocol versions it serves
//! ([`wire::LOCAL_PROTOCOLS`]; these frames are version 1), or [`LocalFrame::Refused`] and
//! closes. Each call carries an id of
//! the client's choosing; answers carry it back and may come out of order (a lock that waits
//! does not hold up the calls after it).
//!
//! # Order
//!
//! The requests of one connection are *started* in the order they arrive: each one's first
//! step (an unlock, a lock admitted at once, a lock queued behind the holder) is taken before the
//! next frame is read. So a client may send an unlock without waiting for its answer, or as a
//! [`LocalRequest::Cast`] that gets none, and the next request on the connection sees its effect.
//!
//! # Identity
//!
//! Who may connect is decided twice: by the socket file's mode ([`LocalSettings::mode`]), and by
//! the peer's credentials (`SO_PEERCRED`, which the kernel fills in at connect), mapped to a
//! client or operator identity by [`LocalSettings::role_of`]; an unmapped peer is refused with a
//! reason. The identity is the same as a certificate of that role on QUIC: handles pass between
//! connections of one identity, whichever transport, and [`crate::api::Sessions`] reports the
//! connection's lost-lock events, numbered, after a [`Request::Subscribe`].
//!
//! # Bounds
//!
//! At most [`LocalSettings::max_connections`] connections (further ones are refused), at most
//! [`LocalSettings::max_in_flight`] requests that may wait ([`Request::may_wait`]) in progress per
//! connection (a further one is answered `Unavailable` at once, before anything is done; a request
//! answered at once, such as an unlock, takes no slot), frames of at most [`MAX_CLIENT_FRAME`] bytes (a larger or malformed
//! frame ends the connection with a [`LocalFrame::Refused`] saying why). A connection's waiting
//! requests are withdrawn when it closes; its handles live on to their deadlines, as on QUIC.

use std::collections::HashMap;
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Poll;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::AbortHandle;
use tokio_util::codec::{FramedRead, FramedWrite, LengthDelimitedCodec};

use crate::admission::Incident;
use crate::config::LocalSettings;
use crate::core::ClientOwner;
use crate::pki::Role;
use crate::ratelog::Source;
use crate::runtime::Shared;
use crate::socket_file::{SocketFile, SocketFileError};
use crate::wire::{
    self, ApiError, ErrorKind, LocalFrame, LocalHello, LocalRequest, MAX_CLIENT_FRAME, Request, Response,
};

/// How long the node keeps writing to a connection it is closing (its last answers and the
/// reason), so a client that stopped reading cannot hold the task.
const CLOSE_FLUSH: Duration = Duration::from_secs(1);

/// The frame codec of both sides: a 4-byte big-endian length, then the body.
pub fn codec() -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder()
        .length_field_length(4)
        .big_endian()
        .max_frame_length(MAX_CLIENT_FRAME)
        .new_codec()
}

/// The local socket, placed ([`SocketFile`]) and listening.
pub(crate) struct LocalListener {
    listener: UnixListener,
    settings: LocalSettings,
    file: SocketFile,
}

impl LocalListener {
    /// Places `settings.socket` with `settings.mode` ([`SocketFile::bind`]).
    pub(crate) fn bind(settings: &LocalSettings) -> Result<LocalListener, SocketFileError> {
        let (listener, file) = SocketFile::bind(&settings.socket, settings.mode)?;
        Ok(LocalListener { listener, settings: settings.clone(), file })
    }

    pub(crate) fn path(&self) -> &Path {
        self.file.path()
    }
}

/// Accepts local connections until the node stops.
pub(crate) async fn accept_loop(shared: Arc<Shared>, listener: LocalListener) {
    let own_uid = rustix::process::getuid().as_raw();
    let connections = Arc::new(Semaphore::new(listener.settings.max_connections));
    let mut stop = shared.shutdown.subscribe();
    loop {
        let stream = tokio::select! {
            s = listener.listener.accept() => s,
            _ = crate::runtime::stopping(&mut stop) => break,
        };
        let stream = match stream {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, say: the next accept may work again.
                tracing::warn!("cannot accept on the local socket: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let cred = stream.peer_cred();
        let source = Source::Local(cred.as_ref().ok().map(|c| c.uid()));
        let admission = match (cred, Arc::clone(&connections).try_acquire_owned()) {
            (Err(e), _) => Err(format!("cannot read the peer's credentials: {e}")),
            (Ok(_), Err(_)) => Err(format!(
                "too many local connections (at most {}); close one and retry",
                listener.settings.max_connections
            )),
            // Counted with the identity's QUIC connections against the node's [limits] (total
            // client connections, and per identity): one mapped uid cannot take every slot.
            (Ok(cred), Ok(permit)) => match listener.settings.role_of(cred.uid(), cred.gid(), own_uid) {
                Some(role) => match shared.admission.connection(&role) {
                    Ok(slot) => Ok((role, (permit, slot))),
                    Err(cap) => Err(format!("{role}: {cap}")),
                },
                None => Err(format!(
                    "uid {} (gid {}) is not allowed on {}: no [[local.allow]] entry maps it",
                    cred.uid(),
                    cred.gid(),
                    listener.path().display()
                )),
            },
        };
        match admission {
            Ok((role, places)) => {
                let max_in_flight = listener.settings.max_in_flight;
                let shared = Arc::clone(&shared);
                tokio::spawn(async move {
                    serve(shared, stream, Peer { role, source }, max_in_flight).await;
                    drop(places);
                });
            }
            Err(reason) => {
                let detail = format!("local connection refused: {reason}");
                shared.admission.incidents.report(Incident::ConnectionRefused, source, detail);
                tokio::spawn(refuse(stream, ApiError::new(ErrorKind::Forbidden, reason)));
            }
        }
    }
}

/// Tells a peer why it is refused, then closes.
async fn refuse(stream: UnixStream, error: ApiError) {
    let mut out = FramedWrite::new(stream, codec());
    if let Ok(frame) = frame_bytes(&LocalFrame::Refused(error)) {
        let _ = tokio::time::timeout(CLOSE_FLUSH, out.send(frame)).await;
    }
}

/// A frame's body (the codec adds the length prefix and refuses one over [`MAX_CLIENT_FRAME`]).
fn frame_bytes(frame: &LocalFrame) -> Result<bytes::Bytes, postcard::Error> {
    postcard::to_allocvec(frame).map(bytes::Bytes::from)
}

/// Who is on the other end of a local connection.
struct Peer {
    role: Role,
    /// Its uid, for the rate-limited logs.
    source: Source,
}

/// Serves one local connection until it closes, the peer sends a bad frame, or the node stops.
async fn serve(shared: Arc<Shared>, stream: UnixStream, peer: Peer, max_in_flight: usize) {
    let Peer { role, source } = peer;
    let owner = shared.api.open(role.clone());
    tracing::debug!(conn = owner.conn, ?role, "local client connected");
    let (read, write) = stream.into_split();
    // Each request in flight sends one answer; events wait for room (their queue is bounded).
    let (out, out_rx) = mpsc::channel::<LocalFrame>(max_in_flight + 1);
    let mut writer =
        tokio::spawn(write_frames(Arc::clone(&shared), owner, FramedWrite::new(write, codec()), out_rx));
    let hello = LocalHello { node: shared.id, identity: role.dns_name(), protocols: wire::LOCAL_PROTOCOLS };
    let mut conn = Connection {
        shared: Arc::clone(&shared),
        owner,
        role: Arc::new(role),
        source,
        out,
        in_flight: Arc::new(Semaphore::new(max_in_flight)),
        max_in_flight,
        waiting: HashMap::new(),
        events: None,
    };
    if conn.out.send(LocalFrame::Hello(hello)).await.is_ok() {
        conn.run(FramedRead::new(read, codec())).await;
    }
    for task in conn.waiting.values().map(|w| &w.task).chain(conn.events.as_ref()) {
        task.abort();
    }
    shared.api.close(owner.conn);
    drop(conn);
    // A peer that does not read keeps the writer (and the socket) busy: it goes with the
    // connection, so the connection's places are freed only when its socket is.
    if tokio::time::timeout(CLOSE_FLUSH, &mut writer).await.is_err() {
        writer.abort();
        let _ = writer.await;
    }
}

/// Writes frames as they come, flushing whenever no further one is ready (so answers that are
/// ready together leave in one write). When the writer ends (a write failed, or it was aborted at
/// close), the lock answers none of whose bytes reached the socket are given back: the one being
/// added to the write buffer and those still queued ([`Unwritten`]). Answers already in the buffer
/// may have been written in part or whole, so they keep their keys.
async fn write_frames(
    shared: Arc<Shared>,
    owner: ClientOwner,
    mut sink: FramedWrite<tokio::net::unix::OwnedWriteHalf, LengthDelimitedCodec>,
    frames: mpsc::Receiver<LocalFrame>,
) {
    let mut rest = Unwritten { shared, owner, frames, current: None };
    'frames: while let Some(frame) = rest.frames.recv().await {
        let mut next = Some(frame);
        while let Some(frame) = next {
            match sendable(&frame) {
                Ok(bytes) => {
                    // A failed `feed` buffered nothing of this frame (the earlier ones' write
                    // failed), nor does one that is aborted.
                    rest.current = Some(frame);
                    if sink.feed(bytes).await.is_err() {
                        break 'frames;
                    }
                    rest.current = None;
                }
                Err(replacement) => {
                    rest.give_back(&frame);
                    if let Some(bytes) = replacement
                        && sink.feed(bytes).await.is_err()
                    {
                        break 'frames;
                    }
                }
            }
            next = rest.frames.try_recv().ok();
        }
        if SinkExt::<bytes::Bytes>::flush(&mut sink).await.is_err() {
            break;
        }
    }
    // After `close`, `recv` yields every frame a sender queued, or is queueing now, then ends.
    rest.frames.close();
    while let Some(frame) = rest.frames.recv().await {
        rest.give_back(&frame);
    }
}

/// What a local connection's writer has not written: given back when it is dropped, the writer
/// done or aborted.
struct Unwritten {
    shared: Arc<Shared>,
    owner: ClientOwner,
    frames: mpsc::Receiver<LocalFrame>,
    /// The frame being added to the write buffer (none of its bytes are there while it is).
    current: Option<LocalFrame>,
}

impl Unwritten {
    /// Gives back the handle of `frame`, if it is a lock answer.
    fn give_back(&self, frame: &LocalFrame) {
        if let LocalFrame::Answer { response, .. } = frame
            && let Some(handle) = response.locked_handle()
        {
            crate::api::give_back_unsent(&self.shared, self.owner, handle);
        }
    }
}

impl Drop for Unwritten {
    /// The writer's end, or its abort. An abort cannot wait for a sender in the middle of a send
    /// (`try_recv` misses its frame); it comes the close's flush time after the connection's
    /// calls were aborted, when none is.
    fn drop(&mut self) {
        if let Some(frame) = self.current.take() {
            self.give_back(&frame);
        }
        self.frames.close();
        while let Ok(frame) = self.frames.try_recv() {
            self.give_back(&frame);
        }
    }
}

/// The bytes of `frame`, if the codec takes them; else what goes instead: an answer too large for
/// a frame becomes an error answer to its call (the codec would refuse it, and with it the write
/// of the answers buffered before it), any other frame nothing.
fn sendable(frame: &LocalFrame) -> Result<bytes::Bytes, Option<bytes::Bytes>> {
    let unsendable = match frame_bytes(frame) {
        Ok(bytes) if bytes.len() <= MAX_CLIENT_FRAME => return Ok(bytes),
        Ok(bytes) => {
            format!("the answer is {} bytes, more than a frame takes ({MAX_CLIENT_FRAME})", bytes.len())
        }
        Err(e) => format!("the answer cannot be encoded: {e}"),
    };
    tracing::warn!("a local frame is not sent: {unsendable}");
    match frame {
        LocalFrame::Answer { id, .. } => {
            let error = ApiError::new(ErrorKind::Unavailable, unsendable);
            Err(frame_bytes(&LocalFrame::Answer { id: *id, response: Response::Error(error) }).ok())
        }
        _ => Err(None),
    }
}

/// A call left running, by its id on the connection.
struct Waiting {
    task: AbortHandle,
    /// Its answer is decided (queued for the client, or about to be): the id is free again.
    answered: Arc<AtomicBool>,
}

/// One local connection's state.
struct Connection {
    shared: Arc<Shared>,
    owner: ClientOwner,
    role: Arc<Role>,
    /// The peer's uid, for the rate-limited logs.
    source: Source,
    out: mpsc::Sender<LocalFrame>,
    in_flight: Arc<Semaphore>,
    max_in_flight: usize,
    /// Requests still waiting (a lock queued behind its holder), by call id.
    waiting: HashMap<u64, Waiting>,
    /// The task forwarding the connection's events, once it subscribed.
    events: Option<AbortHandle>,
}

impl Connection {
    async fn run(&mut self, mut frames: FramedRead<tokio::net::unix::OwnedReadHalf, LengthDelimitedCodec>) {
        let mut stop = self.shared.shutdown.subscribe();
        loop {
            let frame = tokio::select! {
                f = frames.next() => f,
                _ = crate::runtime::stopping(&mut stop) => return,
            };
            let request = match frame {
                None => return,
                Some(Ok(body)) => wire::decode::<LocalRequest>(&body).map_err(|e| e.to_string()),
                Some(Err(e)) => Err(format!("malformed frame: {e}")),
            };
            let keep_on = match request {
                Ok(LocalRequest::Call { id, request }) => self.call(id, request).await,
                Ok(LocalRequest::Cast { request }) => self.cast(request).await,
                Ok(LocalRequest::Cancel { id }) => {
                    if let Some(waiting) = self.waiting.remove(&id) {
                        waiting.task.abort();
                    }
                    true
                }
                Err(e) => {
                    let detail = format!("connection {}: malformed local frame: {e}", self.owner.conn);
                    self.shared.admission.incidents.report(Incident::RequestMalformed, self.source, detail);
                    let error = ApiError::new(ErrorKind::Invalid, e);
                    let _ = self.out.send(LocalFrame::Refused(error)).await;
                    false
                }
            };
            if !keep_on {
                return;
            }
        }
    }

    /// Starts call `id`: answers it if it completes at once, else leaves it running. False once
    /// the connection's writer is gone.
    async fn call(&mut self, id: u64, request: Request) -> bool {
        // Its answer could not be told from the first one's, and the first could no longer be
        // cancelled or withdrawn at close.
        if self.waiting.get(&id).is_some_and(|w| !w.answered.load(Ordering::Acquire)) {
            let error = ApiError::new(ErrorKind::Invalid, format!("call id {id} is already in flight"));
            let _ = self.out.send(LocalFrame::Refused(error)).await;
            return false;
        }
        if let Request::Subscribe = request {
            return self.subscribe(id).await;
        }
        // Only a request that may wait takes a slot, and past the bound it is refused before
        // anything is done: locks waiting on a key can fill every slot without holding up the
        // unlock that would end their wait, answered at once.
        let permit = match request.may_wait() {
            true => match Arc::clone(&self.in_flight).try_acquire_owned() {
                Ok(permit) => Some(permit),
                Err(_) => {
                    let error = ApiError::new(
                        ErrorKind::Unavailable,
                        format!(
                            "too many requests waiting on this connection (at most {})",
                            self.max_in_flight
                        ),
                    );
                    let refusal = LocalFrame::Answer { id, response: Response::Error(error) };
                    return self.out.send(refusal).await.is_ok();
                }
            },
            false => None,
        };
        let (shared, role, owner) = (Arc::clone(&self.shared), Arc::clone(&self.role), self.owner);
        let mut answer = Box::pin(async move { crate::api::answer(&shared, owner, &role, request).await });
        if let Some(result) = poll_once(&mut answer).await {
            drop(permit);
            return queue_answer(&self.shared, owner, &self.out, id, result).await;
        }
        let (shared, out) = (Arc::clone(&self.shared), self.out.clone());
        let answered = Arc::new(AtomicBool::new(false));
        let marked = Arc::clone(&answered);
        let task = tokio::spawn(async move {
            let result = answer.await;
            // Before the answer can reach the client, which may then reuse the id at once.
            marked.store(true, Ordering::Release);
            queue_answer(&shared, owner, &out, id, result).await;
            drop(permit);
        });
        if self.waiting.len() >= self.max_in_flight {
            self.waiting.retain(|_, w| !w.task.is_finished());
        }
        self.waiting.insert(id, Waiting { task: task.abort_handle(), answered });
        true
    }

    /// Carries out a cast as far as it goes at once and answers nothing: what would wait is
    /// withdrawn (the answer's future is dropped, as a `Cancel` drops it). A cast never stays in
    /// flight, so it takes no in-flight slot. False once the connection is to end.
    async fn cast(&mut self, request: Request) -> bool {
        // A cast takes no in-flight slot, so only what ends or extends one handle at once (under
        // one shard's lock) may be one: a check or a status could be cast without bound.
        let refusal = match request {
            Request::Unlock { .. } | Request::GiveBack { .. } | Request::Renew { .. } => None,
            Request::Lock { .. } | Request::Relock { .. } => {
                Some("a lock cannot be a Cast: its answer names the handle to unlock")
            }
            _ => {
                Some("this request cannot be a Cast: only Unlock, GiveBack and Renew can (send it as a call)")
            }
        };
        if let Some(refusal) = refusal {
            let _ = self.out.send(LocalFrame::Refused(ApiError::new(ErrorKind::Invalid, refusal))).await;
            return false;
        }
        let mut answer = std::pin::pin!(crate::api::answer(&self.shared, self.owner, &self.role, request));
        match poll_once(&mut answer).await {
            Some(Ok(_)) => {}
            Some(Err(e)) => tracing::debug!(conn = self.owner.conn, "a cast failed: {}", e.message),
            None => tracing::debug!(conn = self.owner.conn, "a cast would have waited: withdrawn"),
        }
        true
    }

    /// Forwards the connection's events from now on; answers call `id` `Subscribed` first. A
    /// second subscription while the first is live is refused, as on QUIC.
    async fn subscribe(&mut self, id: u64) -> bool {
        let mut events = match self.shared.api.subscribe(self.owner.conn) {
            Ok(events) => events,
            Err(error) => {
                return self
                    .out
                    .send(LocalFrame::Answer { id, response: Response::Error(error) })
                    .await
                    .is_ok();
            }
        };
        if self.out.send(LocalFrame::Answer { id, response: Response::Subscribed }).await.is_err() {
            return false;
        }
        let out = self.out.clone();
        let task = tokio::spawn(async move {
            while let Some(event) = events.recv().await {
                if out.send(LocalFrame::Event(event)).await.is_err() {
                    return;
                }
            }
        });
        self.events = Some(task.abort_handle());
        true
    }
}

/// Queues call `id`'s answer for the connection's writer; false once the writer is gone. A lock
/// answer that never reaches the queue is given back ([`crate::api::Undelivered`]).
async fn queue_answer(
    shared: &Arc<Shared>,
    owner: ClientOwner,
    out: &mpsc::Sender<LocalFrame>,
    id: u64,
    result: Result<Response, ApiError>,
) -> bool {
    let response = result.unwrap_or_else(Response::Error);
    let undelivered = crate::api::Undelivered::new(shared, owner, &response);
    let queued = out.send(LocalFrame::Answer { id, response }).await.is_ok();
    if queued {
        undelivered.delivered();
    }
    queued
}

/// Polls `future` once: its output if it is ready at once.
async fn poll_once<F: Future + Unpin>(future: &mut F) -> Option<F::Output> {
    std::future::poll_fn(|cx| {
        Poll::Ready(match Pin::new(&mut *future).poll(cx) {
            Poll::Ready(output) => Some(output),
            Poll::Pending => None,
        })
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer too large for a frame goes as an error answer to its call, so the writer never
    /// hands the codec a frame it refuses (which would lose the answers buffered before it).
    #[test]
    fn an_answer_too_large_for_a_frame_becomes_an_error_to_its_call() {
        let mut status = crate::status::example();
        status.recent_epochs = vec![crate::status::RecentEpoch {
            epoch: 1,
            members: vec![7; MAX_CLIENT_FRAME],
            ago: Duration::ZERO,
        }];
        let frame = LocalFrame::Answer { id: 9, response: Response::Status(Box::new(status)) };
        let replacement = sendable(&frame).expect_err("too large").expect("an error answer");
        match wire::decode::<LocalFrame>(&replacement) {
            Ok(LocalFrame::Answer { id: 9, response: Response::Error(e) }) => {
                assert_eq!(e.kind, ErrorKind::Unavailable);
                assert!(e.message.contains("more than a frame takes"), "{}", e.message);
            }
            other => panic!("the replacement is {other:?}"),
        }
        let small = LocalFrame::Answer { id: 9, response: Response::Unlocked };
        assert!(sendable(&small).is_ok());
    }
}
