//! Structured inputs from unstructured bytes: every value the fuzz targets feed in is drawn from
//! an [`arbitrary::Unstructured`], so an input is a byte string that replays exactly.
//!
//! The draws are biased towards what matters: the handful of node ids and keys a target works
//! with, epoch numbers and rounds next to the current ones and next to the limits, durations
//! around the leases and at the extremes. Running out of bytes yields zeros and first choices,
//! so every byte string is a valid input.

use std::time::Duration;

use arbitrary::Unstructured;
use keyhome::wire::{PeerFrame, Proposal, Request};
use keyhome_delegation::{
    Body as DBody, CheckAnswer, FencingToken, Grantee, Handed, Message as DMessage, Refusal, RequestId,
    Successor,
};
use keyhome_epoch::paxos::{Ballot, Vote};
use keyhome_epoch::record::{MAX_ADDR_LEN, MAX_LEASE};
use keyhome_epoch::{
    Body as EBody, Change, EpochRecord, MAX_EPOCH, MAX_ROUND, Member, Message as EMessage, NodeId, Timing,
};
use keyhome_ring::ROUTING_VERSION;

/// Node ids the targets use: `1..=5` are members or candidates, 99 is never a member.
pub const NODES: [u64; 6] = [1, 2, 3, 4, 5, 99];
/// Keys the targets use, so that messages about one key meet.
pub const KEYS: [&[u8]; 4] = [b"a", b"b", b"key-c", b"d"];

/// A source of structured values over one input's bytes.
pub struct Gen<'a> {
    u: Unstructured<'a>,
}

impl<'a> Gen<'a> {
    pub fn new(data: &'a [u8]) -> Gen<'a> {
        Gen { u: Unstructured::new(data) }
    }

    /// Whether the input's bytes are used up (draws still work, returning zeros).
    pub fn is_empty(&self) -> bool {
        self.u.is_empty()
    }

    pub fn u8(&mut self) -> u8 {
        self.u.arbitrary().unwrap_or(0)
    }

    pub fn u32(&mut self) -> u32 {
        self.u.arbitrary().unwrap_or(0)
    }

    pub fn u64(&mut self) -> u64 {
        self.u.arbitrary().unwrap_or(0)
    }

    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }

    /// An index below `n` (0 when `n` is 0).
    pub fn index(&mut self, n: usize) -> usize {
        self.u.choose_index(n).unwrap_or(0)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        self.u.int_in_range(lo..=hi).unwrap_or(lo)
    }

    /// One of `items`.
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.index(items.len())]
    }

    /// Up to `max` raw bytes.
    pub fn bytes(&mut self, max: usize) -> Vec<u8> {
        let len = self.index(max + 1);
        self.u.bytes(len).map(<[u8]>::to_vec).unwrap_or_default()
    }

    /// A number near `base`, near the limit of the numbers the cores accept, or anything.
    pub fn number_near(&mut self, base: u64, limit: u64) -> u64 {
        match self.index(8) {
            0..=3 => base.saturating_add(self.range(0, 3)).saturating_sub(1),
            4 => self.range(0, 8),
            5 => limit.saturating_add(self.range(0, 2)).saturating_sub(1),
            6 => u64::MAX - self.range(0, 1),
            _ => self.u64(),
        }
    }

    /// A duration around `scale`, zero, or at the extremes.
    pub fn duration(&mut self, scale: Duration) -> Duration {
        match self.index(10) {
            0 => Duration::ZERO,
            1..=6 => {
                Duration::from_nanos(self.range(0, u64::try_from(scale.as_nanos() * 2).unwrap_or(u64::MAX)))
            }
            7 => MAX_LEASE,
            8 => Duration::MAX,
            _ => Duration::new(self.u64(), self.range(0, 999_999_999) as u32),
        }
    }

    /// Time passing on a node's clock: around `scale`, sometimes zero or up to an hour (a clock
    /// reading never nears `u64::MAX` nanoseconds, 584 years).
    pub fn elapse(&mut self, scale: Duration) -> Duration {
        match self.index(16) {
            0 => Duration::from_nanos(self.range(0, 3_600_000_000_000)),
            _ => Duration::from_nanos(self.range(0, u64::try_from(scale.as_nanos()).unwrap_or(u64::MAX))),
        }
    }

    pub fn node(&mut self) -> NodeId {
        match self.index(16) {
            0 => NodeId(self.u64()),
            _ => NodeId(self.pick(&NODES)),
        }
    }

    /// A key of [`KEYS`], or a random one (sometimes longer than a target's key limit).
    pub fn key(&mut self) -> Vec<u8> {
        match self.index(8) {
            0 => self.bytes(24),
            _ => self.pick(&KEYS).to_vec(),
        }
    }

    /// No note, or one of up to 12 bytes (targets allow 8).
    pub fn note(&mut self) -> Option<Vec<u8>> {
        self.bool().then(|| self.bytes(12))
    }

    pub fn timing(&mut self) -> Timing {
        match self.index(4) {
            0 => Timing::DEFAULT,
            1 => Timing {
                home_lease: Duration::from_millis(40),
                max_delegation_lease: Duration::from_millis(200),
                clock_rate_ppm: 10_000,
            },
            2 => Timing { home_lease: MAX_LEASE, max_delegation_lease: MAX_LEASE, clock_rate_ppm: 100_000 },
            _ => Timing {
                home_lease: self.duration(Duration::from_millis(50)),
                max_delegation_lease: self.duration(Duration::from_millis(200)),
                clock_rate_ppm: self.pick(&[0, 1, 10_000, 100_000, 100_001, u32::MAX]),
            },
        }
    }

    pub fn member(&mut self) -> Member {
        let id = self.node();
        let addr = match self.index(8) {
            0 => String::new(),
            1 => "x".repeat(MAX_ADDR_LEN + self.index(2)),
            2 => "127.0.0.1:7000".to_owned(),
            _ => format!("127.0.0.1:{}", 7000 + id.0 % 1000),
        };
        Member { id, addr }
    }

    /// Members: mostly a sorted subset of `1..=5` with distinct addresses, sometimes anything.
    pub fn members(&mut self) -> Vec<Member> {
        if self.index(8) == 0 {
            let n = self.index(7);
            return (0..n).map(|_| self.member()).collect();
        }
        let mask = self.range(1, 31);
        (1..=5u64)
            .filter(|i| mask & (1 << (i - 1)) != 0)
            .map(|id| Member { id: NodeId(id), addr: format!("127.0.0.1:{}", 7000 + id) })
            .collect()
    }

    /// A record numbered near `base`: mostly valid, sometimes off in one field.
    pub fn record(&mut self, base: u64) -> EpochRecord {
        let timing = if self.index(4) == 0 { self.timing() } else { Timing::DEFAULT };
        let mut record = EpochRecord {
            number: self.number_near(base, MAX_EPOCH),
            members: self.members(),
            ring_version: ROUTING_VERSION,
            timing,
            activation_wait: if self.bool() { Duration::ZERO } else { timing.fence_bound() },
            retired: Vec::new(),
        };
        match self.index(16) {
            0 => record.ring_version = self.u32(),
            1 => record.activation_wait = self.duration(Duration::from_secs(30)),
            2 => record.members.reverse(),
            3 => record.retired = self.members().iter().map(|m| m.id).collect(),
            _ => {}
        }
        record
    }

    pub fn change(&mut self) -> Change {
        match self.index(4) {
            0 => Change::Add(self.member()),
            1 => Change::Remove(self.node()),
            2 => Change::Replace { old: self.node(), new: self.member() },
            _ => Change::SetTiming(self.timing()),
        }
    }

    /// A ballot with a round near `round` (and near the limit).
    pub fn ballot(&mut self, round: u64) -> Ballot {
        Ballot { round: self.number_near(round, MAX_ROUND), proposer: self.node() }
    }

    /// An epoch-core message about epoch `current` and the slot after it; `known` are records
    /// to choose from (valid ones the target has seen), besides generated ones.
    pub fn epoch_message(&mut self, current: u64, round: u64, known: &[EpochRecord]) -> EMessage {
        let epoch = self.number_near(current, MAX_EPOCH);
        let slot = self.number_near(current + 1, MAX_EPOCH);
        let value = |g: &mut Gen<'_>| match known.len() {
            n if n > 0 && g.bool() => known[g.index(n)].clone(),
            _ => g.record(current + 1),
        };
        let body = match self.index(8) {
            0 => EBody::Prepare { slot, ballot: self.ballot(round) },
            1 => EBody::Accept { slot, ballot: self.ballot(round), value: value(self) },
            2 => {
                let ballot = self.ballot(round);
                let vote = match self.index(3) {
                    0 => {
                        let accepted = self.bool().then(|| (self.ballot(round), value(self)));
                        Vote::Promise { ballot, accepted }
                    }
                    1 => Vote::Accepted { ballot },
                    _ => Vote::Reject { ballot, promised: self.ballot(round) },
                };
                EBody::Vote { slot, vote }
            }
            3 => EBody::Chosen(value(self)),
            4 => EBody::CatchUp,
            5 | 6 => EBody::LeaseRequest { incarnation: self.u64(), seq: self.u64() },
            _ => EBody::LeaseGrant { incarnation: self.u64(), seq: self.u64() },
        };
        EMessage { epoch, body }
    }

    pub fn grantee(&mut self, known: &[Grantee]) -> Grantee {
        match known.len() {
            n if n > 0 && self.index(4) != 0 => known[self.index(n)],
            _ => Grantee {
                epoch: self.number_near(1, MAX_EPOCH),
                incarnation: self.number_near(1, u64::MAX),
                counter: self.number_near(1, u64::MAX),
            },
        }
    }

    pub fn token(&mut self, known: &[Grantee]) -> FencingToken {
        let local_seq = self.number_near(0, u64::MAX);
        self.grantee(known).token(local_seq)
    }

    pub fn refusal(&mut self) -> Refusal {
        match self.index(13) {
            0 => Refusal::NotHome,
            1 => Refusal::StaleEpoch,
            2 => Refusal::NotMember,
            3 => Refusal::Quarantine(self.duration(Duration::from_millis(200))),
            4 => Refusal::LockDelay(self.duration(Duration::from_millis(200))),
            5 => Refusal::KeyTooLong,
            6 => Refusal::NoteTooLarge,
            7 => Refusal::HomeFull,
            8 => Refusal::RequesterFull,
            9 => Refusal::QueueFull,
            10 => Refusal::WaitExpired,
            11 => Refusal::Activating,
            _ => Refusal::Recalled,
        }
    }

    /// A request id: one of `known` (ids a holder sent) or any.
    pub fn request_id(&mut self, known: &[RequestId]) -> RequestId {
        match known.len() {
            n if n > 0 && self.index(4) != 0 => known[self.index(n)],
            _ => RequestId::new(self.number_near(1, u64::MAX), self.number_near(1, u64::MAX)),
        }
    }

    /// A delegation granted ahead ([`Successor`]), naming `grantees` and request `ids` seen so far.
    pub fn successor(&mut self, grantees: &[Grantee], ids: &[RequestId], scale: Duration) -> Successor {
        Successor {
            to: self.node(),
            id: self.request_id(ids),
            grantee: self.grantee(grantees),
            lease: self.duration(scale),
        }
    }

    /// A delegation message under an epoch near `epoch`, naming `grantees` and request `ids`
    /// seen so far, and durations around `scale`.
    pub fn delegation_message(
        &mut self,
        epoch: u64,
        grantees: &[Grantee],
        ids: &[RequestId],
        scale: Duration,
    ) -> DMessage {
        let epoch = self.number_near(epoch, MAX_EPOCH);
        let key = self.key();
        let body = match self.index(11) {
            0 => DBody::Request {
                key,
                id: self.request_id(ids),
                lease: self.duration(scale),
                wait: self.duration(scale),
                held: self.bool().then(|| self.grantee(grantees)),
            },
            1 => DBody::Grant {
                key,
                id: self.request_id(ids),
                grantee: self.grantee(grantees),
                lease: self.duration(scale),
                note: self.note(),
                recovered: self.bool(),
            },
            2 => DBody::Refuse { key, id: self.request_id(ids), reason: self.refusal() },
            3 => {
                let grantee = self.grantee(grantees);
                let next = self.bool().then(|| self.successor(grantees, ids, scale));
                DBody::Recall { key, grantee, next }
            }
            4 => DBody::Release {
                key,
                grantee: self.grantee(grantees),
                note: self.note(),
                recovered: self.bool(),
                passed: self.bool().then(|| self.grantee(grantees)),
            },
            10 => {
                let Successor { id, grantee, lease, .. } = self.successor(grantees, ids, scale);
                let (home, note, recovered) = (self.node(), self.note(), self.bool());
                DBody::Pass { key, home, id, grantee, lease, note, recovered }
            }
            5 => DBody::Check { key, id: self.request_id(ids).seq, token: self.token(grantees) },
            6 => {
                let answer = match self.index(5) {
                    0 => Ok(CheckAnswer::HeldNow),
                    1 => Ok(CheckAnswer::Superseded),
                    2 => Ok(CheckAnswer::NotHeld),
                    3 => Ok(CheckAnswer::UnknownKey),
                    _ => Err(self.refusal()),
                };
                DBody::CheckReply { key, id: self.request_id(ids).seq, answer }
            }
            9 => DBody::Probe {
                key,
                id: self.request_id(ids).seq,
                token: self.token(grantees),
                asker: self.node(),
            },
            7 => {
                let chain = self.range(0, 3);
                let ahead = (0..chain)
                    .map(|_| (self.successor(grantees, ids, scale), self.duration(scale)))
                    .collect();
                let live = self.bool().then(|| Handed {
                    holder: self.node(),
                    grantee: self.grantee(grantees),
                    id: self.request_id(ids),
                    remaining: self.duration(scale),
                    ahead,
                });
                DBody::Handover {
                    key,
                    live,
                    note: self.note(),
                    recovered: self.bool(),
                    lock_delay: self.duration(scale),
                }
            }
            _ => DBody::HandoverAck { key },
        };
        DMessage { epoch, body }
    }

    pub fn peer_frame(&mut self) -> PeerFrame {
        match self.index(3) {
            0 => PeerFrame::Hello {
                genesis_digest: [self.u8(); 32],
                ring_version: self.u32(),
                epoch: self.number_near(1, MAX_EPOCH),
            },
            1 => PeerFrame::Epoch(self.epoch_message(1, 1, &[])),
            _ => PeerFrame::Delegation(self.delegation_message(1, &[], &[], Duration::from_secs(1))),
        }
    }

    pub fn request(&mut self) -> Request {
        match self.index(9) {
            0 => Request::Lock {
                key: self.key(),
                ttl: self.duration(Duration::from_secs(1)),
                wait: self.duration(Duration::from_secs(1)),
            },
            1 => Request::Renew { handle: self.u64(), ttl: self.duration(Duration::from_secs(1)) },
            2 => Request::Unlock { handle: self.u64(), note: self.note() },
            3 => Request::Check { key: self.key(), token: self.token(&[]) },
            4 => Request::Status,
            5 => Request::EpochShow,
            6 => Request::Propose(Proposal { change: self.change(), force: self.bool() }),
            7 => {
                let members = self.members();
                let stopped = (0..self.index(3)).map(|_| self.node()).collect();
                Request::RecoverUnsafe { members, stopped, skip: self.number_near(1, MAX_EPOCH) }
            }
            _ => Request::Subscribe,
        }
    }
}
