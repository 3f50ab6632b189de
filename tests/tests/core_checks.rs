//! The node core takes a token check's answer only for the key it asked about, and a handle
//! serial that names no shard for one nobody holds.

use std::time::Duration;

use keyhome::core::{ClaimError, ClientOwner, Core, Output, PeerMessage};
use keyhome_delegation::{Body, CheckAnswer, FencingToken, HolderConfig, HomeConfig, Message};
use keyhome_epoch::{Config, Durable, EpochNode, EpochRecord, Instant, Member, NodeId, Timing};

/// A core of `shards` key shards.
fn core(shards: usize) -> Core {
    let members =
        (1..=3).map(|i| Member { id: NodeId(i), addr: format!("127.0.0.1:{}", 7000 + i) }).collect();
    let genesis = EpochRecord::genesis(members, Timing::DEFAULT).expect("a valid genesis");
    let epoch = EpochNode::start(Config::new(NodeId(1), 1), Durable::genesis(genesis), Instant::ZERO);
    Core::new(
        epoch,
        HomeConfig::new(NodeId(1)),
        HolderConfig::new(NodeId(1)),
        shards,
        Instant::ZERO,
        &mut Vec::new(),
    )
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
