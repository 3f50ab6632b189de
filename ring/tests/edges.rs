//! Edge cases of the public API: empty rings, degenerate `k`, unusual keys
//! and ids. Nothing here may panic.

use keyhome_ring::{NodeId, Ring, home, homes};

fn ids(raw: &[u64]) -> Vec<NodeId> {
    raw.iter().copied().map(NodeId).collect()
}

#[test]
fn empty_ring_finds_nothing() {
    let ring = Ring::new(&[]);
    assert!(ring.is_empty());
    assert_eq!(ring.len(), 0);
    assert!(ring.members().is_empty());
    assert!(!ring.contains(NodeId(0)));
    for key in [&b""[..], b"k", &[0xff; 100]] {
        assert_eq!(ring.home(key), None);
        for k in [0, 1, 3, usize::MAX] {
            assert!(ring.homes(key, k).is_empty());
            assert!(homes(key, &[], k).is_empty());
        }
        assert_eq!(home(key, &[]), None);
    }
}

#[test]
fn k_zero_gives_nothing() {
    let members = ids(&[1, 2, 3]);
    let ring = Ring::new(&members);
    assert!(ring.homes(b"k", 0).is_empty());
    assert!(homes(b"k", &members, 0).is_empty());
}

#[test]
fn k_beyond_the_ring_gives_every_member_once() {
    let members = ids(&[9, 4, 7, 4]);
    let ring = Ring::new(&members);
    for k in [3, 4, 1_000, usize::MAX] {
        let all = ring.homes(b"k", k);
        assert_eq!(all.len(), 3);
        let mut sorted = all.clone();
        sorted.sort();
        assert_eq!(sorted, ring.members());
        assert_eq!(homes(b"k", &members, k), all);
    }
}

#[test]
fn single_member_owns_every_key() {
    let ring = Ring::new(&[NodeId(42)]);
    for i in 0u32..200 {
        let key = i.to_be_bytes();
        assert_eq!(ring.home(&key), Some(NodeId(42)));
        assert_eq!(ring.homes(&key, 3), [NodeId(42)]);
    }
}

#[test]
fn unusual_keys_are_accepted() {
    let members = ids(&[0, 1, 2, 3, 1 << 40, u64::MAX]);
    let ring = Ring::new(&members);
    let every_byte: Vec<u8> = (0..=255).collect();
    let huge = vec![0xa5u8; 4 << 20];
    let keys: [&[u8]; 6] = [b"", b"\0", &[0xff; 8], &every_byte, "ключ/🔒".as_bytes(), &huge];
    for key in keys {
        let best = ring.home(key);
        assert!(best.is_some_and(|id| ring.contains(id)));
        assert_eq!(ring.homes(key, 1).first().copied(), best);
        assert_eq!(home(key, &members), best);
    }
}

#[test]
fn extreme_ids_are_members_like_any_other() {
    let ring = Ring::new(&ids(&[u64::MAX, 0]));
    assert_eq!(ring.members(), ids(&[0, u64::MAX]));
    assert!(ring.contains(NodeId(u64::MAX)) && ring.contains(NodeId(0)));
    let owners: Vec<Option<NodeId>> = (0u32..64).map(|i| ring.home(&i.to_le_bytes())).collect();
    assert!(owners.contains(&Some(NodeId(0))));
    assert!(owners.contains(&Some(NodeId(u64::MAX))));
}

#[test]
fn construction_sorts_and_deduplicates() {
    let ring = Ring::new(&ids(&[5, 3, 5, 1, 3, 3]));
    assert_eq!(ring.members(), ids(&[1, 3, 5]));
    assert_eq!(ring.len(), 3);
    assert!(!ring.is_empty());
    assert!(ring.contains(NodeId(3)));
    assert!(!ring.contains(NodeId(2)));
    assert_eq!(ring, Ring::new(&ids(&[1, 3, 5])));
    assert_eq!(ring.clone(), ring);
    assert_ne!(ring, Ring::new(&ids(&[1, 3])));
}

#[test]
fn node_id_displays_as_the_number_the_cli_takes() {
    assert_eq!(NodeId(0).to_string(), "0");
    assert_eq!(NodeId(42).to_string(), "42");
    assert_eq!(NodeId(u64::MAX).to_string(), "18446744073709551615");
}

#[test]
fn ring_can_be_shared_between_threads() {
    fn shareable<T: Send + Sync>() {}
    shareable::<Ring>();
    shareable::<NodeId>();
}
