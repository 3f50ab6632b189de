//! [`Core`]: the three protocol state machines of one node and the glue between them.
//!
//! The epoch core ([`EpochNode`]), the home side ([`Home`]) and the holder side ([`Holder`]) are
//! pure; this type feeds them inputs and routes what they produce:
//!
//! - epoch messages and delegation messages for other nodes go to [`Core::take_outbox`], which
//!   the runtime sends on the peers' QUIC links after releasing the lock;
//! - delegation messages this node sends to itself (its holder asking its own home) are handled
//!   at once, in order, without touching the network;
//! - every epoch [`Ready`] that has writes goes to the persistence queue ([`Core::take_persist`]):
//!   its persisted messages leave only after [`Core::persisted`] is called for it;
//! - holder events resolve the pending lock waiters ([`Waiters`]) and report lost handles.
//!
//! Every entry point ends with [`Core::settle`], which handles every due timer and drains every
//! output until nothing is left, so the caller never has to know what a call produced.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use keyhome_delegation::{
    Body as DBody, CheckAnswer, FencingToken, Handle, HandleId, Holder, HolderConfig, HolderEvent, Home,
    HomeConfig, LockError, Message as DMessage, Refusal, RevokeReason, Ticket,
};
use keyhome_epoch::{Change, EpochNode, Event as EpochEvent, Instant, NodeId, ProposeError, Ready, Write};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use crate::wire::PeerFrame;

/// Most `handle_timeout` rounds one settle runs; the cores promise that timers move past `now`,
/// so this only guards against a bug turning into a busy loop.
const MAX_SETTLE_ROUNDS: usize = 10_000;

/// Cluster messages in and out of this node, for `keyhome status` and the tests that assert a
/// cached re-lock sends nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Frames queued for other nodes.
    pub peer_sent: u64,
    /// Frames received from other nodes.
    pub peer_received: u64,
    /// Frames dropped because a peer's queue was full or its link was down.
    pub peer_dropped: u64,
    /// Delegation messages this node sent to itself (holder to own home and back): no network.
    pub local_delivered: u64,
    /// Locks admitted (local and remote clients, embedded callers).
    pub locks: u64,
    /// Locks admitted at once, without any message.
    pub locks_immediate: u64,
    /// Delegation messages queued for other nodes (requests, grants, recalls, releases, checks,
    /// handovers): unlike `peer_sent`, background epoch traffic (home-lease renewals) is not
    /// counted, so a cached re-lock shows up as no change here.
    pub delegation_sent: u64,
    /// Delegation messages received from other nodes.
    pub delegation_received: u64,
}

/// A persistence job: make `writes` durable, then send `messages` and call [`Core::persisted`].
#[derive(Debug)]
pub struct PersistJob {
    pub number: u64,
    pub writes: Vec<Write>,
    pub messages: Vec<(NodeId, PeerFrame)>,
}

/// Where the outcome of a pending lock goes.
pub type LockReply = oneshot::Sender<Result<Handle, LockError>>;
/// Where the answer to a token check goes: the answer, or why the key's home refused the check.
pub type CheckReply = oneshot::Sender<Result<CheckAnswer, Refusal>>;

/// Who owns a handle, so its loss can be reported to the right place.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Owner {
    /// An embedded caller: nobody is told (its guard finds out on next use).
    Embedded,
    /// A client connection.
    Client(u64),
}

/// A handle lost, for the owner's event stream.
#[derive(Clone, Debug)]
pub struct Lost {
    pub owner: u64,
    pub handle: HandleId,
    pub key: Vec<u8>,
    pub reason: RevokeReason,
}

/// The three state machines and their glue. Lives behind the runtime's mutex.
pub struct Core {
    pub id: NodeId,
    pub epoch: EpochNode,
    pub home: Home,
    pub holder: Holder,
    /// Every node named by an epoch this run learned: peers we accept connections from.
    known: HashSet<NodeId>,
    /// The last address an epoch this run learned gave each node, so that a node removed from the
    /// current epoch can still be told about it (and have its handovers acknowledged).
    addrs: HashMap<NodeId, String>,
    /// Delegation messages to self, handled in order within [`Core::settle`].
    local: VecDeque<DMessage>,
    outbox: Vec<(NodeId, PeerFrame)>,
    persist: Vec<PersistJob>,
    /// Pending `Holder::lock` calls.
    waiters: HashMap<Ticket, (LockReply, Owner)>,
    /// Live handles of clients by serial number (the number clients name them by), with their
    /// owners. Embedded handles are not kept here: nobody is told of their loss, and their
    /// guards hold the handle id.
    owners: HashMap<u64, (HandleId, Owner)>,
    lost: Vec<Lost>,
    /// Handles admitted for callers that gave up waiting, with the note they came with: unlocked
    /// at once, passing the note on (nothing was done under them).
    abandoned: Vec<(HandleId, Option<Vec<u8>>)>,
    /// Pending token checks, by request id.
    checks: HashMap<u64, CheckReply>,
    next_check: u64,
    /// The operator change in progress on this node.
    proposal: Option<oneshot::Sender<Result<u64, ProposeError>>>,
    /// Set when the epoch changed; the runtime refreshes its links.
    epoch_changed: bool,
    pub counters: Counters,
    /// Once set (a write failed), nothing leaves this node any more.
    failed: bool,
}

impl Core {
    /// A core around an epoch node whose first `Ready` (the incarnation) is already durable.
    pub fn new(epoch: EpochNode, home: HomeConfig, holder: HolderConfig, now: Instant) -> Core {
        let id = epoch.id();
        let known = epoch.current().member_ids().collect();
        let addrs = epoch.current().members.iter().map(|m| (m.id, m.addr.clone())).collect();
        Core {
            id,
            home: Home::new(home, now),
            holder: Holder::new(holder, now),
            epoch,
            known,
            addrs,
            local: VecDeque::new(),
            outbox: Vec::new(),
            persist: Vec::new(),
            waiters: HashMap::new(),
            owners: HashMap::new(),
            lost: Vec::new(),
            abandoned: Vec::new(),
            checks: HashMap::new(),
            next_check: 0,
            proposal: None,
            epoch_changed: true,
            counters: Counters::default(),
            failed: false,
        }
    }

    /// Whether `peer` is named by an epoch this node learned.
    pub fn is_known(&self, peer: NodeId) -> bool {
        self.known.contains(&peer)
    }

    /// The address of `peer` in the current epoch.
    pub fn addr_of(&self, peer: NodeId) -> Option<String> {
        self.epoch.current().members.iter().find(|m| m.id == peer).map(|m| m.addr.clone())
    }

    /// Where to reach `peer`: its address in the current epoch, else the last one an earlier
    /// epoch gave it (a removed node still hears of the epoch that removed it).
    pub fn link_addr(&self, peer: NodeId) -> Option<String> {
        self.addr_of(peer).or_else(|| self.addrs.get(&peer).cloned())
    }

    /// Stops everything from leaving: a durable write failed.
    pub fn fail(&mut self) {
        self.failed = true;
        self.outbox.clear();
        self.persist.clear();
    }

    // ---- inputs ----

    /// A frame from peer `from` (authenticated by its certificate).
    pub fn handle_frame(&mut self, now: Instant, from: NodeId, frame: PeerFrame) {
        self.counters.peer_received += 1;
        match frame {
            PeerFrame::Hello { .. } => {}
            PeerFrame::Epoch(message) => self.epoch.handle_message(now, from, message),
            PeerFrame::Delegation(message) => {
                self.counters.delegation_received += 1;
                self.deliver(now, from, message)
            }
        }
        self.settle(now);
    }

    /// Timers: call at or after [`Core::poll_timeout`].
    pub fn handle_timeout(&mut self, now: Instant) {
        self.settle(now);
    }

    /// The earliest instant something is due.
    pub fn poll_timeout(&self) -> Option<Instant> {
        [self.epoch.poll_timeout(), self.home.poll_timeout(), self.holder.poll_timeout()]
            .into_iter()
            .flatten()
            .min()
    }

    /// The writes of persistence job `number` (and every earlier one) are durable and its messages
    /// are queued.
    pub fn persisted(&mut self, now: Instant, job: PersistJob) {
        if self.failed {
            return;
        }
        self.outbox.extend(job.messages);
        self.epoch.advance(now, job.number);
        self.settle(now);
    }

    /// Locks `key` for `owner`: admitted at once (`Ok(Ok(handle))`), or pending with its outcome
    /// sent to `reply` (`Ok(Err(ticket))`).
    pub fn lock(
        &mut self,
        now: Instant,
        key: &[u8],
        ttl: Duration,
        wait: Duration,
        owner: Owner,
        reply: impl FnOnce() -> LockReply,
    ) -> Result<Result<Handle, Ticket>, LockError> {
        let outcome = self.holder.lock(now, key, ttl, wait, &self.epoch);
        let result = match outcome {
            Ok(keyhome_delegation::LockOutcome::Locked(handle)) => {
                self.admitted(&handle, owner, true);
                Ok(Ok(handle))
            }
            Ok(keyhome_delegation::LockOutcome::Pending(ticket)) => {
                self.waiters.insert(ticket, (reply(), owner));
                Ok(Err(ticket))
            }
            Err(e) => Err(e),
        };
        self.settle(now);
        result
    }

    /// Locks `key` only if that needs no message; the fast path of embedded callers.
    pub fn try_lock(
        &mut self,
        now: Instant,
        key: &[u8],
        ttl: Duration,
        owner: Owner,
    ) -> Result<Handle, LockError> {
        let result = self.holder.try_lock(now, key, ttl);
        if let Ok(handle) = &result {
            self.admitted(handle, owner, true);
        }
        // A miss starts a request: send it now rather than at the next timer.
        if self.holder.poll_timeout().is_some_and(|t| t <= now) {
            self.settle(now);
        }
        result
    }

    /// Gives up a pending lock; `false` if it was already decided.
    pub fn cancel(&mut self, now: Instant, ticket: Ticket) -> bool {
        self.waiters.remove(&ticket);
        let cancelled = self.holder.cancel(now, ticket);
        self.settle(now);
        cancelled
    }

    pub fn renew(&mut self, now: Instant, handle: HandleId, ttl: Duration) -> Result<Instant, LockError> {
        let result = self.holder.renew(now, handle, ttl);
        self.forget_if_lost(handle, &result);
        result
    }

    pub fn unlock(&mut self, now: Instant, handle: HandleId, note: Option<Vec<u8>>) -> Result<(), LockError> {
        let result = self.holder.unlock(now, handle, note);
        if result.is_ok() {
            self.disown(handle);
        } else {
            self.forget_if_lost(handle, &result);
        }
        if self.holder.poll_timeout().is_some_and(|t| t <= now) {
            self.settle(now);
        }
        result
    }

    /// Ends a handle whose owner went away without unlocking: the next holder of the key is told
    /// `recovered`, since the owner may have been interrupted halfway.
    pub fn abandon(&mut self, now: Instant, handle: HandleId) -> Result<(), LockError> {
        self.disown(handle);
        let result = self.holder.abandon(now, handle);
        self.settle(now);
        result
    }

    /// Asks `key`'s home whether `key` is held with `token` now (the home may forward the question
    /// to the key's holder, which then answers); the answer goes to `reply`. Refused with `NoHome`
    /// when no epoch names a home.
    pub fn check(
        &mut self,
        now: Instant,
        key: Vec<u8>,
        token: FencingToken,
        reply: CheckReply,
    ) -> Result<(), LockError> {
        let home = self.epoch.home_of(&key).ok_or(LockError::NoHome)?;
        // Checks whose askers gave up (timed out) are forgotten here, the one place they pile up.
        self.checks.retain(|_, r| !r.is_closed());
        self.next_check += 1;
        let id = self.next_check;
        self.checks.insert(id, reply);
        let message = DMessage { epoch: self.epoch.current().number, body: DBody::Check { key, id, token } };
        self.route(home, message);
        self.settle(now);
        Ok(())
    }

    /// Starts an operator change; its outcome goes to `reply`.
    pub fn propose(
        &mut self,
        now: Instant,
        change: Change,
        reply: oneshot::Sender<Result<u64, ProposeError>>,
    ) -> Result<(), ProposeError> {
        self.epoch.propose(now, change)?;
        self.proposal = Some(reply);
        self.settle(now);
        Ok(())
    }

    /// **Unsafe** recovery (see [`EpochNode::recover_unsafe`]); returns the new epoch's number.
    pub fn recover_unsafe(
        &mut self,
        now: Instant,
        members: Vec<keyhome_epoch::Member>,
        skip: u64,
    ) -> Result<u64, ProposeError> {
        let number = self.epoch.recover_unsafe(now, members, skip)?;
        if let Some(reply) = self.proposal.take() {
            let _ = reply.send(Err(ProposeError::Overtaken(0)));
        }
        self.settle(now);
        Ok(number)
    }

    // ---- outputs ----

    pub fn take_outbox(&mut self) -> Vec<(NodeId, PeerFrame)> {
        std::mem::take(&mut self.outbox)
    }

    pub fn take_persist(&mut self) -> Vec<PersistJob> {
        std::mem::take(&mut self.persist)
    }

    pub fn take_lost(&mut self) -> Vec<Lost> {
        std::mem::take(&mut self.lost)
    }

    /// Whether the epoch changed since the last call.
    pub fn take_epoch_changed(&mut self) -> bool {
        std::mem::take(&mut self.epoch_changed)
    }

    /// Handles of `owner` (for a client connection that went away).
    pub fn handles_of(&self, owner: Owner) -> Vec<HandleId> {
        self.owners.values().filter(|(_, o)| *o == owner).map(|(h, _)| *h).collect()
    }

    /// The live handle with serial number `serial`, and its owner.
    pub fn handle(&self, serial: u64) -> Option<(HandleId, Owner)> {
        self.owners.get(&serial).copied()
    }

    /// Moves a handle to another owner (a client that reconnected).
    pub fn set_owner(&mut self, handle: HandleId, owner: Owner) {
        if let Some((_, o)) = self.owners.get_mut(&handle.serial()) {
            *o = owner;
        }
    }

    /// Ends every handle and gives back every delegation this node holds, for a clean shutdown.
    pub fn release_all(&mut self, now: Instant) {
        for (handle, _) in std::mem::take(&mut self.owners).into_values() {
            let _ = self.holder.unlock(now, handle, None);
        }
        self.holder.release_all(now);
        self.settle(now);
    }

    /// The durable writes of the run's start (the incarnation), to commit before anything else.
    pub fn start_writes(&mut self) -> Vec<PersistJob> {
        while let Some(ready) = self.epoch.ready() {
            self.take_ready(ready);
        }
        std::mem::take(&mut self.persist)
    }

    /// Current epoch members' ids.
    pub fn peer_ids(&self) -> Vec<NodeId> {
        self.epoch.current().member_ids().collect()
    }

    /// This node's status at `now` (members not yet marked connected; the runtime does that).
    pub fn status(&self, now: Instant) -> crate::status::Status {
        let current = self.epoch.current();
        crate::status::Status {
            id: self.id.0,
            incarnation: self.epoch.incarnation(),
            epoch: current.number,
            members: current
                .members
                .iter()
                .map(|m| crate::status::MemberStatus { id: m.id.0, addr: m.addr.clone(), connected: false })
                .collect(),
            home_lease_left: self.epoch.lease_until(now).map(|until| until.saturating_duration_since(now)),
            quarantine_left: self.home.quarantine_end(&current.timing).saturating_duration_since(now),
            holder_keys: self.holder.tracked_keys(),
            homed_delegations: self.home.delegations(),
            lock_delay_keys: self.home.keys_in_lock_delay(),
            counters: self.counters,
        }
    }

    // ---- internals ----

    fn admitted(&mut self, handle: &Handle, owner: Owner, immediate: bool) {
        if let Owner::Client(_) = owner {
            self.owners.insert(handle.id.serial(), (handle.id, owner));
        }
        self.counters.locks += 1;
        if immediate {
            self.counters.locks_immediate += 1;
        }
    }

    /// Forgets a client handle's owner (a no-op for embedded handles, without hashing when no
    /// client holds anything).
    fn disown(&mut self, handle: HandleId) -> Option<(HandleId, Owner)> {
        if self.owners.is_empty() { None } else { self.owners.remove(&handle.serial()) }
    }

    fn forget_if_lost<T>(&mut self, handle: HandleId, result: &Result<T, LockError>) {
        if matches!(result, Err(LockError::Revoked | LockError::Expired | LockError::UnknownHandle)) {
            self.disown(handle);
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
            DBody::Grant { .. } | DBody::Refuse { .. } | DBody::Recall { .. } | DBody::Probe { .. } => {
                self.holder.handle_message(now, from, message, &self.epoch)
            }
            DBody::CheckReply { id, answer, .. } => {
                if let Some(reply) = self.checks.remove(&id) {
                    let _ = reply.send(answer);
                }
            }
        }
    }

    fn route(&mut self, to: NodeId, message: DMessage) {
        if to == self.id {
            self.counters.local_delivered += 1;
            self.local.push_back(message);
        } else {
            self.send(to, PeerFrame::Delegation(message));
        }
    }

    fn send(&mut self, to: NodeId, frame: PeerFrame) {
        if !self.failed {
            self.counters.peer_sent += 1;
            if matches!(frame, PeerFrame::Delegation(_)) {
                self.counters.delegation_sent += 1;
            }
            self.outbox.push((to, frame));
        }
    }

    /// Runs every due timer and drains every output, until nothing is left to do.
    pub fn settle(&mut self, now: Instant) {
        for _ in 0..MAX_SETTLE_ROUNDS {
            if self.epoch.poll_timeout().is_some_and(|t| t <= now) {
                self.epoch.handle_timeout(now);
            }
            if self.home.poll_timeout().is_some_and(|t| t <= now) {
                self.home.handle_timeout(now, &self.epoch);
            }
            if self.holder.poll_timeout().is_some_and(|t| t <= now) {
                self.holder.handle_timeout(now, &self.epoch);
            }
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
                self.on_holder_event(event);
            }
            for (handle, note) in std::mem::take(&mut self.abandoned) {
                let _ = self.holder.unlock(now, handle, note);
            }
            match self.local.pop_front() {
                Some(message) => self.deliver(now, self.id, message),
                None if self.poll_timeout().is_none_or(|t| t > now) => return,
                None => {}
            }
        }
        tracing::error!("settle did not converge; a protocol core keeps a timer at or before now");
    }

    fn take_ready(&mut self, ready: Ready) {
        let gated = ready.needs_advance();
        for t in ready.messages {
            self.send(t.to, PeerFrame::Epoch(t.message));
        }
        if gated && !self.failed {
            let messages =
                ready.persisted_messages.into_iter().map(|t| (t.to, PeerFrame::Epoch(t.message))).collect();
            self.persist.push(PersistJob { number: ready.number, writes: ready.writes, messages });
        }
    }

    fn on_epoch_event(&mut self, now: Instant, event: EpochEvent) {
        match event {
            EpochEvent::Learned { epoch } => {
                tracing::info!(epoch, members = self.epoch.current().members.len(), "learned epoch");
                self.known.extend(self.epoch.current().member_ids());
                self.addrs.extend(self.epoch.current().members.iter().map(|m| (m.id, m.addr.clone())));
                self.home.on_epoch_change(now, &self.epoch);
                self.epoch_changed = true;
            }
            EpochEvent::ProposalApplied { epoch } => {
                if let Some(reply) = self.proposal.take() {
                    let _ = reply.send(Ok(epoch));
                }
            }
            EpochEvent::ProposalFailed { error } => {
                if let Some(reply) = self.proposal.take() {
                    let _ = reply.send(Err(error));
                }
            }
        }
    }

    fn on_holder_event(&mut self, event: HolderEvent) {
        match event {
            HolderEvent::Locked { ticket, handle } => {
                let Some((reply, owner)) = self.waiters.remove(&ticket) else { return };
                self.admitted(&handle, owner, false);
                if let Err(Ok(handle)) = reply.send(Ok(handle)) {
                    self.disown(handle.id);
                    self.abandoned.push((handle.id, handle.note));
                }
            }
            HolderEvent::LockFailed { ticket, error } => {
                if let Some((reply, _)) = self.waiters.remove(&ticket) {
                    let _ = reply.send(Err(error));
                }
            }
            HolderEvent::Revoked { handle, key, reason } => {
                if let Some((_, Owner::Client(owner))) = self.disown(handle) {
                    self.lost.push(Lost { owner, handle, key, reason });
                }
            }
        }
    }
}
