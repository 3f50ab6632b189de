//! The client's local transport: calls on one Unix socket connection to the node
//! ([`crate::local`]), matched to their answers by id, so that many may be in flight at once.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;
use tokio_util::codec::{FramedRead, FramedWrite, LengthDelimitedCodec};

use super::ClientError;
use crate::local::codec;
use crate::runtime::lock;
use crate::wire::{self, ClientEvent, ErrorKind, LocalFrame, LocalHello, LocalRequest, Request, Response};

/// Events queued for the application before further ones are dropped (their numbers show the
/// gap, as on the node's side).
const EVENT_QUEUE: usize = 1024;
/// How long a cancellation may take to leave (a frozen node must not hold the caller).
const CANCEL_WITHIN: Duration = Duration::from_secs(1);

type Sink = Arc<tokio::sync::Mutex<FramedWrite<OwnedWriteHalf, LengthDelimitedCodec>>>;

/// One connection to a node's local socket.
pub(super) struct LocalConn {
    sink: Sink,
    state: Arc<std::sync::Mutex<State>>,
    next: AtomicU64,
    reader: AbortHandle,
    /// Who the node took this process for.
    pub hello: LocalHello,
}

#[derive(Default)]
struct State {
    /// Calls waiting for their answers, by id.
    pending: HashMap<u64, oneshot::Sender<Response>>,
    events: Option<mpsc::Sender<ClientEvent>>,
    /// Why the connection ended, once it has.
    closed: Option<String>,
}

/// Whether the process behind `stream`, connected to the socket at `path`, may be taken for a
/// node: it runs as `node_uid` when the profile names one; else as root, as this process's uid,
/// or as the owner of the directory that holds the socket's name, where no one else could have
/// made that directory ([`made_by_its_owner`]). Anyone else who could bind the path (a directory
/// others may write to, the moment a restarting node has removed its socket) could answer as a
/// node with made-up tokens and deadlines; QUIC's node certificate rules that out on the network.
fn trusted(stream: &UnixStream, path: &Path, node_uid: Option<u32>) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let server = stream.peer_cred().map_err(|e| format!("cannot read the node's credentials: {e}"))?.uid();
    if let Some(expected) = node_uid {
        return if server == expected {
            Ok(())
        } else {
            Err(format!(
                "the process on it runs as uid {server}, not uid {expected} as the profile's node_uid \
                 says; it is not taken for a keyhome node"
            ))
        };
    }
    let own = rustix::process::getuid().as_raw();
    // The directory that holds the socket's name (a symbolic link to the directory is followed,
    // a socket name that is itself a link is not: its target's directory may be anyone's).
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let dir_owner =
        std::fs::metadata(dir).map(|m| m.uid()).ok().filter(|&owner| made_by_its_owner(dir, owner));
    if server == 0 || server == own || dir_owner == Some(server) {
        return Ok(());
    }
    Err(format!(
        "the process on it runs as uid {server}: neither root, this process's uid ({own}) nor the \
         owner of {} (an owner counts only where every directory on its path is writable by \
         root or that owner alone); it is not taken for a keyhome node (a node of another user: name its uid as the \
         profile's node_uid)",
        dir.display()
    ))
}

/// Whether only root or `owner` could have made `dir` (the directory that holds the socket's name)
/// or put it where it is: every directory on its path as named (and a symbolic link met on it),
/// and every directory on the path it resolves to, belongs to root or `owner`, and no group or
/// other may write to it. A sticky bit does not count: in a directory such as `/tmp` anyone may
/// make a directory, and then owns it.
fn made_by_its_owner(dir: &Path, owner: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    let safe = |m: std::fs::Metadata| {
        (m.uid() == 0 || m.uid() == owner) && (m.file_type().is_symlink() || m.mode() & 0o022 == 0)
    };
    let Ok(named) = std::path::absolute(dir) else { return false };
    let Ok(real) = std::fs::canonicalize(&named) else { return false };
    named.ancestors().all(|p| std::fs::symlink_metadata(p).is_ok_and(safe))
        && real.ancestors().all(|p| std::fs::metadata(p).is_ok_and(safe))
}

impl LocalConn {
    /// Connects to the socket at `path` and reads the node's hello, within `timeout`; the node
    /// must run as `node_uid`, if given (see [`trusted`]).
    pub(super) async fn connect(
        path: &Path,
        timeout: Duration,
        node_uid: Option<u32>,
    ) -> Result<LocalConn, ClientError> {
        let refused = |reason: String| ClientError::LocalConnect { path: path.to_path_buf(), reason };
        let open = async {
            let stream = UnixStream::connect(path).await.map_err(|e| refused(e.to_string()))?;
            trusted(&stream, path, node_uid).map_err(refused)?;
            let (read, write) = stream.into_split();
            let mut frames = FramedRead::new(read, codec());
            let first = match frames.next().await {
                Some(Ok(body)) => wire::decode::<LocalFrame>(&body).map_err(|e| refused(e.to_string()))?,
                Some(Err(e)) => return Err(refused(e.to_string())),
                None => return Err(refused("the node closed the connection".into())),
            };
            match first {
                LocalFrame::Hello(hello) if !hello.protocols.serves(wire::LOCAL_PROTOCOL) => {
                    Err(ClientError::LocalProtocol {
                        path: path.to_path_buf(),
                        node: hello.protocols,
                        client: wire::LOCAL_PROTOCOLS,
                    })
                }
                LocalFrame::Hello(hello) => Ok((hello, frames, write)),
                LocalFrame::Refused(e) => Err(refused(e.message)),
                _ => Err(ClientError::Unexpected),
            }
        };
        let (hello, frames, write) = tokio::time::timeout(timeout, open)
            .await
            .map_err(|_| refused(format!("no hello from the node within {timeout:?}")))??;
        let state = Arc::new(std::sync::Mutex::new(State::default()));
        let sink = Arc::new(tokio::sync::Mutex::new(FramedWrite::new(write, codec())));
        let reader = tokio::spawn(read_frames(frames, Arc::clone(&state), Arc::clone(&sink))).abort_handle();
        Ok(LocalConn { sink, state, next: AtomicU64::new(1), reader, hello })
    }

    pub(super) fn is_closed(&self) -> bool {
        lock(&self.state).closed.is_some()
    }

    fn closed_error(&self) -> ClientError {
        ClientError::Closed(lock(&self.state).closed.clone().unwrap_or_else(|| "the connection ended".into()))
    }

    /// Sends `request` and waits for its answer (the caller bounds the wait; dropping the
    /// future cancels the call at the node).
    pub(super) async fn call(&self, request: Request) -> Result<Response, ClientError> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut state = lock(&self.state);
            if state.closed.is_some() {
                drop(state);
                return Err(self.closed_error());
            }
            state.pending.insert(id, tx);
        }
        let mut guard = Cancel { conn: self, id, answer: Some(rx) };
        write(&self.sink, &LocalRequest::Call { id, request }).await?;
        let answer = guard.answer.as_mut().expect("taken only here and on drop").await;
        guard.answer = None;
        answer.map_err(|_| self.closed_error())
    }

    /// Sends `request` as a [`LocalRequest::Cast`]: the node sends no answer; the next request
    /// sent on this connection sees its effect (see [`crate::local`], "Order").
    pub(super) async fn send(&self, request: Request) -> Result<(), ClientError> {
        if self.is_closed() {
            return Err(self.closed_error());
        }
        write(&self.sink, &LocalRequest::Cast { request }).await
    }

    /// Subscribes to the connection's events.
    ///
    /// The node forwards a connection's events for the connection's life once it took a
    /// subscription; here they go to the latest receiver handed out. While that receiver is kept,
    /// a second subscription is refused, as on QUIC. Once it is dropped, or if its subscription
    /// failed or was given up (a timeout) after the node may have taken it, a new one may be
    /// made: the node's answer that it already forwards this connection's events means the earlier
    /// subscription went through, and the new receiver takes its events from now on.
    pub(super) async fn subscribe(&self) -> Result<mpsc::Receiver<ClientEvent>, ClientError> {
        // Set before the node starts sending: no event can arrive unseen.
        let (tx, rx) = mpsc::channel(EVENT_QUEUE);
        let asked_before = {
            let mut state = lock(&self.state);
            if state.events.as_ref().is_some_and(|events| !events.is_closed()) {
                return Err(ClientError::Api(crate::api::second_event_stream()));
            }
            state.events.replace(tx).is_some()
        };
        match self.call(Request::Subscribe).await? {
            Response::Subscribed => Ok(rx),
            Response::Error(e) if asked_before && e.kind == ErrorKind::Invalid => Ok(rx),
            Response::Error(e) => Err(ClientError::Api(e)),
            _ => Err(ClientError::Unexpected),
        }
    }
}

impl Drop for LocalConn {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// Withdraws call `id` at the node if it is dropped before its answer was taken (`answer` is
/// then still here).
///
/// The node may admit a lock while the caller goes away: its answer then reaches no caller, and
/// is given back ([`give_back_unclaimed`]) instead of holding the key until the handle's deadline.
/// Wherever the answer is when the caller goes (on its way, in `pending`'s sender, or already in
/// the receiver), exactly one of this drop and [`read_frames`] finds it.
struct Cancel<'a> {
    conn: &'a LocalConn,
    id: u64,
    answer: Option<oneshot::Receiver<Response>>,
}

impl Drop for Cancel<'_> {
    fn drop(&mut self) {
        let Some(mut answer) = self.answer.take() else { return };
        lock(&self.conn.state).pending.remove(&self.id);
        // After `close`, the reader's send fails (it gives the answer back itself) unless the
        // answer is already here.
        answer.close();
        let give_back = answer.try_recv().ok().and_then(give_back_unclaimed);
        let cancel = LocalRequest::Cancel { id: self.id };
        send_later(&self.conn.sink, std::iter::once(cancel).chain(give_back).collect());
    }
}

/// What gives back the handle of a lock answer no caller took (see [`Cancel`]): the key's next
/// holder gets the handoff this handle got ([`Request::GiveBack`]). Nothing for other answers.
fn give_back_unclaimed(response: Response) -> Option<LocalRequest> {
    let handle = response.locked_handle()?;
    Some(LocalRequest::Cast { request: Request::GiveBack { handle } })
}

/// Sends `requests` in order from a task of their own, each within [`CANCEL_WITHIN`] (a frozen
/// node must not hold anyone up): for the paths that cannot wait, a drop and the reader. Outside a
/// tokio runtime (a caller dropped on another thread's executor) nothing can be sent: the call is
/// left to end with its wait, a handle to its deadline.
fn send_later(sink: &Sink, requests: Vec<LocalRequest>) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
    let sink = Arc::clone(sink);
    rt.spawn(async move {
        for request in &requests {
            let _ = tokio::time::timeout(CANCEL_WITHIN, write(&sink, request)).await;
        }
    });
}

async fn write(sink: &Sink, request: &LocalRequest) -> Result<(), ClientError> {
    let body = postcard::to_allocvec(request).map_err(|e| ClientError::Wire(e.into()))?;
    sink.lock()
        .await
        .send(bytes::Bytes::from(body))
        .await
        .map_err(|e: std::io::Error| ClientError::Closed(e.to_string()))
}

/// Hands each answer to its caller and each event to the subscriber until the connection ends;
/// then fails every call still waiting. A lock answer whose caller is gone is given back.
async fn read_frames(
    mut frames: FramedRead<OwnedReadHalf, LengthDelimitedCodec>,
    state: Arc<std::sync::Mutex<State>>,
    sink: Sink,
) {
    let reason = loop {
        let body = match frames.next().await {
            None => break "the node closed the connection".to_string(),
            Some(Err(e)) => break format!("reading from the node failed: {e}"),
            Some(Ok(body)) => body,
        };
        match wire::decode::<LocalFrame>(&body) {
            Ok(LocalFrame::Answer { id, response }) => {
                let caller = lock(&state).pending.remove(&id);
                let unclaimed = match caller {
                    Some(tx) => tx.send(response).err(),
                    None => Some(response),
                };
                if let Some(give_back) = unclaimed.and_then(give_back_unclaimed) {
                    send_later(&sink, vec![give_back]);
                }
            }
            Ok(LocalFrame::Event(event)) => {
                if let Some(tx) = &lock(&state).events {
                    let _ = tx.try_send(event);
                }
            }
            Ok(LocalFrame::Refused(e)) => break e.message,
            Ok(LocalFrame::Hello(_)) => break "the node sent a second hello".to_string(),
            Err(e) => break format!("the node sent a malformed frame: {e}"),
        }
    };
    let mut state = lock(&state);
    state.closed = Some(reason);
    state.pending.clear();
    state.events = None;
}
