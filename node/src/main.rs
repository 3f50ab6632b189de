//! `keyhome`: run a node, set a cluster up, lock from the shell, inspect and change the cluster.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use keyhome::client::Client;
use keyhome::config::{ClientProfile, LockSettings, NodeConfig};
use keyhome::pki::Role;
use keyhome::wire::{ClientEvent, ErrorKind, EventKind};
use keyhome::{Node, setup};
use keyhome_delegation::{CheckAnswer, FencingToken};
use keyhome_epoch::{Change, Member, NodeId, Timing};

/// Exit status when the lock could not be taken within `--wait`.
const EXIT_NOT_LOCKED: u8 = 3;
/// Exit status when the lock was lost while the command ran (the command was signalled).
const EXIT_LOST: u8 = 4;
/// `keyhome token check` exits 0 when the key is held with the token now, and with one of these
/// otherwise, clear of 1 (any error: no answer in time, a refusal), 2 (a usage error) and the
/// statuses of `keyhome lock`.
const EXIT_SUPERSEDED: u8 = 5;
const EXIT_NOT_HELD: u8 = 6;
const EXIT_UNKNOWN_KEY: u8 = 7;

#[derive(Parser)]
#[command(name = "keyhome", version = VERSION, about = "A distributed lock service with delegated key homes")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start a local cluster of N nodes on loopback, with generated certificates, and keep it
    /// running until Ctrl-C.
    Dev(DevArgs),
    /// Create a cluster directory: a new CA and the genesis epoch.
    Init(InitArgs),
    /// Issue certificates from a cluster's CA.
    #[command(subcommand)]
    Certs(CertsCommand),
    /// Run a node.
    Run {
        /// The node's configuration file.
        #[arg(long)]
        config: PathBuf,
    },
    /// Run a command while holding a lock; its token is in KEYHOME_TOKEN.
    Lock(LockArgs),
    /// Show a node's view of the cluster.
    Status {
        #[command(flatten)]
        profile: ProfileArg,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Show or change the membership epoch.
    #[command(subcommand)]
    Epoch(EpochCommand),
    /// Fencing tokens.
    #[command(subcommand)]
    Token(TokenCommand),
}

#[derive(Args)]
struct ProfileArg {
    /// Client profile (node address and certificates). Default: $KEYHOME_PROFILE, else
    /// ./keyhome-dev/client-app/profile.toml.
    #[arg(long, env = "KEYHOME_PROFILE", default_value = "keyhome-dev/client-app/profile.toml")]
    profile: PathBuf,
}

#[derive(Args)]
struct OperatorProfileArg {
    /// Operator profile. Default: $KEYHOME_OPERATOR_PROFILE, else
    /// ./keyhome-dev/operator/profile.toml.
    #[arg(long, env = "KEYHOME_OPERATOR_PROFILE", default_value = "keyhome-dev/operator/profile.toml")]
    profile: PathBuf,
}

#[derive(Args)]
struct DevArgs {
    /// Number of nodes.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=64))]
    nodes: u64,
    /// Cluster directory; reused if it exists (delete it for a fresh cluster).
    #[arg(long, default_value = "keyhome-dev")]
    dir: PathBuf,
    /// UDP port of node 1; node i listens on port + i - 1.
    #[arg(long, default_value_t = 7101)]
    port: u16,
    #[command(flatten)]
    timing: TimingArgs,
}

#[derive(Args)]
struct TimingArgs {
    /// Home lease.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    home_lease: Duration,
    /// Longest delegation a home grants.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    delegation_lease: Duration,
    /// Bound on clock-rate error, parts per million.
    #[arg(long, default_value_t = 10_000)]
    clock_rate_ppm: u32,
}

impl TimingArgs {
    fn timing(&self) -> Timing {
        Timing {
            home_lease: self.home_lease,
            max_delegation_lease: self.delegation_lease,
            clock_rate_ppm: self.clock_rate_ppm,
        }
    }
}

#[derive(Args)]
struct InitArgs {
    /// Cluster directory to create.
    #[arg(long)]
    dir: PathBuf,
    /// A genesis member, as ID=HOST:PORT; repeat for each.
    #[arg(long = "node", required = true, value_parser = parse_member)]
    nodes: Vec<Member>,
    #[command(flatten)]
    timing: TimingArgs,
}

#[derive(Subcommand)]
enum CertsCommand {
    /// Issue one certificate (and, for a node, write its node.toml; for an operator or client,
    /// its profile.toml).
    Issue(IssueArgs),
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("role").required(true).multiple(false)))]
struct IssueArgs {
    /// Cluster directory made by `keyhome init`.
    #[arg(long)]
    dir: PathBuf,
    /// A node certificate for node ID.
    #[arg(long, group = "role")]
    node: Option<u64>,
    /// An operator certificate (may change the membership).
    #[arg(long, group = "role")]
    operator: bool,
    /// A client certificate named NAME (may lock).
    #[arg(long, group = "role")]
    client: Option<String>,
    /// For a node: the address it listens on. For an operator or client: the node it talks to,
    /// as ID=HOST:PORT.
    #[arg(long)]
    addr: Option<String>,
}

#[derive(Args)]
struct LockArgs {
    #[command(flatten)]
    profile: ProfileArg,
    /// The key to lock.
    key: String,
    /// How long the lock lasts without renewal; renewed every third of it while CMD runs.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    ttl: Duration,
    /// How long to wait for the lock.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    wait: Duration,
    /// How long CMD may take to exit after SIGTERM when the lock is lost, before SIGKILL.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    kill_after: Duration,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

#[derive(Subcommand)]
enum EpochCommand {
    /// Print the current epoch.
    Show {
        #[command(flatten)]
        profile: ProfileArg,
        #[arg(long)]
        json: bool,
    },
    /// Propose a membership change (operator certificate required).
    Propose(ProposeArgs),
    /// UNSAFE: install a new epoch of the surviving members without agreement, for a cluster
    /// that lost its majority for good. Run it against exactly one surviving node, only after
    /// making sure every member left out is stopped and will never run again with its data.
    Recover(RecoverArgs),
}

#[derive(Args)]
struct RecoverArgs {
    #[command(flatten)]
    profile: OperatorProfileArg,
    /// Required: says you read docs/operations.md ("Disaster recovery") and accept the risk.
    #[arg(long = "unsafe", required = true)]
    confirm_unsafe: bool,
    /// A surviving member of the new epoch, as ID=HOST:PORT; repeat for each.
    #[arg(long = "member", required = true, value_parser = parse_member)]
    members: Vec<Member>,
    /// Every current member left out, confirming it is stopped for good (comma-separated ids).
    #[arg(long, value_delimiter = ',', required = true)]
    confirm_stopped: Vec<u64>,
    /// How far past the current epoch number the new epoch goes; its tokens then order after
    /// any epoch the lost members might have chosen, if they went through fewer than this many.
    #[arg(long, default_value_t = 1 << 20)]
    skip: u64,
}

#[derive(Args)]
#[group(id = "change", required = true, multiple = false)]
struct ProposeArgs {
    #[command(flatten)]
    profile: OperatorProfileArg,
    /// Add node ID at HOST:PORT.
    #[arg(long, group = "change", value_parser = parse_member)]
    add: Option<Member>,
    /// Remove node ID.
    #[arg(long, group = "change")]
    remove: Option<u64>,
    /// Replace node OLD by NEW at HOST:PORT, as OLD=NEW=HOST:PORT.
    #[arg(long, group = "change", value_parser = parse_replace)]
    replace: Option<(NodeId, Member)>,
}

#[derive(Subcommand)]
enum TokenCommand {
    /// Ask whether KEY is held with TOKEN now. Exits 0 if it is, 5 if a later lock of KEY was
    /// admitted, 6 if TOKEN's lock ended and no later one is known, 7 if KEY's home has no record
    /// of KEY (not held either), 1 if no answer came.
    Check {
        #[command(flatten)]
        profile: ProfileArg,
        key: String,
        token: FencingToken,
    },
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    let n: u64 = digits.parse().map_err(|_| format!("{s:?} is not a duration like 500ms, 10s or 2m"))?;
    let unit_ms = match unit {
        "ms" => 1,
        "s" | "" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        _ => return Err(format!("unknown unit {unit:?} in {s:?}: use ms, s, m or h")),
    };
    Ok(Duration::from_millis(n.saturating_mul(unit_ms)))
}

fn parse_member(s: &str) -> Result<Member, String> {
    let (id, addr) = s.split_once('=').ok_or_else(|| format!("{s:?} is not ID=HOST:PORT"))?;
    let id = id.parse().map_err(|_| format!("{id:?} is not a node id (a number)"))?;
    if addr.is_empty() {
        return Err(format!("{s:?} has no address"));
    }
    Ok(Member { id: NodeId(id), addr: addr.to_string() })
}

fn parse_replace(s: &str) -> Result<(NodeId, Member), String> {
    let (old, rest) = s.split_once('=').ok_or_else(|| format!("{s:?} is not OLD=NEW=HOST:PORT"))?;
    let old = old.parse().map_err(|_| format!("{old:?} is not a node id (a number)"))?;
    Ok((NodeId(old), parse_member(rest)?))
}

/// The version `--version` prints; a build with the test-only safety switches says so loudly.
const VERSION: &str = if keyhome_epoch::BUG_INJECTION {
    concat!(env!("CARGO_PKG_VERSION"), " (TEST BUILD: bug-injection switches compiled in)")
} else {
    env!("CARGO_PKG_VERSION")
};

fn main() -> ExitCode {
    // Fail-stop in every build: a panic on any thread ends the process, so nothing runs on with
    // state a panic may have left half-changed (release builds also abort on panic).
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        std::process::abort();
    }));
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli.command)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

type Result<T, E = Box<dyn std::error::Error>> = std::result::Result<T, E>;

async fn run(command: Command) -> Result<ExitCode> {
    match command {
        Command::Dev(args) => dev(args).await,
        Command::Init(args) => {
            let members: Vec<_> = args.nodes.iter().map(|m| (m.id, m.addr.clone())).collect();
            setup::init(&args.dir, &members, args.timing.timing())?;
            println!("created {}: ca.pem, ca.key (keep it safe), genesis.toml", args.dir.display());
            println!("next: keyhome certs issue --dir {} --node ID --addr HOST:PORT", args.dir.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Certs(CertsCommand::Issue(args)) => issue(args),
        Command::Run { config } => run_node(&config).await,
        Command::Lock(args) => lock(args).await,
        Command::Status { profile, json } => {
            let status = connect(&profile.profile).await?.status().await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&status)?);
            } else {
                println!("{status}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Epoch(EpochCommand::Show { profile, json }) => {
            let epoch = connect(&profile.profile).await?.epoch().await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&epoch)?);
            } else {
                println!("epoch {} (ring version {})", epoch.number, epoch.ring_version);
                for m in &epoch.members {
                    println!("  {:>6}  {}", m.id, m.addr);
                }
                let t = epoch.timing;
                println!(
                    "home lease {:?}, delegation lease {:?}, clock-rate bound {} ppm, activation wait {:?}",
                    t.home_lease, t.max_delegation_lease, t.clock_rate_ppm, epoch.activation_wait
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Epoch(EpochCommand::Propose(args)) => {
            let change = match (args.add, args.remove, args.replace) {
                (Some(member), _, _) => Change::Add(member),
                (_, Some(id), _) => Change::Remove(NodeId(id)),
                (_, _, Some((old, new))) => Change::Replace { old, new },
                _ => return Err("give one of --add, --remove, --replace".into()),
            };
            let epoch = connect(&args.profile.profile).await?.propose(change).await?;
            println!("the change is part of epoch {epoch}");
            Ok(ExitCode::SUCCESS)
        }
        Command::Epoch(EpochCommand::Recover(args)) => {
            if !args.confirm_unsafe {
                return Err("recovery needs --unsafe".into());
            }
            let stopped = args.confirm_stopped.iter().map(|&id| NodeId(id)).collect();
            let client = connect(&args.profile.profile).await?;
            let epoch = client.recover_unsafe(args.members, stopped, args.skip).await?;
            println!(
                "installed epoch {epoch} without agreement; the other survivors learn it from this node"
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Token(TokenCommand::Check { profile, key, token }) => {
            let answer = connect(&profile.profile).await?.check(key.as_bytes(), token).await?;
            let (text, code) = match answer {
                CheckAnswer::HeldNow => ("holds the lock now", 0),
                CheckAnswer::Superseded => {
                    ("is superseded: a later lock of the key was admitted", EXIT_SUPERSEDED)
                }
                CheckAnswer::NotHeld => {
                    ("no longer holds the lock (or never did), and no later lock is known", EXIT_NOT_HELD)
                }
                CheckAnswer::UnknownKey => {
                    ("does not hold the lock: the key's home has no record of the key", EXIT_UNKNOWN_KEY)
                }
            };
            println!("{token} on {key:?} {text}");
            Ok(ExitCode::from(code))
        }
    }
}

async fn connect(profile: &Path) -> Result<Client> {
    let profile = ClientProfile::load(profile)?;
    Ok(Client::connect(&profile).await?)
}

fn issue(args: IssueArgs) -> Result<ExitCode> {
    let role = match (args.node, args.operator, args.client) {
        (Some(id), _, _) => Role::Node(NodeId(id)),
        (_, true, _) => Role::Operator,
        (_, _, Some(name)) => Role::Client(name),
        _ => return Err("give one of --node, --operator, --client".into()),
    };
    let ca = setup::load_ca(&args.dir)?;
    let dir = setup::issue(&args.dir, &ca, &role)?;
    println!("issued {role} into {}", dir.display());
    match (&role, args.addr) {
        (Role::Node(id), Some(addr)) => {
            let listen = addr.parse().map_err(|_| format!("{addr:?} is not HOST:PORT with an IP address"))?;
            let path = setup::write_node_config(&args.dir, *id, listen, LockSettings::default())?;
            println!("wrote {}; start it with: keyhome run --config {}", path.display(), path.display());
        }
        (Role::Operator | Role::Client(_), Some(target)) => {
            let member = parse_member(&target)?;
            let addr = member
                .addr
                .parse()
                .map_err(|_| format!("{:?} is not an IP address and port", member.addr))?;
            let path = setup::write_profile(&args.dir, &role, member.id, addr)?;
            println!("wrote {}; use it with --profile {}", path.display(), path.display());
        }
        _ => {}
    }
    Ok(ExitCode::SUCCESS)
}

async fn run_node(config: &Path) -> Result<ExitCode> {
    let config = NodeConfig::load(config)?;
    let node = Node::start(config).await?;
    tokio::select! {
        _ = shutdown_signal() => {
            tracing::info!("shutting down: releasing delegations");
            node.shutdown(Duration::from_secs(2)).await;
            Ok(ExitCode::SUCCESS)
        }
        _ = node.stopped() => {
            let failure = node.failure();
            node.shutdown(Duration::ZERO).await;
            Err(failure.unwrap_or_else(|| "the node stopped".into()).into())
        }
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        let _ = tokio::signal::ctrl_c().await;
        return;
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

async fn lock(args: LockArgs) -> Result<ExitCode> {
    let client = connect(&args.profile.profile).await?;
    let mut events = client.events().await?;
    let mut held = match client.lock(args.key.as_bytes(), args.ttl, args.wait).await {
        Ok(held) => held,
        Err(e) if e.kind() == Some(ErrorKind::Timeout) => {
            eprintln!("keyhome: {:?} was not locked within {:?}: {e}", args.key, args.wait);
            return Ok(ExitCode::from(EXIT_NOT_LOCKED));
        }
        Err(e) => return Err(e.into()),
    };
    let (program, rest) = args.command.split_first().ok_or("no command given")?;
    let mut command = tokio::process::Command::new(program);
    command
        .args(rest)
        .env("KEYHOME_KEY", &args.key)
        .env("KEYHOME_TOKEN", held.token().to_string())
        .env("KEYHOME_RECOVERED", if held.recovered() { "1" } else { "0" });
    if let Some(note) = held.note().and_then(|n| std::str::from_utf8(n).ok()) {
        command.env("KEYHOME_NOTE", note);
    }
    let mut child = command.spawn().map_err(|e| format!("cannot run {program:?}: {e}"))?;
    let mut renew = tokio::time::interval(args.ttl / 3);
    renew.tick().await;
    let handle = held.handle();
    let lost = loop {
        tokio::select! {
            status = child.wait() => {
                let status = status?;
                held.unlock(None).await?;
                return Ok(exit_code(status));
            }
            _ = renew.tick() => {
                if let Err(e) = held.renew(args.ttl).await {
                    break format!("renewal failed: {e}");
                }
            }
            event = events.next() => match event {
                Some(ClientEvent { handle: h, kind: EventKind::Expired, .. }) if h == handle => {
                    break "the lock expired".to_string();
                }
                Some(_) => {}
                None => break "the connection to the node was lost".to_string(),
            },
            _ = shutdown_signal() => {
                signal_child(&child, rustix::process::Signal::TERM);
                let status = child.wait().await?;
                held.unlock(None).await?;
                return Ok(exit_code(status));
            }
        }
    };
    eprintln!("keyhome: lost the lock on {:?}: {lost}; stopping the command", args.key);
    signal_child(&child, rustix::process::Signal::TERM);
    if tokio::time::timeout(args.kill_after, child.wait()).await.is_err() {
        let _ = child.kill().await;
    }
    let _ = held.forget();
    Ok(ExitCode::from(EXIT_LOST))
}

fn signal_child(child: &tokio::process::Child, signal: rustix::process::Signal) {
    if let Some(pid) = child.id().and_then(|p| rustix::process::Pid::from_raw(p as i32)) {
        let _ = rustix::process::kill_process(pid, signal);
    }
}

fn exit_code(status: std::process::ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => ExitCode::from(code.clamp(0, 255) as u8),
        (None, Some(signal)) => ExitCode::from((128 + signal).clamp(0, 255) as u8),
        _ => ExitCode::FAILURE,
    }
}

async fn dev(args: DevArgs) -> Result<ExitCode> {
    let fresh = !args.dir.join("genesis.toml").exists();
    let configs: Vec<PathBuf> = if fresh {
        setup::dev_cluster(&args.dir, args.nodes, args.port, args.timing.timing(), &LockSettings::default())?
    } else {
        (1..=args.nodes)
            .map(|i| setup::identity_dir(&args.dir, &Role::Node(NodeId(i))).join("node.toml"))
            .collect()
    };
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for config in &configs {
        let log = std::fs::File::create(config.with_file_name("node.log"))?;
        let child = tokio::process::Command::new(&exe)
            .arg("run")
            .arg("--config")
            .arg(config)
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()?;
        children.push(child);
    }
    let dir = args.dir.display();
    let ready = tokio::select! {
        r = demo_lock(&args.dir, configs.len() as u64) => r,
        (status, i) = first_exit(&mut children) => Err(format!("node {} exited ({status}); see its node.log", i + 1).into()),
    };
    if let Err(e) = ready {
        for child in &mut children {
            let _ = child.kill().await;
        }
        return Err(e);
    }
    println!(
        "keyhome dev: {} nodes on 127.0.0.1:{}..{} ({}; logs in {dir}/node-*/node.log)",
        configs.len(),
        args.port,
        u64::from(args.port) + configs.len() as u64 - 1,
        if fresh { "new cluster" } else { "existing cluster" },
    );
    println!("try, in another shell in this directory:");
    println!("  keyhome status");
    println!("  keyhome lock my-key -- sh -c 'echo \"holding my-key with token $KEYHOME_TOKEN\"; sleep 2'");
    println!("  keyhome epoch show");
    println!("  keyhome status --profile {dir}/operator/profile.toml --json");
    println!(
        "(profiles: {dir}/client-app/profile.toml and {dir}/operator/profile.toml; Ctrl-C stops the cluster)"
    );
    let exited = first_exit(&mut children);
    tokio::select! {
        _ = shutdown_signal() => {}
        (status, i) = exited => eprintln!("node {} exited ({status}); stopping the cluster", i + 1),
    }
    for child in &children {
        signal_child(child, rustix::process::Signal::TERM);
    }
    for child in &mut children {
        if tokio::time::timeout(Duration::from_secs(5), child.wait()).await.is_err() {
            let _ = child.kill().await;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Shows the new cluster locking: a key locked through node 1 and unlocked with a note, then
/// through the last node, which receives the note; waits up to 30 s for the cluster to form.
async fn demo_lock(dir: &Path, nodes: u64) -> Result<()> {
    let profile_path = setup::identity_dir(dir, &Role::Client("app".into())).join("profile.toml");
    let profile = ClientProfile::load(&profile_path)?;
    let identity = keyhome::pki::Identity::load(&profile.cert, &profile.key)?;
    let ca = keyhome::pki::load_ca(&profile.ca)?;
    let last = NodeId(nodes);
    let last_addr =
        keyhome::config::NodeConfig::load(&setup::identity_dir(dir, &Role::Node(last)).join("node.toml"))?
            .listen;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let (ttl, wait) = (Duration::from_secs(5), Duration::from_secs(2));
    loop {
        let attempt = async {
            let first = Client::connect(&profile).await?;
            let held = first.lock(b"hello", ttl, wait).await?;
            let token = held.token();
            held.unlock(Some(b"hello from node 1".to_vec())).await?;
            let other = Client::connect_with(last, last_addr, &identity, &ca).await?;
            let held = other.lock(b"hello", ttl, wait).await?;
            let seen = (held.token(), String::from_utf8_lossy(held.note().unwrap_or_default()).into_owned());
            held.unlock(None).await?;
            Ok::<_, keyhome::client::ClientError>((token, seen))
        };
        match attempt.await {
            Ok((first, (second, note))) => {
                println!(
                    "cluster ready: locked \"hello\" through node 1 (token {first}), then through node {} \
                     (token {second}, handed the note {note:?})",
                    last.0
                );
                return Ok(());
            }
            Err(e) if tokio::time::Instant::now() < deadline => {
                tracing::debug!("cluster not ready yet: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(format!("the cluster did not lock within 30 s: {e}").into()),
        }
    }
}

/// Waits for the first child to exit: its status, its index.
async fn first_exit(children: &mut [tokio::process::Child]) -> (std::process::ExitStatus, usize) {
    loop {
        for (i, child) in children.iter_mut().enumerate() {
            if let Ok(Some(status)) = child.try_wait() {
                return (status, i);
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
