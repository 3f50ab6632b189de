//! Child processes of the CLI that must not outlive it.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;

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
/// this process, in a process group of its own, that only reads a pipe. The pipe's writers are
/// this process and, until it execs, the child [`GroupGuard::arm`] prepared:
///
/// - before exec, that child writes its pid, which is its group's id, so the guard knows the group
///   before anything in it runs;
/// - [`GroupGuard::disarm`] writes a zero: the group is empty, and the guard exits quietly;
/// - end of file (every write end closed: this process died, or left without disarming) makes the
///   guard send SIGKILL to the group, then exit.
///
/// Every signal but SIGKILL and SIGSTOP stays blocked in the guard, and it is in no group a
/// terminal or a `kill -- -PGID` of this process's job signals. Only a SIGKILL aimed at the guard
/// itself (or at every process, as an OOM kill of a whole cgroup does) leaves the group unguarded.
pub struct GroupGuard {
    /// The pipe's write end (close-on-exec: CMD does not keep it).
    tx: OwnedFd,
}

/// The guard's name in `ps` and `/proc/PID/comm`.
const GUARD_NAME: &std::ffi::CStr = c"keyhome-guard";

impl GroupGuard {
    /// Forks the guard. Call it from the thread that spawns CMD, before spawning it.
    pub fn start() -> std::io::Result<GroupGuard> {
        let (rx, tx) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
        // SAFETY: sigset_t is plain data, initialised by sigfillset / pthread_sigmask; between
        // fork and `_exit` the child runs `guard`, which makes only async-signal-safe calls.
        unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut before: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            // Blocked from before the fork, so that no handler of this process runs in the guard.
            libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut before);
            let pid = libc::fork();
            if pid == 0 {
                guard(rx.as_raw_fd(), tx.as_raw_fd());
            }
            let forked = if pid < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) };
            libc::pthread_sigmask(libc::SIG_SETMASK, &before, std::ptr::null_mut());
            forked?;
        }
        Ok(GroupGuard { tx })
    }

    /// Makes the child `command` starts tell the guard its pid before it execs. Set
    /// [`die_with_this_process`] first: its check that this process still runs comes before.
    pub fn arm(&self, command: &mut std::process::Command) {
        let tx = self.tx.as_raw_fd();
        // SAFETY: the closure makes only async-signal-safe system calls (getpid, write); `tx`
        // stays open in this process until the spawn is over (`self` outlives the call).
        unsafe {
            command.pre_exec(move || {
                let pid = rustix::process::getpid().as_raw_nonzero().get();
                send(BorrowedFd::borrow_raw(tx), pid)
            });
        }
    }

    /// CMD's group is empty (or was never started): the guard exits without signalling anything.
    pub fn disarm(self) {
        let _ = send(self.tx.as_fd(), 0);
    }
}

/// One message to the guard: a group's id, or 0 to disarm it. Four bytes, written at once
/// (a pipe never splits a write of up to `PIPE_BUF` bytes).
fn send(tx: BorrowedFd<'_>, message: i32) -> std::io::Result<()> {
    match rustix::io::write(tx, &message.to_ne_bytes())? {
        4 => Ok(()),
        _ => Err(std::io::Error::other("short write to the guard's pipe")),
    }
}

/// The guard's whole life (see [`GroupGuard`]); never returns. Only async-signal-safe calls: it
/// runs in a child forked from a process that may have other threads.
unsafe fn guard(rx: RawFd, tx: RawFd) -> ! {
    // SAFETY: raw system calls on this process's own descriptors, then `_exit`.
    unsafe {
        libc::prctl(libc::PR_SET_NAME, GUARD_NAME.as_ptr());
        libc::setpgid(0, 0);
        libc::close(tx);
        // Holds no descriptor but its pipe (not the caller's stdout, say). Best effort: the
        // guard is correct with them open, only lingering in them until it exits.
        let rx_u = rx as libc::c_uint;
        if rx_u > 0 {
            libc::syscall(libc::SYS_close_range, 0 as libc::c_uint, rx_u - 1, 0 as libc::c_uint);
        }
        libc::syscall(libc::SYS_close_range, rx_u + 1, libc::c_uint::MAX, 0 as libc::c_uint);
        let mut group: libc::pid_t = 0;
        loop {
            let mut message = [0u8; 4];
            let n = libc::read(rx, message.as_mut_ptr().cast(), message.len());
            if n == 4 {
                match i32::from_ne_bytes(message) {
                    0 => libc::_exit(0),
                    pid => group = pid,
                }
            } else if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            } else {
                // End of file (or a pipe that failed): nobody will disarm the guard.
                if group > 0 {
                    libc::kill(-group, libc::SIGKILL);
                }
                libc::_exit(0);
            }
        }
    }
}
