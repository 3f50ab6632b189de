//! Home leases and activation: leases at start, loss when cut off, no renewal after accepting the
//! next epoch, activation waits for moved keys, no gap for keys that keep their home, restarts.

mod harness;

use std::time::Duration;

use harness::{Cluster, Kind, at, find_key, find_keys, home, member, ms, secs};
use keyhome_epoch::{Body, Change, Event, Instant, Message, NodeId, Timing, Write};

const HOME_LEASE: Duration = Timing::DEFAULT.home_lease;

fn settled(members: &[u64], extra: &[u64]) -> Cluster {
    let mut c = Cluster::with_extra(members, extra);
    c.deliver_all();
    c
}

// ---- leases at start ----

#[test]
fn nothing_leaves_a_starting_node_before_its_incarnation_is_durable() {
    let mut c = Cluster::unstarted(&[1, 2, 3], &[], Timing::DEFAULT);
    for id in [1, 2, 3] {
        c.set_manual_persistence(id, true);
        c.start(id);
    }
    assert_eq!(c.mark(), 0, "no message may leave before the first advance");
    for id in [1, 2, 3] {
        let first = &c.host(id).readies[0];
        assert_eq!(first.number, 1);
        assert_eq!(first.messages, 0);
        assert_eq!(first.writes, vec![Write::Incarnation(1)]);
        assert_eq!(first.persisted_messages, 2, "lease requests wait for the incarnation write");
        assert_eq!(c.host(id).durable.incarnation, 0, "not durable yet");
        assert!(!c.node(id).holds_lease(c.now));
    }
    // Node 1's requests go out once its incarnation is durable; nobody else has anything on the wire.
    c.persist(1);
    assert_eq!(c.host(1).durable.incarnation, 1);
    let sent = c.sent_since(0, |_| true);
    assert!(sent.iter().all(|e| e.from == 1 && e.kind() == Kind::LeaseRequest), "{sent:?}");
    assert_eq!(sent.len(), 2);
    // The peers' grants are themselves held until their own incarnation is durable.
    c.deliver_all();
    assert_eq!(c.mark(), 2, "grants wait for the granters' incarnation writes");
    for id in [2, 3] {
        c.persist(id);
    }
    c.deliver_all();
    let now = c.now;
    for id in [1, 2, 3] {
        assert_eq!(c.node(id).lease_until(now), Some(now + HOME_LEASE), "node {id}");
    }
}

#[test]
fn single_node_lease_waits_for_the_incarnation_write() {
    let mut c = Cluster::unstarted(&[1], &[], Timing::DEFAULT);
    c.set_manual_persistence(1, true);
    c.run_until(at(ms(5)));
    c.start(1);
    assert!(!c.node(1).holds_lease(c.now), "its own grant must not count before its write is durable");
    c.persist(1);
    assert_eq!(c.node(1).lease_until(c.now), Some(at(ms(5)) + HOME_LEASE));
}

fn every_member_gets_a_lease(n: u64) {
    let ids: Vec<u64> = (1..=n).collect();
    let mut c = Cluster::new(&ids);
    for &id in &ids {
        assert!(!c.node(id).holds_lease(c.now), "node {id} has no majority before messages flow");
    }
    c.deliver_all();
    for &id in &ids {
        assert_eq!(c.node(id).lease_until(c.now), Some(Instant::ZERO + HOME_LEASE), "node {id}");
    }
    // And keeps it while the network works.
    for _ in 0..600 {
        c.run_for(ms(100));
        for &id in &ids {
            let until = c.node(id).lease_until(c.now).expect("lease held");
            assert!(until > c.now + HOME_LEASE / 2, "renewed every quarter lease");
        }
    }
}

#[test]
fn every_member_of_3_gets_a_home_lease() {
    every_member_gets_a_lease(3);
}

#[test]
fn every_member_of_5_gets_a_home_lease() {
    every_member_gets_a_lease(5);
}

// ---- losing and refusing leases ----

#[test]
fn node_cut_off_from_the_majority_loses_its_lease_within_one_home_lease() {
    let mut c = settled(&[1, 2, 3], &[]);
    c.run_until(at(ms(4_300)));
    let cut = c.now;
    c.isolate(1);
    // Requests go out every quarter lease (0, 2.5 s, ...): the last one granted was at 2.5 s.
    assert_eq!(c.node(1).lease_until(cut), Some(at(ms(2_500)) + HOME_LEASE));
    let mut lost_at = None;
    while c.now < cut + 2 * HOME_LEASE {
        c.run_for(ms(10));
        let now = c.now;
        if c.node(1).holds_lease(now) {
            assert!(lost_at.is_none(), "a lost lease came back while cut off");
        } else {
            lost_at.get_or_insert(now);
        }
        for id in [2, 3] {
            assert!(c.node(id).holds_lease(now), "the majority side keeps its leases (node {id})");
        }
    }
    let lost_at = lost_at.expect("lease lost");
    assert!(lost_at <= cut + HOME_LEASE, "lost at {lost_at:?}, cut at {cut:?}");
    assert!(c.count_sent(0, 1, Kind::LeaseRequest) > 4 * 4, "node 1 kept asking");
}

#[test]
fn acceptor_that_accepted_the_next_epoch_refuses_to_renew_leases() {
    let mut c = settled(&[1, 2, 3], &[]);
    c.run_until(at(secs(1)));
    let request = |seq| Message { epoch: 1, body: Body::LeaseRequest { incarnation: 1, seq } };
    // Control: before accepting anything, node 2 grants.
    let mark = c.mark();
    c.handle(3, 2, request(1000));
    let grants = c.sent_since(mark, |_| true);
    assert!(grants.len() == 1 && grants[0].message.body == Body::LeaseGrant { incarnation: 1, seq: 1000 });
    c.drop_where(|_| true);

    // Node 1's change is accepted by everyone, but nobody learns it is chosen.
    c.propose(1, Change::SetTiming(Timing { home_lease: secs(12), ..Timing::DEFAULT })).unwrap();
    c.deliver_where(|e| e.from == 1 && e.kind() == Kind::Prepare);
    c.deliver_where(|e| e.to == 1 && e.kind() == Kind::Promise);
    c.deliver_where(|e| e.from == 1 && e.kind() == Kind::Accept);
    c.drop_where(|e| e.kind() == Kind::Accepted);
    for id in [1, 2, 3] {
        assert_eq!(c.epoch(id), 1, "epoch 2 not learned by node {id}");
        assert!(c.host(id).durable.acceptor.accepted.is_some(), "node {id} accepted");
    }

    let mark = c.mark();
    c.handle(3, 2, request(1001));
    assert_eq!(c.sent_since(mark, |_| true).len(), 0, "no grant, and nothing else either");

    // Over time, with only lease traffic flowing (whatever retries or recovery the nodes attempt
    // is lost): the requests keep coming, no grant is ever given, every lease runs out within one
    // home lease of the accept.
    let accepted_at = c.now;
    c.mute(&[Kind::Prepare, Kind::Accept, Kind::Promise, Kind::Accepted, Kind::Reject, Kind::Chosen]);
    while c.now < accepted_at + HOME_LEASE + secs(2) {
        c.run_for(ms(50));
        assert!(c.epoch(2) == 1 && c.epoch(3) == 1);
        if c.now >= accepted_at + HOME_LEASE {
            for id in [1, 2, 3] {
                assert!(!c.node(id).holds_lease(c.now), "node {id} at {:?}", c.now);
            }
        }
    }
    assert!(c.count_sent(mark, 2, Kind::LeaseRequest) + c.count_sent(mark, 3, Kind::LeaseRequest) >= 8);
    assert_eq!(c.sent_since(mark, |e| e.kind() == Kind::LeaseGrant).len(), 0);

    // Once the choice is known, leases of epoch 2 are granted again.
    c.heal();
    c.run_for(secs(3));
    for id in [1, 2, 3] {
        assert_eq!(c.epoch(id), 2);
        assert!(c.node(id).holds_lease(c.now), "node {id}");
    }
    c.assert_agreement();
}

// ---- activation ----

/// Proposes `change` at node `proposer` once leases are settled, and checks in 1 ms steps that
/// `key`, whose home moves from `old` to `new`, is active on `new` exactly from the instant `new`
/// learned the epoch plus the epoch's activation wait, and never on two nodes.
fn moved_key_waits(members: &[u64], extra: &[u64], proposer: u64, change: Change, old: u64, new: u64) {
    let genesis = Cluster::new(members).genesis;
    let next = change.apply(&genesis).unwrap();
    let key = find_key(|k| home(&genesis, k) == old && home(&next, k) == new);
    let mut c = settled(members, extra);
    c.run_until(at(secs(31))); // past the start's activation instant (30.6 s)
    assert_eq!(c.active_homes(&key), vec![old]);

    let again = change.clone();
    c.propose(proposer, change).unwrap();
    c.deliver_all();
    let learned = c.event_time(new, &Event::Learned { epoch: 2 }).expect("new home learned epoch 2");
    let wait = c.node(new).current().activation_wait;
    assert!(wait >= HOME_LEASE, "activation wait {wait:?} covers a home lease");
    let active_from = learned + wait;
    assert!(c.node(new).holds_lease(c.now), "the new home holds a lease at once");

    while c.now < active_from + secs(1) {
        let now = c.now;
        assert_eq!(c.node(new).home_active(now, &key), now >= active_from, "at {now:?}");
        assert!(!c.node(old).home_active(now, &key), "the old home stopped when it learned");
        assert!(c.active_homes(&key).len() <= 1);
        c.run_for(ms(1));
    }
    // Exactly at the boundary, on a fresh run (time only runs forward).
    let mut c = settled(members, extra);
    c.run_until(at(secs(31))); // past the start's activation instant (30.6 s)
    c.propose(proposer, again).unwrap();
    c.deliver_all();
    let active_from = c.event_time(new, &Event::Learned { epoch: 2 }).unwrap() + wait;
    c.run_until(active_from - Duration::from_nanos(1));
    assert!(!c.node(new).home_active(c.now, &key));
    c.run_until(active_from);
    assert!(c.node(new).home_active(c.now, &key));
}

#[test]
fn key_moving_to_an_added_node_waits_for_the_activation_wait() {
    moved_key_waits(&[1, 2, 3], &[4], 2, Change::Add(member(4)), 1, 4);
}

#[test]
fn key_moving_off_a_removed_node_waits_for_the_activation_wait() {
    // Keys of node 3 move to node 1 or 2; take one that moves to 1.
    moved_key_waits(&[1, 2, 3], &[], 2, Change::Remove(NodeId(3)), 3, 1);
}

/// `key` has home `stays` in both epochs: it must be active on `stays` at every step, through
/// every single message of the change and 1 ms time steps for 30 s after it.
fn key_keeps_home(members: &[u64], extra: &[u64], change: Change, stays: u64) {
    let genesis = Cluster::new(members).genesis;
    let next = change.apply(&genesis).unwrap();
    let key = find_key(|k| home(&genesis, k) == stays && home(&next, k) == stays);
    let mut c = settled(members, extra);
    // Past the start's activation instant, which also waits out any delegation granted before
    // the start: rate_margin(max_delegation_lease) with the default timing, 30.6 s.
    c.run_until(at(ms(30_700)));
    assert!(c.node(stays).home_active(c.now, &key));
    let proposer = if stays == 2 { 3 } else { 2 };
    c.propose(proposer, change).unwrap();
    assert!(c.node(stays).home_active(c.now, &key));
    let mut steps = 0;
    while c.deliver_next_where(|_| true).is_some() {
        steps += 1;
        assert!(c.node(stays).home_active(c.now, &key), "gap after message {steps}");
    }
    assert!(steps > 10);
    assert_eq!(c.epoch(stays), 2);
    let end = c.now + secs(30);
    while c.now < end {
        c.run_for(ms(1));
        assert!(c.node(stays).home_active(c.now, &key), "gap at {:?}", c.now);
        assert_eq!(c.active_homes(&key), vec![stays]);
    }
}

#[test]
fn key_keeping_its_home_through_an_add_has_no_gap() {
    key_keeps_home(&[1, 2, 3], &[4], Change::Add(member(4)), 1);
}

#[test]
fn key_keeping_its_home_through_a_remove_has_no_gap() {
    key_keeps_home(&[1, 2, 3], &[], Change::Remove(NodeId(3)), 2);
}

/// Trace: genesis {1, 2, 3}; `key`'s home is 1, and 4 once 4 is added. Node 1 is cut off at 1 s;
/// epoch 2 adds 4 (chosen by 2 and 3), so 4 becomes the key's home from about 1 s + wait `W`. At
/// 2 s + `W` epoch 3 removes 4 again (accepted by 2, 3 and 4), and 4 is cut off before it hears the
/// result: it stays an active home under its epoch-2 lease until that runs out. Node 1 reconnects and
/// jumps from epoch 1 to epoch 3, where it is the key's home again. It must wait epoch 3's
/// activation wait; `home_active` instead joins epoch 3's lease with epoch 1's passed activation
/// instant (its history holds [1, 3], skipping epoch 2, where 4 was home), so node 1 is active at
/// once while node 4 still is.
#[test]
fn home_regained_after_a_skipped_epoch_waits_for_the_activation_wait() {
    let genesis = Cluster::new(&[1, 2, 3]).genesis;
    let with4 = Change::Add(member(4)).apply(&genesis).unwrap();
    let key = find_key(|k| home(&genesis, k) == 1 && home(&with4, k) == 4);
    let mut c = settled(&[1, 2, 3], &[4]);
    c.run_until(at(secs(1)));
    c.isolate(1);
    c.propose(2, Change::Add(member(4))).unwrap();
    c.run_until(at(secs(2)));
    let wait = c.node(4).current().activation_wait;
    c.run_until(at(secs(2)) + wait);
    assert_eq!((c.epoch(1), c.epoch(4)), (1, 2));
    assert_eq!(c.active_homes(&key), vec![4]);

    c.propose(2, Change::Remove(NodeId(4))).unwrap();
    c.deliver_where(|e| !(e.to == 4 && e.kind() == Kind::Chosen));
    c.heal();
    c.isolate(4);
    c.drop_where(|e| e.to == 4 || e.from == 4);
    assert_eq!((c.epoch(2), c.epoch(4)), (3, 2));

    let mut learned = None;
    let end = c.now + wait * 2;
    while c.now < end {
        c.run_for(ms(10));
        let now = c.now;
        if learned.is_none() && c.epoch(1) == 3 {
            learned = Some(now);
        }
        let active = c.active_homes(&key);
        assert!(active.len() <= 1, "two active homes at {now:?}: {active:?}");
        if let Some(learned) = learned {
            let wait = c.node(1).current().activation_wait;
            if now < learned + wait {
                assert!(!c.node(1).home_active(now, &key), "node 1 active before its wait, at {now:?}");
            }
        }
    }
    assert!(learned.is_some());
    assert_eq!(c.active_homes(&key), vec![1]);
}

/// Trace: node 1's first lease request (seq 1) reaches 2 and 3, which grant; node 1 crashes before
/// the grants arrive (a peer may send a reply after its own fsync, on a new connection to the
/// restarted node). Epoch 2 adds 4, the new home of `key`. Node 1 restarts at 9 s, still at epoch 1,
/// and its new run again numbers its first request seq 1: the old grants count for it, and node 1
/// holds a lease of epoch 1 from 9 s to 19 s that no acceptor granted after 0 s. It is cut off before
/// it hears of epoch 2, and is active for `key` while node 4 is too (once its activation wait ends).
#[test]
fn lease_grants_meant_for_a_previous_run_do_not_count() {
    let genesis = Cluster::new(&[1, 2, 3]).genesis;
    let with4 = Change::Add(member(4)).apply(&genesis).unwrap();
    let key = find_key(|k| home(&genesis, k) == 1 && home(&with4, k) == 4);
    let mut c = Cluster::with_extra(&[1, 2, 3], &[4]);
    c.deliver_where(|e| e.from == 1);
    assert_eq!(c.queued().filter(|e| e.to == 1 && e.kind() == Kind::LeaseGrant).count(), 2);
    c.crash(1);
    c.propose(2, Change::Add(member(4))).unwrap();
    // Everything but the messages to node 1 flows for 9 s.
    while c.now < at(secs(9)) {
        let t = c.now + ms(10);
        c.tick_until(t);
        c.deliver_where(|e| e.to != 1);
    }
    assert_eq!(c.epoch(4), 2);
    c.restart(1);
    c.deliver_where(|e| e.to == 1 && e.kind() == Kind::LeaseGrant);
    c.isolate(1);
    assert!(!c.node(1).holds_lease(c.now), "only grants of an earlier run reached node 1");
    while c.now < at(secs(25)) {
        c.run_for(ms(10));
        let active = c.active_homes(&key);
        assert!(active.len() <= 1, "two active homes at {:?}: {active:?}", c.now);
    }
}

// ---- restarts ----

#[test]
fn incarnation_increases_across_restarts() {
    let mut c = settled(&[1, 2, 3], &[]);
    assert_eq!(c.node(1).incarnation(), 1);
    assert_eq!(c.host(1).durable.incarnation, 1);
    for expected in 2..=4 {
        c.run_for(secs(1));
        c.crash(1);
        c.restart(1);
        c.deliver_all();
        assert_eq!(c.node(1).incarnation(), expected);
        assert_eq!(c.host(1).durable.incarnation, expected);
        assert!(c.node(1).holds_lease(c.now));
    }
    // A run that crashes before its incarnation is durable sent nothing, so the next run may take
    // the same number; it is still larger than every run that did anything.
    c.set_manual_persistence(1, true);
    let mark = c.mark();
    c.crash(1);
    c.restart(1);
    assert_eq!(c.node(1).incarnation(), 5);
    assert_eq!(c.count_sent(mark, 1, Kind::LeaseRequest), 0);
    c.crash(1);
    c.set_manual_persistence(1, false);
    c.restart(1);
    assert_eq!(c.node(1).incarnation(), 5);
    assert_eq!(c.host(1).durable.incarnation, 5);
}

#[test]
fn restarted_node_is_not_active_before_the_activation_wait() {
    let mut c = settled(&[1, 2, 3], &[]);
    c.propose(2, Change::SetTiming(Timing { home_lease: secs(12), ..Timing::DEFAULT })).unwrap();
    c.run_until(at(secs(32)));
    let record = c.node(1).current().clone();
    assert_eq!(record.number, 2);
    let wait = record.activation_wait;
    assert!(wait > secs(10));
    let keys = find_keys(32, |k| home(&record, k) == 1);
    assert!(keys.iter().all(|k| c.node(1).home_active(c.now, k)));

    c.crash(1);
    c.run_until(at(secs(33)));
    c.restart(1);
    let restarted = c.now;
    c.deliver_all();
    assert!(c.node(1).holds_lease(c.now), "the lease comes back at once");
    while c.now < restarted + wait + ms(500) {
        let now = c.now;
        for k in &keys {
            assert_eq!(c.node(1).home_active(now, k), now >= restarted + wait, "at {now:?}");
            assert!(c.active_homes(k).len() <= 1);
        }
        c.run_for(ms(1));
    }
    // The exact boundary, on a fresh run (time only runs forward).
    let mut c = settled(&[1, 2, 3], &[]);
    c.propose(2, Change::SetTiming(Timing { home_lease: secs(12), ..Timing::DEFAULT })).unwrap();
    c.run_until(at(secs(32)));
    c.crash(1);
    c.restart(1);
    c.run_until(at(secs(32)) + wait - Duration::from_nanos(1));
    assert!(!c.node(1).home_active(c.now, &keys[0]));
    c.run_until(at(secs(32)) + wait);
    assert!(c.node(1).home_active(c.now, &keys[0]));
}

// ---- timing changes ----

#[test]
fn key_keeping_its_home_through_a_change_that_shortens_delegations_has_no_gap() {
    let shorter = Timing { max_delegation_lease: secs(10), ..Timing::DEFAULT };
    key_keeps_home(&[1, 2, 3], &[], Change::SetTiming(shorter), 1);
}

/// Epoch 1: 60 s home leases, 1 s delegations. Epoch 2 (`SetTiming`) turns that round: 1 s home
/// leases, 60 s delegations. Node 3, `key`'s home in both, learns epoch 2 and is cut off before it
/// gets a lease of it; it still holds its lease of epoch 1 for up to 60 s. Within the old activation
/// wait, epoch 3 removes node 3 and the key moves to `new`, which waits epoch 3's activation wait
/// (about 62 s: epoch 2's 1 s lease plus 60 s delegations, or epoch 2's own wait for epoch 1's lease
/// plus 1 s delegations). A home grants delegations as long as its current epoch allows, so if
/// epoch 1's lease let node 3 grant under epoch 2 it could grant 60 s delegations until about
/// 62 s, live until about 122 s, long after `new` starts granting.
///
/// Returns the first instant at which one node may grant the key while a delegation another node
/// may have granted is live (every clock here runs at the same rate, so a delegation granted at `t`
/// under an epoch with delegation lease `D` ends by `t + D`), or `None`.
fn overlap_after_a_timing_change(bugs: Option<keyhome_epoch::Bugs>) -> Option<String> {
    let before = Timing { home_lease: secs(60), max_delegation_lease: secs(1), clock_rate_ppm: 10_000 };
    let after = Timing { home_lease: secs(1), max_delegation_lease: secs(60), ..before };
    let mut c = Cluster::unstarted(&[1, 2, 3], &[], before);
    #[cfg(feature = "bug-injection")]
    for id in [1, 2, 3] {
        c.host_mut(id).config.bugs = bugs.unwrap_or_default();
    }
    #[cfg(not(feature = "bug-injection"))]
    assert!(bugs.is_none(), "bug switches need the bug-injection feature");
    for id in [1, 2, 3] {
        c.start(id);
    }
    c.run_until(at(secs(2))); // past the start's activation instant (1.02 s)
    let removed = Change::Remove(NodeId(3)).apply(&c.genesis).unwrap();
    let key = find_key(|k| home(&c.genesis, k) == 3 && home(&removed, k) == 1);
    assert_eq!(c.active_homes(&key), vec![3]);

    c.propose(1, Change::SetTiming(after)).unwrap();
    while c.epoch(3) < 2 {
        c.deliver_next_where(|_| true).expect("node 3 learns epoch 2");
    }
    c.isolate(3);
    c.drop_where(|e| e.to == 3 || e.from == 3);
    c.deliver_all();
    assert!(c.node(1).holds_lease(c.now) && !c.node(3).holds_lease(c.now));
    c.propose(1, Change::Remove(NodeId(3))).unwrap();
    c.deliver_all();
    assert_eq!((c.epoch(1), c.epoch(3)), (3, 2));
    let active_from =
        c.event_time(1, &Event::Learned { epoch: 3 }).unwrap() + c.node(1).current().activation_wait;

    // Per node: the end of the latest delegation it may have granted.
    let mut reach = [Instant::ZERO; 4];
    let end = active_from + secs(70);
    while c.now < end {
        let now = c.now;
        for id in c.active_homes(&key) {
            if let Some(other) = (1..=3).find(|&o| o != id && reach[o as usize] > now) {
                return Some(format!(
                    "at {now:?} node {id} may grant while node {other}'s delegation is live"
                ));
            }
            let d = c.node(id).current().timing.max_delegation_lease;
            reach[id as usize] = reach[id as usize].max(now + d);
        }
        c.run_for(ms(100));
    }
    assert_eq!(c.active_homes(&key), vec![1], "the new home grants the key in the end");
    None
}

#[test]
fn a_cut_off_home_cannot_grant_the_new_epochs_longer_delegations_under_an_older_lease() {
    assert_eq!(overlap_after_a_timing_change(None), None);
}

/// The same run with the rule switched off: the overlap shows.
#[cfg(feature = "bug-injection")]
#[test]
fn an_older_lease_carrying_longer_delegations_is_caught() {
    let bugs = keyhome_epoch::Bugs { delegation_lease_of_current_epoch: true, ..Default::default() };
    let overlap = overlap_after_a_timing_change(Some(bugs));
    assert!(overlap.is_some(), "with the switch off the overlap must show");
    println!("{}", overlap.unwrap_or_default());
}
