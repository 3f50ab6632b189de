//! Running many seeds on worker threads, for both simulations.

use std::io::Write;
use std::ops::Range;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

/// Longest one seed may run, in wall-clock time, before the run is taken for hung. A seed takes
/// milliseconds (tens of them in a debug build); a core caught in a loop would otherwise hang the
/// test suite until CI's own limit, naming no seed. The one wall-clock bound in the simulation:
/// it decides nothing about a seed that ends.
const SEED_LIMIT: Duration = Duration::from_secs(120);

/// Runs `run` for every seed in `seeds` on `threads` worker threads (1 to 64); the results come
/// back in seed order. `run` returns its result and whether the seed failed. With
/// `stop_at_first`, workers stop taking new seeds once one has failed (seeds already running
/// finish), so the results then end at or shortly after the first failing seed found.
///
/// A seed that runs longer than [`SEED_LIMIT`] ends the process with status 1, naming the seed.
pub fn run_parallel<R: Send>(
    seeds: Range<u64>,
    threads: usize,
    stop_at_first: bool,
    run: impl Fn(u64) -> (R, bool) + Sync,
) -> Vec<R> {
    let next = AtomicU64::new(seeds.start);
    let failed = AtomicBool::new(false);
    let results = Mutex::new(Vec::new());
    let threads = threads.clamp(1, 64);
    // What each worker runs now, and since when.
    let running: Vec<Mutex<Option<(u64, Instant)>>> = (0..threads).map(|_| Mutex::new(None)).collect();
    std::thread::scope(|s| {
        // The watchdog stops when every worker has dropped its sender.
        let (alive, workers_gone) = mpsc::channel::<()>();
        for slot in &running {
            let alive = alive.clone();
            let (next, failed, results, run) = (&next, &failed, &results, &run);
            s.spawn(move || {
                let _alive = alive;
                loop {
                    let seed = next.fetch_add(1, Ordering::Relaxed);
                    if seed >= seeds.end || (stop_at_first && failed.load(Ordering::Relaxed)) {
                        break;
                    }
                    *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some((seed, Instant::now()));
                    let (result, bad) = run(seed);
                    *slot.lock().unwrap_or_else(|e| e.into_inner()) = None;
                    if bad {
                        failed.store(true, Ordering::Relaxed);
                    }
                    results.lock().unwrap_or_else(|e| e.into_inner()).push((seed, result));
                }
            });
        }
        drop(alive);
        let running = &running;
        s.spawn(move || watch(running, &workers_gone));
    });
    let mut results = results.into_inner().unwrap_or_else(|e| e.into_inner());
    results.sort_by_key(|(seed, _)| *seed);
    results.into_iter().map(|(_, r)| r).collect()
}

/// Once a second until the workers are gone, looks for a seed past [`SEED_LIMIT`].
fn watch(running: &[Mutex<Option<(u64, Instant)>>], workers_gone: &mpsc::Receiver<()>) {
    while let Err(RecvTimeoutError::Timeout) = workers_gone.recv_timeout(Duration::from_secs(1)) {
        for slot in running {
            let Some((seed, since)) = *slot.lock().unwrap_or_else(|e| e.into_inner()) else { continue };
            if since.elapsed() > SEED_LIMIT {
                // Written to the process's stderr, past the test harness's capture, which the
                // exit would discard.
                let _ = writeln!(
                    std::io::stderr(),
                    "seed {seed} has run for more than {} s (a seed takes milliseconds): something \
                     loops without end. Run it alone, with the same options and --seed {seed}, \
                     under a debugger or with --trace",
                    SEED_LIMIT.as_secs()
                );
                std::process::exit(1);
            }
        }
    }
}

/// One seed's outcome, as a search for a switched-off rule reads it.
pub trait SeedOutcome {
    /// What broke.
    type Kind: PartialEq + std::fmt::Debug;
    /// The seed.
    fn seed(&self) -> u64;
    /// The first violation, with its kind and its description.
    fn first_violation(&self) -> Option<(Self::Kind, String)>;
}

/// The first of `reports` (seed results, in seed order, of a run with `what` switched off) that
/// found a violation; panics if none did, or if its first violation is not of a kind in
/// `expected`: a safety check that cannot fail proves nothing. Prints what it found.
pub fn first_caught<R: SeedOutcome>(what: &str, reports: &[R], expected: &[R::Kind]) -> u64 {
    let Some((seed, (kind, violation))) = reports.iter().find_map(|r| Some((r.seed(), r.first_violation()?)))
    else {
        panic!("with {what}, {} seeds found no violation", reports.len())
    };
    assert!(expected.contains(&kind), "{what}: seed {seed} found {violation}, expected {expected:?}");
    println!("{what}: seed {seed} finds {violation}");
    seed
}
