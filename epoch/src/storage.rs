//! What a node keeps across restarts, and the trait its drivers store it through.
//!
//! The core never writes by itself: it hands [`Write`]s to its driver in a
//! [`Ready`](crate::node::Ready), and the driver makes them durable through a [`Storage`] before it
//! sends the messages that depend on them.

use serde::{Deserialize, Serialize};

use crate::paxos::AcceptorState;
use crate::record::EpochRecord;

/// One durable change.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Write {
    /// The node's newest learned epoch, which is also its floor: it never acts under a lower one.
    /// Acceptor state for earlier slots is void once this is written.
    Epoch(EpochRecord),
    /// Acceptor state for `slot` (always the current epoch's number + 1).
    Acceptor { slot: u64, state: AcceptorState<EpochRecord> },
    /// The incarnation of the run that is starting.
    Incarnation(u64),
}

/// Everything a node keeps across restarts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Durable {
    /// Digest of the genesis epoch, compared with every peer.
    pub genesis_digest: [u8; 32],
    /// The newest epoch learned: the floor.
    pub current: EpochRecord,
    /// Acceptor state for slot `current.number + 1`.
    pub acceptor: AcceptorState<EpochRecord>,
    /// The incarnation of the last run that started; the next run uses a larger one.
    pub incarnation: u64,
}

impl Durable {
    /// The state of a node that has only the genesis epoch.
    pub fn genesis(genesis: EpochRecord) -> Durable {
        Durable {
            genesis_digest: genesis.digest(),
            current: genesis,
            acceptor: AcceptorState::default(),
            incarnation: 0,
        }
    }

    /// Applies one write. Writes that are stale (an older epoch, another slot's acceptor state, a
    /// lower incarnation) change nothing, so replaying a batch is harmless.
    pub fn apply(&mut self, write: &Write) {
        match write {
            Write::Epoch(record) if record.number > self.current.number => {
                self.current = record.clone();
                self.acceptor = AcceptorState::default();
            }
            Write::Acceptor { slot, state } if *slot == self.current.number + 1 => {
                self.acceptor = state.clone();
            }
            Write::Incarnation(n) if *n > self.incarnation => self.incarnation = *n,
            _ => {}
        }
    }
}

/// Durable storage for one node's [`Durable`] state.
pub trait Storage {
    type Error: std::error::Error + Send + Sync + 'static;

    /// The stored state, or `None` for a node that was never initialised.
    fn load(&self) -> Result<Option<Durable>, Self::Error>;

    /// Applies `writes` in order, atomically, and returns once they are durable (fsync).
    ///
    /// On error the writes may or may not have become durable, and nothing that depends on them
    /// may be acknowledged: the caller stops the node, which reloads what is stored when it
    /// restarts. Within a batch, order matters: an epoch write voids acceptor state written
    /// before it for an earlier slot, which the core relies on by writing in the order it decides.
    fn commit(&mut self, writes: &[Write]) -> Result<(), Self::Error>;
}

/// Storage in memory, for tests and simulations that model durability themselves.
#[derive(Clone, Debug)]
pub struct MemStorage {
    state: Durable,
}

impl MemStorage {
    pub fn new(state: Durable) -> MemStorage {
        MemStorage { state }
    }
}

impl Storage for MemStorage {
    type Error = std::convert::Infallible;

    fn load(&self) -> Result<Option<Durable>, Self::Error> {
        Ok(Some(self.state.clone()))
    }

    fn commit(&mut self, writes: &[Write]) -> Result<(), Self::Error> {
        writes.iter().for_each(|w| self.state.apply(w));
        Ok(())
    }
}
