//! The two drivers: [`Sharded`] runs an [`ElementwiseRule`] over every unit's shard of a
//! wrapped model (state sharded like the parameters), [`Local`] runs a [`Rule`] over every plain
//! parameter. Both launch one kernel per tensor on the stream where the tensor lives and never
//! wait.

use std::ops::{Deref, DerefMut, Range};

use fsdp_alloc::{Device, Stream};
use fsdp_autograd::kernels::Operand;
use fsdp_autograd::{current_stream, Parameter, Tensor};
use fsdp_collectives::Work;

use super::rule::{ElementwiseRule, Rule, StepArgs};
use super::sharded::{f32_operand, kernels_for, slice_f32, trainable_ranges, ShardedParams};
use super::state::{local_sizes, OptimizerState, Slots};
use super::{LocalOptimizer, ShardedOptimizer};
use crate::error::{ArgumentError, FsdpError, Result};
use crate::runtime::fsdp::UnitShard;

/// What one update writes and reads: the parameter tensor (a unit's shard, or a local
/// parameter), its trainable ranges, its memory and its gradient's memory.
pub(crate) struct UnitOperands {
    pub(crate) tensor: Tensor,
    pub(crate) ranges: Vec<Range<usize>>,
    pub(crate) param: Operand,
    pub(crate) grad: Operand,
}

/// One unit's memory for a sharded step, or `None` if the unit has no gradient or nothing
/// trainable.
///
/// # Errors
/// [`FsdpError::InvalidArgument`] for a gradient of another size than the shard; as
/// [`f32_mem`].
pub(crate) fn unit_operands(
    s: &UnitShard,
    op: &str,
    stream: &Stream,
) -> Result<Option<UnitOperands>> {
    let Some(g) = &s.grad else {
        return Ok(None);
    };
    if g.numel() != s.shard.numel() {
        return Err(FsdpError::InvalidArgument(ArgumentError::Count {
            op: op.into(),
            what: format!("the gradient of unit `{}` (like its shard)", s.path),
            counted: "elements",
            actual: g.numel(),
            expected: s.shard.numel(),
        }));
    }
    let ranges = trainable_ranges(s)?;
    if ranges.is_empty() {
        return Ok(None);
    }
    let param = f32_operand(
        &s.shard,
        op,
        &format!("the shard of unit `{}`", s.path),
        stream,
    )?;
    let grad = f32_operand(g, op, &format!("the gradient of unit `{}`", s.path), stream)?;
    Ok(Some(UnitOperands {
        tensor: s.shard.clone(),
        ranges,
        param,
        grad,
    }))
}

/// One parameter's operands for a local step (the whole tensor is trainable) and the stream it
/// runs on, or `None` if it has no tensor or no gradient.
fn local_operands(p: &Parameter, op: &str) -> Result<Option<(Stream, UnitOperands)>> {
    let Some(t) = p.try_get() else {
        return Ok(None);
    };
    let Some(g) = t.grad() else {
        return Ok(None);
    };
    let g = if g.is_contiguous() {
        g
    } else {
        g.contiguous_copy()?
    };
    if g.numel() != t.numel() {
        return Err(FsdpError::InvalidArgument(ArgumentError::Count {
            op: op.into(),
            what: format!(
                "the gradient of parameter `{}` (like the parameter)",
                p.name()
            ),
            counted: "elements",
            actual: g.numel(),
            expected: t.numel(),
        }));
    }
    let stream = current_stream(t.device());
    let param = f32_operand(&t, op, &format!("parameter `{}`", p.name()), &stream)?;
    let grad = f32_operand(&g, op, &format!("the gradient of `{}`", p.name()), &stream)?;
    let o = UnitOperands {
        ranges: std::iter::once(0..t.numel()).collect(),
        tensor: t,
        param,
        grad,
    };
    Ok(Some((stream, o)))
}

/// The state of entry `i` (`n` elements) for a kernel on `stream`: every slot's memory (none
/// when `keeps_state` is false), created as zeros where missing, and whether any was created.
pub(crate) fn state_operands(
    slots: &mut Slots,
    keeps_state: bool,
    i: usize,
    n: usize,
    device: &Device,
    stream: &Stream,
    op: &str,
) -> Result<(Vec<Tensor>, Vec<Operand>, bool)> {
    let (mut tensors, mut mems, mut fresh) = (Vec::new(), Vec::new(), false);
    if keeps_state {
        for slot in 0..slots.names.len() {
            let (t, created) = slots.tensor(slot, i, n, device, stream)?;
            mems.push(f32_operand(&t, op, slots.names[slot], stream)?);
            fresh |= created;
            tensors.push(t);
        }
    }
    Ok((tensors, mems, fresh))
}

/// Launches the rule's fused kernel through the seam on each of `ranges` of the parameter,
/// gradient and state operands: one launch per range, all state slots at once (a unit whose
/// parameters are all trainable has one range, so one launch per unit shard).
#[allow(clippy::too_many_arguments)]
fn launch_rule<R: Rule>(
    device: &Device,
    stream: &Stream,
    c: R::Coeffs,
    ranges: &[Range<usize>],
    param: &Operand,
    grad: &Operand,
    state: &[Operand],
    fresh: bool,
) -> Result<()> {
    let kernels = kernels_for(device)?;
    for r in ranges {
        let p = slice_f32(param, r.clone())?;
        let g = slice_f32(grad, r.clone())?;
        let st = state
            .iter()
            .map(|s| slice_f32(s, r.clone()))
            .collect::<Result<Vec<_>>>()?;
        let a = StepArgs {
            device,
            kernels: &kernels,
            stream,
            p: &p,
            g: &g,
            state: &st,
            fresh,
        };
        R::launch(&c, &a)?;
    }
    Ok(())
}

/// One update of entry `i` (a unit or a parameter) by `rule`: creates the entry's state on
/// `device` where missing, counts the step, launches the kernel on `stream` and marks the
/// parameter and state tensors as written.
fn step_entry<R: Rule>(
    rule: &R,
    slots: &mut Slots,
    i: usize,
    o: UnitOperands,
    device: &Device,
    stream: &Stream,
    op: &str,
) -> Result<()> {
    let n = o.tensor.numel();
    let (state, mems, fresh) = state_operands(slots, rule.keeps_state(), i, n, device, stream, op)?;
    slots.steps[i] += 1;
    let c = rule.coeffs(slots.steps[i]);
    launch_rule::<R>(
        device, stream, c, &o.ranges, &o.param, &o.grad, &mems, fresh,
    )?;
    o.tensor.storage().bump_version();
    bump(&state);
    Ok(())
}

/// Marks the state tensors of a launched update as written.
fn bump(tensors: &[Tensor]) {
    for t in tensors {
        t.storage().bump_version();
    }
}

/// Both drivers read and write their rule's hyper-parameters through themselves (`opt.lr`).
macro_rules! deref_to_rule {
    ($($driver:ident),*) => {$(
        impl<R> Deref for $driver<R> {
            type Target = R;
            fn deref(&self) -> &R {
                &self.rule
            }
        }

        impl<R> DerefMut for $driver<R> {
            fn deref_mut(&mut self) -> &mut R {
                &mut self.rule
            }
        }
    )*};
}

deref_to_rule!(Sharded, Local);

/// The optimizer-trait methods both drivers answer from their rule's slot names and their
/// [`Slots`] alone (inside `impl ShardedOptimizer` and `impl LocalOptimizer`).
macro_rules! slot_methods {
    () => {
        fn slot_names(&self) -> &'static [&'static str] {
            R::SLOTS
        }

        fn state(&self) -> OptimizerState {
            self.slots.export()
        }

        fn step_counts(&self) -> Vec<u64> {
            self.slots.steps.clone()
        }
    };
}

// ============================================================================ sharded

/// The sharded driver: an [`ElementwiseRule`] applied to the trainable pieces of every unit's
/// flat shard, with one state tensor of `chunk_numel` elements per unit and slot (optimizer
/// memory divided by the shard-group size like the parameters). [`super::Sgd`] and
/// [`super::AdamW`] are this driver with their rule. The rule's hyper-parameters read and write
/// through the driver (`opt.lr`, `opt.hyper`).
#[derive(Debug)]
pub struct Sharded<R> {
    pub(crate) rule: R,
    pub(crate) slots: Slots,
    /// The optimizer's own collectives of the previous step (LAMB's norm all-reduce), checked
    /// at the next step.
    pub(crate) pending: Vec<Work>,
}

impl<R: Rule> Sharded<R> {
    /// A sharded optimizer running `rule`; its state is sized at the first step.
    pub fn from_rule(rule: R) -> Sharded<R> {
        Sharded {
            rule,
            slots: Slots::new(R::SLOTS),
            pending: Vec::new(),
        }
    }
}

impl<R> Sharded<R> {
    /// Waits for this optimizer's own collectives (LAMB's norm all-reduce; elementwise rules
    /// issue none) and reports their errors.
    ///
    /// # Errors
    /// A failed all-reduce.
    pub fn synchronize(&mut self) -> Result<()> {
        for w in self.pending.drain(..) {
            w.wait()?;
        }
        Ok(())
    }
}

/// A clone shares the state tensors' handles (like a clone of the state) and has no pending
/// collectives.
impl<R: Clone> Clone for Sharded<R> {
    fn clone(&self) -> Sharded<R> {
        Sharded {
            rule: self.rule.clone(),
            slots: self.slots.clone(),
            pending: Vec::new(),
        }
    }
}

/// How [`Sharded`] steps with a rule: every [`ElementwiseRule`] on the trainable pieces of the
/// shards, and [`super::LambRule`] in two halves around the all-reduce of its norms.
pub trait ShardedStep: Rule + Sized {
    /// One step of `opt` over `model`'s shards.
    ///
    /// # Errors
    /// As [`ShardedOptimizer::step`].
    fn sharded_step(opt: &mut Sharded<Self>, model: &dyn ShardedParams) -> Result<()>;
}

impl<R: ElementwiseRule> ShardedStep for R {
    fn sharded_step(opt: &mut Sharded<R>, model: &dyn ShardedParams) -> Result<()> {
        let op = format!("{}::step", R::NAME);
        opt.rule.check(&op)?;
        let shards = model.shards();
        opt.slots.ensure(shards.len(), &op)?;
        let stream = model.optimizer_stream().clone();
        let dev = model.shard_device();
        for (u, s) in shards.iter().enumerate() {
            if let Some(o) = unit_operands(s, &op, &stream)? {
                step_entry(&opt.rule, &mut opt.slots, u, o, dev, &stream, &op)?;
            }
        }
        model.params_updated();
        Ok(())
    }
}

impl<R: ShardedStep> ShardedOptimizer for Sharded<R> {
    fn name(&self) -> &'static str {
        R::TITLE
    }

    fn lr(&self) -> f32 {
        self.rule.lr()
    }

    fn set_lr(&mut self, lr: f32) {
        self.rule.set_lr(lr);
    }

    fn step(&mut self, model: &dyn ShardedParams) -> Result<()> {
        Sharded::synchronize(self)?;
        R::sharded_step(self, model)
    }

    fn synchronize(&mut self) -> Result<()> {
        Sharded::synchronize(self)
    }

    fn state_slots(&self) -> usize {
        if self.rule.keeps_state() {
            R::SLOTS.len()
        } else {
            0
        }
    }

    slot_methods!();

    fn load_state(
        &mut self,
        model: &dyn ShardedParams,
        state: OptimizerState,
        steps: Vec<u64>,
    ) -> Result<()> {
        let op = format!("{}::load_state", R::NAME);
        let numel: Vec<usize> = model.shards().iter().map(|s| s.shard.numel()).collect();
        self.slots
            .import(&op, state, steps, &numel, model.shard_device())
    }
}

// ============================================================================ local

/// The local driver: a [`Rule`] applied to every plain [`Parameter`] that has a gradient, with
/// one state tensor per parameter and slot, on the parameter device's current stream.
/// [`super::LocalSgd`], [`super::LocalAdamW`] and [`super::LocalLamb`] are this driver with
/// their rule — the parity references for the sharded optimizers.
#[derive(Debug, Clone)]
pub struct Local<R> {
    params: Vec<Parameter>,
    rule: R,
    slots: Slots,
}

impl<R: Rule> Local<R> {
    /// A local optimizer running `rule` over `params`.
    pub fn from_rule(params: Vec<Parameter>, rule: R) -> Local<R> {
        let slots = Slots::sized(R::SLOTS, params.len());
        Local {
            params,
            rule,
            slots,
        }
    }
}

impl<R: Rule> LocalOptimizer for Local<R> {
    fn step(&mut self) -> Result<()> {
        let op = format!("Local{}::step", R::NAME);
        self.rule.check(&op)?;
        for (i, p) in self.params.iter().enumerate() {
            if let Some((stream, o)) = local_operands(p, &op)? {
                let device = o.tensor.device().clone();
                step_entry(&self.rule, &mut self.slots, i, o, &device, &stream, &op)?;
            }
        }
        Ok(())
    }

    fn params(&self) -> &[Parameter] {
        &self.params
    }

    slot_methods!();

    fn load_state(&mut self, state: OptimizerState, steps: Vec<u64>) -> Result<()> {
        let op = format!("Local{}::load_state", R::NAME);
        let (numel, device) = local_sizes(&self.params, &op)?;
        self.slots.import(&op, state, steps, &numel, &device)
    }
}
