//! Shared helpers for fsdp-rs's cross-crate tests (the tests themselves live in `tests/tests`).
#![deny(missing_docs)]
