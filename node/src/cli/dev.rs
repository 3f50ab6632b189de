//! `keyhome dev`: a local cluster of `keyhome run` processes on loopback, kept running until
//! Ctrl-C. A node that exits (crashed, or killed to try a failover) is started again after
//! `--restart-after`, unless `--no-restart`; the other nodes keep running either way. The nodes
//! die with `keyhome dev`, however it ends.
//!
//! The nodes share this host: each has a local socket (`node-N/node.sock`, this user as the
//! client `app`) and an equal share of the cores as worker threads
//! ([`keyhome::setup::local_cluster`]).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use keyhome::client::Client;
use keyhome::config::{ClientProfile, LockSettings, NodeConfig};
use keyhome::duration::Human;
use keyhome::pki::Role;
use keyhome::setup;
use keyhome_epoch::NodeId;
use tokio::time::Instant;

/// How often the node processes are checked.
const POLL: Duration = Duration::from_millis(200);
/// How long the cluster may take to lock for the first time.
const READY_WITHIN: Duration = Duration::from_secs(30);
/// How long each node may take to stop after SIGTERM before it is killed.
const STOP_WITHIN: Duration = Duration::from_secs(5);

#[derive(Args)]
pub struct DevArgs {
    /// Number of nodes.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=64))]
    nodes: u64,
    /// Cluster directory; reused if it exists (delete it for a fresh cluster).
    #[arg(long, default_value = "keyhome-dev")]
    dir: PathBuf,
    /// UDP port of node 1; node i listens on port + i - 1.
    #[arg(long, default_value_t = 7101)]
    port: u16,
    /// How long after a node exits it is started again.
    #[arg(long, default_value = "5s", value_parser = keyhome::duration::parse)]
    restart_after: Duration,
    /// Leave a node that exits down (to try `keyhome epoch propose --remove`, say).
    #[arg(long)]
    no_restart: bool,
    #[command(flatten)]
    timing: crate::TimingArgs,
}

pub async fn run(args: DevArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let last_port = u64::from(args.port) + args.nodes - 1;
    if args.port == 0 || last_port > u64::from(u16::MAX) {
        return Err(format!(
            "--port {} with {} nodes needs UDP ports {}..{last_port}, past 65535: give a --port from 1 to {}",
            args.port,
            args.nodes,
            args.port,
            u64::from(u16::MAX) + 1 - args.nodes
        )
        .into());
    }
    let fresh = !args.dir.join("genesis.toml").exists();
    let configs: Vec<PathBuf> = if fresh {
        setup::dev_cluster(&args.dir, args.nodes, args.port, args.timing.timing(), &LockSettings::default())?
    } else {
        (1..=args.nodes)
            .map(|i| setup::identity_dir(&args.dir, &Role::Node(NodeId(i))).join("node.toml"))
            .collect()
    };
    let listens = check_ports_free(&configs, fresh)?;
    let mut nodes = Nodes::start(configs)?;
    // Absolute, so that the hints below work from any directory.
    let absolute = std::path::absolute(&args.dir)?;
    let dir = absolute.display();
    let restart = (!args.no_restart).then_some(args.restart_after);
    let count = nodes.len();
    let ready = tokio::select! {
        r = demo_lock(&args.dir) => r,
        _ = nodes.supervise(restart) => Err("every node exited; see their node.log".into()),
    };
    if let Err(e) = ready {
        nodes.stop().await;
        return Err(e);
    }
    let ports = listens.first().zip(listens.last()).map(|(first, last)| format!("{first}..{}", last.port()));
    println!(
        "keyhome dev: {count} nodes on {} ({}; logs in {dir}/node-*/node.log)",
        ports.unwrap_or_default(),
        if fresh { "new cluster" } else { "existing cluster" },
    );
    println!("try, in another shell (from any directory):");
    println!("  export KEYHOME_PROFILE={dir}/client-app/profile.toml");
    println!("  export KEYHOME_OPERATOR_PROFILE={dir}/operator/profile.toml");
    println!("  keyhome status");
    println!("  keyhome lock my-key -- sh -c 'echo \"holding my-key with token $KEYHOME_TOKEN\"; sleep 2'");
    println!("  keyhome epoch show");
    println!("or in one line: KEYHOME_PROFILE={dir}/client-app/profile.toml keyhome status --json");
    for line in http_hints(&absolute) {
        println!("{line}");
    }
    println!(
        "(the client-app profile goes through node 1's local socket {dir}/node-1/{}; Ctrl-C stops the cluster)",
        keyhome::setup::LOCAL_SOCKET
    );
    tokio::select! {
        _ = crate::shutdown_signal() => {}
        _ = nodes.supervise(restart) => {}
    }
    nodes.stop().await;
    Ok(ExitCode::SUCCESS)
}

/// The node processes, by id - 1.
struct Nodes {
    exe: PathBuf,
    configs: Vec<PathBuf>,
    children: Vec<Option<tokio::process::Child>>,
    /// When each node that is down is to be started again.
    due: Vec<Option<Instant>>,
}

impl Nodes {
    /// Starts one `keyhome run` per configuration, each appending to `node.log` beside it.
    fn start(configs: Vec<PathBuf>) -> std::io::Result<Nodes> {
        let n = configs.len();
        let mut nodes =
            Nodes { exe: std::env::current_exe()?, children: Vec::new(), configs, due: vec![None; n] };
        for i in 0..n {
            let child = nodes.spawn(i)?;
            nodes.children.push(Some(child));
        }
        Ok(nodes)
    }

    fn len(&self) -> u64 {
        self.configs.len() as u64
    }

    fn log(&self, i: usize) -> PathBuf {
        self.configs[i].with_file_name("node.log")
    }

    /// The last line node `i + 1` wrote to its log (why it stopped, usually), as `: LINE`.
    fn last_words(&self, i: usize) -> String {
        let text = std::fs::read_to_string(self.log(i)).unwrap_or_default();
        match text.lines().rev().find(|l| !l.trim().is_empty()) {
            Some(line) => format!(": {}", line.trim()),
            None => String::new(),
        }
    }

    /// Starts node `i + 1`, appending to its log.
    fn spawn(&self, i: usize) -> std::io::Result<tokio::process::Child> {
        let log = std::fs::OpenOptions::new().append(true).create(true).open(self.log(i))?;
        let mut command = std::process::Command::new(&self.exe);
        command.arg("run").arg("--config").arg(&self.configs[i]).stdout(log.try_clone()?).stderr(log);
        super::process::die_with_this_process(&mut command);
        tokio::process::Command::from(command).kill_on_drop(true).spawn()
    }

    /// The nodes that exited since the last call, now marked down.
    fn reap(&mut self) -> Vec<(usize, std::process::ExitStatus)> {
        let mut exited = Vec::new();
        for (i, slot) in self.children.iter_mut().enumerate() {
            if let Some(child) = slot
                && let Ok(Some(status)) = child.try_wait()
            {
                exited.push((i, status));
                *slot = None;
            }
        }
        exited
    }

    /// Keeps the cluster running: restarts each node that exits `restart` after it did (or
    /// leaves it down). Returns only if every node is down for good. Cancel-safe: what is due
    /// is kept in `self`.
    async fn supervise(&mut self, restart: Option<Duration>) {
        loop {
            for (i, status) in self.reap() {
                match restart {
                    Some(after) => {
                        eprintln!(
                            "node {} exited ({status}){}; starting it again in {}",
                            i + 1,
                            self.last_words(i),
                            Human(after)
                        );
                        self.due[i] = Some(Instant::now() + after);
                    }
                    None => eprintln!(
                        "node {} exited ({status}){}; leaving it down (--no-restart)",
                        i + 1,
                        self.last_words(i)
                    ),
                }
            }
            for i in 0..self.due.len() {
                if self.due[i].is_some_and(|at| at <= Instant::now()) {
                    self.due[i] = None;
                    match self.spawn(i) {
                        Ok(child) => {
                            eprintln!("node {} started again", i + 1);
                            self.children[i] = Some(child);
                        }
                        Err(e) => eprintln!("node {} cannot be started again: {e}", i + 1),
                    }
                }
            }
            if self.children.iter().all(Option::is_none) && self.due.iter().all(Option::is_none) {
                eprintln!("every node is down");
                return;
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// SIGTERM to every running node (each gives its delegations back), SIGKILL to any still
    /// running after [`STOP_WITHIN`].
    async fn stop(&mut self) {
        for child in self.children.iter().flatten() {
            if let Some(pid) = child.id().and_then(|p| rustix::process::Pid::from_raw(p as i32)) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            }
        }
        for child in self.children.iter_mut().flatten() {
            if tokio::time::timeout(STOP_WITHIN, child.wait()).await.is_err() {
                let _ = child.kill().await;
            }
        }
    }
}

/// Refuses to start when a node's UDP port is taken (another `keyhome dev` or `keyhome run`,
/// say), naming the port, rather than leaving the node to fail into its log.
/// Checks that each node's UDP port is free; returns the addresses the nodes listen on, in order
/// (an existing cluster's own, whatever --port says).
fn check_ports_free(
    configs: &[PathBuf],
    fresh: bool,
) -> Result<Vec<std::net::SocketAddr>, Box<dyn std::error::Error>> {
    let mut addrs = Vec::with_capacity(configs.len());
    for (i, path) in configs.iter().enumerate() {
        let listen = NodeConfig::load(path)?.listen;
        if let Err(e) = std::net::UdpSocket::bind(listen) {
            let fix = if fresh {
                "give --port for another range (and a new --dir)"
            } else {
                "this cluster directory uses it; delete the directory and give --port for another range"
            };
            return Err(format!(
                "node {}'s UDP port {listen} is in use ({e}): is another keyhome dev or keyhome run \
                 running? Stop it, or {fix}",
                i + 1
            )
            .into());
        }
        addrs.push(listen);
    }
    Ok(addrs)
}

/// How to reach node 1's HTTP API, if it serves one: a curl line that locks a key, and the
/// status page.
fn http_hints(dir: &Path) -> Vec<String> {
    let config = setup::identity_dir(dir, &Role::Node(NodeId(1))).join("node.toml");
    let Some(addr) = NodeConfig::load(&config).ok().and_then(|c| c.http?.listen) else { return Vec::new() };
    let token = setup::identity_dir(dir, &Role::Client("app".into())).join(keyhome::http::tokens::TOKEN_FILE);
    vec![
        format!(
            "  curl -sS -H \"Authorization: Bearer $(cat {})\" -d '{{\"key\":\"my-key\",\"ttl_ms\":10000,\"wait_ms\":5000}}' http://{addr}/v1/lock",
            token.display()
        ),
        format!("status page and metrics: http://{addr}/ and http://{addr}/metrics"),
    ]
}

/// Shows the cluster locking: a key locked through the profile's node (node 1) and unlocked with
/// a note, then through the last member of the current epoch, which receives the note; waits up to
/// [`READY_WITHIN`] for the cluster to form. Members only: a directory whose cluster had a node
/// removed (the README's tour does) locks through those left.
async fn demo_lock(dir: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let profile_path = setup::identity_dir(dir, &Role::Client("app".into())).join("profile.toml");
    let profile = ClientProfile::load(&profile_path)?;
    let identity = keyhome::pki::Identity::load(&profile.cert, &profile.key)?;
    let ca = keyhome::pki::load_ca(&profile.ca)?;
    let connect = |id: NodeId| {
        let (identity, ca) = (&identity, &ca);
        async move {
            let config = NodeConfig::load(&setup::identity_dir(dir, &Role::Node(id)).join("node.toml"))?;
            Client::connect_with(id, config.listen, identity, ca).await
        }
    };
    let deadline = Instant::now() + READY_WITHIN;
    let (ttl, wait) = (Duration::from_secs(5), Duration::from_secs(2));
    loop {
        let attempt = async {
            let first = Client::connect(&profile).await?;
            let members: Vec<NodeId> = first.epoch().await?.member_ids().collect();
            let (from, first) = match members.contains(&NodeId(profile.node)) {
                true => (NodeId(profile.node), first),
                false => (members[0], connect(members[0]).await?),
            };
            let last = members.iter().copied().filter(|&id| id != from).max().unwrap_or(from);
            let held = first.lock(b"hello", ttl, wait).await?;
            let token = held.token();
            held.unlock(Some(format!("hello from node {from}").into_bytes())).await?;
            let other = connect(last).await?;
            let held = other.lock(b"hello", ttl, wait).await?;
            let seen = (held.token(), String::from_utf8_lossy(held.note().unwrap_or_default()).into_owned());
            held.unlock(None).await?;
            Ok::<_, keyhome::client::ClientError>((from, token, last, seen))
        };
        match attempt.await {
            Ok((from, first, last, (second, note))) => {
                println!(
                    "cluster ready: locked \"hello\" through node {from} (token {first}), then through node \
                     {last} (token {second}, handed the note {note:?})"
                );
                return Ok(());
            }
            Err(e) if Instant::now() < deadline => {
                tracing::debug!("cluster not ready yet: {e}");
                tokio::time::sleep(POLL).await;
            }
            Err(e) => {
                return Err(format!("the cluster did not lock within {}: {e}", Human(READY_WITHIN)).into());
            }
        }
    }
}
