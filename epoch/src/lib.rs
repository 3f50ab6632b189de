//! Membership epochs for keyhome, as a sans-I/O core.
//!
//! - [`activation`]: when a node may grant a key, and the activation waits, as pure functions.
//! - [`record`]: what an epoch fixes (members, ring version, timing) and its validation.
//! - [`change`]: operator changes that form the next epoch.
//! - [`paxos`]: single-decree Paxos as pure data, generic over the value.
//! - [`node`]: one node's epoch core: agreement, learning, home leases, activation.
//! - [`storage`]: the durable state and the trait drivers persist it through.
//! - [`view`]: an owned snapshot of what the delegation layer reads of a node's epoch core.
//! - [`message`], [`time`]: what crosses the wire, and the node-local clock.
//!
//! Epoch `n + 1` is chosen by a Paxos instance whose acceptors are the members of epoch `n`. A
//! member acts as a home under `n` only while a majority of `n` renews its home lease, and an
//! acceptor stops renewing once it has accepted any value for `n + 1`; so once `n + 1` is chosen no
//! lease of `n` outlives the next home's activation wait. See `docs/protocol.md`.

pub mod activation;
pub mod change;
pub mod message;
pub mod node;
pub mod paxos;
pub mod record;
pub mod storage;
pub mod time;
pub mod view;

/// Whether this build has the test-only `bug-injection` switches compiled in. The node refuses
/// to start with them unless told it is a test (see the `keyhome` binary); shipped builds never
/// have them.
pub const BUG_INJECTION: bool = cfg!(feature = "bug-injection");

pub use change::{Change, ChangeError};
pub use keyhome_ring::NodeId;
pub use message::{Body, MAX_ROUND, Message, MessageError, Transmit};
pub use node::{Bugs, Config, EpochNode, Event, ProposeError, Ready};
pub use record::{EpochRecord, MAX_CLOCK_RATE_PPM, MAX_EPOCH, Member, RecordError, Timing};
pub use storage::{Durable, MemStorage, Storage, Write};
pub use time::Instant;
pub use view::{EpochView, ViewStamp};
