//! [`Shard`]: the home and the holder of the keys that hash to one shard of a node, their pending
//! calls and client handles, and the glue between them.
//!
//! A shard decides on its own, against the [`EpochView`] the node's membership last published:
//! every delegation message is about one key, and a key's home and holder on this node live in
//! the same shard, so the messages a shard sends itself (its holder asking its own home) never
//! leave it. Shards of one node share nothing but that view.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use keyhome_delegation::{
    Authority, Body as DBody, Ending, FencingToken, Handle, HandleId, HashedKey, Holder, HolderConfig,
    HolderEvent, Home, HomeConfig, LockError, LockOutcome, Message as DMessage, Ticket,
};
use keyhome_epoch::time::earliest;
use keyhome_epoch::{EpochView, Instant, NodeId};

use super::membership::Published;
use super::monotonic::Monotonic;
use super::outbox::Outbox;
use super::{
    ClaimError, ClientOwner, MAX_PENDING_CHECKS, MAX_PENDING_LOCKS_PER_CONN, MAX_TIMER_ROUNDS, Notice,
    Output, Owner, PeerMessage,
};
use crate::activity::observe_span;
use crate::hotkeys::HotKeys;

/// A pending `lock` call.
struct Waiting {
    owner: Owner,
    key: Box<[u8]>,
    /// When the lock was called.
    since: Instant,
}

/// Where a shard sits among its node's `count` shards: its check ids (like its holder's serials)
/// are `first`, `first + stride`, `first + 2 · stride`, …, with `first ≡ index` modulo `stride`, so
/// none is given twice and an id's low bits name its shard (`id & (stride - 1) == index`: no
/// division on the unlock path).
///
/// Each run of the node has ids of its own, by its incarnation: run `r` gives out ids from
/// `r · RUN_SPAN` up, below `(r + 1) · RUN_SPAN` (whatever its shard count, which may differ from
/// run to run), so a handle number or check id kept from an earlier run names nothing in this
/// one, rather than a live handle of the same identity.
#[derive(Clone, Copy, Debug)]
pub(super) struct Place {
    pub index: u64,
    pub count: u64,
    /// The power of two at or above `count`.
    pub stride: u64,
    /// The run's incarnation, modulo [`RUNS`].
    run: u64,
}

/// The ids of one run: `RUN_SPAN / stride` per shard (2^42 on one shard, 2^36 on each of 64),
/// two hours to five days of locking at ten million a second. A run that gives out more runs
/// into the next run's ids (docs/api.md, "handle number").
const RUN_SPAN: u64 = 1 << 42;

/// Runs before the ids start over (2^10 restarts): every id stays below `RUNS · RUN_SPAN` = 2^52,
/// so a handle number is exact as a JSON number in any language (an IEEE double).
const RUNS: u64 = 1 << 10;

const _: () = assert!(RUN_SPAN >= (super::MAX_SHARDS as u64).next_power_of_two() << 30);

impl Place {
    /// The place of shard `index` of `count` in run `incarnation`.
    pub fn new(index: usize, count: usize, incarnation: u64) -> Place {
        Place {
            index: index as u64,
            count: count as u64,
            stride: Place::stride(count),
            run: incarnation % RUNS,
        }
    }

    /// The distance between two ids of one shard among `count`: the power of two at or above it.
    pub fn stride(count: usize) -> u64 {
        (count as u64).next_power_of_two()
    }

    /// The first id this shard gives out: the run's first, `run · RUN_SPAN` (a multiple of every
    /// stride), plus `index`, or `stride` for shard 0 (0 is never an id).
    pub fn first(self) -> u64 {
        let own = if self.index == 0 { self.stride } else { self.index };
        self.run * RUN_SPAN + own
    }
}

/// See the module docs.
pub(super) struct Shard {
    id: NodeId,
    place: Place,
    pub home: Home,
    pub holder: Holder,
    /// The membership's latest view.
    view: Arc<EpochView>,
    /// Delegation messages to self, delivered in order within [`Shard::settle`].
    local: VecDeque<DMessage>,
    pub out: Outbox,
    /// The latest clock reading the shard acted on (the [`Core`](super::Core) brings every
    /// reading up to it before the shard uses it).
    pub clock: Monotonic,
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
    /// The id of the latest check, or 0.
    last_check: u64,
    pub hot: HotKeys,
    lock_wait: prometheus_client::metrics::histogram::Histogram,
    lock_hold: prometheus_client::metrics::histogram::Histogram,
    /// Report local deliveries, and messages held for other nodes, as [`Output::Observed`].
    pub observe_local: bool,
    /// Hold messages for other nodes while the view's epoch is not durable ([`Outbox::hold`]);
    /// false only with the test-only switch `Bugs::no_outbox_hold`.
    hold_undurable: bool,
    /// The earliest deadline of the home and the token checks as [`Shard::poll_timeout`] last
    /// found it.
    others_due: Option<Instant>,
    /// The calls since the last [`Shard::poll_timeout`] reached the holder alone (a re-lock, a
    /// renewal or an unlock with nothing to settle), so `others_due` still holds: the hot path
    /// reads only the holder's deadline.
    holder_only: bool,
}

impl Shard {
    pub fn new(
        place: Place,
        home: HomeConfig,
        holder: HolderConfig,
        view: Arc<EpochView>,
        histograms: &crate::activity::Activity,
        now: Instant,
    ) -> Shard {
        let hold_undurable = !holder.bugs().no_outbox_hold;
        Shard {
            id: home.id,
            place,
            home: Home::new(home, now),
            holder: Holder::new(holder, now),
            view,
            local: VecDeque::new(),
            out: Outbox::default(),
            clock: Monotonic::new(now),
            waiters: HashMap::new(),
            pending_per_conn: HashMap::new(),
            owners: HashMap::new(),
            checks: HashMap::new(),
            check_deadlines: BinaryHeap::new(),
            last_check: 0,
            hot: HotKeys::default(),
            lock_wait: histograms.lock_wait.clone(),
            lock_hold: histograms.lock_hold.clone(),
            observe_local: false,
            hold_undurable,
            others_due: None,
            holder_only: false,
        }
    }

    // ---- inputs ----

    /// A delegation message from `from` (another node).
    pub fn handle_message(&mut self, now: Instant, from: NodeId, message: DMessage) {
        self.deliver(now, from, message);
        self.settle(now);
    }

    /// Timers, and one share of the paced work (epoch walks, handover resends).
    pub fn handle_timeout(&mut self, now: Instant) {
        // One share per call: the home's first, then the holder's.
        if self.home.poll_timeout().is_some_and(|t| t <= now) {
            self.home.handle_timeout(now, &*self.view);
        } else if self.holder.poll_timeout().is_some_and(|t| t <= now) {
            self.holder.handle_timeout(now, &*self.view);
        }
        self.settle(now);
    }

    /// Takes the membership's new view; with a new epoch, the home and the holder start walking
    /// their keys through the change (and take its first step).
    pub fn publish(&mut self, now: Instant, published: &Published) {
        self.view = Arc::clone(&published.view);
        self.out.hold(!published.durable && self.hold_undurable);
        if published.new_epoch {
            self.home.on_epoch_change(now, &*self.view);
            self.holder.on_epoch_change(now, &*self.view);
        }
        self.settle(now);
    }

    /// The earliest instant something is due, paced work included.
    #[inline]
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        if !std::mem::take(&mut self.holder_only) {
            self.others_due = self.others_deadline();
        }
        debug_assert_eq!(
            self.others_due,
            self.others_deadline(),
            "a holder-only call moved another deadline"
        );
        earliest(self.others_due, self.holder.poll_timeout())
    }

    /// The earliest deadline of the home (paced work included) and the token checks.
    fn others_deadline(&self) -> Option<Instant> {
        earliest(self.home.poll_timeout(), self.next_check_deadline())
    }

    /// The earliest timer, leaving paced work out: what [`Shard::settle`] runs down.
    fn poll_timer(&self) -> Option<Instant> {
        earliest(earliest(self.home.poll_timer(), self.holder.poll_timer()), self.next_check_deadline())
    }

    /// When the oldest pending token check times out.
    fn next_check_deadline(&self) -> Option<Instant> {
        self.check_deadlines.peek().map(|Reverse((at, _))| *at)
    }

    pub fn shutdown(&mut self, now: Instant) {
        self.holder.shutdown(now);
        self.settle(now);
    }

    // ---- lock calls ----

    /// [`Holder::lock_hashed`]: `hashed` is hashed by the holder's key hasher.
    pub fn lock(
        &mut self,
        now: Instant,
        hashed: HashedKey<'_>,
        ttl: Duration,
        wait: Duration,
        owner: Owner,
    ) -> Result<LockOutcome, LockError> {
        if let Owner::Client(c) = owner
            && self.pending_per_conn.get(&c.conn).is_some_and(|&n| n >= MAX_PENDING_LOCKS_PER_CONN)
        {
            return Err(LockError::QueueFull);
        }
        let outcome = self.holder.lock_hashed(now, hashed, ttl, wait, &*self.view);
        let key = hashed.key();
        match &outcome {
            Ok(LockOutcome::Locked(handle)) => self.admitted(now, key, handle, owner, true),
            Ok(LockOutcome::Pending(ticket)) => {
                self.hot.waited(key);
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

    /// [`Holder::try_lock_hashed`]: `key` is hashed by the holder's key hasher.
    #[inline]
    pub fn try_lock(
        &mut self,
        now: Instant,
        key: HashedKey<'_>,
        ttl: Duration,
        owner: Owner,
    ) -> Result<Handle, LockError> {
        let result = self.holder.try_lock_hashed(now, key, ttl);
        if let Ok(handle) = &result {
            self.admitted(now, key.key(), handle, owner, true);
        }
        self.settle_if_due(now);
        result
    }

    pub fn cancel(&mut self, now: Instant, ticket: Ticket) -> bool {
        if let Some(w) = self.waiters.remove(&ticket) {
            self.unqueue(w.owner);
        }
        let cancelled = self.holder.cancel(now, ticket);
        self.settle(now);
        cancelled
    }

    pub fn renew(&mut self, now: Instant, handle: HandleId, ttl: Duration) -> Result<Instant, LockError> {
        let result = self.holder.renew(now, handle, ttl);
        self.forget_if_lost(now, handle, &result);
        self.settle_if_due(now);
        result
    }

    /// See [`Holder::end`].
    #[inline]
    pub fn end(&mut self, now: Instant, handle: HandleId, ending: Ending) -> Result<(), LockError> {
        let result = self.holder.end(now, handle, ending);
        self.ended(now, handle, result)
    }

    /// After `handle` was ended with `result`.
    #[inline]
    fn ended(
        &mut self,
        now: Instant,
        handle: HandleId,
        result: Result<(), LockError>,
    ) -> Result<(), LockError> {
        if result.is_ok() {
            self.disown(now, handle);
        } else {
            self.forget_if_lost(now, handle, &result);
        }
        self.settle_if_due(now);
        result
    }

    pub fn claim(&mut self, serial: u64, owner: ClientOwner) -> Result<HandleId, ClaimError> {
        let (handle, current, _) = self.owners.get_mut(&serial).ok_or(ClaimError::NotHeld(serial))?;
        if current.identity != owner.identity {
            return Err(ClaimError::Forbidden(serial));
        }
        current.conn = owner.conn;
        Ok(*handle)
    }

    pub fn recalled(&self, now: Instant, handle: HandleId) -> bool {
        self.holder
            .key_of(handle)
            .and_then(|key| self.holder.delegation(now, key))
            .is_some_and(|d| d.recalling)
    }

    pub fn check(
        &mut self,
        now: Instant,
        key: Vec<u8>,
        token: FencingToken,
        timeout: Duration,
    ) -> Result<u64, LockError> {
        let home = self.view.home_of(&key).ok_or(LockError::NoHome)?;
        if self.checks.len() >= MAX_PENDING_CHECKS {
            return Err(LockError::QueueFull);
        }
        self.last_check = match self.last_check {
            0 => self.place.first(),
            last => last + self.place.stride,
        };
        let id = self.last_check;
        self.checks.insert(id, key.clone());
        self.check_deadlines.push(Reverse((now + timeout, id)));
        let message = DMessage { epoch: self.view.current().number, body: DBody::Check { key, id, token } };
        self.route(home, message);
        self.settle(now);
        Ok(id)
    }

    // ---- views ----

    pub fn view(&self) -> &EpochView {
        &self.view
    }

    /// The keys of pending lock calls, with when each call was made (one entry per call).
    pub fn waiting(&self) -> impl Iterator<Item = (&[u8], Instant)> {
        self.waiters.values().map(|w| (&*w.key, w.since))
    }

    pub fn waiting_count(&self) -> usize {
        self.waiters.len()
    }

    /// The live handles of client connection `conn`.
    pub fn handles_of(&self, conn: u64) -> impl Iterator<Item = HandleId> + '_ {
        self.owners.values().filter(move |(_, o, _)| o.conn == conn).map(|(h, _, _)| *h)
    }

    // ---- internals ----

    #[inline]
    fn admitted(&mut self, now: Instant, key: &[u8], handle: &Handle, owner: Owner, immediate: bool) {
        if let Owner::Client(c) = owner {
            self.owners.insert(handle.id.serial(), (handle.id, c, now));
        }
        tracing::debug!(key = %key.escape_ascii(), token = %handle.token, immediate, "lock admitted");
        self.out.counters.locks += 1;
        if immediate {
            self.out.counters.locks_immediate += 1;
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
    #[inline]
    fn disown(&mut self, now: Instant, handle: HandleId) -> Option<ClientOwner> {
        if self.owners.is_empty() {
            return None;
        }
        let (_, owner, admitted) = self.owners.remove(&handle.serial())?;
        observe_span(&self.lock_hold, admitted, now);
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
            | DBody::HandoverAck { .. } => self.home.handle_message(now, from, message, &*self.view),
            DBody::Recall { ref key, .. } => {
                self.hot.recalled(key);
                self.holder.handle_message(now, from, message, &*self.view)
            }
            DBody::Grant { .. } | DBody::Pass { .. } | DBody::Refuse { .. } | DBody::Probe { .. } => {
                self.holder.handle_message(now, from, message, &*self.view)
            }
            DBody::CheckReply { key, id, answer } => {
                // Answered by the key's home or its holder: members (a removed node's
                // certificate may be in other hands, and check ids are sequential).
                let member = from == self.id || Authority::is_member(&*self.view, from);
                if member && self.checks.get(&id).is_some_and(|asked| *asked == key) {
                    self.checks.remove(&id);
                    self.out.push(Output::CheckDone { id, answer: Some(answer) });
                }
            }
        }
    }

    fn route(&mut self, to: NodeId, message: DMessage) {
        if to == self.id {
            self.out.counters.local_delivered += 1;
            self.local.push_back(message);
        } else {
            let observed = (self.observe_local && self.out.holding()).then(|| message.clone());
            // Reported only if it is held: one dropped over the hold's budget never leaves.
            if self.out.send(to, PeerMessage::Delegation(message))
                && let Some(message) = observed
            {
                self.out.push(Output::Observed { message, held: true });
            }
        }
    }

    /// [`Shard::settle`] only when something is due, after a call that reached only the holder
    /// ([`Shard::try_lock`], [`Shard::renew`], [`Shard::unlock`]): the hot path (a re-lock, an
    /// unlock) leaves nothing behind in the common case. Every call leaves the home and holder
    /// drained and no local message queued, so only the holder can have produced something: when
    /// it has not, there is nothing to drain, and the call reached the holder alone.
    #[inline]
    fn settle_if_due(&mut self, now: Instant) {
        debug_assert!(self.local.is_empty(), "a local message outlived the call that queued it");
        if self.holder.poll_timer().is_some_and(|t| t <= now) || self.holder.has_output() {
            self.settle_after_holder(now);
        } else {
            self.holder_only = true;
        }
    }

    /// The rare half of [`Shard::settle_if_due`], kept out of line so that the hot path's
    /// callers keep their results in place.
    #[cold]
    #[inline(never)]
    fn settle_after_holder(&mut self, now: Instant) {
        if self.holder.poll_timer().is_some_and(|t| t <= now) {
            self.settle(now);
        } else {
            self.drain(now);
        }
    }

    /// Runs every due timer and drains every output and local message, until no timer is due
    /// (paced work is left to [`Shard::handle_timeout`]).
    fn settle(&mut self, now: Instant) {
        for _ in 0..MAX_TIMER_ROUNDS {
            if self.home.poll_timer().is_some_and(|t| t <= now) {
                self.home.handle_timeout(now, &*self.view);
            }
            if self.holder.poll_timer().is_some_and(|t| t <= now) {
                self.holder.handle_timeout(now, &*self.view);
            }
            while let Some(&Reverse((at, id))) = self.check_deadlines.peek()
                && at <= now
            {
                self.check_deadlines.pop();
                if self.checks.remove(&id).is_some() {
                    self.out.push(Output::CheckDone { id, answer: None });
                }
            }
            self.drain(now);
            if self.poll_timer().is_none_or(|t| t > now) {
                return;
            }
        }
        tracing::error!("settle did not converge; a protocol core keeps a timer at or before now");
    }

    /// Takes everything the home and the holder produced, delivering local messages, until
    /// nothing is left.
    fn drain(&mut self, now: Instant) {
        loop {
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
                        self.out.push(Output::Observed { message: message.clone(), held: false });
                    }
                    self.deliver(now, self.id, message)
                }
                // What a handle given back for no waiter produced.
                None if self.holder.has_output() => {}
                None => return,
            }
        }
    }

    fn on_holder_event(&mut self, now: Instant, event: HolderEvent) {
        match event {
            HolderEvent::Locked { ticket, handle } => {
                let Some(w) = self.waiters.remove(&ticket) else {
                    // Every pending lock the holder keeps is a waiter here (a cancel ends both):
                    // a handle for no waiter is this shard's bug. Nobody can use it, so it is
                    // given back rather than left to hold its key until its deadline.
                    tracing::error!(?ticket, "a lock was admitted for no waiting caller; given back");
                    let _ = self.holder.give_back(now, handle.id);
                    return;
                };
                self.unqueue(w.owner);
                observe_span(&self.lock_wait, w.since, now);
                self.admitted(now, &w.key, &handle, w.owner, false);
                self.out.push(Output::LockDone { ticket, result: Ok(handle) });
            }
            HolderEvent::LockFailed { ticket, error } => {
                let Some(w) = self.waiters.remove(&ticket) else { return };
                self.unqueue(w.owner);
                tracing::debug!(key = %w.key.escape_ascii(), %error, "lock failed");
                self.out.push(Output::LockDone { ticket, result: Err(error) });
            }
            HolderEvent::Recalled { handle, key, deadline } => {
                tracing::debug!(key = %key.escape_ascii(), "lock recalled: another node wants the key");
                if let Some(&(_, owner, _)) = self.owners.get(&handle.serial()) {
                    let notice = Notice::Recalled { deadline };
                    self.out.push(Output::Notice { owner, handle, key, notice });
                }
            }
            HolderEvent::Expired { handle, key } => {
                tracing::info!(key = %key.escape_ascii(), "lock lost: the handle passed its deadline");
                if let Some(owner) = self.disown(now, handle) {
                    self.out.push(Output::Notice { owner, handle, key, notice: Notice::Expired });
                }
            }
        }
    }
}
