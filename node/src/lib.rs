//! The keyhome node: owns all I/O around the protocol cores.
//!
//! - [`runtime`]: the node process ([`Node`]): QUIC links, persistence, timers.
//! - [`core`]: the three protocol state machines of one node and the glue between them.
//! - [`api`]: the client API, server side; [`client`]: the Rust client.
//! - [`embedded`]: locking in-process through a [`Node`].
//! - [`peers`]: noticing two processes that claim one node id.
//! - [`pki`]: certificates and TLS; [`store`]: durable state in redb; [`clock`]: the boot clock.
//! - [`admission`]: caps on handshakes, connections and request bytes; [`ratelog`]: log lines
//!   outsiders can cause, rate-limited.
//! - [`wire`]: frames on QUIC streams; [`config`]: files; [`status`]: what `keyhome status` shows.

pub mod admission;
pub mod api;
#[cfg(feature = "bug-injection")]
pub mod bugs;
pub mod client;
pub mod clock;
pub mod config;
pub mod core;
pub mod embedded;
pub mod peers;
pub mod pki;
pub mod ratelog;
pub mod runtime;
pub mod setup;
pub mod status;
pub mod store;
pub mod wire;

pub use embedded::{CheckError, LockGuard};
pub use runtime::{Node, NodeError};
