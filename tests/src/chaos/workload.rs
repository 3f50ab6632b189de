//! The clients of a chaos run: tasks that lock a handful of keys through their node, write to the
//! fenced resource inside their critical sections, and unlock with a note. Some renew, some stall
//! past their deadline before a last write (a stale holder the resource must fence out), and some
//! are killed inside their critical section (their connection dropped without an unlock).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use keyhome::client::{Client, ClientError};
use keyhome::config::ClientProfile;

use super::history::{Admission, History, Unlock};
use super::resource::Resource;
use crate::rng::Rng;

/// Longest a renew, an unlock or a connection attempt may take before the client gives up on it.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// What the clients do.
#[derive(Clone, Debug)]
pub struct Workload {
    pub keys: Vec<String>,
    /// Each lock asks for a ttl uniform in this range, in milliseconds.
    pub ttl_ms: (u64, u64),
    /// How long a lock request may wait.
    pub wait: Duration,
}

/// What the client tasks share.
pub struct Shared {
    pub history: Arc<History>,
    pub resource: Resource,
    pub workload: Workload,
    pub stop: AtomicBool,
    pub counts: Counts,
}

/// Outcomes the clients saw, for the summary.
#[derive(Default)]
pub struct Counts {
    pub lock_errors: AtomicU64,
    pub clean_unlocks: AtomicU64,
    pub refused_unlocks: AtomicU64,
    pub renewals: AtomicU64,
    pub stalls: AtomicU64,
    pub killed: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// What a client does inside one critical section.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Section {
    /// A few writes, then an unlock with a note.
    Plain,
    /// A write, a renew, another write, an unlock.
    Renew,
    /// Sleeps past its deadline, writes (stale), then tries to unlock.
    Stall,
    /// Is killed after a write: no unlock.
    Killed,
}

impl Section {
    fn draw(rng: &mut Rng) -> Section {
        match rng.range(0, 99) {
            0..=71 => Section::Plain,
            72..=83 => Section::Renew,
            84..=91 => Section::Stall,
            _ => Section::Killed,
        }
    }
}

/// One client task: connects to its node and runs critical sections until told to stop.
pub async fn client(shared: Arc<Shared>, id: usize, profile: ClientProfile, seed: u64) {
    let mut rng = Rng::new(seed);
    while !shared.stop.load(Ordering::Relaxed) {
        let Some(client) = connect(&profile).await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        while !shared.stop.load(Ordering::Relaxed) {
            if !section(&shared, &client, id, profile.node, &mut rng).await {
                break;
            }
        }
        // A new connection after a failure, or after being "killed".
    }
}

/// A connection to the node of `profile`, or `None` if none could be made in time.
pub async fn connect(profile: &ClientProfile) -> Option<Client> {
    tokio::time::timeout(CALL_TIMEOUT, Client::connect(profile)).await.ok()?.ok()
}

/// Whether an error leaves the connection usable (the node answered).
fn answered(e: &ClientError) -> bool {
    e.kind().is_some()
}

/// Locks `key` through `client` and records the admission; returns it and its index.
pub async fn lock(
    history: &History,
    client: &Client,
    id: usize,
    node: u64,
    key: &str,
    ttl: Duration,
    wait: Duration,
) -> Result<(u64, Admission, usize), Option<ClientError>> {
    let sent = history.now();
    let answer = tokio::time::timeout(wait + CALL_TIMEOUT, client.lock(key.as_bytes(), ttl, wait)).await;
    let lock = match answer {
        Ok(Ok(lock)) => lock,
        Ok(Err(e)) => {
            history.log(format!("c{id} n{node} lock {key} failed: {e}"));
            return Err(Some(e));
        }
        Err(_) => {
            history.log(format!("c{id} n{node} lock {key}: no answer"));
            return Err(None);
        }
    };
    let admission = Admission {
        key: key.to_string(),
        client: id,
        node,
        token: lock.token(),
        sent,
        admitted: history.now(),
        deadline: sent + lock.valid_for(),
        end: None,
        recovered: lock.recovered(),
        note: lock.note().map(<[u8]>::to_vec),
        unlock: Unlock::Held,
    };
    let index = history.admit(admission.clone());
    Ok((lock.forget(), admission, index))
}

/// Unlocks `handle` of admission `index` with a note naming it; returns whether the connection
/// is still usable.
pub async fn unlock(
    history: &History,
    client: &Client,
    handle: u64,
    a: &Admission,
    index: usize,
) -> (bool, Unlock) {
    let note = format!("c{}/{}", a.client, a.token).into_bytes();
    let end = history.now();
    history.update(index, |a| a.end = Some(end));
    history.log(format!("c{} n{} unlock {} token {}", a.client, a.node, a.key, a.token));
    let (usable, outcome) =
        match tokio::time::timeout(CALL_TIMEOUT, client.unlock(handle, Some(note.clone()))).await {
            Ok(Ok(())) => (true, Unlock::Clean(note)),
            Ok(Err(e)) if answered(&e) => {
                history.log(format!("c{} unlock {} token {} refused: {e}", a.client, a.key, a.token));
                (true, Unlock::Refused)
            }
            failed => {
                let why =
                    failed.err().map_or_else(|| "connection failed".to_string(), |_| "no answer".to_string());
                history.log(format!("c{} unlock {} token {}: {why}", a.client, a.key, a.token));
                (false, Unlock::Unknown(note))
            }
        };
    history.log(format!("c{} unlocked {} token {}: {outcome}", a.client, a.key, a.token));
    history.update(index, |a| a.unlock = outcome.clone());
    (usable, outcome)
}

/// One critical section (or a failed attempt at one); returns whether the connection is still
/// usable.
async fn section(shared: &Shared, client: &Client, id: usize, node: u64, rng: &mut Rng) -> bool {
    let history = &shared.history;
    let w = &shared.workload;
    let key = w.keys[rng.range(0, w.keys.len() as u64 - 1) as usize].as_str();
    let ttl = Duration::from_millis(rng.range(w.ttl_ms.0, w.ttl_ms.1));
    let (handle, mut a, index) = match lock(history, client, id, node, key, ttl, w.wait).await {
        Ok(admitted) => admitted,
        Err(e) => {
            bump(&shared.counts.lock_errors);
            // Not at once again: a node that refuses at once (removed from the epoch, say) would
            // otherwise be asked in a tight loop.
            tokio::time::sleep(Duration::from_millis(rng.range(20, 100))).await;
            return e.as_ref().is_some_and(answered);
        }
    };
    let pause = |rng: &mut Rng| Duration::from_millis(rng.range(0, ttl.as_millis() as u64 / 4));
    let write = |a: &Admission| shared.resource.write(history, id, key, a.token, a.deadline);
    match Section::draw(rng) {
        Section::Plain => {
            for _ in 0..rng.range(1, 3) {
                tokio::time::sleep(pause(rng)).await;
                write(&a);
            }
        }
        Section::Renew => {
            tokio::time::sleep(pause(rng)).await;
            write(&a);
            let sent = history.now();
            match tokio::time::timeout(CALL_TIMEOUT, client.renew(handle, ttl)).await {
                Ok(Ok(valid_for)) => {
                    bump(&shared.counts.renewals);
                    a.deadline = sent + valid_for;
                    history.update(index, |r| r.deadline = a.deadline);
                    history.log(format!(
                        "c{id} renewed {key} token {} deadline {:.6}",
                        a.token,
                        a.deadline.as_secs_f64()
                    ));
                }
                Ok(Err(e)) => history.log(format!("c{id} renew {key} token {} failed: {e}", a.token)),
                Err(_) => history.log(format!("c{id} renew {key} token {}: no answer", a.token)),
            }
            tokio::time::sleep(pause(rng)).await;
            write(&a);
        }
        Section::Stall => {
            bump(&shared.counts.stalls);
            write(&a);
            let past = a.deadline + Duration::from_millis(rng.range(50, 600));
            tokio::time::sleep(past.saturating_sub(history.now())).await;
            write(&a);
        }
        Section::Killed => {
            write(&a);
            bump(&shared.counts.killed);
            let end = history.now();
            history.update(index, |a| {
                a.end = Some(end);
                a.unlock = Unlock::Abandoned;
            });
            history.log(format!("c{id} n{node} KILLED holding {key} token {}", a.token));
            // The caller drops the connection without unlocking.
            return false;
        }
    }
    let (usable, outcome) = unlock(history, client, handle, &a, index).await;
    match outcome {
        Unlock::Clean(_) => bump(&shared.counts.clean_unlocks),
        Unlock::Refused => bump(&shared.counts.refused_unlocks),
        _ => {}
    }
    usable
}
