//! The Redis lock both harnesses use: `SET key value NX PX ttl` to lock, a compare-and-delete
//! script to unlock (deletes the key only if it still holds this holder's value); and
//! [`BlockingLock`], that lock through the `redis` crate's blocking connection, which both
//! harnesses time one connection's latency with.

use std::time::Duration;

/// The lock command: sets `key` to `value` only if it is unset, expiring after `ttl`.
pub fn lock_command(key: &str, value: &str, ttl: Duration) -> redis::Cmd {
    let mut cmd = redis::cmd("SET");
    cmd.arg(key).arg(value).arg("NX").arg("PX").arg(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX));
    cmd
}

/// The unlock script's source: `KEYS[1]` deleted if it holds `ARGV[1]`; returns 1 if it did.
pub const RELEASE: &str =
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end";

/// The unlock script ([`RELEASE`]).
pub fn release_script() -> redis::Script {
    redis::Script::new(RELEASE)
}

/// A lock holder on a blocking connection: nothing runs between a request and its answer but
/// the kernel, as in `redis-benchmark`. (The crate's async multiplexed connection runs a task of
/// its own that every request goes through: in a task on one vCPU it cost 2–5 µs a pair more in
/// run J; see docs/benchmarks.md.)
///
/// Its holder values are unique on this connection only: one holder per key, as the latency
/// scenarios use it, not contenders on one key.
pub struct BlockingLock {
    pub conn: redis::Connection,
    pub release: redis::Script,
    /// The last holder value handed out.
    last: u64,
}

impl BlockingLock {
    pub fn connect(url: &str) -> redis::RedisResult<BlockingLock> {
        Ok(BlockingLock {
            conn: redis::Client::open(url)?.get_connection()?,
            release: release_script(),
            last: 0,
        })
    }

    /// A holder value no earlier lock of this connection used.
    pub fn value(&mut self) -> String {
        self.last += 1;
        self.last.to_string()
    }

    /// Locks `key`, which must be free, and unlocks it: two round trips.
    pub fn pair(&mut self, key: &str, ttl: Duration) -> Result<(), crate::Error> {
        let value = self.value();
        let set: Option<String> = lock_command(key, &value, ttl).query(&mut self.conn)?;
        if set.is_none() {
            return Err("Redis: the key was held".into());
        }
        let deleted: i64 = self.release.key(key).arg(value).invoke(&mut self.conn)?;
        if deleted != 1 {
            return Err("Redis: the lock was gone at unlock".into());
        }
        Ok(())
    }
}
