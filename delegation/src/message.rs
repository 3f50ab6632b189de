//! Messages between a key's home and the nodes that hold or want its delegation.
//!
//! Every message carries the sender's current epoch number. Durations, never instants, cross the
//! wire: each side measures deadlines on its own clock.

use std::time::Duration;

use keyhome_epoch::NodeId;
use serde::{Deserialize, Serialize};

use crate::check::CheckAnswer;
use crate::token::FencingToken;

/// A key, as the application names it: at most [`crate::limits::Limits::max_key_len`] bytes.
pub type Key = Vec<u8>;

/// The part of a fencing token a home fixes when it grants: `(epoch, incarnation, counter)`.
/// The holder adds the local sequence number per admission.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Grantee {
    pub epoch: u64,
    pub incarnation: u64,
    pub counter: u64,
}

impl Grantee {
    /// The token of the `local_seq`-th admission under this delegation.
    pub fn token(self, local_seq: u64) -> FencingToken {
        FencingToken { epoch: self.epoch, incarnation: self.incarnation, counter: self.counter, local_seq }
    }

    /// The delegation `token` was admitted under.
    pub fn of(token: FencingToken) -> Grantee {
        Grantee { epoch: token.epoch, incarnation: token.incarnation, counter: token.counter }
    }
}

/// One message, as encoded on the wire. The sender is not a field: the driver knows it from the
/// authenticated connection.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// The sender's current epoch number.
    pub epoch: u64,
    pub body: Body,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Body {
    /// Holder → home: grant me `key` for `lease`; I wait at most `wait` from my send instant.
    /// `held` names the delegation the sender holds and wants renewed, if any.
    Request { key: Key, id: RequestId, lease: Duration, wait: Duration, held: Option<Grantee> },
    /// Home → holder: the delegation of `key`, valid for `lease` from the instant the holder
    /// sent request `id`. `note` is the previous holder's handoff note; `recovered` says the
    /// previous delegation ended by expiry, not by a clean release, so no note could be handed.
    /// A home also sets it whenever it cannot vouch that the previous delegation, if any, ended in
    /// a clean release with this note (see [`crate::home`]). A renewal (same `grantee` as the
    /// sender's `held`) carries no note and `recovered: false`.
    Grant {
        key: Key,
        id: RequestId,
        grantee: Grantee,
        lease: Duration,
        note: Option<Vec<u8>>,
        recovered: bool,
    },
    /// Home → requester: request `id` is refused.
    Refuse { key: Key, id: RequestId, reason: Refusal },
    /// Home → holder: someone is waiting; release `grantee` as soon as the local holder is done.
    /// `next`, when set, is a delegation the home has already granted to the requester that
    /// follows `grantee` in the key's chain: the holder passes it on directly with [`Body::Pass`]
    /// when it releases (see [`Successor`]). A successor is recalled this way as soon as the next
    /// one is granted ahead, before its own delegation reaches it.
    Recall { key: Key, grantee: Grantee, next: Option<Successor> },
    /// Holder → the requester a [`Successor`] names: the delegation the key's home granted it,
    /// passed on by the previous holder the instant it released, with that holder's handoff note
    /// and flag (as the home would have sent them in a `Grant`). The receiver takes it as a
    /// `Grant` from `home` for request `id`; a pass it cannot use goes back to `home` as a
    /// `Release`.
    Pass {
        key: Key,
        /// The home that granted it, which the receiver asked with request `id`.
        home: NodeId,
        id: RequestId,
        grantee: Grantee,
        lease: Duration,
        note: Option<Vec<u8>>,
        recovered: bool,
    },
    /// Holder → home: `grantee` is given back, with an optional handoff note for the next holder.
    /// Also how a grant that arrived too late to be useful is handed back. `note` and `recovered`
    /// are what the home records for the next grant: `recovered` says the next grant must be
    /// flagged recovered (the released delegation was itself granted `recovered` and never used,
    /// or it is a grant handed back after the sender's delegation expired). A hand-back of an
    /// unused grant passes on the `note` and `recovered` it received. `passed` names the
    /// [`Successor`] the holder sent a [`Body::Pass`] to, if it did: the home then sends no `Grant`
    /// (unless that successor reached its end at the home meanwhile; the home then grants the one
    /// after it, `recovered`).
    Release { key: Key, grantee: Grantee, note: Option<Vec<u8>>, recovered: bool, passed: Option<Grantee> },
    /// Anyone → home: is `key` held with `token` now, and if not, was it superseded? See
    /// [`crate::check`]. The home answers with `CheckReply`, or forwards a `Probe` to the holder
    /// of the live delegation `token` belongs to.
    Check { key: Key, id: u64, token: FencingToken },
    /// Home → holder: answer check `id` of `asker` about `token`, which belongs to the delegation
    /// of `key` the home believes the receiver holds. The receiver answers `asker` directly with
    /// `CheckReply`.
    Probe { key: Key, id: u64, token: FencingToken, asker: NodeId },
    /// Home or holder → asker: the answer to check `id`, or why the home refused it (the same
    /// refusals as a request's, but never `StaleEpoch` for the message's epoch: a check may
    /// come from anyone; `StaleEpoch` says the token is from an epoch the home has not learned).
    CheckReply { key: Key, id: u64, answer: Result<CheckAnswer, Refusal> },
    /// Old home → new home, after an epoch change moved `key` away from the sender: everything
    /// the sender knows of the key, so the new home need not wait out the old epoch's leases.
    ///
    /// The message's epoch is the epoch that moved the key; the sender was the key's home in the
    /// epoch just before it, and has stopped granting the key. `live` is the delegation that may
    /// still be live, if any; when it is `Some`, `note`, `recovered` and `lock_delay` are
    /// meaningless (they are decided by how that delegation ends). Otherwise `note` and
    /// `recovered` are what the next grant must carry, and `lock_delay` is the rest of a
    /// lock-delay (zero if none). Durations are measured on the sender's clock at its send instant.
    /// Resent until acknowledged.
    Handover { key: Key, live: Option<Handed>, note: Option<Vec<u8>>, recovered: bool, lock_delay: Duration },
    /// New home → old home: the handover of `key` under this message's epoch is taken care of
    /// (adopted, or refused so that the new home waits out the old epoch instead); forget the key.
    HandoverAck { key: Key },
}

impl Body {
    /// The key the message is about (every delegation message is about exactly one).
    pub fn key(&self) -> &[u8] {
        match self {
            Body::Request { key, .. }
            | Body::Grant { key, .. }
            | Body::Refuse { key, .. }
            | Body::Recall { key, .. }
            | Body::Pass { key, .. }
            | Body::Release { key, .. }
            | Body::Check { key, .. }
            | Body::Probe { key, .. }
            | Body::CheckReply { key, .. }
            | Body::Handover { key, .. }
            | Body::HandoverAck { key } => key,
        }
    }
}

/// Names one delegation request of one holder: the run (incarnation) that sent it and its number
/// in that run. A run numbers its requests 1, 2, 3, … (64 bits: it never wraps), so no answer
/// meant for an earlier run, or for an earlier request of this one, can match a later request.
/// Ordered by run, then number.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RequestId {
    pub incarnation: u64,
    pub seq: u64,
}

impl RequestId {
    pub const fn new(incarnation: u64, seq: u64) -> RequestId {
        RequestId { incarnation, seq }
    }
}

/// A live delegation, as an old home hands it to a key's new home in [`Body::Handover`].
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Handed {
    /// The node the delegation was granted to.
    pub holder: NodeId,
    pub grantee: Grantee,
    /// The request the delegation answered (so a retransmitted request is recognised).
    pub id: RequestId,
    /// How long, on the old home's clock from its send instant, the old home would still have
    /// treated the delegation as live (its conservative view, already widened for clock rates).
    pub remaining: Duration,
    /// The successors the old home granted ahead ([`Successor`]), in the order the key passes
    /// along them, each of which may hold the key already or be passed it later, and how long (as
    /// `remaining`) the old home would still have treated each as live. The new home keeps them
    /// all, as the old one did.
    pub ahead: Vec<(Successor, Duration)>,
}

/// A delegation a home granted ahead to a requester waiting for a held key, sent in the `Recall`
/// of the delegation it follows in the key's chain, so that that holder hands it on
/// ([`Body::Pass`]) the instant its last handle ends: the key then changes nodes in one message
/// instead of a `Release` to the home and a `Grant` from it. The home counts its lease from the
/// instant it granted it (after the request was sent, as for any grant), and treats it as live
/// from then on until its conservative end or a release, whichever node of the chain turns out
/// to hold it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Successor {
    /// The requester it is granted to.
    pub to: NodeId,
    /// The request it answers.
    pub id: RequestId,
    pub grantee: Grantee,
    /// Granted length, valid from the instant `to` sent request `id`.
    pub lease: Duration,
}

/// Why a home refuses a request. Each says whether and when to retry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, thiserror::Error)]
pub enum Refusal {
    #[error("this node is not the key's home under its epoch; look the home up again")]
    NotHome,
    #[error("the request carries an epoch this home does not act under")]
    StaleEpoch,
    #[error("the requester is not a member of the home's epoch")]
    NotMember,
    #[error("the home restarted recently and grants again in {} ms", .0.as_millis())]
    Quarantine(Duration),
    #[error("the key expired uncleanly and is under lock-delay for {} ms more", .0.as_millis())]
    LockDelay(Duration),
    #[error("the key is longer than the home accepts")]
    KeyTooLong,
    #[error("the handoff note is larger than the home accepts")]
    NoteTooLarge,
    #[error("the home holds as many delegations as it may")]
    HomeFull,
    #[error("the requester holds as many delegations from this home as it may")]
    RequesterFull,
    #[error("too many requesters already wait for this key")]
    QueueFull,
    #[error("the request's wait ran out before the key was free")]
    WaitExpired,
    #[error(
        "this node is the key's home but may not grant it yet (activation wait or no home lease); retry shortly"
    )]
    Activating,
    #[error("others wait for the key, so the delegation is not extended; release it")]
    Recalled,
}
