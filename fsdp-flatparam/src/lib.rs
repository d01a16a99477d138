//! Flatten-concat-chunk layout math for fully sharded data parallel training.
//!
//! This crate is being built; see the project's issues for its contract.
#![deny(missing_docs)]
