//! Busy polling (`busy_poll_us` in `node.toml`): after each message the node sends to or
//! receives from another node, one worker of its runtime keeps polling the sockets for a while
//! instead of going to sleep, so that the next message of the exchange (the answer, or the
//! client's unlock of the key just passed to it) is read without waking a sleeping CPU. The same
//! trade as Linux's `net.core.busy_poll` and Seastar's `--idle-poll-time-us`, for a node's own
//! sockets.
//!
//! On a virtual machine whose idle vCPUs halt at once (no halt polling in the guest), waking a
//! thread on another vCPU costs tens of µs, and a handoff of a contended key is three such
//! wake-ups in a row (docs/benchmarks.md, runs H and O). A poller trades CPU time for them: while
//! messages between nodes come closer together than the window, one worker of each node stays
//! busy. Calls that stay on the node (a re-lock under a held delegation) do not start it: there
//! the poller only took a vCPU from the clients (run P). Between two polls it yields its CPU to
//! any other runnable thread, so that processes sharing the host wait a context switch for it,
//! not a time slice. Off (0) by default, as a sidecar sharing its host should be.
//!
//! The poller is a task: `tokio::task::yield_now` puts it back behind the runtime's poll of its
//! sockets (a poll that does not sleep), so each round of the loop reads whatever arrived. That
//! poll needs the runtime's I/O driver, which a multi-thread runtime's idle worker holds while it
//! sleeps in `epoll_wait`: with more than one worker, the kernel wakes that worker for each
//! message whatever a poller does (run P measured no gain, and more CPU), so the node polls only
//! on a runtime of one worker ([`BusyPoll::for_runtime`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use keyhome_epoch::Instant;
use tokio::sync::{Notify, watch};

use crate::clock::BootClock;

/// The longest window `busy_poll_us` may set (loading `node.toml` refuses more; a window given
/// otherwise is cut to it): a poller is for the gaps between the messages of one exchange, not
/// for keeping a core busy between exchanges.
pub const MAX_WINDOW: Duration = Duration::from_millis(10);

/// Until when the poller polls, how long it has polled, and its wake-up.
pub struct BusyPoll {
    /// How long after each message the poller keeps polling.
    window: Duration,
    /// The latest message's instant plus `window`, in nanoseconds of the node's [`BootClock`]
    /// (0: no message yet). Only ever raised, so a message handled late on another thread does
    /// not cut a later one's window short.
    until: AtomicU64,
    /// Whether the poller is asleep (or about to be), so that [`BusyPoll::touch`] must wake it.
    asleep: AtomicBool,
    /// Wakes the sleeping poller.
    wake: Notify,
    /// Nanoseconds spent polling so far, counted a round at a time (wall-clock time in the
    /// polling loop, not the CPU time it took).
    polled: AtomicU64,
}

impl BusyPoll {
    /// A poller polling for `window` (at most [`MAX_WINDOW`]) after each message, if `window` is
    /// not zero and the runtime has one worker (`workers`); with more, it logs that it is off.
    pub fn for_runtime(window: Duration, workers: usize) -> Option<Arc<BusyPoll>> {
        if window.is_zero() {
            return None;
        }
        if workers > 1 {
            tracing::warn!(
                workers,
                "busy polling is off: it needs a runtime of one worker thread (an idle worker of \
                 several sleeps in the runtime's poll of the sockets, and each message wakes it \
                 whatever a poller does); for `keyhome run`, set worker_threads = 1 \
                 (docs/operations.md, idle polling)"
            );
            return None;
        }
        Some(Arc::new(BusyPoll {
            window: window.min(MAX_WINDOW),
            until: AtomicU64::new(0),
            asleep: AtomicBool::new(false),
            wake: Notify::new(),
            polled: AtomicU64::new(0),
        }))
    }

    /// Records a message to or from another node at `now` (a reading of the node's
    /// [`BootClock`]), waking the poller if it sleeps.
    #[inline]
    pub fn touch(&self, now: Instant) {
        // SeqCst on both sides (here, and the poller's `asleep` store before its last look at
        // `until`): either the poller sees this message, or this sees it asleep and wakes it.
        self.until.fetch_max((now + self.window).as_nanos(), Ordering::SeqCst);
        if self.asleep.load(Ordering::SeqCst) {
            self.wake.notify_one();
        }
    }

    /// How long the poller has spent polling since the node started.
    pub fn polled(&self) -> Duration {
        Duration::from_nanos(self.polled.load(Ordering::Relaxed))
    }

    /// Whether a message came within the window before `now`.
    fn due(&self, now: Instant) -> bool {
        now.as_nanos() < self.until.load(Ordering::SeqCst)
    }

    /// Polls while messages come within the window, sleeps otherwise; returns once `stop` is
    /// true.
    pub async fn run(self: Arc<Self>, clock: BootClock, mut stop: watch::Receiver<bool>) {
        loop {
            self.asleep.store(true, Ordering::SeqCst);
            if !self.due(clock.now()) {
                tokio::select! {
                    _ = self.wake.notified() => {}
                    _ = crate::runtime::stopping(&mut stop) => return,
                }
            }
            self.asleep.store(false, Ordering::SeqCst);
            let mut now = clock.now();
            while self.due(now) {
                // Other threads first (a system call; this CPU's run queue), then the runtime's
                // other tasks and a poll of its sockets.
                std::thread::yield_now();
                tokio::task::yield_now().await;
                let then = std::mem::replace(&mut now, clock.now());
                let round = u64::try_from(now.saturating_duration_since(then).as_nanos()).unwrap_or(u64::MAX);
                self.polled.fetch_add(round, Ordering::Relaxed);
            }
        }
    }
}
