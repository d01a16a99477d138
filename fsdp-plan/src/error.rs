//! [`PlanError`]: what can be wrong with a planning request (a leaf: it imports nothing of the
//! crate).

/// What can be wrong with a planning request.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// The model description is unusable (no units, a leaf naming a missing unit, a policy
    /// naming a missing module).
    #[error("planner model: {0}")]
    Model(String),
    /// The cluster description is unusable (zero ranks, a non-positive bandwidth or rate).
    #[error("planner cluster: {0}; fix the cluster description")]
    Cluster(String),
    /// The batch is empty.
    #[error("planner batch: {0}")]
    Batch(String),
    /// A configuration that cannot run on this cluster (F not dividing W, ...).
    #[error("planner configuration: {0}")]
    Config(String),
    /// No configuration fits in device memory.
    #[error(
        "no configuration fits: the smallest predicted peak is {smallest_peak} bytes per rank \
         (with {headroom_percent}% allocator headroom) but devices have {device_bytes}; use \
         more ranks, a smaller batch, activation checkpointing, or a smaller model"
    )]
    NothingFits {
        /// The smallest predicted per-rank peak over all candidates, bytes.
        smallest_peak: u64,
        /// Device memory, bytes.
        device_bytes: u64,
        /// The allocator headroom assumed, percent.
        headroom_percent: u32,
    },
}
