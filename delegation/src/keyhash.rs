//! [`KeyHasher`]: how a holder hashes keys for its index, shared with its caller so that a key is
//! hashed once per call.
//!
//! A node with several key shards hashes a key to pick its shard, then its shard's holder looks
//! the key up: with one hasher for both ([`HolderConfig::key_hasher`](crate::HolderConfig), the
//! same in every shard) the node hands the holder the [`HashedKey`] it already has
//! ([`Holder::try_lock_hashed`](crate::Holder::try_lock_hashed),
//! [`Holder::lock_hashed`](crate::Holder::lock_hashed)), and a lock call hashes its key once
//! instead of twice, before it takes any lock.
//!
//! Keys come from applications and, through grants and recalls, from the network, so the hasher
//! is keyed with secrets: random ones from the operating system in a node ([`KeyHasher::random`]),
//! fixed ones where runs must repeat exactly (the simulation: [`KeyHasher::with_seeds`]).

use std::hash::BuildHasher;

/// A keyed hash of keys (aHash): see the module docs. Its `Debug` form hides the secrets.
#[derive(Clone)]
pub struct KeyHasher {
    seeds: [u64; 4],
    state: ahash::RandomState,
}

impl KeyHasher {
    /// A hasher keyed with secrets drawn from the operating system's randomness.
    pub fn random() -> KeyHasher {
        // std's `RandomState` draws its keys from the operating system: its hashes of four
        // counters are four random words.
        let os = std::collections::hash_map::RandomState::new();
        KeyHasher::with_seeds([0u64, 1, 2, 3].map(|i| os.hash_one(i)))
    }

    /// A hasher keyed with `seeds`: the same keys hash the same in every run.
    pub fn with_seeds(seeds: [u64; 4]) -> KeyHasher {
        let [a, b, c, d] = seeds;
        KeyHasher { seeds, state: ahash::RandomState::with_seeds(a, b, c, d) }
    }

    /// The hash of `key`.
    #[inline]
    pub fn hash(&self, key: &[u8]) -> u64 {
        self.state.hash_one(key)
    }

    /// `key` with its hash, to hand to a holder keyed by this hasher.
    #[inline]
    pub fn hashed<'a>(&self, key: &'a [u8]) -> HashedKey<'a> {
        HashedKey { key, hash: self.hash(key) }
    }
}

impl std::fmt::Debug for KeyHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyHasher").finish_non_exhaustive()
    }
}

/// A key and its hash by one [`KeyHasher`] (only [`KeyHasher::hashed`] makes one), so that the
/// two travel together. A holder given one of another hasher's would not find the key.
#[derive(Clone, Copy, Debug)]
pub struct HashedKey<'a> {
    key: &'a [u8],
    hash: u64,
}

impl<'a> HashedKey<'a> {
    pub fn key(self) -> &'a [u8] {
        self.key
    }

    pub fn hash(self) -> u64 {
        self.hash
    }
}

impl PartialEq for KeyHasher {
    fn eq(&self, other: &KeyHasher) -> bool {
        self.seeds == other.seeds
    }
}

impl Eq for KeyHasher {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_decide_the_hash() {
        let a = KeyHasher::with_seeds([1, 2, 3, 4]);
        assert_eq!(a.hash(b"k"), KeyHasher::with_seeds([1, 2, 3, 4]).hash(b"k"));
        assert_ne!(a.hash(b"k"), KeyHasher::with_seeds([1, 2, 3, 5]).hash(b"k"));
        assert_eq!(a, a.clone());
        assert_eq!(a.hashed(b"k").hash(), a.hash(b"k"));
        assert_ne!(KeyHasher::random(), KeyHasher::random());
        assert_eq!(format!("{a:?}"), "KeyHasher { .. }", "the secrets are not printed");
    }
}
