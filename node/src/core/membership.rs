//! [`Membership`]: the epoch core of one node and what surrounds it (persistence gating,
//! operator proposals, the peers it knows), and the [`EpochView`] it publishes to the key
//! shards.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use keyhome_epoch::{
    Change, EpochNode, EpochView, Event as EpochEvent, Instant, Member, Message as EpochMessage, NodeId,
    ProposeError, Ready, ViewStamp, Write,
};

use super::monotonic::Monotonic;
use super::outbox::Outbox;
use super::{MAX_PERSIST_BACKLOG, MAX_TIMER_ROUNDS, Output, PeerMessage};
use crate::activity::{EpochChange, EpochLog};

/// A new view for every shard, whether it comes with a new epoch (the shards then walk their
/// keys through the change), and whether that epoch is durable yet (until it is, the shards hold
/// their messages for other nodes).
pub(super) struct Published {
    pub view: Arc<EpochView>,
    pub new_epoch: bool,
    pub durable: bool,
}

/// See the module docs.
pub(super) struct Membership {
    pub epoch: EpochNode,
    /// Every node named by an epoch this run learned: peers we accept connections from.
    known: HashSet<NodeId>,
    /// The last address an epoch this run learned gave each node, so that a node removed from the
    /// current epoch can still be told about it (and have its handovers acknowledged).
    addrs: HashMap<NodeId, String>,
    /// Messages of epoch `Ready`s, by `Ready` number, waiting for their writes to be durable.
    gated: VecDeque<(u64, Vec<(NodeId, EpochMessage)>)>,
    /// An operator change is in progress on this node.
    proposing: bool,
    pub epochs: EpochLog,
    pub out: Outbox,
    /// The latest clock reading the membership acted on (the [`Core`](super::Core) brings every
    /// reading up to it before the membership uses it).
    pub clock: Monotonic,
    /// What the shards' view holds.
    published: ViewStamp,
    /// A new epoch was learned since the last view was published.
    learned: bool,
    /// The `Ready` that writes the newest epoch learned, until it is durable.
    epoch_unsaved: Option<u64>,
    /// Whether the last view published was of a durable epoch.
    published_durable: bool,
}

impl Membership {
    pub fn new(epoch: EpochNode, now: Instant) -> Membership {
        let known = epoch.current().member_ids().collect();
        let addrs = epoch.current().members.iter().map(|m| (m.id, m.addr.clone())).collect();
        let published = epoch.view_stamp();
        let mut membership = Membership {
            epoch,
            known,
            addrs,
            gated: VecDeque::new(),
            proposing: false,
            epochs: EpochLog::default(),
            out: Outbox::default(),
            clock: Monotonic::new(now),
            published,
            learned: false,
            epoch_unsaved: None,
            published_durable: true,
        };
        let current = membership.epoch.current();
        let (number, members) = (current.number, current.member_ids().collect());
        membership.out.push(Output::EpochLearned { epoch: number, members });
        membership.log_epoch(now);
        membership.settle(now);
        membership
    }

    // ---- inputs ----

    /// An epoch message from `from`.
    pub fn handle_message(&mut self, now: Instant, from: NodeId, message: EpochMessage) {
        if self.gated.len() >= MAX_PERSIST_BACKLOG {
            // The disk is behind: the sender resends what matters.
            self.out.counters.peer_dropped += 1;
            return;
        }
        self.epoch.handle_message(now, from, message);
        self.settle(now);
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        self.settle(now);
    }

    pub fn persisted(&mut self, now: Instant, number: u64) {
        if self.out.failed() {
            return;
        }
        while self.gated.front().is_some_and(|(n, _)| *n <= number) {
            let (_, messages) = self.gated.pop_front().expect("front checked");
            for (to, message) in messages {
                self.out.send(to, PeerMessage::Epoch(message));
            }
        }
        if self.epoch_unsaved.is_some_and(|n| n <= number) {
            self.epoch_unsaved = None;
        }
        self.epoch.advance(now, number);
        self.settle(now);
    }

    pub fn fail(&mut self) {
        self.out.fail();
        self.gated.clear();
    }

    pub fn propose(&mut self, now: Instant, change: Change) -> Result<(), ProposeError> {
        self.epoch.propose(now, change)?;
        self.proposing = true;
        self.settle(now);
        Ok(())
    }

    pub fn recover_unsafe(
        &mut self,
        now: Instant,
        members: Vec<Member>,
        skip: u64,
    ) -> Result<u64, ProposeError> {
        let number = self.epoch.recover_unsafe(now, members, skip)?;
        if std::mem::take(&mut self.proposing) {
            self.out.push(Output::ProposalDone { result: Err(ProposeError::Overtaken(0)) });
        }
        self.settle(now);
        Ok(number)
    }

    /// The view the shards must take, if it changed since the last one: a new epoch, or a home
    /// lease gained, renewed or lost.
    pub fn publish(&mut self) -> Option<Published> {
        let stamp = self.epoch.view_stamp();
        let durable = self.epoch_unsaved.is_none();
        if stamp == self.published && !self.learned && durable == self.published_durable {
            return None;
        }
        self.published = stamp;
        self.published_durable = durable;
        let new_epoch = std::mem::take(&mut self.learned);
        Some(Published { view: Arc::new(self.epoch.view()), new_epoch, durable })
    }

    // ---- views ----

    /// Whether this node hears `peer`, whose stream's hello says it is at epoch `claimed`; the
    /// reason if not. A node no epoch this run learned names may be ahead (a member of a later
    /// epoch, telling of it), so it is heard only if it says so; a retired node may be behind (it
    /// is told of the epoch that removed it, and hands its keys over) but never ahead: a later
    /// epoch that names it again reaches this node through the members.
    pub fn hears(&self, peer: NodeId, claimed: u64) -> Result<(), String> {
        let current = self.epoch.current();
        if current.is_retired(peer) && claimed > current.number {
            return Err(format!(
                "node {peer} was removed (epoch {} retires it); it cannot tell of a later epoch",
                current.number
            ));
        }
        if !self.known.contains(&peer) && claimed <= current.number && current.is_retired(peer) {
            // Since this node started it has not known the removed node's address, so it cannot
            // tell it of its removal; the reason reaches it in the close (`keyhome status` there).
            return Err(format!(
                "node {peer} was removed from the cluster: epoch {} retires it (add it back with \
                 `keyhome epoch propose --add`, or stop it)",
                current.number
            ));
        }
        if !self.known.contains(&peer) && claimed <= current.number {
            return Err(format!(
                "node {peer} is not a member of any epoch this node knows (up to {})",
                current.number
            ));
        }
        Ok(())
    }

    /// Where to reach `peer`: its address in the current epoch, else the last one an earlier
    /// epoch gave it (a removed node still hears of the epoch that removed it).
    pub fn link_addr(&self, peer: NodeId) -> Option<&str> {
        let current = self.epoch.current().members.iter().find(|m| m.id == peer);
        current.map(|m| m.addr.as_str()).or_else(|| self.addrs.get(&peer).map(String::as_str))
    }

    // ---- internals ----

    /// Runs the epoch core's due timers and takes everything it produced.
    fn settle(&mut self, now: Instant) {
        for _ in 0..MAX_TIMER_ROUNDS {
            if self.epoch.poll_timeout().is_some_and(|t| t <= now) {
                self.epoch.handle_timeout(now);
            }
            while let Some(ready) = self.epoch.ready() {
                self.take_ready(ready);
            }
            while let Some(event) = self.epoch.poll_event() {
                self.on_event(now, event);
            }
            if self.epoch.poll_timeout().is_none_or(|t| t > now) {
                return;
            }
        }
        tracing::error!("settle did not converge; the epoch core keeps a timer at or before now");
    }

    fn take_ready(&mut self, ready: Ready) {
        let gated = ready.needs_advance();
        for t in ready.messages {
            self.out.send(t.to, PeerMessage::Epoch(t.message));
        }
        if ready.writes.iter().any(|w| matches!(w, Write::Epoch(_))) {
            self.epoch_unsaved = Some(ready.number);
        }
        if gated && !self.out.failed() {
            let messages = ready.persisted_messages.into_iter().map(|t| (t.to, t.message)).collect();
            self.gated.push_back((ready.number, messages));
            self.out.push(Output::Persist { number: ready.number, writes: ready.writes });
        }
    }

    fn on_event(&mut self, now: Instant, event: EpochEvent) {
        match event {
            EpochEvent::Learned { epoch } => {
                self.log_epoch(now);
                let current = self.epoch.current();
                let members: Vec<NodeId> = current.member_ids().collect();
                let member = current.is_member(self.epoch.id());
                tracing::info!(epoch, members = ?members.iter().map(|m| m.0).collect::<Vec<_>>(), member, "learned epoch");
                self.known.extend(members.iter().copied());
                self.addrs.extend(current.members.iter().map(|m| (m.id, m.addr.clone())));
                self.out.push(Output::EpochLearned { epoch, members });
                self.learned = true;
            }
            EpochEvent::ProposalApplied { epoch } => {
                if std::mem::take(&mut self.proposing) {
                    self.out.push(Output::ProposalDone { result: Ok(epoch) });
                }
            }
            EpochEvent::ProposalFailed { error } => {
                if std::mem::take(&mut self.proposing) {
                    self.out.push(Output::ProposalDone { result: Err(error) });
                }
            }
        }
    }

    fn log_epoch(&mut self, now: Instant) {
        let current = self.epoch.current();
        let members = current.member_ids().map(|m| m.0).collect();
        self.epochs.learned(EpochChange { epoch: current.number, members, at: now });
    }
}
