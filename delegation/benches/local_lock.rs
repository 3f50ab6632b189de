//! Cost of a local `lock` + `unlock` pair under a held delegation (the hot path: no message).
//!
//! `cargo bench -p keyhome-delegation --bench local_lock -- --warm-up-time 1 --measurement-time 3`
//!
//! - `local_pair/one_key`: one thread, one key, one `Holder`; reported time is per pair.
//! - `local_pair/10k_keys`: one thread, one `Holder` holding 10 000 delegations, cycling keys.
//! - `scaling/{control,sharded,shared}`: one thread against two threads on different keys,
//!   measured side by side. Every sample runs 1 000 pairs per criterion iteration on one thread,
//!   then the same count on each of two threads at once (in alternating order from sample to
//!   sample), on two long-lived worker threads; a phase's time runs from the earliest worker's
//!   start to the last one's end. Criterion reports the two-thread phase (its element rate is the
//!   aggregate pair rate of both threads); after the group a `scaling/<case>:` line gives both
//!   rates and their ratio per sample (median and range), which is the figure to quote.
//!   - `sharded`: each thread owns a `Holder` (built on that thread) holding its key's delegation.
//!     A `Holder` is a single-threaded state machine, so this is how keys can use more than one
//!     core: shard them across holders. Nothing is shared between the threads.
//!   - `shared`: one `Holder` holding both keys, behind a `std::sync::Mutex`, each thread taking
//!     the lock for its pair. This is a node that keeps one holder behind one lock (as the node
//!     runtime's embedded mode does with its core): the pairs are serialised, so two threads
//!     cannot beat one.
//!   - `control`: the same harness running arithmetic only (about as long as a pair, no memory):
//!     the ratio this machine gives two independent threads, the ceiling for `sharded`.
//!
//! Every pair passes a clock reading 1 ns later than the one before, so handle deadlines and
//! activity bookkeeping do real work; the delegation's 30 s lease outlasts any run.

use std::cell::RefCell;
use std::hint::black_box;
use std::sync::mpsc;
use std::sync::{Arc, Barrier, Mutex};
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

/// One holder and its clock, alone on its cache lines.
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

// ---- scaling ----

/// Pairs each thread runs per criterion iteration.
const PAIRS_PER_ITER: u64 = 1_000;

/// What one worker thread does, `n` times per phase.
trait Work: Send {
    fn run(&mut self, n: u64);
}

/// `sharded`: this thread's own holder and key.
struct Own {
    bench: Bench,
    key: Vec<u8>,
}

impl Work for Own {
    fn run(&mut self, n: u64) {
        for _ in 0..n {
            self.bench.pair(&self.key);
        }
    }
}

/// `shared`: one holder for both threads, behind a mutex.
struct Locked {
    bench: Arc<Mutex<Bench>>,
    key: Vec<u8>,
}

impl Work for Locked {
    fn run(&mut self, n: u64) {
        for _ in 0..n {
            self.bench.lock().expect("no worker panicked").pair(&self.key);
        }
    }
}

/// `control`: dependent multiply-xorshift rounds, touching no memory.
struct Spin(u64);

impl Work for Spin {
    fn run(&mut self, n: u64) {
        let mut x = self.0;
        for _ in 0..n {
            for _ in 0..48 {
                x = black_box(x.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (x >> 29));
            }
        }
        self.0 = x;
    }
}

/// One phase for one worker: run `n` units after `start`, then report when it ran.
struct Phase {
    n: u64,
    start: Arc<Barrier>,
    done: mpsc::Sender<(std::time::Instant, std::time::Instant)>,
}

/// Two long-lived worker threads. Each builds its [`Work`] on its own thread (so a holder's memory
/// comes from that thread's allocator arena) and keeps it for the whole run.
struct Crew {
    go: Vec<mpsc::Sender<Phase>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Crew {
    fn new(make: impl Fn(usize) -> Box<dyn Work> + Send + Sync + 'static) -> Crew {
        let make = Arc::new(make);
        let (go, threads) = (0..2)
            .map(|i| {
                let (tx, rx) = mpsc::channel::<Phase>();
                let make = Arc::clone(&make);
                let thread = std::thread::spawn(move || {
                    let mut work = make(i);
                    work.run(10_000); // warm caches and branch predictors
                    for phase in rx {
                        phase.start.wait();
                        let began = std::time::Instant::now();
                        work.run(phase.n);
                        let _ = phase.done.send((began, std::time::Instant::now()));
                    }
                });
                (tx, thread)
            })
            .unzip();
        Crew { go, threads }
    }

    /// Runs `n` units on each of the first `threads` workers at once; the wall time from the
    /// earliest start to the latest end.
    fn run(&self, threads: usize, n: u64) -> Duration {
        let start = Arc::new(Barrier::new(threads));
        let (done, finished) = mpsc::channel();
        for go in &self.go[..threads] {
            let phase = Phase { n, start: Arc::clone(&start), done: done.clone() };
            go.send(phase).expect("worker alive");
        }
        drop(done);
        let spans: Vec<_> = finished.iter().collect();
        assert_eq!(spans.len(), threads, "every worker reports");
        let began = spans.iter().map(|s| s.0).min().expect("a worker");
        let ended = spans.iter().map(|s| s.1).max().expect("a worker");
        ended - began
    }
}

impl Drop for Crew {
    fn drop(&mut self) {
        self.go.clear();
        for t in self.threads.drain(..) {
            t.join().expect("worker");
        }
    }
}

/// One sample of a scaling case: units per thread, one-thread time, two-thread time.
type Sample = (u64, Duration, Duration);

fn bench_threads(c: &mut Criterion) {
    let cases: [(&str, Crew); 3] = [
        ("control", Crew::new(|i| Box::new(Spin(i as u64 + 1)))),
        (
            "sharded",
            Crew::new(|i| {
                let key = key(i);
                Box::new(Own { bench: Bench::new(std::slice::from_ref(&key)), key })
            }),
        ),
        ("shared", {
            let bench = Arc::new(Mutex::new(Bench::new(&[key(0), key(1)])));
            Crew::new(move |i| Box::new(Locked { bench: Arc::clone(&bench), key: key(i) }))
        }),
    ];
    let mut group = c.benchmark_group("scaling");
    group.throughput(Throughput::Elements(2 * PAIRS_PER_ITER));
    let mut reports = Vec::new();
    for (name, crew) in &cases {
        let samples: RefCell<Vec<Sample>> = RefCell::new(Vec::new());
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter_custom(|iters| {
                let n = iters * PAIRS_PER_ITER;
                let mut samples = samples.borrow_mut();
                // Alternate the order, so neither phase always runs first.
                let (one, two) = if samples.len().is_multiple_of(2) {
                    let one = crew.run(1, n);
                    (one, crew.run(2, n))
                } else {
                    let two = crew.run(2, n);
                    (crew.run(1, n), two)
                };
                samples.push((n, one, two));
                two
            })
        });
        reports.push((*name, samples.into_inner()));
    }
    group.finish();
    for (name, samples) in reports {
        if let Some(line) = report(name, &samples) {
            println!("{line}");
        }
    }
}

/// `scaling/<name>: 1 thread R1 M/s, 2 threads R2 M/s, ratio median X (min A, max B) over N
/// samples`; rates are totals over all samples, the ratio is taken per sample.
fn report(name: &str, samples: &[Sample]) -> Option<String> {
    if samples.len() < 10 {
        return None; // a test run (one sample) says nothing about scaling
    }
    let units: u64 = samples.iter().map(|s| s.0).sum();
    let one: Duration = samples.iter().map(|s| s.1).sum();
    let two: Duration = samples.iter().map(|s| s.2).sum();
    let rate = |count: u64, time: Duration| count as f64 / time.as_secs_f64() / 1e6;
    let mut ratios: Vec<f64> =
        samples.iter().map(|&(_, one, two)| 2.0 * one.as_secs_f64() / two.as_secs_f64()).collect();
    ratios.sort_by(f64::total_cmp);
    let median = ratios[ratios.len() / 2];
    let (min, max) = (ratios[0], ratios[ratios.len() - 1]);
    Some(format!(
        "scaling/{name}: 1 thread {:.2} M/s, 2 threads {:.2} M/s; ratio median {median:.2} (min {min:.2}, \
         max {max:.2}) over {} samples",
        rate(units, one),
        rate(2 * units, two),
        samples.len(),
    ))
}

criterion_group!(benches, bench_pair, bench_threads);
criterion_main!(benches);
