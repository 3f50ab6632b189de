//! Child processes of the CLI that must not outlive it.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;

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

/// Kills CMD's whole process group if this process dies while the group may still run.
///
/// [`die_with_this_process`] reaches only the process spawned: what that process starts in its
/// group (a shell's `sleep &`, a worker pool) would run on after this process was killed outright
/// (SIGKILL, the OOM killer), past the lock it was started under. The guard is a forked copy of
/// this process that only reads a socket (a `SOCK_SEQPACKET` pair). The socket's other end is
/// this process's and, until it execs, the child [`GroupGuard::arm`] prepared:
///
/// - before exec, that child makes its own process group and sends its pid, the group's id, so
///   the guard knows the group before anything in it runs;
/// - [`GroupGuard::disarm`] sends a zero: the group is empty, and the guard exits quietly;
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
}

/// The guard's name: `/proc/PID/comm`, and its command line.
const GUARD_NAME: &std::ffi::CStr = c"keyhome-guard";

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
        Ok(GroupGuard { tx, pid })
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
                send(BorrowedFd::borrow_raw(tx), rustix::process::getpid())
            });
        }
    }

    /// If the guard died (someone killed it), starts another for `group` and says so on stderr.
    pub fn replace_if_gone(&mut self, group: Pid) {
        if let Ok(None) = rustix::process::waitpid(Some(self.pid), WaitOptions::NOHANG) {
            return; // still running
        }
        let replaced = GroupGuard::start().and_then(|new| send(new.tx.as_fd(), group).map(|()| new));
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
                 be started ({e}): if this process is killed, CMD's group runs on",
                self.pid.as_raw_nonzero()
            ),
        }
    }

    /// CMD's group is empty (or was never started): the guard exits without signalling anything.
    pub fn disarm(self) {
        let _ = rustix::net::send(&self.tx, &0i32.to_ne_bytes(), SendFlags::NOSIGNAL);
    }
}

/// Tells the guard `group`'s id. One message of four bytes (the socket keeps its boundaries);
/// `EPIPE`, not SIGPIPE, if the guard is gone.
fn send(tx: BorrowedFd<'_>, group: Pid) -> std::io::Result<()> {
    match rustix::net::send(tx, &group.as_raw_nonzero().get().to_ne_bytes(), SendFlags::NOSIGNAL)? {
        4 => Ok(()),
        _ => Err(std::io::Error::other("short send to the guard of CMD's process group")),
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
        let mut group: libc::pid_t = 0;
        loop {
            let mut message = [0u8; 4];
            let n = libc::read(rx, message.as_mut_ptr().cast(), message.len());
            if n == 4 {
                match i32::from_ne_bytes(message) {
                    0 => libc::_exit(0),
                    pid => group = pid,
                }
            } else if n < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                // Not expected (every signal is blocked), but harmless.
                continue;
            } else {
                // End of file (or a socket that failed): nobody will disarm the guard.
                if group > 0 {
                    libc::kill(-group, libc::SIGKILL);
                }
                libc::_exit(0);
            }
        }
    }
}

/// Whether the process group `group` has no member left. `EPERM` (members this process may not
/// signal, such as a set-user-ID program) is not empty.
pub fn group_is_empty(group: Pid) -> bool {
    matches!(rustix::process::test_kill_process_group(group), Err(Errno::SRCH))
}
