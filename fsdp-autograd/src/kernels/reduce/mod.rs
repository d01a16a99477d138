//! Reductions: [`Sum`] (sum or mean of all elements), [`ColSums`] (column sums in row order)
//! and [`SumTo`] (the general broadcast-undoing sum).

pub(crate) mod col_sums;
pub(crate) mod sum;
mod sum_to;

pub use col_sums::ColSums;
pub use sum::Sum;
pub use sum_to::{SumTo, SumToShape};

/// The family's part of the CUDA program: `reduce.cu` and its ops' kernel tables.
#[cfg(feature = "cuda")]
pub(crate) const FAMILY: super::cuda::kernel::Family = super::cuda::kernel::Family {
    sources: &[include_str!("reduce.cu")],
    kernels: &[col_sums::gpu::KERNELS, sum::gpu::KERNELS],
};
