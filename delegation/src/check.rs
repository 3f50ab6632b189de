//! Token checks: what a key's home (and, while the key is delegated, its holder) says about a
//! fencing token, as a [`CheckAnswer`].
//!
//! # The exchange
//!
//! An asker sends [`Body::Check`](crate::Body::Check) to the key's home. The home answers with
//! [`Body::CheckReply`](crate::Body::CheckReply) itself, except when the token belongs to the
//! key's live delegation: only the holder knows the local admissions under a delegation, so the
//! home forwards the question as [`Body::Probe`](crate::Body::Probe) and the holder answers the
//! asker directly (one more message, no state kept at the home). A holder that is down or
//! unreachable does not answer: the asker's own timeout ends the wait. Once that holder's
//! delegation ends (at the latest at its lease end on the home's clock), the home answers such
//! checks itself.
//!
//! # Tokens compared
//!
//! A token `(epoch, incarnation, counter, local_seq)` names its delegation by its *grantee*
//! `(epoch, incarnation, counter)` ([`Grantee::of`]) and its admission within the delegation by
//! `local_seq`. Grantees of one key strictly increase across grants, home restarts (the
//! incarnation grows) and epoch changes (the epoch grows), so a token whose grantee is below the
//! key's latest delegation belongs to an earlier one, whatever epoch or home run it came from;
//! within one delegation admissions are numbered `0, 1, 2, …`.

use std::cmp::Ordering;

use serde::{Deserialize, Serialize};

use crate::message::Grantee;
use crate::token::FencingToken;

/// The answer to a token check. Every answer but [`CheckAnswer::HeldNow`] means the token's lock is
/// not held: a resource that only needs "may this token act now?" compares with `HeldNow`. Any
/// answer may be stale by the time it arrives (the message takes time; a held lock may end just
/// after the answer left).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CheckAnswer {
    /// A handle holds the key with exactly this token: the key's holder said so when it answered,
    /// the handle being within its deadline then.
    HeldNow,
    /// The token's lock is not held, and the key was admitted or delegated again after it: a later
    /// admission under the same delegation (a local re-lock), or a later delegation of the key
    /// (whose admissions all carry greater tokens). This includes every token of a delegation
    /// granted before a home restart or under an earlier epoch, once a later delegation is known.
    Superseded,
    /// The token's lock is not held, and no later admission is known: the lock ended (unlocked,
    /// revoked or expired) or the token was never issued. After a key's delegation ended, its home
    /// no longer knows the admissions made under it, so an older token of that delegation is
    /// `NotHeld` rather than `Superseded` until a later delegation of the key is granted.
    NotHeld,
    /// The home keeps no record of the key: it never delegated it, or forgot it (a released record
    /// aged out or was not kept, the home restarted, the key moved in without a handover). Still
    /// the token's lock is not held: the home answers only when every delegation it might not know
    /// of has ended (its activation wait and restart quarantine are over).
    UnknownKey,
}

/// What a holder answers about `token`, given the latest delegation of the key it knows of: its
/// grantee `latest`, the number of admissions made under it `admitted` (tokens
/// `latest.token(0)` to `latest.token(admitted - 1)`), and the token of the handle holding the
/// key now, if any.
pub(crate) fn judge(
    token: FencingToken,
    latest: Grantee,
    admitted: u64,
    held: Option<FencingToken>,
) -> CheckAnswer {
    match Grantee::of(token).cmp(&latest) {
        Ordering::Less => CheckAnswer::Superseded,
        Ordering::Greater => CheckAnswer::NotHeld,
        Ordering::Equal if held == Some(token) => CheckAnswer::HeldNow,
        Ordering::Equal if token.local_seq.saturating_add(1) < admitted => CheckAnswer::Superseded,
        Ordering::Equal => CheckAnswer::NotHeld,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn judge_compares_grantee_then_local_sequence() {
        let g = Grantee { epoch: 2, incarnation: 3, counter: 4 };
        let held = Some(g.token(2));
        assert_eq!(judge(g.token(2), g, 3, held), CheckAnswer::HeldNow);
        assert_eq!(judge(g.token(1), g, 3, held), CheckAnswer::Superseded, "a later local re-lock");
        assert_eq!(judge(g.token(2), g, 3, None), CheckAnswer::NotHeld, "the last one, unlocked");
        assert_eq!(judge(g.token(3), g, 3, held), CheckAnswer::NotHeld, "never issued");
        assert_eq!(judge(g.token(u64::MAX), g, u64::MAX, None), CheckAnswer::NotHeld);
        let earlier_run = Grantee { incarnation: 2, counter: 99, ..g };
        assert_eq!(judge(earlier_run.token(0), g, 0, None), CheckAnswer::Superseded);
        let earlier_epoch = Grantee { epoch: 1, incarnation: 50, counter: 50 };
        assert_eq!(judge(earlier_epoch.token(7), g, 3, held), CheckAnswer::Superseded);
        let later = Grantee { counter: 5, ..g };
        assert_eq!(judge(later.token(0), g, 3, held), CheckAnswer::NotHeld);
    }
}
