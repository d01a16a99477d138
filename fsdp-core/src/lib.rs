//! Fully Sharded Data Parallel for Rust: units, FlatParamHandle runtime, sharding strategies, prefetch, mixed precision, sharded optimizers and state dicts.
//!
//! This crate is being built; see the project's issues for its contract.
#![deny(missing_docs)]
