//! A simulated disk: a node core's persistence requests, synced one at a time in the order the
//! core produced them.

use std::collections::VecDeque;

use keyhome_epoch::{Durable, Write};

/// The `Persist` requests a node handed to its disk and that are not synced yet.
#[derive(Debug, Default)]
pub struct Disk {
    pending: VecDeque<(u64, Vec<Write>)>,
}

/// One synced request: the number to hand to `Core::persisted`, and how many of its writes were
/// acceptor writes (for statistics).
pub struct Synced {
    pub number: u64,
    pub acceptor_writes: u64,
}

impl Disk {
    /// Queues `Persist { number, writes }`; true when the disk was idle, so the caller schedules
    /// a sync.
    pub fn push(&mut self, number: u64, writes: Vec<Write>) -> bool {
        self.pending.push_back((number, writes));
        self.pending.len() == 1
    }

    /// Syncs the oldest request onto `durable`, if any.
    pub fn sync(&mut self, durable: &mut Durable) -> Option<Synced> {
        let (number, writes) = self.pending.pop_front()?;
        let acceptor_writes = writes.iter().filter(|w| matches!(w, Write::Acceptor { .. })).count() as u64;
        for w in &writes {
            durable.apply(w);
        }
        Some(Synced { number, acceptor_writes })
    }

    /// Whether requests are still waiting for a sync.
    pub fn busy(&self) -> bool {
        !self.pending.is_empty()
    }

    /// A crash: every write not yet synced is lost.
    pub fn lose(&mut self) {
        self.pending.clear();
    }
}
