//! Epoch changes as the users of a key see them: does a key keep working across a change?
//!
//! The promise (issue point 3, and `delegation/src/home.rs`, "Epoch changes and handovers"): a
//! key whose home is the same node before and after a change keeps working with no pause; a key
//! that moves while its old home is reachable is handed over in one round trip, with no lease
//! wait; only keys whose old home is unreachable wait out the old epoch's leases (the new epoch's
//! activation wait).
//!
//! When a node learns epoch `e`, every key it is the home of under `e` that a client on a member
//! of `e` is waiting for at that instant becomes a [`Sample`]. From then until the node learns a
//! newer epoch, crashes, or the run ends, the world reports what the node does with the key: when
//! it first *may grant* it (as `Home` decides: an adopted key once the node holds a lease of `e`,
//! any other once [`EpochNode::home_active`](keyhome_epoch::EpochNode::home_active) holds), its
//! [`Refusal::Activating`](keyhome_delegation::Refusal::Activating) answers for it, and whether
//! the old home sent a `Handover` of it. At the end each sample falls in one [`Class`];
//! [`HandoverStats`] keeps counts and the longest waits per class, also as a share of the
//! activation wait.
//!
//! **Checked only in calm runs** ([`super::LockScenario::calm`]: no loss, duplication,
//! reordering, crash, partition or pause, changes far apart), where nothing but the change can
//! explain a pause:
//!
//! - a same-home key that the node could grant just before it learned `e`, and whose previous
//!   epoch it learned just before `e`, is never refused `Activating` under `e` (unless the node
//!   had adopted it at an earlier change: [`Class::SameHomeAdopted`], a known gap, measured);
//! - a moved key whose old home sent the new home a `Handover` under `e`, where the new home
//!   learned `e − 1` just before `e` (so it can check the sender), is adopted, and the new home may
//!   grant it before its activation instant for `e`.
//!
//! A breach is a [`LockKind::ChangePause`](super::LockKind::ChangePause) violation. Under faults
//! the same figures are only measured.

use std::collections::HashSet;
use std::time::Duration;

use crate::world::Real;

/// How a key with a waiting client fared across one change at its new home.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// Same home before and after, and the home could grant the key just before the change.
    SameHome,
    /// Same home, and the home had adopted the key by handover at an earlier change. `Home`
    /// grants adopted keys on the current epoch's lease alone, so such a key is refused
    /// `Activating` from the change until the home holds a lease of the new epoch (a round trip
    /// to a majority that has learned it). Measured, not checked: a known gap.
    SameHomeAdopted,
    /// Same home, but it could not grant the key just before the change either (still in an
    /// earlier activation wait, no lease, skipped epoch): not a pause the change caused.
    SameHomeNotReady,
    /// Moved, adopted by handover: granted on the new home's lease, without the activation wait.
    HandedOver,
    /// Moved; the old home was down, paused or cut off from the new home at the change.
    OldHomeUnreachable,
    /// Moved to a home that did not learn the previous epoch in this run (a spare added after
    /// the first change learns only the genesis and the epoch that adds it): it cannot check who
    /// the previous home was, so it adopts nothing and waits.
    NewHomeMissedEpoch,
    /// Moved, old home reachable, new home knew the previous epoch, but no `Handover` came: the
    /// old home kept no record of the key (a home keeps none for a key whose last delegation
    /// ended uncleanly without a note, or that it never granted), or none it could vouch for (it
    /// skipped an epoch, restarted, or the key moved in without a handover and was not granted
    /// since). The new home cannot tell this from an unreachable old home, so it waits.
    NoHandover,
    /// Moved, a `Handover` was sent, but the new home waited out the activation wait instead of
    /// adopting it (it already had a record of the key, for instance).
    NotAdopted,
    /// The new home could not grant the key before it learned a newer epoch, crashed, or the run
    /// ended.
    Unresolved,
}

/// One key with a waiting client, at the instant its home under `epoch` learned `epoch`.
#[derive(Clone, Debug)]
pub struct Sample {
    pub key: usize,
    pub epoch: u64,
    /// The key's home under `epoch` (simulation index).
    pub home: usize,
    /// The key's home under `epoch − 1`.
    pub old_home: Option<usize>,
    /// When `home` learned `epoch` (real time).
    pub learned_at: Real,
    /// The activation wait of `epoch` (on `home`'s clock) and the real instant `home`'s
    /// activation for `epoch` passes.
    pub activation: Duration,
    pub activation_at: Real,
    /// `home` learned `epoch − 1` just before `epoch` in this run.
    pub consecutive: bool,
    /// Same home: `home` could grant the key just before it learned `epoch`.
    pub ready_before: bool,
    /// Same home: `home` had adopted the key by handover (before it learned `epoch`).
    pub adopted_before: bool,
    /// Moved: the old home was up, not paused, and linked both ways with `home`.
    pub old_reachable: bool,
    /// Checked (calm run): breaches are violations.
    pub checked: bool,
    pub ready_at: Option<Real>,
    /// Ready because `home` adopted the key by handover.
    pub adopted: bool,
    /// `Refusal::Activating` answers `home` sent for the key under `epoch`.
    pub activating: u32,
    /// When `home` last refused the key `Activating` under `epoch`.
    pub last_activating: Option<Real>,
}

impl Sample {
    fn moved(&self) -> bool {
        self.old_home != Some(self.home)
    }

    fn class(&self, handovers: &HashSet<(usize, u64)>) -> Class {
        if !self.moved() {
            return match (self.ready_before && self.consecutive, self.adopted_before) {
                (false, _) => Class::SameHomeNotReady,
                (true, false) => Class::SameHome,
                (true, true) => Class::SameHomeAdopted,
            };
        }
        match self.ready_at {
            None => Class::Unresolved,
            Some(_) if self.adopted => Class::HandedOver,
            Some(_) if !self.old_reachable => Class::OldHomeUnreachable,
            Some(_) if !self.consecutive => Class::NewHomeMissedEpoch,
            Some(_) if !handovers.contains(&(self.key, self.epoch)) => Class::NoHandover,
            Some(_) => Class::NotAdopted,
        }
    }
}

/// Counts and longest waits of one [`Class`]. Waits count from the instant the key's new home
/// learned the epoch; ratios divide by that epoch's activation wait.
#[derive(Clone, Copy, Debug, Default)]
pub struct ClassStats {
    pub keys: u64,
    /// Keys the home answered `Activating` for at least once under the new epoch.
    pub refused_activating: u64,
    /// Keys the home could still not grant when the sample closed (it learned a newer epoch,
    /// crashed, or the run ended or stopped at a violation).
    pub never_ready: u64,
    /// Longest wait until the home may grant the key, among the others.
    pub max_ready: Real,
    pub max_ready_ratio: f64,
    /// The latest `Activating` refusal of a key, after the home learned the epoch: how long
    /// requesters were turned away.
    pub max_refused: Real,
    pub max_refused_ratio: f64,
}

impl ClassStats {
    fn add(&mut self, s: &Sample) {
        self.keys += 1;
        if s.activating > 0 {
            self.refused_activating += 1;
        }
        let aw = s.activation.as_nanos().max(1) as f64;
        match s.ready_at {
            Some(at) => {
                let wait = at - s.learned_at;
                self.max_ready = self.max_ready.max(wait);
                self.max_ready_ratio = self.max_ready_ratio.max(wait as f64 / aw);
            }
            None => self.never_ready += 1,
        }
        if let Some(at) = s.last_activating {
            let wait = at - s.learned_at;
            self.max_refused = self.max_refused.max(wait);
            self.max_refused_ratio = self.max_refused_ratio.max(wait as f64 / aw);
        }
    }

    fn merge(&mut self, o: &ClassStats) {
        self.keys += o.keys;
        self.refused_activating += o.refused_activating;
        self.never_ready += o.never_ready;
        self.max_ready = self.max_ready.max(o.max_ready);
        self.max_ready_ratio = self.max_ready_ratio.max(o.max_ready_ratio);
        self.max_refused = self.max_refused.max(o.max_refused);
        self.max_refused_ratio = self.max_refused_ratio.max(o.max_refused_ratio);
    }
}

/// What keys with waiting clients saw across epoch changes, per [`Class`].
#[derive(Clone, Copy, Debug, Default)]
pub struct HandoverStats {
    pub same_home: ClassStats,
    pub same_home_adopted: ClassStats,
    pub same_home_not_ready: ClassStats,
    pub handed_over: ClassStats,
    pub old_home_unreachable: ClassStats,
    pub new_home_missed_epoch: ClassStats,
    pub no_handover: ClassStats,
    pub not_adopted: ClassStats,
    pub unresolved: ClassStats,
    /// Shortest and longest activation wait of the epochs sampled (zero if none).
    pub min_activation: Real,
    pub max_activation: Real,
}

impl HandoverStats {
    pub fn class(&self, class: Class) -> &ClassStats {
        match class {
            Class::SameHome => &self.same_home,
            Class::SameHomeAdopted => &self.same_home_adopted,
            Class::SameHomeNotReady => &self.same_home_not_ready,
            Class::HandedOver => &self.handed_over,
            Class::OldHomeUnreachable => &self.old_home_unreachable,
            Class::NewHomeMissedEpoch => &self.new_home_missed_epoch,
            Class::NoHandover => &self.no_handover,
            Class::NotAdopted => &self.not_adopted,
            Class::Unresolved => &self.unresolved,
        }
    }

    fn class_mut(&mut self, class: Class) -> &mut ClassStats {
        match class {
            Class::SameHome => &mut self.same_home,
            Class::SameHomeAdopted => &mut self.same_home_adopted,
            Class::SameHomeNotReady => &mut self.same_home_not_ready,
            Class::HandedOver => &mut self.handed_over,
            Class::OldHomeUnreachable => &mut self.old_home_unreachable,
            Class::NewHomeMissedEpoch => &mut self.new_home_missed_epoch,
            Class::NoHandover => &mut self.no_handover,
            Class::NotAdopted => &mut self.not_adopted,
            Class::Unresolved => &mut self.unresolved,
        }
    }

    /// Every class, in report order, with its name.
    pub const CLASSES: [(Class, &'static str); 9] = [
        (Class::SameHome, "same home"),
        (Class::SameHomeAdopted, "same home, adopted at an earlier change"),
        (Class::SameHomeNotReady, "same home, not grantable before the change either"),
        (Class::HandedOver, "moved, handed over"),
        (Class::OldHomeUnreachable, "moved, old home unreachable"),
        (Class::NewHomeMissedEpoch, "moved, new home did not learn the previous epoch"),
        (Class::NoHandover, "moved, old home reachable but sent no handover"),
        (Class::NotAdopted, "moved, handover sent but not adopted"),
        (Class::Unresolved, "moved, not grantable by the next change or the end"),
    ];

    pub fn merge(&mut self, o: &HandoverStats) {
        for (class, _) in Self::CLASSES {
            self.class_mut(class).merge(o.class(class));
        }
        let keys = |s: &HandoverStats| Self::CLASSES.iter().map(|(c, _)| s.class(*c).keys).sum::<u64>();
        if keys(o) > 0 {
            let had = self.max_activation > 0;
            self.min_activation =
                if had { self.min_activation.min(o.min_activation) } else { o.min_activation };
            self.max_activation = self.max_activation.max(o.max_activation);
        }
    }

    fn add(&mut self, class: Class, s: &Sample) {
        self.class_mut(class).add(s);
        let aw = s.activation.as_nanos() as Real;
        self.min_activation = if self.max_activation == 0 { aw } else { self.min_activation.min(aw) };
        self.max_activation = self.max_activation.max(aw);
    }
}

/// The samples of one run in progress, and what they found.
#[derive(Debug, Default)]
pub struct Changes {
    /// Whether breaches are violations (calm runs).
    pub checked: bool,
    /// Print every sample as it closes.
    pub trace: bool,
    open: Vec<Sample>,
    /// `(key, epoch)` of every `Handover` a home sent.
    handovers: HashSet<(usize, u64)>,
    pub stats: HandoverStats,
}

/// A breach found: `(real instant, description)`.
pub type Breach = (Real, String);

impl Changes {
    pub fn new(checked: bool, trace: bool) -> Changes {
        Changes { checked, trace, ..Changes::default() }
    }

    /// Whether any sample is open at `node`.
    pub fn open_at(&self, node: usize) -> bool {
        self.open.iter().any(|s| s.home == node)
    }

    /// Whether any sample is open.
    pub fn any_open(&self) -> bool {
        !self.open.is_empty()
    }

    /// The keys of samples at `node` that are not ready yet.
    pub fn unready(&self, node: usize) -> Vec<usize> {
        self.open.iter().filter(|s| s.home == node && s.ready_at.is_none()).map(|s| s.key).collect()
    }

    /// A new sample (the world computed its fields at the learn instant).
    pub fn open(&mut self, mut sample: Sample) {
        sample.checked = self.checked;
        self.open.push(sample);
    }

    /// A home sent a `Handover` of `key` under `epoch`.
    pub fn handover_sent(&mut self, key: usize, epoch: u64) {
        self.handovers.insert((key, epoch));
    }

    /// `node` may grant `key` from `at` on (`adopted`: by handover). Returns a breach if the key
    /// should have been adopted.
    pub fn ready(&mut self, node: usize, key: usize, at: Real, adopted: bool) -> Option<Breach> {
        let s = self.open.iter_mut().find(|s| s.home == node && s.key == key && s.ready_at.is_none())?;
        s.ready_at = Some(at);
        s.adopted = adopted;
        let s = s.clone();
        self.adoption_breach(&s)
    }

    fn adoption_breach(&self, s: &Sample) -> Option<Breach> {
        let expected = s.checked
            && s.moved()
            && s.consecutive
            && s.old_reachable
            && self.handovers.contains(&(s.key, s.epoch));
        let late = match s.ready_at {
            Some(at) => !s.adopted || at >= s.activation_at,
            None => true,
        };
        (expected && late).then(|| {
            let at = s.ready_at.unwrap_or(s.activation_at);
            let detail = format!(
                "k{} moved from node {} to node {} at epoch {}: a handover was sent, but node {} {} {:.1} ms after it learned the epoch (activation wait {:.1} ms)",
                s.key,
                s.old_home.map_or("?".into(), |o| o.to_string()),
                s.home,
                s.epoch,
                s.home,
                if s.ready_at.is_none() {
                    "still could not grant it"
                } else if s.adopted {
                    "adopted it only"
                } else {
                    "did not adopt it and could grant it only"
                },
                (at - s.learned_at) as f64 / 1e6,
                s.activation.as_secs_f64() * 1e3
            );
            (at, detail)
        })
    }

    /// `node` refused `key` with `Activating` at `at`, under `epoch`. Returns a breach if the key
    /// kept its home and was grantable before the change.
    pub fn refused_activating(&mut self, node: usize, key: usize, epoch: u64, at: Real) -> Option<Breach> {
        let s = self.open.iter_mut().find(|s| s.home == node && s.key == key && s.epoch == epoch)?;
        s.activating += 1;
        s.last_activating = Some(at);
        (s.checked && !s.moved() && s.consecutive && s.ready_before && !s.adopted_before).then(|| {
            let detail = format!(
                "k{} kept its home node {} from epoch {} to {}, and node {} could grant it before, but refused it Activating {:.1} ms after it learned epoch {}",
                s.key,
                s.home,
                s.epoch - 1,
                s.epoch,
                s.home,
                (at - s.learned_at) as f64 / 1e6,
                s.epoch
            );
            (at, detail)
        })
    }

    /// Closes the samples of `node` (all nodes if `None`) at `at`: it learned a newer epoch,
    /// crashed, or the run ended. Returns breaches.
    pub fn close(&mut self, node: Option<usize>, at: Real) -> Vec<Breach> {
        let (done, open): (Vec<Sample>, Vec<Sample>) =
            std::mem::take(&mut self.open).into_iter().partition(|s| node.is_none_or(|n| s.home == n));
        self.open = open;
        let mut breaches = Vec::new();
        for s in done {
            // A moved key that never became grantable while a handover was sent: a breach
            // (readiness reached late was reported by `ready`).
            if s.ready_at.is_none()
                && at >= s.activation_at
                && let Some(b) = self.adoption_breach(&s)
            {
                breaches.push(b);
            }
            let class = s.class(&self.handovers);
            if self.trace {
                println!("{:>12.6} change sample closed: {class:?} {s:?}", at as f64 / 1e9);
            }
            self.stats.add(class, &s);
        }
        breaches
    }
}
