//! The epoch layer the delegation targets run under: a script the input changes step by step.

use keyhome_delegation::Authority;
use keyhome_epoch::{Instant, NodeId, Timing};
use keyhome_ring::Ring;

use super::values::Gen;

/// What the epoch layer says; every field is drawn from the input and may change between steps.
#[derive(Debug)]
pub struct Script {
    pub me: NodeId,
    pub epoch: u64,
    pub incarnation: u64,
    pub timing: Timing,
    pub ring: Ring,
    /// The ring of the epoch before, if the node learned it.
    pub previous: Option<Ring>,
    /// `home_active` for keys homed here (with the lease).
    pub active: bool,
    pub lease: bool,
}

impl Script {
    /// Epoch 1 with members drawn from the input (this node among them, mostly).
    pub fn new(g: &mut Gen<'_>, me: NodeId, timing: Timing) -> Script {
        Script {
            me,
            epoch: 1,
            incarnation: g.range(1, 3),
            timing,
            ring: ring(g, me),
            previous: None,
            active: g.index(4) != 0,
            lease: g.index(4) != 0,
        }
    }

    /// The node learns a newer epoch (usually the next one, sometimes one further), with new
    /// members, and its lease and activation start over.
    pub fn next_epoch(&mut self, g: &mut Gen<'_>) {
        let skip = g.pick(&[1, 1, 1, 2]);
        self.epoch += skip;
        let ring = ring(g, self.me);
        let old = std::mem::replace(&mut self.ring, ring);
        self.previous = (skip == 1).then_some(old);
        self.active = false;
        self.lease = g.bool();
    }

    /// Flips the lease or the activation.
    pub fn toggle(&mut self, g: &mut Gen<'_>) {
        if g.bool() {
            self.active = !self.active;
        } else {
            self.lease = !self.lease;
        }
    }
}

/// A ring of members `1..=5` drawn from the input; this node is one of them three times in four.
fn ring(g: &mut Gen<'_>, me: NodeId) -> Ring {
    let mask = g.range(1, 31);
    let mut members: Vec<NodeId> = (1..=5).filter(|i| mask & (1 << (i - 1)) != 0).map(NodeId).collect();
    if g.index(4) != 0 && !members.contains(&me) {
        members.push(me);
    }
    Ring::new(&members)
}

impl Authority for Script {
    fn epoch(&self) -> u64 {
        self.epoch
    }

    fn incarnation(&self) -> u64 {
        self.incarnation
    }

    fn timing(&self) -> Timing {
        self.timing
    }

    fn is_member(&self, node: NodeId) -> bool {
        self.ring.contains(node)
    }

    fn home_of(&self, key: &[u8]) -> Option<NodeId> {
        self.ring.home(key)
    }

    fn home_active(&self, _now: Instant, key: &[u8]) -> bool {
        self.active && self.lease && self.home_of(key) == Some(self.me)
    }

    fn holds_lease(&self, _now: Instant) -> bool {
        self.lease
    }

    fn previous_home_of(&self, key: &[u8]) -> Option<NodeId> {
        self.previous.as_ref()?.home(key)
    }

    fn activation_passed(&self, _now: Instant) -> bool {
        self.active
    }
}
