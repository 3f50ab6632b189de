//! Rate-limited log lines for what outsiders can cause at any rate (refused handshakes, bad
//! requests, closed peer connections, connections claiming a live node's id): a flood must not
//! become a flood of log.
//!
//! Each [`RateLog`] logs the first event of a window in full (so the reason is always seen),
//! counts the rest silently, and at the end of the window ([`RateLog::flush`], called every
//! [`WINDOW`] by the node) logs one summary line, "N handshakes refused from M addresses in the
//! last 10 s" (a local-socket peer's address is its uid). Whatever the event rate, one category
//! writes at most two lines per window.

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::Duration;

use crate::runtime::lock;

/// The length of one summary window.
pub const WINDOW: Duration = Duration::from_secs(10);
/// Distinct addresses remembered per window; beyond it the summary says "at least".
const MAX_ADDRS: usize = 4096;

/// Where an event came from: a network peer's IP address, or a local-socket peer's uid (`None`
/// when its credentials could not be read).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    Ip(IpAddr),
    Local(Option<u32>),
}

impl From<std::net::SocketAddr> for Source {
    fn from(addr: std::net::SocketAddr) -> Source {
        Source::Ip(addr.ip())
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Ip(ip) => ip.fmt(f),
            Source::Local(Some(uid)) => write!(f, "local uid {uid}"),
            Source::Local(None) => f.write_str("local peer of unknown uid"),
        }
    }
}

/// One category of rate-limited events.
pub struct RateLog {
    /// What an event is, in the plural ("handshakes refused").
    what: &'static str,
    /// Whether its lines are errors (an operator must act) rather than information.
    error: bool,
    window: Mutex<Window>,
}

#[derive(Default)]
struct Window {
    /// Events in this window (the first one included).
    count: u64,
    /// The addresses they came from (at most [`MAX_ADDRS`]).
    addrs: HashSet<Source>,
}

/// What a window's summary says: `count` events from `addrs` addresses (`more_addrs`: at least).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Summary {
    pub count: u64,
    pub addrs: usize,
    pub more_addrs: bool,
}

impl RateLog {
    /// A category whose lines are information.
    pub fn new(what: &'static str) -> RateLog {
        RateLog { what, error: false, window: Mutex::new(Window::default()) }
    }

    /// A category whose lines are errors.
    pub fn errors(what: &'static str) -> RateLog {
        RateLog { error: true, ..RateLog::new(what) }
    }

    fn emit(&self, addr: Option<Source>, line: std::fmt::Arguments<'_>) {
        match (self.error, addr) {
            (false, Some(addr)) => tracing::info!(%addr, "{line}"),
            (false, None) => tracing::info!("{line}"),
            (true, Some(addr)) => tracing::error!(%addr, "{line}"),
            (true, None) => tracing::error!("{line}"),
        }
    }

    /// The summary line of a window.
    pub fn line(&self, s: &Summary) -> String {
        let at_least = if s.more_addrs { "at least " } else { "" };
        let plural = if s.addrs == 1 { "" } else { "es" };
        format!(
            "{} {} from {at_least}{} address{plural} in the last {} s",
            s.count,
            self.what,
            s.addrs,
            WINDOW.as_secs()
        )
    }

    /// Records one event from `addr`; logs `detail` if it is the window's first.
    pub fn note(&self, addr: Source, detail: impl std::fmt::Display) {
        if self.record(addr) {
            let every = WINDOW.as_secs();
            self.emit(
                Some(addr),
                format_args!("{}: {detail} (further ones are summed up every {every} s)", self.what),
            );
        }
    }

    /// Counts one event; whether it is the first of its window.
    fn record(&self, addr: Source) -> bool {
        let mut w = lock(&self.window);
        w.count += 1;
        if w.addrs.len() < MAX_ADDRS {
            w.addrs.insert(addr);
        }
        w.count == 1
    }

    /// Ends the window: logs its summary if more than its first event happened, and starts a new
    /// one. Returns the summary of the window that ended, if it had any event.
    pub fn flush(&self) -> Option<Summary> {
        let w = std::mem::take(&mut *lock(&self.window));
        if w.count == 0 {
            return None;
        }
        let summary =
            Summary { count: w.count, addrs: w.addrs.len(), more_addrs: w.addrs.len() >= MAX_ADDRS };
        if w.count > 1 {
            self.emit(None, format_args!("{}", self.line(&summary)));
        }
        Some(summary)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_counts_events_and_addresses_once_each() {
        let log = RateLog::new("handshakes refused");
        let a = Source::Ip("127.0.0.1".parse().unwrap());
        let b = Source::Local(Some(1000));
        assert!(log.record(a), "the first event of a window is logged");
        for _ in 0..1000 {
            assert!(!log.record(b));
        }
        assert!(!log.record(a));
        let summary = log.flush().unwrap();
        assert_eq!(summary, Summary { count: 1002, addrs: 2, more_addrs: false });
        assert_eq!(log.line(&summary), "1002 handshakes refused from 2 addresses in the last 10 s");
        assert_eq!(log.flush(), None, "a new window starts empty");
        assert!(log.record(b), "and logs its first event again");
    }
}
