//! `/metrics` (Prometheus) and the status page (`/`, `/status`), with no token, like the health
//! probes: they change nothing (docs/operations.md, "Monitoring").
//!
//! - `GET /metrics`: OpenMetrics text when the scraper accepts it (Prometheus does), else the
//!   Prometheus text format (`curl`, `promtool check metrics`). See [`crate::metrics`].
//! - `GET /` and `GET /status`: the HTML status page ([`crate::page`]).
//!
//! Hot keys in JSON are part of the status (`GET /v1/status`, `hot_keys`).

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::header::{ACCEPT, CONTENT_TYPE};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;

use crate::metrics;
use crate::runtime::Shared;

pub(crate) fn routes(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/metrics", get(scrape))
        .route("/", get(page))
        .route("/status", get(page))
        .with_state(shared)
}

async fn scrape(State(shared): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    let Ok(text) = metrics::encode(&shared) else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    let openmetrics = (headers.get_all(ACCEPT).iter())
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    if openmetrics {
        ([(CONTENT_TYPE, metrics::CONTENT_TYPE)], text).into_response()
    } else {
        ([(CONTENT_TYPE, metrics::CONTENT_TYPE_CLASSIC)], metrics::to_classic(&text)).into_response()
    }
}

async fn page(State(shared): State<Arc<Shared>>) -> Html<String> {
    Html(crate::page::render(&shared.status(), &shared.metrics.samples()))
}
