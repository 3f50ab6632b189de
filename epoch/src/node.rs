//! The epoch core of one node: agreement on each next epoch, learning, home leases and activation.
//!
//! A pure state machine in the style of quinn-proto's `Connection`: the driver feeds it messages
//! ([`EpochNode::handle_message`]), operator requests ([`EpochNode::propose`]) and timer expiries
//! ([`EpochNode::handle_timeout`]), always with the current reading of the node's own clock, and
//! drains what it produced with [`EpochNode::ready`] and [`EpochNode::poll_event`].
//!
//! # The `Ready` contract
//!
//! Like raft-rs's `Ready`: the driver sends [`Ready::messages`] at once; makes [`Ready::writes`]
//! durable, after the writes of every earlier `Ready`; only then sends
//! [`Ready::persisted_messages`] and calls [`EpochNode::advance`] with the `Ready`'s number. Every
//! message produced while any write is not yet durable is a persisted message, so nothing another
//! node can observe ever runs ahead of this node's disk: acceptor replies follow their promise,
//! lease requests and grants under a new epoch follow the write of that epoch (the floor), and
//! nothing at all leaves before the incarnation of the run is durable.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use keyhome_ring::{KeyDigest, NodeId};

use crate::activation;
use crate::change::{Change, ChangeError};
use crate::message::{Body, Message, Transmit};
use crate::paxos::{Ballot, Proposer, Step, Vote};
use crate::record::{EpochRecord, Member};
use crate::storage::{Durable, Write};
use crate::time::Instant;
use crate::view::{EpochView, History, Learned, ViewStamp};

/// Switches that each disable one safety rule, so tests can show the simulation notices.
/// Only in builds with the `bug-injection` feature; every switch is off by default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bugs {
    /// Acceptor state is not persisted: a restarted acceptor forgets its promises and votes.
    pub amnesiac_acceptor: bool,
    /// Acceptors keep renewing home leases of epoch n after accepting a value for n + 1.
    pub renew_after_accept: bool,
    /// A node acts as home of a moved key as soon as it learns the epoch.
    pub skip_activation_wait: bool,
    /// Learned epochs are not persisted: a restarted node falls back below its floor.
    pub no_epoch_floor: bool,
    /// The incarnation is not persisted: a restarted node reuses an old one.
    pub volatile_incarnation: bool,
    /// The previous epoch's home of a key is never named, so homes adopt no handover and every
    /// moved key waits out the activation wait (a liveness promise, not safety).
    pub no_handover: bool,
    /// After every change, `home_active` is false until the current epoch's activation instant,
    /// also for keys that kept their home (a liveness promise, not safety).
    pub same_home_wait: bool,
    /// A lease of an earlier epoch lets a node grant a key although that epoch's delegations were
    /// shorter than the current epoch's, which the home grants.
    pub delegation_lease_of_current_epoch: bool,
    /// A node the current epoch does not name is believed only once a majority of the members of
    /// the record it tells have told it (the rule of `e206479`, reverted in `b7d685a`): a spare
    /// added to a 2-member epoch by a member of the epoch before, a stranger to it, may then
    /// never learn its epoch, and changes stop (a liveness promise, not safety).
    pub stranger_majority: bool,
}

/// Settings of one node's epoch core that are not part of the epoch record.
#[derive(Clone, Debug)]
pub struct Config {
    pub id: NodeId,
    /// Seeds the retry jitter. Any value works; distinct nodes should use distinct seeds.
    pub seed: u64,
    /// How long a proposer waits for a round before it retries with a higher ballot (plus jitter).
    pub round_timeout: Duration,
    /// How long a node waits before asking the same peer again for a newer epoch.
    pub catch_up_interval: Duration,
    #[cfg(feature = "bug-injection")]
    pub bugs: Bugs,
}

impl Config {
    /// Defaults suited to a LAN: 200 ms rounds, catch-up at most every 100 ms.
    pub fn new(id: NodeId, seed: u64) -> Config {
        Config {
            id,
            seed,
            round_timeout: Duration::from_millis(200),
            catch_up_interval: Duration::from_millis(100),
            #[cfg(feature = "bug-injection")]
            bugs: Bugs::default(),
        }
    }
}

/// The driver's batch of work; see the module documentation for the contract.
#[derive(Debug, Default)]
pub struct Ready {
    /// Numbers `Ready`s in the order they were produced, from 1.
    pub number: u64,
    /// Messages to send at once.
    pub messages: Vec<Transmit>,
    /// Writes to make durable, in order, after every earlier `Ready`'s writes.
    pub writes: Vec<Write>,
    /// Messages to send only once `writes` (and all earlier writes) are durable.
    pub persisted_messages: Vec<Transmit>,
}

impl Ready {
    /// Whether the driver must call [`EpochNode::advance`] for this `Ready`.
    pub fn needs_advance(&self) -> bool {
        !self.writes.is_empty() || !self.persisted_messages.is_empty()
    }
}

/// Something an operator or the runtime may want to know about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// The node learned a newer epoch.
    Learned { epoch: u64 },
    /// This node's operator change is part of `epoch`.
    ProposalApplied { epoch: u64 },
    /// This node's operator change was given up: another change made it invalid, or it was
    /// overtaken too many times.
    ProposalFailed { error: ProposeError },
}

/// Why an operator change is refused or given up.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProposeError {
    #[error("this node is not a member of the current epoch {epoch}, so it cannot propose")]
    NotMember { epoch: u64 },
    #[error("a change is already in progress on this node; wait for it to finish")]
    Busy,
    #[error(transparent)]
    Change(#[from] ChangeError),
    #[error("other changes overtook this one {0} times; propose it again")]
    Overtaken(u32),
    #[error("this node left the cluster before its change was decided")]
    Removed,
    /// Not the core's: its driver stopped (a failed durable write, a shutdown) before the change
    /// was decided.
    #[error("this node stopped before its change was decided; check the current epoch")]
    Stopped,
    #[error("this node is not among the members it would recover to; recover on one of them")]
    NotRecovered,
    #[error(
        "this node holds a home lease of epoch {epoch} for {} ms more: a majority of its members renewed it within one home lease, so they may still be running. Recovery is for a majority lost for good: propose a change instead, or wait until the lease has run out",
        .left.as_millis()
    )]
    MajorityAlive { epoch: u64, left: Duration },
}

/// How many times a change is re-applied on top of epochs other proposers got chosen first.
const MAX_REBASES: u32 = 3;
/// How many learned epochs a node remembers for activation decisions.
const HISTORY: usize = 8;

/// The home lease this node holds or seeks for its current epoch.
#[derive(Clone, Debug)]
struct Lease {
    epoch: u64,
    /// End of the lease on this node's clock; `None` before the first majority.
    valid_until: Option<Instant>,
    /// Number of the latest request in this run.
    seq: u64,
    /// When the latest request was produced; the lease it earns counts from here.
    sent_at: Instant,
    /// Members that granted the latest request (sorted).
    grants: Vec<NodeId>,
    next_request: Instant,
}

/// This node's proposal in progress.
#[derive(Clone, Debug)]
struct Proposal {
    /// The operator change, or `None` when the node drives a value it accepted to a decision
    /// because its proposer went quiet.
    change: Option<Change>,
    slot: u64,
    proposer: Proposer<EpochRecord>,
    retry_at: Instant,
    rebases: u32,
}

/// The epoch core of one node.
#[derive(Debug)]
pub struct EpochNode {
    config: Config,
    /// What this node has handed out to be persisted (some of it maybe not durable yet).
    durable: Durable,
    /// This run's incarnation.
    incarnation: u64,
    /// Epochs learned in this run, oldest first; the last one is the current epoch.
    history: History,
    lease: Lease,
    proposal: Option<Proposal>,
    /// When to start driving the value this acceptor accepted for the next slot to a decision, if
    /// nobody has decided the slot by then. Accepting a value stops lease renewals of the current
    /// epoch, so a half-done change must not be left alone.
    recover_at: Option<Instant>,
    /// The next activation instant a timer must wake the driver for.
    wake_at_fence: Option<Instant>,
    /// Highest round seen in any ballot, so retries outbid it.
    max_round: u64,
    /// Members of the current epoch not yet known to have learned it (sorted), and when to
    /// announce it to them again. A member that may not know it is one cannot be relied on to ask.
    unaware: Vec<NodeId>,
    announce_at: Instant,
    /// Announcements since the epoch was learned: the interval doubles with each, up to 64 times
    /// `2 · catch_up_interval`, so a node nobody answers keeps asking, slowly.
    announced: u32,
    /// Last catch-up request: which epoch it asked past, and when.
    last_catch_up: Option<(u64, Instant)>,
    /// With the injected bug `stranger_majority` only: later epochs told by nodes the current
    /// epoch does not name, each sender's latest (see [`EpochNode::told_by_majority`]). Emptied
    /// when an epoch is learned.
    told: HashMap<NodeId, EpochRecord>,
    /// Messages to self, handled before control returns to the driver.
    local: VecDeque<Body>,
    /// Replies to self (the own votes and lease grant) produced while a write was pending: like
    /// a remote acceptor's, they count only once this node's writes are durable.
    local_gated: Vec<Body>,
    out: Ready,
    /// Number of the newest `Ready` handed out with writes or persisted messages.
    last_gated: u64,
    /// Every `Ready` up to this number is durable and its messages sent.
    advanced: u64,
    next_ready: u64,
    events: VecDeque<Event>,
    rng: u64,
}

impl EpochNode {
    /// Starts a run from the durable state at `now`: takes the next incarnation (to be durable
    /// before anything is sent) and waits the current epoch's activation wait before acting as home.
    pub fn start(config: Config, durable: Durable, now: Instant) -> EpochNode {
        let incarnation = durable.incarnation + 1;
        let current = durable.current.clone();
        // Never reuse a ballot of an earlier run: this node sent accepts only for ballots it had
        // durably promised itself (its own prepare is handled before any other vote arrives, and
        // every message after a write waits for the write), so rounds above the stored promise
        // are new.
        let stored = &durable.acceptor;
        let max_round =
            stored.promised.iter().chain(stored.accepted.iter().map(|(b, _)| b)).map(|b| b.round).max();
        let mut node = EpochNode {
            rng: config.seed ^ 0x9e37_79b9_7f4a_7c15,
            // Lease requests carry the run's incarnation, so no grant meant for an earlier run
            // can count; their numbers start afresh in every run.
            lease: Lease::new(current.number, now, 0),
            config,
            durable,
            incarnation,
            history: History::default(),
            proposal: None,
            recover_at: None,
            wake_at_fence: None,
            max_round: max_round.unwrap_or(0),
            unaware: Vec::new(),
            announce_at: now,
            announced: 0,
            last_catch_up: None,
            told: HashMap::new(),
            local: VecDeque::new(),
            local_gated: Vec::new(),
            out: Ready::default(),
            last_gated: 0,
            advanced: 0,
            next_ready: 1,
            events: VecDeque::new(),
        };
        if !node.bugs().volatile_incarnation {
            node.write(Write::Incarnation(incarnation));
        }
        // Before a restart this node may have granted delegations under the current epoch, and
        // has forgotten them: it acts as home of no key until they have surely ended, whatever
        // timing a later epoch sets.
        node.remember(&current, now, activation::restart_wait(&current));
        // What this node announced before it stopped is forgotten: announce again to all.
        node.unaware = current.member_ids().filter(|&m| m != node.config.id).collect();
        node.request_lease(now);
        if node.durable.acceptor.accepted.is_some() {
            node.schedule_recovery(now);
        }
        node.drain_local(now);
        node
    }

    // ---- queries ----

    pub fn id(&self) -> NodeId {
        self.config.id
    }

    /// This run's incarnation: larger than every earlier run's, once the start's write is durable.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The newest epoch this node knows.
    pub fn current(&self) -> &EpochRecord {
        &self.durable.current
    }

    /// The digest of the genesis epoch this node belongs to.
    pub fn genesis_digest(&self) -> [u8; 32] {
        self.durable.genesis_digest
    }

    /// The end of the home lease for the current epoch, if this node holds one.
    pub fn lease_until(&self, now: Instant) -> Option<Instant> {
        self.lease.valid_until.filter(|&until| self.lease.epoch == self.current().number && now < until)
    }

    /// Whether this node may act as a home under its current epoch at `now`.
    pub fn holds_lease(&self, now: Instant) -> bool {
        self.lease_until(now).is_some()
    }

    /// Whether the current epoch's activation instant has passed at `now`: from then on every
    /// key this node is the new home of is active whenever it holds a lease, without a handover,
    /// so a handover that arrives later is stale (the home may have granted the key, and dropped
    /// its record, since).
    pub fn activation_passed(&self, now: Instant) -> bool {
        self.history.activation_passed(now)
    }

    /// The home of `key` under the current epoch.
    pub fn home_of(&self, key: &[u8]) -> Option<NodeId> {
        self.history.home_of(key)
    }

    /// The home of `key` under the epoch before the current one, if this run learned that epoch
    /// and still remembers it: the only node a home adopts a handed-over key from.
    pub fn previous_home_of(&self, key: &[u8]) -> Option<NodeId> {
        self.history.previous_home_of(self.current().number, key, self.bugs())
    }

    /// The home of `key` under `epoch`, if this run learned that epoch and still remembers it.
    pub fn home_in(&self, epoch: u64, key: &[u8]) -> Option<NodeId> {
        self.history.home_in(epoch, key)
    }

    /// Whether this node may grant `key` at `now`, for delegations of up to the current epoch's
    /// `max_delegation_lease`: it is the key's home, it holds a home lease, and no node can still
    /// be a granting home of the key under an earlier epoch.
    ///
    /// Across a run of consecutive epochs, newest first, in each of which this node is the key's
    /// home, one valid lease of any of them and one passed activation instant of any of them
    /// suffice: every other node that was ever the key's home was so before that run, and the
    /// passed activation instant means its leases ran out, while no lease of an epoch in the run can
    /// be renewed once the epoch after it is chosen. So a key that keeps its home keeps working
    /// through a change. A lease counts only if its epoch allowed delegations at least as long as
    /// the current epoch does: later activation waits cover a delegation granted under it only
    /// that long (so after a change that lengthens delegations the home waits for a lease of the
    /// new epoch). An epoch this node skipped (it caught up past it) ends the run: the key may have
    /// had another home in it. See [`activation::may_grant`].
    pub fn home_active(&self, now: Instant, key: &[u8]) -> bool {
        self.home_active_digest(now, KeyDigest::of(key))
    }

    /// [`EpochNode::home_active`] for a key hashed beforehand.
    pub fn home_active_digest(&self, now: Instant, key: KeyDigest) -> bool {
        self.history.home_active(self.config.id, self.lease_until(now), now, key, self.bugs())
    }

    /// A snapshot of what the delegation layer reads of this node (see [`crate::view`]).
    pub fn view(&self) -> EpochView {
        EpochView {
            id: self.config.id,
            incarnation: self.incarnation,
            current: self.current().clone(),
            history: self.history.clone(),
            lease: self.current_lease(),
            bugs: self.bugs(),
        }
    }

    /// What a view taken now would hold: take a new one when this changes.
    pub fn view_stamp(&self) -> ViewStamp {
        ViewStamp { epoch: self.current().number, lease: self.current_lease() }
    }

    /// The end of the home lease for the current epoch, if this node gained one (passed or not).
    fn current_lease(&self) -> Option<Instant> {
        self.lease.valid_until.filter(|_| self.lease.epoch == self.current().number)
    }

    /// The earliest instant at which [`EpochNode::handle_timeout`] must be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let mut next = None;
        let mut consider = |t: Instant| next = Some(next.map_or(t, |n: Instant| n.min(t)));
        if self.is_member() {
            consider(self.lease.next_request);
        }
        if !self.unaware.is_empty() {
            consider(self.announce_at);
        }
        if let Some(p) = &self.proposal {
            consider(p.retry_at);
        } else if let Some(at) = self.recover_at {
            consider(at);
        }
        // Activation, so drivers that look only on events see a new home start on time (only a
        // member can become a home).
        if let Some(at) = self.wake_at_fence.filter(|_| self.is_member()) {
            consider(at);
        }
        next
    }

    /// The next event, if any.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    // ---- inputs ----

    /// Handles a message from `from` (authenticated by the driver). A message that fails
    /// [`Message::validate`] is dropped: its numbers could make the core's arithmetic overflow.
    pub fn handle_message(&mut self, now: Instant, from: NodeId, message: Message) {
        if message.validate().is_err() {
            return;
        }
        let epoch = message.epoch;
        self.handle_body(now, from, epoch, message.body);
        // After the body, which may itself have brought the newer epoch.
        if epoch >= self.current().number
            && let Ok(i) = self.unaware.binary_search(&from)
        {
            self.unaware.remove(i);
        }
        self.catch_up_if_behind(now, from, epoch);
        self.drain_local(now);
    }

    /// Handles timer expiry; harmless to call early or often.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.wake_at_fence = self.history.learned.iter().map(|l| l.fence_until).filter(|&at| now < at).min();
        if self.is_member() && now >= self.lease.next_request {
            self.request_lease(now);
        }
        if !self.unaware.is_empty() && now >= self.announce_at {
            self.announce_at = now + self.config.catch_up_interval * (2 << self.announced.min(6));
            self.announced += 1;
            for to in self.unaware.clone() {
                self.send(to, Body::Chosen(self.current().clone()));
            }
        }
        let retry = self.proposal.as_ref().is_some_and(|p| now >= p.retry_at);
        if retry {
            self.retry_proposal(now);
        }
        if self.proposal.is_none() && self.recover_at.is_some_and(|at| now >= at) {
            self.recover_at = None;
            if let Some((_, value)) = self.durable.acceptor.accepted.clone() {
                self.begin_proposal(now, None, value, 0);
            }
        }
        self.drain_local(now);
    }

    /// Starts an operator change on top of the current epoch.
    pub fn propose(&mut self, now: Instant, change: Change) -> Result<(), ProposeError> {
        if !self.is_member() {
            return Err(ProposeError::NotMember { epoch: self.current().number });
        }
        if self.proposal.is_some() {
            return Err(ProposeError::Busy);
        }
        let value = self.next_value(&change, now)?;
        self.begin_proposal(now, Some(change), value, 0);
        self.drain_local(now);
        Ok(())
    }

    /// **Unsafe.** Installs an epoch naming `members` without agreement, for a cluster that lost
    /// a majority of its current members for good, and announces it to them.
    ///
    /// Its number is the current one plus `skip`, so that its fencing tokens exceed those of any
    /// epoch the lost members might have chosen without this node learning it, provided they
    /// went through fewer than `skip` epochs. Its activation wait is the longest any change from
    /// the current epoch would have, so delegations granted under earlier epochs run out before
    /// any home grants under it. What this cannot protect against: a lost member that is in fact
    /// still running (it may keep granting under an epoch only it and others like it know). The
    /// operator must make sure every member left out is stopped for good and never restarted with
    /// its data. Refused while this node holds a home lease ([`ProposeError::MajorityAlive`]): a
    /// majority renewed it within one home lease.
    pub fn recover_unsafe(
        &mut self,
        now: Instant,
        members: Vec<Member>,
        skip: u64,
    ) -> Result<u64, ProposeError> {
        let current = self.current().clone();
        // A skip past the largest epoch number is refused as that number would be (by validate).
        let number = current.number.saturating_add(skip.max(1));
        let mut next = current.clone();
        next.number = number;
        next.retired = current.retired_after(&members);
        next.members = members;
        next.members.sort_by_key(|m| m.id);
        next.activation_wait = activation::next_activation_wait(&current, false);
        next.validate().map_err(|e| ProposeError::Change(ChangeError::Invalid(e)))?;
        if !next.is_member(self.config.id) {
            return Err(ProposeError::NotRecovered);
        }
        if let Some(until) = self.lease_until(now) {
            let left = until.saturating_duration_since(now);
            return Err(ProposeError::MajorityAlive { epoch: current.number, left });
        }
        self.proposal = None;
        self.recover_at = None;
        let announce: Vec<NodeId> = next.member_ids().filter(|&m| m != self.config.id).collect();
        self.learn(now, next, &announce);
        self.drain_local(now);
        Ok(number)
    }

    /// Takes what the core produced since the last call.
    pub fn ready(&mut self) -> Option<Ready> {
        let out = &self.out;
        if out.messages.is_empty() && out.writes.is_empty() && out.persisted_messages.is_empty() {
            return None;
        }
        let mut ready = std::mem::take(&mut self.out);
        ready.number = self.next_ready;
        self.next_ready += 1;
        if ready.needs_advance() {
            self.last_gated = ready.number;
        }
        Some(ready)
    }

    /// The driver made the writes of every `Ready` up to `number` durable and sent their persisted
    /// messages, at `now`. Advancing a `Ready` that needed no advance is harmless.
    pub fn advance(&mut self, now: Instant, number: u64) {
        self.advanced = self.advanced.max(number.min(self.next_ready - 1));
        if !self.writes_pending() {
            self.local.extend(self.local_gated.drain(..));
        }
        self.drain_local(now);
    }

    // ---- message handling ----

    fn handle_body(&mut self, now: Instant, from: NodeId, epoch: u64, body: Body) {
        let current = self.current().number;
        match body {
            Body::Prepare { slot, ballot } => {
                self.max_round = self.max_round.max(ballot.round);
                if slot <= current {
                    self.send(from, Body::Chosen(self.current().clone()));
                } else if self.is_acceptor_for(slot, from) {
                    let (vote, changed) = self.durable.acceptor.on_prepare(ballot);
                    self.persist_acceptor(slot, changed);
                    self.send(from, Body::Vote { slot, vote });
                }
            }
            Body::Accept { slot, ballot, value } => {
                self.max_round = self.max_round.max(ballot.round);
                if slot <= current {
                    self.send(from, Body::Chosen(self.current().clone()));
                } else if value.number == slot && value.validate().is_ok() && self.is_acceptor_for(slot, from)
                {
                    let (vote, changed) = self.durable.acceptor.on_accept(ballot, &value);
                    self.persist_acceptor(slot, changed);
                    if changed {
                        self.schedule_recovery(now);
                    }
                    self.send(from, Body::Vote { slot, vote });
                }
            }
            Body::Vote { slot, vote } => self.handle_vote(now, from, slot, vote),
            Body::Chosen(record) => {
                // A retired node's certificate tells of no epoch (it may be in other hands now);
                // members tell this node what it missed.
                if record.number > current && record.validate().is_ok() && !self.current().is_retired(from) {
                    let believed = !self.bugs().stranger_majority
                        || self.current().is_member(from)
                        || self.told_by_majority(from, &record);
                    if believed {
                        self.learn(now, record, &[]);
                    }
                } else if epoch < current || (epoch == current && record.number == current) {
                    // Already known: say so, which ends the sender's announcements to this node
                    // (and fetches anything newer it has).
                    self.send(from, Body::CatchUp);
                }
            }
            Body::CatchUp => {
                if epoch < current {
                    self.send(from, Body::Chosen(self.current().clone()));
                }
            }
            Body::LeaseRequest { incarnation, seq } => {
                if epoch < current {
                    self.send(from, Body::Chosen(self.current().clone()));
                } else if epoch == current && self.current().is_member(from) && self.grants_lease(epoch) {
                    self.send(from, Body::LeaseGrant { incarnation, seq });
                }
            }
            Body::LeaseGrant { incarnation, seq } => {
                if epoch == self.lease.epoch
                    && epoch == current
                    && incarnation == self.incarnation
                    && self.current().is_member(from)
                {
                    self.count_grant(from, seq);
                }
            }
        }
    }

    fn handle_vote(&mut self, now: Instant, from: NodeId, slot: u64, vote: Vote<EpochRecord>) {
        if let Vote::Reject { promised, .. } = &vote {
            self.max_round = self.max_round.max(promised.round);
        }
        if let Vote::Promise { accepted: Some((_, value)), .. } = &vote
            && (value.number != slot || value.validate().is_err())
        {
            return;
        }
        let Some(p) = self.proposal.as_mut().filter(|p| p.slot == slot) else { return };
        match p.proposer.on_vote(from, vote) {
            Step::Wait => {}
            Step::Accept(value) => {
                let ballot = p.proposer.ballot();
                let acceptors = p.proposer.acceptors().to_vec();
                for to in acceptors {
                    self.send(to, Body::Accept { slot, ballot, value: value.clone() });
                }
            }
            Step::Chosen(value) => {
                let mut to: Vec<NodeId> = self.current().member_ids().chain(value.member_ids()).collect();
                to.sort();
                to.dedup();
                self.learn(now, value, &to);
            }
            // Retry soon, with a ballot above the one that beat this round.
            Step::Outbid(_) => p.retry_at = p.retry_at.min(now + self.config.round_timeout / 4),
        }
    }

    /// Whether this node is an acceptor for `slot` and `from` may propose in it.
    fn is_acceptor_for(&self, slot: u64, from: NodeId) -> bool {
        let current = self.current();
        slot == current.number + 1 && current.is_member(self.config.id) && current.is_member(from)
    }

    /// Whether this node, as an acceptor of `epoch + 1`, may renew home leases of `epoch`.
    fn grants_lease(&self, epoch: u64) -> bool {
        let current = self.current();
        epoch == current.number
            && current.is_member(self.config.id)
            && (self.durable.acceptor.accepted.is_none() || self.bugs().renew_after_accept)
    }

    fn catch_up_if_behind(&mut self, now: Instant, from: NodeId, their_epoch: u64) {
        if their_epoch <= self.current().number {
            return;
        }
        let recent = self
            .last_catch_up
            .is_some_and(|(asked, at)| asked >= their_epoch && now < at + self.config.catch_up_interval);
        if !recent {
            self.last_catch_up = Some((their_epoch, now));
            self.send(from, Body::CatchUp);
        }
    }

    // ---- learning and activation ----

    /// The injected bug `stranger_majority`: whether `record` (later than the current epoch,
    /// valid), now told by `from`, a node the current epoch does not name, names this node and
    /// `from` and has been told by a majority of its own members (this node not counted).
    fn told_by_majority(&mut self, from: NodeId, record: &EpochRecord) -> bool {
        let me = self.config.id;
        if from == me || !record.is_member(me) || !record.is_member(from) {
            return false;
        }
        self.told.insert(from, record.clone());
        let tellers = self.told.values().filter(|told| *told == record).count();
        tellers > record.members.len() / 2
    }

    /// Adopts a chosen epoch newer than the current one, and broadcasts it to `announce` first:
    /// the broadcast carries the new epoch (telling every receiver this node knows it) and leaves
    /// before this node's lease requests under it.
    fn learn(&mut self, now: Instant, record: EpochRecord, announce: &[NodeId]) {
        self.told.clear();
        if !self.bugs().no_epoch_floor {
            self.write(Write::Epoch(record.clone()));
        }
        self.durable.apply(&Write::Epoch(record.clone()));
        let number = record.number;
        self.events.push_back(Event::Learned { epoch: number });
        if let Some(previous) = self.history.learned.back_mut() {
            previous.lease_until = self.lease.valid_until;
        }
        self.remember(&record, now, record.activation_wait);
        for &peer in announce {
            self.send(peer, Body::Chosen(record.clone()));
        }
        self.unaware = record.member_ids().filter(|&m| m != self.config.id).collect();
        self.announce_at = now + self.config.catch_up_interval * 2;
        self.announced = 0;
        self.lease = Lease::new(number, now, self.lease.seq);
        self.request_lease(now);
        self.settle_proposal(now);
    }

    /// Adds `record`, learned (or restarted with) at `now`, to the history; its activation instant
    /// is `now + wait`.
    fn remember(&mut self, record: &EpochRecord, now: Instant, wait: Duration) {
        let wait = if self.bugs().skip_activation_wait { Duration::ZERO } else { wait };
        let ring = record.ring();
        if self.history.learned.len() == HISTORY {
            self.history.learned.pop_front();
        }
        let fence_until = now + wait;
        if wait > Duration::ZERO {
            self.wake_at_fence = Some(self.wake_at_fence.map_or(fence_until, |at| at.min(fence_until)));
        }
        self.history.learned.push_back(Learned {
            number: record.number,
            ring,
            max_delegation_lease: record.timing.max_delegation_lease,
            fence_until,
            lease_until: None,
        });
    }

    // ---- home lease ----

    fn is_member(&self) -> bool {
        self.current().is_member(self.config.id)
    }

    /// Sends a new lease request to every member, itself included.
    fn request_lease(&mut self, now: Instant) {
        if !self.is_member() {
            return;
        }
        let renew_every = self.current().timing.home_lease / 4;
        let lease = &mut self.lease;
        lease.seq += 1;
        lease.sent_at = now;
        lease.grants.clear();
        lease.next_request = now + renew_every;
        let (incarnation, seq) = (self.incarnation, lease.seq);
        let members: Vec<NodeId> = self.current().member_ids().collect();
        for to in members {
            self.send(to, Body::LeaseRequest { incarnation, seq });
        }
    }

    fn count_grant(&mut self, from: NodeId, seq: u64) {
        let majority = self.current().majority();
        let home_lease = self.current().timing.home_lease;
        let lease = &mut self.lease;
        if seq != lease.seq {
            return;
        }
        if let Err(i) = lease.grants.binary_search(&from) {
            lease.grants.insert(i, from);
        }
        if lease.grants.len() >= majority {
            let until = lease.sent_at + home_lease;
            lease.valid_until = Some(lease.valid_until.map_or(until, |u| u.max(until)));
        }
    }

    // ---- proposals ----

    /// The record that `change` makes of the current epoch, with its activation wait.
    fn next_value(&self, change: &Change, now: Instant) -> Result<EpochRecord, ChangeError> {
        let current = self.current();
        let mut next = change.apply(current)?;
        // Leases of earlier epochs may still run if this node's own wait for them has not ended.
        let fence_passed = self.history.learned.back().is_some_and(|learned| now >= learned.fence_until);
        next.activation_wait = activation::next_activation_wait(current, fence_passed);
        Ok(next)
    }

    /// Arms the recovery of an accepted value: a few rounds from now, spread by jitter.
    fn schedule_recovery(&mut self, now: Instant) {
        let jitter = self.jitter();
        self.recover_at = Some(now + self.config.round_timeout * 3 + jitter);
    }

    fn begin_proposal(&mut self, now: Instant, change: Option<Change>, value: EpochRecord, rebases: u32) {
        let slot = value.number;
        self.proposal = Some(Proposal {
            change,
            slot,
            // The ballot is set by the first round, below.
            proposer: Proposer::new(
                Ballot { round: 0, proposer: self.config.id },
                value,
                self.current().member_ids(),
            ),
            retry_at: now,
            rebases,
        });
        self.retry_proposal(now);
    }

    fn next_ballot(&mut self) -> Ballot {
        self.max_round += 1;
        Ballot { round: self.max_round, proposer: self.config.id }
    }

    /// Starts the next round of the proposal (the first one too).
    fn retry_proposal(&mut self, now: Instant) {
        let ballot = self.next_ballot();
        let jitter = self.jitter();
        let Some(p) = self.proposal.as_mut() else { return };
        let value = p.proposer.own_value().clone();
        p.proposer = Proposer::new(ballot, value, p.proposer.acceptors().to_vec());
        p.retry_at = now + self.config.round_timeout + jitter;
        let slot = p.slot;
        for to in p.proposer.acceptors().to_vec() {
            self.send(to, Body::Prepare { slot, ballot });
        }
    }

    /// A random share of one round timeout, to break duels between proposers.
    fn jitter(&mut self) -> Duration {
        // splitmix64
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let span = u64::try_from(self.config.round_timeout.as_nanos()).unwrap_or(u64::MAX).max(1);
        Duration::from_nanos(z % span)
    }

    /// After learning an epoch: finish, re-apply or give up this node's change.
    fn settle_proposal(&mut self, now: Instant) {
        let current = self.current().number;
        self.recover_at = None;
        let Some(p) = self.proposal.take_if(|p| p.slot <= current) else { return };
        let Some(change) = p.change else { return };
        if change.is_reflected_in(self.current()) {
            let epoch = self.current().number;
            self.events.push_back(Event::ProposalApplied { epoch });
            return;
        }
        let outcome = if !self.is_member() {
            Err(ProposeError::Removed)
        } else if p.rebases >= MAX_REBASES {
            Err(ProposeError::Overtaken(p.rebases))
        } else {
            self.next_value(&change, now).map_err(ProposeError::from)
        };
        match outcome {
            Ok(value) => self.begin_proposal(now, Some(change), value, p.rebases + 1),
            Err(error) => self.events.push_back(Event::ProposalFailed { error }),
        }
    }

    // ---- output ----

    fn bugs(&self) -> Bugs {
        #[cfg(feature = "bug-injection")]
        return self.config.bugs;
        #[cfg(not(feature = "bug-injection"))]
        Bugs::default()
    }

    fn persist_acceptor(&mut self, slot: u64, changed: bool) {
        if changed && !self.bugs().amnesiac_acceptor {
            self.write(Write::Acceptor { slot, state: self.durable.acceptor.clone() });
        }
    }

    /// Whether some write handed out, or about to be, is not yet durable.
    fn writes_pending(&self) -> bool {
        self.advanced < self.last_gated || !self.out.writes.is_empty()
    }

    fn write(&mut self, write: Write) {
        self.out.writes.push(write);
    }

    fn send(&mut self, to: NodeId, body: Body) {
        if to == self.config.id {
            // Requests to self are handled at once, so the own promise and acceptance are written
            // before anything that depends on them can leave: an accept for a ballot leaves only
            // after this node's own promise of it is durable, which is what keeps a restarted
            // proposer from reusing a ballot. Replies wait for durability, like remote ones.
            let reply = matches!(body, Body::Vote { .. } | Body::LeaseGrant { .. });
            if reply && self.writes_pending() {
                self.local_gated.push(body);
            } else {
                self.local.push_back(body);
            }
            return;
        }
        let message = Message { epoch: self.current().number, body };
        let transmit = Transmit { to, message };
        if self.writes_pending() {
            self.out.persisted_messages.push(transmit);
        } else {
            self.out.messages.push(transmit);
        }
    }

    fn drain_local(&mut self, now: Instant) {
        while let Some(body) = self.local.pop_front() {
            let epoch = self.current().number;
            self.handle_body(now, self.config.id, epoch, body);
        }
    }
}

impl Lease {
    /// A lease for `epoch` whose requests are numbered after `seq`.
    fn new(epoch: u64, now: Instant, seq: u64) -> Lease {
        Lease { epoch, valid_until: None, seq, sent_at: now, grants: Vec::new(), next_request: now }
    }
}
