//! The hashing half of the routing algorithm: how keys and members become
//! 64-bit integers, and how a (member, key) pair becomes a score.
//!
//! Everything here is part of the wire-visible routing contract guarded by
//! [`ROUTING_VERSION`](crate::ROUTING_VERSION): changing any constant,
//! context string, byte order or operation changes which node owns which
//! key, and must come with a version bump and regenerated golden vectors
//! (`tests/golden_vectors.txt`).
//!
//! Only integer operations with fully specified (wrapping) semantics are
//! used, so every platform and compiler computes bit-identical scores.

use std::sync::LazyLock;

use blake3::hazmat::{ContextKey, HasherExt, hash_derive_key_context};

use crate::NodeId;

/// BLAKE3 `derive_key` context under which key bytes are digested.
pub(crate) const KEY_CONTEXT: &str = "keyhome ring v1 key";

/// BLAKE3 `derive_key` context under which member ids are turned into seeds.
pub(crate) const MEMBER_CONTEXT: &str = "keyhome ring v1 member";

/// [`KEY_CONTEXT`] hashed once per process, so a look-up costs one BLAKE3
/// pass over the key instead of two (one for the context, one for the key).
static KEY_CONTEXT_KEY: LazyLock<ContextKey> = LazyLock::new(|| hash_derive_key_context(KEY_CONTEXT));

/// The key digest: the first 8 bytes, read little-endian, of
/// `blake3::derive_key(KEY_CONTEXT, key)`.
///
/// Any byte string is accepted (empty, binary, gigabytes long); the digest
/// is computed once per look-up and shared by all members.
pub(crate) fn key_digest(key: &[u8]) -> u64 {
    let mut hasher = blake3::Hasher::new_from_context_key(&KEY_CONTEXT_KEY);
    hasher.update(key);
    first_u64_le(hasher.finalize().as_bytes())
}

/// The member seed: the first 8 bytes, read little-endian, of
/// `blake3::derive_key(MEMBER_CONTEXT, id.to_le_bytes())` (the id as exactly
/// 8 little-endian bytes).
///
/// Precomputed by [`Ring::new`](crate::Ring::new); the free functions
/// recompute it per call.
pub(crate) fn member_seed(id: NodeId) -> u64 {
    first_u64_le(&blake3::derive_key(MEMBER_CONTEXT, &id.0.to_le_bytes()))
}

/// The score of a member for a key: `mix64(digest XOR seed)`.
///
/// For a fixed seed this is a bijection of the digest, and for a fixed
/// digest a bijection of the seed, so two members with different seeds
/// never receive equal scores for the same key.
#[inline]
pub(crate) fn score(digest: u64, seed: u64) -> u64 {
    mix64(digest ^ seed)
}

/// The SplitMix64 output finalizer (David Stafford's "Mix13" constants):
/// a bijective 64-bit → 64-bit avalanche function where every input bit
/// affects every output bit with probability close to one half.
///
/// `z ^= z >> 30; z *= 0xbf58476d1ce4e5b9; z ^= z >> 27;
///  z *= 0x94d049bb133111eb; z ^= z >> 31` (multiplications modulo 2^64).
#[inline]
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Reads the first 8 bytes of a 32-byte BLAKE3 output as a little-endian u64.
fn first_u64_le(bytes: &[u8; 32]) -> u64 {
    let mut first = [0u8; 8];
    first.copy_from_slice(&bytes[..8]);
    u64::from_le_bytes(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cached context key must be exactly what `derive_key` uses, i.e.
    /// the fast path is plain `blake3::derive_key(KEY_CONTEXT, key)`.
    #[test]
    fn key_digest_is_derive_key() {
        for key in [&b""[..], b"a", b"lock/users/42", &[0xffu8; 2049]] {
            let reference = blake3::derive_key(KEY_CONTEXT, key);
            assert_eq!(key_digest(key), first_u64_le(&reference));
        }
    }

    /// Contexts are distinct, so a key whose bytes equal a member id's
    /// encoding still gets an unrelated digest.
    #[test]
    fn key_and_member_domains_are_separated() {
        assert_ne!(KEY_CONTEXT, MEMBER_CONTEXT);
        let id = NodeId(42);
        assert_ne!(key_digest(&id.0.to_le_bytes()), member_seed(id));
    }

    /// `mix64` is exactly the SplitMix64 finalizer: the first two outputs
    /// of SplitMix64 seeded with 0 are the published reference values.
    #[test]
    fn mix64_matches_splitmix64_reference_outputs() {
        const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;
        assert_eq!(mix64(GAMMA), 0xe220_a839_7b1d_cdaf);
        assert_eq!(mix64(GAMMA.wrapping_mul(2)), 0x6e78_9e6a_a1b9_65f4);
    }

    /// Frozen intermediate values: when the golden vectors fail, these say
    /// which stage of the algorithm changed.
    #[test]
    fn frozen_intermediates() {
        assert_eq!(mix64(0), 0);
        assert_eq!(mix64(1), 0x5692_161d_100b_05e5);
        assert_eq!(key_digest(b""), 0xbffa_b1f2_ad96_c252);
        assert_eq!(member_seed(NodeId(0)), 0x1873_388e_15c8_a988);
        assert_eq!(member_seed(NodeId(u64::MAX)), 0xc415_6dd9_e26e_cc95);
    }
}
