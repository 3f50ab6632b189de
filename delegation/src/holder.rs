//! The holder side of delegations and the local lock table, as a sans-I/O state machine.
//!
//! A [`Holder`] runs on every node. Applications lock keys through it; it asks each key's home
//! for the key's *delegation* (the exclusive right to admit critical sections on the key for a
//! bounded time) and, while it holds one, admits local lockers without sending anything.
//!
//! Like [`keyhome_epoch::EpochNode`] it does no I/O and reads no clock: the driver hands in the
//! node's monotonic clock reading (`now`) with every call, feeds it messages
//! ([`Holder::handle_message`]) and timer expiries ([`Holder::handle_timeout`] at
//! [`Holder::poll_timeout`]), and drains [`Holder::poll_transmit`] and [`Holder::poll_event`]
//! after every call.
//!
//! # Invariants
//!
//! - **Deadlines count from the send instant.** A delegation granted in answer to request `r` ends
//!   at `send(r) + lease` on this node's clock, where `send(r)` is the instant `r` was *first*
//!   sent (a resend keeps the id and the original instant) and `lease` is the smaller of what was
//!   asked and what was granted. The home counts from its receipt of `r`, later than `send(r)`.
//! - **One local handle per key**, and only while the key's delegation is live and admission is
//!   open. A handle's deadline never exceeds the delegation's.
//! - **Tokens strictly increase per key**: `grantee.token(local_seq)` with `local_seq` increasing
//!   per delegation, and a delegation is only used if its grantee is not below the last one this
//!   holder used for the key (an equal grantee continues its sequence).
//! - **A handle is never taken away before its deadline.** A recall closes admission and asks the
//!   handle's owner to unlock ([`Event::Recalled`]), but the delegation is released only once the
//!   handle has been unlocked, abandoned by its owner, or has passed its deadline: no other node
//!   can admit the key while a handle is inside the deadline its owner was told. A recalled
//!   handle's deadline no longer grows (renewals keep or shorten it), so a recall costs at most
//!   the handle's remaining time.
//! - **Every handle ends exactly once**: by a successful [`Holder::unlock`], or by one
//!   [`Event::Expired`]; after the event, the handle's next use
//!   returns [`LockError::Expired`].
//! - **Nothing is held that is not needed**: idle delegations are released after
//!   [`HolderConfig::idle_release`]; grants that are late, stray, duplicated or no longer wanted
//!   are handed back with `Release` (carrying their note and `recovered` flag) while they may
//!   still be live. A renewal's grant that arrives after its delegation was released is not
//!   handed back (the release covers it); after an expiry it is handed back flagged `recovered`.
//!   A grant answering a request of an earlier run of this node is never handed back: it may
//!   renew a delegation under which that run admitted handles whose owners are still inside the
//!   deadlines they were told (a crash does not end them), so the home must let it run out.
//! - **The handoff is passed on**: a delegation granted `recovered` and released before any
//!   admission releases with `recovered: true`; a Recall that overtakes its Grant (while the
//!   acquisition request is outstanding) is remembered, with the successor it carries, and
//!   applied when the Grant arrives: the delegation admits the locker first in line, if any, once
//!   (asked at once to unlock), and is passed on or released when that handle ends.
//!
//! # Timers
//!
//! Each key has one scheduled wake-up in a heap; actions only push a new one when they make the
//! key's next deadline earlier. After [`Holder::handle_timeout`]`(now)` every remaining wake-up is
//! strictly after `now` ([`Holder::poll_timer`]), so a driver that sleeps until
//! [`Holder::poll_timeout`] never spins; only an epoch walk in progress stays due, and each call
//! takes one bounded step of it ([`crate::walk`]).
//! [`Holder::try_lock`] and [`Holder::unlock`] take no [`Authority`], so when they need a request
//! sent they schedule a wake-up at their own `now`: a driver calls `handle_timeout` as soon as
//! `poll_timeout` is not in the future.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet, VecDeque};
use std::time::Duration;

use hashbrown::HashTable;
use keyhome_epoch::time::earliest;
use keyhome_epoch::{Instant, NodeId};

use crate::authority::Authority;
use crate::check::{self, CheckAnswer};
use crate::keyhash::{HashedKey, KeyHasher};
use crate::limits::Limits;
use crate::message::{Body, Grantee, Message, Refusal, RequestId, Successor};
use crate::token::FencingToken;
use crate::walk::{DEFAULT_WALK_STEP, Walk};

/// How many expired handles are remembered, so that their next use says why they were lost.
const TOMBSTONES: usize = 4096;
/// How many sent requests are remembered to judge whether a stray grant may still be live.
const RECENT_REQUESTS: usize = 65_536;
/// The refusal back-off doubles per consecutive refusal, at most this many times.
const MAX_DOUBLINGS: u32 = 5;
/// Shortest `retry` and `resend` accepted: zero would let a timer fire at its own instant forever.
const MIN_INTERVAL: Duration = Duration::from_millis(1);

/// The hasher of the holder's set of expired serials: keyed with per-process random secrets
/// (aHash's `RandomState` draws them from the operating system). Keys are hashed by
/// [`HolderConfig::key_hasher`].
type Hasher = ahash::RandomState;

/// Settings of one node's holder. Build with [`HolderConfig::new`] and adjust fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HolderConfig {
    /// This node.
    pub id: NodeId,
    /// Caps on keys, notes and local waiters.
    pub limits: Limits,
    /// Lease asked for per delegation (capped by the epoch's `max_delegation_lease`). Default 10 s.
    pub lease: Duration,
    /// A delegation with no handle, no waiter and no local call for this long is released.
    /// Default 2 s.
    pub idle_release: Duration,
    /// A grant arriving with less than this left before its deadline is handed back unused (or
    /// with less than half its lease left, for a lease shorter than twice this). Default 50 ms.
    pub min_useful: Duration,
    /// First back-off after a refusal worth retrying; doubles per consecutive refusal (up to 32×).
    /// At least 1 ms. Default 50 ms.
    pub retry: Duration,
    /// A request unanswered this long is sent again, with the same id. At least 1 ms. Default 1 s.
    pub resend: Duration,
    /// How long a request started by a failed [`Holder::try_lock`] asks the home to wait.
    /// Default 2 s.
    pub prefetch_wait: Duration,
    /// Slots one step of an epoch change's walk looks at (see [`crate::walk`]); zero counts as
    /// one. [`DEFAULT_WALK_STEP`] by default.
    pub walk_step: u32,
    /// The serials this holder gives its handles and tickets: `serials.first`, then every
    /// `serials.step` after it, so that several holders of one node (its key shards) never give
    /// out the same serial. `{ first: 1, step: 1 }` by default.
    pub serials: Serials,
    /// Hashes keys for the holder's index: random secrets by default. A caller that hashes keys
    /// itself (the node picks a key's shard by its hash) shares it and hands hashes in with
    /// [`Holder::try_lock_hashed`].
    pub key_hasher: KeyHasher,
    /// Safety rules switched off, for tests that show the simulation notices. All off by default.
    #[cfg(feature = "bug-injection")]
    pub bugs: crate::bugs::Bugs,
}

/// An arithmetic sequence of serial numbers: `first`, `first + step`, `first + 2 · step`, …
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Serials {
    /// The first serial; at least 1 (0 is never a serial).
    pub first: u64,
    /// The distance between two serials; at least 1.
    pub step: u64,
}

impl Serials {
    /// 1, 2, 3, …
    pub const ALL: Serials = Serials { first: 1, step: 1 };
}

impl HolderConfig {
    /// The defaults: default [`Limits`], 10 s leases, 2 s idle release, 50 ms minimum
    /// useful grant, 50 ms first retry, 1 s resend, 2 s prefetch wait.
    pub fn new(id: NodeId) -> HolderConfig {
        HolderConfig {
            id,
            limits: Limits::DEFAULT,
            lease: Duration::from_secs(10),
            idle_release: Duration::from_secs(2),
            min_useful: Duration::from_millis(50),
            retry: Duration::from_millis(50),
            resend: Duration::from_secs(1),
            prefetch_wait: Duration::from_secs(2),
            walk_step: DEFAULT_WALK_STEP,
            serials: Serials::ALL,
            key_hasher: KeyHasher::random(),
            #[cfg(feature = "bug-injection")]
            bugs: crate::bugs::Bugs::default(),
        }
    }

    /// The switches in force (all off without the `bug-injection` feature).
    pub fn bugs(&self) -> crate::bugs::Bugs {
        #[cfg(feature = "bug-injection")]
        return self.bugs;
        #[cfg(not(feature = "bug-injection"))]
        crate::bugs::Bugs::default()
    }

    /// The back-off after `refusals` consecutive refusals.
    fn backoff(&self, refusals: u32) -> Duration {
        self.retry.saturating_mul(1 << refusals.min(MAX_DOUBLINGS))
    }
}

/// Names one local handle. Unique within one [`Holder`]: never reused, even after the handle ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HandleId {
    serial: u64,
    slot: u32,
}

impl HandleId {
    /// A number unique among this holder's handles and tickets, increasing in issue order.
    pub fn serial(self) -> u64 {
        self.serial
    }
}

/// Names one pending [`Holder::lock`]; its outcome arrives as [`Event::Locked`] or
/// [`Event::LockFailed`]. Unique within one [`Holder`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ticket {
    serial: u64,
    slot: u32,
}

impl Ticket {
    /// A number unique among this holder's handles and tickets, increasing in issue order.
    pub fn serial(self) -> u64 {
        self.serial
    }
}

/// One admission: the right to act on a key until `deadline`, proved downstream by `token`.
///
/// The key is not copied into the handle, so that admitting allocates nothing: the caller named
/// it, and [`Holder::key_of`] names it again while the handle lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Handle {
    pub id: HandleId,
    /// Strictly greater than every earlier admission's token for this key.
    pub token: FencingToken,
    /// The handle is valid before this instant of this node's clock (`min(now + ttl, delegation
    /// deadline)` at admission), and nothing takes it away earlier. A renewed delegation may
    /// silently extend the handle up to its ttl (unless the key was recalled), never shorten it;
    /// [`Holder::renew`] reports the current value.
    pub deadline: Instant,
    /// The previous holder's handoff note: on the first admission after a grant, the note the
    /// home handed over; on a later one, the note the previous local holder unlocked with.
    pub note: Option<Vec<u8>>,
    /// The previous holder may have stopped halfway, without handing a note: on the first
    /// admission after a grant, the delegation followed an expiry (not a clean release); on a
    /// later one, the previous local handle passed its deadline instead of being unlocked.
    pub recovered: bool,
}

/// What [`Holder::lock`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LockOutcome {
    /// Admitted at once, without any message.
    Locked(Handle),
    /// Queued: the outcome arrives later as [`Event::Locked`] or [`Event::LockFailed`].
    Pending(Ticket),
}

/// Something the application or the driver must learn about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A pending lock was admitted.
    Locked { ticket: Ticket, handle: Handle },
    /// A pending lock failed: [`LockError::Timeout`], [`LockError::Refused`].
    LockFailed { ticket: Ticket, error: LockError },
    /// The key's home recalled the delegation (another node wants the key): the handle stays
    /// valid until `deadline`, which no longer grows; its owner should unlock as soon as it can.
    Recalled { handle: HandleId, key: Vec<u8>, deadline: Instant },
    /// The handle's deadline passed (its ttl ran out, or the delegation ended): the lock is lost
    /// and its next use fails with [`LockError::Expired`].
    Expired { handle: HandleId, key: Vec<u8> },
}

/// Why a lock call failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LockError {
    #[error("the key cannot be admitted locally right now")]
    WouldBlock,
    #[error("the key is longer than this node accepts")]
    KeyTooLong,
    #[error("a lock's ttl must be more than zero")]
    ZeroTtl,
    #[error("too many local lockers already wait for this key")]
    QueueFull,
    #[error("the handoff note is larger than this node accepts; the lock is still held")]
    NoteTooLarge,
    #[error("no home is known for the key: this node knows no epoch with members")]
    NoHome,
    #[error("the wait ran out before the lock was admitted")]
    Timeout,
    #[error("the key's home refused: {0}")]
    Refused(Refusal),
    #[error("the handle's deadline passed; the lock is lost")]
    Expired,
    #[error("this node tracks as many keys as it accepts; retry once some are unlocked")]
    TooManyKeys,
    #[error("no such handle: it was unlocked already, never issued, or its loss was already reported")]
    UnknownHandle,
    #[error("the node is shutting down")]
    Closed,
}

/// A delegation this holder holds, as [`Holder::delegation`] reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DelegationInfo {
    pub grantee: Grantee,
    /// End of the delegation on this node's clock.
    pub deadline: Instant,
    /// A recall closed admission; the delegation is released once the local handle is done.
    pub recalling: bool,
}

/// The holder side of delegations and the local lock table of one node. See the module docs.
#[derive(Debug)]
pub struct Holder {
    config: HolderConfig,
    /// The slot in `slots` of each key the holder tracks, stored under the key's hash by
    /// `config.key_hasher` (which never changes): every key once, and only slots that hold an
    /// entry (`insert` fills the slot before it indexes it; `tidy` takes the index entry out
    /// when it frees the slot).
    index: HashTable<u32>,
    slots: Vec<Option<Entry>>,
    free: Vec<u32>,
    /// Wake-ups `(at, slot)`; an item counts only while it equals its entry's `scheduled`.
    timers: BinaryHeap<Reverse<(Instant, u32)>>,
    /// Scratch list of the keys due in one `handle_timeout`.
    due: Vec<u32>,
    /// Set by [`Holder::shutdown`]: nothing is admitted or asked for any more.
    closed: bool,
    /// The walk of the last epoch change, until it has passed every slot.
    walk: Option<Walk>,
    io: Io,
}

/// Everything but the lock table, so entries and outputs can be borrowed at once.
#[derive(Debug)]
struct Io {
    /// The epoch stamped on outgoing messages: the latest `auth.epoch()` handed in.
    epoch: u64,
    /// The serial the next handle or ticket gets.
    next_serial: u64,
    serials: Serials,
    /// Requests numbered so far in this run (the `seq` of the latest [`RequestId`]).
    request_count: u64,
    /// Requests sent in this run, by increasing id, while a grant for them may be live.
    recent: VecDeque<Sent>,
    /// First and last request id of this run.
    issued: Option<(RequestId, RequestId)>,
    /// Highest id dropped from `recent` for lack of room rather than age.
    forgotten: RequestId,
    /// Serials of handles that expired, so that their next use says so.
    tombstones: HashSet<u64, Hasher>,
    tomb_order: VecDeque<u64>,
    out: VecDeque<(NodeId, Message)>,
    events: VecDeque<Event>,
    /// The injected bug `Bugs::short_past` (false without the `bug-injection` feature): an
    /// ended delegation's past forgets how long answers to its requests may still arrive.
    short_past: bool,
}

#[derive(Debug)]
struct Sent {
    id: RequestId,
    at: Instant,
    lease: Duration,
}

/// Everything one key needs. Exists while any field is in use; see [`Entry::is_empty`].
#[derive(Debug)]
struct Entry {
    key: Box<[u8]>,
    deleg: Option<Delegation>,
    /// The local handle. Some only while `deleg` is.
    local: Option<Local>,
    /// Local lockers, first come first admitted.
    waiters: VecDeque<Waiter>,
    /// The note the next `Release` carries: the grant's note, replaced by every unlock's note,
    /// cleared by a revocation.
    note: Option<Vec<u8>>,
    /// The outstanding request for this key (acquisition, or renewal when `held` is set).
    request: Option<Request>,
    /// Earliest instant of the next acquisition request.
    retry_at: Instant,
    /// Consecutive refusals, for the back-off.
    refusals: u32,
    /// A failed `try_lock` wants the delegation until then.
    want_until: Option<Instant>,
    /// The delegation this key had last, while its home may still speak of it.
    past: Option<Past>,
    /// A Recall that arrived for a grantee not held yet (it overtook its Grant or Pass while an
    /// acquisition request is outstanding): applied when that delegation arrives.
    early_recall: Option<Box<EarlyRecall>>,
    /// The wake-up of this entry in the heap, if any.
    scheduled: Option<Instant>,
}

#[derive(Debug)]
struct Delegation {
    grantee: Grantee,
    /// Where `Release` goes: the node that granted it or recalled it last.
    home: NodeId,
    lease: Duration,
    /// `send instant of the granting request + lease`.
    deadline: Instant,
    /// When to renew if busy: half the lease after the granting request's send instant.
    renew_at: Instant,
    /// The latest instant a grant answering any request this delegation came from, was renewed
    /// by, or dropped as unneeded at a recall may still arrive live (send instant + asked lease):
    /// the network may duplicate or delay an answer already taken, so the key's [`Past`] outlives
    /// this, to recognise such a grant.
    answers_until: Instant,
    next_seq: u64,
    /// Set by a recall: admission is closed, the local handle (asked to unlock by an
    /// [`Event::Recalled`]) no longer grows, and the delegation is released when it ends.
    recalled: bool,
    /// The delegation the home granted ahead to the next requester (a Recall carried it): passed
    /// on with [`Body::Pass`] at the release. Boxed: most delegations never have one.
    next: Option<Box<Successor>>,
    /// No admission yet under this delegation: the next one carries the grant's note and flag.
    fresh: bool,
    recovered: bool,
    /// What the next local admission and the release are told (`recovered`) once a handle
    /// admitted under this delegation has ended: the flag the handle itself was told, set at its
    /// admission; cleared by its unlock, set when it passes its deadline (it may have written
    /// without leaving a note), and left as it was when it is given back unused.
    unclean: bool,
    last_activity: Instant,
    /// Local activity since the last renewal was sent.
    active: bool,
}

#[derive(Debug)]
struct Local {
    serial: u64,
    deadline: Instant,
    /// `now + ttl` as last asked: how far a renewed delegation may extend the deadline.
    until: Instant,
    /// The handle's token, for token checks.
    token: FencingToken,
}

/// How a live handle ends ([`Holder::end`]): what the key's next holder is told.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ending {
    /// Unlocked by its holder, leaving this note for the next one: a clean handoff.
    Unlocked(Option<Vec<u8>>),
    /// Given back unused: the next holder gets this handle's handoff (its note and flag).
    GivenBack,
    /// Left by its holder without a handoff (it may have stopped halfway: a panic, a note the
    /// node refused): the next holder is told `recovered`, with no note, as after an expiry.
    Abandoned,
}

#[derive(Debug)]
struct Waiter {
    serial: u64,
    ttl: Duration,
    until: Instant,
}

#[derive(Debug)]
struct Request {
    id: RequestId,
    to: NodeId,
    /// First send: the grant's deadline counts from here.
    sent_at: Instant,
    last_sent: Instant,
    lease: Duration,
    held: Option<Grantee>,
}

impl Request {
    /// When it is next sent again if unanswered: `resend` after the last send, or a quarter of
    /// its lease if that is sooner. A resend tells the home the requester still waits, and a home
    /// that granted it ahead credits its lease again with the wait (D2.12), so a successor
    /// granted ahead long before the key reaches it still gets about its lease.
    fn resend_at(&self, config: &HolderConfig) -> Instant {
        self.last_sent + config.resend.min(self.lease / 4).max(MIN_INTERVAL)
    }
}

/// A Recall of a delegation that has not arrived yet, as it applies on arrival: the latest
/// grantee recalled, the node that recalled it last, and the latest successor any Recall of it
/// carried (the waiter the home granted ahead to follow it). Boxed in its entry: it is rare.
#[derive(Debug)]
struct EarlyRecall {
    grantee: Grantee,
    home: NodeId,
    next: Option<Box<Successor>>,
}

#[derive(Debug)]
struct Past {
    grantee: Grantee,
    /// The note it was released with, to repeat if the home recalls it again.
    note: Option<Vec<u8>>,
    /// Released (else it expired).
    released: bool,
    /// The `recovered` flag it was released with, to repeat with the note.
    recovered: bool,
    /// The successor it was passed on to, if any, to repeat with the note.
    passed: Option<Grantee>,
    next_seq: u64,
    until: Instant,
}

impl Holder {
    /// A holder that holds nothing. `now` is the creation instant on this node's clock.
    ///
    /// `config.retry` and `config.resend` are raised to at least 1 ms.
    pub fn new(mut config: HolderConfig, now: Instant) -> Holder {
        config.retry = config.retry.max(MIN_INTERVAL);
        config.resend = config.resend.max(MIN_INTERVAL);
        let serials = Serials { first: config.serials.first.max(1), step: config.serials.step.max(1) };
        let _ = now;
        let short_past = config.bugs().short_past;
        Holder {
            config,
            index: HashTable::new(),
            slots: Vec::new(),
            free: Vec::new(),
            timers: BinaryHeap::new(),
            due: Vec::new(),
            closed: false,
            walk: None,
            io: Io {
                epoch: 0,
                next_serial: serials.first,
                serials,
                request_count: 0,
                recent: VecDeque::new(),
                issued: None,
                forgotten: RequestId::default(),
                tombstones: HashSet::with_hasher(Hasher::new()),
                tomb_order: VecDeque::new(),
                out: VecDeque::new(),
                events: VecDeque::new(),
                short_past,
            },
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &HolderConfig {
        &self.config
    }

    /// The live delegation this holder holds for `key` at `now`, if any.
    pub fn delegation(&self, now: Instant, key: &[u8]) -> Option<DelegationInfo> {
        let d = self.entry(self.find(key)?)?.deleg.as_ref()?;
        (now < d.deadline).then_some(DelegationInfo {
            grantee: d.grantee,
            deadline: d.deadline,
            recalling: d.recalled,
        })
    }

    /// How many keys this holder tracks (delegations, waiters, requests, recent history).
    pub fn tracked_keys(&self) -> usize {
        self.index.len()
    }

    /// The key of `handle` while the handle is held; `None` once it was unlocked or taken away (a
    /// handle past its deadline is taken away by the next call that notices: `handle_timeout`,
    /// `renew`, `unlock`).
    pub fn key_of(&self, handle: HandleId) -> Option<&[u8]> {
        let e = self.entry(handle.slot)?;
        e.local.as_ref().is_some_and(|l| l.serial == handle.serial).then_some(&*e.key)
    }

    // ---- client calls ----

    /// Admits `key` at once if this node holds its live delegation, admission is open, and no
    /// local handle or waiter is ahead; sends nothing then.
    ///
    /// Otherwise fails with [`LockError::WouldBlock`]; and if the key has neither a delegation
    /// nor an outstanding request, it starts asking the home for one (asking it to wait
    /// [`HolderConfig::prefetch_wait`]), so a later `try_lock` can succeed. That request leaves
    /// at the next [`Holder::handle_timeout`]; `poll_timeout` then returns `now`.
    ///
    /// `ttl` (more than zero) bounds the handle: its deadline is `min(now + ttl, delegation
    /// deadline)`. Keys longer than `limits.max_key_len` fail with [`LockError::KeyTooLong`]
    /// before anything is allocated.
    #[inline]
    pub fn try_lock(&mut self, now: Instant, key: &[u8], ttl: Duration) -> Result<Handle, LockError> {
        self.try_lock_hashed(now, self.config.key_hasher.hashed(key), ttl)
    }

    /// [`Holder::try_lock`] of a key the caller hashed already, with this holder's
    /// [`HolderConfig::key_hasher`] (with another hasher's hash the key would not be found).
    #[inline]
    pub fn try_lock_hashed(
        &mut self,
        now: Instant,
        key: HashedKey<'_>,
        ttl: Duration,
    ) -> Result<Handle, LockError> {
        let (key, hash) = self.unpack(key);
        self.check(key, ttl)?;
        if let Some(handle) = self.admit_now(now, key, hash, ttl) {
            return Ok(handle);
        }
        self.prefetch(now, key, hash);
        Err(LockError::WouldBlock)
    }

    /// Locks `key` for `ttl`, waiting at most `wait` (from `now`).
    ///
    /// With the key's live delegation held, admission open and nobody ahead, returns
    /// [`LockOutcome::Locked`] at once and sends nothing. Otherwise queues the locker (FIFO per
    /// key, at most `limits.max_waiters_per_key`, else [`LockError::QueueFull`]), asks the key's
    /// home (`auth.home_of(key)`) for the delegation if nothing is held or asked yet, and returns
    /// [`LockOutcome::Pending`]; the outcome arrives as [`Event::Locked`] or
    /// [`Event::LockFailed`] ([`LockError::Timeout`] at `now + wait`, [`LockError::Refused`]).
    ///
    /// A zero `wait` behaves as [`Holder::try_lock`]. Fails with [`LockError::KeyTooLong`] before
    /// allocating anything, [`LockError::ZeroTtl`], or [`LockError::NoHome`] if a request is
    /// needed and `auth` names no home.
    pub fn lock<A: Authority + ?Sized>(
        &mut self,
        now: Instant,
        key: &[u8],
        ttl: Duration,
        wait: Duration,
        auth: &A,
    ) -> Result<LockOutcome, LockError> {
        self.lock_hashed(now, self.config.key_hasher.hashed(key), ttl, wait, auth)
    }

    /// [`Holder::lock`] of a key the caller hashed already, as for [`Holder::try_lock_hashed`].
    pub fn lock_hashed<A: Authority + ?Sized>(
        &mut self,
        now: Instant,
        key: HashedKey<'_>,
        ttl: Duration,
        wait: Duration,
        auth: &A,
    ) -> Result<LockOutcome, LockError> {
        let (key, hash) = self.unpack(key);
        self.check(key, ttl)?;
        if let Some(handle) = self.admit_now(now, key, hash, ttl) {
            return Ok(LockOutcome::Locked(handle));
        }
        if wait.is_zero() {
            self.prefetch(now, key, hash);
            return Err(LockError::WouldBlock);
        }
        self.io.epoch = auth.epoch();
        let existing = self.find_hashed(key, hash);
        let held = existing.and_then(|s| self.entry(s)).is_some_and(|e| e.deleg.is_some());
        if !held && auth.home_of(key).is_none() {
            return Err(LockError::NoHome);
        }
        if existing.and_then(|s| self.entry(s)).map_or(0, |e| e.waiters.len())
            >= self.config.limits.max_waiters_per_key
        {
            return Err(LockError::QueueFull);
        }
        let slot = match existing {
            Some(slot) => slot,
            None if self.index.len() >= self.config.limits.max_holder_keys => {
                return Err(LockError::TooManyKeys);
            }
            None => self.insert(now, key, hash),
        };
        let serial = self.io.serial();
        let e = self.slots[slot as usize].as_mut().expect("slot just looked up");
        e.waiters.push_back(Waiter { serial, ttl, until: now + wait });
        self.process(now, slot, auth);
        Ok(LockOutcome::Pending(Ticket { serial, slot }))
    }

    /// Extends a live handle to `min(now + ttl, delegation deadline)` and returns that new
    /// deadline; while a recall is under way it never extends the handle beyond its current
    /// deadline. A shorter `ttl` shortens it. Sends nothing.
    ///
    /// Fails with [`LockError::Expired`] (once) for a handle that passed its deadline,
    /// [`LockError::UnknownHandle`] for one that was unlocked, and [`LockError::ZeroTtl`].
    pub fn renew(&mut self, now: Instant, handle: HandleId, ttl: Duration) -> Result<Instant, LockError> {
        if ttl.is_zero() {
            return Err(LockError::ZeroTtl);
        }
        let slot = self.live(now, handle)?;
        let e = self.slots[slot as usize].as_mut().expect("live handle has an entry");
        let d = e.deleg.as_mut().expect("a local handle lives under a delegation");
        let until = now + ttl;
        let local = e.local.as_mut().expect("live handle");
        let mut deadline = until.min(d.deadline);
        if d.recalled {
            deadline = deadline.min(local.deadline);
        }
        d.last_activity = now;
        d.active = true;
        local.until = until;
        local.deadline = deadline;
        self.reschedule(slot);
        Ok(deadline)
    }

    /// Ends a live handle. `note` (at most `limits.max_note_len` bytes, else
    /// [`LockError::NoteTooLarge`] and the lock stays held) becomes the handoff note of the key's
    /// next `Release`, replacing any earlier one.
    ///
    /// The next local waiter is admitted at once (as [`Event::Locked`]), with no message. While a
    /// recall is under way the delegation is released at once instead, with this note. Errors as
    /// for [`Holder::renew`].
    #[inline]
    pub fn unlock(&mut self, now: Instant, handle: HandleId, note: Option<Vec<u8>>) -> Result<(), LockError> {
        self.end(now, handle, Ending::Unlocked(note))
    }

    /// Ends a live handle under which nothing was done (its caller went away before it saw the
    /// handle): the key's next holder gets the handoff this handle got, the key's note unchanged
    /// and the handle's `recovered` flag, as if it had never been admitted. Fails only as
    /// [`Holder::unlock`] does for a handle that is no longer live.
    pub fn give_back(&mut self, now: Instant, handle: HandleId) -> Result<(), LockError> {
        self.end(now, handle, Ending::GivenBack)
    }

    /// Ends a live handle as `ending` says ([`Holder::unlock`], [`Holder::give_back`], or
    /// [`Ending::Abandoned`]); an unlock's note is checked as [`Holder::unlock`] says.
    #[inline]
    pub fn end(&mut self, now: Instant, handle: HandleId, ending: Ending) -> Result<(), LockError> {
        if let Ending::Unlocked(Some(note)) = &ending
            && note.len() > self.config.limits.max_note_len
        {
            return Err(LockError::NoteTooLarge);
        }
        let slot = self.live(now, handle)?;
        let e = self.slots[slot as usize].as_mut().expect("live handle has an entry");
        e.local = None;
        // An unlock is a clean handoff with its own note; a give-back leaves the key's note and
        // `unclean` as this handle found them; an abandoned handle leaves neither.
        let unclean = match ending {
            Ending::Unlocked(note) => {
                e.note = note;
                Some(false)
            }
            Ending::GivenBack => None,
            Ending::Abandoned => {
                e.note = None;
                Some(true)
            }
        };
        if let Some(d) = e.deleg.as_mut() {
            if let Some(unclean) = unclean {
                d.unclean = unclean;
            }
            d.last_activity = now;
            d.active = true;
        }
        // The common case: nobody waits and no recall is under way. The handle's deadline is gone,
        // and the idle release and the renewal (activity being recorded) are the only wake-ups
        // that may have been added.
        let added = match &e.deleg {
            Some(d) if e.waiters.is_empty() && !d.recalled => {
                let idle = now + self.config.idle_release;
                Some(if e.request.is_none() { idle.min(d.renew_at) } else { idle })
            }
            _ => None,
        };
        match added {
            // `settle` would find nothing to do: no waiter to admit or fail, no recall to finish.
            Some(added) => self.reschedule_unless_covered(slot, added),
            None => {
                e.settle(slot, now, &mut self.io);
                self.reschedule(slot);
            }
        }
        Ok(())
    }

    /// Withdraws a pending lock. Returns whether it was still pending (no event follows then).
    pub fn cancel(&mut self, now: Instant, ticket: Ticket) -> bool {
        let Some(e) = self.slots.get_mut(ticket.slot as usize).and_then(Option::as_mut) else {
            return false;
        };
        let Some(i) = e.waiters.iter().position(|w| w.serial == ticket.serial) else { return false };
        e.waiters.remove(i);
        let _ = now;
        self.tidy(ticket.slot);
        true
    }

    /// Stops admitting, for a clean shutdown: queued lockers fail with [`LockError::Closed`],
    /// later `lock` calls too, and every delegation is treated as recalled. One with no live
    /// handle is released at once with its note; one with a live handle is released when that
    /// handle is unlocked or passes its deadline (its owner gets an [`Event::Recalled`]), so no
    /// other node admits the key while the handle is inside the deadline its owner was told.
    /// Outstanding requests are forgotten: grants that answer them are handed back.
    pub fn shutdown(&mut self, now: Instant) {
        self.closed = true;
        for slot in 0..self.slots.len() {
            let slot = slot as u32;
            let io = &mut self.io;
            let Some(e) = self.slots[slot as usize].as_mut() else { continue };
            e.fail_waiters(slot, io, LockError::Closed, |_| true);
            e.want_until = None;
            e.forget_renewal();
            e.request = None;
            e.recall(slot, io);
            e.settle(slot, now, io);
            self.tidy(slot);
        }
    }

    /// Whether any local handle is live (a shutdown waits for none to be left).
    pub fn has_handles(&self) -> bool {
        self.slots.iter().flatten().any(|e| e.local.is_some())
    }

    // ---- network and timers ----

    /// Handles a message from `from` (authenticated by the driver). Grants, refusals, recalls and
    /// probes are the holder's business; other kinds are ignored.
    pub fn handle_message<A: Authority + ?Sized>(
        &mut self,
        now: Instant,
        from: NodeId,
        message: Message,
        auth: &A,
    ) {
        self.io.epoch = auth.epoch();
        match message.body {
            Body::Grant { key, id, grantee, lease, note, recovered } => {
                self.on_grant(now, from, GrantMsg { key, id, grantee, lease, note, recovered }, auth)
            }
            Body::Refuse { key, id, reason } => self.on_refuse(now, from, &key, id, reason, auth),
            Body::Recall { key, grantee, next } => self.on_recall(now, from, &key, grantee, next, auth),
            // Only a member passes a key on: a removed node's certificate may be in other hands,
            // and a made-up Pass naming the home and a request of this node would have it admit
            // while the key's holder may still be inside its deadline. (A real one dropped here
            // costs a resend: the home grants the request again.)
            Body::Pass { .. } if !auth.is_member(from) => {}
            Body::Pass { key, home, id, grantee, lease, note, recovered } => {
                // Passed on by the previous holder: what the home granted, as if from the home.
                self.on_grant(now, home, GrantMsg { key, id, grantee, lease, note, recovered }, auth)
            }
            Body::Probe { key, id, token, asker } => self.on_probe(now, key, id, token, asker, auth),
            _ => {}
        }
    }

    /// The epoch changed (`auth` names the new one): every outstanding request whose key moved to
    /// another home is sent to that home at once. For the first [`HolderConfig::walk_step`]
    /// slots at once, the others a step per [`Holder::handle_timeout`] (see [`crate::walk`]).
    /// Until the walk reaches a key, nothing is lost but time: any other call that processes the
    /// key re-asks its new home too.
    pub fn on_epoch_change<A: Authority + ?Sized>(&mut self, now: Instant, auth: &A) {
        self.io.epoch = auth.epoch();
        self.walk = Some(Walk::new(now));
        self.walk_step(now, auth);
    }

    /// One step of the epoch walk in progress, if any.
    fn walk_step<A: Authority + ?Sized>(&mut self, now: Instant, auth: &A) {
        let Some(walk) = self.walk.as_mut() else { return };
        let slots = u32::try_from(self.slots.len()).unwrap_or(u32::MAX);
        for slot in walk.step(self.config.walk_step, slots) {
            let moved = self.slots[slot as usize].as_ref().is_some_and(|e| {
                e.request.as_ref().is_some_and(|r| auth.home_of(&e.key).is_some_and(|home| home != r.to))
            });
            if moved {
                self.process(now, slot, auth);
            }
        }
        if self.walk.is_some_and(|w| w.is_over(slots)) {
            self.walk = None;
        }
    }

    /// Handles timer expiry: delegation and handle deadlines, waiter timeouts,
    /// renewals, idle releases, retries and resends. Harmless to call early or often.
    pub fn handle_timeout<A: Authority + ?Sized>(&mut self, now: Instant, auth: &A) {
        self.io.epoch = auth.epoch();
        // Collect first, then process: each due key is processed once per call, so even a bug
        // that scheduled a wake-up at `now` could not loop here forever.
        let mut due = std::mem::take(&mut self.due);
        while let Some(&Reverse((at, slot))) = self.timers.peek() {
            if at > now {
                break;
            }
            self.timers.pop();
            if let Some(e) = self.slots.get_mut(slot as usize).and_then(Option::as_mut)
                && e.scheduled == Some(at)
            {
                e.scheduled = None;
                due.push(slot);
            }
        }
        for &slot in &due {
            self.process(now, slot, auth);
        }
        due.clear();
        self.due = due;
        self.walk_step(now, auth);
    }

    /// The earliest instant at which [`Holder::handle_timeout`] must be called; `None` when
    /// nothing is scheduled. While an epoch walk is in progress, no later than the instant it
    /// started (it is due until it is over; each call takes one step).
    #[inline]
    pub fn poll_timeout(&self) -> Option<Instant> {
        earliest(self.poll_timer(), self.walk.map(|w| w.since()))
    }

    /// The next wake-up, leaving the epoch walk out; after `handle_timeout(now)` it is always
    /// later than `now`.
    pub fn poll_timer(&self) -> Option<Instant> {
        self.timers.peek().map(|Reverse((at, _))| *at)
    }

    /// Whether an epoch walk is in progress (see [`crate::walk`]).
    pub fn walking(&self) -> bool {
        self.walk.is_some()
    }

    /// The next message to send, with its destination. Messages carry the epoch of the latest
    /// [`Authority`] handed in.
    pub fn poll_transmit(&mut self) -> Option<(NodeId, Message)> {
        self.io.out.pop_front()
    }

    /// The next event for the application.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.io.events.pop_front()
    }

    /// Whether [`Holder::poll_transmit`] or [`Holder::poll_event`] has something to hand out.
    pub fn has_output(&self) -> bool {
        !self.io.out.is_empty() || !self.io.events.is_empty()
    }

    // ---- internals: lock table ----

    fn entry(&self, slot: u32) -> Option<&Entry> {
        self.slots.get(slot as usize).and_then(Option::as_ref)
    }

    fn check(&self, key: &[u8], ttl: Duration) -> Result<(), LockError> {
        if self.closed {
            return Err(LockError::Closed);
        }
        if key.len() > self.config.limits.max_key_len {
            return Err(LockError::KeyTooLong);
        }
        if ttl.is_zero() {
            return Err(LockError::ZeroTtl);
        }
        Ok(())
    }

    /// The hot path: look the key up without allocating and admit if possible. Inlined, like
    /// [`Entry::admit`], so that the [`Handle`] is built where the caller keeps it.
    #[inline]
    fn admit_now(&mut self, now: Instant, key: &[u8], hash: u64, ttl: Duration) -> Option<Handle> {
        let slot = self.find_hashed(key, hash)?;
        let e = self.slots[slot as usize].as_mut()?;
        if !e.can_admit(now) {
            return None;
        }
        let handle = e.admit(slot, now, ttl, &mut self.io);
        // Admission takes the idle release away and adds two wake-ups at most: the handle's
        // deadline and, the key being busy now, the renewal. Every other one was covered before.
        let d = e.deleg.as_ref().expect("admitted under a delegation");
        let added = if e.request.is_none() { handle.deadline.min(d.renew_at) } else { handle.deadline };
        self.reschedule_unless_covered(slot, added);
        Some(handle)
    }

    fn prefetch(&mut self, now: Instant, key: &[u8], hash: u64) {
        let slot = match self.find_hashed(key, hash) {
            Some(slot) => slot,
            None if self.index.len() >= self.config.limits.max_holder_keys => return,
            None => self.insert(now, key, hash),
        };
        let e = self.slots[slot as usize].as_mut().expect("slot just looked up");
        if e.deleg.is_none() && e.request.is_none() {
            let until = now + self.config.prefetch_wait;
            e.want_until = Some(e.want_until.map_or(until, |u| u.max(until)));
        }
        self.tidy(slot);
    }

    /// The key and hash of `key`, which must come from this holder's [`HolderConfig::key_hasher`]
    /// (with another hasher's hash the key would not be found).
    #[inline]
    fn unpack<'a>(&self, key: HashedKey<'a>) -> (&'a [u8], u64) {
        debug_assert_eq!(key.hash(), self.config.key_hasher.hash(key.key()), "hashed by another hasher");
        (key.key(), key.hash())
    }

    /// The slot of `key`, if the holder tracks it.
    fn find(&self, key: &[u8]) -> Option<u32> {
        self.find_hashed(key, self.config.key_hasher.hash(key))
    }

    /// [`Holder::find`] of a key whose hash is `hash`.
    #[inline]
    fn find_hashed(&self, key: &[u8], hash: u64) -> Option<u32> {
        self.index.find(hash, |&slot| self.entry(slot).is_some_and(|e| *e.key == *key)).copied()
    }

    /// Tracks `key` (whose hash is `hash`), which the holder does not track yet: its new slot.
    fn insert(&mut self, now: Instant, key: &[u8], hash: u64) -> u32 {
        let entry = Entry {
            key: key.into(),
            deleg: None,
            local: None,
            waiters: VecDeque::new(),
            note: None,
            request: None,
            retry_at: now,
            refusals: 0,
            want_until: None,
            past: None,
            early_recall: None,
            scheduled: None,
        };
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some(entry);
                slot
            }
            None => {
                let slot = u32::try_from(self.slots.len()).expect("fewer than 2^32 keys");
                self.slots.push(Some(entry));
                slot
            }
        };
        let (slots, hasher) = (&self.slots, &self.config.key_hasher);
        self.index.insert_unique(hash, slot, |&n| {
            hasher.hash(&slots[n as usize].as_ref().expect("every indexed slot holds an entry").key)
        });
        slot
    }

    /// The slot of a live handle, or why it is not one. A handle found past its deadline is
    /// expired on the spot (with its event) and reported as such.
    #[inline]
    fn live(&mut self, now: Instant, id: HandleId) -> Result<u32, LockError> {
        if let Some(e) = self.entry(id.slot)
            && e.local.as_ref().is_some_and(|l| l.serial == id.serial && now < l.deadline)
        {
            return Ok(id.slot);
        }
        self.not_live(now, id)
    }

    /// Why [`Holder::live`] found no live handle: the handle passed its deadline (now, when it
    /// is still the key's local handle, or earlier), or is unknown. Only for a handle `live`
    /// turned down: a local handle of this serial is taken to be past its deadline.
    #[cold]
    fn not_live(&mut self, now: Instant, id: HandleId) -> Result<u32, LockError> {
        debug_assert!(
            self.entry(id.slot)
                .and_then(|e| e.local.as_ref())
                .is_none_or(|l| l.serial != id.serial || now >= l.deadline),
            "not_live of a live handle"
        );
        let slot = id.slot;
        if let Some(e) = self.slots.get_mut(slot as usize).and_then(Option::as_mut)
            && e.local.as_ref().is_some_and(|l| l.serial == id.serial)
        {
            self.io.expire_handle(slot, e);
            e.settle(slot, now, &mut self.io);
            self.io.tombstones.remove(&id.serial);
            self.reschedule(slot);
            return Err(LockError::Expired);
        }
        if self.io.tombstones.remove(&id.serial) {
            Err(LockError::Expired)
        } else {
            Err(LockError::UnknownHandle)
        }
    }

    /// Runs every timer of one entry that is due at `now`, sends what is owed, and reschedules.
    fn process<A: Authority + ?Sized>(&mut self, now: Instant, slot: u32, auth: &A) {
        let config = &self.config;
        let io = &mut self.io;
        let Some(e) = self.slots.get_mut(slot as usize).and_then(Option::as_mut) else { return };
        if e.deleg.as_ref().is_some_and(|d| now >= d.deadline) {
            e.expire(slot, now, io);
        }
        if e.local.as_ref().is_some_and(|l| now >= l.deadline) {
            io.expire_handle(slot, e);
        }
        e.settle(slot, now, io);
        if e.want_until.is_some_and(|until| now >= until) {
            e.want_until = None;
        }
        if let Some(d) = &e.deleg
            && !d.recalled
            && e.local.is_none()
            && e.waiters.is_empty()
            && now >= d.last_activity + config.idle_release
        {
            e.release(now, io);
        }
        e.drive_requests(now, config, io, auth);
        if e.past.as_ref().is_some_and(|p| now >= p.until) {
            e.past = None;
        }
        self.tidy(slot);
    }

    /// Drops an entry nothing uses any more, or reschedules it.
    fn tidy(&mut self, slot: u32) {
        let Some(e) = self.slots.get_mut(slot as usize).and_then(Option::as_mut) else { return };
        if e.is_empty() {
            let e = self.slots[slot as usize].take().expect("entry present");
            let found = self.index.find_entry(self.config.key_hasher.hash(&e.key), |&n| n == slot);
            debug_assert!(found.is_ok(), "a tracked key was not in the index");
            if let Ok(found) = found {
                found.remove();
            }
            self.free.push(slot);
            return;
        }
        self.reschedule(slot);
    }

    /// [`Holder::reschedule`] after a change that cannot have added a wake-up before `added`:
    /// every other wake-up the entry needs was needed before the change, so the scheduled one
    /// covers it. Skips computing the next wake-up when the scheduled one is not later than `added`.
    #[inline]
    fn reschedule_unless_covered(&mut self, slot: u32, added: Instant) {
        if let Some(e) = self.entry(slot)
            && let Some(scheduled) = e.scheduled
            && scheduled <= added
        {
            debug_assert!(
                e.next_wake(&self.config).is_none_or(|at| scheduled <= at),
                "a skipped reschedule left a wake-up uncovered",
            );
            return;
        }
        self.reschedule(slot);
    }

    /// Pushes the entry's next wake-up if it is earlier than the one already scheduled.
    fn reschedule(&mut self, slot: u32) {
        let Some(e) = self.slots.get_mut(slot as usize).and_then(Option::as_mut) else { return };
        let Some(at) = e.next_wake(&self.config) else { return };
        if e.scheduled.is_some_and(|s| s <= at) {
            return;
        }
        e.scheduled = Some(at);
        self.timers.push(Reverse((at, slot)));
        if self.timers.len() > 64 + 2 * self.index.len() {
            // Superseded wake-ups pile up only when deadlines keep moving earlier; rebuild.
            self.timers = self
                .slots
                .iter()
                .enumerate()
                .filter_map(|(i, e)| Some(Reverse((e.as_ref()?.scheduled?, i as u32))))
                .collect();
        }
    }

    // ---- internals: messages ----

    fn on_grant<A: Authority + ?Sized>(&mut self, now: Instant, from: NodeId, g: GrantMsg, auth: &A) {
        let slot = self.find(&g.key);
        let matched = slot.filter(|&s| {
            self.entry(s).and_then(|e| e.request.as_ref()).is_some_and(|r| r.id == g.id && r.to == from)
        });
        let Some(slot) = matched else {
            return self.stray_grant(now, from, slot, g);
        };
        let config = &self.config;
        let io = &mut self.io;
        let e = self.slots[slot as usize].as_mut().expect("matched entry");
        let r = e.request.take().expect("matched request");
        let early = e.early_recall.take().filter(|early| early.grantee == g.grantee).map(|early| *early);
        // A home credits a request that waited in line with its wait (D2.2): the lease counts
        // from the first send, so it may be longer than asked, but never ends later than the
        // lease asked for from now.
        let lease = g.lease.min(now.saturating_duration_since(r.sent_at) + r.lease);
        let deadline = if config.bugs().deadline_from_receipt { now + lease } else { r.sent_at + lease };
        // A handle already past its deadline (the timer runs late) ends before the grant is taken
        // in: its expiry clears the key's note, which from here on may be the one this grant brings.
        if e.local.as_ref().is_some_and(|l| now >= l.deadline) {
            io.expire_handle(slot, e);
        }
        match (&mut e.deleg, r.held) {
            (Some(d), Some(held)) if held == d.grantee => {
                // Renewal: the deadline again counts from this request's send instant, but never
                // comes earlier than before (the home never shortens its view either): a shorter
                // lease, after a timing change, must not cut a local handle below the deadline its
                // owner was told. A grantee older than the one held is ignored (its tokens would
                // be lower).
                if g.grantee >= d.grantee {
                    let renewed = g.grantee == d.grantee;
                    if !renewed {
                        // Not a renewal after all: the home let the held delegation end (it
                        // expired there, or the home restarted) and granted a new one. Another
                        // node may have held the key in between, so what the next admission is
                        // told comes from this grant, as for an acquisition, not from this
                        // holder's own last unlock; and a handle of the old delegation keeps its
                        // deadline.
                        d.grantee = g.grantee;
                        d.next_seq = 0;
                        d.fresh = true;
                        d.recovered = g.recovered;
                        d.unclean = false;
                        e.note = g.note;
                    }
                    d.home = from;
                    d.lease = lease;
                    d.deadline =
                        if config.bugs().renewal_shortens { deadline } else { d.deadline.max(deadline) };
                    d.renew_at = r.sent_at + lease / 2;
                    d.answers_until = d.answers_until.max(r.sent_at + r.lease);
                    if renewed && let Some(local) = &mut e.local {
                        local.deadline = local.until.min(d.deadline);
                    }
                    e.refusals = 0;
                }
            }
            (None, None) => {
                let next_seq = e.next_seq_for(g.grantee);
                // A lease shorter than `min_useful` (the epoch's cap may be) is useful while half of
                // it is left: handing every such grant back would never admit anything.
                let useful = deadline.saturating_duration_since(now) >= config.min_useful.min(lease / 2);
                match next_seq {
                    Some(next_seq) if useful => {
                        e.deleg = Some(Delegation {
                            grantee: g.grantee,
                            // A Recall that overtook this grant closes admission at once: the
                            // delegation goes where it says, to the successor it carried if any.
                            home: early.as_ref().map_or(from, |early| early.home),
                            lease,
                            deadline,
                            renew_at: r.sent_at + lease / 2,
                            answers_until: r.sent_at + r.lease,
                            next_seq,
                            recalled: early.is_some(),
                            next: early.and_then(|early| early.next),
                            fresh: true,
                            unclean: false,
                            recovered: g.recovered,
                            last_activity: now,
                            active: false,
                        });
                        e.note = g.note;
                        e.past = None;
                        e.want_until = None;
                        e.refusals = 0;
                        e.settle(slot, now, io);
                    }
                    _ => {
                        // Too late to be useful (or below a grantee already used): hand it back
                        // with its note and flag, so the next holder still gets them, and ask
                        // again.
                        let (note, recovered) = (g.note, g.recovered);
                        io.send(
                            from,
                            Body::Release { key: g.key, grantee: g.grantee, note, recovered, passed: None },
                        );
                        e.retry_at = now;
                    }
                }
            }
            _ => {
                // Cannot happen (a renewal is forgotten with its delegation, and nothing is
                // acquired while a delegation is held), but never use or keep it.
                let held = e.deleg.as_ref().is_some_and(|d| d.grantee == g.grantee);
                if !held && now < deadline {
                    let (note, recovered) = (g.note, g.recovered);
                    io.send(
                        from,
                        Body::Release { key: g.key, grantee: g.grantee, note, recovered, passed: None },
                    );
                }
            }
        }
        self.process(now, slot, auth);
    }

    /// A grant for no outstanding request: a duplicate, a late answer to a forgotten request, or
    /// an answer from the wrong node. Handed back if it may be live, with the note and flag it
    /// carries; the one held is kept. A grant of the delegation this key had last (a renewal
    /// answered after it ended) is not handed back if it was released: that Release, in flight,
    /// covers it and carries the real note. If it expired, it is handed back flagged `recovered`.
    /// A grant answering a request of an earlier run of this node is kept from the home: it may
    /// renew a delegation under which that run admitted handles whose owners still work inside
    /// the deadlines they were told (a crash ends none of them), so only its expiry at the home,
    /// which outlasts every such deadline, may free the key.
    fn stray_grant(&mut self, now: Instant, from: NodeId, slot: Option<u32>, g: GrantMsg) {
        let e = slot.and_then(|s| self.entry(s));
        if e.and_then(|e| e.deleg.as_ref()).is_some_and(|d| d.grantee == g.grantee) {
            return;
        }
        let (note, recovered) = match e.and_then(|e| e.past.as_ref()).filter(|p| p.grantee == g.grantee) {
            Some(p) if p.released => return,
            Some(_) => (None, true),
            None if !self.io.issued_this_run(g.id) => {
                if !self.config.bugs().restart_hands_back {
                    return;
                }
                // The injected bug: hand the earlier run's grant back, as before the fix.
                (g.note, true)
            }
            None => (g.note, g.recovered),
        };
        if self.io.grant_live(g.id, g.lease, now) {
            self.io
                .send(from, Body::Release { key: g.key, grantee: g.grantee, note, recovered, passed: None });
        }
    }

    fn on_refuse<A: Authority + ?Sized>(
        &mut self,
        now: Instant,
        from: NodeId,
        key: &[u8],
        id: RequestId,
        reason: Refusal,
        auth: &A,
    ) {
        let Some(slot) = self.find(key) else { return };
        let config = &self.config;
        let io = &mut self.io;
        let Some(e) = self.slots[slot as usize].as_mut() else { return };
        if !e.request.as_ref().is_some_and(|r| r.id == id && r.to == from) {
            return;
        }
        let r = e.request.take().expect("matched request");
        // A delay the home names is at most the epoch's fence bound (a quarantine is shorter):
        // a longer one, from a confused peer, would stall the key here.
        let cap = auth.timing().fence_bound();
        if let Some(d) = e.deleg.as_mut() {
            // A refused renewal: the delegation stays valid until its deadline, and is renewed
            // again later only if the refusal was about where or when to ask.
            if r.held.is_some() {
                d.renew_at = match renewal_retry_delay(reason) {
                    Some(delay) => now + config.backoff(e.refusals).max(delay.min(cap)),
                    None => d.deadline,
                };
                e.refusals = e.refusals.saturating_add(1);
            }
        } else {
            match retry_delay(reason) {
                Some(delay) => {
                    let at = now + config.backoff(e.refusals).max(delay.min(cap));
                    e.refusals = e.refusals.saturating_add(1);
                    e.retry_at = at;
                    // Lockers whose wait ends before the retry time out now: the refusal was
                    // temporary (the key is busy, or the home not ready yet), so their wait is
                    // what ran out.
                    e.fail_waiters(slot, io, LockError::Timeout, |w| w.until <= at);
                    if e.want_until.is_some_and(|until| until <= at) {
                        e.want_until = None;
                    }
                }
                None => {
                    e.fail_waiters(slot, io, LockError::Refused(reason), |_| true);
                    e.want_until = None;
                }
            }
        }
        self.process(now, slot, auth);
    }

    fn on_recall<A: Authority + ?Sized>(
        &mut self,
        now: Instant,
        from: NodeId,
        key: &[u8],
        grantee: Grantee,
        next: Option<Successor>,
        auth: &A,
    ) {
        let Some(slot) = self.find(key) else { return };
        let release_at_once = self.config.bugs().release_before_revoke;
        let io = &mut self.io;
        let Some(e) = self.slots[slot as usize].as_mut() else { return };
        if let Some(d) = e.deleg.as_mut()
            && d.grantee == grantee
        {
            keep_recall(&mut d.home, &mut d.next, from, next);
            if release_at_once {
                // The injected bug: give the delegation back while the local handle lives on.
                e.release(now, io);
                self.process(now, slot, auth);
                return;
            }
            e.recall(slot, io);
            // Releases at once if no local handle holds the key.
            e.settle(slot, now, io);
        } else if let Some(p) = &e.past
            && p.grantee == grantee
        {
            if p.released {
                // The release was lost: say it again, with the same note and flag (and what it
                // was passed on to: that Pass is not repeated; if it was lost too, its receiver
                // asks the home again).
                let (note, recovered, passed) = (p.note.clone(), p.recovered, p.passed);
                io.send(from, Body::Release { key: e.key.to_vec(), grantee, note, recovered, passed });
            }
        } else if e.deleg.is_none()
            && e.request.as_ref().is_some_and(|r| r.held.is_none())
            && e.past.as_ref().is_none_or(|p| p.grantee < grantee)
        {
            // The Recall overtook its Grant (or Pass): remember it for when that arrives, with
            // the latest successor granted ahead, as a Recall of a held delegation keeps it.
            match &mut e.early_recall {
                Some(early) if early.grantee > grantee => {}
                Some(early) if early.grantee == grantee => {
                    keep_recall(&mut early.home, &mut early.next, from, next)
                }
                _ => {
                    e.early_recall =
                        Some(Box::new(EarlyRecall { grantee, home: from, next: next.map(Box::new) }))
                }
            }
        }
        self.process(now, slot, auth);
    }

    /// Answers check `id` of `asker` about `token`, which a home forwarded because it believes
    /// this node holds the token's delegation (see [`crate::check`]). The key's state is brought
    /// up to date first, so a handle past its deadline is not reported held. Anyone may ask: the
    /// answer says no more than the home would, and costs one message.
    fn on_probe<A: Authority + ?Sized>(
        &mut self,
        now: Instant,
        key: Vec<u8>,
        id: u64,
        token: FencingToken,
        asker: NodeId,
        auth: &A,
    ) {
        let slot = self.find(&key);
        if let Some(slot) = slot {
            self.process(now, slot, auth);
        }
        let answer = slot.and_then(|s| self.entry(s)).map_or(CheckAnswer::NotHeld, |e| e.judge(token));
        self.io.send(asker, Body::CheckReply { key, id, answer: Ok(answer) });
    }
}

/// What a Recall tells the holder of the delegation it names, held or still on its way: the node
/// that recalled it last is the one its Release and Pass name, and the latest successor the home
/// granted ahead is the one to pass it on to (a Recall without one keeps the earlier).
fn keep_recall(
    home: &mut NodeId,
    successor: &mut Option<Box<Successor>>,
    from: NodeId,
    next: Option<Successor>,
) {
    *home = from;
    if let Some(next) = next {
        *successor = Some(Box::new(next));
    }
}

/// Like [`retry_delay`], for a refused renewal. Only a refusal about where or when to ask is
/// retried; any other (a home that will not extend because others wait, one that cannot grant
/// now, caps) stops renewing: the delegation is used until its deadline, and a home with
/// waiters recalls it meanwhile.
fn renewal_retry_delay(reason: Refusal) -> Option<Duration> {
    match reason {
        Refusal::NotHome | Refusal::StaleEpoch => Some(Duration::ZERO),
        Refusal::Quarantine(d) | Refusal::LockDelay(d) => Some(d),
        _ => None,
    }
}

/// A received grant's fields.
struct GrantMsg {
    key: Vec<u8>,
    id: RequestId,
    grantee: Grantee,
    lease: Duration,
    note: Option<Vec<u8>>,
    recovered: bool,
}

/// How long to wait before asking again after `reason`, or `None` if asking again is pointless
/// and the lockers fail with it. Refusals this code does not know (added later) are taken as
/// temporary: a retry is bounded by the lockers' waits anyway.
fn retry_delay(reason: Refusal) -> Option<Duration> {
    match reason {
        Refusal::Quarantine(d) | Refusal::LockDelay(d) => Some(d),
        Refusal::NotMember
        | Refusal::KeyTooLong
        | Refusal::NoteTooLarge
        | Refusal::HomeFull
        | Refusal::RequesterFull
        | Refusal::QueueFull => None,
        // NotHome, StaleEpoch, WaitExpired (lockers that joined later may still wait), and
        // anything newer such as an activating home.
        _ => Some(Duration::ZERO),
    }
}

impl Io {
    fn send(&mut self, to: NodeId, body: Body) {
        self.out.push_back((to, Message { epoch: self.epoch, body }));
    }

    fn serial(&mut self) -> u64 {
        let serial = self.next_serial;
        self.next_serial = serial.saturating_add(self.serials.step);
        serial
    }

    /// A fresh request id of the run `incarnation`: no grant meant for an earlier run, or for an
    /// earlier request of this one, can match it (64-bit numbers never wrap).
    fn request_id(&mut self, incarnation: u64, now: Instant, lease: Duration) -> RequestId {
        self.request_count += 1;
        let id = RequestId::new(incarnation, self.request_count);
        self.issued = Some(self.issued.map_or((id, id), |(first, _)| (first, id)));
        while self.recent.front().is_some_and(|s| now >= s.at + s.lease) {
            self.recent.pop_front();
        }
        if self.recent.len() >= RECENT_REQUESTS
            && let Some(s) = self.recent.pop_front()
        {
            self.forgotten = self.forgotten.max(s.id);
        }
        self.recent.push_back(Sent { id, at: now, lease });
        id
    }

    /// How long an answer to one of an ended delegation's requests may still arrive live:
    /// `answers_until` (with the injected bug `short_past`, no longer than its `deadline`).
    fn answers_until(&self, deadline: Instant, answers_until: Instant) -> Instant {
        if self.short_past { deadline } else { answers_until }
    }

    /// Whether request `id` was sent by this run of the node.
    fn issued_this_run(&self, id: RequestId) -> bool {
        self.issued.is_some_and(|(first, last)| (first..=last).contains(&id))
    }

    /// Whether a grant answering request `id` with `lease` may still be live at `now`. Unknown
    /// ids (another run's, or forgotten for lack of room) count as live: handing back a dead
    /// grant costs a message, keeping a live one costs the home a lease.
    fn grant_live(&self, id: RequestId, lease: Duration, now: Instant) -> bool {
        match self.recent.binary_search_by_key(&id, |s| s.id) {
            Ok(i) => {
                let s = &self.recent[i];
                now < s.at + lease.min(s.lease)
            }
            Err(_) => {
                let aged_out = self.issued_this_run(id) && id > self.forgotten;
                !aged_out
            }
        }
    }

    /// Ends the entry's local handle at its deadline (with its event) and clears the note: its
    /// owner may have written without handing one.
    fn expire_handle(&mut self, slot: u32, e: &mut Entry) {
        let Some(local) = e.local.take() else { return };
        e.note = None;
        if let Some(d) = e.deleg.as_mut() {
            d.unclean = true;
        }
        if self.tomb_order.len() >= TOMBSTONES
            && let Some(old) = self.tomb_order.pop_front()
        {
            self.tombstones.remove(&old);
        }
        self.tombstones.insert(local.serial);
        self.tomb_order.push_back(local.serial);
        let handle = HandleId { serial: local.serial, slot };
        self.events.push_back(Event::Expired { handle, key: e.key.to_vec() });
    }
}

impl Entry {
    fn is_empty(&self) -> bool {
        self.deleg.is_none()
            && self.local.is_none()
            && self.waiters.is_empty()
            && self.request.is_none()
            && self.want_until.is_none()
            && self.past.is_none()
    }

    /// What a token check of this key's `token` answers, from the latest delegation this holder
    /// knows of (held, or the one it had last): see [`crate::check::judge`].
    fn judge(&self, token: FencingToken) -> CheckAnswer {
        match (&self.deleg, &self.past) {
            (Some(d), _) => check::judge(token, d.grantee, d.next_seq, self.local.as_ref().map(|l| l.token)),
            (None, Some(p)) => check::judge(token, p.grantee, p.next_seq, None),
            (None, None) => CheckAnswer::NotHeld,
        }
    }

    /// Whether some locker wants the delegation at `now`.
    fn wanted(&self, now: Instant) -> bool {
        !self.waiters.is_empty() || self.want_until.is_some_and(|until| now < until)
    }

    /// How long the lockers wanting the delegation can still wait.
    fn wait_left(&self, now: Instant) -> Duration {
        let until = self.waiters.iter().map(|w| w.until).chain(self.want_until).max();
        until.map_or(Duration::ZERO, |until| until.saturating_duration_since(now))
    }

    /// Whether a new locker is admitted at once: live delegation, admission open, nobody ahead.
    fn can_admit(&self, now: Instant) -> bool {
        self.local.is_none()
            && self.waiters.is_empty()
            && self.deleg.as_ref().is_some_and(|d| !d.recalled && now < d.deadline)
    }

    /// The local sequence a delegation to `grantee` starts at, or `None` if its tokens would not
    /// exceed those this key already had.
    fn next_seq_for(&self, grantee: Grantee) -> Option<u64> {
        match &self.past {
            Some(p) if p.grantee == grantee => Some(p.next_seq),
            Some(p) if p.grantee > grantee => None,
            _ => Some(0),
        }
    }

    /// Admits one locker; the caller checked the delegation is live and open and the key free.
    #[inline]
    fn admit(&mut self, slot: u32, now: Instant, ttl: Duration, io: &mut Io) -> Handle {
        let d = self.deleg.as_mut().expect("admission needs a delegation");
        let serial = io.serial();
        let token = d.grantee.token(d.next_seq);
        d.next_seq += 1;
        let until = now + ttl;
        let deadline = until.min(d.deadline);
        // The first admission under a delegation is told the grant's flag; a local successor,
        // whether the previous local handle was taken away instead of unlocked.
        if d.fresh {
            d.fresh = false;
            d.unclean = d.recovered;
        }
        let (note, recovered) = (self.note.clone(), d.unclean);
        d.last_activity = now;
        d.active = true;
        self.local = Some(Local { serial, deadline, until, token });
        Handle { id: HandleId { serial, slot }, token, deadline, note, recovered }
    }

    /// Closes admission on the held delegation (if any, and not yet closed) and asks the local
    /// handle's owner to unlock: from now on the handle's deadline never grows.
    fn recall(&mut self, slot: u32, io: &mut Io) {
        let Some(d) = self.deleg.as_mut() else { return };
        if d.recalled {
            return;
        }
        d.recalled = true;
        if let Some(local) = &self.local {
            let handle = HandleId { serial: local.serial, slot };
            io.events.push_back(Event::Recalled { handle, key: self.key.to_vec(), deadline: local.deadline });
        }
    }

    /// After the local handle may have ended: fails lockers whose wait ran out; then, if no
    /// handle holds the key, releases a recalled delegation or admits the next locker.
    fn settle(&mut self, slot: u32, now: Instant, io: &mut Io) {
        self.fail_waiters(slot, io, LockError::Timeout, |w| now >= w.until);
        if self.local.is_some() {
            return;
        }
        let Some(d) = &self.deleg else { return };
        if now >= d.deadline {
            return; // expiry is the timers' business
        }
        // A delegation recalled before it admitted anyone (the Recall came with it, or ahead of
        // it, as it does for a delegation the home granted ahead in a chain) still admits the
        // locker first in line once: the key came here for it.
        let admit_one = d.fresh && !self.waiters.is_empty();
        if d.recalled && !admit_one {
            self.release(now, io);
            return;
        }
        if let Some(w) = self.waiters.pop_front() {
            let recalled = d.recalled;
            let handle = self.admit(slot, now, w.ttl, io);
            let (id, deadline) = (handle.id, handle.deadline);
            io.events.push_back(Event::Locked { ticket: Ticket { serial: w.serial, slot }, handle });
            if recalled {
                io.events.push_back(Event::Recalled { handle: id, key: self.key.to_vec(), deadline });
            }
        }
    }

    fn fail_waiters(&mut self, slot: u32, io: &mut Io, error: LockError, fail: impl Fn(&Waiter) -> bool) {
        if !self.waiters.iter().any(&fail) {
            return;
        }
        self.waiters.retain(|w| {
            if fail(w) {
                let ticket = Ticket { serial: w.serial, slot };
                io.events.push_back(Event::LockFailed { ticket, error });
                false
            } else {
                true
            }
        });
    }

    /// Gives the delegation back with the stored note. A delegation granted `recovered` and
    /// never used passes the flag on, and so does one whose last handle was taken away rather
    /// than unlocked. Lockers still queued ask again.
    fn release(&mut self, now: Instant, io: &mut Io) {
        let Some(d) = self.deleg.take() else { return };
        let note = self.note.take();
        let recovered = (d.fresh && d.recovered) || d.unclean;
        // A successor the home granted ahead gets the key first, then the home hears of it.
        let passed = d.next.filter(|_| d.recalled).map(|s| {
            let (key, note) = (self.key.to_vec(), note.clone());
            let Successor { to, id, grantee, lease } = *s;
            io.send(to, Body::Pass { key, home: d.home, id, grantee, lease, note, recovered });
            grantee
        });
        let body = Body::Release {
            key: self.key.to_vec(),
            grantee: d.grantee,
            note: note.clone(),
            recovered,
            passed,
        };
        io.send(d.home, body);
        self.past = Some(Past {
            grantee: d.grantee,
            note,
            released: true,
            recovered,
            passed,
            next_seq: d.next_seq,
            until: (d.deadline + d.lease).max(io.answers_until(d.deadline, d.answers_until)),
        });
        self.forget_renewal();
        self.retry_at = now;
    }

    /// The delegation's deadline passed: the handle under it ends and it is dropped, without a
    /// message (the home expires it on its own clock). Lockers still queued ask again.
    fn expire(&mut self, slot: u32, now: Instant, io: &mut Io) {
        io.expire_handle(slot, self);
        let Some(d) = self.deleg.take() else { return };
        self.note = None;
        self.past = Some(Past {
            grantee: d.grantee,
            note: None,
            released: false,
            recovered: true,
            passed: None,
            next_seq: d.next_seq,
            until: (now + d.lease).max(io.answers_until(d.deadline, d.answers_until)),
        });
        self.forget_renewal();
        self.retry_at = now;
    }

    /// A renewal's grant that arrives after its delegation is gone is a stray: the past
    /// delegation is remembered at least as long as that grant may be live, so the stray is
    /// recognised as one (see `Holder::stray_grant`). So is one whose request is dropped while the delegation is still held (a recall made it
    /// unneeded): the delegation's `answers_until` covers it, and its past inherits that.
    fn forget_renewal(&mut self) {
        if let Some(r) = self.request.take_if(|r| r.held.is_some()) {
            let until = r.sent_at + r.lease;
            if let Some(p) = &mut self.past {
                p.until = p.until.max(until);
            }
            if let Some(d) = &mut self.deleg {
                d.answers_until = d.answers_until.max(until);
            }
        }
    }

    /// Resends an unanswered request, forgets one nobody needs, renews a busy delegation, and
    /// asks for a wanted one.
    fn drive_requests<A: Authority + ?Sized>(
        &mut self,
        now: Instant,
        config: &HolderConfig,
        io: &mut Io,
        auth: &A,
    ) {
        if let Some(r) = &self.request {
            let needed = match r.held {
                Some(_) => self.deleg.as_ref().is_some_and(|d| !d.recalled),
                None => self.deleg.is_none() && self.wanted(now),
            };
            // An epoch change moved the key's home: ask the new home at once rather than keep
            // asking one that may be gone (a dead home never answers `NotHome`). A grant the old
            // home still sends is a stray and handed back.
            let moved = auth.home_of(&self.key).is_some_and(|home| home != r.to);
            if !needed || moved {
                self.forget_renewal();
                if moved {
                    self.retry_at = now;
                    if let Some(d) = &mut self.deleg {
                        d.renew_at = now;
                    }
                }
                self.request = None;
            }
        }
        let wait = match &self.deleg {
            Some(d) => d.deadline.saturating_duration_since(now),
            None => self.wait_left(now),
        };
        if let Some(r) = &mut self.request {
            if now >= r.resend_at(config) {
                // Same id, so the grant still counts from the first send; the home treats it as
                // a duplicate, which the network may produce anyway.
                r.last_sent = now;
                let body =
                    Body::Request { key: self.key.to_vec(), id: r.id, lease: r.lease, wait, held: r.held };
                io.send(r.to, body);
            }
            return;
        }
        match &mut self.deleg {
            Some(d) => {
                let busy = d.active || self.local.is_some() || !self.waiters.is_empty();
                if !d.recalled && busy && now >= d.renew_at {
                    let held = Some(d.grantee);
                    match send_request(&self.key, now, config, io, auth, held, wait) {
                        Some(r) => {
                            d.active = false;
                            self.request = Some(r);
                        }
                        None => d.renew_at = now + config.retry,
                    }
                }
            }
            None => {
                if self.wanted(now) && now >= self.retry_at {
                    match send_request(&self.key, now, config, io, auth, None, wait) {
                        Some(r) => self.request = Some(r),
                        None => self.retry_at = now + config.backoff(self.refusals),
                    }
                }
            }
        }
    }

    /// The next instant this entry needs the timers, if any.
    fn next_wake(&self, config: &HolderConfig) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut at = |t: Instant| next = Some(next.map_or(t, |n| n.min(t)));
        match &self.deleg {
            Some(d) => {
                at(d.deadline);
                if !d.recalled {
                    let busy = self.local.is_some() || !self.waiters.is_empty();
                    if !busy {
                        at(d.last_activity + config.idle_release);
                    }
                    if self.request.is_none() && (busy || d.active) {
                        at(d.renew_at);
                    }
                }
            }
            None => {
                if self.request.is_none() && (!self.waiters.is_empty() || self.want_until.is_some()) {
                    at(self.retry_at);
                }
            }
        }
        if let Some(r) = &self.request {
            at(r.resend_at(config));
        }
        if let Some(local) = &self.local {
            at(local.deadline);
        }
        for w in &self.waiters {
            at(w.until);
        }
        if let Some(until) = self.want_until {
            at(until);
        }
        if let Some(p) = &self.past {
            at(p.until);
        }
        next
    }
}

/// Sends a request for `key` to its home; `None` if no home is known.
fn send_request<A: Authority + ?Sized>(
    key: &[u8],
    now: Instant,
    config: &HolderConfig,
    io: &mut Io,
    auth: &A,
    held: Option<Grantee>,
    wait: Duration,
) -> Option<Request> {
    let to = auth.home_of(key)?;
    let lease = config.lease.min(auth.timing().max_delegation_lease);
    let id = io.request_id(auth.incarnation(), now, lease);
    io.send(to, Body::Request { key: key.to_vec(), id, lease, wait, held });
    Some(Request { id, to, sent_at: now, last_sent: now, lease, held })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let config = HolderConfig::new(NodeId(1));
        assert_eq!(config.backoff(0), Duration::from_millis(50));
        assert_eq!(config.backoff(1), Duration::from_millis(100));
        assert_eq!(config.backoff(5), Duration::from_millis(1600));
        assert_eq!(config.backoff(50), Duration::from_millis(1600));
    }

    #[test]
    fn a_renewal_is_retried_only_after_where_or_when_refusals() {
        assert_eq!(renewal_retry_delay(Refusal::NotHome), Some(Duration::ZERO));
        assert_eq!(renewal_retry_delay(Refusal::StaleEpoch), Some(Duration::ZERO));
        assert_eq!(
            renewal_retry_delay(Refusal::Quarantine(Duration::from_secs(1))),
            Some(Duration::from_secs(1))
        );
        for stop in [Refusal::WaitExpired, Refusal::QueueFull, Refusal::RequesterFull, Refusal::NotMember] {
            assert_eq!(renewal_retry_delay(stop), None, "{stop:?}");
        }
    }

    #[test]
    fn refusals_split_into_retry_and_fail() {
        assert_eq!(retry_delay(Refusal::NotHome), Some(Duration::ZERO));
        assert_eq!(retry_delay(Refusal::StaleEpoch), Some(Duration::ZERO));
        assert_eq!(retry_delay(Refusal::Quarantine(Duration::from_secs(3))), Some(Duration::from_secs(3)));
        assert_eq!(retry_delay(Refusal::LockDelay(Duration::from_secs(2))), Some(Duration::from_secs(2)));
        for hard in [
            Refusal::NotMember,
            Refusal::KeyTooLong,
            Refusal::NoteTooLarge,
            Refusal::HomeFull,
            Refusal::RequesterFull,
            Refusal::QueueFull,
        ] {
            assert_eq!(retry_delay(hard), None, "{hard:?}");
        }
    }

    #[test]
    fn stray_grant_liveness_uses_the_send_instant() {
        let mut io = Holder::new(HolderConfig::new(NodeId(1)), Instant::ZERO).io;
        let t0 = Instant::from_nanos(1_000);
        let id = io.request_id(7, t0, Duration::from_secs(10));
        assert_eq!(id, RequestId::new(7, 1), "numbered within the run");
        assert!(io.grant_live(id, Duration::from_secs(10), t0 + Duration::from_secs(9)));
        assert!(!io.grant_live(id, Duration::from_secs(10), t0 + Duration::from_secs(10)));
        assert!(!io.grant_live(id, Duration::from_secs(3), t0 + Duration::from_secs(3)), "shorter grant");
        // Another run's id is unknown, so taken as live.
        assert!(io.grant_live(RequestId::new(5, 1), Duration::from_secs(10), t0 + Duration::from_secs(100)));
        // Aged out of the log: dead.
        let later = t0 + Duration::from_secs(60);
        io.request_id(7, later, Duration::from_secs(10));
        assert!(!io.grant_live(id, Duration::from_secs(10), later));
    }

    #[test]
    fn request_numbers_do_not_wrap_at_32_bits() {
        let mut io = Holder::new(HolderConfig::new(NodeId(1)), Instant::ZERO).io;
        let t0 = Instant::from_nanos(1_000);
        io.request_count = u64::from(u32::MAX) - 2;
        let first = io.request_id(3, t0, Duration::from_secs(10));
        let (a, b) =
            (io.request_id(3, t0, Duration::from_secs(10)), io.request_id(3, t0, Duration::from_secs(10)));
        assert_eq!((a.seq, b.seq), (u64::from(u32::MAX), 1 << 32), "past 2^32 in one run");
        assert!(first < a && a < b && b.incarnation == 3);
        assert!(io.issued_this_run(b) && !io.issued_this_run(RequestId::new(4, 1)));
    }
}
