//! Caps on everything a peer or client can make a node allocate.

use std::time::Duration;

/// Caps a home and a holder enforce; every one of them is checked before any state is allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Longest key, in bytes.
    pub max_key_len: usize,
    /// Largest handoff note, in bytes.
    pub max_note_len: usize,
    /// Most live delegations one home grants at once.
    pub max_delegations: usize,
    /// Most live delegations one home grants to one requester at once.
    pub max_per_requester: usize,
    /// Most requesters waiting for one key at a home, and most local waiters per key at a holder.
    pub max_waiters_per_key: usize,
    /// Most keys one holder tracks at once (delegations, waiters, requests, recent history).
    pub max_holder_keys: usize,
    /// Longest a home keeps a request queued: a longer `wait` is cut to this. The requester
    /// asks again when it is refused `WaitExpired` and still has lockers waiting.
    pub max_request_wait: Duration,
}

impl Limits {
    /// 1 KiB keys, 4 KiB notes, a million delegations per home, 100 000 per requester, 64 waiters,
    /// a million keys per holder, requests queued for at most an hour.
    pub const DEFAULT: Limits = Limits {
        max_key_len: 1024,
        max_note_len: 4096,
        max_delegations: 1_000_000,
        max_per_requester: 100_000,
        max_waiters_per_key: 64,
        max_holder_keys: 1_000_000,
        max_request_wait: Duration::from_secs(3600),
    };
}

impl Default for Limits {
    fn default() -> Limits {
        Limits::DEFAULT
    }
}
