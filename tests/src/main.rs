//! `keyhome-sim`: runs many seeds of the whole-cluster simulations.
//!
//! ```text
//! cargo run --release -p keyhome-sim -- --seeds 20000          # seeds 0..20000, both simulations
//! cargo run --release -p keyhome-sim -- --seed 1234            # replay one seed, with details
//! cargo run --release -p keyhome-sim -- --epochs --seeds 2000  # the epoch simulation only
//! cargo run --release -p keyhome-sim -- --locks --seeds 2000   # the lock simulation only
//! cargo run --release -p keyhome-sim -- --seeds 2000 --bug activation-wait   # see a bug caught
//! cargo run --release -p keyhome-sim -- --seeds 500 --lock-bug no-quarantine
//! cargo run --release -p keyhome-sim -- --calm --seeds 300 --stats   # epoch changes, no faults
//! cargo run --release -p keyhome-sim -- --calm --seeds 30 --lock-bug no-handover
//! ```
//! The last line is always `seeds: N violations: V rate: R seeds/s`.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use keyhome_sim::locks::{HandoverStats, LockOptions, LockReport, lock_bug, run_lock_seed};
use keyhome_sim::{Options, Report, bug_switch, run_seed};

const USAGE: &str = "usage: keyhome-sim [--seeds N] [--start S] [--seed S] [--epochs | --locks] [--members M]
                   [--threads T] [--bug NAME] [--lock-bug NAME] [--calm] [--hostile] [--stats] [--trace]

By default every seed runs both simulations: the epoch simulation (node cores, no locks), then the lock
simulation (epoch cores, homes, holders, clients and a fenced resource), each drawn from the seed
exactly as when run alone. A seed passes only if both pass; violations count both.

  --seeds N     run N seeds (default 1000), starting at --start (default 0)
  --seed S      run the single seed S and print its details
  --epochs      run the epoch simulation only
  --locks       run the lock simulation only
  --members M   fix the number of genesis members (3..=7; default: drawn per seed, 3..=7 for
                the epoch simulation, 3..=5 for the lock simulation)
  --threads T   worker threads (default: available cores)
  --bug NAME    switch off one epoch safety rule: acceptor-durability, renewal-cutoff,
                activation-wait, epoch-floor, incarnation; or stranger-majority (a node believes
                a stranger's epoch only from a majority of its members: a liveness rule, seen as
                NoProgress). Runs the epoch simulation only,
                unless --locks is given too (the lock simulation with that rule off)
  --lock-bug NAME  switch off one delegation rule: deadline-from-receipt, no-rate-margin,
                release-before-revoke, no-quarantine, ignore-activation, shared-serials (a node's key
                shards number their handles alike), forget-passes (a home forgets the successor a
                holder passed the key to), no-outbox-hold (key shards send messages under an
                epoch not yet durable), unshrunk-credit (a grant's credit for the wait in line
                not shrunk by the rate bound), stale-credit-end (a successor credited again keeps
                its first end), late-handover (a home adopts a handover after its activation
                wait), restart-hands-back (a holder hands back a grant answering an earlier
                run's request), short-past (a holder forgets an ended delegation before its
                late answers can arrive), renewal-shortens (a renewal's shorter lease brings a
                handle's deadline earlier), incarnation,
                delegation-bound (an earlier epoch's lease lets a home grant the current
                epoch's longer delegations); or one
                epoch-change rule, caught only with --calm: no-handover (homes adopt no
                handover), same-home-wait (homes wait out the activation wait for every key).
                Runs the lock simulation only
  --calm        the lock simulation only, in calm runs: no faults, three operator changes 0.8 s
                apart, and the epoch-change checks enforced (a key that keeps its home is never
                refused Activating; a key handed over by its old home is adopted before the
                activation wait)
  --stats       print event, message and latency counts; for the lock simulation also what
                keys with waiting clients saw across epoch changes
  --hostile     full-strength nemeses, more changes (and, for locks, pauses and clients)
  --trace       print every event (use with --seed)
  --strict-handoff  accepted for old replay commands: handoffs are always checked strictly";

/// Which simulations a run covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Parts {
    Both,
    Epochs,
    Locks,
}

struct Args {
    start: u64,
    count: u64,
    single: bool,
    threads: usize,
    options: Options,
    bug: Option<String>,
    stats: bool,
    parts: Parts,
    lock_bug: Option<String>,
    calm: bool,
}

/// Parses the command line; `Err` carries the message to print.
fn parse(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut parsed = Args {
        start: 0,
        count: 1000,
        single: false,
        threads,
        options: Options::default(),
        bug: None,
        stats: false,
        parts: Parts::Both,
        lock_bug: None,
        calm: false,
    };
    let (mut epochs, mut locks) = (false, false);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        let number =
            |name: &str, v: String| v.parse::<u64>().map_err(|_| format!("{name}: not a number: {v}"));
        match arg.as_str() {
            "--seeds" => parsed.count = number("--seeds", value("--seeds")?)?,
            "--start" => parsed.start = number("--start", value("--start")?)?,
            "--seed" => {
                parsed.start = number("--seed", value("--seed")?)?;
                parsed.count = 1;
                parsed.single = true;
            }
            "--members" => {
                let m = number("--members", value("--members")?)?;
                if !(3..=7).contains(&m) {
                    return Err("--members must be 3 to 7".into());
                }
                parsed.options.members = Some(m as usize);
            }
            "--threads" => parsed.threads = number("--threads", value("--threads")?)?.clamp(1, 64) as usize,
            "--bug" => {
                let name = value("--bug")?;
                parsed.options.bugs = bug_switch(&name).ok_or(format!("unknown bug {name}\n{USAGE}"))?;
                parsed.bug = Some(name);
            }
            "--stats" => parsed.stats = true,
            "--epochs" => epochs = true,
            "--locks" => locks = true,
            "--calm" => parsed.calm = true,
            "--strict-handoff" => {}
            "--lock-bug" => {
                let name = value("--lock-bug")?;
                if lock_bug(&name, LockOptions::default()).is_none() {
                    return Err(format!("unknown lock bug {name}\n{USAGE}"));
                }
                parsed.lock_bug = Some(name);
            }
            "--trace" => parsed.options.trace = true,
            "--hostile" => parsed.options.hostile = true,
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    if parsed.calm && parsed.options.hostile {
        return Err("--calm runs have no faults; --hostile does not apply".into());
    }
    let lock_only = parsed.lock_bug.is_some() || parsed.calm;
    parsed.parts = match (epochs, locks) {
        (true, true) => {
            return Err("--epochs and --locks exclude each other; give neither to run both".into());
        }
        (true, false) if lock_only => return Err("--lock-bug and --calm need the lock simulation".into()),
        (true, false) => Parts::Epochs,
        (false, true) => Parts::Locks,
        // A bug switch selects the simulation it belongs to.
        (false, false) if lock_only => Parts::Locks,
        (false, false) if parsed.bug.is_some() => Parts::Epochs,
        (false, false) => Parts::Both,
    };
    Ok(parsed)
}

/// The command that replays `seed` with the options of this run; `part` names the simulation
/// to replay alone (`None`: as this run did).
fn replay_command(seed: u64, args: &Args, part: Option<Parts>) -> String {
    let mut cmd = String::from("cargo run --release -p keyhome-sim --");
    match part.unwrap_or(args.parts) {
        Parts::Both => {}
        Parts::Epochs => cmd += " --epochs",
        Parts::Locks => cmd += " --locks",
    }
    if args.calm {
        cmd += " --calm";
    }
    cmd += &format!(" --seed {seed}");
    if let Some(m) = args.options.members {
        cmd += &format!(" --members {m}");
    }
    if args.options.hostile {
        cmd += " --hostile";
    }
    if let Some(b) = &args.bug {
        cmd += &format!(" --bug {b}");
    }
    if let Some(b) = &args.lock_bug {
        cmd += &format!(" --lock-bug {b}");
    }
    cmd
}

/// What one seed did: the report of each simulation that ran.
struct SeedReport {
    seed: u64,
    epochs: Option<Report>,
    locks: Option<LockReport>,
}

impl SeedReport {
    fn violations(&self) -> usize {
        self.epochs.as_ref().map_or(0, |r| r.violations.len())
            + self.locks.as_ref().map_or(0, |r| r.violations.len())
    }

    /// The first violation of each simulation that failed.
    fn failures(&self) -> Vec<(Parts, String)> {
        let epochs =
            self.epochs.as_ref().and_then(|r| Some((Parts::Epochs, r.violations.first()?.to_string())));
        let locks = self.locks.as_ref().and_then(|r| Some((Parts::Locks, r.violations.first()?.to_string())));
        epochs.into_iter().chain(locks).collect()
    }
}

/// Lists the first failing seeds with their replay commands, then prints the last line,
/// `seeds: N violations: V rate: R seeds/s`.
fn conclude(args: &Args, reports: &[SeedReport], elapsed: f64) -> ExitCode {
    let failed: Vec<(u64, Parts, String)> =
        reports.iter().flat_map(|r| r.failures().into_iter().map(|(part, v)| (r.seed, part, v))).collect();
    for (seed, part, violation) in failed.iter().take(20) {
        if args.parts == Parts::Both {
            let name = if *part == Parts::Epochs { "epoch simulation" } else { "lock simulation" };
            println!("seed {seed} FAILED in the {name}: {violation}");
            println!("  replay: {}", replay_command(*seed, args, Some(*part)));
        } else {
            println!("seed {seed} FAILED: {violation}");
            println!("  replay: {}", replay_command(*seed, args, None));
        }
    }
    if failed.len() > 20 {
        println!("... and {} more failures", failed.len() - 20);
    }
    let violations: usize = reports.iter().map(SeedReport::violations).sum();
    let seeds = reports.len();
    let rate = seeds as f64 / elapsed.max(1e-9);
    println!("seeds: {seeds} violations: {violations} rate: {rate:.0} seeds/s");
    if violations == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// The options of the lock simulation for this run.
fn lock_options(args: &Args) -> LockOptions {
    let options = LockOptions {
        members: args.options.members,
        trace: args.options.trace,
        hostile: args.options.hostile,
        epoch_bugs: args.options.bugs,
        calm: args.calm,
        ..LockOptions::default()
    };
    match &args.lock_bug {
        Some(name) => lock_bug(name, options).expect("checked when parsing"),
        None => options,
    }
}

fn main() -> ExitCode {
    let args = match parse(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(msg) => {
            eprintln!("{msg}");
            return ExitCode::from(2);
        }
    };
    let epoch_options = &args.options;
    let lock_options = lock_options(&args);
    let (epochs, locks) = (args.parts != Parts::Locks, args.parts != Parts::Epochs);
    let started = Instant::now();
    // Each seed runs its parts one after the other on one worker thread, each from the seed
    // alone, exactly as a run of that part alone would.
    let reports =
        keyhome_sim::runner::run_parallel(args.start..args.start + args.count, args.threads, false, |seed| {
            if epochs && locks && epoch_options.trace {
                println!("--- epoch simulation, seed {seed}");
            }
            let epoch = epochs.then(|| run_seed(seed, epoch_options));
            if epochs && locks && epoch_options.trace {
                println!("--- lock simulation, seed {seed}");
            }
            let lock = locks.then(|| run_lock_seed(seed, &lock_options));
            let report = SeedReport { seed, epochs: epoch, locks: lock };
            let failed = report.violations() > 0;
            (report, failed)
        });
    let elapsed = started.elapsed().as_secs_f64();
    if args.single || args.stats {
        let both = epochs && locks;
        if epochs {
            if both {
                println!("epoch simulation:");
            }
            let epoch_reports: Vec<&Report> = reports.iter().filter_map(|r| r.epochs.as_ref()).collect();
            print_epoch_stats(&epoch_reports);
        }
        if locks {
            if both {
                println!("lock simulation:");
            }
            let lock_reports: Vec<&LockReport> = reports.iter().filter_map(|r| r.locks.as_ref()).collect();
            print_lock_stats(&lock_reports);
        }
    }
    conclude(&args, &reports, elapsed)
}

fn print_epoch_stats(reports: &[&Report]) {
    let mut latencies: Vec<Duration> =
        reports.iter().flat_map(|r| r.stats.change_latencies.clone()).collect();
    latencies.sort();
    let sum = |f: fn(&Report) -> u64| reports.iter().map(|r| f(r)).sum::<u64>();
    println!(
        "events: {} messages: {} acceptor writes: {} epochs chosen: {} proposals failed: {}",
        sum(|r| r.stats.events),
        sum(|r| r.stats.messages),
        sum(|r| r.stats.acceptor_writes),
        sum(|r| r.stats.epochs_chosen),
        sum(|r| r.stats.proposals_failed)
    );
    println!(
        "change latency (propose to applied, simulated, under faults): n={} p50={:?} p90={:?} p99={:?} max={:?}",
        latencies.len(),
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.9),
        percentile(&latencies, 0.99),
        latencies.last().copied().unwrap_or_default()
    );
}

fn print_lock_stats(reports: &[&LockReport]) {
    let sum = |f: fn(&LockReport) -> u64| reports.iter().map(|r| f(r)).sum::<u64>();
    println!(
        "events: {} lock calls: {} admissions: {} (at once: {}) failures: {} given up: {} (admitted and given back: {} from the reply, {} unclaimed) grants: {} delegation messages: {} epoch messages: {}",
        sum(|r| r.stats.events),
        sum(|r| r.stats.lock_calls),
        sum(|r| r.stats.admissions),
        sum(|r| r.stats.immediate),
        sum(|r| r.stats.lock_failures),
        sum(|r| r.stats.give_ups),
        sum(|r| r.stats.given_back_from_reply),
        sum(|r| r.stats.given_back_unclaimed),
        sum(|r| r.stats.grants),
        sum(|r| r.stats.deleg_messages),
        sum(|r| r.stats.epoch_messages),
    );
    println!(
        "writes accepted: {} refused: {} (late after a pause: {}) pauses: {} notes delivered: {} recovered: {} probes ok: {} passes: {}",
        sum(|r| r.stats.writes_accepted),
        sum(|r| r.stats.writes_refused),
        sum(|r| r.stats.paused_writes_refused),
        sum(|r| r.stats.pauses),
        sum(|r| r.stats.notes_delivered),
        sum(|r| r.stats.recovered),
        sum(|r| r.stats.probes_ok),
        sum(|r| r.stats.passes),
    );
    println!(
        "renews: {} (of recalled handles: {}) ok: {} (deadline later: {}, earlier: {}) refused: {}",
        sum(|r| r.stats.renews),
        sum(|r| r.stats.renews_recalled),
        sum(|r| r.stats.renews_ok),
        sum(|r| r.stats.renews_later),
        sum(|r| r.stats.renews_earlier),
        sum(|r| r.stats.renews_refused),
    );
    let mut handover = HandoverStats::default();
    for r in reports {
        handover.merge(&r.stats.handover);
    }
    print_handover(&handover);
}

/// What keys with waiting clients saw across epoch changes, one line per class.
fn print_handover(h: &HandoverStats) {
    let ms = |ns: u64| ns as f64 / 1e6;
    println!(
        "epoch changes, keys with a waiting client when their new home learned the epoch (waits from then; x = share of that epoch's activation wait, {:.0} to {:.0} ms):",
        ms(h.min_activation),
        ms(h.max_activation)
    );
    for (class, name) in HandoverStats::CLASSES {
        let c = h.class(class);
        println!(
            "  {name}: {} keys, grantable after max {:.1} ms ({:.2}x){}; refused Activating: {} keys, until max {:.1} ms ({:.2}x)",
            c.keys,
            ms(c.max_ready),
            c.max_ready_ratio,
            if c.never_ready > 0 { format!(" (never: {})", c.never_ready) } else { String::new() },
            c.refused_activating,
            ms(c.max_refused),
            c.max_refused_ratio
        );
    }
}
