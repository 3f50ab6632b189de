//! The fenced resource: what the clients of a chaos run write to inside their critical sections.
//! Per key it keeps the highest token it has accepted and refuses any write with a lower one, as
//! a storage system that checks fencing tokens would.

use std::collections::HashMap;
use std::sync::Mutex;

use keyhome_delegation::FencingToken;

use super::history::{At, History};

/// Counts of the writes the resource saw.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteStats {
    pub accepted: u64,
    /// Refused because a higher token had written: a stale holder fenced out.
    pub refused: u64,
    /// Refused although the writer was still inside its told deadline: a newer admission began
    /// inside an older one's window (a safety violation, seen from the resource).
    pub refused_in_window: u64,
}

/// Highest accepted token per key, and the counts.
#[derive(Default)]
pub struct Resource {
    state: Mutex<(HashMap<String, FencingToken>, WriteStats)>,
}

impl Resource {
    /// A write to `key` under `token` by a holder told `deadline`; returns whether it was
    /// accepted. Equal tokens are accepted (one holder writes several times).
    pub fn write(
        &self,
        history: &History,
        client: usize,
        key: &str,
        token: FencingToken,
        deadline: At,
    ) -> bool {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        // Stamped under the lock: every write that set the highest token happened before this one.
        let at = history.now();
        let (highest, stats) = &mut *state;
        let current = highest.entry(key.to_string()).or_insert(token);
        let accepted = token >= *current;
        if accepted {
            *current = token;
            stats.accepted += 1;
        } else {
            stats.refused += 1;
            if at < deadline {
                stats.refused_in_window += 1;
            }
        }
        let late = if at < deadline { "" } else { " (past its deadline)" };
        let outcome =
            if accepted { "accepted".to_string() } else { format!("REFUSED: highest is {current}") };
        history.log(format!("c{client} write {key} token {token}{late} {outcome}"));
        accepted
    }

    pub fn stats(&self) -> WriteStats {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).1
    }
}
