//! Child processes of the CLI that must not outlive it.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;

use keyhome::clock::boottime_nanos;
use rustix::io::Errno;
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
                return Err(std::io::Error::other("the parent process exited"));
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
/// that only waits on a socket (a `SOCK_SEQPACKET` pair) and a deadline. The socket's other end is
/// this process's and, until it execs, the child [`GroupGuard::arm`] prepared:
///
/// - before exec, that child makes its own process group and sends its pid, the group's id, so
///   the guard knows the group before anything in it runs;
/// - [`GroupGuard::kill_at`] sends the instant (on `CLOCK_BOOTTIME`, which both read) at which
///   the group must be gone: the guard sends SIGKILL to the group then, unless a later instant
///   came first;
/// - [`GroupGuard::disarm`] says the group is empty, and the guard exits quietly;
/// - end of file (every other end closed: this process died, or left without disarming) makes the
///   guard send SIGKILL to the group, then exit.
///
/// The guard blocks every signal but SIGKILL and SIGSTOP, which cannot be blocked. It runs in a
/// process group of its own (not the one a terminal or a `kill -- -PGID` of this process's job
/// signals), and it renames itself `keyhome-guard`, command line included (what `ps`, `pgrep -f`
/// and `pkill -f` match), so that a `pkill -9 -f 'keyhome lock'` does not kill it with this
/// process. If it dies anyway, [`GroupGuard::replace_if_gone`] starts another.
pub struct GroupGuard {
    /// This process's end of the socket (close-on-exec: CMD does not keep it).
    tx: OwnedFd,
    /// The guard's pid.
    pid: Pid,
    /// The last instant sent with [`GroupGuard::kill_at`], for a replacement.
    kill_at: Option<u64>,
}

/// The guard's name: `/proc/PID/comm`, and its command line.
const GUARD_NAME: &std::ffi::CStr = c"keyhome-guard";

/// Longest wait of the guard between two readings of the clock, so that a deadline passed during
/// a suspend is noticed soon after the resume (its timeouts are counted on a clock that stops).
const GUARD_MAX_WAIT_MS: u64 = 250;

/// What the guard is told: one message per `send`, kept whole by the socket.
enum Message {
    /// CMD's process group.
    Group(Pid),
    /// Kill the group at this `CLOCK_BOOTTIME` reading, in nanoseconds.
    KillAt(u64),
    /// The group is empty: exit.
    Disarm,
}

/// The length of an encoded [`Message`]: a tag, then a value.
const MESSAGE_LEN: usize = 12;

impl Message {
    fn encode(&self) -> [u8; MESSAGE_LEN] {
        let (tag, value) = match *self {
            Message::Group(pid) => (1u32, pid.as_raw_nonzero().get() as u64),
            Message::KillAt(at) => (2, at),
            Message::Disarm => (3, 0),
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
            _ => None,
        }
    }

    /// Sends it; `EPIPE`, not SIGPIPE, if the guard is gone.
    fn send(&self, tx: BorrowedFd<'_>) -> std::io::Result<()> {
        match rustix::net::send(tx, &self.encode(), SendFlags::NOSIGNAL)? {
            MESSAGE_LEN => Ok(()),
            _ => Err(std::io::Error::other("short send to the guard of CMD's process group")),
        }
    }
}

impl GroupGuard {
    /// Forks a guard. Call it from the thread that spawns CMD, before spawning it.
    pub fn start() -> std::io::Result<GroupGuard> {
        let (tx, rx) =
            rustix::net::socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?;
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
                guard(rx.as_raw_fd(), tx.as_raw_fd(), title);
            }
            let forked = if pid > 0 { Ok(pid) } else { Err(std::io::Error::last_os_error()) };
            libc::pthread_sigmask(libc::SIG_SETMASK, &before, std::ptr::null_mut());
            forked?
        };
        let pid = Pid::from_raw(pid).ok_or_else(|| std::io::Error::other("fork returned no pid"))?;
        Ok(GroupGuard { tx, pid, kill_at: None })
    }

    /// Makes the child `command` starts lead a process group of its own and tell the guard
    /// before it execs. Set [`die_with_this_process`] first: its check that this process still
    /// runs comes before. Spawning fails (`EPIPE`) if the guard is gone.
    pub fn arm(&self, command: &mut std::process::Command) {
        let tx = self.tx.as_raw_fd();
        command.process_group(0);
        // SAFETY: the closure makes only async-signal-safe system calls (setpgid, getpid, send);
        // `tx` stays open in this process until the spawn is over (`self` outlives the call).
        unsafe {
            command.pre_exec(move || {
                // `process_group(0)` did this already; whether before or after this closure
                // runs, the group the guard is told about is the one CMD leads.
                rustix::process::setpgid(None, None)?;
                Message::Group(rustix::process::getpid()).send(BorrowedFd::borrow_raw(tx))
            });
        }
    }

    /// The group must be gone by `at`, a [`boottime_nanos`] reading (the wrapper's own SIGKILL
    /// instant): replaces any earlier instant.
    pub fn kill_at(&mut self, at: u64) -> std::io::Result<()> {
        self.kill_at = Some(at);
        Message::KillAt(at).send(self.tx.as_fd())
    }

    /// If the guard died (someone killed it), starts another for `group` and says so on stderr.
    pub fn replace_if_gone(&mut self, group: Pid) {
        if let Ok(None) = rustix::process::waitpid(Some(self.pid), WaitOptions::NOHANG) {
            return; // still running
        }
        let replaced = GroupGuard::start().and_then(|mut new| {
            Message::Group(group).send(new.tx.as_fd())?;
            if let Some(at) = self.kill_at {
                new.kill_at(at)?;
            }
            Ok(new)
        });
        match replaced {
            Ok(new) => {
                eprintln!(
                    "keyhome lock: the guard of CMD's process group (pid {}) was killed; started another (pid {})",
                    self.pid.as_raw_nonzero(),
                    new.pid.as_raw_nonzero()
                );
                *self = new;
            }
            Err(e) => eprintln!(
                "keyhome lock: the guard of CMD's process group (pid {}) was killed, and no other could \
                 be started ({e}): if this process is killed or stopped, CMD's group runs on",
                self.pid.as_raw_nonzero()
            ),
        }
    }

    /// CMD's group is empty (or was never started): the guard exits without signalling anything.
    pub fn disarm(self) {
        let _ = Message::Disarm.send(self.tx.as_fd());
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

/// The guard's whole life (see [`GroupGuard`]); never returns. Only async-signal-safe calls: it
/// runs in a child forked from a process that may have other threads.
unsafe fn guard(rx: RawFd, tx: RawFd, title: std::ops::Range<usize>) -> ! {
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
        libc::close(tx);
        // Keeps no descriptor but its socket (not the caller's stdout, say). Best effort: the
        // guard is correct with them open, only holding them until it exits.
        let rx_n = rx as libc::c_long;
        if rx_n > 0 {
            libc::syscall(libc::SYS_close_range, 0 as libc::c_long, rx_n - 1, 0 as libc::c_long);
        }
        libc::syscall(libc::SYS_close_range, rx_n + 1, libc::c_uint::MAX as libc::c_long, 0 as libc::c_long);
        let mut group: Option<Pid> = None;
        let mut kill_at: Option<u64> = None;
        let kill_group = |group: Option<Pid>| {
            if let Some(group) = group {
                let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
            }
        };
        loop {
            let wait_ms = match kill_at {
                None => -1,
                Some(at) => {
                    let now = boottime_nanos();
                    if now >= at {
                        // The deadline passed with nobody moving it: the wrapper is stopped,
                        // or too late to do it itself.
                        kill_group(group);
                        kill_at = None;
                        continue;
                    }
                    ((at - now) / 1_000_000 + 1).min(GUARD_MAX_WAIT_MS) as libc::c_int
                }
            };
            let mut ready = libc::pollfd { fd: rx, events: libc::POLLIN, revents: 0 };
            match libc::poll(&mut ready, 1, wait_ms) {
                0 => continue,
                n if n < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) => continue,
                n if n < 0 => break,
                _ => {}
            }
            let mut message = [0u8; MESSAGE_LEN];
            let n = libc::read(rx, message.as_mut_ptr().cast(), MESSAGE_LEN);
            if n == MESSAGE_LEN as isize {
                match Message::decode(message) {
                    Some(Message::Group(pid)) => group = Some(pid),
                    Some(Message::KillAt(at)) => kill_at = Some(at),
                    Some(Message::Disarm) => libc::_exit(0),
                    None => break,
                }
            } else if n < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                // Not expected (every signal is blocked), but harmless.
                continue;
            } else {
                // End of file: nobody will disarm the guard.
                break;
            }
        }
        // End of file, or a socket that failed.
        kill_group(group);
        libc::_exit(0);
    }
}

/// Whether the process group `group` has no member left. `EPERM` (members this process may not
/// signal, such as a set-user-ID program) is not empty.
pub fn group_is_empty(group: Pid) -> bool {
    matches!(rustix::process::test_kill_process_group(group), Err(Errno::SRCH))
}
