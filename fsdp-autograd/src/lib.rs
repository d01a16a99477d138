//! Tensors, CPU kernels, a reverse-mode autograd engine with FSDP's hook points, and nn layers for fsdp-rs.
//!
//! This crate is being built; see the project's issues for its contract.
#![deny(missing_docs)]

pub mod init;
pub mod kernels;
