//! [`Monotonic`]: the latest clock reading one part of the core has acted on.

use keyhome_epoch::Instant;

/// The latest reading of the node's clock that one part of the core (the membership, a shard)
/// has acted on.
///
/// The cores a part drives require readings that never decrease ("readings must never
/// decrease"), but a caller reads the clock before it takes the part's lock: a thread that read
/// early and then waited for the lock would hand the part an instant older than one it already
/// acted on, and a home would count a grant from before a request it had already queued (its end
/// of the delegation earlier than the grantee's). [`Monotonic::at`] gives the later of the two.
/// That is still no later than the clock at the moment the part acts, since every reading it
/// holds was taken before.
#[derive(Clone, Copy, Debug)]
pub struct Monotonic(Instant);

impl Monotonic {
    pub fn new(now: Instant) -> Monotonic {
        Monotonic(now)
    }

    /// The instant to act at, given a `reading` taken before the part's lock: the latest reading
    /// the part has seen.
    #[inline]
    pub fn at(&mut self, reading: Instant) -> Instant {
        if reading > self.0 {
            self.0 = reading;
        }
        self.0
    }
}
