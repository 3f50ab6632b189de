//! Embedded re-lock driver: one node (its own home) in this process, and a loop of
//! `Node::try_lock` + dropping the guard on one key whose delegation the node holds. Small enough
//! to run under an instruction counter, so the hot path's cost is measured without wall-clock
//! noise:
//!
//!     cargo bench -p keyhome --bench embedded -- --pairs 1000000
//!     valgrind --tool=callgrind --toggle-collect='embedded::relock' \
//!         $CARGO_TARGET_DIR/release/deps/embedded-<hash> --pairs 100000
//!
//! Under callgrind only `relock` is counted: its total divided by `--pairs` is the instructions
//! per lock+unlock pair. The ns per pair it prints are a single wall-clock figure (the cluster
//! bench's `embedded re-lock` is the one reported in docs/benchmarks.md).
//!
//! Then two-thread scaling: the node runs two key shards; one thread re-locks a key of shard 0,
//! then two threads at once each re-lock a key of their own shard, `--pairs` pairs each, and the
//! bench prints both rates and their ratio (`--rounds` times, default 5).

use std::time::{Duration, Instant};

use keyhome::{Node, setup};
use keyhome_epoch::Timing;

fn main() {
    let mut args = std::env::args().skip(1);
    let mut pairs = 1_000_000usize;
    let mut rounds = 5usize;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--pairs" => pairs = args.next().and_then(|n| n.parse().ok()).expect("--pairs takes a number"),
            "--rounds" => rounds = args.next().and_then(|n| n.parse().ok()).expect("--rounds takes a number"),
            _ => {}
        }
    }
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
    rt.block_on(run(pairs, rounds));
}

async fn run(pairs: usize, rounds: usize) {
    let dir = tempfile::tempdir().expect("tempdir");
    let timing = Timing {
        home_lease: Duration::from_secs(2),
        max_delegation_lease: Duration::from_secs(5),
        clock_rate_ppm: 10_000,
    };
    let mut config = setup::embedded_dev_node(dir.path(), timing).expect("layout");
    config.shards = 2;
    let node = Node::start(config).await.expect("node starts");
    let ready = Instant::now();
    while !{
        let s = node.status();
        s.home_lease_left.is_some() && s.quarantine_left.is_zero()
    } {
        assert!(ready.elapsed() < Duration::from_secs(120), "node did not settle");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let key = b"bench/embedded-relock";
    let ttl = Duration::from_secs(10);
    node.lock(key, ttl, Duration::from_secs(10)).await.expect("first lock").unlock(None).expect("unlock");
    for _ in 0..pairs / 10 {
        drop(node.try_lock(key, ttl).expect("warm-up re-lock")); // not counted by callgrind
    }
    let start = Instant::now();
    relock(&node, key, ttl, pairs);
    let per_pair = start.elapsed() / u32::try_from(pairs).expect("pairs fit in u32");
    println!("embedded re-lock: {pairs} pairs, {} ns per pair", per_pair.as_nanos());
    two_threads(&node, ttl, pairs, rounds).await;
    node.shutdown(Duration::from_millis(100)).await;
}

/// The measured loop: `pairs` lock+unlock pairs on `key`.
#[inline(never)]
fn relock(node: &Node, key: &[u8], ttl: Duration, pairs: usize) {
    for _ in 0..pairs {
        let guard = node.try_lock(key, ttl).expect("re-lock needs no message");
        drop(std::hint::black_box(guard));
    }
}

/// One thread, then two threads on keys of different shards: prints pairs per second and the ratio.
async fn two_threads(node: &Node, ttl: Duration, pairs: usize, rounds: usize) {
    let key_in = |shard: usize| {
        (0..)
            .map(|i| format!("bench/thread-{i}").into_bytes())
            .find(|k| node.shard_of(k) == shard)
            .expect("a key")
    };
    let keys = [key_in(0), key_in(1)];
    for key in &keys {
        node.lock(key, ttl, Duration::from_secs(10)).await.expect("first lock").unlock(None).expect("unlock");
    }
    for round in 1..=rounds {
        let start = Instant::now();
        relock(node, &keys[0], ttl, pairs);
        let one = pairs as f64 / start.elapsed().as_secs_f64();
        let start = Instant::now();
        std::thread::scope(|scope| {
            for key in &keys {
                scope.spawn(move || relock(node, key, ttl, pairs));
            }
        });
        let two = 2.0 * pairs as f64 / start.elapsed().as_secs_f64();
        println!(
            "round {round}: 1 thread {:.2} M pairs/s, 2 threads {:.2} M pairs/s: {:.2}x",
            one / 1e6,
            two / 1e6,
            two / one
        );
    }
}
