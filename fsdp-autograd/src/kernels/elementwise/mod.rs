//! Elementwise ops: [`Binary`] (add, mul, row broadcasts), [`Scale`], [`ScaleInplace`],
//! [`AxpyRows`], GELU ([`GeluForward`], [`GeluBackward`]), [`Cast`], [`Fill`], [`Arange`].

pub(crate) mod axpy;
pub(crate) mod binary;
pub(crate) mod cast;
mod fill;
pub(crate) mod gelu;
pub(crate) mod scale;

pub use axpy::AxpyRows;
pub use binary::{Binary, BinaryOp};
pub use cast::Cast;
pub use fill::{Arange, Fill};
pub use gelu::{GeluBackward, GeluForward};
pub use scale::{Scale, ScaleInplace};

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
    ],
};
