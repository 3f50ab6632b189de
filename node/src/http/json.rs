//! JSON in and out of the HTTP API: request bodies read with a size and time bound, and errors
//! as an HTTP status with `{"error": {"kind": ..., "message": ...}}`.
//!
//! `kind` is one of the QUIC API's error kinds (`Timeout`, `Lost`, `Invalid`, `Unavailable`,
//! `Forbidden`, `Epoch`, with the same meaning), or one of the HTTP API's own:
//! `Unauthenticated` (401: no token, or one the node does not know) and `NotFound` (404: no such
//! route).

use std::time::Duration;

use axum::Json;
use axum::body::Body;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::wire::{ApiError, ErrorKind, MAX_CLIENT_FRAME};

/// Largest request body: the QUIC API's frame limit.
pub const MAX_BODY: usize = MAX_CLIENT_FRAME;

/// A failed HTTP request.
#[derive(Debug)]
pub struct HttpError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorDetail<'a>,
}

#[derive(Serialize)]
struct ErrorDetail<'a> {
    kind: &'a str,
    message: &'a str,
}

impl HttpError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> HttpError {
        HttpError { status, kind, message: message.into() }
    }

    /// A request with bad input: 400 `Invalid`.
    pub fn invalid(message: impl Into<String>) -> HttpError {
        HttpError::new(StatusCode::BAD_REQUEST, "Invalid", message)
    }

    /// 401 `Unauthenticated`.
    pub fn unauthenticated(message: impl Into<String>) -> HttpError {
        HttpError::new(StatusCode::UNAUTHORIZED, "Unauthenticated", message)
    }
}

impl From<ApiError> for HttpError {
    /// The status for each QUIC error kind; the kind keeps its name.
    fn from(e: ApiError) -> HttpError {
        let (status, kind) = match e.kind {
            ErrorKind::Timeout => (StatusCode::CONFLICT, "Timeout"),
            ErrorKind::Lost => (StatusCode::GONE, "Lost"),
            ErrorKind::Invalid => (StatusCode::BAD_REQUEST, "Invalid"),
            ErrorKind::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "Unavailable"),
            ErrorKind::Forbidden => (StatusCode::FORBIDDEN, "Forbidden"),
            ErrorKind::Epoch => (StatusCode::CONFLICT, "Epoch"),
        };
        HttpError { status, kind, message: e.message }
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let body = ErrorBody { error: ErrorDetail { kind: self.kind, message: &self.message } };
        let mut response = (self.status, Json(body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// Reads `body` as JSON of type `T`: at most [`MAX_BODY`] bytes (else 413), within `timeout`
/// (else 408), and well-formed with exactly the fields `T` has (else 400). Any content type is
/// taken as JSON, so that `curl -d` works as it is.
pub async fn read<T: DeserializeOwned>(body: Body, timeout: Duration) -> Result<T, HttpError> {
    let bytes = match tokio::time::timeout(timeout, Limited::new(body, MAX_BODY).collect()).await {
        Err(_) => {
            return Err(HttpError::new(
                StatusCode::REQUEST_TIMEOUT,
                "Invalid",
                format!("the request body did not arrive within {} ms", timeout.as_millis()),
            ));
        }
        Ok(Err(e)) if e.is::<LengthLimitError>() => {
            return Err(HttpError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "Invalid",
                format!("the request body exceeds the limit of {MAX_BODY} bytes"),
            ));
        }
        Ok(Err(e)) => return Err(HttpError::invalid(format!("cannot read the request body: {e}"))),
        Ok(Ok(collected)) => collected.to_bytes(),
    };
    serde_json::from_slice(&bytes).map_err(|e| HttpError::invalid(format!("malformed JSON body: {e}")))
}

/// The answer to a route that does not exist.
pub async fn not_found(uri: axum::http::Uri) -> HttpError {
    HttpError::new(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("no route {}; see docs/openapi.json", uri.path()),
    )
}

/// The answer to any request but a probe on a connection past the cap (see [`super::server`]).
pub async fn busy(max_connections: usize) -> HttpError {
    HttpError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "Unavailable",
        format!(
            "this node serves {max_connections} HTTP connections already (http.max_connections): \
             retry later, and reuse connections"
        ),
    )
}

/// The answer to a route that exists, asked with the wrong method.
pub async fn wrong_method(method: axum::http::Method, uri: axum::http::Uri) -> HttpError {
    HttpError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "Invalid",
        format!("{} does not take {method}; see docs/openapi.json", uri.path()),
    )
}

/// Milliseconds of `d`, rounded down (a validity is never overstated).
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
