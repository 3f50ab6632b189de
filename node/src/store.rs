//! The node's durable state, kept in a [redb] database file: [`RedbStore`].
//!
//! # What is stored
//!
//! One table, `meta`, maps a key (`&str`) to a postcard-encoded value (`&[u8]`):
//!
//! | key              | value                                   | written by                |
//! |------------------|-----------------------------------------|---------------------------|
//! | `schema`         | `u32`, [`SCHEMA_VERSION`]               | [`RedbStore::create`]     |
//! | `identity`       | [`NodeId`] of this node                 | [`RedbStore::create`]     |
//! | `genesis_digest` | `[u8; 32]`, [`Durable::genesis_digest`] | [`RedbStore::create`]     |
//! | `current_epoch`  | [`EpochRecord`], [`Durable::current`]   | create, [`Write::Epoch`]  |
//! | `acceptor`       | [`Durable::acceptor`]                   | create, `Write::Epoch`, [`Write::Acceptor`] |
//! | `incarnation`    | `u64`, [`Durable::incarnation`]         | create, [`Write::Incarnation`] |
//!
//! Each field has its own key, so a commit rewrites only the fields its writes changed: bumping the
//! incarnation or recording a promise does not rewrite the (up to a few hundred KiB) epoch record.
//! Every value is decoded with a size bound ([`MAX_VALUE_LEN`]) and must be consumed exactly; a
//! missing, oversized or undecodable value is reported as [`StoreError::Corrupt`], never a panic.
//! `schema` is checked first on [`RedbStore::open`]: a version this binary does not know is
//! [`StoreError::UnknownSchema`]. A schema 1 store (its records without `retired`) is read as
//! records with none retired and rewritten as schema 2 in one transaction when it is opened.
//!
//! # Guarantees
//!
//! [`Storage::commit`] applies its writes in order (with [`Durable::apply`]'s rules, so stale
//! writes are no-ops) in a single redb write transaction with [`Durability::Immediate`]: when it
//! returns `Ok`, every write is on disk (fsync'd) and survives a crash of the process or machine;
//! a crash during the commit leaves either all of its writes or none of them. A commit whose writes
//! are all stale changes nothing and returns at once, since the state it leaves is already durable.
//!
//! When `commit` returns an error, the handle's view of the state is unchanged and the handle
//! refuses every further commit ([`StoreError::Poisoned`]). What reached the disk is still all or
//! nothing, but which of the two is unknown (redb may have made a failed commit durable). So **an
//! error from `commit` must stop the node from acknowledging anything** that depended on the writes
//! — no vote, no reply — and the node must stop; on restart it [`open`](RedbStore::open)s the store
//! again and [`load`](Storage::load)s whatever is actually there.
//!
//! The database is opened in redb's exclusive mode: while one handle is open, no other handle or
//! process can open the file. Every open (and create) verifies redb's page checksums, so a file
//! damaged outside redb is refused with an error rather than trusted; after a crash, the open
//! recovers the last committed transaction.

use std::fmt;
use std::path::{Path, PathBuf};

use keyhome_epoch::paxos::AcceptorState;
use keyhome_epoch::record::RecordV1;
use keyhome_epoch::{Durable, EpochRecord, NodeId, Storage, Write};
use redb::{Database, Durability, ReadableDatabase, TableDefinition};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Version of the layout described in the module docs. Bump it on any change to the keys, the
/// table, or the encoding of a value; [`RedbStore::open`] refuses any other version.
/// 2: an epoch record names its retired nodes.
pub const SCHEMA_VERSION: u32 = 2;

/// Largest value, in bytes, that is written or read back. A valid epoch record (at most 1024
/// members with 255-byte addresses) encodes to under 300 KiB, and the acceptor state holds at most
/// one record; anything larger on disk is corruption.
pub const MAX_VALUE_LEN: usize = 1 << 20;

/// The single table holding every field.
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");

const KEY_SCHEMA: &str = "schema";
const KEY_IDENTITY: &str = "identity";
const KEY_GENESIS_DIGEST: &str = "genesis_digest";
const KEY_CURRENT_EPOCH: &str = "current_epoch";
const KEY_ACCEPTOR: &str = "acceptor";
const KEY_INCARNATION: &str = "incarnation";

/// What a store operation was doing when redb failed; part of [`StoreError::Db`]'s message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Create,
    Open,
    Load,
    Commit,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Create => "creating",
            Op::Open => "opening",
            Op::Load => "loading",
            Op::Commit => "committing to",
        })
    }
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// redb (or the file system beneath it) failed.
    #[error("{op} store {path}: {step}: {source}")]
    Db {
        path: PathBuf,
        op: Op,
        /// The step that failed, e.g. "begin write transaction".
        step: &'static str,
        #[source]
        source: Box<redb::Error>,
    },
    /// [`RedbStore::open`] found no file at the path.
    #[error("no store at {path}: the file does not exist (create the store first)")]
    Missing { path: PathBuf },
    /// [`RedbStore::create`] found a database that already holds data.
    #[error("{path} already holds data; refusing to initialise a store over it")]
    AlreadyInitialised { path: PathBuf },
    /// [`RedbStore::open`] found a redb database that holds no keyhome store.
    #[error("{path} is a database but holds no initialised store (no `{key}` entry)")]
    NotInitialised { path: PathBuf, key: &'static str },
    /// A stored value is missing, too large, or does not decode.
    #[error("corrupt store {path}: value `{what}`: {detail}")]
    Corrupt { path: PathBuf, what: &'static str, detail: String },
    /// The store was written under a schema version this binary does not know.
    #[error("store schema version {0} is not supported (this binary reads version {SCHEMA_VERSION})")]
    UnknownSchema(u32),
    /// A value could not be encoded within [`MAX_VALUE_LEN`]; nothing was written.
    #[error("cannot store value `{what}` in {path}: {detail}")]
    Encode { path: PathBuf, what: &'static str, detail: String },
    /// An earlier commit through this handle failed; the node must stop and reopen the store.
    #[error("an earlier commit to {path} failed; the store must be reopened")]
    Poisoned { path: PathBuf },
}

/// A node's [`Durable`] state and identity in a redb file. See the module docs.
pub struct RedbStore {
    db: Database,
    path: PathBuf,
    identity: NodeId,
    /// The state as last committed through this handle (what the file holds).
    state: Durable,
    /// Set when a commit fails; every later commit is refused.
    poisoned: bool,
}

impl fmt::Debug for RedbStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedbStore")
            .field("path", &self.path)
            .field("identity", &self.identity)
            .field("epoch", &self.state.current.number)
            .field("incarnation", &self.state.incarnation)
            .field("poisoned", &self.poisoned)
            .finish_non_exhaustive()
    }
}

impl RedbStore {
    /// Initialises a new store at `path` holding [`Durable::genesis`] of `genesis` and this node's
    /// `identity`, durably. The file may be absent or empty, or an empty redb database; a database
    /// that already holds any table is refused with [`StoreError::AlreadyInitialised`].
    pub fn create(
        path: impl AsRef<Path>,
        genesis: &EpochRecord,
        identity: NodeId,
    ) -> Result<RedbStore, StoreError> {
        let path = path.as_ref().to_path_buf();
        let db_err = |step, e: redb::Error| db_error(&path, Op::Create, step, e);
        let db = Database::builder()
            .set_check_integrity_on_open(true)
            .create(&path)
            .map_err(|e| db_err("open database", e.into()))?;

        let read = db.begin_read().map_err(|e| db_err("begin read transaction", e.into()))?;
        let has_tables = read.list_tables().map_err(|e| db_err("list tables", e.into()))?.next().is_some();
        drop(read);
        if has_tables {
            return Err(StoreError::AlreadyInitialised { path });
        }

        let state = Durable::genesis(genesis.clone());
        let values = [
            (KEY_SCHEMA, encode(&path, KEY_SCHEMA, &SCHEMA_VERSION)?),
            (KEY_IDENTITY, encode(&path, KEY_IDENTITY, &identity)?),
            (KEY_GENESIS_DIGEST, encode(&path, KEY_GENESIS_DIGEST, &state.genesis_digest)?),
            (KEY_CURRENT_EPOCH, encode(&path, KEY_CURRENT_EPOCH, &state.current)?),
            (KEY_ACCEPTOR, encode(&path, KEY_ACCEPTOR, &state.acceptor)?),
            (KEY_INCARNATION, encode(&path, KEY_INCARNATION, &state.incarnation)?),
        ];
        write_values(&db, &path, Op::Create, &values)?;
        sync_parent_dir(&path).map_err(|e| db_err("sync parent directory", e.into()))?;

        Ok(RedbStore { db, path, identity, state, poisoned: false })
    }

    /// Opens the store that [`create`](RedbStore::create) initialised at `path`, recovering it first
    /// if the last process to write it crashed.
    pub fn open(path: impl AsRef<Path>) -> Result<RedbStore, StoreError> {
        let path = path.as_ref().to_path_buf();
        let db = match Database::builder().set_check_integrity_on_open(true).open(&path) {
            Ok(db) => db,
            Err(redb::DatabaseError::Storage(redb::StorageError::Io(e)))
                if e.kind() == std::io::ErrorKind::NotFound =>
            {
                return Err(StoreError::Missing { path });
            }
            Err(e) => return Err(db_error(&path, Op::Open, "open database", e.into())),
        };
        let (identity, state, schema) = read_all(&db, &path, Op::Open)?;
        if schema != SCHEMA_VERSION {
            let values = [
                (KEY_SCHEMA, encode(&path, KEY_SCHEMA, &SCHEMA_VERSION)?),
                (KEY_CURRENT_EPOCH, encode(&path, KEY_CURRENT_EPOCH, &state.current)?),
                (KEY_ACCEPTOR, encode(&path, KEY_ACCEPTOR, &state.acceptor)?),
            ];
            write_values(&db, &path, Op::Open, &values)?;
        }
        Ok(RedbStore { db, path, identity, state, poisoned: false })
    }

    /// This node's identity, as given to [`create`](RedbStore::create).
    pub fn identity(&self) -> NodeId {
        self.identity
    }

    /// Digest of the genesis epoch the store was created with.
    pub fn genesis_digest(&self) -> [u8; 32] {
        self.state.genesis_digest
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn commit_inner(&mut self, writes: &[Write]) -> Result<(), StoreError> {
        let mut next = self.state.clone();
        writes.iter().for_each(|w| next.apply(w));

        let mut values = Vec::with_capacity(3);
        if next.current != self.state.current {
            values.push((KEY_CURRENT_EPOCH, encode(&self.path, KEY_CURRENT_EPOCH, &next.current)?));
        }
        if next.acceptor != self.state.acceptor {
            values.push((KEY_ACCEPTOR, encode(&self.path, KEY_ACCEPTOR, &next.acceptor)?));
        }
        if next.incarnation != self.state.incarnation {
            values.push((KEY_INCARNATION, encode(&self.path, KEY_INCARNATION, &next.incarnation)?));
        }
        if values.is_empty() {
            return Ok(());
        }
        write_values(&self.db, &self.path, Op::Commit, &values)?;
        self.state = next;
        Ok(())
    }
}

impl Storage for RedbStore {
    type Error = StoreError;

    /// Reads the state back from the file (never `None`: a `RedbStore` is always initialised).
    fn load(&self) -> Result<Option<Durable>, StoreError> {
        read_all(&self.db, &self.path, Op::Load).map(|(_, state, _)| Some(state))
    }

    fn commit(&mut self, writes: &[Write]) -> Result<(), StoreError> {
        if self.poisoned {
            return Err(StoreError::Poisoned { path: self.path.clone() });
        }
        let result = self.commit_inner(writes);
        if result.is_err() {
            self.poisoned = true;
        }
        result
    }
}

/// Writes `values` into `meta` in one write transaction that is fsync'd before it returns. On error
/// the transaction is dropped (aborted) if it had not reached its commit.
fn write_values(
    db: &Database,
    path: &Path,
    op: Op,
    values: &[(&'static str, Vec<u8>)],
) -> Result<(), StoreError> {
    let db_err = |step, e: redb::Error| db_error(path, op, step, e);
    let mut txn = db.begin_write().map_err(|e| db_err("begin write transaction", e.into()))?;
    txn.set_durability(Durability::Immediate).map_err(|e| db_err("set durability", e.into()))?;
    {
        let mut table = txn.open_table(META).map_err(|e| db_err("open table `meta`", e.into()))?;
        for (key, value) in values {
            table.insert(*key, value.as_slice()).map_err(|e| db_err("insert value", e.into()))?;
        }
    }
    txn.commit().map_err(|e| db_err("commit write transaction", e.into()))
}

fn db_error(path: &Path, op: Op, step: &'static str, e: redb::Error) -> StoreError {
    StoreError::Db { path: path.to_path_buf(), op, step, source: Box::new(e) }
}

/// Reads and decodes every field, checking the schema version first, and says which version
/// the store was written under (a schema 1 store's records are read with none retired).
fn read_all(db: &Database, path: &Path, op: Op) -> Result<(NodeId, Durable, u32), StoreError> {
    let db_err = |step, e: redb::Error| db_error(path, op, step, e);
    let txn = db.begin_read().map_err(|e| db_err("begin read transaction", e.into()))?;
    let table = match txn.open_table(META) {
        Ok(table) => table,
        Err(redb::TableError::TableDoesNotExist(_)) => {
            return Err(StoreError::NotInitialised { path: path.to_path_buf(), key: KEY_SCHEMA });
        }
        Err(e) => return Err(db_err("open table `meta`", e.into())),
    };
    let get = |key: &'static str| -> Result<Option<Vec<u8>>, StoreError> {
        let value = table.get(key).map_err(|e| db_err("read value", e.into()))?;
        Ok(value.map(|v| v.value().to_vec()))
    };
    let field = |key: &'static str| -> Result<Vec<u8>, StoreError> {
        get(key)?.ok_or_else(|| StoreError::Corrupt {
            path: path.to_path_buf(),
            what: key,
            detail: "missing".to_string(),
        })
    };

    let Some(schema) = get(KEY_SCHEMA)? else {
        return Err(StoreError::NotInitialised { path: path.to_path_buf(), key: KEY_SCHEMA });
    };
    let schema: u32 = decode(path, KEY_SCHEMA, &schema)?;
    let (current, acceptor) = match schema {
        SCHEMA_VERSION => (
            decode::<EpochRecord>(path, KEY_CURRENT_EPOCH, &field(KEY_CURRENT_EPOCH)?)?,
            decode::<AcceptorState<EpochRecord>>(path, KEY_ACCEPTOR, &field(KEY_ACCEPTOR)?)?,
        ),
        1 => {
            let current = decode::<RecordV1>(path, KEY_CURRENT_EPOCH, &field(KEY_CURRENT_EPOCH)?)?;
            let acceptor = decode::<AcceptorState<RecordV1>>(path, KEY_ACCEPTOR, &field(KEY_ACCEPTOR)?)?;
            let accepted = acceptor.accepted.map(|(ballot, value)| (ballot, value.into()));
            (current.into(), AcceptorState { promised: acceptor.promised, accepted })
        }
        other => return Err(StoreError::UnknownSchema(other)),
    };
    let identity = decode(path, KEY_IDENTITY, &field(KEY_IDENTITY)?)?;
    let state = Durable {
        genesis_digest: decode(path, KEY_GENESIS_DIGEST, &field(KEY_GENESIS_DIGEST)?)?,
        current,
        acceptor,
        incarnation: decode(path, KEY_INCARNATION, &field(KEY_INCARNATION)?)?,
    };
    // What decodes must also be what the node could have written: a valid record (the epoch core
    // does arithmetic on its numbers), and an incarnation a next run can be numbered after.
    let corrupt = |what, detail: String| StoreError::Corrupt { path: path.to_path_buf(), what, detail };
    state.current.validate().map_err(|e| corrupt(KEY_CURRENT_EPOCH, e.to_string()))?;
    if let Some((_, value)) = &state.acceptor.accepted {
        value.validate().map_err(|e| corrupt(KEY_ACCEPTOR, e.to_string()))?;
    }
    if state.incarnation == u64::MAX {
        return Err(corrupt(KEY_INCARNATION, "u64::MAX: no later run can be numbered".into()));
    }
    Ok((identity, state, schema))
}

fn encode<T: Serialize>(path: &Path, what: &'static str, value: &T) -> Result<Vec<u8>, StoreError> {
    let err = |detail: String| StoreError::Encode { path: path.to_path_buf(), what, detail };
    let bytes = postcard::to_stdvec(value).map_err(|e| err(e.to_string()))?;
    if bytes.len() > MAX_VALUE_LEN {
        return Err(err(format!("{} bytes exceed the bound of {MAX_VALUE_LEN}", bytes.len())));
    }
    Ok(bytes)
}

/// Decodes a whole value: it must be within [`MAX_VALUE_LEN`] and leave no bytes over.
fn decode<T: DeserializeOwned>(path: &Path, what: &'static str, bytes: &[u8]) -> Result<T, StoreError> {
    let corrupt = |detail: String| StoreError::Corrupt { path: path.to_path_buf(), what, detail };
    if bytes.len() > MAX_VALUE_LEN {
        return Err(corrupt(format!("{} bytes exceed the bound of {MAX_VALUE_LEN}", bytes.len())));
    }
    match postcard::take_from_bytes(bytes) {
        Ok((value, [])) => Ok(value),
        Ok((_, rest)) => Err(corrupt(format!("{} trailing bytes", rest.len()))),
        Err(e) => Err(corrupt(e.to_string())),
    }
}

/// Creates `dir` and whichever of its ancestors are missing, outermost first, syncing each new
/// directory's parent after it is made: once this returns, a crash of the machine cannot lose the
/// directory, and with it a store [`RedbStore::create`] makes there (which syncs the store file's
/// own directory). A directory that already exists is left as it is.
pub fn create_dir_durably(dir: &Path) -> std::io::Result<()> {
    let missing: Vec<&Path> =
        dir.ancestors().take_while(|p| !p.as_os_str().is_empty() && !p.is_dir()).collect();
    for new in missing.into_iter().rev() {
        match std::fs::create_dir(new) {
            Ok(()) => sync_parent_dir(new)?,
            // Made meanwhile by another process; whoever made it syncs it.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && new.is_dir() => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Makes the new file's directory entry durable, so a freshly created store survives a power
/// loss along with its contents.
fn sync_parent_dir(path: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        std::fs::File::open(parent)?.sync_all()?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}
