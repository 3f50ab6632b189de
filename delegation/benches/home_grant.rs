//! Cost of the home side: requests handled by `Home::handle_message`, and heap bytes per live
//! delegation.
//!
//! `cargo bench -p keyhome-delegation --bench home_grant -- --warm-up-time 1 --measurement-time 3`
//!
//! - `home_request/grant_free_new`: a request for a key the home has no record of (its first
//!   lock, or its record aged out) → Grant. Released keys are dropped at once
//!   (`record_retention` zero), so every request inserts a key.
//! - `home_request/grant_free_record`: a request for a key released cleanly before, whose record
//!   the home keeps (default five-minute retention) → Grant carrying it.
//! - `home_request/renew`: the holder renews its live delegation → Grant (renewal).
//! - `home_request/queue_recall`: another node requests a held key with a wait → it queues and
//!   the home sends a Recall to the holder.
//!
//! Each case cycles through 100 000 distinct keys (24-byte mean, 16 to 32 bytes) on a home that
//! also holds 100 000 other live delegations, so the map has 200 000 entries. The measured cost is
//! `handle_message` plus draining (and dropping) every message `poll_transmit` yields. The
//! requests are built beforehand, outside the timing (a driver gets them from the decoder). What
//! keeps the state bounded runs untimed after each chunk of 1 024 requests: the holder releases
//! the keys just granted (grant cases), or the holder releases and the queued requester is granted
//! and becomes the next round's holder (queue case). The clock advances 1 ns per message; leases
//! are 10 s, so nothing expires.
//!
//! - `home_memory` (printed, not a criterion case): live heap bytes, counted by this binary's
//!   global allocator (requested sizes, not the allocator's rounding), before and after one home
//!   grants delegations of distinct keys, divided by the count, at 900 000, ONE MILLION and
//!   1 200 000 live delegations (the first just below a doubling of the home's index, the others
//!   past it); also `Home::memory_estimate()` and the process's resident-set growth. Twice: with
//!   16-byte keys (the figure the target is about), then with 16-to-32-byte keys (mean 24, as the
//!   timed cases). Runs unless a filter is given that does not match `home_memory`.
//!
//! - `home_epoch_walk` (printed): an epoch change with ONE MILLION live delegations (16-byte
//!   keys), walked a step at a time (`Home::on_epoch_change`, then `Home::handle_timeout` until
//!   `Home::walking` is false): the longest step is the longest the node's core is held for it,
//!   so the stall an epoch change puts on every other call; the sum is how long the walk takes
//!   when nothing else runs. Twice: an epoch that moves no key (every key stays homed here) and
//!   one that adds two members, so the ring (`keyhome_ring::home`, as the node asks it) moves
//!   about two thirds of the keys away, each to be handed over. Runs unless a filter is given
//!   that does not match `home_epoch_walk`.
//!
//! - `holder_epoch_walk` (printed): the holder's side, a holder holding a million delegations with
//!   100 000 more keys asked for and not yet granted, and a change that moves about two thirds of
//!   the keys (so the outstanding requests of those go to their new homes): the longest step.
//!   Runs unless a filter is given that does not match `holder_epoch_walk`.
//!
//! The counting allocator is in force for the timed cases too: it adds one thread-local add per
//! allocation and free.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group};
use keyhome_delegation::{
    Authority, Body, DEFAULT_WALK_STEP, Grantee, Holder, HolderConfig, HolderEvent, Home, HomeConfig,
    LockOutcome, Message, RequestId,
};
use keyhome_epoch::{Instant, NodeId, Timing};

// ---- a counting allocator (per thread: the memory measurement runs on one thread) ----

#[allow(dead_code)] // each includer reads one of its two counts
#[path = "../tests/support/counting.rs"]
mod counting;
use counting::allocated;

// ---- the epoch layer: every key homed here, active, every node a member ----

const ME: NodeId = NodeId(1);
/// Holders of the background delegations (one per 62 500, under the per-requester cap).
const BACKGROUND: [NodeId; 16] = {
    let mut ids = [NodeId(0); 16];
    let mut i = 0;
    while i < 16 {
        ids[i] = NodeId(100 + i as u64);
        i += 1;
    }
    ids
};
const A: NodeId = NodeId(2);
const B: NodeId = NodeId(3);

/// An epoch layer: epoch `epoch`, every node a member and every key homed here and active; or,
/// with `ring`, the members and homes of a ring over those nodes.
struct Layer {
    epoch: u64,
    ring: Option<&'static [NodeId]>,
}

/// The layer of the timed cases: epoch 1, every key homed here.
const FIXED: Layer = Layer { epoch: 1, ring: None };

impl Authority for Layer {
    fn epoch(&self) -> u64 {
        self.epoch
    }
    fn incarnation(&self) -> u64 {
        1
    }
    fn timing(&self) -> Timing {
        Timing::DEFAULT
    }
    fn is_member(&self, node: NodeId) -> bool {
        self.ring.is_none_or(|members| members.contains(&node))
    }
    fn home_of(&self, key: &[u8]) -> Option<NodeId> {
        self.ring.map_or(Some(ME), |members| keyhome_ring::home(key, members))
    }
    fn home_active(&self, _now: Instant, _key: &[u8]) -> bool {
        true
    }
    fn holds_lease(&self, _now: Instant) -> bool {
        true
    }
}

const KEYS: usize = 100_000;
const CHUNK: usize = 1024;
const LEASE: Duration = Duration::from_secs(10);
const WAIT: Duration = Duration::from_secs(5);

/// Key `i` of family `tag`: 16 to 32 bytes (16 + i % 17), distinct for distinct `(tag, i)`.
fn key(tag: u8, i: usize) -> Vec<u8> {
    let mut k = format!("{}{i:015}", tag as char).into_bytes();
    k.resize(16 + i % 17, b'x');
    k
}

fn request(key: &[u8], id: u64, wait: Duration, held: Option<Grantee>) -> Message {
    Message {
        epoch: 1,
        body: Body::Request { key: key.to_vec(), id: RequestId::new(1, id), lease: LEASE, wait, held },
    }
}

fn release(key: &[u8], grantee: Grantee) -> Message {
    Message {
        epoch: 1,
        body: Body::Release { key: key.to_vec(), grantee, note: None, recovered: false, passed: None },
    }
}

/// A home past its restart quarantine, its clock, and the grantee and holder of each bench key.
struct Bench {
    home: Home,
    now: Instant,
    next_id: u64,
    keys: Vec<Vec<u8>>,
    /// Per bench key: who holds it and under which grantee, if held.
    held: Vec<Option<(NodeId, Grantee)>>,
    cursor: usize,
}

impl Bench {
    fn new(record_retention: Duration, background: usize) -> Bench {
        let mut config = HomeConfig::new(ME);
        config.record_retention = record_retention;
        config.limits.max_delegations = 2_000_000;
        let mut bench = Bench {
            home: Home::new(config, Instant::ZERO),
            now: Instant::from_nanos(60_000_000_000),
            next_id: 1,
            keys: (0..KEYS).map(|i| key(b'k', i)).collect(),
            held: vec![None; KEYS],
            cursor: 0,
        };
        for i in 0..background {
            let from = BACKGROUND[i % BACKGROUND.len()];
            let m = request(&key(b'b', i), bench.id(), Duration::ZERO, None);
            bench.deliver(from, m);
            let out = bench.drain();
            assert!(matches!(out.as_slice(), [(_, Body::Grant { .. })]), "{out:?}");
        }
        bench
    }

    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    #[inline]
    fn deliver(&mut self, from: NodeId, m: Message) {
        self.now = self.now + Duration::from_nanos(1);
        self.home.handle_message(self.now, from, m, &FIXED);
    }

    fn drain(&mut self) -> Vec<(NodeId, Body)> {
        std::iter::from_fn(|| self.home.poll_transmit()).map(|(to, m)| (to, m.body)).collect()
    }

    /// Grants every bench key to `A` and records the grantees.
    fn hold_all(&mut self) {
        for i in 0..KEYS {
            let m = request(&self.keys[i].clone(), self.id(), Duration::ZERO, None);
            self.deliver(A, m);
            self.note_grants();
            assert!(self.held[i].is_some());
        }
    }

    /// Records the holder and grantee of every Grant the home sent.
    fn note_grants(&mut self) -> usize {
        let mut n = 0;
        for (to, body) in self.drain() {
            if let Body::Grant { key, grantee, .. } = body {
                let i = self.index(&key);
                self.held[i] = Some((to, grantee));
                n += 1;
            }
        }
        n
    }

    fn index(&self, key: &[u8]) -> usize {
        let digits = std::str::from_utf8(&key[1..16]).expect("ascii");
        digits.parse().expect("digits")
    }

    /// The next chunk of bench keys (at most `n`), cycling.
    fn chunk(&mut self, n: usize) -> std::ops::Range<usize> {
        if self.cursor == KEYS {
            self.cursor = 0;
        }
        let start = self.cursor;
        self.cursor = (start + n).min(KEYS);
        start..self.cursor
    }

    /// Runs `iters` requests built by `make` in chunks, timing only `handle_message` + draining
    /// the output; `after` restores the state for the chunk, untimed.
    fn run(
        &mut self,
        iters: u64,
        mut make: impl FnMut(&mut Bench, usize) -> (NodeId, Message),
        mut after: impl FnMut(&mut Bench, std::ops::Range<usize>),
    ) -> Duration {
        let mut total = Duration::ZERO;
        let mut left = iters as usize;
        let mut batch = Vec::with_capacity(CHUNK);
        while left > 0 {
            let range = self.chunk(left.min(CHUNK));
            left -= range.len();
            batch.clear();
            batch.extend(range.clone().map(|i| make(self, i)));
            let start = std::time::Instant::now();
            for (from, m) in batch.drain(..) {
                self.deliver(from, m);
                while let Some(out) = self.home.poll_transmit() {
                    black_box(out);
                }
            }
            total += start.elapsed();
            after(self, range);
        }
        total
    }
}

/// The holder releases every key of `range` it holds (untimed); grants to waiters are recorded.
fn release_range(b: &mut Bench, range: std::ops::Range<usize>) {
    for i in range {
        if let Some((holder, grantee)) = b.held[i].take() {
            let m = release(&b.keys[i].clone(), grantee);
            b.deliver(holder, m);
            b.note_grants();
        }
    }
}

fn bench_requests(c: &mut Criterion) {
    let mut group = c.benchmark_group("home_request");
    group.throughput(Throughput::Elements(1));

    for (name, retention) in
        [("grant_free_new", Duration::ZERO), ("grant_free_record", Duration::from_secs(300))]
    {
        let mut b = Bench::new(retention, KEYS);
        if !retention.is_zero() {
            // Give every bench key a released record.
            b.hold_all();
            release_range(&mut b, 0..KEYS);
        }
        group.bench_function(name, |bencher| {
            bencher.iter_custom(|iters| {
                b.run(
                    iters,
                    |b, i| {
                        let id = b.id();
                        (A, request(&b.keys[i], id, Duration::ZERO, None))
                    },
                    |b, range| {
                        // Every request was granted: record the grantees, then release.
                        b.grants_were_sent(range.clone());
                        release_range(b, range);
                    },
                )
            })
        });
        assert_eq!(b.home.delegations(), KEYS, "{name}: only the background is held between chunks");
        drop(b);
    }

    let mut b = Bench::new(Duration::from_secs(300), KEYS);
    b.hold_all();
    group.bench_function("renew", |bencher| {
        bencher.iter_custom(|iters| {
            b.run(
                iters,
                |b, i| {
                    let (holder, grantee) = b.held[i].expect("held");
                    let id = b.id();
                    (holder, request(&b.keys[i], id, Duration::ZERO, Some(grantee)))
                },
                |_, _| {},
            )
        })
    });
    assert_eq!(b.home.delegations(), 2 * KEYS);
    drop(b);

    let mut b = Bench::new(Duration::from_secs(300), KEYS);
    b.hold_all();
    group.bench_function("queue_recall", |bencher| {
        bencher.iter_custom(|iters| {
            b.run(
                iters,
                |b, i| {
                    let (holder, _) = b.held[i].expect("held");
                    let other = if holder == A { B } else { A };
                    let id = b.id();
                    (other, request(&b.keys[i], id, WAIT, None))
                },
                // The holder releases; the home grants the queued requester, the next holder.
                |b, range| {
                    release_range(b, range.clone());
                    assert!(range.clone().all(|i| b.held[i].is_some()), "every waiter was granted");
                },
            )
        })
    });
    assert_eq!(b.home.delegations(), 2 * KEYS);
    assert!(b.home.waiters(&b.keys[0]).is_empty());
    drop(b);

    group.finish();
}

impl Bench {
    /// After a timed chunk of grants: the grants were drained (and dropped) inside the timing, so
    /// look the grantees up from the home.
    fn grants_were_sent(&mut self, range: std::ops::Range<usize>) {
        for i in range {
            let d = self.home.delegation(&self.keys[i]).expect("the request was granted");
            assert_eq!(d.holder, A);
            self.held[i] = Some((d.holder, d.grantee));
        }
    }
}

// ---- memory ----

fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

fn home_memory() {
    home_memory_with("16-byte keys", |i| format!("m{i:015}").into_bytes(), true);
    // The first home's memory is free again but stays resident: no resident-set figure.
    home_memory_with("16-to-32-byte keys", |i| key(b'm', i), false);
}

/// One home granting delegations of keys `key(0)`, `key(1)`, …: heap bytes per delegation at
/// each checkpoint, and the growth of the resident set if `rss`.
fn home_memory_with(what: &str, key: impl Fn(usize) -> Vec<u8>, rss: bool) {
    const COUNT: usize = 1_200_000;
    let checkpoints = [900_000, 1_000_000, COUNT];
    let mut config = HomeConfig::new(ME);
    config.limits.max_delegations = 2 * COUNT;
    let mut home = Home::new(config, Instant::ZERO);
    let mut now = Instant::from_nanos(60_000_000_000);
    let holders = BACKGROUND;
    // Warm the output queue with one grant, so its (reused) buffer is not counted.
    home.handle_message(now, A, request(b"warm-up-key-0000", 0, Duration::ZERO, None), &FIXED);
    while home.poll_transmit().is_some() {}
    // Keys are built inside the measured window: the home keeps a request's key buffer as its own
    // copy of the key, so building them beforehand would hide that allocation.
    let key_bytes: usize = (0..COUNT).map(|i| key(i).len()).sum();
    let rss_before = resident_bytes();
    let before = allocated();
    let mut at = 0;
    println!(
        "home_memory: live delegations of distinct keys, {what} (mean {} bytes)",
        key_bytes as f64 / COUNT as f64
    );
    for target in checkpoints {
        for i in at..target {
            now = now + Duration::from_nanos(1);
            let m = request(&key(i), i as u64 + 1, Duration::ZERO, None);
            home.handle_message(now, holders[i % holders.len()], m, &FIXED);
            while home.poll_transmit().is_some() {}
        }
        at = target;
        assert_eq!(home.delegations(), target + 1);
        let live = allocated() - before;
        let estimate = home.memory_estimate();
        println!(
            "home_memory/{target}: {live} live heap bytes, {:.1} bytes per delegation; memory_estimate() {estimate} bytes, {:.1} per delegation",
            live as f64 / target as f64,
            estimate as f64 / (target + 1) as f64,
        );
    }
    if rss && let (Some(b), Some(a)) = (rss_before, resident_bytes()) {
        println!(
            "home_memory/{COUNT}: resident set grew {} bytes, {:.1} bytes per delegation (allocator rounding and free-list slack included)",
            a.saturating_sub(b),
            a.saturating_sub(b) as f64 / COUNT as f64
        );
    }
    println!("home_memory: Home::ENTRY_BYTES = {}", Home::ENTRY_BYTES);
    black_box(&home);
}

// ---- epoch change ----

fn home_epoch_walk() {
    const COUNT: usize = 1_000_000;
    const ALONE: &[NodeId] = &[ME];
    const THREE: &[NodeId] = &[ME, A, B];
    for (what, members) in [("no key moves", ALONE), ("two members added, about 2/3 of the keys move", THREE)]
    {
        let mut config = HomeConfig::new(ME);
        config.limits.max_delegations = 2 * COUNT;
        let mut home = Home::new(config, Instant::ZERO);
        let mut now = Instant::from_nanos(60_000_000_000);
        for i in 0..COUNT {
            now = now + Duration::from_nanos(1);
            let m = request(format!("m{i:015}").as_bytes(), i as u64 + 1, Duration::ZERO, None);
            home.handle_message(now, BACKGROUND[i % BACKGROUND.len()], m, &FIXED);
            while home.poll_transmit().is_some() {}
        }
        let next = Layer { epoch: 2, ring: Some(members) };
        // The change, then the walk's steps as a driver takes them: each call, with the messages
        // it produced drained, is one stretch the node's core is held for.
        let (mut steps, mut sent, mut longest, mut total) = (0usize, 0usize, Duration::ZERO, Duration::ZERO);
        let mut step = |home: &mut Home, call: &dyn Fn(&mut Home)| {
            let start = std::time::Instant::now();
            call(home);
            while home.poll_transmit().is_some() {
                sent += 1;
            }
            let took = start.elapsed();
            longest = longest.max(took);
            total += took;
            steps += 1;
        };
        step(&mut home, &|home| home.on_epoch_change(now, &next));
        while home.walking() {
            step(&mut home, &|home| home.handle_timeout(now, &next));
        }
        println!(
            "home_epoch_walk: {COUNT} live delegations, {what}: {steps} steps of {DEFAULT_WALK_STEP} slots, longest {:.3} ms, all {:.1} ms ({:.0} ns per key), {sent} messages",
            longest.as_secs_f64() * 1e3,
            total.as_secs_f64() * 1e3,
            total.as_secs_f64() * 1e9 / COUNT as f64
        );
        black_box(&home);
    }
}

/// The holder's side of an epoch change: a holder holding a million delegations, with 100 000
/// more keys asked for and not yet granted; the change moves about two thirds of the keys, so
/// about 66 700 requests are sent to their new homes.
fn holder_epoch_walk() {
    const HELD: usize = 1_000_000;
    const ASKED: usize = 100_000;
    let mut config = HolderConfig::new(ME);
    config.limits.max_holder_keys = 2 * (HELD + ASKED);
    config.idle_release = Duration::from_secs(3600);
    let now = Instant::from_nanos(60_000_000_000);
    let mut holder = Holder::new(config, now);
    let ttl = Duration::from_secs(1);
    for (counter, i) in (1u64..).zip(0..HELD + ASKED) {
        let key = format!("h{i:015}").into_bytes();
        let Ok(LockOutcome::Pending(_)) = holder.lock(now, &key, ttl, WAIT, &FIXED) else {
            panic!("a first lock waits for the home")
        };
        let Some((home, Message { body: Body::Request { id, lease, .. }, .. })) = holder.poll_transmit()
        else {
            panic!("a first lock sends a request")
        };
        if i >= HELD {
            continue; // asked for, not granted
        }
        let grantee = Grantee { epoch: 1, incarnation: 1, counter };
        let body = Body::Grant { key, id, grantee, lease, note: None, recovered: false };
        holder.handle_message(now, home, Message { epoch: 1, body }, &FIXED);
        let Some(HolderEvent::Locked { handle, .. }) = holder.poll_event() else { panic!("granted") };
        holder.unlock(now, handle.id, None).expect("a live handle");
    }
    let next = Layer { epoch: 2, ring: Some(&[ME, A, B]) };
    let (mut steps, mut sent, mut longest) = (0usize, 0usize, Duration::ZERO);
    let mut call = |holder: &mut Holder, first: bool| {
        let start = std::time::Instant::now();
        if first {
            holder.on_epoch_change(now, &next);
        } else {
            holder.handle_timeout(now, &next);
        }
        while holder.poll_transmit().is_some() {
            sent += 1;
        }
        longest = longest.max(start.elapsed());
        steps += 1;
    };
    call(&mut holder, true);
    while holder.walking() {
        call(&mut holder, false);
    }
    println!(
        "holder_epoch_walk: {HELD} delegations held, {ASKED} requests outstanding: {steps} steps of {DEFAULT_WALK_STEP} slots, longest {:.3} ms, {sent} requests re-sent",
        longest.as_secs_f64() * 1e3
    );
    black_box(&holder);
}

/// Whether the command line asks for `name`: no filter given, or a filter that is a substring.
fn wants(name: &str) -> bool {
    const VALUED: &[&str] = &[
        "--warm-up-time",
        "--measurement-time",
        "--sample-size",
        "--save-baseline",
        "--baseline",
        "--baseline-lenient",
        "--load-baseline",
        "--noise-threshold",
        "--confidence-level",
        "--significance-level",
        "--nresamples",
        "--output-format",
        "--color",
        "-c",
        "--plotting-backend",
        "--profile-time",
        "--format",
    ];
    let mut filters = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--list" {
            return false;
        }
        if VALUED.contains(&a.as_str()) {
            args.next();
        } else if !a.starts_with('-') {
            filters.push(a);
        }
    }
    filters.is_empty() || filters.iter().any(|f| name.contains(f.as_str()))
}

criterion_group!(benches, bench_requests);

fn main() {
    if wants("home_memory") {
        home_memory();
    }
    if wants("home_epoch_walk") {
        home_epoch_walk();
    }
    if wants("holder_epoch_walk") {
        holder_epoch_walk();
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
