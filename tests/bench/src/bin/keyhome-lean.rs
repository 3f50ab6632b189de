//! keyhome-lean: a second, independent harness for the latency figures of `keyhome-compare`.
//! Both systems are driven by the leanest client that can speak to them: a blocking loop on this
//! thread, no async runtime, no background task. keyhome through a raw blocking Unix socket (its
//! local frames encoded by hand with `keyhome::wire`, not through `keyhome::client`), Redis
//! through the `redis` crate's synchronous connection (`SET NX PX`, then the compare-and-delete
//! script, as `keyhome-compare` does). Alternating within each round, it prints the p50 of a
//! lock+unlock pair on one key (re-lock) and on a fresh key each cycle (fresh key), and of a
//! pipelined cycle of each (one round trip a cycle: the last cycle's unlock goes in the same write
//! as this cycle's lock, as a cast for keyhome and in one pipeline with `EVALSHA` for Redis), so
//! the clients' own cost can be told from the systems' (docs/benchmarks.md, "An independent
//! harness"). It starts its own 3-node keyhome; Redis is the server `--redis` names (start one
//! on loopback first; compare.sh runs only keyhome-compare):
//!
//!     redis-server --port 26390 --bind 127.0.0.1 --save "" --appendonly no &
//!     $CARGO_TARGET_DIR/release/keyhome-lean --redis redis://127.0.0.1:26390/ --rounds 4

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use keyhome::wire::{self, LocalFrame, LocalRequest, MAX_CLIENT_FRAME, Request, Response};
use keyhome_compare::redis_lock::{self, BlockingLock};
use keyhome_compare::{Error, cluster_options, loadavg, machine_line, micros, percentile};
use keyhome_sim::cluster::Cluster;

const TTL: Duration = Duration::from_secs(10);
const WAIT: Duration = Duration::from_secs(30);

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Lock+unlock pairs per figure.
    #[arg(long, default_value_t = 3000)]
    iters: usize,
    /// Redis without persistence (redis://HOST:PORT).
    #[arg(long)]
    redis: String,
    /// Run only these scenarios (comma-separated; default all), e.g. to profile one of them.
    #[arg(long, value_delimiter = ',')]
    only: Vec<Scenario>,
}

/// The scenarios, as `--only` names them.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Scenario {
    Relock,
    Fresh,
    RelockPipelined,
    FreshPipelined,
}

impl Scenario {
    /// What the report calls it, and whether it locks a fresh key each cycle and pipelines.
    fn describe(self) -> (&'static str, bool, bool) {
        match self {
            Scenario::Relock => ("re-lock", false, false),
            Scenario::Fresh => ("fresh key", true, false),
            Scenario::RelockPipelined => ("re-lock, pipelined", false, true),
            Scenario::FreshPipelined => ("fresh key, pipelined", true, true),
        }
    }
}

/// A blocking connection to a node's local socket.
struct Raw {
    stream: UnixStream,
    next: u64,
    /// The handle the pipelined cycle holds between cycles.
    held: Option<u64>,
}

impl Raw {
    fn connect(path: &std::path::Path) -> Result<Raw, Error> {
        let mut raw = Raw { stream: UnixStream::connect(path)?, next: 1, held: None };
        match raw.read()? {
            LocalFrame::Hello(hello) if hello.protocols.serves(wire::LOCAL_PROTOCOL) => Ok(raw),
            other => Err(format!("the node greeted with {other:?}").into()),
        }
    }

    fn read(&mut self) -> Result<LocalFrame, Error> {
        let mut prefix = [0u8; 4];
        self.stream.read_exact(&mut prefix)?;
        let mut body = vec![0u8; u32::from_be_bytes(prefix) as usize];
        self.stream.read_exact(&mut body)?;
        Ok(wire::decode(&body)?)
    }

    /// One call, waited for; `before` goes in the same write, ahead of it.
    fn call_after(&mut self, before: Option<LocalRequest>, request: Request) -> Result<Response, Error> {
        let id = self.next;
        self.next += 1;
        let mut bytes = match before {
            Some(before) => wire::encode(&before, MAX_CLIENT_FRAME)?,
            None => Vec::new(),
        };
        bytes.extend(wire::encode(&LocalRequest::Call { id, request }, MAX_CLIENT_FRAME)?);
        self.stream.write_all(&bytes)?;
        loop {
            match self.read()? {
                LocalFrame::Answer { id: got, response } if got == id => return Ok(response),
                LocalFrame::Answer { .. } | LocalFrame::Event(_) => continue,
                other => return Err(format!("the node sent {other:?}").into()),
            }
        }
    }

    fn lock(&mut self, before: Option<LocalRequest>, key: &[u8]) -> Result<u64, Error> {
        match self.call_after(before, Request::Lock { key: key.to_vec(), ttl: TTL, wait: WAIT })? {
            Response::Locked(locked) => Ok(locked.handle),
            other => Err(format!("lock answered {other:?}").into()),
        }
    }

    fn unlock(&mut self, handle: u64) -> Result<(), Error> {
        match self.call_after(None, Request::Unlock { handle, note: None })? {
            Response::Unlocked => Ok(()),
            other => Err(format!("unlock answered {other:?}").into()),
        }
    }
}

/// One system's lock+unlock cycle, as a blocking client drives it.
trait Cycle {
    /// Locks `key` and unlocks it, each waited for.
    fn pair(&mut self, key: &str) -> Result<(), Error>;
    /// Locks `key`, sending the previous cycle's unlock with it: one round trip a cycle.
    fn pipelined(&mut self, key: &str) -> Result<(), Error>;
    /// Unlocks what the last pipelined cycle holds.
    fn settle(&mut self) -> Result<(), Error>;
}

impl Cycle for Raw {
    fn pair(&mut self, key: &str) -> Result<(), Error> {
        let handle = self.lock(None, key.as_bytes())?;
        self.unlock(handle)
    }

    /// The previous unlock goes as a cast, in one write with this lock.
    fn pipelined(&mut self, key: &str) -> Result<(), Error> {
        let before = self
            .held
            .take()
            .map(|handle| LocalRequest::Cast { request: Request::Unlock { handle, note: None } });
        self.held = Some(self.lock(before, key.as_bytes())?);
        Ok(())
    }

    fn settle(&mut self) -> Result<(), Error> {
        match self.held.take() {
            Some(handle) => self.unlock(handle),
            None => Ok(()),
        }
    }
}

/// A blocking Redis connection, and the lock its pipelined cycle holds between cycles.
struct Lean {
    lock: BlockingLock,
    held: Option<(String, String)>,
}

impl Cycle for Lean {
    fn pair(&mut self, key: &str) -> Result<(), Error> {
        self.lock.pair(key, TTL)
    }

    /// The previous unlock (`EVALSHA`) and this `SET NX PX` in one pipeline.
    fn pipelined(&mut self, key: &str) -> Result<(), Error> {
        let value = self.lock.value();
        let mut pipe = redis::pipe();
        if let Some((k, v)) = self.held.take() {
            pipe.cmd("EVALSHA").arg(self.lock.release.get_hash()).arg(1).arg(k).arg(v);
        }
        pipe.add_command(redis_lock::lock_command(key, &value, TTL));
        let replies: Vec<redis::Value> = pipe.query(&mut self.lock.conn)?;
        if !matches!(replies.last(), Some(redis::Value::Okay | redis::Value::SimpleString(_))) {
            return Err(format!("Redis: the key was held ({replies:?})").into());
        }
        if replies.len() == 2 && replies[0] != redis::Value::Int(1) {
            return Err("Redis: the lock was gone at unlock".into());
        }
        self.held = Some((key.to_owned(), value));
        Ok(())
    }

    fn settle(&mut self) -> Result<(), Error> {
        if let Some((k, v)) = self.held.take() {
            let _: i64 = self.lock.release.key(k).arg(v).invoke(&mut self.lock.conn)?;
        }
        Ok(())
    }
}

/// p50 in µs of `iters` cycles of `system` (after a tenth as many unmeasured): on one key, or a
/// fresh one each cycle; pipelined or not. Leaves nothing locked.
fn figure(
    system: &mut dyn Cycle,
    prefix: &str,
    iters: usize,
    fresh: bool,
    pipelined: bool,
) -> Result<f64, Error> {
    let mut samples = Vec::with_capacity(iters);
    for i in 0..iters + iters / 10 {
        let key = if fresh { format!("{prefix}-{i}") } else { prefix.to_owned() };
        let start = Instant::now();
        if pipelined {
            system.pipelined(&key)?
        } else {
            system.pair(&key)?
        }
        if i >= iters / 10 {
            samples.push(start.elapsed());
        }
    }
    system.settle()?;
    Ok(micros(percentile(&mut samples, 0.5)))
}

fn main() -> Result<(), Error> {
    let args = Args::parse();
    let cluster = Cluster::start(cluster_options());
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(cluster.wait_ready(&cluster.ids(), 1));
    let mut raw = Raw::connect(&cluster.local_socket(1))?;
    let mut lean = Lean { lock: BlockingLock::connect(&args.redis)?, held: None };
    // Loaded now: the pipelined cycle calls it by hash only.
    let _: String = redis::cmd("SCRIPT").arg("LOAD").arg(redis_lock::RELEASE).query(&mut lean.lock.conn)?;
    println!("# keyhome-lean: blocking clients, {} pairs per figure, {} rounds", args.iters, args.rounds);
    println!("{}", machine_line());
    println!("| round | scenario | keyhome (µs) | Redis (µs) | keyhome ÷ Redis | load before |");
    println!("| --- | --- | ---: | ---: | ---: | --- |");
    let chosen: Vec<_> = Scenario::value_variants()
        .iter()
        .filter(|s| args.only.is_empty() || args.only.contains(s))
        .map(|s| s.describe())
        .collect();
    for r in 0..args.rounds {
        let load = loadavg();
        for &(scenario, fresh, pipelined) in &chosen {
            let prefix = format!("lean-{r}-{}", scenario.replace([' ', ','], ""));
            let run = |system: &mut dyn Cycle| figure(system, &prefix, args.iters, fresh, pipelined);
            // Alternating: odd rounds start with Redis.
            let (k, red) = if r % 2 == 0 {
                let k = run(&mut raw)?;
                (k, run(&mut lean)?)
            } else {
                let red = run(&mut lean)?;
                (run(&mut raw)?, red)
            };
            println!("| {} | {scenario} | {k:.1} | {red:.1} | {:.2} | {load} |", r + 1, k / red);
        }
    }
    Ok(())
}
