//! The callers of pending locks: where the outcome of each goes, and what becomes of a lock whose
//! caller stopped waiting. The runtime runs this with tokio's one-shot channels as replies; the
//! simulation runs it with replies of its own, and interleaves a caller's going away with the
//! core's decision the way another thread of the runtime can.
//!
//! A caller that stops waiting (its lock future dropped: the client sent `Cancel`, closed its
//! connection, or an embedded caller gave up) first closes its reply and forgets its entry, then
//! calls [`withdraw`]; the core may decide the lock at any point in between. Every order ends
//! with the key given back, its handoff (note and `recovered` flag) passed on as if the handle
//! had never been admitted, never with a handle nobody holds:
//!
//! - decided before the reply was closed: the handle is in the reply, and [`withdraw`] gives it
//!   back;
//! - decided after the reply was closed or its entry forgotten: [`LockCallers::decided`] returns
//!   the handle, which the caller of the core gives back ([`give_back`]) once no part of the core
//!   is locked;
//! - not decided when [`withdraw`] runs: the core withdraws it and never decides it.
//!
//! Past the core, a lock answer is a message: `api::Undelivered` gives back one the transport
//! never took, and the Rust client gives back one that reached it after its caller left
//! (`Request::GiveBack`). An answer lost on its way keeps its key until the handle's deadline, as
//! any handle whose client left: one a QUIC or HTTP client's stream or connection dropped as the
//! node wrote it, or one a local connection lost in a failed write or in the moment its client
//! closed it (docs/api.md, "Sessions").

use std::collections::HashMap;

use keyhome_delegation::{Ending, Handle, LockError, Ticket};
use keyhome_epoch::Instant;

use super::{Core, Sink};

/// The outcome of a lock.
pub type LockResult = Result<Handle, LockError>;

/// Where one pending lock's outcome goes.
pub trait Reply {
    /// Hands `result` to the caller, or gives it back if the caller closed its end.
    fn send(self, result: LockResult) -> Result<(), LockResult>;
}

/// The callers waiting for pending locks, by ticket.
#[derive(Debug)]
pub struct LockCallers<R> {
    waiting: HashMap<Ticket, R>,
}

impl<R> Default for LockCallers<R> {
    fn default() -> Self {
        LockCallers { waiting: HashMap::new() }
    }
}

impl<R: Reply> LockCallers<R> {
    /// `ticket`'s caller waits for its outcome. Called under the lock of the shard that will
    /// decide it ([`Sink::lock_pending`]), so no outcome comes before its caller is known.
    pub fn wait(&mut self, ticket: Ticket, reply: R) {
        self.waiting.insert(ticket, reply);
    }

    /// The core decided `ticket` ([`super::Output::LockDone`]). Returns the admitted handle if
    /// its caller is gone: nothing was done under it, so it must be given back ([`give_back`])
    /// once no part of the core is locked.
    #[must_use = "a handle nobody holds must be given back"]
    pub fn decided(&mut self, ticket: Ticket, result: LockResult) -> Option<Handle> {
        let unclaimed = match self.waiting.remove(&ticket) {
            Some(reply) => reply.send(result).err(),
            None => Some(result),
        };
        unclaimed.and_then(Result::ok)
    }

    /// `ticket`'s caller stopped waiting: its reply is dropped; an outcome that comes later is
    /// unclaimed.
    pub fn forget(&mut self, ticket: Ticket) {
        self.waiting.remove(&ticket);
    }
}

/// What [`withdraw`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Withdrawn {
    /// The lock had been admitted into the caller's reply: the handle was given back.
    GivenBack,
    /// The lock was still undecided: the core withdrew it and will never decide it.
    Cancelled,
    /// Nothing was left to withdraw: the lock was refused, or the core decided it after the
    /// caller closed its reply (the handle, if admitted, was [`LockCallers::decided`]'s to give
    /// back).
    Decided,
}

/// Gives up the pending lock `ticket` of a caller that stopped waiting, once its reply is closed
/// and its entry forgotten: gives back the handle the reply held (`admitted`), or withdraws the
/// lock.
pub fn withdraw(
    core: &Core,
    now: Instant,
    ticket: Ticket,
    admitted: Option<LockResult>,
    out: &mut impl Sink,
) -> Withdrawn {
    match admitted {
        Some(Ok(handle)) => {
            give_back(core, now, handle, out);
            Withdrawn::GivenBack
        }
        // Refused before the caller left: nothing to give back, nothing pending.
        Some(Err(_)) => Withdrawn::Decided,
        None if core.cancel(now, ticket, out) => Withdrawn::Cancelled,
        None => Withdrawn::Decided,
    }
}

/// Ends `handle`, admitted for a caller that is gone, as if it had never been admitted: the next
/// holder gets its note and its `recovered` flag ([`Ending::GivenBack`]).
pub fn give_back(core: &Core, now: Instant, handle: Handle, out: &mut impl Sink) {
    // Nobody else knows the handle, so it is live unless it expired or the node stopped
    // meanwhile (a give-back fails for nothing else); the key is free either way.
    let _ = core.end(now, handle.id, Ending::GivenBack, out);
}
