//! The embedded API (`keyhome::Node` run in-process) at the boundary its user sees: what a
//! `LockGuard` tells the key's next holder when it ends without a clean unlock.

use std::time::{Duration, Instant};

use keyhome::{Node, setup};
use keyhome_delegation::LockError;
use keyhome_epoch::Timing;
use keyhome_sim::cluster::PATIENCE;

const TTL: Duration = Duration::from_secs(60);

/// One node, its own keys' home, settled (home lease held, quarantine over).
async fn one_node(dir: &std::path::Path) -> Node {
    let timing = Timing {
        home_lease: Duration::from_secs(2),
        max_delegation_lease: Duration::from_secs(5),
        clock_rate_ppm: 10_000,
    };
    let config = setup::embedded_dev_node(dir, timing).expect("layout");
    let node = Node::start(config).await.expect("node starts");
    let started = Instant::now();
    while !{
        let s = node.status();
        s.home_lease_left.is_some() && s.quarantine_left.is_zero()
    } {
        assert!(started.elapsed() < PATIENCE, "the node did not settle");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    node
}

/// A guard dropped while its thread panics (the critical section stopped halfway) and an unlock
/// whose note the node refuses both end the lock at once, and the next holder is told
/// `recovered`, with no note; a guard dropped otherwise is a clean handoff.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_left_without_a_clean_unlock_tells_the_next_holder() {
    let dir = tempfile::tempdir().expect("tempdir");
    let node = one_node(dir.path()).await;
    let key = b"embedded/left";
    let lock = |why: &str| {
        let node = &node;
        let why = why.to_string();
        async move { node.lock(key, TTL, PATIENCE).await.unwrap_or_else(|e| panic!("{why}: {e}")) }
    };

    lock("first").await.unlock(Some(b"wal=1".to_vec())).expect("a clean unlock");
    let clean = lock("after a clean unlock").await;
    assert_eq!((clean.note(), clean.recovered()), (Some(&b"wal=1"[..]), false));
    drop(clean);
    let dropped = lock("after a drop").await;
    assert_eq!((dropped.note(), dropped.recovered()), (None, false), "a drop is a clean unlock");

    // The critical section panics with the guard held.
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        let _held = dropped;
        panic!("the critical section stopped halfway");
    }));
    assert!(panicked.is_err());
    let after_panic = node.try_lock(key, TTL).expect("the panic's guard ended the lock at once");
    assert_eq!((after_panic.note(), after_panic.recovered()), (None, true), "told of the panic");
    after_panic.unlock(Some(b"wal=2".to_vec())).expect("a clean unlock");

    let refused = lock("before a refused note").await;
    let too_large = vec![0u8; keyhome_delegation::Limits::default().max_note_len + 1];
    assert!(matches!(refused.unlock(Some(too_large)), Err(LockError::NoteTooLarge)));
    let after_refusal = node.try_lock(key, TTL).expect("the refused unlock ended the lock at once");
    assert_eq!((after_refusal.note(), after_refusal.recovered()), (None, true), "told of the lost note");
    drop(after_refusal);
    node.shutdown(Duration::from_millis(100)).await;
}
