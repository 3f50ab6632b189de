//! `home`: arbitrary message sequences into a [`Home`].
//!
//! Steps: time passes, a message arrives from any node (requests, releases, checks, handovers,
//! acks, and the holder-bound kinds a home ignores), the timer fires, the epoch layer learns a
//! newer epoch or flips the lease or activation. After every step: no panic, no wake-up at or
//! before the `now` of a `handle_timeout`, every count within the configured caps, and no
//! delegation or lock-delay lasting longer than the epoch's timing and the configuration allow.

use std::time::Duration;

use keyhome_delegation::{Body, Grantee, Home, HomeConfig, Limits, RequestId};
use keyhome_epoch::time::rate_margin;
use keyhome_epoch::{Instant, NodeId};

use super::script::Script;
use super::values::{Gen, KEYS};
use super::{MAX_STEPS, small_timing};

/// Caps small enough that a sequence reaches them (the holder target uses them too).
pub const LIMITS: Limits = Limits {
    max_key_len: 16,
    max_note_len: 8,
    max_delegations: 6,
    max_per_requester: 3,
    max_waiters_per_key: 3,
    max_holder_keys: 8,
    max_request_wait: std::time::Duration::from_secs(2),
};
const MAX_RECORDS: usize = 4;

pub fn run(data: &[u8]) -> Result<(), String> {
    let mut g = Gen::new(data);
    let me = NodeId(1);
    let mut config = HomeConfig::new(me);
    config.limits = LIMITS;
    config.lock_delay = g.pick(&[Duration::ZERO, Duration::ZERO, Duration::from_millis(30)]);
    config.record_retention = Duration::from_millis(g.range(0, 500));
    config.max_records = MAX_RECORDS;
    config.max_record_bytes = 20;
    // A slot or a few per step, so epoch walks and handover resends span several calls.
    config.walk_step = 1 + g.index(3) as u32;
    let timing = small_timing(&mut g);
    let mut auth = Script::new(&mut g, me, timing);
    let mut now = Instant::from_nanos(g.range(0, 1_000_000_000));
    let mut home = Home::new(config, now);
    let mut grantees: Vec<Grantee> = Vec::new();
    let mut ids: Vec<RequestId> = (1..=3).map(|seq| RequestId::new(1, seq)).collect();
    for step in 0..MAX_STEPS {
        if g.is_empty() {
            break;
        }
        match g.index(8) {
            0 | 1 => now = now + g.elapse(timing.max_delegation_lease),
            2 => {
                home.handle_timeout(now, &auth);
                if let Some(at) = home.poll_timer().filter(|&at| at <= now) {
                    return Err(format!("step {step}: after handle_timeout({now:?}) a wake-up at {at:?}"));
                }
            }
            3 => {
                if g.index(4) == 0 {
                    auth.toggle(&mut g);
                } else {
                    auth.next_epoch(&mut g);
                }
                if g.bool() {
                    home.on_epoch_change(now, &auth);
                }
            }
            _ => {
                let from = g.node();
                let message = g.delegation_message(auth.epoch, &grantees, &ids, timing.max_delegation_lease);
                if let Body::Request { id, .. } = &message.body {
                    ids.push(*id);
                }
                home.handle_message(now, from, message, &auth);
            }
        }
        while let Some((_, message)) = home.poll_transmit() {
            if let Body::Grant { grantee, .. } = message.body {
                grantees.push(grantee);
            }
        }
        check_caps(&home).map_err(|e| format!("step {step}: {e}"))?;
        check_ends(&home, now, &auth).map_err(|e| format!("step {step}: {e}"))?;
        grantees.truncate(64);
        ids.truncate(64);
    }
    Ok(())
}

/// No delegation or lock-delay of a shared key ends later than the epoch and the configuration
/// allow: a grant's end is its lease widened by the clock-rate bound, an adopted delegation's
/// at most the fence bound widened, a lock-delay at most the configured one from its start.
fn check_ends(home: &Home, now: Instant, auth: &Script) -> Result<(), String> {
    let timing = auth.timing;
    let latest = now + rate_margin(timing.fence_bound(), timing.clock_rate_ppm);
    for key in KEYS {
        if let Some(d) = home.delegation(key).filter(|d| d.end > latest) {
            return Err(format!("{key:?} delegated until {:?}, past {latest:?}", d.end));
        }
        if let Some(until) = home.lock_delay_until(key).filter(|&u| u > now + home.config().lock_delay) {
            return Err(format!("{key:?} in lock-delay until {until:?} at {now:?}"));
        }
    }
    Ok(())
}

/// Every count the home keeps is within its caps.
fn check_caps(home: &Home) -> Result<(), String> {
    let held = home.delegations() + home.keys_in_lock_delay();
    if held > LIMITS.max_delegations {
        return Err(format!("{held} delegations and lock-delays, cap {}", LIMITS.max_delegations));
    }
    if (1..=5).any(|n| home.delegations_of(NodeId(n)) > LIMITS.max_per_requester) {
        return Err("a requester holds more than its cap".to_owned());
    }
    if let Some(key) = KEYS.iter().find(|k| home.waiters(k).len() > LIMITS.max_waiters_per_key) {
        return Err(format!("{} waiters for {key:?}", home.waiters(key).len()));
    }
    // Every key is held, delayed or a record, and records exceed their cap only for keys being
    // handed over, which an epoch change made from keys within the caps (and the next change
    // turns into keys kept only while held).
    let keys = home.tracked_keys();
    if keys > 2 * (LIMITS.max_delegations + MAX_RECORDS) {
        return Err(format!("{keys} keys tracked"));
    }
    Ok(())
}
