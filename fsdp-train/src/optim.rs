//! `--optimizer` and its hyper-parameters, and the rank's optimizer built from them with
//! fsdp-core's public constructors: SGD (momentum, Nesterov, weight decay), AdamW and LAMB
//! (betas, eps, weight decay). The job holds the result as one `Box<dyn ShardedOptimizer>` and
//! asks it for everything else: its name ([`ShardedOptimizer::name`]), the state it keeps
//! ([`ShardedOptimizer::state_slots`]) and the scheduled learning rate
//! ([`ShardedOptimizer::set_lr`]). Plain SGD (no momentum, no weight decay) keeps no state: it
//! is the very update of [`fsdp_core::Fsdp::sgd_step`].
//!
//! Another optimizer here is an [`OptimizerArg`] variant (its `--help` line, default learning
//! rate, weight decay and constructor below) and its flags in `cli::OptimArgs`.

use clap::ValueEnum;
use fsdp_core::optim::AdamParams;
use fsdp_core::{AdamW, Lamb, Sgd, ShardedOptimizer};

/// `--optimizer`. Its `--optimizer` spelling (`sgd`, `adamw`, `lamb`) is part of the checkpoint
/// fingerprint (`ckpt::optimizer_value`), and checkpoints of before issue #37 hold the
/// variant's `Debug` spelling (`Sgd`, `AdamW`, `Lamb`, read back by `ckpt`): renaming either
/// refuses old checkpoints.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimizerArg {
    /// plain SGD (no state)
    Sgd,
    /// AdamW (betas 0.9/0.999, eps 1e-8, weight decay 0.01 unless set)
    #[value(name = "adamw")]
    AdamW,
    /// LAMB: Adam moments with a per-parameter trust ratio ‖p‖/‖u‖
    Lamb,
}

impl OptimizerArg {
    /// The peak learning rate without `--lr`: 0.05 for SGD, 0.001 for AdamW and LAMB.
    pub fn default_lr(self) -> f32 {
        match self {
            OptimizerArg::Sgd => 0.05,
            OptimizerArg::AdamW | OptimizerArg::Lamb => 1e-3,
        }
    }

    /// The optimizer at learning rate `lr` (a schedule then sets each step's with
    /// [`ShardedOptimizer::set_lr`]).
    pub fn build(self, lr: f32, h: &OptimHyper) -> Box<dyn ShardedOptimizer> {
        match self {
            OptimizerArg::Sgd => Box::new(
                Sgd::new(lr)
                    .with_momentum(h.momentum)
                    .with_nesterov(h.nesterov)
                    .with_weight_decay(h.weight_decay),
            ),
            OptimizerArg::AdamW => Box::new(AdamW::with_params(h.adam(lr))),
            OptimizerArg::Lamb => Box::new(Lamb::new(h.adam(lr))),
        }
    }
}

/// The hyper-parameters besides the learning rate (`--momentum`, `--nesterov`, `--beta1`,
/// `--beta2`, `--eps`, `--weight-decay`); each optimizer reads the ones it has.
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
    pub fn defaults(kind: OptimizerArg) -> OptimHyper {
        let a = AdamParams::new(0.0);
        OptimHyper {
            momentum: 0.0,
            nesterov: false,
            beta1: a.betas.0,
            beta2: a.betas.1,
            eps: a.eps,
            weight_decay: match kind {
                OptimizerArg::Sgd => 0.0,
                OptimizerArg::AdamW | OptimizerArg::Lamb => a.weight_decay,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The optimizer names itself and counts its state: nothing here restates either.
    #[test]
    fn built_optimizers_name_themselves_and_their_state() {
        let sgd = OptimHyper::defaults(OptimizerArg::Sgd);
        let momentum = OptimHyper {
            momentum: 0.9,
            ..sgd
        };
        let adam = OptimHyper::defaults(OptimizerArg::AdamW);
        for (kind, h, name, slots) in [
            (OptimizerArg::Sgd, sgd, "SGD", 0),
            (OptimizerArg::Sgd, momentum, "SGD", 1),
            (OptimizerArg::AdamW, adam, "AdamW", 2),
            (OptimizerArg::Lamb, adam, "LAMB", 2),
        ] {
            let o = kind.build(kind.default_lr(), &h);
            assert_eq!((o.name(), o.state_slots()), (name, slots));
            assert_eq!(o.lr(), kind.default_lr());
        }
    }

    /// `--optimizer`'s spellings, and the `Debug` names older checkpoint fingerprints hold.
    #[test]
    fn spellings_and_fingerprint_names_are_stable() {
        for (kind, flag, debug) in [
            (OptimizerArg::Sgd, "sgd", "Sgd"),
            (OptimizerArg::AdamW, "adamw", "AdamW"),
            (OptimizerArg::Lamb, "lamb", "Lamb"),
        ] {
            assert_eq!(OptimizerArg::from_str(flag, false), Ok(kind));
            assert_eq!(format!("{kind:?}"), debug);
        }
    }
}
