//! Learning epochs: catch-up after a partition, jumping several epochs, ignoring invalid records,
//! answering stale requests, and timers that never spin.

mod harness;

use harness::{Cluster, Envelope, Kind, at, member, ms, secs};
use keyhome_epoch::paxos::{Ballot, Vote};
use keyhome_epoch::{Body, Change, EpochRecord, Event, Instant, Message, NodeId, Timing, Write};

fn timing(home_lease_secs: u64) -> Change {
    Change::SetTiming(Timing { home_lease: secs(home_lease_secs), ..Timing::DEFAULT })
}

/// A cluster of 1, 2, 3 (and 4, not a member at first) where node 3 missed `changes` (each
/// chosen without it); the network is quiet and healed.
fn lagging(changes: &[Change]) -> Cluster {
    let mut c = Cluster::with_extra(&[1, 2, 3], &[4]);
    c.deliver_all();
    c.isolate(3);
    for change in changes {
        c.propose(1, change.clone()).unwrap();
        c.deliver_all();
    }
    c.heal();
    assert_eq!(c.epoch(1), 1 + changes.len() as u64);
    assert_eq!(c.epoch(3), 1);
    c
}

fn summary(envelopes: &[Envelope]) -> Vec<(u64, u64, Kind)> {
    envelopes.iter().map(|e| (e.from, e.to, e.kind())).collect()
}

fn learned_epochs(c: &Cluster, id: u64) -> Vec<u64> {
    c.writes(id)
        .into_iter()
        .filter_map(|w| match w {
            Write::Epoch(r) => Some(r.number),
            _ => None,
        })
        .collect()
}

#[test]
fn partitioned_node_catches_up_from_the_next_lease_request() {
    let mut c = lagging(&[timing(12)]);
    let mark = c.mark();
    c.run_for(secs(3));
    assert_eq!(c.node(3).current(), c.node(1).current());
    assert_eq!(c.events(3), vec![Event::Learned { epoch: 2 }]);
    assert_eq!(learned_epochs(&c, 3), vec![2]);
    assert!(c.count_sent(mark, 3, Kind::CatchUp) >= 1);
    assert!(!c.sent_since(mark, |e| e.to == 3 && e.kind() == Kind::Chosen).is_empty());
    assert!(c.node(3).holds_lease(c.now));
    c.assert_agreement();
}

#[test]
fn any_message_with_a_higher_epoch_triggers_catch_up() {
    let ballot = Ballot { round: 9, proposer: NodeId(1) };
    let bodies = [
        Body::LeaseRequest { incarnation: 1, seq: 5 },
        Body::LeaseGrant { incarnation: 1, seq: 5 },
        Body::CatchUp,
        Body::Prepare { slot: 3, ballot },
        Body::Vote { slot: 3, vote: Vote::Accepted { ballot } },
        Body::Vote { slot: 3, vote: Vote::Promise { ballot, accepted: None } },
    ];
    for body in bodies {
        let mut c = lagging(&[timing(12)]);
        let mark = c.mark();
        c.handle(1, 3, Message { epoch: 2, body: body.clone() });
        assert_eq!(summary(&c.sent_since(mark, |_| true)), vec![(3, 1, Kind::CatchUp)], "{body:?}");
        assert_eq!(c.epoch(3), 1, "nothing learned from the message itself");
        let mark = c.mark();
        c.deliver_all();
        let answers = c.sent_since(mark, |e| e.from == 1 && !e.kind().is_lease());
        assert_eq!(summary(&answers), vec![(1, 3, Kind::Chosen)]);
        assert_eq!(c.node(3).current(), c.node(1).current(), "{body:?}");
        assert_eq!(c.events(3), vec![Event::Learned { epoch: 2 }]);
    }
}

#[test]
fn catch_up_requests_are_rate_limited_per_epoch() {
    let mut c = lagging(&[timing(12), timing(13)]);
    let lease = |seq| Message { epoch: 2, body: Body::LeaseRequest { incarnation: 1, seq } };
    let mark = c.mark();
    c.handle(1, 3, lease(1));
    c.handle(2, 3, lease(1));
    assert_eq!(c.count_sent(mark, 3, Kind::CatchUp), 1, "one request per interval");
    c.handle(1, 3, Message { epoch: 3, body: Body::LeaseRequest { incarnation: 1, seq: 2 } });
    assert_eq!(c.count_sent(mark, 3, Kind::CatchUp), 2, "a newer epoch is asked for at once");
    c.drop_where(|_| true);
    let t = c.now + ms(100);
    c.tick_until(t);
    c.drop_where(|_| true);
    let mark = c.mark();
    c.handle(1, 3, Message { epoch: 3, body: Body::LeaseRequest { incarnation: 1, seq: 3 } });
    assert_eq!(summary(&c.sent_since(mark, |_| true)), vec![(3, 1, Kind::CatchUp)], "asked again later");
}

#[test]
fn node_several_epochs_behind_jumps_straight_to_the_newest() {
    let changes = [timing(11), Change::Add(member(4)), timing(13), Change::Remove(NodeId(4))];
    let mut c = lagging(&changes);
    assert_eq!(learned_epochs(&c, 2), vec![2, 3, 4, 5]);
    let newest = c.node(1).current().clone();
    assert_eq!(newest.number, 5);
    let mark = c.mark();
    c.run_for(secs(3));
    assert_eq!(c.node(3).current(), &newest);
    assert_eq!(c.events(3), vec![Event::Learned { epoch: 5 }], "no intermediate epoch");
    assert_eq!(learned_epochs(&c, 3), vec![5], "one durable write");
    // Every record sent to node 3 was the newest.
    let chosen = c.sent_since(mark, |e| e.to == 3 && e.kind() == Kind::Chosen);
    assert!(!chosen.is_empty());
    assert!(chosen.iter().all(|e| e.message.body == Body::Chosen(newest.clone())));
    assert!(c.node(3).holds_lease(c.now));
    c.assert_agreement();
}

// ---- invalid records ----

/// A valid record for epoch 2 and invalid variants of it.
fn records(genesis: &EpochRecord) -> (EpochRecord, Vec<(&'static str, EpochRecord)>) {
    let mut valid = timing(12).apply(genesis).unwrap();
    valid.activation_wait = secs(11);
    let mut ring = valid.clone();
    ring.ring_version += 1;
    let mut unsorted = valid.clone();
    unsorted.members.swap(0, 2);
    let mut duplicate = valid.clone();
    duplicate.members[1] = duplicate.members[0].clone();
    let mut empty = valid.clone();
    empty.members.clear();
    let mut bad_lease = valid.clone();
    bad_lease.timing.home_lease = ms(1);
    let mut wrong_slot = valid.clone();
    wrong_slot.number = 3;
    let invalid = vec![
        ("bad ring version", ring),
        ("unsorted members", unsorted),
        ("duplicate member", duplicate),
        ("no members", empty),
        ("home lease out of range", bad_lease),
        ("wrong slot number", wrong_slot),
    ];
    (valid, invalid)
}

/// What a node shows the outside; handling an ignored message must leave all of it alone.
fn observable(c: &Cluster, id: u64) -> String {
    let n = c.node(id);
    format!(
        "{:?} {:?} {:?} {:?} {:?} {}",
        n.current(),
        n.lease_until(c.now),
        n.poll_timeout(),
        c.host(id).durable,
        c.host(id).writes.len(),
        c.host(id).events.len(),
    )
}

/// A removed node's certificate may be in other hands: a node that knows of the removal adopts no
/// epoch it tells of (a made-up one putting it back, say), and learns from the members instead.
#[test]
fn a_retired_node_cannot_install_an_epoch() {
    let mut c = Cluster::new(&[1, 2, 3]);
    c.deliver_all();
    c.propose(1, Change::Remove(NodeId(3))).unwrap();
    c.deliver_all();
    assert_eq!((c.epoch(1), c.epoch(2)), (2, 2));
    let removed = c.node(1).current().clone();
    assert_eq!(removed.retired, vec![NodeId(3)]);
    // Epoch 2 with node 3 back in and no wait, as node 3's certificate could make it up.
    let mut forged = Change::Add(member(3)).apply(&removed).unwrap();
    forged.activation_wait = std::time::Duration::ZERO;
    assert!(forged.retired.is_empty(), "naming a node again un-retires it");
    c.handle(3, 1, Message { epoch: 3, body: Body::Chosen(forged.clone()) });
    assert_eq!(c.node(1).current(), &removed, "a retired node installed an epoch");
    // The same record from a member is learned (it stands for an agreement this node missed).
    c.handle(2, 1, Message { epoch: 3, body: Body::Chosen(forged.clone()) });
    assert_eq!(c.node(1).current(), &forged, "control: a member's record is learned");
}

#[test]
fn chosen_with_an_invalid_record_is_ignored() {
    let mut c = Cluster::new(&[1, 2, 3]);
    c.deliver_all();
    let (valid, invalid) = records(&c.genesis);
    for (what, record) in invalid {
        if what == "wrong slot number" {
            continue; // a valid epoch 3 is a legitimate jump for a learner
        }
        let before = format!("{:?}", c.node(2));
        let mark = c.mark();
        c.handle(1, 2, Message { epoch: 1, body: Body::Chosen(record) });
        assert_eq!(format!("{:?}", c.node(2)), before, "{what}: the node changed");
        assert_eq!(c.mark(), mark, "{what}: something was sent");
    }
    assert_eq!(c.events(2), vec![]);
    c.handle(1, 2, Message { epoch: 1, body: Body::Chosen(valid.clone()) });
    assert_eq!(c.node(2).current(), &valid, "control: a valid record is learned");
}

#[test]
fn accept_with_an_invalid_record_is_ignored() {
    let mut c = Cluster::new(&[1, 2, 3]);
    c.deliver_all();
    let (valid, invalid) = records(&c.genesis);
    let ballot = Ballot { round: 5, proposer: NodeId(1) };
    let accept = |slot, value| Message { epoch: 1, body: Body::Accept { slot, ballot, value } };
    for (what, record) in invalid {
        let before = observable(&c, 2);
        let mark = c.mark();
        c.handle(1, 2, accept(2, record));
        assert_eq!(observable(&c, 2), before, "{what}: the node changed");
        assert_eq!(c.mark(), mark, "{what}: something was sent");
    }
    // A valid record for a slot other than the next one.
    let mut third = valid.clone();
    third.number = 3;
    let mark = c.mark();
    c.handle(1, 2, accept(3, third));
    assert_eq!(c.mark(), mark);
    assert!(c.host(2).durable.acceptor.accepted.is_none());
    // Control: the valid one is accepted, persisted and voted for.
    let mark = c.mark();
    c.handle(1, 2, accept(2, valid.clone()));
    assert_eq!(c.host(2).durable.acceptor.accepted, Some((ballot, valid)));
    let votes = c.sent_since(mark, |_| true);
    assert_eq!(summary(&votes), vec![(2, 1, Kind::Accepted)]);
}

#[test]
fn promise_carrying_an_invalid_record_is_ignored() {
    let mut c = Cluster::new(&[1, 2, 3]);
    c.deliver_all();
    let (valid, invalid) = records(&c.genesis);
    let mark = c.mark();
    c.propose(1, timing(15)).unwrap();
    let ballot = match c.sent_since(mark, |e| e.kind() == Kind::Prepare)[0].message.body {
        Body::Prepare { ballot, .. } => ballot,
        _ => unreachable!(),
    };
    c.drop_where(|_| true);
    let earlier = Ballot { round: 1, proposer: NodeId(3) };
    let promise = |value| Message {
        epoch: 1,
        body: Body::Vote { slot: 2, vote: Vote::Promise { ballot, accepted: value } },
    };
    for (what, record) in invalid {
        let before = format!("{:?}", c.node(1));
        let mark = c.mark();
        c.handle(2, 1, promise(Some((earlier, record))));
        assert_eq!(format!("{:?}", c.node(1)), before, "{what}: the proposer changed");
        assert_eq!(c.mark(), mark, "{what}: the proposer acted on it");
    }
    // Control: a promise with a valid accepted value completes the majority and is carried forward.
    let mark = c.mark();
    c.handle(2, 1, promise(Some((earlier, valid.clone()))));
    let accepts = c.sent_since(mark, |e| e.kind() == Kind::Accept);
    assert_eq!(accepts.len(), 2);
    assert!(accepts.iter().all(|e| matches!(&e.message.body, Body::Accept { value, .. } if *value == valid)));
}

#[test]
fn prepare_for_a_slot_that_is_not_next_is_ignored() {
    let mut c = Cluster::new(&[1, 2, 3]);
    c.deliver_all();
    let ballot = Ballot { round: 5, proposer: NodeId(1) };
    let before = observable(&c, 2);
    let mark = c.mark();
    c.handle(1, 2, Message { epoch: 1, body: Body::Prepare { slot: 3, ballot } });
    assert_eq!(observable(&c, 2), before);
    assert_eq!(c.mark(), mark);
    c.handle(1, 2, Message { epoch: 1, body: Body::Prepare { slot: 2, ballot } });
    assert_eq!(summary(&c.sent_since(mark, |_| true)), vec![(2, 1, Kind::Promise)], "control");
}

// ---- answers to stale requests ----

#[test]
fn stale_requests_are_answered_with_the_current_epoch() {
    let mut c = lagging(&[timing(12), timing(13)]);
    c.drop_where(|_| true);
    let current = c.node(1).current().clone();
    let ballot = Ballot { round: 1, proposer: NodeId(3) };
    let cases = [
        (1, Body::LeaseRequest { incarnation: 1, seq: 7 }),
        (1, Body::CatchUp),
        (1, Body::Prepare { slot: 2, ballot }),
        (2, Body::LeaseRequest { incarnation: 1, seq: 7 }),
        (2, Body::Prepare { slot: 3, ballot }),
    ];
    for (epoch, body) in cases {
        let mark = c.mark();
        c.handle(3, 1, Message { epoch, body: body.clone() });
        let sent = c.sent_since(mark, |_| true);
        assert_eq!(summary(&sent), vec![(1, 3, Kind::Chosen)], "{body:?} at epoch {epoch}");
        assert_eq!(sent[0].message, Message { epoch: 3, body: Body::Chosen(current.clone()) });
    }
    // Up to date: a catch-up request gets nothing, a lease request gets a grant.
    let mark = c.mark();
    c.handle(2, 1, Message { epoch: 3, body: Body::CatchUp });
    assert_eq!(c.mark(), mark);
    c.handle(2, 1, Message { epoch: 3, body: Body::LeaseRequest { incarnation: 1, seq: 7 } });
    assert_eq!(summary(&c.sent_since(mark, |_| true)), vec![(1, 2, Kind::LeaseGrant)]);
}

// ---- timers ----

#[test]
fn handle_timeout_never_leaves_a_timer_in_the_past() {
    let mut c = Cluster::with_extra(&[1, 2, 3, 4, 5], &[6, 7]);
    c.deliver_all();
    let minutes = 30;
    for minute in 0..minutes {
        let start = at(secs(60 * minute));
        c.run_until(start);
        let members: Vec<u64> = c.node(1).current().member_ids().map(|m| m.0).collect();
        let pick = |k: u64| members[(minute + k) as usize % members.len()];
        match minute % 6 {
            0 => {
                let extra = if minute % 12 == 0 { 6 } else { 7 };
                let change = if members.contains(&extra) {
                    Change::Remove(NodeId(extra))
                } else {
                    Change::Add(member(extra))
                };
                let _ = c.propose(pick(0), change);
            }
            1 => {
                let id = pick(1);
                if id != 1 {
                    c.crash(id);
                    c.run_until(start + secs(7));
                    c.restart(id);
                }
            }
            2 => {
                let id = pick(2);
                c.isolate(id);
                let _ = c.propose(id, timing(11 + minute % 3));
                c.run_until(start + secs(20));
                c.heal();
            }
            3 => {
                let _ = c.propose(pick(0), timing(10 + minute % 4));
                let _ = c.propose(pick(1), timing(14));
            }
            4 => {
                // A proposer that crashes mid-change.
                let id = pick(3);
                if id != 1 && c.propose(id, timing(12 + minute % 2)).is_ok() {
                    c.deliver_round();
                    c.deliver_round();
                    c.crash(id);
                    c.run_until(start + secs(3));
                    c.restart(id);
                }
            }
            _ => {}
        }
    }
    c.run_until(at(secs(60 * minutes)));

    assert_eq!(c.spins, vec![], "handle_timeout(t) left poll_timeout() <= t");
    let records = c.assert_agreement();
    assert!(records.len() >= 10, "the run made progress: {} epochs", records.len());
    let newest = records.values().last().unwrap().clone();
    for id in newest.member_ids().map(|m| m.0) {
        assert_eq!(c.node(id).current(), &newest, "node {id} converged");
        assert!(c.node(id).holds_lease(c.now), "node {id} holds a lease");
        // Renewals every quarter lease, plus a bounded number of retries and activations.
        let bound = 4 * 60 * minutes / 10 + 500;
        assert!(c.host(id).timeouts < bound, "node {id}: {} timeouts", c.host(id).timeouts);
    }
}

#[test]
fn a_single_node_driven_by_its_own_timer_never_spins() {
    // Drive one node by its own timer alone, its peers never answering: a member with and without
    // a pending proposal, and a non-member.
    for (members, id, propose) in
        [(&[1u64, 2, 3][..], 1u64, false), (&[1, 2, 3], 1, true), (&[1, 2, 3], 9, false)]
    {
        let mut c = Cluster::with_extra(members, if id == 9 { &[9] } else { &[] });
        if propose {
            c.propose(id, timing(12)).unwrap();
        }
        let mut t = Instant::ZERO;
        for _ in 0..10_000 {
            let Some(next) = c.node(id).poll_timeout() else { break };
            assert!(next >= t, "the timer went back: {next:?} < {t:?}");
            t = next;
            c.now = t;
            c.timeout(id);
            c.drop_where(|_| true);
            let after = c.node(id).poll_timeout();
            assert!(after.is_none_or(|a| a > t), "node {id}: handle_timeout({t:?}) left {after:?}");
        }
        // A non-member that nobody answers keeps announcing its epoch, backing off.
        assert!(t > at(secs(1_000)), "the timer kept moving forward: {t:?}");
    }
}
