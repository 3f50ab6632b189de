//! The nemesis of a chaos run: one fault at a time, drawn from the seed, held for a while, then
//! healed, with quiet spells in between. Network faults go through the [`Relay`]; process faults
//! signal the node processes by PID; membership faults are an operator removing a node from the
//! epoch and adding it back, while the clients keep locking.

use std::fmt;
use std::time::Duration;

use keyhome::client::Client;
use keyhome::wire::Proposal;
use keyhome_epoch::{Change, Member, NodeId};

use super::history::History;
use super::relay::{LinkFault, Relay};
use crate::cluster::Cluster;
use crate::rng::Rng;

/// How long an operator's proposal may take before it is retried.
const PROPOSE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the nemesis keeps trying to add a removed node back before it reports a failure.
const READD_PATIENCE: Duration = Duration::from_secs(60);

/// One fault.
#[derive(Clone, Debug, PartialEq)]
pub enum Fault {
    /// Every link to and from one node is cut.
    Isolate(u64),
    /// The nodes split in two sides that cannot talk (`minority` on one side).
    Split { minority: Vec<u64> },
    /// Packets from `from` to the other nodes are lost; the other way works.
    OneWay { from: Vec<u64> },
    /// Every link loses and delays packets.
    Flaky { loss: f64, delay: Duration },
    /// `kill -9`, then a restart when healed.
    Kill(u64),
    /// `kill -STOP`, then `kill -CONT` when healed: a pause longer than a delegation lease.
    Pause(u64),
    /// An operator removes the node from the epoch, and adds it back when healed.
    Remove(u64),
}

impl Fault {
    /// Names of the fault kinds, for the summary.
    pub const KINDS: [&'static str; 7] = ["isolate", "split", "one-way", "flaky", "kill", "pause", "remove"];

    /// This fault's kind: an index into [`Fault::KINDS`].
    pub fn kind(&self) -> usize {
        match self {
            Fault::Isolate(_) => 0,
            Fault::Split { .. } => 1,
            Fault::OneWay { .. } => 2,
            Fault::Flaky { .. } => 3,
            Fault::Kill(_) => 4,
            Fault::Pause(_) => 5,
            Fault::Remove(_) => 6,
        }
    }

    /// A fault among nodes `1..=n`.
    pub fn draw(rng: &mut Rng, n: u64) -> Fault {
        let node = rng.range(1, n);
        let mut shuffled: Vec<u64> = (1..=n).collect();
        for i in (1..shuffled.len()).rev() {
            shuffled.swap(i, rng.range(0, i as u64) as usize);
        }
        let side = |rng: &mut Rng| shuffled[..rng.range(1, (n - 1) / 2) as usize].to_vec();
        match rng.range(0, Fault::KINDS.len() as u64 - 1) {
            0 => Fault::Isolate(node),
            1 => Fault::Split { minority: side(rng) },
            2 => {
                let from = shuffled[..rng.range(1, n - 1) as usize].to_vec();
                Fault::OneWay { from }
            }
            3 => Fault::Flaky {
                loss: rng.range(5, 30) as f64 / 100.0,
                delay: Duration::from_millis(rng.range(2, 40)),
            },
            4 => Fault::Kill(node),
            5 => Fault::Pause(node),
            _ => Fault::Remove(node),
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::Isolate(n) => write!(f, "isolate n{n}"),
            Fault::Split { minority } => write!(f, "split {minority:?} from the rest"),
            Fault::OneWay { from } => write!(f, "one-way: {from:?} cannot reach the rest"),
            Fault::Flaky { loss, delay } => {
                write!(f, "flaky: {:.0}% loss, delay up to {delay:?}", loss * 100.0)
            }
            Fault::Kill(n) => write!(f, "kill -9 n{n}"),
            Fault::Pause(n) => write!(f, "SIGSTOP n{n}"),
            Fault::Remove(n) => write!(f, "operator removes n{n}"),
        }
    }
}

/// What the nemesis works on.
pub struct Nemesis<'a> {
    pub cluster: &'a mut Cluster,
    pub relay: &'a Relay,
    pub history: &'a History,
    /// Problems that are not the checker's (an operator change that never went through).
    pub failures: Vec<String>,
}

impl Nemesis<'_> {
    /// Applies `fault`, holds it for `hold`, then heals it.
    pub async fn strike(&mut self, fault: &Fault, hold: Duration) {
        self.history.log(format!("NEMESIS {fault} for {hold:?}"));
        let n = self.cluster.options.nodes;
        let all: Vec<u64> = (1..=n).collect();
        let rest = |side: &[u64]| all.iter().copied().filter(|i| !side.contains(i)).collect::<Vec<_>>();
        match fault {
            Fault::Isolate(node) => {
                let (side, others) = (vec![*node], rest(&[*node]));
                self.relay.faults(|f| {
                    f.cut(&side, &others);
                    f.cut(&others, &side);
                });
            }
            Fault::Split { minority } => {
                let others = rest(minority);
                self.relay.faults(|f| {
                    f.cut(minority, &others);
                    f.cut(&others, minority);
                });
            }
            Fault::OneWay { from } => self.relay.faults(|f| f.cut(from, &rest(from))),
            Fault::Flaky { loss, delay } => self.relay.faults(|f| {
                for &a in &all {
                    for &b in &all {
                        if a != b {
                            f.set(a, b, LinkFault { cut: false, loss: *loss, delay: *delay });
                        }
                    }
                }
            }),
            Fault::Kill(node) => self.cluster.kill(*node),
            Fault::Pause(node) => self.cluster.pause(*node),
            Fault::Remove(node) => {
                let removed = self.propose(Change::Remove(NodeId(*node)), *node).await;
                if !removed {
                    self.history.log(format!("NEMESIS n{node} was not removed; nothing to add back"));
                    tokio::time::sleep(hold).await;
                    return;
                }
            }
        }
        tokio::time::sleep(hold).await;
        match fault {
            Fault::Kill(node) => self.cluster.start_node(*node),
            Fault::Pause(node) => self.cluster.resume(*node),
            Fault::Remove(node) => self.add_back(*node).await,
            _ => self.relay.faults(|f| f.heal()),
        }
        self.history.log(format!("NEMESIS healed: {fault}"));
    }

    /// An operator proposes `change` through some node other than `avoid`, forced (the node's
    /// checks would refuse some of the nemesis's changes under the faults it makes, and the run is
    /// meant to try them); returns whether it was chosen.
    async fn propose(&mut self, change: Change, avoid: u64) -> bool {
        let n = self.cluster.options.nodes;
        let via = avoid % n + 1;
        let profile = self.cluster.operator_profile(via);
        let outcome = async {
            let operator = Client::connect(&profile).await.map_err(|e| e.to_string())?;
            operator.propose(Proposal::forced(change.clone())).await.map_err(|e| e.to_string())
        };
        let result = tokio::time::timeout(PROPOSE_TIMEOUT, outcome).await;
        match result {
            Ok(Ok(epoch)) => {
                self.history.log(format!("NEMESIS operator via n{via}: {change:?} chosen as epoch {epoch}"));
                true
            }
            Ok(Err(e)) => {
                self.history.log(format!("NEMESIS operator via n{via}: {change:?} failed: {e}"));
                false
            }
            Err(_) => {
                self.history.log(format!("NEMESIS operator via n{via}: {change:?} timed out"));
                false
            }
        }
    }

    /// Whether the current epoch, as a node other than `node` sees it, names `node`.
    async fn is_member(&self, node: u64) -> bool {
        let profile = self.cluster.operator_profile(node % self.cluster.options.nodes + 1);
        let record = async { Client::connect(&profile).await.ok()?.epoch().await.ok() };
        tokio::time::timeout(PROPOSE_TIMEOUT, record)
            .await
            .ok()
            .flatten()
            .is_some_and(|r| r.is_member(NodeId(node)))
    }

    /// Adds `node` back at its relay address, retrying until it is a member again.
    async fn add_back(&mut self, node: u64) {
        let member = Member { id: NodeId(node), addr: self.cluster.relay_addr(node).to_string() };
        let started = self.history.now();
        while self.history.now() < started + READD_PATIENCE {
            // A proposal whose answer was lost may still have been chosen.
            if self.propose(Change::Add(member.clone()), node).await || self.is_member(node).await {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        self.failures.push(format!("n{node} could not be added back within {READD_PATIENCE:?}"));
    }
}
