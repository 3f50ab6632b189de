//! keyhome-compare: the same lock scenarios against a 3-node keyhome (started here with the test
//! harness, clients on the nodes' local sockets) and the peers compare.sh starts on loopback:
//! etcd (v3 lock API), ZooKeeper (the lock recipe of `zookeeper-client`), Redis (SET NX PX and a
//! compare-and-delete script; in memory, and with `appendfsync always`). One connection's
//! latency is timed for Redis through the `redis` crate's blocking connection, everything else
//! through each system's async client. Systems alternate within each round; every round prints
//! its tables with the machine's load, the last the medians over the rounds. See
//! docs/benchmarks.md, "Side by side".

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use keyhome::client::{Client, ClientLock};
use keyhome_compare::redis_lock::{self, BlockingLock};
use keyhome_compare::{
    Error, NODES, cluster_options, loadavg, machine_line, micros, percentile, wakeup_line,
};
use keyhome_sim::cluster::Cluster;
use keyhome_sim::hostile::measure::cpu_time;

/// How long a lock is asked for (no scenario holds one nearly this long).
const TTL: Duration = Duration::from_secs(10);
/// How long a contender waits for a lock before the run counts an error.
const WAIT: Duration = Duration::from_secs(30);
/// A Redis contender's pause between SET NX attempts (Redis has no waiting lock).
const REDIS_RETRY: Duration = Duration::from_millis(1);

#[derive(Parser)]
struct Args {
    /// Rounds; the summary gives the median of each figure over them.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Lock+unlock cycles per latency scenario and system.
    #[arg(long, default_value_t = 2000)]
    iters: usize,
    /// Seconds per throughput and hot-key run.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Runs of each CLI per round.
    #[arg(long, default_value_t = 30)]
    cli_runs: usize,
    /// etcd client URLs, comma-separated (one per member).
    #[arg(long)]
    etcd: Option<String>,
    /// ZooKeeper servers, HOST:PORT comma-separated (one per member).
    #[arg(long)]
    zookeeper: Option<String>,
    /// Redis without persistence (redis://HOST:PORT).
    #[arg(long)]
    redis: Option<String>,
    /// Redis with `appendonly yes`, `appendfsync always`.
    #[arg(long)]
    redis_aof: Option<String>,
    /// The etcdctl binary for the CLI scenario.
    #[arg(long, default_value = "etcdctl")]
    etcdctl: String,
    /// Run only these scenarios (comma-separated; default all).
    #[arg(long, value_enum, value_delimiter = ',')]
    only: Vec<Scenario>,
    /// Time the async clients' one-connection latency on `main`'s own thread, as runs A to I
    /// did, instead of in a task on the runtime's workers (to measure what that placement costs).
    #[arg(long)]
    latency_on_main: bool,
    /// Time Redis's one-connection latency through the `redis` crate's async multiplexed
    /// connection (as runs A to H did), not its blocking one, to compare the two clients.
    #[arg(long)]
    redis_async: bool,
    /// Run the hot key's contenders each on a thread of its own, with a single-threaded runtime
    /// (three applications), instead of as tasks on this process's runtime, to measure what that
    /// placement does to each system's handoffs.
    #[arg(long)]
    contenders_on_threads: bool,
    /// Also run keyhome on a second cluster whose nodes (one worker thread each) poll their
    /// sockets for this many µs after each message between nodes before they sleep
    /// (`busy_poll_us` in `node.toml`; 0: no such cluster), to measure what busy polling buys
    /// and costs beside the default nodes.
    #[arg(long, default_value_t = 0)]
    busy_poll_us: u64,
}

impl Args {
    fn latency_setup(&self) -> LatencySetup {
        LatencySetup { on_main: self.latency_on_main, redis_async: self.redis_async }
    }
}

/// Where [`latency`] runs each system's client, and which Redis client it uses.
#[derive(Clone, Copy)]
struct LatencySetup {
    /// The async clients on `main`'s own thread, not in a task.
    on_main: bool,
    /// Redis through its async client, like the others.
    redis_async: bool,
}

/// The scenarios, as `--only` names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Scenario {
    Relock,
    Fresh,
    Hot,
    Parallel,
    Cli,
}

impl Args {
    /// Whether `scenario` is to run.
    fn runs(&self, scenario: Scenario) -> bool {
        self.only.is_empty() || self.only.contains(&scenario)
    }
}

/// A system under test.
#[derive(Clone, Debug)]
enum System {
    /// keyhome on its nodes' local sockets (one per node); `pipelined`: unlocks sent without
    /// waiting for the answer; `busy_poll`: the cluster whose nodes busy-poll
    /// (`--busy-poll-us`).
    Keyhome {
        sockets: Vec<PathBuf>,
        /// The nodes' processes, for their CPU time.
        pids: Vec<u32>,
        pipelined: bool,
        busy_poll: bool,
    },
    Etcd(Vec<String>),
    Zookeeper(Vec<String>),
    Redis {
        url: String,
        aof: bool,
    },
}

impl System {
    fn name(&self) -> &'static str {
        match self {
            System::Keyhome { pipelined: false, busy_poll: false, .. } => "keyhome",
            System::Keyhome { pipelined: true, busy_poll: false, .. } => "keyhome (pipelined unlock)",
            System::Keyhome { pipelined: false, busy_poll: true, .. } => "keyhome, busy polling",
            System::Keyhome { pipelined: true, busy_poll: true, .. } => {
                "keyhome, busy polling (pipelined unlock)"
            }
            System::Etcd(_) => "etcd v3lock",
            System::Zookeeper(_) => "ZooKeeper",
            System::Redis { aof: false, .. } => "Redis (memory)",
            System::Redis { aof: true, .. } => "Redis AOF always",
        }
    }

    /// What a lock costs in durability, and whether the holder gets a fencing token.
    fn guarantees(&self) -> &'static str {
        match self {
            System::Keyhome { .. } => {
                "membership and incarnations durable (Paxos, fsync); locks in memory under leases; \
                 fencing token (epoch, incarnation, counter)"
            }
            System::Etcd(_) => "each lock a Raft write, fsynced on a majority; fencing: the revision",
            System::Zookeeper(_) => {
                "each lock a ZAB write (a znode), logged on a majority; fencing: the znode's sequence"
            }
            System::Redis { aof: false, .. } => "nothing durable, one server; no fencing token",
            System::Redis { aof: true, .. } => "each lock fsynced to one server's AOF; no fencing token",
        }
    }
}

/// An ordered fencing token, where the system gives one.
type Token = (u64, u64, u64, u64);

/// One client connection of a system.
enum Conn {
    Keyhome {
        client: Client,
        pipelined: bool,
    },
    /// Boxed: the etcd client is some 3.5 KB.
    Etcd {
        client: Box<etcd_client::Client>,
        lease: i64,
    },
    Zookeeper(zookeeper_client::Client),
    Redis {
        conn: redis::aio::MultiplexedConnection,
        release: redis::Script,
        next: u64,
        me: usize,
    },
}

/// A lock held through a [`Conn`].
enum Held {
    Keyhome(ClientLock),
    Etcd(Vec<u8>),
    Zookeeper(String),
    Redis { key: String, value: String },
}

impl Conn {
    /// Connection number `i` (spread over the members).
    async fn open(system: &System, i: usize) -> Result<Conn, Error> {
        Ok(match system {
            System::Keyhome { sockets, pipelined, .. } => {
                let client = Client::connect_local(&sockets[i % sockets.len()]).await?;
                Conn::Keyhome { client, pipelined: *pipelined }
            }
            System::Etcd(endpoints) => {
                let mut client =
                    etcd_client::Client::connect([&endpoints[i % endpoints.len()]], None).await?;
                let lease = client.lease_grant(60, None).await?.id();
                Conn::Etcd { client: Box::new(client), lease }
            }
            System::Zookeeper(servers) => {
                Conn::Zookeeper(zookeeper_client::Client::connect(&servers[i % servers.len()]).await?)
            }
            System::Redis { url, .. } => {
                let conn = redis::Client::open(url.as_str())?.get_multiplexed_async_connection().await?;
                Conn::Redis { conn, release: redis_lock::release_script(), next: 0, me: i }
            }
        })
    }

    /// Locks `key`, waiting for it; returns the hold and its fencing token, if any.
    async fn lock(&mut self, key: &str) -> Result<(Held, Option<Token>), Error> {
        match self {
            Conn::Keyhome { client, .. } => {
                let held = client.lock(key.as_bytes(), TTL, WAIT).await?;
                let t = held.token();
                Ok((Held::Keyhome(held), Some((t.epoch, t.incarnation, t.counter, t.local_seq))))
            }
            Conn::Etcd { client, lease } => {
                let options = etcd_client::LockOptions::new().with_lease(*lease);
                let answer = client.lock(key, Some(options)).await?;
                let revision = answer.header().map_or(0, |h| h.revision()) as u64;
                Ok((Held::Etcd(answer.key().to_vec()), Some((revision, 0, 0, 0))))
            }
            Conn::Zookeeper(client) => {
                let dir = format!("/bench/{key}");
                let prefix = zookeeper_client::LockPrefix::new_curator(&dir, "lock-")?;
                let acl = zookeeper_client::Acls::anyone_all();
                let options = zookeeper_client::LockOptions::new(acl)
                    .with_ancestor_options(zookeeper_client::CreateMode::Persistent.with_acls(acl))?;
                let lock = client.lock(prefix, b"", options).await?;
                let path = lock.lock_path().to_owned();
                // Released by the explicit delete in `unlock` (waited for, as every system's
                // unlock is): the guard's own background delete would be a second request.
                // Forgetting it leaks only its copy of the path.
                std::mem::forget(lock);
                let sequence = path.rsplit('-').next().and_then(|s| s.parse().ok()).unwrap_or(0);
                Ok((Held::Zookeeper(path), Some((sequence, 0, 0, 0))))
            }
            Conn::Redis { conn, next, me, .. } => {
                *next += 1;
                let value = format!("{me}-{next}");
                let deadline = Instant::now() + WAIT;
                loop {
                    let set: Option<String> =
                        redis_lock::lock_command(key, &value, TTL).query_async(conn).await?;
                    if set.is_some() {
                        return Ok((Held::Redis { key: key.to_owned(), value }, None));
                    }
                    if Instant::now() > deadline {
                        return Err("Redis: not locked within the wait".into());
                    }
                    tokio::time::sleep(REDIS_RETRY).await;
                }
            }
        }
    }

    async fn unlock(&mut self, held: Held) -> Result<(), Error> {
        match (self, held) {
            (Conn::Keyhome { pipelined: true, .. }, Held::Keyhome(held)) => held.unlock_nowait(None).await?,
            (Conn::Keyhome { .. }, Held::Keyhome(held)) => held.unlock(None).await?,
            (Conn::Etcd { client, .. }, Held::Etcd(key)) => {
                client.unlock(key).await?;
            }
            (Conn::Zookeeper(client), Held::Zookeeper(path)) => client.delete(&path, None).await?,
            (Conn::Redis { conn, release, .. }, Held::Redis { key, value }) => {
                let deleted: i64 = release.key(key).arg(value).invoke_async(conn).await?;
                if deleted != 1 {
                    return Err("Redis: the lock was gone at unlock".into());
                }
            }
            _ => return Err("a hold unlocked through another system".into()),
        }
        Ok(())
    }
}

/// p50 (µs) of `iters` lock+unlock cycles on one connection, on `key(i)`: every client as an
/// application would run it, in a task on this process's multi-thread runtime, but Redis's through
/// its blocking connection ([`BlockingLock`]), on a thread of its own, unless `setup` says
/// otherwise: any advantage of the client's set-up goes to Redis. Not on `main`'s own thread
/// unless `setup.on_main`: a future there is not run by the runtime's workers, so every answer
/// costs it a wake-up of another thread, a cost of where the caller sits, not of the system.
async fn latency(
    system: &System,
    iters: usize,
    setup: LatencySetup,
    key: impl Fn(usize) -> String + Send + 'static,
) -> Result<f64, Error> {
    let mut samples = Vec::with_capacity(iters);
    if let System::Redis { url, .. } = system
        && !setup.redis_async
    {
        let url = url.clone();
        return tokio::task::spawn_blocking(move || {
            let mut lock = BlockingLock::connect(&url)?;
            for i in 0..iters {
                let start = Instant::now();
                lock.pair(&key(i), TTL)?;
                samples.push(start.elapsed());
            }
            Ok(micros(percentile(&mut samples, 0.5)))
        })
        .await?;
    }
    let system = system.clone();
    let cycles = async move {
        let mut conn = Conn::open(&system, 0).await?;
        for i in 0..iters {
            let start = Instant::now();
            let (held, _) = conn.lock(&key(i)).await?;
            conn.unlock(held).await?;
            samples.push(start.elapsed());
        }
        Ok(micros(percentile(&mut samples, 0.5)))
    };
    if setup.on_main { cycles.await } else { tokio::spawn(cycles).await? }
}

/// What the hot-key contenders saw.
#[derive(Default)]
struct Hot {
    holder: Option<usize>,
    last_holder: Option<usize>,
    last_token: Option<Token>,
    acquisitions: u64,
    handoffs: u64,
    overlaps: u64,
    token_regressions: u64,
    waits: Vec<Duration>,
}

/// The keyhome nodes' own counters, summed over the cluster and over every key (the idle
/// releases of earlier scenarios' keys too): delegation messages between nodes (not those a node
/// sends itself, as the key's home), locks admitted with no message, and the CPU time the
/// nodes' processes used.
struct NodeTally {
    delegation_sent: u64,
    locks: u64,
    locks_immediate: u64,
    cpu: Duration,
}

impl NodeTally {
    /// The counters of `system`'s nodes now, if it is keyhome.
    async fn of(system: &System) -> Option<Result<NodeTally, Error>> {
        let System::Keyhome { sockets, pids, .. } = system else { return None };
        Some(NodeTally::now(sockets, pids).await)
    }

    async fn now(sockets: &[PathBuf], pids: &[u32]) -> Result<NodeTally, Error> {
        let cpu = pids
            .iter()
            .map(|&pid| cpu_time(pid).ok_or(format!("node process {pid} is gone")))
            .sum::<Result<_, _>>()?;
        let mut tally = NodeTally { delegation_sent: 0, locks: 0, locks_immediate: 0, cpu };
        for socket in sockets {
            let status = Client::connect_local(socket).await?.status().await?;
            tally.delegation_sent += status.counters.delegation_sent;
            tally.locks += status.counters.locks;
            tally.locks_immediate += status.counters.locks_immediate;
        }
        Ok(tally)
    }

    /// Delegation messages between nodes and the nodes' CPU time per handoff, and the share of
    /// locks admitted at once, since `before`, for a run of `handoffs` handoffs.
    fn since(&self, before: &NodeTally, handoffs: u64) -> String {
        if handoffs == 0 {
            return "no handoff to count messages for".into();
        }
        let sent = self.delegation_sent.saturating_sub(before.delegation_sent);
        let locks = self.locks.saturating_sub(before.locks).max(1);
        let immediate = self.locks_immediate.saturating_sub(before.locks_immediate);
        format!(
            "{:.2} delegation messages between nodes per handoff (all keys), {:.1} % of locks admitted at once, nodes' CPU {:.0} µs per handoff",
            sent as f64 / handoffs as f64,
            100.0 * immediate as f64 / locks as f64,
            self.cpu.saturating_sub(before.cpu).as_secs_f64() * 1e6 / handoffs as f64
        )
    }
}

/// [`NODES`] contenders, one per member, on one key for `seconds`: tasks on this runtime's
/// workers, or with `on_threads` each on a thread of its own with a single-threaded runtime (as
/// three applications would be, one beside each member).
async fn hot_key(system: &System, key: &str, seconds: f64, on_threads: bool) -> Result<Hot, Error> {
    let state = Arc::new(Mutex::new(Hot::default()));
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    if on_threads {
        let contenders: Vec<_> = (0..NODES)
            .map(|me| {
                let (state, key, system) = (Arc::clone(&state), key.to_owned(), system.clone());
                std::thread::spawn(move || -> Result<(), Error> {
                    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
                    runtime.block_on(contend(&system, me, &key, &state, deadline))
                })
            })
            .collect();
        // Joined off this runtime's workers, which the contenders' clients do not use.
        let joined = tokio::task::spawn_blocking(move || {
            contenders
                .into_iter()
                .map(|t| t.join().unwrap_or_else(|_| Err("a contender panicked".into())))
                .collect::<Vec<_>>()
        })
        .await?;
        joined.into_iter().collect::<Result<(), Error>>()?;
    } else {
        let mut tasks = tokio::task::JoinSet::new();
        for me in 0..NODES {
            let (state, key, system) = (Arc::clone(&state), key.to_owned(), system.clone());
            tasks.spawn(async move { contend(&system, me, &key, &state, deadline).await });
        }
        while let Some(done) = tasks.join_next().await {
            done??;
        }
    }
    let hot = std::mem::take(&mut *state.lock().unwrap_or_else(|p| p.into_inner()));
    Ok(hot)
}

/// Contender `me` of [`hot_key`]: locks and unlocks `key` until `deadline`, recording in `state`.
async fn contend(
    system: &System,
    me: usize,
    key: &str,
    state: &Mutex<Hot>,
    deadline: Instant,
) -> Result<(), Error> {
    let mut conn = Conn::open(system, me).await?;
    while Instant::now() < deadline {
        let asked = Instant::now();
        let (held, token) = conn.lock(key).await?;
        {
            let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
            s.waits.push(asked.elapsed());
            s.overlaps += u64::from(s.holder.is_some());
            s.holder = Some(me);
            s.acquisitions += 1;
            s.handoffs += u64::from(s.last_holder.is_some_and(|h| h != me));
            s.last_holder = Some(me);
            if let Some(t) = token {
                s.token_regressions += u64::from(s.last_token.is_some_and(|last| last >= t));
                s.last_token = Some(t);
            }
        }
        // Hold across a scheduling point, so an overlapping holder would be seen.
        tokio::task::yield_now().await;
        state.lock().unwrap_or_else(|p| p.into_inner()).holder = None;
        conn.unlock(held).await?;
    }
    Ok(())
}

/// `clients` connections, each cycling on its own key for `seconds`; ops/s in all.
async fn parallel(system: &System, clients: usize, prefix: &str, seconds: f64) -> Result<f64, Error> {
    let mut conns = Vec::new();
    for i in 0..clients {
        conns.push(Conn::open(system, i).await?);
    }
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(seconds);
    let mut tasks = tokio::task::JoinSet::new();
    for (i, mut conn) in conns.into_iter().enumerate() {
        let key = format!("{prefix}-{i}");
        tasks.spawn(async move {
            let mut ops = 0u64;
            while Instant::now() < deadline {
                let (held, _) = conn.lock(&key).await?;
                conn.unlock(held).await?;
                ops += 1;
            }
            Ok::<_, Error>(ops)
        });
    }
    let mut ops = 0;
    while let Some(done) = tasks.join_next().await {
        ops += done??;
    }
    Ok(ops as f64 / start.elapsed().as_secs_f64())
}

/// p50 (ms) of `runs` runs of `command`, each of which must succeed.
fn cli_p50(mut command: impl FnMut() -> std::process::Command, runs: usize) -> Result<f64, Error> {
    let mut samples = Vec::new();
    for _ in 0..runs {
        let start = Instant::now();
        let out = command().output()?;
        if !out.status.success() {
            return Err(format!("{:?} failed: {}", command(), String::from_utf8_lossy(&out.stderr)).into());
        }
        samples.push(start.elapsed());
    }
    Ok(percentile(&mut samples, 0.5).as_secs_f64() * 1e3)
}

/// One figure of one system in one round.
#[derive(Clone, Debug)]
struct Figure {
    scenario: &'static str,
    system: &'static str,
    value: f64,
    /// Anything to say beside the value (hot key details, a failure).
    detail: String,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    if values.is_empty() { f64::NAN } else { values[values.len() / 2] }
}

/// The machine's CPU time so far, from `/proc/stat`, in clock ticks: all of it, and what the
/// hypervisor gave to other guests (steal). On a shared virtual machine steal slows every system
/// alike, and varies from minute to minute: each round and each hot-key run say how much.
#[derive(Clone, Copy, Default)]
struct CpuTimes {
    total: u64,
    steal: u64,
}

impl CpuTimes {
    fn now() -> CpuTimes {
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let Some(line) = stat.lines().find(|l| l.starts_with("cpu ")) else { return CpuTimes::default() };
        let ticks: Vec<u64> = line.split_whitespace().skip(1).filter_map(|t| t.parse().ok()).collect();
        // user nice system idle iowait irq softirq steal guest guest_nice: guest time is counted
        // in user already.
        CpuTimes { total: ticks.iter().take(8).sum(), steal: ticks.get(7).copied().unwrap_or(0) }
    }

    /// The share of CPU time stolen since `earlier`, as a percentage.
    fn stolen_since(&self, earlier: CpuTimes) -> String {
        let total = self.total.saturating_sub(earlier.total);
        let steal = self.steal.saturating_sub(earlier.steal);
        if total == 0 { "n/a".into() } else { format!("{:.0} %", 100.0 * steal as f64 / total as f64) }
    }
}

/// Prints one table per scenario: each system's value and keyhome ÷ it.
fn print_tables(title: &str, figures: &[Figure], systems: &[System]) {
    println!("\n## {title}\n");
    let mut scenarios: Vec<&'static str> = figures.iter().map(|f| f.scenario).collect();
    scenarios.dedup();
    for scenario in scenarios {
        println!("| {scenario} | value | keyhome ÷ it | details |\n| --- | ---: | ---: | --- |");
        let of = |system: &str| figures.iter().find(|f| f.scenario == scenario && f.system == system);
        let base = of("keyhome").map(|f| f.value);
        for system in systems {
            let Some(f) = of(system.name()) else { continue };
            let ratio = base.map_or(String::new(), |b| format!("{:.2}", b / f.value));
            println!("| {} | {:.1} | {ratio} | {} |", f.system, f.value, f.detail);
        }
        println!();
    }
    println!("What each system makes durable, and whether it gives a fencing token:\n");
    for system in systems {
        println!("- {}: {}", system.name(), system.guarantees());
    }
}

async fn round(args: &Args, cluster: &Cluster, systems: &[System], round: usize) -> Vec<Figure> {
    let mut figures = Vec::new();
    let mut push = |scenario, system: &System, result: Result<(f64, String), Error>| {
        let (value, detail) = result.unwrap_or_else(|e| (f64::NAN, format!("FAILED: {e}")));
        figures.push(Figure { scenario, system: system.name(), value, detail });
    };
    // Systems alternate: each round starts with another one.
    let order: Vec<&System> =
        systems.iter().cycle().skip(round % systems.len()).take(systems.len()).collect();
    let r = round;
    let run = std::process::id();
    // The systems, for the scenarios `--only` keeps.
    let systems_for = |scenario| if args.runs(scenario) { order.as_slice() } else { &[] };
    for system in systems_for(Scenario::Relock) {
        // Keys of this run alone (its process id): a key an earlier, interrupted run left locked
        // would fail Redis's blocking lock, which does not wait.
        let result =
            latency(system, args.iters, args.latency_setup(), move |_| format!("relock-{run}-{r}")).await;
        push("re-lock, lock+unlock p50 (µs)", system, result.map(|v| (v, String::new())));
    }
    for system in systems_for(Scenario::Fresh) {
        let name = system.name().replace(' ', "_").replace(['(', ')'], "");
        let result =
            latency(system, args.iters, args.latency_setup(), move |i| format!("fresh-{name}-{run}-{r}-{i}"))
                .await;
        push("fresh key, lock+unlock p50 (µs)", system, result.map(|v| (v, String::new())));
    }
    for system in systems_for(Scenario::Hot) {
        let cpu = CpuTimes::now();
        let before = NodeTally::of(system).await;
        let result = hot_key(system, &format!("hot-{r}"), args.seconds, args.contenders_on_threads).await;
        let after = NodeTally::of(system).await;
        let tally = move |handoffs| match (before, after) {
            (Some(Ok(before)), Some(Ok(after))) => format!(", {}", after.since(&before, handoffs)),
            (Some(Err(e)), _) | (_, Some(Err(e))) => format!(", no message count (the nodes' status: {e})"),
            _ => String::new(),
        };
        let result = result.map(|mut hot| {
            let rate = hot.handoffs as f64 / args.seconds;
            let detail = format!(
                "{} acquisitions, {} handoffs, wait p50 {:.0} µs p99 {:.0} µs, overlaps {}, token regressions {}, CPU stolen {}{}",
                hot.acquisitions,
                hot.handoffs,
                micros(percentile(&mut hot.waits, 0.5)),
                micros(percentile(&mut hot.waits, 0.99)),
                hot.overlaps,
                if matches!(system, System::Redis { .. }) {
                    "n/a (no token)".into()
                } else {
                    hot.token_regressions.to_string()
                },
                CpuTimes::now().stolen_since(cpu),
                tally(hot.handoffs),
            );
            (rate, detail)
        });
        push("hot key, 3 contenders on 3 members, handoffs/s", system, result);
    }
    for (clients, scenario) in
        [(12, "12 clients, distinct keys, ops/s"), (48, "48 clients, distinct keys, ops/s")]
    {
        for system in systems_for(Scenario::Parallel) {
            let prefix = format!("par{clients}-{}-{r}", system.name().len());
            let result = parallel(system, clients, &prefix, args.seconds).await;
            push(scenario, system, result.map(|v| (v, String::new())));
        }
    }
    let profile = cluster.dir.join("client-app/profile.toml");
    let profile = profile.to_string_lossy().into_owned();
    for system in systems_for(Scenario::Cli) {
        let result = match system {
            // Spawned as etcdctl is: `Cluster::cli_command`'s death signal (a `pre_exec`) makes
            // std fork this whole process, 0.1 to 0.5 ms a run that etcdctl did not pay
            // (docs/benchmarks.md, run M).
            System::Keyhome { pipelined: false, busy_poll: false, .. } => cli_p50(
                || cluster.cli_spawned(&["lock", "--profile", &profile, "cli-key", "--", "true"]),
                args.cli_runs,
            ),
            System::Etcd(endpoints) => cli_p50(
                || {
                    let mut c = std::process::Command::new(&args.etcdctl);
                    c.env("ETCDCTL_API", "3").args([
                        "--endpoints",
                        &endpoints.join(","),
                        "lock",
                        "cli-key",
                        "true",
                    ]);
                    c
                },
                args.cli_runs,
            ),
            _ => continue,
        };
        push("CLI `lock k -- true` p50 (ms)", system, result.map(|v| (v, String::new())));
    }
    figures
}

fn split(list: &Option<String>) -> Option<Vec<String>> {
    list.as_ref().map(|l| l.split(',').map(str::to_owned).collect())
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let args = Args::parse();
    let cluster = Cluster::start(cluster_options());
    cluster.wait_ready(&cluster.ids(), 1).await;
    let keyhome = |cluster: &Cluster, busy_poll: bool| {
        let sockets: Vec<PathBuf> = cluster.ids().into_iter().map(|id| cluster.local_socket(id)).collect();
        let pids: Vec<u32> =
            cluster.ids().into_iter().map(|id| cluster.pid(id).expect("a running node")).collect();
        [false, true].map(|pipelined| System::Keyhome {
            sockets: sockets.clone(),
            pids: pids.clone(),
            pipelined,
            busy_poll,
        })
    };
    let mut systems: Vec<System> = keyhome(&cluster, false).into();
    // Kept alive for the run; idle (a timer call now and then) while the other systems run.
    let polled = match args.busy_poll_us {
        0 => None,
        us => {
            let mut polled = Cluster::layout(cluster_options());
            for id in polled.ids() {
                polled.edit_config(id, |config| {
                    config.busy_poll_us = us;
                    // Busy polling needs a runtime of one worker (node/src/busy_poll.rs).
                    config.worker_threads = 1;
                });
                polled.start_node(id);
            }
            polled.wait_ready(&polled.ids(), 1).await;
            systems.extend(keyhome(&polled, true));
            Some(polled)
        }
    };
    systems.extend(split(&args.etcd).map(System::Etcd));
    systems.extend(split(&args.zookeeper).map(System::Zookeeper));
    systems.extend(args.redis.clone().map(|url| System::Redis { url, aof: false }));
    systems.extend(args.redis_aof.clone().map(|url| System::Redis { url, aof: true }));

    println!("# keyhome side by side: {} rounds; {}", args.rounds, std::env::consts::ARCH);
    println!("systems: {}", systems.iter().map(System::name).collect::<Vec<_>>().join(", "));
    println!("{}", machine_line());
    if polled.is_some() {
        println!(
            "keyhome, busy polling: a second cluster, its nodes with busy_poll_us = {}",
            args.busy_poll_us
        );
    }

    let mut all = Vec::new();
    for r in 0..args.rounds {
        let (load, cpu) = (loadavg(), CpuTimes::now());
        let figures = round(&args, &cluster, &systems, r).await;
        print_tables(
            &format!(
                "Round {} (load before: {load}; after: {}; CPU stolen by the hypervisor: {}; \
                 wake-up round trip after: {})",
                r + 1,
                loadavg(),
                CpuTimes::now().stolen_since(cpu),
                wakeup_line(),
            ),
            &figures,
            &systems,
        );
        all.extend(figures);
    }
    let mut medians = Vec::new();
    let mut keys: Vec<(&'static str, &'static str)> = all.iter().map(|f| (f.scenario, f.system)).collect();
    keys.sort();
    keys.dedup();
    for (scenario, system) in keys {
        let values =
            all.iter().filter(|f| f.scenario == scenario && f.system == system).map(|f| f.value).collect();
        medians.push(Figure {
            scenario,
            system,
            value: median(values),
            detail: format!("median of {}", args.rounds),
        });
    }
    // Keep the scenarios in the order they ran.
    medians.sort_by_key(|m| all.iter().position(|f| f.scenario == m.scenario));
    print_tables(&format!("Medians over {} rounds", args.rounds), &medians, &systems);
    Ok(())
}
