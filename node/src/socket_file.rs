//! The Unix socket files a node listens on (the local client socket, the HTTP API's socket):
//! placed for one run, never over another process's socket, and removed by their own run only.
//!
//! # Placement
//!
//! A node first takes an exclusive `flock` on a lock file beside the socket (`<name>.lock`) and
//! keeps it for the run, so two nodes configured with one path never both place a socket there
//! (two that start at once and find the same stale socket would otherwise each remove what the
//! other had just placed). Then an existing file at the path is replaced only if it is a socket
//! whose connect is refused (nobody listens on it); a live socket, or one whose state cannot be
//! told, stops the start. The socket is bound under a random temporary name beside the path, given
//! its mode, then hard-linked into place, so it is never reachable with the mode the umask gave it
//! and never replaces a socket placed meanwhile.
//!
//! The lock file is left in place when the node stops: removing it would let a node that had
//! opened it just before lock a name that a third node can lock again under a new file.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Why a socket file could not be placed.
#[derive(Debug, thiserror::Error)]
pub enum SocketFileError {
    #[error("cannot listen on the Unix socket {path}: {source}")]
    Bind { path: PathBuf, source: io::Error },
    #[error("the Unix socket {0} is in use by another process (is this node already running?)")]
    InUse(PathBuf),
    #[error("{0} exists and is not a socket; refusing to replace it")]
    NotASocket(PathBuf),
    #[error("cannot tell whether the Unix socket {path} is in use ({source}); refusing to replace it")]
    Unknown { path: PathBuf, source: io::Error },
    #[error("cannot lock {path}, the lock file of a Unix socket: {source}")]
    Lock { path: PathBuf, source: io::Error },
}

/// A socket placed at its path for this run. When dropped, its name is removed if it still names
/// this socket, and the lock file is unlocked.
#[derive(Debug)]
pub(crate) struct SocketFile {
    path: PathBuf,
    /// The socket file's inode, so that a socket placed under the name since is left alone.
    inode: u64,
    /// Held locked (`flock`, exclusive) for as long as the socket is this run's.
    _lock: File,
}

impl SocketFile {
    /// Places a listening socket at `path` with permission bits `mode` (see the module docs).
    /// Must run inside a tokio runtime.
    pub(crate) fn bind(
        path: &Path,
        mode: u32,
    ) -> Result<(tokio::net::UnixListener, SocketFile), SocketFileError> {
        let bind_err = |source| SocketFileError::Bind { path: path.to_path_buf(), source };
        let lock = lock_beside(path)?;
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            if !meta.file_type().is_socket() {
                return Err(SocketFileError::NotASocket(path.to_path_buf()));
            }
            match std::os::unix::net::UnixStream::connect(path) {
                Ok(_) => return Err(SocketFileError::InUse(path.to_path_buf())),
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    std::fs::remove_file(path).map_err(bind_err)?;
                }
                Err(source) => return Err(SocketFileError::Unknown { path: path.to_path_buf(), source }),
            }
        }
        // A random name (nodes in other PID namespaces may share the directory), short (11
        // bytes), and never removed unless this bind created it.
        let random = std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), 0u8);
        let binding = path.with_file_name(format!(".kh{:08x}", random as u32));
        let listener = std::os::unix::net::UnixListener::bind(&binding).map_err(bind_err)?;
        // Linked, not renamed: a socket another process placed meanwhile is not replaced. Nothing
        // can fail once the link is made, so a failed bind leaves no socket at `path`.
        let placed = std::fs::symlink_metadata(&binding).map(|m| m.ino()).and_then(|inode| {
            std::fs::set_permissions(&binding, std::fs::Permissions::from_mode(mode))?;
            std::fs::hard_link(&binding, path).map(|()| inode)
        });
        let _ = std::fs::remove_file(&binding);
        let inode = match placed {
            Ok(inode) => inode,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                return Err(SocketFileError::InUse(path.to_path_buf()));
            }
            Err(e) => return Err(bind_err(e)),
        };
        let file = SocketFile { path: path.to_path_buf(), inode, _lock: lock };
        let listener =
            listener.set_nonblocking(true).and_then(|()| tokio::net::UnixListener::from_std(listener));
        Ok((listener.map_err(bind_err)?, file))
    }

    /// Where the socket is.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        if std::fs::symlink_metadata(&self.path).is_ok_and(|m| m.ino() == self.inode) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Opens (creating it, mode 0600, never through a symbolic link) and locks `<path>.lock`; a lock
/// another process holds is [`SocketFileError::InUse`].
fn lock_beside(path: &Path) -> Result<File, SocketFileError> {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".lock");
    let lock_path = path.with_file_name(name);
    let lock_err = |source| SocketFileError::Lock { path: lock_path.clone(), source };
    let file = crate::lockfile::open(&lock_path).map_err(lock_err)?;
    match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(file),
        Err(rustix::io::Errno::WOULDBLOCK) => Err(SocketFileError::InUse(path.to_path_buf())),
        Err(e) => Err(lock_err(e.into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<_> = std::fs::read_dir(dir)
            .expect("read_dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// The socket appears with its mode (bound under another name, then linked into place), a live
    /// one is left alone, and a stale one (nobody listens) is replaced.
    #[tokio::test]
    async fn a_socket_is_placed_with_its_mode_and_only_a_stale_one_is_replaced() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("node.sock");
        let (listener, file) = SocketFile::bind(&path, 0o640).expect("bind");
        let mode = std::fs::metadata(&path).expect("the socket").permissions().mode();
        assert_eq!(mode & 0o777, 0o640);
        assert_eq!(names(dir.path()), ["node.sock", "node.sock.lock"], "nothing left under the binding name");
        drop((listener, file));
        // A stale socket file: its process went without removing it.
        drop(std::os::unix::net::UnixListener::bind(&path).expect("a stale socket"));
        let (_listener, _file) = SocketFile::bind(&path, 0o600).expect("a stale socket is replaced");
    }

    /// A live socket is never replaced, whether or not its process placed it this way.
    #[tokio::test]
    async fn a_live_socket_is_left_alone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("node.sock");
        let _live = std::os::unix::net::UnixListener::bind(&path).expect("a live socket");
        assert!(matches!(SocketFile::bind(&path, 0o600), Err(SocketFileError::InUse(_))));
        assert!(std::os::unix::net::UnixStream::connect(&path).is_ok(), "the live socket is left");
    }

    /// While one run holds the name, another cannot place a socket there, even once the name is
    /// free: two nodes that both found one stale socket cannot each remove the other's.
    #[tokio::test]
    async fn a_held_name_is_not_placed_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("node.sock");
        let (_listener, first) = SocketFile::bind(&path, 0o600).expect("bind");
        // As if the second node's check had passed before the first placed its socket.
        std::fs::remove_file(&path).expect("removed by hand");
        assert!(matches!(SocketFile::bind(&path, 0o600), Err(SocketFileError::InUse(_))));
        // A name that now names another socket is left alone when the first goes.
        let other = std::os::unix::net::UnixListener::bind(&path).expect("another socket");
        drop(first);
        assert!(std::os::unix::net::UnixStream::connect(&path).is_ok(), "the other socket is left");
        drop(other);
        std::fs::remove_file(&path).expect("removed by hand");
        let (_listener, last) = SocketFile::bind(&path, 0o600).expect("the name is free again");
        drop(last);
        assert!(!path.exists(), "a run removes its own socket");
    }
}
