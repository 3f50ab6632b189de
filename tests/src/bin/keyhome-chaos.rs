//! `keyhome-chaos`: one Jepsen-style run against a real cluster (see `keyhome_sim::chaos`),
//! printing one summary line. Exit status 0 if no guarantee was broken, 1 if one was (the line
//! then names the history file), 2 for bad arguments.
//!
//! ```text
//! cargo run -p keyhome-sim --bin keyhome-chaos -- --duration 600 --seed 7 --nodes 5
//! cargo run -p keyhome-sim --bin keyhome-chaos -- --duration 60 --bug release-before-revoke
//! ```

use std::process::ExitCode;
use std::time::Duration;

use keyhome_sim::chaos::{self, ChaosOptions};

const USAGE: &str =
    "usage: keyhome-chaos [--duration SECONDS] [--seed S] [--nodes 3..=5] [--clients PER_NODE]
                     [--keys K] [--bug NAME] [--history PATH] [--keep-history]

  --duration SECONDS  how long the nemesis strikes (default 60); the run then heals everything
                      and checks that every key locks again
  --seed S            fixes the faults and the clients' choices (default 0)
  --nodes N           cluster size (default 3)
  --clients C         client tasks per node (default 2)
  --keys K            keys the clients lock (default 4)
  --bug NAME          run nodes built with the bug-injection feature, with one rule off:
                      release-before-revoke, ignore-activation, activation-wait, no-quarantine,
                      no-rate-margin, deadline-from-receipt
  --history PATH      where the history of every event goes (default: the temp directory);
                      kept when the run fails or with --keep-history";

fn parse(args: &[String]) -> Result<ChaosOptions, String> {
    let mut options = ChaosOptions::new(0, Duration::from_secs(60));
    let mut it = args.iter();
    let mut seed = None;
    let mut history = None;
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{arg} needs a value"));
        let number = |v: &String| v.parse::<u64>().map_err(|_| format!("{arg}: {v:?} is not a number"));
        match arg.as_str() {
            "--duration" => options.duration = Duration::from_secs(number(value()?)?),
            "--seed" => seed = Some(number(value()?)?),
            "--nodes" => options.nodes = number(value()?)?,
            "--clients" => options.clients_per_node = number(value()?)? as usize,
            "--keys" => options.keys = number(value()?)?.max(1) as usize,
            "--bug" => options.bug = Some(value()?.clone()),
            "--history" => history = Some(value()?.into()),
            "--keep-history" => options.keep_history = true,
            _ => return Err(format!("unknown argument {arg:?}")),
        }
    }
    if !(3..=5).contains(&options.nodes) {
        return Err("--nodes must be 3, 4 or 5".into());
    }
    if let Some(seed) = seed {
        let defaults = ChaosOptions::new(seed, options.duration);
        options.seed = seed;
        options.history = defaults.history;
    }
    if let Some(path) = history {
        options.history = path;
    }
    Ok(options)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let options = match parse(&args) {
        Ok(options) => options,
        Err(e) => {
            eprintln!("{e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let report = runtime.block_on(chaos::run(&options));
    for violation in &report.violations {
        eprintln!("{violation}");
    }
    println!("{}", report.summary());
    if report.passed() { ExitCode::SUCCESS } else { ExitCode::from(1) }
}
