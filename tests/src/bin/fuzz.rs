//! `keyhome-fuzz`: runs seeded random inputs into one fuzz target; see `keyhome_sim::fuzz`.
//!
//! ```text
//! cargo run --profile fuzz -p keyhome-sim --bin keyhome-fuzz -- --target peer-frame --iterations 10000000 --seed 1
//! cargo run --profile fuzz -p keyhome-sim --bin keyhome-fuzz -- --target home --replay 0a1b…
//! ```
//! The last line is always `target: T seed: S inputs: N failures: F seconds: D rate: R inputs/s`;
//! a failure prints its index, message and input (hex) before it. Exit code 1 on a failure.

use std::process::ExitCode;
use std::time::Instant;

use keyhome_sim::fuzz::{self, Target, from_hex, to_hex};

const USAGE: &str = "usage: keyhome-fuzz --target T [--iterations N] [--seed S] | --target T --replay HEX

  --target T      one of: peer-frame request epoch-record cert-role home holder epoch-node
  --iterations N  inputs to run (default 100000), stopping at the first failure
  --seed S        seed of the inputs (default 1)
  --replay HEX    run the single input HEX (as printed for a failure) and say what it does";

struct Args {
    target: Target,
    iterations: u64,
    seed: u64,
    replay: Option<Vec<u8>>,
}

fn parse(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let (mut target, mut iterations, mut seed, mut replay) = (None, 100_000, 1, None);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--target" => {
                let name = value()?;
                target = Some(Target::parse(&name).ok_or(format!("unknown target {name}"))?);
            }
            "--iterations" => iterations = value()?.parse().map_err(|e| format!("--iterations: {e}"))?,
            "--seed" => seed = value()?.parse().map_err(|e| format!("--seed: {e}"))?,
            "--replay" => replay = Some(from_hex(&value()?).ok_or("--replay needs hex")?),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    let target = target.ok_or("--target is required")?;
    Ok(Args { target, iterations, seed, replay })
}

fn main() -> ExitCode {
    let args = match parse(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("{e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    if let Some(input) = &args.replay {
        return match args.target.run(input) {
            Ok(()) => {
                println!("target: {} input passes", args.target.name());
                ExitCode::SUCCESS
            }
            Err(message) => {
                println!("target: {} input fails: {message}", args.target.name());
                ExitCode::FAILURE
            }
        };
    }
    let started = Instant::now();
    let summary = fuzz::fuzz(args.target, args.seed, args.iterations);
    let seconds = started.elapsed().as_secs_f64();
    if let Some(f) = &summary.failure {
        println!("failure at input {}: {}", f.index, f.message);
        println!("input: {}", to_hex(&f.input));
        println!(
            "replay: cargo run --profile fuzz -p keyhome-sim --bin keyhome-fuzz -- --target {} --replay {}",
            args.target.name(),
            to_hex(&f.input)
        );
    }
    println!(
        "target: {} seed: {} inputs: {} failures: {} seconds: {seconds:.1} rate: {:.0} inputs/s",
        args.target.name(),
        summary.seed,
        summary.inputs,
        usize::from(summary.failure.is_some()),
        summary.inputs as f64 / seconds.max(1e-9),
    );
    if summary.failure.is_some() { ExitCode::FAILURE } else { ExitCode::SUCCESS }
}
