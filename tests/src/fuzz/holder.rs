//! `holder`: arbitrary client calls and message sequences into a [`Holder`].
//!
//! Steps: time passes; the application locks, try-locks, renews, unlocks, cancels or shuts the
//! holder down; a grant, refusal or recall arrives (mostly answering a request the holder
//! sent, from the node it sent it to, with any grantee, lease and delay); the timer fires; the
//! epoch layer changes. After every step: no panic, no wake-up at or before the `now` of a
//! `handle_timeout`, at most one live handle per key, no delegation longer than the epoch allows,
//! and no key tracked that no local call named.

use std::collections::HashSet;
use std::time::Duration;

use keyhome_delegation::{
    Body, Grantee, Handle, HandleId, Holder, HolderConfig, HolderEvent, LockOutcome, RequestId, Ticket,
};
use keyhome_epoch::{Instant, NodeId};

use super::home::LIMITS;
use super::script::Script;
use super::values::Gen;
use super::{MAX_STEPS, small_timing};

/// A handle the application holds, as it last learned its deadline.
struct Held {
    id: HandleId,
    key: Vec<u8>,
    deadline: Instant,
}

/// A request the holder sent: where, for which key, with which id and held grantee.
struct Sent {
    to: NodeId,
    key: Vec<u8>,
    id: RequestId,
    held: Option<Grantee>,
}

struct Run {
    holder: Holder,
    auth: Script,
    now: Instant,
    held: Vec<Held>,
    tickets: Vec<Ticket>,
    sent: Vec<Sent>,
    grantees: Vec<Grantee>,
    /// Keys local calls named (within the key limit).
    named: HashSet<Vec<u8>>,
}

pub fn run(data: &[u8]) -> Result<(), String> {
    let mut g = Gen::new(data);
    let me = NodeId(1);
    let timing = small_timing(&mut g);
    let mut config = HolderConfig::new(me);
    config.limits = LIMITS;
    config.lease = g.duration(timing.max_delegation_lease);
    config.idle_release = g.duration(Duration::from_millis(50));
    config.min_useful = g.duration(Duration::from_millis(5));
    config.retry = g.duration(Duration::from_millis(5));
    config.resend = g.duration(Duration::from_millis(30));
    config.prefetch_wait = g.duration(Duration::from_millis(50));
    // A slot or a few per step, so epoch walks span several calls.
    config.walk_step = 1 + g.index(3) as u32;
    let now = Instant::from_nanos(g.range(0, 1_000_000_000));
    let mut run = Run {
        holder: Holder::new(config, now),
        auth: Script::new(&mut g, me, timing),
        now,
        held: Vec::new(),
        tickets: Vec::new(),
        sent: Vec::new(),
        grantees: Vec::new(),
        named: HashSet::new(),
    };
    for step in 0..MAX_STEPS {
        if g.is_empty() {
            break;
        }
        run.step(&mut g).map_err(|e| format!("step {step}: {e}"))?;
        run.drain();
        run.check().map_err(|e| format!("step {step}: {e}"))?;
    }
    Ok(())
}

impl Run {
    fn step(&mut self, g: &mut Gen<'_>) -> Result<(), String> {
        let now = self.now;
        let scale = self.auth.timing.max_delegation_lease;
        match g.index(12) {
            0 | 1 => self.now = now + g.elapse(scale),
            2 | 3 => {
                let key = self.name(g);
                let (ttl, wait) = (g.duration(scale), g.duration(scale));
                match self.holder.lock(now, &key, ttl, wait, &self.auth) {
                    Ok(LockOutcome::Locked(handle)) => self.admitted(key, handle),
                    Ok(LockOutcome::Pending(ticket)) => self.tickets.push(ticket),
                    Err(_) => {}
                }
            }
            4 => {
                let key = self.name(g);
                if let Ok(handle) = self.holder.try_lock(now, &key, g.duration(scale)) {
                    self.admitted(key, handle);
                }
            }
            5 => {
                if let Some(i) = self.some_handle(g) {
                    let id = self.held[i].id;
                    if g.bool() {
                        match self.holder.renew(now, id, g.duration(scale)) {
                            Ok(deadline) => self.held[i].deadline = deadline,
                            Err(_) => drop(self.held.swap_remove(i)),
                        }
                    } else {
                        let note = g.note();
                        let too_large = note.as_ref().is_some_and(|n| n.len() > LIMITS.max_note_len);
                        if self.holder.unlock(now, id, note).is_ok() || !too_large {
                            self.held.swap_remove(i);
                        }
                    }
                }
            }
            6 => {
                if !self.tickets.is_empty() {
                    let ticket = self.tickets.swap_remove(g.index(self.tickets.len()));
                    self.holder.cancel(now, ticket);
                }
            }
            7 => {
                self.holder.handle_timeout(now, &self.auth);
                if let Some(at) = self.holder.poll_timer().filter(|&at| at <= now) {
                    return Err(format!("after handle_timeout({now:?}) a wake-up at {at:?}"));
                }
            }
            8 => {
                if g.index(4) == 0 {
                    self.auth.toggle(g);
                } else if g.index(16) == 0 {
                    self.holder.shutdown(now);
                } else {
                    self.auth.next_epoch(g);
                    if g.bool() {
                        self.holder.on_epoch_change(now, &self.auth);
                    }
                }
            }
            _ => {
                let (from, message) = self.message(g);
                self.holder.handle_message(now, from, message, &self.auth);
            }
        }
        Ok(())
    }

    /// A key for a local call: mostly one of the shared keys.
    fn name(&mut self, g: &mut Gen<'_>) -> Vec<u8> {
        let key = g.key();
        if key.len() <= LIMITS.max_key_len {
            self.named.insert(key.clone());
        }
        key
    }

    fn admitted(&mut self, key: Vec<u8>, handle: Handle) {
        self.held.push(Held { id: handle.id, key, deadline: handle.deadline });
    }

    fn some_handle(&mut self, g: &mut Gen<'_>) -> Option<usize> {
        (!self.held.is_empty()).then(|| g.index(self.held.len()))
    }

    /// A message for the holder: mostly an answer to a request it sent, else anything.
    fn message(&mut self, g: &mut Gen<'_>) -> (NodeId, keyhome_delegation::Message) {
        let scale = self.auth.timing.max_delegation_lease;
        let epoch = self.auth.epoch;
        if self.sent.is_empty() || g.index(4) == 0 {
            let ids: Vec<RequestId> = self.sent.iter().map(|s| s.id).collect();
            return (g.node(), g.delegation_message(epoch, &self.grantees, &ids, scale));
        }
        let sent = &self.sent[g.index(self.sent.len())];
        let from = if g.index(8) == 0 { g.node() } else { sent.to };
        let (key, id) = (sent.key.clone(), sent.id);
        let body = match g.index(3) {
            0 => {
                let grantee = match sent.held {
                    Some(held) if g.bool() => held,
                    _ => g.grantee(&self.grantees),
                };
                self.grantees.push(grantee);
                Body::Grant {
                    key,
                    id,
                    grantee,
                    lease: g.duration(scale),
                    note: g.note(),
                    recovered: g.bool(),
                }
            }
            1 => Body::Refuse { key, id, reason: g.refusal() },
            _ => {
                let grantee = g.grantee(&self.grantees);
                let ids: Vec<RequestId> = self.sent.iter().map(|s| s.id).collect();
                let next = g.bool().then(|| g.successor(&self.grantees, &ids, scale));
                Body::Recall { key, grantee, next }
            }
        };
        (from, keyhome_delegation::Message { epoch: g.number_near(epoch, u64::MAX), body })
    }

    /// Takes what the holder produced: requests it sent, handles admitted and taken away.
    fn drain(&mut self) {
        while let Some((to, message)) = self.holder.poll_transmit() {
            if let Body::Request { key, id, held, .. } = message.body {
                self.sent.push(Sent { to, key, id, held });
            }
        }
        while let Some(event) = self.holder.poll_event() {
            match event {
                HolderEvent::Locked { ticket, handle } => {
                    self.tickets.retain(|t| *t != ticket);
                    let key = self.holder.key_of(handle.id).map(<[u8]>::to_vec).unwrap_or_default();
                    self.admitted(key, handle);
                }
                HolderEvent::LockFailed { ticket, .. } => self.tickets.retain(|t| *t != ticket),
                HolderEvent::Recalled { handle, deadline, .. } => {
                    self.held.iter_mut().filter(|h| h.id == handle).for_each(|h| h.deadline = deadline)
                }
                HolderEvent::Expired { handle, .. } => self.held.retain(|h| h.id != handle),
            }
        }
        let excess = self.sent.len().saturating_sub(32);
        self.sent.drain(..excess);
        let excess = self.grantees.len().saturating_sub(32);
        self.grantees.drain(..excess);
    }

    fn check(&self) -> Result<(), String> {
        let mut live: Vec<&[u8]> =
            self.held.iter().filter(|h| self.now < h.deadline).map(|h| h.key.as_slice()).collect();
        live.sort();
        if let Some(pair) = live.windows(2).find(|p| p[0] == p[1]) {
            return Err(format!("two live handles for key {:?}", pair[0]));
        }
        let latest = self.now + self.auth.timing.max_delegation_lease;
        for key in &self.named {
            if let Some(d) = self.holder.delegation(self.now, key).filter(|d| d.deadline > latest) {
                return Err(format!("{key:?} delegated until {:?}, past {latest:?}", d.deadline));
            }
        }
        let tracked = self.holder.tracked_keys();
        if tracked > self.named.len() {
            return Err(format!("{tracked} keys tracked, {} named by local calls", self.named.len()));
        }
        Ok(())
    }
}
