//! SGD: the update rule ([`SgdRule`], on one flat f32 slice) and a plain (local, unsharded)
//! optimizer running it over [`Parameter`]s ([`Sgd`]), for single-device training and tests.
//!
//! [`SgdRule`] is the one SGD rule of the workspace: fsdp-core's sharded `Sgd`, its `LocalSgd`
//! and `Fsdp::sgd_step` run the same [`SgdRule::update`], which is what makes FSDP training with
//! SGD equal local training bit for bit.

use std::ops::{Deref, DerefMut};

use crate::context::no_grad;
use crate::error::Result;
use crate::launch::launch;
use crate::ops::{check_pair, Ctx};
use crate::param::Parameter;
use crate::tensor::Tensor;

pub use crate::kernels::optim::SgdRule;

/// Stochastic gradient descent over plain parameters: [`SgdRule`] as one kernel per parameter on
/// the current stream. Half-precision parameters are updated in f32 and rounded once per step
/// (their momentum buffer is kept in the parameter's dtype).
///
/// ```
/// use fsdp_alloc::{DType, Device};
/// use fsdp_autograd::{init::InitOp, optim::Sgd, InitContext};
///
/// let dev = Device::cpu(0);
/// let p = InitContext::eager(&dev, 0).param("w", &[2], DType::F32, vec![InitOp::Fill(1.0)])?;
/// p.get()?.sum()?.backward()?; // grad = 1
/// let mut opt = Sgd::new(vec![p.clone()], 0.5);
/// opt.step()?;
/// assert_eq!(p.get()?.to_vec::<f32>()?, vec![0.5, 0.5]);
/// # Ok::<(), fsdp_autograd::AutogradError>(())
/// ```
#[derive(Debug)]
pub struct Sgd {
    params: Vec<Parameter>,
    rule: SgdRule,
    velocity: Vec<Option<Tensor>>,
}

/// The hyper-parameters read and write through the optimizer: `opt.lr`, `opt.momentum`,
/// `opt.weight_decay`.
impl Deref for Sgd {
    type Target = SgdRule;
    fn deref(&self) -> &SgdRule {
        &self.rule
    }
}

impl DerefMut for Sgd {
    fn deref_mut(&mut self) -> &mut SgdRule {
        &mut self.rule
    }
}

impl Sgd {
    /// SGD over `params` with learning rate `lr`, no momentum or weight decay.
    pub fn new(params: Vec<Parameter>, lr: f32) -> Sgd {
        let n = params.len();
        Sgd {
            params,
            rule: SgdRule::new(lr),
            velocity: vec![None; n],
        }
    }

    /// With momentum μ.
    pub fn with_momentum(self, momentum: f32) -> Sgd {
        Sgd {
            rule: SgdRule {
                momentum,
                ..self.rule
            },
            ..self
        }
    }

    /// With weight decay λ.
    pub fn with_weight_decay(self, weight_decay: f32) -> Sgd {
        Sgd {
            rule: SgdRule {
                weight_decay,
                ..self.rule
            },
            ..self
        }
    }

    /// The parameters.
    pub fn params(&self) -> &[Parameter] {
        &self.params
    }

    /// The rule this optimizer runs (its current hyper-parameters).
    pub fn rule(&self) -> SgdRule {
        self.rule
    }

    /// One update of every parameter that has a gradient.
    ///
    /// # Errors
    /// A gradient of another dtype or device than its parameter, a non-float or non-contiguous
    /// parameter, released storage, device memory.
    pub fn step(&mut self) -> Result<()> {
        const OP: &str = "Sgd::step";
        let rule = self.rule();
        no_grad(|| {
            for (p, v) in self.params.iter().zip(self.velocity.iter_mut()) {
                let Some(t) = p.try_get() else { continue };
                let Some(g) = t.grad() else { continue };
                check_pair(OP, &t, &g)?;
                let g = g.contig()?;
                let ctx = Ctx::of(&t);
                let mut first = false;
                if rule.has_momentum() && v.is_none() {
                    *v = Some(Tensor::zeros(t.shape(), t.dtype(), t.device())?);
                    first = true;
                }
                let buf = v.as_ref().filter(|_| rule.has_momentum());
                let pa = t.arg(OP, &ctx.stream)?;
                let ga = g.arg(OP, &ctx.stream)?;
                let ba = buf.map(|b| b.arg(OP, &ctx.stream)).transpose()?;
                launch(&ctx.stream, "sgd", move || {
                    ga.f32(OP, |g| {
                        pa.f32_mut(OP, true, |p| match &ba {
                            Some(ba) => ba.f32_mut(OP, true, |b| rule.update(p, g, Some(b), first)),
                            None => rule.update(p, g, None, first),
                        })
                    })
                });
                t.storage().bump_version();
                if let Some(b) = buf {
                    b.storage().bump_version();
                }
            }
            Ok(())
        })
    }

    /// Clears the gradients of all parameters.
    pub fn zero_grad(&self) {
        for p in &self.params {
            if let Some(t) = p.try_get() {
                t.zero_grad();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rule_momentum_and_weight_decay_follow_pytorch() {
        let rule = SgdRule {
            lr: 0.1,
            momentum: 0.5,
            weight_decay: 0.2,
            nesterov: false,
        };
        let mut p = vec![1.0f32];
        let mut b = vec![0.0f32];
        rule.update(&mut p, &[1.0], Some(&mut b), true);
        // d = 1 + 0.2 = 1.2, b = 1.2, p = 1 − 0.12
        assert_eq!(b[0], 1.2f32);
        assert_eq!(p[0], 1.0 + -0.1 * 1.2f32);
        let p1 = p[0];
        rule.update(&mut p, &[1.0], Some(&mut b), false);
        let d = 1.0 + 0.2 * p1;
        let b1 = 0.5 * 1.2f32 + d;
        assert_eq!(b[0], b1);
        assert_eq!(p[0], p1 + -0.1 * b1);
    }

    #[test]
    fn rule_without_momentum_ignores_the_buffer() {
        let rule = SgdRule::new(0.5);
        let (mut p, mut b) = (vec![1.0f32, 2.0], vec![7.0f32, 7.0]);
        rule.update(&mut p, &[1.0, -1.0], Some(&mut b), false);
        assert_eq!(p, [0.5, 2.5]);
        assert_eq!(b, [7.0, 7.0]);
    }
}
