//! Delegations, local locks and fencing tokens for keyhome, as sans-I/O state machines.
//!
//! - [`token`]: the fencing token `(epoch, incarnation, counter, local_seq)`.
//! - [`message`]: what homes and holders say to each other.
//! - [`authority`]: what this layer asks of the epoch layer.
//! - [`limits`]: caps on everything a peer or client can make a node allocate.
//! - [`check`]: the [`CheckAnswer`] a token check gets.
//! - [`guard`]: the [`TokenGuard`] a downstream resource embeds.
//! - [`home`]: the [`Home`], a key's home side: grants, queues, recalls, expiries, handovers.
//! - [`holder`]: the holder side of delegations and the local lock table ([`Holder`]).
//! - [`walk`]: how both take an epoch change a bounded step at a time.

pub mod authority;
pub mod bugs;
pub mod check;
pub mod guard;
pub mod holder;
pub mod home;
pub mod keyhash;
pub mod limits;
pub mod message;
pub mod token;
pub mod walk;

pub use authority::Authority;
pub use bugs::Bugs;
pub use check::CheckAnswer;
pub use guard::{Stale, TokenGuard};
pub use holder::{
    DelegationInfo, Ending, Event as HolderEvent, Handle, HandleId, Holder, HolderConfig, LockError,
    LockOutcome, Serials, Ticket,
};
pub use home::{Delegation, Home, HomeConfig, HomeCounters, KeyStatus};
pub use keyhash::{HashedKey, KeyHasher};
pub use limits::Limits;
pub use message::{Body, Grantee, Handed, Key, Message, Refusal, RequestId, Successor};
pub use token::{FencingToken, TokenParseError};
pub use walk::DEFAULT_WALK_STEP;
