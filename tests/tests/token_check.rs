//! `keyhome token check` against a cluster of real `keyhome run` processes: the README's tour,
//! through the real binary, with one exit status per answer.
//!
//! The key is homed on node 2, locked through node 1 (its holder) and checked through node 3, so
//! a check of the live delegation crosses the network twice more: the home's `Probe` to node 1,
//! and node 1's answer to node 3.

use std::path::Path;
use std::time::Duration;

use keyhome::pki::Role;
use keyhome_delegation::{FencingToken, Grantee};
use keyhome_sim::cluster::{self as harness, Cluster, Options, PATIENCE, key_homed_on};

/// `keyhome token check`'s exit statuses (docs/api.md).
const HELD_NOW: i32 = 0;
const ERROR: i32 = 1;
const USAGE: i32 = 2;
const SUPERSEDED: i32 = 5;
const NOT_HELD: i32 = 6;
const UNKNOWN_KEY: i32 = 7;

/// The token a `keyhome lock` command wrote to `path`, once it is there.
async fn token_in(path: &Path) -> FencingToken {
    harness::eventually(PATIENCE, &format!("a token in {}", path.display()), || {
        let token = std::fs::read_to_string(path).ok().and_then(|s| s.parse().ok());
        std::future::ready(token)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_check_tells_held_superseded_ended_and_unknown_apart() {
    // Delegations idle for up to 5 s are kept (6 s leases): the tour's locks, run one after the
    // other, re-lock under one delegation on node 1 unless one CLI call takes seconds.
    let mut options = Options::with_delegation_lease(Duration::from_secs(6));
    options.locks.idle_release_ms = 5000;
    let cluster = Cluster::start(options);
    cluster.wait_ready(&cluster.ids(), 1).await;
    let app = Role::Client("app".into());
    let via_1 = cluster.profile_file(&app, 1);
    let via_3 = cluster.profile_file(&app, 3);
    let (via_1, via_3) = (via_1.to_str().unwrap(), via_3.to_str().unwrap());
    let key = String::from_utf8(key_homed_on("orders", &[1, 2, 3], 2)).unwrap();
    let check = |token: &str| {
        let out = cluster.cli(&["token", "check", &key, token, "--profile", via_3]);
        (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
    };

    // `keyhome lock orders -- sh -c 'echo "token $KEYHOME_TOKEN"; …'`: the first token.
    let first = cluster.dir.join("first");
    let script = format!("printf %s \"$KEYHOME_TOKEN\" > '{}'", first.display());
    let out = cluster.cli(&["lock", &key, "--profile", via_1, "--", "sh", "-c", &script]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let t0 = token_in(&first).await;

    // A second lock of the key, held while the checks run.
    let second = cluster.dir.join("second");
    let script = format!("printf %s \"$KEYHOME_TOKEN\" > '{}'; exec cat", second.display());
    let holding = cluster.cli_background(&["lock", &key, "--profile", via_1, "--", "sh", "-c", &script]);
    let t1 = token_in(&second).await;
    assert_eq!(Grantee::of(t1), Grantee::of(t0), "a local re-lock under node 1's delegation: {t0} {t1}");
    assert_eq!(t1.local_seq, t0.local_seq + 1);

    let (code, text) = check(&t1.to_string());
    assert_eq!(code, Some(HELD_NOW), "the held token: {text}");
    assert!(text.contains("holds the lock now"), "{text}");
    // The home never heard of the re-lock; node 1, the holder, answers.
    let (code, text) = check(&t0.to_string());
    assert_eq!(code, Some(SUPERSEDED), "the first token after a local re-lock: {text}");
    assert!(text.contains("superseded"), "{text}");
    let never = FencingToken { local_seq: t1.local_seq + 1, ..t1 };
    assert_eq!(check(&never.to_string()).0, Some(NOT_HELD), "a token not issued yet");

    // Unlocked: the last token is no longer held (whether node 1 still holds the delegation and
    // answers, or has given it back and the home answers).
    assert!(holding.finish().success());
    let (code, text) = check(&t1.to_string());
    assert_eq!(code, Some(NOT_HELD), "{text}");
    assert!(text.contains("no longer holds"), "{text}");

    // A command that checks its own token while it holds the lock: `keyhome lock` passes on its
    // status.
    let binary = harness::keyhome_binary();
    let script =
        format!("exec '{}' token check '{key}' \"$KEYHOME_TOKEN\" --profile '{via_3}'", binary.display());
    let out = cluster.cli(&["lock", &key, "--profile", via_1, "--", "sh", "-c", &script]);
    assert_eq!(out.status.code(), Some(HELD_NOW), "{out:?}");

    // A key its home has no record of.
    let out = cluster.cli(&["token", "check", "never-locked", &t0.to_string(), "--profile", via_3]);
    assert_eq!(out.status.code(), Some(UNKNOWN_KEY), "{out:?}");

    // Errors keep their own statuses: a refusal (a token of an epoch no home has reached) and a
    // malformed token.
    let (code, _) = check(&FencingToken { epoch: 99, ..t0 }.to_string());
    assert_eq!(code, Some(ERROR));
    assert_eq!(check("1.2.3").0, Some(USAGE));
}
