//! Child processes of the CLI that must not outlive it.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;

use rustix::net::{AddressFamily, SendFlags, SocketFlags, SocketType};
use rustix::process::{Pid, WaitOptions};

/// Makes the process `command` starts get SIGKILL when this process dies, even by SIGKILL
/// (`PR_SET_PDEATHSIG`). The death signal follows the *thread* that spawns the child: spawn
/// from the runtime's main thread (the future `block_on` runs), which lives as long as the
/// process.
pub fn die_with_this_process(command: &mut std::process::Command) {
    let parent = rustix::process::getpid();
    // SAFETY: the closure makes only async-signal-safe system calls (prctl, getppid).
    unsafe {
        command.pre_exec(move || {
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))?;
            // This process may have died before the death signal was armed.
            if rustix::process::getppid() != Some(parent) {
                // ESRCH, not a message: nothing may allocate between fork and exec.
                return Err(rustix::io::Errno::SRCH.into());
            }
            Ok(())
        });
    }
}

/// Kills CMD's whole process group if this process dies, or stops, while the group may still run.
///
/// [`die_with_this_process`] reaches only the process spawned: what that process starts in its
/// group (a shell's `sleep &`, a worker pool) would run on after this process was killed outright
/// (SIGKILL, the OOM killer), past the lock it was started under; and a stopped wrapper (SIGSTOP,
/// Ctrl-Z, a debugger) stops nothing at the deadline. The guard is a forked copy of this process
/// that only waits on a socket (a `SOCK_SEQPACKET` pair) and a timer (a `timerfd` on
/// `CLOCK_BOOTTIME`, which counts through a suspend and fires as soon as the machine resumes).
/// The socket's other end is this process's and, until it execs, the child [`GroupGuard::arm`]
/// prepared:
///
/// - before exec, that child makes its own process group and sends its pid, the group's id, so
///   the guard knows the group before anything in it runs;
/// - [`GroupGuard::kill_at`] sends the instant (a `CLOCK_BOOTTIME` reading) by which the group
///   must be gone: the guard sends SIGKILL to the group then, unless a later instant came first
///   (it reads every message before it looks at the timer), and says so;
/// - [`GroupGuard::disarm`] says the group is empty, and the guard exits quietly; it returns
///   whether a guard said it killed the group;
/// - end of file (every other end closed: this process died, or left without disarming) makes the
///   guard send SIGKILL to the group, then exit.
///
/// The guard blocks every signal but SIGKILL and SIGSTOP, which cannot be blocked. It runs in a
/// process group of its own (not the one a terminal or a `kill -- -PGID` of this process's job
/// signals), and it renames itself `keyhome-guard`, command line included (what `ps`, `pgrep -f`
/// and `pkill -f` match), so that a `pkill -9 -f 'keyhome lock'` does not kill it with this
/// process. One that dies, stops, or cannot be told a new instant is replaced
/// ([`GroupGuard::check`]). This process never waits for it: every send is non-blocking.
pub struct GroupGuard {
    /// This process's end of the socket (close-on-exec: CMD does not keep it).
    sock: OwnedFd,
    /// The guard's pid, until it is reaped (never signalled after: the pid may be reused).
    pid: Option<Pid>,
    /// The last instant sent with [`GroupGuard::kill_at`], for a replacement.
    kill_at: Option<u64>,
    /// A guard (this one or one it replaced) said it killed the group at its instant.
    said_killed: bool,
    /// Guards killed to be replaced and not reaped yet (reaped without waiting, later).
    dying: Vec<Pid>,
    /// The last replacement failed and was reported; the next ones are tried quietly.
    failing: bool,
}

/// The guard's name: `/proc/PID/comm`, and its command line.
const GUARD_NAME: &std::ffi::CStr = c"keyhome-guard";

/// A message on the guard's socket, kept whole by it.
#[derive(Clone, Copy)]
enum Message {
    /// To the guard: CMD's process group.
    Group(Pid),
    /// To the guard: kill the group at this `CLOCK_BOOTTIME` reading, in nanoseconds.
    KillAt(u64),
    /// To the guard: the group is empty; exit.
    Disarm,
    /// From the guard: it killed the group at the instant it was given.
    Killed,
}

/// The length of an encoded [`Message`]: a tag, then a value.
const MESSAGE_LEN: usize = 12;

impl Message {
    fn encode(self) -> [u8; MESSAGE_LEN] {
        let (tag, value) = match self {
            Message::Group(pid) => (1u32, pid.as_raw_nonzero().get() as u64),
            Message::KillAt(at) => (2, at),
            Message::Disarm => (3, 0),
            Message::Killed => (4, 0),
        };
        let mut bytes = [0; MESSAGE_LEN];
        bytes[..4].copy_from_slice(&tag.to_le_bytes());
        bytes[4..].copy_from_slice(&value.to_le_bytes());
        bytes
    }

    fn decode(bytes: [u8; MESSAGE_LEN]) -> Option<Message> {
        let tag = u32::from_le_bytes(bytes[..4].try_into().ok()?);
        let value = u64::from_le_bytes(bytes[4..].try_into().ok()?);
        match tag {
            1 => Some(Message::Group(Pid::from_raw(i32::try_from(value).ok().filter(|&p| p > 0)?)?)),
            2 => Some(Message::KillAt(value)),
            3 => Some(Message::Disarm),
            4 => Some(Message::Killed),
            _ => None,
        }
    }

    /// Sends it without waiting: `EAGAIN` if the socket is full (a guard that does not read),
    /// `EPIPE`, not SIGPIPE, if the other end is gone.
    fn send(self, sock: BorrowedFd<'_>) -> std::io::Result<()> {
        match rustix::net::send(sock, &self.encode(), SendFlags::NOSIGNAL | SendFlags::DONTWAIT)? {
            MESSAGE_LEN => Ok(()),
            _ => Err(std::io::Error::other("short send on the socket of CMD's guard")),
        }
    }
}

impl GroupGuard {
    /// Forks a guard. Call it from the thread that spawns CMD, before spawning it.
    pub fn start() -> std::io::Result<GroupGuard> {
        let (sock, theirs) =
            rustix::net::socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?;
        let timer = rustix::time::timerfd_create(
            rustix::time::TimerfdClockId::Boottime,
            rustix::time::TimerfdFlags::CLOEXEC | rustix::time::TimerfdFlags::NONBLOCK,
        )?;
        let title = own_command_line().unwrap_or(0..0);
        // SAFETY: sigset_t is plain data, initialised by sigfillset / pthread_sigmask; between
        // fork and `_exit` the child runs `guard`, which makes only async-signal-safe calls.
        let pid = unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut before: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            // Blocked from before the fork, so that no handler of this process runs in the guard.
            libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut before);
            let pid = libc::fork();
            if pid == 0 {
                guard(
                    Fds { sock: theirs.as_raw_fd(), timer: timer.as_raw_fd(), ours: sock.as_raw_fd() },
                    title,
                );
            }
            let forked = if pid > 0 { Ok(pid) } else { Err(std::io::Error::last_os_error()) };
            libc::pthread_sigmask(libc::SIG_SETMASK, &before, std::ptr::null_mut());
            forked?
        };
        let pid = Pid::from_raw(pid).ok_or_else(|| std::io::Error::other("fork returned no pid"))?;
        Ok(GroupGuard {
            sock,
            pid: Some(pid),
            kill_at: None,
            said_killed: false,
            dying: Vec::new(),
            failing: false,
        })
    }

    /// Makes the child `command` starts lead a process group of its own and tell the guard
    /// before it execs. Set [`die_with_this_process`] first: its check that this process still
    /// runs comes before. Spawning fails (`ECONNRESET`, or `EPIPE`) if the guard is gone, and
    /// ([`GroupGuard::too_late`]) if `CLOCK_BOOTTIME` has reached `start_by` (nanoseconds, as
    /// [`BootClock::raw_nanos`](keyhome::clock::BootClock::raw_nanos) gives it) by the time the
    /// child would exec: CMD never starts after the instant it would be told to stop.
    pub fn arm(&self, command: &mut std::process::Command, start_by: u64) {
        let sock = self.sock.as_raw_fd();
        command.process_group(0);
        // SAFETY: the closure makes only async-signal-safe calls (setpgid, getpid, send, a vDSO
        // clock read); `sock` stays open in this process until the spawn is over (`self` outlives
        // the call).
        unsafe {
            command.pre_exec(move || {
                // `process_group(0)` did this already; whether before or after this closure
                // runs, the group the guard is told about is the one CMD leads.
                rustix::process::setpgid(None, None)?;
                Message::Group(rustix::process::getpid()).send(BorrowedFd::borrow_raw(sock))?;
                // Once the guard knows the group: a child held up past this check is killed
                // with it at the guard's instant.
                if keyhome::clock::BootClock::raw_now() >= start_by {
                    return Err(rustix::io::Errno::TIMEDOUT.into());
                }
                Ok(())
            });
        }
    }

    /// Whether `e`, from spawning a command [`GroupGuard::arm`] prepared, says that its
    /// `start_by` had passed when the child was about to exec (this process, or the child, was
    /// held up: stopped, or the machine suspended). The command did not run.
    pub fn too_late(e: &std::io::Error, start_by: u64) -> bool {
        // `execve` itself may fail with ETIMEDOUT (a file on a network filesystem): only a child
        // past `start_by` says this.
        e.raw_os_error() == Some(rustix::io::Errno::TIMEDOUT.raw_os_error())
            && keyhome::clock::BootClock::raw_now() >= start_by
    }

    /// Whether `e`, from spawning a command [`GroupGuard::arm`] prepared, says that the guard had
    /// ended (killed from outside) before the command could start: the child's message to it
    /// found the socket reset (`ECONNRESET`: the guard ended with messages unread) or closed
    /// (`EPIPE`). The command did not run.
    pub fn gone_before_spawn(e: &std::io::Error) -> bool {
        matches!(e.kind(), std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe)
    }

    /// The group must be gone by `at`, a `CLOCK_BOOTTIME` reading in nanoseconds (the
    /// wrapper's own SIGKILL instant): replaces any earlier instant. Fails if the guard cannot be
    /// told (gone, or not reading); [`GroupGuard::check`] then replaces it, telling the new one.
    pub fn kill_at(&mut self, at: u64) -> std::io::Result<()> {
        self.kill_at = Some(at);
        Message::KillAt(at).send(self.sock.as_fd())
    }

    /// Reads what the guard sent: whether it killed the group at its instant.
    fn read_word(&mut self) {
        let mut bytes = [0u8; MESSAGE_LEN];
        while let Ok((_, MESSAGE_LEN)) =
            rustix::net::recv(&self.sock, &mut bytes, rustix::net::RecvFlags::DONTWAIT)
        {
            self.said_killed |= matches!(Message::decode(bytes), Some(Message::Killed));
        }
    }

    /// Replaces the guard for `group` if it died, stopped, or (`stuck`) could not be told its
    /// last instant; says so on stderr. Never waits for a guard.
    pub fn check(&mut self, group: Pid, stuck: bool) {
        self.dying
            .retain(|&pid| matches!(rustix::process::waitpid(Some(pid), WaitOptions::NOHANG), Ok(None)));
        let why = match self
            .pid
            .map(|pid| rustix::process::waitpid(Some(pid), WaitOptions::NOHANG | WaitOptions::UNTRACED))
        {
            // One that failed to be replaced is tried again on every check: a stop is
            // reported once only.
            Some(Ok(None)) if !stuck && !self.failing => return,
            Some(Ok(None)) if stuck => "could not be told the lock's new deadline",
            Some(Ok(None)) => "could not be replaced before",
            Some(Ok(Some((_, status)))) if status.stopped() => "was stopped",
            // Reaped now (or gone before): its pid is free, and must not be signalled.
            Some(Ok(Some(_)) | Err(_)) => {
                self.pid = None;
                "was killed"
            }
            None => "could not be replaced",
        };
        // The new guard first: should none start, the old one (if it is only stuck, or stopped
        // and later continued) still kills the group at the instant it knows, never later.
        let replaced = GroupGuard::start().and_then(|mut new| {
            Message::Group(group).send(new.sock.as_fd())?;
            if let Some(at) = self.kill_at {
                new.kill_at(at)?;
            }
            Ok(new)
        });
        match replaced {
            Ok(mut new) => {
                if let Some(pid) = self.pid.take() {
                    // Still ours (not reaped): gone for good now that another has taken over;
                    // SIGKILL ends a stopped process too.
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                    self.dying.push(pid);
                }
                self.read_word(); // what it said, before its socket goes
                eprintln!(
                    "keyhome lock: the guard of CMD's process group {why}; started another (pid {})",
                    new.pid.map_or(0, |pid| pid.as_raw_nonzero().get())
                );
                new.said_killed = self.said_killed;
                new.dying = std::mem::take(&mut self.dying);
                *self = new;
            }
            Err(e) => {
                if !self.failing {
                    eprintln!(
                        "keyhome lock: the guard of CMD's process group {why}, and no other could be \
                         started ({e}): until one is, if this process is killed or stopped, CMD's group \
                         runs on"
                    );
                }
                self.failing = true;
            }
        }
    }

    /// CMD's group is empty (or was never started): the guard exits without signalling anything.
    /// Returns whether a guard said it killed the group at its instant (this process was held up
    /// past it).
    pub fn disarm(mut self) -> bool {
        // Read first: closing a socket with unread messages resets the guard's end before it
        // could read the disarm.
        self.read_word();
        let _ = Message::Disarm.send(self.sock.as_fd());
        self.said_killed
    }
}

/// Where this process's command line lies in its memory (`arg_start..arg_end` of
/// `/proc/self/stat`), for the guard to overwrite its copy; `None` without procfs.
fn own_command_line() -> Option<std::ops::Range<usize>> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // After the command name (in parentheses, and free to hold any character), fields 3 on.
    let mut fields = stat.rsplit_once(')')?.1.split_ascii_whitespace();
    let start = fields.nth(48 - 3)?.parse().ok()?;
    let end = fields.next()?.parse().ok()?;
    (start < end).then_some(start..end)
}

/// The guard's descriptors, as the fork left them.
struct Fds {
    /// Its end of the socket.
    sock: RawFd,
    /// The timer.
    timer: RawFd,
    /// The wrapper's end of the socket, to close.
    ours: RawFd,
}

/// The guard's whole life (see [`GroupGuard`]); never returns. Only async-signal-safe calls
/// (system calls through `libc`, no allocation, no lock): it runs in a child forked from a
/// process that may have other threads.
unsafe fn guard(fds: Fds, title: std::ops::Range<usize>) -> ! {
    // SAFETY: raw system calls on this process's own descriptors; `title` is this (forked)
    // process's own copy of the command-line strings, which nothing here reads; then `_exit`.
    unsafe {
        libc::prctl(libc::PR_SET_NAME, GUARD_NAME.as_ptr());
        if !title.is_empty() {
            let line = std::slice::from_raw_parts_mut(title.start as *mut u8, title.len());
            line.fill(0);
            let name = GUARD_NAME.to_bytes();
            let n = name.len().min(line.len() - 1);
            line[..n].copy_from_slice(&name[..n]);
        }
        libc::setpgid(0, 0);
        libc::close(fds.ours);
        // Keeps no descriptor but its socket and timer (not the caller's stdout, say). Best
        // effort: the guard is correct with them open, only holding them until it exits.
        let (low, high) = (fds.sock.min(fds.timer) as libc::c_long, fds.sock.max(fds.timer) as libc::c_long);
        for (first, last) in
            [(0, low - 1), (low + 1, high - 1), (high + 1, libc::c_uint::MAX as libc::c_long)]
        {
            if first <= last {
                libc::syscall(libc::SYS_close_range, first, last, 0 as libc::c_long);
            }
        }
        let mut group: Option<libc::pid_t> = None;
        // The timer fired for the instant last given, and the group was not killed yet.
        let mut due = false;
        let mut message = [0u8; MESSAGE_LEN];
        loop {
            // Every message first, so that an instant moved later in time is not missed.
            loop {
                let n = libc::recv(fds.sock, message.as_mut_ptr().cast(), MESSAGE_LEN, libc::MSG_DONTWAIT);
                if n == MESSAGE_LEN as isize {
                    match Message::decode(message) {
                        Some(Message::Group(pid)) => group = Some(pid.as_raw_nonzero().get()),
                        Some(Message::KillAt(at)) => {
                            // Setting the timer clears what it counted, and an instant already
                            // past makes it fire at once.
                            let value = libc::timespec {
                                tv_sec: (at / 1_000_000_000) as libc::time_t,
                                tv_nsec: (at % 1_000_000_000) as libc::c_long,
                            };
                            let spec = libc::itimerspec { it_interval: std::mem::zeroed(), it_value: value };
                            if libc::timerfd_settime(
                                fds.timer,
                                libc::TFD_TIMER_ABSTIME,
                                &spec,
                                std::ptr::null_mut(),
                            ) != 0
                            {
                                end(group);
                            }
                            due = false;
                        }
                        Some(Message::Disarm) => libc::_exit(0),
                        Some(Message::Killed) | None => end(group),
                    }
                } else if n < 0 && errno() == libc::EAGAIN {
                    break;
                } else if !(n < 0 && matches!(errno(), libc::EINTR | libc::ECONNRESET)) {
                    // (A reset is reported once, ahead of what is still queued, a disarm say.)
                    // End of file (nobody will disarm the guard), or a socket that failed.
                    end(group);
                }
            }
            let mut fired = 0u64;
            if libc::read(fds.timer, (&mut fired as *mut u64).cast(), 8) == 8 && fired > 0 {
                due = true;
            }
            if let (true, Some(group)) = (due, group) {
                // Said first, so that a wrapper that finds the group empty has the word too.
                let _ = Message::Killed.send(BorrowedFd::borrow_raw(fds.sock));
                libc::kill(-group, libc::SIGKILL);
                due = false;
            }
            let mut ready = [
                libc::pollfd { fd: fds.sock, events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: fds.timer, events: libc::POLLIN, revents: 0 },
            ];
            libc::poll(ready.as_mut_ptr(), 2, -1);
        }
    }
}

/// The guard's last act: SIGKILL to the group if it knows it, then exit.
fn end(group: Option<libc::pid_t>) -> ! {
    // SAFETY: a system call and `_exit`, async-signal-safe.
    unsafe {
        if let Some(group) = group {
            libc::kill(-group, libc::SIGKILL);
        }
        libc::_exit(0)
    }
}

/// This thread's `errno`, read without allocating.
fn errno() -> libc::c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Held by each test here while it forks. A fork by another test thread copies this test's
    /// socket, and until that child execs or its guard closes what it inherited, the copy keeps
    /// the socket open: a killed guard's socket could then take CMD's message, and CMD start.
    /// (`keyhome lock` forks from one thread; CI saw this race between the two tests once.)
    static FORKING: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// A guard killed before CMD starts fails the start: nothing would kill CMD's group if the
    /// wrapper died. (Checked able to fail: with `arm`'s message to the guard left out, CMD
    /// starts and this test fails.)
    #[test]
    fn cmd_does_not_start_once_its_guard_is_gone() {
        let _forking = FORKING.lock().unwrap_or_else(|e| e.into_inner());
        let mut guard = GroupGuard::start().expect("fork a guard");
        guard.kill_at(u64::MAX).expect("tell the guard an instant");
        let pid = guard.pid.expect("the guard's pid");
        rustix::process::kill_process(pid, rustix::process::Signal::KILL).expect("kill the guard");
        // Reaped only once it has exited, which closed its end of the socket.
        rustix::process::waitpid(Some(pid), WaitOptions::empty()).expect("reap the guard");
        let mut command = std::process::Command::new("true");
        guard.arm(&mut command, u64::MAX);
        match command.spawn() {
            Ok(mut child) => {
                let _ = child.wait();
                panic!("CMD started although its guard was gone");
            }
            Err(e) => assert!(GroupGuard::gone_before_spawn(&e), "an error that names the guard: {e}"),
        }
    }

    /// The same start with the guard alive: CMD runs, leading a process group of its own.
    #[test]
    fn cmd_starts_in_a_group_of_its_own_while_its_guard_runs() {
        let _forking = FORKING.lock().unwrap_or_else(|e| e.into_inner());
        let guard = GroupGuard::start().expect("fork a guard");
        let mut command = std::process::Command::new("true");
        guard.arm(&mut command, u64::MAX);
        let mut child = command.spawn().expect("CMD starts");
        let pid = Pid::from_raw(child.id() as i32).expect("a pid");
        assert_eq!(rustix::process::getpgid(Some(pid)).ok(), Some(pid), "CMD leads its own group");
        assert!(child.wait().expect("CMD ends").success());
        assert!(!guard.disarm(), "the guard killed nothing");
    }

    /// A child held up until its instant to start has passed (here: an instant already past
    /// when it is armed) fails to start: CMD never runs after the instant it would be told to
    /// stop, however long the wrapper was stopped between its own check and the spawn. (Checked
    /// able to fail: with the check left out of `arm`, CMD starts and this test fails.)
    #[test]
    fn cmd_does_not_start_once_its_time_is_up() {
        let _forking = FORKING.lock().unwrap_or_else(|e| e.into_inner());
        let guard = GroupGuard::start().expect("fork a guard");
        let dir = tempfile::tempdir().expect("tempdir");
        let ran = dir.path().join("ran");
        let mut command = std::process::Command::new("touch");
        command.arg(&ran);
        let start_by = keyhome::clock::BootClock::raw_now();
        guard.arm(&mut command, start_by);
        match command.spawn() {
            Ok(mut child) => {
                let _ = child.wait();
                panic!("CMD started after its instant to start");
            }
            Err(e) => assert!(GroupGuard::too_late(&e, start_by), "an error that says it was too late: {e}"),
        }
        assert!(!ran.exists(), "CMD did not run");
        guard.disarm();
    }
}
