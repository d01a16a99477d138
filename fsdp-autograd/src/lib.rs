#![doc = include_str!("../README.md")]
//!
//! # Crate layout
//! - [`Tensor`], [`Storage`]: layout, storage release/attach (FSDP's `resize_(0)`), version
//!   counters, constructors and readback.
//! - [`with_stream`], [`no_grad`]: the thread's current stream and grad mode.
//! - tensor operations (methods on [`Tensor`] plus [`linear`], [`layer_norm`], [`rms_norm`],
//!   [`embedding`], [`causal_attention`], [`cross_entropy`], [`rope`], [`silu_mul`]), each with
//!   its backward.
//! - [`autograd`]: the engine, hooks, [`queue_callback`], [`checkpoint`], [`custom_op`].
//! - [`Parameter`], [`InitContext`]: named parameters with recorded [`init::InitOp`]s, created
//!   eagerly on a device or on a fake device (recorded only).
//! - [`nn`]: the `Module` trait with forward hooks, layers and a small GPT; [`optim::Sgd`].
//! - [`kernels`]: the backend seam, the CPU kernels (and CUDA kernels with the `cuda` feature);
//!   [`init`]: init ops and the counter-based RNG.
//! - [`profile`]: per-operation kernel timing.
//!
//! # Streams and memory
//! Operations run on the issuing thread's current stream for the tensor's device (the default
//! stream unless [`with_stream`] says otherwise) and allocate their outputs there. Launched work
//! captures memory handles (`BufferRef`s), never tensors, so dropping a tensor frees its memory to
//! the caching allocator at once, and stream order makes the reuse safe on the same stream. When a
//! kernel uses a tensor allocated on *another* stream, the tensor layer calls
//! `Buffer::record_stream` for that stream, so the block is not reused until the work completes
//! (ordering the *producer* before the consumer is the caller's job: `Stream::wait_event`).
//! Kernel errors that can only be seen while running (an embedding id out of range) fail the
//! stream and surface at the next synchronization (`to_vec`, `item`, `synchronize`); everything
//! checkable at launch is returned as an [`AutogradError`] at once.
//!
//! # Limitations
//! - CUDA: with the `cuda` feature, operations on a CUDA device run the CUDA kernels through the
//!   backend seam ([`kernels`]); CI runs the kernels on a host emulator, and `cargo xtask
//!   gpu-test` runs them on a GPU (what has run where: `docs/GPU-STATUS.md`). Without the
//!   feature a CUDA device is an [`AutogradError::CudaNotBuilt`] error. On
//!   CUDA, the general broadcast-undoing sum and copies into non-contiguous destinations (split
//!   backward along an inner dimension) return [`AutogradError::Unsupported`], and so does eager
//!   parameter init on a CUDA device (init runs on the host: create the model on a CPU device and
//!   move it, or use the fake device; materializing deferred init directly on a CUDA device is
//!   not implemented).
//! - `matmul` needs operands with at least two dimensions and equal batch dimensions (or a 2-D
//!   right operand); there is no general batch broadcasting. Binary operations need equal dtypes.
//! - See [`autograd`] for the engine's limitations (no `retain_graph`, no higher-order
//!   gradients, no autograd through in-place ops, checkpoint regions do not nest).
#![deny(missing_docs)]

pub mod autograd;
pub mod context;
pub mod error;
pub mod init;
pub mod kernels;
pub(crate) mod launch;
pub mod nn;
pub mod ops;
pub mod optim;
pub mod param;
pub mod profile;
pub mod storage;
pub mod tensor;

pub use autograd::{
    backward, checkpoint, custom_op, in_backward, queue_callback, queue_callback_fallible,
    HookHandle,
};
pub use context::{
    current_stream, enable_grad, is_grad_enabled, no_grad, with_stream, GradModeGuard,
};
pub use error::{AutogradError, HookError, Result};
pub use kernels::Gelu;
pub use ops::{
    causal_attention, causal_attention_qkv, causal_attention_qkv_grouped, causal_attention_scaled,
    cross_entropy, dropout, embedding, layer_norm, linear, rms_norm, rope, silu_mul,
};
pub use param::{InitContext, Parameter};
pub use storage::Storage;
pub use tensor::{Element, Tensor};
