//! The activation rules as pure functions: when a node may grant a key, how long the next epoch's
//! activation wait is, and how long a restarted node waits. [`crate::EpochNode`] applies them to
//! its history; the lease model (`epoch/tests/lease_model.rs`) checks them over abstract time.
//! See `docs/protocol.md`, sections 6 and 9 (b).

use std::time::Duration;

use crate::node::Bugs;
use crate::record::EpochRecord;
use crate::time::{Instant, rate_margin};

/// What one epoch a node learned contributes to its right to grant one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Standing {
    pub number: u64,
    /// Whether the node is the key's home in this epoch.
    pub homes_key: bool,
    /// End of the node's home lease of this epoch, on its own clock, if it held one.
    pub lease_until: Option<Instant>,
    /// The node's activation instant for this epoch, on its own clock.
    pub fence_until: Instant,
    /// The epoch's `max_delegation_lease`.
    pub max_delegation_lease: Duration,
}

/// Whether a node may grant the key at `now`, given what its learned epochs say, newest first
/// (the first is its current epoch). A home grants delegations of up to the current epoch's
/// `max_delegation_lease` (`D`).
///
/// Over the run of consecutive epochs, newest first, in each of which the node is the key's home,
/// one valid lease and one passed activation instant suffice, possibly of different epochs. But a
/// lease of epoch `j` counts only if `D_j` is at least the current `D`: the activation waits of
/// later epochs cover a delegation granted under a lease of `j` only for `D_j`, so a lease of an
/// epoch with shorter delegations cannot carry the longer ones the current epoch allows. (After a
/// timing change that lengthens delegations, the home waits for a lease of the new epoch.)
pub fn may_grant(newest_first: impl IntoIterator<Item = Standing>, now: Instant, bugs: Bugs) -> bool {
    let mut epochs = newest_first.into_iter().peekable();
    let Some(current) = epochs.peek().copied() else { return false };
    let (mut leased, mut fenced) = (false, false);
    let mut expected = current.number;
    for epoch in epochs {
        if epoch.number != expected || !epoch.homes_key {
            break;
        }
        expected = expected.saturating_sub(1);
        let carries = epoch.max_delegation_lease >= current.max_delegation_lease
            || bugs.delegation_lease_of_current_epoch;
        leased |= carries && epoch.lease_until.is_some_and(|until| now < until);
        fenced |= now >= epoch.fence_until;
        if leased && fenced {
            return true;
        }
    }
    false
}

/// The activation wait of the epoch after `current`, as its proposer computes it: the current
/// epoch's home lease plus a delegation granted at its very end, widened by the clock-rate bound
/// ([`crate::Timing::fence_bound`]), and at least the current epoch's own wait while the
/// proposer's activation instant for the current epoch has not passed (`fence_passed` false):
/// leases of earlier epochs may then still run.
pub fn next_activation_wait(current: &EpochRecord, fence_passed: bool) -> Duration {
    let earlier = if fence_passed { Duration::ZERO } else { current.activation_wait };
    current.timing.fence_bound().max(earlier)
}

/// How long a node that starts a run at epoch `current` waits before it grants any key: the
/// epoch's activation wait, and every delegation it may have granted under `current` before it
/// stopped (it has forgotten them), whatever timing a later epoch sets.
pub fn restart_wait(current: &EpochRecord) -> Duration {
    let forgotten = rate_margin(current.timing.max_delegation_lease, current.timing.clock_rate_ppm);
    current.activation_wait.max(forgotten)
}
