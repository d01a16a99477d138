//! SGD with momentum and weight decay: fsdp-autograd's [`SgdRule`] (the workspace's one SGD
//! rule) as a [`Rule`], and the sharded and local optimizers running it.

use fsdp_autograd::kernels::optim::{sgd_step, SgdStep};
use fsdp_autograd::nn::Module;
use fsdp_autograd::Parameter;

pub use fsdp_autograd::optim::SgdRule;

use super::driver::{Local, Sharded};
use super::rule::{check_finite, ElementwiseRule, Rule, StepArgs};
use crate::error::{ArgumentError, FsdpError, Result};
use crate::optim::ShardedOptimizer;
use crate::runtime::fsdp::Fsdp;
use fsdp_alloc::trace;

impl Rule for SgdRule {
    const NAME: &'static str = "Sgd";
    const TITLE: &'static str = "SGD";
    const KERNEL: &'static str = "sgd";
    const SLOTS: &'static [&'static str] = &["momentum_buffer"];
    type Coeffs = SgdRule;

    fn check(&self, op: &str) -> Result<()> {
        check_finite(op, "lr", self.lr)?;
        check_finite(op, "momentum", self.momentum)?;
        check_finite(op, "weight_decay", self.weight_decay)?;
        if self.nesterov && !self.has_momentum() {
            return Err(FsdpError::InvalidArgument(ArgumentError::Value {
                op: op.into(),
                name: "momentum".into(),
                value: self.momentum.to_string(),
                requirement: "non-zero with Nesterov momentum (set momentum or drop nesterov)"
                    .into(),
            }));
        }
        Ok(())
    }

    fn keeps_state(&self) -> bool {
        self.has_momentum()
    }

    fn coeffs(&self, _step: u64) -> SgdRule {
        *self
    }

    fn lr(&self) -> f32 {
        self.lr
    }

    fn set_lr(&mut self, lr: f32) {
        self.lr = lr;
    }

    fn update(
        c: &SgdRule,
        p: &mut [f32],
        g: &[f32],
        state: &mut [&mut [f32]],
        fresh: bool,
    ) -> Result<()> {
        if c.has_momentum() && state.is_empty() {
            return Err(super::rule::missing_slices("Sgd", 0, 1));
        }
        let buf = state.first_mut().map(|b| &mut **b);
        sgd_step(c, p, g, buf, fresh).map_err(super::rule::kernel_err)
    }

    fn launch(c: &SgdRule, a: &StepArgs<'_>) -> Result<()> {
        let buf = if c.has_momentum() {
            Some(super::rule::slots::<1>("Sgd::step", a)?)
        } else {
            None
        };
        let l = SgdStep {
            n: a.p.numel(),
            rule: *c,
            first: a.fresh,
            p: a.p,
            g: a.g,
            buf: buf.map(|[b]| b),
        };
        Ok(a.kernels.launch(a.stream, &l)?)
    }
}

impl ElementwiseRule for SgdRule {}

/// Sharded SGD with momentum, Nesterov and weight decay: `d = g + λ·p`, `b = μ·b + d` (`b = d` on
/// the first step), `p −= lr·b` (Nesterov: `p −= lr·(d + μ·b)`) — on each unit's shard, with one momentum buffer of `chunk_numel` per unit.
/// With `momentum == 0` and `weight_decay == 0` this is exactly [`crate::Fsdp::sgd_step`].
/// The hyper-parameters are the rule's fields: `opt.lr`, `opt.momentum`, `opt.weight_decay`.
///
/// See the [module docs](super) for an example (`AdamW` there; `Sgd` is used the same way).
pub type Sgd = Sharded<SgdRule>;

impl Sharded<SgdRule> {
    /// SGD with learning rate `lr`, no momentum, no weight decay.
    pub fn new(lr: f32) -> Sgd {
        Sharded::from_rule(SgdRule::new(lr))
    }

    /// With momentum μ.
    pub fn with_momentum(mut self, momentum: f32) -> Sgd {
        self.momentum = momentum;
        self
    }

    /// With weight decay λ.
    pub fn with_weight_decay(mut self, weight_decay: f32) -> Sgd {
        self.weight_decay = weight_decay;
        self
    }

    /// With or without Nesterov momentum (PyTorch's `nesterov=True`; only with momentum).
    pub fn with_nesterov(mut self, nesterov: bool) -> Sgd {
        self.nesterov = nesterov;
        self
    }
}

/// Local SGD over plain parameters with exactly [`Sgd`]'s arithmetic (and
/// `fsdp_autograd::optim::Sgd`'s: the same [`SgdRule`]): the parity reference for sharded SGD.
///
/// ```
/// use fsdp_alloc::{DType, Device};
/// use fsdp_autograd::{init::InitOp, InitContext};
/// use fsdp_core::optim::{LocalOptimizer, LocalSgd};
///
/// let dev = Device::cpu(0);
/// let p = InitContext::eager(&dev, 0).param("w", &[2], DType::F32, vec![InitOp::Fill(1.0)])?;
/// let mut opt = LocalSgd::new(vec![p.clone()], 0.5).with_momentum(0.9);
/// for _ in 0..2 {
///     p.get()?.sum()?.backward()?; // grad = 1
///     opt.step()?;
///     opt.zero_grad();
/// }
/// // b = 1, p = 0.5; then b = 0.9 + 1 = 1.9, p = 0.5 − 0.95
/// assert_eq!(p.get()?.to_vec::<f32>()?, vec![0.5 - 0.5 * 1.9; 2]);
/// # Ok::<(), fsdp_core::FsdpError>(())
/// ```
pub type LocalSgd = Local<SgdRule>;

impl Local<SgdRule> {
    /// SGD over `params` with learning rate `lr`, no momentum or weight decay.
    pub fn new(params: Vec<Parameter>, lr: f32) -> LocalSgd {
        Local::from_rule(params, SgdRule::new(lr))
    }

    /// With momentum μ.
    pub fn with_momentum(mut self, momentum: f32) -> LocalSgd {
        self.momentum = momentum;
        self
    }

    /// With weight decay λ.
    pub fn with_weight_decay(mut self, weight_decay: f32) -> LocalSgd {
        self.weight_decay = weight_decay;
        self
    }
}

// `Fsdp::sgd_step` lives here, beside the rule it runs, so that the runtime does not import the
// optimizers (which import the runtime).
impl<M: Module + 'static> Fsdp<M> {
    /// Plain SGD on the sharded parameters: `shard -= lr * shard_grad` for every unit with a
    /// gradient, on the compute stream (the same elementwise operation as
    /// `Tensor::add_scaled_(grad, -lr)` on unsharded parameters).
    pub fn sgd_step(&self, lr: f32) -> Result<()> {
        self.check_works()?;
        let _span = trace::span(self.device().id(), "optimizer sgd");
        // One SGD rule for the whole workspace: the sharded driver runs it on the optimizer
        // stream (the compute stream, or the host stream under CPU offload) and calls
        // `params_updated`, which records `params_ready` and drops stale gathers.
        Sgd::new(lr).step(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hyper_parameters_are_checked() {
        let bad = SgdRule {
            momentum: f32::INFINITY,
            ..SgdRule::new(0.1)
        };
        assert!(matches!(
            bad.check("t"),
            Err(crate::FsdpError::InvalidArgument(_))
        ));
        assert!(SgdRule::new(f32::NAN).check("t").is_err());
        assert!(SgdRule::new(0.1).check("t").is_ok());
    }
}
