//! `keyhome`: run a node, set a cluster up, lock from the shell, inspect and change the cluster.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use keyhome::client::Client;
use keyhome::config::{ClientProfile, ConfigError, LockSettings, NodeConfig};
use keyhome::duration::{self, Human};
use keyhome::pki::Role;
use keyhome::wire::Proposal;
use keyhome::{Node, setup};
use keyhome_delegation::{CheckAnswer, FencingToken};
use keyhome_epoch::{Change, Member, NodeId, Timing};

/// `keyhome token check` exits 0 when the key is held with the token now, and with one of these
/// otherwise, clear of 1 (any error: no answer in time, a refusal), 2 (a usage error) and the
/// statuses of `keyhome lock` (123 to 127).
const EXIT_SUPERSEDED: u8 = 5;
const EXIT_NOT_HELD: u8 = 6;
const EXIT_UNKNOWN_KEY: u8 = 7;

mod cli {
    pub mod dev;
    pub mod lock;
    pub mod process;
}

#[derive(Parser)]
#[command(name = "keyhome", version = VERSION, about = "A distributed lock service with delegated key homes")]
struct Cli {
    /// Log format on stderr: `text` (coloured only on a terminal) or `json` (one object a line).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "KEYHOME_LOG_FORMAT")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`); see docs/operations.md ("Logs").
fn init_logs(format: LogFormat) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => logs.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => logs.json().init(),
    }
}

#[derive(Subcommand)]
enum Command {
    /// Start a local cluster of N nodes on loopback, with generated certificates, and keep it
    /// running until Ctrl-C.
    Dev(cli::dev::DevArgs),
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
    /// Run a command while holding a lock (its token is in KEYHOME_TOKEN); the command never
    /// outlives the lock. Exit status: the command's, or 123 (the lock was ending and the command
    /// was stopped), 124 (not locked within --wait), 125 (keyhome failed), 126/127 (the command
    /// cannot run / was not found).
    Lock(cli::lock::LockArgs),
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

/// Where the CLI looks for a client profile when neither `--profile` nor `KEYHOME_PROFILE` says.
const DEFAULT_PROFILE: &str = "keyhome-dev/client-app/profile.toml";
/// Where operator commands look for a profile when neither `--profile` nor
/// `KEYHOME_OPERATOR_PROFILE` says.
const DEFAULT_OPERATOR_PROFILE: &str = "keyhome-dev/operator/profile.toml";

#[derive(Args)]
pub struct ProfileArg {
    /// Client profile (node address and certificates). Default: $KEYHOME_PROFILE, else
    /// ./keyhome-dev/client-app/profile.toml.
    #[arg(long, env = "KEYHOME_PROFILE", default_value = DEFAULT_PROFILE)]
    pub profile: PathBuf,
}

#[derive(Args)]
struct OperatorProfileArg {
    /// Operator profile. Default: $KEYHOME_OPERATOR_PROFILE, else
    /// ./keyhome-dev/operator/profile.toml.
    #[arg(long, env = "KEYHOME_OPERATOR_PROFILE", default_value = DEFAULT_OPERATOR_PROFILE)]
    profile: PathBuf,
}

#[derive(Args)]
pub struct TimingArgs {
    /// Home lease.
    #[arg(long, default_value = "2s", value_parser = duration::parse)]
    home_lease: Duration,
    /// Longest delegation a home grants (each node asks for its `delegation_lease_ms`, 5 s by
    /// default, capped by this).
    #[arg(long, default_value = "5s", value_parser = duration::parse)]
    delegation_lease: Duration,
    /// Bound on clock-rate error, parts per million.
    #[arg(long, default_value_t = 10_000)]
    clock_rate_ppm: u32,
}

impl TimingArgs {
    pub fn timing(&self) -> Timing {
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
    /// A node certificate for node ID, and its node.toml.
    #[arg(long, group = "role")]
    node: Option<u64>,
    /// An operator certificate (may change the membership).
    #[arg(long, group = "role")]
    operator: bool,
    /// A client certificate named NAME (may lock).
    #[arg(long, group = "role")]
    client: Option<String>,
    /// For a node: its address, HOST:PORT (an IP address or a DNS name) [default: its address
    /// in the genesis]. For an operator or client: the node it talks to, as ID=HOST:PORT, which
    /// writes its profile.toml.
    #[arg(long)]
    addr: Option<String>,
    /// Replace the identity's files if they exist (a new key and certificate; the old
    /// certificate stays valid until the CA is rotated).
    #[arg(long)]
    force: bool,
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
struct ProposeArgs {
    #[command(flatten)]
    profile: OperatorProfileArg,
    #[command(flatten)]
    change: ChangeArgs,
    /// Propose the change even if a new member does not answer at its address now, or the epoch
    /// it makes would lack a majority of members this node reaches.
    #[arg(long)]
    force: bool,
}

#[derive(Args)]
#[group(id = "change", required = true, multiple = false)]
struct ChangeArgs {
    /// Add node ID at HOST:PORT (it must be running and answer there, unless --force).
    #[arg(long, group = "change", value_parser = parse_member)]
    add: Option<Member>,
    /// Remove node ID.
    #[arg(long, group = "change")]
    remove: Option<u64>,
    /// Replace node OLD by NEW at HOST:PORT, as OLD=NEW=HOST:PORT (NEW must answer there, unless
    /// --force).
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
        /// The key (a key that starts with `-` goes after `--`: `token check -- -k TOKEN`).
        #[arg(value_parser = parse_key)]
        key: String,
        token: FencingToken,
    },
}

/// A key as given on the command line: not empty (the node refuses one over its limit, and says
/// the limit).
pub fn parse_key(s: &str) -> Result<String, String> {
    if s.is_empty() {
        return Err("the key is empty: give a key of at least one byte".into());
    }
    Ok(s.to_string())
}

fn parse_member(s: &str) -> Result<Member, String> {
    let (id, addr) = s.split_once('=').ok_or_else(|| format!("{s:?} is not ID=HOST:PORT"))?;
    let id = id.parse().map_err(|_| format!("{id:?} is not a node id (a number)"))?;
    keyhome::addr::check(addr)?;
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
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            // `keyhome lock` keeps the statuses CMD does not use for its own. Which subcommand was
            // meant is read by clap past the error (global options may come before it).
            let lock = <Cli as clap::CommandFactory>::command()
                .ignore_errors(true)
                .try_get_matches()
                .is_ok_and(|m| m.subcommand_name() == Some("lock"));
            return match e.exit_code() {
                0 => ExitCode::SUCCESS,
                _ if lock => ExitCode::from(cli::lock::EXIT_ERROR),
                code => ExitCode::from(u8::try_from(code).unwrap_or(2)),
            };
        }
    };
    init_logs(cli.log_format);
    // `keyhome run` sizes its runtime by the node's `worker_threads` (0: tokio's default), and
    // `keyhome dev` takes tokio's default; every other command is one request or a few, which
    // one thread serves with no cross-thread wake-ups and no threads to start.
    let mut builder = match &cli.command {
        Command::Run { .. } | Command::Dev(_) => tokio::runtime::Builder::new_multi_thread(),
        _ => tokio::runtime::Builder::new_current_thread(),
    };
    if let Command::Run { config } = &cli.command {
        match NodeConfig::load(config) {
            Ok(config) if config.worker_threads > 0 => {
                builder.worker_threads(config.worker_threads);
            }
            Ok(_) => {}
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let runtime = match builder.enable_all().build() {
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
        Command::Dev(args) => cli::dev::run(args).await,
        Command::Init(args) => {
            let members: Vec<_> = args.nodes.iter().map(|m| (m.id, m.addr.clone())).collect();
            setup::init(&args.dir, &members, args.timing.timing())?;
            println!("created {}: ca.pem, ca.key (keep it safe), genesis.toml", args.dir.display());
            println!("next: keyhome certs issue --dir {} --node ID (for each node)", args.dir.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Certs(CertsCommand::Issue(args)) => issue(args),
        Command::Run { config } => run_node(&config).await,
        Command::Lock(args) => Ok(cli::lock::run(args).await),
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
                println!("{}", serde_json::to_string_pretty(&keyhome::status::EpochJson::from(&epoch))?);
            } else {
                println!("epoch {} (ring version {})", epoch.number, epoch.ring_version);
                for m in &epoch.members {
                    println!("  {:>6}  {}", m.id, m.addr);
                }
                let t = epoch.timing;
                println!(
                    "home lease {}, delegation lease {}, clock-rate bound {} ppm, activation wait {}",
                    Human(t.home_lease),
                    Human(t.max_delegation_lease),
                    t.clock_rate_ppm,
                    Human(epoch.activation_wait)
                );
                if !epoch.retired.is_empty() {
                    let ids: Vec<String> = epoch.retired.iter().map(|id| id.to_string()).collect();
                    println!("retired (removed; not heard of later epochs): {}", ids.join(", "));
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Epoch(EpochCommand::Propose(args)) => {
            let change = match (args.change.add, args.change.remove, args.change.replace) {
                (Some(member), _, _) => Change::Add(member),
                (_, Some(id), _) => Change::Remove(NodeId(id)),
                (_, _, Some((old, new))) => Change::Replace { old, new },
                _ => return Err("give one of --add, --remove, --replace".into()),
            };
            let client = connect(&args.profile.profile).await?;
            // The node checks the change (a new member answers, a reachable majority stays)
            // unless forced: every API gets the same checks.
            let epoch = client.propose(Proposal { change, force: args.force }).await?;
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

/// Reads the profile at `path`; a missing one says how to name another.
fn load_profile(path: &Path) -> Result<ClientProfile> {
    match ClientProfile::load(path) {
        Err(ConfigError::Read { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            let env = if path == Path::new(DEFAULT_OPERATOR_PROFILE) {
                Some("KEYHOME_OPERATOR_PROFILE")
            } else if path == Path::new(DEFAULT_PROFILE) {
                Some("KEYHOME_PROFILE")
            } else {
                None
            };
            Err(match env {
                Some(env) => format!(
                    "no profile at {} (the default, which `keyhome dev` writes in the directory it runs \
                     in): give --profile FILE or set {env}=FILE",
                    path.display()
                ),
                None => format!(
                    "no profile at {}: check the path (`keyhome certs issue --client NAME --addr \
                     ID=HOST:PORT` writes one)",
                    path.display()
                ),
            }
            .into())
        }
        other => Ok(other?),
    }
}

/// Connects with the profile at `path`; a failure names the profile.
pub async fn connect(path: &Path) -> Result<Client> {
    let profile = load_profile(path)?;
    Client::connect(&profile).await.map_err(|e| format!("{e} (profile {})", path.display()).into())
}

fn issue(args: IssueArgs) -> Result<ExitCode> {
    let role = match (args.node, args.operator, args.client) {
        (Some(id), _, _) => Role::Node(NodeId(id)),
        (_, true, _) => Role::Operator,
        (_, _, Some(name)) => Role::Client(name),
        _ => return Err("give one of --node, --operator, --client".into()),
    };
    let ca = setup::load_ca(&args.dir)?;
    let held = setup::ClusterLock::acquire(&args.dir)?;
    let mut files = setup::Files::new();
    let dir = setup::stage_identity(&mut files, &held, &args.dir, &ca, &role)?;
    // A node's configuration may have been edited since it was written (its data directory, say):
    // a certificate issued again (--force, a new key) keeps it.
    let kept = setup::identity_dir(&args.dir, &role).join("node.toml");
    let companion = match (&role, args.addr) {
        (Role::Node(_), Some(_)) if args.force && kept.exists() => {
            return Err(format!(
                "{} exists and --force keeps it: change its listen address by hand, or remove it to have \
                 one written for --addr",
                kept.display()
            )
            .into());
        }
        (Role::Node(_), None) if args.force && kept.exists() => {
            Some(format!("nothing else: {} is kept as it is", kept.display()))
        }
        (Role::Node(id), addr) => {
            let addr = match addr {
                Some(addr) => addr,
                None => setup::genesis_addr(&args.dir, *id)?,
            };
            let listen = keyhome::addr::listen_for(&addr)?;
            let path = setup::stage_node_config(
                &mut files,
                &args.dir,
                *id,
                listen,
                false,
                LockSettings::default(),
                setup::HostSettings::default(),
            )?;
            Some(format!(
                "{} (listening on {listen}, reached at {addr}); start it with: keyhome run --config {}",
                path.display(),
                path.display()
            ))
        }
        (Role::Operator | Role::Client(_), Some(target)) => {
            let member = parse_member(&target)?;
            let path = setup::stage_profile(&mut files, &args.dir, &role, member.id, &member.addr, None)?;
            Some(format!("{}; use it with --profile {}", path.display(), path.display()))
        }
        (Role::Operator | Role::Client(_), None) => None,
    };
    files.commit(args.force).map_err(|e| match e {
        setup::SetupError::Exists(path) => format!(
            "{} exists already: a certificate for {role} was issued before. Give --force to replace its files (a new key \
             and certificate), or use the ones there",
            path.display()
        )
        .into(),
        e => Box::<dyn std::error::Error>::from(e),
    })?;
    println!("issued a certificate for {role} into {}", dir.display());
    if !matches!(role, Role::Node(_)) {
        println!("HTTP API token in {}", dir.join(keyhome::http::tokens::TOKEN_FILE).display());
    }
    if let Some(companion) = companion {
        println!("wrote {companion}");
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

pub async fn shutdown_signal() {
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
