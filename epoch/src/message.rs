//! Messages between epoch cores. Each carries the sender's current epoch number, so the side that
//! is behind notices and fetches what it missed.

use keyhome_ring::NodeId;
use serde::{Deserialize, Serialize};

use crate::paxos::{Ballot, Vote};
use crate::record::EpochRecord;

/// One message, as the driver encodes it on the wire. The sender is not a field: the driver knows
/// it from the authenticated connection.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Message {
    /// The sender's current epoch number.
    pub epoch: u64,
    pub body: Body,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Body {
    /// Phase 1a for epoch `slot`, sent to the members of epoch `slot - 1`.
    Prepare { slot: u64, ballot: Ballot },
    /// Phase 2a: accept `value` (whose number is `slot`) at `ballot`.
    Accept { slot: u64, ballot: Ballot, value: EpochRecord },
    /// An acceptor's answer to a prepare or an accept for `slot`.
    Vote { slot: u64, vote: Vote<EpochRecord> },
    /// An epoch that is chosen: broadcast by the proposer that saw it chosen, and the answer to
    /// catch-up requests, stale lease requests and prepares for decided slots.
    Chosen(EpochRecord),
    /// "My epoch is `Message::epoch`; send me the current one if yours is newer."
    CatchUp,
    /// A home lease request for the sender's current epoch; `seq` numbers the sender's attempts.
    LeaseRequest { seq: u64 },
    /// A vote for the lease request `seq`, valid only for the epoch the message carries.
    LeaseGrant { seq: u64 },
}

/// A message for one peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transmit {
    pub to: NodeId,
    pub message: Message,
}
