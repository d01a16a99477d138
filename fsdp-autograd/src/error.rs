//! The crate's error type.

use fsdp_alloc::{AllocError, DType};

use crate::init::InitError;
use crate::kernels::KernelError;

/// Everything that can go wrong in tensors, the autograd engine and the nn layers.
///
/// Variants carry the operation and the sizes/dtypes involved, and their messages say what to do.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum AutogradError {
    /// The device runtime failed (out of memory, a failed stream, a bad buffer access).
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// A kernel rejected its arguments (only on synchronous paths; kernels launched on a stream
    /// report through the stream's failure instead).
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// Evaluating a parameter's init ops failed.
    #[error(transparent)]
    Init(#[from] InitError),
    /// Shapes that do not fit the operation.
    #[error("`{op}`: shape mismatch: {detail}")]
    Shape {
        /// The operation.
        op: &'static str,
        /// The shapes involved and what was expected.
        detail: String,
    },
    /// An element type the operation does not accept.
    #[error("`{op}`: dtype {got} is not supported here; expected {expected}")]
    DType {
        /// The operation.
        op: &'static str,
        /// What was given.
        got: DType,
        /// What the operation accepts.
        expected: String,
    },
    /// Tensors on different devices were combined.
    #[error(
        "`{op}`: tensors live on different devices ({a} and {b}); move them to one device first"
    )]
    Device {
        /// The operation.
        op: &'static str,
        /// One device.
        a: String,
        /// The other device.
        b: String,
    },
    /// An argument outside its valid range (dimension index, narrow bounds, split sizes …).
    #[error("`{op}`: invalid argument: {detail}")]
    Argument {
        /// The operation.
        op: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// A kernel was launched on a tensor whose storage has been released.
    #[error(
        "`{op}`: the storage of this tensor (storage #{storage}, {nbytes} bytes) is released; \
         attach a buffer (`Storage::attach`) before using the tensor (FSDP: unshard first)"
    )]
    StorageReleased {
        /// The operation.
        op: &'static str,
        /// The storage's id.
        storage: u64,
        /// The storage's byte size.
        nbytes: usize,
    },
    /// `Storage::attach` was given an unusable buffer.
    #[error("cannot attach a buffer to storage #{storage}: {detail}")]
    Attach {
        /// The storage's id.
        storage: u64,
        /// Why not.
        detail: String,
    },
    /// A CUDA device was used by a build of this crate without the `cuda` feature.
    #[error(
        "`{op}` on {device}: this build of fsdp-autograd was built without CUDA support; rebuild \
         with `--features cuda` (and a CUDA driver) or use a CPU device"
    )]
    CudaNotBuilt {
        /// The operation.
        op: &'static str,
        /// The CUDA device.
        device: String,
    },
    /// A device backend (CUDA: driver, NVRTC, cuBLAS or a kernel's device-side check) failed.
    #[error("`{op}` on the {backend} backend: {detail}")]
    Backend {
        /// The backend's name.
        backend: &'static str,
        /// The operation.
        op: &'static str,
        /// The backend's error, with what to do.
        detail: String,
    },
    /// The operation is not available for this device or configuration.
    #[error("`{op}`: not supported: {detail}")]
    Unsupported {
        /// The operation.
        op: &'static str,
        /// What is missing and what to do instead.
        detail: String,
    },
    /// A tensor saved for backward was modified in place after it was saved.
    #[error(
        "one of the tensors needed to compute the gradient of `{op}` was modified by an in-place \
         operation: it was saved at version {saved} and is now at version {current}; do the \
         in-place update after backward, or operate on a copy (`.contiguous_copy()`)"
    )]
    SavedTensorModified {
        /// The operation that saved it.
        op: &'static str,
        /// Version when saved.
        saved: u64,
        /// Version now.
        current: u64,
    },
    /// Backward reached a node whose saved state was already consumed by an earlier backward.
    #[error(
        "`{op}`: trying to backward through the graph a second time (its saved tensors were freed \
         by the first backward); run the forward again before calling backward again"
    )]
    GraphConsumed {
        /// The node's operation.
        op: &'static str,
    },
    /// Backward was called on something that has no gradient graph, or with a bad seed gradient.
    #[error("backward: {0}")]
    Backward(String),
    /// A hook or queued callback returned an error; backward was aborted.
    #[error("a backward hook failed ({what}): {detail}")]
    Hook {
        /// Which kind of hook, on which op/tensor.
        what: String,
        /// Its error.
        detail: String,
    },
    /// A hook or queued callback failed with another crate's error, kept whole: recover it with
    /// [`HookError::downcast_ref`] (e.g. FSDP's own error type from `loss.backward()`).
    #[error("a backward hook failed ({}): {}", .0.what(), .0)]
    HookFailed(HookError),
    /// `queue_callback` was called while no backward was running on this thread.
    #[error(
        "queue_callback called outside of backward; call it from inside a backward hook (it runs \
         when the current backward finishes)"
    )]
    NotInBackward,
    /// An in-place operation on a tensor that takes part in autograd.
    #[error(
        "`{op}`: in-place operation on a tensor that requires grad while grad mode is enabled; \
         wrap the update in `no_grad(|| ...)` (e.g. optimizer steps) or use the out-of-place op"
    )]
    InPlaceOnGradTensor {
        /// The operation.
        op: &'static str,
    },
    /// `requires_grad` can only be changed on leaves, and only for floating-point tensors.
    #[error("set_requires_grad: {0}")]
    RequiresGrad(String),
    /// Activation checkpointing could not recompute consistently.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// A parameter has no tensor (it was created on the fake device and not materialized).
    #[error(
        "parameter `{name}` has no tensor (created by a fake InitContext and not materialized); \
         materialize it (fsdp-init) or create the model with `InitContext::eager`"
    )]
    NoTensor {
        /// Fully-qualified parameter name.
        name: String,
    },
    /// A parameter-level problem (unknown name, duplicate name, shape of a replacement tensor).
    #[error("parameter `{name}`: {detail}")]
    Parameter {
        /// Fully-qualified parameter name.
        name: String,
        /// What is wrong.
        detail: String,
    },
}

/// Shorthand for results of this crate.
pub type Result<T, E = AutogradError> = std::result::Result<T, E>;

pub(crate) fn shape_err(op: &'static str, detail: impl Into<String>) -> AutogradError {
    AutogradError::Shape {
        op,
        detail: detail.into(),
    }
}

pub(crate) fn arg_err(op: &'static str, detail: impl Into<String>) -> AutogradError {
    AutogradError::Argument {
        op,
        detail: detail.into(),
    }
}

/// The error of a hook or callback from another crate, carried through autograd unchanged
/// (inside [`AutogradError::HookFailed`]) so that whoever called `backward` can get it back by
/// type.
///
/// ```
/// use fsdp_autograd::{AutogradError, HookError};
///
/// #[derive(Debug, thiserror::Error, PartialEq)]
/// #[error("ranks disagree")]
/// struct Mine;
///
/// let e = AutogradError::HookFailed(HookError::new("my hook", Mine));
/// assert_eq!(e.to_string(), "a backward hook failed (my hook): ranks disagree");
/// let AutogradError::HookFailed(h) = &e else { unreachable!() };
/// assert_eq!(h.downcast_ref::<Mine>(), Some(&Mine));
/// ```
#[derive(Clone)]
pub struct HookError {
    what: String,
    error: std::sync::Arc<dyn std::error::Error + Send + Sync + 'static>,
}

impl HookError {
    /// Wraps `error`, raised by the hook described by `what`.
    pub fn new(
        what: impl Into<String>,
        error: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        HookError {
            what: what.into(),
            error: std::sync::Arc::new(error),
        }
    }

    /// Which hook failed.
    pub fn what(&self) -> &str {
        &self.what
    }

    /// The original error, if it is an `E`.
    pub fn downcast_ref<E: std::error::Error + 'static>(&self) -> Option<&E> {
        self.error.downcast_ref::<E>()
    }

    /// The original error.
    pub fn error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.error
    }
}

impl std::fmt::Debug for HookError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HookError")
            .field("what", &self.what)
            .field("error", &self.error)
            .finish()
    }
}

impl std::fmt::Display for HookError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl PartialEq for HookError {
    /// The same hook description and the same error instance (errors need not be comparable).
    fn eq(&self, other: &Self) -> bool {
        self.what == other.what && std::sync::Arc::ptr_eq(&self.error, &other.error)
    }
}
