//! Operator changes of the membership, as every API proposes them: the node checks a change
//! before it proposes it, whoever asks (the CLI, the client API over QUIC or the local socket,
//! HTTP, an embedding program), so that a typo or a mix-up cannot leave a cluster stuck.
//!
//! Unless the [`Proposal`] is forced, a change is refused when
//! - it adds a member (or moves a member's id to a new node) that does not answer at its address
//!   with its own certificate: the handshake from this node proves the id ([`ProposalError::NotAnswering`]);
//! - the epoch it makes would lack a majority of members this node reaches now (itself, its
//!   connected peers, and a new member that just answered): that epoch could neither serve its
//!   keys nor agree on another change, and only its missing members coming back, or an unsafe
//!   recovery, would end it ([`ProposalError::NoMajority`]).
//!
//! The checks are advice taken at one instant, not part of the agreement: a peer may go down
//! right after them. What the epoch core itself refuses (an address a member has, removing the
//! last member) it refuses whether forced or not.

use std::sync::Arc;
use std::time::Duration;

use keyhome_epoch::{Change, Member, NodeId, ProposeError};
use tokio::sync::oneshot;

use crate::runtime::Shared;
use crate::wire::Proposal;

/// How long a new member may take to answer the handshake that proves its id.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a membership change was not made.
#[derive(Debug, thiserror::Error)]
pub enum ProposalError {
    #[error(
        "node {id} does not answer at {addr}: {reason}. Start it first (keyhome run --config …), check \
         the address, or force the change (`--force`; over HTTP \"force\": true; in Rust \
         `Proposal::forced`)"
    )]
    NotAnswering { id: NodeId, addr: String, reason: String },
    #[error(
        "after this change, epoch {epoch} would need {needed} of its members {} to answer, but node {node} \
         reaches only {reached} of them (unreachable: {}); it could then neither serve its keys nor change \
         again. Bring those members back first, check that this is the change you meant, or force it \
         (`--force`; over HTTP \"force\": true; in Rust `Proposal::forced`)",
        list(.members), list(.unreachable)
    )]
    NoMajority {
        epoch: u64,
        needed: usize,
        members: Vec<NodeId>,
        node: NodeId,
        reached: usize,
        unreachable: Vec<NodeId>,
    },
    #[error(transparent)]
    Epoch(#[from] ProposeError),
}

fn list(ids: &[NodeId]) -> String {
    ids.iter().map(|id| id.to_string()).collect::<Vec<_>>().join(", ")
}

/// Checks `proposal` (unless forced), proposes its change through this node and resolves with
/// the epoch that includes it. Fails [`ProposeError::Stopped`] if the node stops first.
pub(crate) async fn propose(shared: &Arc<Shared>, proposal: Proposal) -> Result<u64, ProposalError> {
    let Proposal { change, force } = proposal;
    if !force {
        check(shared, &change).await?;
    }
    let (tx, rx) = oneshot::channel();
    shared.propose_call(change, tx)?;
    Ok(rx.await.unwrap_or(Err(ProposeError::Stopped))?)
}

async fn check(shared: &Arc<Shared>, change: &Change) -> Result<(), ProposalError> {
    // A change the epoch core refuses (this node not a member, an address a member has, …) is
    // the core's to explain, when it is proposed: nothing is probed for it.
    let current = shared.core.current();
    if !current.is_member(shared.id) {
        return Ok(());
    }
    let Ok(next) = change.apply(&current) else { return Ok(()) };
    let probed = match change {
        // A member moved to a new address is started there once the epoch says so; its link to
        // the old address says whether it is reached now.
        Change::Replace { old, new } if *old == new.id => None,
        Change::Add(member) | Change::Replace { new: member, .. } => Some(member),
        Change::Remove(_) | Change::SetTiming(_) => None,
    };
    if let Some(Member { id, addr }) = probed {
        shared.probe(*id, addr, PROBE_TIMEOUT).await.map_err(|reason| ProposalError::NotAnswering {
            id: *id,
            addr: addr.clone(),
            reason,
        })?;
    }
    let reached = |id: NodeId| id == shared.id || Some(id) == probed.map(|m| m.id) || shared.connected(id);
    let (reachable, unreachable): (Vec<NodeId>, Vec<NodeId>) = next.member_ids().partition(|&id| reached(id));
    if reachable.len() >= next.majority() {
        return Ok(());
    }
    Err(ProposalError::NoMajority {
        epoch: next.number,
        needed: next.majority(),
        members: next.member_ids().collect(),
        node: shared.id,
        reached: reachable.len(),
        unreachable,
    })
}
