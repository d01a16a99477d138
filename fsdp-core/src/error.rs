//! The crate's error type.

use fsdp_alloc::AllocError;
use fsdp_autograd::AutogradError;
use fsdp_collectives::CollectiveError;
use fsdp_flatparam::LayoutError;

/// Everything that can go wrong in FSDP.
#[derive(Debug, thiserror::Error)]
pub enum FsdpError {
    /// Unit planning failed (bad policy, bad module tree).
    #[error("wrapping: {0}")]
    Wrap(String),
    /// A configuration that cannot work (e.g. a strategy without the process groups it needs).
    #[error("configuration: {0}")]
    Config(String),
    /// A device-runtime error (out of memory, a failed stream).
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// A tensor or autograd error.
    #[error(transparent)]
    Autograd(#[from] AutogradError),
    /// A collective failed (a peer died, sizes disagreed, a timeout).
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// Building shards from recorded init ops or from existing parameters failed.
    #[error(transparent)]
    Init(#[from] fsdp_init::MaterializeError),
    /// Saving or loading a state dict failed.
    #[error(transparent)]
    StateDict(Box<crate::state_dict::StateDictError>),
    /// A flat-parameter layout error.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// Ranks ran their units in different orders in one iteration (see
    /// [`crate::FsdpConfig::verify_execution_order`]).
    #[error(
        "units ran in different orders on rank {rank} ({ours}) and rank {peer} ({theirs}) of \
         group `{group}`: FSDP pairs the ranks' collectives by issue order, so every rank must \
         run its units in the same order; make the forward's control flow the same on every \
         rank, or wrap the modules whose order varies into one unit"
    )]
    ExecutionOrder {
        /// This rank (in `group`).
        rank: usize,
        /// The first rank whose order differs.
        peer: usize,
        /// The group the orders were compared in.
        group: String,
        /// This rank's forward order, as unit paths.
        ours: String,
        /// The peer's forward order, as unit paths.
        theirs: String,
    },
}

impl From<FsdpError> for AutogradError {
    /// FSDP errors raised inside module or autograd hooks travel through autograd as hook errors.
    fn from(e: FsdpError) -> AutogradError {
        match e {
            FsdpError::Autograd(a) => a,
            other => AutogradError::Hook {
                what: "FSDP".into(),
                detail: other.to_string(),
            },
        }
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = FsdpError> = std::result::Result<T, E>;

impl From<crate::state_dict::StateDictError> for FsdpError {
    fn from(e: crate::state_dict::StateDictError) -> FsdpError {
        match e {
            // A runtime error that passed through a state-dict call: hand back the original.
            crate::state_dict::StateDictError::Fsdp(inner) => *inner,
            other => FsdpError::StateDict(Box::new(other)),
        }
    }
}
