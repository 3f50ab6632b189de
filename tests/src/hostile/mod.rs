//! Hostile load against a real node's transport (issue 12): the attacks that
//! tests/tests/hostile_load.rs asserts on and the `keyhome-hostile` long run measures.
//!
//! - [`attack`]: what an attacker does: many connections from one certificate, request streams
//!   that stall after a length prefix, handshakes with certificates the node refuses, replayed
//!   QUIC Initial packets (half-open handshakes from addresses that never answer), malformed
//!   requests.
//! - [`measure`]: what the node costs meanwhile: its RSS (from `/proc`), the bytes of log it
//!   wrote, and a control client that keeps locking and records each lock's latency.
//! - [`run`]: the probes of the long run (`keyhome-hostile`), each against a fresh cluster.
//!
//! Every target is a loopback address; attacks from their "own" address bind to another address
//! of 127.0.0.0/8.

pub mod attack;
pub mod measure;
pub mod run;

use std::net::SocketAddr;

use keyhome::pki::{self, Identity, Role};
use keyhome::setup;
use quinn::rustls::pki_types::CertificateDer;

use crate::cluster::Cluster;

/// What an attacker knows of node `node`.
pub struct Target {
    pub node: u64,
    pub addr: SocketAddr,
    /// The cluster CA, to verify the node.
    pub ca: Vec<CertificateDer<'static>>,
    /// A client certificate of the cluster (`client-mallory`): authenticated, but hostile.
    pub mallory: Identity,
    /// A client certificate with a valid role from another CA: the node must refuse it.
    pub stranger: Identity,
}

/// The identity `role` was issued in `cluster` (its certificate and key).
pub fn identity(cluster: &Cluster, role: &Role) -> Identity {
    let dir = setup::identity_dir(&cluster.dir, role);
    Identity::load(dir.join("cert.pem"), dir.join("key.pem"))
        .unwrap_or_else(|e| panic!("{role}'s identity: {e}"))
}

/// The client name of [`Target::mallory`].
pub const MALLORY: &str = "mallory";

impl Target {
    /// Node `node` of `cluster`; issues the `mallory` certificate on first use.
    pub fn new(cluster: &Cluster, node: u64) -> Target {
        let role = Role::Client(MALLORY.into());
        let dir = setup::identity_dir(&cluster.dir, &role);
        if !dir.join("cert.pem").exists() {
            let ca = setup::load_ca(&cluster.dir).expect("the cluster CA");
            setup::issue(&cluster.dir, &ca, &role).expect("issue mallory's certificate");
        }
        let mallory = identity(cluster, &role);
        let other_ca = pki::generate_ca("not the cluster CA").expect("a CA");
        let stranger = pki::issue(&other_ca, &Role::Client("app".into()))
            .and_then(|issued| issued.identity())
            .expect("a stranger's identity");
        Target {
            node,
            addr: cluster.addr(node),
            ca: pki::load_ca(cluster.dir.join("ca.pem")).expect("the cluster CA certificate"),
            mallory,
            stranger,
        }
    }
}
