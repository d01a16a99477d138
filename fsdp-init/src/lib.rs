//! Deferred initialization for fsdp-rs: record init ops on a fake device, replay them whole, unit by unit, or shard by shard, bit-identical to eager init.
//!
//! This crate is being built; see the project's issues for its contract.
#![deny(missing_docs)]
