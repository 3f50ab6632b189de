//! Test-only: switching one safety rule off at run time, so a multi-process test can show that its
//! checker notices. Compiled only with the `bug-injection` feature, which no release build enables;
//! without it the node has no switches at all.
//!
//! The node reads `KEYHOME_INJECT_BUG` once at start: one of [`Bugs::NAMES`] (the delegation
//! rules, by the names the lock simulation uses), or `activation-wait` (the epoch core acts as
//! home of a moved key as soon as it learns the epoch).

use keyhome_delegation::{Bugs, HolderConfig, HomeConfig};

/// The environment variable naming the rule to switch off.
pub const BUG_VAR: &str = "KEYHOME_INJECT_BUG";

/// The epoch rule that can be switched off, besides [`Bugs::NAMES`].
const ACTIVATION_WAIT: &str = "activation-wait";

/// Switches off the rule `KEYHOME_INJECT_BUG` names, if any; returns its name. An unknown name is
/// an error, so that a test never believes it runs with a bug it does not have.
pub fn apply(
    epoch: &mut keyhome_epoch::Config,
    home: &mut HomeConfig,
    holder: &mut HolderConfig,
) -> Result<Option<String>, String> {
    let Ok(name) = std::env::var(BUG_VAR) else { return Ok(None) };
    let mut bugs = Bugs::default();
    if name == ACTIVATION_WAIT {
        epoch.bugs.skip_activation_wait = true;
    } else if bugs.switch_on(&name) {
        home.bugs = bugs;
        holder.bugs = bugs;
    } else {
        return Err(format!(
            "{BUG_VAR}={name:?} names no rule; one of {:?} or {ACTIVATION_WAIT:?}",
            Bugs::NAMES
        ));
    }
    Ok(Some(name))
}
