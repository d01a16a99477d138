//! Gradient clipping and norms across shards: the global gradient norm with one all-reduce of a
//! scalar, and **exact per-original-parameter** gradient and weight norms with one all-reduce of
//! a vector — the limitation of the paper's §7.2.1 (per-parameter norms are not available from
//! flat shards) lifted.
//!
//! # How the sums are formed
//! Each rank sums the squares of its shard gradients in f64 (sequentially, per unit), rounds the
//! sum to f32 and the shard group all-reduces it (f32, summed in rank order by the thread
//! backend); the norm is the f64 square root. Replicas of hybrid sharding hold identical reduced
//! gradients, so only the shard group takes part; with `NoShard` every rank holds everything and
//! nothing is communicated. For per-parameter norms each rank walks its per-rank pieces
//! ([`fsdp_flatparam::FlatParamLayout::rank_pieces`]: which part of which original parameter
//! sits where in its shard) and adds each piece's squares to that parameter's slot of a vector
//! with one entry per parameter of the model; one all-reduce of that vector completes every norm,
//! however the parameters are split across ranks.
//!
//! Every rank obtains bitwise the same result (the same all-reduce output), so every rank
//! computes the same clipping coefficient. Against a local computation (one f64 sum over each
//! whole parameter) the results differ only by the f32 roundings of the partial sums and of their
//! sum: a relative difference of at most about (W + 1)·2⁻²⁴ of the squared norm.
//!
//! The sums run as kernels (the seam's `SumSquares`) on the model's optimizer stream and stay on
//! the device until the functions read them, which they do because they return them to the host
//! (one wait each; nothing else in a step waits).
//!
//! ```
//! use std::sync::Arc;
//! use fsdp_alloc::{DType, Device};
//! use fsdp_autograd::{nn::Linear, InitContext, Tensor};
//! use fsdp_collectives::{ProcessGroup, ThreadGroup};
//! use fsdp_core::clip::{clip_grad_norm, grad_norms_per_param};
//! use fsdp_core::{Fsdp, FsdpConfig};
//!
//! let dev = Device::cpu(0);
//! let model = Linear::new(&InitContext::eager(&dev, 0), 4, 2, true)?;
//! let pg: Arc<dyn ProcessGroup> = Arc::new(ThreadGroup::new(1).remove(0));
//! let fsdp = Fsdp::wrap(model, &dev, pg, FsdpConfig::default())?;
//! let x = Tensor::ones(&[3, 4], DType::F32, &dev)?;
//! fsdp.forward(&x)?.sum()?.backward()?; // d/d bias = 3 for each of the 2 outputs
//! let per_param = grad_norms_per_param(&fsdp)?;
//! let bias = per_param.iter().find(|(n, _)| n.ends_with("bias")).unwrap().1;
//! assert!((bias - 18f64.sqrt()).abs() < 1e-6);
//! let total = clip_grad_norm(&fsdp, 1.0)?; // returns the norm before clipping
//! let after: f64 = grad_norms_per_param(&fsdp)?.iter().map(|(_, n)| n * n).sum::<f64>().sqrt();
//! assert!(total > 1.0 && (after - 1.0).abs() < 1e-5);
//! # Ok::<(), fsdp_core::FsdpError>(())
//! ```
//!
//! # Limitations
//! - A non-finite total norm leaves the gradients as they are (and is returned): clipping cannot
//!   repair an overflow; a grad scaler skips such a step.
//! - The per-rank sums travel as f32, so a norm above about 1.8·10¹⁹ (a squared norm beyond
//!   f32's range) reads as infinite.
//! - The sharded norms and clipping run through the kernel seam on the shard device (CPU or
//!   CUDA: `SumSquares`, `ScaleInplace`); the local references (`*_local`) sum on the host and
//!   accept CPU tensors only. On CUDA the per-rank sums are blocked f64 sums (deterministic, no
//!   atomics) and may differ from the CPU's sequential f64 sums in the last bit of the f32
//!   rounding.

use std::sync::mpsc;

use fsdp_autograd::{current_stream, Parameter, Tensor};

use crate::error::{ArgumentError, DeviceError, ExpectedDevice, FsdpError, Result, StateError};
use fsdp_alloc::Stream;
use fsdp_autograd::kernels::elementwise::ScaleInplace;
use fsdp_autograd::kernels::optim::{SqPiece, SumSquares};
use fsdp_autograd::kernels::{Kernels, Operand};

use super::sharded::{
    all_reduce_sum, f32_mem, f32_operand, kernels_for, launch_f32, read_after, sum_sq, zeros_on,
    ShardedParams,
};

/// Per-parameter sums of squares of either the gradients (`grads`) or the shards, completed
/// across the shard group; one entry per parameter in unit order, with its name.
fn per_param_sq(model: &dyn ShardedParams, grads: bool, op: &str) -> Result<Vec<(String, f64)>> {
    let shards = model.shards();
    let stream = model.optimizer_stream().clone();
    let names: Vec<String> = shards.iter().flat_map(|s| s.names.clone()).collect();
    let n = names.len();
    let mut reads = Vec::new();
    let mut jobs: Vec<Vec<(usize, std::ops::Range<usize>)>> = Vec::new();
    let mut base = 0;
    for s in &shards {
        if s.names.len() != s.layout.num_params() {
            return Err(FsdpError::InvalidArgument(ArgumentError::Count {
                op: op.into(),
                what: format!(
                    "unit `{}`'s parameter names (one per layout parameter)",
                    s.path
                ),
                counted: "names",
                actual: s.names.len(),
                expected: s.layout.num_params(),
            }));
        }
        let first = base;
        base += s.layout.num_params();
        let t = if grads {
            match &s.grad {
                Some(g) => g,
                None => continue,
            }
        } else {
            &s.shard
        };
        if t.numel() != s.layout.chunk_numel() {
            return Err(FsdpError::InvalidArgument(ArgumentError::Count {
                op: op.into(),
                what: format!("unit `{}` (one layout chunk)", s.path),
                counted: "elements",
                actual: t.numel(),
                expected: s.layout.chunk_numel(),
            }));
        }
        reads.push(f32_operand(t, op, &format!("unit `{}`", s.path), &stream)?);
        jobs.push(
            s.layout
                .rank_pieces(s.rank)?
                .into_iter()
                .map(|p| (first + p.param_index, p.shard_range()))
                .collect(),
        );
    }
    let sums = zeros_on(n, model.shard_device(), &stream)?;
    let out = f32_operand(&sums, op, "the norm sums", &stream)?;
    let pieces: Vec<SqPiece> = jobs
        .iter()
        .enumerate()
        .flat_map(|(input, pieces)| {
            pieces.iter().map(move |(idx, range)| SqPiece {
                input,
                start: range.start,
                len: range.len(),
                out: *idx,
            })
        })
        .collect();
    let l = SumSquares {
        xs: &reads,
        pieces: &pieces,
        out: &out,
    };
    kernels_for(model.shard_device())?.launch(&stream, &l)?;
    let work = all_reduce_sum(model, &sums, &stream)?;
    let v = read_after(&sums, &stream, work)?;
    Ok(names
        .into_iter()
        .zip(v.into_iter().map(f64::from))
        .collect())
}

/// The gradient norm of every original parameter, exact across shards (one all-reduce of a
/// vector over the shard group): `(fully-qualified name, ‖grad‖₂)` in unit order. Parameters of
/// units without a gradient, and frozen ones, report 0. A collective: every rank calls it.
///
/// # Errors
/// Non-f32 or released gradients, CUDA memory, a failed all-reduce.
pub fn grad_norms_per_param(model: &dyn ShardedParams) -> Result<Vec<(String, f64)>> {
    Ok(per_param_sq(model, true, "grad_norms_per_param")?
        .into_iter()
        .map(|(n, s)| (n, s.sqrt()))
        .collect())
}

/// The weight norm `‖p‖₂` of every original parameter, exact across shards (one all-reduce of a
/// vector), in unit order. A collective: every rank calls it.
///
/// # Errors
/// As [`grad_norms_per_param`].
pub fn param_norms_per_param(model: &dyn ShardedParams) -> Result<Vec<(String, f64)>> {
    Ok(per_param_sq(model, false, "param_norms_per_param")?
        .into_iter()
        .map(|(n, s)| (n, s.sqrt()))
        .collect())
}

/// The global gradient norm `‖g‖₂` over all parameters: each rank sums the squares of its shard
/// gradients, one all-reduce of a scalar over the shard group. A collective.
///
/// # Errors
/// As [`grad_norms_per_param`].
pub fn grad_norm(model: &dyn ShardedParams) -> Result<f64> {
    const OP: &str = "grad_norm";
    let stream = model.optimizer_stream().clone();
    let mut reads = Vec::new();
    for s in model.shards() {
        if let Some(g) = &s.grad {
            reads.push(f32_operand(
                g,
                OP,
                &format!("the gradient of unit `{}`", s.path),
                &stream,
            )?);
        }
    }
    // One output: every gradient's f64 sum of squares added in unit order (as one f64 sum
    // over all units), rounded to f32 once.
    let pieces: Vec<SqPiece> = reads
        .iter()
        .enumerate()
        .map(|(input, g)| SqPiece {
            input,
            start: 0,
            len: g.numel(),
            out: 0,
        })
        .collect();
    let acc = zeros_on(1, model.shard_device(), &stream)?;
    let out = f32_operand(&acc, OP, "the norm sum", &stream)?;
    let l = SumSquares {
        xs: &reads,
        pieces: &pieces,
        out: &out,
    };
    kernels_for(model.shard_device())?.launch(&stream, &l)?;
    let work = all_reduce_sum(model, &acc, &stream)?;
    let v = read_after(&acc, &stream, work)?;
    Ok((v[0] as f64).sqrt())
}

/// The clipping coefficient PyTorch uses, `max_norm / (total + 1e-6)`, when it is below 1 and
/// the norm is finite (`None`: leave the gradients alone).
fn clip_coef(max_norm: f64, total: f64) -> Option<f32> {
    if !total.is_finite() {
        return None;
    }
    let c = max_norm / (total + 1e-6);
    (c < 1.0).then_some(c as f32)
}

fn check_max_norm(op: &str, max_norm: f64) -> Result<()> {
    if max_norm.is_finite() && max_norm >= 0.0 {
        Ok(())
    } else {
        Err(FsdpError::InvalidArgument(ArgumentError::Value {
            op: op.into(),
            name: "max_norm".into(),
            value: max_norm.to_string(),
            requirement: "finite and non-negative".into(),
        }))
    }
}

/// `g ← c·g` in place through the seam (`ScaleInplace`: one f32 product per element).
fn scale_inplace(k: &Kernels, stream: &Stream, g: &Operand, c: f32) -> Result<()> {
    let l = ScaleInplace {
        n: g.numel(),
        alpha: c,
        y: g,
    };
    Ok(k.launch(stream, &l)?)
}

/// Clips the global gradient norm to `max_norm`: computes it as [`grad_norm`] (one all-reduce
/// of a scalar), then scales every shard gradient by `min(1, max_norm / (norm + 1e-6))` on the
/// optimizer stream. Returns the norm *before* clipping. Every rank gets the same norm and
/// applies the same coefficient. A collective: every rank calls it.
///
/// # Errors
/// A negative or non-finite `max_norm`; as [`grad_norms_per_param`].
pub fn clip_grad_norm(model: &dyn ShardedParams, max_norm: f64) -> Result<f64> {
    const OP: &str = "clip_grad_norm";
    check_max_norm(OP, max_norm)?;
    let total = grad_norm(model)?;
    if let Some(c) = clip_coef(max_norm, total) {
        let stream = model.optimizer_stream().clone();
        let k = kernels_for(model.shard_device())?;
        for s in model.shards() {
            if let Some(g) = &s.grad {
                let gm = f32_operand(
                    g,
                    OP,
                    &format!("the gradient of unit `{}`", s.path),
                    &stream,
                )?;
                scale_inplace(&k, &stream, &gm, c)?;
                g.storage().bump_version();
            }
        }
    }
    Ok(total)
}

// ============================================================================ local

/// The gradients of `params` that exist, as (index, contiguous gradient tensor).
fn local_grads(params: &[Parameter]) -> Vec<(usize, Tensor)> {
    params
        .iter()
        .enumerate()
        .filter_map(|(i, p)| p.grad().map(|g| (i, g)))
        .collect()
}

/// Sums of squares of `tensors` (f64, one per tensor), computed on their device's current
/// stream and returned to the host.
fn local_sq(tensors: &[Tensor], op: &'static str) -> Result<Vec<f64>> {
    let Some(first) = tensors.first() else {
        return Ok(Vec::new());
    };
    let stream = current_stream(first.device());
    let mut reads = Vec::with_capacity(tensors.len());
    let mut keep = Vec::with_capacity(tensors.len());
    for t in tensors {
        let t = if t.is_contiguous() {
            t.clone()
        } else {
            t.contiguous_copy()?
        };
        let m = f32_mem(&t, op, "a local tensor", &stream)?;
        if m.device_ptr().is_some() {
            return Err(FsdpError::Device(DeviceError {
                op: op.into(),
                what: "a local tensor".into(),
                actual: t.device().id(),
                expected: ExpectedDevice::Cpu,
                fix: "the local norm references sum on the host (f64, one sequential sum per \
                      tensor); move the tensors to a CPU device, or use the sharded norms \
                      (`grad_norm`, `grad_norms_per_param`), which run on the device"
                    .into(),
            }));
        }
        reads.push(m);
        keep.push(t);
    }
    let (tx, rx) = mpsc::channel();
    launch_f32(&stream, op, reads, vec![], move |r, _| {
        let _ = tx.send(r.iter().map(|x| sum_sq(x)).collect::<Vec<f64>>());
    });
    match rx.recv() {
        Ok(v) => Ok(v),
        Err(_) => {
            stream.synchronize()?;
            Err(FsdpError::State(StateError::KernelDidNotRun {
                op: op.into(),
                kernel: "norm",
            }))
        }
    }
}

/// Local counterpart of [`grad_norms_per_param`]: `(parameter name, ‖grad‖₂)` for every
/// parameter (0 without a gradient), each summed over the whole parameter in f64.
///
/// # Errors
/// Non-f32 gradients, released storage, CUDA memory.
pub fn grad_norms_per_param_local(params: &[Parameter]) -> Result<Vec<(String, f64)>> {
    let grads = local_grads(params);
    let sums = local_sq(
        &grads.iter().map(|(_, g)| g.clone()).collect::<Vec<_>>(),
        "grad_norms_per_param_local",
    )?;
    let mut out: Vec<(String, f64)> = params.iter().map(|p| (p.name().to_string(), 0.0)).collect();
    for ((i, _), s) in grads.iter().zip(sums) {
        out[*i].1 = s.sqrt();
    }
    Ok(out)
}

/// Local counterpart of [`param_norms_per_param`] (unmaterialized parameters report 0).
///
/// # Errors
/// As [`grad_norms_per_param_local`].
pub fn param_norms_per_param_local(params: &[Parameter]) -> Result<Vec<(String, f64)>> {
    let present: Vec<(usize, Tensor)> = params
        .iter()
        .enumerate()
        .filter_map(|(i, p)| p.try_get().map(|t| (i, t)))
        .collect();
    let sums = local_sq(
        &present.iter().map(|(_, t)| t.clone()).collect::<Vec<_>>(),
        "param_norms_per_param_local",
    )?;
    let mut out: Vec<(String, f64)> = params.iter().map(|p| (p.name().to_string(), 0.0)).collect();
    for ((i, _), s) in present.iter().zip(sums) {
        out[*i].1 = s.sqrt();
    }
    Ok(out)
}

/// Local counterpart of [`clip_grad_norm`]: the global norm over the gradients of `params`
/// (f64 sums), then every gradient scaled by `min(1, max_norm / (norm + 1e-6))` in place (the
/// same coefficient formula and kernel). Returns the norm before clipping.
///
/// ```
/// use fsdp_alloc::{DType, Device};
/// use fsdp_autograd::{init::InitOp, InitContext};
/// use fsdp_core::clip::clip_grad_norm_local;
///
/// let dev = Device::cpu(0);
/// let p = InitContext::eager(&dev, 0).param("w", &[4], DType::F32, vec![InitOp::Fill(1.0)])?;
/// p.get()?.sum()?.scale(3.0)?.backward()?; // grad = 3 everywhere, norm 6
/// assert_eq!(clip_grad_norm_local(&[p.clone()], 3.0)?, 6.0);
/// let g = p.grad().unwrap().to_vec::<f32>()?;
/// assert!(g.iter().all(|x| (x - 1.5).abs() < 1e-5));
/// # Ok::<(), fsdp_core::FsdpError>(())
/// ```
///
/// # Errors
/// A negative or non-finite `max_norm`; non-contiguous or non-f32 gradients; as
/// [`grad_norms_per_param_local`].
pub fn clip_grad_norm_local(params: &[Parameter], max_norm: f64) -> Result<f64> {
    const OP: &str = "clip_grad_norm_local";
    check_max_norm(OP, max_norm)?;
    let grads = local_grads(params);
    let tensors: Vec<Tensor> = grads.iter().map(|(_, g)| g.clone()).collect();
    let total = local_sq(&tensors, OP)?.iter().sum::<f64>().sqrt();
    if let Some(c) = clip_coef(max_norm, total) {
        for g in &tensors {
            let stream = current_stream(g.device());
            let gm = f32_operand(g, OP, "a gradient", &stream)?;
            scale_inplace(&kernels_for(g.device())?, &stream, &gm, c)?;
            g.storage().bump_version();
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coefficient_clips_only_above_max_norm() {
        assert_eq!(clip_coef(1.0, 0.5), None);
        assert_eq!(clip_coef(1.0, f64::INFINITY), None);
        assert_eq!(clip_coef(1.0, f64::NAN), None);
        let c = clip_coef(1.0, 4.0).unwrap();
        assert!((c - 0.25).abs() < 1e-6);
        assert!(matches!(
            check_max_norm("t", -1.0),
            Err(FsdpError::InvalidArgument(_))
        ));
        assert!(check_max_norm("t", f64::NAN).is_err());
        assert!(check_max_norm("t", 0.0).is_ok());
    }
}
