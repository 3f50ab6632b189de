//! Statistical properties over fixed, generated keys: how evenly keys
//! spread over members, and how many move on a membership change.
//!
//! Keys and ids are fixed, so these tests are deterministic (never flaky):
//! they pass or fail the same way on every run and platform. The bounds are
//! still chosen from the binomial model an ideal random assignment follows,
//! so a failure means real bias, not bad luck. All arithmetic is integer.

use keyhome_ring::{NodeId, Ring};

/// Deterministic, realistic-looking lock keys (text with shared prefixes).
fn key(i: usize) -> Vec<u8> {
    format!("tenant-{}/locks/resource-{i}", i % 97).into_bytes()
}

/// Non-contiguous ids: `1, 1_000_004, 2_000_007, …`.
fn members(n: u64) -> Vec<NodeId> {
    (0..n).map(|i| NodeId(1 + i * 1_000_003)).collect()
}

/// Balance: with `E = 2_000` keys expected per member, every member's count
/// `c` satisfies `|c - E| <= 5 * sqrt(E)` (5 sigma, about ±11.2% of its
/// `1/n` share, hence max/min load ratio below 1.26), and the chi-square
/// statistic `sum (c - E)^2 / E` stays within `dof + 6 * sqrt(2 * dof)`
/// (`dof = n - 1`), so the whole histogram is as flat as a random one.
#[test]
fn every_member_gets_its_share() {
    const PER_MEMBER: u64 = 2_000;
    for n in [3u64, 16, 64, 256] {
        let ring = Ring::new(&members(n));
        let mut counts = vec![0u64; ring.len()];
        for i in 0..(PER_MEMBER * n) as usize {
            let owner = ring.home(&key(i)).expect("ring is not empty");
            let at = ring.members().binary_search(&owner).expect("owner is a member");
            counts[at] += 1;
        }
        let worst = counts.iter().map(|&c| c.abs_diff(PER_MEMBER)).max().unwrap_or(0);
        assert!(
            worst * worst <= 25 * PER_MEMBER,
            "n={n}: a member's count is {worst} keys away from {PER_MEMBER}: {counts:?}"
        );
        let chi_square_e: u64 = counts.iter().map(|&c| c.abs_diff(PER_MEMBER).pow(2)).sum();
        let dof = n - 1;
        let bound = dof + 6 * (2 * dof).isqrt();
        assert!(
            chi_square_e <= bound * PER_MEMBER,
            "n={n}: chi-square {} exceeds {bound}",
            chi_square_e / PER_MEMBER
        );
    }
}

/// Adding a member to `n` moves only keys onto it, and about `N/(n+1)` of
/// them: `|moved - N/(n+1)| <= 5 sigma` with `sigma^2 = N n / (n+1)^2`,
/// i.e. `(moved (n+1) - N)^2 <= 25 N n`, over `N = 20_000` keys.
#[test]
fn adding_a_member_moves_about_one_in_n_plus_one() {
    const KEYS: u64 = 20_000;
    for n in [1u64, 3, 16, 64, 256] {
        let before = members(n);
        let new = NodeId(u64::MAX - n);
        let mut grown = before.clone();
        grown.push(new);
        let (old, bigger) = (Ring::new(&before), Ring::new(&grown));
        let mut moved = 0u64;
        for i in 0..KEYS as usize {
            let key = key(i);
            let (was, is) = (old.home(&key), bigger.home(&key));
            if was != is {
                assert_eq!(is, Some(new), "n={n}: key {i} moved between old members");
                moved += 1;
            }
        }
        let off = (moved * (n + 1)).abs_diff(KEYS);
        assert!(
            off * off <= 25 * KEYS * n,
            "n={n}: {moved} of {KEYS} keys moved, expected about {}",
            KEYS / (n + 1)
        );
    }
}

/// Removing a member spreads its keys evenly over all the others (no single
/// successor inherits its load): over the keys of the removed member, with
/// `E = 2_000` expected per survivor, each survivor's count is within
/// `5 * sqrt(E)`.
#[test]
fn a_removed_members_keys_spread_over_all_others() {
    const PER_SURVIVOR: u64 = 2_000;
    let n = 16u64;
    let ring = Ring::new(&members(n));
    let gone = ring.members()[0];
    let mut inherited = vec![0u64; ring.len()];
    let mut i = 0usize;
    // Keys owned by `gone` are 1/n of all keys: keep going until it has
    // owned `PER_SURVIVOR * (n - 1)` of them.
    let mut owned = 0u64;
    while owned < PER_SURVIVOR * (n - 1) {
        let top = ring.homes(&key(i), 2);
        if top[0] == gone {
            let at = ring.members().binary_search(&top[1]).expect("a member");
            inherited[at] += 1;
            owned += 1;
        }
        i += 1;
    }
    assert_eq!(inherited[0], 0);
    for (at, &count) in inherited.iter().enumerate().skip(1) {
        let off = count.abs_diff(PER_SURVIVOR);
        assert!(
            off * off <= 25 * PER_SURVIVOR,
            "survivor {at} inherited {count} keys, expected about {PER_SURVIVOR}"
        );
    }
}
