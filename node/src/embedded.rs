//! Embedded mode: a Rust program runs a [`Node`] in-process and locks through it directly, with
//! no loopback hop. A lock whose key's delegation this node holds is admitted under its key
//! shard's mutex alone, without any message or await; threads locking keys of different shards
//! share no lock and no written cache line (the guard borrows its node instead of counting a
//! reference to it).

use std::sync::Arc;
use std::time::Duration;

use keyhome_delegation::{CheckAnswer, Ending, FencingToken, LockError};
use tokio::sync::oneshot;

use crate::core::Owner;
use crate::proposal::ProposalError;
use crate::runtime::{Node, Shared};
use crate::status::Status;
use crate::wire::Proposal;

/// Why a token check failed.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error("the key's home did not answer within {}", crate::duration::Human(*.0))]
    Timeout(Duration),
}

impl Node {
    /// Locks `key` for `ttl` if that needs no message (this node holds the key's delegation and
    /// nobody holds the key locally); otherwise fails with [`LockError::WouldBlock`] and asks the
    /// key's home for the delegation in the background.
    #[inline]
    pub fn try_lock(&self, key: &[u8], ttl: Duration) -> Result<LockGuard<'_>, LockError> {
        let shared = &self.shared;
        // The guard is made once the core's call is over: the call's result stays a bare handle,
        // which the fast path moves fewer times (see docs/benchmarks.md, "embedded").
        let handle = shared.with_core(|core, now, out| core.try_lock(now, key, ttl, Owner::Embedded, out))?;
        Ok(LockGuard::new(shared, handle))
    }

    /// Locks `key` for `ttl`, waiting at most `wait` for it.
    pub async fn lock(&self, key: &[u8], ttl: Duration, wait: Duration) -> Result<LockGuard<'_>, LockError> {
        let handle = crate::runtime::lock_key(&self.shared, key, ttl, wait, Owner::Embedded).await?;
        Ok(LockGuard::new(&self.shared, handle))
    }

    /// Whether `key` is held with `token` now, and if not, whether it was superseded (see
    /// [`CheckAnswer`]). A refusal by the key's home fails with [`LockError::Refused`].
    pub async fn check(
        &self,
        key: &[u8],
        token: FencingToken,
        timeout: Duration,
    ) -> Result<CheckAnswer, CheckError> {
        let (tx, rx) = oneshot::channel();
        self.shared.check_call(key.to_vec(), token, timeout, tx)?;
        match rx.await {
            Ok(Some(Ok(answer))) => Ok(answer),
            Ok(Some(Err(refusal))) => Err(CheckError::Lock(LockError::Refused(refusal))),
            Ok(None) => Err(CheckError::Timeout(timeout)),
            Err(_) => Err(CheckError::Lock(LockError::Closed)), // the node stopped
        }
    }

    /// Proposes a membership change through this node, checked first unless forced (see
    /// [`crate::proposal`]: a plain [`keyhome_epoch::Change`] is checked); resolves with the epoch that includes
    /// it.
    pub async fn propose(&self, proposal: impl Into<Proposal>) -> Result<u64, ProposalError> {
        crate::proposal::propose(&self.shared, proposal.into()).await
    }

    /// The key shard `key` belongs to on this node (0 to the shard count, exclusive): keys of
    /// different shards lock on different threads without sharing a lock. The mapping holds for
    /// the life of this `Node` only: it is keyed with secrets drawn at each start.
    pub fn shard_of(&self, key: &[u8]) -> usize {
        self.shared.core.shard_index(key)
    }

    /// This node's status.
    pub fn status(&self) -> Status {
        self.shared.status()
    }

    /// The current epoch.
    pub fn epoch(&self) -> keyhome_epoch::EpochRecord {
        self.shared.core.current()
    }
}

/// A held lock, borrowing its node. Dropping it unlocks (without a note), except while its thread
/// panics: then the next holder is told `recovered`. [`LockGuard::unlock`] leaves a note.
#[must_use = "dropping the guard unlocks at once"]
pub struct LockGuard<'a> {
    shared: &'a Arc<Shared>,
    /// Kept whole: moved in one piece from the core's answer (its deadline as last renewed).
    handle: keyhome_delegation::Handle,
    done: bool,
}

impl<'a> LockGuard<'a> {
    #[inline]
    fn new(shared: &'a Arc<Shared>, handle: keyhome_delegation::Handle) -> LockGuard<'a> {
        LockGuard { shared, handle, done: false }
    }

    /// The fencing token to present to resources: greater than every earlier holder's.
    pub fn token(&self) -> FencingToken {
        self.handle.token
    }

    /// The previous holder's handoff note.
    pub fn note(&self) -> Option<&[u8]> {
        self.handle.note.as_deref()
    }

    /// The previous holder's delegation expired: it may have stopped halfway.
    pub fn recovered(&self) -> bool {
        self.handle.recovered
    }

    /// Time left before the lock must be renewed (zero once it has passed). Nothing takes the
    /// lock away before then; past it, the lock may be someone else's.
    pub fn valid_for(&self) -> Duration {
        self.shared.clock.until(self.handle.deadline)
    }

    /// Whether another node wants the key: the lock stays valid for [`LockGuard::valid_for`],
    /// renewals no longer extend it, and the holder should unlock as soon as it can.
    pub fn recalled(&self) -> bool {
        self.shared.core.recalled(self.shared.clock.now(), self.handle.id)
    }

    /// Extends the lock to `ttl` from now (bounded by its delegation); returns the time left.
    pub fn renew(&mut self, ttl: Duration) -> Result<Duration, LockError> {
        let handle = self.handle.id;
        let deadline = self.shared.with_core(|core, now, out| core.renew(now, handle, ttl, out))?;
        self.handle.deadline = deadline;
        Ok(self.valid_for())
    }

    /// Unlocks, leaving `note` for the next holder. A note longer than the node takes fails with
    /// [`LockError::NoteTooLarge`] and ends the lock as abandoned: the next holder is told
    /// `recovered`, with no note, since the handoff you meant did not happen.
    pub fn unlock(mut self, note: Option<Vec<u8>>) -> Result<(), LockError> {
        self.done = true;
        let handle = self.handle.id;
        self.shared.with_core(|core, now, out| {
            let result = core.end(now, handle, Ending::Unlocked(note), out);
            if let Err(LockError::NoteTooLarge) = result {
                let _ = core.end(now, handle, Ending::Abandoned, out);
            }
            result
        })
    }
}

impl Drop for LockGuard<'_> {
    /// Unlocks without a note; while the thread panics (the critical section stopped halfway),
    /// ends the lock as abandoned instead, so the next holder is told `recovered`.
    #[inline]
    fn drop(&mut self) {
        if !self.done {
            let handle = self.handle.id;
            let ending = if std::thread::panicking() { Ending::Abandoned } else { Ending::Unlocked(None) };
            let _ = self.shared.with_core(|core, now, out| core.end(now, handle, ending, out));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keyhome_epoch::{Change, ProposeError};

    const TTL: Duration = Duration::from_secs(60);
    const PATIENCE: Duration = Duration::from_secs(60);

    /// A node that stops by itself (here the persistence thread's path when a durable write
    /// fails) tells the lock call waiting on it, and every later one, that it closed, and a later
    /// operator change that it failed: none waits on a node that decides nothing more.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn callers_of_a_node_that_stopped_itself_are_told_it_closed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let timing = keyhome_epoch::Timing {
            home_lease: Duration::from_secs(2),
            max_delegation_lease: Duration::from_secs(5),
            clock_rate_ppm: 10_000,
        };
        let config = crate::setup::embedded_dev_node(dir.path(), timing).expect("layout");
        let node = Node::start(config).await.expect("node starts");
        let key = b"embedded/stopped";
        let held = node.lock(key, TTL, PATIENCE).await.expect("hold the key");
        let mut waiting = std::pin::pin!(node.lock(key, TTL, PATIENCE));
        let pending = std::future::poll_fn(|cx| {
            std::task::Poll::Ready(std::future::Future::poll(waiting.as_mut(), cx).is_pending())
        });
        assert!(pending.await, "the second lock waits");

        node.shared.write_failed(&"injected");
        let waited = tokio::time::timeout(PATIENCE, waiting).await.expect("the waiting lock is answered");
        assert!(matches!(waited, Err(LockError::Closed)), "{:?}", waited.err());
        let later = tokio::time::timeout(PATIENCE, node.lock(b"embedded/other", TTL, PATIENCE)).await;
        assert!(matches!(later, Ok(Err(LockError::Closed))), "a later lock: {:?}", later.map(|r| r.err()));
        let change = Change::SetTiming(keyhome_epoch::Timing { clock_rate_ppm: 20_000, ..timing });
        let proposed = tokio::time::timeout(PATIENCE, node.propose(change)).await;
        assert!(
            matches!(proposed, Ok(Err(ProposalError::Epoch(ProposeError::Stopped)))),
            "a later change: {proposed:?}"
        );
        assert!(node.failure().is_some_and(|f| f.contains("injected")));
        drop(held);
    }
}
