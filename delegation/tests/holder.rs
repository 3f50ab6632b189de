//! The holder side of delegations, driven by hand: a scripted [`Authority`] and a fake home that
//! the tests answer for, message by message, on an explicit clock.

use std::collections::HashMap;
use std::time::Duration;

use keyhome_delegation::holder::{Event, Handle, Holder, HolderConfig, LockError, LockOutcome, Ticket};
use keyhome_delegation::{
    Authority, Body, CheckAnswer, FencingToken, Grantee, Message, Refusal, RequestId, Successor,
};
use keyhome_epoch::{Instant, NodeId, Timing};

// ---- allocation counting (rule 8) ----

#[allow(dead_code)] // each includer reads one of its two counts
#[path = "support/counting.rs"]
mod counting;
use counting::allocations;

// ---- the scripted world ----

const ME: NodeId = NodeId(1);
const HOME: NodeId = NodeId(2);
const OTHER: NodeId = NodeId(3);
const EPOCH: u64 = 4;

/// An epoch layer whose answers the test sets.
struct Script {
    epoch: u64,
    incarnation: u64,
    timing: Timing,
    /// Per-key homes; other keys live on `home`.
    homes: HashMap<Vec<u8>, NodeId>,
    home: Option<NodeId>,
}

impl Script {
    fn new() -> Script {
        Script {
            epoch: EPOCH,
            incarnation: 7,
            timing: Timing::DEFAULT,
            homes: HashMap::new(),
            home: Some(HOME),
        }
    }
}

impl Authority for Script {
    fn epoch(&self) -> u64 {
        self.epoch
    }
    fn incarnation(&self) -> u64 {
        self.incarnation
    }
    fn timing(&self) -> Timing {
        self.timing
    }
    fn is_member(&self, node: NodeId) -> bool {
        [ME, HOME, OTHER].contains(&node)
    }
    fn home_of(&self, key: &[u8]) -> Option<NodeId> {
        self.homes.get(key).copied().or(self.home)
    }
    fn home_active(&self, _now: Instant, _key: &[u8]) -> bool {
        false
    }
}

/// `ms` milliseconds after an arbitrary origin well away from zero.
fn at(ms: u64) -> Instant {
    Instant::from_nanos(1_000_000_000_000) + Duration::from_millis(ms)
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

const NS: Duration = Duration::from_nanos(1);

fn holder() -> Holder {
    Holder::new(HolderConfig::new(ME), at(0))
}

fn grantee(counter: u64) -> Grantee {
    Grantee { epoch: EPOCH, incarnation: 1, counter }
}

/// Everything the holder wants sent, checking every message carries the authority's epoch.
fn sent(h: &mut Holder) -> Vec<(NodeId, Body)> {
    let mut out = Vec::new();
    while let Some((to, message)) = h.poll_transmit() {
        assert_eq!(message.epoch, EPOCH, "messages carry auth.epoch()");
        out.push((to, message.body));
    }
    out
}

fn events(h: &mut Holder) -> Vec<Event> {
    std::iter::from_fn(|| h.poll_event()).collect()
}

#[derive(Debug)]
struct Req {
    to: NodeId,
    key: Vec<u8>,
    id: RequestId,
    lease: Duration,
    wait: Duration,
    held: Option<Grantee>,
}

fn as_request(to: NodeId, body: Body) -> Req {
    match body {
        Body::Request { key, id, lease, wait, held } => Req { to, key, id, lease, wait, held },
        other => panic!("expected a request, got {other:?}"),
    }
}

/// Exactly one message is pending, and it is a request.
fn one_request(h: &mut Holder) -> Req {
    let mut out = sent(h);
    assert_eq!(out.len(), 1, "expected one request: {out:?}");
    let (to, body) = out.pop().expect("one");
    as_request(to, body)
}

/// Exactly one message is pending, and it is a release: `(to, key, grantee, note)`.
fn one_release(h: &mut Holder) -> (NodeId, Vec<u8>, Grantee, Option<Vec<u8>>) {
    let (to, key, grantee, note, _) = one_release_flagged(h);
    (to, key, grantee, note)
}

/// Exactly one message is pending, and it is a release: `(to, key, grantee, note, recovered)`.
fn one_release_flagged(h: &mut Holder) -> (NodeId, Vec<u8>, Grantee, Option<Vec<u8>>, bool) {
    let mut out = sent(h);
    assert_eq!(out.len(), 1, "expected one release: {out:?}");
    match out.pop().expect("one") {
        (to, Body::Release { key, grantee, note, recovered, passed: None }) => {
            (to, key, grantee, note, recovered)
        }
        other => panic!("expected a release, got {other:?}"),
    }
}

fn release(g: Grantee, note: Option<&[u8]>, recovered: bool) -> Body {
    Body::Release { key: b"k".to_vec(), grantee: g, note: note.map(<[u8]>::to_vec), recovered, passed: None }
}

fn grant(
    key: &[u8],
    id: RequestId,
    g: Grantee,
    lease: Duration,
    note: Option<&[u8]>,
    recovered: bool,
) -> Message {
    Message {
        epoch: EPOCH,
        body: Body::Grant {
            key: key.to_vec(),
            id,
            grantee: g,
            lease,
            note: note.map(<[u8]>::to_vec),
            recovered,
        },
    }
}

fn refuse(key: &[u8], id: RequestId, reason: Refusal) -> Message {
    Message { epoch: EPOCH, body: Body::Refuse { key: key.to_vec(), id, reason } }
}

fn recall(key: &[u8], g: Grantee) -> Message {
    Message { epoch: EPOCH, body: Body::Recall { key: key.to_vec(), grantee: g, next: None } }
}

fn pending(outcome: Result<LockOutcome, LockError>) -> Ticket {
    match outcome {
        Ok(LockOutcome::Pending(ticket)) => ticket,
        other => panic!("expected a pending lock, got {other:?}"),
    }
}

fn locked(outcome: Result<LockOutcome, LockError>) -> Handle {
    match outcome {
        Ok(LockOutcome::Locked(handle)) => handle,
        other => panic!("expected an immediate lock, got {other:?}"),
    }
}

/// The one event pending is `Locked` for `ticket`.
fn locked_event(h: &mut Holder, ticket: Ticket) -> Handle {
    let mut evs = events(h);
    assert_eq!(evs.len(), 1, "expected one event: {evs:?}");
    match evs.pop().expect("one") {
        Event::Locked { ticket: t, handle } if t == ticket => handle,
        other => panic!("expected Locked for {ticket:?}, got {other:?}"),
    }
}

/// Locks `key` at `now` through a new delegation (`grantee(counter)`, 10 s lease) that the home
/// grants at once; returns the first handle (ttl 60 s) and the grant's request.
fn acquire(h: &mut Holder, auth: &Script, now: Instant, key: &[u8], counter: u64) -> (Handle, Req) {
    let ticket = pending(h.lock(now, key, secs(60), secs(30), auth));
    let r = one_request(h);
    assert_eq!((r.to, r.key.as_slice(), r.held), (HOME, key, None));
    h.handle_message(now, HOME, grant(key, r.id, grantee(counter), secs(10), None, false), auth);
    let handle = locked_event(h, ticket);
    assert!(sent(h).is_empty());
    (handle, r)
}

/// Runs the timers at `now` and checks the holder does not ask to be woken at or before `now`.
fn tick(h: &mut Holder, auth: &Script, now: Instant) {
    h.handle_timeout(now, auth);
    assert!(h.poll_timeout().is_none_or(|next| next > now), "timer spin at {now:?}");
}

// ---- rule 1: deadlines count from the send instant; late grants are handed back ----

#[test]
fn deadline_counts_from_the_send_instant_not_receipt() {
    let auth = Script::new();
    let mut h = holder();
    let ticket = pending(h.lock(at(0), b"k", secs(60), secs(30), &auth));
    let r = one_request(&mut h);
    assert_eq!(r.lease, secs(10));
    // The grant takes 3 s to arrive.
    h.handle_message(at(3_000), HOME, grant(b"k", r.id, grantee(1), secs(10), None, false), &auth);
    let handle = locked_event(&mut h, ticket);
    assert_eq!(handle.deadline, at(10_000), "send instant + lease, not receipt + lease");
    assert_eq!(h.delegation(at(3_000), b"k").map(|d| d.deadline), Some(at(10_000)));
    // A grant of more than was asked (a home credits a request with its wait in line, D2.2)
    // counts from the send instant too, but ends no later than the lease asked from its arrival.
    let mut h2 = holder();
    pending(h2.lock(at(0), b"k", secs(60), secs(30), &auth));
    let r2 = one_request(&mut h2);
    h2.handle_message(at(100), HOME, grant(b"k", r2.id, grantee(1), secs(25), None, false), &auth);
    assert_eq!(h2.delegation(at(100), b"k").map(|d| d.deadline), Some(at(10_100)));
    let mut h3 = holder();
    pending(h3.lock(at(0), b"k", secs(60), secs(30), &auth));
    let r3 = one_request(&mut h3);
    h3.handle_message(at(100), HOME, grant(b"k", r3.id, grantee(1), ms(10_050), None, false), &auth);
    assert_eq!(h3.delegation(at(100), b"k").map(|d| d.deadline), Some(at(10_050)));
    // The handle is valid up to the last nanosecond before the deadline, and lost at it.
    tick(&mut h, &auth, at(10_000) - NS);
    assert!(events(&mut h).is_empty());
    tick(&mut h, &auth, at(10_000));
    assert_eq!(events(&mut h), vec![Event::Expired { handle: handle.id, key: b"k".to_vec() }]);
    assert_eq!(h.delegation(at(10_000), b"k"), None);
}

#[test]
fn a_resent_request_keeps_its_first_send_instant() {
    let auth = Script::new();
    let mut h = holder();
    let ticket = pending(h.lock(at(0), b"k", secs(60), secs(30), &auth));
    let first = one_request(&mut h);
    // Unanswered: resent after `resend` (1 s) under the same id, with the remaining wait.
    tick(&mut h, &auth, at(999));
    assert!(sent(&mut h).is_empty());
    tick(&mut h, &auth, at(1_000));
    let again = one_request(&mut h);
    assert_eq!((again.id, again.lease, again.wait), (first.id, first.lease, secs(29)));
    h.handle_message(at(1_500), HOME, grant(b"k", first.id, grantee(1), secs(10), None, false), &auth);
    let handle = locked_event(&mut h, ticket);
    assert_eq!(handle.deadline, at(10_000), "counted from the first send, the conservative choice");
}

/// A lease shorter than `min_useful` (an epoch capped at 40 ms, say) is used while half of it is
/// left (review: every such grant was handed back and asked for again, so nothing was admitted).
#[test]
fn a_lease_shorter_than_min_useful_is_used_while_half_of_it_is_left() {
    let auth = Script::new();
    let mut h = holder();
    let ticket = pending(h.lock(at(0), b"k", secs(60), secs(30), &auth));
    let r = one_request(&mut h);
    // 30 ms left of a 40 ms lease (min_useful is 50 ms).
    h.handle_message(at(10), HOME, grant(b"k", r.id, grantee(1), ms(40), None, false), &auth);
    let handle = locked_event(&mut h, ticket);
    assert_eq!(handle.deadline, at(40));
}

#[test]
fn a_grant_too_late_to_be_useful_is_handed_back_with_its_note() {
    let auth = Script::new();
    let mut h = holder();
    let ticket = pending(h.lock(at(0), b"k", secs(60), secs(30), &auth));
    let r = one_request(&mut h);
    // 40 ms left (< min_useful 50 ms).
    h.handle_message(at(9_960), HOME, grant(b"k", r.id, grantee(1), secs(10), Some(b"pos=7"), false), &auth);
    let out = sent(&mut h);
    assert_eq!(out.len(), 2, "{out:?}");
    assert_eq!(
        out[0],
        (HOME, release(grantee(1), Some(b"pos=7"), false)),
        "handed back with the predecessor's note"
    );
    let again = as_request(out[1].0, out[1].1.clone());
    assert_ne!(again.id, r.id, "the locker keeps waiting: a new request");
    assert_eq!(again.wait, ms(20_040));
    assert!(events(&mut h).is_empty(), "the locker is still pending");
    assert_eq!(h.delegation(at(9_960), b"k"), None);
    // One already past its deadline is handed back too.
    h.handle_message(
        at(21_000),
        HOME,
        grant(b"k", again.id, grantee(2), secs(10), Some(b"pos=8"), true),
        &auth,
    );
    let out = sent(&mut h);
    assert_eq!(out[0], (HOME, release(grantee(2), Some(b"pos=8"), true)), "note and flag passed on");
    let third = as_request(out[1].0, out[1].1.clone());
    // A useful grant then admits the locker, with the note and flag of that grant.
    h.handle_message(
        at(21_100),
        HOME,
        grant(b"k", third.id, grantee(3), secs(10), Some(b"pos=9"), true),
        &auth,
    );
    let handle = locked_event(&mut h, ticket);
    assert_eq!((handle.note.as_deref(), handle.recovered), (Some(&b"pos=9"[..]), true));
    assert_eq!(handle.token, grantee(3).token(0));
}

#[test]
fn exactly_min_useful_left_is_used() {
    let auth = Script::new();
    let mut h = holder();
    let ticket = pending(h.lock(at(0), b"k", secs(60), secs(30), &auth));
    let r = one_request(&mut h);
    h.handle_message(at(9_950), HOME, grant(b"k", r.id, grantee(1), secs(10), None, false), &auth);
    assert_eq!(locked_event(&mut h, ticket).deadline, at(10_000));
    // Used, not handed back; being busy past half its lease, it asks for a renewal at once.
    assert_eq!(one_request(&mut h).held, Some(grantee(1)));
}

// ---- rule 2: local admission is silent; tokens; handle deadlines; FIFO waiters ----

#[test]
fn relock_under_a_live_delegation_sends_nothing_and_tokens_increase() {
    let auth = Script::new();
    let mut h = holder();
    let (first, _) = acquire(&mut h, &auth, at(0), b"k", 5);
    assert_eq!(first.token, grantee(5).token(0));
    h.unlock(at(1), first.id, None).unwrap();
    let mut last = first.token;
    for i in 0..200u64 {
        let now = at(2 + i * 10);
        // Short ttl: now + ttl. Long ttl: the delegation's deadline.
        let ttl = if i % 2 == 0 { ms(5) } else { secs(60) };
        let handle = locked(h.lock(now, b"k", ttl, secs(1), &auth));
        assert!(h.poll_transmit().is_none(), "a re-lock under a live delegation sends nothing");
        assert!(handle.token > last, "tokens strictly increase");
        assert_eq!(handle.token.local_seq, i + 1);
        assert_eq!(handle.deadline, (now + ttl).min(at(10_000)));
        assert_eq!((handle.note.as_ref(), handle.recovered), (None, false));
        last = handle.token;
        h.unlock(now + ms(1), handle.id, None).unwrap();
        assert!(h.poll_transmit().is_none(), "an unlock under a live delegation sends nothing");
    }
    let handle = h.try_lock(at(3_000), b"k", secs(1)).expect("try_lock succeeds while held and free");
    assert!(handle.token > last);
    assert!(h.poll_transmit().is_none());
    assert!(events(&mut h).is_empty());
}

#[test]
fn relocks_keep_every_wake_up_and_name_their_key() {
    // The re-lock path skips recomputing the key's next wake-up when the one scheduled comes
    // first: a handle's deadline and the idle release after the last unlock must still fire.
    let auth = Script::new();
    let mut h = holder();
    let (a, _) = acquire(&mut h, &auth, at(0), b"k", 1);
    h.unlock(at(1), a.id, None).unwrap();
    let b = locked(h.lock(at(10), b"k", ms(5), secs(1), &auth));
    assert_eq!(h.key_of(b.id), Some(&b"k"[..]));
    assert_eq!(h.poll_timeout(), Some(at(15)), "the short handle's deadline comes first");
    tick(&mut h, &auth, at(15));
    assert_eq!(events(&mut h), vec![Event::Expired { handle: b.id, key: b"k".to_vec() }]);
    assert_eq!(h.key_of(b.id), None, "taken away");
    for i in 0..10 {
        let c = locked(h.lock(at(20 + i), b"k", secs(60), secs(1), &auth));
        assert_eq!(h.key_of(c.id), Some(&b"k"[..]));
        h.unlock(at(20 + i), c.id, None).unwrap();
        assert_eq!(h.key_of(c.id), None, "unlocked");
    }
    // A handle held across the idle wake-up: the next one is the renewal, at 5 s.
    let d = locked(h.lock(at(30), b"k", secs(60), secs(1), &auth));
    tick(&mut h, &auth, at(2_030));
    assert!(sent(&mut h).is_empty(), "busy: no idle release");
    assert_eq!(h.poll_timeout(), Some(at(5_000)));
    // Idle from the unlock (at 2.5 s) for `idle_release` (2 s): released then, not at the renewal.
    h.unlock(at(2_500), d.id, None).unwrap();
    tick(&mut h, &auth, at(4_500) - NS);
    assert!(sent(&mut h).is_empty());
    tick(&mut h, &auth, at(4_500));
    assert_eq!(one_release(&mut h), (HOME, b"k".to_vec(), grantee(1), None));
    assert!(events(&mut h).is_empty());
}

#[test]
fn first_admission_after_a_grant_carries_its_note_and_flag() {
    let auth = Script::new();
    let mut h = holder();
    let ticket = pending(h.lock(at(0), b"k", secs(1), secs(5), &auth));
    let r = one_request(&mut h);
    h.handle_message(at(10), HOME, grant(b"k", r.id, grantee(1), secs(10), Some(b"wal=12"), true), &auth);
    let first = locked_event(&mut h, ticket);
    assert_eq!((first.note.as_deref(), first.recovered), (Some(&b"wal=12"[..]), true));
    h.unlock(at(20), first.id, None).unwrap();
    let second = locked(h.lock(at(30), b"k", secs(1), secs(5), &auth));
    assert_eq!((second.note, second.recovered), (None, false));
}

#[test]
fn a_handle_given_back_hands_on_the_handoff_it_got() {
    // A handle admitted for a caller that went away is given back as if never admitted: the
    // next admission, and the release, get its note and its `recovered` flag.
    let auth = Script::new();
    let mut h = holder();
    let ticket = pending(h.lock(at(0), b"k", secs(1), secs(5), &auth));
    let r = one_request(&mut h);
    h.handle_message(at(10), HOME, grant(b"k", r.id, grantee(1), secs(10), Some(b"wal=12"), true), &auth);
    let unseen = locked_event(&mut h, ticket);
    h.give_back(at(11), unseen.id).unwrap();
    let next = locked(h.lock(at(20), b"k", secs(1), secs(5), &auth));
    assert_eq!((next.note.as_deref(), next.recovered), (Some(&b"wal=12"[..]), true));
    h.give_back(at(21), next.id).unwrap();
    tick(&mut h, &auth, at(2_021));
    let (_, _, _, note, recovered) = one_release_flagged(&mut h);
    assert_eq!((note.as_deref(), recovered), (Some(&b"wal=12"[..]), true), "the idle release too");
    // A clean handoff stays clean; an unlock after a given-back handle is clean again.
    let (a, _) = acquire(&mut h, &auth, at(3_000), b"k", 2);
    h.unlock(at(3_001), a.id, Some(b"wal=13".to_vec())).unwrap();
    let b = locked(h.lock(at(3_002), b"k", secs(1), secs(5), &auth));
    assert_eq!(h.give_back(at(3_003), b.id), Ok(()));
    assert_eq!(h.give_back(at(3_004), b.id), Err(LockError::UnknownHandle), "ended once");
    let c = locked(h.lock(at(3_005), b"k", secs(1), secs(5), &auth));
    assert_eq!((c.note.as_deref(), c.recovered), (Some(&b"wal=13"[..]), false));
}

#[test]
fn one_handle_per_key_and_local_waiters_are_fifo() {
    let auth = Script::new();
    let mut h = holder();
    let (a, _) = acquire(&mut h, &auth, at(0), b"k", 1);
    let b = pending(h.lock(at(10), b"k", secs(1), secs(5), &auth));
    let c = pending(h.lock(at(20), b"k", secs(1), ms(500), &auth));
    let d = pending(h.lock(at(30), b"k", secs(1), secs(5), &auth));
    assert_eq!(h.try_lock(at(40), b"k", secs(1)), Err(LockError::WouldBlock));
    assert!(sent(&mut h).is_empty(), "queuing behind a local handle sends nothing");
    // c's own wait runs out while a still holds the key.
    tick(&mut h, &auth, at(520) - NS);
    assert!(events(&mut h).is_empty());
    tick(&mut h, &auth, at(520));
    assert_eq!(events(&mut h), vec![Event::LockFailed { ticket: c, error: LockError::Timeout }]);
    // Unlock admits the next waiter at once, with no message.
    h.unlock(at(600), a.id, None).unwrap();
    let hb = locked_event(&mut h, b);
    assert!(sent(&mut h).is_empty());
    assert!(hb.token > a.token);
    assert_eq!(hb.deadline, at(1_600), "the waiter's ttl counts from its admission");
    h.unlock(at(700), hb.id, None).unwrap();
    let hd = locked_event(&mut h, d);
    assert!(hd.token > hb.token);
    assert!(sent(&mut h).is_empty());
}

#[test]
fn a_handle_past_its_ttl_is_expired_and_the_next_waiter_admitted() {
    let auth = Script::new();
    let mut h = holder();
    let ticket = pending(h.lock(at(0), b"k", ms(100), secs(5), &auth));
    let r = one_request(&mut h);
    h.handle_message(at(0), HOME, grant(b"k", r.id, grantee(1), secs(10), None, false), &auth);
    let a = locked_event(&mut h, ticket);
    assert_eq!(a.deadline, at(100));
    let b = pending(h.lock(at(50), b"k", secs(1), secs(5), &auth));
    tick(&mut h, &auth, at(100));
    let evs = events(&mut h);
    assert_eq!(evs[0], Event::Expired { handle: a.id, key: b"k".to_vec() });
    assert!(matches!(&evs[1], Event::Locked { ticket, .. } if *ticket == b));
    assert_eq!(h.unlock(at(110), a.id, None), Err(LockError::Expired));
    assert_eq!(h.unlock(at(110), a.id, None), Err(LockError::UnknownHandle), "reported once");
    assert!(sent(&mut h).is_empty());
}

#[test]
fn renew_extends_up_to_the_delegation_deadline() {
    let auth = Script::new();
    let mut h = holder();
    let ticket = pending(h.lock(at(0), b"k", ms(100), secs(5), &auth));
    let r = one_request(&mut h);
    h.handle_message(at(0), HOME, grant(b"k", r.id, grantee(1), secs(10), None, false), &auth);
    let a = locked_event(&mut h, ticket);
    assert_eq!(h.renew(at(50), a.id, secs(1)), Ok(at(1_050)));
    assert_eq!(h.renew(at(60), a.id, secs(60)), Ok(at(10_000)));
    assert_eq!(h.renew(at(70), a.id, Duration::ZERO), Err(LockError::ZeroTtl));
    assert!(sent(&mut h).is_empty(), "renewing a handle is local");
    h.unlock(at(80), a.id, None).unwrap();
    assert_eq!(h.renew(at(90), a.id, secs(1)), Err(LockError::UnknownHandle));
}

// ---- rule 3: recall ----

#[test]
fn recall_asks_the_local_holder_to_unlock_and_waits_for_the_deadline_it_was_told() {
    let auth = Script::new();
    let mut h = holder();
    let (a, _) = acquire(&mut h, &auth, at(0), b"k", 1);
    h.unlock(at(10), a.id, Some(b"n1".to_vec())).unwrap();
    // Told: valid until the delegation's end, 10 s after the request was sent.
    let b = locked(h.lock(at(20), b"k", secs(60), secs(5), &auth));
    assert_eq!(b.deadline, at(10_000));
    h.handle_message(at(100), HOME, recall(b"k", grantee(1)), &auth);
    assert!(sent(&mut h).is_empty(), "the local holder keeps the key until it unlocks");
    assert_eq!(
        events(&mut h),
        vec![Event::Recalled { handle: b.id, key: b"k".to_vec(), deadline: b.deadline }]
    );
    assert!(h.delegation(at(100), b"k").is_some_and(|d| d.recalling));
    // Admission is closed: new lockers queue, try_lock fails without asking for anything.
    let c = pending(h.lock(at(200), b"k", secs(1), secs(20), &auth));
    assert_eq!(h.try_lock(at(200), b"k", secs(1)), Err(LockError::WouldBlock));
    assert!(sent(&mut h).is_empty());
    // A recalled handle never grows: a renewal keeps its deadline, a shorter ttl shortens it.
    assert_eq!(h.renew(at(300), b.id, secs(60)), Ok(at(10_000)));
    assert_eq!(h.renew(at(400), b.id, secs(2)), Ok(at(2_400)));
    // Nothing is taken away before that deadline, whatever time passes.
    tick(&mut h, &auth, at(2_400) - NS);
    assert!(sent(&mut h).is_empty() && events(&mut h).is_empty());
    assert!(h.key_of(b.id).is_some());
    // At the deadline the handle expires: release without a note and flagged `recovered` (the
    // holder may have written without leaving one); the queued locker asks again.
    tick(&mut h, &auth, at(2_400));
    assert_eq!(events(&mut h), vec![Event::Expired { handle: b.id, key: b"k".to_vec() }]);
    let out = sent(&mut h);
    assert_eq!(out.len(), 2, "{out:?}");
    assert_eq!(out[0], (HOME, release(grantee(1), None, true)));
    let again = as_request(out[1].0, out[1].1.clone());
    assert_eq!((again.to, again.held, again.wait), (HOME, None, ms(17_800)));
    // The expired handle's next use fails, once.
    assert_eq!(h.unlock(at(2_500), b.id, Some(b"late".to_vec())), Err(LockError::Expired));
    assert_eq!(h.renew(at(2_500), b.id, secs(1)), Err(LockError::UnknownHandle));
    // The home grants the next delegation: the queued locker gets it.
    h.handle_message(at(2_600), HOME, grant(b"k", again.id, grantee(2), secs(10), None, true), &auth);
    let hc = locked_event(&mut h, c);
    assert!(hc.token > b.token);
}

#[test]
fn a_holder_tracks_at_most_its_cap_of_keys() {
    let auth = Script::new();
    let mut config = HolderConfig::new(ME);
    config.limits.max_holder_keys = 2;
    let mut h = Holder::new(config, at(0));
    pending(h.lock(at(0), b"a", secs(1), secs(5), &auth));
    pending(h.lock(at(0), b"b", secs(1), secs(5), &auth));
    assert_eq!(h.lock(at(0), b"c", secs(1), secs(5), &auth), Err(LockError::TooManyKeys));
    assert_eq!(h.try_lock(at(0), b"c", secs(1)), Err(LockError::WouldBlock));
    assert_eq!(h.tracked_keys(), 2, "nothing allocated past the cap");
    // A key already tracked still takes waiters.
    pending(h.lock(at(0), b"a", secs(1), secs(5), &auth));
}

#[test]
fn a_pending_request_follows_its_key_to_a_new_home_at_once() {
    let mut auth = Script::new();
    let mut h = holder();
    let ticket = pending(h.lock(at(0), b"k", secs(1), secs(30), &auth));
    let first = one_request(&mut h);
    assert_eq!(first.to, HOME);
    // The home died and an epoch change moved the key: the request goes to the new home now,
    // not after a resend to the dead one.
    auth.homes.insert(b"k".to_vec(), OTHER);
    h.on_epoch_change(at(10), &auth);
    let second = one_request(&mut h);
    assert_eq!((second.to, second.held), (OTHER, None));
    assert_ne!(second.id, first.id);
    h.handle_message(at(20), OTHER, grant(b"k", second.id, grantee(9), secs(10), None, true), &auth);
    assert!(locked_event(&mut h, ticket).recovered);
    // A late grant of the dead home's is a stray and handed back.
    h.handle_message(at(30), HOME, grant(b"k", first.id, grantee(8), secs(10), None, false), &auth);
    let (to, _, g, _) = one_release(&mut h);
    assert_eq!((to, g), (HOME, grantee(8)));
}

#[test]
fn shutdown_releases_idle_delegations_and_waits_for_live_handles() {
    let auth = Script::new();
    let mut h = holder();
    let (a, _) = acquire(&mut h, &auth, at(0), b"idle", 1);
    h.unlock(at(1), a.id, Some(b"done".to_vec())).unwrap();
    let (b, _) = acquire(&mut h, &auth, at(2), b"busy", 2);
    let queued = pending(h.lock(at(3), b"busy", secs(1), secs(5), &auth));
    h.shutdown(at(4));
    // Renewing after the shutdown may shorten the handle, never extend it.
    assert_eq!(h.renew(at(4), b.id, secs(1)), Ok(at(1_004)));
    let evs = events(&mut h);
    assert!(evs.contains(&Event::LockFailed { ticket: queued, error: LockError::Closed }), "{evs:?}");
    assert!(evs.contains(&Event::Recalled { handle: b.id, key: b"busy".to_vec(), deadline: b.deadline }));
    let release_of = |key: &[u8], g: Grantee, note: Option<&[u8]>, recovered: bool| Body::Release {
        key: key.to_vec(),
        grantee: g,
        note: note.map(<[u8]>::to_vec),
        recovered,
        passed: None,
    };
    // The idle key passes on at once with its note; the busy one keeps its handle.
    assert_eq!(sent(&mut h), vec![(HOME, release_of(b"idle", grantee(1), Some(b"done"), false))]);
    assert!(h.has_handles());
    assert_eq!(h.lock(at(5), b"other", secs(1), secs(1), &auth), Err(LockError::Closed));
    // The handle passes its deadline: the successor is told `recovered`.
    tick(&mut h, &auth, at(1_004) - NS);
    assert!(sent(&mut h).is_empty() && events(&mut h).is_empty());
    tick(&mut h, &auth, at(1_004));
    assert_eq!(events(&mut h), vec![Event::Expired { handle: b.id, key: b"busy".to_vec() }]);
    assert_eq!(sent(&mut h), vec![(HOME, release_of(b"busy", grantee(2), None, true))]);
    assert!(!h.has_handles());
}

#[test]
fn recall_releases_at_a_clean_unlock_with_the_latest_note() {
    let auth = Script::new();
    let mut h = holder();
    let (a, _) = acquire(&mut h, &auth, at(0), b"k", 1);
    h.unlock(at(10), a.id, Some(b"n1".to_vec())).unwrap();
    let b = locked(h.lock(at(20), b"k", secs(60), secs(5), &auth));
    h.handle_message(at(100), HOME, recall(b"k", grantee(1)), &auth);
    assert!(sent(&mut h).is_empty());
    h.unlock(at(300), b.id, Some(b"n2".to_vec())).unwrap();
    let release = one_release_flagged(&mut h);
    assert_eq!(
        release,
        (HOME, b"k".to_vec(), grantee(1), Some(b"n2".to_vec()), false),
        "the latest unlock's note, clean"
    );
    assert_eq!(
        events(&mut h),
        vec![Event::Recalled { handle: b.id, key: b"k".to_vec(), deadline: b.deadline }],
        "asked to unlock, nothing taken away"
    );
    assert_eq!(h.delegation(at(300), b"k"), None);
    // Nothing wants the key: no request follows.
    tick(&mut h, &auth, at(300));
    assert!(sent(&mut h).is_empty());
}

#[test]
fn a_handle_taken_away_makes_the_next_release_recovered_until_a_clean_unlock() {
    let auth = Script::new();
    let mut h = holder();
    let (a, _) = acquire(&mut h, &auth, at(0), b"k", 1);
    h.unlock(at(10), a.id, Some(b"n1".to_vec())).unwrap();
    // A handle outlives its ttl: it may have written without leaving a note.
    let b = locked(h.lock(at(20), b"k", ms(100), secs(5), &auth));
    tick(&mut h, &auth, at(120));
    assert_eq!(events(&mut h), vec![Event::Expired { handle: b.id, key: b"k".to_vec() }]);
    tick(&mut h, &auth, at(2_120));
    assert_eq!(one_release_flagged(&mut h), (HOME, b"k".to_vec(), grantee(1), None, true));
    // Same again, but a later handle unlocks cleanly: the release is clean, with its note.
    let (c, _) = acquire(&mut h, &auth, at(3_000), b"k", 2);
    h.unlock(at(3_010), c.id, None).unwrap();
    let d = locked(h.lock(at(3_020), b"k", ms(10), secs(5), &auth));
    tick(&mut h, &auth, at(3_030));
    assert_eq!(events(&mut h).len(), 1, "d expired");
    let e = locked(h.lock(at(3_040), b"k", secs(1), secs(5), &auth));
    assert!(e.token > d.token);
    h.unlock(at(3_050), e.id, Some(b"n3".to_vec())).unwrap();
    tick(&mut h, &auth, at(5_050));
    assert_eq!(one_release_flagged(&mut h), (HOME, b"k".to_vec(), grantee(2), Some(b"n3".to_vec()), false));
}

#[test]
fn recall_with_no_local_holder_releases_at_once_and_repeats_a_lost_release() {
    let auth = Script::new();
    let mut h = holder();
    let (a, _) = acquire(&mut h, &auth, at(0), b"k", 1);
    h.unlock(at(10), a.id, Some(b"n1".to_vec())).unwrap();
    h.handle_message(at(100), HOME, recall(b"k", grantee(1)), &auth);
    assert_eq!(one_release(&mut h), (HOME, b"k".to_vec(), grantee(1), Some(b"n1".to_vec())));
    // The release was lost and the home recalls again: the same release, same note.
    h.handle_message(at(600), HOME, recall(b"k", grantee(1)), &auth);
    assert_eq!(one_release(&mut h), (HOME, b"k".to_vec(), grantee(1), Some(b"n1".to_vec())));
    // A recall of something never held is ignored.
    h.handle_message(at(700), HOME, recall(b"k", grantee(9)), &auth);
    assert!(sent(&mut h).is_empty());
}

/// Defect (a): a grant flagged `recovered` that is handed back unused (too late, or no longer
/// wanted) passes its flag and note on, so the next grant is flagged too.
#[test]
fn a_recovered_grant_handed_back_unused_keeps_its_flag() {
    let auth = Script::new();
    let mut h = holder();
    // Too late to be useful.
    pending(h.lock(at(0), b"k", secs(60), secs(30), &auth));
    let r = one_request(&mut h);
    h.handle_message(at(9_960), HOME, grant(b"k", r.id, grantee(1), secs(10), Some(b"p"), true), &auth);
    let out = sent(&mut h);
    assert_eq!(out[0], (HOME, release(grantee(1), Some(b"p"), true)));
    // No longer wanted: the locker gave up, and the grant arrives as a stray.
    let mut h = holder();
    let ticket = pending(h.lock(at(0), b"k", secs(60), secs(30), &auth));
    let r = one_request(&mut h);
    assert!(h.cancel(at(10), ticket));
    tick(&mut h, &auth, at(1_000));
    assert!(sent(&mut h).is_empty(), "the request is forgotten, not resent");
    h.handle_message(at(1_100), HOME, grant(b"k", r.id, grantee(1), secs(10), Some(b"p"), true), &auth);
    assert_eq!(sent(&mut h), vec![(HOME, release(grantee(1), Some(b"p"), true))]);
}

/// Defect (b): a renewal's grant that arrives after the holder released the delegation is not
/// handed back: the release in flight covers it, and an empty hand-back could overtake it.
#[test]
fn a_renewal_grant_after_the_release_is_not_handed_back() {
    let auth = Script::new();
    let mut h = holder();
    let (a, _) = acquire(&mut h, &auth, at(0), b"k", 1);
    tick(&mut h, &auth, at(5_000));
    let renewal = one_request(&mut h);
    assert_eq!(renewal.held, Some(grantee(1)));
    h.unlock(at(5_100), a.id, Some(b"n49".to_vec())).unwrap();
    h.handle_message(at(5_200), HOME, recall(b"k", grantee(1)), &auth);
    assert_eq!(one_release_flagged(&mut h), (HOME, b"k".to_vec(), grantee(1), Some(b"n49".to_vec()), false));
    h.handle_message(at(5_300), HOME, grant(b"k", renewal.id, grantee(1), secs(10), None, false), &auth);
    assert!(sent(&mut h).is_empty(), "the release already sent covers the renewal");
    // A repeated recall still repeats the real release.
    h.handle_message(at(5_400), HOME, recall(b"k", grantee(1)), &auth);
    assert_eq!(sent(&mut h), vec![(HOME, release(grantee(1), Some(b"n49"), false))]);
}

/// A renewal answered with a newer grantee: the home had let the held delegation end and granted
/// a new one, flagged `recovered` (another node may have held the key in between). The holder's
/// own last note no longer describes the key: the next admission, and a release before any, say
/// `recovered` with the grant's note. (Found by the lock simulation, seed 19112, once walks were
/// paced: a slow node's renewal reached the home after its delegation ended there.)
#[test]
fn a_renewal_answered_with_a_new_delegation_passes_on_the_grants_handoff() {
    let auth = Script::new();
    // Admitted under the new delegation: told `recovered`, not given this holder's own note.
    let mut h = holder();
    let renewed_into_new = |h: &mut Holder| {
        let (a, _) = acquire(h, &auth, at(0), b"k", 1);
        tick(h, &auth, at(5_000));
        let renewal = one_request(h);
        assert_eq!(renewal.held, Some(grantee(1)));
        h.unlock(at(5_100), a.id, Some(b"mine".to_vec())).unwrap();
        h.handle_message(at(5_200), HOME, grant(b"k", renewal.id, grantee(7), secs(10), None, true), &auth);
        assert!(sent(h).is_empty());
    };
    renewed_into_new(&mut h);
    let b = locked(h.lock(at(5_300), b"k", secs(60), secs(1), &auth));
    assert_eq!((b.token.counter, b.note.as_deref(), b.recovered), (7, None, true));
    // Released before any admission: the grant's flag goes back, not this holder's note.
    let mut h = holder();
    renewed_into_new(&mut h);
    h.handle_message(at(5_300), HOME, recall(b"k", grantee(7)), &auth);
    assert_eq!(one_release_flagged(&mut h), (HOME, b"k".to_vec(), grantee(7), None, true));
}

/// A renewal answered with a newer grantee whose handoff note arrives while this holder's old
/// handle is past its deadline but not yet expired (the node's timer runs late): the old handle
/// is expired first, so its expiry (which clears the key's note: its owner may have written
/// without leaving one) does not take the note the grant brought from the key's holder in between.
/// Nobody here wants the key, so the grant goes back at once with that note and flag.
#[test]
fn a_grants_note_outlives_an_old_handle_expired_late() {
    let auth = Script::new();
    let mut h = holder();
    let (a, _) = acquire(&mut h, &auth, at(0), b"k", 1);
    tick(&mut h, &auth, at(5_000));
    let renewal = one_request(&mut h);
    // The handle's deadline (the delegation's, 10 s) passes; the timer has not run yet.
    h.handle_message(
        at(10_500),
        HOME,
        grant(b"k", renewal.id, grantee(7), secs(10), Some(b"theirs"), false),
        &auth,
    );
    tick(&mut h, &auth, at(10_600));
    assert_eq!(
        one_release_flagged(&mut h),
        (HOME, b"k".to_vec(), grantee(7), Some(b"theirs".to_vec()), false)
    );
    let expired: Vec<_> = events(&mut h).into_iter().filter(|e| matches!(e, Event::Expired { .. })).collect();
    assert_eq!(expired, vec![Event::Expired { handle: a.id, key: b"k".to_vec() }]);
}

/// Defect (c): a renewal's grant that arrives after the delegation expired is handed back flagged
/// `recovered`, even when it arrives after the expired delegation's own lease would have ended
/// (the renewal asked for more).
#[test]
fn a_renewal_grant_after_an_expiry_is_handed_back_recovered() {
    let auth = Script::new();
    let mut h = holder();
    let ticket = pending(h.lock(at(0), b"k", secs(60), secs(30), &auth));
    let r = one_request(&mut h);
    h.handle_message(at(0), HOME, grant(b"k", r.id, grantee(1), secs(1), Some(b"p"), false), &auth);
    locked_event(&mut h, ticket);
    // Busy: renewal at half the lease, never answered in time.
    tick(&mut h, &auth, at(500));
    let renewal = one_request(&mut h);
    assert_eq!((renewal.held, renewal.lease), (Some(grantee(1)), secs(10)));
    tick(&mut h, &auth, at(1_000));
    assert_eq!(h.delegation(at(1_000), b"k"), None);
    sent(&mut h);
    events(&mut h);
    // Arrives after the expired delegation's lease (1 s) has passed once more, but the renewal
    // (sent at 0.5 s for 10 s) may still be live.
    h.handle_message(at(3_000), HOME, grant(b"k", renewal.id, grantee(1), secs(10), None, false), &auth);
    assert_eq!(sent(&mut h), vec![(HOME, release(grantee(1), None, true))]);
}

/// The same when a Recall made the renewal unneeded while it was in flight (found by the lock
/// simulation, hostile 3-member seed 3824 on 2026-12-06): the holder dropped the request without
/// noting how long its answer may stay live, forgot the key once the handle and the delegation
/// had run out, and handed the late grant back with the grant's own flag, `recovered: false`,
/// although the handle had ended at its deadline.
#[test]
fn a_renewal_dropped_at_a_recall_is_handed_back_recovered_after_an_expiry() {
    let auth = Script::new();
    let mut h = holder();
    let ticket = pending(h.lock(at(0), b"k", secs(60), secs(30), &auth));
    let r = one_request(&mut h);
    h.handle_message(at(0), HOME, grant(b"k", r.id, grantee(1), secs(1), Some(b"p"), false), &auth);
    locked_event(&mut h, ticket);
    tick(&mut h, &auth, at(500));
    let renewal = one_request(&mut h);
    assert_eq!((renewal.held, renewal.lease), (Some(grantee(1)), secs(10)));
    // Recalled: admission closes and the renewal is no longer needed; the handle holds on.
    h.handle_message(at(600), HOME, recall(b"k", grantee(1)), &auth);
    tick(&mut h, &auth, at(700));
    assert!(sent(&mut h).is_empty(), "the handle is live: nothing is released yet");
    tick(&mut h, &auth, at(1_000));
    assert_eq!(h.delegation(at(1_000), b"k"), None);
    sent(&mut h);
    events(&mut h);
    // After every answer to the acquisition (sent at 0 for 10 s) is dead, but the renewal (sent
    // at 0.5 s for 10 s) may still be live.
    tick(&mut h, &auth, at(10_100));
    h.handle_message(at(10_200), HOME, grant(b"k", renewal.id, grantee(1), secs(10), None, false), &auth);
    assert_eq!(sent(&mut h), vec![(HOME, release(grantee(1), None, true))]);
}

/// After a restart, a grant answering a request of the earlier run may renew a delegation under
/// which that run admitted handles whose owners are still inside the deadlines they were told (a
/// crash ends none of them). Handing it back would let the home grant the key to someone else
/// inside those deadlines (found by the lock simulation, seed 12141: node 4's restarted run handed
/// back the renewal its crashed run had asked for, and was itself granted the key while the
/// crashed run's client held it). So it is kept from the home, and not used either.
#[test]
fn a_grant_for_an_earlier_run_is_left_to_expire_at_the_home() {
    let auth = Script::new();
    let mut h = holder();
    let earlier = RequestId::new(6, 3);
    h.handle_message(at(10), HOME, grant(b"k", earlier, grantee(1), secs(10), None, false), &auth);
    h.handle_message(
        at(20),
        HOME,
        grant(b"k", RequestId { seq: 4, ..earlier }, grantee(2), secs(10), Some(b"p"), false),
        &auth,
    );
    assert_eq!(sent(&mut h), vec![], "nothing is handed back");
    pending(h.lock(at(30), b"k", secs(1), secs(30), &auth));
    let r = one_request(&mut h);
    assert_eq!((r.to, r.held), (HOME, None), "the earlier run's delegation is not used: a new request");
}

/// Defect (d): a delegation granted `recovered` and released before any admission passes the
/// flag (and the note) on; one admitted under releases cleanly.
#[test]
fn a_recovered_delegation_released_unused_passes_the_flag_on() {
    let auth = Script::new();
    let mut h = holder();
    assert_eq!(h.try_lock(at(0), b"k", secs(1)), Err(LockError::WouldBlock));
    tick(&mut h, &auth, at(0));
    let r = one_request(&mut h);
    h.handle_message(at(10), HOME, grant(b"k", r.id, grantee(1), secs(10), Some(b"p"), true), &auth);
    assert!(sent(&mut h).is_empty() && events(&mut h).is_empty());
    h.handle_message(at(100), HOME, recall(b"k", grantee(1)), &auth);
    assert_eq!(one_release_flagged(&mut h), (HOME, b"k".to_vec(), grantee(1), Some(b"p".to_vec()), true));
    // A lost release is repeated with the same flag.
    h.handle_message(at(600), HOME, recall(b"k", grantee(1)), &auth);
    assert_eq!(sent(&mut h), vec![(HOME, release(grantee(1), Some(b"p"), true))]);
    // Once admitted, the release is clean.
    let mut h = holder();
    let ticket = pending(h.lock(at(0), b"k", secs(60), secs(30), &auth));
    let r = one_request(&mut h);
    h.handle_message(at(10), HOME, grant(b"k", r.id, grantee(1), secs(10), Some(b"p"), true), &auth);
    let a = locked_event(&mut h, ticket);
    assert!(a.recovered);
    h.unlock(at(20), a.id, None).unwrap();
    h.handle_message(at(100), HOME, recall(b"k", grantee(1)), &auth);
    assert_eq!(one_release_flagged(&mut h), (HOME, b"k".to_vec(), grantee(1), None, false));
}

/// The locker's handle from the events a delegation that came recalled gives: `Locked`, then
/// `Recalled` at once with the handle's deadline.
fn locked_recalled(h: &mut Holder, ticket: Ticket) -> Handle {
    let evs = events(h);
    match &evs[..] {
        [Event::Locked { ticket: t, handle }, Event::Recalled { handle: r, key, deadline }]
            if *t == ticket && *r == handle.id && key == b"k" && *deadline == handle.deadline =>
        {
            handle.clone()
        }
        other => panic!("expected Locked then Recalled for {ticket:?}, got {other:?}"),
    }
}

/// Defect (e): a Recall that overtakes its Grant is remembered while the acquisition request is
/// outstanding, and applied when the Grant arrives: the locker first in line is admitted once and
/// told at once that the key is recalled, and the delegation goes straight back when it unlocks,
/// instead of being held until the next Recall (or its expiry). A later locker asks again.
#[test]
fn a_recall_that_overtakes_its_grant_is_applied_when_the_grant_arrives() {
    let auth = Script::new();
    let mut h = holder();
    let ticket = pending(h.lock(at(0), b"k", secs(60), secs(30), &auth));
    let r = one_request(&mut h);
    h.handle_message(at(10), HOME, recall(b"k", grantee(1)), &auth);
    assert!(sent(&mut h).is_empty());
    h.handle_message(at(20), HOME, grant(b"k", r.id, grantee(1), secs(10), Some(b"p"), false), &auth);
    assert!(sent(&mut h).is_empty(), "the key came for the waiting locker: it is admitted first");
    let first = locked_recalled(&mut h, ticket);
    assert_eq!((first.note.as_deref(), first.token), (Some(&b"p"[..]), grantee(1).token(0)));
    // Recalled: nobody else is admitted under it, and the unlock gives it back.
    let second = pending(h.lock(at(25), b"k", secs(60), secs(30), &auth));
    assert!(sent(&mut h).is_empty() && events(&mut h).is_empty());
    h.unlock(at(30), first.id, Some(b"q".to_vec())).unwrap();
    tick(&mut h, &auth, at(30));
    let out = sent(&mut h);
    assert_eq!(out.len(), 2, "{out:?}");
    assert_eq!(out[0], (HOME, release(grantee(1), Some(b"q"), false)));
    let again = as_request(out[1].0, out[1].1.clone());
    assert_eq!((again.held, again.wait), (None, ms(29_995)), "the next locker asks again");
    assert!(events(&mut h).is_empty());
    // A later grant with another grantee is not affected by that recall.
    h.handle_message(at(40), HOME, grant(b"k", again.id, grantee(2), secs(10), Some(b"q"), false), &auth);
    let handle = locked_event(&mut h, second);
    assert_eq!(handle.note.as_deref(), Some(&b"q"[..]));
    assert!(sent(&mut h).is_empty());
}

/// A Recall that overtakes its Grant (with no locker waiting any more) goes straight back.
#[test]
fn a_recall_that_overtakes_an_unwanted_grant_sends_it_straight_back() {
    let auth = Script::new();
    let mut h = holder();
    let ticket = pending(h.lock(at(0), b"k", secs(60), ms(15), &auth));
    let r = one_request(&mut h);
    h.handle_message(at(10), HOME, recall(b"k", grantee(1)), &auth);
    tick(&mut h, &auth, at(15));
    assert!(
        matches!(&events(&mut h)[..], [Event::LockFailed { ticket: t, error: LockError::Timeout }] if *t == ticket)
    );
    h.handle_message(at(20), HOME, grant(b"k", r.id, grantee(1), secs(10), Some(b"p"), false), &auth);
    assert_eq!(sent(&mut h), vec![(HOME, release(grantee(1), Some(b"p"), false))]);
    assert!(events(&mut h).is_empty());
}

/// A Recall that overtakes its Grant and carries a successor granted ahead (as every Recall of a
/// delegation in a home's chain does): the locker first in line is admitted once, and when it
/// unlocks the delegation is passed to the successor, instead of going back to the home (which
/// would then grant the successor itself, one message later). The Recall's sender (here a new home
/// that adopted the key while the Grant was in flight) is the home the Pass names and the Release
/// goes to, and a resent Recall without the successor keeps it.
#[test]
fn a_recall_that_overtakes_its_grant_passes_the_successor_it_carries() {
    const NEW_HOME: NodeId = NodeId(7);
    let auth = Script::new();
    let mut h = holder();
    let ticket = pending(h.lock(at(0), b"k", secs(60), secs(30), &auth));
    let r = one_request(&mut h);
    let next = Successor { to: OTHER, id: RequestId::new(9, 3), grantee: grantee(2), lease: secs(4) };
    let recall_ahead =
        |next| Message { epoch: EPOCH, body: Body::Recall { key: b"k".to_vec(), grantee: grantee(1), next } };
    h.handle_message(at(10), NEW_HOME, recall_ahead(Some(next)), &auth);
    h.handle_message(at(15), NEW_HOME, recall_ahead(None), &auth);
    assert!(sent(&mut h).is_empty());
    h.handle_message(at(20), HOME, grant(b"k", r.id, grantee(1), secs(10), Some(b"p"), false), &auth);
    assert!(sent(&mut h).is_empty());
    let handle = locked_recalled(&mut h, ticket);
    h.unlock(at(21), handle.id, None).unwrap();
    tick(&mut h, &auth, at(21));
    let out = sent(&mut h);
    let pass = Body::Pass {
        key: b"k".to_vec(),
        home: NEW_HOME,
        id: next.id,
        grantee: grantee(2),
        lease: secs(4),
        note: None,
        recovered: false,
    };
    let release = Body::Release {
        key: b"k".to_vec(),
        grantee: grantee(1),
        note: None,
        recovered: false,
        passed: Some(grantee(2)),
    };
    assert_eq!(out, [(OTHER, pass), (NEW_HOME, release)]);
    assert!(events(&mut h).is_empty());
}

// ---- rule 4: expiry ----

#[test]
fn expiry_revokes_every_handle_and_waiters_ask_again() {
    let auth = Script::new();
    let mut h = holder();
    let (a, _) = acquire(&mut h, &auth, at(0), b"k", 1);
    let b = pending(h.lock(at(10), b"k", secs(1), secs(30), &auth));
    let c = pending(h.lock(at(20), b"k", secs(1), ms(9_000), &auth));
    // Busy: a renewal goes out at half the lease, and the home never answers it.
    tick(&mut h, &auth, at(5_000));
    let renewal = one_request(&mut h);
    assert_eq!(renewal.held, Some(grantee(1)));
    tick(&mut h, &auth, at(6_000));
    assert_eq!(one_request(&mut h).id, renewal.id, "resent, same id");
    tick(&mut h, &auth, at(9_020));
    assert_eq!(events(&mut h), vec![Event::LockFailed { ticket: c, error: LockError::Timeout }]);
    assert_eq!(one_request(&mut h).id, renewal.id, "resent again (at 7, 8 and 9 s)");
    tick(&mut h, &auth, at(10_000));
    assert_eq!(events(&mut h), vec![Event::Expired { handle: a.id, key: b"k".to_vec() }]);
    assert_eq!(h.delegation(at(10_000), b"k"), None);
    let again = one_request(&mut h);
    assert_eq!((again.held, again.wait), (None, ms(20_010)), "b still waits: it asks again");
    assert_eq!(h.unlock(at(10_100), a.id, None), Err(LockError::Expired));
    // The renewal's grant, arriving after expiry, is handed back as stale (still live: sent at 5 s).
    // Flagged `recovered`: the handles under it were revoked by the expiry.
    h.handle_message(at(10_200), HOME, grant(b"k", renewal.id, grantee(1), secs(10), None, false), &auth);
    assert_eq!(one_release_flagged(&mut h), (HOME, b"k".to_vec(), grantee(1), None, true));
    // A new delegation admits b, with tokens above everything before.
    h.handle_message(at(10_300), HOME, grant(b"k", again.id, grantee(2), secs(10), None, true), &auth);
    let hb = locked_event(&mut h, b);
    assert!(hb.token > a.token);
    assert!(hb.recovered);
}

// ---- rule 5: renew busy delegations, release idle ones ----

#[test]
fn a_busy_delegation_renews_at_half_lease_counted_from_its_own_send() {
    let auth = Script::new();
    let mut h = holder();
    let (a, _) = acquire(&mut h, &auth, at(0), b"k", 1);
    h.unlock(at(1_000), a.id, None).unwrap();
    // Activity keeps it from idling; no renewal before half the lease.
    let mut now = 1_000;
    while now + 700 < 4_950 {
        now += 700;
        let hd = locked(h.lock(at(now), b"k", ms(10), secs(1), &auth));
        h.unlock(at(now + 5), hd.id, None).unwrap();
        tick(&mut h, &auth, at(now + 5));
        assert!(sent(&mut h).is_empty(), "no renewal before half the lease ({now} ms)");
    }
    let handle = locked(h.lock(at(4_950), b"k", secs(60), secs(1), &auth));
    tick(&mut h, &auth, at(5_000) - NS);
    assert!(sent(&mut h).is_empty());
    tick(&mut h, &auth, at(5_000));
    let renewal = one_request(&mut h);
    assert_eq!((renewal.to, renewal.held, renewal.lease), (HOME, Some(grantee(1)), secs(10)));
    // Answered 1 s later: the new deadline counts from the renewal's send instant.
    h.handle_message(at(6_000), HOME, grant(b"k", renewal.id, grantee(1), secs(10), None, false), &auth);
    assert!(sent(&mut h).is_empty());
    assert_eq!(h.delegation(at(6_000), b"k").map(|d| d.deadline), Some(at(15_000)));
    // The handle held across the renewal follows the delegation up to its own ttl; tokens go on.
    assert_eq!(h.renew(at(6_000), handle.id, secs(60)), Ok(at(15_000)));
    h.unlock(at(6_100), handle.id, None).unwrap();
    let next = locked(h.lock(at(6_200), b"k", secs(60), secs(1), &auth));
    assert!(next.token > handle.token);
    assert_eq!(next.deadline, at(15_000));
    // A long critical section with no calls still counts as busy: the next renewal at 10 s.
    tick(&mut h, &auth, at(10_000));
    let second = one_request(&mut h);
    assert_eq!(second.held, Some(grantee(1)));
    h.handle_message(at(10_050), HOME, grant(b"k", second.id, grantee(1), secs(10), None, false), &auth);
    assert_eq!(h.delegation(at(10_050), b"k").map(|d| d.deadline), Some(at(20_000)));
    assert_eq!(h.renew(at(10_100), next.id, secs(60)), Ok(at(20_000)));
}

#[test]
fn a_refused_renewal_is_retried_only_for_where_or_when_refusals() {
    let mut auth = Script::new();
    let mut h = holder();
    let (a, _) = acquire(&mut h, &auth, at(0), b"k", 1);
    tick(&mut h, &auth, at(5_000));
    let r1 = one_request(&mut h);
    assert_eq!(r1.held, Some(grantee(1)));
    // The key moved: ask the new home after the back-off.
    h.handle_message(at(5_010), HOME, refuse(b"k", r1.id, Refusal::NotHome), &auth);
    auth.homes.insert(b"k".to_vec(), OTHER);
    tick(&mut h, &auth, at(5_060) - NS);
    assert!(sent(&mut h).is_empty());
    tick(&mut h, &auth, at(5_060));
    let r2 = one_request(&mut h);
    assert_eq!((r2.to, r2.held), (OTHER, Some(grantee(1))));
    // Not extended (say, others wait): no more renewals; the delegation is used to its deadline.
    h.handle_message(at(5_100), OTHER, refuse(b"k", r2.id, Refusal::WaitExpired), &auth);
    assert_eq!(h.delegation(at(5_100), b"k").map(|d| d.deadline), Some(at(10_000)));
    assert_eq!(h.renew(at(6_000), a.id, secs(60)), Ok(at(10_000)));
    tick(&mut h, &auth, at(9_999));
    assert!(sent(&mut h).is_empty());
    tick(&mut h, &auth, at(10_000));
    assert_eq!(events(&mut h), vec![Event::Expired { handle: a.id, key: b"k".to_vec() }]);
    assert!(sent(&mut h).is_empty(), "an expiry sends nothing");
}

#[test]
fn an_idle_delegation_is_released_cleanly_with_its_stored_note() {
    let auth = Script::new();
    let mut h = holder();
    let (a, _) = acquire(&mut h, &auth, at(0), b"k", 1);
    h.unlock(at(500), a.id, Some(b"last".to_vec())).unwrap();
    tick(&mut h, &auth, at(2_500) - NS);
    assert!(sent(&mut h).is_empty());
    tick(&mut h, &auth, at(2_500));
    assert_eq!(one_release(&mut h), (HOME, b"k".to_vec(), grantee(1), Some(b"last".to_vec())));
    assert!(events(&mut h).is_empty());
    // Without a note: a release without one, and never a renewal.
    let mut h = holder();
    let (a, _) = acquire(&mut h, &auth, at(0), b"k", 1);
    h.unlock(at(100), a.id, None).unwrap();
    tick(&mut h, &auth, at(2_100));
    assert_eq!(one_release(&mut h), (HOME, b"k".to_vec(), grantee(1), None));
    // Afterwards nothing is left to do: the key is forgotten once its history ages out.
    let mut now = at(2_100);
    while let Some(next) = h.poll_timeout() {
        assert!(next < at(60_000), "still busy at {next:?}");
        now = next;
        tick(&mut h, &auth, now);
        assert!(sent(&mut h).is_empty(), "an idle, released key never renews");
    }
    assert!(now < at(30_000));
    assert_eq!(h.tracked_keys(), 0);
}

#[test]
fn an_idle_delegation_is_not_renewed_even_past_half_its_lease() {
    let auth = Script::new();
    let mut config = HolderConfig::new(ME);
    config.idle_release = secs(8);
    let mut h = Holder::new(config, at(0));
    let (a, _) = acquire(&mut h, &auth, at(0), b"k", 1);
    h.unlock(at(100), a.id, None).unwrap();
    // The lock and unlock are activity since the grant: one renewal at half the lease...
    tick(&mut h, &auth, at(5_000));
    let r = one_request(&mut h);
    h.handle_message(at(5_000), HOME, grant(b"k", r.id, grantee(1), secs(10), None, false), &auth);
    tick(&mut h, &auth, at(8_099));
    assert!(sent(&mut h).is_empty());
    // Idle for 8 s since the unlock: released, while the delegation still runs to 15 s, and
    // without a second renewal at 10 s.
    tick(&mut h, &auth, at(8_100));
    assert_eq!(one_release(&mut h), (HOME, b"k".to_vec(), grantee(1), None));
    tick(&mut h, &auth, at(10_000));
    assert!(sent(&mut h).is_empty());
    // A delegation untouched since its grant is never renewed.
    let mut config = HolderConfig::new(ME);
    config.idle_release = secs(8);
    let mut h = Holder::new(config, at(0));
    assert_eq!(h.try_lock(at(0), b"k", secs(1)), Err(LockError::WouldBlock));
    tick(&mut h, &auth, at(0));
    let r = one_request(&mut h);
    h.handle_message(at(0), HOME, grant(b"k", r.id, grantee(1), secs(10), None, false), &auth);
    tick(&mut h, &auth, at(5_000));
    assert!(sent(&mut h).is_empty(), "no activity since the grant: no renewal");
    tick(&mut h, &auth, at(8_000));
    assert_eq!(one_release(&mut h), (HOME, b"k".to_vec(), grantee(1), None));
}

#[test]
fn an_unused_grant_is_released_with_the_note_it_carried() {
    let auth = Script::new();
    let mut h = holder();
    let ticket = pending(h.lock(at(0), b"k", secs(1), secs(1), &auth));
    let r = one_request(&mut h);
    // The locker gives up before the grant arrives.
    assert!(h.cancel(at(10), ticket));
    assert!(!h.cancel(at(10), ticket));
    // The request is forgotten at its next timer, so the grant is stray: handed back with its note.
    tick(&mut h, &auth, at(1_000));
    assert!(sent(&mut h).is_empty(), "not resent: nobody wants it");
    h.handle_message(at(1_100), HOME, grant(b"k", r.id, grantee(1), secs(10), Some(b"n0"), false), &auth);
    assert_eq!(one_release(&mut h), (HOME, b"k".to_vec(), grantee(1), Some(b"n0".to_vec())));
}

// ---- rule 6: homes, refusals, stray grants ----

#[test]
fn requests_go_to_the_home_and_soft_refusals_retry_after_a_back_off() {
    let mut auth = Script::new();
    auth.homes.insert(b"k".to_vec(), OTHER);
    let mut h = holder();
    let ticket = pending(h.lock(at(0), b"k", secs(1), secs(30), &auth));
    let r = one_request(&mut h);
    assert_eq!(r.to, OTHER, "requests go to auth.home_of(key)");
    // A refusal from someone else, or for another id, is ignored.
    h.handle_message(at(10), HOME, refuse(b"k", r.id, Refusal::HomeFull), &auth);
    h.handle_message(
        at(10),
        OTHER,
        refuse(b"k", RequestId { seq: r.id.seq + 1, ..r.id }, Refusal::HomeFull),
        &auth,
    );
    assert!(events(&mut h).is_empty());
    // NotHome: the epoch moved on; retry after the back-off (50 ms), at the new home.
    h.handle_message(at(20), OTHER, refuse(b"k", r.id, Refusal::NotHome), &auth);
    auth.homes.insert(b"k".to_vec(), HOME);
    tick(&mut h, &auth, at(70) - NS);
    assert!(sent(&mut h).is_empty());
    tick(&mut h, &auth, at(70));
    let r2 = one_request(&mut h);
    assert_eq!(r2.to, HOME);
    // StaleEpoch: again, with the back-off doubled.
    h.handle_message(at(80), HOME, refuse(b"k", r2.id, Refusal::StaleEpoch), &auth);
    tick(&mut h, &auth, at(180) - NS);
    assert!(sent(&mut h).is_empty());
    tick(&mut h, &auth, at(180));
    let r3 = one_request(&mut h);
    // Quarantine: retry once it is over.
    h.handle_message(at(200), HOME, refuse(b"k", r3.id, Refusal::Quarantine(secs(3))), &auth);
    tick(&mut h, &auth, at(3_199));
    assert!(sent(&mut h).is_empty());
    tick(&mut h, &auth, at(3_200));
    let r4 = one_request(&mut h);
    assert_eq!(r4.wait, ms(26_800));
    h.handle_message(at(3_250), HOME, grant(b"k", r4.id, grantee(1), secs(10), None, false), &auth);
    assert_eq!(locked_event(&mut h, ticket).deadline, at(4_250));
}

#[test]
fn a_retry_beyond_a_lockers_wait_times_it_out() {
    let auth = Script::new();
    let mut h = holder();
    let short = pending(h.lock(at(0), b"k", secs(1), secs(2), &auth));
    let long = pending(h.lock(at(0), b"k", secs(1), secs(30), &auth));
    let r = one_request(&mut h);
    h.handle_message(at(100), HOME, refuse(b"k", r.id, Refusal::LockDelay(secs(5))), &auth);
    assert_eq!(
        events(&mut h),
        vec![Event::LockFailed { ticket: short, error: LockError::Timeout }],
        "the key is busy for longer than the locker waits: its wait ran out, the cluster is fine"
    );
    tick(&mut h, &auth, at(5_100));
    assert_eq!(one_request(&mut h).wait, ms(24_900));
    let _ = long;
}

#[test]
fn a_refusal_delay_beyond_the_epochs_fence_bound_is_cut_to_it() {
    let auth = Script::new();
    let bound = auth.timing.fence_bound();
    let mut h = holder();
    let ticket = pending(h.lock(at(0), b"k", secs(1), secs(3600), &auth));
    let r = one_request(&mut h);
    // A home that names a delay no epoch allows: the holder asks again after the fence bound, not
    // never.
    h.handle_message(at(0), HOME, refuse(b"k", r.id, Refusal::Quarantine(Duration::MAX)), &auth);
    assert!(events(&mut h).is_empty(), "the locker still waits");
    tick(&mut h, &auth, at(0) + bound - NS);
    assert!(sent(&mut h).is_empty());
    tick(&mut h, &auth, at(0) + bound);
    let r2 = one_request(&mut h);
    h.handle_message(at(0) + bound, HOME, refuse(b"k", r2.id, Refusal::LockDelay(Duration::MAX)), &auth);
    tick(&mut h, &auth, at(0) + bound * 2);
    let r3 = one_request(&mut h);
    h.handle_message(at(0) + bound * 2, HOME, grant(b"k", r3.id, grantee(1), secs(10), None, false), &auth);
    locked_event(&mut h, ticket);
}

#[test]
fn hard_refusals_fail_every_pending_locker() {
    let auth = Script::new();
    let mut h = holder();
    let a = pending(h.lock(at(0), b"k", secs(1), secs(30), &auth));
    let b = pending(h.lock(at(5), b"k", secs(1), secs(30), &auth));
    let r = one_request(&mut h);
    h.handle_message(at(100), HOME, refuse(b"k", r.id, Refusal::HomeFull), &auth);
    let error = LockError::Refused(Refusal::HomeFull);
    assert_eq!(
        events(&mut h),
        vec![Event::LockFailed { ticket: a, error }, Event::LockFailed { ticket: b, error }]
    );
    tick(&mut h, &auth, at(10_000));
    assert!(sent(&mut h).is_empty(), "no retry");
    assert_eq!(h.tracked_keys(), 0);
}

#[test]
fn a_pending_lock_times_out_at_its_wait() {
    let auth = Script::new();
    let mut h = holder();
    let ticket = pending(h.lock(at(0), b"k", secs(1), ms(2_500), &auth));
    one_request(&mut h);
    tick(&mut h, &auth, at(1_000));
    one_request(&mut h); // resent
    tick(&mut h, &auth, at(2_000));
    one_request(&mut h); // resent
    tick(&mut h, &auth, at(2_500) - NS);
    assert!(events(&mut h).is_empty());
    tick(&mut h, &auth, at(2_500));
    assert_eq!(events(&mut h), vec![Event::LockFailed { ticket, error: LockError::Timeout }]);
    assert!(sent(&mut h).is_empty());
}

#[test]
fn stray_and_duplicate_grants_are_handed_back_while_live() {
    let auth = Script::new();
    let mut h = holder();
    let (a, r) = acquire(&mut h, &auth, at(0), b"k", 1);
    // A duplicate of the grant in use is not handed back: that would release what is held.
    h.handle_message(at(100), HOME, grant(b"k", r.id, grantee(1), secs(10), None, false), &auth);
    assert!(sent(&mut h).is_empty());
    // A grant for an id this run never sent (another run's) is left to expire at the home: it may
    // renew a delegation whose handles' owners are inside their told deadlines.
    h.handle_message(
        at(100),
        HOME,
        grant(b"k", RequestId::new(99, 5), grantee(7), secs(10), Some(b"x"), false),
        &auth,
    );
    assert!(sent(&mut h).is_empty());
    // A grant for a key nobody asked for, likewise.
    h.handle_message(at(100), HOME, grant(b"other", r.id, grantee(8), secs(10), None, false), &auth);
    assert_eq!(one_release(&mut h), (HOME, b"other".to_vec(), grantee(8), None));
    // The held delegation is untouched.
    assert_eq!(h.delegation(at(100), b"k").map(|d| d.grantee), Some(grantee(1)));
    h.unlock(at(200), a.id, None).unwrap();
    // Once the request it answered is dead, a stray grant is not worth a message.
    h.handle_message(at(10_000), HOME, grant(b"k", r.id, grantee(9), secs(10), None, false), &auth);
    assert!(sent(&mut h).is_empty());
}

#[test]
fn a_grant_from_a_node_not_asked_is_not_used() {
    let auth = Script::new();
    let mut h = holder();
    let ticket = pending(h.lock(at(0), b"k", secs(1), secs(30), &auth));
    let r = one_request(&mut h);
    h.handle_message(at(10), OTHER, grant(b"k", r.id, grantee(1), secs(10), None, false), &auth);
    assert_eq!(one_release(&mut h), (OTHER, b"k".to_vec(), grantee(1), None));
    assert!(events(&mut h).is_empty());
    h.handle_message(at(20), HOME, grant(b"k", r.id, grantee(2), secs(10), None, false), &auth);
    locked_event(&mut h, ticket);
}

// ---- rule 7: caps ----

#[test]
fn caps_on_keys_waiters_and_notes() {
    let auth = Script::new();
    let mut h = holder();
    let max = h.config().limits.max_key_len;
    let long = vec![b'x'; max + 1];
    assert_eq!(h.lock(at(0), &long, secs(1), secs(1), &auth), Err(LockError::KeyTooLong));
    assert_eq!(h.try_lock(at(0), &long, secs(1)), Err(LockError::KeyTooLong));
    assert_eq!(h.tracked_keys(), 0, "refused before anything was allocated");
    assert!(sent(&mut h).is_empty());
    pending(h.lock(at(0), &long[..max], secs(1), secs(1), &auth));
    sent(&mut h);

    let (a, _) = acquire(&mut h, &auth, at(0), b"k", 1);
    let waiters = h.config().limits.max_waiters_per_key;
    for i in 0..waiters {
        pending(h.lock(at(i as u64), b"k", secs(1), secs(5), &auth));
    }
    assert_eq!(h.lock(at(100), b"k", secs(1), secs(5), &auth), Err(LockError::QueueFull));

    let note_max = h.config().limits.max_note_len;
    assert_eq!(h.unlock(at(200), a.id, Some(vec![0; note_max + 1])), Err(LockError::NoteTooLarge));
    assert!(events(&mut h).is_empty(), "the lock stays held: no waiter admitted");
    assert_eq!(h.renew(at(200), a.id, secs(1)), Ok(at(1_200)), "still live");
    h.unlock(at(300), a.id, Some(vec![0; note_max])).unwrap();
    assert!(matches!(events(&mut h).as_slice(), [Event::Locked { .. }]));
}

// ---- local successors under one delegation ----

#[test]
fn a_local_successor_gets_the_previous_local_holders_note() {
    let auth = Script::new();
    let mut h = holder();
    let (a, _) = acquire(&mut h, &auth, at(0), b"k", 1);
    h.unlock(at(1), a.id, Some(b"up to row 7".to_vec())).unwrap();
    let b = h.try_lock(at(2), b"k", secs(1)).unwrap();
    assert_eq!(b.note.as_deref(), Some(&b"up to row 7"[..]));
    assert!(!b.recovered, "a clean local unlock");
    h.unlock(at(3), b.id, None).unwrap();
    let c = h.try_lock(at(4), b"k", secs(1)).unwrap();
    assert_eq!(c.note, None, "the note went to the holder after the one who left it");
}

#[test]
fn a_local_successor_of_a_taken_away_handle_is_told_recovered() {
    let auth = Script::new();
    let mut h = holder();
    let (a, _) = acquire(&mut h, &auth, at(0), b"k", 1);
    h.unlock(at(1), a.id, Some(b"n".to_vec())).unwrap();
    // A handle whose ttl runs out under a delegation that stays live.
    let b = h.try_lock(at(2), b"k", ms(100)).unwrap();
    tick(&mut h, &auth, at(200));
    assert!(events(&mut h).iter().any(|e| matches!(e, Event::Expired { handle, .. } if *handle == b.id)));
    let d = h.try_lock(at(300), b"k", secs(1)).unwrap();
    assert!(d.recovered, "the previous local handle expired: it may have stopped halfway");
    assert_eq!(d.note, None);
    // After a clean unlock, the next one is not.
    h.unlock(at(303), d.id, None).unwrap();
    let e = h.try_lock(at(304), b"k", secs(1)).unwrap();
    assert!(!e.recovered);
}

// ---- rule 8: the re-lock path allocates nothing ----

#[test]
fn relock_allocates_nothing() {
    let auth = Script::new();
    let mut h = holder();
    let (a, _) = acquire(&mut h, &auth, at(0), b"some/key", 1);
    h.unlock(at(1), a.id, None).unwrap();
    // Warm up (first pushes into the timer heap).
    for i in 0..10 {
        let handle = locked(h.lock(at(2 + i), b"some/key", secs(1), secs(1), &auth));
        h.unlock(at(2 + i), handle.id, None).unwrap();
    }
    for i in 0..100 {
        let now = at(20 + i);
        let before = allocations();
        let handle = locked(h.lock(now, b"some/key", secs(1), secs(1), &auth));
        let after_lock = allocations();
        h.unlock(now, handle.id, None).unwrap();
        let after_unlock = allocations();
        drop(handle);
        assert_eq!(after_lock - before, 0, "lock allocates nothing");
        assert_eq!(after_unlock - after_lock, 0, "unlock allocates nothing");
        let before = allocations();
        let handle = h.try_lock(now, b"some/key", secs(1)).unwrap();
        assert_eq!(allocations() - before, 0, "try_lock allocates nothing");
        h.unlock(now, handle.id, None).unwrap();
    }
}

// ---- tokens across delegations ----

#[test]
fn tokens_increase_across_delegations() {
    let auth = Script::new();
    let mut h = holder();
    let (a, _) = acquire(&mut h, &auth, at(0), b"k", 5);
    h.unlock(at(10), a.id, None).unwrap();
    let b = locked(h.lock(at(20), b"k", secs(1), secs(1), &auth));
    h.unlock(at(30), b.id, None).unwrap();
    tick(&mut h, &auth, at(2_030));
    one_release(&mut h);
    // The next delegation has a higher counter: every token beats every earlier one.
    let (c, r) = acquire(&mut h, &auth, at(3_000), b"k", 6);
    assert!(c.token > b.token && b.token > a.token);
    assert_eq!(c.token, FencingToken { epoch: EPOCH, incarnation: 1, counter: 6, local_seq: 0 });
    h.unlock(at(3_010), c.id, None).unwrap();
    tick(&mut h, &auth, at(5_010));
    one_release(&mut h);
    // A grant below one already used for the key is never used.
    let ticket = pending(h.lock(at(6_000), b"k", secs(1), secs(5), &auth));
    let r2 = one_request(&mut h);
    assert_ne!(r2.id, r.id);
    h.handle_message(at(6_000), HOME, grant(b"k", r2.id, grantee(4), secs(10), None, false), &auth);
    let out = sent(&mut h);
    assert_eq!(out[0], (HOME, release(grantee(4), None, false)));
    let r3 = as_request(out[1].0, out[1].1.clone());
    // Re-granting the same delegation continues its sequence rather than repeating tokens.
    h.handle_message(at(6_010), HOME, grant(b"k", r3.id, grantee(6), secs(10), None, false), &auth);
    let d = locked_event(&mut h, ticket);
    assert!(d.token > c.token);
    assert_eq!(d.token.local_seq, 1);
}

// ---- try_lock and timers ----

#[test]
fn try_lock_starts_a_request_so_a_later_try_succeeds() {
    let auth = Script::new();
    let mut h = holder();
    assert_eq!(h.try_lock(at(0), b"k", secs(1)), Err(LockError::WouldBlock));
    assert!(sent(&mut h).is_empty(), "try_lock has no authority: the request waits for the timer");
    assert_eq!(h.poll_timeout(), Some(at(0)));
    tick(&mut h, &auth, at(0));
    let r = one_request(&mut h);
    assert_eq!(r.wait, secs(2));
    // Trying again while the request is out asks for nothing more.
    assert_eq!(h.try_lock(at(10), b"k", secs(1)), Err(LockError::WouldBlock));
    tick(&mut h, &auth, at(10));
    assert!(sent(&mut h).is_empty());
    h.handle_message(at(20), HOME, grant(b"k", r.id, grantee(1), secs(10), Some(b"n"), false), &auth);
    assert!(events(&mut h).is_empty());
    let handle = h.try_lock(at(30), b"k", secs(1)).expect("held now");
    assert_eq!(handle.note.as_deref(), Some(&b"n"[..]));
    assert_eq!(handle.deadline, at(1_030));
    // Unused, the prefetched delegation is released after idle_release like any other.
    h.unlock(at(40), handle.id, None).unwrap();
    tick(&mut h, &auth, at(2_040));
    one_release(&mut h);
}

#[test]
fn zero_wait_lock_behaves_as_try_lock() {
    let auth = Script::new();
    let mut h = holder();
    assert_eq!(h.lock(at(0), b"k", secs(1), Duration::ZERO, &auth), Err(LockError::WouldBlock));
    assert_eq!(h.lock(at(0), b"k", Duration::ZERO, secs(1), &auth), Err(LockError::ZeroTtl));
    tick(&mut h, &auth, at(0));
    one_request(&mut h);
}

#[test]
fn no_home_fails_fast() {
    let mut auth = Script::new();
    auth.home = None;
    let mut h = holder();
    assert_eq!(h.lock(at(0), b"k", secs(1), secs(1), &auth), Err(LockError::NoHome));
    assert_eq!(h.tracked_keys(), 0);
}

/// A fake home that grants every request at once (renewals with the same grantee, new
/// delegations with a new counter) and honours releases.
struct EagerHome {
    counter: u64,
}

impl EagerHome {
    fn answer(&mut self, h: &mut Holder, auth: &Script, now: Instant) -> usize {
        let mut n = 0;
        for (to, body) in sent(h) {
            assert_eq!(to, HOME);
            n += 1;
            if let Body::Request { key, id, lease, held, .. } = body {
                let g = held.unwrap_or_else(|| {
                    self.counter += 1;
                    grantee(self.counter)
                });
                h.handle_message(now, HOME, grant(&key, id, g, lease, None, false), auth);
            }
        }
        n
    }
}

#[test]
fn no_timer_spin_over_a_long_run() {
    let auth = Script::new();
    let mut h = holder();
    let mut home = EagerHome { counter: 0 };
    // Busy for the first half hour (a lock every 1.7 s, held 300 ms), then idle for as long.
    let busy_until = at(1_800_000);
    let end = at(3_600_000);
    let mut now = at(0);
    let mut next_work = Some(at(0));
    let mut held: Option<Handle> = None;
    let (mut wakeups, mut messages, mut admissions) = (0u64, 0usize, 0u64);
    let mut last_token: Option<FencingToken> = None;
    let mut admitted = |handle: Handle, held: &mut Option<Handle>| {
        assert!(last_token.is_none_or(|t| handle.token > t), "tokens strictly increase");
        last_token = Some(handle.token);
        admissions += 1;
        assert!(held.replace(handle).is_none(), "one handle at a time");
    };
    loop {
        let timer = h.poll_timeout();
        let Some(next) = [timer, next_work].into_iter().flatten().min() else { break };
        assert!(next >= now, "time never goes back");
        now = next;
        assert!(now <= end, "still busy after an hour");
        if timer.is_some_and(|t| t <= now) {
            wakeups += 1;
            tick(&mut h, &auth, now);
        }
        if next_work == Some(now) {
            match held.take() {
                Some(handle) => {
                    h.unlock(now, handle.id, None).unwrap();
                    next_work = Some(now + ms(1_400)).filter(|&t| t < busy_until);
                }
                None => {
                    if let LockOutcome::Locked(handle) = h.lock(now, b"k", secs(5), secs(5), &auth).unwrap() {
                        admitted(handle, &mut held);
                    }
                    next_work = Some(now + ms(300));
                }
            }
        }
        messages += home.answer(&mut h, &auth, now);
        for event in events(&mut h) {
            match event {
                Event::Locked { handle, .. } => admitted(handle, &mut held),
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    // 1 059 lock cycles; one request, a renewal every 5 s (360), one release once idle; fewer
    // than two wake-ups per cycle.
    assert_eq!(admissions, 1_059);
    assert_eq!(messages, 1 + 360 + 1);
    assert!(wakeups < 2 * admissions, "{wakeups} wake-ups");
    assert!(now < busy_until + secs(60), "the idle key was dropped soon after the work stopped");
    assert_eq!(h.tracked_keys(), 0);
}

// ---- token checks: the holder answers a home's probe ----

/// The asker of the probes below: some other node.
const ASKER: NodeId = NodeId(9);

/// Probes the holder about `key`'s `token` at `now` as the home would; returns the answer, which
/// must go to the asker alone, as the one message sent.
fn probe(h: &mut Holder, auth: &Script, now: Instant, key: &[u8], token: FencingToken) -> CheckAnswer {
    let body = Body::Probe { key: key.to_vec(), id: 77, token, asker: ASKER };
    h.handle_message(now, HOME, Message { epoch: EPOCH, body }, auth);
    match &sent(h)[..] {
        [(ASKER, Body::CheckReply { key: k, id: 77, answer: Ok(answer) })] if k == key => *answer,
        other => panic!("expected one answer to the asker, got {other:?}"),
    }
}

#[test]
fn a_probe_is_answered_exactly_from_the_local_lock_table() {
    let auth = Script::new();
    let mut h = holder();
    let g = grantee(1);
    let (first, _) = acquire(&mut h, &auth, at(0), b"k", 1);
    assert_eq!(probe(&mut h, &auth, at(1), b"k", g.token(0)), CheckAnswer::HeldNow);
    h.unlock(at(2), first.id, None).unwrap();
    assert_eq!(
        probe(&mut h, &auth, at(3), b"k", g.token(0)),
        CheckAnswer::NotHeld,
        "unlocked, nothing later"
    );
    // Two local re-locks under the same delegation, which the home never hears of.
    let second = locked(h.lock(at(4), b"k", secs(60), secs(1), &auth));
    h.unlock(at(5), second.id, None).unwrap();
    let third = locked(h.lock(at(6), b"k", ms(100), secs(1), &auth));
    assert_eq!(third.token, g.token(2));
    assert_eq!(probe(&mut h, &auth, at(7), b"k", g.token(0)), CheckAnswer::Superseded, "re-locked since");
    assert_eq!(probe(&mut h, &auth, at(7), b"k", g.token(1)), CheckAnswer::Superseded);
    assert_eq!(probe(&mut h, &auth, at(7), b"k", g.token(2)), CheckAnswer::HeldNow);
    assert_eq!(probe(&mut h, &auth, at(7), b"k", g.token(3)), CheckAnswer::NotHeld, "never issued");
    let earlier = Grantee { epoch: EPOCH - 1, incarnation: 9, counter: 9 };
    assert_eq!(probe(&mut h, &auth, at(7), b"k", earlier.token(5)), CheckAnswer::Superseded, "earlier epoch");
    let later = grantee(2);
    assert_eq!(probe(&mut h, &auth, at(7), b"k", later.token(0)), CheckAnswer::NotHeld);
    assert_eq!(probe(&mut h, &auth, at(7), b"other", g.token(2)), CheckAnswer::NotHeld, "no such key here");
    // Past its deadline (at(106)) the handle is not held, though no timer has run yet.
    assert_eq!(probe(&mut h, &auth, at(106) - NS, b"k", g.token(2)), CheckAnswer::HeldNow);
    assert_eq!(probe(&mut h, &auth, at(106), b"k", g.token(2)), CheckAnswer::NotHeld);
    assert_eq!(events(&mut h).len(), 1, "the expiry is reported as usual");
}

#[test]
fn a_probe_after_the_release_still_knows_the_local_re_locks() {
    let auth = Script::new();
    let mut h = holder();
    let g = grantee(1);
    let (first, _) = acquire(&mut h, &auth, at(0), b"k", 1);
    h.unlock(at(1), first.id, None).unwrap();
    let second = locked(h.lock(at(2), b"k", secs(60), secs(1), &auth));
    h.unlock(at(3), second.id, None).unwrap();
    // Idle: released (the home may still think it live while the Release is in flight).
    tick(&mut h, &auth, at(2_003));
    assert_eq!(one_release(&mut h).2, g);
    assert_eq!(probe(&mut h, &auth, at(2_004), b"k", g.token(0)), CheckAnswer::Superseded);
    assert_eq!(probe(&mut h, &auth, at(2_004), b"k", g.token(1)), CheckAnswer::NotHeld);
}

// ---- passes: a Recall that carries the next holder's delegation ----

#[test]
fn a_recalled_holder_passes_the_successor_its_delegation_then_tells_the_home() {
    let auth = Script::new();
    let mut h = holder();
    let (handle, _) = acquire(&mut h, &auth, at(0), b"k", 5);
    let next = Successor { to: OTHER, id: RequestId::new(9, 3), grantee: grantee(6), lease: secs(4) };
    let message = Message {
        epoch: EPOCH,
        body: Body::Recall { key: b"k".to_vec(), grantee: grantee(5), next: Some(next) },
    };
    h.handle_message(at(1), HOME, message, &auth);
    assert!(sent(&mut h).is_empty(), "nothing passes while the handle holds the key");
    h.unlock(at(2), handle.id, Some(b"n".to_vec())).unwrap();
    let note = Some(b"n".to_vec());
    assert_eq!(
        sent(&mut h),
        vec![
            (
                OTHER,
                Body::Pass {
                    key: b"k".to_vec(),
                    home: HOME,
                    id: next.id,
                    grantee: grantee(6),
                    lease: secs(4),
                    note: note.clone(),
                    recovered: false
                }
            ),
            (
                HOME,
                Body::Release {
                    key: b"k".to_vec(),
                    grantee: grantee(5),
                    note,
                    recovered: false,
                    passed: Some(grantee(6))
                }
            ),
        ]
    );
}

/// Only a member of the current epoch passes a key on: a removed node's certificate may be in
/// other hands, and a Pass made up with it (naming the home and a request this node sent) would
/// have this node admit while the key's holder may still be inside the deadline it was told.
#[test]
fn a_pass_from_a_node_that_is_not_a_member_is_ignored() {
    const REMOVED: NodeId = NodeId(99);
    let auth = Script::new();
    let mut h = holder();
    let ticket = pending(h.lock(at(0), b"k", secs(60), secs(30), &auth));
    let r = one_request(&mut h);
    let body = Body::Pass {
        key: b"k".to_vec(),
        home: HOME,
        id: r.id,
        grantee: grantee(6),
        lease: secs(4),
        note: None,
        recovered: false,
    };
    let pass = Message { epoch: EPOCH, body };
    h.handle_message(at(3), REMOVED, pass.clone(), &auth);
    assert!(events(&mut h).is_empty(), "nothing admitted");
    assert!(sent(&mut h).is_empty(), "nothing sent");
    assert_eq!(h.delegation(at(3), b"k"), None);
    h.handle_message(at(4), OTHER, pass, &auth);
    locked_event(&mut h, ticket);
}

#[test]
fn a_pass_is_taken_as_the_homes_grant_of_the_request_it_names() {
    let auth = Script::new();
    let mut h = holder();
    let ticket = pending(h.lock(at(0), b"k", secs(60), secs(30), &auth));
    let r = one_request(&mut h);
    let pass = |id| Message {
        epoch: EPOCH,
        body: Body::Pass {
            key: b"k".to_vec(),
            home: HOME,
            id,
            grantee: grantee(6),
            lease: secs(4),
            note: Some(b"n".to_vec()),
            recovered: false,
        },
    };
    // From the previous holder, not the home; the deadline counts from this node's send instant.
    h.handle_message(at(3), OTHER, pass(r.id), &auth);
    let handle = locked_event(&mut h, ticket);
    assert_eq!((handle.token, handle.deadline), (grantee(6).token(0), at(4_000)));
    assert_eq!(handle.note.as_deref(), Some(&b"n"[..]));
    // The home's own grant of the same delegation (it could not tell it was passed) changes nothing.
    h.handle_message(at(4), HOME, grant(b"k", r.id, grantee(6), secs(4), None, true), &auth);
    assert!(sent(&mut h).is_empty());
    // A pass for a request this node never sent goes back to the home named in it.
    h.handle_message(at(5), OTHER, pass(RequestId::new(1, 77)), &auth);
    assert!(sent(&mut h).iter().all(|(to, _)| *to == HOME));
}
