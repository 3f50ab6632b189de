//! The HTTP listeners and their accept loops: hyper's HTTP/1.1 server on the node's tokio
//! runtime, one task per connection, serving [`super::router`].
//!
//! Limits against misbehaving clients: at most [`MAX_CONNECTIONS`] connections at once (further
//! ones wait in the kernel's backlog); a request's headers must arrive within the configured
//! request timeout, else the connection is closed (its body has the same bound, see
//! [`super::json`]); request bodies are capped at [`super::json::MAX_BODY`]. A connection that
//! ends drops its handler, which withdraws a pending lock.

use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::serve::{Listener, ListenerExt};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

use crate::config::NodeConfig;
use crate::runtime::{Shared, stopping};

/// Most HTTP connections served at once, over both listeners.
pub const MAX_CONNECTIONS: usize = 1024;

/// Why the HTTP API could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen for HTTP on {addr}: {source}")]
    Tcp { addr: SocketAddr, source: std::io::Error },
    #[error("cannot listen for HTTP on the Unix socket {path}: {source}")]
    Unix { path: PathBuf, source: std::io::Error },
    #[error("{path} exists and is not a socket; refusing to replace it with the HTTP socket")]
    NotASocket { path: PathBuf },
    #[error("the HTTP tokens: {0}")]
    Tokens(#[from] super::tokens::TokensError),
}

/// The bound HTTP listeners of a node, not yet serving.
pub(crate) struct Listeners {
    tcp: Option<tokio::net::TcpListener>,
    unix: Option<tokio::net::UnixListener>,
    header_timeout: Duration,
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
            Some(path) => Some(bind_unix(path)?),
            None => None,
        };
        Ok(Some(Listeners { tcp, unix, header_timeout: Duration::from_millis(http.request_timeout_ms) }))
    }

    /// The TCP address bound, if any.
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.tcp.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// Serves [`super::router`] on every listener until the node stops.
    pub fn serve(self, shared: &Arc<Shared>) {
        let router = super::router(Arc::clone(shared));
        let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        let serving = Serving { router, permits, header_timeout: self.header_timeout };
        if let Some(tcp) = self.tcp {
            tracing::info!(addr = ?tcp.local_addr().ok(), "HTTP API listening");
            let tcp = tcp.tap_io(|stream| {
                let _ = stream.set_nodelay(true);
            });
            tokio::spawn(accept_loop(serving.clone(), tcp, shared.shutdown.subscribe()));
        }
        if let Some(unix) = self.unix {
            tokio::spawn(accept_loop(serving, unix, shared.shutdown.subscribe()));
        }
    }
}

/// Binds the Unix socket at `path` (mode 0600), replacing a stale socket left there.
fn bind_unix(path: &Path) -> Result<tokio::net::UnixListener, StartError> {
    let err = |source| StartError::Unix { path: path.to_path_buf(), source };
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(path).map_err(err)?,
        Ok(_) => return Err(StartError::NotASocket { path: path.to_path_buf() }),
        Err(_) => {}
    }
    let listener = tokio::net::UnixListener::bind(path).map_err(err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    tracing::info!(path = %path.display(), "HTTP API listening on a Unix socket");
    Ok(listener)
}

/// What every connection task needs.
#[derive(Clone)]
struct Serving {
    router: axum::Router,
    permits: Arc<Semaphore>,
    header_timeout: Duration,
}

async fn accept_loop<L: Listener>(serving: Serving, mut listener: L, mut stop: watch::Receiver<bool>) {
    loop {
        let permit = tokio::select! {
            permit = Arc::clone(&serving.permits).acquire_owned() => permit,
            _ = stopping(&mut stop) => return,
        };
        let Ok(permit) = permit else { return };
        let io = tokio::select! {
            (io, _) = listener.accept() => io,
            _ = stopping(&mut stop) => return,
        };
        tokio::spawn(serve_connection(serving.clone(), io, permit, stop.clone()));
    }
}

/// Serves one connection until it ends or the node stops (which drops its handlers).
async fn serve_connection<I>(
    serving: Serving,
    io: I,
    _permit: OwnedSemaphorePermit,
    mut stop: watch::Receiver<bool>,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(serving.header_timeout);
    let connection =
        builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(serving.router.clone()));
    tokio::select! {
        result = connection => {
            if let Err(e) = result {
                tracing::debug!("HTTP connection ended: {e}");
            }
        }
        _ = stopping(&mut stop) => {}
    }
}
