//! What an attack costs the node: memory, log and the latency a well-behaved client sees.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keyhome::client::Client;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::cluster::Cluster;

/// A process's resident memory, KiB.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Memory {
    /// Now (`VmRSS`).
    pub rss_kib: u64,
    /// The most it ever was (`VmHWM`).
    pub peak_kib: u64,
}

/// The resident memory of process `pid`, from `/proc/PID/status`; `None` if it is gone.
pub fn memory(pid: u32) -> Option<Memory> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kib| kib.parse::<u64>().ok())
    };
    Some(Memory { rss_kib: field("VmRSS:")?, peak_kib: field("VmHWM:")? })
}

/// The CPU time process `pid` has used so far (user and system, at the kernel's clock-tick
/// resolution), from `/proc/PID/stat`; `None` if it is gone.
pub fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command's closing parenthesis start at the state (field 3); utime and
    // stime are fields 14 and 15.
    let mut fields = stat.get(stat.rfind(')')? + 1..)?.split_whitespace().skip(11);
    let mut ticks = || fields.next()?.parse::<u64>().ok();
    let ticks = ticks()? + ticks()?;
    Some(Duration::from_secs_f64(ticks as f64 / rustix::param::clock_ticks_per_second() as f64))
}

/// Bytes node `id` has written to its log so far.
pub fn log_bytes(cluster: &Cluster, id: u64) -> u64 {
    std::fs::metadata(cluster.node_dir(id).join("node.log")).map_or(0, |m| m.len())
}

/// Lines of node `id`'s log that contain `needle`.
pub fn log_lines(cluster: &Cluster, id: u64, needle: &str) -> usize {
    let text = std::fs::read_to_string(cluster.node_dir(id).join("node.log")).unwrap_or_default();
    text.lines().filter(|l| l.contains(needle)).count()
}

/// What the control client saw.
#[derive(Clone, Debug, Default)]
pub struct Seen {
    /// Latency of each lock call that succeeded.
    pub locks: Vec<Duration>,
    /// Why calls failed.
    pub failures: Vec<String>,
}

impl Seen {
    /// The `p`-th percentile (0 to 100) of the lock latencies.
    pub fn percentile(&self, p: u32) -> Option<Duration> {
        let mut sorted = self.locks.clone();
        sorted.sort();
        let last = sorted.len().checked_sub(1)?;
        sorted.get(last * p.min(100) as usize / 100).copied()
    }
}

/// A well-behaved client that locks and unlocks one key every `interval` until stopped.
pub struct Control {
    seen: Arc<Mutex<Seen>>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Control {
    pub fn start(client: Client, key: Vec<u8>, interval: Duration) -> Control {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (stop, mut stopped) = watch::channel(false);
        let record = Arc::clone(&seen);
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stopped.changed() => return,
                }
                let sent = Instant::now();
                let result = client.lock(&key, Duration::from_secs(2), Duration::from_secs(2)).await;
                let took = sent.elapsed();
                let outcome = match result {
                    Ok(lock) => lock.unlock(None).await.map(|()| took).map_err(|e| format!("unlock: {e}")),
                    Err(e) => Err(format!("lock: {e}")),
                };
                let mut seen = record.lock().unwrap_or_else(|p| p.into_inner());
                match outcome {
                    Ok(took) => seen.locks.push(took),
                    Err(e) => seen.failures.push(e),
                }
            }
        });
        Control { seen, stop, task }
    }

    /// What it saw since the last call.
    pub fn take(&self) -> Seen {
        std::mem::take(&mut *self.seen.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Waits until it has locked `n` more times since the last [`Control::take`] (bounded by
    /// the cluster's patience): it keeps locking.
    pub async fn wait_locks(&self, n: usize) {
        crate::cluster::eventually(crate::cluster::PATIENCE, "the control client keeps locking", || async {
            let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
            (seen.locks.len() >= n).then_some(())
        })
        .await
    }

    pub async fn stop(self) -> Seen {
        let _ = self.stop.send(true);
        let Control { seen, task, .. } = self;
        let _ = task.await;
        std::mem::take(&mut *seen.lock().unwrap_or_else(|p| p.into_inner()))
    }
}
