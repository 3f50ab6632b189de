//! The Redis lock both harnesses use: `SET key value NX PX ttl` to lock, a compare-and-delete
//! script to unlock (deletes the key only if it still holds this holder's value).

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
