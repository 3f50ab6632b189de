//! `keyhome lock` with real processes: CMD never outlives the lock. In each test a first
//! `keyhome lock` runs a CMD that ignores or traps SIGTERM (and leaves a child that ignores it
//! too), something goes wrong under it (the wrapper is signalled, its node is killed or paused),
//! and a second `keyhome lock` of the key through another node runs a CMD that looks, the moment
//! it starts, whether the first CMD or its child is still alive.

use keyhome_sim::cluster as harness;

use std::path::PathBuf;
use std::process::{Child, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use harness::{Cluster, Options, PATIENCE, key_homed_on};
use keyhome::pki::Role;

/// Delegations of 4 s, so that a lock's `valid_for` (at least half of that) leaves room for a
/// 500 ms `--kill-after`.
fn options() -> Options {
    Options::with_delegation_lease(Duration::from_secs(4))
}

async fn started() -> Cluster {
    let cluster = Cluster::start(options());
    cluster.wait_ready(&cluster.ids(), 1).await;
    cluster
}

/// A `keyhome lock` process, killed if the test ends first.
struct Wrapper(Child);

impl Wrapper {
    /// Starts `keyhome lock KEY --ttl 3s --kill-after 500ms EXTRA… -- sh -c SCRIPT` through node
    /// `node`.
    fn start(cluster: &Cluster, node: u64, key: &str, extra: &[&str], script: &str) -> Wrapper {
        let profile = cluster.profile_file(&Role::Client("app".into()), node);
        let mut args = vec!["lock", key, "--profile", profile.to_str().unwrap()];
        args.extend(["--ttl", "3s", "--kill-after", "500ms", "--wait", "25s"]);
        args.extend(extra);
        args.extend(["--", "sh", "-c", script]);
        let child = cluster.cli_command(&args).stdout(Stdio::null()).spawn().expect("start keyhome lock");
        Wrapper(child)
    }

    fn signal(&self, signal: rustix::process::Signal) {
        let pid = rustix::process::Pid::from_raw(self.0.id() as i32).expect("a pid");
        rustix::process::kill_process(pid, signal).expect("signal keyhome lock");
    }

    /// Waits for the wrapper to exit, at most [`PATIENCE`].
    async fn exit(&mut self) -> ExitStatus {
        harness::eventually(PATIENCE, "keyhome lock exits", || std::future::ready(self.0.try_wait().unwrap()))
            .await
    }
}

impl Drop for Wrapper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Files the two CMDs write into.
struct Marks {
    dir: PathBuf,
}

impl Marks {
    fn new(cluster: &Cluster, name: &str) -> Marks {
        let dir = cluster.dir.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        Marks { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    fn read(&self, name: &str) -> Option<String> {
        std::fs::read_to_string(self.dir.join(name)).ok()
    }

    /// The first CMD: records the SIGTERM and SIGINT it receives (and otherwise ignores them),
    /// starts a child that ignores both, and writes both process ids.
    fn first(&self) -> String {
        format!(
            "trap 'echo TERM >> {sigs}' TERM; trap 'echo INT >> {sigs}' INT; \
             (trap '' TERM INT; exec sleep 120) & \
             echo $$ $! > {pids}.tmp && mv {pids}.tmp {pids}; \
             while :; do sleep 0.05; done",
            sigs = self.path("signals"),
            pids = self.path("pids"),
        )
    }

    /// The second CMD: records `overlap` if the first CMD or its child is alive (not a zombie)
    /// when it starts, and what it was told.
    fn second(&self) -> String {
        format!(
            "for p in $(cat {pids}); do \
                 s=$(awk '{{ print $3 }}' /proc/$p/stat 2>/dev/null); \
                 if [ -n \"$s\" ] && [ \"$s\" != Z ]; then echo overlap >> {overlap}; fi; \
             done; \
             echo \"$KEYHOME_RECOVERED\" > {started}",
            pids = self.path("pids"),
            overlap = self.path("overlap"),
            started = self.path("second-started"),
        )
    }

    /// Waits until the first CMD runs; the process ids of it and its child.
    async fn first_running(&self) -> Vec<i32> {
        harness::eventually(PATIENCE, "the first CMD runs", || {
            let pids =
                self.read("pids").map(|s| s.split_whitespace().filter_map(|p| p.parse().ok()).collect());
            std::future::ready(pids.filter(|p: &Vec<i32>| p.len() == 2))
        })
        .await
    }
}

/// Whether any of `pids` is alive (zombies are not).
fn alive(pids: &[i32]) -> bool {
    pids.iter().any(|pid| {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // pid (comm) state …; comm may hold spaces, so read the state after its ')'.
        stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()).is_some_and(|s| s != "Z")
    })
}

/// Checks the second CMD ran, saw no process of the first CMD's group alive, and was told
/// `recovered` as expected.
fn assert_no_overlap(marks: &Marks, recovered: bool) {
    assert_eq!(marks.read("overlap"), None, "the second CMD started while the first CMD (or its child) ran");
    let told = marks.read("second-started").expect("the second CMD ran");
    assert_eq!(told.trim(), if recovered { "1" } else { "0" }, "KEYHOME_RECOVERED of the second CMD");
}

fn code(status: ExitStatus) -> Option<i32> {
    status.code()
}

/// SIGTERM or SIGINT to the first wrapper: it passes the signal on, keeps the lock while CMD
/// ignores it, kills CMD's group after `--kill-after`, unlocks, and exits with CMD's status.
async fn signal_to_the_wrapper(signal: rustix::process::Signal, name: &str) {
    let cluster = started().await;
    let marks = Marks::new(&cluster, "marks");
    let mut first = Wrapper::start(&cluster, 1, "cmd/signal", &[], &marks.first());
    let pids = marks.first_running().await;
    let mut second = Wrapper::start(&cluster, 3, "cmd/signal", &[], &marks.second());
    first.signal(signal);
    let second_status = second.exit().await;
    assert_no_overlap(&marks, false);
    assert_eq!(code(second_status), Some(0), "{second_status}");
    let status = first.exit().await;
    assert!(!alive(&pids), "the first CMD or its child outlived its wrapper");
    assert_eq!(code(status), Some(128 + 9), "the first wrapper exits with CMD's status (SIGKILL): {status}");
    assert_eq!(marks.read("signals").as_deref().map(str::trim), Some(name), "CMD got the wrapper's signal");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_to_the_wrapper_is_passed_on_and_cmd_is_killed_inside_the_lock() {
    signal_to_the_wrapper(rustix::process::Signal::TERM, "TERM").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_to_the_wrapper_is_passed_on_and_cmd_is_killed_inside_the_lock() {
    signal_to_the_wrapper(rustix::process::Signal::INT, "INT").await;
}

/// The live processes whose parent is `parent` and whose name is `name`.
fn children_named(parent: u32, name: &str) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // pid (comm) state ppid …
            let Some((head, rest)) = stat.rsplit_once(')') else { return false };
            let comm = head.split_once('(').map_or("", |(_, comm)| comm);
            let mut fields = rest.split_whitespace();
            let (state, ppid) = (fields.next(), fields.next().and_then(|p| p.parse::<u32>().ok()));
            comm == name && state != Some("Z") && ppid == Some(parent)
        })
        .collect()
}

/// The `keyhome-guard` of the wrapper `wrapper` (once one runs other than `not`), checked to
/// show as `keyhome-guard` in its command line too.
async fn guard_of(wrapper: &Wrapper, not: Option<i32>) -> i32 {
    let guard = harness::eventually(PATIENCE, "the wrapper's guard runs", || {
        std::future::ready(
            children_named(wrapper.0.id(), "keyhome-guard").into_iter().find(|&p| Some(p) != not),
        )
    })
    .await;
    let line = std::fs::read(format!("/proc/{guard}/cmdline")).unwrap_or_default();
    assert_eq!(line.split(|&b| b == 0).next(), Some(&b"keyhome-guard"[..]), "the guard's command line");
    assert!(!line.windows(4).any(|w| w == b"lock"), "`pkill -f 'keyhome lock'` must not match the guard");
    guard
}

/// SIGKILL to the first wrapper, which can then do nothing itself: nothing of CMD's group runs
/// on. CMD dies with the wrapper (`PR_SET_PDEATHSIG`) and the wrapper's guard process kills the
/// rest of the group (the child CMD started, which ignores SIGTERM and SIGINT). The lock stays
/// held until the deadline the wrapper was told, and the second CMD finds nothing of the first
/// alive and is told `recovered`. With `to_the_guard_first`, the guard gets that signal before
/// the wrapper's SIGKILL, and the wrapper starts another.
async fn sigkill_to_the_wrapper(to_the_guard_first: Option<rustix::process::Signal>) {
    use std::os::unix::process::ExitStatusExt;
    let cluster = started().await;
    let marks = Marks::new(&cluster, "marks");
    let mut first = Wrapper::start(&cluster, 1, "cmd/sigkill", &[], &marks.first());
    let pids = marks.first_running().await;
    let mut guard = guard_of(&first, None).await;
    if let Some(signal) = to_the_guard_first {
        let pid = rustix::process::Pid::from_raw(guard).expect("a pid");
        rustix::process::kill_process(pid, signal).expect("signal the guard");
        guard = guard_of(&first, Some(guard)).await;
    }
    let mut second = Wrapper::start(&cluster, 3, "cmd/sigkill", &[], &marks.second());
    first.signal(rustix::process::Signal::KILL);
    let status = first.exit().await;
    assert_eq!(status.signal(), Some(9), "the first wrapper was killed: {status}");
    let second_status = second.exit().await;
    assert_no_overlap(&marks, true);
    assert_eq!(code(second_status), Some(0), "{second_status}");
    assert!(!alive(&pids), "the first CMD or its child outlived its wrapper");
    assert!(!alive(&[guard]), "the guard outlived the group it guards");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_to_the_wrapper_kills_cmd_and_all_of_its_group() {
    sigkill_to_the_wrapper(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_guard_is_replaced() {
    sigkill_to_the_wrapper(Some(rustix::process::Signal::KILL)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_guard_is_replaced() {
    sigkill_to_the_wrapper(Some(rustix::process::Signal::STOP)).await;
}

/// SIGSTOP to the first wrapper (as a debugger or a Ctrl-Z would stop it): it can do nothing at
/// the deadline, and its guard sends SIGKILL to CMD's group at the wrapper's own SIGKILL instant.
/// CMD first runs past its first deadline, so the guard must have followed the renewals. The
/// second CMD finds nothing of the first alive; resumed, the first wrapper says the lock was lost
/// (123). With `guard_stopped_first`, the guard is stopped (and replaced) first, so the
/// replacement must have been told the latest instant.
async fn stopped_wrapper(guard_stopped_first: bool) {
    let cluster = started().await;
    let marks = Marks::new(&cluster, "marks");
    let mut first = Wrapper::start(&cluster, 1, "cmd/stopped", &[], &marks.first());
    let pids = marks.first_running().await;
    let guard = guard_of(&first, None).await;
    // Past the first deadline (`--ttl 3s`): renewed, and the guard told so.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(alive(&pids), "CMD was stopped although its lock was renewed");
    if guard_stopped_first {
        let pid = rustix::process::Pid::from_raw(guard).expect("a pid");
        rustix::process::kill_process(pid, rustix::process::Signal::STOP).expect("stop the guard");
        guard_of(&first, Some(guard)).await;
    }
    let mut second = Wrapper::start(&cluster, 3, "cmd/stopped", &[], &marks.second());
    first.signal(rustix::process::Signal::STOP);
    let second_status = second.exit().await;
    assert_no_overlap(&marks, true);
    assert_eq!(code(second_status), Some(0), "{second_status}");
    assert!(!alive(&pids), "the first CMD or its child outlived the lock");
    first.signal(rustix::process::Signal::CONT);
    let status = first.exit().await;
    assert_eq!(code(status), Some(123), "the resumed wrapper says the lock was lost: {status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_wrapper_has_cmd_killed_by_its_guard_before_the_deadline() {
    stopped_wrapper(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_guard_is_replaced_by_one_told_the_latest_deadline() {
    stopped_wrapper(true).await;
}

/// The first wrapper's node fails under it (`fail` is given the cluster): the wrapper stops CMD
/// before the lock can pass on, exits 123, and the second CMD finds nothing of it alive.
async fn node_failure_under_cmd(fail: impl FnOnce(&mut Cluster), restore: impl FnOnce(&mut Cluster)) {
    let mut cluster = started().await;
    let marks = Marks::new(&cluster, "marks");
    // Homed on node 2, so that node 1 failing leaves the key's home alive.
    let key = String::from_utf8(key_homed_on("cmd/node", &[1, 2, 3], 2)).unwrap();
    let mut first = Wrapper::start(&cluster, 1, &key, &[], &marks.first());
    let pids = marks.first_running().await;
    fail(&mut cluster);
    let started = Instant::now();
    let mut second = Wrapper::start(&cluster, 3, &key, &[], &marks.second());
    let second_status = second.exit().await;
    assert_no_overlap(&marks, true);
    assert_eq!(code(second_status), Some(0), "{second_status} after {:?}", started.elapsed());
    let status = first.exit().await;
    assert!(!alive(&pids), "the first CMD or its child outlived its wrapper");
    assert_eq!(code(status), Some(123), "the lock was lost: {status}");
    assert!(marks.read("signals").is_some_and(|s| s.contains("TERM")), "CMD got SIGTERM before SIGKILL");
    restore(&mut cluster);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_under_a_running_cmd_stops_it_before_the_lock_passes_on() {
    node_failure_under_cmd(|cluster| cluster.kill(1), |_| {}).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_node_under_a_running_cmd_stops_it_before_the_lock_passes_on() {
    let signal = |cluster: &Cluster, signal| {
        let pid = rustix::process::Pid::from_raw(cluster.pid(1).expect("node 1 runs") as i32).unwrap();
        rustix::process::kill_process(pid, signal).expect("signal node 1");
    };
    node_failure_under_cmd(
        |cluster| signal(cluster, rustix::process::Signal::STOP),
        |cluster| {
            signal(cluster, rustix::process::Signal::CONT);
            let gone = cluster.exited();
            assert!(gone.is_empty(), "a paused and resumed node must keep running: {gone:?}");
        },
    )
    .await;
}

/// CMD's children are part of it: when CMD exits, the ones it left get SIGTERM, then SIGKILL,
/// and the lock is held until they are gone. The guard then leaves too (CMD waits for the test
/// to have seen it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn children_cmd_leaves_behind_are_stopped_before_the_unlock() {
    let cluster = started().await;
    let marks = Marks::new(&cluster, "marks");
    let script = format!(
        "(trap '' TERM; exec sleep 120) & echo $! > {}; while [ ! -e {} ]; do sleep 0.02; done; exit 5",
        marks.path("child"),
        marks.path("go")
    );
    let mut wrapper = Wrapper::start(&cluster, 1, "cmd/children", &[], &script);
    let guard = guard_of(&wrapper, None).await;
    std::fs::write(marks.path("go"), b"").unwrap();
    let status = wrapper.exit().await;
    assert_eq!(code(status), Some(5), "CMD's own status: {status}");
    let child: i32 = marks.read("child").expect("the child's pid").trim().parse().unwrap();
    assert!(!alive(&[child]), "CMD's child outlived the lock");
    harness::eventually(PATIENCE, "the guard leaves", || {
        std::future::ready((!alive(&[guard])).then_some(()))
    })
    .await;
}

/// A recall cuts CMD short inside the lock (renewals no longer extend it: SIGTERM, then SIGKILL
/// before the deadline). The first wrapper exits 123 and does not unlock: the second CMD starts
/// only once the lock ran out, and is told `recovered`, since the first CMD may have stopped
/// halfway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cmd_cut_short_by_a_recall_hands_on_recovered() {
    let cluster = started().await;
    let marks = Marks::new(&cluster, "marks");
    let mut first = Wrapper::start(&cluster, 1, "cmd/recalled", &[], &marks.first());
    let pids = marks.first_running().await;
    let mut second = Wrapper::start(&cluster, 3, "cmd/recalled", &[], &marks.second());
    let second_status = second.exit().await;
    assert_no_overlap(&marks, true);
    assert_eq!(code(second_status), Some(0), "{second_status}");
    let status = first.exit().await;
    assert!(!alive(&pids), "the first CMD or its child outlived its wrapper");
    assert_eq!(code(status), Some(123), "the first wrapper cut CMD short: {status}");
}

/// The statuses that are keyhome's own, and the handoff note.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_statuses_and_the_handoff_note() {
    let cluster = started().await;
    let profile = cluster.profile_file(&Role::Client("app".into()), 1);
    let profile = profile.to_str().unwrap();
    let lock = |extra: &[&str], cmd: &[&str]| {
        let mut args = vec!["lock", "cmd/status", "--profile", profile];
        args.extend(extra);
        args.push("--");
        args.extend(cmd);
        cluster.cli(&args)
    };
    // 124: not locked within --wait (someone else holds it).
    let held = cluster.client(2).await.lock(b"cmd/status", Duration::from_secs(20), PATIENCE).await.unwrap();
    let out = lock(&["--wait", "300ms"], &["true"]);
    assert_eq!(out.status.code(), Some(124), "{out:?}");
    held.unlock(None).await.unwrap();
    // 127: no such command; 126: not executable.
    let out = lock(&[], &["/nonexistent/keyhome-test-command"]);
    assert_eq!(out.status.code(), Some(127), "{out:?}");
    let out = lock(&[], &[cluster.dir.join("genesis.toml").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(126), "{out:?}");
    // 125: --kill-after leaves no room within --ttl; a usage error.
    let out = lock(&["--ttl", "1s", "--kill-after", "1s"], &["true"]);
    assert_eq!(out.status.code(), Some(125), "{out:?}");
    let out = lock(&["--ttl", "soon"], &["true"]);
    assert_eq!(out.status.code(), Some(125), "{out:?}");
    // CMD writes the note into KEYHOME_NOTE_FILE; the next holder reads it in KEYHOME_NOTE.
    let note_file = cluster.dir.join("note");
    let note_path = note_file.to_str().unwrap();
    let out = lock(&["--note-file", note_path], &["sh", "-c", "printf 'row 12' > \"$KEYHOME_NOTE_FILE\""]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let seen = cluster.dir.join("seen");
    let script = format!("printf %s \"$KEYHOME_NOTE\" > '{}'", seen.display());
    let out = lock(&["--note", "from the CLI"], &["sh", "-c", &script]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert_eq!(std::fs::read_to_string(&seen).unwrap(), "row 12");
    let out = lock(&[], &["sh", "-c", &script]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert_eq!(std::fs::read_to_string(&seen).unwrap(), "from the CLI");
}
