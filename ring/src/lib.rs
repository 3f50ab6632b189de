//! Which node is the home of a key: rendezvous (highest-random-weight)
//! hashing over the cluster's member set.
//!
//! Every member `m` gets a score for a key, and the key's home is the member
//! with the highest score; the replica order for a key is the members sorted
//! by descending score. Scores are computed as follows (see `docs/ring.md`):
//!
//! 1. key digest `d` = first 8 bytes (little-endian) of
//!    `blake3::derive_key("keyhome ring v1 key", key)`, computed once per
//!    look-up;
//! 2. member seed `s` = first 8 bytes (little-endian) of
//!    `blake3::derive_key("keyhome ring v1 member", id.to_le_bytes())`,
//!    precomputed by [`Ring::new`];
//! 3. score = SplitMix64 finalizer of `d ^ s` (integer-only, wrapping);
//! 4. equal scores (only possible when two seeds collide) go to the smaller id.
//!
//! Removing a member moves exactly the keys it was home to (each to its
//! second choice); adding one moves keys only onto the new member, about
//! `1/(n+1)` of them.
//!
//! The algorithm is versioned by [`ROUTING_VERSION`] and pinned by the golden
//! vectors in `tests/golden_vectors.txt`.
//!
//! ```
//! use keyhome_ring::{NodeId, Ring};
//!
//! // Once per membership change:
//! let ring = Ring::new(&[NodeId(3), NodeId(1), NodeId(2)]);
//! // Per request:
//! let owner = ring.home(b"lock/users/42").expect("the ring is not empty");
//! let replicas = ring.homes(b"lock/users/42", 2);
//! assert_eq!(replicas[0], owner);
//! assert!(replicas.iter().all(|&id| ring.contains(id)));
//! ```

#![warn(missing_docs)]

mod hash;
mod ring;

use std::cmp::Reverse;

use serde::{Deserialize, Serialize};

pub use crate::ring::{KeyDigest, Ring};

/// A node's identity in the cluster (the id in its certificate). Displayed as the bare number,
/// as the CLI takes it (`--remove 3`); messages say "node 3".
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct NodeId(pub u64);

impl std::fmt::Display for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Version of the routing algorithm; peers refuse to talk when theirs differs.
///
/// Any change to how homes are computed (context strings, digest or seed
/// width, byte order, mix function, tie-break) must bump this, because two
/// binaries that place keys differently must never serve one cluster. The
/// golden-vector test enforces it: the vectors file declares the version it
/// was generated for, and `tests/golden.rs` keeps an append-only table of
/// each version's fingerprint (a digest of the rankings of a fixed probe
/// workload), so an algorithm change fails until this constant is bumped.
pub const ROUTING_VERSION: u32 = 1;

/// The home of `key` among `members` (any order, duplicates allowed), or
/// `None` when `members` is empty. Same result as
/// `Ring::new(members).home(key)`.
///
/// Allocates nothing, but hashes every member's id on each call (one BLAKE3
/// call per member); on hot paths build a [`Ring`] once and reuse it.
pub fn home(key: &[u8], members: &[NodeId]) -> Option<NodeId> {
    if members.is_empty() {
        return None;
    }
    let digest = hash::key_digest(key);
    // `Reverse(id)`: on equal scores the smaller id ranks higher.
    members.iter().copied().max_by_key(|&id| (hash::score(digest, hash::member_seed(id)), Reverse(id)))
}

/// The `k` best members for `key` among `members` (any order, duplicates
/// allowed), best first; same result as `Ring::new(members).homes(key, k)`.
///
/// Builds a temporary [`Ring`] (a sort plus one BLAKE3 call per distinct
/// member) unless `k == 0`; on hot paths build a [`Ring`] once and reuse it.
pub fn homes(key: &[u8], members: &[NodeId], k: usize) -> Vec<NodeId> {
    if k == 0 {
        return Vec::new();
    }
    Ring::new(members).homes(key, k)
}
