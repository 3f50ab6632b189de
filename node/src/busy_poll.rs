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
//! message whatever the poller does, so busy polling is for nodes with one worker thread (the
//! node warns at start otherwise).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use keyhome_epoch::Instant;
use tokio::sync::{Notify, watch};

use crate::clock::BootClock;

/// The longest window `busy_poll_us` may set: a poller is for the gaps between the messages of
/// one exchange, not for keeping a core busy between exchanges.
pub const MAX_WINDOW: Duration = Duration::from_millis(10);

/// When the node last sent or received a message between nodes, and the poller's wake-up.
pub struct BusyPoll {
    /// How long after the last message the poller keeps polling.
    window: Duration,
    /// The last message's instant, in nanoseconds of the node's [`BootClock`].
    last: AtomicU64,
    /// Whether the poller is asleep (or about to be), so that [`BusyPoll::touch`] must wake it.
    asleep: AtomicBool,
    wake: Notify,
}

impl BusyPoll {
    /// A poller polling for `window` after each message; `None` for a zero window (off).
    pub fn new(window: Duration) -> Option<Arc<BusyPoll>> {
        (!window.is_zero()).then(|| {
            Arc::new(BusyPoll {
                window: window.min(MAX_WINDOW),
                last: AtomicU64::new(0),
                asleep: AtomicBool::new(false),
                wake: Notify::new(),
            })
        })
    }

    /// Records a message to or from another node at `now`, waking the poller if it sleeps.
    #[inline]
    pub fn touch(&self, now: Instant) {
        // SeqCst on both sides (here, and the poller's `asleep` store before its last look at
        // `last`): either the poller sees this message, or this sees it asleep and wakes it.
        self.last.store(now.as_nanos(), Ordering::SeqCst);
        if self.asleep.load(Ordering::SeqCst) {
            self.wake.notify_one();
        }
    }

    fn recent(&self, now: Instant) -> bool {
        let last = Instant::from_nanos(self.last.load(Ordering::SeqCst));
        now.saturating_duration_since(last) < self.window
    }

    /// Polls while messages come within the window, sleeps otherwise; returns once `stop` is
    /// true.
    pub async fn run(self: Arc<Self>, clock: BootClock, mut stop: watch::Receiver<bool>) {
        loop {
            self.asleep.store(true, Ordering::SeqCst);
            if !self.recent(clock.now()) {
                tokio::select! {
                    _ = self.wake.notified() => {}
                    _ = crate::runtime::stopping(&mut stop) => return,
                }
            }
            self.asleep.store(false, Ordering::SeqCst);
            while self.recent(clock.now()) {
                // Other threads first (a system call; this CPU's run queue), then the runtime's
                // other tasks and a poll of its sockets.
                std::thread::yield_now();
                tokio::task::yield_now().await;
            }
        }
    }
}
