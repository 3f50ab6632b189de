//! Noticing two processes that run as one node id.
//!
//! Each node keeps exactly one connection to each peer it sends to, dialled from its own
//! `listen` socket (runtime.rs, "Peer links"), so every live connection a node accepts from peer
//! `p` comes from one address. Two live connections authenticated as `p` from two different
//! addresses mean two processes hold `p`'s certificate and run at once, which the guarantees
//! forbid (guarantees.md, A2): that is logged as an error each time it is seen, counted, and
//! shown in `keyhome status` while both connections live ([`PeerConnections::duplicates`]). (A restarted
//! peer dials from the same address while its old connection may linger until the idle
//! timeout; that is not reported.)

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use keyhome_epoch::NodeId;

use crate::runtime::lock;
use crate::status::DuplicateId;

/// The live accepted peer connections of one node, by peer id.
#[derive(Default)]
pub struct PeerConnections {
    next: AtomicU64,
    live: Mutex<HashMap<NodeId, Vec<(u64, SocketAddr)>>>,
}

/// A registered connection; dropping it (when the connection ends) forgets it.
pub struct Registered<'a> {
    /// The address of another live connection claiming the same id, when there was one.
    pub other: Option<SocketAddr>,
    conns: &'a PeerConnections,
    peer: NodeId,
    serial: u64,
}

impl PeerConnections {
    /// Registers a connection authenticated as `peer` from `remote`; [`Registered::other`] names
    /// another live connection claiming `peer` from a different address, if there is one (the
    /// caller reports it: two processes run as one node).
    pub fn register(&self, peer: NodeId, remote: SocketAddr) -> Registered<'_> {
        let serial = self.next.fetch_add(1, Ordering::Relaxed);
        let mut live = lock(&self.live);
        let conns = live.entry(peer).or_default();
        let other = conns.iter().map(|(_, addr)| *addr).find(|addr| *addr != remote);
        conns.push((serial, remote));
        Registered { other, conns: self, peer, serial }
    }

    /// The ids live connections from more than one address claim now, for `keyhome status`.
    pub fn duplicates(&self) -> Vec<DuplicateId> {
        let live = lock(&self.live);
        let mut found: Vec<DuplicateId> = (live.iter())
            .filter_map(|(peer, conns)| {
                let mut addrs: Vec<SocketAddr> = Vec::new();
                for (_, addr) in conns {
                    if !addrs.contains(addr) {
                        addrs.push(*addr);
                    }
                }
                (addrs.len() > 1).then(|| DuplicateId {
                    id: peer.0,
                    addrs: addrs.iter().map(ToString::to_string).collect(),
                })
            })
            .collect();
        found.sort_by_key(|d| d.id);
        found
    }
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        let mut live = lock(&self.conns.live);
        if let Some(conns) = live.get_mut(&self.peer) {
            conns.retain(|(serial, _)| *serial != self.serial);
            if conns.is_empty() {
                live.remove(&self.peer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_live_address_for_one_id_is_reported() {
        let conns = PeerConnections::default();
        let a: SocketAddr = "127.0.0.1:7001".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:7101".parse().unwrap();
        let first = conns.register(NodeId(1), a);
        assert_eq!(first.other, None);
        let reconnect = conns.register(NodeId(1), a);
        assert_eq!(reconnect.other, None, "a reconnection from the same address is no duplicate");
        assert_eq!(conns.register(NodeId(2), b).other, None, "another id");
        assert!(conns.duplicates().is_empty());
        let impostor = conns.register(NodeId(1), b);
        assert_eq!(impostor.other, Some(a));
        assert_eq!(
            conns.duplicates(),
            vec![DuplicateId { id: 1, addrs: vec![a.to_string(), b.to_string()] }],
            "shown in the status, the first connection's address first"
        );
        drop((first, reconnect));
        assert_eq!(conns.register(NodeId(1), b).other, None, "ended connections are forgotten");
        drop(impostor);
        assert_eq!(conns.register(NodeId(1), a).other, None);
    }
}
