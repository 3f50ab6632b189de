//! `keyhome-sim`: runs many seeds of the whole-cluster simulation.
//!
//! ```text
//! cargo run --release -p keyhome-sim -- --seeds 20000          # seeds 0..20000
//! cargo run --release -p keyhome-sim -- --seed 1234            # replay one seed, with details
//! cargo run --release -p keyhome-sim -- --seeds 2000 --bug activation-wait   # see a bug caught
//! cargo run --release -p keyhome-sim -- --locks --seeds 2000  # clusters with delegations and clients
//! cargo run --release -p keyhome-sim -- --locks --seeds 500 --lock-bug no-quarantine
//! ```
//! The last line is always `seeds: N violations: V rate: R seeds/s`.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use keyhome_sim::{Options, Report, bug_switch, run_seeds};

const USAGE: &str = "usage: keyhome-sim [--seeds N] [--start S] [--seed S] [--members M] [--threads T] [--bug NAME] [--hostile] [--stats] [--trace]
  --seeds N     run N seeds (default 1000), starting at --start (default 0)
  --seed S      run the single seed S and print its details
  --members M   fix the number of genesis members (3..=7; default: drawn per seed)
  --threads T   worker threads (default: available cores)
  --bug NAME    switch off one safety rule: acceptor-durability, renewal-cutoff,
                activation-wait, epoch-floor, incarnation
  --stats       print latency and message statistics
  --hostile     full-strength nemeses and more changes in every seed
  --trace       print every event (use with --seed)
  --locks       simulate delegations, local locks and a client workload on top of the epochs
                (--members then 3..=5; --stats prints lock counters)
  --lock-bug NAME  with --locks, switch off one rule: deadline-from-receipt, no-rate-margin,
                release-before-revoke, no-quarantine, ignore-activation, incarnation
  --strict-handoff  accepted for old replay commands: handoffs are always checked strictly";

struct Args {
    start: u64,
    count: u64,
    single: bool,
    threads: usize,
    options: Options,
    bug: Option<String>,
    stats: bool,
    locks: bool,
    lock_bug: Option<String>,
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
        locks: false,
        lock_bug: None,
    };
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
            "--locks" => parsed.locks = true,
            "--strict-handoff" => {}
            "--lock-bug" => {
                let name = value("--lock-bug")?;
                if keyhome_sim::locks::lock_bug(&name, Default::default()).is_none() {
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
    Ok(parsed)
}

/// The command that replays `seed` with the options of this run.
fn replay_command(seed: u64, args: &Args) -> String {
    let mut cmd = String::from("cargo run --release -p keyhome-sim --");
    if args.locks {
        cmd += " --locks";
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

/// Lists the first failing seeds (`(seed, first violation)`) with their replay commands, then
/// prints the last line, `seeds: N violations: V rate: R seeds/s`.
fn conclude(
    args: &Args,
    seeds: usize,
    violations: usize,
    failed: &[(u64, String)],
    elapsed: f64,
) -> ExitCode {
    for (seed, violation) in failed.iter().take(20) {
        println!("seed {seed} FAILED: {violation}");
        println!("  replay: {}", replay_command(*seed, args));
    }
    if failed.len() > 20 {
        println!("... and {} more failed seeds", failed.len() - 20);
    }
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

fn main() -> ExitCode {
    let args = match parse(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(msg) => {
            eprintln!("{msg}");
            return ExitCode::from(2);
        }
    };
    if args.locks {
        return locks_main(&args);
    }
    let started = Instant::now();
    let reports = run_seeds(args.start..args.start + args.count, &args.options, args.threads, false);
    let elapsed = started.elapsed().as_secs_f64();

    if args.single || args.stats {
        let mut latencies: Vec<Duration> =
            reports.iter().flat_map(|r| r.stats.change_latencies.clone()).collect();
        latencies.sort();
        let sum = |f: fn(&Report) -> u64| reports.iter().map(f).sum::<u64>();
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
    let violations = reports.iter().map(|r| r.violations.len()).sum();
    let failed: Vec<(u64, String)> =
        reports.iter().filter_map(|r| Some((r.seed, r.violations.first()?.to_string()))).collect();
    conclude(&args, reports.len(), violations, &failed, elapsed)
}

/// `--locks`: the delegation simulation, with the same last line.
fn locks_main(args: &Args) -> ExitCode {
    use keyhome_sim::locks::{LockOptions, LockReport, lock_bug, run_lock_seeds};
    let mut options = LockOptions {
        members: args.options.members,
        trace: args.options.trace,
        hostile: args.options.hostile,
        epoch_bugs: args.options.bugs,
        ..LockOptions::default()
    };
    if let Some(name) = &args.lock_bug {
        options = lock_bug(name, options).expect("checked when parsing");
    }
    let started = Instant::now();
    let reports = run_lock_seeds(args.start..args.start + args.count, &options, args.threads, false);
    let elapsed = started.elapsed().as_secs_f64();
    if args.single || args.stats {
        let sum = |f: fn(&LockReport) -> u64| reports.iter().map(f).sum::<u64>();
        println!(
            "events: {} lock calls: {} admissions: {} (at once: {}) failures: {} grants: {} delegation messages: {} epoch messages: {}",
            sum(|r| r.stats.events),
            sum(|r| r.stats.lock_calls),
            sum(|r| r.stats.admissions),
            sum(|r| r.stats.immediate),
            sum(|r| r.stats.lock_failures),
            sum(|r| r.stats.grants),
            sum(|r| r.stats.deleg_messages),
            sum(|r| r.stats.epoch_messages),
        );
        println!(
            "writes accepted: {} refused: {} (late after a pause: {}) pauses: {} notes delivered: {} recovered: {} probes ok: {}",
            sum(|r| r.stats.writes_accepted),
            sum(|r| r.stats.writes_refused),
            sum(|r| r.stats.paused_writes_refused),
            sum(|r| r.stats.pauses),
            sum(|r| r.stats.notes_delivered),
            sum(|r| r.stats.recovered),
            sum(|r| r.stats.probes_ok),
        );
    }
    let violations = reports.iter().map(|r| r.violations.len()).sum();
    let failed: Vec<(u64, String)> =
        reports.iter().filter_map(|r| Some((r.seed, r.violations.first()?.to_string()))).collect();
    conclude(args, reports.len(), violations, &failed, elapsed)
}
