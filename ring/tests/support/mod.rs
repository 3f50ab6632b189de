//! Helpers shared by the integration tests (not a test crate itself).

pub mod vectors;
