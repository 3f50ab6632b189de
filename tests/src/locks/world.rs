//! The lock world: every node runs the node's own core ([`keyhome::core::Core`], the very type
//! the `keyhome` binary runs: epoch core, home, holder and their glue) on one clock, one disk and
//! one network, under a seeded client workload, holder pauses and every fault of the epoch
//! harness. Only sockets, disks and clocks are replaced.
//!
//! The core's outputs are carried out in the order it produced them: transmits go on the
//! simulated network (self-addressed delegation messages never leave the core), persistence
//! requests go to a FIFO disk whose completion calls `Core::persisted` (a crash loses unsynced
//! writes and the messages held back behind them), lock outcomes go to the node's clients through
//! the runtime's own glue ([`keyhome::core::callers`]: a client that gives up closes its reply,
//! and withdraws its lock a while later, so the core may decide it in between as another thread
//! of the runtime can), handle notices go to the clients too. Clients holding a handle sometimes
//! renew it (`Core::renew`), and the checker then counts the admission to the deadline renewed.
//! A crash loses the whole core (homes and holders are volatile); a restart builds a new one, so
//! the home's restart quarantine applies. A pause freezes the whole process:
//! nothing is delivered to it, its timers and clients do not run, and writes its clients had
//! checked just before reach the resource only after it resumes.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::time::Duration;

use keyhome::core::callers::{self, LockCallers, LockResult, Reply, Withdrawn};
use keyhome::core::{ClientOwner, Core, Notice, Output, Owner, PeerMessage, Sink};
use keyhome_delegation::{
    Body as DBody, FencingToken, Handle, HandleId, HolderConfig, HomeConfig, KeyHasher, LockError,
    LockOutcome, Message as DMessage, Refusal, Ticket,
};
use keyhome_epoch::time::rate_margin;
use keyhome_epoch::{Body, Change, Config, Durable, EpochNode, EpochRecord, Instant, Message, ProposeError};
use keyhome_ring::NodeId;

use crate::check::Checker;
use crate::clock::Clock;
use crate::disk::Disk;
use crate::queue::EventQueue;
use crate::rng::Rng;
use crate::scenario::{Fault, Links};
use crate::world::{Real, nanos};

use super::check::{End, LockChecker, LockKind};
use super::handover::{Breach, Changes, HandoverStats, Sample};
use super::scenario::LockScenario;

/// The share of waiting workload locks whose clients give up before their wait is over.
const GIVE_UP: f64 = 0.1;
/// The share of answered workload locks whose clients give up as the answer arrives (their
/// future dropped with the outcome in its reply).
const GIVE_UP_ON_ANSWER: f64 = 0.02;
/// Longest time between a client closing its reply and withdrawing its lock (ns): other calls
/// into the core may run in between, as on the runtime's other threads.
const LEAVE_WINDOW: u64 = 1_000_000;
/// The chance that a workload client holding a handle, at a step where it would write, renews
/// the handle instead (`Core::renew`, as `keyhome lock`, the Rust client and `/v1/renew` do),
/// and writes at its next step.
const RENEW: f64 = 0.06;

#[derive(Debug)]
enum Ev {
    Deliver {
        from: usize,
        to: usize,
        message: PeerMessage,
    },
    Timer {
        node: usize,
        generation: u64,
    },
    Sync {
        node: usize,
        run: u64,
    },
    Fault(Fault),
    Pause {
        node: usize,
        length: Real,
    },
    /// A client's next step; stale unless `generation` matches.
    Client {
        node: usize,
        client: usize,
        generation: u64,
    },
    /// A write that passed its client's deadline check reaches the resource.
    Write {
        node: usize,
        key: usize,
        token: FencingToken,
        write_id: u64,
        late: bool,
    },
    Probe,
}

/// A waiting client's reply, as the runtime's one-shot channel: the core's outcome is sent into
/// it unless the client closed it.
#[derive(Clone, Debug, Default)]
struct SimReply(Rc<RefCell<ReplyState>>);

#[derive(Debug, Default)]
enum ReplyState {
    #[default]
    Open,
    Sent(LockResult),
    Closed,
}

impl Reply for SimReply {
    fn send(self, result: LockResult) -> Result<(), LockResult> {
        let mut state = self.0.borrow_mut();
        match *state {
            ReplyState::Open => {
                *state = ReplyState::Sent(result);
                Ok(())
            }
            _ => Err(result),
        }
    }
}

impl SimReply {
    /// Closes the reply (as a dropped lock future does); returns what had been sent into it.
    fn close(&self) -> Option<LockResult> {
        match std::mem::replace(&mut *self.0.borrow_mut(), ReplyState::Closed) {
            ReplyState::Sent(result) => Some(result),
            _ => None,
        }
    }
}

/// What a client is doing.
#[derive(Clone, Debug)]
enum CState {
    Idle,
    Waiting {
        ticket: Ticket,
        key: usize,
        reply: SimReply,
    },
    /// Gave up waiting: its reply is closed, with the outcome it held (`admitted`); it withdraws
    /// the lock at its next step. `decided`: the core decided the lock meanwhile.
    Leaving {
        ticket: Ticket,
        key: usize,
        admitted: Option<LockResult>,
        decided: bool,
    },
    Holding {
        handle: Handle,
        key: usize,
        admission: usize,
        writes_left: u32,
        step: Real,
        last_write: u64,
    },
}

#[derive(Clone, Debug)]
struct Client {
    state: CState,
    generation: u64,
    /// A liveness probe: locks once, must succeed.
    probe: bool,
}

struct Slot {
    id: NodeId,
    clock: Clock,
    durable: Durable,
    /// The node's core, while the node runs.
    core: Option<Core>,
    /// The sink of every call into the core, as the runtime's `Carrier`.
    glue: Glue,
    /// Home start instant (home clock), for the ghost quarantine.
    home_started: Instant,
    run: u64,
    /// Persistence requests not yet durable, oldest first.
    disk: Disk,
    /// Delegation messages the core holds until their epoch is durable, checked when they were
    /// made ([`Output::Observed`] `held`); their transmission is not checked again.
    held: Vec<DMessage>,
    timer_generation: u64,
    /// Frozen until this real instant.
    paused_until: Real,
    /// The driver takes the next epoch-walk step no earlier than this real instant.
    walk_next: Real,
    clients: Vec<Client>,
    /// Ghost of the core's history in this run: each epoch learned (or started with) and its
    /// activation instant (node clock), oldest first.
    learned: Vec<(u64, Instant)>,
    /// Whether the node held its home lease after its last event.
    lease_ok: bool,
    /// Per scenario key: whether the home had adopted it by handover after the node's last
    /// event (what it decided on before an epoch change it learns now).
    adopted: Vec<bool>,
}

/// A node's sink for calls into its core, doing what the runtime's `Carrier` does at the same
/// points of a call: it registers a lock call's reply when the core leaves the lock pending
/// ([`Sink::lock_pending`], under the shard's lock) and hands a decided lock to its caller as the
/// core emits the decision ([`LockCallers::decided`]); every output is also queued for the world
/// to carry out afterwards, in order.
#[derive(Default)]
struct Glue {
    /// What the core produced and the world has not carried out yet, in order.
    out: VecDeque<Output>,
    /// The callers of the core's pending locks.
    callers: LockCallers<SimReply>,
    /// The reply of the lock call under way, until the core leaves it pending.
    reply: Option<SimReply>,
    /// Handles admitted for clients that had stopped waiting, to give back once the outputs that
    /// admitted them are carried out (as the runtime does once the call is over).
    unclaimed: Vec<Handle>,
}

impl Sink for Glue {
    fn output(&mut self, output: Output) {
        if let Output::LockDone { ticket, result } = &output
            && let Some(handle) = self.callers.decided(*ticket, result.clone())
        {
            self.unclaimed.push(handle);
        }
        self.out.push_back(output);
    }

    fn lock_pending(&mut self, ticket: Ticket) {
        if let Some(reply) = self.reply.take() {
            self.callers.wait(ticket, reply);
        }
    }
}

/// A whole simulated cluster with delegations under one lock scenario.
pub struct LockWorld {
    now: Real,
    queue: EventQueue<Ev>,
    slots: Vec<Slot>,
    rng: Rng,
    pub scenario: LockScenario,
    /// Draws the clients' renewals (whether, how long, how much longer to hold), apart from
    /// `rng`, so that a run with no renewal draws everything else as it did without them.
    renew_rng: Rng,
    links: Links,
    loss: f64,
    duplication: f64,
    lose_chosen: f64,
    crash_after_vote: f64,
    reorder: f64,
    /// Epoch invariants (fork, two homes, floor), shared with the epoch harness.
    pub epoch_checker: Checker,
    pub checker: LockChecker,
    next_write: u64,
    /// Locks a scripted run asked for, by `(node, client)`: the handle once admitted.
    script_results: Vec<(usize, usize, Option<Handle>)>,
    /// Live admissions by node and handle, so every revocation reaches the ghost state.
    handles: std::collections::HashMap<(usize, HandleId), usize>,
    /// Pending locks whose clients gave up and that `Core::cancel` said it withdrew, by node
    /// (for the node's current run): none of them may be decided afterwards.
    cancelled: std::collections::HashSet<(usize, Ticket)>,
    /// Every lock ticket a lock call of a node's current run was left pending under, by node:
    /// whether the core has decided it (each is decided at most once).
    tickets: std::collections::HashMap<(usize, Ticket), bool>,
    /// Handles admitted for clients that had stopped waiting, as `(node, key, handle)`: each must
    /// be unlocked by the end of the event that admitted (or withdrew) it.
    loose: Vec<(usize, usize, HandleId)>,
    /// Per epoch number seen: the home (simulation index) of each key, and the activation wait.
    epochs: std::collections::HashMap<u64, (Vec<Option<usize>>, Duration)>,
    /// Keys with waiting clients across epoch changes (see [`super::handover`]).
    pub changes: Changes,
}

impl LockWorld {
    pub fn new(seed: u64, scenario: LockScenario) -> LockWorld {
        let mut rng = Rng::new(seed);
        let genesis = scenario.base.genesis.clone();
        let bound = i64::from(genesis.timing.clock_rate_ppm);
        let n = scenario.base.nodes;
        let clients = scenario.clients;
        let extreme = scenario.extreme_clocks;
        let slots = (0..n)
            .map(|i| Slot {
                id: NodeId(i as u64 + 1),
                clock: Clock::new(
                    rng.range(0, 1 << 50),
                    if extreme {
                        if rng.chance(0.5) { bound } else { -bound }
                    } else {
                        rng.range(0, 2 * bound as u64) as i64 - bound
                    },
                ),
                durable: Durable::genesis(genesis.clone()),
                core: None,
                glue: Glue::default(),
                home_started: Instant::ZERO,
                run: 0,
                disk: Disk::default(),
                held: Vec::new(),
                timer_generation: 0,
                paused_until: 0,
                walk_next: 0,
                clients: vec![Client { state: CState::Idle, generation: 0, probe: false }; clients],
                learned: Vec::new(),
                lease_ok: false,
                adopted: vec![false; scenario.base.keys.len()],
            })
            .collect();
        let base = &scenario.base;
        let mut world = LockWorld {
            now: 0,
            queue: EventQueue::default(),
            slots,
            loss: base.loss,
            duplication: base.duplication,
            lose_chosen: base.lose_chosen,
            crash_after_vote: base.crash_after_vote,
            reorder: base.reorder,
            links: Links::new(n),
            epoch_checker: Checker::new(n, base),
            checker: LockChecker::new(base.keys.len()),
            rng,
            renew_rng: Rng::new(seed ^ 0x2e7e_5eed),
            next_write: 0,
            script_results: Vec::new(),
            handles: std::collections::HashMap::new(),
            cancelled: std::collections::HashSet::new(),
            tickets: std::collections::HashMap::new(),
            loose: Vec::new(),
            epochs: std::collections::HashMap::new(),
            changes: Changes::new(scenario.calm, scenario.base.trace),
            scenario,
        };
        for fault in world.scenario.base.faults.clone() {
            world.schedule(fault.at(), Ev::Fault(fault));
        }
        for (at, node, length) in world.scenario.pauses.clone() {
            world.schedule(at, Ev::Pause { node, length });
        }
        if let Some(at) = world.scenario.probe_at {
            world.schedule(at, Ev::Probe);
        }
        for i in 0..n {
            world.start(i);
        }
        if world.scenario.workload {
            for i in 0..n {
                for c in 0..clients {
                    let at = world.rng.range(0, 20_000_000);
                    world.schedule(at, Ev::Client { node: i, client: c, generation: 0 });
                }
            }
        }
        world
    }

    /// Simulated real time now.
    pub fn now(&self) -> Real {
        self.now
    }

    /// Runs the scenario to its end and checks the probes.
    pub fn run(&mut self) {
        let end = self.scenario.base.end;
        self.run_until(end);
        if self.scenario.probe_at.is_some() {
            self.check_probes_at_end();
        }
        self.finish_changes();
    }

    /// Closes every open epoch-change sample (see [`super::handover`]) and returns the figures,
    /// which also go to `checker.stats.handover`. [`LockWorld::run`] calls it at the end.
    pub fn finish_changes(&mut self) -> HandoverStats {
        let breaches = self.changes.close(None, self.now);
        self.breaches(breaches);
        self.checker.stats.handover = self.changes.stats;
        self.changes.stats
    }

    /// Runs every event up to real time `end` (or the first violation).
    pub fn run_until(&mut self, end: Real) {
        while let Some(next) = self.queue.peek_time() {
            if next > end {
                break;
            }
            let Some((at, ev)) = self.queue.pop() else { break };
            self.now = at;
            self.checker.stats.events += 1;
            if self.scenario.base.trace {
                println!("{:>12.6} {ev:?}", at as f64 / 1e9);
            }
            self.dispatch(ev);
            if !self.checker.violations.is_empty() || !self.epoch_checker.violations.is_empty() {
                self.take_epoch_violations();
                return;
            }
        }
        self.now = self.now.max(end);
    }

    fn take_epoch_violations(&mut self) {
        for v in std::mem::take(&mut self.epoch_checker.violations) {
            self.checker.violation(v.at, LockKind::Epoch(v.kind), v.detail);
        }
    }

    fn schedule(&mut self, at: Real, ev: Ev) {
        self.queue.push(at, ev);
    }

    fn local(&self, i: usize) -> Instant {
        self.slots[i].clock.local(self.now)
    }

    fn index(&self, id: NodeId) -> Option<usize> {
        let i = usize::try_from(id.0).ok()?.checked_sub(1)?;
        (i < self.slots.len()).then_some(i)
    }

    /// Whether node `i`'s process is frozen now; if so, `ev` is put back for when it resumes.
    fn deferred(&mut self, i: usize, ev: Ev) -> Option<Ev> {
        let until = self.slots[i].paused_until;
        if self.now < until {
            self.schedule(until, ev);
            return None;
        }
        Some(ev)
    }

    fn dispatch(&mut self, ev: Ev) {
        let node = match &ev {
            Ev::Deliver { to, .. } => Some(*to),
            Ev::Timer { node, .. } | Ev::Sync { node, .. } | Ev::Client { node, .. } => Some(*node),
            _ => None,
        };
        let ev = match node {
            Some(i) => match self.deferred(i, ev) {
                Some(ev) => ev,
                None => return,
            },
            None => ev,
        };
        match ev {
            Ev::Deliver { from, to, message } => {
                if self.links.is_cut(from, to) {
                    return;
                }
                let now = self.local(to);
                let from_id = self.slots[from].id;
                let slot = &mut self.slots[to];
                let Some(core) = slot.core.as_ref() else { return };
                core.handle_message(now, from_id, message, &mut slot.glue);
                self.pump(to, false);
            }
            Ev::Timer { node, generation } => {
                if self.slots[node].timer_generation != generation {
                    return;
                }
                let now = self.local(node);
                let slot = &mut self.slots[node];
                let Some(core) = slot.core.as_ref() else { return };
                let core_due = core.epoch().poll_timeout().is_some_and(|t| t <= now);
                core.handle_timeout(now, &mut slot.glue);
                self.slots[node].walk_next = self.now + self.scenario.walk.lag;
                self.pump(node, core_due);
            }
            Ev::Sync { node, run } => self.sync(node, run),
            Ev::Fault(fault) => self.apply_fault(fault),
            Ev::Pause { node, length } => {
                if self.slots[node].core.is_some() && self.now >= self.slots[node].paused_until {
                    self.slots[node].paused_until = self.now + length;
                    self.checker.stats.pauses += 1;
                }
            }
            Ev::Client { node, client, generation } => {
                if self.slots[node].clients[client].generation == generation {
                    self.client_step(node, client);
                }
            }
            Ev::Write { node, key, token, write_id, late } => {
                let until = self.slots[node].paused_until;
                if self.now < until {
                    // The write was checked just before the pause: it lands after the resume.
                    let delay = self.rng.range(self.scenario.write_delay.0, self.scenario.write_delay.1);
                    self.schedule(until + delay, Ev::Write { node, key, token, write_id, late: true });
                    return;
                }
                self.checker.write(self.now, key, token, write_id, late);
            }
            Ev::Probe => self.start_probes(),
        }
    }

    // ---- processes ----

    fn start(&mut self, i: usize) {
        let now = self.local(i);
        let scenario = &self.scenario;
        let slot = &mut self.slots[i];
        slot.run += 1;
        let mut config = Config::new(slot.id, scenario.base.seed ^ (slot.id.0 << 32) ^ slot.run);
        config.round_timeout = scenario.base.round_timeout;
        config.catch_up_interval = scenario.base.round_timeout;
        config.bugs = scenario.base.bugs;
        config.bugs.no_handover |= scenario.sim_bugs.no_handover;
        config.bugs.same_home_wait |= scenario.sim_bugs.same_home_wait;
        let epoch = EpochNode::start(config, slot.durable.clone(), now);
        // The reused-incarnation check compares each run's first message with earlier runs'.
        self.epoch_checker.started(i, epoch.incarnation());
        let mut home_config = HomeConfig::new(slot.id);
        home_config.bugs = scenario.bugs;
        let mut holder_config = HolderConfig::new(slot.id);
        let p = &scenario.holder;
        holder_config.idle_release = p.idle_release;
        holder_config.min_useful = p.min_useful;
        holder_config.retry = p.retry;
        holder_config.resend = p.resend;
        holder_config.bugs = scenario.bugs;
        // Keys hash (and so pick their shards) the same way whenever this seed runs.
        holder_config.key_hasher = KeyHasher::with_seeds([scenario.base.seed, slot.id.0, slot.run, 0]);
        home_config.walk_step = scenario.walk.step;
        holder_config.walk_step = scenario.walk.step;
        // The core waits this long before acting as home after a start (`EpochNode::start`).
        let current = slot.durable.current.clone();
        let timing = current.timing;
        let wait =
            current.activation_wait.max(rate_margin(timing.max_delegation_lease, timing.clock_rate_ppm));
        slot.learned = vec![(current.number, now + wait)];
        slot.lease_ok = false;
        let core = Core::new(epoch, home_config, holder_config, scenario.shards, now, &mut slot.glue);
        core.observe_local(true);
        slot.core = Some(core);
        slot.home_started = now;
        slot.paused_until = 0;
        self.note_epoch(&current);
        self.pump(i, false);
    }

    fn crash(&mut self, i: usize) {
        let slot = &mut self.slots[i];
        if slot.core.take().is_none() {
            return;
        }
        slot.glue = Glue::default();
        slot.disk.lose();
        slot.held.clear();
        slot.timer_generation += 1;
        slot.paused_until = 0;
        self.epoch_checker.crashed(i);
        let now = self.now;
        let breaches = self.changes.close(Some(i), now);
        self.breaches(breaches);
        let lost: Vec<usize> =
            self.handles.iter().filter(|((n, _), _)| *n == i).map(|(_, &admission)| admission).collect();
        for admission in lost {
            self.checker.ended(now, admission, End::Crash);
        }
        self.handles.retain(|(n, _), _| *n != i);
        self.cancelled.retain(|(n, _)| *n != i);
        self.tickets.retain(|(n, _), _| *n != i);
        self.loose.retain(|(n, _, _)| *n != i);
        for c in 0..self.slots[i].clients.len() {
            let client = &mut self.slots[i].clients[c];
            client.state = CState::Idle;
            client.generation += 1;
            let generation = client.generation;
            if self.scenario.workload && !client.probe {
                let at = now + self.rng.range(1_000_000, 20_000_000);
                self.schedule(at, Ev::Client { node: i, client: c, generation });
            }
        }
    }

    /// Carries out everything node `i`'s core produced, in order, re-arms the node's timer and
    /// runs the epoch checks.
    fn pump(&mut self, i: usize, core_timer: bool) {
        self.carry_out(i);
        self.check_given_back(i);
        let slot = &mut self.slots[i];
        slot.timer_generation += 1;
        let Some(core) = slot.core.as_ref() else { return };
        if let Some(at) = core.poll_timeout() {
            let generation = slot.timer_generation;
            let mut real = slot.clock.real_at(at).max(self.now);
            if core.walking() {
                real = real.max(slot.walk_next);
            }
            self.schedule(real, Ev::Timer { node: i, generation });
        }
        let now = self.local(i);
        let slot = &mut self.slots[i];
        let Some(core) = slot.core.as_ref() else { return };
        slot.lease_ok = core.epoch().holds_lease(now);
        for (k, name) in self.scenario.base.keys.iter().enumerate() {
            slot.adopted[k] = core.home(name).is_adopted(name);
        }
        if self.changes.open_at(i) {
            self.check_ready(i);
        }
        let Some(core) = self.slots[i].core.as_ref() else { return };
        if self.epoch_checker.after_event(self.now, i, now, core_timer, &core.epoch()) {
            let guards: Vec<_> = (self.slots.iter().enumerate())
                .filter(|(j, _)| *j != i)
                .filter_map(|(j, s)| s.core.as_ref().map(|c| (j, s.clock.local(self.now), c.epoch())))
                .collect();
            let others: Vec<(usize, Instant, &EpochNode)> =
                guards.iter().map(|(j, t, e)| (*j, *t, &**e)).collect();
            self.epoch_checker.check_homes(self.now, i, now, &core.epoch(), &others);
        }
    }

    /// Carries out node `i`'s outputs in order; then gives back the handles admitted for clients
    /// that had stopped waiting (which makes more outputs), as the runtime does once a call into
    /// the core is over.
    fn carry_out(&mut self, i: usize) {
        loop {
            while let Some(output) = self.slots[i].glue.out.pop_front() {
                match output {
                    Output::Transmit { to, message: PeerMessage::Epoch(message) } => {
                        self.send_epoch(i, to, message)
                    }
                    Output::Transmit { to, message: PeerMessage::Delegation(message) } => {
                        self.check_epoch_durable(i, message.epoch);
                        // A message held until its epoch was durable was checked when it was made.
                        let held = &mut self.slots[i].held;
                        match held.iter().position(|m| *m == message) {
                            Some(at) => {
                                held.swap_remove(at);
                            }
                            None => self.observe_deleg(i, &message),
                        }
                        self.send_deleg(i, to, message);
                    }
                    Output::Observed { message, held } => {
                        self.observe_deleg(i, &message);
                        if held {
                            self.slots[i].held.push(message);
                        }
                    }
                    Output::Persist { number, writes } => {
                        let was_idle = self.slots[i].disk.push(number, writes);
                        if was_idle {
                            self.schedule_sync(i);
                        }
                    }
                    Output::LockDone { ticket, result } => self.lock_done(i, ticket, result),
                    Output::Notice { handle, notice, key, .. } => self.on_notice(i, handle, &key, notice),
                    Output::EpochLearned { epoch, .. } => self.epoch_learned(i, epoch),
                    Output::CheckDone { .. } | Output::ProposalDone { .. } => {}
                }
            }
            let now = self.local(i);
            let slot = &mut self.slots[i];
            let (Some(core), Some(handle)) = (slot.core.as_ref(), slot.glue.unclaimed.pop()) else { return };
            callers::give_back(core, now, handle, &mut slot.glue);
        }
    }

    /// The epoch floor for delegation messages: node `i` sends none under an epoch its disk does not
    /// hold yet (a crash would take it back below a message it sent).
    fn check_epoch_durable(&mut self, i: usize, epoch: u64) {
        let durable = self.slots[i].durable.current.number;
        if epoch > durable {
            self.checker.violation(
                self.now,
                LockKind::Epoch(crate::Kind::BelowFloor),
                format!("node {i} sent a delegation message under epoch {epoch}, while its disk holds epoch {durable}"),
            );
        }
    }

    /// Every handle admitted for a client of node `i` that had stopped waiting was unlocked.
    fn check_given_back(&mut self, i: usize) {
        let loose = std::mem::take(&mut self.loose);
        for (n, key, handle) in loose {
            let Some(core) = self.slots[n].core.as_ref() else { continue };
            if n != i {
                self.loose.push((n, key, handle));
            } else if core.holder(&self.scenario.base.keys[key]).key_of(handle).is_some() {
                self.checker.violation(
                    self.now,
                    LockKind::Unclaimed,
                    format!("node {n} left {handle:?} of k{key} live, admitted for a client that had stopped waiting"),
                );
            }
        }
    }

    /// Checks on a delegation message node `i` sends (to a peer or to itself): grants against
    /// the granting rules, what homes say during epoch changes, and clean releases.
    fn observe_deleg(&mut self, i: usize, message: &DMessage) {
        match &message.body {
            // A Recall that carries a successor grants it (ahead): the same rules hold.
            DBody::Grant { key, .. } | DBody::Recall { key, next: Some(_), .. } => self.check_grant(i, key),
            DBody::Pass { .. } => self.checker.stats.passes += 1,
            // A release flagged `recovered` does not vouch for a clean end: the checker still
            // expects the next holder to be told.
            DBody::Release { key, grantee, note, recovered: false, .. } => {
                if let Some(k) = self.scenario.base.keys.iter().position(|n| n == key) {
                    self.checker.released(k, *grantee, note.is_some());
                }
            }
            _ => {}
        }
        self.home_sent(i, message);
    }

    // ---- epoch changes as keys see them (see `super::handover`) ----

    /// Remembers the homes of the scenario's keys under `record`, and its activation wait.
    fn note_epoch(&mut self, record: &EpochRecord) {
        if self.epochs.contains_key(&record.number) {
            return;
        }
        let ring = record.ring();
        let homes =
            self.scenario.base.keys.iter().map(|k| ring.home(k).and_then(|id| self.index(id))).collect();
        self.epochs.insert(record.number, (homes, record.activation_wait));
    }

    fn home_in(&self, epoch: u64, key: usize) -> Option<usize> {
        self.epochs.get(&epoch).and_then(|(homes, _)| homes[key])
    }

    /// Node `i` learned `epochs` (its home has not heard yet): closes its samples of earlier
    /// epochs and opens one for every key it is the new home of that a client waits for.
    fn epoch_learned(&mut self, i: usize, learned: u64) {
        let now = self.local(i);
        let Some(core) = self.slots[i].core.as_ref() else { return };
        let record = core.current();
        self.note_epoch(&record);
        let breaches = self.changes.close(Some(i), self.now);
        self.breaches(breaches);
        let before = self.slots[i].learned.clone();
        if self.slots[i].learned.last().is_some_and(|&(n, _)| n >= learned) {
            return; // the epoch the core started with
        }
        let wait = self.epochs.get(&learned).map_or(Duration::MAX, |(_, w)| *w);
        self.slots[i].learned.push((learned, now + wait));
        let e = record.number;
        let consecutive = self.slots[i].learned.iter().rev().nth(1).is_some_and(|(n, _)| *n + 1 == e);
        // Clients on members of the new epoch: others are refused `NotMember` anyway.
        let mut waiting = vec![false; self.scenario.base.keys.len()];
        for slot in self.slots.iter().filter(|s| record.is_member(s.id)) {
            for c in &slot.clients {
                if let CState::Waiting { key, .. } = c.state {
                    waiting[key] = true;
                }
            }
        }
        let slot = &self.slots[i];
        let activation = record.activation_wait;
        let activation_at = slot.clock.real_at(now + activation);
        for (key, _) in waiting.iter().enumerate().filter(|(_, w)| **w) {
            if self.home_in(e, key) != Some(i) {
                continue;
            }
            let old_home = self.home_in(e - 1, key);
            // As `Home` decided before the change: an adopted key on the lease alone, any other
            // by `home_active` (its lease half approximated by the lease held after the last event).
            let adopted_before = old_home == Some(i) && slot.adopted[key];
            let ready_before =
                old_home == Some(i) && slot.lease_ok && (adopted_before || self.fenced(&before, i, key, now));
            let old_reachable = old_home.is_some_and(|o| {
                o != i
                    && self.slots[o].core.is_some()
                    && self.now >= self.slots[o].paused_until
                    && !self.links.is_cut(o, i)
                    && !self.links.is_cut(i, o)
            });
            self.changes.open(Sample {
                key,
                epoch: e,
                home: i,
                old_home,
                learned_at: self.now,
                activation,
                activation_at,
                consecutive,
                ready_before,
                adopted_before,
                old_reachable,
                checked: false,
                ready_at: None,
                adopted: false,
                activating: 0,
                last_activating: None,
            });
        }
    }

    /// Whether, by the ghost `history` of node `i`, an activation instant of the run of
    /// consecutive epochs ending with the newest, in each of which `i` is `key`'s home, has passed
    /// at `now` (the fence half of `EpochNode::home_active`).
    fn fenced(&self, history: &[(u64, Instant)], i: usize, key: usize, now: Instant) -> bool {
        let Some(&(mut expected, _)) = history.last() else { return false };
        for &(n, fence) in history.iter().rev() {
            if n != expected || self.home_in(n, key) != Some(i) {
                return false;
            }
            if now >= fence {
                return true;
            }
            expected -= 1;
        }
        false
    }

    /// What home `i` sends, as the change samples see it.
    fn home_sent(&mut self, i: usize, message: &DMessage) {
        let key = match &message.body {
            DBody::Refuse { key, reason: Refusal::Activating, .. } | DBody::Handover { key, .. } => key,
            _ => return,
        };
        let Some(k) = self.scenario.base.keys.iter().position(|n| n == key) else { return };
        match message.body {
            DBody::Handover { .. } => self.changes.handover_sent(k, message.epoch),
            _ => {
                let breach = self.changes.refused_activating(i, k, message.epoch, self.now);
                self.breaches(breach);
            }
        }
    }

    /// Marks the keys of node `i`'s open samples that it may grant now: adopted by handover and
    /// holding its lease, or active for the key; and past its restart quarantine.
    fn check_ready(&mut self, i: usize) {
        let now = self.local(i);
        let slot = &self.slots[i];
        let Some(core) = slot.core.as_ref() else { return };
        if now < core.quarantine_end(&core.current().timing) {
            return;
        }
        // As `Home` decides: an adopted key on the current epoch's lease alone, any other by
        // `home_active`.
        let epoch = core.epoch();
        let mut ready = Vec::new();
        for key in self.changes.unready(i) {
            let name = &self.scenario.base.keys[key];
            let adopted = core.home(name).is_adopted(name);
            if (adopted && epoch.holds_lease(now)) || (!adopted && epoch.home_active(now, name)) {
                ready.push((key, adopted));
            }
        }
        drop(epoch);
        for (key, adopted) in ready {
            let breach = self.changes.ready(i, key, self.now, adopted);
            self.breaches(breach);
        }
    }

    fn breaches(&mut self, breaches: impl IntoIterator<Item = Breach>) {
        for (at, detail) in breaches {
            self.checker.violation(at, LockKind::ChangePause, detail);
        }
    }

    /// Checker 5: a grant leaves home `i`. It must hold its home lease, be active for the key
    /// (or have adopted it by handover), and be past its restart quarantine (computed here).
    fn check_grant(&mut self, i: usize, key: &[u8]) {
        self.checker.stats.grants += 1;
        let now = self.local(i);
        let slot = &self.slots[i];
        let Some(core) = slot.core.as_ref() else { return };
        let record = core.current();
        let timing = record.timing;
        let (home, epoch) = (core.home(key), core.epoch());
        let quarantine_end =
            slot.home_started + rate_margin(timing.max_delegation_lease, timing.clock_rate_ppm);
        let name = String::from_utf8_lossy(key).into_owned();
        // A key that keeps its home through epoch changes is granted on a lease of any epoch of
        // that run (see `EpochNode::home_active`), so "holds a home lease" is part of
        // `home_active`; an adopted key needs the current epoch's lease.
        let problem = if home.is_adopted(key) {
            (!epoch.holds_lease(now)).then_some("(adopted by handover) without a home lease")
        } else {
            (!epoch.home_active(now, key))
                .then_some("while not active for the key (no home lease in its run of epochs, or inside the activation wait)")
        };
        let problem = if problem.is_some() {
            problem
        } else if now < quarantine_end {
            Some("inside its restart quarantine")
        } else {
            None
        };
        if let Some(problem) = problem {
            let detail = format!("node {i} (epoch {}) granted {name} {problem}", record.number);
            self.checker.violation(self.now, LockKind::BadGrant, detail);
        }
    }

    fn schedule_sync(&mut self, i: usize) {
        let (lo, hi) = self.scenario.base.disk_latency;
        let at = self.now + self.rng.range(lo, hi);
        let run = self.slots[i].run;
        self.schedule(at, Ev::Sync { node: i, run });
    }

    fn sync(&mut self, i: usize, run: u64) {
        let slot = &mut self.slots[i];
        if slot.run != run || slot.core.is_none() {
            return;
        }
        let now = slot.clock.local(self.now);
        let Some(synced) = slot.disk.sync(&mut slot.durable) else { return };
        if let Some(core) = slot.core.as_ref() {
            core.persisted(now, synced.number, &mut slot.glue);
        }
        if self.slots[i].disk.busy() {
            self.schedule_sync(i);
        }
        self.pump(i, false);
    }

    fn send_epoch(&mut self, i: usize, to: NodeId, message: Message) {
        self.checker.stats.epoch_messages += 1;
        if let Some(core) = self.slots[i].core.as_ref() {
            let promised = self.slots[i].durable.acceptor.promised;
            self.epoch_checker.sent(self.now, i, core.epoch().incarnation(), promised, &message);
        }
        match message.body {
            Body::Chosen(_) if self.rng.chance(self.lose_chosen) => return,
            Body::Vote { .. } if self.rng.chance(self.crash_after_vote) => {
                let back = self.now + self.rng.range(1_000_000, 30_000_000);
                self.schedule(self.now, Ev::Fault(Fault::Crash { at: self.now, node: i }));
                self.schedule(back, Ev::Fault(Fault::Restart { at: back, node: i }));
            }
            _ => {}
        }
        let Some(to) = self.index(to) else { return };
        self.transmit(i, to, PeerMessage::Epoch(message));
    }

    fn send_deleg(&mut self, i: usize, to: NodeId, message: DMessage) {
        let Some(to) = self.index(to) else { return };
        self.checker.stats.deleg_messages += 1;
        self.transmit(i, to, PeerMessage::Delegation(message));
    }

    fn transmit(&mut self, i: usize, to: usize, message: PeerMessage) {
        let copies = if self.rng.chance(self.duplication) { 2 } else { 1 };
        for _ in 0..copies {
            if self.rng.chance(self.loss) {
                continue;
            }
            let (lo, hi) = self.scenario.base.net_delay;
            let mut delay = self.rng.range(lo, hi);
            if self.rng.chance(self.reorder) {
                delay += self.rng.range(hi, hi * 20);
            }
            self.schedule(self.now + delay, Ev::Deliver { from: i, to, message: message.clone() });
        }
    }

    // ---- faults ----

    fn apply_fault(&mut self, fault: Fault) {
        match fault {
            Fault::Crash { node, .. } => self.crash(node),
            Fault::Restart { node, .. } => {
                if self.slots[node].core.is_none() {
                    self.start(node);
                }
            }
            Fault::Partition { ref side, one_way, .. } => self.links.partition(side, one_way),
            Fault::HealPartition { .. } => self.links.heal(),
            Fault::Propose { node, .. } => {
                let change = self.random_change();
                let now = self.local(node);
                if self.now < self.slots[node].paused_until {
                    return; // a frozen process takes no operator command
                }
                let slot = &mut self.slots[node];
                if let Some(core) = slot.core.as_ref() {
                    let _ = core.propose(now, change, &mut slot.glue);
                    self.pump(node, false);
                }
            }
            Fault::Heal { .. } => {
                self.links.heal();
                self.loss = 0.0;
                self.duplication = 0.0;
                self.lose_chosen = 0.0;
                self.crash_after_vote = 0.0;
                self.reorder = 0.0;
                for i in 0..self.slots.len() {
                    if self.slots[i].core.is_none() {
                        self.start(i);
                    }
                }
            }
            Fault::LivenessPropose { .. } => {
                // Calm runs: an operator asks a running member of the newest epoch.
                let newest = self.newest();
                let members: Vec<usize> = (0..self.slots.len())
                    .filter(|&j| newest.is_member(self.slots[j].id) && self.slots[j].core.is_some())
                    .collect();
                let Some(node) = self.rng.pick(&members) else { return };
                let change = self.random_change();
                let now = self.local(node);
                let slot = &mut self.slots[node];
                if let Some(core) = slot.core.as_ref() {
                    let _ = core.propose(now, change, &mut slot.glue);
                    self.pump(node, false);
                }
            }
        }
    }

    /// The newest epoch any node knows, in memory or on its disk.
    fn newest(&self) -> EpochRecord {
        let current = self.slots.iter().filter_map(|s| s.core.as_ref().map(|c| c.current()));
        self.scenario.base.newest(current.chain(self.slots.iter().map(|s| s.durable.current.clone())))
    }

    /// A change an operator might ask for, judged against the newest epoch.
    fn random_change(&mut self) -> Change {
        let newest = self.newest();
        self.scenario.base.random_change(&mut self.rng, &newest, self.slots.iter().map(|s| s.id))
    }

    // ---- clients ----

    /// A random key: from the Zipf-hot set (weights 1, 1/2, 1/3, ...) or uniform over all keys.
    fn pick_key(&mut self) -> usize {
        let keys = self.scenario.base.keys.len();
        let hot = self.scenario.hot.min(keys);
        if hot > 0 && self.rng.chance(self.scenario.hot_share) {
            let total: f64 = (1..=hot).map(|r| 1.0 / r as f64).sum();
            let mut x = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
            for r in 1..=hot {
                x -= 1.0 / r as f64;
                if x <= 0.0 {
                    return r - 1;
                }
            }
            return hot - 1;
        }
        self.rng.range(0, keys as u64 - 1) as usize
    }

    fn schedule_client(&mut self, node: usize, client: usize, at: Real) {
        let c = &mut self.slots[node].clients[client];
        c.generation += 1;
        let generation = c.generation;
        self.schedule(at, Ev::Client { node, client, generation });
    }

    /// An idle client goes back to sleep for a while (workload clients only).
    fn idle(&mut self, node: usize, client: usize) {
        self.slots[node].clients[client].state = CState::Idle;
        if self.scenario.workload
            && !self.slots[node].clients[client].probe
            && self.now < self.scenario.quiet_at
        {
            let at = self.now + self.rng.range(0, 15_000_000);
            self.schedule_client(node, client, at);
        } else {
            self.slots[node].clients[client].generation += 1;
        }
    }

    fn lease(&self, node: usize) -> Duration {
        self.slots[node].core.as_ref().map_or(self.scenario.base.genesis.timing.max_delegation_lease, |c| {
            c.current().timing.max_delegation_lease
        })
    }

    fn client_step(&mut self, node: usize, client: usize) {
        if self.slots[node].core.is_none() {
            return;
        }
        match self.slots[node].clients[client].state.clone() {
            CState::Idle => {
                if !self.scenario.workload || self.now >= self.scenario.quiet_at {
                    return;
                }
                let key = self.pick_key();
                let lease = nanos(self.lease(node));
                let ttl = Duration::from_nanos(self.rng.range(lease / 2, 2 * lease));
                let wait = if self.rng.chance(0.1) {
                    Duration::ZERO
                } else {
                    Duration::from_nanos(self.rng.range(1_000_000, 3 * lease + 50_000_000))
                };
                self.lock(node, client, key, ttl, wait);
            }
            CState::Waiting { ticket, key, reply } => self.give_up(node, client, ticket, key, &reply),
            CState::Leaving { ticket, key, admitted, decided } => {
                self.withdraw(node, client, ticket, key, admitted, decided)
            }
            CState::Holding { handle, key, admission, writes_left, step, last_write } => {
                let now = self.local(node);
                if now >= handle.deadline {
                    // The client sees its handle is past its deadline: it stops, and tells the
                    // node (which then reports the handle expired, if it had not yet).
                    let slot = &mut self.slots[node];
                    let core = slot.core.as_ref().expect("up");
                    if core.unlock(now, handle.id, None, &mut slot.glue).is_ok() {
                        // The holder had extended the handle silently; it ends now, noteless.
                        self.handles.remove(&(node, handle.id));
                        self.checker.ended(self.now, admission, End::Unlock(None));
                    }
                    self.idle(node, client);
                    self.pump(node, false);
                    return;
                }
                if writes_left > 0
                    && self.scenario.workload
                    && !self.slots[node].clients[client].probe
                    && self.renew_rng.chance(RENEW)
                {
                    self.renew(node, client, key, handle, admission, writes_left, last_write);
                    return;
                }
                if writes_left > 0 {
                    self.checker.used(self.now, admission);
                    self.next_write += 1;
                    let write_id = self.next_write;
                    let delay = self.rng.range(self.scenario.write_delay.0, self.scenario.write_delay.1);
                    let token = handle.token;
                    self.schedule(self.now + delay, Ev::Write { node, key, token, write_id, late: false });
                    self.slots[node].clients[client].state = CState::Holding {
                        handle,
                        key,
                        admission,
                        writes_left: writes_left - 1,
                        step,
                        last_write: write_id,
                    };
                    self.schedule_client(node, client, self.now + step);
                    return;
                }
                let note = Some(last_write.to_le_bytes().to_vec());
                let slot = &mut self.slots[node];
                let core = slot.core.as_ref().expect("up");
                if self.scenario.base.trace {
                    println!(
                        "{:>12.6} node {node} client {client}: unlock k{key} {} note {last_write}",
                        self.now as f64 / 1e9,
                        handle.token
                    );
                }
                match core.unlock(now, handle.id, note, &mut slot.glue) {
                    Ok(()) => {
                        self.handles.remove(&(node, handle.id));
                        self.checker.ended(self.now, admission, End::Unlock(Some(last_write)));
                    }
                    // Past its deadline (a client may hold on a little longer than told); inside
                    // it, the node dropped the handle unannounced.
                    Err(e @ (LockError::Expired | LockError::UnknownHandle)) => {
                        self.checker.lost(self.now, admission, &format!("an unlock refused: {e}"));
                    }
                    Err(e) => panic!("unlock failed: {e}"),
                }
                self.idle(node, client);
                self.pump(node, false);
            }
        }
    }

    /// Client `client` of `node`, holding `handle` of `key` (admission `admission`, inside the
    /// deadline it was told), renews it for a ttl of a quarter to twice the delegation lease, so
    /// the new deadline may be later or earlier than the one before. What the client is told
    /// counts as a lock's does: the handle's new deadline on the node's clock (the API tells
    /// `valid_for` from the call's instant, shrunk by the rate margin, which a client on the
    /// node's own clock and sending at that instant counts to a deadline no later). Told, it
    /// holds on for up to 6/5 of the new time left, writing at its remaining steps. A refused
    /// renewal leaves the deadline it was told in force; the handle is lost to the client, which
    /// stops.
    #[allow(clippy::too_many_arguments)]
    fn renew(
        &mut self,
        node: usize,
        client: usize,
        key: usize,
        mut handle: Handle,
        admission: usize,
        writes_left: u32,
        last_write: u64,
    ) {
        self.checker.stats.renews += 1;
        let now = self.local(node);
        let lease = nanos(self.lease(node));
        let ttl = Duration::from_nanos(self.renew_rng.range(lease / 4, 2 * lease));
        let slot = &mut self.slots[node];
        let core = slot.core.as_ref().expect("up");
        if core.recalled(now, handle.id) {
            self.checker.stats.renews_recalled += 1;
        }
        let result = core.renew(now, handle.id, ttl, &mut slot.glue);
        if self.scenario.base.trace {
            let told = result.as_ref().map(|d| self.slots[node].clock.real_at(*d) as f64 / 1e9);
            println!(
                "{:>12.6} node {node} client {client}: renews k{key} {} ttl {ttl:?}: deadline {told:?}",
                self.now as f64 / 1e9,
                handle.token,
            );
        }
        match result {
            Ok(deadline) => {
                let told = self.slots[node].clock.real_at(deadline);
                let asked = self.slots[node].clock.real_at(now + ttl);
                self.checker.renewed(self.now, admission, told, asked);
                let left = deadline.saturating_duration_since(now);
                let hold = self.renew_rng.range(0, nanos(left) * 6 / 5);
                let step = hold / (u64::from(writes_left) + 1) + 1;
                handle.deadline = deadline;
                self.slots[node].clients[client].state =
                    CState::Holding { handle, key, admission, writes_left, step, last_write };
                self.schedule_client(node, client, self.now + step);
            }
            Err(e @ (LockError::Expired | LockError::UnknownHandle)) => {
                self.checker.stats.renews_refused += 1;
                self.checker.lost(self.now, admission, &format!("a renewal refused: {e}"));
                self.idle(node, client);
            }
            Err(e) => panic!("renew failed: {e}"),
        }
        self.pump(node, false);
    }

    /// Client `client` of `node` calls `lock`.
    fn lock(&mut self, node: usize, client: usize, key: usize, ttl: Duration, wait: Duration) {
        self.checker.stats.lock_calls += 1;
        let now = self.local(node);
        let name = self.scenario.base.keys[key].clone();
        let slot = &mut self.slots[node];
        let Some(core) = slot.core.as_ref() else { return };
        let owner = Owner::Client(ClientOwner { conn: client as u64, identity: 0 });
        let reply = SimReply::default();
        slot.glue.reply = Some(reply.clone());
        // Calls that will not wait take the fast path an embedded caller takes (`Core::try_lock`,
        // the key hashed once) for even clients, `Core::lock` for odd ones: the simulation drives
        // both entries the node ships.
        let outcome = if wait.is_zero() && client.is_multiple_of(2) {
            core.try_lock(now, &name, ttl, owner, &mut slot.glue).map(LockOutcome::Locked)
        } else {
            core.lock(now, &name, ttl, wait, owner, &mut slot.glue)
        };
        // The glue registers the reply when the core says the lock is pending (`Sink::lock_pending`),
        // as the runtime does, under the shard's lock, before anything could decide the lock.
        let registered = slot.glue.reply.take().is_none();
        if registered != matches!(outcome, Ok(LockOutcome::Pending(_))) {
            self.checker.violation(
                self.now,
                LockKind::Registration,
                format!("node {node}'s lock call of k{key} answered {outcome:?}, its reply registered: {registered}"),
            );
        }
        match outcome {
            Ok(LockOutcome::Locked(handle)) => {
                self.checker.stats.immediate += 1;
                self.holding(node, client, key, handle);
            }
            Ok(LockOutcome::Pending(ticket)) => {
                self.tickets.insert((node, ticket), false);
                self.slots[node].clients[client].state = CState::Waiting { ticket, key, reply };
                // Some workload clients give up before their wait is over, as a caller that
                // drops its lock future, sends `Cancel` or closes its connection does. Scripted
                // clients wait as their script says.
                if self.scenario.workload
                    && !self.slots[node].clients[client].probe
                    && self.rng.chance(GIVE_UP)
                {
                    let at = self.now + self.rng.range(0, nanos(wait).max(1));
                    self.schedule_client(node, client, at);
                }
            }
            Err(_) => {
                self.checker.stats.lock_failures += 1;
                if self.slots[node].clients[client].probe {
                    self.probe_failed(node, "lock refused at once");
                }
                self.idle(node, client);
            }
        }
        self.pump(node, false);
    }

    /// Client `client` of `node`, waiting for `key` under `ticket`, gives up, as a caller that
    /// drops its lock future (sends `Cancel`, closes its connection) does in the runtime: it
    /// closes its reply, and forgets its entry now or at its withdrawal, which comes up to
    /// [`LEAVE_WINDOW`] later; the core may decide the lock in between.
    fn give_up(&mut self, node: usize, client: usize, ticket: Ticket, key: usize, reply: &SimReply) {
        self.checker.stats.give_ups += 1;
        if self.scenario.base.trace {
            println!(
                "{:>12.6} node {node} client {client}: gives up {ticket:?} (k{key})",
                self.now as f64 / 1e9
            );
        }
        let admitted = reply.close();
        if self.rng.chance(0.5) {
            self.slots[node].glue.callers.forget(ticket);
        }
        self.slots[node].clients[client].state = CState::Leaving { ticket, key, admitted, decided: false };
        let at = self.now + self.rng.range(0, LEAVE_WINDOW);
        self.schedule_client(node, client, at);
    }

    /// Client `client` of `node`, which gave up `ticket`, withdraws it through the runtime's
    /// glue ([`callers::withdraw`]). A lock still undecided here must be withdrawn, and never
    /// decided afterwards (see [`LockWorld::lock_done`]); an admitted handle must be unlocked.
    fn withdraw(
        &mut self,
        node: usize,
        client: usize,
        ticket: Ticket,
        key: usize,
        admitted: Option<LockResult>,
        decided: bool,
    ) {
        let now = self.local(node);
        let slot = &mut self.slots[node];
        let Some(core) = slot.core.as_ref() else { return };
        slot.glue.callers.forget(ticket);
        let from_reply = admitted.as_ref().and_then(|r| r.as_ref().ok()).map(|h| h.id);
        let was_undecided = admitted.is_none() && !decided;
        let withdrawn = callers::withdraw(core, now, ticket, admitted, &mut slot.glue);
        if self.scenario.base.trace {
            println!(
                "{:>12.6} node {node} client {client}: withdraws {ticket:?} (k{key}): {withdrawn:?}",
                self.now as f64 / 1e9
            );
        }
        match withdrawn {
            Withdrawn::Cancelled => {
                self.cancelled.insert((node, ticket));
            }
            Withdrawn::GivenBack => self.checker.stats.given_back_from_reply += 1,
            Withdrawn::Decided if was_undecided => self.checker.violation(
                self.now,
                LockKind::Cancel,
                format!("node {node} could not withdraw the undecided lock {ticket:?} of k{key}"),
            ),
            Withdrawn::Decided => {}
        }
        if let Some(handle) = from_reply {
            self.loose.push((node, key, handle));
        }
        self.idle(node, client);
        self.pump(node, false);
    }

    /// A client got `handle`: the admission starts now.
    fn holding(&mut self, node: usize, client: usize, key: usize, handle: Handle) {
        let deadline = self.slots[node].clock.real_at(handle.deadline);
        let note =
            handle.note.as_ref().map(|n| u64::from_le_bytes(n.as_slice().try_into().unwrap_or([0xff; 8])));
        if self.scenario.base.trace {
            println!(
                "{:>12.6} node {node} client {client}: admitted k{key} {} note {note:?} recovered {} deadline {:.6}",
                self.now as f64 / 1e9,
                handle.token,
                handle.recovered,
                deadline as f64 / 1e9
            );
        }
        let admission =
            self.checker.admitted(self.now, key, node, handle.token, deadline, note, handle.recovered);
        self.handles.insert((node, handle.id), admission);
        let c = &self.slots[node].clients[client];
        if c.probe {
            self.checker.stats.probes_ok += 1;
        }
        let probe = c.probe;
        if self.scenario.workload || probe {
            // Hold for a while (sometimes past the ttl), writing 1 to 3 times, then unlock.
            let ttl = handle.deadline.saturating_duration_since(self.local(node));
            let hold = if probe { 1_000_000 } else { self.rng.range(0, nanos(ttl) * 6 / 5) };
            let writes = if probe { 1 } else { self.rng.range(1, 3) as u32 };
            let step = hold / (u64::from(writes) + 1) + 1;
            self.slots[node].clients[client].state =
                CState::Holding { handle, key, admission, writes_left: writes, step, last_write: 0 };
            self.schedule_client(node, client, self.now + step);
        } else {
            self.slots[node].clients[client].state = CState::Holding {
                handle: handle.clone(),
                key,
                admission,
                writes_left: 0,
                step: 0,
                last_write: 0,
            };
            self.script_results.push((node, client, Some(handle)));
        }
    }

    /// A pending lock of node `node` was decided; its outcome went to its caller as the core
    /// emitted it ([`Glue`]). Checks it was not withdrawn, and follows the client.
    fn lock_done(&mut self, node: usize, ticket: Ticket, result: LockResult) {
        if self.scenario.base.trace {
            println!("{:>12.6} node {node}: lock {ticket:?} {result:?}", self.now as f64 / 1e9);
        }
        if self.cancelled.remove(&(node, ticket)) {
            self.checker.violation(
                self.now,
                LockKind::Cancel,
                format!("node {node} decided the lock {ticket:?} after withdrawing it: {result:?}"),
            );
            return; // the run stops at this violation
        }
        // Each ticket is decided once. A decision with no client to take it is legitimate only
        // for a client that is leaving (below); a second one would otherwise be absorbed here,
        // and its handle given back unseen by the glue.
        let stray = match self.tickets.get_mut(&(node, ticket)) {
            None => Some("that no lock call of its current run was left pending under"),
            Some(true) => Some("a second time"),
            Some(decided) => {
                *decided = true;
                None
            }
        };
        if let Some(how) = stray {
            self.checker.violation(
                self.now,
                LockKind::StrayDecision,
                format!("node {node} decided the lock {ticket:?} {how}: {result:?}"),
            );
            return; // the run stops at this violation
        }
        let admitted = result.as_ref().ok().map(|h| h.id);
        let Some(c) = self.find_client(node, |s| match s {
            CState::Waiting { ticket: t, .. } | CState::Leaving { ticket: t, .. } => *t == ticket,
            _ => false,
        }) else {
            return;
        };
        match self.slots[node].clients[c].state.clone() {
            CState::Leaving { ticket, key, admitted: in_reply, .. } => {
                // Decided between the client's closing its reply and its withdrawal.
                if let Some(handle) = admitted {
                    self.checker.stats.given_back_unclaimed += 1;
                    self.loose.push((node, key, handle));
                }
                self.slots[node].clients[c].state =
                    CState::Leaving { ticket, key, admitted: in_reply, decided: true };
            }
            CState::Waiting { ticket, key, reply } => {
                let client = &self.slots[node].clients[c];
                if self.scenario.workload && !client.probe && self.rng.chance(GIVE_UP_ON_ANSWER) {
                    // The caller goes away with the outcome in its reply.
                    self.give_up(node, c, ticket, key, &reply);
                    return;
                }
                match reply.close() {
                    Some(Ok(handle)) => self.holding(node, c, key, handle),
                    Some(Err(error)) => {
                        self.checker.stats.lock_failures += 1;
                        if self.slots[node].clients[c].probe {
                            self.probe_failed(node, &format!("lock failed: {error}"));
                        }
                        self.idle(node, c);
                    }
                    None => {
                        self.checker.violation(
                            self.now,
                            LockKind::Cancel,
                            format!(
                                "node {node} decided {ticket:?} of k{key} but its waiting client got nothing"
                            ),
                        );
                    }
                }
            }
            _ => {}
        }
    }

    /// Node `node` tells the owner of `handle` it was recalled or has expired.
    fn on_notice(&mut self, node: usize, handle: HandleId, key: &[u8], notice: Notice) {
        if self.scenario.base.trace {
            println!("{:>12.6} node {node}: {notice:?} for {handle:?}", self.now as f64 / 1e9);
        }
        let client =
            self.find_client(node, |s| matches!(s, CState::Holding { handle: h, .. } if h.id == handle));
        match notice {
            Notice::Recalled { deadline } => {
                let Some(c) = client else { return };
                // The recall names when the handle ends: not before the deadline its owner was
                // told (a renewal while recalled may only shorten it, and is told so).
                if let CState::Holding { handle: h, .. } = &self.slots[node].clients[c].state
                    && deadline < h.deadline
                {
                    let detail = format!(
                        "node {node} recalled {} of {} ending at {deadline:?} on its clock, before the {:?} its client was told",
                        h.token,
                        String::from_utf8_lossy(key),
                        h.deadline,
                    );
                    self.checker.violation(self.now, LockKind::CutShort, detail);
                }
                // Most clients hurry: they write no more and unlock at their next step, with the
                // note of their last write. The others ignore the request and hold on to the
                // deadline they were told, as an unresponsive client would.
                if !self.rng.chance(self.scenario.responsive) {
                    return;
                }
                if let CState::Holding { writes_left, .. } = &mut self.slots[node].clients[c].state {
                    *writes_left = 0;
                }
                let at = self.now + self.rng.range(0, 2_000_000);
                self.schedule_client(node, c, at);
            }
            Notice::Expired => {
                let now = self.local(node);
                let deleg_gone = self.slots[node]
                    .core
                    .as_ref()
                    .is_none_or(|c| c.holder(key).delegation(now, key).is_none());
                if let Some(admission) = self.handles.remove(&(node, handle)) {
                    self.checker.lost(self.now, admission, "an Expired notice");
                    self.checker.ended(self.now, admission, End::Expired { deleg_gone });
                }
                if let Some(c) = client {
                    self.idle(node, c);
                }
            }
        }
    }

    fn find_client(&self, node: usize, which: impl Fn(&CState) -> bool) -> Option<usize> {
        self.slots[node].clients.iter().position(|c| which(&c.state))
    }

    // ---- liveness probes ----

    /// After healing: one probe client on every member of the newest epoch locks a random key,
    /// with a wait of twice the delegation lease plus its margin (a recalled holder may keep the
    /// key until its deadline, at most a lease away), and round trips to spare.
    fn start_probes(&mut self) {
        let newest = self.newest();
        for i in 0..self.slots.len() {
            if !newest.is_member(self.slots[i].id) || self.slots[i].core.is_none() {
                continue;
            }
            let key = self.pick_key();
            let timing = newest.timing;
            let wait = 2 * rate_margin(timing.max_delegation_lease, timing.clock_rate_ppm)
                + Duration::from_millis(100);
            self.slots[i].clients.push(Client { state: CState::Idle, generation: 0, probe: true });
            let c = self.slots[i].clients.len() - 1;
            self.lock(i, c, key, Duration::from_millis(50), wait);
        }
    }

    fn probe_failed(&mut self, node: usize, why: &str) {
        let epoch = self.slots[node].core.as_ref().map_or(0, |c| c.current().number);
        self.checker.violation(
            self.now,
            LockKind::NoLiveness,
            format!("probe on node {node} (epoch {epoch}): {why}"),
        );
    }

    fn check_probes_at_end(&mut self) {
        for i in 0..self.slots.len() {
            for c in 0..self.slots[i].clients.len() {
                if self.slots[i].clients[c].probe
                    && matches!(self.slots[i].clients[c].state, CState::Waiting { .. })
                {
                    self.probe_failed(i, "no answer by the end of the run");
                }
            }
        }
    }

    // ---- scripted use (message counts) ----

    /// Scripted: client 0 of `node` locks `key` (an index into the scenario's keys). Returns
    /// whether it was admitted at once.
    pub fn script_lock(&mut self, node: usize, key: usize, ttl: Duration, wait: Duration) -> bool {
        let before = self.checker.stats.immediate;
        self.lock(node, 0, key, ttl, wait);
        self.checker.stats.immediate > before
    }

    /// Scripted: whether client 0 of `node` holds a handle.
    pub fn script_holds(&self, node: usize) -> bool {
        matches!(self.slots[node].clients[0].state, CState::Holding { .. })
    }

    /// Scripted: whether client 0 of `node` waits for a lock it asked for.
    pub fn script_waiting(&self, node: usize) -> bool {
        matches!(self.slots[node].clients[0].state, CState::Waiting { .. })
    }

    /// Scripted: client 0 of `node` renews its handle for `ttl`, as [`LockWorld`]'s workload
    /// clients do. Returns the deadline it is told (real time), or `None` if it holds nothing or
    /// the renewal was refused (the handle is then lost to it).
    pub fn script_renew(&mut self, node: usize, ttl: Duration) -> Option<Real> {
        let CState::Holding { mut handle, key, admission, .. } = self.slots[node].clients[0].state.clone()
        else {
            return None;
        };
        let now = self.local(node);
        let slot = &mut self.slots[node];
        let result = slot.core.as_ref().expect("up").renew(now, handle.id, ttl, &mut slot.glue);
        let told = match result {
            Ok(deadline) => {
                let told = self.slots[node].clock.real_at(deadline);
                let asked = self.slots[node].clock.real_at(now + ttl);
                self.checker.renewed(self.now, admission, told, asked);
                handle.deadline = deadline;
                self.slots[node].clients[0].state =
                    CState::Holding { handle, key, admission, writes_left: 0, step: 0, last_write: 0 };
                Some(told)
            }
            Err(e) => {
                self.checker.lost(self.now, admission, &format!("a renewal refused: {e}"));
                self.slots[node].clients[0].state = CState::Idle;
                None
            }
        };
        self.pump(node, false);
        told
    }

    /// Scripted: client 0 of `node` unlocks with a note.
    pub fn script_unlock(&mut self, node: usize) {
        if let CState::Holding { handle, admission, .. } = self.slots[node].clients[0].state.clone() {
            let now = self.local(node);
            self.next_write += 1;
            let note = self.next_write;
            let slot = &mut self.slots[node];
            let core = slot.core.as_ref().expect("up");
            core.unlock(now, handle.id, Some(note.to_le_bytes().to_vec()), &mut slot.glue)
                .expect("a live handle");
            self.checker.ended(self.now, admission, End::Unlock(Some(note)));
            self.handles.remove(&(node, handle.id));
            self.slots[node].clients[0].state = CState::Idle;
            self.pump(node, false);
        }
    }

    /// Scripted: an operator asks `node` for `change`.
    pub fn script_propose(&mut self, node: usize, change: Change) -> Result<(), ProposeError> {
        let now = self.local(node);
        let slot = &mut self.slots[node];
        let core = slot.core.as_ref().expect("up");
        let result = core.propose(now, change, &mut slot.glue);
        self.pump(node, false);
        result
    }

    /// Scripted: cuts the links between the `true` and the `false` side of `side`; with
    /// `one_way`, only those from the `true` side to the `false` side.
    pub fn script_partition(&mut self, side: &[bool], one_way: bool) {
        self.links.partition(side, one_way);
    }

    /// Scripted: restores every link.
    pub fn script_heal(&mut self) {
        self.links.heal();
    }

    /// The epoch node `node` is in.
    pub fn epoch_of(&self, node: usize) -> Option<u64> {
        self.slots[node].core.as_ref().map(|c| c.current().number)
    }

    /// The home of key index `key` under node `node`'s current epoch.
    pub fn home_of(&self, node: usize, key: usize) -> Option<usize> {
        let core = self.slots[node].core.as_ref()?;
        self.index(core.epoch().home_of(&self.scenario.base.keys[key])?)
    }

    /// Every handle id ever returned to scripted lockers (for tests).
    pub fn script_handles(&self) -> Vec<HandleId> {
        self.script_results.iter().filter_map(|(_, _, h)| h.as_ref().map(|h| h.id)).collect()
    }
}
