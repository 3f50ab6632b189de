//! Whole-cluster simulation with delegations under a client workload.
//!
//! Each node runs its epoch core, its home and its holder together ([`world`]); clients on every
//! node lock random keys (uniform plus a Zipf-hot set), hold them (sometimes renewing them), write
//! to a fenced resource and unlock with a handoff note; processes crash, restart and pause past their deadlines. The
//! [`check::LockChecker`] holds the delegation invariants against simulated real time, next to
//! the epoch harness's own checker.
//!
//! ```text
//! cargo run --release -p keyhome-sim -- --locks --seeds 2000
//! cargo run --release -p keyhome-sim -- --locks --seed 17 --trace
//! cargo run --release -p keyhome-sim -- --locks --seeds 500 --lock-bug no-quarantine
//! cargo run --release -p keyhome-sim -- --calm --seeds 300 --stats
//! ```

use std::ops::Range;

pub mod check;
pub mod contend;
pub mod handover;
pub mod pinned;
pub mod scenario;
pub mod world;

pub use check::{LockKind, LockStats, LockViolation};
pub use handover::{Class, ClassStats, HandoverStats};
pub use scenario::{LockScenario, WalkParams};
pub use world::LockWorld;

/// Choices the caller may fix instead of the seed.
#[derive(Clone, Debug, Default)]
pub struct LockOptions {
    /// Number of genesis members (3 to 5 when not fixed); two spare nodes are added.
    pub members: Option<usize>,
    /// Epoch safety rules to switch off.
    pub epoch_bugs: keyhome_epoch::Bugs,
    /// Delegation safety rules to switch off.
    pub bugs: keyhome_delegation::Bugs,
    /// Print every event.
    pub trace: bool,
    /// More faults, pauses and clients, every clock at an end of the rate bound: what the
    /// injected-bug tests use.
    pub hostile: bool,
    /// Calm runs ([`LockScenario::calm`]): no faults at all, operator changes far apart, and the
    /// epoch-change checks of [`handover`] enforced. `hostile` does not apply to them.
    pub calm: bool,
    /// Epoch-change rules to switch off in the simulation's own wrapper around the epoch core.
    pub sim_bugs: SimBugs,
}

/// Rules the simulation itself can switch off, in the [`Authority`] it gives each home: they
/// break the promises about epoch changes (see [`handover`]), not safety, so only calm runs
/// ([`LockOptions::calm`]) catch them.
///
/// [`Authority`]: keyhome_delegation::Authority
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimBugs {
    /// Homes never adopt a handover (the authority never names the previous home), so every
    /// moved key waits out the activation wait.
    pub no_handover: bool,
    /// After every change, homes wait out the activation wait for every key, also for keys that
    /// keep their home (the authority answers `home_active` false until the new epoch's
    /// activation instant).
    pub same_home_wait: bool,
}

/// Options with the rule named `name` (one of `Bugs::NAMES`, or a rule of the epoch core or the
/// simulation's glue below) switched off; `None` for any other name.
pub fn lock_bug(name: &str, mut options: LockOptions) -> Option<LockOptions> {
    match name {
        "incarnation" => options.epoch_bugs.volatile_incarnation = true,
        "delegation-bound" => options.epoch_bugs.delegation_lease_of_current_epoch = true,
        "no-handover" => options.sim_bugs.no_handover = true,
        "same-home-wait" => options.sim_bugs.same_home_wait = true,
        _ if options.bugs.switch_on(name) => {}
        _ => return None,
    }
    Some(options)
}

/// The outcome of one lock seed.
#[derive(Debug)]
pub struct LockReport {
    pub seed: u64,
    pub violations: Vec<LockViolation>,
    pub stats: LockStats,
}

impl crate::runner::SeedOutcome for LockReport {
    type Kind = LockKind;
    fn seed(&self) -> u64 {
        self.seed
    }
    fn first_violation(&self) -> Option<(LockKind, String)> {
        self.violations.first().map(|v| (v.kind, v.to_string()))
    }
}

/// Runs one seed to its end.
pub fn run_lock_seed(seed: u64, options: &LockOptions) -> LockReport {
    let scenario =
        if options.calm { LockScenario::calm(seed, options) } else { LockScenario::generate(seed, options) };
    let mut world = LockWorld::new(seed, scenario);
    world.run();
    let checker = &mut world.checker;
    LockReport { seed, violations: std::mem::take(&mut checker.violations), stats: checker.stats.clone() }
}

/// Runs `seeds` on `threads` workers; reports sorted by seed. With `stop_at_first`, workers stop
/// taking new seeds once one has failed.
pub fn run_lock_seeds(
    seeds: Range<u64>,
    options: &LockOptions,
    threads: usize,
    stop_at_first: bool,
) -> Vec<LockReport> {
    crate::runner::run_parallel(seeds, threads, stop_at_first, |seed| {
        let report = run_lock_seed(seed, options);
        let failed = !report.violations.is_empty();
        (report, failed)
    })
}
