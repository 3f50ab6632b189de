//! A deterministic in-process harness for the epoch core, in the style of raft-rs's test cluster.
//!
//! - Nodes are numbered `u64`s ([`NodeId`]`(n)`), all built from one genesis; some may be "extra"
//!   nodes that start from the same genesis without being members of it (to be added later).
//! - One simulated clock, [`Cluster::now`], shared by every node.
//! - One FIFO network queue that the test drives explicitly: deliver everything, one round, only
//!   the messages a predicate picks, or drop them; links can be blocked and kinds of messages muted
//!   (such messages are dropped when they come up for delivery).
//! - Per node a `MemStorage`-like [`Durable`]. In the default mode the harness drains every
//!   [`Ready`] right after each input: it sends `messages`, applies `writes` (durable at once),
//!   sends `persisted_messages` and calls [`EpochNode::advance`]. A node can be switched to manual
//!   persistence, where `messages` still leave at once but writes, persisted messages and the
//!   `advance` wait for [`Cluster::persist`].
//! - Crash drops the [`EpochNode`], keeps its durable state, discards its undelivered outgoing
//!   messages and its writes not yet persisted; messages addressed to it stay queued (a peer may
//!   still answer, e.g. after its own fsync) and are dropped only if they arrive while it is down.
//!   Restart runs [`EpochNode::start`] from the durable state.
//! - Everything sent and written is logged, so tests count messages and writes exactly.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use keyhome_epoch::paxos::Vote;
use keyhome_epoch::{
    Body, Change, Config, Durable, EpochNode, EpochRecord, Event, Instant, Member, Message, NodeId,
    ProposeError, Ready, Timing, Write,
};

/// Most deliveries one `deliver_*` call may make before the harness calls it a message storm.
const DELIVERY_LIMIT: usize = 1_000_000;
/// Most timer firings at one instant before the harness calls it a timer spin.
const SPIN_LIMIT: usize = 1_000;

pub fn nid(n: u64) -> NodeId {
    NodeId(n)
}

/// The member record the harness uses for node `n`.
pub fn member(n: u64) -> Member {
    Member { id: NodeId(n), addr: format!("10.0.0.{n}:7100") }
}

pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

pub fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// The instant `d` after the clock's origin.
pub fn at(d: Duration) -> Instant {
    Instant::ZERO + d
}

/// The first key `key-<i>` that `want` accepts.
pub fn find_key(mut want: impl FnMut(&[u8]) -> bool) -> Vec<u8> {
    (0..1_000_000u32)
        .map(|i| format!("key-{i}").into_bytes())
        .find(|k| want(k))
        .expect("no key satisfies the condition")
}

/// Up to `count` keys `key-<i>` that `want` accepts.
pub fn find_keys(count: usize, mut want: impl FnMut(&[u8]) -> bool) -> Vec<Vec<u8>> {
    (0..1_000_000u32).map(|i| format!("key-{i}").into_bytes()).filter(|k| want(k)).take(count).collect()
}

/// The home of `key` in `record`.
pub fn home(record: &EpochRecord, key: &[u8]) -> u64 {
    record.ring().home(key).expect("an epoch has members").0
}

/// What kind of message a [`Body`] is, for counting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Prepare,
    Accept,
    Promise,
    Accepted,
    Reject,
    Chosen,
    CatchUp,
    LeaseRequest,
    LeaseGrant,
}

impl Kind {
    pub fn of(body: &Body) -> Kind {
        match body {
            Body::Prepare { .. } => Kind::Prepare,
            Body::Accept { .. } => Kind::Accept,
            Body::Vote { vote: Vote::Promise { .. }, .. } => Kind::Promise,
            Body::Vote { vote: Vote::Accepted { .. }, .. } => Kind::Accepted,
            Body::Vote { vote: Vote::Reject { .. }, .. } => Kind::Reject,
            Body::Chosen(_) => Kind::Chosen,
            Body::CatchUp => Kind::CatchUp,
            Body::LeaseRequest { .. } => Kind::LeaseRequest,
            Body::LeaseGrant { .. } => Kind::LeaseGrant,
        }
    }

    /// Home-lease traffic.
    pub fn is_lease(self) -> bool {
        matches!(self, Kind::LeaseRequest | Kind::LeaseGrant)
    }
}

/// One message on the simulated network.
#[derive(Clone, Debug)]
pub struct Envelope {
    /// Position in the global send order.
    pub seq: u64,
    /// When it was sent.
    pub at: Instant,
    pub from: u64,
    pub to: u64,
    pub message: Message,
}

impl Envelope {
    pub fn kind(&self) -> Kind {
        Kind::of(&self.message.body)
    }

    pub fn is(&self, from: u64, to: u64, kind: Kind) -> bool {
        self.from == from && self.to == to && self.kind() == kind
    }
}

/// What one `Ready` held, as the harness saw it.
#[derive(Clone, Debug)]
pub struct ReadyShape {
    pub number: u64,
    pub messages: usize,
    pub writes: Vec<Write>,
    pub persisted_messages: usize,
}

/// One node: its core while it runs, its durable state, and logs.
pub struct Host {
    pub config: Config,
    pub node: Option<EpochNode>,
    /// The durable state, as a `MemStorage` would hold it.
    pub durable: Durable,
    /// Every write made durable, with the instant it was applied.
    pub writes: Vec<(Instant, Write)>,
    /// Every event polled, with the instant it was polled.
    pub events: Vec<(Instant, Event)>,
    /// The `Ready`s of the current run, in order.
    pub readies: Vec<ReadyShape>,
    /// How many runs were started (the first start included).
    pub runs: u32,
    /// `handle_timeout` calls made by the harness.
    pub timeouts: u64,
    /// Whether writes wait for [`Cluster::persist`].
    pub manual: bool,
    /// `Ready`s whose writes are not durable yet (manual persistence only).
    pending: VecDeque<Ready>,
}

impl Host {
    fn node(&self) -> &EpochNode {
        self.node.as_ref().expect("node is down")
    }
}

/// A cluster of epoch cores on a simulated network and clock.
pub struct Cluster {
    pub now: Instant,
    pub genesis: EpochRecord,
    hosts: BTreeMap<u64, Host>,
    queue: VecDeque<Envelope>,
    /// Directed links whose messages are dropped.
    blocked: BTreeSet<(u64, u64)>,
    /// Kinds of messages that are dropped on every link.
    muted: BTreeSet<Kind>,
    /// Every message sent, in order.
    pub sent: Vec<Envelope>,
    /// Every message dropped (blocked link, crashed sender or receiver, or by the test).
    pub dropped: Vec<Envelope>,
    /// Number of messages handed to a node.
    pub delivered: u64,
    /// Timer spins seen: `(node, t, poll_timeout())` where `handle_timeout(t)` left
    /// `poll_timeout() <= t`.
    pub spins: Vec<(u64, Instant, Instant)>,
    next_seq: u64,
}

impl Cluster {
    /// A cluster of `members` with the default timing, all started at time zero, nothing delivered.
    pub fn new(members: &[u64]) -> Cluster {
        Cluster::build(members, &[], Timing::DEFAULT)
    }

    /// Like [`Cluster::new`], plus `extra` nodes that start from the same genesis without being
    /// members of it.
    pub fn with_extra(members: &[u64], extra: &[u64]) -> Cluster {
        Cluster::build(members, extra, Timing::DEFAULT)
    }

    pub fn build(members: &[u64], extra: &[u64], timing: Timing) -> Cluster {
        let mut c = Cluster::unstarted(members, extra, timing);
        for id in c.ids() {
            c.start(id);
        }
        c
    }

    /// Hosts with their genesis durable state, none of them started.
    pub fn unstarted(members: &[u64], extra: &[u64], timing: Timing) -> Cluster {
        let genesis = EpochRecord::genesis(members.iter().map(|&n| member(n)).collect(), timing)
            .expect("valid genesis");
        let hosts = members
            .iter()
            .chain(extra)
            .map(|&n| {
                let host = Host {
                    config: Config::new(NodeId(n), 0x5eed_0000 + n),
                    node: None,
                    durable: Durable::genesis(genesis.clone()),
                    writes: Vec::new(),
                    events: Vec::new(),
                    readies: Vec::new(),
                    runs: 0,
                    timeouts: 0,
                    manual: false,
                    pending: VecDeque::new(),
                };
                (n, host)
            })
            .collect();
        Cluster {
            now: Instant::ZERO,
            genesis,
            hosts,
            queue: VecDeque::new(),
            blocked: BTreeSet::new(),
            muted: BTreeSet::new(),
            sent: Vec::new(),
            dropped: Vec::new(),
            delivered: 0,
            spins: Vec::new(),
            next_seq: 0,
        }
    }

    // ---- access ----

    pub fn ids(&self) -> Vec<u64> {
        self.hosts.keys().copied().collect()
    }

    pub fn host(&self, id: u64) -> &Host {
        &self.hosts[&id]
    }

    pub fn host_mut(&mut self, id: u64) -> &mut Host {
        self.hosts.get_mut(&id).expect("unknown node")
    }

    pub fn node(&self, id: u64) -> &EpochNode {
        self.host(id).node()
    }

    pub fn is_up(&self, id: u64) -> bool {
        self.hosts.get(&id).is_some_and(|h| h.node.is_some())
    }

    /// The current epoch number of a running node.
    pub fn epoch(&self, id: u64) -> u64 {
        self.node(id).current().number
    }

    /// The events `id` emitted, oldest first.
    pub fn events(&self, id: u64) -> Vec<Event> {
        self.host(id).events.iter().map(|(_, e)| e.clone()).collect()
    }

    /// The writes `id` made durable, oldest first.
    pub fn writes(&self, id: u64) -> Vec<Write> {
        self.host(id).writes.iter().map(|(_, w)| w.clone()).collect()
    }

    /// A mark in the send log, for counting what is sent after it.
    pub fn mark(&self) -> usize {
        self.sent.len()
    }

    /// Messages sent since `mark` that `pred` accepts.
    pub fn sent_since(&self, mark: usize, pred: impl Fn(&Envelope) -> bool) -> Vec<Envelope> {
        self.sent[mark..].iter().filter(|e| pred(e)).cloned().collect()
    }

    /// How many messages of `kind` `from` sent since `mark`.
    pub fn count_sent(&self, mark: usize, from: u64, kind: Kind) -> usize {
        self.sent[mark..].iter().filter(|e| e.from == from && e.kind() == kind).count()
    }

    /// Messages waiting for delivery, in FIFO order.
    pub fn queued(&self) -> impl Iterator<Item = &Envelope> {
        self.queue.iter()
    }

    // ---- inputs ----

    /// Starts (or restarts) `id` from its durable state at the current time.
    pub fn start(&mut self, id: u64) {
        let now = self.now;
        let host = self.host_mut(id);
        assert!(host.node.is_none(), "node {id} is already running");
        host.node = Some(EpochNode::start(host.config.clone(), host.durable.clone(), now));
        host.runs += 1;
        host.readies.clear();
        self.pump(id);
    }

    /// Crashes `id`: the core is dropped with its undelivered outgoing messages and the writes it
    /// had not made durable yet; the durable state stays.
    pub fn crash(&mut self, id: u64) {
        let host = self.host_mut(id);
        assert!(host.node.take().is_some(), "node {id} is already down");
        host.pending.clear();
        let (lost, kept): (VecDeque<_>, VecDeque<_>) =
            std::mem::take(&mut self.queue).into_iter().partition(|e| e.from == id);
        self.queue = kept;
        self.dropped.extend(lost);
    }

    pub fn restart(&mut self, id: u64) {
        self.start(id);
    }

    pub fn propose(&mut self, id: u64, change: Change) -> Result<(), ProposeError> {
        let now = self.now;
        let result = self.node_mut(id).propose(now, change);
        self.pump(id);
        result
    }

    pub fn recover_unsafe(&mut self, id: u64, members: &[u64], skip: u64) -> Result<u64, ProposeError> {
        let now = self.now;
        let members = members.iter().map(|&m| member(m)).collect();
        let result = self.node_mut(id).recover_unsafe(now, members, skip);
        self.pump(id);
        result
    }

    /// Hands `message` from `from` to `to` at once, bypassing the queue and blocked links.
    pub fn handle(&mut self, from: u64, to: u64, message: Message) {
        let now = self.now;
        self.node_mut(to).handle_message(now, NodeId(from), message);
        self.delivered += 1;
        self.pump(to);
    }

    /// Puts a forged message on the network, as if `from` had sent it.
    pub fn inject(&mut self, from: u64, to: u64, message: Message) {
        self.enqueue(from, to, message);
    }

    /// Calls `handle_timeout(now)` on `id` unconditionally.
    pub fn timeout(&mut self, id: u64) {
        let now = self.now;
        self.node_mut(id).handle_timeout(now);
        self.host_mut(id).timeouts += 1;
        self.pump(id);
    }

    // ---- persistence ----

    /// Switches `id` between immediate (default) and manual persistence.
    pub fn set_manual_persistence(&mut self, id: u64, manual: bool) {
        self.host_mut(id).manual = manual;
        if !manual {
            self.persist(id);
        }
    }

    /// Makes every pending write of `id` durable, in order; sends the persisted messages and calls
    /// `advance` for each `Ready`.
    pub fn persist(&mut self, id: u64) {
        while let Some(ready) = self.host_mut(id).pending.pop_front() {
            self.complete(id, ready);
        }
        if self.is_up(id) {
            self.pump(id);
        }
    }

    /// Whether `id` has writes that are not durable yet.
    pub fn has_pending(&self, id: u64) -> bool {
        !self.host(id).pending.is_empty()
    }

    // ---- network ----

    /// Blocks both directions between `a` and `b`.
    pub fn block(&mut self, a: u64, b: u64) {
        self.blocked.insert((a, b));
        self.blocked.insert((b, a));
    }

    /// Blocks every link to and from `id`.
    pub fn isolate(&mut self, id: u64) {
        for other in self.ids() {
            if other != id {
                self.block(id, other);
            }
        }
    }

    /// Drops every message of these kinds on every link, until [`Cluster::heal`].
    pub fn mute(&mut self, kinds: &[Kind]) {
        self.muted.extend(kinds);
    }

    /// Unblocks every link and unmutes every kind.
    pub fn heal(&mut self) {
        self.blocked.clear();
        self.muted.clear();
    }

    /// Delivers the first queued message `pred` accepts; returns it.
    pub fn deliver_next_where(&mut self, pred: impl Fn(&Envelope) -> bool) -> Option<Envelope> {
        let i = self.queue.iter().position(pred)?;
        let envelope = self.queue.remove(i).expect("position is in range");
        self.deliver(envelope.clone());
        Some(envelope)
    }

    /// Delivers, in FIFO order, every queued message `pred` accepts, including ones sent meanwhile;
    /// leaves the others queued. Returns how many were taken off the queue.
    pub fn deliver_where(&mut self, pred: impl Fn(&Envelope) -> bool) -> usize {
        let mut n = 0;
        while self.deliver_next_where(&pred).is_some() {
            n += 1;
            assert!(n < DELIVERY_LIMIT, "message storm");
        }
        n
    }

    /// Delivers everything until the network is quiet.
    pub fn deliver_all(&mut self) -> usize {
        self.deliver_where(|_| true)
    }

    /// Delivers the messages queued now (one network hop), not the ones they cause.
    pub fn deliver_round(&mut self) -> usize {
        let limit = self.next_seq;
        self.deliver_where(|e| e.seq < limit)
    }

    /// Removes every queued message `pred` accepts; returns how many.
    pub fn drop_where(&mut self, pred: impl Fn(&Envelope) -> bool) -> usize {
        let (lost, kept): (VecDeque<_>, VecDeque<_>) =
            std::mem::take(&mut self.queue).into_iter().partition(|e| pred(e));
        self.queue = kept;
        let n = lost.len();
        self.dropped.extend(lost);
        n
    }

    // ---- time ----

    /// The earliest timer of any running node.
    pub fn next_timer(&self) -> Option<Instant> {
        self.hosts.values().filter_map(|h| h.node.as_ref()?.poll_timeout()).min()
    }

    /// Runs timers and delivers every message (zero latency) until `t`; the clock ends at `t`.
    pub fn run_until(&mut self, t: Instant) {
        self.advance_time(t, true);
    }

    pub fn run_for(&mut self, d: Duration) {
        self.run_until(self.now + d);
    }

    /// Runs timers until `t` without delivering anything.
    pub fn tick_until(&mut self, t: Instant) {
        self.advance_time(t, false);
    }

    fn advance_time(&mut self, t: Instant, deliver: bool) {
        assert!(t >= self.now, "time runs forward");
        if deliver {
            self.deliver_all();
        }
        let mut same_instant = 0;
        while let Some(next) = self.next_timer().filter(|&n| n <= t) {
            if next <= self.now {
                same_instant += 1;
                assert!(same_instant < SPIN_LIMIT, "timer spin at {:?}: {:?}", self.now, self.spins);
            } else {
                same_instant = 0;
                self.now = next;
            }
            self.fire_due();
            if deliver {
                self.deliver_all();
            }
        }
        self.now = t;
    }

    /// Calls `handle_timeout(now)` on every running node whose timer is due, and records spins.
    fn fire_due(&mut self) {
        let now = self.now;
        for id in self.ids() {
            let Some(node) = self.hosts.get_mut(&id).and_then(|h| h.node.as_mut()) else { continue };
            if node.poll_timeout().is_none_or(|due| due > now) {
                continue;
            }
            node.handle_timeout(now);
            if let Some(after) = node.poll_timeout().filter(|&after| after <= now) {
                self.spins.push((id, now, after));
            }
            self.host_mut(id).timeouts += 1;
            self.pump(id);
        }
    }

    // ---- checks ----

    /// Every epoch number was learned (written) with one record by every node; returns the records
    /// by number.
    pub fn assert_agreement(&self) -> BTreeMap<u64, EpochRecord> {
        let mut chosen = BTreeMap::from([(1, self.genesis.clone())]);
        for (id, host) in &self.hosts {
            let learned = host.writes.iter().filter_map(|(_, w)| match w {
                Write::Epoch(r) => Some(r.clone()),
                _ => None,
            });
            let running = host.node.as_ref().map(|n| n.current().clone());
            for record in learned.chain(running) {
                let previous = chosen.entry(record.number).or_insert_with(|| record.clone());
                assert_eq!(*previous, record, "node {id} learned a different epoch {}", record.number);
            }
        }
        chosen
    }

    /// The running nodes that may act as home of `key` now.
    pub fn active_homes(&self, key: &[u8]) -> Vec<u64> {
        self.hosts
            .iter()
            .filter(|(_, h)| h.node.as_ref().is_some_and(|n| n.home_active(self.now, key)))
            .map(|(&id, _)| id)
            .collect()
    }

    /// When `id` emitted `event` first.
    pub fn event_time(&self, id: u64, event: &Event) -> Option<Instant> {
        self.host(id).events.iter().find(|(_, e)| e == event).map(|(t, _)| *t)
    }

    // ---- internals ----

    fn node_mut(&mut self, id: u64) -> &mut EpochNode {
        self.host_mut(id).node.as_mut().expect("node is down")
    }

    fn enqueue(&mut self, from: u64, to: u64, message: Message) {
        // Every test checks this: an accept for a ballot leaves a proposer only after its own
        // promise of that ballot (or a higher one) is durable, so no restart can reuse the ballot.
        if let Body::Accept { ballot, .. } = &message.body {
            let promised = self.host(from).durable.acceptor.promised;
            assert!(
                promised >= Some(*ballot),
                "node {from} sent an accept at {ballot:?} with only {promised:?} durably promised"
            );
        }
        let envelope = Envelope { seq: self.next_seq, at: self.now, from, to, message };
        self.next_seq += 1;
        self.sent.push(envelope.clone());
        self.queue.push_back(envelope);
    }

    fn deliver(&mut self, envelope: Envelope) {
        if self.blocked.contains(&(envelope.from, envelope.to))
            || self.muted.contains(&envelope.kind())
            || !self.is_up(envelope.to)
        {
            self.dropped.push(envelope);
            return;
        }
        self.handle(envelope.from, envelope.to, envelope.message);
    }

    /// Drains every `Ready` and event of `id`.
    fn pump(&mut self, id: u64) {
        let now = self.now;
        loop {
            let host = self.host_mut(id);
            let node = host.node.as_mut().expect("node is down");
            while let Some(event) = node.poll_event() {
                host.events.push((now, event));
            }
            let Some(mut ready) = node.ready() else { break };
            host.readies.push(ReadyShape {
                number: ready.number,
                messages: ready.messages.len(),
                writes: ready.writes.clone(),
                persisted_messages: ready.persisted_messages.len(),
            });
            for t in std::mem::take(&mut ready.messages) {
                self.enqueue(id, t.to.0, t.message);
            }
            let host = self.host_mut(id);
            if host.manual || !host.pending.is_empty() {
                host.pending.push_back(ready);
            } else {
                self.complete(id, ready);
            }
        }
    }

    /// Makes `ready`'s writes durable, sends its persisted messages and advances the node.
    fn complete(&mut self, id: u64, ready: Ready) {
        let now = self.now;
        let host = self.host_mut(id);
        for w in &ready.writes {
            host.durable.apply(w);
            host.writes.push((now, w.clone()));
        }
        for t in ready.persisted_messages.iter() {
            self.enqueue(id, t.to.0, t.message.clone());
        }
        if ready.needs_advance() {
            self.node_mut(id).advance(now, ready.number);
        }
    }
}
