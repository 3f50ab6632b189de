//! The files a node and its clients read: the node's TOML configuration, the cluster's genesis,
//! and a client profile. Every relative path in a file is relative to the file's directory.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::duration::millis;
use keyhome_epoch::{EpochRecord, Member, NodeId, RecordError, Timing};
use serde::{Deserialize, Serialize};

/// Why a file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("{path} is not valid: {source}")]
    Parse { path: PathBuf, source: Box<toml::de::Error> },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("the genesis in {path} is not a valid epoch: {source}")]
    Genesis { path: PathBuf, source: RecordError },
    #[error(
        "node {id} is configured to listen on {listen}, but epoch {epoch} places it at {addr}: \
         is this a copy of another node's configuration? Each node id runs in one process only; \
         start this node with listen = {addr:?}"
    )]
    ListenMismatch { id: u64, listen: SocketAddr, epoch: u64, addr: String },
}

/// Largest configuration file read: anything larger is a mistake.
const MAX_FILE: u64 = 1 << 20;

fn read_toml<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, ConfigError> {
    let read_err = |source| ConfigError::Read { path: path.to_path_buf(), source };
    let Some(text) = crate::readfile::text(path, MAX_FILE).map_err(read_err)? else {
        return Err(ConfigError::Invalid {
            path: path.to_path_buf(),
            message: format!("larger than the {MAX_FILE}-byte limit"),
        });
    };
    toml::from_str(&text).map_err(|e| ConfigError::Parse { path: path.to_path_buf(), source: Box::new(e) })
}

/// Writes `value` as TOML to `path`.
pub fn write_toml<T: Serialize>(path: &Path, value: &T) -> Result<(), ConfigError> {
    let text = toml::to_string(value).map_err(|e| ConfigError::Invalid {
        path: path.to_path_buf(),
        message: format!("cannot encode: {e}"),
    })?;
    std::fs::write(path, text).map_err(|source| ConfigError::Write { path: path.to_path_buf(), source })
}

fn resolve(base: &Path, p: &Path) -> PathBuf {
    if p.is_absolute() { p.to_path_buf() } else { base.join(p) }
}

fn dir_of(path: &Path) -> PathBuf {
    path.parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// A node's configuration file (`keyhome run --config node.toml`). Defaults in brackets.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// This node's id; must match its certificate.
    pub id: u64,
    /// UDP address of the node's QUIC endpoint, for peers and clients alike (they are told apart
    /// by ALPN and certificate role). Must match this node's address in the epoch.
    pub listen: SocketAddr,
    /// UDP address of the client API. Default: the same socket as `listen` when that is a
    /// loopback address, else port `listen.port()` on loopback (127.0.0.1 or ::1), so that only
    /// local applications reach it. Set it to `listen` to serve clients on the peer address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_listen: Option<SocketAddr>,
    /// Peers reach this node through a relay or a NAT that changes its address, so `listen` need
    /// not match its address in the epoch: the start-up check against a second process started
    /// from a copy of this configuration ([`NodeConfig::check_listen`]) is skipped. [false]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub behind_relay: bool,
    /// Where the node keeps its redb database (`state.redb`).
    pub data_dir: PathBuf,
    /// The cluster CA certificate (PEM).
    pub ca: PathBuf,
    /// This node's certificate and key (PEM), issued by `keyhome certs issue --node ID`.
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The genesis file: the first start creates the store from it; a later start only checks,
    /// when the file is there, that the store was created from it.
    pub genesis: PathBuf,
    /// Local lock settings.
    #[serde(default)]
    pub locks: LockSettings,
    /// The HTTP/JSON API (docs/api.md, "HTTP API"): off unless this table is present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpConfig>,
    /// The client API on a Unix domain socket, for applications on this host (`[local]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local: Option<LocalSettings>,
    /// Worker threads of the node's runtime (`keyhome run`); 0: one per core (tokio's
    /// default); at most [`NodeConfig::MAX_WORKER_THREADS`]. Nodes that share a host should split
    /// its cores between them. [0]
    #[serde(default, skip_serializing_if = "is_zero")]
    pub worker_threads: usize,
    /// Busy polling (µs): after each message to or from another node, one worker keeps polling
    /// the sockets this long before it sleeps, so that the next message of the exchange is read
    /// without waking a sleeping CPU; at most 10 000. It costs up to a core while messages come
    /// closer together than this; for a host whose idle CPUs are slow to wake (a VM without halt
    /// polling) with cores to spare, and a node of one worker thread (docs/operations.md, "On
    /// virtual machines: idle polling"). [0: off]
    #[serde(default, skip_serializing_if = "is_zero")]
    pub busy_poll_us: u64,
    /// Key shards of the node's core: each is the home and holder of the keys that hash to it,
    /// behind its own lock, so calls about keys of different shards run on different threads at
    /// once (at most 64). 0: `worker_threads`, or one per core (at most 16) when that is 0 too.
    /// [0]
    #[serde(default, skip_serializing_if = "is_zero")]
    pub shards: usize,
    /// Caps against hostile load (docs/operations.md, "Limits and hostile load").
    #[serde(default, skip_serializing_if = "crate::admission::Limits::is_default")]
    pub limits: crate::admission::Limits,
}

fn is_zero<T: Default + PartialEq>(n: &T) -> bool {
    *n == T::default()
}

/// The local client socket (`[local]` in `node.toml`): who may connect is decided by the
/// socket file's mode and then by the peer's credentials (`SO_PEERCRED`), which [`LocalSettings::allow`]
/// maps to a client or operator identity. A peer no entry maps is refused.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalSettings {
    /// Path of the socket file (relative: to `node.toml`'s directory). A stale socket there is
    /// replaced; a live one (another process answers on it) stops the node from starting.
    pub socket: PathBuf,
    /// Permission bits of the socket file; connecting needs write permission. [0o660]
    #[serde(default = "LocalSettings::default_mode")]
    pub mode: u32,
    /// Most connections open at once; further ones are refused. [1024]
    #[serde(default = "LocalSettings::default_max_connections")]
    pub max_connections: usize,
    /// Most requests of one connection that may wait (locks, checks, operator changes) in
    /// progress at once; a further one is answered `Unavailable` at once. What is answered at
    /// once (an unlock, a renewal, a status) takes no slot. [256]
    #[serde(default = "LocalSettings::default_max_in_flight")]
    pub max_in_flight: usize,
    /// Who may connect (`[[local.allow]]`): an entry for the peer's uid wins over one for its
    /// gid. Empty: only the node's own uid, as the operator (a process of that uid can read the
    /// node's key anyway).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<LocalAllow>,
}

impl LocalSettings {
    fn default_mode() -> u32 {
        0o660
    }
    fn default_max_connections() -> usize {
        1024
    }
    fn default_max_in_flight() -> usize {
        256
    }

    /// The socket at `socket`, default limits, and `allow`.
    pub fn new(socket: PathBuf, allow: Vec<LocalAllow>) -> LocalSettings {
        LocalSettings {
            socket,
            mode: LocalSettings::default_mode(),
            max_connections: LocalSettings::default_max_connections(),
            max_in_flight: LocalSettings::default_max_in_flight(),
            allow,
        }
    }

    fn check(&self) -> Result<(), String> {
        if self.mode > 0o777 {
            return Err(format!("local.mode {:#o} is not a set of permission bits", self.mode));
        }
        if !(1..=MAX_CONNECTIONS).contains(&self.max_connections) {
            return Err(format!(
                "local.max_connections = {} is not within 1 to {MAX_CONNECTIONS}",
                self.max_connections
            ));
        }
        if !(1..=MAX_IN_FLIGHT).contains(&self.max_in_flight) {
            return Err(format!(
                "local.max_in_flight = {} is not within 1 to {MAX_IN_FLIGHT}",
                self.max_in_flight
            ));
        }
        self.allow.iter().try_for_each(LocalAllow::check)
    }

    /// The identity of a peer with `uid` and `gid`, for a node running as `own_uid`.
    pub fn role_of(&self, uid: u32, gid: u32, own_uid: u32) -> Option<crate::pki::Role> {
        if self.allow.is_empty() {
            return (uid == own_uid).then_some(crate::pki::Role::Operator);
        }
        let by_uid = self.allow.iter().find(|a| a.uid == Some(uid));
        let by_gid = || self.allow.iter().find(|a| a.uid.is_none() && a.gid == Some(gid));
        by_uid.or_else(by_gid).map(LocalAllow::role)
    }
}

/// One `[[local.allow]]` entry: peers of this uid (or, without `uid`, of this gid) act as
/// `role` (`client`, with `name`, or `operator`), exactly as a certificate of that role does on
/// QUIC (a handle passes between connections of one identity, whichever transport).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalAllow {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
    pub role: LocalRole,
    /// The client name (`role = "client"` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LocalRole {
    Client,
    Operator,
}

impl LocalAllow {
    fn check(&self) -> Result<(), String> {
        if self.uid.is_some() == self.gid.is_some() {
            return Err("each [[local.allow]] entry names exactly one of uid and gid".into());
        }
        match (self.role, &self.name) {
            (LocalRole::Client, Some(_)) | (LocalRole::Operator, None) => {}
            (LocalRole::Client, None) => return Err("a client [[local.allow]] entry needs a name".into()),
            (LocalRole::Operator, Some(_)) => {
                return Err("an operator [[local.allow]] entry has no name".into());
            }
        }
        self.role().validate().map_err(|e| e.to_string())
    }

    pub fn role(&self) -> crate::pki::Role {
        match (self.role, &self.name) {
            (LocalRole::Client, Some(name)) => crate::pki::Role::Client(name.clone()),
            _ => crate::pki::Role::Operator,
        }
    }
}

/// The `[http]` table of `node.toml`: where the HTTP/JSON API listens and whom it lets in.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// TCP address to serve on, e.g. `127.0.0.1:7101` (the same number as the QUIC port is fine:
    /// TCP and UDP ports are apart). Keep it on loopback unless a TLS proxy fronts it: bearer
    /// tokens travel in clear text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listen: Option<SocketAddr>,
    /// Unix socket path to serve on as well (created with mode 0600; a stale socket there is
    /// replaced). Tokens are required on it too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unix: Option<PathBuf>,
    /// The tokens file (`http-tokens.toml` in the cluster directory, kept by `keyhome certs
    /// issue`): hashes of the bearer tokens and the identity each stands for. Re-read when it
    /// changes.
    pub tokens: PathBuf,
    /// A request's headers and body must arrive within this long, else it is answered 408 (or
    /// the connection closed) [10 000].
    #[serde(
        default = "HttpConfig::default_request_timeout_ms",
        deserialize_with = "crate::duration::ms_or_text"
    )]
    pub request_timeout_ms: u64,
    /// Most connections served at once over both listeners [1024]. Past it, a few more (32) are
    /// answered at once and closed: the probes (`/healthz`, `/readyz`) as usual, every other route
    /// `503 Unavailable`, so that one client's many connections cannot starve the probes.
    #[serde(default = "HttpConfig::default_max_connections")]
    pub max_connections: usize,
}

/// Most `http.max_connections` or `local.max_connections` a node takes (each is a task and a file
/// descriptor).
pub const MAX_CONNECTIONS: usize = 1 << 20;

/// Most `local.max_in_flight` a node takes (requests in progress on one connection).
pub const MAX_IN_FLIGHT: usize = 1 << 16;

impl HttpConfig {
    fn default_request_timeout_ms() -> u64 {
        10_000
    }

    fn default_max_connections() -> usize {
        1024
    }

    /// The settings `keyhome dev` and the test clusters use: TCP on `listen`, the cluster's
    /// tokens file (one directory up from `node.toml`), default timeout.
    pub fn local(listen: SocketAddr) -> HttpConfig {
        HttpConfig {
            listen: Some(listen),
            unix: None,
            tokens: PathBuf::from("..").join(crate::http::tokens::TOKENS_FILE),
            request_timeout_ms: HttpConfig::default_request_timeout_ms(),
            max_connections: HttpConfig::default_max_connections(),
        }
    }
}

/// Tuning of the delegation layer on one node; all durations in milliseconds, written in the file
/// as an integer (`5000`) or a duration (`"5s"`, `"1m30s"`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LockSettings {
    /// Delegation lease asked for (capped by the epoch's `max_delegation_lease`) [5 000: the
    /// delegation lease `keyhome init` and `keyhome dev` put in the genesis].
    #[serde(deserialize_with = "crate::duration::ms_or_text")]
    pub delegation_lease_ms: u64,
    /// An unused delegation is released after this long [2 000].
    #[serde(deserialize_with = "crate::duration::ms_or_text")]
    pub idle_release_ms: u64,
    /// After an unclean expiry, a key this node homes is kept from everyone this long [0: off].
    #[serde(deserialize_with = "crate::duration::ms_or_text")]
    pub lock_delay_ms: u64,
}

impl LockSettings {
    /// Longest any of these durations may be: the longest lease an epoch allows (an hour).
    const MAX_MS: u64 = keyhome_epoch::record::MAX_LEASE.as_millis() as u64;

    /// Checks the bounds: a delegation lease of 1 ms to an hour, the others at most an hour.
    pub fn check(&self) -> Result<(), String> {
        if !(1..=Self::MAX_MS).contains(&self.delegation_lease_ms) {
            return Err(format!(
                "locks.delegation_lease_ms = {} is not within 1 to {} (an hour)",
                self.delegation_lease_ms,
                Self::MAX_MS
            ));
        }
        for (name, ms) in [("idle_release_ms", self.idle_release_ms), ("lock_delay_ms", self.lock_delay_ms)] {
            if ms > Self::MAX_MS {
                return Err(format!("locks.{name} = {ms} is more than {} (an hour)", Self::MAX_MS));
            }
        }
        Ok(())
    }
}

impl Default for LockSettings {
    fn default() -> LockSettings {
        LockSettings { delegation_lease_ms: 5_000, idle_release_ms: 2_000, lock_delay_ms: 0 }
    }
}

impl NodeConfig {
    /// Largest `worker_threads`: more threads than any host has cores only cost memory and
    /// wake-ups (and a number near `usize::MAX` would make the runtime abort).
    pub const MAX_WORKER_THREADS: usize = 1024;

    /// How many key shards the node runs (see [`NodeConfig::shards`]).
    pub fn shard_count(&self) -> usize {
        let chosen = if self.shards > 0 { self.shards } else { self.worker_threads };
        if chosen > 0 { chosen.min(crate::core::MAX_SHARDS) } else { crate::core::default_shards() }
    }

    /// Reads `path` and resolves its relative paths against the file's directory.
    pub fn load(path: &Path) -> Result<NodeConfig, ConfigError> {
        let mut config: NodeConfig = read_toml(path)?;
        let base = dir_of(path);
        for p in
            [&mut config.data_dir, &mut config.ca, &mut config.cert, &mut config.key, &mut config.genesis]
        {
            *p = resolve(&base, p);
        }
        if let Some(http) = &mut config.http {
            http.tokens = resolve(&base, &http.tokens);
            if let Some(unix) = &mut http.unix {
                *unix = resolve(&base, unix);
            }
            if http.listen.is_none() && http.unix.is_none() {
                return Err(ConfigError::Invalid {
                    path: path.to_path_buf(),
                    message: "[http] needs `listen` (a TCP address), `unix` (a socket path) or both".into(),
                });
            }
            if http.request_timeout_ms == 0 {
                return Err(ConfigError::Invalid {
                    path: path.to_path_buf(),
                    message: "http.request_timeout_ms = 0: a request could never arrive in time".into(),
                });
            }
            if !(1..=MAX_CONNECTIONS).contains(&http.max_connections) {
                return Err(ConfigError::Invalid {
                    path: path.to_path_buf(),
                    message: format!(
                        "http.max_connections = {} is not within 1 to {MAX_CONNECTIONS}",
                        http.max_connections
                    ),
                });
            }
        }
        if let Some(local) = &mut config.local {
            local.socket = resolve(&base, &local.socket);
            local.check().map_err(|message| ConfigError::Invalid { path: path.to_path_buf(), message })?;
        }
        if config.worker_threads > NodeConfig::MAX_WORKER_THREADS {
            return Err(ConfigError::Invalid {
                path: path.to_path_buf(),
                message: format!(
                    "worker_threads = {} is more than {}",
                    config.worker_threads,
                    NodeConfig::MAX_WORKER_THREADS
                ),
            });
        }
        if config.shards > crate::core::MAX_SHARDS {
            return Err(ConfigError::Invalid {
                path: path.to_path_buf(),
                message: format!("shards = {} is more than {}", config.shards, crate::core::MAX_SHARDS),
            });
        }
        if config.busy_poll_us > crate::busy_poll::MAX_WINDOW.as_micros() as u64 {
            return Err(ConfigError::Invalid {
                path: path.to_path_buf(),
                message: format!(
                    "busy_poll_us = {} is more than {}: busy polling is for the gaps within an exchange",
                    config.busy_poll_us,
                    crate::busy_poll::MAX_WINDOW.as_micros()
                ),
            });
        }
        config
            .limits
            .check()
            .and_then(|()| config.locks.check())
            .map_err(|message| ConfigError::Invalid { path: path.to_path_buf(), message })?;
        Ok(config)
    }

    pub fn node_id(&self) -> NodeId {
        NodeId(self.id)
    }

    /// The client API's own address, or `None` when clients share the peer socket.
    pub fn client_endpoint(&self) -> Option<SocketAddr> {
        let loopback = |port| match self.listen {
            SocketAddr::V4(_) => SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, port)),
            SocketAddr::V6(_) => SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port)),
        };
        match self.client_listen {
            Some(addr) if addr == self.listen => None,
            Some(addr) => Some(addr),
            None if self.listen.ip().is_loopback() => None,
            None => Some(loopback(self.listen.port())),
        }
    }

    /// The node's database file.
    pub fn store_path(&self) -> PathBuf {
        self.data_dir.join("state.redb")
    }

    /// Refuses to start a node whose `listen` address is not its address in `epoch` (the newest
    /// it knows), which is what a second process started from a copy of a node's configuration
    /// looks like. An unspecified `listen` IP (`0.0.0.0`) matches any address with its port; a
    /// node `epoch` does not name, or whose address does not resolve now, is not checked.
    pub fn check_listen(&self, epoch: &EpochRecord) -> Result<(), ConfigError> {
        if self.behind_relay {
            return Ok(());
        }
        let Some(member) = epoch.members.iter().find(|m| m.id.0 == self.id) else { return Ok(()) };
        let Ok(resolved) = std::net::ToSocketAddrs::to_socket_addrs(member.addr.as_str()) else {
            return Ok(());
        };
        let listen = self.listen;
        let matches = |a: SocketAddr| {
            a.port() == listen.port() && (listen.ip().is_unspecified() || a.ip() == listen.ip())
        };
        if resolved.into_iter().any(matches) {
            return Ok(());
        }
        Err(ConfigError::ListenMismatch {
            id: self.id,
            listen,
            epoch: epoch.number,
            addr: member.addr.clone(),
        })
    }
}

/// The cluster's first epoch, as `keyhome init` writes it. Durations in milliseconds (an integer,
/// or a duration such as `"5s"`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenesisFile {
    #[serde(deserialize_with = "crate::duration::ms_or_text")]
    pub home_lease_ms: u64,
    #[serde(deserialize_with = "crate::duration::ms_or_text")]
    pub max_delegation_lease_ms: u64,
    pub clock_rate_ppm: u32,
    pub members: Vec<GenesisMember>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenesisMember {
    pub id: u64,
    pub addr: String,
}

impl GenesisFile {
    pub fn new(members: &[(NodeId, String)], timing: Timing) -> GenesisFile {
        GenesisFile {
            home_lease_ms: millis(timing.home_lease),
            max_delegation_lease_ms: millis(timing.max_delegation_lease),
            clock_rate_ppm: timing.clock_rate_ppm,
            members: members
                .iter()
                .map(|(id, addr)| GenesisMember { id: id.0, addr: addr.clone() })
                .collect(),
        }
    }

    pub fn load(path: &Path) -> Result<GenesisFile, ConfigError> {
        read_toml(path)
    }

    /// The genesis epoch record, validated, its addresses `HOST:PORT` (as every later change's).
    pub fn record(&self, path: &Path) -> Result<EpochRecord, ConfigError> {
        for m in &self.members {
            crate::addr::check(&m.addr).map_err(|message| ConfigError::Invalid {
                path: path.to_path_buf(),
                message: format!("member {}: {message}", m.id),
            })?;
        }
        let timing = Timing {
            home_lease: Duration::from_millis(self.home_lease_ms),
            max_delegation_lease: Duration::from_millis(self.max_delegation_lease_ms),
            clock_rate_ppm: self.clock_rate_ppm,
        };
        let members =
            self.members.iter().map(|m| Member { id: NodeId(m.id), addr: m.addr.clone() }).collect();
        EpochRecord::genesis(members, timing)
            .map_err(|source| ConfigError::Genesis { path: path.to_path_buf(), source })
    }
}

/// What a client needs to reach a node: `keyhome dev` and `keyhome certs issue --client` write
/// one (`profile.toml` in the identity's directory, e.g. `keyhome-dev/client-app/profile.toml`);
/// the CLI finds it with `--profile` or `KEYHOME_PROFILE`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientProfile {
    /// The node to talk to: its id (checked against its certificate) and address, `HOST:PORT`
    /// with an IP address or a DNS name (resolved on each connection; see [`crate::addr`]).
    pub node: u64,
    pub addr: String,
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The node's local socket ([`LocalSettings::socket`]): when the file exists, the client
    /// talks to the node through it (identified by its uid, not the certificate), else over QUIC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket: Option<PathBuf>,
    /// The uid the node behind `socket` runs as. Without it, the client takes a process running
    /// as root, as the client's own uid or as the owner of the socket's directory for the node
    /// (api.md, "The node's identity").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_uid: Option<u32>,
}

impl ClientProfile {
    pub fn load(path: &Path) -> Result<ClientProfile, ConfigError> {
        let mut profile: ClientProfile = read_toml(path)?;
        crate::addr::check(&profile.addr).map_err(|message| ConfigError::Invalid {
            path: path.to_path_buf(),
            message: format!("addr: {message}"),
        })?;
        let base = dir_of(path);
        for p in
            [&mut profile.ca, &mut profile.cert, &mut profile.key].into_iter().chain(profile.socket.as_mut())
        {
            *p = resolve(&base, p);
        }
        Ok(profile)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_peers_map_by_uid_then_gid_and_only_as_configured() {
        use crate::pki::Role;
        let entry =
            |uid, gid, role, name: Option<&str>| LocalAllow { uid, gid, role, name: name.map(Into::into) };
        let mut local = LocalSettings::new("s".into(), Vec::new());
        assert_eq!(local.role_of(7, 7, 7), Some(Role::Operator), "no entries: the node's own uid");
        assert_eq!(local.role_of(8, 7, 7), None);
        local.allow = vec![
            entry(None, Some(50), LocalRole::Client, Some("team")),
            entry(Some(1000), None, LocalRole::Client, Some("app")),
            entry(Some(0), None, LocalRole::Operator, None),
        ];
        assert!(local.check().is_ok());
        assert_eq!(local.role_of(1000, 50, 7), Some(Role::Client("app".into())), "the uid entry wins");
        assert_eq!(local.role_of(1001, 50, 7), Some(Role::Client("team".into())));
        assert_eq!(local.role_of(0, 0, 0), Some(Role::Operator));
        assert_eq!(local.role_of(7, 7, 7), None, "with entries, the node's uid needs one too");
        for bad in [
            entry(Some(1), Some(1), LocalRole::Operator, None),
            entry(None, None, LocalRole::Operator, None),
            entry(Some(1), None, LocalRole::Client, None),
            entry(Some(1), None, LocalRole::Operator, Some("x")),
            entry(Some(1), None, LocalRole::Client, Some("Not Valid")),
        ] {
            local.allow = vec![bad.clone()];
            assert!(local.check().is_err(), "{bad:?} accepted");
        }
    }

    /// Every `_ms` field takes a duration as text too, as operations.md says (review: the HTTP and
    /// admission timeouts took integers only).
    #[test]
    fn every_ms_field_takes_a_duration_text() {
        let text = "request_timeout_ms = \"5s\"\nfailed_handshake_refill_ms = \"1.5s\"";
        let limits: crate::admission::Limits = toml::from_str(text).expect("limits");
        assert_eq!((limits.request_timeout_ms, limits.failed_handshake_refill_ms), (5_000, 1_500));
        let http: HttpConfig = toml::from_str("tokens = \"t\"\nrequest_timeout_ms = \"10s\"").expect("http");
        assert_eq!(http.request_timeout_ms, 10_000);
        let locks: LockSettings = toml::from_str("delegation_lease_ms = \"2s\"").expect("locks");
        assert_eq!(locks.delegation_lease_ms, 2_000);
    }

    #[test]
    fn lock_settings_are_bounded() {
        assert!(LockSettings::default().check().is_ok());
        let bad = [
            LockSettings { delegation_lease_ms: 0, ..LockSettings::default() },
            LockSettings { delegation_lease_ms: 3_600_001, ..LockSettings::default() },
            LockSettings { idle_release_ms: u64::MAX, ..LockSettings::default() },
            LockSettings { lock_delay_ms: 3_600_001, ..LockSettings::default() },
        ];
        for settings in bad {
            assert!(settings.check().is_err(), "{settings:?} accepted");
        }
    }

    #[test]
    fn local_limits_are_bounded_both_ways() {
        let mut local = LocalSettings::new("s".into(), Vec::new());
        assert!(local.check().is_ok());
        // Past the bounds the socket's semaphore or answer queue could not be made (a panic,
        // so the node would stop at its first local connection).
        for (connections, in_flight) in
            [(0, 1), (1, 0), (MAX_CONNECTIONS + 1, 1), (1, MAX_IN_FLIGHT + 1), (usize::MAX, usize::MAX)]
        {
            local.max_connections = connections;
            local.max_in_flight = in_flight;
            assert!(local.check().is_err(), "{connections} connections, {in_flight} in flight accepted");
        }
        local.max_connections = MAX_CONNECTIONS;
        local.max_in_flight = MAX_IN_FLIGHT;
        assert!(local.check().is_ok());
    }

    #[test]
    fn a_node_listens_where_its_epoch_places_it() {
        let members = vec![Member { id: NodeId(1), addr: "127.0.0.1:7100".into() }];
        let epoch = EpochRecord::genesis(members, Timing::DEFAULT).unwrap();
        let config = |listen: &str| NodeConfig {
            id: 1,
            listen: listen.parse().unwrap(),
            client_listen: None,
            behind_relay: false,
            data_dir: "data".into(),
            ca: "ca.pem".into(),
            cert: "cert.pem".into(),
            key: "key.pem".into(),
            genesis: "genesis.toml".into(),
            locks: LockSettings::default(),
            http: None,
            local: None,
            worker_threads: 0,
            busy_poll_us: 0,
            shards: 0,
            limits: Default::default(),
        };
        assert!(config("127.0.0.1:7100").check_listen(&epoch).is_ok());
        assert!(config("0.0.0.0:7100").check_listen(&epoch).is_ok(), "any address with the port");
        assert!(matches!(
            config("127.0.0.1:7200").check_listen(&epoch),
            Err(ConfigError::ListenMismatch { id: 1, epoch: 1, .. })
        ));
        assert!(config("0.0.0.0:7200").check_listen(&epoch).is_err());
        let mut other = config("127.0.0.1:7200");
        other.id = 2;
        assert!(other.check_listen(&epoch).is_ok(), "a node the epoch does not name yet");
    }

    #[test]
    fn a_node_toml_out_of_bounds_is_refused_before_it_is_used() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.toml");
        let text = |extra: &str| {
            format!(
                "id = 1\nlisten = \"127.0.0.1:7100\"\ndata_dir = \"data\"\nca = \"ca.pem\"\n\
                 cert = \"c.pem\"\nkey = \"k.pem\"\ngenesis = \"g.toml\"\n{extra}"
            )
        };
        std::fs::write(&path, text("worker_threads = 1024")).unwrap();
        assert!(NodeConfig::load(&path).is_ok());
        std::fs::write(&path, text("worker_threads = 1152921504606846976")).unwrap();
        let err = NodeConfig::load(&path).unwrap_err();
        assert!(err.to_string().contains("worker_threads"), "{err}");
        // A genesis member's address is HOST:PORT, as every change's is.
        let genesis = GenesisFile::new(&[(NodeId(1), "10.0.0.1".into())], Timing::DEFAULT);
        let err = genesis.record(&path).unwrap_err();
        assert!(err.to_string().contains("member 1") && err.to_string().contains("HOST:PORT"), "{err}");
        // A device's length is 0 and it never ends: refused after the limit, not read whole.
        let err = NodeConfig::load(Path::new("/dev/zero")).unwrap_err();
        assert!(err.to_string().contains("limit"), "{err}");
    }
}
