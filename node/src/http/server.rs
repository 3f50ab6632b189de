//! The HTTP listeners and their accept loops: hyper's HTTP/1.1 server on the node's tokio
//! runtime, one task per connection, serving [`super::router`].
//!
//! Limits against misbehaving clients: at most `http.max_connections` connections served at
//! once; past it, [`OVERFLOW`] more are each answered at once (the probes as usual, any other
//! route `503 Unavailable`, [`super::busy_router`]) and closed, so that connections holding long
//! lock waits, or idle ones, cannot starve the health probes or leave other clients hanging in
//! the kernel's backlog (further ones wait there); a request's headers must arrive within the
//! configured request timeout ([`OVERFLOW_HEADER_TIMEOUT`] at most past the cap), else the
//! connection is closed (its body has the same bound, see [`super::json`]); request bodies are
//! capped at [`super::json::MAX_BODY`]. A connection that ends drops its handler, which
//! withdraws a pending lock.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::{Listener, ListenerExt};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

use crate::config::NodeConfig;
use crate::runtime::{Shared, stopping};
use crate::socket_file::{SocketFile, SocketFileError};

/// Connections accepted past `http.max_connections`, each answered at once and closed.
pub const OVERFLOW: usize = 32;
/// Longest an overflow connection may take to send its request's headers.
pub const OVERFLOW_HEADER_TIMEOUT: Duration = Duration::from_secs(1);

/// Why the HTTP API could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen for HTTP on {addr}: {source}")]
    Tcp { addr: SocketAddr, source: std::io::Error },
    #[error("the HTTP API's socket: {0}")]
    Unix(#[from] SocketFileError),
    #[error("the HTTP tokens: {0}")]
    Tokens(#[from] super::tokens::TokensError),
}

/// The bound HTTP listeners of a node, not yet serving.
pub(crate) struct Listeners {
    tcp: Option<tokio::net::TcpListener>,
    /// The Unix socket (mode 0600), removed when its accept loop ends.
    unix: Option<(tokio::net::UnixListener, SocketFile)>,
    header_timeout: Duration,
    max_connections: usize,
}

impl Listeners {
    /// Binds what `config`'s `[http]` table names (nothing without one), after checking that its
    /// tokens file can be read.
    pub async fn bind(config: &NodeConfig) -> Result<Option<Listeners>, StartError> {
        let Some(http) = &config.http else { return Ok(None) };
        super::tokens::Tokens::check(&http.tokens)?;
        let tcp = match http.listen {
            Some(addr) => Some(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|source| StartError::Tcp { addr, source })?,
            ),
            None => None,
        };
        let unix = match &http.unix {
            Some(path) => Some(SocketFile::bind(path, 0o600)?),
            None => None,
        };
        let header_timeout = Duration::from_millis(http.request_timeout_ms);
        Ok(Some(Listeners { tcp, unix, header_timeout, max_connections: http.max_connections }))
    }

    /// The TCP address bound, if any.
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.tcp.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// Serves [`super::router`] on every listener until the node stops.
    pub fn serve(self, shared: &Arc<Shared>) {
        let serving = Serving {
            full: Pool {
                router: super::router(Arc::clone(shared)),
                permits: Arc::new(Semaphore::new(self.max_connections)),
                header_timeout: self.header_timeout,
            },
            overflow: Pool {
                router: super::busy_router(Arc::clone(shared), self.max_connections),
                permits: Arc::new(Semaphore::new(OVERFLOW)),
                header_timeout: self.header_timeout.min(OVERFLOW_HEADER_TIMEOUT),
            },
        };
        if let Some(tcp) = self.tcp {
            tracing::info!(addr = ?tcp.local_addr().ok(), "HTTP API listening");
            let tcp = tcp.tap_io(|stream| {
                let _ = stream.set_nodelay(true);
            });
            tokio::spawn(accept_loop(serving.clone(), tcp, shared.shutdown.subscribe()));
        }
        if let Some((unix, file)) = self.unix {
            tracing::info!(path = %file.path().display(), "HTTP API listening on a Unix socket");
            let stop = shared.shutdown.subscribe();
            tokio::spawn(async move {
                accept_loop(serving, unix, stop).await;
                drop(file);
            });
        }
    }
}

/// The connections of one kind: what serves them, and how many may be served at once.
#[derive(Clone)]
struct Pool {
    router: axum::Router,
    permits: Arc<Semaphore>,
    header_timeout: Duration,
}

/// What every connection task needs: the full API, and what serves connections past the cap.
#[derive(Clone)]
struct Serving {
    full: Pool,
    overflow: Pool,
}

async fn accept_loop<L: Listener>(serving: Serving, mut listener: L, mut stop: watch::Receiver<bool>) {
    loop {
        // A slot before the connection: with none free of either kind, connections wait in the
        // kernel's backlog.
        let slot = tokio::select! {
            biased;
            _ = stopping(&mut stop) => return,
            permit = Arc::clone(&serving.full.permits).acquire_owned() => permit.map(|p| (p, false)),
            permit = Arc::clone(&serving.overflow.permits).acquire_owned() => permit.map(|p| (p, true)),
        };
        let Ok((mut permit, mut overflow)) = slot else { return };
        let io = tokio::select! {
            (io, _) = listener.accept() => io,
            _ = stopping(&mut stop) => return,
        };
        // A full slot may have come free while this one waited for the connection.
        if overflow && let Ok(full) = Arc::clone(&serving.full.permits).try_acquire_owned() {
            (permit, overflow) = (full, false);
        }
        let pool = if overflow { serving.overflow.clone() } else { serving.full.clone() };
        tokio::spawn(serve_connection(pool, overflow, io, permit, stop.clone()));
    }
}

/// Serves one connection until it ends or the node stops (which drops its handlers); an
/// `overflow` connection for one request only.
async fn serve_connection<I>(
    pool: Pool,
    overflow: bool,
    io: I,
    _permit: OwnedSemaphorePermit,
    mut stop: watch::Receiver<bool>,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(pool.header_timeout).keep_alive(!overflow);
    let connection = builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(pool.router));
    tokio::select! {
        result = connection => {
            if let Err(e) = result {
                tracing::debug!("HTTP connection ended: {e}");
            }
        }
        _ = stopping(&mut stop) => {}
    }
}
