//! Cost of a local `lock` + `unlock` pair under a held delegation (the hot path: no message).
//!
//! `cargo bench -p keyhome-delegation -- --warm-up-time 1 --measurement-time 3`
//!
//! - `local_pair/one_key`: one thread, one key, one `Holder`; reported time is per pair.
//! - `local_pair/10k_keys`: one thread, one `Holder` holding 10 000 delegations, cycling keys.
//! - `scaling/threads/{1,2}`: one or two threads, each with its own `Holder` and key (a
//!   `Holder` is single-threaded; a node shards keys across holders to use more cores). Each
//!   criterion iteration is 1 000 pairs per thread; for a sample of `n` iterations every thread
//!   runs `n × 1 000` pairs free (no synchronisation between pairs), and the sample's time is the
//!   wall time from a common start (threads already spawned) until the last thread is done.
//!   Criterion's element rate is the aggregate pair rate of all threads.
//!
//! Every pair passes a clock reading 1 ns later than the one before, so handle deadlines and
//! activity bookkeeping do real work; the delegation's 30 s lease outlasts any run.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use keyhome_delegation::holder::{Event, Holder, HolderConfig, LockOutcome};
use keyhome_delegation::{Authority, Body, Grantee, Message};
use keyhome_epoch::{Instant, NodeId, Timing};

const ME: NodeId = NodeId(1);
const HOME: NodeId = NodeId(2);

/// A fixed epoch layer: every key is homed on `HOME`.
struct Fixed;

impl Authority for Fixed {
    fn epoch(&self) -> u64 {
        1
    }
    fn incarnation(&self) -> u64 {
        1
    }
    fn timing(&self) -> Timing {
        Timing::DEFAULT
    }
    fn is_member(&self, _node: NodeId) -> bool {
        true
    }
    fn home_of(&self, _key: &[u8]) -> Option<NodeId> {
        Some(HOME)
    }
    fn home_active(&self, _now: Instant, _key: &[u8]) -> bool {
        false
    }
}

/// One holder and its clock, alone on its cache lines (two of them sit side by side in a `Vec`
/// in the threaded bench, and must not share a line).
#[repr(align(128))]
struct Bench {
    holder: Holder,
    now: Instant,
}

impl Bench {
    /// A holder that holds the delegation of every key in `keys`, granted at once by the home.
    fn new(keys: &[Vec<u8>]) -> Bench {
        let mut config = HolderConfig::new(ME);
        config.lease = Duration::from_secs(30);
        config.idle_release = Duration::from_secs(3600);
        let now = Instant::from_nanos(1_000_000_000);
        let mut holder = Holder::new(config, now);
        for (counter, key) in (1u64..).zip(keys) {
            let ticket = match holder.lock(now, key, Duration::from_secs(1), Duration::from_secs(1), &Fixed) {
                Ok(LockOutcome::Pending(ticket)) => ticket,
                other => panic!("expected a pending lock, got {other:?}"),
            };
            let Some((to, Message { body: Body::Request { id, lease, .. }, .. })) = holder.poll_transmit()
            else {
                panic!("expected a request");
            };
            let grantee = Grantee { epoch: 1, incarnation: 1, counter };
            let body = Body::Grant { key: key.clone(), id, grantee, lease, note: None, recovered: false };
            holder.handle_message(now, to, Message { epoch: 1, body }, &Fixed);
            match holder.poll_event() {
                Some(Event::Locked { ticket: t, handle }) if t == ticket => {
                    holder.unlock(now, handle.id, None).expect("live handle");
                }
                other => panic!("expected the lock, got {other:?}"),
            }
        }
        Bench { holder, now }
    }

    /// One local lock + unlock pair on `key`.
    #[inline]
    fn pair(&mut self, key: &[u8]) {
        self.now = self.now + Duration::from_nanos(1);
        let ttl = Duration::from_secs(5);
        match self.holder.lock(self.now, black_box(key), ttl, Duration::from_secs(1), &Fixed) {
            Ok(LockOutcome::Locked(handle)) => {
                black_box(handle.token);
                self.holder.unlock(self.now, handle.id, None).expect("live handle");
            }
            other => panic!("the delegation is held: {other:?}"),
        }
    }
}

fn key(i: usize) -> Vec<u8> {
    format!("tenant-{:02}/orders/{i:06}", i % 17).into_bytes()
}

fn bench_pair(c: &mut Criterion) {
    let mut group = c.benchmark_group("local_pair");
    group.throughput(Throughput::Elements(1));
    let one = key(0);
    let mut b1 = Bench::new(std::slice::from_ref(&one));
    group.bench_function("one_key", |b| b.iter(|| b1.pair(&one)));
    drop(b1);
    let keys: Vec<Vec<u8>> = (0..10_000).map(key).collect();
    let mut many = Bench::new(&keys);
    group.bench_function("10k_keys", |b| {
        let mut next = keys.iter().cycle();
        b.iter(|| many.pair(next.next().expect("cycle")))
    });
    group.finish();
}

/// Pairs each thread runs per criterion iteration.
const PAIRS_PER_ITER: u64 = 1_000;

fn bench_threads(c: &mut Criterion) {
    let mut group = c.benchmark_group("scaling");
    for threads in [1usize, 2] {
        let keys: Vec<Vec<u8>> = (0..threads).map(key).collect();
        let mut benches: Vec<Bench> = keys.iter().map(|k| Bench::new(std::slice::from_ref(k))).collect();
        group.throughput(Throughput::Elements(threads as u64 * PAIRS_PER_ITER));
        group.bench_function(BenchmarkId::new("threads", threads), |b| {
            b.iter_custom(|iters| {
                let pairs = iters * PAIRS_PER_ITER;
                // Every thread is spawned and waiting before the clock starts; then each runs its
                // count free, and the clock stops when the last one is done.
                let start_line = std::sync::Barrier::new(threads + 1);
                std::thread::scope(|s| {
                    let workers: Vec<_> = benches
                        .iter_mut()
                        .zip(&keys)
                        .map(|(bench, key)| {
                            let start_line = &start_line;
                            s.spawn(move || {
                                start_line.wait();
                                for _ in 0..pairs {
                                    bench.pair(key);
                                }
                            })
                        })
                        .collect();
                    start_line.wait();
                    let start = std::time::Instant::now();
                    for w in workers {
                        w.join().expect("worker");
                    }
                    start.elapsed()
                })
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_pair, bench_threads);
criterion_main!(benches);
