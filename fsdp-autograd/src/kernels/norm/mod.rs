//! Row normalizations: [`Softmax`], [`LayerNorm`] and [`RmsNorm`], each with its backward.

pub(crate) mod layer_norm;
pub(crate) mod rms_norm;
pub(crate) mod softmax;

pub use layer_norm::{LayerNorm, LayerNormBackward, LayerNormShape};
pub use rms_norm::{rms_norm, rms_norm_backward, RmsNorm, RmsNormBackward, RmsNormShape};
pub use softmax::{Softmax, SoftmaxBackward};

/// The family's part of the CUDA program: `norm.cu` and its ops' kernel tables.
#[cfg(feature = "cuda")]
pub(crate) const FAMILY: super::cuda::kernel::Family = super::cuda::kernel::Family {
    sources: &[include_str!("norm.cu")],
    kernels: &[
        softmax::gpu::KERNELS,
        layer_norm::gpu::KERNELS,
        rms_norm::gpu::KERNELS,
    ],
};
