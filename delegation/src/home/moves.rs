//! [`Moves`]: the handovers a [`super::Home`] has in progress, by slot number, and when each is
//! next due to be sent.
//!
//! An epoch change can move most of a home's keys at once. Their handover state is therefore kept
//! where adding it never rehashes or copies what is already there: in chunks of
//! [`super::CHUNK`] slots (one allocation of 40 KiB, made when the first key of the chunk moves
//! and freed when the last handover in it ends), and their resends in a queue of batches, one
//! batch per instant at which handovers were sent. The home's timer heap holds none of them.

use std::collections::VecDeque;

use keyhome_epoch::{Instant, NodeId};

use super::CHUNK;

/// A moved key's handover in progress.
#[derive(Clone, Copy, Debug)]
pub(super) struct Moving {
    pub(super) to: NodeId,
    /// The epoch that moved the key; only an ack under it counts.
    pub(super) epoch: u64,
    pub(super) next_send: Instant,
    /// Sends since the key last had a live delegation.
    pub(super) sends: u32,
}

/// The handovers of one chunk of slots.
#[derive(Debug)]
struct Chunk {
    /// [`CHUNK`] entries.
    slots: Box<[Option<Moving>]>,
    /// Entries that are `Some`.
    count: usize,
}

/// Handovers in progress by slot number, and their sends by due instant. See the module docs.
#[derive(Debug, Default)]
pub(super) struct Moves {
    chunks: Vec<Option<Chunk>>,
    len: usize,
    /// Slot numbers whose handover is due at each instant, earliest first (instants are pushed in
    /// the order sends happen, so they increase unless the resend period shrank). A slot may be
    /// listed more than once, or no longer be moving: each is checked when it comes up.
    due: VecDeque<(Instant, Vec<u32>)>,
}

impl Moves {
    pub(super) fn get(&self, slot: u32) -> Option<&Moving> {
        let (c, i) = split(slot);
        self.chunks.get(c)?.as_ref()?.slots[i].as_ref()
    }

    pub(super) fn get_mut(&mut self, slot: u32) -> Option<&mut Moving> {
        let (c, i) = split(slot);
        self.chunks.get_mut(c)?.as_mut()?.slots[i].as_mut()
    }

    /// Starts (or restarts) the handover of `slot`. It is due at `moving.next_send`, which the
    /// caller acts on at once or lists with [`Moves::list`].
    pub(super) fn insert(&mut self, slot: u32, moving: Moving) {
        let (c, i) = split(slot);
        if self.chunks.len() <= c {
            self.chunks.resize_with(c + 1, || None);
        }
        let chunk = self.chunks[c]
            .get_or_insert_with(|| Chunk { slots: std::iter::repeat_n(None, CHUNK).collect(), count: 0 });
        if chunk.slots[i].replace(moving).is_none() {
            chunk.count += 1;
            self.len += 1;
        }
    }

    /// Ends the handover of `slot`, if any.
    pub(super) fn remove(&mut self, slot: u32) -> Option<Moving> {
        let (c, i) = split(slot);
        let entry = self.chunks.get_mut(c)?;
        let chunk = entry.as_mut()?;
        let moving = chunk.slots[i].take()?;
        chunk.count -= 1;
        self.len -= 1;
        if chunk.count == 0 {
            *entry = None;
        }
        if self.len == 0 {
            // Nothing moves any more: every listed send is stale.
            self.due.clear();
        }
        Some(moving)
    }

    /// Lists `slot` as due at `at`. A batch holds at most [`CHUNK`] slots, so that no batch
    /// ever grows large enough for its growth to cost.
    pub(super) fn list(&mut self, slot: u32, at: Instant) {
        match self.due.back_mut() {
            Some((last, slots)) if *last == at && slots.len() < CHUNK => slots.push(slot),
            _ => self.due.push_back((at, vec![slot])),
        }
    }

    /// When the first listed send is due.
    pub(super) fn next_due(&self) -> Option<Instant> {
        self.due.front().map(|(at, _)| *at)
    }

    /// Takes at most `max` (at least one) listed slots due at or before `now`, earliest first.
    pub(super) fn take_due(&mut self, now: Instant, max: usize) -> Vec<u32> {
        let max = max.max(1);
        let mut taken = Vec::new();
        while taken.len() < max
            && let Some((at, slots)) = self.due.front_mut()
            && *at <= now
        {
            let room = max - taken.len();
            if slots.len() <= room {
                taken.append(slots);
                self.due.pop_front();
            } else {
                taken.extend(slots.drain(..room));
            }
        }
        taken
    }

    /// Heap bytes: the chunk table, the chunks and the send queue.
    pub(super) fn allocation_size(&self) -> usize {
        let chunks = self.chunks.capacity() * size_of::<Option<Chunk>>()
            + self.chunks.iter().flatten().count() * CHUNK * size_of::<Option<Moving>>();
        let due = self.due.capacity() * size_of::<(Instant, Vec<u32>)>()
            + self.due.iter().map(|(_, s)| s.capacity() * size_of::<u32>()).sum::<usize>();
        chunks + due
    }
}

fn split(slot: u32) -> (usize, usize) {
    (slot as usize / CHUNK, slot as usize % CHUNK)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moving(at: u64) -> Moving {
        Moving { to: NodeId(2), epoch: 1, next_send: Instant::from_nanos(at), sends: 0 }
    }

    #[test]
    fn chunks_come_and_go_with_their_handovers() {
        let mut moves = Moves::default();
        moves.insert(5, moving(1));
        moves.insert(CHUNK as u32 * 3, moving(1));
        assert_eq!(moves.chunks.iter().flatten().count(), 2);
        assert!(moves.get(5).is_some() && moves.get(6).is_none() && moves.get(u32::MAX).is_none());
        if let Some(m) = moves.get_mut(5) {
            m.sends = 4;
        }
        assert_eq!(moves.remove(5).map(|m| m.sends), Some(4));
        assert!(moves.remove(5).is_none());
        assert_eq!(moves.chunks.iter().flatten().count(), 1, "an empty chunk is freed");
    }

    #[test]
    fn due_sends_come_earliest_first_and_at_most_max_at_a_time() {
        let mut moves = Moves::default();
        moves.insert(1, moving(0));
        let at = Instant::from_nanos;
        for slot in 0..5 {
            moves.list(slot, at(10));
        }
        moves.list(9, at(20));
        assert_eq!(moves.next_due(), Some(at(10)));
        assert_eq!(moves.take_due(at(9), 8), Vec::<u32>::new());
        assert_eq!(moves.take_due(at(25), 3), [0, 1, 2]);
        assert_eq!(moves.take_due(at(25), 3), [3, 4, 9]);
        assert_eq!(moves.next_due(), None);
        moves.list(7, at(30));
        moves.remove(1);
        assert_eq!(moves.next_due(), None, "nothing moves: the queue is dropped");
    }
}
