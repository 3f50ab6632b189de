//! The keyhome node: owns all I/O around the protocol cores.

pub mod store;
