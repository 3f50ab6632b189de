//! `keyhome lock KEY -- CMD…`: runs CMD while holding KEY's lock, and never lets CMD outlive it.
//!
//! # The deadline
//!
//! The wrapper plans against the lock's deadline `D` as the Rust client counts it
//! ([`ClientLock::deadline`]: the send instant of the latest lock or renewal request plus the
//! `valid_for` answered, on the boot clock). No other holder of the key is admitted before `D`.
//!
//! - Renewals go out every third of the time left before the SIGTERM instant below, each with a
//!   timeout; a renewal that fails, times out or does not move `D` later is retried, and moves
//!   nothing.
//! - Unless renewed, CMD gets SIGTERM at `D − kill_after − margin` and SIGKILL at `D − margin`
//!   (see [`Plan::new`]), so even a CMD that ignores SIGTERM is gone before `D`. When the lock is known to be over (the
//!   node says the handle is lost, or the connection to it ended) SIGTERM goes at once, SIGKILL
//!   `kill_after` later or at `D − margin`, whichever is first.
//!
//! The wrapper's guard process ([`GroupGuard`]) is told every `D − margin` and sends SIGKILL to
//! CMD's group then itself, so a wrapper that is stopped (SIGSTOP, Ctrl-Z, a debugger) past it
//! changes nothing. Only holding up both (stopping both, a frozen machine, which freezes CMD too
//! until it resumes, or CPU starvation of both but not CMD) or killing both can make CMD outlive
//! `D`: the fencing token is what protects a resource then.
//!
//! # CMD's process group
//!
//! CMD leads a process group of its own, and every signal goes to the whole group. The wrapper is
//! a child subreaper, so it reaps CMD's orphaned children too, and it holds (and renews) the lock
//! until the group is empty: when CMD exits and leaves children behind, they get SIGTERM, then
//! SIGKILL after `kill_after`. A process that leaves the group (`setsid`, `setpgid`) is not
//! followed. If the wrapper is killed outright, CMD dies with it (`PR_SET_PDEATHSIG`) and the
//! guard kills the rest of CMD's group at once.
//!
//! # Signals to the wrapper
//!
//! SIGTERM, SIGINT and SIGHUP are passed on to CMD's group as they are; the lock is kept and
//! renewed while CMD finishes; SIGKILL follows `kill_after` after the first of them.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use keyhome::client::{ClientError, ClientLock, Events};
use keyhome::clock::{BootClock, MAX_SLEEP};
use keyhome::duration::Human;
use keyhome::wire::{ClientEvent, ErrorKind, EventKind};
use keyhome_delegation::Limits;
use keyhome_epoch::Instant;
use rustix::process::{Pid, Signal, WaitOptions, WaitStatus};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::process::GroupGuard;

/// CMD was stopped because the lock was ending (not renewed in time, or lost), or, held up
/// until then, never started.
pub const EXIT_LOST: u8 = 123;
/// The lock was not taken within `--wait`; CMD did not run.
pub const EXIT_NOT_LOCKED: u8 = 124;
/// keyhome failed before CMD ran (bad options, profile, node unreachable, a refused lock).
pub const EXIT_ERROR: u8 = 125;
/// CMD was found but could not be run.
pub const EXIT_CANNOT_RUN: u8 = 126;
/// CMD was not found.
pub const EXIT_NOT_FOUND: u8 = 127;

/// How long giving back a lock CMD never ran under may take when the lock is ending anyway.
const GIVE_BACK_WITHIN: Duration = Duration::from_secs(1);
/// Shortest pause between two renewal attempts.
const MIN_RETRY: Duration = Duration::from_millis(20);

#[derive(Args)]
pub struct LockArgs {
    #[command(flatten)]
    pub profile: crate::ProfileArg,
    /// The key to lock (a key that starts with `-`: give it with --key).
    #[arg(value_parser = crate::parse_key, required_unless_present = "key_option")]
    pub key: Option<String>,
    /// The key to lock, for a key that starts with `-` (`--key -k`, `--key=-k`).
    #[arg(
        long = "key",
        id = "key_option",
        value_name = "KEY",
        value_parser = crate::parse_key,
        allow_hyphen_values = true,
        conflicts_with = "key"
    )]
    pub key_option: Option<String>,
    /// How long the lock lasts without renewal (the node may grant less: at most what is left of
    /// its delegation). Renewed while CMD runs.
    #[arg(long, default_value = "10s", value_parser = keyhome::duration::parse)]
    pub ttl: Duration,
    /// How long to wait for the lock; exit 124 if it was not taken by then.
    #[arg(long, default_value = "30s", value_parser = keyhome::duration::parse)]
    pub wait: Duration,
    /// How long CMD has between SIGTERM and SIGKILL [default: 1s, or a quarter of the time the
    /// lock is first granted for, if shorter]. Must leave room before the lock's deadline: keep
    /// it under half the delegation lease.
    #[arg(long, value_parser = keyhome::duration::parse)]
    pub kill_after: Option<Duration>,
    /// A handoff note for the key's next holder.
    #[arg(long, conflicts_with = "note_file")]
    pub note: Option<String>,
    /// A file whose contents (read when CMD is done, at most 4 KiB) are the handoff note; CMD
    /// finds its path in KEYHOME_NOTE_FILE. No file, no note.
    #[arg(long)]
    pub note_file: Option<PathBuf>,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// Runs `keyhome lock`; every failure of keyhome's own is [`EXIT_ERROR`].
pub async fn run(args: LockArgs) -> ExitCode {
    match lock(args).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("keyhome lock: {e}");
            ExitCode::from(EXIT_ERROR)
        }
    }
}

/// Shortest time kept between SIGKILL and the deadline.
const MIN_MARGIN: Duration = Duration::from_millis(50);
/// Shortest `--ttl`: room for the margin, a SIGTERM-to-SIGKILL pause and renewals between them.
pub const MIN_TTL: Duration = Duration::from_millis(200);
/// Longest default `--kill-after`.
const DEFAULT_KILL_AFTER: Duration = Duration::from_secs(1);

impl Plan {
    /// The timing for a lock first granted for `valid_for`: the margin kept between SIGKILL and
    /// the deadline (for the kill to land, and for timers that fire late) is a twentieth of it,
    /// 50 ms to 1 s; `kill_after` is as given, else 1 s or a quarter of `valid_for` if shorter.
    fn new(ttl: Duration, kill_after: Option<Duration>, valid_for: Duration) -> Plan {
        Plan {
            ttl,
            kill_after: kill_after.unwrap_or((valid_for / 4).min(DEFAULT_KILL_AFTER)),
            margin: (valid_for / 20).clamp(MIN_MARGIN, Duration::from_secs(1)),
        }
    }
}

/// The instant CMD must get SIGTERM unless the lock is renewed.
fn term_at(deadline: Instant, kill_after: Duration, margin: Duration) -> Instant {
    deadline - kill_after - margin
}

impl LockArgs {
    /// The key, given as the first argument or with `--key`.
    fn key(&self) -> &str {
        self.key.as_deref().or(self.key_option.as_deref()).unwrap_or_default()
    }
}

async fn lock(args: LockArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    if args.ttl < MIN_TTL {
        return Err(format!(
            "--ttl {} is too short: keyhome lock renews the lock while CMD runs and stops CMD before it \
             ends, which needs a --ttl of at least {} (the default is 10s)",
            Human(args.ttl),
            Human(MIN_TTL)
        )
        .into());
    }
    if let Some(kill_after) = args.kill_after
        && kill_after.saturating_add(MIN_MARGIN) >= args.ttl
    {
        return Err(format!(
            "--kill-after {} leaves no time within --ttl {}: give a longer --ttl or a shorter --kill-after",
            Human(kill_after),
            Human(args.ttl)
        )
        .into());
    }
    let key = args.key();
    let (program, rest) = args.command.split_first().ok_or("no command given")?;
    let client = crate::connect(&args.profile.profile).await?;
    let clock = client.clock();
    // The event stream opens beside the lock request, in the same round trip.
    let (held, events) = tokio::join!(client.lock(key.as_bytes(), args.ttl, args.wait), client.events());
    let mut held = match held {
        Ok(held) => held,
        Err(e) if e.kind() == Some(ErrorKind::Timeout) || matches!(e, ClientError::TimedOut { .. }) => {
            eprintln!("keyhome lock: {key:?} was not locked within {}: {e}", Human(args.wait));
            return Ok(ExitCode::from(EXIT_NOT_LOCKED));
        }
        Err(e) => return Err(e.into()),
    };
    let lost = match events {
        Ok(events) => watch_events(events, held.handle()),
        Err(e) => {
            let _ = held.give_back().await;
            return Err(e.into());
        }
    };
    let plan = Plan::new(args.ttl, args.kill_after, held.valid_for());
    if term_at(held.deadline(), plan.kill_after, plan.margin) <= clock.now() {
        // A delegation near its end: its holder node renews it once half of it is left. A renewal
        // that fails gives the lock back, as every failure before CMD runs does.
        if let Err(e) = held.renew(args.ttl).await {
            let _ = tokio::time::timeout(GIVE_BACK_WITHIN, held.give_back()).await;
            return Err(e.into());
        }
        if term_at(held.deadline(), plan.kill_after, plan.margin) <= clock.now() {
            let valid_for = held.valid_for();
            let _ = held.give_back().await;
            return Err(format!(
                "the lock is valid for only {}: no room for --kill-after {} plus a {} margin; use a \
                 shorter --kill-after (under half the delegation lease)",
                Human(valid_for),
                Human(plan.kill_after),
                Human(plan.margin)
            )
            .into());
        }
    }
    // What CMD's supervision needs; on failure, CMD does not run and the lock goes back at once.
    // The guard enforces the wrapper's own last instant for SIGKILL, should the wrapper stop.
    let prepared = Signals::new().and_then(|signals| {
        rustix::process::set_child_subreaper(Some(rustix::process::getpid()))?;
        let mut guard = GroupGuard::start()?;
        guard.kill_at(clock.raw_nanos(held.deadline() - plan.margin))?;
        Ok((signals, guard))
    });
    let (signals, guard) = match prepared {
        Ok(prepared) => prepared,
        Err(e) => {
            let _ = held.give_back().await;
            return Err(
                format!("cannot supervise CMD (signal handlers, subreaper, guard process): {e}").into()
            );
        }
    };
    let mut command = std::process::Command::new(program);
    command
        .args(rest)
        .env("KEYHOME_KEY", key)
        .env("KEYHOME_TOKEN", held.token().to_string())
        .env("KEYHOME_RECOVERED", if held.recovered() { "1" } else { "0" });
    match held.note().map(std::str::from_utf8) {
        Some(Ok(note)) => command.env("KEYHOME_NOTE", note),
        _ => command.env_remove("KEYHOME_NOTE"),
    };
    if let Some(path) = &args.note_file {
        command.env("KEYHOME_NOTE_FILE", path);
    }
    // The deadline was checked above, but this process may be stopped (or the machine suspended)
    // between that check and the spawn: the child checks again, once the guard knows its group.
    let start_by = clock.raw_nanos(term_at(held.deadline(), plan.kill_after, plan.margin));
    let leader = match spawn_in_group(command, &guard, start_by) {
        Ok(pid) => pid,
        Err(e) => {
            guard.disarm();
            if GroupGuard::too_late(&e, start_by) {
                eprintln!(
                    "keyhome lock: the lock on {key:?} was ending before CMD could start (keyhome lock \
                     was held up: stopped, or the machine suspended); CMD did not run"
                );
                let _ = tokio::time::timeout(GIVE_BACK_WITHIN, held.give_back()).await;
                return Ok(ExitCode::from(EXIT_LOST));
            }
            // keyhome's failure, not CMD's.
            if GroupGuard::gone_before_spawn(&e) {
                let _ = held.give_back().await;
                return Err(format!(
                    "the guard process of CMD's group ended before CMD started ({e}); CMD did not run"
                )
                .into());
            }
            let code = match e.kind() {
                std::io::ErrorKind::NotFound => EXIT_NOT_FOUND,
                _ => EXIT_CANNOT_RUN,
            };
            eprintln!("keyhome lock: cannot run {program:?}: {e}");
            let _ = held.give_back().await;
            return Ok(ExitCode::from(code));
        }
    };
    let mut group = Group { leader, status: None, guard: Some(guard), guard_killed: false };
    let outcome = supervise(&mut group, held, plan, clock, signals, lost).await;
    let status = group.status.map_or(ExitCode::FAILURE, exit_code);
    match outcome {
        Outcome { held, cut_short: Some(why) } => {
            eprintln!("keyhome lock: the lock on {key:?} was ending ({why}): CMD was stopped");
            // CMD may have stopped halfway: no unlock, which would tell the next holder of a clean
            // handoff. The lock runs out at its deadline (at most --kill-after and the margin after
            // the SIGTERM), and the next holder is told `recovered`.
            if let Some(held) = held {
                held.forget();
            }
            Ok(ExitCode::from(EXIT_LOST))
        }
        Outcome { held, cut_short: None } => {
            // CMD's status stands whatever the unlock does: CMD finished within the lock.
            let unlocked = match held {
                Some(held) => held.unlock(handoff_note(&args)).await.map_err(|e| e.to_string()),
                None => Err("the lock was lost".into()),
            };
            if let Err(e) = unlocked {
                eprintln!("keyhome lock: unlocking {key:?} failed: {e}");
            }
            Ok(status)
        }
    }
}

/// The note to leave: `--note`, or the contents of `--note-file` if CMD left one that fits.
fn handoff_note(args: &LockArgs) -> Option<Vec<u8>> {
    if let Some(note) = &args.note {
        return Some(note.clone().into_bytes());
    }
    let path = args.note_file.as_ref()?;
    let max = Limits::DEFAULT.max_note_len;
    match keyhome::readfile::bytes(path, max as u64) {
        Ok(Some(note)) => Some(note),
        Ok(None) => {
            eprintln!("keyhome lock: {} holds over the {max}-byte note limit: no note", path.display());
            None
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            eprintln!("keyhome lock: cannot read {}: {e}; no note", path.display());
            None
        }
    }
}

/// Watches the connection's event stream; the receiver yields why the lock is over when
/// `handle` expired, or when the stream (the connection) ends. The reading task owns the stream:
/// reading a frame is not cancel-safe.
fn watch_events(mut events: Events, handle: u64) -> LostEvents {
    let (tx, rx) = mpsc::channel(4);
    tokio::spawn(async move {
        loop {
            // A recall needs nothing here: renewals stop extending the lock, which the plan
            // already treats as failing renewals.
            let why = match events.next().await {
                Some(ClientEvent { handle: h, kind: EventKind::Expired, .. }) if h == handle => {
                    format!("handle {handle} expired")
                }
                Some(_) => continue,
                None => "the connection to the node ended".to_string(),
            };
            if tx.send(why).await.is_err() {
                return;
            }
        }
    });
    LostEvents { rx }
}

/// Loss reports from the node, see [`watch_events`].
struct LostEvents {
    rx: mpsc::Receiver<String>,
}

/// The signals the wrapper handles.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    child: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> std::io::Result<Signals> {
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            hup: signal(SignalKind::hangup())?,
            child: signal(SignalKind::child())?,
        })
    }
}

/// Starts `command` as the leader of a new process group, to die with this process, the whole
/// group guarded by `guard`, and only before `start_by` (see [`GroupGuard::arm`]).
fn spawn_in_group(
    mut command: std::process::Command,
    guard: &GroupGuard,
    start_by: u64,
) -> std::io::Result<Pid> {
    super::process::die_with_this_process(&mut command);
    guard.arm(&mut command, start_by);
    let child = command.spawn()?;
    // Reaped by `Group::reap`, not by `Child::wait`.
    Pid::from_raw(child.id() as i32).ok_or_else(|| std::io::Error::other("no process id"))
}

/// CMD's process group: its leader's pid (also the group id), once reaped its status, and its
/// guard until the group is empty.
struct Group {
    leader: Pid,
    status: Option<WaitStatus>,
    guard: Option<GroupGuard>,
    /// The guard said it killed the group at the SIGKILL instant (this process was held up).
    guard_killed: bool,
}

impl Group {
    /// Reaps every exited child of this process in the group; whether the group is now empty.
    /// The guard is disarmed the moment it is, and replaced while it is not if it died or stopped.
    fn reap(&mut self) -> bool {
        while let Ok(Some((pid, status))) = rustix::process::waitpgid(self.leader, WaitOptions::NOHANG) {
            if pid == self.leader {
                self.status = Some(status);
            }
        }
        // `EPERM` (members this process may not signal, such as a set-user-ID program) is not
        // empty: only `ESRCH` is.
        let empty = self.status.is_some()
            && matches!(rustix::process::test_kill_process_group(self.leader), Err(rustix::io::Errno::SRCH));
        if empty {
            if let Some(guard) = self.guard.take() {
                self.guard_killed = guard.disarm();
            }
        } else if let Some(guard) = &mut self.guard {
            guard.check(self.leader, false);
        }
        empty
    }

    fn signal(&self, signal: Signal) {
        let _ = rustix::process::kill_process_group(self.leader, signal);
    }

    /// Whether the guard killed the group at its instant while CMD still ran.
    fn killed_by_guard(&self) -> bool {
        let killed = self.status.and_then(WaitStatus::terminating_signal) == Some(libc::SIGKILL);
        self.guard_killed && killed
    }

    /// Tells the guard the group's new last instant (a raw boot-clock reading); a guard that
    /// cannot be told is replaced by one that is.
    fn kill_at(&mut self, at: u64) {
        if let Some(guard) = &mut self.guard
            && guard.kill_at(at).is_err()
        {
            guard.check(self.leader, true);
        }
    }
}

/// The timing the wrapper keeps.
#[derive(Clone, Copy)]
struct Plan {
    ttl: Duration,
    kill_after: Duration,
    margin: Duration,
}

/// How supervision ended, once CMD's group is empty.
struct Outcome {
    /// The lock, unless the renewal task holding it failed.
    held: Option<ClientLock>,
    /// Why keyhome signalled CMD because the lock was ending; `None`: CMD finished within the
    /// lock.
    cut_short: Option<String>,
}

type Renewal = JoinHandle<(ClientLock, Result<Result<Duration, ClientError>, tokio::time::error::Elapsed>)>;

/// Runs until CMD's group is empty, renewing the lock and signalling the group as the module
/// documentation says.
async fn supervise(
    group: &mut Group,
    held: ClientLock,
    plan: Plan,
    clock: BootClock,
    mut signals: Signals,
    mut lost_events: LostEvents,
) -> Outcome {
    let mut deadline = held.deadline();
    let mut idle = Some(held);
    let mut renewal: Option<Renewal> = None;
    let mut renew_at = next_renewal(clock.now(), deadline, plan);
    // Why the lock is over (no renewal can help any more), and whether keyhome signalled CMD
    // because the lock was ending.
    let mut lost: Option<String> = None;
    let mut cut_short: Option<String> = None;
    let mut term_sent: Option<Instant> = None;
    let mut killed = false;
    loop {
        let now = clock.now();
        if group.reap() {
            if cut_short.is_none() && group.killed_by_guard() {
                // This process was held up (stopped) past its SIGKILL instant, and the guard
                // killed CMD then (not a CMD that had exited, whose zombie the signal found).
                cut_short = Some(
                    "this process was held up past the lock's deadline: its guard killed CMD's group".into(),
                );
            }
            break;
        }
        // What is due now.
        let term_due = term_at(deadline, plan.kill_after, plan.margin);
        if term_sent.is_none() {
            let why = if let Some(why) = &lost {
                Some(why.clone())
            } else if now >= term_due {
                Some(format!(
                    "not renewed in time: SIGTERM is due {} before its deadline",
                    Human(plan.kill_after + plan.margin)
                ))
            } else if group.status.is_some() {
                // CMD exited and left children in its group: they go too.
                group.signal(Signal::TERM);
                term_sent = Some(now);
                None
            } else {
                None
            };
            if let Some(why) = why {
                group.signal(Signal::TERM);
                term_sent = Some(now);
                cut_short = Some(why);
            }
        }
        let last_kill = deadline - plan.margin;
        let kill_due = term_sent.map_or(last_kill, |t| (t + plan.kill_after).min(last_kill));
        if !killed && now >= kill_due {
            group.signal(Signal::KILL);
            killed = true;
            if now >= last_kill && cut_short.is_none() {
                cut_short = Some("its deadline was near".into());
            }
        }
        if lost.is_none()
            && renewal.is_none()
            && now >= renew_at
            && let Some(mut held) = idle.take()
        {
            let timeout = (term_due.saturating_duration_since(now) / 2).max(MIN_RETRY);
            let ttl = plan.ttl;
            renewal = Some(tokio::spawn(async move {
                let result = tokio::time::timeout(timeout, held.renew(ttl)).await;
                (held, result)
            }));
        }
        // Sleep until the next thing due, at most `MAX_SLEEP` (the boot clock is re-read on every
        // wake, so a suspend is noticed).
        let mut next = now + MAX_SLEEP;
        if term_sent.is_none() {
            next = next.min(term_due);
        }
        if !killed {
            next = next.min(kill_due);
        }
        if lost.is_none() && renewal.is_none() {
            next = next.min(renew_at);
        }
        tokio::select! {
            _ = tokio::time::sleep(clock.until(next)) => {}
            _ = signals.child.recv() => {}
            Some(why) = lost_events.rx.recv(), if lost.is_none() => lost = Some(why),
            joined = async { renewal.as_mut().expect("guarded").await }, if renewal.is_some() => {
                renewal = None;
                let now = clock.now();
                match joined {
                    Ok((held, result)) => {
                        match result {
                            Ok(Ok(_)) if held.deadline() > deadline => {
                                deadline = held.deadline();
                                renew_at = next_renewal(now, deadline, plan);
                                group.kill_at(clock.raw_nanos(deadline - plan.margin));
                            }
                            // Not extended (the delegation is due for renewal, or the key was
                            // recalled), timed out, or refused for now: try again soon.
                            Ok(Ok(_)) | Err(_) => renew_at = retry_at(now, deadline, plan),
                            Ok(Err(e)) if is_final(&e) => lost = Some(format!("renewal failed: {e}")),
                            Ok(Err(_)) => renew_at = retry_at(now, deadline, plan),
                        }
                        idle = Some(held);
                    }
                    Err(_) => lost = Some("the renewal task failed".into()),
                }
            }
            _ = signals.term.recv() => forward(group, Signal::TERM, &mut term_sent, now),
            _ = signals.int.recv() => forward(group, Signal::INT, &mut term_sent, now),
            _ = signals.hup.recv() => forward(group, Signal::HUP, &mut term_sent, now),
        }
    }
    // A renewal still in flight ends within its timeout and gives the lock back.
    if let Some(renewal) = renewal
        && let Ok((held, _)) = renewal.await
    {
        idle = Some(held);
    }
    Outcome { held: idle, cut_short }
}

/// Passes a signal the wrapper received on to CMD's group; SIGKILL follows `kill_after` after
/// the first.
fn forward(group: &Group, signal: Signal, term_sent: &mut Option<Instant>, now: Instant) {
    group.signal(signal);
    term_sent.get_or_insert(now);
}

/// When to renew after the deadline moved: a third of the way to the SIGTERM instant.
fn next_renewal(now: Instant, deadline: Instant, plan: Plan) -> Instant {
    now + term_at(deadline, plan.kill_after, plan.margin).saturating_duration_since(now) / 3
}

/// When to try again after a renewal that did not extend the lock.
fn retry_at(now: Instant, deadline: Instant, plan: Plan) -> Instant {
    now + (term_at(deadline, plan.kill_after, plan.margin).saturating_duration_since(now) / 4).max(MIN_RETRY)
}

/// Whether a renewal error means the lock is over: the node says so, or the connection is gone.
fn is_final(e: &ClientError) -> bool {
    e.kind() == Some(ErrorKind::Lost) || matches!(e, ClientError::Connection(_) | ClientError::Closed(_))
}

/// The exit status of a shell for `status`: the code, or 128 + the signal that killed it.
fn exit_code(status: WaitStatus) -> ExitCode {
    match (status.exit_status(), status.terminating_signal()) {
        (Some(code), _) => ExitCode::from(code.clamp(0, 255) as u8),
        (None, Some(signal)) => ExitCode::from((128 + signal).clamp(0, 255) as u8),
        _ => ExitCode::FAILURE,
    }
}
