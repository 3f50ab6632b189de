//! [`HotKeys`]: a bounded view of the keys this node contends for most, for `keyhome status`
//! and the status page (metrics carry no per-key labels: their cardinality would be unbounded).
//!
//! Only contention is counted, on paths that send messages anyway: a lock that had to wait for
//! the key's home, and a Recall this node received for a delegation it holds (resends
//! included). A key re-locked under a cached
//! delegation is not hot, however often it is locked. At most [`TRACKED`] keys are remembered,
//! least recently contended forgotten first, so a key that stays hot stays in view.

use std::num::NonZeroUsize;

use lru::LruCache;

/// Keys remembered at most (each costs its key's bytes and two counters).
pub const TRACKED: usize = 256;

/// How much one key was contended for, since it was last forgotten.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Heat {
    /// Locks of the key on this node that had to wait for a message (not admitted at once).
    pub waits: u64,
    /// Recall messages for the key this node received as its holder (another node wanted it).
    pub recalls: u64,
}

impl Heat {
    /// How hot: waits and recalls together.
    pub fn score(&self) -> u64 {
        self.waits.saturating_add(self.recalls)
    }
}

/// The most recently contended keys, with their [`Heat`]. See the module docs.
pub struct HotKeys {
    keys: LruCache<Vec<u8>, Heat>,
}

impl Default for HotKeys {
    fn default() -> HotKeys {
        HotKeys { keys: LruCache::new(NonZeroUsize::new(TRACKED).unwrap_or(NonZeroUsize::MIN)) }
    }
}

impl HotKeys {
    /// A lock of `key` waits for its home.
    pub fn waited(&mut self, key: &[u8]) {
        self.heat(key).waits += 1;
    }

    /// A Recall of `key` arrived for this node's delegation.
    pub fn recalled(&mut self, key: &[u8]) {
        self.heat(key).recalls += 1;
    }

    /// The `n` hottest keys, hottest first (ties: the more recently contended first).
    pub fn top(&self, n: usize) -> Vec<(&[u8], Heat)> {
        let mut all: Vec<_> = self.keys.iter().map(|(k, h)| (&**k, *h)).collect();
        // `iter` runs most recent first and the sort is stable.
        all.sort_by_key(|(_, h)| std::cmp::Reverse(h.score()));
        all.truncate(n);
        all
    }

    fn heat(&mut self, key: &[u8]) -> &mut Heat {
        self.keys.get_or_insert_mut_ref(key, Heat::default)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hottest_keys_come_first_and_the_view_stays_bounded() {
        let mut hot = HotKeys::default();
        for i in 0..(TRACKED as u32 * 4) {
            hot.waited(&i.to_be_bytes());
        }
        assert_eq!(hot.keys.len(), TRACKED, "bounded");
        for _ in 0..3 {
            hot.waited(b"orders");
        }
        hot.recalled(b"orders");
        hot.recalled(b"carts");
        hot.waited(b"carts");
        let top = hot.top(2);
        assert_eq!(top[0], (&b"orders"[..], Heat { waits: 3, recalls: 1 }));
        assert_eq!(top[1], (&b"carts"[..], Heat { waits: 1, recalls: 1 }));
        assert_eq!(hot.top(1000).len(), TRACKED);
    }
}
