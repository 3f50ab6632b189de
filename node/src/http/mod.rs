//! The HTTP/JSON API of the sidecar (docs/api.md, "HTTP API"; docs/openapi.json): the client API
//! over HTTP/1.1 with bearer tokens, plus health probes. On when `node.toml` has an `[http]`
//! table.
//!
//! Each submodule gives its routes as a [`Router`] with its state applied; [`router`] merges
//! them. Everything it answers is JSON; errors are [`json::HttpError`]s.

use std::sync::Arc;

use axum::Router;

use crate::runtime::Shared;

pub(crate) mod api;
pub(crate) mod health;
pub(crate) mod json;
pub(crate) mod observe;
pub(crate) mod server;
pub mod tokens;

pub(crate) use server::Listeners;
pub use server::StartError;

/// Every route the node serves over HTTP.
pub(crate) fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .merge(health::routes(Arc::clone(&shared)))
        .merge(observe::routes(Arc::clone(&shared)))
        .merge(api::routes(shared))
        .fallback(json::not_found)
        .method_not_allowed_fallback(json::wrong_method)
}

/// What a connection past `http.max_connections` is served ([`server`]): the probes, and for
/// any other route `503 Unavailable` saying why.
pub(crate) fn busy_router(shared: Arc<Shared>, max_connections: usize) -> Router {
    Router::new()
        .merge(health::routes(shared))
        .fallback(move || json::busy(max_connections))
        .method_not_allowed_fallback(json::wrong_method)
}
