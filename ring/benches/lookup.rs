//! Look-up cost of a prepared `Ring`.
//!
//! `cargo bench -p keyhome-ring -- --warm-up-time 1 --measurement-time 3`
//!
//! Each iteration looks up one key from a fixed pool of 64 keys of 16–32
//! bytes (varied content and length, so neither the branch predictor nor
//! the hash sees one repeated input); reported times are per look-up.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use keyhome_ring::{KeyDigest, NodeId, Ring};

/// 64 keys, 16 to 32 bytes long.
fn keys() -> Vec<Vec<u8>> {
    (0..64u32)
        .map(|i| {
            let mut key = format!("tenant-{:02}/lock/{i:x}", i % 13).into_bytes();
            key.resize(16 + (i as usize * 7) % 17, b'.');
            key
        })
        .collect()
}

fn ring(n: u64) -> Ring {
    Ring::new(&(0..n).map(|i| NodeId(1 + i * 1_000_003)).collect::<Vec<_>>())
}

fn bench_home(c: &mut Criterion) {
    let keys = keys();
    let mut group = c.benchmark_group("home");
    for n in [3u64, 16, 64, 256] {
        let ring = ring(n);
        group.bench_with_input(BenchmarkId::from_parameter(n), &ring, |b, ring| {
            let mut next = keys.iter().cycle();
            b.iter(|| ring.home(black_box(next.next().map_or(&[][..], Vec::as_slice))));
        });
    }
    group.finish();
}

/// The same look-ups with the key hashed beforehand ([`KeyDigest`]): the per-member cost alone.
fn bench_home_of(c: &mut Criterion) {
    let digests: Vec<KeyDigest> = keys().iter().map(|k| KeyDigest::of(k)).collect();
    let mut group = c.benchmark_group("home_of");
    for n in [3u64, 16, 64, 256] {
        let ring = ring(n);
        group.bench_with_input(BenchmarkId::from_parameter(n), &ring, |b, ring| {
            let mut next = digests.iter().cycle();
            b.iter(|| ring.home_of(black_box(*next.next().unwrap_or(&digests[0]))));
        });
    }
    group.finish();
}

fn bench_homes(c: &mut Criterion) {
    let keys = keys();
    let mut group = c.benchmark_group("homes_k3");
    for n in [16u64, 256] {
        let ring = ring(n);
        group.bench_with_input(BenchmarkId::from_parameter(n), &ring, |b, ring| {
            let mut next = keys.iter().cycle();
            b.iter(|| ring.homes(black_box(next.next().map_or(&[][..], Vec::as_slice)), 3));
        });
    }
    group.finish();
}

criterion_group!(benches, bench_home, bench_home_of, bench_homes);
criterion_main!(benches);
