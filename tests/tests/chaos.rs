//! Jepsen-style runs against real clusters (`keyhome_sim::chaos`): real `keyhome run` processes
//! behind UDP relays, clients locking through every node, a nemesis partitioning, dropping,
//! delaying, killing, pausing and removing nodes, and the checker judging the guarantees from
//! outside. Longer runs: the `keyhome-chaos` binary (docs/guarantees.md, "Chaos runs").

use std::time::Duration;

use keyhome_sim::chaos::{self, ChaosOptions};

/// Two short seeded runs, one of three nodes and one of five: no violation, and every key locks
/// again after the faults heal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_chaos_runs_break_no_guarantee() {
    for (seed, nodes) in [(1, 3), (2, 5)] {
        let mut options = ChaosOptions::new(seed, Duration::from_secs(20));
        options.nodes = nodes;
        options.history =
            std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("chaos-{seed}.history"));
        let report = chaos::run(&options).await;
        println!("{}", report.summary());
        assert!(report.admissions > 0 && report.faults.iter().sum::<u64>() > 0, "{}", report.summary());
        assert!(
            report.passed(),
            "{}\n{}",
            report.summary(),
            report.violations.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n")
        );
    }
}

/// The checker catches a node that gives a recalled delegation back while its local holder still
/// holds the key (`release-before-revoke`). Needs a `keyhome` built with the `bug-injection`
/// feature, which the test builds into target/bug-injection/ (a few minutes the first time), so
/// it is not part of the default suite:
/// `cargo test -p keyhome-sim --test chaos -- --ignored`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "builds a bug-injected node; run with --ignored"]
async fn the_checker_catches_release_before_revoke() {
    let mut options = ChaosOptions::new(3, Duration::from_secs(20));
    options.bug = Some("release-before-revoke".into());
    options.history = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("chaos-bug.history");
    let report = chaos::run(&options).await;
    println!("{}", report.summary());
    assert!(
        report.violations.iter().any(|v| v.kind == "overlap"),
        "the checker missed overlapping sections: {}",
        report.summary()
    );
}
