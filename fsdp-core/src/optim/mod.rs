//! The optimizer step's wing: sharded optimizers — SGD (momentum, weight decay), AdamW and a
//! LAMB-style trust-ratio optimizer that update FSDP's flat shards in place, with their state
//! sharded exactly like the parameters — and their **local** counterparts for plain
//! [`Parameter`]s; gradient clipping and norms across shards ([`clip`]); the sharded grad scaler
//! ([`scaler`]).
//!
//! # Sharded and local, bit for bit
//! Each rank holds, per FSDP unit, one f32 shard of `chunk_numel` elements and the reduced
//! (summed over ranks) gradient of that shard. A sharded optimizer keeps one state tensor of
//! `chunk_numel` elements per unit and state slot (`"momentum_buffer"`, `"exp_avg"`,
//! `"exp_avg_sq"`), so optimizer memory is divided by the shard-group size like the parameters.
//! Elementwise optimizers need nothing else: element `i` of a shard is updated from element `i`
//! of the gradient and of the state, exactly as the same element of the unsharded parameter would
//! be. [`Sgd`] / [`LocalSgd`] and [`AdamW`] / [`LocalAdamW`] call the very same per-element
//! update rule (same operations in the same order, no fused multiply-add), so FSDP on W ranks
//! with a sharded optimizer equals local training with W-way gradient accumulation and the local
//! optimizer **bitwise** in f32 — the parity tests in `tests/tests/fsdp_optim.rs` check it.
//! [`Lamb`] also needs per-parameter norms across shards (see [`clip`]); those are summed
//! in a different order than locally, so [`Lamb`] matches [`LocalLamb`] within a tolerance only.
//!
//! # Where the math runs
//! Every update is a kernel *launched through the kernel seam*
//! (the ops `fsdp_autograd::kernels::optim::{SgdStep, AdamWStep, LambDirection, LambApply,
//! SumSquares}`) on the device holding the shards — CPU or CUDA — on the model's optimizer
//! stream ([`ShardedParams::optimizer_stream`]: the compute stream, or the host stream under CPU
//! offload) or, for local optimizers, on the parameter device's current stream: the issuing
//! thread returns at once and nothing is read back to the host. The update is **fused**: one
//! launch per unit shard updates the parameters and every state slot (one per contiguous
//! trainable range of the shard; a unit whose parameters are all trainable has one). The CPU
//! kernels are the rules' host updates ([`Rule::update`], the functions of
//! `fsdp_autograd::kernels::optim`); the CUDA kernels repeat their operations in the same
//! order without fused multiply-adds. After all units are updated the optimizer calls
//! [`ShardedParams::params_updated`], so the next all-gather waits for the update.
//!
//! Only the pieces of *trainable* parameters are updated (the layout's per-rank pieces); frozen
//! parameters sharing a unit with trainable ones and the shard's padding are left untouched.
//!
//! # Example
//! ```
//! use std::sync::Arc;
//! use fsdp_alloc::{DType, Device};
//! use fsdp_autograd::{nn::Linear, InitContext, Tensor};
//! use fsdp_collectives::{ProcessGroup, ThreadGroup};
//! use fsdp_core::optim::{AdamW, ShardedOptimizer};
//! use fsdp_core::{Fsdp, FsdpConfig};
//!
//! let dev = Device::cpu(0);
//! let model = Linear::new(&InitContext::eager(&dev, 0), 4, 2, true)?;
//! // One rank here; with W thread ranks every rank runs the same code on its own shard.
//! let pg: Arc<dyn ProcessGroup> = Arc::new(ThreadGroup::new(1).remove(0));
//! let fsdp = Fsdp::wrap(model, &dev, pg, FsdpConfig::default())?;
//! let mut opt = AdamW::new(1e-2).with_weight_decay(0.01);
//! let before = fsdp.local_shards()?;
//! let x = Tensor::ones(&[3, 4], DType::F32, &dev)?;
//! fsdp.forward(&x)?.sum()?.backward()?;
//! opt.step(&fsdp)?;
//! opt.zero_grad(&fsdp);
//! assert_ne!(fsdp.local_shards()?, before);
//! assert_eq!(opt.step_counts(), vec![1]);
//! # Ok::<(), fsdp_core::FsdpError>(())
//! ```
//!
//! # Limitations
//! - FSDP sees one flat gradient per unit: a trainable parameter that took no part in a backward
//!   (an *unused* parameter) has a zero gradient piece, not no gradient, so momentum and weight
//!   decay still move it, where a local optimizer skips a parameter without gradient (PyTorch's
//!   FSDP with flat parameters behaves the same). Step counts are kept per unit, not per
//!   parameter.
//! - LAMB's apply is one launch per parameter piece (the trust ratio differs per parameter);
//!   SGD and AdamW are one launch per unit shard.
//! - [`LocalLamb`] rounds its squared norms to f32 before the trust ratio (as the seam's
//!   `SumSquares` and the sharded [`Lamb`] do); before the seam it used the unrounded f64 sums.
//!
//! # Layout: rules and drivers
//! An optimizer is a [`Rule`] — what it does to one flat f32 tensor given its gradient and its
//! state slots ([`SgdRule`], [`AdamWRule`], [`LambRule`]) — run by a driver: [`Sharded`] over every
//! unit's shard of a wrapped model (for [`ElementwiseRule`]s), [`Local`] over plain parameters.
//! [`Sgd`], [`AdamW`], [`Lamb`], [`LocalSgd`], [`LocalAdamW`] and [`LocalLamb`] are those drivers
//! with their rule; how [`Sharded`] steps is the rule's [`ShardedStep`]: elementwise rules run on
//! the shards' pieces, [`LambRule`] in two halves around the all-reduce of its per-parameter
//! norms. A new elementwise optimizer adds a rule, not a driver. `state` holds the state slots
//! shared by all of them; [`ShardedParams`] (what they, [`clip`] and [`scaler`] need from the
//! model) lives in `sharded.rs`, below all of them.

mod adamw;
pub mod clip;
mod driver;
mod lamb;
mod rule;
pub mod scaler;
mod sgd;
mod sharded;
mod state;

pub use adamw::{AdamCoeffs, AdamParams, AdamW, AdamWRule, LocalAdamW};
pub use driver::{Local, Sharded, ShardedStep};
pub use lamb::{Lamb, LambCoeffs, LambRule, LocalLamb};
pub use rule::{ElementwiseRule, Rule, StepArgs};
pub use sgd::{LocalSgd, Sgd, SgdRule};
pub use state::OptimizerState;

pub use sharded::ShardedParams;

use fsdp_autograd::Parameter;

use crate::error::Result;

/// An optimizer over the flat shards of a wrapped model (see the module docs).
///
/// A training loop can hold any of them as one `Box<dyn ShardedOptimizer>`: the learning rate
/// is set through the trait ([`Self::set_lr`], before each step of a schedule), and the
/// optimizer names itself ([`Self::name`]) and the state it keeps ([`Self::state_slots`]).
pub trait ShardedOptimizer {
    /// The optimizer's name as the literature writes it: `"SGD"`, `"AdamW"`, `"LAMB"`.
    fn name(&self) -> &'static str;

    /// The learning rate of the next step.
    fn lr(&self) -> f32;

    /// Sets the learning rate of the next steps (a schedule calls it before every step).
    fn set_lr(&mut self, lr: f32);

    /// Updates every unit's shard that has a gradient, then calls
    /// [`ShardedParams::params_updated`]. Launches kernels and returns; does not wait.
    ///
    /// # Errors
    /// State that does not fit the model (another model's optimizer), non-f32 or released
    /// tensors, CUDA memory, a failed earlier collective.
    fn step(&mut self, model: &dyn ShardedParams) -> Result<()>;

    /// Waits for the optimizer's own collectives of the last step (LAMB's norm all-reduce;
    /// elementwise optimizers issue none) and reports their errors, so that a failure is
    /// reported at this step rather than at the next. The kernels themselves are not waited for.
    ///
    /// # Errors
    /// A failed collective.
    fn synchronize(&mut self) -> Result<()> {
        Ok(())
    }

    /// Drops the model's sharded gradients.
    fn zero_grad(&self, model: &dyn ShardedParams) {
        model.zero_grad()
    }

    /// Names of the state slots, e.g. `["exp_avg", "exp_avg_sq"]`.
    fn slot_names(&self) -> &'static [&'static str];

    /// How many state tensors per unit this configuration keeps: the number of
    /// [`Self::slot_names`], or 0 when it keeps none (SGD without momentum). Optimizer memory
    /// is `state_slots × 4 × chunk_numel` bytes per unit and rank.
    fn state_slots(&self) -> usize;

    /// The state: per slot, one tensor of `chunk_numel` elements per unit (`None` until the
    /// unit's first step). Handles to the live tensors: read them after the model's
    /// `synchronize()` or on its optimizer stream.
    fn state(&self) -> OptimizerState;

    /// Steps taken per unit (AdamW's bias correction uses it).
    fn step_counts(&self) -> Vec<u64>;

    /// Replaces the state (e.g. from a state dict): every slot of [`Self::slot_names`] with one
    /// entry per unit of `model`, each `None` or a contiguous f32 tensor of the unit's
    /// `chunk_numel` on the shard device; one step count per unit. The tensors are adopted, not
    /// copied.
    ///
    /// # Errors
    /// Missing or unknown slots, wrong counts, sizes, dtypes or devices.
    fn load_state(
        &mut self,
        model: &dyn ShardedParams,
        state: OptimizerState,
        steps: Vec<u64>,
    ) -> Result<()>;
}

/// An optimizer over plain, unsharded [`Parameter`]s (the local counterparts).
pub trait LocalOptimizer {
    /// Updates every parameter that has a gradient (kernels on the device's current stream).
    ///
    /// # Errors
    /// Non-f32 or non-contiguous parameters, released storage, CUDA memory.
    fn step(&mut self) -> Result<()>;

    /// Clears the gradients of all parameters.
    fn zero_grad(&self) {
        for p in self.params() {
            if let Some(t) = p.try_get() {
                t.zero_grad();
            }
        }
    }

    /// The parameters, in the order the state is kept.
    fn params(&self) -> &[Parameter];

    /// Names of the state slots.
    fn slot_names(&self) -> &'static [&'static str];

    /// The state: per slot, one tensor per parameter (flattened, `None` until its first step).
    fn state(&self) -> OptimizerState;

    /// Steps taken per parameter.
    fn step_counts(&self) -> Vec<u64>;

    /// Replaces the state: every slot with one entry per parameter (`None` or a contiguous f32
    /// tensor of the parameter's numel on its device), one step count per parameter.
    ///
    /// # Errors
    /// Missing or unknown slots, wrong counts, sizes, dtypes or devices.
    fn load_state(&mut self, state: OptimizerState, steps: Vec<u64>) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use fsdp_alloc::{DType, Device};
    use fsdp_autograd::{nn::Linear, InitContext, Tensor};
    use fsdp_collectives::{ProcessGroup, ThreadGroup};

    use super::{AdamParams, AdamW, Lamb, Sgd, ShardedOptimizer};
    use crate::{Fsdp, FsdpConfig};

    /// Two steps of `opt` on a one-rank wrapped `Linear(4, 2)`: the final shards' bits.
    fn two_steps(opt: &mut dyn ShardedOptimizer) -> Vec<u32> {
        let dev = Device::cpu(0);
        let model = Linear::new(&InitContext::eager(&dev, 0), 4, 2, true).unwrap();
        let pg: Arc<dyn ProcessGroup> = Arc::new(ThreadGroup::new(1).remove(0));
        let fsdp = Fsdp::wrap(model, &dev, pg, FsdpConfig::default()).unwrap();
        for _ in 0..2 {
            let x = Tensor::ones(&[3, 4], DType::F32, &dev).unwrap();
            fsdp.forward(&x).unwrap().sum().unwrap().backward().unwrap();
            opt.step(&fsdp).unwrap();
            opt.synchronize().unwrap();
            opt.zero_grad(&fsdp);
        }
        let shards = fsdp.local_shards().unwrap();
        shards.concat().into_iter().map(f32::to_bits).collect()
    }

    /// Every optimizer as a trait object: named, its state counted, and `set_lr` is the same
    /// as building it with that learning rate (bit for bit).
    #[test]
    fn set_lr_name_and_state_slots_through_the_trait() {
        fn adam(lr: f32) -> AdamParams {
            AdamParams {
                weight_decay: 0.1,
                ..AdamParams::new(lr)
            }
        }
        type Make = fn(f32) -> Box<dyn ShardedOptimizer>;
        let cases: [(Make, &str, usize); 5] = [
            (|lr| Box::new(Sgd::new(lr)), "SGD", 0),
            (|lr| Box::new(Sgd::new(lr).with_weight_decay(0.1)), "SGD", 0),
            (|lr| Box::new(Sgd::new(lr).with_momentum(0.9)), "SGD", 1),
            (|lr| Box::new(AdamW::with_params(adam(lr))), "AdamW", 2),
            (|lr| Box::new(Lamb::new(adam(lr))), "LAMB", 2),
        ];
        for (make, name, slots) in cases {
            let mut moved = make(0.5);
            assert_eq!((moved.name(), moved.state_slots()), (name, slots));
            moved.set_lr(0.01);
            assert_eq!(moved.lr(), 0.01);
            let direct = two_steps(&mut *make(0.01));
            assert_eq!(two_steps(&mut *moved), direct, "{name}");
            assert_ne!(two_steps(&mut *make(0.5)), direct, "{name}");
        }
    }
}
