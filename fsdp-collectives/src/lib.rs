//! Even-sized collectives (all-gather, reduce-scatter, all-reduce, broadcast) for fsdp-rs: in-process thread backend, NCCL backend, device mesh, TCP rendezvous.
//!
//! This crate is being built; see the project's issues for its contract.
#![deny(missing_docs)]
