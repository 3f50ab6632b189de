//! Tests of `keyhome::store::RedbStore`: round trips through a reopen, crash consistency under
//! SIGKILL, and the errors for missing, doubly created, corrupt and foreign-schema stores.

use std::io::{BufRead, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use keyhome::store::{MAX_VALUE_LEN, RedbStore, SCHEMA_VERSION, StoreError};
use keyhome_epoch::paxos::{AcceptorState, Ballot};
use keyhome_epoch::{Durable, EpochRecord, Member, NodeId, Storage, Timing, Write};
use redb::{Database, TableDefinition};

const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");

fn members(ids: &[u64]) -> Vec<Member> {
    ids.iter().map(|&id| Member { id: NodeId(id), addr: format!("127.0.0.1:{}", 7000 + id) }).collect()
}

fn genesis() -> EpochRecord {
    EpochRecord::genesis(members(&[1, 2, 3]), Timing::DEFAULT).unwrap()
}

/// Epoch `number`, following the genesis with members `ids`.
fn epoch(number: u64, ids: &[u64]) -> EpochRecord {
    EpochRecord { number, members: members(ids), activation_wait: Duration::from_secs(11), ..genesis() }
}

fn ballot(round: u64, proposer: u64) -> Ballot {
    Ballot { round, proposer: NodeId(proposer) }
}

fn promised(slot: u64, b: Ballot) -> Write {
    Write::Acceptor { slot, state: AcceptorState { promised: Some(b), accepted: None } }
}

fn accepted(slot: u64, b: Ballot, value: EpochRecord) -> Write {
    Write::Acceptor { slot, state: AcceptorState { promised: Some(b), accepted: Some((b, value)) } }
}

fn store_path(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("node.redb")
}

/// Commits `batches` one commit each, reopening the store after every `reopen_every` commits, and
/// checks that the stored state always equals the same batches applied in memory.
fn check_sequence(batches: &[Vec<Write>], reopen_every: usize) {
    let dir = tempfile::tempdir().unwrap();
    let path = store_path(&dir);
    let g = genesis();
    let mut expected = Durable::genesis(g.clone());
    let mut store = RedbStore::create(&path, &g, NodeId(2)).unwrap();
    assert_eq!(store.load().unwrap(), Some(expected.clone()));

    for (i, batch) in batches.iter().enumerate() {
        store.commit(batch).unwrap();
        batch.iter().for_each(|w| expected.apply(w));
        assert_eq!(store.load().unwrap().as_ref(), Some(&expected), "after batch {i}: {batch:?}");
        if (i + 1) % reopen_every == 0 {
            drop(store);
            store = RedbStore::open(&path).unwrap();
            assert_eq!(store.load().unwrap().as_ref(), Some(&expected), "after reopening at batch {i}");
        }
    }
    drop(store);
    let store = RedbStore::open(&path).unwrap();
    assert_eq!(store.load().unwrap(), Some(expected.clone()));
    assert_eq!(store.identity(), NodeId(2));
    assert_eq!(store.genesis_digest(), g.digest());
    assert_eq!(expected.genesis_digest, g.digest());
}

#[test]
fn commits_survive_reopen() {
    let e2 = epoch(2, &[1, 2, 3, 4]);
    let e3 = epoch(3, &[2, 3, 4]);
    let e4 = epoch(4, &[2, 3]);

    // One write per commit through a whole epoch change: promise, accept, learn, next slot.
    let one_by_one = vec![
        vec![Write::Incarnation(1)],
        vec![promised(2, ballot(1, 1))],
        vec![promised(2, ballot(2, 3))],
        vec![accepted(2, ballot(2, 3), e2.clone())],
        vec![Write::Epoch(e2.clone())],
        vec![promised(3, ballot(1, 4))],
        vec![Write::Incarnation(2)],
        vec![accepted(3, ballot(1, 4), e3.clone())],
        vec![Write::Epoch(e3.clone())],
    ];
    check_sequence(&one_by_one, 1);
    check_sequence(&one_by_one, 4);

    // Stale writes between real ones: older epochs, other slots, lower incarnations.
    let stale = vec![
        vec![Write::Incarnation(5)],
        vec![Write::Incarnation(3)],
        vec![promised(3, ballot(1, 1))],
        vec![Write::Epoch(e2.clone())],
        vec![Write::Epoch(genesis())],
        vec![Write::Epoch(e2.clone())],
        vec![promised(2, ballot(9, 1))],
        vec![accepted(4, ballot(1, 2), e4.clone())],
        vec![Write::Incarnation(5)],
        vec![],
        vec![promised(3, ballot(2, 2))],
        vec![Write::Incarnation(6)],
    ];
    check_sequence(&stale, 1);
    check_sequence(&stale, 5);

    // Several writes per commit, including batches whose later writes make earlier ones stale
    // (an acceptor write for a slot the batch's epoch then voids) or void them (the epoch resets
    // the acceptor state).
    let batched = vec![
        vec![Write::Incarnation(1), promised(2, ballot(1, 1)), accepted(2, ballot(1, 1), e2.clone())],
        vec![Write::Epoch(e2.clone()), promised(3, ballot(1, 2)), Write::Incarnation(2)],
        vec![accepted(3, ballot(1, 2), e3.clone()), Write::Epoch(e3.clone())],
        vec![Write::Epoch(e4.clone()), promised(4, ballot(7, 3)), promised(5, ballot(1, 1))],
        vec![
            Write::Incarnation(1),
            Write::Epoch(e3.clone()),
            promised(5, ballot(2, 1)),
            Write::Incarnation(9),
        ],
        vec![promised(5, ballot(3, 1)), promised(5, ballot(1, 1))],
    ];
    check_sequence(&batched, 1);
    check_sequence(&batched, 2);
}

/// A small deterministic generator (xorshift64*), so the random sequences repeat exactly.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn random_sequences_match_in_memory_apply() {
    for seed in [1u64, 0x5eed, 0xdead_beef] {
        let mut rng = Rng(seed);
        let batches: Vec<Vec<Write>> = (0..25)
            .map(|_| {
                (0..rng.below(4))
                    .map(|_| {
                        let n = 1 + rng.below(5);
                        match rng.below(4) {
                            0 => Write::Epoch(epoch(n, &[1, 2, 3, n + 3])),
                            1 => promised(n, ballot(rng.below(4), rng.below(4))),
                            2 => accepted(n, ballot(rng.below(4), rng.below(4)), epoch(n, &[1, n + 4])),
                            _ => Write::Incarnation(rng.below(20)),
                        }
                    })
                    .collect()
            })
            .collect();
        check_sequence(&batches, 1 + rng.below(6) as usize);
    }
}

#[test]
fn failed_commit_changes_nothing_and_poisons_the_handle() {
    let dir = tempfile::tempdir().unwrap();
    let path = store_path(&dir);
    let g = genesis();
    let mut store = RedbStore::create(&path, &g, NodeId(1)).unwrap();
    store.commit(&[Write::Incarnation(3)]).unwrap();
    let before = store.load().unwrap();

    // An epoch record too large to store (valid records are far smaller): the whole batch,
    // including the incarnation before it, is refused.
    let long = "x".repeat(250);
    let huge = EpochRecord {
        number: 2,
        members: (1..5000).map(|id| Member { id: NodeId(id), addr: long.clone() }).collect(),
        ..g.clone()
    };
    let err = store.commit(&[Write::Incarnation(4), Write::Epoch(huge)]).unwrap_err();
    assert!(matches!(err, StoreError::Encode { what: "current_epoch", .. }), "{err}");
    assert_eq!(store.load().unwrap(), before);
    let err = store.commit(&[Write::Incarnation(5)]).unwrap_err();
    assert!(matches!(err, StoreError::Poisoned { .. }), "{err}");
    assert_eq!(store.load().unwrap(), before);

    drop(store);
    let mut store = RedbStore::open(&path).unwrap();
    assert_eq!(store.load().unwrap(), before);
    store.commit(&[Write::Incarnation(5)]).unwrap();
    assert_eq!(store.load().unwrap().unwrap().incarnation, 5);
}

// ---- Crash consistency -------------------------------------------------------------------------

/// Set (to a store path) in the child process that `crash_writer` turns into a writer.
const WRITER_ENV: &str = "KEYHOME_STORE_TEST_CRASH_WRITER";
/// How many commits the writer makes at most if nobody kills it.
const WRITER_MAX: u64 = 100_000;
/// Marks the writer's acknowledgements on stdout (libtest prints its own lines too).
const ACK: &str = "committed ";

/// Not a test by itself: when [`WRITER_ENV`] is set this is the child process of
/// `killed_writer_loses_no_acknowledged_commit`. It commits incarnation `n` together with a promise
/// at round `n` (two keys in one transaction), for n = stored incarnation + 1, + 2, ..., and prints
/// `committed n` after each commit returns.
#[test]
fn crash_writer() {
    let Some(path) = std::env::var_os(WRITER_ENV) else { return };
    let mut store = RedbStore::open(&path).unwrap();
    let start = store.load().unwrap().unwrap().incarnation + 1;
    let mut out = std::io::stdout().lock();
    for n in start..start + WRITER_MAX {
        store.commit(&[Write::Incarnation(n), promised(2, ballot(n, 1))]).unwrap();
        writeln!(out, "{ACK}{n}").unwrap();
        out.flush().unwrap();
    }
}

/// Kills the child when dropped, so a failing assertion never leaves a writer running.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_writer(path: &Path) -> KillOnDrop {
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "crash_writer", "--nocapture", "--test-threads=1"])
        .env(WRITER_ENV, path)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    KillOnDrop(child)
}

/// Reads acknowledgement lines until `want` have arrived (or, with `want` = None, until the pipe
/// closes), returning the numbers in order. Only complete lines count.
fn read_acks(reader: &mut impl BufRead, acks: &mut Vec<u64>, want: Option<usize>) {
    let mut line = String::new();
    while want.is_none_or(|w| acks.len() < w) {
        line.clear();
        if reader.read_line(&mut line).unwrap() == 0 {
            break;
        }
        // libtest's "test crash_writer ... " may precede the first acknowledgement on its line.
        if let Some((_, n)) = line.strip_suffix('\n').and_then(|l| l.split_once(ACK)) {
            acks.push(n.parse().unwrap());
        }
    }
}

#[test]
fn killed_writer_loses_no_acknowledged_commit() {
    let dir = tempfile::tempdir().unwrap();
    let path = store_path(&dir);
    drop(RedbStore::create(&path, &genesis(), NodeId(1)).unwrap());

    let mut stored = 0;
    for lines_before_kill in [1, 2, 5, 13, 40] {
        let mut child = spawn_writer(&path);
        let mut reader = BufReader::new(child.0.stdout.take().unwrap());
        let mut acks = Vec::new();
        read_acks(&mut reader, &mut acks, Some(lines_before_kill));
        assert_eq!(acks.len(), lines_before_kill, "the writer stopped early");
        child.0.kill().unwrap(); // SIGKILL
        child.0.wait().unwrap();
        // Every line already in the pipe was printed after its commit returned.
        read_acks(&mut reader, &mut acks, None);

        let expected: Vec<u64> = (stored + 1..).take(acks.len()).collect();
        assert_eq!(acks, expected, "acknowledged incarnations are consecutive from the stored one");
        let last_acked = *acks.last().unwrap();

        let store = RedbStore::open(&path).unwrap();
        let state = store.load().unwrap().unwrap();
        // The last acknowledged commit survived; at most the one after it (which may have
        // completed without being printed) is also there, and never half of it.
        assert!(
            state.incarnation == last_acked || state.incarnation == last_acked + 1,
            "stored incarnation {} after acknowledging {last_acked}",
            state.incarnation
        );
        assert_eq!(state.acceptor.promised, Some(ballot(state.incarnation, 1)), "torn commit");
        assert_eq!(state.current, genesis());
        assert_eq!(store.identity(), NodeId(1));
        stored = state.incarnation;
    }
}

// ---- Errors ------------------------------------------------------------------------------------

/// Overwrites (or adds) one raw value in the store's `meta` table, bypassing `RedbStore`.
fn put_raw(path: &Path, key: &str, value: &[u8]) {
    let db = Database::open(path).unwrap();
    let txn = db.begin_write().unwrap();
    txn.open_table(META).unwrap().insert(key, value).unwrap();
    txn.commit().unwrap();
}

fn created(dir: &tempfile::TempDir) -> PathBuf {
    let path = store_path(dir);
    let mut store = RedbStore::create(&path, &genesis(), NodeId(3)).unwrap();
    store.commit(&[accepted(2, ballot(1, 1), epoch(2, &[1, 2]))]).unwrap();
    path
}

#[test]
fn open_missing_path_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let err = RedbStore::open(dir.path().join("nope.redb")).unwrap_err();
    assert!(matches!(err, StoreError::Missing { .. }), "{err}");
    assert!(err.to_string().contains("nope.redb"), "{err}");
}

#[test]
fn create_twice_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = created(&dir);
    let before = RedbStore::open(&path).unwrap().load().unwrap();

    let err = RedbStore::create(&path, &epoch(1, &[7]), NodeId(9)).unwrap_err();
    assert!(matches!(err, StoreError::AlreadyInitialised { .. }), "{err}");
    let store = RedbStore::open(&path).unwrap();
    assert_eq!(store.load().unwrap(), before, "a refused create changes nothing");
    assert_eq!(store.identity(), NodeId(3));

    // While one handle is open, neither create nor open gets another: redb locks the file.
    let err = RedbStore::open(&path).unwrap_err();
    assert!(matches!(err, StoreError::Db { .. }), "{err}");
    let err = RedbStore::create(&path, &genesis(), NodeId(3)).unwrap_err();
    assert!(matches!(err, StoreError::Db { .. }), "{err}");
}

#[test]
fn create_accepts_an_empty_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = store_path(&dir);
    std::fs::File::create(&path).unwrap();
    RedbStore::create(&path, &genesis(), NodeId(1)).unwrap();
    assert_eq!(RedbStore::open(&path).unwrap().load().unwrap(), Some(Durable::genesis(genesis())));
}

#[test]
fn database_without_store_is_not_initialised() {
    let dir = tempfile::tempdir().unwrap();
    let path = store_path(&dir);
    drop(Database::create(&path).unwrap());
    let err = RedbStore::open(&path).unwrap_err();
    assert!(matches!(err, StoreError::NotInitialised { .. }), "{err}");

    // A `meta` table without a schema entry is no store either.
    put_raw(&path, "incarnation", &[1]);
    let err = RedbStore::open(&path).unwrap_err();
    assert!(matches!(err, StoreError::NotInitialised { key: "schema", .. }), "{err}");
    // ... and create will not initialise over it.
    let err = RedbStore::create(&path, &genesis(), NodeId(1)).unwrap_err();
    assert!(matches!(err, StoreError::AlreadyInitialised { .. }), "{err}");
}

#[test]
fn a_file_that_is_no_database_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = store_path(&dir);
    std::fs::write(&path, vec![0xa5; 10_000]).unwrap();
    let err = RedbStore::open(&path).unwrap_err();
    assert!(matches!(err, StoreError::Db { .. }), "{err}");
    let err = RedbStore::create(&path, &genesis(), NodeId(1)).unwrap_err();
    assert!(matches!(err, StoreError::Db { .. }), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), vec![0xa5; 10_000], "the file is left alone");
}

#[test]
fn corrupt_values_are_reported_not_panicked_on() {
    let oversized = vec![0u8; MAX_VALUE_LEN + 1];
    let cases: &[(&str, &[u8])] = &[
        ("incarnation", &[0xff, 0xff]),                     // truncated varint
        ("incarnation", &[1, 2]),                           // trailing byte
        ("incarnation", &[]),                               // empty
        ("identity", &[0x80; 11]),                          // varint too long
        ("genesis_digest", &[0; 31]),                       // one byte short
        ("current_epoch", &[0x01, 0xff, 0xff, 0xff, 0x0f]), // member count far beyond the data
        ("current_epoch", &oversized),                      // beyond the size bound
        ("acceptor", &[7]),                                 // bad option tag
    ];
    for &(key, garbage) in cases {
        let dir = tempfile::tempdir().unwrap();
        let path = created(&dir);
        put_raw(&path, key, garbage);
        let err = RedbStore::open(&path).unwrap_err();
        match &err {
            StoreError::Corrupt { what, .. } => assert_eq!(*what, key, "{err}"),
            _ => panic!("garbage under {key}: expected Corrupt, got {err}"),
        }
        assert!(err.to_string().contains(key), "{err}");
    }

    // So is a value that decodes but that no node writes: a record that fails validation (the
    // epoch core does arithmetic on its numbers), and an incarnation no next run can follow.
    let mut invalid = epoch(2, &[1, 2]);
    invalid.members.clear();
    let ballot = ballot(1, 1);
    let accepted = keyhome_epoch::paxos::AcceptorState {
        promised: Some(ballot),
        accepted: Some((ballot, invalid.clone())),
    };
    let decodable: [(&str, Vec<u8>); 3] = [
        ("current_epoch", postcard::to_stdvec(&invalid).unwrap()),
        ("acceptor", postcard::to_stdvec(&accepted).unwrap()),
        ("incarnation", postcard::to_stdvec(&u64::MAX).unwrap()),
    ];
    for (key, value) in decodable {
        let dir = tempfile::tempdir().unwrap();
        let path = created(&dir);
        put_raw(&path, key, &value);
        let err = RedbStore::open(&path).unwrap_err();
        assert!(matches!(&err, StoreError::Corrupt { what, .. } if *what == key), "{key}: {err}");
    }

    // A missing field of an initialised store is corruption too.
    let dir = tempfile::tempdir().unwrap();
    let path = created(&dir);
    {
        let db = Database::open(&path).unwrap();
        let txn = db.begin_write().unwrap();
        txn.open_table(META).unwrap().remove("acceptor").unwrap();
        txn.commit().unwrap();
    }
    let err = RedbStore::open(&path).unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { what: "acceptor", .. }), "{err}");
}

#[test]
fn unknown_schema_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = created(&dir);
    put_raw(&path, "schema", &postcard::to_stdvec(&(SCHEMA_VERSION + 98)).unwrap());
    let err = RedbStore::open(&path).unwrap_err();
    assert!(matches!(err, StoreError::UnknownSchema(v) if v == SCHEMA_VERSION + 98), "{err}");

    // The schema is checked before anything else is decoded.
    put_raw(&path, "incarnation", b"garbage");
    let err = RedbStore::open(&path).unwrap_err();
    assert!(matches!(err, StoreError::UnknownSchema(_)), "{err}");

    put_raw(&path, "schema", &postcard::to_stdvec(&SCHEMA_VERSION).unwrap());
    let err = RedbStore::open(&path).unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { what: "incarnation", .. }), "{err}");
}

#[test]
fn layout_is_as_documented() {
    let dir = tempfile::tempdir().unwrap();
    let path = created(&dir);
    let db = Database::open(&path).unwrap();
    let txn = redb::ReadableDatabase::begin_read(&db).unwrap();
    let table = txn.open_table(META).unwrap();
    let mut keys: Vec<String> = redb::ReadableTable::iter(&table)
        .unwrap()
        .map(|entry| entry.unwrap().0.value().to_string())
        .collect();
    keys.sort();
    assert_eq!(keys, ["acceptor", "current_epoch", "genesis_digest", "identity", "incarnation", "schema"]);
    let schema = table.get("schema").unwrap().unwrap();
    assert_eq!(postcard::from_bytes::<u32>(schema.value()).unwrap(), SCHEMA_VERSION);
    let identity = table.get("identity").unwrap().unwrap();
    assert_eq!(postcard::from_bytes::<NodeId>(identity.value()).unwrap(), NodeId(3));
}

/// A store written before epoch records listed their retired nodes (schema 1) opens with none
/// retired, and is rewritten as schema 2 at once: a record written since (with a retired node)
/// reads back after the next open, which a store still marked schema 1 would misread.
#[test]
fn a_schema_1_store_is_migrated_when_opened() {
    let dir = tempfile::tempdir().unwrap();
    let path = store_path(&dir);
    RedbStore::create(&path, &genesis(), NodeId(1)).unwrap();
    let v1 = |r: &EpochRecord| (r.number, r.members.clone(), r.ring_version, r.timing, r.activation_wait);
    let (current, proposed) = (epoch(2, &[1, 2, 3]), epoch(3, &[1, 2]));
    let ballot = Ballot { round: 4, proposer: NodeId(2) };
    let acceptor = AcceptorState { promised: Some(ballot), accepted: Some((ballot, v1(&proposed))) };
    put_raw(&path, "schema", &postcard::to_stdvec(&1u32).unwrap());
    put_raw(&path, "current_epoch", &postcard::to_stdvec(&v1(&current)).unwrap());
    put_raw(&path, "acceptor", &postcard::to_stdvec(&acceptor).unwrap());

    let mut store = RedbStore::open(&path).expect("a schema 1 store opens");
    let state = store.load().unwrap().unwrap();
    assert_eq!(state.current, current);
    assert_eq!(state.acceptor.accepted, Some((ballot, proposed)));
    let mut retiring = epoch(4, &[1, 2]);
    retiring.retired = vec![NodeId(3)];
    store.commit(&[Write::Epoch(retiring.clone())]).unwrap();
    drop(store);
    let store = RedbStore::open(&path).expect("reopened as schema 2");
    assert_eq!(store.load().unwrap().unwrap().current, retiring);
}

/// The data directory is made one level at a time (each new level synced into its parent, which
/// no test here can observe), an existing one is accepted as it is, and a path through a file is an
/// error rather than a directory made somewhere else.
#[test]
fn the_data_directory_is_made_level_by_level() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("a/b/data");
    keyhome::store::create_dir_durably(&data).unwrap();
    assert!(data.is_dir());
    keyhome::store::create_dir_durably(&data).expect("an existing directory is fine");
    RedbStore::create(data.join("state.redb"), &genesis(), NodeId(1)).unwrap();

    std::fs::write(dir.path().join("file"), b"").unwrap();
    let err = keyhome::store::create_dir_durably(&dir.path().join("file/data")).unwrap_err();
    assert!(!dir.path().join("file/data").exists(), "{err}");
}
