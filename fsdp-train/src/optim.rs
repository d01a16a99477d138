//! The optimizer of a rank, built from `--optimizer` and its hyper-parameter flags with
//! fsdp-core's public constructors: SGD (momentum, weight decay), AdamW and LAMB (betas, eps,
//! weight decay). Plain SGD (no momentum, no weight decay) keeps no state and steps through
//! [`Fsdp::sgd_step`], as the main job always did.

use fsdp_autograd::nn::Gpt;
use fsdp_core::optim::AdamParams;
use fsdp_core::{AdamW, Fsdp, FsdpError, Lamb, Sgd, ShardedOptimizer};

/// The optimizer `--optimizer` picks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Optimizer {
    /// SGD (momentum and weight decay optional).
    Sgd,
    /// Sharded AdamW.
    AdamW,
    /// Sharded LAMB (Adam moments, per-parameter trust ratio).
    Lamb,
}

/// The hyper-parameters besides the learning rate (`--momentum`, `--beta1`, `--beta2`, `--eps`,
/// `--weight-decay`); each optimizer reads the ones it has.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptimHyper {
    /// SGD momentum μ (0: none).
    pub momentum: f32,
    /// SGD with Nesterov momentum (only with a non-zero momentum).
    pub nesterov: bool,
    /// Adam β1.
    pub beta1: f32,
    /// Adam β2.
    pub beta2: f32,
    /// Adam ε.
    pub eps: f32,
    /// Weight decay λ (SGD: L2 added to the gradient; AdamW: decoupled; LAMB: in the direction).
    pub weight_decay: f32,
}

impl OptimHyper {
    /// The defaults of `kind`: momentum 0, PyTorch's Adam betas (0.9, 0.999) and eps 1e-8,
    /// weight decay 0 for SGD and 0.01 for AdamW and LAMB.
    pub fn defaults(kind: Optimizer) -> OptimHyper {
        let a = AdamParams::new(0.0);
        OptimHyper {
            momentum: 0.0,
            nesterov: false,
            beta1: a.betas.0,
            beta2: a.betas.1,
            eps: a.eps,
            weight_decay: match kind {
                Optimizer::Sgd => 0.0,
                Optimizer::AdamW | Optimizer::Lamb => a.weight_decay,
            },
        }
    }

    fn adam(&self, lr: f32) -> AdamParams {
        AdamParams {
            lr,
            betas: (self.beta1, self.beta2),
            eps: self.eps,
            weight_decay: self.weight_decay,
        }
    }
}

/// A rank's stateful optimizer.
#[derive(Debug)]
pub enum RankOptimizer {
    /// SGD with momentum and/or weight decay.
    Sgd(Sgd),
    /// AdamW.
    AdamW(AdamW),
    /// LAMB.
    Lamb(Lamb),
}

impl RankOptimizer {
    /// The optimizer of `kind` at learning rate `lr`; `None` for plain SGD (stateless, stepped
    /// by [`Fsdp::sgd_step`]).
    pub fn new(kind: Optimizer, lr: f32, h: &OptimHyper) -> Option<RankOptimizer> {
        match kind {
            Optimizer::Sgd if h.momentum == 0.0 && h.weight_decay == 0.0 => None,
            Optimizer::Sgd => Some(RankOptimizer::Sgd(
                Sgd::new(lr)
                    .with_momentum(h.momentum)
                    .with_nesterov(h.nesterov)
                    .with_weight_decay(h.weight_decay),
            )),
            Optimizer::AdamW => Some(RankOptimizer::AdamW(AdamW::with_params(h.adam(lr)))),
            Optimizer::Lamb => Some(RankOptimizer::Lamb(Lamb::new(h.adam(lr)))),
        }
    }

    /// One step at learning rate `lr`, waiting for the optimizer's own collectives (LAMB's
    /// norm all-reduce) so that a failure is reported at this step.
    ///
    /// # Errors
    /// The optimizer's errors.
    pub fn step(&mut self, fsdp: &Fsdp<Gpt>, lr: f32) -> Result<(), FsdpError> {
        match self {
            RankOptimizer::Sgd(o) => {
                o.lr = lr;
                o.step(fsdp)?;
                o.synchronize()
            }
            RankOptimizer::AdamW(o) => {
                o.hyper.lr = lr;
                o.step(fsdp)?;
                o.synchronize()
            }
            RankOptimizer::Lamb(o) => {
                o.hyper.lr = lr;
                o.step(fsdp)?;
                o.synchronize()
            }
        }
    }

    /// As the trait object checkpoints take.
    pub fn as_dyn(&self) -> &dyn ShardedOptimizer {
        match self {
            RankOptimizer::Sgd(o) => o,
            RankOptimizer::AdamW(o) => o,
            RankOptimizer::Lamb(o) => o,
        }
    }

    /// As the mutable trait object checkpoint loading takes.
    pub fn as_dyn_mut(&mut self) -> &mut dyn ShardedOptimizer {
        match self {
            RankOptimizer::Sgd(o) => o,
            RankOptimizer::AdamW(o) => o,
            RankOptimizer::Lamb(o) => o,
        }
    }
}
