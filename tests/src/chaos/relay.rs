//! The network the nemesis controls: one UDP relay per node, in the test process. The genesis gives
//! node `b` its relay's address, so every packet between two nodes crosses a relay: node `a`
//! dials `b` from its own port to `b`'s relay, which forwards from a socket of its own kept for
//! `a` (so `b`'s answers come back through it). Each packet's direction is therefore known, and
//! [`Faults`] can cut, drop or delay it per directed link. Nodes identify peers by certificate,
//! never by address, so the relayed source addresses change nothing for them. Clients reach
//! nodes directly.
//!
//! Only loopback sockets of this process are ever bound or addressed.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio::task::JoinHandle;

use crate::rng::Rng;

/// Largest UDP payload.
const MAX_DATAGRAM: usize = 65_535;

/// What happens to packets on one directed link.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LinkFault {
    /// Every packet is dropped.
    pub cut: bool,
    /// Probability that a packet is dropped.
    pub loss: f64,
    /// Each packet is held for a uniform delay in `0..=delay` (so packets also reorder).
    pub delay: Duration,
}

/// The faults of every directed link between nodes `1..=n`.
#[derive(Clone, Debug)]
pub struct Faults {
    n: u64,
    links: Vec<LinkFault>,
}

impl Faults {
    fn new(n: u64) -> Faults {
        Faults { n, links: vec![LinkFault::default(); (n * n) as usize] }
    }

    fn index(&self, from: u64, to: u64) -> usize {
        ((from - 1) * self.n + (to - 1)) as usize
    }

    pub fn link(&self, from: u64, to: u64) -> LinkFault {
        self.links[self.index(from, to)]
    }

    pub fn set(&mut self, from: u64, to: u64, fault: LinkFault) {
        let i = self.index(from, to);
        self.links[i] = fault;
    }

    /// Cuts every link from a node of `from` to a node of `to`.
    pub fn cut(&mut self, from: &[u64], to: &[u64]) {
        for &a in from {
            for &b in to {
                if a != b {
                    let i = self.index(a, b);
                    self.links[i].cut = true;
                }
            }
        }
    }

    /// Every link works again.
    pub fn heal(&mut self) {
        self.links.fill(LinkFault::default());
    }
}

/// The running relays; dropping it stops them.
pub struct Relay {
    faults: Arc<Mutex<Faults>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Relay {
    /// Starts a relay for each `(node, listen address, relay socket)` in `nodes` (ids `1..=n`); the
    /// relay socket is bound already, at the address the genesis gives the node.
    pub async fn start(
        nodes: Vec<(u64, SocketAddr, std::net::UdpSocket)>,
        seed: u64,
    ) -> std::io::Result<Relay> {
        let faults = Arc::new(Mutex::new(Faults::new(nodes.len() as u64)));
        let listens: Arc<Vec<(u64, SocketAddr)>> =
            Arc::new(nodes.iter().map(|&(id, l, _)| (id, l)).collect());
        let mut tasks = Vec::new();
        for (to, to_listen, relay_socket) in nodes {
            relay_socket.set_nonblocking(true)?;
            let front = Arc::new(UdpSocket::from_std(relay_socket)?);
            // One socket per dialing peer, connected to the node behind this relay.
            let mut uplinks = Vec::new();
            for &(from, from_listen) in listens.iter().filter(|(id, _)| *id != to) {
                let up = Arc::new(UdpSocket::bind("127.0.0.1:0").await?);
                up.connect(to_listen).await?;
                let back = Forward {
                    out: Arc::clone(&front),
                    dest: Some(from_listen),
                    from: to,
                    to: from,
                    faults: Arc::clone(&faults),
                    rng: Rng::new(seed ^ (to << 32) ^ from ^ 0xbac),
                };
                tasks.push(tokio::spawn(back.run(Arc::clone(&up))));
                uplinks.push((from, from_listen, up));
            }
            tasks.push(tokio::spawn(front_loop(front, uplinks, to, Arc::clone(&faults), seed ^ to)));
        }
        Ok(Relay { faults, tasks })
    }

    /// Changes the faults.
    pub fn faults(&self, f: impl FnOnce(&mut Faults)) {
        f(&mut self.faults.lock().unwrap_or_else(|p| p.into_inner()));
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Packets arriving at node `to`'s relay: from each peer's port, forwarded to `to` through the
/// socket kept for that peer. Packets from anywhere else are dropped.
async fn front_loop(
    front: Arc<UdpSocket>,
    uplinks: Vec<(u64, SocketAddr, Arc<UdpSocket>)>,
    to: u64,
    faults: Arc<Mutex<Faults>>,
    seed: u64,
) {
    let mut forwards: Vec<(SocketAddr, Forward)> = uplinks
        .into_iter()
        .map(|(from, from_listen, up)| {
            let rng = Rng::new(seed ^ (from << 32));
            (from_listen, Forward { out: up, dest: None, from, to, faults: Arc::clone(&faults), rng })
        })
        .collect();
    let mut buf = vec![0u8; MAX_DATAGRAM];
    loop {
        // Errors (an ICMP "port unreachable" of a stopped node, say) end no relay.
        let Ok((len, src)) = front.recv_from(&mut buf).await else { continue };
        if let Some((_, forward)) = forwards.iter_mut().find(|(addr, _)| *addr == src) {
            forward.send(&buf[..len]);
        }
    }
}

/// One direction of one link: decides each packet's fate and sends the survivors.
struct Forward {
    out: Arc<UdpSocket>,
    /// `None` for a connected socket.
    dest: Option<SocketAddr>,
    from: u64,
    to: u64,
    faults: Arc<Mutex<Faults>>,
    rng: Rng,
}

impl Forward {
    /// Answers from the node behind the relay, on `up`, back to the peer that dialed it.
    async fn run(mut self, up: Arc<UdpSocket>) {
        let mut buf = vec![0u8; MAX_DATAGRAM];
        loop {
            let Ok(len) = up.recv(&mut buf).await else { continue };
            self.send(&buf[..len]);
        }
    }

    fn send(&mut self, packet: &[u8]) {
        let fault = self.faults.lock().unwrap_or_else(|p| p.into_inner()).link(self.from, self.to);
        if fault.cut || (fault.loss > 0.0 && self.rng.chance(fault.loss)) {
            return;
        }
        let delay = Duration::from_micros(self.rng.range(0, fault.delay.as_micros() as u64));
        if delay.is_zero() {
            let _ = send_to(&self.out, self.dest, packet);
            return;
        }
        let (out, dest, packet) = (Arc::clone(&self.out), self.dest, packet.to_vec());
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = send_to(&out, dest, &packet);
        });
    }
}

/// Sends without waiting: a full socket buffer drops the packet, as a congested link would.
fn send_to(socket: &UdpSocket, dest: Option<SocketAddr>, packet: &[u8]) -> std::io::Result<usize> {
    match dest {
        Some(dest) => socket.try_send_to(packet, dest),
        None => socket.try_send(packet),
    }
}
