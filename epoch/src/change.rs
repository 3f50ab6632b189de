//! Operator changes: what an operator may ask of the next epoch, and the checks it must pass.

use keyhome_ring::NodeId;
use serde::{Deserialize, Serialize};

use crate::record::{EpochRecord, Member, RecordError, Timing};

/// One operator change, applied to the current epoch to form the proposed next one.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Change {
    /// Add a member.
    Add(Member),
    /// Remove a member.
    Remove(NodeId),
    /// Replace member `old` by `new` in one step.
    Replace { old: NodeId, new: Member },
    /// Change the timing.
    SetTiming(Timing),
}

/// Why an operator change cannot apply to the current epoch.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ChangeError {
    #[error("node {0} is already a member")]
    AlreadyMember(NodeId),
    #[error("node {0} is not a member")]
    NotMember(NodeId),
    #[error("removing the last member would leave an empty cluster")]
    LastMember,
    #[error("address {addr} is already used by node {member}")]
    AddressInUse { addr: String, member: NodeId },
    #[error("the change leaves the epoch as it is")]
    NoOp,
    #[error("the resulting epoch is invalid: {0}")]
    Invalid(#[from] RecordError),
}

impl Change {
    /// Whether `record` already has what this change asks for (so it needs no epoch of its own).
    pub fn is_reflected_in(&self, record: &EpochRecord) -> bool {
        let has = |m: &Member| record.members.iter().any(|r| r == m);
        match self {
            Change::Add(m) => has(m),
            Change::Remove(id) => !record.is_member(*id),
            Change::Replace { old, new } => has(new) && (old == &new.id || !record.is_member(*old)),
            Change::SetTiming(t) => record.timing == *t,
        }
    }

    /// The members and timing of the epoch that follows `current` under this change.
    ///
    /// The result is a valid record except for `activation_wait`, which the proposer sets.
    pub fn apply(&self, current: &EpochRecord) -> Result<EpochRecord, ChangeError> {
        let mut members = current.members.clone();
        let mut timing = current.timing;
        match self {
            Change::Add(m) => {
                if current.is_member(m.id) {
                    return Err(ChangeError::AlreadyMember(m.id));
                }
                address_free(current, m, None)?;
                members.push(m.clone());
            }
            Change::Remove(id) => {
                if !current.is_member(*id) {
                    return Err(ChangeError::NotMember(*id));
                }
                if members.len() == 1 {
                    return Err(ChangeError::LastMember);
                }
                members.retain(|m| m.id != *id);
            }
            Change::Replace { old, new } => {
                if !current.is_member(*old) {
                    return Err(ChangeError::NotMember(*old));
                }
                if old != &new.id && current.is_member(new.id) {
                    return Err(ChangeError::AlreadyMember(new.id));
                }
                address_free(current, new, Some(*old))?;
                members.retain(|m| m.id != *old);
                members.push(new.clone());
            }
            Change::SetTiming(t) => {
                if *t == current.timing {
                    return Err(ChangeError::NoOp);
                }
                timing = *t;
            }
        }
        members.sort_by_key(|m| m.id);
        let next = EpochRecord {
            number: current.number + 1,
            retired: current.retired_after(&members),
            members,
            ring_version: current.ring_version,
            timing,
            activation_wait: current.activation_wait,
        };
        if next.members == current.members && next.timing == current.timing {
            return Err(ChangeError::NoOp);
        }
        next.validate()?;
        Ok(next)
    }
}

/// Refuses `new`'s address if a member of `current` other than `leaving` has it, naming that
/// member.
fn address_free(current: &EpochRecord, new: &Member, leaving: Option<NodeId>) -> Result<(), ChangeError> {
    match current.members.iter().find(|m| m.addr == new.addr && Some(m.id) != leaving) {
        Some(holder) => Err(ChangeError::AddressInUse { addr: new.addr.clone(), member: holder.id }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::tests::members;

    fn genesis() -> EpochRecord {
        EpochRecord::genesis(members(&[1, 2, 3]), Timing::DEFAULT).unwrap()
    }

    #[test]
    fn add_remove_replace() {
        let g = genesis();
        let added = Change::Add(members(&[4])[0].clone()).apply(&g).unwrap();
        assert_eq!(added.number, 2);
        assert_eq!(added.members.len(), 4);
        let removed = Change::Remove(NodeId(2)).apply(&g).unwrap();
        assert!(!removed.is_member(NodeId(2)));
        let replaced = Change::Replace { old: NodeId(1), new: members(&[9])[0].clone() }.apply(&g).unwrap();
        assert_eq!(replaced.member_ids().collect::<Vec<_>>(), vec![NodeId(2), NodeId(3), NodeId(9)]);
        // Replacing a member by itself at a new address is allowed.
        let moved =
            Change::Replace { old: NodeId(1), new: Member { id: NodeId(1), addr: "10.0.0.1:1".into() } };
        assert_eq!(moved.apply(&g).unwrap().members[0].addr, "10.0.0.1:1");
    }

    /// A member left out of the next epoch is retired, one named again is not, and the record
    /// remembers at most `MAX_RETIRED`, forgetting the longest retired first.
    #[test]
    fn removed_members_are_retired_until_named_again() {
        use crate::record::MAX_RETIRED;
        let g = genesis();
        let removed = Change::Remove(NodeId(2)).apply(&g).unwrap();
        assert_eq!(removed.retired, vec![NodeId(2)]);
        let replaced =
            Change::Replace { old: NodeId(1), new: members(&[9])[0].clone() }.apply(&removed).unwrap();
        assert_eq!(replaced.retired, vec![NodeId(2), NodeId(1)]);
        let back = Change::Add(members(&[2])[0].clone()).apply(&replaced).unwrap();
        assert_eq!(back.retired, vec![NodeId(1)]);
        let moved =
            Change::Replace { old: NodeId(3), new: Member { id: NodeId(3), addr: "10.0.0.3:1".into() } };
        assert_eq!(moved.apply(&back).unwrap().retired, vec![NodeId(1)], "a member moved is not retired");
        let mut full = g.clone();
        full.retired = (100..100 + MAX_RETIRED as u64).map(NodeId).collect();
        let next = Change::Remove(NodeId(3)).apply(&full).unwrap();
        assert_eq!(next.retired.len(), MAX_RETIRED);
        assert_eq!((next.retired[0], next.retired[MAX_RETIRED - 1]), (NodeId(101), NodeId(3)));
    }

    #[test]
    fn clear_errors() {
        let g = genesis();
        assert_eq!(
            Change::Add(members(&[2])[0].clone()).apply(&g),
            Err(ChangeError::AlreadyMember(NodeId(2)))
        );
        assert_eq!(Change::Remove(NodeId(7)).apply(&g), Err(ChangeError::NotMember(NodeId(7))));
        assert_eq!(Change::SetTiming(Timing::DEFAULT).apply(&g), Err(ChangeError::NoOp));
        let clash = Member { id: NodeId(8), addr: g.members[0].addr.clone() };
        let in_use = ChangeError::AddressInUse { addr: clash.addr.clone(), member: NodeId(1) };
        assert_eq!(Change::Add(clash.clone()).apply(&g), Err(in_use.clone()));
        assert_eq!(Change::Replace { old: NodeId(2), new: clash.clone() }.apply(&g), Err(in_use));
        // The member being replaced may hand its address on.
        assert!(Change::Replace { old: NodeId(1), new: clash }.apply(&g).is_ok());
        let one = EpochRecord::genesis(members(&[1]), Timing::DEFAULT).unwrap();
        assert_eq!(Change::Remove(NodeId(1)).apply(&one), Err(ChangeError::LastMember));
        let bad = Timing { home_lease: std::time::Duration::ZERO, ..Timing::DEFAULT };
        assert!(matches!(
            Change::SetTiming(bad).apply(&g),
            Err(ChangeError::Invalid(RecordError::HomeLease(_)))
        ));
    }
}
