//! What the node notices about the machine it runs on and tells its operator: facts that move
//! its latency but are not keyhome's to change.

use std::fmt;

/// Where Linux names the cpuidle driver in use.
const CPUIDLE_DRIVER: &str = "/sys/devices/system/cpu/cpuidle/current_driver";
/// How long the `haltpoll` driver lets an idle vCPU poll before it halts, in nanoseconds.
const HALT_POLL_NS: &str = "/sys/module/haltpoll/parameters/guest_halt_poll_ns";

/// How this machine's idle CPUs wait, which sets what waking a process on another CPU costs (see
/// docs/operations.md, "On virtual machines: idle polling"). Every lock handoff between nodes,
/// and every call through the local socket, is a chain of such wake-ups.
///
/// Only the `haltpoll` driver (KVM guests that have it) is looked into: a guest without it that
/// halts on `HLT` looks like any other machine here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdlePolling {
    /// The cpuidle driver, if the kernel names one.
    driver: Option<String>,
    /// With the `haltpoll` driver only (`None` otherwise): how long an idle vCPU polls before it
    /// halts, in nanoseconds.
    halt_poll_ns: Option<u64>,
}

impl IdlePolling {
    /// Reads this machine's setting from sysfs; what cannot be read is `None`.
    pub fn read() -> IdlePolling {
        let read = |path| std::fs::read_to_string(path).ok();
        IdlePolling::parse(read(CPUIDLE_DRIVER).as_deref(), read(HALT_POLL_NS).as_deref())
    }

    /// From the two sysfs files' contents (`None`: not there).
    pub fn parse(driver: Option<&str>, halt_poll_ns: Option<&str>) -> IdlePolling {
        let driver = driver.map(str::trim).filter(|d| !d.is_empty()).map(str::to_owned);
        let halt_poll_ns = match driver.as_deref() {
            Some("haltpoll") => halt_poll_ns.and_then(|ns| ns.trim().parse().ok()),
            _ => None,
        };
        IdlePolling { driver, halt_poll_ns }
    }

    /// The cpuidle driver, if the kernel names one.
    pub fn driver(&self) -> Option<&str> {
        self.driver.as_deref()
    }

    /// With the `haltpoll` driver: how long an idle vCPU polls before it halts, in nanoseconds.
    pub fn halt_poll_ns(&self) -> Option<u64> {
        self.halt_poll_ns
    }

    /// Whether an idle vCPU halts at once, so that every wake-up of a process on it goes
    /// through the hypervisor (a KVM guest with halt polling off).
    pub fn halts_at_once(&self) -> bool {
        self.halt_poll_ns == Some(0)
    }
}

impl fmt::Display for IdlePolling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.driver, self.halt_poll_ns) {
            (Some(driver), Some(ns)) => write!(f, "cpuidle driver {driver}, guest_halt_poll_ns {ns}"),
            (Some(driver), None) => write!(f, "cpuidle driver {driver}"),
            (None, _) => f.write_str("no cpuidle driver"),
        }
    }
}

/// Logs what about this machine an operator chasing latency should know: once per process,
/// however many nodes it starts.
pub fn log_notes() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let idle = IdlePolling::read();
        if idle.halts_at_once() {
            tracing::info!(
                %idle,
                "idle vCPUs halt without polling: every wake-up across vCPUs goes through the \
                 hypervisor, which can double lock latency (docs/operations.md, idle polling: \
                 halt polling in the guest, or busy_poll_us in node.toml)"
            );
        }
    });
}

#[cfg(test)]
mod tests {
    use super::IdlePolling;

    #[test]
    fn a_kvm_guest_without_halt_polling_is_noticed() {
        let idle = IdlePolling::parse(Some("haltpoll\n"), Some("0\n"));
        assert_eq!((idle.driver(), idle.halt_poll_ns()), (Some("haltpoll"), Some(0)));
        assert!(idle.halts_at_once());
        assert_eq!(idle.to_string(), "cpuidle driver haltpoll, guest_halt_poll_ns 0");
    }

    #[test]
    fn a_polling_guest_is_not() {
        let idle = IdlePolling::parse(Some("haltpoll\n"), Some("200000\n"));
        assert!(!idle.halts_at_once());
        assert_eq!(idle.to_string(), "cpuidle driver haltpoll, guest_halt_poll_ns 200000");
    }

    #[test]
    fn the_haltpoll_setting_counts_only_under_its_driver() {
        let idle = IdlePolling::parse(Some("intel_idle\n"), Some("0\n"));
        assert_eq!(idle.halt_poll_ns(), None);
        assert!(!idle.halts_at_once());
        assert_eq!(idle.to_string(), "cpuidle driver intel_idle");
    }

    #[test]
    fn missing_or_garbled_files_say_nothing() {
        let none = IdlePolling::parse(None, None);
        assert!(!none.halts_at_once());
        assert_eq!(none.to_string(), "no cpuidle driver");
        let garbled = IdlePolling::parse(Some("haltpoll"), Some("a lot"));
        assert_eq!(garbled.halt_poll_ns(), None);
        assert!(!garbled.halts_at_once());
    }
}
