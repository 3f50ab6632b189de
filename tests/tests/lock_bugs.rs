//! Each delegation safety rule, switched off, is caught by the lock simulation (and the
//! non-durable incarnation of the epoch layer shows up as tokens that fail to increase).
//!
//! Each test searches hostile 3-member seeds until the first violation, up to a cap well above
//! where the first one shows (seed 29 for the rarest, the missing rate margin, which needs clocks
//! at opposite ends of the bound and a short network delay), and checks the violation is one the
//! rule protects against.
//!
//! The two epoch-change rules the simulation switches off in its own authority wrapper
//! (`no-handover`, `same-home-wait`) break promises about pauses, not safety: calm runs
//! (`LockOptions::calm`, no faults) catch them as `ChangePause`.

use keyhome_sim::locks::{LockKind, LockOptions, lock_bug, run_lock_seeds};

/// Most seeds a search may take.
const CAP: u64 = 200;

fn caught(bug: &str, expected: &[LockKind]) {
    let base = LockOptions { members: Some(3), hostile: true, ..LockOptions::default() };
    let options = lock_bug(bug, base).expect("a known bug");
    let reports = run_lock_seeds(0..CAP, &options, 2, true);
    let found = reports.iter().find(|r| !r.violations.is_empty());
    let Some(report) = found else { panic!("with {bug} switched off, {CAP} seeds found no violation") };
    let violation = &report.violations[0];
    assert!(
        expected.contains(&violation.kind),
        "{bug}: seed {} found {violation}, expected {expected:?}",
        report.seed
    );
    println!("{bug}: seed {} finds {violation}", report.seed);
}

#[test]
fn a_deadline_counted_from_receipt_is_caught() {
    // The holder's deadline outlives the home's view: the next holder overlaps it; or a grant
    // delayed past its use is used, below a later token.
    caught("deadline-from-receipt", &[LockKind::Overlap, LockKind::TokenOrder]);
}

#[test]
fn a_regrant_without_the_rate_margin_is_caught() {
    caught("no-rate-margin", &[LockKind::Overlap]);
}

#[test]
fn releasing_before_revoking_live_handles_is_caught() {
    // A recall releases the delegation while the local handle is inside the deadline its owner
    // was told: the next holder overlaps it, or gets the handoff note of before that handle's
    // writes.
    caught("release-before-revoke", &[LockKind::Overlap, LockKind::Handoff]);
}

#[test]
fn no_restart_quarantine_is_caught() {
    caught("no-quarantine", &[LockKind::BadGrant, LockKind::Overlap]);
}

#[test]
fn serving_a_moved_key_without_waiting_or_handover_is_caught() {
    caught("ignore-activation", &[LockKind::BadGrant, LockKind::Overlap]);
}

#[test]
fn an_incarnation_that_is_not_durable_makes_tokens_fail_to_increase() {
    caught("incarnation", &[LockKind::TokenOrder, LockKind::FenceRegression]);
}

/// Searches calm seeds from 0 until the first violation, which must be a `ChangePause`.
fn caught_calm(bug: &str) {
    let options = lock_bug(bug, LockOptions { calm: true, ..LockOptions::default() }).expect("a known bug");
    let reports = run_lock_seeds(0..CALM_CAP, &options, 2, true);
    let found = reports.iter().find(|r| !r.violations.is_empty());
    let Some(report) = found else { panic!("with {bug}, {CALM_CAP} calm seeds found no violation") };
    let violation = &report.violations[0];
    assert_eq!(violation.kind, LockKind::ChangePause, "{bug}: seed {} found {violation}", report.seed);
    println!("{bug}: calm seed {} finds {violation}", report.seed);
}

/// Most calm seeds a search may take.
const CALM_CAP: u64 = 30;

#[test]
fn a_home_that_never_adopts_a_handover_is_caught() {
    // Moved keys then wait out the activation wait although their old home handed them over.
    caught_calm("no-handover");
}

#[test]
fn a_home_that_waits_for_keys_that_kept_it_is_caught() {
    // Keys that keep their home are then refused `Activating` after every change.
    caught_calm("same-home-wait");
}
