//! Contention for one key: client 0 of each of several nodes locks the key again and again and
//! holds it longer than a delegation lease, so that waiters wait longer than a lease too (their
//! grants count from their requests' first sends). What it measures is fairness: how often each
//! contender is admitted, and the longest any of them waits.
//!
//! It drives a [`LockWorld`] (usually [`super::LockScenario::quiet`]) through its scripted calls,
//! one `step` of simulated time at a time. How a client reacts to a recall is the world's
//! `scenario.responsive`: 1 unlocks at once, 0 holds on to the deadline it was told.

use std::time::Duration;

use crate::rng::Rng;
use crate::world::{Real, nanos};

use super::LockWorld;

/// What every contender does. Times are simulated real time.
#[derive(Clone, Debug)]
pub struct Contention {
    /// Contenders: client 0 of nodes `0..nodes`.
    pub nodes: usize,
    /// The key (an index into the scenario's keys).
    pub key: usize,
    /// The ttl of every lock and renewal.
    pub ttl: Duration,
    /// How long every lock call waits before it fails.
    pub wait: Duration,
    /// Each admission is held for a time drawn from this range (ns, inclusive), then unlocked,
    /// unless the handle is lost first (its deadline passed, or the client unlocked on a recall).
    pub hold: (Real, Real),
    /// A holding client renews its handle this often (ns).
    pub renew_every: Real,
    /// An admission's end to the client's next lock call (ns).
    pub pause: Real,
    /// The driver's resolution (ns): clients act at multiples of it.
    pub step: Real,
}

/// What one contender saw.
#[derive(Clone, Debug, Default)]
pub struct Contender {
    pub admissions: u64,
    /// Lock calls that failed (their wait ran out, or were refused).
    pub failures: u64,
    /// Admissions that ended before their hold time: lost at the deadline, or unlocked on a recall.
    pub cut: u64,
    /// Longest time from a lock call to its admission (ns), counting a wait still under way at
    /// the end of the run up to then.
    pub longest_wait: Real,
}

/// One contender's state, as the driver keeps it.
#[derive(Clone, Copy, Debug)]
enum Phase {
    /// Locks at `at`.
    Idle { at: Real },
    /// Called lock at `since`.
    Waiting { since: Real },
    /// Admitted; unlocks at `until`, renews next at `renew_at`.
    Holding { until: Real, renew_at: Real },
}

/// Runs `contention` on `world` until real time `end`; `seed` draws the hold times. The
/// contenders start together at the world's current instant.
pub fn run(world: &mut LockWorld, contention: &Contention, seed: u64, end: Real) -> Vec<Contender> {
    let c = contention;
    let mut rng = Rng::new(seed ^ 0xc0_47e5d);
    let mut phases = vec![Phase::Idle { at: world.now() }; c.nodes];
    let mut report = vec![Contender::default(); c.nodes];
    // Admissions the checker recorded that the driver has looked at.
    let mut seen = world.checker.admissions.len();
    while world.now() < end && world.checker.violations.is_empty() {
        let now = world.now();
        for node in 0..c.nodes {
            admitted(world, c, &mut seen, &mut phases, &mut report, &mut rng);
            phases[node] = match phases[node] {
                Phase::Idle { at } if now >= at => {
                    world.script_lock(node, c.key, c.ttl, c.wait);
                    Phase::Waiting { since: now }
                }
                Phase::Waiting { .. } if !world.script_waiting(node) && !world.script_holds(node) => {
                    report[node].failures += 1;
                    Phase::Idle { at: now + c.pause }
                }
                Phase::Holding { until, .. } if !world.script_holds(node) => {
                    report[node].cut += u64::from(now < until);
                    Phase::Idle { at: now + c.pause }
                }
                Phase::Holding { until, .. } if now >= until => {
                    world.script_unlock(node);
                    Phase::Idle { at: now + c.pause }
                }
                Phase::Holding { until, renew_at } if now >= renew_at => {
                    world.script_renew(node, c.ttl);
                    Phase::Holding { until, renew_at: now + c.renew_every }
                }
                phase => phase,
            };
        }
        admitted(world, c, &mut seen, &mut phases, &mut report, &mut rng);
        world.run_until(now + c.step);
    }
    for (node, phase) in phases.iter().enumerate() {
        if let Phase::Waiting { since } = phase {
            report[node].longest_wait = report[node].longest_wait.max(world.now() - since);
        }
    }
    report
}

/// Starts the hold of every admission the checker recorded since `seen` (at once, or since the
/// last step), and counts its wait.
fn admitted(
    world: &LockWorld,
    c: &Contention,
    seen: &mut usize,
    phases: &mut [Phase],
    report: &mut [Contender],
    rng: &mut Rng,
) {
    while let Some(a) = world.checker.admissions.get(*seen) {
        *seen += 1;
        let Some(&Phase::Waiting { since }) = phases.get(a.node).filter(|_| a.key == c.key) else {
            continue;
        };
        let r = &mut report[a.node];
        r.admissions += 1;
        r.longest_wait = r.longest_wait.max(a.start - since);
        let until = a.start + rng.range(c.hold.0, c.hold.1);
        phases[a.node] = Phase::Holding { until, renew_at: a.start + c.renew_every };
    }
}

/// The longest a contender may wait when the key goes round in queue order: each of the `n − 1`
/// others ahead of it (at most) keeps the key for at most one turn. A turn is one delegation
/// lease and the home's rate margin on it (a recalled holder keeps its handle to its deadline at
/// most, and the home frees the key at its conservative end at the latest), plus `slack` for the
/// hand-off's messages and the driver's steps.
pub fn fair_bound(n: usize, lease: Duration, ppm: u32, slack: Duration) -> Real {
    let turn = nanos(keyhome_epoch::time::rate_margin(lease, ppm)) + nanos(slack);
    (n as Real - 1) * turn
}
