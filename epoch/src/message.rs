//! Messages between epoch cores. Each carries the sender's current epoch number, so the side that
//! is behind notices and fetches what it missed.

use keyhome_ring::NodeId;
use serde::{Deserialize, Serialize};

use crate::paxos::{Ballot, Vote};
use crate::record::{EpochRecord, MAX_EPOCH};

/// Largest ballot round a message may carry (2^62): a proposer outbids the highest round it has
/// seen by one, so rounds far below `u64::MAX` keep that from overflowing; no cluster runs 2^62
/// rounds.
pub const MAX_ROUND: u64 = 1 << 62;

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
    /// A home lease request for the sender's current epoch: attempt `seq` (1, 2, 3, …; 64 bits,
    /// never wraps) of the sender's run `incarnation`, so no vote for another run's or an
    /// earlier attempt's request can count.
    LeaseRequest { incarnation: u64, seq: u64 },
    /// A vote for that lease request, echoing its numbers, valid only for the epoch the message
    /// carries.
    LeaseGrant { incarnation: u64, seq: u64 },
}

/// Why a received message is dropped before it is looked at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MessageError {
    #[error("epoch or slot number {0} exceeds the largest, {MAX_EPOCH}")]
    EpochNumber(u64),
    #[error("ballot round {0} exceeds the largest, {MAX_ROUND}")]
    BallotRound(u64),
}

impl Message {
    /// Checks the numbers the core does arithmetic on: the epoch, slots and ballot rounds. (Records
    /// a message carries are checked with [`EpochRecord::validate`] where they are used.)
    pub fn validate(&self) -> Result<(), MessageError> {
        let epoch = |n: u64| if n > MAX_EPOCH { Err(MessageError::EpochNumber(n)) } else { Ok(()) };
        let ballot =
            |b: &Ballot| if b.round > MAX_ROUND { Err(MessageError::BallotRound(b.round)) } else { Ok(()) };
        epoch(self.epoch)?;
        match &self.body {
            Body::Prepare { slot, ballot: b } | Body::Accept { slot, ballot: b, .. } => {
                epoch(*slot)?;
                ballot(b)
            }
            Body::Vote { slot, vote } => {
                epoch(*slot)?;
                match vote {
                    Vote::Promise { ballot: b, accepted } => {
                        ballot(b)?;
                        accepted.as_ref().map_or(Ok(()), |(b, _)| ballot(b))
                    }
                    Vote::Accepted { ballot: b } => ballot(b),
                    Vote::Reject { ballot: b, promised } => ballot(b).and(ballot(promised)),
                }
            }
            Body::Chosen(_) | Body::CatchUp | Body::LeaseRequest { .. } | Body::LeaseGrant { .. } => Ok(()),
        }
    }
}

/// A message for one peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transmit {
    pub to: NodeId,
    pub message: Message,
}
