//! `/healthz` and `/readyz`: probes for Kubernetes and `keyhome dev`, with no token.
//!
//! - `GET /healthz`: 200 while the process serves HTTP at all.
//! - `GET /readyz`: 200 when the node can admit locks as a full member: it is a member of its
//!   current epoch, holds a home lease for it, and its restart quarantine is over; else 503.
//!   Either way the body says which of the three holds.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use serde::Serialize;

use crate::runtime::Shared;

/// The body of `/readyz`.
#[derive(Serialize)]
struct Readiness {
    ready: bool,
    /// The node's current epoch.
    epoch: u64,
    /// This node is a member of it.
    member: bool,
    /// This node holds a home lease for it.
    home_lease: bool,
    /// Restart quarantine left, in milliseconds (0: over).
    quarantine_left_ms: u64,
}

pub(crate) fn routes(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { Json(serde_json::json!({ "ok": true })) }))
        .route("/readyz", get(readyz))
        .with_state(shared)
}

async fn readyz(State(shared): State<Arc<Shared>>) -> (StatusCode, Json<Readiness>) {
    let status = shared.status();
    let member = status.members.iter().any(|m| m.id == status.id);
    let home_lease = status.home_lease_left.is_some();
    let ready = member && home_lease && status.quarantine_left.is_zero();
    let body = Readiness {
        ready,
        epoch: status.epoch,
        member,
        home_lease,
        quarantine_left_ms: super::json::millis(status.quarantine_left),
    };
    (if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }, Json(body))
}
