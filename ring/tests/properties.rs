//! Structural properties of rendezvous hashing, checked on random member
//! sets and keys. They hold for every input (no tolerance), so a failure is
//! a bug; proptest prints the shrunk counter-example.

use keyhome_ring::{NodeId, Ring, home, homes};
use proptest::prelude::*;

/// Cases per property: enough to explore, few enough that the whole file
/// runs well under a second.
fn config() -> ProptestConfig {
    ProptestConfig { cases: 96, failure_persistence: None, ..ProptestConfig::default() }
}

/// Ids from a small range (so duplicates and neighbours are common) or from
/// the whole `u64` range (extremes included).
fn id() -> impl Strategy<Value = NodeId> {
    prop_oneof![0u64..48, any::<u64>(), Just(u64::MAX), Just(0)].prop_map(NodeId)
}

fn member_list(max: usize) -> impl Strategy<Value = Vec<NodeId>> {
    prop::collection::vec(id(), 0..max)
}

fn keys() -> impl Strategy<Value = Vec<Vec<u8>>> {
    prop::collection::vec(prop::collection::vec(any::<u8>(), 0..48), 1..24)
}

/// The full ranking of `key` over `ring`.
fn ranking(ring: &Ring, key: &[u8]) -> Vec<NodeId> {
    ring.homes(key, usize::MAX)
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn order_and_duplicates_do_not_matter(
        (members, shuffled) in member_list(40)
            .prop_flat_map(|m| (Just(m.clone()), Just(m).prop_shuffle())),
        repeat in prop::collection::vec(any::<prop::sample::Index>(), 0..8),
        keys in keys(),
    ) {
        let mut scrambled = shuffled;
        if !members.is_empty() {
            scrambled.extend(repeat.iter().map(|i| members[i.index(members.len())]));
        }
        let ring = Ring::new(&members);
        let other = Ring::new(&scrambled);
        prop_assert_eq!(&ring, &other);
        prop_assert!(ring.members().windows(2).all(|w| w[0] < w[1]));
        for key in &keys {
            prop_assert_eq!(ring.home(key), other.home(key));
            prop_assert_eq!(ranking(&ring, key), ranking(&other, key));
            prop_assert_eq!(home(key, &scrambled), ring.home(key));
            prop_assert_eq!(homes(key, &scrambled, 3), ring.homes(key, 3));
        }
    }

    #[test]
    fn homes_is_a_ranking_with_consistent_prefixes(
        members in member_list(40),
        key in prop::collection::vec(any::<u8>(), 0..64),
        k in 0usize..48,
    ) {
        let ring = Ring::new(&members);
        let full = ranking(&ring, &key);
        let mut sorted = full.clone();
        sorted.sort();
        prop_assert_eq!(&sorted[..], ring.members());
        prop_assert_eq!(full.first().copied(), ring.home(&key));
        let top = ring.homes(&key, k);
        prop_assert_eq!(top.len(), k.min(ring.len()));
        prop_assert_eq!(&top[..], &full[..top.len()]);
        prop_assert_eq!(homes(&key, &members, k), top);
    }

    /// Removing member `m` moves exactly the keys `m` was home to, each to
    /// its second choice; more generally the ranking loses `m` and keeps
    /// the order of everyone else.
    #[test]
    fn removing_a_member_moves_only_its_keys(
        members in member_list(40).prop_filter("two members", |m| Ring::new(m).len() >= 2),
        pick in any::<prop::sample::Index>(),
        keys in keys(),
    ) {
        let ring = Ring::new(&members);
        let gone = ring.members()[pick.index(ring.len())];
        let rest: Vec<NodeId> = ring.members().iter().copied().filter(|&m| m != gone).collect();
        let smaller = Ring::new(&rest);
        for key in &keys {
            let before = ranking(&ring, key);
            let after = ranking(&smaller, key);
            let expected: Vec<NodeId> = before.iter().copied().filter(|&m| m != gone).collect();
            prop_assert_eq!(&after, &expected);
            if before[0] == gone {
                prop_assert_eq!(smaller.home(key), Some(before[1]));
            } else {
                prop_assert_eq!(smaller.home(key), Some(before[0]));
            }
        }
    }

    /// Adding member `m` moves keys only onto `m`, and leaves the relative
    /// order of the existing members untouched.
    #[test]
    fn adding_a_member_moves_keys_only_to_it(
        members in member_list(40),
        new in id(),
        keys in keys(),
    ) {
        let ring = Ring::new(&members);
        prop_assume!(!ring.contains(new));
        let mut grown = members.clone();
        grown.push(new);
        let bigger = Ring::new(&grown);
        for key in &keys {
            let after = bigger.home(key);
            prop_assert!(after == ring.home(key) || after == Some(new));
            let kept: Vec<NodeId> = ranking(&bigger, key).into_iter().filter(|&m| m != new).collect();
            prop_assert_eq!(kept, ranking(&ring, key));
        }
    }
}
