//! Optimizer, gradient-clipping and grad-scaler ops on flat f32 tensors: [`SgdStep`],
//! [`AdamWStep`], [`LambDirection`], [`LambApply`], [`SumSquares`], [`Unscale`] (fsdp-core's
//! optimizers, clipping and grad scaler launch these), with their coefficient types
//! ([`SgdRule`], [`AdamCoeffs`], [`LambCoeffs`], [`SqPiece`]) and the host-slice kernels that are
//! the one place their arithmetic is written down ([`sgd_step`], [`adamw_step`],
//! [`lamb_direction`], [`lamb_apply`], [`sum_sq`], [`unscale`]). fsdp-core's optimizer rules call
//! those slice functions as their host update; the CUDA kernels repeat the same operations in
//! the same order.
//!
//! Every update is elementwise, one f32 rounding per operation, no fused multiply-add: running a
//! kernel on any piece of a tensor gives exactly that piece of the whole update, which is what
//! makes a sharded optimizer equal its local counterpart bit for bit. Norm sums accumulate in
//! f64, sequentially over each piece ([`sum_sq`]). Every operand of the ops is f32 and no output
//! overlaps another operand.

pub(crate) mod adamw;
mod common;
pub(crate) mod lamb;
pub(crate) mod sgd;
pub(crate) mod sum_squares;
pub(crate) mod unscale;

pub use adamw::{adamw_step, AdamCoeffs, AdamWStep};
pub use lamb::{lamb_apply, lamb_direction, trust_ratio, LambApply, LambCoeffs, LambDirection};
pub use sgd::{sgd_step, SgdRule, SgdStep};
pub use sum_squares::{sum_sq, SqPiece, SumSquares};
pub use unscale::{unscale, Unscale};

/// The family's part of the CUDA program: `optim.cu` and its ops' kernel tables.
#[cfg(feature = "cuda")]
pub(crate) const FAMILY: super::cuda::kernel::Family = super::cuda::kernel::Family {
    sources: &[include_str!("optim.cu")],
    kernels: &[
        sgd::gpu::KERNELS,
        adamw::gpu::KERNELS,
        lamb::gpu::KERNELS,
        sum_squares::gpu::KERNELS,
        unscale::gpu::KERNELS,
    ],
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::KernelError;

    #[test]
    fn kernels_reject_mismatched_lengths() {
        let c = AdamCoeffs::new(0.1, (0.9, 0.999), 1e-8, 0.0, 1);
        let (mut p, mut m, mut v) = (vec![0.0; 3], vec![0.0; 3], vec![0.0; 2]);
        assert!(matches!(
            adamw_step(&c, &mut p, &[0.0; 3], &mut m, &mut v),
            Err(KernelError::LengthMismatch { arg: "v", .. })
        ));
        assert!(sgd_step(&SgdRule::new(0.1), &mut p, &[1.0; 2], None, false).is_err());
        assert!(lamb_apply(&mut p, &[0.0; 4], 0.1, 1.0, 1.0).is_err());
    }

    #[test]
    fn unscale_flags_inf_and_nan_and_trust_ratio_falls_back() {
        let mut g = vec![2.0, f32::NAN];
        assert!(unscale(&mut g, 0.5));
        assert_eq!(g[0], 1.0);
        assert!(!unscale(&mut [1.0, 2.0], 0.5));
        assert_eq!(trust_ratio(4.0, 1.0), 2.0);
        assert_eq!(trust_ratio(0.0, 1.0), 1.0);
        assert_eq!(trust_ratio(f64::INFINITY, 1.0), 1.0);
        assert_eq!(sum_sq(&[3.0, 4.0]), 25.0);
    }
}
