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

use crate::config::{
    ClientProfile, ConfigError, GenesisFile, HttpConfig, LocalAllow, LocalRole, LocalSettings, LockSettings,
    NodeConfig,
};
use crate::http::tokens;
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
    #[error(transparent)]
    Tokens(#[from] tokens::TokensError),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> SetupError + '_ {
    move |source| SetupError::Io { path: path.to_path_buf(), source }
}

/// Files written together, all or none: [`Files::commit`] writes each to a temporary file beside
/// its path and only then renames them all into place, so a failure part-way (a full disk, a
/// file that exists) leaves no file half-written and, before the renames, none written at all.
#[derive(Default)]
pub struct Files {
    files: Vec<Staged>,
}

/// One file of [`Files`].
struct Staged {
    path: PathBuf,
    contents: String,
    /// Mode 0600, else 0644.
    secret: bool,
    /// Replaced whatever `commit` is told (a file that accumulates, like the tokens file).
    replace: bool,
}

impl Files {
    pub fn new() -> Files {
        Files::default()
    }

    /// Adds a file; a secret one gets mode 0600.
    pub fn add(&mut self, path: PathBuf, contents: String, secret: bool) {
        self.stage(Staged { path, contents, secret, replace: false });
    }

    /// Adds a file that replaces the one at `path`, if any, even when `commit` may not overwrite.
    pub fn replace(&mut self, path: PathBuf, contents: String) {
        self.stage(Staged { path, contents, secret: false, replace: true });
    }

    /// The contents staged for `path`, if any.
    pub fn contents(&self, path: &Path) -> Option<&str> {
        self.files.iter().find(|f| f.path == path).map(|f| f.contents.as_str())
    }

    /// Stages `file`, in place of what was staged for its path before.
    fn stage(&mut self, file: Staged) {
        match self.files.iter_mut().find(|f| f.path == file.path) {
            Some(staged) => *staged = file,
            None => self.files.push(file),
        }
    }

    /// Adds `value` as a TOML file.
    pub fn add_toml<T: serde::Serialize>(&mut self, path: PathBuf, value: &T) -> Result<(), SetupError> {
        let text = toml_text(&path, value)?;
        self.add(path, text, false);
        Ok(())
    }

    /// The paths, in the order they were added.
    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(|f| f.path.as_path())
    }

    /// Writes every file. Refuses with [`SetupError::Exists`], before writing anything, if one
    /// exists already and `overwrite` is false.
    pub fn commit(self, overwrite: bool) -> Result<(), SetupError> {
        if !overwrite && let Some(f) = self.files.iter().find(|f| !f.replace && f.path.exists()) {
            return Err(SetupError::Exists(f.path.clone()));
        }
        let mut written: Vec<(PathBuf, &Path)> = Vec::new();
        let result = (|| {
            for Staged { path, contents, secret, .. } in &self.files {
                if let Some(dir) = path.parent() {
                    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
                }
                let tmp = temporary(path);
                write_new(&tmp, contents, *secret)?;
                written.push((tmp, path));
            }
            for (tmp, path) in &written {
                std::fs::rename(tmp, path).map_err(io_err(path))?;
            }
            Ok(())
        })();
        if result.is_err() {
            for (tmp, _) in &written {
                let _ = std::fs::remove_file(tmp);
            }
        }
        result
    }
}

/// The temporary file [`Files::commit`] writes `path`'s contents to first: hidden, beside it.
fn temporary(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!(".{name}.{}.tmp", std::process::id()))
}

fn write_new(path: &Path, contents: &str, secret: bool) -> Result<(), SetupError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::remove_file(path);
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true).mode(if secret { 0o600 } else { 0o644 });
    let mut file = options.open(path).map_err(io_err(path))?;
    file.write_all(contents.as_bytes()).and_then(|()| file.sync_all()).map_err(io_err(path))
}

fn toml_text<T: serde::Serialize>(path: &Path, value: &T) -> Result<String, SetupError> {
    toml::to_string(value).map_err(|e| {
        SetupError::Config(ConfigError::Invalid {
            path: path.to_path_buf(),
            message: format!("cannot encode: {e}"),
        })
    })
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
    let genesis = GenesisFile::new(members, timing);
    let genesis_path = cluster.join("genesis.toml");
    genesis.record(&genesis_path)?;
    let ca = pki::generate_ca("keyhome cluster CA")?;
    let mut files = Files::new();
    files.add(cluster.join("ca.pem"), ca.cert_pem(), false);
    files.add(cluster.join("ca.key"), ca.key_pem(), true);
    files.add_toml(genesis_path, &genesis)?;
    files.commit(false)
}

/// Loads the cluster's CA (certificate and key).
pub fn load_ca(cluster: &Path) -> Result<CaKeyPair, SetupError> {
    let read = |name: &str| crate::pki::read_pem_file(&cluster.join(name));
    Ok(CaKeyPair::from_pem(&read("ca.pem")?, &read("ca.key")?)?)
}

/// An exclusive hold on a cluster directory's shared files, from reading what a change rewrites
/// (the tokens file) until the change is committed: a `flock` on `.keyhome.lock` in the directory,
/// waited for, released when dropped. Two `keyhome certs issue` runs at once would otherwise each
/// rewrite the tokens file from the same contents, and one token's hash would be lost.
pub struct ClusterLock {
    _file: std::fs::File,
}

impl ClusterLock {
    /// The lock file's name in a cluster directory.
    pub const FILE: &str = ".keyhome.lock";

    /// Waits for, and takes, the lock of the cluster directory `cluster` (which must exist).
    pub fn acquire(cluster: &Path) -> Result<ClusterLock, SetupError> {
        let path = cluster.join(ClusterLock::FILE);
        let file = crate::lockfile::open(&path).map_err(io_err(&path))?;
        rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive)
            .map_err(|e| SetupError::Io { path, source: e.into() })?;
        Ok(ClusterLock { _file: file })
    }
}

/// Adds a new certificate for `role` and its key to `files`, in the role's identity directory;
/// returns the directory. An operator or client also gets an HTTP API token (`http-token`, its
/// hash in the cluster's tokens file, which `files` then replaces: see [`crate::http::tokens`]);
/// `_held` is the cluster's lock, to be kept until `files` is committed.
pub fn stage_identity(
    files: &mut Files,
    _held: &ClusterLock,
    cluster: &Path,
    ca: &CaKeyPair,
    role: &Role,
) -> Result<PathBuf, SetupError> {
    let issued = pki::issue(ca, role)?;
    let dir = identity_dir(cluster, role);
    files.add(dir.join("cert.pem"), issued.cert_pem, false);
    files.add(dir.join("key.pem"), issued.key_pem, true);
    if !matches!(role, Role::Node(_)) {
        let path = cluster.join(tokens::TOKENS_FILE);
        let drawn = tokens::draw(&path, files.contents(&path), role)?;
        files.add(dir.join(tokens::TOKEN_FILE), format!("{}\n", drawn.token), true);
        files.replace(path, drawn.file);
    }
    Ok(dir)
}

/// Issues a certificate for `role` into its identity directory, refusing to overwrite one;
/// returns the directory.
pub fn issue(cluster: &Path, ca: &CaKeyPair, role: &Role) -> Result<PathBuf, SetupError> {
    let held = ClusterLock::acquire(cluster)?;
    let mut files = Files::new();
    let dir = stage_identity(&mut files, &held, cluster, ca, role)?;
    files.commit(false)?;
    Ok(dir)
}

/// How a node shares its host, for [`stage_node_config`].
#[derive(Clone, Debug, Default)]
pub struct HostSettings {
    /// The local client socket, if any ([`NodeConfig::local`]).
    pub local: Option<LocalSettings>,
    /// [`NodeConfig::worker_threads`].
    pub worker_threads: usize,
}

/// Adds `node.toml` for node `id` listening on `listen`, next to its certificate; with
/// `behind_relay`, peers reach it at another address (see [`NodeConfig::behind_relay`]). The HTTP
/// API is on, on loopback TCP with `listen`'s port number, taking the cluster's tokens. Returns its
/// path.
pub fn stage_node_config(
    files: &mut Files,
    cluster: &Path,
    id: NodeId,
    listen: SocketAddr,
    behind_relay: bool,
    locks: LockSettings,
    host: HostSettings,
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
        http: Some(HttpConfig::local(loopback(listen.port()))),
        local: host.local,
        worker_threads: host.worker_threads,
        busy_poll_us: 0,
        shards: 0,
        limits: Default::default(),
    };
    let path = dir.join("node.toml");
    files.add_toml(path.clone(), &config)?;
    Ok(path)
}

/// `port` on 127.0.0.1.
fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, port))
}

/// Adds `profile.toml` for an operator or client identity, pointing at node `node` at `addr`
/// (`HOST:PORT`, a name or an IP address). Returns its path.
pub fn stage_profile(
    files: &mut Files,
    cluster: &Path,
    role: &Role,
    node: NodeId,
    addr: &str,
    socket: Option<&Path>,
) -> Result<PathBuf, SetupError> {
    let dir = identity_dir(cluster, role);
    let profile = ClientProfile {
        node: node.0,
        addr: addr.to_string(),
        ca: "../ca.pem".into(),
        cert: "cert.pem".into(),
        key: "key.pem".into(),
        socket: socket.map(|s| Path::new("..").join(s)),
        node_uid: None,
    };
    let path = dir.join("profile.toml");
    files.add_toml(path.clone(), &profile)?;
    Ok(path)
}

/// The address the genesis of `cluster` gives node `id`.
pub fn genesis_addr(cluster: &Path, id: NodeId) -> Result<String, SetupError> {
    let path = cluster.join("genesis.toml");
    let genesis = GenesisFile::load(&path)?;
    genesis.members.iter().find(|m| m.id == id.0).map(|m| m.addr.clone()).ok_or_else(|| {
        let ids: Vec<String> = genesis.members.iter().map(|m| m.id.to_string()).collect();
        SetupError::Config(ConfigError::Invalid {
            path,
            message: format!(
                "names no node {id} (its members are {}): give the node's address with --addr HOST:PORT",
                ids.join(", ")
            ),
        })
    })
}

/// Lays out a complete local cluster of `nodes` nodes on 127.0.0.1 from `base_port`: CA, genesis,
/// node certificates and configurations, an operator and a client (`app`) identity with profiles
/// pointing at node 1. Returns the node configuration paths. The ports must fit below 65536.
///
/// The nodes share this host: each gets [`LOCAL_SOCKET`] in its directory, which this user's
/// processes reach as the client `app` (the `app` profile names node 1's), and an equal share of
/// the cores as worker threads ([`shared_host_workers`]).
pub fn dev_cluster(
    cluster: &Path,
    nodes: u64,
    base_port: u16,
    timing: Timing,
    locks: &LockSettings,
) -> Result<Vec<PathBuf>, SetupError> {
    let addr = |i: u64| SocketAddr::from(([127, 0, 0, 1], base_port.saturating_add((i - 1) as u16)));
    local_cluster(cluster, nodes, addr, |i| addr(i).to_string(), false, timing, locks)
}

/// A one-node [`dev_cluster`] in `cluster`, on the first 127.0.0.1 port from 20 000 that is free
/// now, without the HTTP API: the node is its keys' own home, for a program (or a test, or a
/// bench) that embeds it. Returns its configuration, loaded.
pub fn embedded_dev_node(cluster: &Path, timing: Timing) -> Result<NodeConfig, SetupError> {
    let free = |port: &u16| std::net::UdpSocket::bind(("127.0.0.1", *port)).is_ok();
    let port = (20_000..60_000).step_by(97).find(free).ok_or_else(|| SetupError::Io {
        path: cluster.to_path_buf(),
        source: std::io::Error::new(std::io::ErrorKind::AddrInUse, "no free port on 127.0.0.1"),
    })?;
    let configs = dev_cluster(cluster, 1, port, timing, &LockSettings::default())?;
    let mut config = NodeConfig::load(&configs[0])?;
    config.http = None;
    Ok(config)
}

/// Like [`dev_cluster`], with node `i` listening on `listen(i)` while the genesis tells its peers
/// to reach it at `advertised(i)` (a name for the same socket, or with `relayed`, a relay in
/// front of it). Clients' profiles point at node 1's advertised address, or with `relayed`, at its
/// `listen` address.
pub fn local_cluster(
    cluster: &Path,
    nodes: u64,
    listen: impl Fn(u64) -> SocketAddr,
    advertised: impl Fn(u64) -> String,
    relayed: bool,
    timing: Timing,
    locks: &LockSettings,
) -> Result<Vec<PathBuf>, SetupError> {
    let members: Vec<(NodeId, String)> = (1..=nodes).map(|i| (NodeId(i), advertised(i))).collect();
    init(cluster, &members, timing)?;
    let ca = load_ca(cluster)?;
    let held = ClusterLock::acquire(cluster)?;
    let mut files = Files::new();
    let mut configs = Vec::new();
    let app = LocalAllow {
        uid: Some(rustix::process::getuid().as_raw()),
        gid: None,
        role: LocalRole::Client,
        name: Some("app".into()),
    };
    for i in 1..=nodes {
        stage_identity(&mut files, &held, cluster, &ca, &Role::Node(NodeId(i)))?;
        let host = HostSettings {
            local: Some(LocalSettings::new(LOCAL_SOCKET.into(), vec![app.clone()])),
            worker_threads: shared_host_workers(nodes),
        };
        configs.push(stage_node_config(
            &mut files,
            cluster,
            NodeId(i),
            listen(i),
            relayed,
            locks.clone(),
            host,
        )?);
    }
    let client_addr = if relayed { listen(1).to_string() } else { advertised(1) };
    let node_1_socket = identity_dir(Path::new(""), &Role::Node(NodeId(1))).join(LOCAL_SOCKET);
    stage_identity(&mut files, &held, cluster, &ca, &Role::Operator)?;
    stage_profile(&mut files, cluster, &Role::Operator, NodeId(1), &client_addr, None)?;
    let app = Role::Client("app".into());
    stage_identity(&mut files, &held, cluster, &ca, &app)?;
    stage_profile(&mut files, cluster, &app, NodeId(1), &client_addr, Some(&node_1_socket))?;
    files.commit(false)?;
    Ok(configs)
}

/// The local socket's file name in a node's directory, as [`local_cluster`] lays it out.
pub const LOCAL_SOCKET: &str = "node.sock";

/// Worker threads for each of `nodes` nodes sharing this host: an equal share of its cores, at
/// least one.
pub fn shared_host_workers(nodes: u64) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    (cores / usize::try_from(nodes.max(1)).unwrap_or(usize::MAX)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// While one `certs issue` holds the cluster's lock, another waits for it rather than read
    /// the tokens file the first is about to rewrite: both tokens' hashes end up in the file.
    #[test]
    fn a_second_issue_waits_for_the_first_and_both_tokens_stay() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cluster = dir.path().to_path_buf();
        init(&cluster, &[(NodeId(1), "127.0.0.1:7000".into())], Timing::DEFAULT).expect("init");
        let ca = load_ca(&cluster).expect("ca");

        let first = ClusterLock::acquire(&cluster).expect("lock");
        let second = std::thread::spawn({
            let (cluster, ca) = (cluster.clone(), load_ca(&cluster).expect("ca"));
            move || issue(&cluster, &ca, &Role::Client("b".into())).map(|_| ())
        });
        // The second run is seen waiting on the lock file (a blocked entry in /proc/locks).
        let inode = std::os::unix::fs::MetadataExt::ino(
            &std::fs::metadata(cluster.join(ClusterLock::FILE)).expect("the lock file"),
        );
        let waiting = format!(":{inode} ");
        let patience = std::time::Instant::now();
        while !std::fs::read_to_string("/proc/locks")
            .expect("/proc/locks")
            .lines()
            .any(|l| l.contains("->") && l.contains(&waiting))
        {
            assert!(!second.is_finished(), "the second issue did not wait for the lock");
            assert!(patience.elapsed() < std::time::Duration::from_secs(60), "the second issue never waited");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let mut files = Files::new();
        stage_identity(&mut files, &first, &cluster, &ca, &Role::Client("a".into())).expect("stage");
        files.commit(false).expect("commit");
        drop(first);
        second.join().expect("the second issue").expect("issued");

        let text = std::fs::read_to_string(cluster.join(tokens::TOKENS_FILE)).expect("tokens file");
        for name in ["a", "b"] {
            let identity = Role::Client(name.into()).dns_name();
            assert!(text.contains(&identity), "{identity} lost: {text}");
        }
    }
}
