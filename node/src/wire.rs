//! What crosses a QUIC stream: length-prefixed postcard frames, and the frame types of the peer
//! and client protocols.
//!
//! A frame is a 4-byte big-endian length followed by that many bytes of postcard. The length is
//! checked against the stream's limit before anything is allocated, and a frame must decode
//! exactly (no trailing bytes). Any violation is a [`WireError`] that closes the stream (and, on a
//! peer connection, the connection) with a clear reason; the node keeps serving everyone else.

use std::time::Duration;

use keyhome_delegation::{CheckAnswer, FencingToken};
use keyhome_epoch::{Change, EpochRecord, NodeId};

use crate::core::PeerMessage;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

/// Largest peer frame: an epoch record of 1024 members with 255-byte addresses, twice over (an
/// accept carries one, a vote may carry one), fits well within it.
pub const MAX_PEER_FRAME: usize = 1 << 20;
/// Largest first frame of a peer stream (a [`PeerFrame::Hello`] encodes to at most 48 bytes):
/// whoever opens a stream is heard, or not, before it may send anything larger.
pub const MAX_HELLO_FRAME: usize = 64;
/// Largest client frame: keys and notes are capped far below this.
pub const MAX_CLIENT_FRAME: usize = 64 << 10;

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("frame of {len} bytes exceeds the limit of {max}")]
    TooLarge { len: usize, max: usize },
    #[error("malformed frame: {0}")]
    Decode(#[from] postcard::Error),
    #[error("malformed frame: {0} bytes left over after the value")]
    TrailingBytes(usize),
    #[error("stream ended inside a frame")]
    Truncated,
    #[error("stream read failed: {0}")]
    Read(#[from] quinn::ReadExactError),
    #[error("stream write failed: {0}")]
    Write(#[from] quinn::WriteError),
    #[error("the connection is closing")]
    Closed,
}

/// Encodes `value` as one frame (length prefix included).
pub fn encode<T: Serialize>(value: &T, max: usize) -> Result<Vec<u8>, WireError> {
    let mut buf = postcard::to_extend(value, vec![0u8; 4])?;
    let len = buf.len() - 4;
    if len > max {
        return Err(WireError::TooLarge { len, max });
    }
    let prefix = u32::try_from(len).map_err(|_| WireError::TooLarge { len, max })?;
    buf[..4].copy_from_slice(&prefix.to_be_bytes());
    Ok(buf)
}

/// Writes one frame.
pub async fn write_frame<T: Serialize>(
    send: &mut quinn::SendStream,
    value: &T,
    max: usize,
) -> Result<(), WireError> {
    send.write_all(&encode(value, max)?).await?;
    Ok(())
}

/// Reads one frame; `Ok(None)` at a clean end of stream between frames. The body grows as its
/// bytes arrive: a length prefix alone allocates nothing.
pub async fn read_frame<T: DeserializeOwned>(
    recv: &mut quinn::RecvStream,
    max: usize,
) -> Result<Option<T>, WireError> {
    read_frame_within(recv, max, &[]).await
}

/// Bytes read per step while a frame body arrives.
const CHUNK: usize = 16 << 10;

/// [`read_frame`], with every body byte held until the frame is read whole counted against each
/// of `budgets` (one permit per byte): a step waits for its permits before it reads, so a reader
/// never holds more than its budgets allow (and QUIC flow control holds the sender back meanwhile).
/// Each budget must have at least `max` permits, or a frame that large waits forever.
pub async fn read_frame_within<T: DeserializeOwned>(
    recv: &mut quinn::RecvStream,
    max: usize,
    budgets: &[&Semaphore],
) -> Result<Option<T>, WireError> {
    let mut prefix = [0u8; 4];
    match recv.read_exact(&mut prefix).await {
        Ok(()) => {}
        Err(quinn::ReadExactError::FinishedEarly(0)) => return Ok(None),
        Err(quinn::ReadExactError::FinishedEarly(_)) => return Err(WireError::Truncated),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_be_bytes(prefix) as usize;
    if len > max {
        return Err(WireError::TooLarge { len, max });
    }
    let mut body = Vec::new();
    // Permits held for the bytes in `body` and the step under way; `credit` of them unused yet.
    let mut held = Vec::new();
    let mut credit = 0;
    while body.len() < len {
        let want = (len - body.len()).min(CHUNK);
        if credit < want {
            let more = u32::try_from(want - credit).map_err(|_| WireError::TooLarge { len, max })?;
            for budget in budgets {
                held.push(budget.acquire_many(more).await.map_err(|_| WireError::Closed)?);
            }
            credit = want;
        }
        let chunk = recv
            .read_chunk(want, true)
            .await
            .map_err(|e| WireError::Read(quinn::ReadExactError::ReadError(e)))?
            .ok_or(WireError::Truncated)?;
        credit -= chunk.bytes.len();
        body.extend_from_slice(&chunk.bytes);
    }
    decode(&body).map(Some)
}

/// Decodes one frame's body, which must hold exactly one value: bytes left over after it are a
/// [`WireError::TrailingBytes`], so every value has one encoding on the wire.
pub fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, WireError> {
    let (value, rest) = postcard::take_from_bytes(body)?;
    if !rest.is_empty() {
        return Err(WireError::TrailingBytes(rest.len()));
    }
    Ok(value)
}

// ---- peer protocol (ALPN `keyhome/1`) ----

/// One frame on a peer stream. Each stream starts with a [`PeerFrame::Hello`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum PeerFrame {
    /// First frame of every stream: peers of different clusters or ring versions refuse to talk.
    Hello {
        genesis_digest: [u8; 32],
        ring_version: u32,
        epoch: u64,
    },
    Epoch(keyhome_epoch::Message),
    Delegation(keyhome_delegation::Message),
}

impl From<PeerMessage> for PeerFrame {
    fn from(message: PeerMessage) -> PeerFrame {
        match message {
            PeerMessage::Epoch(m) => PeerFrame::Epoch(m),
            PeerMessage::Delegation(m) => PeerFrame::Delegation(m),
        }
    }
}

impl PeerFrame {
    /// The protocol message this frame carries; `None` for a `Hello`.
    pub fn into_message(self) -> Option<PeerMessage> {
        match self {
            PeerFrame::Hello { .. } => None,
            PeerFrame::Epoch(m) => Some(PeerMessage::Epoch(m)),
            PeerFrame::Delegation(m) => Some(PeerMessage::Delegation(m)),
        }
    }
}

/// Why a connection is closed, sent as the QUIC application close code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum CloseCode {
    /// The certificate names no node, or a node no known epoch names, or a retired node that
    /// claims a later epoch.
    NotMember = 1,
    /// The peer belongs to another cluster (genesis digest) or routes by another ring version.
    Mismatch = 2,
    /// The peer sent a frame that is oversized, malformed or out of order.
    BadFrame = 3,
    /// The node is shutting down.
    Shutdown = 4,
    /// A client certificate was used on the peer port, or a node certificate on the client port.
    WrongRole = 5,
    /// The node has as many client connections as `limits.max_client_connections` allows.
    TooManyConnections = 6,
    /// The certificate identity has as many connections as
    /// `limits.max_connections_per_identity` allows.
    TooManyForIdentity = 7,
}

impl From<CloseCode> for quinn::VarInt {
    fn from(code: CloseCode) -> quinn::VarInt {
        quinn::VarInt::from_u32(code as u32)
    }
}

// ---- client protocol (ALPN `keyhome-client/1`) ----

/// Longest a node takes to answer a [`Request::Propose`]: it then says "no decision yet".
pub const PROPOSE_TIMEOUT: Duration = Duration::from_secs(60);

/// The stream error code of a client that stops waiting for a lock (a QUIC `RESET_STREAM` of
/// its half of the call's stream, which it keeps open while it waits): the node withdraws the
/// lock and finishes its half without an answer. The client reads on, to give back
/// ([`Request::GiveBack`]) an answer the node sent before the reset reached it.
pub const RESET_WITHDRAW: u32 = 1;

/// A client request: one per bidirectional stream, answered by one [`Response`]; except
/// [`Request::Subscribe`], answered by [`Response::Subscribed`] and then a stream of
/// [`ClientEvent`]s (or by one [`Response::Error`]).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Request {
    /// Lock `key` for `ttl`, waiting at most `wait` (zero: only if it can be admitted at once).
    Lock { key: Vec<u8>, ttl: Duration, wait: Duration },
    /// Extend a handle to `ttl` from now (bounded by its delegation).
    Renew { handle: u64, ttl: Duration },
    /// End a handle, leaving `note` for the next holder of the key.
    Unlock { handle: u64, note: Option<Vec<u8>> },
    /// Ask whether `key` is held with `token` now (answered by the key's home, or its holder).
    Check { key: Vec<u8>, token: FencingToken },
    /// The node's status.
    Status,
    /// The node's current epoch.
    EpochShow,
    /// Operator only: change the membership (see [`Proposal`]).
    Propose(Proposal),
    /// Operator only, **unsafe**: install an epoch naming `members` without agreement, numbered
    /// `skip` past the current one, for a cluster that lost its majority for good. `stopped` must
    /// list exactly the current members left out, confirming the operator stopped them for good.
    /// See docs/operations.md, "Disaster recovery".
    RecoverUnsafe { members: Vec<keyhome_epoch::Member>, stopped: Vec<NodeId>, skip: u64 },
    /// Stream [`ClientEvent`]s for handles this connection holds. One live event stream per
    /// connection: a second while the first is open is refused ([`ErrorKind::Invalid`]). On QUIC
    /// the request's stream carries the events after a [`Response::Subscribed`]; on the local
    /// socket the call is answered [`Response::Subscribed`] and the events follow as
    /// [`LocalFrame::Event`]s.
    Subscribe,
    /// Unlock `handle` (leaving `note`), then lock `key` as [`Request::Lock`] does, in one round
    /// trip. If the unlock fails, nothing is locked and its error is the answer.
    Relock { handle: u64, note: Option<Vec<u8>>, key: Vec<u8>, ttl: Duration, wait: Duration },
    /// End a handle this connection never used: the lock answer came after its caller stopped
    /// waiting. Unlike [`Request::Unlock`] it leaves the key's handoff as the handle found it (its
    /// note, and `recovered` for the next holder if this handle was told so), as if the lock had
    /// never been admitted. Answered [`Response::Unlocked`].
    GiveBack { handle: u64 },
}

impl Request {
    /// The request's name, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Request::Lock { .. } => "lock",
            Request::Renew { .. } => "renew",
            Request::Unlock { .. } => "unlock",
            Request::Check { .. } => "check",
            Request::Status => "status",
            Request::EpochShow => "epoch show",
            Request::Propose(_) => "propose",
            Request::RecoverUnsafe { .. } => "recover",
            Request::Subscribe => "subscribe",
            Request::Relock { .. } => "relock",
            Request::GiveBack { .. } => "give back",
        }
    }

    /// Whether the answer may be [`Response::Locked`]: a handle, to be given back if the answer
    /// reaches nobody.
    pub fn may_lock(&self) -> bool {
        matches!(self, Request::Lock { .. } | Request::Relock { .. })
    }

    /// Whether the node may take a while to answer: a lock or relock that may wait, a token check
    /// (the home may ask the key's holder), an operator change. Every other request is answered
    /// at once, under one part of the node's lock.
    pub fn may_wait(&self) -> bool {
        match self {
            Request::Lock { wait, .. } | Request::Relock { wait, .. } => !wait.is_zero(),
            Request::Check { .. } | Request::Propose(_) | Request::RecoverUnsafe { .. } => true,
            Request::Renew { .. }
            | Request::Unlock { .. }
            | Request::Status
            | Request::EpochShow
            | Request::Subscribe
            | Request::GiveBack { .. } => false,
        }
    }
}

/// A membership change an operator asks for. The node checks it first unless `force` is set:
/// a new member must answer at its address with its own certificate, and the epoch the change
/// makes must keep a majority of members the node reaches (see [`crate::proposal`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proposal {
    pub change: Change,
    /// Skip the node's checks (not the epoch's own rules, which hold whatever is asked).
    pub force: bool,
}

impl Proposal {
    /// `change`, proposed without the node's checks.
    pub fn forced(change: Change) -> Proposal {
        Proposal { change, force: true }
    }
}

/// A change proposed with the node's checks.
impl From<Change> for Proposal {
    fn from(change: Change) -> Proposal {
        Proposal { change, force: false }
    }
}

/// A lock admitted.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Locked {
    /// Names the handle in [`Request::Renew`] and [`Request::Unlock`].
    pub handle: u64,
    pub token: FencingToken,
    /// How long the handle is valid, counted from the instant the client *sent* its request: the
    /// node answers with its remaining time, shortened by the epoch's clock-rate margin, so that
    /// a client that counts from its send instant on its own clock never overstays it.
    pub valid_for: Duration,
    /// The previous holder's handoff note.
    pub note: Option<Vec<u8>>,
    /// The previous holder's delegation expired rather than being released cleanly.
    pub recovered: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Response {
    Locked(Locked),
    /// The handle is valid for this long from now.
    Renewed {
        valid_for: Duration,
    },
    Unlocked,
    Checked {
        answer: CheckAnswer,
    },
    Status(Box<crate::status::Status>),
    Epoch(Box<EpochRecord>),
    /// The change became part of this epoch.
    Proposed {
        epoch: u64,
    },
    Error(ApiError),
    /// The event stream of a [`Request::Subscribe`] is open: [`ClientEvent`]s follow (on QUIC on
    /// its stream, on the local socket as [`LocalFrame::Event`]s).
    Subscribed,
}

impl Response {
    /// The handle a lock answer names: what must be given back if the answer reaches nobody.
    pub fn locked_handle(&self) -> Option<u64> {
        match self {
            Response::Locked(locked) => Some(locked.handle),
            _ => None,
        }
    }
}

/// A failed request, as the client sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{kind:?}: {message}")]
pub struct ApiError {
    pub kind: ErrorKind,
    pub message: String,
}

/// What kind of failure; decides whether retrying can help.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorKind {
    /// Not admitted within the wait (or at once, for a zero wait). Retry later.
    Timeout,
    /// The lock was lost (its deadline passed).
    Lost,
    /// The request is invalid (key too long, zero ttl, note too large, unknown handle…).
    Invalid,
    /// The key's home refused, or is unreachable; retrying may help.
    Unavailable,
    /// The client's certificate does not allow this request.
    Forbidden,
    /// An operator change was refused or failed.
    Epoch,
}

impl ApiError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> ApiError {
        ApiError { kind, message: message.into() }
    }
}

/// Something the node tells a subscribed client without being asked.
///
/// Events are advisory: a handle's safety never depends on one arriving (its deadline, counted
/// from the client's own send instant, is what the client relies on). `seq` numbers one
/// connection's events from 1 with no gap; a gap means events were dropped (the client's queue
/// was full), and the client should renew its handles to learn their state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientEvent {
    pub seq: u64,
    pub handle: u64,
    pub key: Vec<u8>,
    pub kind: EventKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum EventKind {
    /// Another client wants the key: renewals no longer extend the handle. Unlock as soon as you
    /// can. `valid_for` is the handle's time left when the node queued the event, less the
    /// clock-rate margin: advice, not a deadline (the event may reach the client later; the
    /// lock's deadline stays the one counted from its lock or renew request).
    Recalled { valid_for: Duration },
    /// The handle's deadline passed: the lock is lost and its next use fails.
    Expired,
}

// ---- local client protocol (Unix domain socket, see `crate::local`) ----

/// A frame a client sends on the local socket. `id` is the client's to choose; the node answers
/// each [`LocalRequest::Call`] with a [`LocalFrame::Answer`] of the same `id`, possibly out of
/// order, but starts the requests of one connection in the order they arrive, so a request sees
/// the effect of every earlier one that completes at once (an unlock, say) without waiting for
/// its answer, or without any answer ([`LocalRequest::Cast`]).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum LocalRequest {
    Call {
        id: u64,
        request: Request,
    },
    /// The client gave up on call `id`: a lock still waiting is withdrawn; no answer follows.
    Cancel {
        id: u64,
    },
    /// A request whose answer the client does not want (a pipelined unlock): the node carries it
    /// out as far as it goes at once, as it starts a `Call`, and sends nothing back, not even an
    /// error. What would have to wait (a lock queued behind its holder) is withdrawn at once.
    /// `Subscribe` cannot be cast (its events follow its answer): the node refuses the frame.
    Cast {
        request: Request,
    },
}

/// A frame the node sends on the local socket.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum LocalFrame {
    /// First frame on an accepted connection: the node's id and the identity the peer's
    /// credentials map to.
    Hello(LocalHello),
    /// The connection is refused or ended (unmapped uid, too many connections, a bad frame):
    /// the node closes it after this frame.
    Refused(ApiError),
    Answer {
        id: u64,
        response: Response,
    },
    Event(ClientEvent),
}

/// The local protocol version of the frames in this module ([`LocalRequest`], [`LocalFrame`]).
/// A change a client or node of this version could not read gets a new version; a node keeps
/// serving the versions its [`LocalHello::protocols`] names.
pub const LOCAL_PROTOCOL: u32 = 1;

/// The local protocol versions this node serves.
pub const LOCAL_PROTOCOLS: LocalProtocols = LocalProtocols { oldest: LOCAL_PROTOCOL, newest: LOCAL_PROTOCOL };

/// Who the node took a local peer for, and which frames it speaks.
///
/// Every version's clients must be able to read every later node's hello, so its encoding is
/// fixed for good: [`LocalFrame::Hello`] stays variant 0 and [`LocalFrame::Refused`] variant 1
/// with its [`ApiError`]; this struct's fields never change, move or grow (a later version says
/// more in frames of its own). A client of version 2 or later will name its version in its first
/// frame, a [`LocalRequest`] variant that version 1 never sends; a version 1 client sends none,
/// and a node serving version 1 takes that silence for version 1. The test
/// `the_local_hello_is_encoded_as_every_version_reads_it` pins the bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalHello {
    pub node: NodeId,
    /// The identity, as its certificate names it (`crate::pki::Role::dns_name`: `client-NAME.keyhome`).
    pub identity: String,
    /// The local protocol versions the node serves ([`LOCAL_PROTOCOLS`]). A client that speaks
    /// none of them must not send a frame: it closes with an error naming both (the Rust client:
    /// [`crate::client::ClientError::LocalProtocol`]).
    pub protocols: LocalProtocols,
}

/// A range of local protocol versions, both ends included (`oldest` ≤ `newest`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalProtocols {
    pub oldest: u32,
    pub newest: u32,
}

impl LocalProtocols {
    /// Whether `version` is in the range.
    pub fn serves(&self, version: u32) -> bool {
        (self.oldest..=self.newest).contains(&version)
    }
}

impl std::fmt::Display for LocalProtocols {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.oldest == self.newest {
            write!(f, "version {}", self.oldest)
        } else {
            write!(f, "versions {} to {}", self.oldest, self.newest)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(frame: &[u8]) -> &[u8] {
        let len = u32::from_be_bytes(frame[..4].try_into().unwrap()) as usize;
        assert_eq!(len, frame.len() - 4, "the prefix counts the body");
        &frame[4..]
    }

    #[test]
    fn the_local_hello_is_encoded_as_every_version_reads_it() {
        let hello = LocalFrame::Hello(LocalHello {
            node: NodeId(3),
            identity: "client-app.keyhome".into(),
            protocols: LocalProtocols { oldest: 1, newest: 2 },
        });
        let mut expected = vec![0, 3, 18];
        expected.extend_from_slice(b"client-app.keyhome");
        expected.extend_from_slice(&[1, 2]);
        assert_eq!(
            postcard::to_allocvec(&hello).unwrap(),
            expected,
            "variant 0, node, identity, oldest, newest"
        );
        let refused = LocalFrame::Refused(ApiError::new(ErrorKind::Forbidden, "no"));
        assert_eq!(postcard::to_allocvec(&refused).unwrap()[0], 1, "Refused stays variant 1");
    }

    #[test]
    fn a_frame_decodes_exactly() {
        let request = Request::Renew { handle: 7, ttl: Duration::from_millis(1500) };
        let frame = encode(&request, MAX_CLIENT_FRAME).unwrap();
        let decoded: Request = decode(body(&frame)).unwrap();
        assert!(matches!(decoded, Request::Renew { handle: 7, ttl } if ttl == Duration::from_millis(1500)));
    }

    #[test]
    fn the_largest_hello_fits_its_frame() {
        let hello = PeerFrame::Hello { genesis_digest: [255; 32], ring_version: u32::MAX, epoch: u64::MAX };
        assert!(encode(&hello, MAX_HELLO_FRAME).is_ok());
    }

    #[test]
    fn trailing_bytes_are_refused() {
        let frame =
            encode(&PeerFrame::Hello { genesis_digest: [3; 32], ring_version: 1, epoch: 9 }, 64).unwrap();
        let mut padded = body(&frame).to_vec();
        padded.extend_from_slice(&[0, 0]);
        let err = decode::<PeerFrame>(&padded).unwrap_err();
        assert!(matches!(err, WireError::TrailingBytes(2)), "{err}");
        assert_eq!(err.to_string(), "malformed frame: 2 bytes left over after the value");
    }

    #[test]
    fn truncated_and_oversized_frames_are_refused() {
        let frame = encode(
            &Request::Lock { key: b"k".to_vec(), ttl: Duration::from_secs(1), wait: Duration::ZERO },
            64,
        )
        .unwrap();
        let short = &body(&frame)[..frame.len() - 5];
        assert!(matches!(decode::<Request>(short), Err(WireError::Decode(_))));
        let big = Request::Lock { key: vec![0; 100], ttl: Duration::ZERO, wait: Duration::ZERO };
        assert!(matches!(encode(&big, 64), Err(WireError::TooLarge { max: 64, .. })));
    }
}
