//! [`Core`]: one node's protocol state machines and the glue between them, as one pure state
//! machine. The node runtime drives it on tokio; the simulation (`keyhome-sim`) drives the very
//! same type on simulated clocks, disks and networks.
//!
//! Like the cores it wraps ([`EpochNode`], [`Home`], [`Holder`]) it does no I/O, reads no clock
//! and holds no channel: every input comes with the current instant of this node's monotonic
//! clock, and everything it wants done comes out of [`Core::poll_output`] as an [`Output`]:
//!
//! - [`Output::Transmit`]: a message for another node;
//! - [`Output::Persist`]: epoch writes to make durable, then report with [`Core::persisted`];
//!   the messages that depend on them are held back until then (raft's `Ready` rule);
//! - [`Output::LockDone`], [`Output::CheckDone`], [`Output::ProposalDone`]: the outcome of a
//!   pending call;
//! - [`Output::Notice`]: a client handle was recalled (its owner should unlock) or expired;
//! - [`Output::EpochLearned`]: the runtime refreshes its links;
//! - [`Output::Observed`]: only when asked for ([`Core::observe_local`]), a copy of each
//!   delegation message this node delivered to itself, so a checker sees every grant.
//!
//! Delegation messages this node sends to itself (its holder asking its own home) are handled at
//! once, in order, inside the call that produced them. Every input ends by settling: every due
//! timer runs and every local message is delivered, so after any call [`Core::poll_timeout`] is
//! later than its `now` unless the caller passed a later instant — or paced work is left. The
//! home and the holder apply an epoch change a bounded step of keys at a time
//! (`keyhome_delegation::walk`), and the home resends handovers a bounded batch at a time, so
//! that no call holds the core for long with a million keys: while such work is left,
//! [`Core::poll_timeout`] stays at or before `now`, and each [`Core::handle_timeout`] takes one
//! share. Other inputs bring up to date only the key they are about, and take a share only when a
//! home or holder timer happens to be due in them (a share is one `walk_step` budget, 128 slots
//! by default; the call that learns an epoch takes the first step of both walks).
//!
//! # Owners
//!
//! A client handle belongs to a [`ClientOwner`]: the connection that locked it and the identity
//! (certificate) behind that connection. Only a connection with the same identity may take a
//! handle over ([`Core::claim`]), and a handle whose connection went away is never ended early:
//! it keeps its key until its deadline, since the client may still be working inside the
//! deadline it was told. Embedded handles have no owner entry (their guard holds the handle).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::time::Duration;

use keyhome_delegation::{
    Body as DBody, CheckAnswer, FencingToken, Handle, HandleId, Holder, HolderConfig, HolderEvent, Home,
    HomeConfig, LockError, LockOutcome, Message as DMessage, Refusal, Ticket,
};
use keyhome_epoch::time::earliest;
use keyhome_epoch::{
    Change, EpochNode, EpochRecord, Event as EpochEvent, Instant, Member, Message as EpochMessage, NodeId,
    ProposeError, Ready, Write,
};
use serde::{Deserialize, Serialize};

use crate::activity::{Activity, EpochChange, ago, observe_span};
use crate::status::{
    Counters, DelayedKey, HotKey, LISTED, MemberStatus, RecentEpoch, Status, WaitingKey, show_key,
};

/// Most timer rounds one settle runs. Every core moves its timers past `now` in a round, so a
/// second round is rare; this only turns a core bug into a logged error instead of a busy loop.
const MAX_TIMER_ROUNDS: usize = 64;
/// Token checks waiting for their key's home, at most; more are refused with `QueueFull`.
pub const MAX_PENDING_CHECKS: usize = 4096;
/// Pending locks one client connection may have at once; more are refused with `QueueFull`.
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
    /// The node learned epoch `epoch` (its homes and holder have already adjusted).
    EpochLearned {
        epoch: u64,
    },
    /// A delegation message this node delivered to itself (see [`Core::observe_local`]).
    Observed {
        message: DMessage,
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

/// A pending `lock` call.
struct Waiting {
    owner: Owner,
    key: Box<[u8]>,
    /// When the lock was called.
    since: Instant,
}

/// One node's protocol state machines and their glue. See the module docs.
pub struct Core {
    id: NodeId,
    epoch: EpochNode,
    home: Home,
    holder: Holder,
    /// Every node named by an epoch this run learned: peers we accept connections from.
    known: HashSet<NodeId>,
    /// The last address an epoch this run learned gave each node, so that a node removed from the
    /// current epoch can still be told about it (and have its handovers acknowledged).
    addrs: HashMap<NodeId, String>,
    /// Delegation messages to self, delivered in order within [`Core::settle`].
    local: VecDeque<DMessage>,
    out: VecDeque<Output>,
    /// Messages of epoch `Ready`s, by `Ready` number, waiting for their writes to be durable.
    gated: VecDeque<(u64, Vec<(NodeId, EpochMessage)>)>,
    /// Pending `lock` calls.
    waiters: HashMap<Ticket, Waiting>,
    /// Pending locks per client connection.
    pending_per_conn: HashMap<u64, usize>,
    /// Live client handles by serial number (the number clients name them by), with their owners
    /// and admission instants.
    owners: HashMap<u64, (HandleId, ClientOwner, Instant)>,
    /// Pending token checks: ids by deadline, and the key of each live id (an answer counts only
    /// for the key it was asked about).
    checks: HashMap<u64, Vec<u8>>,
    check_deadlines: BinaryHeap<Reverse<(Instant, u64)>>,
    next_check: u64,
    /// An operator change is in progress on this node.
    proposing: bool,
    counters: Counters,
    activity: Activity,
    /// Once set (a write failed), nothing leaves this node any more.
    failed: bool,
    /// Report local deliveries as [`Output::Observed`].
    observe_local: bool,
}

impl Core {
    // ---- construction ----

    /// A core around a freshly started epoch node. Its first outputs are the writes of the run's
    /// start (the incarnation): the runtime makes them durable before it opens its port.
    pub fn new(epoch: EpochNode, home: HomeConfig, holder: HolderConfig, now: Instant) -> Core {
        let id = epoch.id();
        let known = epoch.current().member_ids().collect();
        let addrs = epoch.current().members.iter().map(|m| (m.id, m.addr.clone())).collect();
        let mut core = Core {
            id,
            home: Home::new(home, now),
            holder: Holder::new(holder, now),
            epoch,
            known,
            addrs,
            local: VecDeque::new(),
            out: VecDeque::new(),
            gated: VecDeque::new(),
            waiters: HashMap::new(),
            pending_per_conn: HashMap::new(),
            owners: HashMap::new(),
            checks: HashMap::new(),
            check_deadlines: BinaryHeap::new(),
            next_check: 0,
            proposing: false,
            counters: Counters::default(),
            activity: Activity::default(),
            failed: false,
            observe_local: false,
        };
        core.out.push_back(Output::EpochLearned { epoch: core.current().number });
        let members = core.current().member_ids().map(|m| m.0).collect();
        core.activity.epochs.learned(EpochChange { epoch: core.current().number, members, at: now });
        core.settle(now);
        core
    }

    // ---- inputs from peers, timers and the disk ----

    /// A message from peer `from` (authenticated by its certificate).
    pub fn handle_message(&mut self, now: Instant, from: NodeId, message: PeerMessage) {
        self.counters.peer_received += 1;
        self.activity.messages.received(&message);
        match message {
            PeerMessage::Epoch(message) => {
                if self.gated.len() >= MAX_PERSIST_BACKLOG {
                    // The disk is behind: the sender resends what matters.
                    self.counters.peer_dropped += 1;
                    return;
                }
                self.epoch.handle_message(now, from, message)
            }
            PeerMessage::Delegation(message) => {
                self.counters.delegation_received += 1;
                self.deliver(now, from, message)
            }
        }
        self.settle(now);
    }

    /// Timers, and one share of the paced work (epoch walks, handover resends): call at or
    /// after [`Core::poll_timeout`]; harmless earlier.
    pub fn handle_timeout(&mut self, now: Instant) {
        // One share per call: the home's first, then the holder's.
        if self.home.poll_timeout().is_some_and(|t| t <= now) {
            self.home.handle_timeout(now, &self.epoch);
        } else if self.holder.poll_timeout().is_some_and(|t| t <= now) {
            self.holder.handle_timeout(now, &self.epoch);
        }
        self.settle(now);
    }

    /// The earliest instant something is due, paced work included.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.earliest_with(self.home.poll_timeout(), self.holder.poll_timeout())
    }

    /// The earliest timer, leaving paced work out: what [`Core::settle`] runs down.
    fn poll_timer(&self) -> Option<Instant> {
        self.earliest_with(self.home.poll_timer(), self.holder.poll_timer())
    }

    /// The earliest of `home`, `holder`, the epoch node's next timer and the first check deadline.
    fn earliest_with(&self, home: Option<Instant>, holder: Option<Instant>) -> Option<Instant> {
        // Straight-line rather than an iterator over the four: the runtime asks after every call.
        let cores = earliest(self.epoch.poll_timeout(), earliest(home, holder));
        earliest(cores, self.check_deadlines.peek().map(|Reverse((at, _))| *at))
    }

    /// The writes of [`Output::Persist`] `number` (and of every earlier one) are durable: the
    /// messages that waited for them leave.
    pub fn persisted(&mut self, now: Instant, number: u64) {
        if self.failed {
            return;
        }
        while self.gated.front().is_some_and(|(n, _)| *n <= number) {
            let (_, messages) = self.gated.pop_front().expect("front checked");
            for (to, message) in messages {
                self.send(to, PeerMessage::Epoch(message));
            }
        }
        self.epoch.advance(now, number);
        self.settle(now);
    }

    /// A durable write failed: nothing leaves this node any more (the runtime stops it).
    pub fn fail(&mut self) {
        self.failed = true;
        self.out.retain(|o| !matches!(o, Output::Transmit { .. } | Output::Persist { .. }));
        self.gated.clear();
    }

    /// Whether to report each delegation message this node delivers to itself as an
    /// [`Output::Observed`] (for checkers; off by default, and costs a copy per message).
    pub fn observe_local(&mut self, on: bool) {
        self.observe_local = on;
    }

    /// A frame for a peer could not be queued (its link is down or full).
    pub fn count_dropped(&mut self, frames: u64) {
        self.counters.peer_dropped += frames;
    }

    // ---- lock calls ----

    /// Locks `key` for `owner`: admitted at once ([`LockOutcome::Locked`]), or pending
    /// ([`LockOutcome::Pending`]) with its outcome in a later [`Output::LockDone`].
    pub fn lock(
        &mut self,
        now: Instant,
        key: &[u8],
        ttl: Duration,
        wait: Duration,
        owner: Owner,
    ) -> Result<LockOutcome, LockError> {
        if let Owner::Client(c) = owner
            && self.pending_per_conn.get(&c.conn).is_some_and(|&n| n >= MAX_PENDING_LOCKS_PER_CONN)
        {
            return Err(LockError::QueueFull);
        }
        let outcome = self.holder.lock(now, key, ttl, wait, &self.epoch);
        match &outcome {
            Ok(LockOutcome::Locked(handle)) => self.admitted(now, key, handle, owner, true),
            Ok(LockOutcome::Pending(ticket)) => {
                self.activity.hot.waited(key);
                self.waiters.insert(*ticket, Waiting { owner, key: key.into(), since: now });
                if let Owner::Client(c) = owner {
                    *self.pending_per_conn.entry(c.conn).or_default() += 1;
                }
            }
            Err(_) => {}
        }
        self.settle(now);
        outcome
    }

    /// Locks `key` only if that needs no message: the fast path of embedded callers. A miss
    /// starts asking the key's home in the background.
    #[inline]
    pub fn try_lock(
        &mut self,
        now: Instant,
        key: &[u8],
        ttl: Duration,
        owner: Owner,
    ) -> Result<Handle, LockError> {
        let result = self.holder.try_lock(now, key, ttl);
        if let Ok(handle) = &result {
            self.admitted(now, key, handle, owner, true);
        }
        self.settle_if_due(now);
        result
    }

    /// Gives up a pending lock; `false` if it was already decided (its [`Output::LockDone`] is
    /// queued or was taken).
    pub fn cancel(&mut self, now: Instant, ticket: Ticket) -> bool {
        if let Some(w) = self.waiters.remove(&ticket) {
            self.unqueue(w.owner);
        }
        let cancelled = self.holder.cancel(now, ticket);
        self.settle(now);
        cancelled
    }

    /// Extends a live handle (see [`Holder::renew`]); returns its new deadline.
    pub fn renew(&mut self, now: Instant, handle: HandleId, ttl: Duration) -> Result<Instant, LockError> {
        let result = self.holder.renew(now, handle, ttl);
        self.forget_if_lost(now, handle, &result);
        self.settle_if_due(now);
        result
    }

    /// Ends a live handle, leaving `note` for the next holder.
    #[inline]
    pub fn unlock(&mut self, now: Instant, handle: HandleId, note: Option<Vec<u8>>) -> Result<(), LockError> {
        let result = self.holder.unlock(now, handle, note);
        if result.is_ok() {
            self.disown(now, handle);
        } else {
            self.forget_if_lost(now, handle, &result);
        }
        self.settle_if_due(now);
        result
    }

    /// The live client handle with serial number `serial`, for a connection of `owner`'s
    /// identity: the handle then belongs to `owner`'s connection (a client that reconnected).
    pub fn claim(&mut self, serial: u64, owner: ClientOwner) -> Result<HandleId, ClaimError> {
        let (handle, current, _) = self.owners.get_mut(&serial).ok_or(ClaimError::NotHeld(serial))?;
        if current.identity != owner.identity {
            return Err(ClaimError::Forbidden(serial));
        }
        current.conn = owner.conn;
        Ok(*handle)
    }

    /// Whether the home recalled the key of a live handle (its owner should unlock).
    pub fn recalled(&self, now: Instant, handle: HandleId) -> bool {
        self.holder
            .key_of(handle)
            .and_then(|key| self.holder.delegation(now, key))
            .is_some_and(|d| d.recalling)
    }

    /// Asks whether `key` is held with `token` now: its home answers, or forwards the question to
    /// the key's holder, which answers. The answer comes as [`Output::CheckDone`] with the
    /// returned id, `None` if nobody answers within `timeout`. Refused with `NoHome` when no
    /// epoch names a home, `QueueFull` past [`MAX_PENDING_CHECKS`].
    pub fn check(
        &mut self,
        now: Instant,
        key: Vec<u8>,
        token: FencingToken,
        timeout: Duration,
    ) -> Result<u64, LockError> {
        let home = self.epoch.home_of(&key).ok_or(LockError::NoHome)?;
        if self.checks.len() >= MAX_PENDING_CHECKS {
            return Err(LockError::QueueFull);
        }
        self.next_check += 1;
        let id = self.next_check;
        self.checks.insert(id, key.clone());
        self.check_deadlines.push(Reverse((now + timeout, id)));
        let message = DMessage { epoch: self.epoch.current().number, body: DBody::Check { key, id, token } };
        self.route(home, message);
        self.settle(now);
        Ok(id)
    }

    // ---- operator calls ----

    /// Starts an operator change; its outcome comes as [`Output::ProposalDone`].
    pub fn propose(&mut self, now: Instant, change: Change) -> Result<(), ProposeError> {
        self.epoch.propose(now, change)?;
        self.proposing = true;
        self.settle(now);
        Ok(())
    }

    /// **Unsafe** recovery (see [`EpochNode::recover_unsafe`]); returns the new epoch's number.
    pub fn recover_unsafe(
        &mut self,
        now: Instant,
        members: Vec<Member>,
        skip: u64,
    ) -> Result<u64, ProposeError> {
        let number = self.epoch.recover_unsafe(now, members, skip)?;
        if std::mem::take(&mut self.proposing) {
            self.out.push_back(Output::ProposalDone { result: Err(ProposeError::Overtaken(0)) });
        }
        self.settle(now);
        Ok(number)
    }

    /// Stops admitting, for a clean shutdown (see [`Holder::shutdown`]): idle delegations are
    /// given back at once; a key under a live handle passes on only when the handle is unlocked
    /// or passes its deadline, and its successor is told `recovered` unless it was unlocked.
    pub fn shutdown(&mut self, now: Instant) {
        self.holder.shutdown(now);
        self.settle(now);
    }

    /// Whether the home or the holder is still walking through an epoch change (see the module
    /// docs); [`Core::poll_timeout`] is due meanwhile.
    pub fn walking(&self) -> bool {
        self.home.walking() || self.holder.walking()
    }

    /// Whether any handle is live on this node (a shutdown waits until none is).
    pub fn has_handles(&self) -> bool {
        self.holder.has_handles()
    }

    // ---- outputs and views ----

    /// The next thing to do, in the order the core produced it.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.out.pop_front()
    }

    pub fn id(&self) -> NodeId {
        self.id
    }

    pub fn epoch(&self) -> &EpochNode {
        &self.epoch
    }

    pub fn home(&self) -> &Home {
        &self.home
    }

    pub fn holder(&self) -> &Holder {
        &self.holder
    }

    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Lock timings, messages by kind, hot keys and recent epochs (see [`Activity`]).
    pub fn activity(&self) -> &Activity {
        &self.activity
    }

    /// The keys of pending lock calls, with when each call was made (one entry per call).
    pub fn waiting(&self) -> impl Iterator<Item = (&[u8], Instant)> {
        self.waiters.values().map(|w| (&*w.key, w.since))
    }

    /// The current epoch's record.
    pub fn current(&self) -> &EpochRecord {
        self.epoch.current()
    }

    /// Whether `peer` is named by an epoch this node learned.
    pub fn is_known(&self, peer: NodeId) -> bool {
        self.known.contains(&peer)
    }

    /// The address of `peer` in the current epoch.
    pub fn addr_of(&self, peer: NodeId) -> Option<&str> {
        self.current().members.iter().find(|m| m.id == peer).map(|m| m.addr.as_str())
    }

    /// Where to reach `peer`: its address in the current epoch, else the last one an earlier
    /// epoch gave it (a removed node still hears of the epoch that removed it).
    pub fn link_addr(&self, peer: NodeId) -> Option<&str> {
        self.addr_of(peer).or_else(|| self.addrs.get(&peer).map(String::as_str))
    }

    /// The live handles of client connection `conn`.
    pub fn handles_of(&self, conn: u64) -> impl Iterator<Item = HandleId> + '_ {
        self.owners.values().filter(move |(_, o, _)| o.conn == conn).map(|(h, _, _)| *h)
    }

    /// This node's status at `now` (members not yet marked connected; the runtime does that).
    pub fn status(&self, now: Instant) -> Status {
        let current = self.current();
        Status {
            id: self.id.0,
            incarnation: self.epoch.incarnation(),
            epoch: current.number,
            members: (current.members.iter())
                .map(|m| MemberStatus {
                    id: m.id.0,
                    addr: m.addr.clone(),
                    connected: m.id == self.id,
                    unreachable_for: None,
                })
                .collect(),
            home_lease_left: self.epoch.lease_until(now).map(|until| until.saturating_duration_since(now)),
            quarantine_left: self.home.quarantine_end(&current.timing).saturating_duration_since(now),
            holder_keys: self.holder.tracked_keys(),
            homed_delegations: self.home.delegations(),
            lock_delay_keys: self.home.keys_in_lock_delay(),
            counters: self.counters,
            member: current.is_member(self.id),
            hot_keys: (self.activity.hot.top(LISTED).into_iter())
                .map(|(key, heat)| HotKey { key: show_key(key), waits: heat.waits, recalls: heat.recalls })
                .collect(),
            lock_delayed: self.lock_delayed(now),
            waiting: self.waiting_keys(now),
            recent_epochs: (self.activity.epochs.iter().rev())
                .map(|c| RecentEpoch { epoch: c.epoch, members: c.members.clone(), ago: ago(c.at, now) })
                .collect(),
            duplicate_ids: Vec::new(),
            load: Default::default(),
        }
    }

    /// The keys in lock-delay at this home, soonest free first, at most [`LISTED`].
    fn lock_delayed(&self, now: Instant) -> Vec<DelayedKey> {
        let mut delayed: Vec<_> = self.home.lock_delayed().collect();
        delayed.sort_unstable_by_key(|(_, until)| *until);
        (delayed.into_iter().take(LISTED))
            .map(|(key, until)| DelayedKey { key: show_key(key), left: until.saturating_duration_since(now) })
            .collect()
    }

    /// The keys of pending lock calls, longest waiting first, at most [`LISTED`] (not yet marked
    /// stalled: the runtime knows which homes are reachable).
    fn waiting_keys(&self, now: Instant) -> Vec<WaitingKey> {
        let mut by_key: HashMap<&[u8], (usize, Instant)> = HashMap::new();
        for (key, since) in self.waiting() {
            let (locks, oldest) = by_key.entry(key).or_insert((0, since));
            *locks += 1;
            *oldest = (*oldest).min(since);
        }
        let mut keys: Vec<_> = by_key.into_iter().collect();
        keys.sort_unstable_by_key(|(_, (_, oldest))| *oldest);
        (keys.into_iter().take(LISTED))
            .map(|(key, (locks, oldest))| WaitingKey {
                key: show_key(key),
                home: self.epoch.home_of(key).map(|h| h.0),
                locks,
                waiting_for: ago(oldest, now),
                stalled: false,
            })
            .collect()
    }

    // ---- internals ----

    fn admitted(&mut self, now: Instant, key: &[u8], handle: &Handle, owner: Owner, immediate: bool) {
        if let Owner::Client(c) = owner {
            self.owners.insert(handle.id.serial(), (handle.id, c, now));
        }
        tracing::debug!(key = %key.escape_ascii(), token = %handle.token, immediate, "lock admitted");
        self.counters.locks += 1;
        if immediate {
            self.counters.locks_immediate += 1;
        }
    }

    /// A pending lock of `owner` was decided or withdrawn.
    fn unqueue(&mut self, owner: Owner) {
        if let Owner::Client(c) = owner
            && let Some(n) = self.pending_per_conn.get_mut(&c.conn)
        {
            *n -= 1;
            if *n == 0 {
                self.pending_per_conn.remove(&c.conn);
            }
        }
    }

    /// Forgets a client handle's owner, recording how long it was held (a no-op for embedded
    /// handles, without hashing when no client holds anything).
    fn disown(&mut self, now: Instant, handle: HandleId) -> Option<ClientOwner> {
        if self.owners.is_empty() {
            return None;
        }
        let (_, owner, admitted) = self.owners.remove(&handle.serial())?;
        observe_span(&self.activity.lock_hold, admitted, now);
        Some(owner)
    }

    fn forget_if_lost<T>(&mut self, now: Instant, handle: HandleId, result: &Result<T, LockError>) {
        if matches!(result, Err(LockError::Expired | LockError::UnknownHandle)) {
            self.disown(now, handle);
        }
    }

    /// A delegation message from `from` (maybe this node): to the home, the holder or a check.
    fn deliver(&mut self, now: Instant, from: NodeId, message: DMessage) {
        match message.body {
            DBody::Request { .. }
            | DBody::Release { .. }
            | DBody::Check { .. }
            | DBody::Handover { .. }
            | DBody::HandoverAck { .. } => self.home.handle_message(now, from, message, &self.epoch),
            DBody::Recall { ref key, .. } => {
                self.activity.hot.recalled(key);
                self.holder.handle_message(now, from, message, &self.epoch)
            }
            DBody::Grant { .. } | DBody::Refuse { .. } | DBody::Probe { .. } => {
                self.holder.handle_message(now, from, message, &self.epoch)
            }
            DBody::CheckReply { key, id, answer } => {
                if self.checks.get(&id).is_some_and(|asked| *asked == key) {
                    self.checks.remove(&id);
                    self.out.push_back(Output::CheckDone { id, answer: Some(answer) });
                }
            }
        }
    }

    fn route(&mut self, to: NodeId, message: DMessage) {
        if to == self.id {
            self.counters.local_delivered += 1;
            self.local.push_back(message);
        } else {
            self.send(to, PeerMessage::Delegation(message));
        }
    }

    fn send(&mut self, to: NodeId, message: PeerMessage) {
        if !self.failed {
            self.counters.peer_sent += 1;
            self.activity.messages.sent(&message);
            if matches!(message, PeerMessage::Delegation(_)) {
                self.counters.delegation_sent += 1;
            }
            self.out.push_back(Output::Transmit { to, message });
        }
    }

    /// [`Core::settle`] only when something is due, after a call that reached only the holder
    /// ([`Core::try_lock`], [`Core::renew`], [`Core::unlock`]): the hot path (a re-lock, an
    /// unlock) leaves nothing behind in the common case. Every call leaves every core drained and
    /// no local message queued, so only the holder can have produced something: when it has not,
    /// there is nothing to drain.
    fn settle_if_due(&mut self, now: Instant) {
        debug_assert!(self.local.is_empty(), "a local message outlived the call that queued it");
        if self.holder.poll_timer().is_some_and(|t| t <= now) {
            self.settle(now);
        } else if self.holder.has_output() {
            self.drain(now);
        }
    }

    /// Runs every due timer and drains every output and local message, until no timer is due
    /// (paced work is left to [`Core::handle_timeout`]).
    fn settle(&mut self, now: Instant) {
        for _ in 0..MAX_TIMER_ROUNDS {
            if self.epoch.poll_timeout().is_some_and(|t| t <= now) {
                self.epoch.handle_timeout(now);
            }
            if self.home.poll_timer().is_some_and(|t| t <= now) {
                self.home.handle_timeout(now, &self.epoch);
            }
            if self.holder.poll_timer().is_some_and(|t| t <= now) {
                self.holder.handle_timeout(now, &self.epoch);
            }
            while let Some(&Reverse((at, id))) = self.check_deadlines.peek()
                && at <= now
            {
                self.check_deadlines.pop();
                if self.checks.remove(&id).is_some() {
                    self.out.push_back(Output::CheckDone { id, answer: None });
                }
            }
            self.drain(now);
            if self.poll_timer().is_none_or(|t| t > now) {
                return;
            }
        }
        tracing::error!("settle did not converge; a protocol core keeps a timer at or before now");
    }

    /// Takes everything the cores produced, delivering local messages, until nothing is left.
    fn drain(&mut self, now: Instant) {
        loop {
            while let Some(ready) = self.epoch.ready() {
                self.take_ready(ready);
            }
            while let Some(event) = self.epoch.poll_event() {
                self.on_epoch_event(now, event);
            }
            while let Some((to, message)) = self.home.poll_transmit() {
                self.route(to, message);
            }
            while let Some((to, message)) = self.holder.poll_transmit() {
                self.route(to, message);
            }
            while let Some(event) = self.holder.poll_event() {
                self.on_holder_event(now, event);
            }
            match self.local.pop_front() {
                Some(message) => {
                    if self.observe_local {
                        self.out.push_back(Output::Observed { message: message.clone() });
                    }
                    self.deliver(now, self.id, message)
                }
                None => return,
            }
        }
    }

    fn take_ready(&mut self, ready: Ready) {
        let gated = ready.needs_advance();
        for t in ready.messages {
            self.send(t.to, PeerMessage::Epoch(t.message));
        }
        if gated && !self.failed {
            let messages = ready.persisted_messages.into_iter().map(|t| (t.to, t.message)).collect();
            self.gated.push_back((ready.number, messages));
            self.out.push_back(Output::Persist { number: ready.number, writes: ready.writes });
        }
    }

    fn on_epoch_event(&mut self, now: Instant, event: EpochEvent) {
        match event {
            EpochEvent::Learned { epoch } => {
                let members: Vec<u64> = self.current().member_ids().map(|m| m.0).collect();
                let member = self.current().is_member(self.id);
                tracing::info!(epoch, ?members, member, "learned epoch");
                self.activity.epochs.learned(EpochChange { epoch, members, at: now });
                self.known.extend(self.epoch.current().member_ids());
                self.addrs.extend(self.epoch.current().members.iter().map(|m| (m.id, m.addr.clone())));
                self.out.push_back(Output::EpochLearned { epoch });
                self.home.on_epoch_change(now, &self.epoch);
                self.holder.on_epoch_change(now, &self.epoch);
            }
            EpochEvent::ProposalApplied { epoch } => {
                if std::mem::take(&mut self.proposing) {
                    self.out.push_back(Output::ProposalDone { result: Ok(epoch) });
                }
            }
            EpochEvent::ProposalFailed { error } => {
                if std::mem::take(&mut self.proposing) {
                    self.out.push_back(Output::ProposalDone { result: Err(error) });
                }
            }
        }
    }

    fn on_holder_event(&mut self, now: Instant, event: HolderEvent) {
        match event {
            HolderEvent::Locked { ticket, handle } => {
                let Some(w) = self.waiters.remove(&ticket) else { return };
                self.unqueue(w.owner);
                observe_span(&self.activity.lock_wait, w.since, now);
                self.admitted(now, &w.key, &handle, w.owner, false);
                self.out.push_back(Output::LockDone { ticket, result: Ok(handle) });
            }
            HolderEvent::LockFailed { ticket, error } => {
                let Some(w) = self.waiters.remove(&ticket) else { return };
                self.unqueue(w.owner);
                tracing::debug!(key = %w.key.escape_ascii(), %error, "lock failed");
                self.out.push_back(Output::LockDone { ticket, result: Err(error) });
            }
            HolderEvent::Recalled { handle, key, deadline } => {
                tracing::debug!(key = %key.escape_ascii(), "lock recalled: another node wants the key");
                if let Some(&(_, owner, _)) = self.owners.get(&handle.serial()) {
                    let notice = Notice::Recalled { deadline };
                    self.out.push_back(Output::Notice { owner, handle, key, notice });
                }
            }
            HolderEvent::Expired { handle, key } => {
                tracing::info!(key = %key.escape_ascii(), "lock lost: the handle passed its deadline");
                if let Some(owner) = self.disown(now, handle) {
                    self.out.push_back(Output::Notice { owner, handle, key, notice: Notice::Expired });
                }
            }
        }
    }
}
