//! Sharded optimizers: SGD (momentum, weight decay), AdamW and a LAMB-style trust-ratio
//! optimizer that update FSDP's flat shards in place, with their state sharded exactly like the
//! parameters — and their **local** counterparts for plain [`Parameter`]s.
//!
//! # Sharded and local, bit for bit
//! Each rank holds, per FSDP unit, one f32 shard of `chunk_numel` elements and the reduced
//! (summed over ranks) gradient of that shard. A sharded optimizer keeps one state tensor of
//! `chunk_numel` elements per unit and state slot (`"momentum_buffer"`, `"exp_avg"`,
//! `"exp_avg_sq"`), so optimizer memory is divided by the shard-group size like the parameters.
//! Elementwise optimizers need nothing else: element `i` of a shard is updated from element `i`
//! of the gradient and of the state, exactly as the same element of the unsharded parameter would
//! be. [`Sgd`] / [`LocalSgd`] and [`AdamW`] / [`LocalAdamW`] call the very same per-element
//! kernel functions (same operations in the same order, no fused multiply-add), so FSDP on W ranks
//! with a sharded optimizer equals local training with W-way gradient accumulation and the local
//! optimizer **bitwise** in f32 — the parity tests in `tests/tests/fsdp_optim.rs` check it.
//! [`Lamb`] also needs per-parameter norms across shards (see [`crate::clip`]); those are summed
//! in a different order than locally, so [`Lamb`] matches [`LocalLamb`] within a tolerance only.
//!
//! # Where the math runs
//! Every update is a kernel *launched* on the model's optimizer stream
//! ([`ShardedParams::optimizer_stream`]: the compute stream, or the host stream under CPU
//! offload) or, for local optimizers, on the parameter device's current stream: the issuing
//! thread returns at once and nothing is read back to the host. After all units are updated the
//! optimizer calls [`ShardedParams::params_updated`], so the next all-gather waits for the update.
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
//! - Kernels run on host-accessible memory (CPU devices); on a CUDA device the step returns an
//!   error instead of launching (there are no device kernels for the optimizers yet).

use std::ops::Range;
use std::sync::Arc;

use fsdp_alloc::{BufferRef, DType, Device, Stream};
use fsdp_autograd::nn::Module;
use fsdp_autograd::{current_stream, with_stream, Parameter, Tensor};
use fsdp_collectives::{ProcessGroup, Work};

use crate::error::{FsdpError, Result};
use crate::fsdp::{Fsdp, UnitShard};

// ============================================================================ the model side

/// What sharded optimizers, gradient clipping and grad scalers need from a wrapped model.
/// Implemented by [`Fsdp`]; passing `&fsdp` where a `&dyn ShardedParams` is expected just works.
pub trait ShardedParams {
    /// Every unit's shard, gradient and layout on this rank (see [`UnitShard`]).
    fn shards(&self) -> Vec<UnitShard>;
    /// Replaces unit `unit`'s sharded gradient (`None` drops it).
    ///
    /// # Errors
    /// An unknown unit or a gradient of the wrong size.
    fn set_shard_grad(&self, unit: usize, grad: Option<Tensor>) -> Result<()>;
    /// Records that the shards were updated on the optimizer stream (the next all-gather waits).
    fn params_updated(&self);
    /// The stream optimizer work is launched on (where the shards and gradients live).
    fn optimizer_stream(&self) -> &Stream;
    /// The device holding the shards and sharded gradients.
    fn shard_device(&self) -> &Device;
    /// The group the parameters are sharded over.
    fn shard_group(&self) -> &Arc<dyn ProcessGroup>;
    /// For hybrid sharding, the group of replicas of this rank's shard.
    fn replicate_group(&self) -> Option<&Arc<dyn ProcessGroup>>;
    /// False when every rank holds the whole parameters (`NoShard`): then a rank's "shard" is
    /// the full flat parameter and nothing must be summed across ranks.
    fn is_sharded(&self) -> bool;
    /// Drops the sharded gradients.
    fn zero_grad(&self);
}

impl<M: Module + 'static> ShardedParams for Fsdp<M> {
    fn shards(&self) -> Vec<UnitShard> {
        Fsdp::shards(self)
    }
    fn set_shard_grad(&self, unit: usize, grad: Option<Tensor>) -> Result<()> {
        Fsdp::set_shard_grad(self, unit, grad)
    }
    fn params_updated(&self) {
        Fsdp::params_updated(self)
    }
    fn optimizer_stream(&self) -> &Stream {
        Fsdp::optimizer_stream(self)
    }
    fn shard_device(&self) -> &Device {
        Fsdp::shard_device(self)
    }
    fn shard_group(&self) -> &Arc<dyn ProcessGroup> {
        Fsdp::shard_group(self)
    }
    fn replicate_group(&self) -> Option<&Arc<dyn ProcessGroup>> {
        Fsdp::replicate_group(self)
    }
    fn is_sharded(&self) -> bool {
        self.config().strategy.is_sharded()
    }
    fn zero_grad(&self) {
        Fsdp::zero_grad(self)
    }
}

// ============================================================================ kernels

/// The memory of a contiguous f32 tensor for a kernel launched on `stream`. Records `stream` on
/// the tensor's buffer when it was allocated on another stream (e.g. a gradient produced on the
/// reduce stream), so the allocator does not hand the memory out again before the kernel ran.
pub(crate) fn f32_mem(t: &Tensor, op: &str, what: &str, stream: &Stream) -> Result<BufferRef> {
    if t.dtype() != DType::F32 {
        return Err(FsdpError::Config(format!(
            "{op}: {what} is {}, but optimizer, clipping and scaler kernels work on f32 tensors \
             (FSDP keeps shards, sharded gradients and optimizer state in f32)",
            t.dtype()
        )));
    }
    if !t.is_contiguous() {
        return Err(FsdpError::Config(format!(
            "{op}: {what} is not contiguous (shape {:?}, strides {:?}); pass a contiguous copy",
            t.shape(),
            t.strides()
        )));
    }
    if t.device().id() != stream.device() {
        return Err(FsdpError::Config(format!(
            "{op}: {what} lives on {} but the kernel runs on stream `{}` of {}; keep tensors \
             and streams on one device",
            t.device().id(),
            stream.name(),
            stream.device()
        )));
    }
    let r = t
        .storage()
        .with_buffer(|b| {
            if b.stream() != stream {
                b.record_stream(stream);
            }
            b.data().clone()
        })
        .ok_or_else(|| {
            FsdpError::Config(format!(
                "{op}: {what} has no memory attached (its storage was released)"
            ))
        })?;
    if r.device_ptr().is_some() {
        return Err(FsdpError::Config(format!(
            "{op}: {what} is CUDA device memory; the optimizer, clipping and scaler kernels of \
             fsdp-core run on host-accessible (CPU) memory only — use CPU devices or CPU offload"
        )));
    }
    Ok(r.slice_elems::<f32>(t.offset(), t.numel())?)
}

/// Launches `f` on `stream` with shared access to `reads` and exclusive access to `writes`
/// (f32 ranges). Access conflicts cannot happen for ranges checked at launch time; if one did,
/// the stream fails (like an asynchronous device error) and reports it at the next
/// synchronization.
pub(crate) fn launch_f32(
    stream: &Stream,
    op: &'static str,
    reads: Vec<BufferRef>,
    writes: Vec<BufferRef>,
    f: impl FnOnce(&[&[f32]], &mut [&mut [f32]]) + Send + 'static,
) {
    stream.launch_named(op, move || {
        let rg: Vec<_> = reads
            .iter()
            .map(|r| {
                r.read::<f32>()
                    .unwrap_or_else(|e| panic!("kernel `{op}` failed: {e}"))
            })
            .collect();
        let mut wg: Vec<_> = writes
            .iter()
            .map(|w| {
                w.write::<f32>()
                    .unwrap_or_else(|e| panic!("kernel `{op}` failed: {e}"))
            })
            .collect();
        let rs: Vec<&[f32]> = rg.iter().map(|g| &**g).collect();
        let mut ws: Vec<&mut [f32]> = wg.iter_mut().map(|g| &mut **g).collect();
        f(&rs, &mut ws);
    });
}

/// The element ranges of `s.shard` holding trainable parameters, merged where adjacent.
pub(crate) fn trainable_ranges(s: &UnitShard) -> Result<Vec<Range<usize>>> {
    if s.requires_grad.len() != s.layout.num_params() {
        return Err(FsdpError::Config(format!(
            "unit `{}`: {} requires_grad flags for {} parameters",
            s.path,
            s.requires_grad.len(),
            s.layout.num_params()
        )));
    }
    let mut out: Vec<Range<usize>> = Vec::new();
    for p in s.layout.rank_pieces(s.rank)? {
        if !s.requires_grad[p.param_index] {
            continue;
        }
        let r = p.shard_range();
        match out.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => out.push(r),
        }
    }
    Ok(out)
}

/// A state tensor of `n` zeros, allocated on `stream` of `device`.
pub(crate) fn zeros_on(n: usize, device: &Device, stream: &Stream) -> Result<Tensor> {
    Ok(with_stream(stream, || {
        Tensor::zeros(&[n], DType::F32, device)
    })?)
}

/// SGD hyper-parameters as the kernel sees them.
#[derive(Clone, Copy, Debug)]
struct SgdCoeffs {
    neg_lr: f32,
    momentum: f32,
    weight_decay: f32,
}

/// One SGD update (PyTorch's formulation, no dampening, no Nesterov), element by element:
/// `d = g + λ·p`; with momentum `b = d` on the first step, else `b = μ·b + d`, and `d = b`;
/// then `p = p + (−lr)·d`. The same operations as `fsdp_autograd::optim::Sgd`.
fn sgd_kernel(p: &mut [f32], g: &[f32], buf: Option<&mut [f32]>, first: bool, c: SgdCoeffs) {
    match buf {
        Some(b) => {
            for ((p, &g), b) in p.iter_mut().zip(g).zip(b.iter_mut()) {
                let mut d = g;
                if c.weight_decay != 0.0 {
                    d += c.weight_decay * *p;
                }
                *b = if first { d } else { c.momentum * *b + d };
                *p += c.neg_lr * *b;
            }
        }
        None => {
            for (p, &g) in p.iter_mut().zip(g) {
                let mut d = g;
                if c.weight_decay != 0.0 {
                    d += c.weight_decay * *p;
                }
                *p += c.neg_lr * d;
            }
        }
    }
}

/// AdamW hyper-parameters for one step `t`, as the kernel sees them (scalars computed in f64,
/// rounded to f32 once).
#[derive(Clone, Copy, Debug)]
struct AdamCoeffs {
    decay: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    neg_step_size: f32,
    bc2_sqrt: f32,
    eps: f32,
}

impl AdamCoeffs {
    fn new(lr: f32, betas: (f32, f32), eps: f32, weight_decay: f32, step: u64) -> AdamCoeffs {
        let (b1, b2) = (betas.0 as f64, betas.1 as f64);
        let t = step as f64;
        let bc1 = 1.0 - b1.powf(t);
        let bc2 = 1.0 - b2.powf(t);
        AdamCoeffs {
            decay: (1.0 - lr as f64 * weight_decay as f64) as f32,
            one_minus_beta1: (1.0 - b1) as f32,
            beta2: betas.1,
            one_minus_beta2: (1.0 - b2) as f32,
            neg_step_size: (-(lr as f64) / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps,
        }
    }
}

/// The Adam moment updates shared by AdamW and LAMB:
/// `m = m + (1−β1)·(g − m)`, `v = β2·v + (1−β2)·(g·g)`; returns the new (m, v).
#[inline(always)]
fn moments(g: f32, m: &mut f32, v: &mut f32, c: &AdamCoeffs) -> (f32, f32) {
    *m += c.one_minus_beta1 * (g - *m);
    *v = c.beta2 * *v + c.one_minus_beta2 * (g * g);
    (*m, *v)
}

/// One AdamW update (PyTorch's single-tensor algorithm), element by element:
/// `p = p·(1 − lr·λ)`, moments as [`moments`], `denom = √v / √(1−β2ᵗ) + ε`,
/// `p = p + (−lr/(1−β1ᵗ))·(m / denom)`.
fn adamw_kernel(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: AdamCoeffs) {
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let decayed = *p * c.decay;
        let (m, v) = moments(g, m, v, &c);
        let denom = v.sqrt() / c.bc2_sqrt + c.eps;
        *p = decayed + c.neg_step_size * (m / denom);
    }
}

/// LAMB phase 1, element by element: moments as [`moments`], then the update direction
/// `u = m̂ / (√v̂ + ε) + λ·p` with `m̂ = m / (1−β1ᵗ)`, `v̂ = v / (1−β2ᵗ)` (written to `u`).
fn lamb_direction_kernel(
    p: &[f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    u: &mut [f32],
    c: LambCoeffs,
) {
    for ((((&p, &g), m), v), u) in p
        .iter()
        .zip(g)
        .zip(m.iter_mut())
        .zip(v.iter_mut())
        .zip(u.iter_mut())
    {
        let (m, v) = moments(g, m, v, &c.adam);
        let m_hat = m / c.bc1;
        let v_hat = v / c.bc2;
        *u = m_hat / (v_hat.sqrt() + c.adam.eps) + c.weight_decay * p;
    }
}

/// LAMB phase 2, element by element: `p = p + a·u` with `a = −lr·ratio` for the parameter.
fn lamb_apply_kernel(p: &mut [f32], u: &[f32], a: f32) {
    for (p, &u) in p.iter_mut().zip(u) {
        *p += a * u;
    }
}

/// The trust ratio `‖w‖ / ‖u‖` from the squared norms (1 if either norm is 0 or not finite).
pub(crate) fn trust_ratio(w_sq: f64, u_sq: f64) -> f32 {
    let (w, u) = (w_sq.sqrt(), u_sq.sqrt());
    if w > 0.0 && u > 0.0 && w.is_finite() && u.is_finite() {
        (w / u) as f32
    } else {
        1.0
    }
}

#[derive(Clone, Copy, Debug)]
struct LambCoeffs {
    adam: AdamCoeffs,
    bc1: f32,
    bc2: f32,
    weight_decay: f32,
}

impl LambCoeffs {
    fn new(betas: (f32, f32), eps: f32, weight_decay: f32, step: u64) -> LambCoeffs {
        let t = step as f64;
        LambCoeffs {
            adam: AdamCoeffs::new(0.0, betas, eps, 0.0, step),
            bc1: (1.0 - (betas.0 as f64).powf(t)) as f32,
            bc2: (1.0 - (betas.1 as f64).powf(t)) as f32,
            weight_decay,
        }
    }
}

// ============================================================================ state

/// Optimizer state by slot: `(slot name, one tensor per unit (sharded) or per parameter
/// (local), `None` where no step has created it yet)`.
pub type OptimizerState = Vec<(String, Vec<Option<Tensor>>)>;

/// State slots plus step counts, shared by all optimizers here.
#[derive(Debug, Clone)]
struct Slots {
    names: &'static [&'static str],
    /// `tensors[slot][unit or parameter]`.
    tensors: Vec<Vec<Option<Tensor>>>,
    steps: Vec<u64>,
}

impl Slots {
    fn new(names: &'static [&'static str]) -> Slots {
        Slots {
            names,
            tensors: vec![Vec::new(); names.len()],
            steps: Vec::new(),
        }
    }

    /// Slots for `n` parameters, known up front (local optimizers).
    fn sized(names: &'static [&'static str], n: usize) -> Slots {
        Slots {
            names,
            tensors: vec![vec![None; n]; names.len()],
            steps: vec![0; n],
        }
    }

    /// Sizes the state for `n` units on first use; afterwards `n` must not change.
    fn ensure(&mut self, n: usize, op: &str) -> Result<()> {
        if self.steps.is_empty() && self.tensors.iter().all(|t| t.is_empty()) {
            self.steps = vec![0; n];
            for t in &mut self.tensors {
                *t = vec![None; n];
            }
        }
        if self.steps.len() != n {
            return Err(FsdpError::Config(format!(
                "{op}: the optimizer holds state for {} units/parameters but the model has {n}; \
                 use one optimizer per wrapped model",
                self.steps.len()
            )));
        }
        Ok(())
    }

    fn export(&self) -> OptimizerState {
        self.names
            .iter()
            .zip(&self.tensors)
            .map(|(n, t)| (n.to_string(), t.clone()))
            .collect()
    }

    /// Validates and adopts `state`; `numel[i]` is the required size of entry `i`.
    fn import(
        &mut self,
        op: &str,
        mut state: OptimizerState,
        steps: Vec<u64>,
        numel: &[usize],
        device: &Device,
    ) -> Result<()> {
        let n = numel.len();
        if steps.len() != n {
            return Err(FsdpError::Config(format!(
                "{op}: {} step counts for {n} units/parameters",
                steps.len()
            )));
        }
        let mut got: Vec<&str> = state.iter().map(|(s, _)| s.as_str()).collect();
        got.sort_unstable();
        let mut want: Vec<&str> = self.names.to_vec();
        want.sort_unstable();
        if got != want {
            return Err(FsdpError::Config(format!(
                "{op}: state slots {got:?}, but this optimizer keeps {want:?}"
            )));
        }
        let mut tensors = Vec::with_capacity(self.names.len());
        for name in self.names {
            let i = state
                .iter()
                .position(|(s, _)| s == name)
                .expect("slot names checked above");
            let (_, per) = state.swap_remove(i);
            if per.len() != n {
                return Err(FsdpError::Config(format!(
                    "{op}: slot `{name}` has {} entries for {n} units/parameters",
                    per.len()
                )));
            }
            for (j, (t, &want)) in per.iter().zip(numel).enumerate() {
                let Some(t) = t else { continue };
                if t.numel() != want || t.dtype() != DType::F32 || !t.is_contiguous() {
                    return Err(FsdpError::Config(format!(
                        "{op}: slot `{name}` entry {j} is a {} tensor of {} elements \
                         (contiguous: {}); expected a contiguous f32 tensor of {want}",
                        t.dtype(),
                        t.numel(),
                        t.is_contiguous()
                    )));
                }
                if t.device().id() != device.id() {
                    return Err(FsdpError::Config(format!(
                        "{op}: slot `{name}` entry {j} lives on {}, the parameters on {}",
                        t.device().id(),
                        device.id()
                    )));
                }
            }
            tensors.push(per);
        }
        self.tensors = tensors;
        self.steps = steps;
        Ok(())
    }
}

/// Checks a learning-rate-like hyper-parameter.
fn check_finite(op: &str, what: &str, v: f32) -> Result<()> {
    if v.is_finite() {
        Ok(())
    } else {
        Err(FsdpError::Config(format!(
            "{op}: {what} is {v}; it must be finite"
        )))
    }
}

fn check_betas(op: &str, betas: (f32, f32), eps: f32) -> Result<()> {
    for (what, b) in [("beta1", betas.0), ("beta2", betas.1)] {
        if !(0.0..1.0).contains(&b) {
            return Err(FsdpError::Config(format!(
                "{op}: {what} is {b}; it must lie in [0, 1)"
            )));
        }
    }
    if !(eps.is_finite() && eps > 0.0) {
        return Err(FsdpError::Config(format!(
            "{op}: eps is {eps}; it must be positive and finite"
        )));
    }
    Ok(())
}

// ============================================================================ traits

/// An optimizer over the flat shards of a wrapped model (see the module docs).
pub trait ShardedOptimizer {
    /// Updates every unit's shard that has a gradient, then calls
    /// [`ShardedParams::params_updated`]. Launches kernels and returns; does not wait.
    ///
    /// # Errors
    /// State that does not fit the model (another model's optimizer), non-f32 or released
    /// tensors, CUDA memory, a failed earlier collective.
    fn step(&mut self, model: &dyn ShardedParams) -> Result<()>;

    /// Drops the model's sharded gradients.
    fn zero_grad(&self, model: &dyn ShardedParams) {
        model.zero_grad()
    }

    /// Names of the state slots, e.g. `["exp_avg", "exp_avg_sq"]`.
    fn slot_names(&self) -> &'static [&'static str];

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

/// One parameter's tensors for a local step: (stream, param memory, grad memory, numel), or
/// `None` if it has no tensor or no gradient.
fn local_operands(
    p: &Parameter,
    op: &str,
) -> Result<Option<(Stream, Tensor, BufferRef, BufferRef)>> {
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
        return Err(FsdpError::Config(format!(
            "{op}: parameter `{}` has {} elements but its gradient {}",
            p.name(),
            t.numel(),
            g.numel()
        )));
    }
    let stream = current_stream(t.device());
    let pm = f32_mem(&t, op, &format!("parameter `{}`", p.name()), &stream)?;
    let gm = f32_mem(&g, op, &format!("the gradient of `{}`", p.name()), &stream)?;
    Ok(Some((stream, t, pm, gm)))
}

/// A unit's trainable ranges, shard memory and gradient memory.
type UnitOperands = (Vec<Range<usize>>, BufferRef, BufferRef);

/// One unit's tensors for a sharded step: (trainable ranges, shard memory, grad memory), or
/// `None` if the unit has no gradient or nothing trainable.
fn unit_operands(s: &UnitShard, op: &str, stream: &Stream) -> Result<Option<UnitOperands>> {
    let Some(g) = &s.grad else {
        return Ok(None);
    };
    if g.numel() != s.shard.numel() {
        return Err(FsdpError::Config(format!(
            "{op}: unit `{}` has a shard of {} elements but a gradient of {}",
            s.path,
            s.shard.numel(),
            g.numel()
        )));
    }
    let ranges = trainable_ranges(s)?;
    if ranges.is_empty() {
        return Ok(None);
    }
    let pm = f32_mem(
        &s.shard,
        op,
        &format!("the shard of unit `{}`", s.path),
        stream,
    )?;
    let gm = f32_mem(g, op, &format!("the gradient of unit `{}`", s.path), stream)?;
    Ok(Some((ranges, pm, gm)))
}

/// The state tensor `slots.tensors[slot][i]`, created as zeros of `n` elements if missing.
/// Returns (tensor, created).
fn state_tensor(
    slots: &mut Slots,
    slot: usize,
    i: usize,
    n: usize,
    device: &Device,
    stream: &Stream,
) -> Result<(Tensor, bool)> {
    match &slots.tensors[slot][i] {
        Some(t) if t.numel() == n => Ok((t.clone(), false)),
        Some(t) => Err(FsdpError::Config(format!(
            "optimizer slot `{}` entry {i} has {} elements, the parameters {n}; the state does \
             not belong to this model",
            slots.names[slot],
            t.numel()
        ))),
        None => {
            let t = zeros_on(n, device, stream)?;
            slots.tensors[slot][i] = Some(t.clone());
            Ok((t, true))
        }
    }
}

/// The state accessors every [`ShardedOptimizer`] here shares (its state lives in `self.slots`,
/// one entry per unit).
macro_rules! sharded_state_methods {
    ($slots:expr, $op:literal) => {
        fn slot_names(&self) -> &'static [&'static str] {
            $slots
        }

        fn state(&self) -> OptimizerState {
            self.slots.export()
        }

        fn step_counts(&self) -> Vec<u64> {
            self.slots.steps.clone()
        }

        fn load_state(
            &mut self,
            model: &dyn ShardedParams,
            state: OptimizerState,
            steps: Vec<u64>,
        ) -> Result<()> {
            let numel: Vec<usize> = model.shards().iter().map(|s| s.shard.numel()).collect();
            self.slots
                .import($op, state, steps, &numel, model.shard_device())
        }
    };
}

/// The accessors every [`LocalOptimizer`] here shares (`self.params`, state in `self.slots`,
/// one entry per parameter).
macro_rules! local_state_methods {
    ($slots:expr, $op:literal) => {
        fn params(&self) -> &[Parameter] {
            &self.params
        }

        fn slot_names(&self) -> &'static [&'static str] {
            $slots
        }

        fn state(&self) -> OptimizerState {
            self.slots.export()
        }

        fn step_counts(&self) -> Vec<u64> {
            self.slots.steps.clone()
        }

        fn load_state(&mut self, state: OptimizerState, steps: Vec<u64>) -> Result<()> {
            let (numel, device) = local_sizes(&self.params, $op)?;
            self.slots.import($op, state, steps, &numel, &device)
        }
    };
}

// ============================================================================ SGD

const SGD_SLOTS: &[&str] = &["momentum_buffer"];

fn sgd_coeffs(op: &str, lr: f32, momentum: f32, weight_decay: f32) -> Result<SgdCoeffs> {
    check_finite(op, "lr", lr)?;
    check_finite(op, "momentum", momentum)?;
    check_finite(op, "weight_decay", weight_decay)?;
    Ok(SgdCoeffs {
        neg_lr: -lr,
        momentum,
        weight_decay,
    })
}

/// Sharded SGD with momentum and weight decay: `d = g + λ·p`, `b = μ·b + d` (`b = d` on the first
/// step), `p −= lr·b` — on each unit's shard, with one momentum buffer of `chunk_numel` per unit.
/// With `momentum == 0` and `weight_decay == 0` this is exactly [`Fsdp::sgd_step`].
///
/// See the [module docs](self) for an example (`AdamW` there; `Sgd` is used the same way).
#[derive(Debug, Clone)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f32,
    /// Momentum factor μ (0 disables momentum and its state).
    pub momentum: f32,
    /// Weight decay λ (L2, added to the gradient).
    pub weight_decay: f32,
    slots: Slots,
}

impl Sgd {
    /// SGD with learning rate `lr`, no momentum, no weight decay.
    pub fn new(lr: f32) -> Sgd {
        Sgd {
            lr,
            momentum: 0.0,
            weight_decay: 0.0,
            slots: Slots::new(SGD_SLOTS),
        }
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
}

impl ShardedOptimizer for Sgd {
    fn step(&mut self, model: &dyn ShardedParams) -> Result<()> {
        const OP: &str = "Sgd::step";
        let c = sgd_coeffs(OP, self.lr, self.momentum, self.weight_decay)?;
        let shards = model.shards();
        self.slots.ensure(shards.len(), OP)?;
        let stream = model.optimizer_stream().clone();
        for (u, s) in shards.iter().enumerate() {
            let Some((ranges, pm, gm)) = unit_operands(s, OP, &stream)? else {
                continue;
            };
            let n = s.shard.numel();
            let mut writes = vec![pm];
            let mut first = false;
            if c.momentum != 0.0 {
                let (b, created) =
                    state_tensor(&mut self.slots, 0, u, n, model.shard_device(), &stream)?;
                first = created;
                writes.push(f32_mem(&b, OP, "a momentum buffer", &stream)?);
                b.storage().bump_version();
            }
            launch_f32(&stream, "sgd", vec![gm], writes, move |r, w| {
                let (p, rest) = w.split_at_mut(1);
                for range in &ranges {
                    let buf = rest.first_mut().map(|b| &mut b[range.clone()]);
                    sgd_kernel(
                        &mut p[0][range.clone()],
                        &r[0][range.clone()],
                        buf,
                        first,
                        c,
                    );
                }
            });
            s.shard.storage().bump_version();
            self.slots.steps[u] += 1;
        }
        model.params_updated();
        Ok(())
    }

    sharded_state_methods!(SGD_SLOTS, "Sgd::load_state");
}

/// Local SGD over plain parameters with exactly [`Sgd`]'s arithmetic (and
/// `fsdp_autograd::optim::Sgd`'s): the parity reference for sharded SGD.
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
#[derive(Debug, Clone)]
pub struct LocalSgd {
    params: Vec<Parameter>,
    /// Learning rate.
    pub lr: f32,
    /// Momentum factor μ.
    pub momentum: f32,
    /// Weight decay λ.
    pub weight_decay: f32,
    slots: Slots,
}

impl LocalSgd {
    /// SGD over `params` with learning rate `lr`, no momentum or weight decay.
    pub fn new(params: Vec<Parameter>, lr: f32) -> LocalSgd {
        let slots = Slots::sized(SGD_SLOTS, params.len());
        LocalSgd {
            params,
            lr,
            momentum: 0.0,
            weight_decay: 0.0,
            slots,
        }
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

impl LocalOptimizer for LocalSgd {
    fn step(&mut self) -> Result<()> {
        const OP: &str = "LocalSgd::step";
        let c = sgd_coeffs(OP, self.lr, self.momentum, self.weight_decay)?;
        for (i, p) in self.params.iter().enumerate() {
            let Some((stream, t, pm, gm)) = local_operands(p, OP)? else {
                continue;
            };
            let mut writes = vec![pm];
            let mut first = false;
            if c.momentum != 0.0 {
                let (b, created) =
                    state_tensor(&mut self.slots, 0, i, t.numel(), t.device(), &stream)?;
                first = created;
                writes.push(f32_mem(&b, OP, "a momentum buffer", &stream)?);
                b.storage().bump_version();
            }
            launch_f32(&stream, "sgd", vec![gm], writes, move |r, w| {
                let (p, rest) = w.split_at_mut(1);
                sgd_kernel(p[0], r[0], rest.first_mut().map(|b| &mut **b), first, c);
            });
            t.storage().bump_version();
            self.slots.steps[i] += 1;
        }
        Ok(())
    }

    local_state_methods!(SGD_SLOTS, "LocalSgd::load_state");
}

/// Numels of `params` and their (common) device.
fn local_sizes(params: &[Parameter], op: &str) -> Result<(Vec<usize>, Device)> {
    let mut device: Option<Device> = None;
    for p in params {
        if let Some(t) = p.try_get() {
            match &device {
                None => device = Some(t.device().clone()),
                Some(d) if d.id() != t.device().id() => {
                    return Err(FsdpError::Config(format!(
                        "{op}: parameters on {} and {}; local optimizers keep all parameters \
                         on one device",
                        d.id(),
                        t.device().id()
                    )))
                }
                Some(_) => {}
            }
        }
    }
    let device = device.ok_or_else(|| {
        FsdpError::Config(format!(
            "{op}: no parameter is materialized, so there is no device for the state"
        ))
    })?;
    Ok((params.iter().map(|p| p.numel()).collect(), device))
}

// ============================================================================ AdamW

const ADAM_SLOTS: &[&str] = &["exp_avg", "exp_avg_sq"];

/// AdamW hyper-parameters, shared by [`AdamW`], [`LocalAdamW`], [`Lamb`] and [`LocalLamb`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamParams {
    /// Learning rate.
    pub lr: f32,
    /// Decay rates (β1, β2) of the first and second moments.
    pub betas: (f32, f32),
    /// Added to the denominator for stability.
    pub eps: f32,
    /// Decoupled weight decay λ (AdamW: `p ← p·(1 − lr·λ)`; LAMB: `+ λ·p` in the direction).
    pub weight_decay: f32,
}

impl AdamParams {
    /// PyTorch's defaults with learning rate `lr`: betas (0.9, 0.999), eps 1e-8, weight decay
    /// 0.01.
    pub fn new(lr: f32) -> AdamParams {
        AdamParams {
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }

    fn check(&self, op: &str) -> Result<()> {
        check_finite(op, "lr", self.lr)?;
        check_finite(op, "weight_decay", self.weight_decay)?;
        check_betas(op, self.betas, self.eps)
    }
}

/// Sharded AdamW (PyTorch's algorithm, decoupled weight decay) with `exp_avg` and `exp_avg_sq`
/// of `chunk_numel` elements per unit. Example in the [module docs](self).
#[derive(Debug, Clone)]
pub struct AdamW {
    /// Hyper-parameters (`lr`, `betas`, `eps`, `weight_decay`).
    pub hyper: AdamParams,
    slots: Slots,
}

impl AdamW {
    /// AdamW with learning rate `lr` and PyTorch's defaults (see [`AdamParams::new`]).
    pub fn new(lr: f32) -> AdamW {
        AdamW::with_params(AdamParams::new(lr))
    }

    /// AdamW with the given hyper-parameters.
    pub fn with_params(hyper: AdamParams) -> AdamW {
        AdamW {
            hyper,
            slots: Slots::new(ADAM_SLOTS),
        }
    }

    /// With betas (β1, β2).
    pub fn with_betas(mut self, betas: (f32, f32)) -> AdamW {
        self.hyper.betas = betas;
        self
    }

    /// With eps.
    pub fn with_eps(mut self, eps: f32) -> AdamW {
        self.hyper.eps = eps;
        self
    }

    /// With weight decay λ.
    pub fn with_weight_decay(mut self, weight_decay: f32) -> AdamW {
        self.hyper.weight_decay = weight_decay;
        self
    }
}

impl ShardedOptimizer for AdamW {
    fn step(&mut self, model: &dyn ShardedParams) -> Result<()> {
        const OP: &str = "AdamW::step";
        let h = self.hyper;
        h.check(OP)?;
        let shards = model.shards();
        self.slots.ensure(shards.len(), OP)?;
        let stream = model.optimizer_stream().clone();
        for (u, s) in shards.iter().enumerate() {
            let Some((ranges, pm, gm)) = unit_operands(s, OP, &stream)? else {
                continue;
            };
            let n = s.shard.numel();
            let dev = model.shard_device();
            let (m, _) = state_tensor(&mut self.slots, 0, u, n, dev, &stream)?;
            let (v, _) = state_tensor(&mut self.slots, 1, u, n, dev, &stream)?;
            let writes = vec![
                pm,
                f32_mem(&m, OP, "exp_avg", &stream)?,
                f32_mem(&v, OP, "exp_avg_sq", &stream)?,
            ];
            self.slots.steps[u] += 1;
            let c = AdamCoeffs::new(h.lr, h.betas, h.eps, h.weight_decay, self.slots.steps[u]);
            launch_f32(&stream, "adamw", vec![gm], writes, move |r, w| {
                let [p, m, v] = w else {
                    unreachable!("three outputs launched")
                };
                for range in &ranges {
                    adamw_kernel(
                        &mut p[range.clone()],
                        &r[0][range.clone()],
                        &mut m[range.clone()],
                        &mut v[range.clone()],
                        c,
                    );
                }
            });
            for t in [&s.shard, &m, &v] {
                t.storage().bump_version();
            }
        }
        model.params_updated();
        Ok(())
    }

    sharded_state_methods!(ADAM_SLOTS, "AdamW::load_state");
}

/// Local AdamW over plain parameters with exactly [`AdamW`]'s arithmetic.
///
/// ```
/// use fsdp_alloc::{DType, Device};
/// use fsdp_autograd::{init::InitOp, InitContext};
/// use fsdp_core::optim::{AdamParams, LocalAdamW, LocalOptimizer};
///
/// let dev = Device::cpu(0);
/// let p = InitContext::eager(&dev, 0).param("w", &[3], DType::F32, vec![InitOp::Fill(1.0)])?;
/// let hp = AdamParams { weight_decay: 0.0, ..AdamParams::new(0.1) };
/// let mut opt = LocalAdamW::new(vec![p.clone()], hp);
/// p.get()?.sum()?.backward()?;
/// opt.step()?;
/// // Adam's first step moves every element by about lr against the gradient's sign.
/// for x in p.get()?.to_vec::<f32>()? {
///     assert!((x - 0.9).abs() < 1e-5);
/// }
/// # Ok::<(), fsdp_core::FsdpError>(())
/// ```
#[derive(Debug, Clone)]
pub struct LocalAdamW {
    params: Vec<Parameter>,
    /// Hyper-parameters.
    pub hyper: AdamParams,
    slots: Slots,
}

impl LocalAdamW {
    /// AdamW over `params` with hyper-parameters `hp`.
    pub fn new(params: Vec<Parameter>, hp: AdamParams) -> LocalAdamW {
        let slots = Slots::sized(ADAM_SLOTS, params.len());
        LocalAdamW {
            params,
            hyper: hp,
            slots,
        }
    }
}

impl LocalOptimizer for LocalAdamW {
    fn step(&mut self) -> Result<()> {
        const OP: &str = "LocalAdamW::step";
        let h = self.hyper;
        h.check(OP)?;
        for (i, p) in self.params.iter().enumerate() {
            let Some((stream, t, pm, gm)) = local_operands(p, OP)? else {
                continue;
            };
            let n = t.numel();
            let (m, _) = state_tensor(&mut self.slots, 0, i, n, t.device(), &stream)?;
            let (v, _) = state_tensor(&mut self.slots, 1, i, n, t.device(), &stream)?;
            let writes = vec![
                pm,
                f32_mem(&m, OP, "exp_avg", &stream)?,
                f32_mem(&v, OP, "exp_avg_sq", &stream)?,
            ];
            self.slots.steps[i] += 1;
            let c = AdamCoeffs::new(h.lr, h.betas, h.eps, h.weight_decay, self.slots.steps[i]);
            launch_f32(&stream, "adamw", vec![gm], writes, move |r, w| {
                let [p, m, v] = w else {
                    unreachable!("three outputs launched")
                };
                adamw_kernel(p, r[0], m, v, c);
            });
            for t in [&t, &m, &v] {
                t.storage().bump_version();
            }
        }
        Ok(())
    }

    local_state_methods!(ADAM_SLOTS, "LocalAdamW::load_state");
}

// ============================================================================ LAMB

/// Sharded LAMB-style optimizer: Adam moments, the direction `u = m̂/(√v̂ + ε) + λ·p`, and a
/// **per-original-parameter** trust ratio `‖p‖ / ‖u‖` (1 if either is 0), `p −= lr·ratio·u`.
///
/// The norms are exact per original parameter although parameters are split across ranks: each
/// rank sums squares of its pieces of `p` and `u` (the layout's per-rank pieces) and one
/// all-reduce of a vector of 2 × (number of parameters) f32 sums over the shard group completes
/// them (the mechanism of [`crate::clip::grad_norms_per_param`]). Everything runs on the
/// optimizer stream — the ratios never visit the host. One temporary of `chunk_numel` per unit
/// holds `u` during the step.
///
/// Compared with [`LocalLamb`], only the trust ratios differ, by the rounding of the norm sums
/// (f64 per rank, rounded to f32, summed in rank order in f32), a relative 1e-7-scale difference.
#[derive(Debug)]
pub struct Lamb {
    /// Hyper-parameters.
    pub hyper: AdamParams,
    slots: Slots,
    /// The previous step's all-reduce, checked at the next step.
    pending: Vec<Work>,
}

impl Lamb {
    /// LAMB with hyper-parameters `hp`.
    pub fn new(hp: AdamParams) -> Lamb {
        Lamb {
            hyper: hp,
            slots: Slots::new(ADAM_SLOTS),
            pending: Vec::new(),
        }
    }

    /// Waits for this optimizer's collectives and reports their errors.
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

impl ShardedOptimizer for Lamb {
    fn step(&mut self, model: &dyn ShardedParams) -> Result<()> {
        const OP: &str = "Lamb::step";
        self.synchronize()?;
        let h = self.hyper;
        h.check(OP)?;
        let shards = model.shards();
        self.slots.ensure(shards.len(), OP)?;
        let stream = model.optimizer_stream().clone();
        let dev = model.shard_device().clone();
        let num_params: usize = shards.iter().map(|s| s.layout.num_params()).sum();
        // Phase 1: moments and directions. Per unit with a gradient, keep (trainable pieces as
        // (global parameter index, range in the shard), shard memory, direction).
        type Job = (Vec<(usize, Range<usize>)>, BufferRef, Tensor);
        let mut jobs: Vec<Job> = Vec::new();
        let mut base = 0;
        for (u, s) in shards.iter().enumerate() {
            let first_param = base;
            base += s.layout.num_params();
            let Some((ranges, pm, gm)) = unit_operands(s, OP, &stream)? else {
                continue;
            };
            let pieces: Vec<(usize, Range<usize>)> = s
                .layout
                .rank_pieces(s.rank)?
                .into_iter()
                .filter(|p| s.requires_grad[p.param_index])
                .map(|p| (first_param + p.param_index, p.shard_range()))
                .collect();
            let n = s.shard.numel();
            let (m, _) = state_tensor(&mut self.slots, 0, u, n, &dev, &stream)?;
            let (v, _) = state_tensor(&mut self.slots, 1, u, n, &dev, &stream)?;
            let dir = zeros_on(n, &dev, &stream)?;
            self.slots.steps[u] += 1;
            let c = LambCoeffs::new(h.betas, h.eps, h.weight_decay, self.slots.steps[u]);
            launch_f32(
                &stream,
                "lamb_direction",
                vec![pm.clone(), gm],
                vec![
                    f32_mem(&m, OP, "exp_avg", &stream)?,
                    f32_mem(&v, OP, "exp_avg_sq", &stream)?,
                    f32_mem(&dir, OP, "the LAMB direction", &stream)?,
                ],
                move |r, w| {
                    let [m, v, d] = w else {
                        unreachable!("three outputs launched")
                    };
                    for range in &ranges {
                        lamb_direction_kernel(
                            &r[0][range.clone()],
                            &r[1][range.clone()],
                            &mut m[range.clone()],
                            &mut v[range.clone()],
                            &mut d[range.clone()],
                            c,
                        );
                    }
                },
            );
            m.storage().bump_version();
            v.storage().bump_version();
            jobs.push((pieces, pm, dir));
        }
        // Phase 2: per-parameter squared norms of p (first half) and u (second half), summed
        // over this rank's pieces in f64, then across the shard group in one all-reduce.
        let sums = zeros_on(2 * num_params, &dev, &stream)?;
        let mut reads = Vec::with_capacity(2 * jobs.len());
        for (_, pm, dir) in &jobs {
            reads.push(pm.clone());
            reads.push(f32_mem(dir, OP, "the LAMB direction", &stream)?);
        }
        let all_pieces: Vec<Vec<(usize, Range<usize>)>> =
            jobs.iter().map(|(p, _, _)| p.clone()).collect();
        launch_f32(
            &stream,
            "lamb_norms",
            reads,
            vec![f32_mem(&sums, OP, "the norm sums", &stream)?],
            move |r, w| {
                let mut acc = vec![0f64; 2 * num_params];
                for (j, pieces) in all_pieces.iter().enumerate() {
                    let (p, d) = (r[2 * j], r[2 * j + 1]);
                    for (idx, range) in pieces {
                        acc[*idx] += crate::clip::sum_sq(&p[range.clone()]);
                        acc[num_params + idx] += crate::clip::sum_sq(&d[range.clone()]);
                    }
                }
                for (o, a) in w[0].iter_mut().zip(&acc) {
                    *o = *a as f32;
                }
            },
        );
        if let Some(w) = crate::clip::all_reduce_sum(model, &sums, &stream)? {
            self.pending.push(w);
        }
        // Phase 3: p += (−lr·ratio)·u per parameter piece, the ratios read on the stream.
        let sums_mem = f32_mem(&sums, OP, "the norm sums", &stream)?;
        let lr = h.lr;
        for (pieces, pm, dir) in jobs {
            launch_f32(
                &stream,
                "lamb_apply",
                vec![
                    f32_mem(&dir, OP, "the LAMB direction", &stream)?,
                    sums_mem.clone(),
                ],
                vec![pm],
                move |r, w| {
                    let (d, sums) = (r[0], r[1]);
                    for (idx, range) in &pieces {
                        let ratio = trust_ratio(sums[*idx] as f64, sums[num_params + idx] as f64);
                        lamb_apply_kernel(
                            &mut w[0][range.clone()],
                            &d[range.clone()],
                            -(lr * ratio),
                        );
                    }
                },
            );
        }
        for s in &shards {
            if s.grad.is_some() {
                s.shard.storage().bump_version();
            }
        }
        model.params_updated();
        Ok(())
    }

    sharded_state_methods!(ADAM_SLOTS, "Lamb::load_state");
}

/// Local LAMB-style optimizer with [`Lamb`]'s elementwise arithmetic; the norms are summed over
/// each whole parameter in f64.
///
/// ```
/// use fsdp_alloc::{DType, Device};
/// use fsdp_autograd::{init::InitOp, InitContext};
/// use fsdp_core::optim::{AdamParams, LocalLamb, LocalOptimizer};
///
/// let dev = Device::cpu(0);
/// let p = InitContext::eager(&dev, 0).param("w", &[4], DType::F32, vec![InitOp::Fill(2.0)])?;
/// let hp = AdamParams { weight_decay: 0.0, ..AdamParams::new(0.1) };
/// let mut opt = LocalLamb::new(vec![p.clone()], hp);
/// p.get()?.sum()?.backward()?;
/// opt.step()?;
/// // u ≈ 1 everywhere, ‖p‖ = 4, ‖u‖ ≈ 2: ratio ≈ 2, so p ≈ 2 − 0.1·2.
/// for x in p.get()?.to_vec::<f32>()? {
///     assert!((x - 1.8).abs() < 1e-5);
/// }
/// # Ok::<(), fsdp_core::FsdpError>(())
/// ```
#[derive(Debug, Clone)]
pub struct LocalLamb {
    params: Vec<Parameter>,
    /// Hyper-parameters.
    pub hyper: AdamParams,
    slots: Slots,
}

impl LocalLamb {
    /// LAMB over `params` with hyper-parameters `hp`.
    pub fn new(params: Vec<Parameter>, hp: AdamParams) -> LocalLamb {
        let slots = Slots::sized(ADAM_SLOTS, params.len());
        LocalLamb {
            params,
            hyper: hp,
            slots,
        }
    }
}

impl LocalOptimizer for LocalLamb {
    fn step(&mut self) -> Result<()> {
        const OP: &str = "LocalLamb::step";
        let h = self.hyper;
        h.check(OP)?;
        for (i, p) in self.params.iter().enumerate() {
            let Some((stream, t, pm, gm)) = local_operands(p, OP)? else {
                continue;
            };
            let n = t.numel();
            let (m, _) = state_tensor(&mut self.slots, 0, i, n, t.device(), &stream)?;
            let (v, _) = state_tensor(&mut self.slots, 1, i, n, t.device(), &stream)?;
            self.slots.steps[i] += 1;
            let c = LambCoeffs::new(h.betas, h.eps, h.weight_decay, self.slots.steps[i]);
            let (mm, vm) = (
                f32_mem(&m, OP, "exp_avg", &stream)?,
                f32_mem(&v, OP, "exp_avg_sq", &stream)?,
            );
            let lr = h.lr;
            launch_f32(&stream, "lamb", vec![gm], vec![pm, mm, vm], move |r, w| {
                let [p, m, v] = w else {
                    unreachable!("three outputs launched")
                };
                let mut d = vec![0f32; p.len()];
                lamb_direction_kernel(p, r[0], m, v, &mut d, c);
                let ratio = trust_ratio(crate::clip::sum_sq(p), crate::clip::sum_sq(&d));
                lamb_apply_kernel(p, &d, -(lr * ratio));
            });
            for t in [&t, &m, &v] {
                t.storage().bump_version();
            }
        }
        Ok(())
    }

    local_state_methods!(ADAM_SLOTS, "LocalLamb::load_state");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plain scalar AdamW step written out independently (PyTorch's formulas, f64 scalars).
    fn adamw_reference(p: f32, g: f32, m: f32, v: f32, t: u64, h: AdamParams) -> (f32, f32, f32) {
        let p = p * (1.0 - h.lr as f64 * h.weight_decay as f64) as f32;
        let m = m + (1.0 - h.betas.0 as f64) as f32 * (g - m);
        let v = h.betas.1 * v + (1.0 - h.betas.1 as f64) as f32 * (g * g);
        let bc1 = 1.0 - (h.betas.0 as f64).powf(t as f64);
        let bc2 = 1.0 - (h.betas.1 as f64).powf(t as f64);
        let denom = v.sqrt() / (bc2.sqrt() as f32) + h.eps;
        let p = p + (-(h.lr as f64) / bc1) as f32 * (m / denom);
        (p, m, v)
    }

    #[test]
    fn adamw_kernel_matches_the_written_out_formula_bitwise() {
        let h = AdamParams {
            lr: 0.01,
            betas: (0.8, 0.95),
            eps: 1e-6,
            weight_decay: 0.1,
        };
        let mut p: Vec<f32> = (0..7).map(|i| 0.3 * i as f32 - 1.0).collect();
        let mut m = vec![0f32; 7];
        let mut v = vec![0f32; 7];
        let (mut rp, mut rm, mut rv) = (p.clone(), m.clone(), v.clone());
        for t in 1..=4u64 {
            let g: Vec<f32> = (0..7)
                .map(|i| ((i * 3 + t as usize) % 5) as f32 - 2.0)
                .collect();
            let c = AdamCoeffs::new(h.lr, h.betas, h.eps, h.weight_decay, t);
            adamw_kernel(&mut p, &g, &mut m, &mut v, c);
            for i in 0..7 {
                (rp[i], rm[i], rv[i]) = adamw_reference(rp[i], g[i], rm[i], rv[i], t, h);
            }
            assert_eq!(p, rp, "step {t}");
            assert_eq!(m, rm);
            assert_eq!(v, rv);
        }
    }

    #[test]
    fn adamw_first_step_moves_by_lr_against_the_gradient() {
        let h = AdamParams {
            weight_decay: 0.0,
            ..AdamParams::new(0.05)
        };
        let mut p = vec![1.0f32, -2.0, 0.5];
        let g = [3.0f32, -0.25, 1e-3];
        let (mut m, mut v) = (vec![0.0; 3], vec![0.0; 3]);
        adamw_kernel(
            &mut p,
            &g,
            &mut m,
            &mut v,
            AdamCoeffs::new(h.lr, h.betas, h.eps, 0.0, 1),
        );
        for (x, want) in p.iter().zip([0.95f32, -1.95, 0.45]) {
            assert!((x - want).abs() < 1e-5, "{x} vs {want}");
        }
    }

    #[test]
    fn sgd_kernel_momentum_and_weight_decay_follow_pytorch() {
        let c = SgdCoeffs {
            neg_lr: -0.1,
            momentum: 0.5,
            weight_decay: 0.2,
        };
        let mut p = vec![1.0f32];
        let mut b = vec![0.0f32];
        sgd_kernel(&mut p, &[1.0], Some(&mut b), true, c);
        // d = 1 + 0.2 = 1.2, b = 1.2, p = 1 − 0.12
        assert_eq!(b[0], 1.2f32);
        assert_eq!(p[0], 1.0 + -0.1 * 1.2f32);
        let p1 = p[0];
        sgd_kernel(&mut p, &[1.0], Some(&mut b), false, c);
        let d = 1.0 + 0.2 * p1;
        let b1 = 0.5 * 1.2f32 + d;
        assert_eq!(b[0], b1);
        assert_eq!(p[0], p1 + -0.1 * b1);
    }

    #[test]
    fn trust_ratio_falls_back_to_one() {
        assert_eq!(trust_ratio(4.0, 1.0), 2.0);
        assert_eq!(trust_ratio(0.0, 1.0), 1.0);
        assert_eq!(trust_ratio(1.0, 0.0), 1.0);
        assert_eq!(trust_ratio(f64::INFINITY, 1.0), 1.0);
    }

    #[test]
    fn hyper_parameters_are_checked() {
        let bad = AdamParams {
            betas: (1.0, 0.9),
            ..AdamParams::new(0.1)
        };
        assert!(bad.check("t").is_err());
        let bad = AdamParams {
            eps: 0.0,
            ..AdamParams::new(0.1)
        };
        assert!(bad.check("t").is_err());
        assert!(AdamParams::new(f32::NAN).check("t").is_err());
        assert!(sgd_coeffs("t", 0.1, f32::INFINITY, 0.0).is_err());
        assert!(AdamParams::new(0.1).check("t").is_ok());
    }
}
