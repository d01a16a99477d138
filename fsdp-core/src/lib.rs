//! # fsdp-core: Fully Sharded Data Parallel for Rust
//!
//! This crate is being built; what exists today is unit planning ([`wrap`]).
#![deny(missing_docs)]

pub mod error;
pub mod wrap;

pub use error::{FsdpError, Result};
pub use wrap::{plan_units, ModuleInfo, UnitPlan, WrapPolicy};
