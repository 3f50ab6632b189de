//! Delegations and fencing tokens for keyhome.
//!
//! For now this crate holds the fencing token; the home and holder state machines follow.

pub mod token;

pub use token::{FencingToken, TokenParseError};
