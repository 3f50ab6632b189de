//! Lock files: a file whose `flock` one process holds while it uses what the file stands for (a
//! Unix socket's name, a cluster directory's shared files).

use std::fs::File;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Opens the lock file at `path`, creating it with mode 0600, never through a symbolic link.
pub(crate) fn open(path: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}
