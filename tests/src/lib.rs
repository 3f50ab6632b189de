//! Deterministic simulation of keyhome clusters.
