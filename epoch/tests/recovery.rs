//! Unsafe recovery of a cluster that lost its majority for good: the survivors move to an epoch
//! far ahead, with a full activation wait, and its tokens order after every earlier epoch's.

mod harness;

use harness::{Cluster, Kind, at, find_key, home, secs};
use keyhome_epoch::{Event, NodeId, ProposeError, Timing};

/// Five members, three of them lost for good; node 1 installs an epoch of 1 and 2.
fn recovered(skip: u64) -> (Cluster, u64) {
    let mut c = Cluster::new(&[1, 2, 3, 4, 5]);
    c.deliver_all();
    c.run_until(at(secs(31))); // past the start's activation instant
    for lost in [3, 4, 5] {
        c.crash(lost);
    }
    // While node 1's home lease lasts, a majority may still be running: recovery waits it out.
    let refused = c.recover_unsafe(1, &[1, 2], skip);
    assert!(matches!(refused, Err(ProposeError::MajorityAlive { epoch: 1, .. })), "{refused:?}");
    c.run_for(Timing::DEFAULT.home_lease);
    let number = c.recover_unsafe(1, &[1, 2], skip).expect("recovery");
    c.deliver_all();
    (c, number)
}

#[test]
fn survivors_learn_an_epoch_far_ahead_and_lease_it_without_the_lost_members() {
    let (mut c, number) = recovered(1 << 20);
    assert_eq!(number, 1 + (1 << 20));
    // The lost members are retired: should one come back, no survivor takes its word on epochs.
    assert_eq!(c.node(1).current().retired, vec![NodeId(3), NodeId(4), NodeId(5)]);
    for id in [1, 2] {
        assert_eq!(c.epoch(id), number, "node {id}");
        assert!(c.events(id).contains(&Event::Learned { epoch: number }));
    }
    // A majority of the new epoch (both survivors) renews home leases again.
    c.run_for(secs(1));
    let now = c.now;
    assert!(c.node(1).holds_lease(now) && c.node(2).holds_lease(now));
    // The lost members were not asked for anything.
    let mark = c.mark();
    c.run_for(secs(1));
    for lost in [3, 4, 5] {
        assert!(c.sent_since(mark, |e| e.to == lost && e.kind() == Kind::LeaseRequest).is_empty());
    }
}

#[test]
fn every_key_waits_the_full_activation_wait_after_recovery() {
    let (mut c, _) = recovered(1000);
    let record = c.node(1).current().clone();
    let old = c.genesis.clone();
    // Even a key whose home stays node 1 waits: the epochs in between were skipped.
    let kept = find_key(|k| home(&old, k) == 1 && home(&record, k) == 1);
    let moved = find_key(|k| home(&old, k) == 3 && home(&record, k) == 2);
    let learned = c.event_time(1, &Event::Learned { epoch: record.number }).unwrap();
    let wait = record.activation_wait;
    assert!(wait >= old.timing.fence_bound(), "{wait:?}");
    c.run_until(learned + wait - secs(1));
    assert!(!c.node(1).home_active(c.now, &kept));
    assert!(!c.node(2).home_active(c.now, &moved));
    c.run_until(learned + wait + secs(1));
    assert!(c.node(1).home_active(c.now, &kept));
    assert!(c.node(2).home_active(c.now, &moved));
}

#[test]
fn recovery_refuses_an_invalid_or_self_excluding_member_list() {
    let mut c = Cluster::new(&[1, 2, 3]);
    c.deliver_all();
    assert!(matches!(c.recover_unsafe(1, &[], 10), Err(ProposeError::Change(_))));
    assert!(matches!(c.recover_unsafe(1, &[2], 10), Err(ProposeError::NotRecovered)));
    // A skip past the largest epoch number says so (it said "the change leaves the epoch as it
    // is" when the sum overflowed).
    let err = c.recover_unsafe(1, &[1, 2], u64::MAX).unwrap_err();
    assert!(err.to_string().contains("exceeds the largest"), "{err}");
    assert_eq!(c.epoch(1), 1, "a refused recovery changes nothing");
}
