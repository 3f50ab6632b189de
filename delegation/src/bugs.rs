//! Test-only switches that each disable one safety rule of the delegation layer, so the
//! simulation can show that it notices. Only in builds with the `bug-injection` feature; every
//! switch is off by default.

/// One switch per safety rule; see the field docs for what each breaks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bugs {
    /// Holder: a delegation's deadline counts from the grant's receipt, not the request's send.
    pub deadline_from_receipt: bool,
    /// Home: a delegation's end is `grant + lease`, without the clock-rate margin.
    pub no_rate_margin: bool,
    /// Holder: a recall releases the delegation at once, without waiting for or revoking the
    /// local handle.
    pub release_before_revoke: bool,
    /// Home: no restart quarantine.
    pub no_quarantine: bool,
    /// Home: grants a key it is the home of on its home lease alone, without the activation wait
    /// (a moved key served by the new home without waiting or a handover).
    pub ignore_activation: bool,
    /// Node core (which reads it through [`crate::HolderConfig::bugs`]): every key shard numbers
    /// its handles and tickets 1, 2, 3…, so a serial no longer names the shard that gave it out
    /// and a call by handle may reach another shard's handle.
    pub shared_serials: bool,
    /// Home: forgets a delegation it granted ahead in a Recall once the holder says it passed it
    /// on, so the key is free (and granted again) while the node it was passed to holds it.
    pub forget_passes: bool,
    /// Node core (which reads it through [`crate::HolderConfig::bugs`]): key shards do not hold
    /// their messages for other nodes while the epoch they carry is not durable yet (the node's
    /// `Outbox::hold`), so a crash can take a node back below an epoch it sent messages under.
    pub no_outbox_hold: bool,
    /// Home: a grant's credit for the wait in line is the wait as the home's clock measured it,
    /// not shrunk by the clock-rate bound.
    pub unshrunk_credit: bool,
    /// Home: a successor granted ahead and credited again when its request is resent keeps the
    /// end of its first grant ahead, while the predecessor is told the larger lease.
    pub stale_credit_end: bool,
    /// Home: adopts a `Handover` whenever it has no record of the key, also once the activation
    /// wait of its epoch is over (it may have granted the key and forgotten it since the
    /// Handover left, so the handed note is stale).
    pub late_handover: bool,
    /// Holder: a grant answering a request of an earlier run of this node is handed back
    /// (flagged `recovered`), so the home may free the key while that run's handles are inside
    /// the deadlines their owners were told.
    pub restart_hands_back: bool,
    /// Holder: an ended delegation is remembered only to its deadline (or its expiry) plus a
    /// lease, not while an answer to one of its requests may still arrive, so a late duplicate
    /// of a renewal's grant is handed back as a clean release.
    pub short_past: bool,
    /// Holder: a renewal's deadline counts from its request's send instant even when that is
    /// earlier than the deadline held, so a shorter lease cuts a local handle below the deadline
    /// its owner was told.
    pub renewal_shortens: bool,
}

impl Bugs {
    /// The switches' names, as the lock simulation and a bug-injected node's `KEYHOME_INJECT_BUG`
    /// spell them.
    pub const NAMES: [&'static str; 14] = [
        "deadline-from-receipt",
        "no-rate-margin",
        "release-before-revoke",
        "no-quarantine",
        "ignore-activation",
        "shared-serials",
        "forget-passes",
        "no-outbox-hold",
        "unshrunk-credit",
        "stale-credit-end",
        "late-handover",
        "restart-hands-back",
        "short-past",
        "renewal-shortens",
    ];

    /// Turns on the switch named `name` (one of [`Bugs::NAMES`]); returns false for any other name.
    pub fn switch_on(&mut self, name: &str) -> bool {
        match name {
            "deadline-from-receipt" => self.deadline_from_receipt = true,
            "no-rate-margin" => self.no_rate_margin = true,
            "release-before-revoke" => self.release_before_revoke = true,
            "no-quarantine" => self.no_quarantine = true,
            "ignore-activation" => self.ignore_activation = true,
            "shared-serials" => self.shared_serials = true,
            "forget-passes" => self.forget_passes = true,
            "no-outbox-hold" => self.no_outbox_hold = true,
            "unshrunk-credit" => self.unshrunk_credit = true,
            "stale-credit-end" => self.stale_credit_end = true,
            "late-handover" => self.late_handover = true,
            "restart-hands-back" => self.restart_hands_back = true,
            "short-past" => self.short_past = true,
            "renewal-shortens" => self.renewal_shortens = true,
            _ => return false,
        }
        true
    }
}
