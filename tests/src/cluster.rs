//! A harness for multi-process tests (tests/tests/cluster.rs, the [`crate::chaos`] runs): real
//! `keyhome run` processes on loopback, one temporary cluster directory per cluster, every process
//! killed (SIGKILL, by PID) when the [`Cluster`] is dropped, also when the caller panics.
//!
//! - The binary is the `keyhome` that ships, in the caller's profile, (re)built by
//!   `deploy/build.sh` (the shipped feature set, linked as it ships:
//!   `target/<host>/<profile>/keyhome`; a no-op when fresh); or, for showing that a checker
//!   catches a bug, one built with the `bug-injection` feature into `target/bug-injection/`
//!   ([`keyhome_binary_with_bugs`]).
//! - Ports come from outside the kernel's ephemeral range (no client socket can take a node's port
//!   while the node is down for a restart), from a per-process sequence, each checked free.
//! - Nothing sleeps a fixed time to let something happen: [`Cluster::wait_status`] and
//!   [`eventually`] poll with a generous deadline.

use std::future::Future;
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use keyhome::client::Client;
use keyhome::config::{ClientProfile, LockSettings, write_toml};
use keyhome::pki::Role;
use keyhome::setup;
use keyhome::status::Status;
use keyhome_epoch::{NodeId, Timing};

/// How long any "wait until" may take before the test fails: generous, for slow machines.
pub const PATIENCE: Duration = Duration::from_secs(30);
/// How often a condition is polled.
pub const POLL: Duration = Duration::from_millis(25);
/// Longest a single status call may take (a killed node's connection otherwise hangs until the
/// QUIC idle timeout).
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// Timing and lock settings of a test cluster.
#[derive(Clone, Debug)]
pub struct Options {
    pub nodes: u64,
    pub timing: Timing,
    pub locks: LockSettings,
}

impl Options {
    /// The default options with delegations of `lease` (at most, and as granted), for tests that
    /// need a delegation to outlast something.
    pub fn with_delegation_lease(lease: Duration) -> Options {
        let mut options = Options::default();
        options.timing.max_delegation_lease = lease;
        options.locks.delegation_lease_ms = u64::try_from(lease.as_millis()).unwrap_or(u64::MAX);
        options
    }
}

impl Default for Options {
    /// Three nodes, short leases: 500 ms home lease, 1 s delegations (so a fresh node's restart
    /// quarantine and an expiry both take about a second), idle delegations released after
    /// 400 ms (before an unrenewed one could expire and lose its note).
    fn default() -> Options {
        Options {
            nodes: 3,
            timing: Timing {
                home_lease: Duration::from_millis(500),
                max_delegation_lease: Duration::from_millis(1000),
                clock_rate_ppm: 10_000,
            },
            locks: LockSettings { delegation_lease_ms: 1000, idle_release_ms: 400, lock_delay_ms: 0 },
        }
    }
}

/// A cluster laid out in a temporary directory, with its node processes.
pub struct Cluster {
    pub options: Options,
    tmp: tempfile::TempDir,
    /// The cluster directory (`ca.pem`, `genesis.toml`, `node-<i>/`, `client-app/`, `operator/`).
    pub dir: PathBuf,
    /// The cluster's ports: node `i` at `base + i - 1`, in a relayed cluster its relay at
    /// `base + n + i - 1`; each held until its node starts (or its relay takes the socket).
    ports: PortBlock,
    /// Whether the genesis names relay addresses ([`Cluster::relay_addr`]) rather than the nodes'.
    relayed: bool,
    /// Whether the genesis and the profiles name the nodes `localhost:PORT` rather than
    /// `127.0.0.1:PORT` ([`Cluster::layout_named`]).
    named: bool,
    /// The `keyhome` binary the nodes run, and environment variables set for them.
    binary: PathBuf,
    env: Vec<(String, String)>,
    /// Node processes by id - 1; `None` while a node is down.
    children: Vec<Option<Child>>,
    /// Status connections by node id, reused across polls.
    clients: Mutex<Vec<Option<Client>>>,
}

impl Cluster {
    /// Lays out a cluster (CA, genesis, node certificates and `node.toml`s, an operator and an
    /// `app` client identity) without starting anything.
    pub fn layout(options: Options) -> Cluster {
        Cluster::lay_out(options, false, false)
    }

    /// Lays out a cluster whose genesis and profiles give every node by a DNS name,
    /// `localhost:PORT` ([`Cluster::member_addr`]), resolved when dialled.
    pub fn layout_named(options: Options) -> Cluster {
        Cluster::lay_out(options, false, true)
    }

    /// Lays out a cluster whose genesis tells peers to reach node `i` at [`Cluster::relay_addr`]
    /// (`i`) instead of [`Cluster::addr`]`(i)`, where the caller runs a relay; clients still reach
    /// the nodes directly.
    pub fn layout_relayed(options: Options) -> Cluster {
        Cluster::lay_out(options, true, false)
    }

    fn lay_out(options: Options, relayed: bool, named: bool) -> Cluster {
        let tmp = tempfile::Builder::new().prefix("keyhome-cluster-").tempdir().expect("temp dir");
        let dir = tmp.path().join("cluster");
        let n = options.nodes as u16;
        let ports = PortBlock::reserve(if relayed { 2 * n } else { n });
        let base_port = ports.base();
        let port = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
        let listen = |i: u64| port(base_port + (i - 1) as u16);
        let advertised = |i: u64| match (relayed, named) {
            (true, _) => port(base_port + n + (i - 1) as u16).to_string(),
            (false, true) => format!("localhost:{}", listen(i).port()),
            (false, false) => listen(i).to_string(),
        };
        setup::local_cluster(
            &dir,
            options.nodes,
            listen,
            advertised,
            relayed,
            options.timing,
            &options.locks,
        )
        .expect("lay the cluster out");
        Cluster {
            options,
            tmp,
            dir,
            ports,
            relayed,
            named,
            binary: keyhome_binary(),
            env: Vec::new(),
            children: (0..n).map(|_| None).collect(),
            clients: Mutex::new(vec![None; usize::from(n)]),
        }
    }

    /// Runs the nodes from `binary` with the extra environment `env` (for the nodes started
    /// after the call).
    pub fn set_binary(&mut self, binary: PathBuf, env: Vec<(String, String)>) {
        self.binary = binary;
        self.env = env;
    }

    /// Lays out a cluster and starts every node.
    pub fn start(options: Options) -> Cluster {
        let mut cluster = Cluster::layout(options);
        for id in cluster.ids() {
            cluster.start_node(id);
        }
        cluster
    }

    pub fn ids(&self) -> Vec<u64> {
        (1..=self.options.nodes).collect()
    }

    /// The address node `id` listens on.
    pub fn addr(&self, id: u64) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.ports.base() + (id - 1) as u16))
    }

    /// The address clients reach node `id` at, as its profiles give it: `localhost:PORT` in a
    /// [`Cluster::layout_named`] cluster, else [`Cluster::addr`].
    pub fn member_addr(&self, id: u64) -> String {
        if self.named { format!("localhost:{}", self.addr(id).port()) } else { self.addr(id).to_string() }
    }

    /// The base URL of node `id`'s HTTP API (TCP, the port number of its QUIC address).
    pub fn http_url(&self, id: u64) -> String {
        format!("http://{}", self.addr(id))
    }

    /// The file holding the HTTP API token of `role` (a client or the operator).
    pub fn http_token_file(&self, role: &Role) -> PathBuf {
        setup::identity_dir(&self.dir, role).join(keyhome::http::tokens::TOKEN_FILE)
    }

    /// The HTTP API token of `role`.
    pub fn http_token(&self, role: &Role) -> String {
        let path = self.http_token_file(role);
        std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
            .trim()
            .to_string()
    }

    /// Changes node `id`'s `node.toml` (before the node starts, to take effect).
    pub fn edit_config(&self, id: u64, edit: impl FnOnce(&mut keyhome::config::NodeConfig)) {
        let path = self.node_config(id);
        let mut config = keyhome::config::NodeConfig::load(&path).expect("load node.toml");
        edit(&mut config);
        write_toml(&path, &config).expect("write node.toml");
    }

    /// `GET path` on node `id`'s HTTP listener with `Accept: accept`, no token: the status code
    /// and the body.
    pub fn http_get(&self, id: u64, path: &str, accept: &str) -> (u16, String) {
        use std::io::{Read, Write};
        let mut conn = std::net::TcpStream::connect(self.addr(id)).expect("connect to the HTTP listener");
        conn.set_read_timeout(Some(PATIENCE)).expect("timeout");
        write!(
            conn,
            "GET {path} HTTP/1.1\r\nHost: localhost\r\nAccept: {accept}\r\nConnection: close\r\n\r\n"
        )
        .expect("send");
        let mut response = String::new();
        conn.read_to_string(&mut response).expect("read the response");
        let (head, body) = response.split_once("\r\n\r\n").expect("a header block");
        let code = head.split(' ').nth(1).and_then(|c| c.parse().ok()).expect("a status line");
        (code, body.to_string())
    }

    /// The address the genesis gives node `id`: where its peers reach it.
    pub fn relay_addr(&self, id: u64) -> SocketAddr {
        if !self.relayed {
            return self.addr(id);
        }
        SocketAddr::from(([127, 0, 0, 1], self.ports.base() + (self.options.nodes + id - 1) as u16))
    }

    /// Frees every port the cluster holds, for a process other than its nodes to bind (a
    /// `keyhome dev` run on the laid-out ports).
    pub fn release_ports(&self) {
        self.ports.release_all();
    }

    /// The UDP socket bound to [`Cluster::relay_addr`]`(id)`, for the relay in front of node `id`
    /// (once; panics in a cluster that is not [`Cluster::layout_relayed`]).
    pub fn take_relay_socket(&self, id: u64) -> UdpSocket {
        assert!(self.relayed, "a relay socket of a cluster with no relays");
        let i = (self.options.nodes + id - 1) as u16;
        self.ports.take_udp(i).unwrap_or_else(|| panic!("node {id}'s relay socket is taken"))
    }

    pub fn node_dir(&self, id: u64) -> PathBuf {
        setup::identity_dir(&self.dir, &Role::Node(NodeId(id)))
    }

    pub fn node_config(&self, id: u64) -> PathBuf {
        self.node_dir(id).join("node.toml")
    }

    fn log_path(&self, id: u64) -> PathBuf {
        self.node_dir(id).join("node.log")
    }

    /// Starts `keyhome run --config node-<id>/node.toml`, its output appended to `node.log`.
    pub fn start_node(&mut self, id: u64) {
        let slot = &self.children[(id - 1) as usize];
        assert!(slot.is_none(), "node {id} is already running");
        let log =
            std::fs::OpenOptions::new().create(true).append(true).open(self.log_path(id)).expect("node log");
        let mut command = Command::new(&self.binary);
        command
            .arg("run")
            .arg("--config")
            .arg(self.node_config(id))
            .env("RUST_LOG", std::env::var("KEYHOME_TEST_LOG").unwrap_or_else(|_| "info".into()))
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("node log"))
            .stderr(log);
        die_with_parent(&mut command);
        self.ports.release((id - 1) as u16);
        let child = command.spawn().expect("start keyhome run");
        self.children[(id - 1) as usize] = Some(child);
        self.forget_client(id);
    }

    /// `kill -9` of node `id`; returns once the process is gone.
    pub fn kill(&mut self, id: u64) {
        let mut child =
            self.children[(id - 1) as usize].take().unwrap_or_else(|| panic!("node {id} is not running"));
        let _ = child.kill();
        let _ = child.wait();
        self.forget_client(id);
    }

    /// SIGTERM to node `id` (a clean shutdown); returns once the process is gone.
    pub fn terminate(&mut self, id: u64) {
        let mut child =
            self.children[(id - 1) as usize].take().unwrap_or_else(|| panic!("node {id} is not running"));
        if let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let _ = child.wait();
        self.forget_client(id);
    }

    /// Sends `signal` to node `id`'s process (by its PID).
    fn signal(&self, id: u64, signal: rustix::process::Signal) {
        let child =
            self.children[(id - 1) as usize].as_ref().unwrap_or_else(|| panic!("node {id} is not running"));
        let pid = rustix::process::Pid::from_raw(child.id() as i32).expect("a child's PID is positive");
        rustix::process::kill_process(pid, signal).unwrap_or_else(|e| panic!("signal node {id}: {e}"));
    }

    /// `kill -STOP` of node `id`: it stops running (a long pause) until [`Cluster::resume`].
    pub fn pause(&self, id: u64) {
        self.signal(id, rustix::process::Signal::STOP);
    }

    /// `kill -CONT` of a paused node `id`.
    pub fn resume(&self, id: u64) {
        self.signal(id, rustix::process::Signal::CONT);
    }

    /// The nodes whose processes exited by themselves since the last call (they count as down
    /// from now on), with their exit status.
    pub fn exited(&mut self) -> Vec<(u64, std::process::ExitStatus)> {
        let mut gone = Vec::new();
        for (i, slot) in self.children.iter_mut().enumerate() {
            if let Some(child) = slot
                && let Ok(Some(status)) = child.try_wait()
            {
                gone.push((i as u64 + 1, status));
                *slot = None;
            }
        }
        gone
    }

    /// The last lines of node `id`'s log.
    pub fn log_tail(&self, id: u64) -> String {
        let text = std::fs::read_to_string(self.log_path(id)).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    }

    /// A profile of the `app` client identity (may lock, may not change the membership) for node
    /// `id`.
    pub fn client_profile(&self, id: u64) -> ClientProfile {
        self.profile(&Role::Client("app".into()), id)
    }

    /// A profile of the operator identity for node `id`.
    pub fn operator_profile(&self, id: u64) -> ClientProfile {
        self.profile(&Role::Operator, id)
    }

    fn profile(&self, role: &Role, id: u64) -> ClientProfile {
        let dir = setup::identity_dir(&self.dir, role);
        ClientProfile {
            node: id,
            addr: self.member_addr(id),
            ca: self.dir.join("ca.pem"),
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
            socket: None,
            node_uid: None,
        }
    }

    /// Node `id`'s local socket, as [`setup::local_cluster`] configures it (the test's uid acts
    /// as the client `app` on it).
    pub fn local_socket(&self, id: u64) -> PathBuf {
        self.node_dir(id).join(setup::LOCAL_SOCKET)
    }

    /// A new connection to node `id`'s local socket (retried until the node accepts it).
    pub async fn local_client(&self, id: u64) -> Client {
        let socket = self.local_socket(id);
        let mut last = None;
        let deadline = Instant::now() + PATIENCE;
        while Instant::now() < deadline {
            match Client::connect_local(&socket).await {
                Ok(client) => return client,
                Err(e) => last = Some(e.to_string()),
            }
            tokio::time::sleep(POLL).await;
        }
        panic!("cannot connect to node {id}'s local socket {}: {last:?}", socket.display());
    }

    /// Writes `profile` as `<identity dir>/node-<id>.toml` (relative paths, as `keyhome certs
    /// issue` writes them) for the CLI; returns the path.
    pub fn profile_file(&self, role: &Role, id: u64) -> PathBuf {
        let dir = setup::identity_dir(&self.dir, role);
        let profile = ClientProfile {
            node: id,
            addr: self.member_addr(id),
            ca: "../ca.pem".into(),
            cert: "cert.pem".into(),
            key: "key.pem".into(),
            socket: None,
            node_uid: None,
        };
        let path = dir.join(format!("node-{id}.toml"));
        write_toml(&path, &profile).expect("write profile");
        path
    }

    /// A new client connection to node `id` (retried until the node accepts it).
    pub async fn client(&self, id: u64) -> Client {
        self.connect(&self.client_profile(id)).await
    }

    /// A new operator connection to node `id`.
    pub async fn operator(&self, id: u64) -> Client {
        self.connect(&self.operator_profile(id)).await
    }

    async fn connect(&self, profile: &ClientProfile) -> Client {
        let mut last = None;
        let deadline = Instant::now() + PATIENCE;
        while Instant::now() < deadline {
            match tokio::time::timeout(CALL_TIMEOUT, Client::connect(profile)).await {
                Ok(Ok(client)) => return client,
                Ok(Err(e)) => last = Some(e.to_string()),
                Err(_) => last = Some("connect timed out".into()),
            }
            tokio::time::sleep(POLL).await;
        }
        panic!("cannot connect to node {} at {}: {last:?}", profile.node, profile.addr);
    }

    fn forget_client(&self, id: u64) {
        self.clients.lock().unwrap_or_else(|p| p.into_inner())[(id - 1) as usize] = None;
    }

    /// Node `id`'s status, or why it could not be read.
    pub async fn try_status(&self, id: u64) -> Result<Status, String> {
        let cached = self.clients.lock().unwrap_or_else(|p| p.into_inner())[(id - 1) as usize].clone();
        let client = match cached {
            Some(c) => c,
            None => {
                let c = tokio::time::timeout(CALL_TIMEOUT, Client::connect(&self.client_profile(id)))
                    .await
                    .map_err(|_| "connect timed out".to_string())?
                    .map_err(|e| e.to_string())?;
                self.clients.lock().unwrap_or_else(|p| p.into_inner())[(id - 1) as usize] = Some(c.clone());
                c
            }
        };
        match tokio::time::timeout(CALL_TIMEOUT, client.status()).await {
            Ok(Ok(status)) => Ok(status),
            failed => {
                self.forget_client(id);
                Err(match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => "status timed out".into(),
                })
            }
        }
    }

    /// Node `id`'s status; panics if it cannot be read.
    pub async fn status(&self, id: u64) -> Status {
        self.wait_status(id, "its status can be read", |_| true).await
    }

    /// Polls node `id`'s status until `pred` holds; panics after [`PATIENCE`] with the last
    /// status seen and the node's log.
    pub async fn wait_status(&self, id: u64, what: &str, pred: impl Fn(&Status) -> bool) -> Status {
        let deadline = Instant::now() + PATIENCE;
        let mut last = Err("never polled".to_string());
        while Instant::now() < deadline {
            last = self.try_status(id).await;
            if let Ok(status) = &last
                && pred(status)
            {
                return status.clone();
            }
            tokio::time::sleep(POLL).await;
        }
        panic!(
            "node {id}: not true within {PATIENCE:?}: {what}\nlast status: {last:#?}\nlog:\n{}",
            self.log_tail(id)
        );
    }

    /// Waits until each of `ids` is serving: the epoch `epoch`, every member of it connected, a
    /// home lease, and no restart quarantine left.
    pub async fn wait_ready(&self, ids: &[u64], epoch: u64) {
        for &id in ids {
            self.wait_status(id, &format!("serving epoch {epoch}"), |s| ready(s, epoch)).await;
        }
    }

    /// The built `keyhome` binary with `args`, to run in the cluster directory (it dies with the
    /// test).
    pub fn cli_command(&self, args: &[&str]) -> Command {
        let mut command = self.cli_spawned(args);
        die_with_parent(&mut command);
        command
    }

    /// [`Cluster::cli_command`] without the death signal: std then spawns it (`posix_spawn`)
    /// instead of forking the caller, as it starts any plain command (for timing a CLI beside
    /// another system's).
    pub fn cli_spawned(&self, args: &[&str]) -> Command {
        let mut command = Command::new(&self.binary);
        command.args(args).current_dir(&self.dir).stdin(Stdio::null());
        command
    }

    /// Runs the built `keyhome` binary with `args` in the cluster directory; returns its output.
    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        self.cli_command(args).output().expect("run keyhome")
    }

    /// The process id of node `id`, while it runs.
    pub fn pid(&self, id: u64) -> Option<u32> {
        self.children[(id - 1) as usize].as_ref().map(Child::id)
    }

    /// Starts the built `keyhome` binary with `args` in the cluster directory, its stdin a pipe
    /// (closing it ends a `cat` the command runs), its output discarded. Killed when dropped.
    pub fn cli_background(&self, args: &[&str]) -> Background {
        let mut command = Command::new(&self.binary);
        command.args(args).current_dir(&self.dir).stdin(Stdio::piped()).stdout(Stdio::null());
        die_with_parent(&mut command);
        Background(command.spawn().expect("start keyhome"))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for child in self.children.iter_mut().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            for id in self.ids() {
                eprintln!("---- node {id} log (last lines) ----\n{}", self.log_tail(id));
            }
            if std::env::var_os("KEYHOME_KEEP_TEST_DIRS").is_some() {
                let dir = std::mem::replace(&mut self.tmp, tempfile::tempdir().expect("temp dir"));
                eprintln!("kept {}", dir.keep().display());
            }
        }
    }
}

/// A `keyhome` process started by [`Cluster::cli_background`]; SIGKILLed when dropped unless it
/// was waited for.
pub struct Background(Child);

impl Background {
    /// Closes the process's stdin and waits for it to exit; returns its exit status.
    pub fn finish(mut self) -> std::process::ExitStatus {
        drop(self.0.stdin.take());
        self.0.wait().expect("wait for keyhome")
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Whether `s` shows a node serving epoch `epoch` with everyone connected.
pub fn ready(s: &Status, epoch: u64) -> bool {
    s.epoch == epoch
        && s.members.iter().all(|m| m.connected)
        && s.home_lease_left.is_some()
        && s.quarantine_left.is_zero()
}

/// Polls `f` until it returns `Some`; panics after `timeout` with `what`.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "not true within {timeout:?}: {what}");
        tokio::time::sleep(POLL).await;
    }
}

/// A key (`<prefix>-<n>`) whose home among `members` is `home`.
pub fn key_homed_on(prefix: &str, members: &[u64], home: u64) -> Vec<u8> {
    let ids: Vec<NodeId> = members.iter().map(|&m| NodeId(m)).collect();
    let ring = keyhome_ring::Ring::new(&ids);
    (0u64..)
        .map(|n| format!("{prefix}-{n}").into_bytes())
        .find(|key| ring.home(key) == Some(NodeId(home)))
        .expect("some key is homed on every member")
}

/// The home of `key` among `members`.
pub fn home_of(key: &[u8], members: &[u64]) -> u64 {
    let ids: Vec<NodeId> = members.iter().map(|&m| NodeId(m)).collect();
    keyhome_ring::home(key, &ids).expect("members").0
}

// ---- processes ----

/// A child started by a test dies with the test's thread, even if the test process is killed
/// before the [`Cluster`] guard can run (a CI timeout, say).
fn die_with_parent(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure only makes one async-signal-safe system call (prctl).
    unsafe {
        command.pre_exec(|| {
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
                .map_err(std::io::Error::from)
        });
    }
}

/// The `keyhome` binary of the profile the tests were built in, (re)built by `deploy/build.sh` as
/// it ships (its feature set, statically linked on glibc), and checked to be no test build.
pub fn keyhome_binary() -> PathBuf {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| locate_or_build(false)).clone()
}

/// A `keyhome` binary built with the `bug-injection` feature (the node then switches off the
/// rule its `KEYHOME_INJECT_BUG` variable names), in its own target directory,
/// `target/bug-injection/`, so the ordinary binary is never replaced by it.
pub fn keyhome_binary_with_bugs() -> PathBuf {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| locate_or_build(true)).clone()
}

fn locate_or_build(bugs: bool) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/cluster-<hash> (a test) or target/<profile>/keyhome-chaos (a binary)
    let exe_dir = exe.parent().expect("an executable in a directory");
    let profile_dir = if exe_dir.ends_with("deps") { exe_dir.parent().unwrap_or(exe_dir) } else { exe_dir };
    let profile = profile_dir.file_name().and_then(|n| n.to_str()).unwrap_or("debug");
    // The caller's target directory (for a `--target` build of the caller, target/<triple>, which
    // serves as well); the bug-injection build in a directory of its own below it.
    let mut target_dir = profile_dir.parent().unwrap_or(profile_dir).to_path_buf();
    if bugs {
        target_dir = target_dir.join("bug-injection");
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf();
    // Always through deploy/build.sh (a no-op when fresh): the binary a workspace test build
    // leaves behind has the simulation's `bug-injection` switches unified into it and is linked
    // like the tests, and these tests must run the binary that ships.
    let binary = {
        let mut command = Command::new(workspace.join("deploy/build.sh"));
        command.current_dir(&workspace).arg("--target-dir").arg(&target_dir);
        match profile {
            "debug" => {}
            "release" => {
                command.arg("--release");
            }
            other => {
                command.args(["--profile", other]);
            }
        }
        if bugs {
            command.args(["--features", "bug-injection"]);
        }
        // Not the variables cargo set for this test process: build scripts that watch them would
        // see a changed environment and rebuild (here, and again in the next ordinary build).
        for (name, _) in std::env::vars_os() {
            let name = name.to_string_lossy();
            if name.starts_with("CARGO_PKG_")
                || name.starts_with("CARGO_BIN_")
                || ["CARGO_MANIFEST_DIR", "CARGO_MANIFEST_PATH", "CARGO_CRATE_NAME", "CARGO_PRIMARY_PACKAGE"]
                    .contains(&&*name)
                || ["CARGO_TARGET_TMPDIR", "CARGO_RUSTC_CURRENT_DIR", "OUT_DIR"].contains(&&*name)
            {
                command.env_remove(&*name);
            }
        }
        let out = command.stderr(Stdio::inherit()).output().expect("run deploy/build.sh");
        assert!(out.status.success(), "deploy/build.sh failed: {}", out.status);
        PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
    };
    assert!(binary.exists(), "no keyhome binary at {}", binary.display());
    let version = Command::new(&binary).arg("--version").output().expect("keyhome --version");
    let version = String::from_utf8_lossy(&version.stdout);
    let test_build = version.contains("TEST BUILD");
    assert!(
        test_build == bugs,
        "wanted a {} build, found {version}",
        if bugs { "bug-injection" } else { "shipped" }
    );
    binary
}

// ---- ports ----

/// `n` consecutive ports on 127.0.0.1 for UDP (the nodes' QUIC, the relays) and TCP (the nodes'
/// HTTP API, same number), outside the ephemeral range, never handed out twice by this process,
/// and *held* (bound) until [`PortBlock::release`] or [`PortBlock::take_udp`], so nothing else
/// can take one between the choice and the process that binds it.
pub struct PortBlock {
    base: u16,
    held: Mutex<Vec<Option<(UdpSocket, TcpListener)>>>,
}

impl PortBlock {
    pub fn reserve(n: u16) -> PortBlock {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let (lo, hi) = port_region();
        let span = u32::from(hi - lo);
        let stride = u32::from(n) + 1;
        // Start somewhere that depends on the process, so concurrent test processes rarely overlap.
        let start = (std::process::id().wrapping_mul(2_654_435_761) % span) / stride * stride;
        for _ in 0..(span / stride) {
            let offset = (start + NEXT.fetch_add(stride, Ordering::Relaxed)) % (span - stride);
            let base = lo + offset as u16;
            let held: Option<Vec<_>> = (0..n)
                .map(|i| {
                    let udp = UdpSocket::bind(("127.0.0.1", base + i)).ok()?;
                    let tcp = TcpListener::bind(("127.0.0.1", base + i)).ok()?;
                    Some(Some((udp, tcp)))
                })
                .collect();
            if let Some(held) = held {
                return PortBlock { base, held: Mutex::new(held) };
            }
        }
        panic!("no {n} consecutive free UDP and TCP ports in {lo}..{hi}");
    }

    /// The block's first port.
    pub fn base(&self) -> u16 {
        self.base
    }

    /// Frees port `base + i` for the process about to bind it (a no-op if it is free already).
    pub fn release(&self, i: u16) {
        self.held()[usize::from(i)] = None;
    }

    /// Frees every port of the block.
    pub fn release_all(&self) {
        self.held().fill_with(|| None);
    }

    /// Hands over the UDP socket bound to port `base + i` (frees its TCP port), for a relay
    /// in this process; `None` if it was released or taken already.
    pub fn take_udp(&self, i: u16) -> Option<UdpSocket> {
        self.held()[usize::from(i)].take().map(|(udp, _)| udp)
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Vec<Option<(UdpSocket, TcpListener)>>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Ports to draw from: below the kernel's ephemeral range if there is room, else above it.
fn port_region() -> (u16, u16) {
    let (eph_lo, eph_hi) = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| {
            let mut it = s.split_whitespace().map(|p| p.parse::<u16>().ok());
            Some((it.next()??, it.next()??))
        })
        .unwrap_or((32768, 60999));
    if eph_lo >= 12_000 {
        (10_000, eph_lo)
    } else if eph_hi <= 63_000 {
        (eph_hi + 1, 65_535)
    } else {
        (10_000, 65_535)
    }
}
