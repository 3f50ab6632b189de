//! Ghost state of every admission, grant and write, kept outside the nodes, and the invariants of
//! the delegation layer held against simulated real time.

use std::collections::HashMap;
use std::fmt;

use keyhome_delegation::{FencingToken, Grantee, TokenGuard};

use crate::world::Real;

/// Which invariant broke.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LockKind {
    /// An epoch invariant (fork, two homes, epoch floor, reused incarnation).
    Epoch(crate::Kind),
    /// Two admissions of one key overlapped in real time.
    Overlap,
    /// An admission's token was not above every earlier admission's token of its key.
    TokenOrder,
    /// The fenced resource accepted a token below one it had accepted before for the key.
    FenceRegression,
    /// A client used a handle after its deadline or after it ended.
    UseAfterDeadline,
    /// A home sent a grant without a home lease, without being active for the key (and not
    /// adopted), or inside its restart quarantine.
    BadGrant,
    /// A clean handoff lost or changed its note, or a grant after an expiry was not `recovered`.
    Handoff,
    /// After healing, a lock whose wait allowed for lease, margin and round trips failed.
    NoLiveness,
    /// In a calm run, an epoch change paused a key it should not have: a key that kept its home
    /// (and was not adopted at an earlier change) was refused `Activating`, or a moved key whose
    /// old home handed it over was not adopted before the activation wait (see
    /// [`super::handover`]).
    ChangePause,
    /// A pending lock whose client gave up was not withdrawn (`Core::cancel` found it decided
    /// while its outcome had not come), or was decided after it was withdrawn.
    Cancel,
    /// A handle admitted for a client that had stopped waiting was left live: nobody holds it,
    /// and its key stays taken until its deadline.
    Unclaimed,
    /// The core left a lock pending without telling the call's sink (`Sink::lock_pending`), so
    /// the runtime would have had nowhere to send its outcome, or told it of a lock it did not
    /// leave pending, leaving a reply nothing will answer.
    Registration,
    /// The core decided a lock ticket it had decided before, or one no lock call of the node's
    /// current run was left pending under: the runtime's glue would give the extra handle back
    /// unseen (as for a caller that went away), and nothing would notice.
    StrayDecision,
    /// The node told a client its handle was lost (an `Expired` notice, or a renewal refused
    /// `Expired` or `UnknownHandle`), or that a recall ends it, before the deadline that client
    /// was told at its lock or its last renewal: something cut the handle short.
    CutShort,
}

/// One broken invariant, at a simulated real instant.
#[derive(Clone, Debug)]
pub struct LockViolation {
    pub at: Real,
    pub kind: LockKind,
    pub detail: String,
}

impl fmt::Display for LockViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} at {:.6} s: {}", self.kind, self.at as f64 / 1e9, self.detail)
    }
}

/// How an admission ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// Unlocked by its client, with this handoff note (a write id).
    Unlock(Option<u64>),
    /// Ended at its deadline; `deleg_gone` when the delegation expired with it.
    Expired { deleg_gone: bool },
    /// Its node crashed. The client is not told: it may work on until the deadline it was told.
    Crash,
}

/// One admission: from the real instant `lock` returned a handle to its unlock or to the
/// deadline its client was told, whichever is first. Nothing else ends it early: not a recall,
/// not a crash of its node, since the client relies on the deadline alone.
#[derive(Clone, Debug)]
pub struct Admission {
    pub key: usize,
    pub node: usize,
    pub token: FencingToken,
    pub start: Real,
    /// The latest deadline the client was told (the handle's deadline at admission, or at its
    /// last successful renewal, on its node's clock), as real time: a renewal moves it later or
    /// earlier ([`LockChecker::renewed`]); a refused one leaves it.
    pub deadline: Real,
    pub end: Option<(Real, End)>,
}

impl Admission {
    /// The real instant the admission stops counting, as known at `now`.
    fn over_by(&self) -> Real {
        match self.end {
            Some((at, End::Unlock(_))) => at.min(self.deadline),
            _ => self.deadline,
        }
    }

    fn grantee(&self) -> Grantee {
        Grantee { epoch: self.token.epoch, incarnation: self.token.incarnation, counter: self.token.counter }
    }
}

/// Counters a lock run reports.
#[derive(Clone, Debug, Default)]
pub struct LockStats {
    pub events: u64,
    /// Delegation messages between distinct nodes (self-addressed ones excluded).
    pub deleg_messages: u64,
    pub epoch_messages: u64,
    pub lock_calls: u64,
    /// Admissions, and how many of them came back at once from `lock` (no message).
    pub admissions: u64,
    pub immediate: u64,
    pub lock_failures: u64,
    /// Pending locks whose clients gave up (each withdrawn through `Core::cancel`, or given back
    /// if the core had admitted it meanwhile).
    pub give_ups: u64,
    /// Of those, handles admitted into the reply before the client closed it, and admitted
    /// after it (unclaimed), each given back.
    pub given_back_from_reply: u64,
    pub given_back_unclaimed: u64,
    pub grants: u64,
    /// Delegations a holder passed straight to the successor its Recall named.
    pub passes: u64,
    pub writes_accepted: u64,
    /// Writes the fenced resource refused (stale tokens), and how many of those were late writes
    /// of a paused client.
    pub writes_refused: u64,
    pub paused_writes_refused: u64,
    pub pauses: u64,
    /// First admissions of a new delegation carrying the predecessor's note, and flagged recovered.
    pub notes_delivered: u64,
    pub recovered: u64,
    pub probes_ok: u64,
    /// Renewals clients asked for (`Core::renew`); of them, those of a handle whose key was being
    /// recalled, those that succeeded, and of those the ones that moved the told deadline later
    /// and earlier; and those refused (the handle lost: each is a `CutShort`).
    pub renews: u64,
    pub renews_recalled: u64,
    pub renews_ok: u64,
    pub renews_later: u64,
    pub renews_earlier: u64,
    pub renews_refused: u64,
    /// Keys with waiting clients across epoch changes (see [`super::handover`]).
    pub handover: super::handover::HandoverStats,
}

/// The fenced resource: every write with its token, guarded by a [`TokenGuard`].
pub struct Resource {
    guard: TokenGuard,
    /// Highest token accepted per key, as seen from outside the guard.
    accepted: HashMap<usize, FencingToken>,
    pub log: Vec<(Real, usize, FencingToken, u64, bool)>,
}

/// The checker: ghost state outside the nodes, so crashes cannot erase it.
///
/// Every handoff is checked strictly: grants handed back unused (too late, stray, no longer
/// wanted, renewals that arrive after their delegation ended) must pass their note and
/// `recovered` flag on, through the `Release`'s own `note` and `recovered`.
pub struct LockChecker {
    /// Delegations their holders released (sent a `Release` for), by key, with whether a
    /// release with a note and one without were sent.
    released: HashMap<(usize, Grantee), (bool, bool)>,
    pub admissions: Vec<Admission>,
    /// Per key: admissions not known to be over, and the last admission.
    open: Vec<Vec<usize>>,
    last: Vec<Option<usize>>,
    max_token: Vec<Option<FencingToken>>,
    pub resource: Resource,
    pub violations: Vec<LockViolation>,
    pub stats: LockStats,
}

impl LockChecker {
    pub fn new(keys: usize) -> LockChecker {
        LockChecker {
            released: HashMap::new(),
            admissions: Vec::new(),
            open: vec![Vec::new(); keys],
            last: vec![None; keys],
            max_token: vec![None; keys],
            resource: Resource {
                guard: TokenGuard::new(4 * keys),
                accepted: HashMap::new(),
                log: Vec::new(),
            },
            violations: Vec::new(),
            stats: LockStats::default(),
        }
    }

    pub fn violation(&mut self, at: Real, kind: LockKind, detail: String) {
        self.violations.push(LockViolation { at, kind, detail });
    }

    /// A handle was returned at real time `at`: checks exclusivity, token order and the handoff.
    /// Returns the admission's id.
    #[allow(clippy::too_many_arguments)]
    pub fn admitted(
        &mut self,
        at: Real,
        key: usize,
        node: usize,
        token: FencingToken,
        deadline: Real,
        note: Option<u64>,
        recovered: bool,
    ) -> usize {
        self.stats.admissions += 1;
        let id = self.admissions.len();
        // 1. No overlap with any admission of the key not yet over.
        let admissions = &self.admissions;
        self.open[key].retain(|&a| admissions[a].over_by() > at);
        if let Some(&other) = self.open[key].first() {
            let o = &self.admissions[other];
            let detail = format!(
                "key k{key}: node {node} admitted {token} while node {} holds {} (admitted at {:.6}, deadline {:.6})",
                o.node,
                o.token,
                o.start as f64 / 1e9,
                o.deadline as f64 / 1e9
            );
            self.violation(at, LockKind::Overlap, detail);
        }
        // 2. Tokens strictly increase per key.
        if let Some(max) = self.max_token[key]
            && token <= max
        {
            self.violation(
                at,
                LockKind::TokenOrder,
                format!("key k{key}: node {node} admitted {token} after {max}"),
            );
        }
        self.max_token[key] = Some(self.max_token[key].map_or(token, |m| m.max(token)));
        // 6. The handoff: the first admission of a new delegation carries the predecessor's note
        // unless it is flagged recovered, and must be flagged after an expiry or after a handle
        // that was taken away (it may have written without leaving a note).
        let grantee = Grantee { epoch: token.epoch, incarnation: token.incarnation, counter: token.counter };
        let previous = self.last[key].map(|p| &self.admissions[p]);
        if previous.is_none_or(|p| p.grantee() != grantee) {
            // The predecessor's delegation ended by expiry if its holder never released it.
            let expired = previous.is_some_and(|p| !self.released.contains_key(&(key, p.grantee())));
            let (expected, unclean) = match previous.map(|p| p.end) {
                None => (None, false),
                Some(Some((_, End::Unlock(n)))) => (n, expired),
                Some(Some((_, End::Expired { .. }))) => (None, true),
                Some(Some((_, End::Crash))) | Some(None) => (None, expired),
            };
            if recovered {
                self.stats.recovered += 1;
            } else if unclean {
                let p = previous.expect("unclean needs a predecessor");
                let detail = format!(
                    "key k{key}: node {node} admitted {token} not flagged recovered after {} on node {} ended {:?}",
                    p.token, p.node, p.end
                );
                self.violation(at, LockKind::Handoff, detail);
            } else if note != expected {
                let detail = format!(
                    "key k{key}: node {node} admitted {token} with note {note:?}, expected {expected:?}"
                );
                self.violation(at, LockKind::Handoff, detail);
            } else {
                if note.is_some() {
                    self.stats.notes_delivered += 1;
                }
            }
        }
        self.admissions.push(Admission { key, node, token, start: at, deadline, end: None });
        self.open[key].push(id);
        self.last[key] = Some(id);
        id
    }

    /// A holder sent a clean `Release` of `key`'s delegation `grantee` (not flagged `recovered`).
    pub fn released(&mut self, key: usize, grantee: Grantee, with_note: bool) {
        let r = self.released.entry((key, grantee)).or_default();
        if with_note {
            r.0 = true;
        } else {
            r.1 = true;
        }
    }

    /// Admission `id` ended at `at` (the first end counts).
    pub fn ended(&mut self, at: Real, id: usize, how: End) {
        let a = &mut self.admissions[id];
        if a.end.is_none() {
            a.end = Some((at, how));
        }
    }

    /// Admission `id` was renewed at `at` and its client told the new deadline `deadline` (real
    /// time), later or earlier than the one before: from now on the admission counts to it. A
    /// renewal is a use of the handle, so it must come inside the admission.
    ///
    /// `asked` is the end the renewal asked for (its ttl from the call's instant, as real time): a
    /// renewal may shorten a handle to it, never below both it and the deadline told before.
    pub fn renewed(&mut self, at: Real, id: usize, deadline: Real, asked: Real) {
        self.used(at, id);
        self.stats.renews_ok += 1;
        let floor = self.admissions[id].deadline.min(asked);
        if deadline < floor {
            let a = &self.admissions[id];
            let detail = format!(
                "node {} renewed {} (k{}) to {:.6}, below both its told deadline {:.6} and the ttl asked ({:.6})",
                a.node,
                a.token,
                a.key,
                deadline as f64 / 1e9,
                a.deadline as f64 / 1e9,
                asked as f64 / 1e9
            );
            self.violation(at, LockKind::CutShort, detail);
        }
        let a = &mut self.admissions[id];
        if deadline > a.deadline {
            self.stats.renews_later += 1;
        } else if deadline < a.deadline {
            self.stats.renews_earlier += 1;
        }
        a.deadline = deadline;
    }

    /// The node told the client of admission `id` at `at` that its handle is lost (`how`): not
    /// before the deadline it was told.
    pub fn lost(&mut self, at: Real, id: usize, how: &str) {
        let a = &self.admissions[id];
        if at < a.deadline && a.end.is_none_or(|(end, _)| end > at) {
            let detail = format!(
                "node {} told the client of {} (k{}) it lost the handle ({how}) at {:.6}, before its told deadline {:.6}",
                a.node,
                a.token,
                a.key,
                at as f64 / 1e9,
                a.deadline as f64 / 1e9
            );
            self.violation(at, LockKind::CutShort, detail);
        }
    }

    /// Checker 4: a client is about to use admission `id` at `at`.
    pub fn used(&mut self, at: Real, id: usize) {
        let a = &self.admissions[id];
        if a.end.is_some_and(|(end, _)| end <= at) || at >= a.deadline {
            let detail = format!(
                "node {} used {} at {:.6} after its end {:?}",
                a.node,
                a.token,
                at as f64 / 1e9,
                a.end
            );
            self.violation(at, LockKind::UseAfterDeadline, detail);
        }
    }

    /// Checker 3: a write with `token` reached the fenced resource. Returns whether it was accepted.
    pub fn write(&mut self, at: Real, key: usize, token: FencingToken, write_id: u64, late: bool) -> bool {
        let name = format!("k{key}");
        let ok = self.resource.guard.admit(name.as_bytes(), token).is_ok();
        self.resource.log.push((at, key, token, write_id, ok));
        if ok {
            self.stats.writes_accepted += 1;
            if let Some(&high) = self.resource.accepted.get(&key)
                && token < high
            {
                self.violation(
                    at,
                    LockKind::FenceRegression,
                    format!("key {name}: accepted {token} after {high}"),
                );
            }
            let high = self.resource.accepted.entry(key).or_insert(token);
            *high = (*high).max(token);
        } else {
            self.stats.writes_refused += 1;
            if late {
                self.stats.paused_writes_refused += 1;
            }
        }
        ok
    }
}
