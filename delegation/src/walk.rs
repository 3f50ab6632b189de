//! [`Walk`]: an epoch change's pass over the key slots of a [`crate::Home`] or
//! [`crate::Holder`], a bounded step at a time.
//!
//! An epoch change may concern every key a node keeps state for (a home hands moved keys over, a
//! holder re-asks a moved key's new home). With a million keys that is hundreds of milliseconds of
//! work, and the driver holds the node's core while it runs. So neither core does it inside the
//! call that learned the epoch: it starts a walk, looks at one step of slots per
//! `handle_timeout` (the first step at once), and reports the walk as due in `poll_timeout`
//! until it has passed every slot. Other calls run between the steps. Each core also brings a
//! key it is asked about up to date before using it, so what a call sees of a key never depends
//! on how far the walk has come; the walk only bounds how long the untouched keys wait.

use std::ops::Range;

use keyhome_epoch::Instant;

/// Slots one step of a walk looks at, by default. The bench `home_grant -- home_epoch_walk`
/// measures the longest step with a million live delegations, two thirds of them moving.
pub const DEFAULT_WALK_STEP: u32 = 128;

/// A walk in progress over slot numbers `0..`, which may grow while it runs (slots added after
/// the start are up to date already and are passed cheaply).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Walk {
    /// The next slot number to look at.
    next: u32,
    /// When the epoch change that started it was handed in: the walk is due from then on.
    since: Instant,
}

impl Walk {
    pub(crate) fn new(since: Instant) -> Walk {
        Walk { next: 0, since }
    }

    /// When the walk became due (it stays due until it is over).
    pub(crate) fn since(&self) -> Instant {
        self.since
    }

    /// The next at most `step` (at least one) slot numbers below `slots`; empty once the walk
    /// has passed every slot.
    pub(crate) fn step(&mut self, step: u32, slots: u32) -> Range<u32> {
        let start = self.next.min(slots);
        self.next = start.saturating_add(step.max(1)).min(slots);
        start..self.next
    }

    /// Whether every slot below `slots` was handed out.
    pub(crate) fn is_over(&self, slots: u32) -> bool {
        self.next >= slots
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_cover_every_slot_once_even_as_slots_grow() {
        let mut walk = Walk::new(Instant::ZERO);
        assert_eq!(walk.step(4, 10), 0..4);
        assert_eq!(walk.step(4, 10), 4..8);
        assert_eq!(walk.step(4, 12), 8..12);
        assert!(walk.is_over(12));
        assert_eq!(walk.step(4, 12), 12..12);
        assert!(!walk.is_over(13));
        assert_eq!(walk.step(0, 13), 12..13, "a step of zero looks at one slot");
    }
}
