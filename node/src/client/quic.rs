//! The client's QUIC transport: one request per bidirectional stream, answered by one frame.
//!
//! A lock call ([`Request::may_lock`]) keeps its half of the stream open while it waits (at most
//! [`LOCK_STREAMS`] that may wait at once per connection, see [`call`]). A
//! caller that stops waiting (its future dropped, or the client's timeout) resets that half with
//! [`RESET_WITHDRAW`], which withdraws the lock at the node (any call given up resets it), and
//! the answer is read on in the background: a `Locked` answer the node sent before the reset reached it names a handle nobody
//! holds, and it is given back ([`Request::GiveBack`]), so that its key is free at once and its
//! next holder gets the handoff this handle got. The answer is read so that giving up halfway
//! loses none of its bytes ([`Answer`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::ClientError;
use crate::pki::CLIENT_STREAMS;
use crate::wire::{self, MAX_CLIENT_FRAME, RESET_WITHDRAW, Request, Response};

/// Length prefix of a frame, in bytes.
const PREFIX: usize = 4;

/// Lock calls one connection has open at once (48). They hold their stream while they wait, so
/// they must leave room for the calls answered at once (an unlock, a renewal, a status) and the
/// event subscription: 8 streams, and the eighth of [`CLIENT_STREAMS`] that a closed stream may
/// not be usable for yet (the node, as quinn does, announces new stream credit only once more
/// than an eighth of its limit has closed). Then waiting locks never hold up the unlock that
/// would end their wait. Further lock calls wait in the client for one of these to end.
pub const LOCK_STREAMS: usize = (CLIENT_STREAMS - CLIENT_STREAMS / 8 - 8) as usize;

/// A client's QUIC connection, and the slots its waiting lock calls take.
#[derive(Clone)]
pub(super) struct Conn {
    pub conn: quinn::Connection,
    /// [`LOCK_STREAMS`] permits: one per lock call until its answer is read (or, given up, read
    /// on and given back).
    lock_slots: Arc<Semaphore>,
}

impl Conn {
    pub fn new(conn: quinn::Connection) -> Conn {
        Conn { conn, lock_slots: Arc::new(Semaphore::new(LOCK_STREAMS)) }
    }
}

/// Sends `request` on a stream of its own and reads its answer. A call given up before its answer
/// is read resets its half of the stream (the node withdraws what it was doing for it, or drops a
/// request that had not arrived whole); a lock call's answer is then read on in the background
/// for `give_back_within`, and given back if it comes.
///
/// A lock call that may wait takes one of [`LOCK_STREAMS`] slots first, waiting for one. A relock
/// does not wait for a slot, since its unlock may be what the other lock calls wait for: with none
/// free it is sent as its unlock, then its lock (a lock the node then refuses as invalid finds the
/// old handle unlocked already).
pub(super) async fn call(
    conn: &Conn,
    request: Request,
    give_back_within: Duration,
) -> Result<Response, ClientError> {
    // The semaphore is never closed.
    let slot = match &request {
        Request::Lock { .. } if request.may_wait() => Arc::clone(&conn.lock_slots).acquire_owned().await.ok(),
        Request::Relock { .. } if request.may_wait() => {
            match Arc::clone(&conn.lock_slots).try_acquire_owned() {
                Ok(slot) => Some(slot),
                Err(_) => return relock_in_two(conn, request, give_back_within).await,
            }
        }
        _ => None,
    };
    exchange(conn, request, slot, give_back_within).await
}

/// [`call`]'s relock when no lock slot is free: its unlock alone, then its lock.
async fn relock_in_two(
    conn: &Conn,
    request: Request,
    give_back_within: Duration,
) -> Result<Response, ClientError> {
    let Request::Relock { handle, note, key, ttl, wait } = request else {
        return Err(ClientError::Unexpected);
    };
    match exchange(conn, Request::Unlock { handle, note }, None, give_back_within).await? {
        Response::Unlocked => {}
        refused => return Ok(refused),
    }
    let slot = Arc::clone(&conn.lock_slots).acquire_owned().await.ok();
    exchange(conn, Request::Lock { key, ttl, wait }, slot, give_back_within).await
}

/// Sends `request` on a new stream, holding `slot` (a lock call's) until its answer is read.
async fn exchange(
    conn: &Conn,
    request: Request,
    slot: Option<OwnedSemaphorePermit>,
    give_back_within: Duration,
) -> Result<Response, ClientError> {
    let may_lock = request.may_lock();
    let (send, recv) = conn.conn.open_bi().await?;
    let mut call = Call {
        conn: conn.clone(),
        send,
        answer: Some(Answer { recv, buf: Vec::new() }),
        may_lock,
        give_back_within,
        slot,
    };
    wire::write_frame(&mut call.send, &request, MAX_CLIENT_FRAME).await?;
    if !call.may_lock {
        let _ = call.send.finish();
    }
    call.answer().await
}

/// A call's stream until its answer is read; dropped before that, it withdraws the call.
struct Call {
    conn: Conn,
    /// The request half; a lock call leaves it open while it waits.
    send: quinn::SendStream,
    /// `None` once the answer is read (or failed): nothing left to give back.
    answer: Option<Answer>,
    /// The answer may be a handle ([`Request::may_lock`]).
    may_lock: bool,
    give_back_within: Duration,
    /// A lock call's slot ([`Conn::lock_slots`]), kept while its stream is.
    slot: Option<OwnedSemaphorePermit>,
}

impl Call {
    async fn answer(&mut self) -> Result<Response, ClientError> {
        let Some(answer) = &mut self.answer else { return Err(ClientError::NoAnswer) };
        let response = answer.read().await;
        self.answer = None;
        response
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        let Some(mut answer) = self.answer.take() else { return };
        // Fails harmlessly once the node has the whole request and its end.
        let _ = self.send.reset(RESET_WITHDRAW.into());
        if !self.may_lock {
            return;
        }
        // Outside a tokio runtime nothing can be read on: an answer already sent keeps its key
        // until its deadline, as when the connection is gone. The task holds the connection open
        // until it is done.
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let (conn, within, slot) = (self.conn.clone(), self.give_back_within, self.slot.take());
        rt.spawn(async move {
            let read = tokio::time::timeout(within, answer.read()).await;
            drop((answer, slot));
            let Ok(Ok(response)) = read else { return };
            let Some(handle) = response.locked_handle() else { return };
            let give_back = call(&conn, Request::GiveBack { handle }, within);
            if let Ok(Err(e)) = tokio::time::timeout(within, give_back).await {
                tracing::debug!(handle, "cannot give back a lock answered after its caller left: {e}");
            }
        });
    }
}

/// The answer half of a call's stream, read into `buf` as it arrives: a read dropped halfway
/// leaves what it had in `buf` for the next (quinn's `read_chunk` is cancel-safe).
struct Answer {
    recv: quinn::RecvStream,
    /// The frame's bytes so far, prefix included: at most [`PREFIX`] + [`MAX_CLIENT_FRAME`].
    buf: Vec<u8>,
}

impl Answer {
    /// The stream's answer frame; a stream that ends without one is [`ClientError::NoAnswer`].
    async fn read(&mut self) -> Result<Response, ClientError> {
        loop {
            let wanted = match self.buf.first_chunk::<PREFIX>() {
                None => PREFIX,
                Some(prefix) => {
                    let len = u32::from_be_bytes(*prefix) as usize;
                    if len > MAX_CLIENT_FRAME {
                        return Err(wire::WireError::TooLarge { len, max: MAX_CLIENT_FRAME }.into());
                    }
                    if self.buf.len() == PREFIX + len {
                        return Ok(wire::decode(&self.buf[PREFIX..])?);
                    }
                    PREFIX + len
                }
            };
            let chunk = (self.recv.read_chunk(wanted - self.buf.len(), true).await)
                .map_err(|e| wire::WireError::Read(quinn::ReadExactError::ReadError(e)))?;
            match chunk {
                Some(chunk) => self.buf.extend_from_slice(&chunk.bytes),
                None if self.buf.is_empty() => return Err(ClientError::NoAnswer),
                None => return Err(wire::WireError::Truncated.into()),
            }
        }
    }
}
