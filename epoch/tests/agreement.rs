//! Agreement on the next epoch: message and write cost of an uncontended change, competing and
//! interrupted proposals, proposal validation, proposal events, removal and non-members.

mod harness;

use harness::{Cluster, Envelope, Kind, member, ms, secs};
use keyhome_epoch::paxos::{AcceptorState, Ballot, Vote};
use keyhome_epoch::{
    Body, Change, ChangeError, EpochRecord, Event, Member, Message, NodeId, ProposeError, RecordError,
    Timing, Write,
};

fn timing(home_lease_secs: u64) -> Change {
    Change::SetTiming(Timing { home_lease: secs(home_lease_secs), ..Timing::DEFAULT })
}

/// A started cluster whose start-up lease traffic has been delivered.
fn settled(members: &[u64], extra: &[u64]) -> Cluster {
    let mut c = Cluster::with_extra(members, extra);
    c.deliver_all();
    c
}

fn acceptor_writes(c: &Cluster, id: u64, from: usize) -> Vec<AcceptorState<EpochRecord>> {
    c.host(id).writes[from..]
        .iter()
        .filter_map(|(_, w)| match w {
            Write::Acceptor { state, .. } => Some(state.clone()),
            _ => None,
        })
        .collect()
}

fn epoch_writes(c: &Cluster, id: u64, from: usize) -> Vec<u64> {
    c.host(id).writes[from..]
        .iter()
        .filter_map(|(_, w)| match w {
            Write::Epoch(r) => Some(r.number),
            _ => None,
        })
        .collect()
}

fn kinds(envelopes: &[Envelope]) -> Vec<(u64, u64, Kind)> {
    envelopes.iter().map(|e| (e.from, e.to, e.kind())).collect()
}

/// Counts, for one uncontended change proposed by node 1 among `n` members:
/// - one-way network hops (delivery rounds) until the proposer learns the new epoch: must be 4,
///   i.e. two round trips (prepare → promise, accept → accepted);
/// - per kind, every non-lease message any node sends until the network is quiet;
/// - per node, its `Write::Acceptor` writes (must be exactly the promise and the accept) and its
///   `Write::Epoch` writes (the learn, reported separately).
///
/// Lease traffic (`LeaseRequest`/`LeaseGrant`, which the new epoch starts) is excluded from the
/// message counts, and the change is a timing change so no message goes to a node that is not
/// running.
fn uncontended_change(n: u64) {
    let ids: Vec<u64> = (1..=n).collect();
    let mut c = settled(&ids, &[]);
    let mark = c.mark();
    let writes_from: Vec<usize> = ids.iter().map(|&id| c.host(id).writes.len()).collect();

    c.propose(1, timing(12)).expect("valid change");

    // Hop by hop: what each delivery round makes the nodes send.
    let mut hops = Vec::new();
    while c.epoch(1) == 1 {
        let before = c.mark();
        assert!(c.deliver_round() > 0, "the change stalled after {} hops", hops.len());
        let sent = c.sent_since(before, |e| !e.kind().is_lease());
        hops.push(sent.iter().map(Envelope::kind).collect::<Vec<_>>());
    }
    let others = (n - 1) as usize;
    // Hop 1 delivers the prepares: every acceptor promises. Hop 2 delivers the promises: the
    // proposer sends accepts. Hop 3 delivers the accepts: every acceptor votes accepted. Hop 4
    // delivers the accepted votes: the proposer sees its value chosen and broadcasts it.
    assert_eq!(
        hops,
        vec![
            vec![Kind::Promise; others],
            vec![Kind::Accept; others],
            vec![Kind::Accepted; others],
            vec![Kind::Chosen; others],
        ],
        "two round trips from the proposer"
    );
    c.deliver_all();

    let sent = c.sent_since(mark, |e| !e.kind().is_lease());
    let count = |kind| sent.iter().filter(|e| e.kind() == kind).count();
    for (kind, expected) in [
        (Kind::Prepare, others),
        (Kind::Promise, others),
        (Kind::Accept, others),
        (Kind::Accepted, others),
        (Kind::Chosen, others),
        (Kind::Reject, 0),
        (Kind::CatchUp, 0),
    ] {
        assert_eq!(count(kind), expected, "{kind:?} messages in a {n}-node change: {:?}", kinds(&sent));
    }
    assert!(
        sent.iter()
            .filter(|e| e.from == 1)
            .all(|e| matches!(e.kind(), Kind::Prepare | Kind::Accept | Kind::Chosen))
    );
    assert!(sent.iter().filter(|e| e.from != 1).all(|e| e.to == 1));

    let chosen = c.node(1).current().clone();
    assert_eq!(chosen.number, 2);
    assert_eq!(chosen.timing.home_lease, secs(12));
    let ballot = match &c.sent_since(mark, |e| e.kind() == Kind::Prepare)[0].message.body {
        Body::Prepare { ballot, .. } => *ballot,
        other => panic!("not a prepare: {other:?}"),
    };
    for (i, &id) in ids.iter().enumerate() {
        // The proposer's own acceptor included: one promise write, one accept write.
        assert_eq!(
            acceptor_writes(&c, id, writes_from[i]),
            vec![
                AcceptorState { promised: Some(ballot), accepted: None },
                AcceptorState { promised: Some(ballot), accepted: Some((ballot, chosen.clone())) },
            ],
            "acceptor writes of node {id}"
        );
        assert_eq!(epoch_writes(&c, id, writes_from[i]), vec![2], "learn write of node {id}");
        assert_eq!(c.node(id).current(), &chosen);
    }
    c.assert_agreement();
}

#[test]
fn uncontended_change_on_3_nodes_takes_two_round_trips_and_two_acceptor_writes() {
    uncontended_change(3);
}

#[test]
fn uncontended_change_on_5_nodes_takes_two_round_trips_and_two_acceptor_writes() {
    uncontended_change(5);
}

#[test]
fn competing_proposals_both_apply_in_consecutive_epochs() {
    let mut c = settled(&[1, 2, 3], &[4, 5]);
    let add4 = Change::Add(member(4));
    let add5 = Change::Add(member(5));
    c.propose(1, add4.clone()).unwrap();
    c.propose(2, add5.clone()).unwrap();
    c.deliver_all();
    // A duel may need a retry after a round timeout.
    c.run_for(secs(5));

    let records = c.assert_agreement();
    assert_eq!(records.keys().copied().collect::<Vec<_>>(), vec![1, 2, 3], "exactly two new epochs");
    let (e2, e3) = (&records[&2], &records[&3]);
    let first_is_add4 = add4.is_reflected_in(e2);
    assert!(first_is_add4 != add5.is_reflected_in(e2), "epoch 2 holds exactly one change: {e2:?}");
    assert!(add4.is_reflected_in(e3) && add5.is_reflected_in(e3), "epoch 3 holds both: {e3:?}");
    assert_eq!(e3.member_ids().map(|m| m.0).collect::<Vec<_>>(), vec![1, 2, 3, 4, 5]);

    let (first, second) = if first_is_add4 { (1, 2) } else { (2, 1) };
    assert_eq!(c.events(first).iter().filter(|e| matches!(e, Event::ProposalApplied { .. })).count(), 1);
    assert!(c.events(first).contains(&Event::ProposalApplied { epoch: 2 }));
    assert!(c.events(second).contains(&Event::ProposalApplied { epoch: 3 }), "{:?}", c.events(second));
    for id in [first, second] {
        assert!(!c.events(id).iter().any(|e| matches!(e, Event::ProposalFailed { .. })));
    }
    for id in 1..=5 {
        assert_eq!(c.node(id).current(), e3, "node {id} converged");
        assert!(c.events(id).contains(&Event::Learned { epoch: 3 }));
    }
}

#[test]
fn identical_concurrent_changes_are_applied_once() {
    let mut c = settled(&[1, 2, 3], &[4]);
    c.propose(1, Change::Add(member(4))).unwrap();
    c.propose(2, Change::Add(member(4))).unwrap();
    c.run_for(secs(5));
    let records = c.assert_agreement();
    assert_eq!(records.len(), 2, "one new epoch only: {records:?}");
    for id in [1, 2] {
        assert!(c.events(id).contains(&Event::ProposalApplied { epoch: 2 }), "{:?}", c.events(id));
    }
}

#[test]
fn change_accepted_by_some_acceptors_survives_the_proposers_crash() {
    let mut c = settled(&[1, 2, 3], &[4, 5]);
    let add4 = Change::Add(member(4));
    c.propose(1, add4.clone()).unwrap();
    c.deliver_where(|e| e.from == 1 && e.kind() == Kind::Prepare);
    c.deliver_where(|e| e.to == 1 && e.kind() == Kind::Promise);
    // Node 1 sent its accepts; only node 2 gets one before node 1 crashes.
    let accept = c.deliver_next_where(|e| e.is(1, 2, Kind::Accept)).expect("node 1 sent accepts");
    let Body::Accept { value: half_done, .. } = accept.message.body else { unreachable!() };
    assert!(add4.is_reflected_in(&half_done));
    c.crash(1);
    assert!(c.queued().all(|e| e.from != 1), "a crash discards the node's outgoing messages");
    assert!(c.node(2).current().number == 1 && c.node(3).current().number == 1);

    // The next proposer wants something else, but must finish the half-done change first.
    let add5 = Change::Add(member(5));
    c.propose(3, add5.clone()).unwrap();
    c.deliver_all();

    let records = c.assert_agreement();
    assert_eq!(records[&2], half_done, "epoch 2 is the crashed proposer's value, unchanged");
    assert!(add5.is_reflected_in(&records[&3]) && add4.is_reflected_in(&records[&3]));
    assert!(c.events(3).contains(&Event::ProposalApplied { epoch: 3 }), "{:?}", c.events(3));
    assert_eq!(c.node(4).current().number, 3, "the added node followed");

    c.restart(1);
    c.deliver_all();
    assert_eq!(c.node(1).current(), &records[&3], "the restarted proposer catches up");
    c.assert_agreement();
}

#[test]
fn proposal_validation_errors_are_returned_and_change_nothing() {
    let mut c = settled(&[1, 2, 3], &[4]);
    let mark = c.mark();
    let writes = c.host(1).writes.len();
    let lease = Timing { home_lease: ms(1), ..Timing::DEFAULT };
    let clash = Member { id: NodeId(9), addr: member(2).addr };
    let cases = [
        (4, Change::Remove(NodeId(1)), ProposeError::NotMember { epoch: 1 }),
        (1, Change::Add(member(2)), ChangeError::AlreadyMember(NodeId(2)).into()),
        (1, Change::Remove(NodeId(7)), ChangeError::NotMember(NodeId(7)).into()),
        (1, Change::Replace { old: NodeId(7), new: member(8) }, ChangeError::NotMember(NodeId(7)).into()),
        (1, Change::Replace { old: NodeId(1), new: member(3) }, ChangeError::AlreadyMember(NodeId(3)).into()),
        (1, Change::SetTiming(Timing::DEFAULT), ChangeError::NoOp.into()),
        (1, Change::SetTiming(lease), ChangeError::Invalid(RecordError::HomeLease(ms(1))).into()),
        (1, Change::Add(clash), ChangeError::AddressInUse { addr: member(2).addr, member: NodeId(2) }.into()),
    ];
    for (id, change, error) in cases {
        assert_eq!(c.propose(id, change.clone()), Err(error.clone()), "{change:?} at node {id}");
        assert!(!error.to_string().is_empty());
    }
    assert_eq!(c.mark(), mark, "a refused change sends nothing");
    assert_eq!(c.host(1).writes.len(), writes, "a refused change writes nothing");

    // Busy: one change at a time per node, and the first one is not disturbed.
    c.propose(1, Change::Add(member(4))).unwrap();
    assert_eq!(c.propose(1, timing(12)), Err(ProposeError::Busy));
    c.deliver_all();
    assert!(Change::Add(member(4)).is_reflected_in(c.node(1).current()));
    assert_eq!(c.node(1).current().timing, Timing::DEFAULT);
    // Free again once applied.
    c.propose(1, timing(12)).unwrap();

    // The last member cannot be removed.
    let mut solo = settled(&[1], &[]);
    assert_eq!(solo.propose(1, Change::Remove(NodeId(1))), Err(ChangeError::LastMember.into()));
}

#[test]
fn proposal_applied_is_emitted_once_at_the_proposer_only() {
    let mut c = settled(&[1, 2, 3], &[]);
    c.propose(2, timing(12)).unwrap();
    c.deliver_all();
    assert_eq!(c.events(2), vec![Event::Learned { epoch: 2 }, Event::ProposalApplied { epoch: 2 }]);
    for id in [1, 3] {
        assert_eq!(c.events(id), vec![Event::Learned { epoch: 2 }], "node {id}");
    }
}

/// Stalls `id`'s proposal: its prepares never arrive.
fn stall(c: &mut Cluster, id: u64) {
    c.drop_where(|e| e.from == id && e.kind() == Kind::Prepare);
}

#[test]
fn proposal_failed_when_another_change_removes_the_proposer() {
    let mut c = settled(&[1, 2, 3], &[4]);
    c.propose(2, Change::Add(member(4))).unwrap();
    stall(&mut c, 2);
    c.propose(3, Change::Remove(NodeId(2))).unwrap();
    c.deliver_all();
    assert_eq!(c.node(2).current().number, 2);
    assert!(!c.node(2).current().is_member(NodeId(2)));
    assert_eq!(
        c.events(2),
        vec![Event::Learned { epoch: 2 }, Event::ProposalFailed { error: ProposeError::Removed }]
    );
    assert!(c.events(3).contains(&Event::ProposalApplied { epoch: 2 }));
}

#[test]
fn proposal_failed_when_another_change_makes_it_invalid() {
    let mut c = settled(&[1, 2, 3], &[]);
    c.propose(1, Change::Replace { old: NodeId(3), new: member(5) }).unwrap();
    stall(&mut c, 1);
    c.propose(2, Change::Remove(NodeId(3))).unwrap();
    c.deliver_all();
    let failed = Event::ProposalFailed { error: ChangeError::NotMember(NodeId(3)).into() };
    assert_eq!(c.events(1), vec![Event::Learned { epoch: 2 }, failed]);
    c.run_for(secs(2));
    assert_eq!(c.assert_agreement().len(), 2, "the failed change was not proposed again");
}

#[test]
fn proposal_failed_after_being_overtaken_too_often() {
    let mut c = settled(&[1, 2, 3], &[]);
    c.propose(1, timing(20)).unwrap();
    for (i, lease) in [11, 12, 13, 14].into_iter().enumerate() {
        stall(&mut c, 1);
        let proposer = 2 + (i as u64 % 2);
        c.propose(proposer, timing(lease)).unwrap();
        c.deliver_where(|e| !(e.from == 1 && e.kind() == Kind::Prepare));
        assert_eq!(c.epoch(1), 2 + i as u64);
    }
    let failed: Vec<_> =
        c.events(1).into_iter().filter(|e| matches!(e, Event::ProposalFailed { .. })).collect();
    assert_eq!(failed, vec![Event::ProposalFailed { error: ProposeError::Overtaken(3) }]);
    // Free again for a new change.
    c.propose(1, timing(20)).unwrap();
    c.deliver_all();
    assert_eq!(c.node(1).current().timing.home_lease, secs(20));
}

#[test]
fn removed_node_learns_it_and_stops_requesting_leases() {
    let mut c = settled(&[1, 2, 3], &[]);
    c.run_for(secs(3));
    assert!(c.node(3).holds_lease(c.now));
    c.propose(1, Change::Remove(NodeId(3))).unwrap();
    c.deliver_all();
    let removed_at = c.mark();
    let now = c.now;
    assert_eq!(c.epoch(3), 2, "the removed node learns the epoch that removes it");
    assert!(c.events(3).contains(&Event::Learned { epoch: 2 }));
    assert!(!c.node(3).current().is_member(NodeId(3)));
    assert!(!c.node(3).holds_lease(now) && c.node(3).lease_until(now).is_none());

    // It announces the epoch to the member it has not heard from since (node 2), which answers
    // once; then it falls silent.
    c.run_for(secs(1));
    let announced = c.sent_since(removed_at, |e| e.from == 3 || e.to == 3);
    let kinds: Vec<_> = announced.iter().map(|e| (e.from, e.to, e.kind())).collect();
    assert!(kinds == [(3, 2, Kind::Chosen), (2, 3, Kind::CatchUp)], "{kinds:?}");
    let quiet_from = c.mark();
    c.run_for(secs(60));
    assert_eq!(c.count_sent(removed_at, 3, Kind::LeaseRequest), 0, "no lease requests after removal");
    assert_eq!(c.sent_since(quiet_from, |e| e.from == 3 || e.to == 3).len(), 0);
    assert_eq!(c.node(3).poll_timeout(), None, "nothing left to wake up for");
    assert!(!c.node(3).home_active(c.now, b"any key"));
    assert_eq!(c.propose(3, timing(12)), Err(ProposeError::NotMember { epoch: 2 }));
    // Nor does it grant leases any more.
    let mark = c.mark();
    c.handle(1, 3, Message { epoch: 2, body: Body::LeaseRequest { incarnation: 1, seq: 99 } });
    assert_eq!(c.sent_since(mark, |_| true).len(), 0);
    // The remaining members keep their leases.
    for id in [1, 2] {
        assert!(c.node(id).holds_lease(c.now), "node {id}");
    }
}

#[test]
fn non_member_cannot_propose_until_added() {
    let mut c = settled(&[1, 2, 3], &[4]);
    let mark = c.mark();
    assert_eq!(c.propose(4, timing(12)), Err(ProposeError::NotMember { epoch: 1 }));
    assert_eq!(c.mark(), mark);
    // A starting node announces its epoch to the members once; they answer, and then a
    // non-member has nothing to wake up for: no lease to renew.
    c.run_for(secs(1));
    assert_eq!(c.node(4).poll_timeout(), None, "a non-member has no lease to renew");
    c.propose(1, Change::Add(member(4))).unwrap();
    c.deliver_all();
    assert_eq!(c.epoch(4), 2);
    c.propose(4, timing(12)).unwrap();
    c.deliver_all();
    assert_eq!(c.epoch(1), 3);
    assert!(c.events(4).contains(&Event::ProposalApplied { epoch: 3 }));
}

// ---- crash and restart of a proposer ----

fn prepare_ballots(envelopes: &[Envelope]) -> Vec<Ballot> {
    envelopes
        .iter()
        .filter_map(|e| match e.message.body {
            Body::Prepare { ballot, .. } => Some(ballot),
            _ => None,
        })
        .collect()
}

/// Node 1 proposes, collects node 2's promise and sends its accepts; its own accept is not durable
/// yet when it crashes. Returns the ballot it used.
fn crash_after_sending_accepts(c: &mut Cluster, change: Change) -> Ballot {
    let mark = c.mark();
    c.propose(1, change).unwrap();
    let ballot = prepare_ballots(&c.sent_since(mark, |_| true))[0];
    c.deliver_where(|e| e.from == 1 && e.kind() == Kind::Prepare);
    c.set_manual_persistence(1, true);
    c.deliver_next_where(|e| e.is(2, 1, Kind::Promise)).unwrap();
    assert!(c.has_pending(1), "node 1's own accept is not durable yet");
    c.deliver_where(|e| e.from == 1 && e.kind() == Kind::Accept);
    c.crash(1);
    c.set_manual_persistence(1, false);
    ballot
}

#[test]
fn restarted_proposer_uses_a_higher_ballot() {
    let mut c = settled(&[1, 2, 3], &[]);
    let before = crash_after_sending_accepts(&mut c, timing(12));
    c.restart(1);
    let mark = c.mark();
    c.propose(1, timing(15)).unwrap();
    let after = prepare_ballots(&c.sent_since(mark, |_| true));
    assert!(after.iter().all(|&b| b > before), "ballot {before:?} reused after restart: {after:?}");
}

/// Trace: node 1 proposes V (lease 12 s) at ballot b; 2 and 3 promise; node 1 gets 2's promise,
/// sends accept(b, V) and crashes before its own accept is durable; 2 and 3 accept V (V is now
/// chosen). Node 1 restarts and proposes W (lease 15 s), again at ballot b; the promise and the
/// accepted votes that 3 and 2 sent to its previous run arrive and are counted for the new round, so
/// node 1 learns W as epoch 2. Node 3, proposing next, finds V and gets V chosen as epoch 2.
#[test]
fn stale_votes_for_a_restarted_proposer_cannot_choose_a_second_value() {
    let mut c = settled(&[1, 2, 3], &[]);
    let v = timing(12);
    crash_after_sending_accepts(&mut c, v.clone());
    c.restart(1);
    c.propose(1, timing(15)).unwrap();
    // Everything addressed to node 1 arrives (the old run's votes first); its own new messages are
    // held back.
    c.deliver_where(|e| e.to == 1);
    c.isolate(1);
    c.propose(3, timing(13)).unwrap();
    c.deliver_all();
    c.heal();
    c.run_for(secs(5));

    let records = c.assert_agreement();
    assert!(v.is_reflected_in(&records[&2]), "V was accepted by a majority, so epoch 2 is V");
}

#[test]
fn votes_for_another_slot_or_ballot_do_not_count() {
    let mut c = settled(&[1, 2, 3], &[]);
    let mark = c.mark();
    c.propose(1, timing(12)).unwrap();
    let ballot = prepare_ballots(&c.sent_since(mark, |_| true))[0];
    c.drop_where(|_| true);
    let other = Ballot { round: ballot.round + 1, ..ballot };
    let before = c.mark();
    for (slot, b) in [(3, ballot), (2, other)] {
        c.handle(
            2,
            1,
            Message {
                epoch: 1,
                body: Body::Vote { slot, vote: Vote::Promise { ballot: b, accepted: None } },
            },
        );
    }
    assert_eq!(c.count_sent(before, 1, Kind::Accept), 0, "neither vote made a majority");
    c.handle(
        2,
        1,
        Message { epoch: 1, body: Body::Vote { slot: 2, vote: Vote::Promise { ballot, accepted: None } } },
    );
    assert_eq!(c.count_sent(before, 1, Kind::Accept), 2, "the matching promise does");
}

#[test]
fn rounds_and_epochs_near_the_limit_are_dropped_and_proposals_still_work() {
    use keyhome_epoch::{MAX_EPOCH, MAX_ROUND, MessageError};
    let mut c = settled(&[1, 2, 3], &[]);
    let huge = Ballot { round: u64::MAX, proposer: NodeId(2) };
    let prepare = Message { epoch: 1, body: Body::Prepare { slot: 2, ballot: huge } };
    assert_eq!(prepare.validate(), Err(MessageError::BallotRound(u64::MAX)));
    let reject = Vote::Reject { ballot: Ballot { round: 1, proposer: NodeId(1) }, promised: huge };
    let vote = Message { epoch: 1, body: Body::Vote { slot: 2, vote: reject } };
    assert_eq!(vote.validate(), Err(MessageError::BallotRound(u64::MAX)));
    let far = Message { epoch: MAX_EPOCH + 1, body: Body::CatchUp };
    assert_eq!(far.validate(), Err(MessageError::EpochNumber(MAX_EPOCH + 1)));
    let highest = Ballot { round: MAX_ROUND, proposer: NodeId(2) };
    let fine = Message { epoch: MAX_EPOCH, body: Body::Prepare { slot: MAX_EPOCH, ballot: highest } };
    assert_eq!(fine.validate(), Ok(()));
    // Outbidding u64::MAX would overflow: the messages are dropped unseen, so the next
    // proposal's ballot is an ordinary one, and it is chosen.
    c.handle(2, 1, prepare);
    c.handle(2, 1, vote);
    c.handle(2, 1, far);
    let mark = c.mark();
    c.propose(1, timing(12)).unwrap();
    let ballot = prepare_ballots(&c.sent_since(mark, |_| true))[0];
    assert!(ballot.round < 100, "{ballot:?}");
    c.run_for(secs(2));
    assert_eq!(c.epoch(1), 2);
}
