//! Simulated node clocks: each runs at its own rate, within the configured bound, from its own
//! arbitrary origin, so nothing can depend on clocks agreeing in offset.

use keyhome_epoch::Instant;

const PPM: i128 = 1_000_000;

/// One node's monotonic clock as a function of simulated real time (nanoseconds).
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    /// The reading at real time zero.
    origin: u64,
    /// Rate error in parts per million: the clock advances `1 + rate_ppm / 1e6` per real second.
    rate_ppm: i64,
}

impl Clock {
    pub fn new(origin: u64, rate_ppm: i64) -> Clock {
        Clock { origin, rate_ppm }
    }

    /// The reading at real time `real`.
    pub fn local(&self, real: u64) -> Instant {
        // In 64 bits while `real · rate` fits (runs of many hours); in 128 beyond.
        let drift = i64::try_from(real).ok().and_then(|r| r.checked_mul(self.rate_ppm)).map_or_else(
            || (i128::from(real) * i128::from(self.rate_ppm)).div_euclid(PPM) as i64,
            |d| d.div_euclid(PPM as i64),
        );
        Instant::from_nanos(self.origin.saturating_add(real).saturating_add_signed(drift))
    }

    /// The earliest real time at which the clock reads at least `local`.
    pub fn real_at(&self, local: Instant) -> u64 {
        let ticks = i128::from(local.as_nanos().saturating_sub(self.origin));
        let rate = PPM + i128::from(self.rate_ppm);
        let mut real = ((ticks * PPM + rate - 1) / rate).min(i128::from(u64::MAX)) as u64;
        while self.local(real) < local {
            real += 1;
        }
        real
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_at_inverts_local() {
        for rate in [-10_000, 0, 7, 10_000] {
            let c = Clock::new(123_456_789, rate);
            for real in [0u64, 1, 999, 1_000_000_007, 86_400_000_000_000] {
                let local = c.local(real);
                let back = c.real_at(local);
                assert!(back <= real && c.local(back) >= local, "rate {rate} real {real}");
            }
        }
    }
}
