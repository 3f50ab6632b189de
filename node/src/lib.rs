//! The keyhome node: owns all I/O around the protocol cores.
//!
//! - [`runtime`]: the node process ([`Node`]): QUIC links, persistence, timers.
//! - [`core`]: the three protocol state machines of one node and the glue between them.
//! - [`api`]: the client API, server side (QUIC); [`local`]: the same on a Unix socket;
//!   [`client`]: the Rust client (either transport); [`http`]: the same API as HTTP/JSON, and
//!   health probes.
//! - [`embedded`]: locking in-process through a [`Node`].
//! - [`peers`]: noticing two processes that claim one node id.
//! - [`pki`]: certificates and TLS; [`store`]: durable state in redb; [`clock`]: the boot clock.
//! - [`admission`]: caps on handshakes, connections and request bytes; [`ratelog`]: log lines
//!   outsiders can cause, rate-limited.
//! - [`wire`]: frames on QUIC streams; [`config`]: files; [`status`]: what `keyhome status` shows.
//! - [`addr`]: `HOST:PORT` addresses and DNS names; [`duration`]: durations read and shown.
//! - [`machine`]: what the node notices about the machine it runs on (idle polling on VMs).
//! - Observability: [`activity`] and [`hotkeys`] (what the core records), [`metrics`]
//!   (Prometheus `/metrics`), [`page`] (the HTML status page).

pub mod activity;
pub mod addr;
pub mod admission;
pub mod api;
#[cfg(feature = "bug-injection")]
pub mod bugs;
pub mod busy_poll;
pub mod client;
pub mod clock;
pub mod config;
pub mod core;
pub mod duration;
pub mod embedded;
pub mod hotkeys;
pub mod http;
pub mod local;
mod lockfile;
pub mod machine;
pub mod metrics;
pub mod page;
pub mod peers;
pub mod pki;
pub mod proposal;
pub mod ratelog;
pub mod readfile;
pub mod runtime;
pub mod setup;
pub mod socket_file;
pub mod status;
pub mod store;
pub mod wire;

pub use embedded::{CheckError, LockGuard};
pub use runtime::{Node, NodeError};
