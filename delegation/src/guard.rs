//! [`TokenGuard`]: what a downstream resource embeds to refuse writes from stale lock holders.

use std::collections::HashMap;

use crate::token::FencingToken;

/// Remembers the highest fencing token seen per key and refuses any lower one, in bounded memory.
///
/// A resource calls [`TokenGuard::admit`] with the token of every write it receives for a key.
/// A paused or partitioned ex-holder's token is lower than its successor's, so once the successor
/// has written, the ex-holder's late writes are refused.
///
/// Memory is bounded by `capacity` keys. When full, the key seen longest ago is forgotten and its
/// highest token raises a floor that every token of a key not remembered must reach. That keeps
/// the guarantee (no token below one already admitted for its key is ever admitted) at the cost
/// of refusing some valid tokens of long-unseen keys until their holders hold newer tokens; a
/// capacity above the number of keys in active use avoids that.
#[derive(Debug)]
pub struct TokenGuard {
    capacity: usize,
    /// Highest token per remembered key, with the tick it was last seen at.
    seen: HashMap<Vec<u8>, (FencingToken, u64)>,
    /// No forgotten key ever admitted a token above this.
    floor: Option<FencingToken>,
    tick: u64,
}

/// Why a guard refused a token.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("fencing token {offered} is below {highest}, already seen for this key: the lock was lost")]
pub struct Stale {
    pub offered: FencingToken,
    pub highest: FencingToken,
}

impl TokenGuard {
    /// A guard remembering at most `capacity` keys (at least 1).
    pub fn new(capacity: usize) -> TokenGuard {
        TokenGuard { capacity: capacity.max(1), seen: HashMap::new(), floor: None, tick: 0 }
    }

    /// Admits `token` for `key` if no higher token was seen for the key, and remembers it.
    /// Equal tokens are admitted: one admission may write many times.
    pub fn admit(&mut self, key: &[u8], token: FencingToken) -> Result<(), Stale> {
        self.tick += 1;
        if let Some((highest, at)) = self.seen.get_mut(key) {
            if token < *highest {
                return Err(Stale { offered: token, highest: *highest });
            }
            *highest = token;
            *at = self.tick;
            return Ok(());
        }
        if let Some(floor) = self.floor.filter(|f| token < *f) {
            return Err(Stale { offered: token, highest: floor });
        }
        if self.seen.len() >= self.capacity {
            self.forget_oldest();
        }
        self.seen.insert(key.to_vec(), (token, self.tick));
        Ok(())
    }

    /// The highest token admitted for `key`, if the guard still remembers the key.
    pub fn highest(&self, key: &[u8]) -> Option<FencingToken> {
        self.seen.get(key).map(|(t, _)| *t)
    }

    fn forget_oldest(&mut self) {
        let oldest = self.seen.iter().min_by_key(|(_, (_, at))| *at).map(|(k, (t, _))| (k.clone(), *t));
        if let Some((key, token)) = oldest {
            self.seen.remove(&key);
            self.floor = Some(self.floor.map_or(token, |f| f.max(token)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(epoch: u64, counter: u64, seq: u64) -> FencingToken {
        FencingToken { epoch, incarnation: 1, counter, local_seq: seq }
    }

    #[test]
    fn refuses_lower_tokens_per_key() {
        let mut g = TokenGuard::new(10);
        assert_eq!(g.admit(b"a", t(1, 5, 0)), Ok(()));
        assert_eq!(g.admit(b"a", t(1, 5, 0)), Ok(()), "the same admission may write again");
        assert_eq!(g.admit(b"b", t(1, 1, 0)), Ok(()), "keys are independent");
        assert_eq!(g.admit(b"a", t(1, 6, 0)), Ok(()));
        assert_eq!(g.admit(b"a", t(1, 5, 9)), Err(Stale { offered: t(1, 5, 9), highest: t(1, 6, 0) }));
        assert_eq!(g.highest(b"a"), Some(t(1, 6, 0)));
    }

    #[test]
    fn forgetting_keys_never_admits_a_stale_token() {
        let mut g = TokenGuard::new(2);
        g.admit(b"a", t(1, 7, 0)).unwrap();
        g.admit(b"b", t(1, 3, 0)).unwrap();
        g.admit(b"c", t(1, 4, 0)).unwrap(); // forgets "a" (oldest): floor 1.7.0
        assert_eq!(g.highest(b"a"), None);
        assert!(g.admit(b"a", t(1, 6, 0)).is_err(), "a's stale token stays refused");
        assert!(g.admit(b"d", t(1, 2, 0)).is_err(), "the price: an old token of an unseen key");
        assert_eq!(g.admit(b"a", t(2, 1, 0)), Ok(()));
        assert!(g.seen.len() <= 2);
    }
}
