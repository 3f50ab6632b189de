//! `keyhome-hostile`: runs each probe of issue 12's table against a fresh local cluster (three
//! nodes, default limits) while a control client locks every 100 ms, and prints what each cost
//! node 1 as a Markdown table (docs/operations.md, "Limits and hostile load"). Exit status 0 if
//! the control client never failed, 1 if it did, 2 for bad arguments.
//!
//! ```text
//! cargo run --release -p keyhome-sim --bin keyhome-hostile -- --seconds 10
//! cargo run --release -p keyhome-sim --bin keyhome-hostile -- --seconds 10 --probe stalled-requests
//! ```

use std::process::ExitCode;
use std::time::Duration;

use keyhome_sim::hostile::run::{PROBES, Row, run_probe};

const USAGE: &str = "usage: keyhome-hostile [--seconds S] [--probe NAME]...

  --seconds S   how long each sustained probe attacks (default 10)
  --probe NAME  run only this probe (repeatable): stalled-requests, idle-connections,
                unauthenticated-handshakes, malformed-requests, idle-streams, trailing-bytes,
                second-subscribe, second-node-id";

fn parse(args: &[String]) -> Result<(Duration, Vec<&'static str>), String> {
    let mut seconds = 10;
    let mut probes = Vec::new();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--seconds" => {
                let v = value()?;
                seconds = v.parse().map_err(|_| format!("--seconds: {v:?} is not a number"))?;
            }
            "--probe" => {
                let v = value()?;
                probes.push(
                    *PROBES
                        .iter()
                        .find(|p| **p == v.as_str())
                        .ok_or_else(|| format!("unknown probe {v:?}"))?,
                );
            }
            _ => return Err(format!("unknown argument {arg:?}")),
        }
    }
    if probes.is_empty() {
        probes = PROBES.to_vec();
    }
    Ok((Duration::from_secs(seconds), probes))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (hold, probes) = match parse(&args) {
        Ok(parsed) => parsed,
        Err(e) => {
            eprintln!("{e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::from(2);
        }
    };
    println!("{}", Row::HEADER);
    let mut failed = false;
    for probe in probes {
        let row = runtime.block_on(run_probe(probe, hold));
        failed |= row.failures > 0;
        println!("{row}");
    }
    if failed { ExitCode::from(1) } else { ExitCode::SUCCESS }
}
