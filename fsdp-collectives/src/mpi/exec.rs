//! The per-group execution state and the step patterns, shared by the MPI path (`mod.rs`) and
//! the shared-memory path (`shm.rs`): their own file so that `shm.rs` does not import `mod.rs`,
//! which imports it.

use crate::error::CollectiveError;

/// Execution state of one group, held for the whole of one collective.
pub(super) struct Exec {
    /// Sequence number of the next collective to run.
    pub(super) turn: u64,
    /// Steps completed on the shared-memory path (barrier generation).
    pub(super) step: u64,
    /// Set once the group can no longer agree: every later collective fails with it.
    pub(super) broken: Option<CollectiveError>,
    /// Receive scratch of the MPI path.
    pub(super) scratch: Vec<u8>,
}

/// How the pieces of one step travel.
#[derive(Clone, Copy)]
pub(super) enum Pattern {
    /// Every rank contributes `len` bytes; every rank sees all contributions.
    Gather,
    /// Every rank contributes `size × len` bytes (piece `d` for rank `d`); rank `r` sees piece
    /// `r` of every contribution.
    ToAll,
    /// Only `root` contributes `len` bytes; every rank sees it.
    FromRoot(usize),
}
