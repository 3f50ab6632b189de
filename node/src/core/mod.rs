//! [`Core`]: one node's protocol state machines and the glue between them. The node runtime
//! drives it on tokio; the simulation (`keyhome-sim`) drives the very same type on simulated
//! clocks, disks and networks.
//!
//! Like the cores it wraps ([`EpochNode`], [`Home`], [`Holder`]) it does no I/O, reads no clock
//! and holds no channel: every input comes with the current instant of this node's monotonic
//! clock, and everything it wants done goes to the caller's [`Sink`], before the call returns, as
//! an [`Output`]:
//!
//! - [`Output::Transmit`]: a message for another node;
//! - [`Output::Persist`]: epoch writes to make durable, then report with [`Core::persisted`];
//!   the messages that depend on them are held back until then (raft's `Ready` rule);
//! - [`Output::LockDone`], [`Output::CheckDone`], [`Output::ProposalDone`]: the outcome of a
//!   pending call (a lock's goes to its caller through [`callers`], which both the runtime and the
//!   simulation run);
//! - [`Output::Notice`]: a client handle was recalled (its owner should unlock) or expired;
//! - [`Output::EpochLearned`]: the runtime refreshes its links;
//! - [`Output::Observed`]: only when asked for ([`Core::observe_local`]), a copy of each
//!   delegation message this node delivered to itself, and of each one for another node held
//!   until its epoch is durable (as it is made), so a checker sees every grant when it is made.
//!
//! # Shards
//!
//! The core is in parts, each behind its own mutex, so that calls about different keys run on
//! different threads at once: the [`Membership`] (the epoch core, persistence gating, proposals)
//! and `K` key [`Shard`]s, each the home and the holder of the keys that hash to it (with
//! their pending calls, client handles and token checks). A shard reads the [`EpochView`] the
//! membership publishes whenever the epoch or the home lease changes, and is handed it, under the
//! membership's lock, before anything else happens in the call that changed it. Every delegation
//! message is about one key and goes to that key's shard, picked from the key's hash by the
//! holders' [`KeyHasher`] (a lock call hands the shard's holder that hash: one hash per
//! call); handle serials, lock tickets and check ids name their shard in their low bits (see
//! `Place` in `shard.rs`). Locks are only ever taken membership first, then one
//! shard at a time: a call about a key takes its shard's lock alone, and nothing a shard does
//! reaches another part. Each call hands its part's outputs to the sink under that part's lock,
//! so what one part sends leaves in the order it produced it.
//!
//! Delegation messages a shard sends itself (its holder asking its own home) are handled at
//! once, in order, inside the call that produced them. Every input ends by settling the parts it
//! reached: every due timer runs and every local message is delivered, so after any call
//! [`Core::poll_timeout`] is later than its `now` unless the caller passed a later instant — or
//! paced work is left. The home and the holder apply an epoch change a bounded step of keys at a
//! time (`keyhome_delegation::walk`), and the home resends handovers a bounded batch at a time,
//! so that no call holds a shard for long with a million keys: while such work is left,
//! [`Core::poll_timeout`] stays at or before `now`, and each [`Core::handle_timeout`] takes one
//! share in each shard that has some. Other inputs bring up to date only the key they are about.
//!
//! # Owners
//!
//! A client handle belongs to a [`ClientOwner`]: the connection that locked it and the identity
//! (certificate) behind that connection. Only a connection with the same identity may take a
//! handle over ([`Core::claim`]), and a handle whose connection went away is never ended early:
//! it keeps its key until its deadline, since the client may still be working inside the
//! deadline it was told. The one exception is a handle no caller can have seen: admitted for a
//! caller that had stopped waiting, or in an answer the transport never took; it is given back
//! ([`callers`], `api::Undelivered`). Embedded handles have no owner entry (their guard holds
//! the handle).

pub mod callers;
mod membership;
mod monotonic;
mod outbox;
mod shard;

use std::collections::{HashMap, VecDeque};
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use keyhome_delegation::{
    CheckAnswer, Ending, FencingToken, Handle, HandleId, HashedKey, Holder, HolderConfig, Home, HomeConfig,
    HomeCounters, KeyHasher, LockError, LockOutcome, Message as DMessage, Refusal, Serials, Ticket,
};
use keyhome_epoch::time::earliest;
use keyhome_epoch::{
    Change, EpochNode, EpochRecord, EpochView, Instant, Member, Message as EpochMessage, NodeId,
    ProposeError, Write,
};
use serde::{Deserialize, Serialize};

use self::membership::Membership;
use self::shard::{Place, Shard};
use crate::activity::{Activity, MessageCounts, ago};
use crate::hotkeys::Heat;
use crate::status::{
    Counters, DelayedKey, HotKey, LISTED, MemberStatus, RecentEpoch, Status, WaitingKey, show_key,
};

/// Most timer rounds one settle runs. Every core moves its timers past `now` in a round, so a
/// second round is rare; this only turns a core bug into a logged error instead of a busy loop.
const MAX_TIMER_ROUNDS: usize = 64;
/// Token checks waiting for their key's home, at most, per shard; more are refused with
/// `QueueFull`.
pub const MAX_PENDING_CHECKS: usize = 4096;
/// Pending locks one client connection may have at once in one shard; more are refused with
/// `QueueFull`.
pub const MAX_PENDING_LOCKS_PER_CONN: usize = 1024;
/// Epoch `Ready`s waiting for the disk, at most: past it incoming epoch messages are dropped
/// (their senders resend) until the disk catches up.
pub const MAX_PERSIST_BACKLOG: usize = 1024;

/// A message between nodes, as the core takes and produces it (the wire adds its `Hello`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum PeerMessage {
    Epoch(EpochMessage),
    Delegation(DMessage),
}

/// A client handle's owner: the connection that holds it and the identity behind it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClientOwner {
    /// The connection, as numbered by the runtime.
    pub conn: u64,
    /// The certificate identity of that connection, as numbered by the runtime: handles pass
    /// only between connections of one identity.
    pub identity: u64,
}

/// A token check's answer: the answer, or why the key's home refused the check.
pub type CheckReply = Result<CheckAnswer, Refusal>;

/// Who a lock is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Owner {
    /// An embedded caller: its guard holds the handle and asks the core when it needs to know.
    Embedded,
    /// A client connection, told of its handles' recalls and expiries.
    Client(ClientOwner),
}

/// What a client must learn about one of its handles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Notice {
    /// The key's home recalled it: the handle stays valid until `deadline` (this node's clock),
    /// which no longer grows; the owner should unlock as soon as it can.
    Recalled { deadline: Instant },
    /// The handle passed its deadline: the lock is lost.
    Expired,
}

/// Something the driver must do; see the module docs.
#[derive(Debug, PartialEq)]
pub enum Output {
    Transmit {
        to: NodeId,
        message: PeerMessage,
    },
    /// Make `writes` durable (in order, after every earlier `Persist`), then call
    /// [`Core::persisted`] with `number`.
    Persist {
        number: u64,
        writes: Vec<Write>,
    },
    LockDone {
        ticket: Ticket,
        result: Result<Handle, LockError>,
    },
    /// The answer to token check `id`; `None` when nobody answered within its timeout.
    CheckDone {
        id: u64,
        answer: Option<CheckReply>,
    },
    ProposalDone {
        result: Result<u64, ProposeError>,
    },
    Notice {
        owner: ClientOwner,
        handle: HandleId,
        key: Vec<u8>,
        notice: Notice,
    },
    /// The node learned epoch `epoch`, whose members are `members` (its homes and holders have
    /// already adjusted).
    EpochLearned {
        epoch: u64,
        members: Vec<NodeId>,
    },
    /// A delegation message this node delivered to itself, or (`held`) one for another node that
    /// waits until the epoch it carries is durable: its [`Output::Transmit`] follows then (see
    /// [`Core::observe_local`]).
    Observed {
        message: DMessage,
        held: bool,
    },
}

/// Why [`Core::claim`] refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ClaimError {
    #[error("handle {0} is not held (unlocked, expired or never issued)")]
    NotHeld(u64),
    #[error("handle {0} belongs to another client identity")]
    Forbidden(u64),
}

/// Where a call's outputs go; see the module docs. Called under the lock of the part that
/// produced them.
pub trait Sink {
    fn output(&mut self, output: Output);

    /// A [`Core::lock`] call is pending as `ticket`: called under its shard's lock, before
    /// anything can decide it.
    fn lock_pending(&mut self, ticket: Ticket) {
        let _ = ticket;
    }

    /// A [`Core::check`] is pending as `id`: called under its shard's lock, before any answer.
    fn check_pending(&mut self, id: u64) {
        let _ = id;
    }

    /// A [`Core::propose`] is pending: called under the membership's lock, before any outcome.
    fn proposal_pending(&mut self) {}

    /// A part the call reached is next due at `at` (paced work included); [`Core::poll_timeout`]
    /// is the earliest over all parts.
    fn due(&mut self, at: Option<Instant>) {
        let _ = at;
    }
}

impl Sink for VecDeque<Output> {
    fn output(&mut self, output: Output) {
        self.push_back(output);
    }
}

impl Sink for Vec<Output> {
    fn output(&mut self, output: Output) {
        self.push(output);
    }
}

/// Locks one part of the core. A poisoned lock means a thread panicked while holding it: the
/// node is fail-stop, so it stops rather than run on with state a panic may have left
/// half-changed.
#[inline]
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(guard) => guard,
        Err(_) => poisoned(),
    }
}

/// Locks a shard for a call that changes it, and brings `now` (read before the lock) up to the
/// latest reading the shard acted on (see [`Monotonic`](monotonic::Monotonic)): every such call
/// enters its shard this way.
#[inline]
fn enter(shard: &Mutex<Shard>, now: Instant) -> (MutexGuard<'_, Shard>, Instant) {
    let mut shard = lock(shard);
    let now = shard.clock.at(now);
    (shard, now)
}

/// [`lock`] found its mutex poisoned: stops the process.
#[cold]
fn poisoned() -> ! {
    eprintln!("keyhome: a thread panicked while holding node state; stopping (fail-stop)");
    std::process::abort()
}

/// One shard behind its own lock, alone on its cache lines (two threads on two shards share no
/// line).
#[repr(align(128))]
struct Slot(Mutex<Shard>);

/// A borrowed part of the core (the epoch node, or one shard's home or holder), held under its
/// part's lock for as long as the guard lives: for reading only.
pub struct Part<'a, P, T> {
    guard: MutexGuard<'a, P>,
    get: fn(&P) -> &T,
}

impl<P, T> Deref for Part<'_, P, T> {
    type Target = T;

    fn deref(&self) -> &T {
        (self.get)(&self.guard)
    }
}

/// How many key shards a node runs when its configuration leaves it open: one per core the
/// process may use, at most 16.
pub fn default_shards() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).min(16)
}

/// Most key shards one node runs.
pub const MAX_SHARDS: usize = 64;

/// One node's protocol state machines and their glue. See the module docs.
pub struct Core {
    id: NodeId,
    membership: Mutex<Membership>,
    shards: Box<[Slot]>,
    /// Picks a serial's shard: `serial & serial_mask` (the shards' stride less one, see `Place`),
    /// clamped to the last shard for a serial no shard gave out.
    serial_mask: u64,
    /// Hashes keys, to pick a key's shard and to look it up in the shard's holder (every shard's
    /// holder hashes with it): a `lock` or `try_lock` hashes its key once.
    key_hasher: KeyHasher,
    /// Frames for peers that could not be queued (see [`Core::count_dropped`]).
    dropped: AtomicU64,
    /// The lock wait and hold histograms every shard records into.
    activity: Activity,
}

impl Core {
    // ---- construction ----

    /// A core around a freshly started epoch node, with `shards` key shards (at least 1, at most
    /// [`MAX_SHARDS`]): the caps of `home` and `holder` are shared out between them. Its first
    /// outputs are the writes of the run's start (the incarnation): the runtime makes them
    /// durable before it opens its port.
    pub fn new(
        epoch: EpochNode,
        home: HomeConfig,
        holder: HolderConfig,
        shards: usize,
        now: Instant,
        out: &mut impl Sink,
    ) -> Core {
        let (id, incarnation) = (epoch.id(), epoch.incarnation());
        let count = shards.clamp(1, MAX_SHARDS);
        let view = std::sync::Arc::new(epoch.view());
        let activity = Activity::default();
        let shards = (0..count)
            .map(|index| {
                let place = Place::new(index, count, incarnation);
                let (home, holder) = share_out(&home, &holder, place);
                Slot(Mutex::new(Shard::new(
                    place,
                    home,
                    holder,
                    std::sync::Arc::clone(&view),
                    &activity,
                    now,
                )))
            })
            .collect();
        let core = Core {
            id,
            membership: Mutex::new(Membership::new(epoch, now)),
            shards,
            serial_mask: Place::stride(count) - 1,
            key_hasher: holder.key_hasher.clone(),
            dropped: AtomicU64::new(0),
            activity,
        };
        core.with_membership(now, out, |_, _, _| ());
        core
    }

    // ---- inputs from peers, timers and the disk ----

    /// A message from peer `from` (authenticated by its certificate).
    pub fn handle_message(&self, now: Instant, from: NodeId, message: PeerMessage, out: &mut impl Sink) {
        match message {
            PeerMessage::Epoch(m) => self.with_membership(now, out, |ms, _, now| {
                ms.out.received_epoch(&m);
                ms.handle_message(now, from, m)
            }),
            PeerMessage::Delegation(m) => self.with_shard(self.shard_of(m.body.key()), now, out, |s, now| {
                s.out.received_delegation(&m);
                s.handle_message(now, from, m)
            }),
        }
    }

    /// Timers, and one share of the paced work (epoch walks, handover resends) in each shard
    /// that has some: call at or after [`Core::poll_timeout`]; harmless earlier.
    pub fn handle_timeout(&self, now: Instant, out: &mut impl Sink) {
        let due = |at: Option<Instant>| at.is_some_and(|t| t <= now);
        if due(lock(&self.membership).epoch.poll_timeout()) {
            self.with_membership(now, out, |ms, _, now| ms.handle_timeout(now));
        }
        for slot in &self.shards {
            let (mut shard, now) = enter(&slot.0, now);
            if due(shard.poll_timeout()) {
                shard.handle_timeout(now);
                finish(&mut shard, out);
            }
        }
    }

    /// The earliest instant something is due, paced work included.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let epoch = lock(&self.membership).epoch.poll_timeout();
        self.shards.iter().fold(epoch, |next, slot| earliest(next, lock(&slot.0).poll_timeout()))
    }

    /// The writes of [`Output::Persist`] `number` (and of every earlier one) are durable: the
    /// messages that waited for them leave.
    pub fn persisted(&self, now: Instant, number: u64, out: &mut impl Sink) {
        self.with_membership(now, out, |ms, _, now| ms.persisted(now, number));
    }

    /// A durable write failed: nothing leaves this node any more (the runtime stops it).
    pub fn fail(&self) {
        let mut membership = lock(&self.membership);
        membership.fail();
        for slot in &self.shards {
            lock(&slot.0).out.fail();
        }
    }

    /// Whether to report each delegation message this node delivers to itself, or holds for
    /// another node, as an [`Output::Observed`] (for checkers; off by default, and costs a copy
    /// per message).
    pub fn observe_local(&self, on: bool) {
        for slot in &self.shards {
            lock(&slot.0).observe_local = on;
        }
    }

    /// `frames` for a peer could not be queued (its link is down or full). Takes no lock: the
    /// runtime counts while it carries out a part's outputs.
    pub fn count_dropped(&self, frames: u64) {
        self.dropped.fetch_add(frames, Ordering::Relaxed);
    }

    // ---- lock calls ----

    /// Locks `key` for `owner`: admitted at once ([`LockOutcome::Locked`]), or pending
    /// ([`LockOutcome::Pending`], told to [`Sink::lock_pending`] first) with its outcome in a
    /// later [`Output::LockDone`].
    pub fn lock(
        &self,
        now: Instant,
        key: &[u8],
        ttl: Duration,
        wait: Duration,
        owner: Owner,
        out: &mut impl Sink,
    ) -> Result<LockOutcome, LockError> {
        // Hashed once: for the shard, and for the shard's holder.
        let key = self.key_hasher.hashed(key);
        let (mut shard, now) = enter(self.shard_of_hashed(key), now);
        let outcome = shard.lock(now, key, ttl, wait, owner);
        if let Ok(LockOutcome::Pending(ticket)) = &outcome {
            out.lock_pending(*ticket);
        }
        finish(&mut shard, out);
        outcome
    }

    /// Locks `key` only if that needs no message: the fast path of embedded callers. A miss
    /// starts asking the key's home in the background.
    #[inline]
    pub fn try_lock(
        &self,
        now: Instant,
        key: &[u8],
        ttl: Duration,
        owner: Owner,
        out: &mut impl Sink,
    ) -> Result<Handle, LockError> {
        // Hashed once: for the shard, and for the shard's holder.
        let key = self.key_hasher.hashed(key);
        self.with_shard(self.shard_of_hashed(key), now, out, |s, now| s.try_lock(now, key, ttl, owner))
    }

    /// Gives up a pending lock; `false` if it was already decided (its [`Output::LockDone`] went
    /// to a sink).
    pub fn cancel(&self, now: Instant, ticket: Ticket, out: &mut impl Sink) -> bool {
        self.with_shard(self.shard_of_serial(ticket.serial()), now, out, |s, now| s.cancel(now, ticket))
    }

    /// Extends a live handle (see [`Holder::renew`]); returns its new deadline.
    pub fn renew(
        &self,
        now: Instant,
        handle: HandleId,
        ttl: Duration,
        out: &mut impl Sink,
    ) -> Result<Instant, LockError> {
        self.with_shard(self.shard_of_serial(handle.serial()), now, out, |s, now| s.renew(now, handle, ttl))
    }

    /// Ends a live handle, leaving `note` for the next holder ([`Core::end`] with
    /// [`Ending::Unlocked`]).
    #[inline]
    pub fn unlock(
        &self,
        now: Instant,
        handle: HandleId,
        note: Option<Vec<u8>>,
        out: &mut impl Sink,
    ) -> Result<(), LockError> {
        self.end(now, handle, Ending::Unlocked(note), out)
    }

    /// Ends a live handle as `ending` says: unlocked with a note, given back (nothing done under
    /// it: its caller went away before it saw it), or abandoned (see [`Ending`]).
    #[inline]
    pub fn end(
        &self,
        now: Instant,
        handle: HandleId,
        ending: Ending,
        out: &mut impl Sink,
    ) -> Result<(), LockError> {
        self.with_shard(self.shard_of_serial(handle.serial()), now, out, |s, now| s.end(now, handle, ending))
    }

    /// The live client handle with serial number `serial`, for a connection of `owner`'s
    /// identity: the handle then belongs to `owner`'s connection (a client that reconnected).
    pub fn claim(&self, serial: u64, owner: ClientOwner) -> Result<HandleId, ClaimError> {
        lock(self.shard_of_serial(serial)).claim(serial, owner)
    }

    /// Whether the home recalled the key of a live handle (its owner should unlock).
    pub fn recalled(&self, now: Instant, handle: HandleId) -> bool {
        let (shard, now) = enter(self.shard_of_serial(handle.serial()), now);
        shard.recalled(now, handle)
    }

    /// Asks whether `key` is held with `token` now: its home answers, or forwards the question to
    /// the key's holder, which answers. The answer comes as [`Output::CheckDone`] with the
    /// returned id (told to [`Sink::check_pending`] first), `None` if nobody answers within
    /// `timeout`. Refused with `NoHome` when no epoch names a home, `QueueFull` past
    /// [`MAX_PENDING_CHECKS`].
    pub fn check(
        &self,
        now: Instant,
        key: Vec<u8>,
        token: FencingToken,
        timeout: Duration,
        out: &mut impl Sink,
    ) -> Result<u64, LockError> {
        let (mut shard, now) = enter(self.shard_of(&key), now);
        let id = shard.check(now, key, token, timeout)?;
        out.check_pending(id);
        finish(&mut shard, out);
        Ok(id)
    }

    // ---- operator calls ----

    /// Starts an operator change (told to [`Sink::proposal_pending`] first); its outcome comes
    /// as [`Output::ProposalDone`].
    pub fn propose(&self, now: Instant, change: Change, out: &mut impl Sink) -> Result<(), ProposeError> {
        self.with_membership(now, out, |ms, out, now| {
            ms.propose(now, change)?;
            out.proposal_pending();
            Ok(())
        })
    }

    /// **Unsafe** recovery (see [`EpochNode::recover_unsafe`]); returns the new epoch's number.
    pub fn recover_unsafe(
        &self,
        now: Instant,
        members: Vec<Member>,
        skip: u64,
        out: &mut impl Sink,
    ) -> Result<u64, ProposeError> {
        self.with_membership(now, out, |ms, _, now| ms.recover_unsafe(now, members, skip))
    }

    /// Stops admitting, for a clean shutdown (see [`Holder::shutdown`]): idle delegations are
    /// given back at once; a key under a live handle passes on only when the handle is unlocked
    /// or passes its deadline, and its successor is told `recovered` unless it was unlocked.
    pub fn shutdown(&self, now: Instant, out: &mut impl Sink) {
        for slot in &self.shards {
            let (mut shard, now) = enter(&slot.0, now);
            shard.shutdown(now);
            finish(&mut shard, out);
        }
    }

    /// Whether a home or a holder is still walking through an epoch change (see the module
    /// docs); [`Core::poll_timeout`] is due meanwhile.
    pub fn walking(&self) -> bool {
        self.shards.iter().any(|slot| {
            let shard = lock(&slot.0);
            shard.home.walking() || shard.holder.walking()
        })
    }

    /// Whether any handle is live on this node (a shutdown waits until none is).
    pub fn has_handles(&self) -> bool {
        self.shards.iter().any(|slot| lock(&slot.0).holder.has_handles())
    }

    /// Whether a key shard holds messages for other nodes until an epoch is durable (a shutdown
    /// waits for them too: its releases may be among them).
    pub fn has_held(&self) -> bool {
        self.shards.iter().any(|slot| lock(&slot.0).out.has_held())
    }

    // ---- views ----

    pub fn id(&self) -> NodeId {
        self.id
    }

    /// How many key shards the node runs.
    pub fn shards(&self) -> usize {
        self.shards.len()
    }

    /// The epoch node, for reading (holds the membership's lock while the guard lives).
    pub fn epoch(&self) -> Part<'_, impl Sized, EpochNode> {
        Part { guard: lock(&self.membership), get: |ms: &Membership| &ms.epoch }
    }

    /// The home of `key`'s shard, for reading (holds the shard's lock while the guard lives).
    pub fn home(&self, key: &[u8]) -> Part<'_, impl Sized, Home> {
        Part { guard: lock(self.shard_of(key)), get: |s: &Shard| &s.home }
    }

    /// The holder of `key`'s shard, for reading (holds the shard's lock while the guard lives).
    pub fn holder(&self, key: &[u8]) -> Part<'_, impl Sized, Holder> {
        Part { guard: lock(self.shard_of(key)), get: |s: &Shard| &s.holder }
    }

    /// The view `key`'s shard decides by, for reading.
    pub fn view(&self, key: &[u8]) -> Part<'_, impl Sized, EpochView> {
        Part { guard: lock(self.shard_of(key)), get: Shard::view }
    }

    /// The current epoch's record.
    pub fn current(&self) -> EpochRecord {
        lock(&self.membership).epoch.current().clone()
    }

    /// Whether this node hears `peer`, at epoch `claimed` by its word; why not if it does not
    /// (see `Membership::hears`).
    pub fn hears(&self, peer: NodeId, claimed: u64) -> Result<(), String> {
        lock(&self.membership).hears(peer, claimed)
    }

    /// Where to reach `peer`: its address in the current epoch, else the last one an earlier
    /// epoch gave it (a removed node still hears of the epoch that removed it).
    pub fn link_addr(&self, peer: NodeId) -> Option<String> {
        lock(&self.membership).link_addr(peer).map(str::to_owned)
    }

    /// The live handles of client connection `conn`.
    pub fn handles_of(&self, conn: u64) -> Vec<HandleId> {
        self.shards.iter().flat_map(|slot| lock(&slot.0).handles_of(conn).collect::<Vec<_>>()).collect()
    }

    /// The node's counters: every part's, summed.
    pub fn counters(&self) -> Counters {
        let mut counters = lock(&self.membership).out.counters;
        for slot in &self.shards {
            counters.add_core(&lock(&slot.0).out.counters);
        }
        counters.peer_dropped += self.dropped.load(Ordering::Relaxed);
        counters
    }

    /// Messages to and from other nodes, by kind: every part's, summed.
    pub fn messages(&self) -> MessageCounts {
        let mut messages = lock(&self.membership).out.messages;
        for slot in &self.shards {
            messages.add(&lock(&slot.0).out.messages);
        }
        messages
    }

    /// Lock wait and hold times.
    pub fn activity(&self) -> &Activity {
        &self.activity
    }

    /// Every shard's home counters, summed.
    pub fn home_counters(&self) -> HomeCounters {
        let mut sum = HomeCounters::default();
        for slot in &self.shards {
            sum += lock(&slot.0).home.counters();
        }
        sum
    }

    /// What the node holds, homes and waits for, over all shards.
    pub fn totals(&self) -> Totals {
        let mut totals = Totals::default();
        for slot in &self.shards {
            let shard = lock(&slot.0);
            totals.held += shard.holder.tracked_keys();
            totals.homed += shard.home.delegations();
            totals.lock_delay_keys += shard.home.keys_in_lock_delay();
            totals.pending_locks += shard.waiting_count();
        }
        totals
    }

    /// The end of the restart quarantine under `timing` (every shard's home started together).
    pub fn quarantine_end(&self, timing: &keyhome_epoch::Timing) -> Instant {
        lock(&self.shards[0].0).home.quarantine_end(timing)
    }

    /// This node's status at `now` (members not yet marked connected; the runtime does that).
    pub fn status(&self, now: Instant) -> Status {
        let (current, incarnation, home_lease_left, recent_epochs) = {
            let ms = lock(&self.membership);
            let lease = ms.epoch.lease_until(now).map(|until| until.saturating_duration_since(now));
            let recent = (ms.epochs.iter().rev())
                .map(|c| RecentEpoch { epoch: c.epoch, members: c.members.clone(), ago: ago(c.at, now) })
                .collect::<Vec<_>>();
            (ms.epoch.current().clone(), ms.epoch.incarnation(), lease, recent)
        };
        let totals = self.totals();
        Status {
            id: self.id.0,
            incarnation,
            epoch: current.number,
            members: (current.members.iter())
                .map(|m| MemberStatus {
                    id: m.id.0,
                    addr: m.addr.clone(),
                    connected: m.id == self.id,
                    unreachable_for: None,
                    refused: None,
                })
                .collect(),
            home_lease_left,
            quarantine_left: self.quarantine_end(&current.timing).saturating_duration_since(now),
            holder_keys: totals.held,
            homed_delegations: totals.homed,
            lock_delay_keys: totals.lock_delay_keys,
            counters: self.counters(),
            member: current.is_member(self.id),
            hot_keys: self.hot_keys(),
            lock_delayed: self.lock_delayed(now),
            waiting: self.waiting_keys(now),
            recent_epochs,
            duplicate_ids: Vec::new(),
            load: Default::default(),
        }
    }

    /// The hottest keys over all shards, at most [`LISTED`].
    fn hot_keys(&self) -> Vec<HotKey> {
        let mut hot: Vec<(String, Heat)> = Vec::new();
        for slot in &self.shards {
            let shard = lock(&slot.0);
            hot.extend(shard.hot.top(LISTED).into_iter().map(|(key, heat)| (show_key(key), heat)));
        }
        hot.sort_by_key(|(_, heat)| std::cmp::Reverse(heat.score()));
        (hot.into_iter().take(LISTED))
            .map(|(key, heat)| HotKey { key, waits: heat.waits, recalls: heat.recalls })
            .collect()
    }

    /// The keys in lock-delay at this node's homes, soonest free first, at most [`LISTED`].
    fn lock_delayed(&self, now: Instant) -> Vec<DelayedKey> {
        let mut delayed = Vec::new();
        for slot in &self.shards {
            let shard = lock(&slot.0);
            delayed.extend(shard.home.lock_delayed().map(|(key, until)| (show_key(key), until)));
        }
        delayed.sort_unstable_by_key(|(_, until)| *until);
        (delayed.into_iter().take(LISTED))
            .map(|(key, until)| DelayedKey { key, left: until.saturating_duration_since(now) })
            .collect()
    }

    /// The keys of pending lock calls, longest waiting first, at most [`LISTED`] (not yet marked
    /// stalled: the runtime knows which homes are reachable).
    fn waiting_keys(&self, now: Instant) -> Vec<WaitingKey> {
        let mut by_key: HashMap<Vec<u8>, (usize, Instant, Option<u64>)> = HashMap::new();
        for slot in &self.shards {
            let shard = lock(&slot.0);
            for (key, since) in shard.waiting() {
                let home = shard.view().home_of(key).map(|h| h.0);
                let (locks, oldest, _) = by_key.entry(key.to_vec()).or_insert((0, since, home));
                *locks += 1;
                *oldest = (*oldest).min(since);
            }
        }
        let mut keys: Vec<_> = by_key.into_iter().collect();
        keys.sort_unstable_by_key(|(_, (_, oldest, _))| *oldest);
        (keys.into_iter().take(LISTED))
            .map(|(key, (locks, oldest, home))| WaitingKey {
                key: show_key(&key),
                home,
                locks,
                waiting_for: ago(oldest, now),
                stalled: false,
            })
            .collect()
    }

    // ---- internals ----

    /// The index of `key`'s shard, for the life of this core (the key hasher's secrets are drawn
    /// at each start).
    #[inline]
    pub fn shard_index(&self, key: &[u8]) -> usize {
        if self.shards.len() == 1 { 0 } else { self.shard_of_hash(self.key_hasher.hash(key)) }
    }

    /// The index of the shard of a key whose hash is `hash`: bits 24 to 55 of the hash, scaled to
    /// the shard count by a multiply (Lemire's reduction), not a division. The holder's index
    /// uses the lowest bits (bucket) and the top 7 (tag), which this leaves as random within a
    /// shard as they are over all keys.
    #[inline]
    fn shard_of_hash(&self, hash: u64) -> usize {
        let middle = u64::from((hash >> 24) as u32);
        ((middle * self.shards.len() as u64) >> 32) as usize
    }

    /// Shard number `index` (below the shard count).
    #[inline]
    fn shard_at(&self, index: usize) -> &Mutex<Shard> {
        &self.shards[index].0
    }

    /// The shard of `key`.
    #[inline]
    fn shard_of(&self, key: &[u8]) -> &Mutex<Shard> {
        self.shard_at(self.shard_index(key))
    }

    /// The shard of a key already hashed by the holders' key hasher.
    #[inline]
    fn shard_of_hashed(&self, key: HashedKey<'_>) -> &Mutex<Shard> {
        self.shard_at(self.shard_of_hash(key.hash()))
    }

    /// The shard that gave out a serial (a handle's, a ticket's) or a check id.
    #[inline]
    fn shard_of_serial(&self, serial: u64) -> &Mutex<Shard> {
        // A serial no shard gave out (a client may name any) may point past the last shard: it
        // goes to the last one, which does not know it either.
        self.shard_at(((serial & self.serial_mask) as usize).min(self.shards.len() - 1))
    }

    /// Runs `f` on `shard` at `now` (brought up to the latest reading the shard acted on, see
    /// [`enter`]) and hands what it produced to `out`, under the shard's lock.
    #[inline]
    fn with_shard<R>(
        &self,
        shard: &Mutex<Shard>,
        now: Instant,
        out: &mut impl Sink,
        f: impl FnOnce(&mut Shard, Instant) -> R,
    ) -> R {
        let (mut shard, now) = enter(shard, now);
        let result = f(&mut shard, now);
        finish(&mut shard, out);
        result
    }

    /// Runs `f` on the membership at `now` (brought up to the latest reading it has seen, as in
    /// [`Core::with_shard`]), hands what it produced to `out`, and, if the view changed,
    /// publishes the new one to every shard (under the membership's lock, so that views reach
    /// the shards in order).
    fn with_membership<S: Sink, R>(
        &self,
        now: Instant,
        out: &mut S,
        f: impl FnOnce(&mut Membership, &mut S, Instant) -> R,
    ) -> R {
        let mut ms = lock(&self.membership);
        let now = ms.clock.at(now);
        let result = f(&mut ms, out, now);
        while let Some(output) = ms.out.pop() {
            out.output(output);
        }
        if let Some(published) = ms.publish() {
            for slot in &self.shards {
                let (mut shard, now) = enter(&slot.0, now);
                shard.publish(now, &published);
                finish(&mut shard, out);
            }
        }
        out.due(ms.epoch.poll_timeout());
        result
    }
}

/// Hands what `shard` produced to `out`, and when it is next due.
#[inline]
fn finish(shard: &mut Shard, out: &mut impl Sink) {
    while let Some(output) = shard.out.pop() {
        out.output(output);
    }
    out.due(shard.poll_timeout());
}

/// The configuration of the shard at `place`: the node's caps shared out, and its own serials.
fn share_out(home: &HomeConfig, holder: &HolderConfig, place: Place) -> (HomeConfig, HolderConfig) {
    let count = place.count as usize;
    let part = |cap: usize| cap.div_ceil(count);
    let mut home = home.clone();
    home.limits.max_delegations = part(home.limits.max_delegations);
    home.limits.max_per_requester = part(home.limits.max_per_requester);
    home.max_records = part(home.max_records);
    home.max_record_bytes = part(home.max_record_bytes);
    let mut holder = holder.clone();
    holder.limits.max_holder_keys = part(holder.limits.max_holder_keys);
    if !holder.bugs().shared_serials {
        holder.serials = Serials { first: place.first(), step: place.stride };
    }
    (home, holder)
}

/// What a node holds, homes and waits for (see [`Core::totals`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Keys the holders track.
    pub held: usize,
    /// Live delegations the homes granted.
    pub homed: usize,
    pub lock_delay_keys: usize,
    pub pending_locks: usize,
}

#[cfg(test)]
mod tests {
    use keyhome_delegation::Limits;

    use super::*;

    #[test]
    fn shards_share_out_the_caps_and_never_give_out_the_same_serial() {
        let (home, holder) = (HomeConfig::new(NodeId(1)), HolderConfig::new(NodeId(1)));
        for (count, incarnation) in (1..=5u64).zip([1, 2, 3, u64::MAX, 1 << 10]) {
            let mut firsts = Vec::new();
            let mask = count.next_power_of_two() - 1;
            for index in 0..count {
                let (h, l) =
                    share_out(&home, &holder, Place::new(index as usize, count as usize, incarnation));
                // Serial `s` belongs to shard `s & mask`, and 0 is never a serial.
                assert!(l.serials.first >= 1);
                assert_eq!(l.serials.first & mask, index);
                assert_eq!(l.serials.step, mask + 1);
                firsts.push(l.serials.first);
                assert!(h.limits.max_delegations as u64 * count >= Limits::DEFAULT.max_delegations as u64);
                assert!(l.limits.max_holder_keys as u64 * count >= Limits::DEFAULT.max_holder_keys as u64);
            }
            firsts.sort_unstable();
            firsts.dedup();
            assert_eq!(firsts.len() as u64, count);
        }
    }

    /// A handle number kept from an earlier run of the node names nothing in this one: each run's
    /// ids lie in a span of their own, whatever the shard counts of the two runs.
    #[test]
    fn each_run_gives_out_serials_the_run_before_did_not() {
        let span = |count: usize, incarnation: u64| {
            let stride = Place::stride(count);
            let firsts: Vec<u64> = (0..count).map(|i| Place::new(i, count, incarnation).first()).collect();
            for (index, first) in firsts.iter().enumerate() {
                assert_eq!(first & (stride - 1), index as u64 & (stride - 1), "the low bits name the shard");
            }
            // The lowest id of the run, and past the highest it gives out (2^42 / stride per shard).
            (*firsts.iter().min().unwrap(), firsts.iter().max().unwrap() + ((1 << 42) / stride - 1) * stride)
        };
        for (before, after) in [(1, 1), (2, 1), (1, 2), (MAX_SHARDS, 1), (3, MAX_SHARDS), (5, 4)] {
            for incarnation in [1, 2, 1000, (1 << 10) - 2] {
                let (_, last) = span(before, incarnation);
                let (next, _) = span(after, incarnation + 1);
                assert!(
                    last < next,
                    "run {incarnation} ({before} shards) reaches run {} ({after})",
                    incarnation + 1
                );
            }
            // The last run's ids stay exact as JSON numbers (IEEE doubles); then the runs start over.
            assert!(span(before, (1 << 10) - 1).1 < 1 << 53);
            assert_eq!(span(after, 1 << 10), span(after, 0));
        }
    }
}
