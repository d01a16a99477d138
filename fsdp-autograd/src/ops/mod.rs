//! Differentiable tensor operations. Each checks its tensors, launches its kernels through the
//! device's backend seam ([`crate::kernels::Kernels`]) on the current stream, and records
//! a backward node when needed.
//!
//! Methods live on [`Tensor`]; operations with several tensor arguments are also free functions
//! ([`linear`], [`layer_norm`], [`rms_norm`], [`embedding`], [`causal_attention`],
//! [`causal_attention_scaled`], [`causal_attention_qkv`], [`causal_attention_qkv_grouped`],
//! [`cross_entropy`], [`rope`], [`silu_mul`], [`dropout`]).
//! Half-precision tensors are computed in `f32` and rounded on output; binary operations need
//! equal dtypes.

pub(crate) mod attention_dropout;
pub(crate) mod attention_qkv;
pub(crate) mod dropout;
pub(crate) mod elementwise;
pub(crate) mod matmul;
pub(crate) mod nn;
pub(crate) mod reduce;
pub(crate) mod rope;
pub(crate) mod shape;
pub(crate) mod swiglu;
pub(crate) mod transfer;

pub use attention_dropout::{causal_attention_qkv_dropout, ProbDropout};
pub use attention_qkv::{causal_attention_qkv, causal_attention_qkv_grouped};
pub use dropout::dropout;
pub use matmul::linear;
pub use nn::{
    causal_attention, causal_attention_scaled, cross_entropy, embedding, layer_norm, rms_norm,
};
pub use rope::rope;
pub use swiglu::silu_mul;

use fsdp_alloc::{Device, Stream};

use crate::context::current_stream;
use crate::error::{AutogradError, Result};
use crate::kernels::Kernels;
use crate::tensor::Tensor;

/// Device and current stream of an operation.
pub(crate) struct Ctx {
    pub device: Device,
    pub stream: Stream,
}

impl Ctx {
    pub(crate) fn of(t: &Tensor) -> Ctx {
        let device = t.device().clone();
        let stream = current_stream(&device);
        Ctx { device, stream }
    }

    /// The device's kernels (behind the seam's argument checks).
    pub(crate) fn k(&self) -> Result<Kernels> {
        Kernels::for_device(&self.device)
    }

    pub(crate) fn empty(&self, shape: &[usize], dtype: fsdp_alloc::DType) -> Result<Tensor> {
        Tensor::empty_on(shape, dtype, &self.device, &self.stream)
    }
}

/// Checks that two float tensors can be combined (same device, same dtype).
pub(crate) fn check_pair(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    a.check_same_device(b, op)?;
    a.check_float(op)?;
    if a.dtype() != b.dtype() {
        return Err(AutogradError::DType {
            op,
            got: b.dtype(),
            expected: format!("{} (the dtype of the first operand)", a.dtype()),
        });
    }
    Ok(())
}
