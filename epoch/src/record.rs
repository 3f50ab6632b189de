//! The epoch record: what one membership epoch fixes, and the checks every received record passes.

use std::time::Duration;

use keyhome_ring::{NodeId, ROUTING_VERSION, Ring};
use serde::{Deserialize, Serialize};

use crate::time::rate_margin;

/// Most members an epoch may name.
pub const MAX_MEMBERS: usize = 1024;

/// Retired nodes a record remembers at most; past it the longest retired is forgotten.
pub const MAX_RETIRED: usize = 1024;
/// Longest member address, in bytes.
pub const MAX_ADDR_LEN: usize = 255;
/// Shortest home lease an epoch may set.
pub const MIN_HOME_LEASE: Duration = Duration::from_millis(10);
/// Longest home lease or delegation lease an epoch may set.
pub const MAX_LEASE: Duration = Duration::from_secs(3600);
/// Largest clock-rate bound an epoch may set: 10 %.
pub const MAX_CLOCK_RATE_PPM: u32 = 100_000;
/// Largest epoch number (2^62): far beyond any cluster's life (an epoch a nanosecond for over a
/// century), and far enough below `u64::MAX` that no arithmetic on an epoch number, or on an
/// unsafe recovery's skip past one, can overflow. Records and messages above it are refused.
pub const MAX_EPOCH: u64 = 1 << 62;

/// Longest activation wait a record may carry: the longest [`Timing::fence_bound`] of any valid
/// timing. A proposer sets a record's wait to the current epoch's fence bound or carries the
/// current record's wait forward, so no valid record's wait exceeds it.
pub fn max_activation_wait() -> Duration {
    rate_margin(MAX_LEASE.saturating_mul(2), MAX_CLOCK_RATE_PPM)
}

/// One member of an epoch: its identity (from its certificate) and where peers reach it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Member {
    pub id: NodeId,
    /// `host:port` of the member's peer endpoint.
    pub addr: String,
}

/// The timing every member of an epoch runs by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Timing {
    /// How long a home lease lasts, counted by the holder from the instant it sent the request.
    pub home_lease: Duration,
    /// The longest delegation a home may grant under this epoch.
    pub max_delegation_lease: Duration,
    /// Bound on how far any node's clock rate may stray from real time, in parts per million.
    pub clock_rate_ppm: u32,
}

impl Timing {
    /// Defaults for a production cluster: 10 s home lease, 30 s delegations, 1 % clock-rate bound.
    pub const DEFAULT: Timing = Timing {
        home_lease: Duration::from_secs(10),
        max_delegation_lease: Duration::from_secs(30),
        clock_rate_ppm: 10_000,
    };

    /// How long, on any node's own clock, a grant made under this epoch can stay live after the
    /// next epoch is chosen: a home lease (the last one renewed before the choice) plus a
    /// delegation granted at its very end, both widened by the clock-rate bound. A node that
    /// becomes the home of a key in the next epoch waits this long after learning it.
    pub fn fence_bound(&self) -> Duration {
        rate_margin(self.home_lease.saturating_add(self.max_delegation_lease), self.clock_rate_ppm)
    }

    /// Checks the ranges; see the `MIN_`/`MAX_` constants.
    pub fn validate(&self) -> Result<(), RecordError> {
        if self.home_lease < MIN_HOME_LEASE || self.home_lease > MAX_LEASE {
            return Err(RecordError::HomeLease(self.home_lease));
        }
        if self.max_delegation_lease.is_zero() || self.max_delegation_lease > MAX_LEASE {
            return Err(RecordError::DelegationLease(self.max_delegation_lease));
        }
        if self.clock_rate_ppm > MAX_CLOCK_RATE_PPM {
            return Err(RecordError::ClockRate(self.clock_rate_ppm));
        }
        Ok(())
    }
}

impl Default for Timing {
    fn default() -> Timing {
        Timing::DEFAULT
    }
}

/// One membership epoch, as chosen by the agreement among the previous epoch's members.
///
/// Invariants (checked by [`EpochRecord::validate`]): `1 <= number <= MAX_EPOCH`; members sorted
/// by id, ids unique, 1 to [`MAX_MEMBERS`] of them, addresses non-empty and at most
/// [`MAX_ADDR_LEN`] bytes; timing in range; activation wait at most [`max_activation_wait`].
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EpochRecord {
    /// Epoch number; the genesis is 1.
    pub number: u64,
    pub members: Vec<Member>,
    /// The ring algorithm every member routes by ([`keyhome_ring::ROUTING_VERSION`]).
    pub ring_version: u32,
    pub timing: Timing,
    /// How long a node waits, on its own clock, after learning this epoch before it acts as home
    /// of a key whose home it was not in the epoch before: long enough that every home lease of an
    /// earlier epoch has run out everywhere. Zero for the genesis.
    pub activation_wait: Duration,
    /// Nodes an earlier epoch removed and none named since, longest retired first, at most
    /// [`MAX_RETIRED`]: a node that knows this record adopts no epoch a retired node tells it of,
    /// so a removed node's certificate can no longer install a made-up epoch (an epoch that names
    /// the node again un-retires it).
    pub retired: Vec<NodeId>,
}

/// An epoch record as encoded before `retired` existed (store schema 1): what an old store holds,
/// and what a record with none retired hashes as ([`EpochRecord::digest`]). `M` is the members'
/// container: owned to decode, borrowed to encode (both encode alike).
#[derive(Serialize, Deserialize)]
pub struct RecordV1<M = Vec<Member>> {
    pub number: u64,
    pub members: M,
    pub ring_version: u32,
    pub timing: Timing,
    pub activation_wait: Duration,
}

impl From<RecordV1> for EpochRecord {
    /// The record with none retired.
    fn from(r: RecordV1) -> EpochRecord {
        let (number, members, ring_version, timing) = (r.number, r.members, r.ring_version, r.timing);
        EpochRecord {
            number,
            members,
            ring_version,
            timing,
            activation_wait: r.activation_wait,
            retired: Vec::new(),
        }
    }
}

/// Why a record, or a change to one, is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("epoch number 0 is not valid; the genesis is epoch 1")]
    ZeroNumber,
    #[error("epoch number {0} exceeds the largest, {MAX_EPOCH}")]
    NumberTooLarge(u64),
    #[error("activation wait {} ms exceeds the longest any valid timing needs", .0.as_millis())]
    ActivationWait(Duration),
    #[error("an epoch needs at least one member")]
    NoMembers,
    #[error("an epoch may have at most {MAX_MEMBERS} members, not {0}")]
    TooManyMembers(usize),
    #[error("node {0} is listed twice")]
    DuplicateMember(NodeId),
    #[error("node {0} is both a member and retired, or retired twice")]
    Retired(NodeId),
    #[error("an epoch may name at most {MAX_RETIRED} retired nodes, not {0}")]
    TooManyRetired(usize),
    #[error("members must be sorted by id")]
    Unsorted,
    #[error("node {id} has an empty address or one longer than {MAX_ADDR_LEN} bytes")]
    BadAddress { id: NodeId },
    #[error("members {first} and {second} both have the address {addr}")]
    AddressInUse { first: NodeId, second: NodeId, addr: String },
    #[error("ring version {0} differs from this binary's {ROUTING_VERSION}")]
    RingVersion(u32),
    #[error("home lease {} ms is outside 10 ms ..= 1 h", .0.as_millis())]
    HomeLease(Duration),
    #[error("delegation lease {} ms is outside (0, 1 h]", .0.as_millis())]
    DelegationLease(Duration),
    #[error("clock-rate bound {0} ppm exceeds {MAX_CLOCK_RATE_PPM} ppm")]
    ClockRate(u32),
}

impl EpochRecord {
    /// The genesis epoch: number 1 with the given members (sorted by id here) and timing.
    pub fn genesis(mut members: Vec<Member>, timing: Timing) -> Result<EpochRecord, RecordError> {
        members.sort_by_key(|m| m.id);
        let record = EpochRecord {
            number: 1,
            members,
            ring_version: ROUTING_VERSION,
            timing,
            activation_wait: Duration::ZERO,
            retired: Vec::new(),
        };
        record.validate()?;
        Ok(record)
    }

    /// Checks every invariant; run on each record that arrives from the network or a file.
    pub fn validate(&self) -> Result<(), RecordError> {
        if self.number == 0 {
            return Err(RecordError::ZeroNumber);
        }
        if self.number > MAX_EPOCH {
            return Err(RecordError::NumberTooLarge(self.number));
        }
        if self.activation_wait > max_activation_wait() {
            return Err(RecordError::ActivationWait(self.activation_wait));
        }
        if self.members.is_empty() {
            return Err(RecordError::NoMembers);
        }
        if self.members.len() > MAX_MEMBERS {
            return Err(RecordError::TooManyMembers(self.members.len()));
        }
        for pair in self.members.windows(2) {
            if pair[0].id == pair[1].id {
                return Err(RecordError::DuplicateMember(pair[0].id));
            }
            if pair[0].id > pair[1].id {
                return Err(RecordError::Unsorted);
            }
        }
        for m in &self.members {
            if m.addr.is_empty() || m.addr.len() > MAX_ADDR_LEN {
                return Err(RecordError::BadAddress { id: m.id });
            }
        }
        let mut addrs: Vec<(&str, NodeId)> = self.members.iter().map(|m| (m.addr.as_str(), m.id)).collect();
        addrs.sort_unstable();
        if let Some(pair) = addrs.windows(2).find(|p| p[0].0 == p[1].0) {
            let (first, second) = (pair[0].1, pair[1].1);
            return Err(RecordError::AddressInUse { first, second, addr: pair[1].0.to_owned() });
        }
        if self.retired.len() > MAX_RETIRED {
            return Err(RecordError::TooManyRetired(self.retired.len()));
        }
        let mut retired = self.retired.clone();
        retired.sort_unstable();
        if let Some(&id) = retired.windows(2).find(|p| p[0] == p[1]).map(|p| &p[0]) {
            return Err(RecordError::Retired(id));
        }
        if let Some(&id) = self.retired.iter().find(|&&id| self.is_member(id)) {
            return Err(RecordError::Retired(id));
        }
        if self.ring_version != ROUTING_VERSION {
            return Err(RecordError::RingVersion(self.ring_version));
        }
        self.timing.validate()
    }

    /// Whether an earlier epoch removed `id` and none named it since (as far as this record
    /// remembers: [`MAX_RETIRED`]).
    pub fn is_retired(&self, id: NodeId) -> bool {
        self.retired.contains(&id)
    }

    /// The retired nodes of the epoch after this one, whose members are `next`: this record's,
    /// less those `next` names again, then this record's members `next` leaves out; the longest
    /// retired forgotten past [`MAX_RETIRED`].
    pub fn retired_after(&self, next: &[Member]) -> Vec<NodeId> {
        let named = |id: &NodeId| next.iter().any(|m| m.id == *id);
        let mut retired: Vec<NodeId> = self.retired.iter().copied().filter(|id| !named(id)).collect();
        retired.extend(self.member_ids().filter(|id| !named(id)));
        let excess = retired.len().saturating_sub(MAX_RETIRED);
        retired.drain(..excess);
        retired
    }

    /// A digest of the whole record that peers compare (the genesis digest in particular). A
    /// record with none retired is hashed as it was encoded before `retired` existed, so a
    /// genesis (none retired) has the same digest for every version.
    pub fn digest(&self) -> [u8; 32] {
        let mut hasher = blake3::Hasher::new_derive_key("keyhome epoch record v1");
        // postcard encoding of plain data into a Vec cannot fail.
        let bytes = if self.retired.is_empty() {
            postcard::to_stdvec(&RecordV1 {
                number: self.number,
                members: &self.members[..],
                ring_version: self.ring_version,
                timing: self.timing,
                activation_wait: self.activation_wait,
            })
        } else {
            postcard::to_stdvec(self)
        }
        .unwrap_or_default();
        hasher.update(&bytes);
        *hasher.finalize().as_bytes()
    }

    /// Whether `id` is a member.
    pub fn is_member(&self, id: NodeId) -> bool {
        self.members.binary_search_by_key(&id, |m| m.id).is_ok()
    }

    /// The member ids, sorted.
    pub fn member_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.members.iter().map(|m| m.id)
    }

    /// How many members make a majority.
    pub fn majority(&self) -> usize {
        self.members.len() / 2 + 1
    }

    /// The home ring of this epoch.
    pub fn ring(&self) -> Ring {
        Ring::new(&self.member_ids().collect::<Vec<_>>())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn members(ids: &[u64]) -> Vec<Member> {
        ids.iter().map(|&id| Member { id: NodeId(id), addr: format!("127.0.0.1:{}", 7000 + id) }).collect()
    }

    #[test]
    fn genesis_sorts_and_validates() {
        let g = EpochRecord::genesis(members(&[3, 1, 2]), Timing::DEFAULT).unwrap();
        assert_eq!(g.number, 1);
        assert_eq!(g.member_ids().collect::<Vec<_>>(), vec![NodeId(1), NodeId(2), NodeId(3)]);
        assert_eq!(g.majority(), 2);
        assert!(g.is_member(NodeId(2)) && !g.is_member(NodeId(4)));
    }

    /// A record with none retired hashes as before `retired` existed (its encoding less the
    /// empty list's length byte), so every version agrees on a genesis digest.
    #[test]
    fn the_digest_of_a_record_with_none_retired_is_unchanged() {
        let g = EpochRecord::genesis(members(&[1, 2]), Timing::DEFAULT).unwrap();
        let mut encoded = postcard::to_stdvec(&g).unwrap();
        assert_eq!(encoded.pop(), Some(0), "the empty list ends the encoding");
        let mut hasher = blake3::Hasher::new_derive_key("keyhome epoch record v1");
        hasher.update(&encoded);
        assert_eq!(g.digest(), *hasher.finalize().as_bytes());
        let retired = EpochRecord { retired: vec![NodeId(9)], ..g.clone() };
        assert_ne!(retired.digest(), g.digest());
    }

    #[test]
    fn retired_nodes_are_bounded_unique_and_not_members() {
        let g = EpochRecord::genesis(members(&[1, 2]), Timing::DEFAULT).unwrap();
        let with = |retired: Vec<u64>| EpochRecord {
            retired: retired.into_iter().map(NodeId).collect(),
            ..g.clone()
        };
        assert_eq!(with(vec![5, 4]).validate(), Ok(()));
        assert_eq!(with(vec![2]).validate(), Err(RecordError::Retired(NodeId(2))));
        assert_eq!(with(vec![4, 5, 4]).validate(), Err(RecordError::Retired(NodeId(4))));
        let many = (10..11 + MAX_RETIRED as u64).collect();
        assert_eq!(with(many).validate(), Err(RecordError::TooManyRetired(MAX_RETIRED + 1)));
    }

    #[test]
    fn invalid_records_are_refused() {
        assert_eq!(EpochRecord::genesis(vec![], Timing::DEFAULT), Err(RecordError::NoMembers));
        assert_eq!(
            EpochRecord::genesis(members(&[1, 1]), Timing::DEFAULT),
            Err(RecordError::DuplicateMember(NodeId(1)))
        );
        let mut bad = members(&[1]);
        bad[0].addr = "x".repeat(MAX_ADDR_LEN + 1);
        assert_eq!(
            EpochRecord::genesis(bad, Timing::DEFAULT),
            Err(RecordError::BadAddress { id: NodeId(1) })
        );
        let mut shared = members(&[1, 5, 3]);
        shared[2].addr = shared[0].addr.clone();
        let addr = shared[0].addr.clone();
        assert_eq!(
            EpochRecord::genesis(shared, Timing::DEFAULT),
            Err(RecordError::AddressInUse { first: NodeId(1), second: NodeId(3), addr }),
            "both members named"
        );
        let timing = Timing { clock_rate_ppm: MAX_CLOCK_RATE_PPM + 1, ..Timing::DEFAULT };
        assert!(matches!(EpochRecord::genesis(members(&[1]), timing), Err(RecordError::ClockRate(_))));
        let mut g = EpochRecord::genesis(members(&[1, 2]), Timing::DEFAULT).unwrap();
        g.members.swap(0, 1);
        assert_eq!(g.validate(), Err(RecordError::Unsorted));
    }

    #[test]
    fn numbers_and_waits_near_the_limits_are_refused() {
        let g = EpochRecord::genesis(members(&[1, 2]), Timing::DEFAULT).unwrap();
        let with_number = |number| EpochRecord { number, ..g.clone() };
        assert_eq!(with_number(MAX_EPOCH).validate(), Ok(()));
        assert_eq!(with_number(MAX_EPOCH + 1).validate(), Err(RecordError::NumberTooLarge(MAX_EPOCH + 1)));
        assert_eq!(with_number(u64::MAX).validate(), Err(RecordError::NumberTooLarge(u64::MAX)));
        // The longest wait a proposer can set is allowed; anything longer is not.
        let slowest = Timing {
            home_lease: MAX_LEASE,
            max_delegation_lease: MAX_LEASE,
            clock_rate_ppm: MAX_CLOCK_RATE_PPM,
        };
        let longest = EpochRecord { timing: slowest, activation_wait: slowest.fence_bound(), ..g.clone() };
        assert_eq!(longest.validate(), Ok(()));
        let wait = max_activation_wait() + Duration::from_nanos(1);
        let too_long = EpochRecord { activation_wait: wait, ..g };
        assert_eq!(too_long.validate(), Err(RecordError::ActivationWait(wait)));
    }

    #[test]
    fn digest_covers_every_field() {
        let g = EpochRecord::genesis(members(&[1, 2, 3]), Timing::DEFAULT).unwrap();
        let mut other = g.clone();
        other.timing.clock_rate_ppm += 1;
        assert_ne!(g.digest(), other.digest());
        assert_eq!(g.digest(), g.clone().digest());
    }
}
