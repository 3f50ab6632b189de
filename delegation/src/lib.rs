//! Delegations, local locks and fencing tokens for keyhome, as sans-I/O state machines.
//!
//! - [`token`]: the fencing token `(epoch, incarnation, counter, local_seq)`.
//! - [`message`]: what homes and holders say to each other.
//! - [`authority`]: what this layer asks of the epoch layer.
//! - [`limits`]: caps on everything a peer or client can make a node allocate.
//! - [`guard`]: the [`TokenGuard`] a downstream resource embeds.

pub mod authority;
pub mod guard;
pub mod limits;
pub mod message;
pub mod token;

pub use authority::Authority;
pub use guard::{Stale, TokenGuard};
pub use limits::Limits;
pub use message::{Body, Grantee, Key, Message, Refusal};
pub use token::{FencingToken, TokenParseError};
