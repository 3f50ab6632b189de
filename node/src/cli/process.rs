//! Child processes of the CLI that must not outlive it.

/// Makes the process `command` starts get SIGKILL when this process dies, even by SIGKILL
/// (`PR_SET_PDEATHSIG`). The death signal follows the *thread* that spawns the child: spawn
/// from the runtime's main thread (the future `block_on` runs), which lives as long as the
/// process.
pub fn die_with_this_process(command: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
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
