//! One clock and one record for a chaos run: every event is stamped with the test process's
//! monotonic clock (time since the run started), so that admissions seen through different nodes
//! compare on one time line. Events stream to a history file as they happen; admissions are kept
//! for the checker.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use keyhome_delegation::FencingToken;

/// An instant of a run: the time since it started, on the test process's monotonic clock.
pub type At = Duration;

/// How an admission's critical section ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unlock {
    /// Still inside its critical section.
    Held,
    /// The node confirmed the unlock with this note.
    Clean(Vec<u8>),
    /// An unlock with this note was sent, but its answer was lost (a timeout, a dropped
    /// connection): the node may or may not have applied it.
    Unknown(Vec<u8>),
    /// The node refused the unlock (the handle was already lost).
    Refused,
    /// The client was killed inside its critical section: no unlock was ever sent.
    Abandoned,
}

impl std::fmt::Display for Unlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unlock::Held => write!(f, "held"),
            Unlock::Clean(note) => write!(f, "clean, note {}", show_note(Some(note))),
            Unlock::Unknown(note) => write!(f, "unanswered, note {}", show_note(Some(note))),
            Unlock::Refused => write!(f, "refused"),
            Unlock::Abandoned => write!(f, "abandoned (client killed)"),
        }
    }
}

/// One admission as its client saw it.
#[derive(Clone, Debug)]
pub struct Admission {
    pub key: String,
    /// The client task and the node it locked through.
    pub client: usize,
    pub node: u64,
    pub token: FencingToken,
    /// When the client sent the lock request, and when it received the admission.
    pub sent: At,
    pub admitted: At,
    /// The deadline the client was told: its own send instant of the lock (or of the last
    /// successful renew) plus the `valid_for` it was answered.
    pub deadline: At,
    /// When the client left its critical section: just before it sent the unlock, or when it was
    /// killed. `None` while it is inside.
    pub end: Option<At>,
    pub recovered: bool,
    pub note: Option<Vec<u8>>,
    pub unlock: Unlock,
}

impl Admission {
    /// The real-time interval in which this admission is exclusive: from the admission to the
    /// earlier of its deadline and its end. Empty (`start >= end`) when the answer came after the
    /// deadline had passed.
    pub fn window(&self) -> (At, At) {
        (self.admitted, self.end.map_or(self.deadline, |e| e.min(self.deadline)))
    }
}

/// The record of one run.
pub struct History {
    start: Instant,
    path: PathBuf,
    file: Mutex<BufWriter<File>>,
    admissions: Mutex<Vec<Admission>>,
}

impl History {
    /// Starts a record whose events go to `path` (created or truncated).
    pub fn create(path: &Path) -> std::io::Result<History> {
        Ok(History {
            start: Instant::now(),
            path: path.to_path_buf(),
            file: Mutex::new(BufWriter::new(File::create(path)?)),
            admissions: Mutex::new(Vec::new()),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The current instant of the run.
    pub fn now(&self) -> At {
        self.start.elapsed()
    }

    /// Records `event` at the current instant. A failing history file loses lines, never the run.
    pub fn log(&self, event: impl AsRef<str>) {
        let at = self.now();
        let mut file = self.file.lock().unwrap_or_else(|p| p.into_inner());
        let _ = writeln!(file, "{:>11.6} {}", at.as_secs_f64(), event.as_ref());
    }

    /// Records an admission; returns its index for [`History::update`].
    pub fn admit(&self, admission: Admission) -> usize {
        self.log(format!(
            "c{} n{} ADMIT {} token {} sent {:.6} deadline {:.6} recovered {} note {}",
            admission.client,
            admission.node,
            admission.key,
            admission.token,
            admission.sent.as_secs_f64(),
            admission.deadline.as_secs_f64(),
            admission.recovered,
            show_note(admission.note.as_deref()),
        ));
        let mut all = self.admissions.lock().unwrap_or_else(|p| p.into_inner());
        all.push(admission);
        all.len() - 1
    }

    /// Changes admission `index` (a renewed deadline, its end).
    pub fn update(&self, index: usize, f: impl FnOnce(&mut Admission)) {
        if let Some(a) = self.admissions.lock().unwrap_or_else(|p| p.into_inner()).get_mut(index) {
            f(a);
        }
    }

    /// Every admission so far.
    pub fn admissions(&self) -> Vec<Admission> {
        self.admissions.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Writes out what is buffered.
    pub fn flush(&self) {
        let _ = self.file.lock().unwrap_or_else(|p| p.into_inner()).flush();
    }
}

/// A note as the history shows it.
pub fn show_note(note: Option<&[u8]>) -> String {
    note.map_or_else(|| "-".to_string(), |n| String::from_utf8_lossy(n).into_owned())
}
