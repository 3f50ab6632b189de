//! The files a node and its clients read: the node's TOML configuration, the cluster's genesis,
//! and a client profile. Every relative path in a file is relative to the file's directory.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

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
    let len = std::fs::metadata(path).map_err(read_err)?.len();
    if len > MAX_FILE {
        return Err(ConfigError::Invalid {
            path: path.to_path_buf(),
            message: format!("{len} bytes is larger than the {MAX_FILE}-byte limit"),
        });
    }
    let text = std::fs::read_to_string(path).map_err(read_err)?;
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
    /// The genesis file, read only when the node starts for the first time.
    pub genesis: PathBuf,
    /// Local lock settings.
    #[serde(default)]
    pub locks: LockSettings,
    /// Caps against hostile load (docs/operations.md, "Limits and hostile load").
    #[serde(default, skip_serializing_if = "crate::admission::Limits::is_default")]
    pub limits: crate::admission::Limits,
}

/// Tuning of the delegation layer on one node; all durations in milliseconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LockSettings {
    /// Delegation lease asked for (capped by the epoch's `max_delegation_lease`) [10 000].
    pub delegation_lease_ms: u64,
    /// An unused delegation is released after this long [2 000].
    pub idle_release_ms: u64,
    /// After an unclean expiry, a key this node homes is kept from everyone this long [0: off].
    pub lock_delay_ms: u64,
}

impl Default for LockSettings {
    fn default() -> LockSettings {
        LockSettings { delegation_lease_ms: 10_000, idle_release_ms: 2_000, lock_delay_ms: 0 }
    }
}

impl NodeConfig {
    /// Reads `path` and resolves its relative paths against the file's directory.
    pub fn load(path: &Path) -> Result<NodeConfig, ConfigError> {
        let mut config: NodeConfig = read_toml(path)?;
        let base = dir_of(path);
        for p in
            [&mut config.data_dir, &mut config.ca, &mut config.cert, &mut config.key, &mut config.genesis]
        {
            *p = resolve(&base, p);
        }
        config
            .limits
            .check()
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

/// Checks that `addr` reads as a member address: `HOST:PORT`, the host an IP address (IPv6 in
/// brackets) or a DNS name, the port from 1 to 65535. Says what is wrong otherwise.
pub fn check_member_addr(addr: &str) -> Result<(), String> {
    let port_ok = |port: u16| {
        if port == 0 { Err(format!("{addr:?}: port 0 is not a port to listen on")) } else { Ok(()) }
    };
    if let Ok(sock) = addr.parse::<SocketAddr>() {
        return port_ok(sock.port());
    }
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err(format!("{addr:?} is not HOST:PORT"));
    };
    let port: u16 = port.parse().map_err(|_| format!("{addr:?}: {port:?} is not a port number"))?;
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if host.is_empty() || host.len() > 253 || !host.trim_end_matches('.').split('.').all(label_ok) {
        return Err(format!("{addr:?}: {host:?} is neither an IP address nor a host name"));
    }
    port_ok(port)
}

/// The cluster's first epoch, as `keyhome init` writes it. Durations in milliseconds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenesisFile {
    pub home_lease_ms: u64,
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

    /// The genesis epoch record, validated.
    pub fn record(&self, path: &Path) -> Result<EpochRecord, ConfigError> {
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

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// What a client needs to reach a node: `keyhome dev` and `keyhome certs issue --client` write
/// one (`client.toml`); the CLI finds it with `--profile` or `KEYHOME_PROFILE`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientProfile {
    /// The node to talk to: its id (checked against its certificate) and address.
    pub node: u64,
    pub addr: SocketAddr,
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl ClientProfile {
    pub fn load(path: &Path) -> Result<ClientProfile, ConfigError> {
        let mut profile: ClientProfile = read_toml(path)?;
        let base = dir_of(path);
        for p in [&mut profile.ca, &mut profile.cert, &mut profile.key] {
            *p = resolve(&base, p);
        }
        Ok(profile)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_addresses_are_host_and_port() {
        for ok in ["127.0.0.1:7100", "[::1]:7100", "node-4.example:7100", "localhost:1"] {
            assert_eq!(check_member_addr(ok), Ok(()), "{ok}");
        }
        for bad in ["notanaddress", "127.0.0.1", "10.0.0.1:0", "host:99999", ":7100", "::1", "a b:1", "-x:1"]
        {
            assert!(check_member_addr(bad).is_err(), "{bad} accepted");
        }
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
}
