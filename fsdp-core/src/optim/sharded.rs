//! What the optimizers ([`crate::optim`]), gradient clipping ([`crate::optim::clip`]) and the
//! grad scalers ([`crate::optim::scaler`]) share, below all of them: access to a wrapped model's
//! shards ([`ShardedParams`]), f32 kernel launches on a stream ([`f32_mem`], [`launch_f32`],
//! [`zeros_on`]), the trainable element ranges of a shard, and the sum over the shard group
//! ([`sum_sq`], [`all_reduce_sum`], [`read_after`]). Nothing here imports from the rest of
//! `optim/`, so its dependencies run one way: the rules, drivers, `clip` and `scaler` →
//! `sharded` → the runtime.

use std::ops::Range;
use std::sync::Arc;

use fsdp_alloc::{BufferRef, DType, Device, Stream};
use fsdp_autograd::kernels::{Kernels, Operand};
use fsdp_autograd::nn::Module;
use fsdp_autograd::{with_stream, Tensor};
use fsdp_collectives::{DeviceSlice, ProcessGroup, ReduceOp, Work};

use crate::error::{
    ArgumentError, DeviceError, DtypeError, ExpectedDevice, FsdpError, Result, StateError,
};
use crate::runtime::fsdp::{Fsdp, UnitShard};

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

// ============================================================================ f32 kernels

/// A contiguous f32 tensor as a kernel operand on `stream` (see [`f32_mem`]).
///
/// # Errors
/// As [`f32_mem`].
pub(crate) fn f32_operand(t: &Tensor, op: &str, what: &str, stream: &Stream) -> Result<Operand> {
    Ok(Operand {
        buf: f32_mem(t, op, what, stream)?,
        dtype: DType::F32,
    })
}

/// Elements `range` of an f32 operand.
///
/// # Errors
/// A range outside the operand.
pub(crate) fn slice_f32(o: &Operand, range: Range<usize>) -> Result<Operand> {
    Ok(Operand {
        buf: o.buf.slice_elems::<f32>(range.start, range.len())?,
        dtype: DType::F32,
    })
}

/// The kernels (the seam) of `device`.
///
/// # Errors
/// A CUDA device without the `cuda` feature or whose kernels cannot be loaded.
pub(crate) fn kernels_for(device: &Device) -> Result<Kernels> {
    Ok(Kernels::for_device(device)?)
}

/// The memory of a contiguous f32 tensor for a kernel launched on `stream`. Records `stream` on
/// the tensor's buffer when it was allocated on another stream (e.g. a gradient produced on the
/// reduce stream), so the allocator does not hand the memory out again before the kernel ran.
///
/// # Errors
/// [`FsdpError::Dtype`] for a non-f32 tensor, [`FsdpError::InvalidArgument`] for a
/// non-contiguous one, [`FsdpError::Device`] for a tensor on another device than `stream`,
/// [`FsdpError::State`] for released storage.
pub(crate) fn f32_mem(t: &Tensor, op: &str, what: &str, stream: &Stream) -> Result<BufferRef> {
    if t.dtype() != DType::F32 {
        return Err(FsdpError::Dtype(DtypeError {
            op: op.into(),
            what: what.into(),
            actual: t.dtype(),
            expected: DType::F32,
            why: "optimizer, clipping and scaler kernels work on f32 tensors (FSDP keeps shards, \
                  sharded gradients and optimizer state in f32)",
        }));
    }
    if !t.is_contiguous() {
        return Err(FsdpError::InvalidArgument(ArgumentError::NotContiguous {
            op: op.into(),
            what: what.into(),
            shape: t.shape().to_vec(),
            strides: t.strides().to_vec(),
        }));
    }
    if t.device().id() != stream.device() {
        return Err(FsdpError::Device(DeviceError {
            op: op.into(),
            what: what.into(),
            actual: t.device().id(),
            expected: ExpectedDevice::Exactly(stream.device()),
            fix: format!(
                "the kernel runs on stream `{}`; keep tensors and streams on one device",
                stream.name()
            ),
        }));
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
            FsdpError::State(StateError::StorageReleased {
                op: op.into(),
                what: what.into(),
            })
        })?;
    Ok(r.slice_elems::<f32>(t.offset(), t.numel())?)
}

/// Launches `f` on `stream` with shared access to `reads` and exclusive access to `writes`
/// (f32 ranges of host-accessible memory: the local norm references only; everything a sharded
/// model runs goes through the kernel seam). Access conflicts cannot happen for ranges checked at launch time; if one did,
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

/// A tensor of `n` f32 zeros, allocated on `stream` of `device`.
pub(crate) fn zeros_on(n: usize, device: &Device, stream: &Stream) -> Result<Tensor> {
    Ok(with_stream(stream, || {
        Tensor::zeros(&[n], DType::F32, device)
    })?)
}

/// The element ranges of `s.shard` holding trainable parameters, merged where adjacent.
///
/// # Errors
/// [`FsdpError::InvalidArgument`] when `s` has not one `requires_grad` flag per parameter; a
/// layout error.
pub(crate) fn trainable_ranges(s: &UnitShard) -> Result<Vec<Range<usize>>> {
    if s.requires_grad.len() != s.layout.num_params() {
        return Err(FsdpError::InvalidArgument(ArgumentError::Count {
            op: "optimizer step".into(),
            what: format!("unit `{}`'s requires_grad list (one per parameter)", s.path),
            counted: "flags",
            actual: s.requires_grad.len(),
            expected: s.layout.num_params(),
        }));
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

// ============================================================================ sums across ranks

pub(crate) use fsdp_autograd::kernels::optim::sum_sq;

/// All-reduces (sum) the f32 tensor `t` over the model's shard group on `stream` and returns
/// the collective; `None` when there is nothing to reduce (`NoShard`: every rank holds whole
/// parameters; or a group of one). Replicas (hybrid sharding) hold identical reduced gradients
/// and shards, so they never take part.
pub(crate) fn all_reduce_sum(
    model: &dyn ShardedParams,
    t: &Tensor,
    stream: &Stream,
) -> Result<Option<Work>> {
    let group = model.shard_group();
    if !model.is_sharded() || group.size() == 1 {
        return Ok(None);
    }
    let mem = f32_mem(t, "all_reduce", "a reduction buffer", stream)?;
    let slice = DeviceSlice::new(mem, DType::F32)?;
    Ok(Some(group.all_reduce(&slice, ReduceOp::Sum, stream)))
}

/// Reads an f32 tensor on `stream` (after everything launched there), then reports `work`'s
/// error if the collective failed. The readback is the one host wait: the collective was
/// launched on `stream` before the read, so it has finished once the read returns and its
/// outcome is taken without waiting again (a collective still running then is waited for).
pub(crate) fn read_after(t: &Tensor, stream: &Stream, work: Option<Work>) -> Result<Vec<f32>> {
    let v = with_stream(stream, || t.to_vec::<f32>());
    if let Some(w) = work {
        outcome(&w)?;
    }
    Ok(v?)
}

/// A collective's outcome: without waiting when it has finished, else after waiting.
pub(crate) fn outcome(w: &Work) -> Result<()> {
    match w.try_result() {
        Some(r) => Ok(r?),
        None => Ok(w.wait()?),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sum_of_squares_is_f64() {
        // 1e20² overflows f32 but not f64.
        assert_eq!(sum_sq(&[1e20, 0.0]), 1e20f32 as f64 * 1e20f32 as f64);
        assert_eq!(sum_sq(&[]), 0.0);
        assert_eq!(sum_sq(&[3.0, 4.0]), 25.0);
    }

    #[test]
    fn kernel_operands_are_typed_errors() {
        let dev = Device::cpu(0);
        let stream = fsdp_autograd::current_stream(&dev);
        let half = Tensor::zeros(&[2], DType::BF16, &dev).unwrap();
        assert!(matches!(
            f32_mem(&half, "t", "x", &stream),
            Err(FsdpError::Dtype(_))
        ));
        let m = Tensor::zeros(&[2, 3], DType::F32, &dev).unwrap();
        let mt = m.transpose(0, 1).unwrap();
        assert!(matches!(
            f32_mem(&mt, "t", "x", &stream),
            Err(FsdpError::InvalidArgument(_))
        ));
        let other = Tensor::zeros(&[2], DType::F32, &Device::cpu(1)).unwrap();
        assert!(matches!(
            f32_mem(&other, "t", "x", &stream),
            Err(FsdpError::Device(_))
        ));
        assert!(f32_mem(&m, "t", "x", &stream).is_ok());
    }
}
