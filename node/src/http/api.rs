//! The client API over HTTP: every request of the QUIC API (`Subscribe` as `GET /v1/events`), answered by the same code
//! ([`crate::api::answer`]), with JSON bodies and explicit units.
//!
//! # Identities and handles
//!
//! A request is authenticated by its bearer token, which stands for one certificate identity
//! (a client name, or the operator; see [`super::tokens`]). All HTTP requests of one identity
//! act as **one client connection** of that identity, opened on its first request and kept for
//! the node's life: its handles belong to it, its lost-lock events go to its event stream, and
//! the claim rules are the QUIC API's (a handle passes only between connections of one
//! identity: a QUIC connection with the same certificate may renew or unlock an HTTP handle,
//! which moves it there, and back). A client that dies leaves its handles to their deadlines, as
//! on QUIC. A pending lock whose HTTP connection closes is withdrawn (its handler is dropped).

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{FromRequest, FromRequestParts, Request as HttpRequest, State};
use axum::http::header;
use axum::http::request::Parts;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine;
use futures_util::Stream;
use keyhome_delegation::{CheckAnswer, FencingToken};
use keyhome_epoch::{Change, Member, NodeId, Timing};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::json::{self, HttpError, millis};
use super::tokens::Tokens;
use crate::core::ClientOwner;
use crate::pki::Role;
use crate::runtime::{Shared, lock};
use crate::wire::Proposal;
use crate::wire::{ClientEvent, EventKind, Locked, Request, Response};

/// Keep-alive comments on an idle event stream, so proxies and clients see it alive.
const EVENTS_KEEP_ALIVE: Duration = Duration::from_secs(15);

/// What the API routes share.
struct ApiState {
    shared: Arc<Shared>,
    tokens: Tokens,
    /// The one client connection of each identity that used the HTTP API.
    owners: Mutex<HashMap<Role, ClientOwner>>,
    /// Bound on reading a request body.
    body_timeout: Duration,
}

type St = Arc<ApiState>;

pub(crate) fn routes(shared: Arc<Shared>) -> Router {
    let Some(http) = &shared.config.http else { return Router::new() };
    let state = Arc::new(ApiState {
        tokens: Tokens::new(&http.tokens),
        owners: Mutex::new(HashMap::new()),
        body_timeout: Duration::from_millis(http.request_timeout_ms),
        shared: Arc::clone(&shared),
    });
    Router::new()
        .route("/v1/lock", post(lock_key))
        .route("/v1/try-lock", post(try_lock))
        .route("/v1/renew", post(renew))
        .route("/v1/unlock", post(unlock))
        .route("/v1/relock", post(relock))
        .route("/v1/give-back", post(give_back))
        .route("/v1/check", post(check))
        .route("/v1/status", get(status))
        .route("/v1/epoch", get(epoch))
        .route("/v1/epoch/propose", post(propose))
        .route("/v1/epoch/recover", post(recover))
        .route("/v1/events", get(events))
        .with_state(state)
}

// ---- extractors ----

/// The authenticated identity of a request, as its client connection.
struct Caller {
    owner: ClientOwner,
    role: Role,
}

impl FromRequestParts<St> for Caller {
    type Rejection = HttpError;

    async fn from_request_parts(parts: &mut Parts, state: &St) -> Result<Caller, HttpError> {
        let value = parts.headers.get(header::AUTHORIZATION).ok_or_else(|| {
            HttpError::unauthenticated(
                "no `Authorization: Bearer TOKEN` header; the token is in the identity's `http-token` file",
            )
        })?;
        let token = value
            .to_str()
            .ok()
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim())
            .ok_or_else(|| HttpError::unauthenticated("the Authorization header is not `Bearer TOKEN`"))?;
        let role = state.tokens.identify(token).ok_or_else(|| {
            HttpError::unauthenticated("unknown token (reissued since, or from another cluster?)")
        })?;
        let owner =
            *lock(&state.owners).entry(role.clone()).or_insert_with(|| state.shared.api.open(role.clone()));
        Ok(Caller { owner, role })
    }
}

/// A JSON request body, read by [`json::read`].
struct Body<T>(T);

impl<T: DeserializeOwned> FromRequest<St> for Body<T> {
    type Rejection = HttpError;

    async fn from_request(req: HttpRequest, state: &St) -> Result<Body<T>, HttpError> {
        json::read(req.into_body(), state.body_timeout).await.map(Body)
    }
}

// ---- request bodies ----

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LockBody {
    key: String,
    ttl_ms: u64,
    wait_ms: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TryLockBody {
    key: String,
    ttl_ms: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RenewBody {
    handle: u64,
    ttl_ms: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UnlockBody {
    handle: u64,
    #[serde(default)]
    note: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RelockBody {
    handle: u64,
    #[serde(default)]
    note: Option<String>,
    key: String,
    ttl_ms: u64,
    wait_ms: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GiveBackBody {
    handle: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CheckBody {
    key: String,
    token: TokenIn,
}

/// A fencing token as its text form (`"3.1.7.2"`) or its four numbers.
#[derive(Deserialize)]
#[serde(untagged)]
enum TokenIn {
    Text(String),
    Parts(FencingToken),
}

/// A membership change: exactly one of `{"add": {"id", "addr"}}`, `{"remove": {"id"}}`,
/// `{"replace": {"old", "id", "addr"}}` or `{"set_timing": {...}}`, and `"force": true` to skip
/// the node's checks (see [`crate::proposal`]).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ProposeBody {
    add: Option<MemberBody>,
    remove: Option<RemoveBody>,
    replace: Option<ReplaceBody>,
    set_timing: Option<TimingBody>,
    #[serde(default)]
    force: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RemoveBody {
    id: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplaceBody {
    old: u64,
    id: u64,
    addr: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TimingBody {
    home_lease_ms: u64,
    max_delegation_lease_ms: u64,
    clock_rate_ppm: u32,
}

impl ProposeBody {
    /// The one change the body names.
    fn change(self) -> Result<Change, &'static str> {
        let change = match (self.add, self.remove, self.replace, self.set_timing) {
            (Some(m), None, None, None) => Change::Add(m.into()),
            (None, Some(RemoveBody { id }), None, None) => Change::Remove(NodeId(id)),
            (None, None, Some(ReplaceBody { old, id, addr }), None) => {
                Change::Replace { old: NodeId(old), new: Member { id: NodeId(id), addr } }
            }
            (None, None, None, Some(t)) => Change::SetTiming(Timing {
                home_lease: ms(t.home_lease_ms),
                max_delegation_lease: ms(t.max_delegation_lease_ms),
                clock_rate_ppm: t.clock_rate_ppm,
            }),
            _ => return Err("name exactly one change: \"add\", \"remove\", \"replace\" or \"set_timing\""),
        };
        Ok(change)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MemberBody {
    id: u64,
    addr: String,
}

impl From<MemberBody> for Member {
    fn from(m: MemberBody) -> Member {
        Member { id: NodeId(m.id), addr: m.addr }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RecoverBody {
    members: Vec<MemberBody>,
    /// Every current member left out, confirming it is stopped for good.
    confirm_stopped: Vec<u64>,
    #[serde(default = "RecoverBody::default_skip")]
    skip: u64,
}

impl RecoverBody {
    /// As `keyhome epoch recover`.
    fn default_skip() -> u64 {
        1 << 20
    }
}

// ---- answers ----

/// A lock admitted.
#[derive(Serialize)]
struct LockedBody {
    handle: u64,
    /// The fencing token's text form, `epoch.incarnation.counter.local_seq`.
    token: String,
    token_parts: FencingToken,
    /// Valid for this long from the instant the client sent the request (on its own clock).
    valid_for_ms: u64,
    /// The previous holder's note, if it is UTF-8 (else `null`, and `note_base64` has it).
    note: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    note_base64: Option<String>,
    recovered: bool,
}

impl From<Locked> for LockedBody {
    fn from(l: Locked) -> LockedBody {
        let (note, note_base64) = text_or_base64(l.note);
        LockedBody {
            handle: l.handle,
            token: l.token.to_string(),
            token_parts: l.token,
            valid_for_ms: millis(l.valid_for),
            note,
            note_base64,
            recovered: l.recovered,
        }
    }
}

/// One lost-lock event, as the `data` of a server-sent event.
#[derive(Serialize)]
struct EventBody {
    seq: u64,
    handle: u64,
    /// The key, if it is UTF-8 (else `null`, and `key_base64` has it).
    key: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    key_base64: Option<String>,
    /// `recalled` or `expired`.
    kind: &'static str,
    /// For `recalled`: the handle's time left when the node queued the event, less the clock-rate
    /// margin. Advice to hurry, not a deadline.
    #[serde(skip_serializing_if = "Option::is_none")]
    valid_for_ms: Option<u64>,
}

impl From<ClientEvent> for EventBody {
    fn from(e: ClientEvent) -> EventBody {
        let (key, key_base64) = text_or_base64(Some(e.key));
        let (kind, valid_for_ms) = match e.kind {
            EventKind::Recalled { valid_for } => ("recalled", Some(millis(valid_for))),
            EventKind::Expired => ("expired", None),
        };
        EventBody { seq: e.seq, handle: e.handle, key, key_base64, kind, valid_for_ms }
    }
}

/// Bytes as text when they are UTF-8, else as base64 (the second).
fn text_or_base64(bytes: Option<Vec<u8>>) -> (Option<String>, Option<String>) {
    match bytes.map(String::from_utf8) {
        None => (None, None),
        Some(Ok(text)) => (Some(text), None),
        Some(Err(e)) => (None, Some(base64::engine::general_purpose::STANDARD.encode(e.as_bytes()))),
    }
}

type Answer = Result<Json<serde_json::Value>, HttpError>;

/// Answers `request` for `caller` as the QUIC API does, in JSON.
async fn call(state: &St, caller: &Caller, request: Request) -> Answer {
    let response = crate::api::answer(&state.shared, caller.owner, &caller.role, request)
        .await
        .unwrap_or_else(Response::Error);
    let value = match response {
        Response::Locked(locked) => serde_json::to_value(LockedBody::from(locked)),
        Response::Renewed { valid_for } => Ok(serde_json::json!({ "valid_for_ms": millis(valid_for) })),
        Response::Unlocked => Ok(serde_json::json!({ "unlocked": true })),
        Response::Checked { answer } => {
            Ok(serde_json::json!({ "answer": answer, "held": answer == CheckAnswer::HeldNow }))
        }
        Response::Status(status) => serde_json::to_value(status),
        Response::Epoch(epoch) => serde_json::to_value(crate::status::EpochJson::from(&*epoch)),
        Response::Proposed { epoch } => Ok(serde_json::json!({ "epoch": epoch })),
        // `answer` refuses `Subscribe`; events are `GET /v1/events`.
        Response::Subscribed => Ok(serde_json::json!({ "subscribed": true })),
        Response::Error(e) => return Err(e.into()),
    };
    value.map(Json).map_err(|e| {
        HttpError::new(axum::http::StatusCode::INTERNAL_SERVER_ERROR, "Unavailable", e.to_string())
    })
}

fn ms(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

// ---- handlers ----

async fn lock_key(State(state): State<St>, caller: Caller, Body(b): Body<LockBody>) -> Answer {
    call(&state, &caller, Request::Lock { key: b.key.into_bytes(), ttl: ms(b.ttl_ms), wait: ms(b.wait_ms) })
        .await
}

async fn try_lock(State(state): State<St>, caller: Caller, Body(b): Body<TryLockBody>) -> Answer {
    call(&state, &caller, Request::Lock { key: b.key.into_bytes(), ttl: ms(b.ttl_ms), wait: Duration::ZERO })
        .await
}

async fn renew(State(state): State<St>, caller: Caller, Body(b): Body<RenewBody>) -> Answer {
    call(&state, &caller, Request::Renew { handle: b.handle, ttl: ms(b.ttl_ms) }).await
}

async fn unlock(State(state): State<St>, caller: Caller, Body(b): Body<UnlockBody>) -> Answer {
    call(&state, &caller, Request::Unlock { handle: b.handle, note: b.note.map(String::into_bytes) }).await
}

async fn relock(State(state): State<St>, caller: Caller, Body(b): Body<RelockBody>) -> Answer {
    let (note, key) = (b.note.map(String::into_bytes), b.key.into_bytes());
    call(
        &state,
        &caller,
        Request::Relock { handle: b.handle, note, key, ttl: ms(b.ttl_ms), wait: ms(b.wait_ms) },
    )
    .await
}

async fn give_back(State(state): State<St>, caller: Caller, Body(b): Body<GiveBackBody>) -> Answer {
    call(&state, &caller, Request::GiveBack { handle: b.handle }).await
}

async fn check(State(state): State<St>, caller: Caller, Body(b): Body<CheckBody>) -> Answer {
    let token = match b.token {
        TokenIn::Parts(token) => token,
        TokenIn::Text(text) => {
            text.parse().map_err(|e| HttpError::invalid(format!("token {text:?}: {e}")))?
        }
    };
    call(&state, &caller, Request::Check { key: b.key.into_bytes(), token }).await
}

async fn status(State(state): State<St>, caller: Caller) -> Answer {
    call(&state, &caller, Request::Status).await
}

async fn epoch(State(state): State<St>, caller: Caller) -> Answer {
    call(&state, &caller, Request::EpochShow).await
}

async fn propose(State(state): State<St>, caller: Caller, Body(b): Body<ProposeBody>) -> Answer {
    let force = b.force;
    let change = b.change().map_err(HttpError::invalid)?;
    call(&state, &caller, Request::Propose(Proposal { change, force })).await
}

async fn recover(State(state): State<St>, caller: Caller, Body(b): Body<RecoverBody>) -> Answer {
    let request = Request::RecoverUnsafe {
        members: b.members.into_iter().map(Member::from).collect(),
        stopped: b.confirm_stopped.into_iter().map(NodeId).collect(),
        skip: b.skip,
    };
    call(&state, &caller, request).await
}

/// The caller identity's lost-lock events as server-sent events (`event:` the kind, `id:` the
/// `seq`, `data:` an [`EventBody`]). A new stream of the same identity replaces this one, which
/// then ends.
async fn events(
    State(state): State<St>,
    caller: Caller,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let rx = state.shared.api.resubscribe(caller.owner.conn);
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        let event = rx.recv().await?;
        let body = EventBody::from(event);
        let sse = Event::default().event(body.kind).id(body.seq.to_string());
        let sse = sse.json_data(&body).unwrap_or_else(|_| Event::default().comment("unencodable event"));
        Some((Ok(sse), rx))
    });
    Sse::new(stream).keep_alive(KeepAlive::new().interval(EVENTS_KEEP_ALIVE))
}
