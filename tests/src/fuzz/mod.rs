//! Fuzzing on stable Rust: seeded random inputs into the decoders and the protocol cores.
//!
//! Every target is a function of one byte string (see [`Target::run`]): structured values are
//! drawn from it through [`values::Gen`] (an `arbitrary::Unstructured`), so a failing input is
//! printed in hex and replays exactly (`keyhome-fuzz --target T --replay HEX`). The driver draws
//! each input's bytes from the seeded [`Rng`], input `i` of seed `s` from its own generator, so
//! one input can be regenerated without the others. A panic is caught and reported as a failure
//! with its input; run with overflow checks on (the `fuzz` profile, or a test build), so that
//! arithmetic overflow, which aborts a release node, is found here.

pub mod decode;
pub mod epoch;
pub mod holder;
pub mod home;
pub mod script;
pub mod values;

use std::panic::{self, AssertUnwindSafe};
use std::time::Duration;

use keyhome_epoch::Timing;

use crate::rng::Rng;
use values::Gen;

/// Most steps of one state-machine sequence.
pub const MAX_STEPS: usize = 200;

/// What is fuzzed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// `wire::decode::<PeerFrame>` and the checks on what a frame carries.
    PeerFrame,
    /// `wire::decode::<Request>`, the client protocol.
    Request,
    /// `EpochRecord` decoding, validation and changes applied to valid records.
    EpochRecord,
    /// `pki::role_of` on mutated certificates, `Role::from_dns_name` on names.
    CertRole,
    /// Message sequences into `Home`.
    Home,
    /// Client calls and message sequences into `Holder`.
    Holder,
    /// Message sequences into `EpochNode`.
    EpochNode,
}

impl Target {
    pub const ALL: [Target; 7] = [
        Target::PeerFrame,
        Target::Request,
        Target::EpochRecord,
        Target::CertRole,
        Target::Home,
        Target::Holder,
        Target::EpochNode,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Target::PeerFrame => "peer-frame",
            Target::Request => "request",
            Target::EpochRecord => "epoch-record",
            Target::CertRole => "cert-role",
            Target::Home => "home",
            Target::Holder => "holder",
            Target::EpochNode => "epoch-node",
        }
    }

    pub fn parse(name: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.name() == name)
    }

    /// Whether the target drives a state machine through a sequence of steps.
    pub fn is_sequence(self) -> bool {
        matches!(self, Target::Home | Target::Holder | Target::EpochNode)
    }

    /// Longest input: enough bytes for a few values, or for [`MAX_STEPS`] steps.
    fn max_input(self) -> usize {
        if self.is_sequence() { 4096 } else { 512 }
    }

    /// Runs one input; `Err` says what broke.
    fn run_raw(self, data: &[u8]) -> Result<(), String> {
        match self {
            Target::PeerFrame => decode::peer_frame(data),
            Target::Request => decode::request(data),
            Target::EpochRecord => decode::epoch_record(data),
            Target::CertRole => decode::cert_role(data),
            Target::Home => home::run(data),
            Target::Holder => holder::run(data),
            Target::EpochNode => epoch::run(data),
        }
    }

    /// Runs one input, catching a panic as a failure with its message.
    pub fn run(self, data: &[u8]) -> Result<(), String> {
        match panic::catch_unwind(AssertUnwindSafe(|| self.run_raw(data))) {
            Ok(result) => result,
            Err(payload) => {
                let message = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic without a message".to_owned());
                Err(format!("panic: {message}"))
            }
        }
    }
}

/// Input `index` of `seed` for `target`.
pub fn input(target: Target, seed: u64, index: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(17));
    let len = rng.range(0, target.max_input() as u64) as usize;
    let mut bytes = Vec::with_capacity(len + 8);
    while bytes.len() < len {
        bytes.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    bytes.truncate(len);
    bytes
}

/// A failing input.
#[derive(Debug)]
pub struct Failure {
    pub index: u64,
    pub input: Vec<u8>,
    pub message: String,
}

/// The outcome of a run: how many inputs ran, and the first failure, if any.
#[derive(Debug)]
pub struct Summary {
    pub target: Target,
    pub seed: u64,
    pub inputs: u64,
    pub failure: Option<Failure>,
}

/// Runs inputs `0..iterations` of `seed`, stopping at the first failure.
pub fn fuzz(target: Target, seed: u64, iterations: u64) -> Summary {
    for index in 0..iterations {
        let data = input(target, seed, index);
        if let Err(message) = target.run(&data) {
            let failure = Some(Failure { index, input: data, message });
            return Summary { target, seed, inputs: index + 1, failure };
        }
    }
    Summary { target, seed, inputs: iterations, failure: None }
}

/// A valid epoch timing for the delegation and epoch targets, with leases short enough that a
/// sequence's time steps reach them.
pub fn small_timing(g: &mut Gen<'_>) -> Timing {
    let ms = Duration::from_millis;
    match g.index(4) {
        0 => Timing { home_lease: ms(40), max_delegation_lease: ms(200), clock_rate_ppm: 10_000 },
        1 => Timing { home_lease: ms(10), max_delegation_lease: ms(50), clock_rate_ppm: 100_000 },
        2 => Timing { home_lease: ms(100), max_delegation_lease: ms(1000), clock_rate_ppm: 0 },
        _ => Timing::DEFAULT,
    }
}

/// Lower-case hex of `bytes`.
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Bytes from hex (whitespace ignored), or `None` if it is not hex.
pub fn from_hex(text: &str) -> Option<Vec<u8>> {
    let digits: Vec<u8> = text.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    if !digits.len().is_multiple_of(2) {
        return None;
    }
    digits.chunks(2).map(|pair| u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()).collect()
}
