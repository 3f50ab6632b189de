//! Time as the protocol cores see it: one node's own monotonic clock, handed in by the driver.
//!
//! An [`Instant`] is only meaningful on the node that read it. It never crosses the wire: messages
//! carry [`Duration`]s. The node runtime reads a boot-time clock (one that keeps counting while the
//! machine is suspended); the simulation hands in its own simulated clocks.

use std::ops::{Add, Sub};
use std::time::Duration;

/// A reading of one node's monotonic clock, in nanoseconds since an arbitrary per-process origin.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Instant(u64);

impl Instant {
    /// The clock's origin.
    pub const ZERO: Instant = Instant(0);

    /// An instant `nanos` nanoseconds after the origin.
    pub const fn from_nanos(nanos: u64) -> Instant {
        Instant(nanos)
    }

    /// Nanoseconds since the origin.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// Time from `earlier` to `self`, zero if `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Instant) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl Add<Duration> for Instant {
    type Output = Instant;
    /// Saturates at the far future rather than wrapping.
    fn add(self, d: Duration) -> Instant {
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        Instant(self.0.saturating_add(nanos))
    }
}

impl Sub<Duration> for Instant {
    type Output = Instant;
    /// Saturates at the origin.
    fn sub(self, d: Duration) -> Instant {
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        Instant(self.0.saturating_sub(nanos))
    }
}

/// Parts per million, the unit of the clock-rate bound.
const PPM: u128 = 1_000_000;

/// The earlier of two optional instants (`None` means "never"). Straight-line, for the poll
/// functions drivers call after every input.
#[inline]
pub fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// How long a node must wait on its own clock so that `d` has surely passed on any other node's
/// clock, when every clock's rate is within `rate_ppm` parts per million of real time.
///
/// A clock that runs fast by the bound ticks `d` in `d / (1 + ε)` real time; one that runs slow
/// needs `d / (1 - ε)`. Waiting `d · (1 + ε) / (1 - ε)` local ticks covers both. Rounded up to the
/// nanosecond; a bound of 1 000 000 ppm or more (no usable bound) gives the largest duration.
pub fn rate_margin(d: Duration, rate_ppm: u32) -> Duration {
    let eps = u128::from(rate_ppm);
    if eps >= PPM {
        return Duration::MAX;
    }
    let num = d.as_nanos().saturating_mul(PPM + eps);
    let den = PPM - eps;
    let nanos = num.div_ceil(den);
    u64::try_from(nanos).map_or(Duration::MAX, Duration::from_nanos)
}

/// The inverse of [`rate_margin`]: the longest `v` such that `rate_margin(v, rate_ppm) <= d`
/// (rounded down), so that `v` measured on any other clock within the bound surely ends before
/// `d` has passed on this one. What a node tells a client it may count on its own clock.
pub fn rate_shrink(d: Duration, rate_ppm: u32) -> Duration {
    let eps = u128::from(rate_ppm);
    if eps >= PPM {
        return Duration::ZERO;
    }
    let nanos = d.as_nanos().saturating_mul(PPM - eps) / (PPM + eps);
    u64::try_from(nanos).map_or(Duration::MAX, Duration::from_nanos)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn margin_covers_both_directions() {
        let d = Duration::from_secs(10);
        let w = rate_margin(d, 10_000); // 1%
        // 10 s * 1.01 / 0.99 = 10.2020... s
        assert!(w > Duration::from_millis(10_202) && w < Duration::from_millis(10_203));
        assert_eq!(rate_margin(d, 0), d);
        assert_eq!(rate_margin(d, 1_000_000), Duration::MAX);
    }

    #[test]
    fn shrink_inverts_margin() {
        for d in
            [Duration::ZERO, Duration::from_millis(7), Duration::from_secs(10), Duration::from_secs(86_400)]
        {
            for ppm in [0, 1, 100, 10_000, 999_999] {
                let v = rate_shrink(d, ppm);
                assert!(rate_margin(v, ppm) <= d, "{d:?} {ppm}");
                assert!(rate_margin(v + Duration::from_nanos(2), ppm) > d || v == d, "{d:?} {ppm}");
            }
        }
        assert_eq!(rate_shrink(Duration::from_secs(1), 1_000_000), Duration::ZERO);
    }

    #[test]
    fn instant_arithmetic_saturates() {
        let t = Instant::from_nanos(5);
        assert_eq!(t - Duration::from_nanos(9), Instant::ZERO);
        assert_eq!((t + Duration::MAX).as_nanos(), u64::MAX);
        assert_eq!(Instant::from_nanos(9).saturating_duration_since(t), Duration::from_nanos(4));
        assert_eq!(t.saturating_duration_since(Instant::from_nanos(9)), Duration::ZERO);
    }
}
