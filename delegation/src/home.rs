//! The home side of delegations: [`Home`], a pure sans-I/O state machine.
//!
//! A key's home grants at most one node at a time the *delegation* of the key: the right to admit
//! critical sections on it, locally and without messages, for a bounded lease. This module keeps
//! the home's side of that bargain. It has no sockets, no clock and no randomness: the driver
//! hands in every message with the authenticated sender ([`Home::handle_message`]), wakes it when
//! [`Home::poll_timeout`] says ([`Home::handle_timeout`]), tells it when the epoch layer learned a
//! newer epoch ([`Home::on_epoch_change`]), and sends what [`Home::poll_transmit`] yields. Every
//! call takes `now`, a reading of this node's monotonic clock (the one the epoch core reads);
//! readings must never decrease. What the epoch layer knows comes in through [`Authority`].
//!
//! # Guarantees and how they are kept
//!
//! - **Refusal before allocation.** A request is checked in this order, and the first failing
//!   check is the answer, before any state is allocated: message epoch equals
//!   [`Authority::epoch`] ([`Refusal::StaleEpoch`]); sender is a member ([`Refusal::NotMember`]);
//!   key length ([`Refusal::KeyTooLong`]); this node is the key's home ([`Refusal::NotHome`]);
//!   this node may grant it now ([`Refusal::Activating`]); the restart quarantine is over
//!   ([`Refusal::Quarantine`]); then, depending on the key's state, the lock-delay
//!   ([`Refusal::LockDelay`]) and the caps ([`Refusal::HomeFull`], [`Refusal::RequesterFull`],
//!   [`Refusal::QueueFull`]).
//! - **One live delegation per key, never forgotten early.** The home's view of a delegation
//!   granted at home instant `g` for `lease` ends at `g + rate_margin(lease, ppm)` on the home's
//!   clock. The holder counts `lease` from the instant it *sent* the request, which is before `g`
//!   in real time, on a clock whose rate is within the bound; so the holder's deadline passes,
//!   in real time, before the home's view ends. The home keeps the delegation until that end or
//!   a release from the holder naming it, whichever comes first; renewals only move the end later.
//! - **Ordered grantees.** Every grant takes `Grantee { epoch, incarnation, counter }` with the
//!   current epoch, this run's durable incarnation and a counter that strictly increases within
//!   the run, so the grantees of one key strictly increase across grants, home restarts (the
//!   incarnation grows) and epoch changes (the epoch grows; a key has one home per epoch).
//! - **Restart quarantine.** A restarted home has forgotten its volatile delegations. It refuses
//!   every request until `started + rate_margin(max_delegation_lease, ppm)`, by which time all of
//!   them have surely ended. Only this home's keys wait, and only once.
//! - **Successor freshness.** A release hands its note and its `recovered` flag to the next
//!   grant (a clean release says `recovered: false`; a holder handing back a grant it received
//!   `recovered`, or one that follows its own expiry, says `true`). `recovered: true` means the
//!   home cannot vouch for a clean hand-off: the previous delegation expired, or a release said
//!   so, or its note was too large and was dropped, or the home has
//!   no record of the key (never locked, record aged out or evicted, home restarted, key moved in
//!   without a handover). So the first grant of a key this home has no record of is `recovered`.
//!
//! # Epoch changes and handovers
//!
//! Keys whose home stays this node across a change from epoch `e − 1` to `e` keep everything:
//! the epoch layer keeps them active without a wait ([`Authority::home_active`]), and this home
//! knows every delegation of them. Keys that moved away stay tracked until their live delegation
//! ends (requests get [`Refusal::NotHome`]), and are handed to the new home in one round trip: a
//! [`Body::Handover`] describing the live delegation (holder, grantee, remaining conservative
//! time) or, if none, the note and `recovered` flag the next grant must carry; the new home
//! answers [`Body::HandoverAck`] and the old home forgets the key. Handovers are resent every
//! retry period until acknowledged; once no delegation is live, after [`HANDOVER_SENDS`] sends
//! the old home gives up and forgets the key (the new home then waits out the activation wait).
//!
//! The new home *adopts* the handed state when the Handover carries its own current epoch `e`,
//! it is the key's home under `e`, the sender was the key's home under `e − 1`
//! ([`Authority::previous_home_of`]), it has no record of the key, and the activation wait of `e`
//! is not over ([`Authority::activation_passed`]: once it is, the home may have been active for
//! the key, granted it and forgotten it since the Handover left, even if it has no lease now: the
//! handed state is stale, and not needed). It keeps the handed
//! delegation until `receipt + rate_margin(remaining, ppm)` (the remaining time was measured on
//! the old home's clock), and may grant the key as soon as that delegation ends or is released,
//! **without waiting for [`Authority::home_active`]**: for adopted keys it checks only that it
//! holds its home lease ([`Authority::holds_lease`]) and is the key's home. Why that is safe:
//!
//! 1. Under `e − 1` the sender was the key's only home. A home sends a Handover only for keys
//!    whose record is *authoritative* (it granted or adopted them under `e − 1`, or under earlier
//!    epochs it homed them in without a gap) and only when it moved straight from `e − 1` to `e`.
//!    Every grant it made was behind its own activation (or an adoption, the same argument one
//!    step earlier), which had outlasted every delegation of earlier epochs' homes. So the only
//!    delegation of the key that can be live is the one its record names.
//! 2. The sender learned `e` before it sent the Handover, and from then on refuses the key: after
//!    the snapshot it sent, the delegation can only end (released or expired), never be renewed
//!    or re-granted by it.
//! 3. The remaining time is the sender's conservative view, widened again by the receiver, so
//!    the receiver's view ends after the holder's deadline in real time.
//! 4. Only the new home can grant the key under `e`, and only while it holds a lease of `e`,
//!    which no majority renews once `e + 1` can be chosen.
//!
//! A home acknowledges a Handover under its own epoch even when it does not adopt it (it already
//! has a record, or is full, or cannot verify the sender): the old home may then forget the key
//! because this home grants it only after [`Authority::home_active`], which waits out the old
//! epoch anyway. Keys whose old home is unreachable simply wait for the activation wait.
//!
//! A home that missed an epoch (it saw `e − 2` then `e`) treats nothing as authoritative: its
//! records may miss grants some other home made in between. Such keys, and keys that come back
//! to this home, keep their live delegations tracked but drop notes (the next grant is
//! `recovered`), hand nothing over, and need [`Authority::home_active`] before the next grant.
//!
//! An epoch change is applied key by key, a bounded step of slots at a time ([`crate::walk`]),
//! and to any key a message names before the message is looked at, so no call looks at a key the
//! change has not reached. Each entry records how many epoch changes it has seen; a key the walk
//! of `e − 1` had not reached when `e` came missed `e − 1` as far as its record goes, and is
//! treated as above (its handover under `e − 1` was never sent, so `e − 1`'s home waited for
//! [`Authority::home_active`] and granted only behind it).
//!
//! # Decisions
//!
//! - **Recall period:** a Recall goes to the holder when the first requester queues (and right
//!   after a grant that leaves requesters queued), and again every
//!   `max(home_lease / 4, 10 ms)`, with every successor of the chain, while the key is held and
//!   someone waits; more requesters joining the queue send nothing more to the holder (with
//!   passes, each new successor's predecessor is recalled naming it). (The pacing lives with the
//!   queue: if every requester leaves and a new one comes, it recalls at once.) The same period
//!   paces Handover resends.
//! - **Passes, chained.** While a delegation is held and others wait, the home grants the
//!   waiters ahead one behind the other ([`Successor`]: grantee, lease), a chain, and recalls the
//!   delegation each follows at once, naming it; each holder passes the key on with
//!   [`Body::Pass`] the instant its last handle ends and says so in its `Release`, so the key
//!   changes nodes in one message, and a successor knows where to pass it before it has it. From
//!   its grant the home treats every successor as live (its conservative end counts from there,
//!   after the request was sent, as for any grant) as well as the recalled delegation, and until
//!   it learns how far along the chain the key went it grants it to nobody else: a release of the
//!   recalled delegation, or its expiry, makes the first successor the live delegation (granted by
//!   the home itself unless the release says it was passed); a release or renewal by a successor
//!   says every delegation before it passed the key on; a successor reaching its own end is
//!   dropped alone. No pass is granted under lock-delay (an expiry must then leave the key
//!   ungranted for a while), to the node it would be passed from, nor for a key that is not
//!   authoritatively homed here; a key that moves away with a chain outstanding is handed over
//!   with all of it (`Handed::ahead`), and the new home keeps it as this one did.
//! - **Renewal while others wait** is refused with [`Refusal::Recalled`]: the delegation stays
//!   valid until its deadline but is not extended, so a busy holder cannot starve waiters.
//! - **Retransmitted request** (same id as the live grant, from its holder, not a renewal): the
//!   Grant is sent again with the lease shrunk so that it ends within the home's view from any
//!   earlier send instant, without the note (the note went with the first Grant), `recovered`.
//! - **Wait of zero** on a held key: refused at once with [`Refusal::WaitExpired`]; no Recall.
//! - **Oversized note** on a release: the release counts (the key is freed) but the note is
//!   dropped and the next grant is `recovered: true`, since a note the holder meant to hand over
//!   was lost.
//! - **Lock-delay** (`HomeConfig::lock_delay > 0`): when a delegation expires, the key is in
//!   lock-delay until `end + lock_delay`. Queued requesters whose wait ends by then, and new
//!   requests whose wait does, are refused [`Refusal::LockDelay`] with the time left; the others
//!   stay queued and the first is granted (`recovered: true`) when the delay ends.
//! - **Released records** (note and clean flag of a released key nobody waits for) are kept for
//!   `HomeConfig::record_retention`, at most `HomeConfig::max_records` of them and
//!   `HomeConfig::max_record_bytes` of notes; past either cap the record is not kept and the next
//!   grant is `recovered`.
//! - **Checks** answer anyone (a downstream resource need not be a member nor track epochs), so
//!   the epoch and membership checks are skipped for them; every other check of a request applies,
//!   and a token from an epoch later than the home's is refused [`Refusal::StaleEpoch`]. Refusals
//!   come as a [`Body::CheckReply`] carrying the reason. A token of the live delegation is
//!   forwarded to its holder ([`Body::Probe`]), which answers the asker; the home keeps nothing
//!   for it. Otherwise the home answers from its record (see [`crate::check`]).
//! - **Releases** are honoured whatever epoch they carry and from whomever the delegation was
//!   granted to: they only ever shorten what the holder itself holds.
//!
//! # Memory
//!
//! Every key the home keeps state for is stored once, in a slot of a slab: [`Home::ENTRY_BYTES`]
//! = 104 bytes, the key's state and the pointer to its bytes, which are one allocation of the
//! key's length. The slab grows 1 024 slots at a time and never moves a slot; freed slots are
//! reused. An index maps the key's hash (std's `RandomState`, keyed by the OS: keys come from the
//! network) to its slot number: 4 bytes and a control byte per bucket, at most 7/8 full. The
//! timer heap names keys by slot number too: 16 bytes per wake-up, in a `Vec` at most half empty.
//!
//! So a key with a live delegation and nobody waiting costs 104 bytes of slot, its own bytes, 16
//! to 32 bytes of timer heap and 5.7 to 11.4 bytes of index, depending on where the count sits
//! between doublings: with 16-byte keys, between about 144 and 164 bytes at any count (plus the
//! unused part of the last 104 KiB chunk). The bench `home_grant` (`home_memory`, counting every
//! allocation) measures 144.5 bytes per delegation at 900 000 live delegations, 147.3 at a
//! million and 156.8 at 1 200 000; the test `memory_per_live_delegation` (in `tests/home.rs`)
//! checks that it stays at most 200 at every count from 16 Ki to 140 000, a range holding one
//! doubling of both the index and the heap. [`Home::memory_estimate`] computes the same from
//! capacities. Waiters (56 bytes each, plus a 48-byte queue) and notes are allocated only while
//! present; handovers in progress take 40 KiB per chunk of 1 024 slots in which at least one key
//! is being handed over (see `home/moves.rs`), so an epoch change that moves a few keys spread
//! over a million slots holds up to 40 MB until their handovers end. Neither the slab nor the
//! index shrinks when keys go.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::ops::Deref;
use std::time::Duration;

use hashbrown::HashTable;

use keyhome_epoch::time::{earliest, rate_margin};
use keyhome_epoch::{Instant, NodeId, Timing};

use crate::authority::Authority;
use crate::check::CheckAnswer;
use crate::limits::Limits;
use crate::message::{Body, Grantee, Handed, Key, Message, Refusal, RequestId, Successor};
use crate::token::FencingToken;
use crate::walk::{DEFAULT_WALK_STEP, Walk};

mod moves;
use moves::{Moves, Moving};

/// "No wake-up armed" in [`Entry::wake`].
const NEVER: Instant = Instant::from_nanos(u64::MAX);

/// Shortest Recall and Handover resend period, whatever the home lease.
pub const MIN_RETRY: Duration = Duration::from_millis(10);
/// How many times an old home sends the Handover of a key with no live delegation before it gives
/// up and forgets the key.
pub const HANDOVER_SENDS: u32 = 8;

/// Settings of one node's home side that are not part of the epoch record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HomeConfig {
    /// This node's identity: the home compares [`Authority::home_of`] with it.
    pub id: NodeId,
    /// Caps on what peers can make this home allocate.
    pub limits: Limits,
    /// Whether waiters are granted ahead in a chain, each holder passing the key on directly to
    /// the next (see the module documentation). On by default; never under lock-delay.
    pub passes: bool,
    /// How long a key stays unavailable after its delegation *expired* (not after a clean
    /// release), measured on this home's clock from the expiry. Zero (the default) disables it.
    pub lock_delay: Duration,
    /// How long the record of a clean release (its note, and that it was clean) is kept when
    /// nobody waits for the key, so the next grant can carry it. Five minutes by default.
    pub record_retention: Duration,
    /// Most released records kept at once. A million by default.
    pub max_records: usize,
    /// Most note bytes kept in released records at once. 64 MiB by default.
    pub max_record_bytes: usize,
    /// Slots one step of an epoch change's walk looks at (see [`crate::walk`]), and Handover
    /// resends one [`Home::handle_timeout`] makes at most; zero counts as one.
    /// [`DEFAULT_WALK_STEP`] by default.
    pub walk_step: u32,
    /// Safety rules switched off, for tests that show the simulation notices. All off by default.
    #[cfg(feature = "bug-injection")]
    pub bugs: crate::bugs::Bugs,
}

impl HomeConfig {
    /// Default limits, no lock-delay, released records kept five minutes (at most a million of
    /// them and 64 MiB of notes).
    pub fn new(id: NodeId) -> HomeConfig {
        HomeConfig {
            id,
            limits: Limits::DEFAULT,
            passes: true,
            lock_delay: Duration::ZERO,
            record_retention: Duration::from_secs(300),
            max_records: 1_000_000,
            max_record_bytes: 64 << 20,
            walk_step: DEFAULT_WALK_STEP,
            #[cfg(feature = "bug-injection")]
            bugs: crate::bugs::Bugs::default(),
        }
    }
}

/// A live delegation as the home sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Delegation {
    /// The node it was granted to.
    pub holder: NodeId,
    pub grantee: Grantee,
    /// The home's conservative end, on the home's clock: the delegation is live before it.
    pub end: Instant,
}

/// What a home knows of a key, for status pages and tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyStatus {
    /// No live delegation and no lock-delay: the next grant (if this node may grant) carries a
    /// note of `note_len` bytes, if any, and `recovered`. A key without a record is `Free` with
    /// `recovered: true` and no note.
    Free { recovered: bool, note_len: Option<usize> },
    /// Delegated.
    Held(Delegation),
    /// Expired uncleanly and kept from every requester until `until` (home clock).
    LockDelay { until: Instant },
}

/// Slots per chunk of the slab in [`Keys`].
const CHUNK: usize = 1024;

/// The keys a home keeps state for, each stored once: a slab of [`Slot`]s numbered by `u32`, and
/// an index from the hash of a key to its slot number. A key keeps its slot number for as long as
/// the home keeps state for it, so the timer heap and the handovers in progress name keys by it.
///
/// The slab grows a chunk of [`CHUNK`] slots at a time: it never moves a slot, and wastes at most
/// one partly used chunk. Freed slots are reused before it grows; it never shrinks (nor did the
/// hash map it replaces).
#[derive(Debug)]
struct Keys {
    /// Keyed by randomness from the OS: keys come from the network.
    hasher: RandomState,
    /// The slot number of every key with state, by the hash of the key. The index only grows
    /// (and so re-hashes every key it holds) in [`Keys::restore`], when every slot is in place.
    index: HashTable<u32>,
    /// [`CHUNK`] slots each, except the last (which, while it is the only one, grows as a `Vec`
    /// does). `None`: free, or taken out for processing (see [`Keys::take`]).
    chunks: Vec<Vec<Option<Slot>>>,
    /// Free slot numbers, reused last freed first.
    free: Vec<u32>,
}

/// A key with state, and the state.
#[derive(Debug)]
struct Slot {
    key: Box<[u8]>,
    entry: Entry,
}

/// A key taken out of [`Keys`] for processing: its slot stays reserved for it until
/// [`Keys::restore`] puts it back or [`Keys::remove`] frees it. Dereferences to the key.
#[derive(Debug)]
struct KeyRef {
    slot: u32,
    hash: u64,
    /// Whether the index already finds the slot; `false` for a key being created.
    indexed: bool,
    key: Box<[u8]>,
}

impl Deref for KeyRef {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.key
    }
}

/// A key's hash and, if the home keeps state for it, its slot.
#[derive(Clone, Copy, Debug)]
struct Found {
    hash: u64,
    slot: Option<u32>,
}

impl Keys {
    fn new() -> Keys {
        Keys { hasher: RandomState::new(), index: HashTable::new(), chunks: Vec::new(), free: Vec::new() }
    }

    fn hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    fn slot(chunks: &[Vec<Option<Slot>>], n: u32) -> Option<&Slot> {
        let n = n as usize;
        chunks.get(n / CHUNK)?.get(n % CHUNK)?.as_ref()
    }

    fn slot_mut(&mut self, n: u32) -> Option<&mut Slot> {
        let n = n as usize;
        self.chunks.get_mut(n / CHUNK)?.get_mut(n % CHUNK)?.as_mut()
    }

    fn place_mut(&mut self, n: u32) -> &mut Option<Slot> {
        let n = n as usize;
        &mut self.chunks[n / CHUNK][n % CHUNK]
    }

    /// Hashes `key` and finds its slot (one that is in place).
    fn find(&self, key: &[u8]) -> Found {
        let hash = self.hash(key);
        let chunks = &self.chunks;
        let slot = self.index.find(hash, |&n| Keys::slot(chunks, n).is_some_and(|s| *s.key == *key)).copied();
        Found { hash, slot }
    }

    /// The state of the key in slot `n`, if it is in place.
    fn entry(&self, n: u32) -> Option<&Entry> {
        Keys::slot(&self.chunks, n).map(|s| &s.entry)
    }

    fn get(&self, key: &[u8]) -> Option<&Entry> {
        self.entry(self.find(key).slot?)
    }

    /// Number of keys with state (one taken out for processing included, unless being created).
    fn len(&self) -> usize {
        self.index.len()
    }

    /// Number of slots, free or not: slot numbers are below it.
    fn slots(&self) -> u32 {
        // Every chunk but the last is full.
        let n = self.chunks.last().map_or(0, |last| (self.chunks.len() - 1) * CHUNK + last.len());
        u32::try_from(n).expect("fewer than 2^32 slots")
    }

    fn iter(&self) -> impl Iterator<Item = &Slot> {
        self.chunks.iter().flatten().flatten()
    }

    /// Takes slot `n` out for processing, if it holds a key (whose hash is `hash`, if known).
    fn take(&mut self, n: u32, hash: Option<u64>) -> Option<(KeyRef, Entry)> {
        let Slot { key, entry } =
            self.chunks.get_mut(n as usize / CHUNK)?.get_mut(n as usize % CHUNK)?.take()?;
        let hash = hash.unwrap_or_else(|| self.hash(&key));
        Some((KeyRef { slot: n, hash, indexed: true, key }, entry))
    }

    /// Reserves a slot for `key`, which has no state (its hash is `hash`).
    fn create(&mut self, hash: u64, key: Box<[u8]>) -> KeyRef {
        let slot = match self.free.pop() {
            Some(n) => n,
            None => {
                let n = self.slots();
                match self.chunks.last_mut() {
                    Some(chunk) if chunk.len() < CHUNK => chunk.push(None),
                    Some(_) => {
                        let mut chunk = Vec::with_capacity(CHUNK);
                        chunk.push(None);
                        self.chunks.push(chunk);
                    }
                    // The first chunk grows as a `Vec` does, so a small home stays small.
                    None => self.chunks.push(vec![None]),
                }
                n
            }
        };
        KeyRef { slot, hash, indexed: false, key }
    }

    /// Puts a taken or created key back with its state.
    fn restore(&mut self, key: KeyRef, entry: Entry) {
        let KeyRef { slot, hash, indexed, key } = key;
        *self.place_mut(slot) = Some(Slot { key, entry });
        if !indexed {
            let (chunks, hasher) = (&self.chunks, &self.hasher);
            self.index.insert_unique(hash, slot, |&n| {
                let s = Keys::slot(chunks, n).expect("every slot is in place when the index grows");
                hasher.hash_one(&*s.key)
            });
        }
    }

    /// Forgets a taken or created key: frees its slot.
    fn remove(&mut self, key: KeyRef) {
        if key.indexed
            && let Ok(entry) = self.index.find_entry(key.hash, |&n| n == key.slot)
        {
            entry.remove();
        }
        self.free.push(key.slot);
    }

    /// Heap bytes of the index and the slab.
    fn allocation_size(&self) -> usize {
        self.index.allocation_size()
            + self.chunks.capacity() * size_of::<Vec<Option<Slot>>>()
            + self.chunks.iter().map(|c| c.capacity() * size_of::<Option<Slot>>()).sum::<usize>()
            + self.free.capacity() * size_of::<u32>()
    }
}

/// A queued request.
#[derive(Clone, Copy, Debug)]
struct Waiter {
    from: NodeId,
    id: RequestId,
    /// As asked; clamped when granted (see [`granted_lease`]).
    lease: Duration,
    /// Receipt, home clock: the grant credits the wait since (see [`Home::credited`]).
    received: Instant,
    /// Receipt + the request's wait, home clock.
    deadline: Instant,
}

/// A live delegation.
#[derive(Clone, Copy, Debug)]
struct Live {
    holder: NodeId,
    grantee: Grantee,
    /// The request id it answered last (grant or renewal).
    id: RequestId,
    /// Conservative end, home clock.
    end: Instant,
}

/// The requesters queued for a key, and the Recall pacing of its holder.
#[derive(Debug)]
struct Queue {
    /// Oldest first; never empty unless `ahead` is not (an empty queue is dropped).
    waiters: VecDeque<Waiter>,
    /// Earliest instant the next Recall may be sent.
    recall_next: Instant,
    /// A Recall of the current delegation went out (for [`HomeCounters::recalls`]).
    recalled: bool,
    /// The chain of delegations granted ahead, taken out of `waiters` in their order (see
    /// [`Next`]): the live delegation's holder passes the key to the first, the first's holder to
    /// the second, and so on.
    ahead: VecDeque<Next>,
}

/// A delegation granted ahead to a requester waiting for a held key, for the holder of the
/// delegation before it in the chain to pass on ([`Successor`]). From the instant it was granted
/// until `end` or a release, the key may be live at any node of the chain up to it, never at two
/// at once (each holder passes it only once its last handle ended).
#[derive(Clone, Copy, Debug)]
struct Next {
    /// Its `lease` is credited with the wait since `received` (see [`Home::credited`]), again at
    /// every resend of the request.
    successor: Successor,
    /// The lease its request asked for, and the request's receipt (home clock; for an adopted
    /// successor, the adoption).
    asked: Duration,
    received: Instant,
    /// Conservative end, home clock: the last instant `t` its lease was credited at, plus
    /// `rate_margin` of the lease granted at `t` before the credit, or later.
    end: Instant,
    /// Its own Recall went out: it was told to pass the key on (to the next one, if any).
    recalled: bool,
}

/// How a live delegation ended, as [`Home::end_live`] acts on it.
enum Ended {
    /// Released by its holder, who passed the [`Next`] delegation on.
    Passed,
    /// Released by its holder without passing anything on; what the next grant carries.
    Released { note: Option<Box<[u8]>>, recovered: bool },
    /// Released by its holder, who passed the key to a successor this home has since dropped at
    /// its end: that successor may have admitted, let its handle run out, and passed the key on
    /// down the chain.
    PassedToDropped,
    /// Its conservative end passed.
    Expired,
}

/// In `Delay` and `Free`, `last` is the key's last delegation this home knows of, for token checks
/// ([`NO_GRANTEE`] if none): it is superseded by nothing yet, and supersedes every earlier one.
#[derive(Debug)]
enum Phase {
    Held(Live),
    /// Expired uncleanly; nothing is granted before `until`.
    Delay {
        until: Instant,
        last: Grantee,
    },
    /// Not delegated. `note` and `recovered` are what the next grant carries; the record is kept
    /// until `until` (see [`Home::finish`] for which records are kept at all).
    Free {
        note: Option<Box<[u8]>>,
        recovered: bool,
        until: Instant,
        last: Grantee,
    },
}

/// Below every grantee a home issues (grant counters start at 1): "no delegation known".
const NO_GRANTEE: Grantee = Grantee { epoch: 0, incarnation: 0, counter: 0 };

/// How far this home's record of a key can be trusted, and what it may do with the key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// Homed here; the record names every delegation of the key that may be live. Grants need
    /// [`Authority::home_active`].
    Home,
    /// Homed here and handed over by the previous home; authoritative. Grants need the lease.
    Adopted,
    /// Homed here but the record may miss delegations other homes made (an epoch was skipped,
    /// or the key came back). Grants need [`Authority::home_active`]; the first makes it `Home`.
    Stale,
    /// Moved away; the record is being handed over (see [`Moving`]).
    Moved,
    /// Moved away with nothing to hand over; kept only while its delegation is live.
    Tracking,
}

/// Everything a home keeps per key. Invariant: waiters exist only in `Held` and `Delay` (a free
/// key with waiters is granted or its waiters refused before control returns to the driver), and
/// a [`Next`] only in `Held`.
#[derive(Debug)]
struct Entry {
    phase: Phase,
    /// Queued requests and the chain of successors granted ahead; `None` when nobody waits (most
    /// keys).
    /// Boxed so that it costs 8 bytes in every entry, and one allocation only while someone waits.
    queue: Option<Box<Queue>>,
    /// The earliest instant the timer heap holds for this key; [`NEVER`] if none.
    wake: Instant,
    role: Role,
    /// In `Held`: the credit for the wait in line (see [`Home::credited`]) that the lease granted
    /// for the live delegation's `id` carried, in [`CREDIT_UNIT`]s rounded down: a resent `id`
    /// gets it again (D2.5). Here, not in [`Live`], because it fits the entry's padding.
    credit: u16,
    /// The [`Home::generation`] this entry was last brought up to (see [`Home::catch_up`]).
    seen: u32,
}

/// Totals over the entries currently in the map (an entry taken out for processing is not
/// counted until it is put back).
#[derive(Debug, Default)]
struct Counts {
    live: usize,
    delayed: usize,
    records: usize,
    record_bytes: usize,
    per_holder: HashMap<NodeId, usize>,
}

/// Which checks a message passes through before it is looked at.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Gate {
    Request,
    Check,
}

/// The home side of one node. See the module documentation.
#[derive(Debug)]
pub struct Home {
    config: HomeConfig,
    /// When this run started (home clock); the quarantine counts from here.
    started: Instant,
    /// The epoch the home last saw; `None` before the first call with an [`Authority`].
    epoch: Option<u64>,
    /// Epoch changes this home has seen, modulo 2^32: what [`Entry::seen`] counts in.
    generation: u32,
    /// Whether the last epoch change went straight from an epoch to the next one.
    consecutive: bool,
    /// Every entry was brought up to this generation or a later one: the generation of the last
    /// walk that finished. Never 2^31 or more behind `generation` (see [`Home::on_epoch_change`]),
    /// so `seen` compares soundly modulo 2^32.
    floor: u32,
    /// The walk of the last epoch change, until it has passed every slot.
    walk: Option<Walk>,
    /// Last grant counter handed out in this run.
    counter: u64,
    keys: Keys,
    /// Handovers in progress, by slot number in `keys`, and their resends.
    moves: Moves,
    /// Wake-ups, earliest first, by slot number in `keys`. May hold stale entries (for keys since
    /// dropped, whose slot may since hold another key, or superseded by an earlier one); each is
    /// popped once and costs at most one early [`Home::service`], which is harmless.
    timers: BinaryHeap<Reverse<(Instant, u32)>>,
    counts: Counts,
    counters: HomeCounters,
    out: VecDeque<(NodeId, Message)>,
}

/// What a home did since it started, for metrics. Plain counts: no clock, no key names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HomeCounters {
    /// Delegations granted (renewals included).
    pub grants: u64,
    /// Grants to a requester that had queued behind another delegation of the key: the key
    /// passed from one holder to the next.
    pub handoffs: u64,
    /// Delegations recalled (counted once per delegation, however often the Recall is resent).
    pub recalls: u64,
    /// Delegations that reached their end at this home without being released (revoked by
    /// expiry: the holder died, was cut off, or kept a handle past the lease).
    pub expiries: u64,
    /// Expiries that put the key into lock-delay.
    pub lock_delays: u64,
    /// Delegations granted ahead in a chain, for the holder before each to pass on (counted in
    /// `grants` too).
    pub passes: u64,
}

impl std::ops::AddAssign for HomeCounters {
    /// Sums the counters of several homes (a node's key shards).
    fn add_assign(&mut self, other: HomeCounters) {
        self.grants += other.grants;
        self.handoffs += other.handoffs;
        self.recalls += other.recalls;
        self.expiries += other.expiries;
        self.lock_delays += other.lock_delays;
        self.passes += other.passes;
    }
}

impl Home {
    /// A home whose run started at `now`. Construct it when the process starts, before the node
    /// acts as a home: the restart quarantine counts from `now`.
    pub fn new(config: HomeConfig, now: Instant) -> Home {
        Home {
            config,
            started: now,
            epoch: None,
            generation: 0,
            consecutive: false,
            floor: 0,
            walk: None,
            counter: 0,
            keys: Keys::new(),
            moves: Moves::default(),
            timers: BinaryHeap::new(),
            counts: Counts::default(),
            counters: HomeCounters::default(),
            out: VecDeque::new(),
        }
    }

    pub fn config(&self) -> &HomeConfig {
        &self.config
    }

    // ---- inputs ----

    /// Handles a message `from` a peer (the identity the driver authenticated, never a payload
    /// field). Home-bound bodies are `Request`, `Release`, `Check`, `Handover` and `HandoverAck`;
    /// others are ignored. Replies are queued for [`Home::poll_transmit`].
    pub fn handle_message(&mut self, now: Instant, from: NodeId, message: Message, auth: &impl Authority) {
        self.on_epoch_change(now, auth);
        let Message { epoch, body } = message;
        if self.walk.is_some()
            && let Body::Request { key, .. }
            | Body::Release { key, .. }
            | Body::Check { key, .. }
            | Body::Handover { key, .. }
            | Body::HandoverAck { key } = &body
        {
            self.catch_up_key(now, key, auth);
        }
        match body {
            Body::Request { key, id, lease, wait, held } => {
                self.on_request(now, from, epoch, key, id, lease, wait, held, auth)
            }
            Body::Release { key, grantee, note, recovered, passed } => {
                self.on_release(now, from, key, grantee, note, recovered, passed, auth)
            }
            Body::Check { key, id, token } => self.on_check(now, from, key, id, token, auth),
            Body::Handover { key, live, note, recovered, lock_delay } => {
                self.on_handover(now, from, epoch, key, live, note, recovered, lock_delay, auth)
            }
            Body::HandoverAck { key } => self.on_ack(from, epoch, &key),
            Body::Grant { .. }
            | Body::Refuse { .. }
            | Body::Recall { .. }
            | Body::Pass { .. }
            | Body::Probe { .. }
            | Body::CheckReply { .. } => {}
        }
    }

    /// Handles every wake-up due at `now`: expiries, lock-delay ends, waits that ran out, Recall
    /// resends, released records that aged out; then up to [`HomeConfig::walk_step`] Handover
    /// resends and a step of the epoch walk in progress, if any, within one
    /// [`HomeConfig::walk_step`] budget. Harmless to call early or often. Afterwards
    /// [`Home::poll_timer`] is later than `now`.
    pub fn handle_timeout(&mut self, now: Instant, auth: &impl Authority) {
        self.on_epoch_change(now, auth);
        while let Some(Reverse((at, _))) = self.timers.peek()
            && *at <= now
        {
            let Some(Reverse((_, slot))) = self.timers.pop() else { break };
            let Some((key, mut e)) = self.take_slot(slot, None) else { continue };
            if e.wake <= now {
                e.wake = NEVER;
            }
            self.bring_up(now, key, e, auth);
        }
        let resends = self.moves.take_due(now, self.config.walk_step as usize);
        let resent = resends.len();
        for slot in resends {
            // `service` resends the handover if it is still due (a key may have been listed again,
            // have stopped moving, or even given its slot to another key meanwhile).
            if let Some((key, e)) = self.take_slot(slot, None) {
                self.bring_up(now, key, e, auth);
            }
        }
        // Resends and the walk share one step's budget; a full batch of resends leaves the walk
        // due for the next call.
        if resent < self.config.walk_step.max(1) as usize {
            self.walk_step(now, auth);
        }
    }

    /// The earliest instant at which [`Home::handle_timeout`] must be called, if any: the next
    /// wake-up or Handover resend, or while an epoch walk is in progress the instant it started
    /// (it is due until it is over; each call takes one step). Resends and walks are paced: each
    /// call takes a bounded share of them, and they may stay due after it.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let paced = earliest(self.moves.next_due(), self.walk.map(|w| w.since()));
        earliest(self.poll_timer(), paced)
    }

    /// The next wake-up, leaving Handover resends and the epoch walk out. After
    /// `handle_timeout(t)` it is never `t` or earlier (no timer spin).
    pub fn poll_timer(&self) -> Option<Instant> {
        self.timers.peek().map(|Reverse((at, _))| *at)
    }

    /// Whether an epoch walk is in progress (see [`crate::walk`]).
    pub fn walking(&self) -> bool {
        self.walk.is_some()
    }

    /// The next message to send, with its destination. Every message carries the epoch the home
    /// acted under ([`Authority::epoch`] at the call that produced it).
    pub fn poll_transmit(&mut self) -> Option<(NodeId, Message)> {
        self.out.pop_front()
    }

    /// Tells the home the epoch layer may have learned a newer epoch. The driver should call it
    /// as soon as that happens, so handovers leave at once; every other entry point calls it too,
    /// so a late call loses nothing but time. Idempotent.
    ///
    /// - Keys still homed here after a change straight from `e − 1` to `e` keep everything.
    /// - Keys that moved: queued requesters are refused [`Refusal::NotHome`]; live delegations
    ///   stay tracked until they end; authoritative records are handed to the new home.
    /// - After a skipped epoch, or for keys that come back, records are no longer authoritative
    ///   (see the module documentation).
    ///
    /// It does this for the first [`HomeConfig::walk_step`] slots and starts a walk for the rest
    /// (see [`crate::walk`]): each [`Home::handle_timeout`] takes one more step, and every key a
    /// message names is brought up to date before the message is looked at. A key the walk of `e`
    /// had not reached when `e + 1` came counts as having missed an epoch.
    pub fn on_epoch_change(&mut self, now: Instant, auth: &impl Authority) {
        let new = auth.epoch();
        let Some(old) = self.epoch.replace(new) else { return };
        if old == new {
            return;
        }
        self.generation = self.generation.wrapping_add(1);
        self.consecutive = new.checked_sub(1) == Some(old);
        self.walk = Some(Walk::new(now));
        self.walk_step(now, auth);
        if self.generation.wrapping_sub(self.floor) >= 1 << 31 {
            // Two billion epoch changes, each arriving before the walk of the one before was
            // over: finish this walk at once, so that `seen` stays comparable.
            while self.walk.is_some() {
                self.walk_step(now, auth);
            }
        }
    }

    /// One step of the epoch walk in progress, if any: brings up to date the keys of the next
    /// [`HomeConfig::walk_step`] slots, in slot order (so the messages leave in an order that
    /// depends only on the inputs).
    fn walk_step(&mut self, now: Instant, auth: &impl Authority) {
        let Some(walk) = self.walk.as_mut() else { return };
        let generation = self.generation;
        for slot in walk.step(self.config.walk_step, self.keys.slots()) {
            let keeps = match Keys::slot(&self.keys.chunks, slot) {
                None => continue,
                Some(s) if s.entry.seen == generation => continue,
                Some(s) => self.keeps_everything(&s.key, &s.entry, auth),
            };
            if keeps {
                if let Some(s) = self.keys.slot_mut(slot) {
                    s.entry.seen = generation;
                }
                continue;
            }
            if let Some((key, e)) = self.take_slot(slot, None) {
                self.bring_up(now, key, e, auth);
            }
        }
        if self.walk.is_some_and(|w| w.is_over(self.keys.slots())) {
            self.walk = None;
            self.floor = generation;
        }
    }

    /// Whether the epoch change leaves `e` as it is: its record stays authoritative and the key
    /// is still homed here.
    fn keeps_everything(&self, key: &[u8], e: &Entry, auth: &impl Authority) -> bool {
        self.stays_authoritative(e) && auth.home_of(key) == Some(self.config.id)
    }

    /// Whether `e`'s record is still authoritative under the current epoch: it was authoritative,
    /// and it saw the epoch straight before this one (an entry the last walk did not reach before
    /// this change came saw an earlier one, and misses whatever another home did in between).
    fn stays_authoritative(&self, e: &Entry) -> bool {
        self.consecutive
            && e.seen == self.generation.wrapping_sub(1)
            && matches!(e.role, Role::Home | Role::Adopted)
    }

    /// [`Home::catch_up`], then [`Home::service`] and [`Home::finish`]: a taken-out key brought
    /// up to date and put back.
    fn bring_up(&mut self, now: Instant, key: KeyRef, mut e: Entry, auth: &impl Authority) {
        self.catch_up(now, &key, &mut e, auth);
        self.service(now, &key, &mut e, auth);
        self.finish(now, key, e);
    }

    /// Brings the key a message names up to date, if the epoch walk has not yet.
    fn catch_up_key(&mut self, now: Instant, key: &[u8], auth: &impl Authority) {
        if key.len() > self.config.limits.max_key_len {
            return;
        }
        let found = self.keys.find(key);
        let Some(slot) = found.slot else { return };
        if self.keys.entry(slot).is_none_or(|e| e.seen == self.generation) {
            return;
        }
        if let Some((k, e)) = self.take_found(found) {
            self.bring_up(now, k, e, auth);
        }
    }

    /// Applies the epoch changes `e` (taken out) has not seen (see [`Home::on_epoch_change`] and
    /// [`Home::stays_authoritative`]).
    fn catch_up(&mut self, now: Instant, key: &KeyRef, e: &mut Entry, auth: &impl Authority) {
        if e.seen == self.generation {
            return;
        }
        let authoritative = self.stays_authoritative(e);
        e.seen = self.generation;
        let home = auth.home_of(key);
        if home == Some(self.config.id) {
            if !authoritative {
                self.moves.remove(key.slot);
                e.role = Role::Stale;
                forget_record(e);
            }
            return;
        }
        self.refuse_waiters(key, e, Refusal::NotHome);
        match home {
            Some(to) if authoritative => {
                e.role = Role::Moved;
                let moving = Moving { to, epoch: auth.epoch(), next_send: now, sends: 0 };
                self.moves.insert(key.slot, moving);
            }
            _ => {
                self.moves.remove(key.slot);
                e.role = Role::Tracking;
                forget_record(e);
                if let Phase::Delay { last, .. } = e.phase {
                    e.phase = Phase::Free { note: None, recovered: true, until: now, last };
                }
            }
        }
    }

    // ---- queries (as of the last call that took `now`; while an epoch walk is in progress, a key
    // it has not reached yet shows its state from before the change) ----

    /// The live delegation of `key`, if any.
    pub fn delegation(&self, key: &[u8]) -> Option<Delegation> {
        match &self.keys.get(key)?.phase {
            Phase::Held(live) => Some(live.view()),
            _ => None,
        }
    }

    /// What the home knows of `key`. A key in lock-delay is never reported `Free`.
    pub fn status(&self, key: &[u8]) -> KeyStatus {
        match self.keys.get(key).map(|e| &e.phase) {
            Some(Phase::Held(live)) => KeyStatus::Held(live.view()),
            Some(Phase::Delay { until, .. }) => KeyStatus::LockDelay { until: *until },
            Some(Phase::Free { note, recovered, .. }) => {
                KeyStatus::Free { recovered: *recovered, note_len: note.as_ref().map(|n| n.len()) }
            }
            None => KeyStatus::Free { recovered: true, note_len: None },
        }
    }

    /// Number of live delegations this home tracks (including moved keys not yet handed over).
    pub fn delegations(&self) -> usize {
        self.counts.live
    }

    /// Number of live delegations granted to `holder` that this home tracks.
    pub fn delegations_of(&self, holder: NodeId) -> usize {
        self.counts.per_holder.get(&holder).copied().unwrap_or(0)
    }

    /// The requesters queued for `key`, oldest first, as `(requester, request id)`; not those
    /// granted ahead already (the key's chain).
    pub fn waiters(&self, key: &[u8]) -> Vec<(NodeId, RequestId)> {
        self.keys
            .get(key)
            .and_then(|e| e.queue.as_ref())
            .map(|q| q.waiters.iter().map(|w| (w.from, w.id)).collect())
            .unwrap_or_default()
    }

    /// The end of `key`'s lock-delay (home clock), if it is in one.
    pub fn lock_delay_until(&self, key: &[u8]) -> Option<Instant> {
        match self.keys.get(key)?.phase {
            Phase::Delay { until, .. } => Some(until),
            _ => None,
        }
    }

    /// Number of keys in lock-delay.
    pub fn keys_in_lock_delay(&self) -> usize {
        self.counts.delayed
    }

    /// The keys in lock-delay and when each delay ends (in no particular order). Walks every key
    /// this home keeps state for, unless none is in lock-delay: for status views, not hot paths.
    pub fn lock_delayed(&self) -> impl Iterator<Item = (&[u8], Instant)> {
        let any = self.counts.delayed > 0;
        self.keys.iter().take_while(move |_| any).filter_map(|slot| match slot.entry.phase {
            Phase::Delay { until, .. } => Some((&*slot.key, until)),
            _ => None,
        })
    }

    /// What this home did since it started.
    pub fn counters(&self) -> HomeCounters {
        self.counters
    }

    /// Number of released records kept for the next grant.
    pub fn records(&self) -> usize {
        self.counts.records
    }

    /// Number of keys the home keeps any state for.
    pub fn tracked_keys(&self) -> usize {
        self.keys.len()
    }

    /// The end of the restart quarantine under `timing` (home clock): `started +
    /// rate_margin(max_delegation_lease, clock_rate_ppm)`.
    pub fn quarantine_end(&self, timing: &Timing) -> Instant {
        if self.bugs().no_quarantine {
            return self.started;
        }
        self.started + rate_margin(timing.max_delegation_lease, timing.clock_rate_ppm)
    }

    /// Whether `key` was handed over to this home by its previous home (and not since dropped).
    pub fn is_adopted(&self, key: &[u8]) -> bool {
        self.keys.get(key).is_some_and(|e| e.role == Role::Adopted)
    }

    /// The new home `key` is being handed over to, while the handover is unacknowledged.
    pub fn handing_over(&self, key: &[u8]) -> Option<NodeId> {
        self.moves.get(self.keys.find(key).slot?).map(|m| m.to)
    }

    /// An estimate of the heap bytes the home's per-key state occupies: the index, slab, timer
    /// heap and handovers from their capacities, plus key, waiter and note allocations.
    /// Walks every key.
    pub fn memory_estimate(&self) -> usize {
        let moving = self.moves.allocation_size();
        let heap = self.timers.capacity() * size_of::<Reverse<(Instant, u32)>>();
        let per_key: usize = self
            .keys
            .iter()
            .map(|Slot { key, entry: e }| {
                let waiters = e
                    .queue
                    .as_ref()
                    .map_or(0, |q| size_of::<Queue>() + q.waiters.capacity() * size_of::<Waiter>());
                let note = match &e.phase {
                    Phase::Free { note: Some(n), .. } => n.len(),
                    _ => 0,
                };
                key.len() + waiters + note
            })
            .sum();
        self.keys.allocation_size() + moving + heap + per_key
    }

    /// Size of one slot of the home's slab: a key's state and the pointer to the key's bytes.
    pub const ENTRY_BYTES: usize = size_of::<Option<Slot>>();

    // ---- message handling ----

    #[allow(clippy::too_many_arguments)]
    fn on_request(
        &mut self,
        now: Instant,
        from: NodeId,
        epoch: u64,
        key: Key,
        id: RequestId,
        lease: Duration,
        wait: Duration,
        held: Option<Grantee>,
        auth: &impl Authority,
    ) {
        let found = match self.gate(now, from, epoch, &key, Gate::Request, auth) {
            Ok(found) => found,
            Err(reason) => {
                self.refuse(from, key, id, reason);
                return;
            }
        };
        let Some((k, mut e)) = self.take_found(found) else {
            // No record: a grant would create the key's first state.
            if let Err(reason) = self.grant_caps(from) {
                self.refuse(from, key, id, reason);
                return;
            }
            let k = self.keys.create(found.hash, key.into_boxed_slice());
            let mut e = Entry {
                phase: Phase::Free { note: None, recovered: true, until: now, last: NO_GRANTEE },
                queue: None,
                wake: NEVER,
                role: Role::Home,
                credit: 0,
                seen: self.generation,
            };
            self.grant(now, &k, &mut e, from, id, lease, now, auth);
            self.service(now, &k, &mut e, auth);
            self.finish(now, k, e);
            return;
        };
        self.service(now, &k, &mut e, auth);
        if let Err(reason) = self.admit(now, &k, &mut e, from, id, lease, wait, held, auth) {
            self.refuse(from, key, id, reason);
        }
        self.service(now, &k, &mut e, auth);
        self.finish(now, k, e);
    }

    /// Acts on a request that passed the gate, for a key with a record: grants, renews, re-sends
    /// or queues, or says why not. Allocates nothing when it refuses.
    #[allow(clippy::too_many_arguments)]
    fn admit(
        &mut self,
        now: Instant,
        key: &KeyRef,
        e: &mut Entry,
        from: NodeId,
        id: RequestId,
        lease: Duration,
        wait: Duration,
        held: Option<Grantee>,
        auth: &impl Authority,
    ) -> Result<(), Refusal> {
        let ppm = auth.timing().clock_rate_ppm;
        if let Some(i) = held.and_then(|g| e.position(from, g)) {
            // A successor renews what it was passed: every delegation before it has ended.
            self.pass_along(now, key, e, i, auth);
        }
        let delay_until = match &mut e.phase {
            Phase::Free { .. } => {
                self.grant_caps(from)?;
                self.grant(now, key, e, from, id, lease, now, auth);
                return Ok(());
            }
            Phase::Held(live) if live.holder == from && held == Some(live.grantee) => {
                // Renewal. Never shortens the home's view: the holder's earlier deadline stands.
                if e.queue.is_some() {
                    return Err(Refusal::Recalled);
                }
                let lease = granted_lease(lease, auth);
                live.end = live.end.max(now + self.margin(lease, ppm));
                live.id = id;
                e.credit = 0;
                let grantee = live.grantee;
                let body =
                    Body::Grant { key: key.to_vec(), id, grantee, lease, note: None, recovered: false };
                self.send(from, body);
                return Ok(());
            }
            Phase::Held(live) if live.holder == from && id == live.id => {
                // The Grant was lost (or is still on its way) and the request resent: grant again
                // what is left, counted from any instant before now, and the credit the first
                // Grant carried for the wait in line before it (counted from the first send, as
                // that Grant's lease was: no more than it).
                let credit = CREDIT_UNIT * u32::from(e.credit);
                let lease = shrink(live.end.saturating_duration_since(now), ppm) + credit;
                let grantee = live.grantee;
                let body = Body::Grant { key: key.to_vec(), id, grantee, lease, note: None, recovered: true };
                self.send(from, body);
                return Ok(());
            }
            Phase::Held(_) => None,
            Phase::Delay { until, .. } => Some(*until),
        };
        if e.queue.as_ref().is_some_and(|q| q.waiters.iter().any(|w| w.from == from && w.id == id)) {
            return Ok(()); // a duplicate: already queued
        }
        if let Some(i) = e.ahead().position(|n| n.successor.to == from && n.successor.id == id) {
            self.credit_again(now, key, e, i, auth);
            return Ok(()); // granted ahead: its holder is still waiting for the key
        }
        let deadline = now + wait.min(self.config.limits.max_request_wait);
        if let Some(until) = delay_until
            && deadline <= until
        {
            return Err(Refusal::LockDelay(until.saturating_duration_since(now)));
        }
        if deadline <= now {
            return Err(Refusal::WaitExpired);
        }
        if self.delegations_of(from) >= self.config.limits.max_per_requester {
            return Err(Refusal::RequesterFull);
        }
        if e.waiting() >= self.config.limits.max_waiters_per_key {
            return Err(Refusal::QueueFull);
        }
        let waiter = Waiter { from, id, lease, received: now, deadline };
        match &mut e.queue {
            Some(q) => q.waiters.push_back(waiter),
            None => {
                e.queue = Some(Box::new(Queue {
                    waiters: VecDeque::from([waiter]),
                    recall_next: now,
                    recalled: false,
                    ahead: VecDeque::new(),
                }))
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn on_release(
        &mut self,
        now: Instant,
        from: NodeId,
        key: Key,
        grantee: Grantee,
        note: Option<Vec<u8>>,
        recovered: bool,
        passed: Option<Grantee>,
        auth: &impl Authority,
    ) {
        if key.len() > self.config.limits.max_key_len {
            return;
        }
        let Some((k, mut e)) = self.take(&key) else { return };
        self.service(now, &k, &mut e, auth);
        // The release says what the next grant carries: its note, and whether the next holder
        // must be told the hand-off was not clean.
        let (note, recovered) = match note {
            Some(n) if n.len() > self.config.limits.max_note_len => (None, true),
            n => (n.map(Vec::into_boxed_slice), recovered),
        };
        if let Some(i) = e.position(from, grantee) {
            // A successor was passed the key and has given it back already (the releases before
            // it are still on their way): every delegation up to it has ended.
            self.pass_along(now, &k, &mut e, i, auth);
        }
        if let Phase::Held(live) = &e.phase
            && live.holder == from
            && live.grantee == grantee
        {
            let how = match passed {
                Some(g) if e.ahead().next().is_some_and(|n| n.successor.grantee == g) => Ended::Passed,
                // Passed to a successor this home dropped at its end: it may have admitted, and
                // its last handle may have run out, so its release's note is not this one; and it
                // may have passed the key on to the chain behind it.
                Some(_) => Ended::PassedToDropped,
                None => Ended::Released { note, recovered },
            };
            self.end_live(now, &k, &mut e, how, auth);
            self.service(now, &k, &mut e, auth);
        }
        self.finish(now, k, e);
    }

    /// Answers check `id` of `from` (see [`crate::check`]), or forwards it to the holder of the
    /// live delegation `token` belongs to: only that holder knows the admissions under it.
    fn on_check(
        &mut self,
        now: Instant,
        from: NodeId,
        key: Key,
        id: u64,
        token: FencingToken,
        auth: &impl Authority,
    ) {
        let answer = match self.gate(now, from, 0, &key, Gate::Check, auth) {
            // Grants under an epoch this home has not learned are another home's.
            Ok(_) if token.epoch > auth.epoch() => Err(Refusal::StaleEpoch),
            Err(reason) => Err(reason),
            Ok(found) => match self.take_found(found) {
                None => Ok(CheckAnswer::UnknownKey),
                Some((k, mut e)) => {
                    self.service(now, &k, &mut e, auth);
                    let answer = self.judge(&k, &e, from, id, token);
                    self.finish(now, k, e);
                    match answer {
                        Some(answer) => Ok(answer),
                        None => return,
                    }
                }
            },
        };
        self.send(from, Body::CheckReply { key, id, answer });
    }

    /// What this home answers about `token` of key `e` (brought up to date), or `None` when it
    /// forwarded check `id` of `asker` to the holder of the token's live delegation instead.
    fn judge(
        &mut self,
        key: &KeyRef,
        e: &Entry,
        asker: NodeId,
        id: u64,
        token: FencingToken,
    ) -> Option<CheckAnswer> {
        let asked = Grantee::of(token);
        let last = match &e.phase {
            Phase::Held(live) if live.grantee == asked => {
                self.send(live.holder, Body::Probe { key: key.to_vec(), id, token, asker });
                return None;
            }
            Phase::Held(live) => match e.ahead().find(|n| n.successor.grantee == asked) {
                // A successor granted ahead may hold it already.
                Some(n) => {
                    let to = n.successor.to;
                    self.send(to, Body::Probe { key: key.to_vec(), id, token, asker });
                    return None;
                }
                None => e.ahead().last().map_or(live.grantee, |n| n.successor.grantee),
            },
            Phase::Delay { last, .. } | Phase::Free { last, .. } => *last,
        };
        // A grantee above the last one was never issued; an equal one's delegation has ended (and
        // its admissions are not known here).
        Some(if asked < last { CheckAnswer::Superseded } else { CheckAnswer::NotHeld })
    }

    #[allow(clippy::too_many_arguments)]
    fn on_handover(
        &mut self,
        now: Instant,
        from: NodeId,
        epoch: u64,
        key: Key,
        live: Option<Handed>,
        note: Option<Vec<u8>>,
        recovered: bool,
        lock_delay: Duration,
        auth: &impl Authority,
    ) {
        // Under another epoch the sender or this home is behind: the one behind will catch up,
        // and the sender resends (or, having moved on, stops).
        if epoch != auth.epoch() || key.len() > self.config.limits.max_key_len {
            return;
        }
        // Durations from the peer are bounded by what this home's epoch and configuration allow:
        // a lock-delay by this home's own, and a live delegation's time left by the epoch's fence
        // bound (no grant under its timing stays live longer). A longer `remaining` is not
        // adopted: the key then waits for `home_active`, which outlasts every earlier delegation.
        let lock_delay = lock_delay.min(self.config.lock_delay);
        let bound = auth.timing().fence_bound();
        let plausible = live.as_ref().is_none_or(|h| {
            h.remaining <= bound
                && h.ahead.len() <= self.config.limits.max_waiters_per_key
                && h.ahead.iter().all(|(_, r)| *r <= bound)
        });
        let found = self.keys.find(&key);
        let limits = &self.config.limits;
        let takes_slot = live.is_some() || !lock_delay.is_zero();
        let fits = if takes_slot {
            self.counts.live + self.counts.delayed < limits.max_delegations
        } else {
            self.counts.records < self.config.max_records
        };
        let adopt = from != self.config.id
            && fits
            && plausible
            && note.as_ref().is_none_or(|n| n.len() <= limits.max_note_len)
            && auth.home_of(&key) == Some(self.config.id)
            && auth.previous_home_of(&key) == Some(from)
            && found.slot.is_none()
            // Once the activation wait is over this home may have been active for the key, granted
            // it and forgotten it since the Handover was sent (a record that says no more than "no
            // record" is dropped), even if it has lost its lease now: the handed state is stale,
            // and no longer needed either (the wait outlasts every delegation of the previous
            // epoch).
            && (!auth.activation_passed(now) || self.bugs().late_handover);
        if adopt {
            let ppm = auth.timing().clock_rate_ppm;
            let k = self.keys.create(found.hash, Box::from(key.as_slice()));
            let mut e = Entry {
                phase: Phase::Free { note: None, recovered: true, until: now, last: NO_GRANTEE },
                queue: None,
                wake: NEVER,
                role: Role::Adopted,
                credit: 0,
                seen: self.generation,
            };
            match live {
                Some(h) => {
                    let end = now + rate_margin(h.remaining, ppm);
                    let live = Live { holder: h.holder, grantee: h.grantee, id: h.id, end };
                    e.phase = Phase::Held(live);
                    if !h.ahead.is_empty() {
                        let ahead = h.ahead.iter().map(|&(successor, remaining)| {
                            let end = now + rate_margin(remaining, ppm);
                            let asked = successor.lease;
                            Next { successor, asked, received: now, end, recalled: false }
                        });
                        e.queue = Some(Box::new(Queue {
                            waiters: VecDeque::new(),
                            recall_next: now,
                            recalled: false,
                            ahead: ahead.collect(),
                        }));
                    }
                }
                None if !lock_delay.is_zero() => {
                    e.phase = Phase::Delay { until: now + lock_delay, last: NO_GRANTEE }
                }
                None => self.set_free(now, &mut e, note.map(Vec::into_boxed_slice), recovered, NO_GRANTEE),
            }
            self.service(now, &k, &mut e, auth);
            self.finish(now, k, e);
        }
        self.send(from, Body::HandoverAck { key });
    }

    fn on_ack(&mut self, from: NodeId, epoch: u64, key: &[u8]) {
        let Some(slot) = self.keys.find(key).slot else { return };
        if self.moves.get(slot).is_some_and(|m| m.to == from && m.epoch == epoch) {
            self.moves.remove(slot);
            // Forget everything: the new home has taken the key over.
            if let Some((k, _)) = self.take_slot(slot, None) {
                self.keys.remove(k);
            }
        }
    }

    // ---- checks ----

    /// The checks every request passes before anything is allocated, in the documented order.
    /// Passed, it says where the key is.
    fn gate(
        &self,
        now: Instant,
        from: NodeId,
        epoch: u64,
        key: &[u8],
        gate: Gate,
        auth: &impl Authority,
    ) -> Result<Found, Refusal> {
        if gate == Gate::Request {
            if epoch != auth.epoch() {
                return Err(Refusal::StaleEpoch);
            }
            if !auth.is_member(from) {
                return Err(Refusal::NotMember);
            }
        }
        if key.len() > self.config.limits.max_key_len {
            return Err(Refusal::KeyTooLong);
        }
        let found = self.keys.find(key);
        let role = found.slot.and_then(|n| self.keys.entry(n)).map_or(Role::Home, |e| e.role);
        self.may_grant(now, key, role, auth)?;
        Ok(found)
    }

    /// Whether this home may grant `key` now: it is the key's home, it is active for the key
    /// (for adopted keys: holds its lease), and the restart quarantine is over.
    fn may_grant(&self, now: Instant, key: &[u8], role: Role, auth: &impl Authority) -> Result<(), Refusal> {
        if auth.home_of(key) != Some(self.config.id) || matches!(role, Role::Moved | Role::Tracking) {
            return Err(Refusal::NotHome);
        }
        let active = match role {
            Role::Adopted => auth.holds_lease(now),
            _ if self.bugs().ignore_activation => auth.holds_lease(now),
            _ => auth.home_active(now, key),
        };
        if !active {
            return Err(Refusal::Activating);
        }
        let quarantine_end = self.quarantine_end(&auth.timing());
        if now < quarantine_end {
            return Err(Refusal::Quarantine(quarantine_end.saturating_duration_since(now)));
        }
        Ok(())
    }

    /// The caps a grant of a key without a live delegation must fit in.
    fn grant_caps(&self, from: NodeId) -> Result<(), Refusal> {
        let limits = &self.config.limits;
        if self.counts.live + self.counts.delayed >= limits.max_delegations {
            return Err(Refusal::HomeFull);
        }
        if self.delegations_of(from) >= limits.max_per_requester {
            return Err(Refusal::RequesterFull);
        }
        Ok(())
    }

    // ---- per-key state changes ----

    /// Grants the free key `e` to `from` for request `id`, received at `received`, handing over
    /// the record's note.
    #[allow(clippy::too_many_arguments)]
    fn grant(
        &mut self,
        now: Instant,
        key: &KeyRef,
        e: &mut Entry,
        from: NodeId,
        id: RequestId,
        asked: Duration,
        received: Instant,
        auth: &impl Authority,
    ) {
        let (note, recovered) = match &mut e.phase {
            Phase::Free { note, recovered, .. } => (note.take(), *recovered),
            _ => (None, true),
        };
        self.counter += 1;
        self.counters.grants += 1;
        let grantee = Grantee { epoch: auth.epoch(), incarnation: auth.incarnation(), counter: self.counter };
        let (lease, credit, end) = self.credited(now, asked, received, auth);
        e.phase = Phase::Held(Live { holder: from, grantee, id, end });
        e.credit = credit_units(credit);
        if let Some(q) = e.queue.as_mut() {
            // Others still wait: the new holder hears so at once.
            q.recall_next = now;
            q.recalled = false;
        }
        if e.role == Role::Stale {
            // Granted behind `home_active`: every other home's delegation has ended.
            e.role = Role::Home;
        }
        let note = note.map(Vec::from);
        self.send(from, Body::Grant { key: key.to_vec(), id, grantee, lease, note, recovered });
    }

    /// The lease a grant at `now` of a request asking `asked`, received at `received`, carries,
    /// and the conservative end it gives the delegation. The holder counts the lease from the
    /// request's first send, which is before `received`, so a request that waited in line would
    /// get a lease spent on arrival (a waiter that waits longer than a lease, as waiters behind
    /// holders that keep the key to their deadlines do, would hand every grant back and ask
    /// again at the back of the line). So the lease is credited with the wait: `granted_lease +
    /// shrink(now − received)`. The holder's deadline still comes before the end, `now +
    /// rate_margin(granted_lease)`: the credit is at most the real time from `received` to
    /// `now` shrunk by `1 − ε`, and the request was sent before `received`, so the deadline
    /// passes, in real time, no later than one sent at `now` for `granted_lease` would (D5).
    /// Returns the lease, the credit in it, and the end.
    fn credited(
        &self,
        now: Instant,
        asked: Duration,
        received: Instant,
        auth: &impl Authority,
    ) -> (Duration, Duration, Instant) {
        let ppm = auth.timing().clock_rate_ppm;
        let lease = granted_lease(asked, auth);
        let waited = now.saturating_duration_since(received);
        let credit = if self.bugs().unshrunk_credit { waited } else { shrink(waited, ppm) };
        (lease.saturating_add(credit), credit, now + self.margin(lease, ppm))
    }

    /// Makes `e` free with what the next grant carries, within the record caps; `last` is the
    /// delegation that just ended.
    fn set_free(
        &mut self,
        now: Instant,
        e: &mut Entry,
        note: Option<Box<[u8]>>,
        recovered: bool,
        last: Grantee,
    ) {
        let over_bytes =
            note.as_ref().is_some_and(|n| self.counts.record_bytes + n.len() > self.config.max_record_bytes);
        let over_count = self.counts.records >= self.config.max_records && e.role != Role::Moved;
        let (note, recovered) = if over_bytes || over_count { (None, true) } else { (note, recovered) };
        e.phase = Phase::Free { note, recovered, until: now + self.config.record_retention, last };
    }

    /// Brings `e` up to date at `now`: expiries, lock-delay ends, grants to queued requesters,
    /// waits that ran out, Recall and Handover sends. Afterwards every deadline of `e` is later
    /// than `now`.
    fn service(&mut self, now: Instant, key: &KeyRef, e: &mut Entry, auth: &impl Authority) {
        let retry = retry_period(&auth.timing());
        loop {
            match &e.phase {
                Phase::Held(live) if now >= live.end => self.end_live(now, key, e, Ended::Expired, auth),
                Phase::Delay { until, last } if now >= *until => {
                    let last = *last;
                    self.set_free(now, e, None, true, last);
                }
                // Each promotion grants or refuses at least one waiter, so the loop ends.
                Phase::Free { .. } if e.queue.as_ref().is_some_and(|q| !q.waiters.is_empty()) => {
                    debug_assert!(e.ahead().next().is_none(), "a free key has no successors");
                    self.promote(now, key, e, auth)
                }
                _ => break,
            }
        }
        if let Some(q) = e.queue.as_mut() {
            // Past its conservative end a successor holds nothing, whether passed it or not. The
            // one before it passes to it, or releases to this home, which then grants the one
            // after it (a delegation after it may have been passed the key already: it stays).
            q.ahead.retain(|n| now < n.end);
            e.tidy_queue();
        }
        self.expire_waiters(now, key, e);
        if matches!(e.phase, Phase::Held(_)) && e.queue.is_some() {
            self.recall(now, key, e, retry, auth);
        }
        if e.role == Role::Moved {
            self.hand_over(now, key, e, retry);
        }
    }

    /// Sends the Recalls held key `e` owes (someone waits, or a successor was granted ahead).
    /// While this home may grant the key, the waiters first in line are granted ahead at the end
    /// of the chain ([`Home::grant_ahead`]), and the holder each new one follows is recalled at
    /// once, naming it. When the Recall period comes round, every delegation of the chain is
    /// recalled again, each naming the one after it (only while this home may grant the key),
    /// and the last one too if anyone still waits.
    fn recall(&mut self, now: Instant, key: &KeyRef, e: &mut Entry, retry: Duration, auth: &impl Authority) {
        let Phase::Held(live) = &e.phase else { return };
        let (holder, grantee) = (live.holder, live.grantee);
        let Some(q) = e.queue.as_ref() else { return };
        let due = now >= q.recall_next;
        let first_new = q.ahead.len();
        let extends = q.waiters.front().is_some_and(|w| w.from != q.tail(holder));
        if !due && !extends {
            return;
        }
        let may_pass = self.config.passes
            && self.config.lock_delay.is_zero()
            && matches!(e.role, Role::Home | Role::Adopted)
            && self.may_grant(now, key, e.role, auth).is_ok();
        if may_pass {
            self.grant_ahead(now, e, holder, auth);
        }
        let Some(q) = e.queue.as_mut() else { return };
        // Link `i` is the delegation the key passes on from to `ahead[i]`: 0 the live one.
        let links = if due {
            q.recall_next = now + retry;
            let last = q.ahead.len() + usize::from(!q.waiters.is_empty());
            0..last
        } else {
            first_new..q.ahead.len()
        };
        for i in links {
            let (node, link, sent) = match i.checked_sub(1) {
                None => (holder, grantee, &mut q.recalled),
                Some(j) => {
                    let n = &mut q.ahead[j];
                    (n.successor.to, n.successor.grantee, &mut n.recalled)
                }
            };
            if !std::mem::replace(sent, true) {
                self.counters.recalls += 1;
            }
            let next = q.ahead.get(i).filter(|_| may_pass).map(|n| n.successor);
            self.send(node, Body::Recall { key: key.to_vec(), grantee: link, next });
        }
    }

    /// Grants the waiters first in line for held key `e` ahead, at the end of its chain of
    /// [`Next`] delegations, while the first is not the node the key would pass to it from (that
    /// node's request is served, or refused, when the key is free, as without passes) and is
    /// under its per-requester cap. Their waits that ran out were refused already.
    fn grant_ahead(&mut self, now: Instant, e: &mut Entry, holder: NodeId, auth: &impl Authority) {
        let Some(q) = e.queue.as_mut() else { return };
        while let Some(&w) = q.waiters.front() {
            if w.from == q.tail(holder) || self.delegations_of(w.from) >= self.config.limits.max_per_requester
            {
                return;
            }
            q.waiters.pop_front();
            self.counter += 1;
            self.counters.grants += 1;
            self.counters.passes += 1;
            let grantee =
                Grantee { epoch: auth.epoch(), incarnation: auth.incarnation(), counter: self.counter };
            let (lease, _, end) = self.credited(now, w.lease, w.received, auth);
            let successor = Successor { to: w.from, id: w.id, grantee, lease };
            let (asked, received) = (w.lease, w.received);
            q.ahead.push_back(Next { successor, asked, received, end, recalled: false });
        }
    }

    /// The holder of successor `ahead[i]` of `e` resent its request: it still waits for the key.
    /// While this home may grant ahead (as [`Home::recall`] decides), the successor's lease is
    /// credited again with its wait up to now and its end moved to the credit's, and the
    /// delegation before it is recalled at once naming the credited successor, so that however
    /// long the key takes to reach it, it arrives with about a lease left (at most a resend
    /// period less). A holder that stops resending (it crashed, or its lockers left) is not
    /// credited again: its successor reaches its end as before.
    fn credit_again(&mut self, now: Instant, key: &KeyRef, e: &mut Entry, i: usize, auth: &impl Authority) {
        let may_pass = self.config.passes
            && self.config.lock_delay.is_zero()
            && matches!(e.role, Role::Home | Role::Adopted)
            && self.may_grant(now, key, e.role, auth).is_ok();
        let (Phase::Held(live), Some(q), true) = (&e.phase, e.queue.as_mut(), may_pass) else { return };
        let (to, grantee) = match i.checked_sub(1) {
            None => (live.holder, live.grantee),
            Some(j) => (q.ahead[j].successor.to, q.ahead[j].successor.grantee),
        };
        let n = &mut q.ahead[i];
        let (lease, _, end) = self.credited(now, n.asked, n.received, auth);
        n.successor.lease = lease;
        if !self.bugs().stale_credit_end {
            n.end = n.end.max(end);
        }
        let next = Some(n.successor);
        self.send(to, Body::Recall { key: key.to_vec(), grantee, next });
    }

    /// The delegations of `e` up to `ahead[i]` have ended, each passing the key to the next:
    /// makes `ahead[i]` the live delegation.
    fn pass_along(&mut self, now: Instant, key: &KeyRef, e: &mut Entry, i: usize, auth: &impl Authority) {
        for _ in 0..=i {
            self.end_live(now, key, e, Ended::Passed, auth);
        }
    }

    /// The live delegation of `e` ended as `how` says. The first successor granted ahead becomes
    /// the live delegation: passed on by the holder; or, if the holder released without passing
    /// it, or the delegation expired (the holder may have passed it, and its `Release` was lost),
    /// or the holder passed the key to a successor dropped since (which may have passed it on),
    /// granted by this home itself, if it still may. Only a successor that nobody can have passed
    /// anything to is dropped when this home may not grant: after a release that passed nothing,
    /// with the chain after it; every other stays tracked as live regardless. Without a successor
    /// the key is free, or (expired) free or in lock-delay.
    fn end_live(&mut self, now: Instant, key: &KeyRef, e: &mut Entry, how: Ended, auth: &impl Authority) {
        let Phase::Held(live) = &e.phase else { return };
        let (end, last) = (live.end, live.grantee);
        let next = e.queue.as_mut().and_then(|q| q.ahead.pop_front());
        e.tidy_queue();
        let Some(Next { successor: mut s, asked, received, end: next_end, recalled }) = next else {
            match how {
                Ended::Released { note, recovered } => self.set_free(now, e, note, recovered, last),
                // Callers say `Passed` only of a successor they found.
                Ended::Passed | Ended::PassedToDropped => self.set_free(now, e, None, true, last),
                Ended::Expired => self.expire(now, key, e, end, last),
            }
            return;
        };
        if matches!(how, Ended::Expired) {
            self.counters.expiries += 1;
        }
        let taken = Live { holder: s.to, grantee: s.grantee, id: s.id, end: next_end };
        let may_grant = self.may_grant(now, key, e.role, auth).is_ok();
        // What the home itself must send the successor, if anything.
        let grant = match how {
            Ended::Passed if self.bugs().forget_passes => {
                // The chain after `s` is forgotten with it: a free key has no successors.
                if let Some(q) = e.queue.as_mut() {
                    q.ahead.clear();
                }
                e.tidy_queue();
                self.set_free(now, e, None, true, s.grantee);
                return;
            }
            Ended::Passed => None,
            Ended::Released { note, recovered } if !may_grant => {
                // Never delivered, and this home may not deliver it now.
                let last = e.ahead().last().map_or(s.grantee, |n| n.successor.grantee);
                if let Some(q) = e.queue.as_mut() {
                    q.ahead.clear();
                }
                e.tidy_queue();
                self.set_free(now, e, note, recovered, last);
                return;
            }
            Ended::Released { note, recovered } => Some((note.map(Vec::from), recovered)),
            Ended::PassedToDropped | Ended::Expired => may_grant.then_some((None, true)),
        };
        e.phase = Phase::Held(taken);
        // Passed on by a holder: a resend the successor made before the Pass reached it is a
        // stray there, and needs no credit.
        e.credit = 0;
        if let Some((note, recovered)) = grant {
            // Granted now by this home: credited with the wait up to now, like any grant.
            let (lease, credit, end) = self.credited(now, asked, received, auth);
            s.lease = lease;
            if let Phase::Held(live) = &mut e.phase {
                live.end = live.end.max(end);
            }
            e.credit = credit_units(credit);
            let body = Body::Grant {
                key: key.to_vec(),
                id: s.id,
                grantee: s.grantee,
                lease: s.lease,
                note,
                recovered,
            };
            self.send(s.to, body);
        }
        self.counters.handoffs += 1;
        if let Some(q) = e.queue.as_mut() {
            // Others still wait: the new holder hears so at once, unless it was recalled already
            // while it waited in the chain.
            q.recalled = recalled;
            if !recalled {
                q.recall_next = now;
            }
        }
    }

    /// The delegation `last` of `e` reached its conservative end `end` (at or before `now`).
    fn expire(&mut self, now: Instant, key: &KeyRef, e: &mut Entry, end: Instant, last: Grantee) {
        self.counters.expiries += 1;
        let lock_delay = self.config.lock_delay;
        if lock_delay.is_zero() || matches!(e.role, Role::Tracking) {
            self.set_free(now, e, None, true, last);
            return;
        }
        self.counters.lock_delays += 1;
        let until = end + lock_delay;
        e.phase = Phase::Delay { until, last };
        if until > now {
            // Those who would stop waiting before the delay ends hear so now.
            let remaining = until.saturating_duration_since(now);
            self.refuse_waiters_where(key, e, |w| w.deadline <= until, Refusal::LockDelay(remaining));
        }
    }

    /// Grants the free key `e` to its first queued requester that may have it, or refuses them all
    /// if this home may not grant the key now.
    fn promote(&mut self, now: Instant, key: &KeyRef, e: &mut Entry, auth: &impl Authority) {
        if let Err(reason) = self.may_grant(now, key, e.role, auth) {
            self.refuse_waiters(key, e, reason);
            return;
        }
        while let Some(w) = e.pop_waiter() {
            if w.deadline <= now {
                self.refuse(w.from, key.to_vec(), w.id, Refusal::WaitExpired);
            } else if self.delegations_of(w.from) >= self.config.limits.max_per_requester {
                self.refuse(w.from, key.to_vec(), w.id, Refusal::RequesterFull);
            } else {
                self.counters.handoffs += 1;
                self.grant(now, key, e, w.from, w.id, w.lease, w.received, auth);
                return;
            }
        }
    }

    fn expire_waiters(&mut self, now: Instant, key: &KeyRef, e: &mut Entry) {
        self.refuse_waiters_where(key, e, |w| w.deadline <= now, Refusal::WaitExpired);
    }

    fn refuse_waiters(&mut self, key: &KeyRef, e: &mut Entry, reason: Refusal) {
        self.refuse_waiters_where(key, e, |_| true, reason);
    }

    fn refuse_waiters_where(
        &mut self,
        key: &KeyRef,
        e: &mut Entry,
        mut which: impl FnMut(&Waiter) -> bool,
        reason: Refusal,
    ) {
        let Some(q) = e.queue.as_mut() else { return };
        let mut refused = Vec::new();
        q.waiters.retain(|w| {
            let refuse = which(w);
            if refuse {
                refused.push((w.from, w.id));
            }
            !refuse
        });
        e.tidy_queue();
        for (from, id) in refused {
            self.refuse(from, key.to_vec(), id, reason);
        }
    }

    /// Sends the Handover of moved key `e` if it is due, or gives up.
    fn hand_over(&mut self, now: Instant, key: &KeyRef, e: &mut Entry, retry: Duration) {
        let Some(m) = self.moves.get_mut(key.slot) else { return };
        if now < m.next_send {
            return;
        }
        let (live, note, recovered, lock_delay) = match &e.phase {
            Phase::Held(live) => {
                let remaining = live.end.saturating_duration_since(now);
                let ahead = e.ahead().map(|n| (n.successor, n.end.saturating_duration_since(now))).collect();
                let handed =
                    Handed { holder: live.holder, grantee: live.grantee, id: live.id, remaining, ahead };
                (Some(handed), None, false, Duration::ZERO)
            }
            Phase::Delay { until, .. } => (None, None, true, until.saturating_duration_since(now)),
            Phase::Free { note, recovered, .. } => {
                (None, note.as_deref().map(<[u8]>::to_vec), *recovered, Duration::ZERO)
            }
        };
        if live.is_none() && m.sends >= HANDOVER_SENDS {
            // Nothing live to protect: forget the key; the new home waits out the activation.
            self.moves.remove(key.slot);
            e.role = Role::Tracking;
            e.phase = Phase::Free { note: None, recovered: true, until: now, last: NO_GRANTEE };
            return;
        }
        // Only sends without a live delegation count towards giving up.
        m.sends = if live.is_some() { 0 } else { m.sends + 1 };
        m.next_send = now + retry;
        let to = m.to;
        self.moves.list(key.slot, now + retry);
        self.send(to, Body::Handover { key: key.to_vec(), live, note, recovered, lock_delay });
    }

    // ---- bookkeeping ----

    /// Takes `key`'s entry out of [`Keys`] (and out of the totals) for processing.
    fn take(&mut self, key: &[u8]) -> Option<(KeyRef, Entry)> {
        let found = self.keys.find(key);
        self.take_found(found)
    }

    /// [`Home::take`] of a key already looked up.
    fn take_found(&mut self, found: Found) -> Option<(KeyRef, Entry)> {
        self.take_slot(found.slot?, Some(found.hash))
    }

    /// [`Home::take`] of the key in slot `slot` (whose hash is `hash`, if known), if any.
    fn take_slot(&mut self, slot: u32, hash: Option<u64>) -> Option<(KeyRef, Entry)> {
        let (k, e) = self.keys.take(slot, hash)?;
        for holder in e.holders() {
            if let Some(n) = self.counts.per_holder.get_mut(&holder) {
                *n -= 1;
                if *n == 0 {
                    self.counts.per_holder.remove(&holder);
                }
            }
        }
        match &e.phase {
            Phase::Held(_) => self.counts.live -= 1,
            Phase::Delay { .. } => self.counts.delayed -= 1,
            Phase::Free { note, .. } => {
                self.counts.records -= 1;
                self.counts.record_bytes -= note.as_ref().map_or(0, |n| n.len());
            }
        }
        Some((k, e))
    }

    /// Puts a processed entry back, or drops it when there is nothing left worth keeping, and
    /// arms its next wake-up.
    fn finish(&mut self, now: Instant, key: KeyRef, mut e: Entry) {
        let keep = match &e.phase {
            Phase::Held(_) | Phase::Delay { .. } => true,
            Phase::Free { note, recovered, until, .. } => match e.role {
                Role::Moved => true,
                Role::Tracking => false,
                Role::Adopted => now < *until,
                Role::Home | Role::Stale => (note.is_some() || !recovered) && now < *until,
            },
        };
        if !keep {
            self.moves.remove(key.slot);
            self.keys.remove(key);
            return;
        }
        if let Some(at) = e.next_wake()
            && at < e.wake
        {
            debug_assert!(at > now, "a wake-up at {at:?} is not after {now:?}: it would spin");
            e.wake = at;
            self.timers.push(Reverse((at, key.slot)));
        }
        for holder in e.holders() {
            *self.counts.per_holder.entry(holder).or_default() += 1;
        }
        match &e.phase {
            Phase::Held(_) => self.counts.live += 1,
            Phase::Delay { .. } => self.counts.delayed += 1,
            Phase::Free { note, .. } => {
                self.counts.records += 1;
                self.counts.record_bytes += note.as_ref().map_or(0, |n| n.len());
            }
        }
        self.keys.restore(key, e);
    }

    /// The switches in force (all off without the `bug-injection` feature).
    fn bugs(&self) -> crate::bugs::Bugs {
        #[cfg(feature = "bug-injection")]
        return self.config.bugs;
        #[cfg(not(feature = "bug-injection"))]
        crate::bugs::Bugs::default()
    }

    /// `rate_margin(lease, ppm)`: the home's conservative view of a lease it grants.
    fn margin(&self, lease: Duration, ppm: u32) -> Duration {
        if self.bugs().no_rate_margin { lease } else { rate_margin(lease, ppm) }
    }

    fn send(&mut self, to: NodeId, body: Body) {
        let epoch = self.epoch.unwrap_or(0);
        self.out.push_back((to, Message { epoch, body }));
    }

    fn refuse(&mut self, to: NodeId, key: Key, id: RequestId, reason: Refusal) {
        self.send(to, Body::Refuse { key, id, reason });
    }
}

impl Queue {
    /// The node the key passes from to the next successor granted ahead: the last successor's,
    /// or `holder`'s (the live delegation's) if there is none.
    fn tail(&self, holder: NodeId) -> NodeId {
        self.ahead.back().map_or(holder, |n| n.successor.to)
    }
}

impl Live {
    fn view(&self) -> Delegation {
        Delegation { holder: self.holder, grantee: self.grantee, end: self.end }
    }
}

impl Entry {
    /// The earliest instant something happens to the key by itself (its handover's resends
    /// aside: [`Moves`] lists those).
    fn next_wake(&self) -> Option<Instant> {
        let first_deadline = self.queue.as_ref().and_then(|q| q.waiters.iter().map(|w| w.deadline).min());
        match &self.phase {
            Phase::Held(live) => {
                let recall = self.queue.as_ref().map(|q| q.recall_next);
                let ahead = self.ahead().map(|n| n.end).min();
                [Some(live.end), first_deadline, recall, ahead].into_iter().flatten().min()
            }
            Phase::Delay { until, .. } => first_deadline.map_or(Some(*until), |d| Some(d.min(*until))),
            Phase::Free { until, .. } => (self.role != Role::Moved).then_some(*until),
        }
    }

    /// Requesters in line: queued, or granted ahead.
    fn waiting(&self) -> usize {
        self.queue.as_ref().map_or(0, |q| q.waiters.len() + q.ahead.len())
    }

    fn pop_waiter(&mut self) -> Option<Waiter> {
        let w = self.queue.as_mut()?.waiters.pop_front();
        self.tidy_queue();
        w
    }

    /// Drops the queue once nobody is left in it.
    fn tidy_queue(&mut self) {
        if self.queue.as_ref().is_some_and(|q| q.waiters.is_empty() && q.ahead.is_empty()) {
            self.queue = None;
        }
    }

    /// The chain of successors granted ahead, in the order the key passes along it.
    fn ahead(&self) -> std::collections::vec_deque::Iter<'_, Next> {
        self.queue.as_ref().map_or_else(Default::default, |q| q.ahead.iter())
    }

    /// Where in the chain the successor `grantee` granted ahead to `from` is, if it is.
    fn position(&self, from: NodeId, grantee: Grantee) -> Option<usize> {
        self.ahead().position(|n| n.successor.to == from && n.successor.grantee == grantee)
    }

    /// The nodes that may hold a delegation of the key: the live one's holder and the chain's.
    fn holders(&self) -> impl Iterator<Item = NodeId> + '_ {
        let live = match &self.phase {
            Phase::Held(live) => Some(live.holder),
            _ => None,
        };
        live.into_iter().chain(self.ahead().map(|n| n.successor.to))
    }
}

/// Drops what the next grant would have carried: this home can no longer vouch for it.
fn forget_record(e: &mut Entry) {
    if let Phase::Free { note, recovered, .. } = &mut e.phase {
        *note = None;
        *recovered = true;
    }
}

/// The unit [`Entry::credit`] counts in: 16 ms, so that up to about 17 minutes fit.
const CREDIT_UNIT: Duration = Duration::from_millis(16);

/// `d` in whole [`CREDIT_UNIT`]s, rounded down, at most `u16::MAX` of them.
fn credit_units(d: Duration) -> u16 {
    u16::try_from(d.as_nanos() / CREDIT_UNIT.as_nanos()).unwrap_or(u16::MAX)
}

/// The lease a grant or renewal gives for an `asked` one: at most the current epoch's
/// `max_delegation_lease`, read at the instant of granting. A request queued under an earlier epoch
/// may be granted under a later one that allows less; and [`Authority::home_active`] vouches only
/// for delegations of the current epoch's length.
fn granted_lease(asked: Duration, auth: &impl Authority) -> Duration {
    asked.min(auth.timing().max_delegation_lease)
}

/// The Recall and Handover resend period: a quarter home lease, at least [`MIN_RETRY`].
pub fn retry_period(timing: &Timing) -> Duration {
    (timing.home_lease / 4).max(MIN_RETRY)
}

/// The longest lease that, counted by any node from any instant before now on its own clock,
/// surely ends before `remaining` has passed on this node's clock: the inverse of
/// [`rate_margin`], rounded down (`rate_margin(shrink(r)) <= r`).
pub fn shrink(remaining: Duration, rate_ppm: u32) -> Duration {
    const PPM: u128 = 1_000_000;
    let eps = u128::from(rate_ppm);
    if eps >= PPM {
        return Duration::ZERO;
    }
    let nanos = remaining.as_nanos() * (PPM - eps) / (PPM + eps);
    u64::try_from(nanos).map_or(Duration::MAX, Duration::from_nanos)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shrink_inverts_the_margin() {
        for ppm in [0, 1, 10_000, 100_000] {
            for nanos in [0, 1, 999, 1_000_000_007, 3_600_000_000_000] {
                let r = Duration::from_nanos(nanos);
                let s = shrink(r, ppm);
                assert!(rate_margin(s, ppm) <= r, "{ppm} {nanos}");
                assert!(rate_margin(s + Duration::from_nanos(2), ppm) > r || ppm == 0, "{ppm} {nanos}");
            }
        }
    }

    #[test]
    fn per_key_state_is_small() {
        // The figure the module documentation quotes.
        assert_eq!(std::mem::size_of::<Live>(), 56);
        assert!(std::mem::size_of::<Entry>() <= 88, "{}", std::mem::size_of::<Entry>());
        assert_eq!(Home::ENTRY_BYTES, 104);
        assert_eq!(std::mem::size_of::<Reverse<(Instant, u32)>>(), 16);
        assert_eq!(std::mem::size_of::<Waiter>(), 56);
        assert_eq!(std::mem::size_of::<Queue>(), 80);
    }
}
