//! [`StreamId`], the process-unique stream identifier: a plain value that the checked mode's
//! vector clocks (`clock.rs`, `checked.rs`), a stream's health and the streams themselves name.
//! `stream.rs` imports the clocks and the health, so the id sits below them in a file of its own;
//! the crate root and `stream.rs` re-export it.

/// A process-unique stream identifier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub u64);

impl std::fmt::Display for StreamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "s{}", self.0)
    }
}
