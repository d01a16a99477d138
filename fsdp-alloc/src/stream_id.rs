//! [`StreamId`], the process-unique stream identifier (a leaf: it imports nothing from the
//! crate, so the checked mode's clocks and the streams can both use it).

/// A process-unique stream identifier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub u64);

impl std::fmt::Display for StreamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "s{}", self.0)
    }
}
