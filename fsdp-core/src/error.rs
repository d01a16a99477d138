//! The crate's error type, [`FsdpError`]: a leaf of the crate (it imports no other module of
//! it). State-dict errors wrap it ([`crate::StateDictError::Fsdp`]), not the reverse.

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
    /// A tensor had the wrong element type for the operation (e.g. a gradient in f16 where the
    /// optimizer keeps f32 state).
    #[error("wrong dtype: {0}")]
    Dtype(String),
    /// A tensor or module lives on the wrong device (e.g. a model built on another rank's device).
    #[error("wrong device: {0}")]
    Device(String),
    /// An argument out of its domain (a negative learning rate, a non-finite clip norm, an empty
    /// input).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A call made in a state where it cannot work (storage released, a gradient that does not
    /// exist yet, an optimizer state of another model): the message says what to call first.
    #[error("invalid state: {0}")]
    State(String),
    /// A unit index that does not exist.
    #[error("unit {unit} does not exist (there are {units})")]
    UnknownUnit {
        /// The index asked for.
        unit: usize,
        /// How many units the model has.
        units: usize,
    },
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
    /// FSDP errors raised inside module or autograd hooks travel through autograd whole, as
    /// [`AutogradError::HookFailed`]; [`FsdpError::from_backward`] gets them back.
    fn from(e: FsdpError) -> AutogradError {
        match e {
            FsdpError::Autograd(a) => a,
            other => AutogradError::HookFailed(fsdp_autograd::HookError::new("FSDP", other)),
        }
    }
}

impl FsdpError {
    /// The FSDP error behind an autograd error, when FSDP raised it inside a hook (the forward's
    /// module hooks or backward's hooks and callbacks: an unshard, a reduction, the order check).
    ///
    /// ```no_run
    /// # fn demo(loss: fsdp_autograd::Tensor) {
    /// use fsdp_core::FsdpError;
    /// if let Err(e) = loss.backward() {
    ///     match FsdpError::from_backward(&e) {
    ///         Some(FsdpError::Collective(c)) => eprintln!("a collective failed: {c}"),
    ///         Some(other) => eprintln!("FSDP failed in backward: {other}"),
    ///         None => eprintln!("autograd failed: {e}"),
    ///     }
    /// }
    /// # }
    /// ```
    pub fn from_backward(e: &AutogradError) -> Option<&FsdpError> {
        match e {
            AutogradError::HookFailed(h) => h.downcast_ref::<FsdpError>(),
            _ => None,
        }
    }

    /// This error with autograd's hook wrapping removed: for `FsdpError::Autograd` of an error
    /// FSDP raised in a hook, that FSDP error; otherwise `self`. Use it to match on errors that
    /// came back through `?` from `forward` or `backward`.
    pub fn root(&self) -> &FsdpError {
        match self {
            FsdpError::Autograd(a) => FsdpError::from_backward(a).map_or(self, FsdpError::root),
            _ => self,
        }
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = FsdpError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_raised_in_hooks_come_back_by_type() {
        let through_autograd: AutogradError = FsdpError::Config("bad".into()).into();
        assert_eq!(
            through_autograd.to_string(),
            "a backward hook failed (FSDP): configuration: bad"
        );
        assert!(matches!(
            FsdpError::from_backward(&through_autograd),
            Some(FsdpError::Config(m)) if m == "bad"
        ));
        let returned: FsdpError = through_autograd.into();
        assert!(matches!(returned.root(), FsdpError::Config(m) if m == "bad"));
        // Autograd's own errors pass through unchanged and are their own root.
        let plain = FsdpError::Autograd(AutogradError::Backward("no graph".into()));
        assert!(matches!(plain.root(), FsdpError::Autograd(_)));
        let back: AutogradError = FsdpError::Autograd(AutogradError::NotInBackward).into();
        assert_eq!(back, AutogradError::NotInBackward);
        assert!(FsdpError::from_backward(&back).is_none());
    }
}
