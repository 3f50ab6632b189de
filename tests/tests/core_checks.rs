//! The node core takes a token check's answer only for the key it asked about, a handle
//! serial that names no shard for one nobody holds, and a clock reading older than one it acted on
//! as that later one.

use std::time::Duration;

use keyhome::core::{ClaimError, ClientOwner, Core, Output, PeerMessage};
use keyhome_delegation::{Body, CheckAnswer, FencingToken, HolderConfig, HomeConfig, Message, RequestId};
use keyhome_epoch::{Config, Durable, EpochNode, EpochRecord, Instant, Member, NodeId, Timing};

/// A core of `shards` key shards.
fn core(shards: usize) -> Core {
    core_with(shards, HomeConfig::new(NodeId(1)), &mut Vec::new())
}

/// Node 1's core of a genesis {1, 2, 3}, with `shards` key shards and its home configured as
/// `home`; what its start produced goes to `out`.
fn core_with(shards: usize, home: HomeConfig, out: &mut Vec<Output>) -> Core {
    let members =
        (1..=3).map(|i| Member { id: NodeId(i), addr: format!("127.0.0.1:{}", 7000 + i) }).collect();
    let genesis = EpochRecord::genesis(members, Timing::DEFAULT).expect("a valid genesis");
    let epoch = EpochNode::start(Config::new(NodeId(1), 1), Durable::genesis(genesis), Instant::ZERO);
    Core::new(epoch, home, HolderConfig::new(NodeId(1)), shards, Instant::ZERO, out)
}

fn reply(key: &[u8], id: u64) -> PeerMessage {
    let body = Body::CheckReply { key: key.to_vec(), id, answer: Ok(CheckAnswer::NotHeld) };
    PeerMessage::Delegation(Message { epoch: 1, body })
}

fn done(out: &mut Vec<Output>) -> Vec<Output> {
    std::mem::take(out).into_iter().filter(|o| matches!(o, Output::CheckDone { .. })).collect()
}

#[test]
fn a_check_answer_counts_only_for_the_key_asked_about() {
    // Two shards: the check and its answer must meet in the key's shard.
    let c = core(2);
    let mut out = Vec::new();
    let now = Instant::from_nanos(1_000_000);
    let token: FencingToken = "1.1.1.0".parse().expect("a token");
    // A key homed elsewhere, so the answer must come from a peer.
    let key =
        (0..).map(|i| format!("orders-{i}").into_bytes()).find(|k| c.epoch().home_of(k) != Some(NodeId(1)));
    let key = key.expect("some key is homed on another node");
    let home = c.epoch().home_of(&key).expect("a home");
    let id = c.check(now, key.clone(), token, Duration::from_secs(5), &mut out).expect("a home is known");
    assert_eq!(done(&mut out), vec![]);
    // Another key of the same shard, so that the answer reaches the shard that asked.
    let other =
        (0..).map(|i| format!("other-{i}").into_bytes()).find(|k| c.shard_index(k) == c.shard_index(&key));
    c.handle_message(now, home, reply(&other.expect("a key of the same shard"), id), &mut out);
    assert_eq!(done(&mut out), vec![], "an answer about another key is ignored");
    c.handle_message(now, NodeId(9), reply(&key, id), &mut out);
    assert_eq!(done(&mut out), vec![], "an answer from a node no epoch names is ignored");
    c.handle_message(now, home, reply(&key, id), &mut out);
    assert_eq!(done(&mut out), vec![Output::CheckDone { id, answer: Some(Ok(CheckAnswer::NotHeld)) }]);
    c.handle_message(now, home, reply(&key, id), &mut out);
    assert_eq!(done(&mut out), vec![], "answered once");
}

#[test]
fn a_serial_that_names_no_shard_is_not_held() {
    // Three shards give out serials 4 apart: serials of the form 4n + 3 name no shard.
    let c = core(3);
    let owner = ClientOwner { conn: 1, identity: 1 };
    for serial in [0, 3, 7, 8, u64::MAX] {
        assert_eq!(c.claim(serial, owner), Err(ClaimError::NotHeld(serial)));
    }
}

/// Carries out what a lone core asked for until nothing is left: its writes are durable at once,
/// and nodes 2 and 3 grant every home lease it asks for. Returns the delegation messages it sent.
fn settle(c: &Core, now: Instant, out: &mut Vec<Output>) -> Vec<(NodeId, Body)> {
    use keyhome_epoch::Body as E;
    let mut sent = Vec::new();
    while !out.is_empty() {
        for output in std::mem::take(out) {
            match output {
                Output::Persist { number, .. } => c.persisted(now, number, out),
                Output::Transmit { to, message: PeerMessage::Epoch(m) } => {
                    if let E::LeaseRequest { incarnation, seq } = m.body {
                        let body = E::LeaseGrant { incarnation, seq };
                        let grant = keyhome_epoch::Message { epoch: m.epoch, body };
                        c.handle_message(now, to, PeerMessage::Epoch(grant), out);
                    }
                }
                Output::Transmit { to, message: PeerMessage::Delegation(m) } => sent.push((to, m.body)),
                _ => {}
            }
        }
    }
    sent
}

/// The runtime reads the clock before it takes a shard's lock, so a thread that waited for the
/// lock hands the shard an instant older than one the shard already acted on. The core acts at
/// the later one: here a release read at 50 ms, handled after a request received at 100 ms was
/// queued, grants that request a delegation the home counts from 100 ms, not from before the
/// requester asked (its holder counts from its send instant, so the home's view would end first
/// and the home could grant the key again while the holder's clients still hold it).
#[test]
fn a_reading_older_than_one_the_core_acted_on_counts_as_that_later_one() {
    // With a lock-delay the home grants no successor ahead: the waiter is granted when the key
    // is released, at the release's instant.
    let mut home = HomeConfig::new(NodeId(1));
    home.lock_delay = Duration::from_secs(1);
    let mut out = Vec::new();
    let c = core_with(1, home, &mut out);
    settle(&c, Instant::ZERO, &mut out);
    // Past the start's activation wait and quarantine, with a home lease.
    let t = Instant::ZERO + Duration::from_secs(60);
    for s in 1..=60 {
        let now = Instant::ZERO + Duration::from_secs(s);
        c.handle_timeout(now, &mut out);
        settle(&c, now, &mut out);
    }
    let key = (0..).map(|i| format!("k{i}").into_bytes()).find(|k| c.epoch().home_of(k) == Some(NodeId(1)));
    let key = key.expect("some key is homed here");
    let lease = Duration::from_secs(5);
    let request = |seq| Body::Request {
        key: key.clone(),
        id: RequestId { incarnation: 1, seq },
        lease,
        wait: Duration::from_secs(10),
        held: None,
    };
    let message = |body| PeerMessage::Delegation(Message { epoch: 1, body });

    c.handle_message(t, NodeId(2), message(request(1)), &mut out);
    let sent = settle(&c, t, &mut out);
    let grantee = match sent.as_slice() {
        [(NodeId(2), Body::Grant { grantee, .. })] => *grantee,
        other => panic!("node 2 is granted the key: {other:?}"),
    };
    let asked = t + Duration::from_millis(100);
    c.handle_message(asked, NodeId(3), message(request(1)), &mut out);
    let sent = settle(&c, asked, &mut out);
    let recall = matches!(sent.as_slice(), [(NodeId(2), Body::Recall { next: None, .. })]);
    assert!(recall, "node 3 waits, node 2 is recalled: {sent:?}");

    let stale = t + Duration::from_millis(50);
    let release = Body::Release { key: key.clone(), grantee, note: None, recovered: false, passed: None };
    c.handle_message(stale, NodeId(2), message(release), &mut out);
    let sent = settle(&c, stale, &mut out);
    assert!(matches!(sent.as_slice(), [(NodeId(3), Body::Grant { .. })]), "node 3 is granted: {sent:?}");
    let end = c.home(&key).delegation(&key).expect("node 3's delegation").end;
    let margin = keyhome_epoch::time::rate_margin(lease, Timing::DEFAULT.clock_rate_ppm);
    assert!(
        end >= asked + margin,
        "the home ends node 3's delegation at {end:?}: counted from before it asked"
    );
}
