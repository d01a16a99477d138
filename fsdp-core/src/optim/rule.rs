//! The update-rule abstraction: what an optimizer does to **one flat f32 tensor** given its
//! gradient and its state tensors (burn's `SimpleOptimizer` is the model). The drivers in
//! [`super::driver`] run a rule over every unit's shard ([`super::Sharded`]) or over every plain
//! parameter ([`super::Local`]); a new optimizer adds a rule, not a driver.

use fsdp_alloc::{Device, Stream};
use fsdp_autograd::kernels::{Kernels, Operand};

use crate::error::{ArgumentError, FsdpError, Result, StateError};

/// Where and on what one update runs: the device's kernels (the seam), the stream, and the
/// operands — all f32, `p`, `g` and every state slot of the same length.
#[derive(Debug, Clone, Copy)]
pub struct StepArgs<'a> {
    /// The device holding the operands (for temporaries, e.g. LAMB's direction).
    pub device: &'a Device,
    /// Its kernels.
    pub kernels: &'a Kernels,
    /// The stream the update is launched on.
    pub stream: &'a Stream,
    /// The parameters (updated in place).
    pub p: &'a Operand,
    /// The gradient.
    pub g: &'a Operand,
    /// One operand per [`Rule::SLOTS`] entry (none if not [`Rule::keeps_state`]).
    pub state: &'a [Operand],
    /// The state was just created as zeros.
    pub fresh: bool,
}

/// An optimizer's update of one flat f32 tensor `p` from its gradient `g` and its state
/// (one f32 tensor per [`Self::SLOTS`] entry, shaped like `p`).
///
/// The rule is the whole optimizer for [`super::Local`]: it is called once per parameter with
/// the parameter's whole tensor. [`super::Sharded`] calls it on the trainable pieces of each
/// unit's shard, which is only the same computation when the rule is an
/// [`ElementwiseRule`].
pub trait Rule: Clone + std::fmt::Debug {
    /// The optimizer's name in error messages, e.g. `"AdamW"` (`"AdamW::step"`).
    const NAME: &'static str;
    /// The optimizer's name as the literature writes it (`"SGD"`, `"AdamW"`, `"LAMB"`): what
    /// [`super::ShardedOptimizer::name`] returns for banners and plans.
    const TITLE: &'static str;
    /// The kernel's name (what a stream failure and the profiler report).
    const KERNEL: &'static str;
    /// Names of the state slots, e.g. `["exp_avg", "exp_avg_sq"]`.
    const SLOTS: &'static [&'static str];
    /// What one step's kernel needs, computed on the host (hyper-parameters and the
    /// step-dependent scalars such as bias corrections).
    type Coeffs: Copy + Send + 'static;

    /// Checks the hyper-parameters.
    ///
    /// # Errors
    /// [`FsdpError::InvalidArgument`] naming the bad hyper-parameter.
    fn check(&self, op: &str) -> Result<()>;

    /// Whether this configuration keeps state (SGD without momentum keeps none: no slot tensor
    /// is created and `state` is empty in [`Self::update`]).
    fn keeps_state(&self) -> bool {
        true
    }

    /// The coefficients of step `step` (1 for the tensor's first step).
    fn coeffs(&self, step: u64) -> Self::Coeffs;

    /// The learning rate of the next steps.
    fn lr(&self) -> f32;

    /// Sets the learning rate of the next steps (a schedule calls it before every step).
    fn set_lr(&mut self, lr: f32);

    /// Updates `p` in place on host slices: the rule's CPU kernel (the functions of
    /// `fsdp_autograd::kernels::optim`). `state` holds one slice per slot (none if not
    /// [`Self::keeps_state`]), `fresh` is true when the state was just created as zeros.
    ///
    /// # Errors
    /// Slices of different lengths, a missing state slice.
    fn update(
        c: &Self::Coeffs,
        p: &mut [f32],
        g: &[f32],
        state: &mut [&mut [f32]],
        fresh: bool,
    ) -> Result<()>;

    /// Launches one update of all of `a.p` through the kernel seam on `a.stream`: the rule's
    /// fused kernel(s) (all state slots in one launch), which on a CPU device run exactly
    /// [`Self::update`]'s arithmetic and on a CUDA device the matching CUDA kernels. Returns
    /// once launched.
    ///
    /// # Errors
    /// The seam's argument checks; a missing state slot; CUDA errors.
    fn launch(c: &Self::Coeffs, a: &StepArgs<'_>) -> Result<()>;
}

/// A [`Rule`] whose element `i` depends only on element `i` of the parameter, the gradient and
/// the state, so running it on any piece of a tensor equals running it on the whole tensor and
/// keeping that piece: what lets [`super::Sharded`] run it on shards. (LAMB's trust ratio needs
/// whole-parameter norms, so [`super::LambRule`] is not one; [`super::Lamb`] drives it.)
pub trait ElementwiseRule: Rule {}

/// Checks a learning-rate-like hyper-parameter.
pub(crate) fn check_finite(op: &str, what: &str, v: f32) -> Result<()> {
    if v.is_finite() {
        Ok(())
    } else {
        Err(FsdpError::InvalidArgument(ArgumentError::Value {
            op: op.into(),
            name: what.into(),
            value: v.to_string(),
            requirement: "finite".into(),
        }))
    }
}

/// Checks Adam's betas and eps.
pub(crate) fn check_betas(op: &str, betas: (f32, f32), eps: f32) -> Result<()> {
    for (what, b) in [("beta1", betas.0), ("beta2", betas.1)] {
        if !(0.0..1.0).contains(&b) {
            return Err(FsdpError::InvalidArgument(ArgumentError::Value {
                op: op.into(),
                name: what.into(),
                value: b.to_string(),
                requirement: "in [0, 1)".into(),
            }));
        }
    }
    if !(eps.is_finite() && eps > 0.0) {
        return Err(FsdpError::InvalidArgument(ArgumentError::Value {
            op: op.into(),
            name: "eps".into(),
            value: eps.to_string(),
            requirement: "positive and finite".into(),
        }));
    }
    Ok(())
}

/// The `K` state operands of a rule that keeps `K` slots.
pub(crate) fn slots<'a, const K: usize>(name: &str, a: &StepArgs<'a>) -> Result<&'a [Operand; K]> {
    a.state.try_into().map_err(|_| {
        FsdpError::State(StateError::StateOperands {
            op: name.into(),
            actual: a.state.len(),
            expected: K,
        })
    })
}

/// The error of a rule's host update called with the wrong number of state slices.
pub(crate) fn missing_slices(name: &str, got: usize, want: usize) -> FsdpError {
    FsdpError::State(StateError::StateOperands {
        op: name.into(),
        actual: got,
        expected: want,
    })
}

/// A kernel error of a host update as an [`FsdpError`].
pub(crate) fn kernel_err(e: fsdp_autograd::kernels::KernelError) -> FsdpError {
    fsdp_autograd::AutogradError::from(e).into()
}
