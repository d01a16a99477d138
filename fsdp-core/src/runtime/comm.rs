//! The communication context every unit's runtime runs in: the device and its streams, the
//! process groups, the all-gather rate limiter, and the bookkeeping of issued collectives
//! (their [`Work`]s, buffers whose release waits on an event, byte statistics).
//!
//! One [`CommContext`] exists per wrapped model (per rank). [`crate::runtime::handle::FlatParamHandle`]'s
//! methods take it to unshard, reshard and reduce a unit; `fsdp.rs` decides *when* they run.

use std::sync::{Arc, Mutex, MutexGuard};

use fsdp_alloc::{Buffer, DType, Device, Event, RateLimiter, Stream};
use fsdp_autograd::{no_grad, with_stream, Tensor};
use fsdp_collectives::{DeviceSlice, Int8Codec, ProcessGroup, ReduceOp, Work};

use crate::config::{AdaptiveLimiter, BufferLifetime};
use crate::error::{FsdpError, Result, StateError};

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

/// The all-gather rate limiter's state ([`crate::Fsdp::limiter_status`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LimiterStatus {
    /// The limiter runs in the adaptive mode ([`crate::LimitAllGathers::Auto`]).
    pub adaptive: bool,
    /// The limiter bounds all-gathers now (always true for `On`, never for `Off`).
    pub active: bool,
    /// Times the adaptive limiter turned on.
    pub turned_on: u64,
    /// Times the adaptive limiter turned off again.
    pub turned_off: u64,
    /// Clean iterations the adaptive limiter needs now to turn off (doubles each time it has to
    /// turn back on); 0 when not adaptive.
    pub clean_iterations_to_disable: usize,
    /// All-gathers issued through the limiter (each may have waited for a release).
    pub limited_all_gathers: u64,
    /// Of those, how many had to wait.
    pub blocked_all_gathers: u64,
}

/// The adaptive limiter's state machine (see [`crate::LimitAllGathers::Auto`]).
#[derive(Debug)]
pub(crate) struct AutoLimit {
    /// The configured clean streak.
    base: usize,
    state: Mutex<AutoState>,
}

#[derive(Debug, Default)]
struct AutoState {
    active: bool,
    /// Clean iterations in a row while active.
    clean: usize,
    /// Clean iterations needed to turn off.
    needed: usize,
    /// The allocator's `num_alloc_retries` when last looked at.
    seen_retries: u64,
    /// A retry happened in the current iteration.
    retried: bool,
    turned_on: u64,
    turned_off: u64,
}

impl AutoLimit {
    /// Starts off, with the device's current retry count as the baseline.
    pub fn new(config: AdaptiveLimiter, device: &Device) -> AutoLimit {
        let base = config.clean_iterations_to_disable.max(1);
        AutoLimit {
            base,
            state: Mutex::new(AutoState {
                needed: base,
                seen_retries: device.memory_stats().num_alloc_retries,
                ..AutoState::default()
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, AutoState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Looks at the allocator's retries: any new one turns the limiter on (at once, mid
    /// iteration). Returns whether the limiter is on.
    fn poll(&self, st: &mut AutoState, device: &Device) -> bool {
        let retries = device.memory_stats().num_alloc_retries;
        if retries > st.seen_retries {
            st.seen_retries = retries;
            st.retried = true;
            st.clean = 0;
            if !st.active {
                st.active = true;
                st.turned_on += 1;
                if st.turned_off > 0 {
                    // It was needed again after turning off: demand a longer clean streak.
                    st.needed = (st.needed * 2).min(self.base.saturating_mul(1024));
                }
            }
        }
        st.active
    }

    /// Before an all-gather: whether to go through the limiter.
    pub fn active(&self, device: &Device) -> bool {
        let mut st = self.lock();
        self.poll(&mut st, device)
    }

    /// At the start of an iteration: closes the previous one (retries since the last look,
    /// e.g. in the optimizer step, still count for it), counts a clean one, turns off after
    /// enough of them.
    pub fn iteration_start(&self, device: &Device) {
        let mut st = self.lock();
        self.poll(&mut st, device);
        if st.active && !st.retried {
            st.clean += 1;
            if st.clean >= st.needed {
                st.active = false;
                st.clean = 0;
                st.turned_off += 1;
            }
        }
        st.retried = false;
    }

    fn status(&self) -> (bool, u64, u64, usize) {
        let st = self.lock();
        (st.active, st.turned_on, st.turned_off, st.needed)
    }
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
    /// CPU offload: the compute device's stream every host↔device copy runs on (uploads of
    /// shards, downloads of reduced gradients), ordered by events. Without offload, the
    /// compute stream (unused).
    pub copy_stream: Stream,
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
    /// Bounds in-flight all-gathers (`limit_all_gathers` or the adaptive limiter, with a
    /// sharded strategy).
    pub limiter: Option<RateLimiter>,
    /// The adaptive limiter: `limiter` is used only while it says so; while it is off,
    /// everything runs exactly as without a limiter.
    pub auto_limit: Option<AutoLimit>,
    /// Int8 quantization of all-gathers and reduce-scatters.
    pub quant: Option<Int8Codec>,
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

    /// The limiter that bounds all-gathers right now (`None` when off, or adaptive and off).
    fn active_limiter(&self) -> Option<&RateLimiter> {
        let l = self.limiter.as_ref()?;
        match &self.auto_limit {
            Some(a) if !a.active(&self.device) => None,
            _ => Some(l),
        }
    }

    /// Before issuing an all-gather: waits for the limiter when it is on.
    pub fn acquire_for_all_gather(&self) -> Result<()> {
        if let Some(l) = self.active_limiter() {
            l.acquire()?;
        }
        Ok(())
    }

    /// The start of an iteration (the first forward after a backward): the adaptive limiter's
    /// clock.
    pub fn iteration_start(&self) {
        if let Some(a) = &self.auto_limit {
            a.iteration_start(&self.device);
        }
    }

    /// The limiter's state.
    pub fn limiter_status(&self) -> LimiterStatus {
        let counters = self.limiter.as_ref().map(RateLimiter::stats);
        let (limited, blocked) = counters.map_or((0, 0), |c| (c.acquires, c.blocked));
        match &self.auto_limit {
            Some(a) => {
                let (active, on, off, needed) = a.status();
                LimiterStatus {
                    adaptive: true,
                    active,
                    turned_on: on,
                    turned_off: off,
                    clean_iterations_to_disable: needed,
                    limited_all_gathers: limited,
                    blocked_all_gathers: blocked,
                }
            }
            None => LimiterStatus {
                active: self.limiter.is_some(),
                limited_all_gathers: limited,
                blocked_all_gathers: blocked,
                ..LimiterStatus::default()
            },
        }
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
            // A finished collective's outcome is read without waiting (no host sync).
            match w.try_result() {
                Some(Err(e)) if first.is_ok() => first = Err(e.into()),
                Some(_) => {}
                None => keep.push(w),
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

    /// The int8 all-gather of `input` (this rank's f32 chunk of `n` values) into `out` (an f32
    /// slice of `W·n` values) on the unshard stream: quantize the chunk into one packet
    /// ([`Int8Codec`]), all-gather the W packets as bytes, dequantize each into its chunk of
    /// `out`. Counts the packets' bytes; returns the event after the dequantization.
    pub fn all_gather_int8(
        &self,
        codec: Int8Codec,
        input: &Tensor,
        out: &DeviceSlice,
    ) -> Result<Event> {
        let stream = &self.unshard_stream;
        let (n, w) = (input.numel(), self.group.size());
        let packet = codec.packed_len(n);
        let send = self.device.alloc(packet, stream)?;
        let recv = self.device.alloc(w * packet, stream)?;
        launch_encode(stream, codec, tensor_slice(input)?, &send, n, 1);
        let work = self.group.all_gather_into(
            &DeviceSlice::from_buffer(&send, DType::U8)?,
            &DeviceSlice::from_buffer(&recv, DType::U8)?,
            stream,
        );
        let (packets, dst) = (recv.data().clone(), out.data().clone());
        stream.launch(move || {
            let packets = packets
                .read::<u8>()
                .expect("int8 all-gather: packets unreadable");
            let mut dst = dst
                .write::<f32>()
                .expect("int8 all-gather: output unwritable");
            for (p, chunk) in packets.chunks_exact(packet).zip(dst.chunks_exact_mut(n)) {
                codec
                    .decode(p, chunk)
                    .expect("int8 all-gather: packet sizes are fixed by the layout");
            }
        });
        let done = stream.record_event();
        // Both staging buffers are used only by work launched on this stream so far (the
        // collective's peers finish reading `send` before it completes): stream order makes
        // them reusable at once.
        drop((send, recv));
        let mut l = self.ledger();
        l.works.push(work);
        l.stats.all_gather_bytes += (w * packet) as u64;
        l.stats.num_all_gathers += 1;
        Ok(done)
    }

    /// The int8 reduce-scatter (sum) of the f32 `grad` (`W·n` values) into `out` (`n` f32
    /// values) on the reduce stream: quantize each destination chunk into a packet, exchange
    /// the packets with an all-to-all, and sum the W dequantized chunks in f32 in rank order
    /// (every contribution is quantized once; errors do not compound across ranks). Counts the
    /// packets' bytes.
    pub fn reduce_scatter_int8(&self, codec: Int8Codec, grad: &Tensor, out: &Tensor) -> Result<()> {
        let stream = &self.reduce_stream;
        let (n, w) = (out.numel(), self.group.size());
        let packet = codec.packed_len(n);
        let send = self.device.alloc(w * packet, stream)?;
        let recv = self.device.alloc(w * packet, stream)?;
        launch_encode(stream, codec, tensor_slice(grad)?, &send, n, w);
        let work = self.group.all_to_all_into(
            &DeviceSlice::from_buffer(&send, DType::U8)?,
            &DeviceSlice::from_buffer(&recv, DType::U8)?,
            stream,
        );
        let (packets, dst) = (recv.data().clone(), tensor_slice(out)?.data().clone());
        stream.launch(move || {
            let packets = packets
                .read::<u8>()
                .expect("int8 reduce: packets unreadable");
            let mut dst = dst.write::<f32>().expect("int8 reduce: output unwritable");
            for (src, p) in packets.chunks_exact(packet).enumerate() {
                let r = if src == 0 {
                    codec.decode(p, &mut dst)
                } else {
                    codec.decode_add(p, &mut dst)
                };
                r.expect("int8 reduce: packet sizes are fixed by the layout");
            }
        });
        // As in `all_gather_int8`: only this stream's work used them.
        drop((send, recv));
        self.ledger().stats.reduce_scatter_bytes += (w * packet) as u64;
        self.track(work);
        Ok(())
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
    /// rate limiter when it is on, or in the context's deferred list without one).
    pub fn release_gathered(&self, mut buf: Buffer, consumed: Event) {
        let limiter = self.active_limiter();
        match self.buffer_lifetime {
            BufferLifetime::RecordStream => {
                buf.record_stream(&self.compute);
                drop(buf);
                if let Some(l) = limiter {
                    l.release(consumed);
                }
            }
            BufferLifetime::Explicit => match limiter {
                Some(l) => l.release_buffer(buf, consumed),
                None => self.ledger().deferred.push((buf, consumed)),
            },
        }
    }
}

/// The memory of `t` (its elements, in its dtype) as a [`DeviceSlice`] for collectives.
///
/// # Errors
/// [`StateError::StorageReleased`] if the tensor's storage is released (no memory attached);
/// an access error if the tensor does not fit its buffer.
pub fn tensor_slice(t: &Tensor) -> Result<DeviceSlice> {
    let r = t.storage().buffer_ref().ok_or_else(|| {
        FsdpError::State(StateError::StorageReleased {
            op: "tensor_slice".into(),
            what: "a tensor given to a collective".into(),
        })
    })?;
    let size = t.dtype().size();
    let r = r.slice(t.offset() * size, t.numel() * size)?;
    Ok(DeviceSlice::new(r, t.dtype())?)
}

/// Launches the quantization of `chunks` consecutive chunks of `n` f32 values of `src` into
/// `chunks` packets of `dst` on `stream`.
fn launch_encode(
    stream: &Stream,
    codec: Int8Codec,
    src: DeviceSlice,
    dst: &Buffer,
    n: usize,
    chunks: usize,
) {
    let (src, dst) = (src.data().clone(), dst.data().clone());
    let packet = codec.packed_len(n);
    stream.launch(move || {
        let x = src.read::<f32>().expect("int8 quantize: input unreadable");
        let mut d = dst
            .write::<u8>()
            .expect("int8 quantize: packets unwritable");
        for (vals, p) in x
            .chunks_exact(n.max(1))
            .zip(d.chunks_exact_mut(packet.max(1)))
            .take(chunks)
        {
            codec
                .encode(vals, p)
                .expect("int8 quantize: packet sizes are fixed by the layout");
        }
    });
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

#[cfg(test)]
mod tests {
    use super::*;
    use fsdp_alloc::{Capacity, DeviceConfig};

    /// Makes the allocator of `dev` (capped at 64 MiB, PyTorch policy) free its cache and retry:
    /// 40 MiB cached for one stream cannot be handed to another, and a second 40 MiB segment
    /// does not fit under the cap.
    fn force_retries(dev: &Device, a: &Stream, b: &Stream) {
        drop(dev.alloc(40 << 20, a).unwrap());
        drop(dev.alloc(40 << 20, b).unwrap());
    }

    #[test]
    fn the_adaptive_limiter_follows_the_retries_with_a_growing_clean_streak() {
        let dev = Device::cpu_with(
            4242,
            DeviceConfig::default()
                .with_capacity(Capacity::Bytes(64 << 20))
                .with_compact(false),
        );
        let (a, b) = (dev.new_stream("a"), dev.new_stream("b"));
        let auto = AutoLimit::new(
            AdaptiveLimiter {
                clean_iterations_to_disable: 2,
            },
            &dev,
        );
        assert!(!auto.active(&dev), "starts off");
        auto.iteration_start(&dev);
        assert!(!auto.active(&dev), "clean iterations keep it off");

        force_retries(&dev, &a, &b);
        assert!(dev.memory_stats().num_alloc_retries > 0);
        assert!(auto.active(&dev), "a retry turns it on at once");
        auto.iteration_start(&dev); // closes the iteration that retried
        auto.iteration_start(&dev); // clean 1
        assert!(auto.active(&dev));
        auto.iteration_start(&dev); // clean 2: off
        assert!(!auto.active(&dev), "off after 2 clean iterations");
        assert_eq!(auto.status(), (false, 1, 1, 2));

        // Needed again: on, and now it takes 4 clean iterations to turn off.
        force_retries(&dev, &a, &b);
        assert!(auto.active(&dev));
        assert_eq!(auto.status(), (true, 2, 1, 4));
        auto.iteration_start(&dev);
        for clean in 1..4 {
            auto.iteration_start(&dev);
            assert!(auto.active(&dev), "still on after {clean} clean iterations");
        }
        // Retries in the optimizer step (between iterations) count for the iteration before.
        force_retries(&dev, &a, &b);
        auto.iteration_start(&dev);
        assert!(auto.active(&dev), "the streak starts over");
        for _ in 0..4 {
            auto.iteration_start(&dev);
        }
        assert!(!auto.active(&dev));
        assert_eq!(auto.status(), (false, 2, 2, 4));
    }
}
