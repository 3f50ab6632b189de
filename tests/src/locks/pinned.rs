//! Lock seeds pinned by regression tests, each with the bug switch that makes it fail.
//!
//! A pinned seed guards a fix only while it still drives the scenario the fix is about: the
//! simulation and the node change, and a seed that once failed may then pass whatever the code
//! does. So every pin names the `--lock-bug` switch that puts its bug back, and two tests use it:
//! `tests/locks.rs` runs the seeds with every rule on (they must pass) and `tests/lock_bugs.rs`
//! runs the same seeds with the switch on (each must fail, as the pin says). When the second
//! stops failing, the pin is stale: find fresh seeds with
//! `cargo run --release -p keyhome-sim -- --locks --seeds N --lock-bug NAME` (with `--hostile`
//! for a hostile pin) and put them here.

use std::time::Duration;

use keyhome_epoch::{Change, NodeId};

use crate::locks::{
    LockKind, LockOptions, LockReport, LockScenario, LockViolation, LockWorld, lock_bug, run_lock_seed,
};

/// Seeds that fail with one bug switched on, and pass without it.
#[derive(Clone, Copy, Debug)]
pub struct Pin {
    /// The `--lock-bug` switch that puts the bug back.
    pub bug: &'static str,
    /// Whether the seeds are hostile ones (`--hostile`).
    pub hostile: bool,
    /// The seeds.
    pub seeds: &'static [u64],
    /// What each seed's first violation may be with the bug in.
    pub kinds: &'static [LockKind],
}

impl Pin {
    /// The options the seeds run under, with the bug switched on or not.
    pub fn options(&self, with_bug: bool) -> LockOptions {
        let base = LockOptions { hostile: self.hostile, ..LockOptions::default() };
        if with_bug { lock_bug(self.bug, base).expect("a known bug") } else { base }
    }

    /// Runs every seed, with the bug switched on or not.
    pub fn run(&self, with_bug: bool) -> Vec<LockReport> {
        let options = self.options(with_bug);
        self.seeds.iter().map(|&seed| run_lock_seed(seed, &options)).collect()
    }

    /// The flags that replay a seed (`--hostile` or nothing), without the bug.
    pub fn flags(&self) -> &'static str {
        if self.hostile { " --hostile" } else { "" }
    }
}

/// A home adopts a `Handover` after the activation wait of its epoch (`late-handover`; the fix:
/// `Home::on_handover` adopts only before it). Seed 12542 of `--locks` seeds 0 to 19 999, the only
/// one to fail with the switch on (2026-12-08): node 3 admits 2.1.4.0 of k7 with the previous
/// epoch's note `Some(523)` where the key's last writes left `Some(619)` (`Handoff`). The same
/// bug scripted: [`late_handover_scripted`].
pub const LATE_HANDOVER: Pin =
    Pin { bug: "late-handover", hostile: false, seeds: &[12542], kinds: &[LockKind::Handoff] };

/// A restarted holder hands back a grant answering its earlier run's request
/// (`restart-hands-back`; the fix: `Holder::stray_grant` leaves it to expire at the home). Hostile
/// seeds 1081, 1269 and 1367, three of the four of hostile seeds 0 to 1 999 to fail with the
/// switch on (1562 the fourth; none of 2 000 default or hostile 3-member seeds does; 2026-12-08): the home frees the key and
/// grants it again while a handle the earlier run admitted is inside its told deadline
/// (`Overlap`).
pub const RESTART_HANDS_BACK: Pin =
    Pin { bug: "restart-hands-back", hostile: true, seeds: &[1081, 1269, 1367], kinds: &[LockKind::Overlap] };

/// A holder forgets an ended delegation before an answer to its requests can no longer arrive
/// (`short-past`; the fix: its past lasts to `answers_until`). Seed 702, the only one of `--locks`
/// seeds 0 to 15 999 to fail with the switch on (none of 2 000 hostile ones; 2026-12-08): a late
/// grant is handed back as a clean release, and node 4 admits 3.1.7.0 of k4 not flagged
/// recovered after the previous delegation expired (`Handoff`).
pub const SHORT_PAST: Pin =
    Pin { bug: "short-past", hostile: false, seeds: &[702], kinds: &[LockKind::Handoff] };

/// A renewal's shorter lease brings the delegation's deadline, and a local handle's, earlier
/// (`renewal-shortens`; the fix: a renewal never brings the deadline earlier). Seeds 94, 96 and
/// 346, the first three of the 23 of `--locks` seeds 0 to 1 999 to fail with the switch on
/// (2026-12-08):
/// the handle's holder keeps less than its client was told, by a recall (94, 346) or by the
/// renewal itself (96) (`CutShort`).
pub const RENEWAL_SHORTENS: Pin =
    Pin { bug: "renewal-shortens", hostile: false, seeds: &[94, 96, 346], kinds: &[LockKind::CutShort] };

/// One simulated millisecond, in nanoseconds.
const MS: u64 = 1_000_000;

/// A late `Handover`, scripted (what [`LATE_HANDOVER`] finds by chance in one seed of 20 000).
/// Four members, 300 ms home leases, 20 ms delegations, no faults but the partitions below, and
/// `bugs` switched off in every node. A key homed on node A moves to node B when A is removed:
///
/// 1. node C's client locks the key and unlocks it with a note; the idle delegation goes back to
///    A (holders release an idle delegation after 5 ms here, before it expires), whose record
///    keeps that note (a clean end);
/// 2. nothing A sends gets out any more; node B proposes removing A, A learns the new epoch and
///    hands the key over to B, again and again (a retry period apart), but B hears none of it;
/// 3. B waits out the activation wait and grants the key to C's client, which is then cut off
///    until its delegation has expired at B (the handle ends `Expired`) and B has dropped the
///    key's record (it says no more than "no record");
/// 4. every link heals: A's next Handover, with the note of step 1, reaches B after its
///    activation wait, and node D's client locks the key.
///
/// A home that adopts that Handover hands D the note of step 1 as a clean handoff, although the
/// key's last holder expired (`Handoff`). Returns the run's violations.
pub fn late_handover_scripted(bugs: keyhome_delegation::Bugs) -> Vec<LockViolation> {
    let ms = |n: u64| Duration::from_millis(n);
    let seed = 11;
    let mut scenario = LockScenario::quiet(seed, 4, ms(20));
    scenario.bugs = bugs;
    // An idle delegation goes back before it would expire, so its note reaches the home.
    scenario.holder.idle_release = ms(5);
    let genesis = scenario.base.genesis.clone();
    let keys = scenario.base.keys.clone();
    // Simulation indices: node `i` has id `i + 1`.
    let home = |r: &keyhome_epoch::EpochRecord, k: usize| r.ring().home(&keys[k]).map(|n| n.0 as usize - 1);
    let (a, key, b) = (0..4)
        .flat_map(|a| (0..keys.len()).map(move |k| (a, k)))
        .find_map(|(a, k)| {
            let removed = Change::Remove(NodeId(a as u64 + 1)).apply(&genesis).ok()?;
            (home(&genesis, k) == Some(a)).then_some((a, k, home(&removed, k)?))
        })
        .expect("a key that moves when its home is removed");
    let mut others = (0..4).filter(|&i| i != a && i != b);
    let (c, d) = (others.next().expect("four nodes"), others.next().expect("four nodes"));
    let mut w = LockWorld::new(seed, scenario);
    w.run_until(1_000 * MS);

    // 1. A note at A.
    w.script_lock(c, key, ms(10), ms(100));
    w.run_until(w.now() + 10 * MS);
    assert!(w.script_holds(c), "C's client is admitted");
    w.script_unlock(c);
    w.run_until(w.now() + 200 * MS);

    // 2. A cut off on its way out; B removes it.
    let side: Vec<bool> = (0..4).map(|i| i == a).collect();
    w.script_partition(&side, true);
    let change = w.now();
    w.script_propose(b, Change::Remove(NodeId(a as u64 + 1))).expect("B takes the removal");
    w.run_until(change + 50 * MS);
    assert_eq!([a, b, c, d].map(|i| w.epoch_of(i)), [Some(2); 4], "every node learned epoch 2");

    // 3. B, active after the activation wait, grants C; C is cut off until it has expired at B.
    w.run_until(change + 400 * MS);
    w.script_lock(c, key, ms(20), ms(100));
    w.run_until(w.now() + 5 * MS);
    assert!(w.script_holds(c), "B grants the key after its activation wait");
    let side: Vec<bool> = (0..4).map(|i| i == c).collect();
    w.script_partition(&side, false);
    w.run_until(w.now() + 60 * MS);
    assert!(!w.script_holds(c), "C's handle expired");

    // 4. A's resent Handover reaches B; D locks the key.
    w.script_heal();
    w.run_until(w.now() + 100 * MS);
    w.script_lock(d, key, ms(1_000), ms(200));
    w.run_until(w.now() + 30 * MS);
    assert!(w.script_holds(d), "D's client is admitted");
    w.script_unlock(d);
    w.run_until(w.now() + 100 * MS);
    std::mem::take(&mut w.checker.violations)
}
