//! Observability against a real cluster: `/metrics` parsed by Prometheus's own `promtool`, the
//! status page loaded in headless Chromium (DOM checked, screenshot saved), and `keyhome status`
//! naming unreachable members and stalled keys. Needs `promtool` and `chromium` on PATH (`.ci/run`
//! installs Debian's `prometheus` and `chromium`).

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use keyhome::pki::Role;
use keyhome_sim::cluster::{self as harness, Cluster, Options, PATIENCE, key_homed_on};

const TTL: Duration = Duration::from_secs(20);
/// Longest a browser run may take before the test fails.
const BROWSER_PATIENCE: Duration = Duration::from_secs(60);

/// Runs `command` to its end within `patience`, killing it past that; its stdout.
fn run_bounded(mut command: Command, patience: Duration) -> String {
    let mut child = command.stdout(Stdio::piped()).stderr(Stdio::null()).spawn().expect("start");
    let mut stdout = child.stdout.take().expect("piped stdout");
    let reader = std::thread::spawn(move || {
        let mut out = String::new();
        let _ = stdout.read_to_string(&mut out);
        out
    });
    let deadline = Instant::now() + patience;
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            assert!(status.success(), "{command:?} failed: {status}");
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{command:?} did not finish within {patience:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    reader.join().expect("reader")
}

/// Headless Chromium on `url`, with a fresh profile directory under `dir`; `what` is its
/// output flag (`--dump-dom`, `--screenshot=PATH`).
fn chromium(dir: &Path, url: &str, what: &str) -> String {
    let profile = tempfile::tempdir_in(dir).expect("browser profile dir");
    let mut command = Command::new("chromium");
    command.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1200,900",
    ]);
    command.arg(format!("--user-data-dir={}", profile.path().display())).arg(what).arg(url);
    run_bounded(command, BROWSER_PATIENCE)
}

/// Contends for `key` between nodes 1 and 2 (each lock but the first waits for a recall).
async fn contend(cluster: &Cluster, key: &[u8], rounds: usize) {
    let clients = [cluster.client(1).await, cluster.client(2).await];
    for round in 0..rounds {
        let lock = clients[round % 2].lock(key, TTL, PATIENCE).await.expect("lock");
        lock.unlock(None).await.expect("unlock");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_and_the_status_page_shows_the_live_cluster() {
    let mut cluster = Cluster::start(Options::default());
    cluster.wait_ready(&cluster.ids(), 1).await;
    contend(&cluster, b"orders", 6).await;

    // ---- /metrics, through Prometheus's own parser and linter ----
    let (code, classic) = cluster.http_get(1, "/metrics", "*/*");
    assert_eq!(code, 200, "{classic}");
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool (Debian package prometheus)");
    promtool.stdin.take().expect("stdin").write_all(classic.as_bytes()).expect("feed promtool");
    let checked = promtool.wait_with_output().expect("promtool");
    assert!(
        checked.status.success(),
        "promtool check metrics: {}{}\n{classic}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    for line in ["keyhome_epoch 1", "keyhome_member 1", "keyhome_peer_connected{peer=\"2\"} 1"] {
        assert!(classic.lines().any(|l| l == line), "{line:?} missing:\n{classic}");
    }
    let locks: u64 = (classic.lines())
        .find_map(|l| l.strip_prefix("keyhome_locks_total "))
        .and_then(|v| v.parse().ok())
        .expect("keyhome_locks_total");
    assert!(locks >= 3, "node 1 admitted {locks} locks");
    assert!(
        classic.lines().any(|l| l.starts_with("keyhome_lock_wait_seconds_count ") && !l.ends_with(" 0")),
        "node 1's locks after the first waited for a recall:\n{classic}"
    );
    let (code, openmetrics) = cluster.http_get(1, "/metrics", "application/openmetrics-text; version=1.0.0");
    assert_eq!(code, 200);
    assert!(openmetrics.ends_with("# EOF\n"), "OpenMetrics when asked for it");

    // ---- the hot key, in the status JSON ----
    let status = cluster.status(2).await;
    assert!(status.hot_keys.iter().any(|h| h.key == "orders" && h.waits > 0), "{:?}", status.hot_keys);
    let status = cluster.status(1).await;
    assert!(status.hot_keys.iter().any(|h| h.key == "orders" && h.recalls > 0), "{:?}", status.hot_keys);
    assert_eq!(status.recent_epochs.first().map(|e| e.epoch), Some(1), "the genesis epoch is logged");

    // ---- the status page in a real browser ----
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let url = format!("{}/", cluster.http_url(1));
    let dom = chromium(tmp, &url, "--dump-dom");
    assert!(dom.contains("keyhome node 1") && dom.contains("epoch 1"), "{dom}");
    for id in 1..=3 {
        assert!(dom.contains(&format!("data-member=\"{id}\"")), "member {id} missing: {dom}");
    }
    assert!(dom.contains("connected") && dom.contains("orders"), "{dom}");
    let shot = tmp.join("status-page.png");
    let _ = std::fs::remove_file(&shot);
    chromium(tmp, &url, &format!("--screenshot={}", shot.display()));
    let png = std::fs::read(&shot).expect("the screenshot was written");
    assert!(png.starts_with(b"\x89PNG"), "a PNG");
    println!("status page screenshot: {}", shot.display());

    // ---- a dead member: unreachable, and a key homed on it stalls ----
    cluster.kill(3);
    let stalled = key_homed_on("stall", &[1, 2, 3], 3);
    let key = String::from_utf8(stalled.clone()).expect("ascii key");
    let profile = cluster.profile_file(&Role::Client("app".into()), 1);
    let profile = profile.to_str().expect("utf-8 path");
    let waiter = cluster.cli_background(&["lock", "--profile", profile, "--wait", "60s", &key, "--", "true"]);
    let text = harness::eventually(PATIENCE, "node 1's status names the stalled key", || {
        let out = cluster.cli(&["status", "--profile", profile]);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        std::future::ready((text.contains("STALLED") && text.contains(&key)).then_some(text))
    })
    .await;
    assert!(text.contains("UNREACHABLE for"), "{text}");
    assert!(text.contains("keyhome epoch propose --remove 3"), "{text}");
    let dom = chromium(tmp, &url, "--dump-dom");
    assert!(dom.contains("unreachable for") && dom.contains("Stalled keys"), "{dom}");
    let dead = tmp.join("status-page-member-down.png");
    chromium(tmp, &url, &format!("--screenshot={}", dead.display()));
    println!("status page with node 3 down: {}", dead.display());

    // ---- the fix the status names: the key moves to a live home and its lock is admitted ----
    let operator = cluster.profile_file(&Role::Operator, 1);
    let out =
        cluster.cli(&["epoch", "propose", "--profile", operator.to_str().expect("utf-8"), "--remove", "3"]);
    assert!(out.status.success(), "propose: {}", String::from_utf8_lossy(&out.stderr));
    assert!(waiter.finish().success(), "the stalled lock was admitted once its key moved");
    let dom = chromium(tmp, &url, "--dump-dom");
    assert!(dom.contains("epoch 2") && !dom.contains("data-member=\"3\""), "{dom}");
    assert!(dom.contains("<td>2</td><td>1, 2</td>"), "the epoch change is listed: {dom}");
}
