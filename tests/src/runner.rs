//! Running many seeds on worker threads, for both simulations.

use std::ops::Range;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Runs `run` for every seed in `seeds` on `threads` worker threads (1 to 64); the results come
/// back in seed order. `run` returns its result and whether the seed failed. With
/// `stop_at_first`, workers stop taking new seeds once one has failed (seeds already running
/// finish), so the results then end at or shortly after the first failing seed found.
pub fn run_parallel<R: Send>(
    seeds: Range<u64>,
    threads: usize,
    stop_at_first: bool,
    run: impl Fn(u64) -> (R, bool) + Sync,
) -> Vec<R> {
    let next = AtomicU64::new(seeds.start);
    let failed = AtomicBool::new(false);
    let results = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, 64) {
            s.spawn(|| {
                loop {
                    let seed = next.fetch_add(1, Ordering::Relaxed);
                    if seed >= seeds.end || (stop_at_first && failed.load(Ordering::Relaxed)) {
                        break;
                    }
                    let (result, bad) = run(seed);
                    if bad {
                        failed.store(true, Ordering::Relaxed);
                    }
                    results.lock().unwrap_or_else(|e| e.into_inner()).push((seed, result));
                }
            });
        }
    });
    let mut results = results.into_inner().unwrap_or_else(|e| e.into_inner());
    results.sort_by_key(|(seed, _)| *seed);
    results.into_iter().map(|(_, r)| r).collect()
}
