//! The fencing token every admission carries.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// `(epoch, home incarnation, delegation counter, local sequence)`, ordered lexicographically.
///
/// Every admission of a key gets a token strictly greater than every earlier admission of that
/// key, across delegations, home restarts and epoch changes, so a resource that remembers the
/// highest token it has seen can refuse a paused or partitioned ex-holder.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct FencingToken {
    /// The epoch under which the home granted the delegation.
    pub epoch: u64,
    /// The home's incarnation: durably advanced on every start of the home node.
    pub incarnation: u64,
    /// Counts the home's grants of this key within one incarnation.
    pub counter: u64,
    /// Counts the admissions under one delegation.
    pub local_seq: u64,
}

/// Why a token's text form did not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("a fencing token is four decimal numbers joined by '.', as in 3.7.42.1")]
pub struct TokenParseError;

impl fmt::Display for FencingToken {
    /// The compact text form `epoch.incarnation.counter.local_seq`, for environment variables and
    /// headers. It parses back exactly.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}.{}", self.epoch, self.incarnation, self.counter, self.local_seq)
    }
}

impl FromStr for FencingToken {
    type Err = TokenParseError;

    fn from_str(s: &str) -> Result<FencingToken, TokenParseError> {
        let mut parts = s.split('.');
        let mut next = || -> Result<u64, TokenParseError> {
            let part = parts.next().ok_or(TokenParseError)?;
            // Only plain decimal digits: no sign, no spaces, nothing `u64::from_str` would tolerate.
            if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
                return Err(TokenParseError);
            }
            part.parse().map_err(|_| TokenParseError)
        };
        let token =
            FencingToken { epoch: next()?, incarnation: next()?, counter: next()?, local_seq: next()? };
        if parts.next().is_some() {
            return Err(TokenParseError);
        }
        Ok(token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_is_lexicographic() {
        let t = |e, i, c, l| FencingToken { epoch: e, incarnation: i, counter: c, local_seq: l };
        assert!(t(1, 9, 9, 9) < t(2, 0, 0, 0));
        assert!(t(2, 1, 50, 0) < t(2, 2, 1, 0), "a restarted home's tokens beat its earlier ones");
        assert!(t(2, 2, 1, 7) < t(2, 2, 2, 0));
    }

    #[test]
    fn text_form_round_trips() {
        let token = FencingToken { epoch: 3, incarnation: 7, counter: 42, local_seq: u64::MAX };
        assert_eq!(token.to_string().parse::<FencingToken>(), Ok(token));
        for bad in [
            "",
            "1.2.3",
            "1.2.3.4.5",
            "1.2.3.-4",
            "1.2.3.+4",
            "1.2. 3.4",
            "a.b.c.d",
            "1.2.3.18446744073709551616",
        ] {
            assert_eq!(bad.parse::<FencingToken>(), Err(TokenParseError), "{bad:?}");
        }
    }
}
