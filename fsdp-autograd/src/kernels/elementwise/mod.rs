//! Elementwise ops: [`Binary`] (add, mul, row broadcasts), [`Scale`], [`ScaleInplace`],
//! [`AxpyRows`], GELU ([`GeluForward`], [`GeluBackward`]), SiLU·mul ([`SiluMul`],
//! [`SiluMulBackward`]), [`Cast`], [`Fill`], [`Arange`].

pub(crate) mod axpy;
pub(crate) mod binary;
pub(crate) mod cast;
mod fill;
pub(crate) mod gelu;
pub(crate) mod scale;
pub(crate) mod silu_mul;

pub use axpy::AxpyRows;
pub use binary::{Binary, BinaryOp};
pub use cast::Cast;
pub use fill::{Arange, Fill};
pub use gelu::{GeluBackward, GeluForward};
pub use scale::{Scale, ScaleInplace};
pub use silu_mul::{silu_mul, silu_mul_backward, SiluMul, SiluMulBackward};

/// The family's part of the CUDA program: `elementwise.cu` and its ops' kernel tables.
#[cfg(feature = "cuda")]
pub(crate) const FAMILY: super::cuda::kernel::Family = super::cuda::kernel::Family {
    sources: &[include_str!("elementwise.cu")],
    kernels: &[
        binary::gpu::KERNELS,
        scale::gpu::KERNELS,
        axpy::gpu::KERNELS,
        gelu::gpu::KERNELS,
        cast::gpu::KERNELS,
        silu_mul::gpu::KERNELS,
    ],
};
