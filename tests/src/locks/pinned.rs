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

use crate::locks::{LockKind, LockOptions, LockReport, lock_bug, run_lock_seed};

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
/// epoch's note `Some(523)` where the key's last writes left `Some(619)` (`Handoff`).
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
