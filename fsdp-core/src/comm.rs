//! The communication context every unit's runtime runs in: the device and its streams, the
//! process groups, the all-gather rate limiter, and the bookkeeping of issued collectives
//! (their [`Work`]s, buffers whose release waits on an event, byte statistics).
//!
//! One [`CommContext`] exists per wrapped model (per rank). [`crate::handle::FlatParamHandle`]'s
//! methods take it to unshard, reshard and reduce a unit; `fsdp.rs` decides *when* they run.

use std::sync::{Arc, Mutex, MutexGuard};

use fsdp_alloc::{Buffer, DType, Device, Event, RateLimiter, Stream};
use fsdp_autograd::{no_grad, with_stream, Tensor};
use fsdp_collectives::{DeviceSlice, ProcessGroup, ReduceOp, Work};

use crate::config::BufferLifetime;
use crate::error::{FsdpError, Result};

/// Bytes moved by this rank's collectives since wrapping (or the last reset).
///
/// Every figure counts the bytes of the buffers as communicated, in the dtype they are
/// communicated in: under mixed precision, bf16/f16 all-gathers and reductions count 2 bytes
/// per element.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommStats {
    /// Bytes written into this rank's all-gather outputs.
    pub all_gather_bytes: u64,
    /// Bytes of this rank's reduce-scatter inputs.
    pub reduce_scatter_bytes: u64,
    /// Bytes of this rank's all-reduce buffers.
    pub all_reduce_bytes: u64,
    /// Number of all-gathers issued.
    pub num_all_gathers: u64,
}

/// What the context records about collectives it issued (start with `Ledger::default()`).
#[derive(Default)]
pub(crate) struct Ledger {
    /// Collectives whose errors have not been checked yet.
    works: Vec<Work>,
    /// Explicit-lifetime buffers waiting for their consumer's event (no rate limiter).
    deferred: Vec<(Buffer, Event)>,
    /// Bytes communicated.
    stats: CommStats,
}

/// Streams, groups and limiter of one rank's FSDP runtime (see the module docs).
pub(crate) struct CommContext {
    /// The compute device.
    pub device: Device,
    /// The compute stream (the device's current stream when wrapping).
    pub compute: Stream,
    /// CPU offload: the host device holding shards and sharded gradients. Without offload, the
    /// compute device.
    pub host: Device,
    /// Where the shards live and the optimizer runs: the host device's stream under CPU offload,
    /// else the compute stream.
    pub host_stream: Stream,
    /// CPU offload is on.
    pub offload: bool,
    /// The stream all-gathers run on.
    pub unshard_stream: Stream,
    /// The stream reductions run on.
    pub reduce_stream: Stream,
    /// The group parameters are sharded over (the shard group for HybridShard).
    pub group: Arc<dyn ProcessGroup>,
    /// HybridShard: the replicate group gradients are all-reduced over.
    pub replicate: Option<Arc<dyn ProcessGroup>>,
    /// Parameters are sharded (every strategy but NoShard): unshard gathers, reshard frees.
    pub sharded: bool,
    /// How gathered buffers are kept alive for the streams that read them.
    pub buffer_lifetime: BufferLifetime,
    /// Dtype gradients are communicated in.
    pub reduce_dtype: DType,
    /// Bounds in-flight all-gathers (`limit_all_gathers` with a sharded strategy).
    pub limiter: Option<RateLimiter>,
    /// Issued collectives, deferred buffers, statistics.
    pub ledger: Mutex<Ledger>,
}

impl CommContext {
    fn ledger(&self) -> MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes communicated so far.
    pub fn stats(&self) -> CommStats {
        self.ledger().stats
    }

    /// Keeps `work` until its error is checked ([`CommContext::check_works`],
    /// [`CommContext::take_works`]).
    fn track(&self, work: Work) {
        self.ledger().works.push(work);
    }

    /// Returns the first error among completed collectives; keeps the running ones.
    pub fn check_works(&self) -> Result<()> {
        let mut l = self.ledger();
        let mut keep = Vec::with_capacity(l.works.len());
        let mut first = Ok(());
        for w in std::mem::take(&mut l.works) {
            if w.is_completed() {
                if let (Err(e), true) = (w.wait(), first.is_ok()) {
                    first = Err(e.into());
                }
            } else {
                keep.push(w);
            }
        }
        l.works = keep;
        first
    }

    /// Every collective not checked yet (the caller waits on them).
    pub fn take_works(&self) -> Vec<Work> {
        std::mem::take(&mut self.ledger().works)
    }

    /// Issues the all-gather of `input` (this rank's chunk) into `out` on the unshard stream,
    /// counting `out`'s bytes; returns the gather's completion event.
    pub fn all_gather(&self, input: &Tensor, out: &DeviceSlice, out_bytes: usize) -> Result<Event> {
        let work = self
            .group
            .all_gather_into(&tensor_slice(input)?, out, &self.unshard_stream);
        let ev = work.event().clone();
        let mut l = self.ledger();
        l.works.push(work);
        l.stats.all_gather_bytes += out_bytes as u64;
        l.stats.num_all_gathers += 1;
        Ok(ev)
    }

    /// Issues the reduce-scatter (sum) of `grad` over the shard group into `out` on the reduce
    /// stream, counting `grad`'s bytes in its dtype.
    pub fn reduce_scatter(&self, grad: &Tensor, out: &Tensor) -> Result<()> {
        let w = self.group.reduce_scatter(
            &tensor_slice(grad)?,
            &tensor_slice(out)?,
            ReduceOp::Sum,
            &self.reduce_stream,
        );
        self.ledger().stats.reduce_scatter_bytes += tensor_bytes(grad);
        self.track(w);
        Ok(())
    }

    /// Issues the all-reduce (sum) of `t` in place over `group` on the reduce stream, counting
    /// `t`'s bytes in its dtype.
    pub fn all_reduce(&self, group: &Arc<dyn ProcessGroup>, t: &Tensor) -> Result<()> {
        let w = group.all_reduce(&tensor_slice(t)?, ReduceOp::Sum, &self.reduce_stream);
        self.ledger().stats.all_reduce_bytes += tensor_bytes(t);
        self.track(w);
        Ok(())
    }

    /// Frees explicit-lifetime buffers whose consumers are done.
    pub fn drop_released_buffers(&self) {
        self.ledger().deferred.retain(|(_, ev)| !ev.query());
    }

    /// Releases a gathered buffer the compute stream read, according to the buffer lifetime:
    /// `record_stream` (the allocator defers reuse) or kept until `consumed` completes (by the
    /// rate limiter, or in the context's deferred list without one).
    pub fn release_gathered(&self, mut buf: Buffer, consumed: Event) {
        match self.buffer_lifetime {
            BufferLifetime::RecordStream => {
                buf.record_stream(&self.compute);
                drop(buf);
                if let Some(l) = &self.limiter {
                    l.release(consumed);
                }
            }
            BufferLifetime::Explicit => match &self.limiter {
                Some(l) => l.release_buffer(buf, consumed),
                None => self.ledger().deferred.push((buf, consumed)),
            },
        }
    }

    /// The shard as a tensor on the compute device: itself, or (CPU offload) a copy made on
    /// `stream` after `ready` (the last optimizer update).
    pub fn shard_on_device(
        &self,
        shard: &Tensor,
        stream: &Stream,
        ready: &Event,
    ) -> Result<Tensor> {
        if !self.offload {
            return Ok(shard.clone());
        }
        stream.wait_event(ready);
        let dev = with_stream(stream, || {
            Tensor::empty(&[shard.numel()], DType::F32, &self.device)
        })?;
        copy_tensor(shard, &dev, stream)?;
        Ok(dev)
    }
}

/// `t` in `dtype`: itself, or a cast launched on `stream` (outside autograd).
pub(crate) fn cast_on(stream: &Stream, t: Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() == dtype {
        Ok(t)
    } else {
        Ok(with_stream(stream, || no_grad(|| t.to_dtype(dtype)))?)
    }
}

/// Bytes of `t`'s elements in its dtype.
fn tensor_bytes(t: &Tensor) -> u64 {
    (t.numel() * t.dtype().size()) as u64
}

/// The memory of `t` (its elements, in its dtype) as a [`DeviceSlice`] for collectives.
///
/// # Errors
/// [`FsdpError::State`] if the tensor's storage is released (no memory attached); an access
/// error if the tensor does not fit its buffer.
pub fn tensor_slice(t: &Tensor) -> Result<DeviceSlice> {
    let r = t.storage().buffer_ref().ok_or_else(|| {
        FsdpError::State(
            "a tensor given to a collective has no memory attached (its storage was released); \
             pass a tensor whose storage is allocated"
                .into(),
        )
    })?;
    let size = t.dtype().size();
    let r = r.slice(t.offset() * size, t.numel() * size)?;
    Ok(DeviceSlice::new(r, t.dtype())?)
}

/// All-gathers `t` (this rank's chunk) over `group` on `stream` into a new tensor of
/// `group.size() × t.numel()` elements of `device`, and waits for it on the host.
pub(crate) fn gather_flat(
    group: &Arc<dyn ProcessGroup>,
    t: &Tensor,
    stream: &Stream,
    device: &Device,
) -> Result<Tensor> {
    let full = with_stream(stream, || {
        Tensor::zeros(&[group.size() * t.numel()], t.dtype(), device)
    })?;
    group
        .all_gather_into(&tensor_slice(t)?, &tensor_slice(&full)?, stream)
        .wait()?;
    Ok(full)
}

/// Copies `src` into `dst` (contiguous f32 tensors of equal length, possibly on different CPU
/// devices) as work launched on `stream`. Between a CUDA device and a CPU host the copy goes
/// through the kernel seam instead ([`crate::offload::copy_across`]).
pub(crate) fn copy_tensor(src: &Tensor, dst: &Tensor, stream: &Stream) -> Result<()> {
    if src.numel() != dst.numel() {
        return Err(FsdpError::InvalidArgument(format!(
            "copy of {} elements into {}",
            src.numel(),
            dst.numel()
        )));
    }
    if crate::offload::needs_seam_copy(src.device().id(), dst.device().id()) {
        return crate::offload::copy_across(src, dst, stream);
    }
    let (s, d) = (tensor_slice(src)?, tensor_slice(dst)?);
    let (s, d) = (s.data().clone(), d.data().clone());
    stream.launch(move || {
        let s = s.read::<f32>().expect("offload copy: source unreadable");
        let mut d = d
            .write::<f32>()
            .expect("offload copy: destination unwritable");
        d.copy_from_slice(&s);
    });
    Ok(())
}
