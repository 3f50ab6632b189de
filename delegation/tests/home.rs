//! The home side of delegations, driven by a scripted epoch layer and a hand-held clock.
//!
//! Every test names the rule of `delegation::home` it pins down; each would fail if the rule
//! were broken.

use std::collections::HashMap;
use std::time::Duration;

use keyhome_delegation::home::{HANDOVER_SENDS, retry_period, shrink};
use keyhome_delegation::{
    Authority, Body, CheckAnswer, Delegation, FencingToken, Grantee, Handed, Home, HomeConfig, HomeCounters,
    KeyStatus, Limits, Message, Refusal, RequestId, Successor,
};
use keyhome_epoch::time::rate_margin;
use keyhome_epoch::{Instant, NodeId, Timing};

// ---- a counting allocator, per thread, for the memory test ----

#[allow(dead_code)] // each includer reads one of its two counts
#[path = "support/counting.rs"]
mod counting;
use counting::allocated;

// ---- the scripted epoch layer ----

/// The home under test.
const H: NodeId = NodeId(1);
const A: NodeId = NodeId(2);
const B: NodeId = NodeId(3);
const C: NodeId = NodeId(4);
/// A key's new home after an epoch change.
const N: NodeId = NodeId(5);
/// Not a member.
const X: NodeId = NodeId(99);

const TIMING: Timing = Timing {
    home_lease: Duration::from_millis(100),
    max_delegation_lease: Duration::from_secs(1),
    clock_rate_ppm: 10_000,
};

/// What the epoch layer says, set field by field per test.
#[derive(Clone, Debug)]
struct Script {
    me: NodeId,
    epoch: u64,
    incarnation: u64,
    timing: Timing,
    members: Vec<NodeId>,
    /// Home of every key not in `homes`.
    home: Option<NodeId>,
    homes: HashMap<Vec<u8>, NodeId>,
    /// `home_active` for keys homed at `me`.
    active: bool,
    lease: bool,
    /// Home of every key under the previous epoch.
    previous: Option<NodeId>,
}

impl Script {
    fn new(me: NodeId) -> Script {
        Script {
            me,
            epoch: 1,
            incarnation: 1,
            timing: TIMING,
            members: vec![H, A, B, C, N],
            home: Some(me),
            homes: HashMap::new(),
            active: true,
            lease: true,
            previous: None,
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
        self.members.contains(&node)
    }
    fn home_of(&self, key: &[u8]) -> Option<NodeId> {
        self.homes.get(key).copied().or(self.home)
    }
    fn home_active(&self, _now: Instant, key: &[u8]) -> bool {
        self.active && self.lease && self.home_of(key) == Some(self.me)
    }
    fn holds_lease(&self, _now: Instant) -> bool {
        self.lease
    }
    fn previous_home_of(&self, _key: &[u8]) -> Option<NodeId> {
        self.previous
    }
    fn activation_passed(&self, _now: Instant) -> bool {
        self.active
    }
}

// ---- helpers ----

/// Milliseconds after the test's origin, well past the restart quarantine of a home started at 0.
fn at(ms: u64) -> Instant {
    Instant::from_nanos((10_000 + ms) * 1_000_000)
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// The lease a grant at `now` carries for a request for `lease` (clamped) received at
/// `received`: credited with its wait in line (rule 2).
fn credited(lease: Duration, received: Instant, now: Instant) -> Duration {
    lease + shrink(now.saturating_duration_since(received), TIMING.clock_rate_ppm)
}

/// The home's conservative end of a lease granted at `t`.
fn end_of(t: Instant, lease: Duration) -> Instant {
    t + rate_margin(lease, TIMING.clock_rate_ppm)
}

/// The configuration of a home that never grants ahead: the rules tested with it are those of a
/// Recall without a successor, as a home with passes also follows them whenever it grants none.
/// Passes have their own section (`passing_home`).
fn config(id: NodeId) -> HomeConfig {
    HomeConfig { passes: false, ..HomeConfig::new(id) }
}

fn home() -> Home {
    Home::new(config(H), Instant::ZERO)
}

fn passing_home() -> Home {
    Home::new(HomeConfig::new(H), Instant::ZERO)
}

fn request(
    epoch: u64,
    key: &[u8],
    id: u64,
    lease: Duration,
    wait: Duration,
    held: Option<Grantee>,
) -> Message {
    Message { epoch, body: Body::Request { key: key.to_vec(), id: rid(id), lease, wait, held } }
}

/// Request number `seq` of the requesters' (single) run.
fn rid(seq: u64) -> RequestId {
    RequestId::new(1, seq)
}

/// The requesters queued for `key`, oldest first, as `(requester, request number)`.
fn waiters(home: &Home, key: &[u8]) -> Vec<(NodeId, u64)> {
    home.waiters(key).into_iter().map(|(from, id)| (from, id.seq)).collect()
}

/// A request under epoch 1 for a 500 ms lease, waiting up to `wait`.
fn req(key: &[u8], id: u64, wait: Duration) -> Message {
    request(1, key, id, ms(500), wait, None)
}

fn release(epoch: u64, key: &[u8], grantee: Grantee, note: Option<&[u8]>) -> Message {
    release_flagged(epoch, key, grantee, note, false)
}

/// A release that says whether the next grant must be flagged `recovered`.
fn release_flagged(
    epoch: u64,
    key: &[u8],
    grantee: Grantee,
    note: Option<&[u8]>,
    recovered: bool,
) -> Message {
    let note = note.map(<[u8]>::to_vec);
    Message { epoch, body: Body::Release { key: key.to_vec(), grantee, note, recovered, passed: None } }
}

fn drain(home: &mut Home) -> Vec<(NodeId, Body)> {
    std::iter::from_fn(|| home.poll_transmit()).map(|(to, m)| (to, m.body)).collect()
}

/// The one message the home sent, which must be a Grant to `to`: (id, grantee, lease, note,
/// recovered).
fn the_grant(home: &mut Home, to: NodeId) -> (u64, Grantee, Duration, Option<Vec<u8>>, bool) {
    let out = drain(home);
    assert_eq!(out.len(), 1, "{out:?}");
    match out.into_iter().next() {
        Some((dest, Body::Grant { id, grantee, lease, note, recovered, .. })) if dest == to => {
            (id.seq, grantee, lease, note, recovered)
        }
        other => panic!("expected a grant to {to}, got {other:?}"),
    }
}

fn the_refusal(home: &mut Home, to: NodeId) -> (u64, Refusal) {
    let out = drain(home);
    assert_eq!(out.len(), 1, "{out:?}");
    match out.into_iter().next() {
        Some((dest, Body::Refuse { id, reason, .. })) if dest == to => (id.seq, reason),
        other => panic!("expected a refusal to {to}, got {other:?}"),
    }
}

/// Grants `key` to `to` at `t` and returns the grantee.
fn grant(home: &mut Home, auth: &Script, t: Instant, to: NodeId, key: &[u8], id: u64) -> Grantee {
    home.handle_message(t, to, req(key, id, ms(0)), auth);
    the_grant(home, to).1
}

/// Everything the home allocates per key, for "no allocation" checks.
fn footprint(home: &Home, key: &[u8]) -> (usize, usize, usize, usize, Vec<(NodeId, u64)>) {
    (home.tracked_keys(), home.delegations(), home.keys_in_lock_delay(), home.records(), waiters(home, key))
}

// ---- rule 1: refusals, in order, before any allocation ----

#[test]
fn refusals_come_in_order_before_any_allocation() {
    let mut home = home();
    let mut auth = Script::new(H);
    let long = vec![b'k'; Limits::DEFAULT.max_key_len + 1];
    let t = Instant::from_nanos(1_000_000); // inside the restart quarantine too
    let before = footprint(&home, &long);
    let ask = |home: &mut Home, auth: &Script, epoch, from, key: &[u8]| {
        home.handle_message(t, from, request(epoch, key, 7, ms(500), ms(100), None), auth);
        let (id, reason) = the_refusal(home, from);
        assert_eq!(id, 7);
        reason
    };
    // Everything wrong at once: the epoch is reported first, then each next check as the
    // previous one is put right.
    auth.home = Some(N);
    auth.active = false;
    assert_eq!(ask(&mut home, &auth, 0, X, &long), Refusal::StaleEpoch);
    assert_eq!(ask(&mut home, &auth, 2, X, &long), Refusal::StaleEpoch, "a newer epoch is refused too");
    assert_eq!(ask(&mut home, &auth, 1, X, &long), Refusal::NotMember);
    assert_eq!(ask(&mut home, &auth, 1, A, &long), Refusal::KeyTooLong);
    assert_eq!(ask(&mut home, &auth, 1, A, b"k"), Refusal::NotHome);
    auth.home = Some(H);
    assert_eq!(ask(&mut home, &auth, 1, A, b"k"), Refusal::Activating);
    auth.active = true;
    let quarantine = rate_margin(TIMING.max_delegation_lease, TIMING.clock_rate_ppm);
    assert_eq!(ask(&mut home, &auth, 1, A, b"k"), Refusal::Quarantine(quarantine - ms(1)));
    assert_eq!(footprint(&home, &long), before);
    assert_eq!(footprint(&home, b"k"), before);
    assert_eq!(home.poll_timeout(), None, "no timer either");
}

#[test]
fn restart_quarantine_lasts_the_widened_delegation_lease() {
    let started = Instant::from_nanos(5_000_000_000);
    let mut home = Home::new(config(H), started);
    let auth = Script::new(H);
    let end = started + rate_margin(TIMING.max_delegation_lease, TIMING.clock_rate_ppm);
    assert_eq!(home.quarantine_end(&TIMING), end);
    let before_end = end - Duration::from_nanos(1);
    home.handle_message(before_end, A, req(b"k", 1, ms(10)), &auth);
    assert_eq!(the_refusal(&mut home, A), (1, Refusal::Quarantine(Duration::from_nanos(1))));
    assert_eq!(home.tracked_keys(), 0);
    home.handle_message(end, A, req(b"k", 2, ms(10)), &auth);
    assert_eq!(the_grant(&mut home, A).0, 2);
}

#[test]
fn home_full_refuses_before_allocating() {
    let mut config = config(H);
    config.limits.max_delegations = 2;
    let mut home = Home::new(config, Instant::ZERO);
    let auth = Script::new(H);
    grant(&mut home, &auth, at(0), A, b"a", 1);
    grant(&mut home, &auth, at(0), B, b"b", 1);
    let before = footprint(&home, b"c");
    home.handle_message(at(1), C, req(b"c", 1, ms(100)), &auth);
    assert_eq!(the_refusal(&mut home, C), (1, Refusal::HomeFull));
    assert_eq!(footprint(&home, b"c"), before);
    // A held key still queues: queuing creates no delegation.
    home.handle_message(at(1), C, req(b"a", 2, ms(100)), &auth);
    assert!(matches!(drain(&mut home)[..], [(A, Body::Recall { .. })]));
    assert_eq!(waiters(&home, b"a"), vec![(C, 2)]);
}

#[test]
fn requester_full_refuses_before_allocating() {
    let mut config = config(H);
    config.limits.max_per_requester = 1;
    let mut home = Home::new(config, Instant::ZERO);
    let auth = Script::new(H);
    grant(&mut home, &auth, at(0), A, b"a", 1);
    grant(&mut home, &auth, at(0), B, b"b", 1);
    for key in [&b"c"[..], b"b"] {
        let before = footprint(&home, key);
        home.handle_message(at(1), A, req(key, 9, ms(100)), &auth);
        assert_eq!(the_refusal(&mut home, A), (9, Refusal::RequesterFull), "{key:?}");
        assert_eq!(footprint(&home, key), before);
    }
    assert_eq!(home.delegations_of(A), 1);
}

#[test]
fn queue_full_refuses_before_allocating() {
    let mut config = config(H);
    config.limits.max_waiters_per_key = 2;
    let mut home = Home::new(config, Instant::ZERO);
    let auth = Script::new(H);
    grant(&mut home, &auth, at(0), A, b"k", 1);
    home.handle_message(at(1), B, req(b"k", 1, ms(100)), &auth);
    home.handle_message(at(1), C, req(b"k", 1, ms(100)), &auth);
    drain(&mut home);
    let before = footprint(&home, b"k");
    home.handle_message(at(1), N, req(b"k", 1, ms(100)), &auth);
    assert_eq!(the_refusal(&mut home, N), (1, Refusal::QueueFull));
    assert_eq!(footprint(&home, b"k"), before);
}

#[test]
fn lease_is_clamped_to_the_epochs_longest_delegation() {
    let mut home = home();
    let auth = Script::new(H);
    home.handle_message(at(0), A, request(1, b"k", 1, Duration::from_secs(60), ms(0), None), &auth);
    let (_, _, lease, _, _) = the_grant(&mut home, A);
    assert_eq!(lease, TIMING.max_delegation_lease);
    assert_eq!(home.delegation(b"k").unwrap().end, end_of(at(0), TIMING.max_delegation_lease));
}

/// A request queued while the epoch allowed 1 s delegations, granted after a timing change cut
/// them to 100 ms: the grant (and a renewal) gets what the epoch it is granted under allows.
#[test]
fn a_queued_request_granted_after_a_timing_change_gets_the_new_bound() {
    let mut home = home();
    let mut auth = Script::new(H);
    let g = grant(&mut home, &auth, at(0), A, b"k", 1);
    home.handle_message(at(1), B, request(1, b"k", 10, ms(800), ms(900), None), &auth);
    drain(&mut home);
    let shorter = ms(100);
    auth.epoch = 2;
    auth.timing.max_delegation_lease = shorter;
    home.on_epoch_change(at(2), &auth);
    home.handle_message(at(3), A, release(2, b"k", g, None), &auth);
    let out = drain(&mut home);
    let (grantee, lease) = match &out[..] {
        [(B, Body::Grant { id: RequestId { seq: 10, .. }, grantee, lease, .. })] => (*grantee, *lease),
        other => panic!("{other:?}"),
    };
    assert_eq!(lease, credited(shorter, at(1), at(3)), "the new bound, and the wait in line");
    assert_eq!(home.delegation(b"k").unwrap().end, end_of(at(3), shorter));
    home.handle_message(at(4), B, request(2, b"k", 11, ms(800), ms(0), Some(grantee)), &auth);
    assert_eq!(the_grant(&mut home, B).2, shorter, "a renewal is clamped too");
    assert_eq!(home.delegation(b"k").unwrap().end, end_of(at(4), shorter));
}

// ---- rule 2: one live delegation, grantees, conservative end ----

#[test]
fn one_live_delegation_per_key_with_the_conservative_end() {
    let mut home = home();
    let mut auth = Script::new(H);
    auth.incarnation = 7;
    let g1 = grant(&mut home, &auth, at(0), A, b"k", 1);
    assert_eq!(g1, Grantee { epoch: 1, incarnation: 7, counter: 1 });
    assert_eq!(
        home.delegation(b"k"),
        Some(Delegation { holder: A, grantee: g1, end: end_of(at(0), ms(500)) })
    );
    assert!(end_of(at(0), ms(500)) > at(500), "the home's view outlasts the lease");
    // A second requester is queued, not granted.
    home.handle_message(at(1), B, req(b"k", 1, ms(900)), &auth);
    let out = drain(&mut home);
    assert!(out.iter().all(|(_, b)| !matches!(b, Body::Grant { .. })), "{out:?}");
    assert_eq!(home.delegations(), 1);
    assert_eq!(home.delegation(b"k").unwrap().holder, A);
    // Another key is independent and takes the next counter.
    let g2 = grant(&mut home, &auth, at(2), B, b"other", 1);
    assert_eq!(g2.counter, 2);
}

#[test]
fn first_grant_of_an_unknown_key_is_recovered() {
    let mut home = home();
    let auth = Script::new(H);
    home.handle_message(at(0), A, req(b"k", 1, ms(0)), &auth);
    let (_, _, _, note, recovered) = the_grant(&mut home, A);
    assert_eq!((note, recovered), (None, true), "the home cannot vouch for a key it has no record of");
}

// ---- rule 3: queue, recall, renewal, expiry of waits ----

#[test]
fn waiters_are_served_in_order_and_deduplicated() {
    let mut home = home();
    let auth = Script::new(H);
    let g = grant(&mut home, &auth, at(0), A, b"k", 1);
    home.handle_message(at(1), B, req(b"k", 10, ms(900)), &auth);
    home.handle_message(at(2), C, req(b"k", 20, ms(900)), &auth);
    home.handle_message(at(3), B, req(b"k", 10, ms(900)), &auth); // a duplicate
    home.handle_message(at(4), N, req(b"k", 30, ms(900)), &auth);
    drain(&mut home);
    assert_eq!(waiters(&home, b"k"), vec![(B, 10), (C, 20), (N, 30)]);
    home.handle_message(at(5), A, release(1, b"k", g, None), &auth);
    let out = drain(&mut home);
    let g_b = match &out[..] {
        [(B, Body::Grant { id: RequestId { seq: 10, .. }, grantee, .. }), (B, Body::Recall { .. })] => {
            *grantee
        }
        other => panic!("{other:?}"),
    };
    home.handle_message(at(6), B, release(1, b"k", g_b, None), &auth);
    assert!(matches!(
        drain(&mut home)[..],
        [(C, Body::Grant { id: RequestId { seq: 20, .. }, .. }), (C, Body::Recall { .. })]
    ));
    assert_eq!(waiters(&home, b"k"), vec![(N, 30)]);
}

/// A grant to a request that waited in line is credited with the wait (rule 2), the end counted
/// as for an uncredited grant; a resend of the request answered while that Grant may be on its
/// way gets the credit again (rule 5), or it could overtake the Grant and come spent.
#[test]
fn a_grant_after_a_wait_in_line_is_credited_and_so_is_its_resend() {
    let mut home = home();
    let auth = Script::new(H);
    let g = grant(&mut home, &auth, at(0), A, b"k", 1);
    home.handle_message(at(1), B, req(b"k", 10, ms(900)), &auth);
    drain(&mut home);
    // (A's Recall is due again at the release too.)
    home.handle_message(at(401), A, release(1, b"k", g, None), &auth);
    let lease = match &drain(&mut home)[..] {
        [(A, Body::Recall { .. }), (B, Body::Grant { id: RequestId { seq: 10, .. }, lease, .. })] => *lease,
        other => panic!("{other:?}"),
    };
    assert_eq!(lease, credited(ms(500), at(1), at(401)));
    let end = end_of(at(401), ms(500));
    assert_eq!(home.delegation(b"k").unwrap().end, end);
    home.handle_message(at(402), B, req(b"k", 10, ms(900)), &auth);
    let (id, _, again, _, recovered) = the_grant(&mut home, B);
    // What is left, and the credit (392.08 ms) in whole 16 ms units: 384 ms.
    let left = shrink(end.saturating_duration_since(at(402)), TIMING.clock_rate_ppm);
    assert_eq!((id, again, recovered), (10, left + ms(384), true));
    assert!(again <= lease);
}

#[test]
fn recall_is_sent_once_then_again_after_the_period() {
    let mut home = home();
    let auth = Script::new(H);
    let period = retry_period(&TIMING);
    assert_eq!(period, ms(25));
    let g = grant(&mut home, &auth, at(0), A, b"k", 1);
    home.handle_message(at(1), B, req(b"k", 1, ms(900)), &auth);
    assert_eq!(drain(&mut home), vec![(A, Body::Recall { key: b"k".to_vec(), grantee: g, next: None })]);
    home.handle_message(at(2), C, req(b"k", 1, ms(900)), &auth);
    assert_eq!(drain(&mut home), vec![], "one recall per period, not one per waiter");
    let resend = at(1) + period;
    assert_eq!(home.poll_timeout(), Some(resend));
    home.handle_timeout(resend - Duration::from_nanos(1), &auth);
    assert_eq!(drain(&mut home), vec![]);
    home.handle_timeout(resend, &auth);
    assert_eq!(drain(&mut home), vec![(A, Body::Recall { key: b"k".to_vec(), grantee: g, next: None })]);
    assert_eq!(home.poll_timeout(), Some(resend + period));
}

#[test]
fn no_recall_when_nobody_waits() {
    let mut home = home();
    let auth = Script::new(H);
    grant(&mut home, &auth, at(0), A, b"k", 1);
    home.handle_message(at(1), B, req(b"k", 1, ms(0)), &auth);
    assert_eq!(the_refusal(&mut home, B), (1, Refusal::WaitExpired), "a try-lock neither waits nor recalls");
    home.handle_timeout(at(400), &auth);
    assert_eq!(drain(&mut home), vec![]);
}

#[test]
fn a_request_waits_at_most_the_longest_wait_the_home_allows() {
    let mut config = config(H);
    config.limits.max_request_wait = ms(100);
    let mut home = Home::new(config, Instant::ZERO);
    let auth = Script::new(H);
    grant(&mut home, &auth, at(0), A, b"k", 1);
    home.handle_message(at(1), B, req(b"k", 1, Duration::from_secs(864_000)), &auth);
    drain(&mut home);
    home.handle_timeout(at(100), &auth);
    assert!(drain(&mut home).iter().all(|(_, b)| !matches!(b, Body::Refuse { .. })));
    home.handle_timeout(at(101), &auth);
    let refused = Body::Refuse { key: b"k".to_vec(), id: rid(1), reason: Refusal::WaitExpired };
    assert!(drain(&mut home).contains(&(B, refused)), "a ten-day wait is cut to 100 ms");
    assert_eq!(waiters(&home, b"k"), vec![]);
}

#[test]
fn expired_waiters_are_refused_and_dropped() {
    let mut home = home();
    let auth = Script::new(H);
    grant(&mut home, &auth, at(0), A, b"k", 1);
    home.handle_message(at(1), B, req(b"k", 1, ms(50)), &auth);
    home.handle_message(at(1), C, req(b"k", 2, ms(300)), &auth);
    drain(&mut home);
    home.handle_timeout(at(50), &auth);
    assert!(drain(&mut home).iter().all(|(_, b)| !matches!(b, Body::Refuse { .. })));
    home.handle_timeout(at(51), &auth);
    let out = drain(&mut home);
    assert!(
        out.contains(&(B, Body::Refuse { key: b"k".to_vec(), id: rid(1), reason: Refusal::WaitExpired }))
    );
    assert_eq!(waiters(&home, b"k"), vec![(C, 2)]);
}

#[test]
fn renewal_extends_and_keeps_the_grantee() {
    let mut home = home();
    let auth = Script::new(H);
    let g = grant(&mut home, &auth, at(0), A, b"k", 1);
    home.handle_message(at(300), A, request(1, b"k", 2, ms(500), ms(0), Some(g)), &auth);
    assert_eq!(the_grant(&mut home, A), (2, g, ms(500), None, false));
    assert_eq!(home.delegation(b"k").unwrap().end, end_of(at(300), ms(500)));
    // A shorter renewal never shortens the home's view.
    home.handle_message(at(301), A, request(1, b"k", 3, ms(10), ms(0), Some(g)), &auth);
    the_grant(&mut home, A);
    assert_eq!(home.delegation(b"k").unwrap().end, end_of(at(300), ms(500)));
    assert_eq!(home.delegations(), 1);
    // Someone else naming A's grantee is no renewal.
    home.handle_message(at(302), B, request(1, b"k", 1, ms(500), ms(100), Some(g)), &auth);
    assert!(matches!(drain(&mut home)[..], [(A, Body::Recall { .. })]));
}

#[test]
fn renewal_is_refused_while_others_wait() {
    let mut home = home();
    let auth = Script::new(H);
    let g = grant(&mut home, &auth, at(0), A, b"k", 1);
    home.handle_message(at(1), B, req(b"k", 1, ms(900)), &auth);
    drain(&mut home);
    home.handle_message(at(300), A, request(1, b"k", 2, ms(500), ms(0), Some(g)), &auth);
    let out = drain(&mut home);
    let refused = (A, Body::Refuse { key: b"k".to_vec(), id: rid(2), reason: Refusal::Recalled });
    assert!(out.contains(&refused), "{out:?}");
    assert!(out.iter().all(|m| *m == refused || matches!(m, (A, Body::Recall { .. }))), "{out:?}");
    assert_eq!(home.delegation(b"k").unwrap().end, end_of(at(0), ms(500)), "not extended");
}

#[test]
fn a_lost_grant_is_sent_again_within_the_homes_view() {
    let mut home = home();
    let auth = Script::new(H);
    let g = grant(&mut home, &auth, at(0), A, b"k", 1);
    home.handle_message(at(100), A, req(b"k", 1, ms(0)), &auth); // the same request again
    let (id, grantee, lease, note, recovered) = the_grant(&mut home, A);
    assert_eq!((id, grantee, note, recovered), (1, g, None, true));
    // Counted from any instant up to now, the lease ends within the home's view.
    assert!(at(100) + rate_margin(lease, TIMING.clock_rate_ppm) <= end_of(at(0), ms(500)));
    assert!(lease > ms(390));
    assert_eq!(home.delegations(), 1);
    assert_eq!(waiters(&home, b"k"), vec![]);
}

// ---- rule 4: release ----

#[test]
fn release_with_note_hands_it_to_the_next_grant() {
    let mut home = home();
    let auth = Script::new(H);
    let g = grant(&mut home, &auth, at(0), A, b"k", 1);
    home.handle_message(at(10), A, release(1, b"k", g, Some(b"pos=42")), &auth);
    assert_eq!(drain(&mut home), vec![]);
    assert_eq!(home.delegations(), 0);
    assert_eq!(home.status(b"k"), KeyStatus::Free { recovered: false, note_len: Some(6) });
    home.handle_message(at(20), B, req(b"k", 1, ms(0)), &auth);
    let (_, g2, _, note, recovered) = the_grant(&mut home, B);
    assert_eq!((note.as_deref(), recovered), (Some(&b"pos=42"[..]), false));
    assert!(g2 > g);
    // Straight to a waiter too, and a clean release without a note is not `recovered`.
    home.handle_message(at(30), C, req(b"k", 1, ms(500)), &auth);
    drain(&mut home);
    home.handle_message(at(40), B, release(1, b"k", g2, None), &auth);
    let (_, _, _, note, recovered) = the_grant(&mut home, C);
    assert_eq!((note, recovered), (None, false));
}

/// Defects (a), (c), (d): a release flagged `recovered` (a handed-back `recovered` grant, a
/// renewal handed back after an expiry, a `recovered` delegation released unused) makes the next
/// grant `recovered`, with the release's note, whether it is recorded or goes to a waiter.
#[test]
fn a_release_flagged_recovered_flags_the_next_grant() {
    let mut home = home();
    let auth = Script::new(H);
    let g = grant(&mut home, &auth, at(0), A, b"k", 1);
    home.handle_message(at(10), A, release_flagged(1, b"k", g, Some(b"pos=1"), true), &auth);
    assert_eq!(drain(&mut home), vec![]);
    assert_eq!(home.delegations(), 0);
    assert_eq!(home.status(b"k"), KeyStatus::Free { recovered: true, note_len: Some(5) });
    home.handle_message(at(20), B, req(b"k", 1, ms(0)), &auth);
    let (_, g2, _, note, recovered) = the_grant(&mut home, B);
    assert_eq!((note.as_deref(), recovered), (Some(&b"pos=1"[..]), true));
    // Straight to a waiter too.
    home.handle_message(at(30), C, req(b"k", 1, ms(500)), &auth);
    drain(&mut home);
    home.handle_message(at(40), B, release_flagged(1, b"k", g2, None, true), &auth);
    let (_, g3, _, note, recovered) = the_grant(&mut home, C);
    assert_eq!((note, recovered), (None, true));
    // And a clean one after it is clean again.
    home.handle_message(at(50), C, release(1, b"k", g3, Some(b"pos=2")), &auth);
    assert_eq!(home.status(b"k"), KeyStatus::Free { recovered: false, note_len: Some(5) });
}

#[test]
fn oversized_note_frees_the_key_but_the_next_grant_is_recovered() {
    let mut home = home();
    let auth = Script::new(H);
    let g = grant(&mut home, &auth, at(0), A, b"k", 1);
    let big = vec![0; Limits::DEFAULT.max_note_len + 1];
    home.handle_message(at(10), A, release(1, b"k", g, Some(&big)), &auth);
    assert_eq!(home.delegations(), 0);
    home.handle_message(at(20), B, req(b"k", 1, ms(0)), &auth);
    let (_, _, _, note, recovered) = the_grant(&mut home, B);
    assert_eq!((note, recovered), (None, true));
}

#[test]
fn a_release_that_does_not_match_is_ignored() {
    let mut home = home();
    let auth = Script::new(H);
    let g = grant(&mut home, &auth, at(0), A, b"k", 1);
    let other = Grantee { counter: g.counter + 1, ..g };
    home.handle_message(at(10), A, release(1, b"k", other, None), &auth);
    home.handle_message(at(10), B, release(1, b"k", g, None), &auth); // not the holder
    home.handle_message(at(10), A, release(1, b"unknown", g, None), &auth);
    assert_eq!(drain(&mut home), vec![]);
    assert_eq!(home.delegation(b"k").map(|d| d.grantee), Some(g));
    // A release under another epoch still counts: it only gives back what the holder holds.
    home.handle_message(at(11), A, release(7, b"k", g, None), &auth);
    assert_eq!(home.delegations(), 0);
}

#[test]
fn released_records_are_kept_for_the_retention_then_forgotten() {
    let mut config = config(H);
    config.record_retention = Duration::from_secs(60);
    let mut home = Home::new(config, Instant::ZERO);
    let auth = Script::new(H);
    let g = grant(&mut home, &auth, at(0), A, b"k", 1);
    home.handle_message(at(10), A, release(1, b"k", g, Some(b"n")), &auth);
    assert_eq!(home.records(), 1);
    let forget = at(10) + Duration::from_secs(60);
    home.handle_timeout(forget - Duration::from_nanos(1), &auth);
    assert_eq!(home.records(), 1);
    home.handle_timeout(forget, &auth);
    assert_eq!((home.records(), home.tracked_keys()), (0, 0));
    assert_eq!(home.status(b"k"), KeyStatus::Free { recovered: true, note_len: None });
}

#[test]
fn record_caps_drop_the_record_and_flag_the_next_grant() {
    let mut config = config(H);
    config.max_records = 1;
    let mut home = Home::new(config, Instant::ZERO);
    let auth = Script::new(H);
    let g1 = grant(&mut home, &auth, at(0), A, b"a", 1);
    let g2 = grant(&mut home, &auth, at(0), A, b"b", 2);
    home.handle_message(at(1), A, release(1, b"a", g1, Some(b"1")), &auth);
    home.handle_message(at(1), A, release(1, b"b", g2, Some(b"2")), &auth);
    assert_eq!(home.records(), 1);
    home.handle_message(at(2), B, req(b"b", 1, ms(0)), &auth);
    assert!(the_grant(&mut home, B).4);
    home.handle_message(at(2), B, req(b"a", 2, ms(0)), &auth);
    assert_eq!(the_grant(&mut home, B).3.as_deref(), Some(&b"1"[..]));
}

// ---- rule 5: expiry and lock-delay ----

#[test]
fn expiry_never_comes_before_the_conservative_end() {
    let mut home = home();
    let auth = Script::new(H);
    grant(&mut home, &auth, at(0), A, b"k", 1);
    home.handle_message(at(1), B, req(b"k", 1, Duration::from_secs(5)), &auth);
    drain(&mut home);
    let end = end_of(at(0), ms(500));
    assert_eq!(end, at(0) + Duration::from_nanos(510_101_011), "500 ms widened by 1 % both ways");
    // Every wake-up before the end leaves the delegation alone (Recalls aside).
    while let Some(t) = home.poll_timeout().filter(|&t| t < end) {
        home.handle_timeout(t, &auth);
        assert!(drain(&mut home).iter().all(|(_, b)| matches!(b, Body::Recall { .. })));
    }
    home.handle_timeout(end - Duration::from_nanos(1), &auth);
    assert_eq!(home.delegation(b"k").map(|d| d.holder), Some(A));
    // A message at end − 1 ns does not end it either.
    home.handle_message(end - Duration::from_nanos(1), C, req(b"k", 1, ms(0)), &auth);
    assert_eq!(the_refusal(&mut home, C).1, Refusal::WaitExpired);
    assert_eq!(home.delegation(b"k").map(|d| d.holder), Some(A));
    home.handle_timeout(end, &auth);
    let (id, _, _, note, recovered) = the_grant(&mut home, B);
    assert_eq!((id, note, recovered), (1, None, true));
}

#[test]
fn an_expired_key_without_waiters_is_forgotten_and_recovered() {
    let mut home = home();
    let auth = Script::new(H);
    let g = grant(&mut home, &auth, at(0), A, b"k", 1);
    home.handle_timeout(end_of(at(0), ms(500)), &auth);
    assert_eq!((home.delegations(), home.tracked_keys()), (0, 0));
    home.handle_message(at(600), A, release(1, b"k", g, Some(b"late")), &auth);
    home.handle_message(at(601), B, req(b"k", 1, ms(0)), &auth);
    let (_, _, _, note, recovered) = the_grant(&mut home, B);
    assert_eq!((note, recovered), (None, true), "a release after the end changes nothing");
}

#[test]
fn lock_delay_is_its_own_state_and_is_respected() {
    let mut config = config(H);
    config.lock_delay = ms(200);
    let mut home = Home::new(config, Instant::ZERO);
    let auth = Script::new(H);
    grant(&mut home, &auth, at(0), A, b"k", 1);
    home.handle_message(at(1), B, req(b"k", 1, Duration::from_secs(2)), &auth);
    home.handle_message(at(2), C, req(b"k", 2, ms(600)), &auth); // ends before the delay does
    drain(&mut home);
    let end = end_of(at(0), ms(500));
    let until = end + ms(200);
    home.handle_timeout(end, &auth);
    let refused_c = Body::Refuse { key: b"k".to_vec(), id: rid(2), reason: Refusal::LockDelay(ms(200)) };
    assert_eq!(drain(&mut home), vec![(C, refused_c)]);
    assert_eq!(home.status(b"k"), KeyStatus::LockDelay { until });
    assert_eq!(home.lock_delay_until(b"k"), Some(until));
    assert_eq!(home.lock_delayed().collect::<Vec<_>>(), vec![(&b"k"[..], until)]);
    assert_eq!((home.keys_in_lock_delay(), home.delegations()), (1, 0));
    assert_eq!(waiters(&home, b"k"), vec![(B, 1)]);
    // New requests: refused with the time left if their wait cannot cover it, else queued.
    home.handle_message(end + ms(50), N, req(b"k", 3, ms(100)), &auth);
    assert_eq!(the_refusal(&mut home, N), (3, Refusal::LockDelay(ms(150))));
    home.handle_message(end + ms(50), A, req(b"k", 4, ms(500)), &auth);
    assert_eq!(drain(&mut home), vec![]);
    assert_eq!(waiters(&home, b"k"), vec![(B, 1), (A, 4)]);
    home.handle_timeout(until - Duration::from_nanos(1), &auth);
    assert_eq!(drain(&mut home), vec![]);
    home.handle_timeout(until, &auth);
    let out = drain(&mut home);
    assert!(matches!(
        &out[..],
        [
            (B, Body::Grant { id: RequestId { seq: 1, .. }, recovered: true, note: None, .. }),
            (B, Body::Recall { .. })
        ]
    ));
    assert_eq!(home.keys_in_lock_delay(), 0);
    assert_eq!(home.lock_delayed().count(), 0);
    // For metrics: A's grant and B's (a handoff: B queued behind A), each recalled once however
    // often the Recall was resent; A's expiry, which put the key into lock-delay.
    let counters =
        HomeCounters { grants: 2, handoffs: 1, recalls: 2, expiries: 1, lock_delays: 1, passes: 0 };
    assert_eq!(home.counters(), counters);
}

#[test]
fn lock_delay_without_waiters_then_the_key_is_free() {
    let mut config = config(H);
    config.lock_delay = ms(200);
    let mut home = Home::new(config, Instant::ZERO);
    let auth = Script::new(H);
    grant(&mut home, &auth, at(0), A, b"k", 1);
    let until = end_of(at(0), ms(500)) + ms(200);
    home.handle_timeout(end_of(at(0), ms(500)), &auth);
    home.handle_message(until - Duration::from_nanos(1), B, req(b"k", 1, ms(0)), &auth);
    assert_eq!(the_refusal(&mut home, B), (1, Refusal::LockDelay(Duration::from_nanos(1))));
    home.handle_timeout(until, &auth);
    assert_eq!(home.status(b"k"), KeyStatus::Free { recovered: true, note_len: None });
    home.handle_message(until, B, req(b"k", 2, ms(0)), &auth);
    assert!(the_grant(&mut home, B).4);
}

// ---- rule 6: check ----

/// Sends check 5 about `key`'s `token` from `X` (anyone may ask) at `t`; returns what the home sent.
fn check(home: &mut Home, auth: &Script, t: Instant, key: &[u8], token: FencingToken) -> Vec<(NodeId, Body)> {
    home.handle_message(
        t,
        X,
        Message { epoch: 1, body: Body::Check { key: key.to_vec(), id: 5, token } },
        auth,
    );
    drain(home)
}

/// The home's own answer to check 5: exactly one reply, to the asker.
fn answer(
    home: &mut Home,
    auth: &Script,
    t: Instant,
    key: &[u8],
    token: FencingToken,
) -> Result<CheckAnswer, Refusal> {
    match &check(home, auth, t, key, token)[..] {
        [(X, Body::CheckReply { key: k, id: 5, answer })] if k == key => *answer,
        other => panic!("expected the home's answer to X, got {other:?}"),
    }
}

/// The probe the home forwards to `holder` instead of answering check 5.
fn probed(home: &mut Home, auth: &Script, t: Instant, key: &[u8], token: FencingToken) -> NodeId {
    match &check(home, auth, t, key, token)[..] {
        [(to, Body::Probe { key: k, id: 5, token: tk, asker: X })] if k == key && *tk == token => *to,
        other => panic!("expected a probe for X, got {other:?}"),
    }
}

#[test]
fn a_check_of_the_live_delegation_is_forwarded_to_its_holder() {
    let mut home = home();
    let auth = Script::new(H);
    let g = grant(&mut home, &auth, at(0), A, b"k", 1);
    // Every admission under the live delegation: only the holder knows its local re-locks.
    for seq in [0, 1, 17] {
        assert_eq!(probed(&mut home, &auth, at(1), b"k", g.token(seq)), A);
    }
    // The home keeps nothing for it: its answer goes from the holder to the asker.
    assert_eq!(home.tracked_keys(), 1);
    // A holder that never answers: once its delegation ends the home answers by itself.
    let end = end_of(at(0), ms(500));
    assert_eq!(probed(&mut home, &auth, end - Duration::from_nanos(1), b"k", g.token(0)), A);
    assert_eq!(answer(&mut home, &auth, end, b"k", g.token(0)), Ok(CheckAnswer::NotHeld), "expired");
    assert_eq!(answer(&mut home, &auth, end, b"k", g.token(0)), Ok(CheckAnswer::UnknownKey), "and forgotten");
}

#[test]
fn the_home_answers_superseded_not_held_and_unknown_by_itself() {
    let mut home = home();
    let mut config = config(H);
    config.lock_delay = ms(100);
    let mut delayed = Home::new(config, Instant::ZERO);
    let auth = Script::new(H);
    assert_eq!(
        answer(&mut home, &auth, at(0), b"k", Grantee { epoch: 1, incarnation: 1, counter: 1 }.token(0)),
        Ok(CheckAnswer::UnknownKey)
    );
    let g = grant(&mut home, &auth, at(0), A, b"k", 1);
    let earlier = [
        Grantee { counter: g.counter - 1, ..g },
        Grantee { incarnation: g.incarnation - 1, counter: 99, ..g },
        Grantee { epoch: g.epoch - 1, incarnation: 99, counter: 99 },
    ];
    for e in earlier {
        assert_eq!(answer(&mut home, &auth, at(1), b"k", e.token(9)), Ok(CheckAnswer::Superseded), "{e:?}");
    }
    let later = Grantee { counter: g.counter + 1, ..g };
    assert_eq!(
        answer(&mut home, &auth, at(1), b"k", later.token(0)),
        Ok(CheckAnswer::NotHeld),
        "never issued"
    );
    assert_eq!(answer(&mut home, &auth, at(1), b"other", g.token(0)), Ok(CheckAnswer::UnknownKey));
    // Released cleanly: the record names the delegation (the local admissions under it are not
    // known), which supersedes every earlier one.
    home.handle_message(at(2), A, release(1, b"k", g, None), &auth);
    assert_eq!(answer(&mut home, &auth, at(3), b"k", g.token(0)), Ok(CheckAnswer::NotHeld));
    assert_eq!(answer(&mut home, &auth, at(3), b"k", earlier[0].token(0)), Ok(CheckAnswer::Superseded));
    // A later delegation supersedes every token of the earlier one.
    let g2 = grant(&mut home, &auth, at(4), B, b"k", 2);
    assert_eq!(answer(&mut home, &auth, at(5), b"k", g.token(40)), Ok(CheckAnswer::Superseded));
    assert_eq!(probed(&mut home, &auth, at(5), b"k", g2.token(0)), B);
    // In lock-delay nothing is delegated.
    let d = grant(&mut delayed, &auth, at(0), A, b"k", 1);
    let end = end_of(at(0), ms(500));
    assert_eq!(answer(&mut delayed, &auth, end, b"k", d.token(0)), Ok(CheckAnswer::NotHeld));
    let before_d = Grantee { counter: d.counter - 1, ..d };
    assert_eq!(answer(&mut delayed, &auth, end, b"k", before_d.token(0)), Ok(CheckAnswer::Superseded));
    assert_eq!(delayed.status(b"k"), KeyStatus::LockDelay { until: end + ms(100) });
}

#[test]
fn a_check_the_home_cannot_answer_is_refused_in_the_reply() {
    let mut home = home();
    let mut auth = Script::new(H);
    let g = grant(&mut home, &auth, at(0), A, b"k", 1);
    // A token of an epoch this home has not learned: another home's grant.
    let newer = Grantee { epoch: 2, incarnation: 1, counter: 1 };
    assert_eq!(answer(&mut home, &auth, at(1), b"k", newer.token(0)), Err(Refusal::StaleEpoch));
    let long = vec![b'k'; Limits::DEFAULT.max_key_len + 1];
    assert_eq!(answer(&mut home, &auth, at(1), &long, g.token(0)), Err(Refusal::KeyTooLong));
    auth.home = Some(N);
    assert_eq!(answer(&mut home, &auth, at(1), b"k", g.token(0)), Err(Refusal::NotHome));
    // A restarted home in its quarantine has forgotten its delegations.
    let mut restarted = Home::new(config(H), at(2));
    let auth = Script::new(H);
    let left = restarted.quarantine_end(&TIMING).saturating_duration_since(at(3));
    assert_eq!(answer(&mut restarted, &auth, at(3), b"k", g.token(0)), Err(Refusal::Quarantine(left)));
}

#[test]
fn a_token_from_before_a_handoff_is_judged_by_the_new_home() {
    let (mut new, mut auth, g) = adopting();
    drain(&mut new);
    // The adopted delegation's holder answers for its tokens; older ones are superseded.
    assert_eq!(probed(&mut new, &auth, at(11), b"k", g.token(3)), A);
    let older = Grantee { counter: 8, ..g };
    assert_eq!(answer(&mut new, &auth, at(11), b"k", older.token(0)), Ok(CheckAnswer::Superseded));
    // Released and granted again under epoch 2: every epoch-1 token is superseded.
    new.handle_message(at(12), A, release(2, b"k", g, None), &auth);
    new.handle_message(at(13), B, request(2, b"k", 2, ms(500), ms(0), None), &auth);
    let g2 = the_grant(&mut new, B).1;
    assert!(g2 > g);
    assert_eq!(answer(&mut new, &auth, at(14), b"k", g.token(3)), Ok(CheckAnswer::Superseded));
    // A new home with no record of the key (no handover) answers only once active, then
    // `UnknownKey`: every earlier delegation has ended by then.
    let mut fresh = Home::new(config(N), Instant::ZERO);
    assert_eq!(answer(&mut fresh, &auth, at(11), b"k", g.token(3)), Err(Refusal::Activating));
    auth.active = true;
    assert_eq!(answer(&mut fresh, &auth, at(11), b"k", g.token(3)), Ok(CheckAnswer::UnknownKey));
}

// ---- rule 7: epoch changes and handovers ----

#[test]
fn a_key_that_keeps_its_home_keeps_everything() {
    let mut home = home();
    let mut auth = Script::new(H);
    let g = grant(&mut home, &auth, at(0), A, b"k", 1);
    home.handle_message(at(1), B, req(b"k", 1, ms(900)), &auth);
    drain(&mut home);
    auth.epoch = 2;
    home.on_epoch_change(at(2), &auth);
    assert_eq!(drain(&mut home), vec![]);
    assert_eq!(home.delegation(b"k").map(|d| d.grantee), Some(g));
    assert_eq!(waiters(&home, b"k"), vec![(B, 1)]);
    // A release under the new epoch grants the waiter, with the note, under the new epoch.
    home.handle_message(at(3), A, release(2, b"k", g, Some(b"n")), &auth);
    let out = drain(&mut home);
    match &out[..] {
        [(B, Body::Grant { grantee, note: Some(n), recovered: false, .. })] => {
            assert_eq!((grantee.epoch, n.as_slice()), (2, &b"n"[..]));
            assert!(*grantee > g);
        }
        other => panic!("{other:?}"),
    }
}

/// The old home's side: stop, hand over, resend, forget on the ack.
#[test]
fn a_moved_key_is_handed_over_and_forgotten_on_the_ack() {
    let mut home = home();
    let mut auth = Script::new(H);
    let g = grant(&mut home, &auth, at(0), A, b"k", 1);
    home.handle_message(at(1), B, req(b"k", 1, ms(900)), &auth);
    drain(&mut home);
    auth.epoch = 2;
    auth.home = Some(N);
    home.on_epoch_change(at(100), &auth);
    let end = end_of(at(0), ms(500));
    let handover = |remaining| Body::Handover {
        key: b"k".to_vec(),
        live: Some(Handed { holder: A, grantee: g, id: rid(1), remaining, ahead: Vec::new() }),
        note: None,
        recovered: false,
        lock_delay: Duration::ZERO,
    };
    let out = drain(&mut home);
    assert_eq!(
        out,
        vec![
            (B, Body::Refuse { key: b"k".to_vec(), id: rid(1), reason: Refusal::NotHome }),
            (N, handover(end.saturating_duration_since(at(100)))),
        ]
    );
    assert_eq!(home.handing_over(b"k"), Some(N));
    // New requests: NotHome, and the delegation stays tracked.
    home.handle_message(at(101), C, request(2, b"k", 1, ms(500), ms(900), None), &auth);
    assert_eq!(the_refusal(&mut home, C), (1, Refusal::NotHome));
    assert_eq!(home.delegations(), 1);
    // Resent after the period until acknowledged.
    let period = retry_period(&TIMING);
    home.handle_timeout(at(100) + period, &auth);
    assert_eq!(drain(&mut home), vec![(N, handover(end.saturating_duration_since(at(100) + period)))]);
    // The holder releases to the old home before the ack: the next Handover says so.
    home.handle_message(at(129), A, release(1, b"k", g, Some(b"n")), &auth);
    assert_eq!(home.delegations(), 0);
    home.handle_timeout(at(100) + period * 2, &auth);
    let freed = Body::Handover {
        key: b"k".to_vec(),
        live: None,
        note: Some(b"n".to_vec()),
        recovered: false,
        lock_delay: Duration::ZERO,
    };
    assert_eq!(drain(&mut home), vec![(N, freed)]);
    // An ack from someone else, or under another epoch, does not count.
    let ack = |epoch| Message { epoch, body: Body::HandoverAck { key: b"k".to_vec() } };
    home.handle_message(at(151), C, ack(2), &auth);
    home.handle_message(at(151), N, ack(3), &auth);
    assert_eq!((home.tracked_keys(), home.handing_over(b"k")), (1, Some(N)));
    home.handle_message(at(152), N, ack(2), &auth);
    assert_eq!((home.delegations(), home.tracked_keys(), home.handing_over(b"k")), (0, 0, None));
    let mut t = at(152);
    while let Some(next) = home.poll_timeout() {
        t = next;
        home.handle_timeout(t, &auth);
    }
    assert!(t < at(1000));
    assert_eq!(drain(&mut home), vec![], "nothing more once acknowledged");
}

#[test]
fn an_unacknowledged_handover_keeps_the_delegation_until_its_end_then_gives_up() {
    let mut home = home();
    let mut auth = Script::new(H);
    let g = grant(&mut home, &auth, at(0), A, b"k", 1);
    auth.epoch = 2;
    auth.home = Some(N);
    home.on_epoch_change(at(100), &auth);
    let end = end_of(at(0), ms(500));
    let mut sends_after_end = 0;
    while let Some(t) = home.poll_timeout() {
        home.handle_timeout(t, &auth);
        if t < end {
            assert_eq!(home.delegation(b"k").map(|d| d.grantee), Some(g), "never forgotten early");
        }
        for (to, body) in drain(&mut home) {
            assert_eq!(to, N);
            let Body::Handover { live, recovered, .. } = body else { panic!("{body:?}") };
            if t >= end {
                assert_eq!((live, recovered), (None, true), "expired: the next grant is recovered");
                sends_after_end += 1;
            }
        }
    }
    assert_eq!(sends_after_end, HANDOVER_SENDS);
    assert_eq!(home.tracked_keys(), 0);
}

/// The new home's side: adopt, re-grant right after the handed delegation is released.
#[test]
fn the_new_home_adopts_and_regrants_right_after_the_release() {
    let mut new = Home::new(config(N), Instant::ZERO);
    let mut auth = Script::new(N);
    auth.epoch = 2;
    auth.active = false; // the activation wait is still running
    auth.previous = Some(H);
    let g = Grantee { epoch: 1, incarnation: 3, counter: 9 };
    let handed = Handed { holder: A, grantee: g, id: rid(1), remaining: ms(400), ahead: Vec::new() };
    let handover = |epoch| Message {
        epoch,
        body: Body::Handover {
            key: b"k".to_vec(),
            live: Some(handed.clone()),
            note: None,
            recovered: false,
            lock_delay: Duration::ZERO,
        },
    };
    // Before adoption, the key waits for the activation.
    new.handle_message(at(0), B, request(2, b"k", 1, ms(500), ms(900), None), &auth);
    assert_eq!(the_refusal(&mut new, B), (1, Refusal::Activating));
    new.handle_message(at(10), H, handover(2), &auth);
    assert_eq!(drain(&mut new), vec![(H, Body::HandoverAck { key: b"k".to_vec() })]);
    assert!(new.is_adopted(b"k"));
    assert_eq!(
        new.delegation(b"k"),
        Some(Delegation { holder: A, grantee: g, end: at(10) + rate_margin(ms(400), TIMING.clock_rate_ppm) })
    );
    // A duplicate handover is acknowledged again and changes nothing.
    new.handle_message(at(11), H, handover(2), &auth);
    assert_eq!(drain(&mut new), vec![(H, Body::HandoverAck { key: b"k".to_vec() })]);
    // A waiter queues and the holder is recalled, though `home_active` is still false.
    new.handle_message(at(20), B, request(2, b"k", 2, ms(500), ms(900), None), &auth);
    assert_eq!(drain(&mut new), vec![(A, Body::Recall { key: b"k".to_vec(), grantee: g, next: None })]);
    // The holder renews? Others wait: refused. It releases: the waiter gets the key at once.
    new.handle_message(at(30), A, release(2, b"k", g, Some(b"n")), &auth);
    let (id, g2, _, note, recovered) = the_grant(&mut new, B);
    assert_eq!((id, note.as_deref(), recovered), (2, Some(&b"n"[..]), false));
    assert_eq!((g2.epoch, g2.counter), (2, 1));
    assert!(g2 > g);
    // Without its home lease, even an adopted key is not granted.
    new.handle_message(at(40), B, release(2, b"k", g2, None), &auth);
    auth.lease = false;
    new.handle_message(at(41), C, request(2, b"k", 1, ms(500), ms(900), None), &auth);
    assert_eq!(the_refusal(&mut new, C), (1, Refusal::Activating));
}

/// A new home (`N`, epoch 2, activation wait still running) that adopted at `at(10)` the live
/// delegation of `b"k"` held by `A`, with 400 ms left, from the previous home `H`.
fn adopting() -> (Home, Script, Grantee) {
    let mut new = Home::new(config(N), Instant::ZERO);
    let mut auth = Script::new(N);
    auth.epoch = 2;
    auth.active = false;
    auth.previous = Some(H);
    let g = Grantee { epoch: 1, incarnation: 3, counter: 9 };
    let body = Body::Handover {
        key: b"k".to_vec(),
        live: Some(Handed { holder: A, grantee: g, id: rid(1), remaining: ms(400), ahead: Vec::new() }),
        note: None,
        recovered: false,
        lock_delay: Duration::ZERO,
    };
    new.handle_message(at(10), H, Message { epoch: 2, body }, &auth);
    (new, auth, g)
}

#[test]
fn an_adopted_delegation_is_kept_to_its_widened_end() {
    let (mut new, auth, g) = adopting();
    new.handle_message(at(20), B, request(2, b"k", 2, ms(500), Duration::from_secs(2), None), &auth);
    drain(&mut new);
    let end = at(10) + rate_margin(ms(400), TIMING.clock_rate_ppm);
    assert!(end > at(10) + ms(400));
    new.handle_timeout(end - Duration::from_nanos(1), &auth);
    assert!(drain(&mut new).iter().all(|(_, b)| !matches!(b, Body::Grant { .. })));
    assert_eq!(new.delegation(b"k").map(|d| d.grantee), Some(g));
    new.handle_timeout(end, &auth);
    let (id, g2, _, note, recovered) = the_grant(&mut new, B);
    assert_eq!((id, note, recovered, g2.epoch), (2, None, true, 2));
}

#[test]
fn handed_durations_beyond_what_the_epoch_and_config_allow_are_not_taken_at_face_value() {
    let mut auth = Script::new(N);
    auth.epoch = 2;
    auth.active = false;
    auth.previous = Some(H);
    let handover = |key: &[u8], live, lock_delay| Message {
        epoch: 2,
        body: Body::Handover { key: key.to_vec(), live, note: None, recovered: true, lock_delay },
    };
    let mut config = config(N);
    config.lock_delay = ms(300);
    let mut new = Home::new(config, Instant::ZERO);
    // A delegation said to outlive every grant the epoch's timing allows: acknowledged but not
    // adopted, so the key waits for the activation (which outlasts every earlier delegation)
    // instead of staying held forever.
    let g = Grantee { epoch: 1, incarnation: 3, counter: 9 };
    for remaining in [TIMING.fence_bound() + Duration::from_nanos(1), Duration::MAX] {
        let live = Some(Handed { holder: A, grantee: g, id: rid(1), remaining, ahead: Vec::new() });
        new.handle_message(at(0), H, handover(b"k", live, Duration::ZERO), &auth);
        assert_eq!(drain(&mut new), vec![(H, Body::HandoverAck { key: b"k".to_vec() })]);
        assert_eq!((new.tracked_keys(), new.delegation(b"k")), (0, None));
    }
    // Up to the bound, adopted.
    let live = Some(Handed {
        holder: A,
        grantee: g,
        id: rid(1),
        remaining: TIMING.fence_bound(),
        ahead: Vec::new(),
    });
    new.handle_message(at(0), H, handover(b"k", live, Duration::ZERO), &auth);
    assert!(new.is_adopted(b"k"));
    // A lock-delay is cut to this home's own.
    new.handle_message(at(0), H, handover(b"d", None, Duration::MAX), &auth);
    assert_eq!(new.lock_delay_until(b"d"), Some(at(0) + ms(300)));
}

#[test]
fn a_handover_is_adopted_only_from_the_previous_home_under_the_same_epoch() {
    let handover = |epoch| Message {
        epoch,
        body: Body::Handover {
            key: b"k".to_vec(),
            live: None,
            note: Some(b"n".to_vec()),
            recovered: false,
            lock_delay: Duration::ZERO,
        },
    };
    let mut auth = Script::new(N);
    auth.epoch = 2;
    auth.active = false;
    auth.previous = Some(H);
    // From a node that was not the key's home: acknowledged (harmless) but not adopted.
    let mut new = Home::new(config(N), Instant::ZERO);
    new.handle_message(at(0), C, handover(2), &auth);
    assert_eq!(drain(&mut new), vec![(C, Body::HandoverAck { key: b"k".to_vec() })]);
    assert!(!new.is_adopted(b"k"));
    // Under another epoch: neither.
    for epoch in [1, 3] {
        new.handle_message(at(0), H, handover(epoch), &auth);
        assert_eq!(drain(&mut new), vec![]);
        assert_eq!(new.tracked_keys(), 0);
    }
    // Not this node's key under its epoch.
    auth.home = Some(B);
    new.handle_message(at(0), H, handover(2), &auth);
    assert!(!new.is_adopted(b"k"));
    // An epoch layer that cannot name the previous home (the default): never adopted.
    auth.home = Some(N);
    auth.previous = None;
    new.handle_message(at(0), H, handover(2), &auth);
    assert!(!new.is_adopted(b"k"));
    drain(&mut new);
    new.handle_message(at(1), B, request(2, b"k", 1, ms(500), ms(0), None), &auth);
    assert_eq!(the_refusal(&mut new, B), (1, Refusal::Activating));
    // The right one: the key is free at once, with the handed note.
    auth.previous = Some(H);
    new.handle_message(at(2), H, handover(2), &auth);
    drain(&mut new);
    new.handle_message(at(3), B, request(2, b"k", 2, ms(500), ms(0), None), &auth);
    let (_, _, _, note, recovered) = the_grant(&mut new, B);
    assert_eq!((note.as_deref(), recovered), (Some(&b"n"[..]), false));
}

/// A handover that arrives once the activation wait is over is stale even when the home has lost
/// its lease meanwhile (found by the lock simulation, seed 18952 on 2026-12-06): the home was
/// active, granted the key, saw the delegation expire and dropped the record (it said no more
/// than "no record"); adopting the old home's clean note then would tell the next holder
/// `recovered: false` after an expiry.
#[test]
fn a_handover_after_the_activation_is_not_adopted_without_a_lease_either() {
    let mut auth = Script::new(N);
    auth.epoch = 2;
    auth.previous = Some(H);
    let mut new = Home::new(config(N), Instant::ZERO);
    // Active (activation over, lease held): grants the key, whose delegation then expires.
    new.handle_message(at(0), A, request(2, b"k", 1, ms(500), ms(0), None), &auth);
    let (_, g, lease, _, _) = the_grant(&mut new, A);
    assert_eq!(g.epoch, 2);
    let end = end_of(at(0), lease);
    new.handle_timeout(end, &auth);
    drain(&mut new);
    assert_eq!(new.tracked_keys(), 0, "an expired key's record says no more than no record");
    // The lease runs out; the old home's handover, late, arrives.
    auth.lease = false;
    let body = Body::Handover {
        key: b"k".to_vec(),
        live: None,
        note: Some(b"old".to_vec()),
        recovered: false,
        lock_delay: Duration::ZERO,
    };
    new.handle_message(end + ms(1), H, Message { epoch: 2, body }, &auth);
    assert_eq!(drain(&mut new), vec![(H, Body::HandoverAck { key: b"k".to_vec() })]);
    assert!(!new.is_adopted(b"k"));
    // With the lease back, the next holder is told the handoff may be incomplete.
    auth.lease = true;
    new.handle_message(end + ms(2), B, request(2, b"k", 1, ms(500), ms(0), None), &auth);
    let (_, _, _, note, recovered) = the_grant(&mut new, B);
    assert_eq!((note, recovered), (None, true));
}

#[test]
fn after_a_skipped_epoch_nothing_is_handed_over_and_notes_are_dropped() {
    let mut home = home();
    let mut auth = Script::new(H);
    let g1 = grant(&mut home, &auth, at(0), A, b"moves", 1);
    let g2 = grant(&mut home, &auth, at(0), A, b"stays", 2);
    home.handle_message(at(1), A, release(1, b"stays", g2, Some(b"n")), &auth);
    auth.epoch = 3; // epoch 2 was never seen: someone else may have homed both keys in it
    auth.homes.insert(b"moves".to_vec(), N);
    home.on_epoch_change(at(2), &auth);
    assert_eq!(drain(&mut home), vec![], "no handover");
    assert_eq!(home.delegation(b"moves").map(|d| d.grantee), Some(g1), "still tracked");
    assert_eq!(home.status(b"stays"), KeyStatus::Free { recovered: true, note_len: None });
    // The key that stayed needs `home_active` again before it is granted.
    auth.active = false;
    home.handle_message(at(3), B, request(3, b"stays", 1, ms(500), ms(0), None), &auth);
    assert_eq!(the_refusal(&mut home, B), (1, Refusal::Activating));
    auth.active = true;
    home.handle_message(at(4), B, request(3, b"stays", 2, ms(500), ms(0), None), &auth);
    assert!(the_grant(&mut home, B).4);
    // The moved key's delegation is dropped at its end.
    home.handle_timeout(end_of(at(0), ms(500)), &auth);
    assert_eq!(home.delegation(b"moves"), None);
    assert_eq!(home.tracked_keys(), 1);
}

// ---- rule 7b: an epoch change is walked a step at a time ----

/// A home that looks at `step` slots per step of an epoch walk.
fn walking_home(me: NodeId, step: u32) -> Home {
    let mut config = config(me);
    config.walk_step = step;
    Home::new(config, Instant::ZERO)
}

/// The keys of the Handovers among `out`, all of which must go to `to`.
fn handed_keys(out: &[(NodeId, Body)], to: NodeId) -> Vec<Vec<u8>> {
    (out.iter())
        .filter_map(|(dest, body)| match body {
            Body::Handover { key, .. } => {
                assert_eq!(*dest, to, "{body:?}");
                Some(key.clone())
            }
            _ => None,
        })
        .collect()
}

/// A home walking 2 slots per step whose five delegations (`k0` to `k4`, held by `A`) all moved
/// to `N` by epoch 2, learned at `at(100)`; the first step taken, its messages not drained.
fn five_keys_moved() -> (Home, Script, Vec<Vec<u8>>) {
    let mut home = walking_home(H, 2);
    let mut auth = Script::new(H);
    let keys: Vec<Vec<u8>> = (0..5).map(|i| format!("k{i}").into_bytes()).collect();
    for (i, key) in keys.iter().enumerate() {
        grant(&mut home, &auth, at(0), A, key, i as u64 + 1);
    }
    auth.epoch = 2;
    auth.home = Some(N);
    home.on_epoch_change(at(100), &auth);
    (home, auth, keys)
}

#[test]
fn an_epoch_change_is_walked_a_step_at_a_time_and_stays_due_until_done() {
    let (mut home, auth, keys) = five_keys_moved();
    let mut handed = handed_keys(&drain(&mut home), N);
    assert_eq!(handed, keys[..2], "the first step at once, in slot order");
    for (calls, upto) in [(1, 4), (2, 5)] {
        assert!(home.walking());
        assert_eq!(home.poll_timeout(), Some(at(100)), "due from the change on");
        assert!(home.poll_timer().is_some_and(|t| t > at(100 + calls - 1)), "no timer is due");
        home.handle_timeout(at(100 + calls), &auth);
        handed.extend(handed_keys(&drain(&mut home), N));
        assert_eq!(handed, keys[..upto], "one more step per call");
    }
    assert!(!home.walking());
    assert!(home.poll_timeout().is_some_and(|t| t > at(102)), "done: nothing due");
}

#[test]
fn a_key_a_message_names_is_brought_up_to_date_before_the_walk_reaches_it() {
    let mut home = walking_home(H, 1);
    let mut auth = Script::new(H);
    for (i, key) in [&b"k0"[..], b"k1", b"k2"].into_iter().enumerate() {
        grant(&mut home, &auth, at(0), A, key, i as u64 + 1);
    }
    home.handle_message(at(1), B, req(b"k2", 7, ms(900)), &auth);
    drain(&mut home);
    auth.epoch = 2;
    auth.home = Some(N);
    home.on_epoch_change(at(100), &auth);
    assert_eq!(handed_keys(&drain(&mut home), N), [b"k0".to_vec()]);
    assert_eq!(home.handing_over(b"k2"), None, "not reached yet");
    // A release of the last key: the key is moved first (its waiter refused, its handover sent),
    // then the release counts, and the walk later passes it without a second handover.
    let g2 = Grantee { epoch: 1, incarnation: 1, counter: 3 };
    home.handle_message(at(101), A, release(1, b"k2", g2, Some(b"n")), &auth);
    let out = drain(&mut home);
    assert!(out.contains(&(B, Body::Refuse { key: b"k2".to_vec(), id: rid(7), reason: Refusal::NotHome })));
    assert_eq!(handed_keys(&out, N), [b"k2".to_vec()]);
    assert_eq!((home.handing_over(b"k2"), home.delegation(b"k2")), (Some(N), None));
    home.handle_timeout(at(102), &auth);
    home.handle_timeout(at(103), &auth);
    assert_eq!(handed_keys(&drain(&mut home), N), [b"k1".to_vec()]);
    assert!(!home.walking());
}

#[test]
fn handover_resends_are_paced_and_stay_due_until_sent() {
    let (mut home, auth, keys) = five_keys_moved();
    while home.walking() {
        home.handle_timeout(at(100), &auth);
    }
    assert_eq!(handed_keys(&drain(&mut home), N), keys, "each sent once by the walk");
    let resend = at(100) + retry_period(&TIMING);
    assert_eq!(home.poll_timeout(), Some(resend));
    assert!(home.poll_timer().is_some_and(|t| t > resend), "resends are not timer-heap wake-ups");
    let mut resent = Vec::new();
    for upto in [2, 4, 5] {
        assert!(home.poll_timeout().is_some_and(|t| t <= resend), "still due");
        home.handle_timeout(resend, &auth);
        resent.extend(handed_keys(&drain(&mut home), N));
        assert_eq!(resent, keys[..upto], "at most a step's worth per call");
    }
    assert!(home.poll_timeout().is_some_and(|t| t > resend), "all resent: nothing due");
}

/// Epoch 2: `N` adopted `a`, `b` and `k` from `H` and their holder released them. Epoch 3 keeps
/// every home, but its walk (a slot per step) has reached only `a` when epoch 4 comes. So `k`
/// (and `b`) missed epoch 3 as far as their records go: someone else may have granted them then.
/// Under epoch 4, inside its activation wait, `a` is granted on the lease (adopted, up to date),
/// but `k` is refused until `home_active`.
#[test]
fn a_key_the_walk_had_not_reached_when_the_next_epoch_came_is_not_trusted() {
    let mut new = walking_home(N, 1);
    let mut auth = Script::new(N);
    auth.epoch = 2;
    auth.active = false;
    auth.previous = Some(H);
    for (i, key) in [&b"a"[..], b"b", b"k"].into_iter().enumerate() {
        let g = Grantee { epoch: 1, incarnation: 3, counter: i as u64 + 1 };
        let body = Body::Handover {
            key: key.to_vec(),
            live: Some(Handed { holder: A, grantee: g, id: rid(1), remaining: ms(400), ahead: Vec::new() }),
            note: None,
            recovered: false,
            lock_delay: Duration::ZERO,
        };
        new.handle_message(at(10), H, Message { epoch: 2, body }, &auth);
        new.handle_message(at(20), A, release(2, key, g, None), &auth);
        assert!(new.is_adopted(key));
    }
    drain(&mut new);
    auth.epoch = 3;
    new.on_epoch_change(at(30), &auth);
    auth.epoch = 4;
    new.on_epoch_change(at(40), &auth);
    new.handle_message(at(41), B, request(4, b"a", 1, ms(500), ms(0), None), &auth);
    let (id, grantee, _, _, _) = the_grant(&mut new, B);
    assert_eq!((id, grantee.epoch), (1, 4), "up to date and adopted: granted on the lease");
    new.handle_message(at(42), B, request(4, b"k", 2, ms(500), ms(0), None), &auth);
    assert_eq!(the_refusal(&mut new, B), (2, Refusal::Activating), "missed an epoch: waits");
    assert!(!new.is_adopted(b"k"));
    auth.active = true;
    new.handle_message(at(43), B, request(4, b"k", 3, ms(500), ms(0), None), &auth);
    assert!(the_grant(&mut new, B).4, "granted behind home_active, recovered");
}

// ---- rule 8: grantees strictly increase ----

#[test]
fn grantees_increase_across_grants_runs_and_epochs() {
    let mut auth = Script::new(H);
    let mut seen = Vec::new();
    let mut home = home();
    for i in 0..3 {
        let g = grant(&mut home, &auth, at(i * 10), A, b"k", i);
        home.handle_message(at(i * 10 + 1), A, release(1, b"k", g, None), &auth);
        seen.push(g);
    }
    // The home restarts: the counter starts over, the incarnation grows.
    auth.incarnation = 2;
    let start = at(100);
    let mut home = Home::new(config(H), start);
    let after_quarantine = home.quarantine_end(&TIMING);
    seen.push(grant(&mut home, &auth, after_quarantine, A, b"k", 10));
    // The epoch changes with the key staying here.
    auth.epoch = 2;
    home.on_epoch_change(after_quarantine + ms(1), &auth);
    home.handle_message(after_quarantine + ms(2), A, release(2, b"k", *seen.last().unwrap(), None), &auth);
    home.handle_message(after_quarantine + ms(3), A, request(2, b"k", 11, ms(500), ms(0), None), &auth);
    seen.push(the_grant(&mut home, A).1);
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
    assert_eq!(seen[3], Grantee { epoch: 1, incarnation: 2, counter: 1 });
    assert_eq!(seen[4], Grantee { epoch: 2, incarnation: 2, counter: 2 });
}

// ---- timers ----

#[test]
fn no_timer_spin_over_a_long_scripted_run() {
    let mut config = config(H);
    config.lock_delay = ms(30);
    config.record_retention = ms(700);
    let mut home = Home::new(config, Instant::ZERO);
    let mut auth = Script::new(H);
    let nodes = [A, B, C, N];
    let mut t = at(0);
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut grants: HashMap<Vec<u8>, (NodeId, Grantee)> = HashMap::new();
    let mut wakeups = 0;
    for step in 0..5_000u64 {
        // Some traffic...
        let r = next();
        let key = vec![b'a' + (r % 5) as u8];
        let from = nodes[(r >> 8) as usize % nodes.len()];
        match (r >> 16) % 4 {
            0 | 1 => {
                let wait = ms((r >> 24) % 400);
                let lease = ms(1 + (r >> 32) % 300);
                home.handle_message(t, from, request(auth.epoch, &key, step, lease, wait, None), &auth);
            }
            2 => {
                if let Some((holder, g)) = grants.get(&key) {
                    home.handle_message(t, *holder, release(auth.epoch, &key, *g, None), &auth);
                }
            }
            _ => {
                if step % 1000 == 999 {
                    auth.epoch += 1;
                    auth.previous = Some(H);
                    home.on_epoch_change(t, &auth);
                }
            }
        }
        for (to, body) in drain(&mut home) {
            if let Body::Grant { key, grantee, .. } = body {
                grants.insert(key, (to, grantee));
            }
        }
        // ...then every timer due before the next message, each strictly later than the last.
        let until = t + ms((next() % 50) + 1);
        let mut last = None;
        while let Some(w) = home.poll_timeout().filter(|&w| w <= until) {
            assert!(last.is_none_or(|l| w > l), "timer did not advance: {w:?} after {last:?}");
            let w = w.max(t);
            home.handle_timeout(w, &auth);
            assert!(home.poll_timeout().is_none_or(|n| n > w), "spin at {w:?}");
            last = Some(w);
            wakeups += 1;
            assert!(wakeups < 200_000);
            for (to, body) in drain(&mut home) {
                if let Body::Grant { key, grantee, .. } = body {
                    grants.insert(key, (to, grantee));
                }
            }
        }
        t = until;
    }
    // Quiet: everything ends.
    while let Some(w) = home.poll_timeout() {
        assert!(w >= t);
        t = w;
        home.handle_timeout(t, &auth);
        assert!(home.poll_timeout().is_none_or(|n| n > t));
        drain(&mut home);
    }
    assert_eq!((home.delegations(), home.tracked_keys(), home.keys_in_lock_delay()), (0, 0, 0));
    assert!(wakeups > 1000, "the run exercised the timers: {wakeups}");
}

// ---- memory ----

/// Heap bytes per live delegation (16-byte keys, nobody waiting), counting every allocation, at
/// every count from 16 Ki to 140 000. That range holds a doubling of the index (at 114 689 keys)
/// and of the timer heap (at 131 073): each costs the same fraction of a delegation's bytes at
/// every size, so the worst point here is the worst point at a million too (the slab, which grows
/// by fixed chunks, only gets closer to its size).
#[test]
fn memory_per_live_delegation() {
    const FROM: usize = 1 << 14;
    const COUNT: usize = 140_000;
    const KEY_LEN: usize = 16;
    let auth = Script::new(H);
    let mut home = home();
    // Warm the output queue, so its (reused) buffer is not counted.
    grant(&mut home, &auth, at(0), A, b"warm-up", u64::MAX);
    let before = allocated();
    let holders = [A, B, C, N];
    // (bytes per delegation, count) at the worst count seen.
    let mut worst = (0.0, 0);
    for i in 0..COUNT {
        let key = format!("{i:0KEY_LEN$}");
        home.handle_message(at(1), holders[i % 4], req(key.as_bytes(), i as u64, ms(0)), &auth);
        while home.poll_transmit().is_some() {}
        let n = i + 1;
        if n >= FROM {
            let per = (allocated() - before) as f64 / n as f64;
            if per > worst.0 {
                worst = (per, n);
            }
        }
    }
    let measured = (allocated() - before) as usize / COUNT;
    let estimate = home.memory_estimate() / (COUNT + 1);
    assert_eq!(home.delegations(), COUNT + 1);
    eprintln!(
        "per delegation: {measured} bytes measured at {COUNT}, {estimate} estimated; worst {:.1} bytes at {}; slot {} bytes, key {KEY_LEN} bytes",
        worst.0,
        worst.1,
        Home::ENTRY_BYTES
    );
    const { assert!(Home::ENTRY_BYTES <= 104) };
    assert!(worst.0 <= 200.0, "{:.1} bytes per delegation at {}", worst.0, worst.1);
    assert!(measured.abs_diff(estimate) <= 4, "estimate {estimate} vs measured {measured}");
}

// ---- passes: the first waiter granted ahead in the Recall ----

/// A Release of `grantee` that says it passed `passed` on.
fn release_passing(key: &[u8], grantee: Grantee, note: Option<&[u8]>, passed: Option<Grantee>) -> Message {
    let note = note.map(<[u8]>::to_vec);
    Message { epoch: 1, body: Body::Release { key: key.to_vec(), grantee, note, recovered: false, passed } }
}

/// The `Grant` a home sends by itself, for request `id`, to a successor granted ahead whose
/// handoff it cannot vouch for: the successor's 500 ms lease credited with its wait since
/// `received` up to `now`, no note, `recovered`.
fn recovered_grant(id: u64, grantee: Grantee, received: Instant, now: Instant) -> Body {
    let lease = credited(ms(500), received, now);
    Body::Grant { key: b"k".to_vec(), id: rid(id), grantee, lease, note: None, recovered: true }
}

/// `A` holds `k` (granted at 0); `B` queues at 1 ms and is granted ahead in the Recall to `A`.
/// Returns A's grantee and B's successor.
fn granted_ahead(home: &mut Home, auth: &Script) -> (Grantee, Successor) {
    let g = grant(home, auth, at(0), A, b"k", 1);
    home.handle_message(at(1), B, req(b"k", 10, ms(900)), auth);
    let next = match &drain(home)[..] {
        [(A, Body::Recall { grantee, next: Some(next), .. })] if *grantee == g => *next,
        other => panic!("expected a Recall to A carrying a successor, got {other:?}"),
    };
    assert_eq!((next.to, next.id, next.lease), (B, rid(10), ms(500)));
    assert!(next.grantee > g, "a later grant of the key has a larger grantee");
    assert_eq!(waiters(home, b"k"), vec![], "the successor no longer waits");
    assert_eq!(home.counters().passes, 1);
    (g, next)
}

#[test]
fn a_passed_delegation_moves_to_its_successor_without_a_grant() {
    let mut home = passing_home();
    let auth = Script::new(H);
    let (g, next) = granted_ahead(&mut home, &auth);
    // A resend of B's request is neither queued again nor answered (A answers it), but B still
    // waits: its lease is credited with the wait so far, and A told so at once (rule 12).
    home.handle_message(at(2), B, req(b"k", 10, ms(900)), &auth);
    let credited_next = Successor { lease: credited(ms(500), at(1), at(2)), ..next };
    assert_eq!(
        drain(&mut home),
        vec![(A, Body::Recall { key: b"k".to_vec(), grantee: g, next: Some(credited_next) })]
    );
    home.handle_message(at(3), A, release_passing(b"k", g, Some(b"n"), Some(next.grantee)), &auth);
    assert_eq!(drain(&mut home), vec![], "A passed it: nothing for the home to send");
    let d = home.delegation(b"k").expect("live");
    assert_eq!((d.holder, d.grantee), (B, next.grantee));
    assert_eq!(d.end, end_of(at(2), ms(500)), "its lease counts from its last credit");
    // The next waiter is granted ahead in a Recall to B at once.
    home.handle_message(at(4), C, req(b"k", 20, ms(900)), &auth);
    assert!(matches!(&drain(&mut home)[..], [(B, Body::Recall { next: Some(Successor { to: C, .. }), .. })]));
}

#[test]
fn a_release_that_passed_nothing_is_granted_on_by_the_home() {
    let mut home = passing_home();
    let auth = Script::new(H);
    let (g, next) = granted_ahead(&mut home, &auth);
    // Released before the Recall arrived (or by a holder that did not pass it): the home sends
    // the successor its grant, with the release's note.
    home.handle_message(at(3), A, release_passing(b"k", g, Some(b"n"), None), &auth);
    let (id, grantee, lease, note, recovered) = the_grant(&mut home, B);
    assert_eq!((id, grantee, lease), (10, next.grantee, credited(ms(500), at(1), at(3))));
    assert_eq!((note.as_deref(), recovered), (Some(&b"n"[..]), false));
}

#[test]
fn an_expired_holder_leaves_its_successor_live() {
    let mut home = passing_home();
    let auth = Script::new(H);
    let (g, next) = granted_ahead(&mut home, &auth);
    home.handle_message(at(2), C, req(b"k", 20, ms(2_000)), &auth);
    drain(&mut home);
    // A's Release (and maybe its Pass) is lost; at A's end the home cannot tell whether B holds
    // the key, so B holds it, granted `recovered` now (its wait credited), to the end counted
    // from now.
    let a_end = end_of(at(0), ms(500));
    home.handle_timeout(a_end, &auth);
    let out = drain(&mut home);
    assert!(out.contains(&(B, recovered_grant(10, next.grantee, at(1), a_end))), "{out:?}");
    assert!(out.iter().all(|(to, _)| *to != C), "C is not granted while B may hold the key: {out:?}");
    let d = home.delegation(b"k").expect("live");
    assert_eq!((d.holder, d.grantee, d.end), (B, next.grantee, end_of(a_end, ms(500))));
    // A's late release changes nothing.
    home.handle_message(a_end, A, release_passing(b"k", g, None, Some(next.grantee)), &auth);
    assert_eq!(home.delegation(b"k").map(|d| d.holder), Some(B));
}

#[test]
fn a_successor_that_releases_first_frees_the_key() {
    let mut home = passing_home();
    let auth = Script::new(H);
    let (g, next) = granted_ahead(&mut home, &auth);
    home.handle_message(at(2), C, req(b"k", 20, ms(900)), &auth);
    drain(&mut home);
    // B was passed the key and gave it back before A's release reached the home.
    home.handle_message(at(5), B, release_passing(b"k", next.grantee, Some(b"b"), None), &auth);
    let (id, _, _, note, _) = the_grant(&mut home, C);
    assert_eq!((id, note.as_deref()), (20, Some(&b"b"[..])));
    home.handle_message(at(6), A, release_passing(b"k", g, None, Some(next.grantee)), &auth);
    assert_eq!(home.delegation(b"k").map(|d| d.holder), Some(C), "A's late release is stale");
}

#[test]
fn a_check_of_the_successors_token_asks_the_successor() {
    let mut home = passing_home();
    let auth = Script::new(H);
    let (g, next) = granted_ahead(&mut home, &auth);
    assert!(matches!(
        &check(&mut home, &auth, at(2), b"k", next.grantee.token(0))[..],
        [(B, Body::Probe { .. })]
    ));
    assert!(matches!(&check(&mut home, &auth, at(2), b"k", g.token(0))[..], [(A, Body::Probe { .. })]));
}

#[test]
fn no_pass_under_lock_delay_nor_to_the_holder_itself() {
    let config = HomeConfig { lock_delay: ms(100), ..HomeConfig::new(H) };
    let mut home = Home::new(config, Instant::ZERO);
    let auth = Script::new(H);
    grant(&mut home, &auth, at(0), A, b"k", 1);
    home.handle_message(at(1), B, req(b"k", 10, ms(900)), &auth);
    assert!(matches!(&drain(&mut home)[..], [(A, Body::Recall { next: None, .. })]));
    let mut home = passing_home();
    grant(&mut home, &auth, at(0), A, b"k", 1);
    home.handle_message(at(1), A, req(b"k", 2, ms(900)), &auth);
    assert!(matches!(&drain(&mut home)[..], [(A, Body::Recall { next: None, .. })]));
}

/// Found by the lock simulation (seed 5087 of `--seeds 20000` with successors chained, one
/// granted a shorter lease after a timing change): a successor dropped at its own end while the
/// holder before it is still live may have been passed the key, admitted and let its handle run
/// out. The holder's release naming it must not hand the holder's own note on as if the handoff
/// were clean.
#[test]
fn a_release_passing_to_a_successor_past_its_end_flags_the_next_grant() {
    let mut home = passing_home();
    let auth = Script::new(H);
    let g = grant(&mut home, &auth, at(0), A, b"k", 1);
    home.handle_message(at(1), B, request(1, b"k", 10, ms(100), ms(900), None), &auth);
    let b = match &drain(&mut home)[..] {
        [(A, Body::Recall { next: Some(b), .. })] => *b,
        other => panic!("expected a Recall to A carrying B, got {other:?}"),
    };
    home.handle_timeout(end_of(at(1), ms(100)), &auth);
    assert_eq!(home.delegation(b"k").map(|d| d.holder), Some(A), "B dropped at its end, A still live");
    home.handle_message(at(200), A, release_passing(b"k", g, Some(b"a"), Some(b.grantee)), &auth);
    home.handle_message(at(201), C, req(b"k", 20, ms(900)), &auth);
    let (id, _, _, note, recovered) = the_grant(&mut home, C);
    assert_eq!((id, note, recovered), (20, None, true), "B may have held the key after A's note");
}

// ---- chains: each waiter granted ahead behind the last, its predecessor recalled at once ----

/// `A` holds `k` and `B` is granted ahead (see `granted_ahead`); `C` queues at 2 ms and is granted
/// ahead behind B at once, and B, which has not been passed the key yet, is recalled naming C.
/// Returns A's grantee and the two successors.
fn chained(home: &mut Home, auth: &Script) -> (Grantee, Successor, Successor) {
    let (g, b) = granted_ahead(home, auth);
    home.handle_message(at(2), C, req(b"k", 20, ms(900)), auth);
    let c = match &drain(home)[..] {
        [(B, Body::Recall { grantee, next: Some(c), .. })] if *grantee == b.grantee => *c,
        other => panic!("expected a Recall to B carrying C, got {other:?}"),
    };
    assert_eq!((c.to, c.id, c.lease), (C, rid(20), ms(500)));
    assert!(c.grantee > b.grantee, "each successor's grantee is above the one before it");
    assert_eq!(home.counters().passes, 2);
    assert_eq!(home.counters().recalls, 2);
    (g, b, c)
}

#[test]
fn the_key_passes_along_the_chain_without_a_message_from_the_home() {
    let mut home = passing_home();
    let auth = Script::new(H);
    let (g, b, c) = chained(&mut home, &auth);
    home.handle_message(at(3), A, release_passing(b"k", g, None, Some(b.grantee)), &auth);
    assert_eq!(drain(&mut home), vec![], "B was recalled already: nothing more to send");
    assert_eq!(home.delegation(b"k").map(|d| (d.holder, d.grantee)), Some((B, b.grantee)));
    // A asks again: granted ahead behind C, and C is recalled naming it.
    home.handle_message(at(4), A, req(b"k", 2, ms(900)), &auth);
    let a2 = match &drain(&mut home)[..] {
        [(C, Body::Recall { grantee, next: Some(a2), .. })] if *grantee == c.grantee => *a2,
        other => panic!("expected a Recall to C carrying A, got {other:?}"),
    };
    assert_eq!((a2.to, a2.id), (A, rid(2)));
    home.handle_message(at(5), B, release_passing(b"k", b.grantee, None, Some(c.grantee)), &auth);
    assert_eq!(drain(&mut home), vec![]);
    assert_eq!(home.delegation(b"k").map(|d| (d.holder, d.grantee)), Some((C, c.grantee)));
    // The Recall period recalls every delegation of the chain again, each naming its successor.
    let retry = TIMING.home_lease / 4;
    home.handle_timeout(at(4) + retry, &auth);
    assert_eq!(
        drain(&mut home),
        vec![(C, Body::Recall { key: b"k".to_vec(), grantee: c.grantee, next: Some(a2) })]
    );
    assert_eq!(home.counters().recalls, 3, "each delegation counted once");
}

#[test]
fn a_release_down_the_chain_ends_every_delegation_before_it() {
    let mut home = passing_home();
    let auth = Script::new(H);
    let (g, b, c) = chained(&mut home, &auth);
    // C was passed the key by B (which A passed it to) and gave it back before A's and B's
    // releases reached the home.
    home.handle_message(at(5), C, release_passing(b"k", c.grantee, Some(b"c"), None), &auth);
    assert_eq!(drain(&mut home), vec![]);
    assert_eq!(home.delegation(b"k"), None, "every delegation of the chain has ended");
    home.handle_message(at(6), A, release_passing(b"k", g, None, Some(b.grantee)), &auth);
    home.handle_message(at(6), B, release_passing(b"k", b.grantee, None, Some(c.grantee)), &auth);
    assert_eq!(drain(&mut home), vec![], "the late releases are stale");
    home.handle_message(at(7), A, req(b"k", 3, ms(900)), &auth);
    let (_, grantee, _, note, recovered) = the_grant(&mut home, A);
    assert_eq!((note.as_deref(), recovered), (Some(&b"c"[..]), false), "C's note goes on");
    assert!(grantee > c.grantee);
}

#[test]
fn a_release_that_passed_nothing_down_the_chain_is_granted_on_by_the_home() {
    let mut home = passing_home();
    let auth = Script::new(H);
    let (g, b, c) = chained(&mut home, &auth);
    home.handle_message(at(3), A, release_passing(b"k", g, None, Some(b.grantee)), &auth);
    // B got the key and gave it back without passing it (its Pass was late for it, say).
    home.handle_message(at(4), B, release_passing(b"k", b.grantee, Some(b"b"), None), &auth);
    let (id, grantee, lease, note, recovered) = the_grant(&mut home, C);
    assert_eq!((id, grantee, lease), (20, c.grantee, credited(ms(500), at(2), at(4))));
    assert_eq!((note.as_deref(), recovered), (Some(&b"b"[..]), false));
}

#[test]
fn an_expired_holder_leaves_the_chain_behind_it_in_place() {
    let mut home = passing_home();
    let auth = Script::new(H);
    let (_, b, c) = chained(&mut home, &auth);
    let a_end = end_of(at(0), ms(500));
    home.handle_timeout(a_end, &auth);
    let out = drain(&mut home);
    assert_eq!(out[0], (B, recovered_grant(10, b.grantee, at(1), a_end)), "B may hold the key");
    assert!(out.iter().all(|(to, _)| *to == B), "C stays ahead of B, told nothing: {out:?}");
    assert!(matches!(
        &check(&mut home, &auth, a_end, b"k", c.grantee.token(0))[..],
        [(C, Body::Probe { .. })]
    ));
    // Past B's own end (counted from its grant at A's end), C (which B may have passed the key
    // to) is granted the key by the home.
    home.handle_timeout(end_of(a_end, ms(500)), &auth);
    let (id, grantee, _, _, recovered) = the_grant(&mut home, C);
    assert_eq!((id, grantee, recovered), (20, c.grantee, true));
}

#[test]
fn a_moved_key_hands_over_its_whole_chain() {
    let mut new = Home::new(HomeConfig::new(N), Instant::ZERO);
    let mut auth = Script::new(N);
    auth.epoch = 2;
    auth.active = false;
    auth.previous = Some(H);
    let g = Grantee { epoch: 1, incarnation: 3, counter: 9 };
    let successor = |to, seq, counter| Successor {
        to,
        id: rid(seq),
        grantee: Grantee { epoch: 1, incarnation: 3, counter },
        lease: ms(500),
    };
    let (b, c) = (successor(B, 10, 10), successor(C, 20, 11));
    let ahead = vec![(b, ms(450)), (c, ms(480))];
    let body = Body::Handover {
        key: b"k".to_vec(),
        live: Some(Handed { holder: A, grantee: g, id: rid(1), remaining: ms(400), ahead }),
        note: None,
        recovered: false,
        lock_delay: Duration::ZERO,
    };
    new.handle_message(at(10), H, Message { epoch: 2, body }, &auth);
    // Adopted as the old home kept it: the holder recalled naming B, B naming C.
    let recall = |grantee, next| Body::Recall { key: b"k".to_vec(), grantee, next };
    assert_eq!(
        drain(&mut new),
        vec![
            (A, recall(g, Some(b))),
            (B, recall(b.grantee, Some(c))),
            (H, Body::HandoverAck { key: b"k".to_vec() })
        ]
    );
    new.handle_message(at(20), A, release_passing(b"k", g, None, Some(b.grantee)), &auth);
    assert_eq!(new.delegation(b"k").map(|d| d.holder), Some(B));
    // A check of C's token asks C, which B may have passed the key to already.
    assert!(matches!(
        &check(&mut new, &auth, at(21), b"k", c.grantee.token(0))[..],
        [(C, Body::Probe { .. })]
    ));
    new.handle_message(at(30), B, release_passing(b"k", b.grantee, None, Some(c.grantee)), &auth);
    let d = new.delegation(b"k").expect("live");
    assert_eq!(
        (d.holder, d.grantee, d.end),
        (C, c.grantee, at(10) + rate_margin(ms(480), TIMING.clock_rate_ppm))
    );
    assert_eq!(drain(&mut new), vec![]);
}

/// `A` holds `k`; `B` (asking a 100 ms lease) and then `C` (the usual 500 ms) are granted ahead
/// behind it, and B reaches its end with A still live: the home drops B. Returns A's grantee and
/// the two successors.
fn dropped_successor(home: &mut Home, auth: &Script) -> (Grantee, Successor, Successor) {
    let g = grant(home, auth, at(0), A, b"k", 1);
    home.handle_message(at(1), B, request(1, b"k", 10, ms(100), ms(900), None), auth);
    home.handle_message(at(2), C, req(b"k", 20, ms(900)), auth);
    let (b, c) = match &drain(home)[..] {
        [(A, Body::Recall { next: Some(b), .. }), (B, Body::Recall { next: Some(c), .. })] => (*b, *c),
        other => panic!("expected Recalls to A carrying B and to B carrying C, got {other:?}"),
    };
    home.handle_timeout(end_of(at(1), ms(100)), auth);
    drain(home);
    (g, b, c)
}

#[test]
fn a_successor_past_its_end_leaves_the_chain_behind_it_in_place() {
    let mut home = passing_home();
    let auth = Script::new(H);
    let (g, b, c) = dropped_successor(&mut home, &auth);
    // A passed the key to B, B to C; both releases are late. B was dropped at its end, but C,
    // which may hold the key, stays: nobody else is granted it until C's own end.
    home.handle_message(at(150), N, req(b"k", 30, ms(900)), &auth);
    let out = drain(&mut home);
    assert!(out.iter().all(|(to, body)| !matches!(body, Body::Grant { .. }) && *to != N), "{out:?}");
    assert!(matches!(
        &check(&mut home, &auth, at(151), b"k", c.grantee.token(0))[..],
        [(C, Body::Probe { .. })]
    ));
    // A's release names B, dropped: the home grants C itself, recovered (B may have run out).
    home.handle_message(at(200), A, release_passing(b"k", g, Some(b"a"), Some(b.grantee)), &auth);
    let grants: Vec<_> =
        drain(&mut home).into_iter().filter(|(_, b)| matches!(b, Body::Grant { .. })).collect();
    assert_eq!(grants, vec![(C, recovered_grant(20, c.grantee, at(2), at(200)))]);
}

/// Found in review: the same release, when the home may not grant at that instant (its home
/// lease lapsed, or the key moved), must not free the key: C may hold it, passed on by B.
#[test]
fn a_pass_to_a_dropped_successor_keeps_the_chain_tracked_when_the_home_may_not_grant() {
    let mut home = passing_home();
    let mut auth = Script::new(H);
    let (g, b, c) = dropped_successor(&mut home, &auth);
    auth.active = false;
    home.handle_message(at(200), A, release_passing(b"k", g, Some(b"a"), Some(b.grantee)), &auth);
    let d = home.delegation(b"k").expect("C may hold the key: still tracked");
    assert_eq!((d.holder, d.grantee), (C, c.grantee));
    assert!(drain(&mut home).iter().all(|(_, body)| !matches!(body, Body::Grant { .. })));
    // Active again: a new requester waits for C, it is not granted the key.
    auth.active = true;
    home.handle_message(at(201), N, req(b"k", 30, ms(900)), &auth);
    let out = drain(&mut home);
    assert!(out.iter().all(|(to, body)| !matches!(body, Body::Grant { .. }) && *to != N), "{out:?}");
    assert_eq!(home.delegation(b"k").map(|d| d.holder), Some(C));
}
