//! The simulations' event queue: events in time order, ties in the order they were scheduled.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use crate::world::Real;

/// Events of type `E` keyed by simulated real time. Events are boxed so the heap moves only
/// small entries.
pub struct EventQueue<E> {
    heap: BinaryHeap<Reverse<Entry<E>>>,
    /// Scheduling order, which breaks ties between events at one instant (so runs replay).
    seq: u64,
}

struct Entry<E> {
    at: Real,
    seq: u64,
    event: Box<E>,
}

impl<E> PartialEq for Entry<E> {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}

impl<E> Eq for Entry<E> {}

impl<E> PartialOrd for Entry<E> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl<E> Ord for Entry<E> {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        EventQueue { heap: BinaryHeap::new(), seq: 0 }
    }
}

impl<E> EventQueue<E> {
    /// Schedules `event` at `at`, after every event already scheduled at `at`.
    pub fn push(&mut self, at: Real, event: E) {
        self.seq += 1;
        self.heap.push(Reverse(Entry { at, seq: self.seq, event: Box::new(event) }));
    }

    /// The time of the next event.
    pub fn peek_time(&self) -> Option<Real> {
        self.heap.peek().map(|Reverse(e)| e.at)
    }

    /// Takes the next event.
    pub fn pop(&mut self) -> Option<(Real, E)> {
        self.heap.pop().map(|Reverse(e)| (e.at, *e.event))
    }
}
