//! `epoch-node`: arbitrary message sequences into an [`EpochNode`].
//!
//! Steps: time passes; a message arrives from any node (prepares, accepts, votes, chosen records,
//! catch-ups, lease requests and grants, with ballots and records near the ones in play and near
//! the limits); the timer fires; the driver makes some of the `Ready`s it took durable (it takes
//! one after every step);
//! the operator proposes a change or an unsafe recovery; the node restarts from what was durable.
//! After every step: no panic, no wake-up at or before the `now` of a `handle_timeout`, the
//! current epoch is valid and never goes back, and a `Ready` stays within a bound on size.

use std::time::Duration;

use keyhome_epoch::{Body, Config, Durable, EpochNode, EpochRecord, Instant, NodeId, Ready, Write};

use super::MAX_STEPS;
use super::values::Gen;

/// Most transmits one `Ready` may carry: each of the few messages a step handles answers or
/// announces to each member at most a few times.
const MAX_READY_MESSAGES: usize = 64;

struct Run {
    config: Config,
    node: EpochNode,
    now: Instant,
    /// What a restart finds: the writes of every `Ready` made durable, applied in order.
    durable: Durable,
    /// `Ready`s taken and not yet durable, oldest first.
    pending: Vec<Ready>,
    /// Records and the highest round seen in the node's messages, to answer with.
    known: Vec<EpochRecord>,
    round: u64,
    floor: u64,
}

pub fn run(data: &[u8]) -> Result<(), String> {
    let mut g = Gen::new(data);
    let mut config = Config::new(NodeId(1), g.u64());
    config.round_timeout = Duration::from_millis(g.range(1, 50));
    config.catch_up_interval = Duration::from_millis(g.range(1, 20));
    let mut members = g.members();
    if members.is_empty() || EpochRecord::genesis(members.clone(), super::small_timing(&mut g)).is_err() {
        members = (1..=3)
            .map(|id| keyhome_epoch::Member { id: NodeId(id), addr: format!("127.0.0.1:{id}") })
            .collect();
    }
    let genesis = EpochRecord::genesis(members, super::small_timing(&mut g)).map_err(|e| e.to_string())?;
    let durable = Durable::genesis(genesis.clone());
    let now = Instant::from_nanos(g.range(0, 1_000_000_000));
    let mut run = Run {
        node: EpochNode::start(config.clone(), durable.clone(), now),
        config,
        now,
        durable,
        pending: Vec::new(),
        known: vec![genesis],
        round: 0,
        floor: 1,
    };
    for step in 0..MAX_STEPS {
        if g.is_empty() {
            break;
        }
        run.step(&mut g).map_err(|e| format!("step {step}: {e}"))?;
        run.check().map_err(|e| format!("step {step}: {e}"))?;
    }
    Ok(())
}

impl Run {
    fn step(&mut self, g: &mut Gen<'_>) -> Result<(), String> {
        let now = self.now;
        match g.index(11) {
            0 | 1 => self.now = now + g.elapse(Duration::from_millis(40)),
            2 => {
                self.node.handle_timeout(now);
                if let Some(at) = self.node.poll_timeout().filter(|&at| at <= now) {
                    return Err(format!("after handle_timeout({now:?}) a wake-up at {at:?}"));
                }
            }
            3 => {
                // Everything up to some taken `Ready` is durable.
                if !self.pending.is_empty() {
                    let upto = g.index(self.pending.len());
                    let done: Vec<Ready> = self.pending.drain(..=upto).collect();
                    for write in done.iter().flat_map(|r| &r.writes) {
                        self.durable.apply(write);
                    }
                    let number = done.last().map_or(0, |r| r.number);
                    self.node.advance(now, number);
                }
            }
            4 => {
                let change = g.change();
                let _ = self.node.propose(now, change);
            }
            5 if g.index(8) == 0 => {
                let members = g.members();
                let skip = g.number_near(1, u64::MAX);
                let _ = self.node.recover_unsafe(now, members, skip);
            }
            6 if g.index(4) == 0 => {
                // A crash: what was not durable is lost.
                self.pending.clear();
                self.node = EpochNode::start(self.config.clone(), self.durable.clone(), now);
                self.floor = self.durable.current.number;
            }
            _ => {
                let from = g.node();
                let current = self.node.current().number;
                let message = g.epoch_message(current, self.round, &self.known);
                self.node.handle_message(now, from, message);
            }
        }
        while self.node.poll_event().is_some() {}
        self.take_ready()
    }

    /// Takes the `Ready` of the step, as a driver does after every call: sends its messages at
    /// once (noting what they carry) and keeps it pending if it needs to be made durable.
    fn take_ready(&mut self) -> Result<(), String> {
        let Some(ready) = self.node.ready() else { return Ok(()) };
        let count = ready.messages.len() + ready.persisted_messages.len();
        if count > MAX_READY_MESSAGES {
            return Err(format!("a Ready with {count} messages"));
        }
        for t in ready.messages.iter().chain(&ready.persisted_messages) {
            match &t.message.body {
                Body::Prepare { ballot, .. } | Body::Accept { ballot, .. } => {
                    self.round = self.round.max(ballot.round)
                }
                _ => {}
            }
            if let Body::Accept { value, .. } | Body::Chosen(value) = &t.message.body
                && !self.known.contains(value)
            {
                self.known.push(value.clone());
            }
        }
        let excess = self.known.len().saturating_sub(8);
        self.known.drain(..excess);
        if ready.writes.iter().any(|w| matches!(w, Write::Epoch(r) if r.validate().is_err())) {
            return Err("an invalid epoch written".to_owned());
        }
        if ready.needs_advance() {
            self.pending.push(ready);
        }
        Ok(())
    }

    fn check(&mut self) -> Result<(), String> {
        let current = self.node.current();
        current.validate().map_err(|e| format!("the current epoch {} is invalid: {e}", current.number))?;
        if current.number < self.floor {
            return Err(format!("the epoch went back from {} to {}", self.floor, current.number));
        }
        self.floor = current.number;
        Ok(())
    }
}
