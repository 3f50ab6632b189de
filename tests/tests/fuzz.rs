//! A short seeded run of every fuzz target; the long runs are in docs/simulation.md, "Fuzzing".

use keyhome_sim::fuzz::{self, Target, from_hex};

/// A few thousand decoder inputs and a few hundred sequences per target, seed 7.
#[test]
fn every_target_passes_a_short_run() {
    for target in Target::ALL {
        let iterations = if target.is_sequence() { 300 } else { 5_000 };
        let summary = fuzz::fuzz(target, 7, iterations);
        if let Some(f) = summary.failure {
            let input = fuzz::to_hex(&f.input);
            panic!("{} input {} failed: {}\ninput: {input}", target.name(), f.index, f.message);
        }
        assert_eq!(summary.inputs, iterations, "{}", target.name());
    }
}

#[test]
fn inputs_replay_and_every_byte_string_is_an_input() {
    let a = fuzz::input(Target::Home, 3, 41);
    assert_eq!(a, fuzz::input(Target::Home, 3, 41), "an input is fixed by seed and index");
    assert_ne!(a, fuzz::input(Target::Home, 3, 42));
    assert_eq!(from_hex(&fuzz::to_hex(&a)), Some(a));
    assert_eq!(from_hex("0g"), None);
    // Every byte string is a valid input, the empty one included.
    for target in Target::ALL {
        assert_eq!(target.run(&[]), Ok(()), "{}", target.name());
        assert_eq!(Target::parse(target.name()), Some(target));
    }
}
