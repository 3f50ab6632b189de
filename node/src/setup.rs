//! Setting a cluster up on disk: the CA, the genesis, certificates and configuration files, as
//! `keyhome init`, `keyhome certs issue` and `keyhome dev` write them.
//!
//! A cluster directory holds `ca.pem` and `ca.key` (keep the key offline in production),
//! `genesis.toml`, and one sub-directory per identity issued from it (`node-<id>/`, `operator/`,
//! `client-<name>/`), each with `cert.pem` and `key.pem` (mode 0600) and, for nodes, `node.toml`;
//! for operators and clients, `profile.toml`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use keyhome_epoch::{NodeId, Timing};

use crate::config::{ClientProfile, ConfigError, GenesisFile, LockSettings, NodeConfig, write_toml};
use crate::pki::{self, CaKeyPair, PkiError, Role};

/// Why a set-up step failed.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error(transparent)]
    Pki(#[from] PkiError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot write {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{0} already exists; refusing to overwrite it")]
    Exists(PathBuf),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> SetupError + '_ {
    move |source| SetupError::Io { path: path.to_path_buf(), source }
}

fn write_file(path: &Path, contents: &str, secret: bool) -> Result<(), SetupError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true).mode(if secret { 0o600 } else { 0o644 });
    let mut file = options.open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::AlreadyExists => SetupError::Exists(path.to_path_buf()),
        _ => SetupError::Io { path: path.to_path_buf(), source: e },
    })?;
    file.write_all(contents.as_bytes()).map_err(io_err(path))
}

/// The directory an identity's files go to.
pub fn identity_dir(cluster: &Path, role: &Role) -> PathBuf {
    cluster.join(match role {
        Role::Node(id) => format!("node-{}", id.0),
        Role::Operator => "operator".to_string(),
        Role::Client(name) => format!("client-{name}"),
    })
}

/// Creates a cluster directory: a new CA and the genesis naming `members`.
pub fn init(cluster: &Path, members: &[(NodeId, String)], timing: Timing) -> Result<(), SetupError> {
    std::fs::create_dir_all(cluster).map_err(io_err(cluster))?;
    let genesis = GenesisFile::new(members, timing);
    let genesis_path = cluster.join("genesis.toml");
    genesis.record(&genesis_path)?;
    if genesis_path.exists() {
        return Err(SetupError::Exists(genesis_path));
    }
    let ca = pki::generate_ca("keyhome cluster CA")?;
    write_file(&cluster.join("ca.pem"), &ca.cert_pem(), false)?;
    write_file(&cluster.join("ca.key"), &ca.key_pem(), true)?;
    write_toml(&genesis_path, &genesis)?;
    Ok(())
}

/// Loads the cluster's CA (certificate and key).
pub fn load_ca(cluster: &Path) -> Result<CaKeyPair, SetupError> {
    let read = |name: &str| {
        let path = cluster.join(name);
        std::fs::read_to_string(&path).map_err(|source| SetupError::Io { path, source })
    };
    Ok(CaKeyPair::from_pem(&read("ca.pem")?, &read("ca.key")?)?)
}

/// Issues a certificate for `role` into its identity directory; returns the directory.
pub fn issue(cluster: &Path, ca: &CaKeyPair, role: &Role) -> Result<PathBuf, SetupError> {
    let issued = pki::issue(ca, role)?;
    let dir = identity_dir(cluster, role);
    std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
    write_file(&dir.join("cert.pem"), &issued.cert_pem, false)?;
    write_file(&dir.join("key.pem"), &issued.key_pem, true)?;
    Ok(dir)
}

/// Writes `node.toml` for node `id` listening on `listen`, next to its certificate; with
/// `behind_relay`, peers reach it at another address (see [`NodeConfig::behind_relay`]).
pub fn write_node_config(
    cluster: &Path,
    id: NodeId,
    listen: SocketAddr,
    behind_relay: bool,
    locks: LockSettings,
) -> Result<PathBuf, SetupError> {
    let dir = identity_dir(cluster, &Role::Node(id));
    let config = NodeConfig {
        id: id.0,
        listen,
        client_listen: None,
        behind_relay,
        data_dir: "data".into(),
        ca: "../ca.pem".into(),
        cert: "cert.pem".into(),
        key: "key.pem".into(),
        genesis: "../genesis.toml".into(),
        locks,
        limits: Default::default(),
    };
    let path = dir.join("node.toml");
    write_toml(&path, &config)?;
    Ok(path)
}

/// Writes `profile.toml` for an operator or client identity, pointing at node `node`.
pub fn write_profile(
    cluster: &Path,
    role: &Role,
    node: NodeId,
    addr: SocketAddr,
) -> Result<PathBuf, SetupError> {
    let dir = identity_dir(cluster, role);
    let profile = ClientProfile {
        node: node.0,
        addr,
        ca: "../ca.pem".into(),
        cert: "cert.pem".into(),
        key: "key.pem".into(),
    };
    let path = dir.join("profile.toml");
    write_toml(&path, &profile)?;
    Ok(path)
}

/// Lays out a complete local cluster of `nodes` nodes on 127.0.0.1 from `base_port`: CA, genesis,
/// node certificates and configurations, an operator and a client (`app`) identity with profiles
/// pointing at node 1. Returns the node configuration paths.
pub fn dev_cluster(
    cluster: &Path,
    nodes: u64,
    base_port: u16,
    timing: Timing,
    locks: &LockSettings,
) -> Result<Vec<PathBuf>, SetupError> {
    let addr = |i: u64| SocketAddr::from(([127, 0, 0, 1], base_port.saturating_add((i - 1) as u16)));
    local_cluster(cluster, nodes, addr, addr, timing, locks)
}

/// Like [`dev_cluster`], with node `i` listening on `listen(i)` while the genesis tells its peers
/// to reach it at `advertised(i)` (a relay in front of it, say). Clients' profiles point at node
/// 1's `listen` address.
pub fn local_cluster(
    cluster: &Path,
    nodes: u64,
    listen: impl Fn(u64) -> SocketAddr,
    advertised: impl Fn(u64) -> SocketAddr,
    timing: Timing,
    locks: &LockSettings,
) -> Result<Vec<PathBuf>, SetupError> {
    let members: Vec<(NodeId, String)> =
        (1..=nodes).map(|i| (NodeId(i), advertised(i).to_string())).collect();
    init(cluster, &members, timing)?;
    let ca = load_ca(cluster)?;
    let mut configs = Vec::new();
    for i in 1..=nodes {
        issue(cluster, &ca, &Role::Node(NodeId(i)))?;
        let relayed = listen(i) != advertised(i);
        configs.push(write_node_config(cluster, NodeId(i), listen(i), relayed, locks.clone())?);
    }
    for role in [Role::Operator, Role::Client("app".into())] {
        issue(cluster, &ca, &role)?;
        write_profile(cluster, &role, NodeId(1), listen(1))?;
    }
    Ok(configs)
}
