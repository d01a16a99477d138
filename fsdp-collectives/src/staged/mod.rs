//! [`HostStaged`]: a group whose collectives run on host threads (the thread and MPI backends),
//! used from device memory by staging every collective through host memory.
//!
//! `mpirun -n 2 train_gpt --backend mpi --device cuda` puts two processes on GPUs (the same GPU
//! when there is one): their buffers are device memory, which MPI (and the thread backend) cannot
//! read. [`HostStaged`] wraps such a group and runs each collective in three parts, all in the
//! order of the stream it is issued on:
//!
//! 1. **device → host**: the bytes the collective reads (its input; the buffer of an all-reduce
//!    or broadcast) are copied into a staging buffer of the staging device, on the caller's
//!    stream (a CUDA stream: `cuMemcpyDtoHAsync` into page-locked memory; a CPU stream: a byte
//!    copy launched on it);
//! 2. **the host collective**: launched on the group's own stream of the staging device, which
//!    first waits (device-side) for the copy, then runs the wrapped group's collective on the
//!    staging buffers; the issuing thread **waits for it** (`Work::wait`: a host wait, counted
//!    by `fsdp_alloc::stream::host_syncs` like every other);
//! 3. **host → device**: the result is copied back into the caller's output on the caller's
//!    stream, and the returned [`Work`]'s event is recorded after that copy.
//!
//! The staging buffers keep the caller's aliasing: an in-place all-gather or reduce-scatter is
//! staged as one buffer with the input at the same offset inside the output (or the output
//! inside the input), so the wrapped group validates exactly what the caller passed, and every
//! rank agrees on the same typed errors (sizes, dtypes, roots, aliasing) as without staging.
//! Results are the wrapped group's bit for bit (the copies move bytes).
//!
//! **Why the issuing thread waits.** The copy back must run on the caller's stream after a
//! collective that runs on a host thread. A CUDA stream can only wait for host work through a
//! host function that blocks (`cuLaunchHostFunc`), and the CUDA driver may run the host
//! functions of all streams one at a time: a blocked one waiting for an MPI collective whose own
//! input copy waits behind another stream's host function would never return. Waiting on the
//! issuing thread instead costs one counted host wait per collective (and the overlap of
//! communication with later compute), and cannot deadlock: by the time the thread waits, every
//! copy the collective needs is already enqueued. This is a correctness path for processes that
//! share a GPU (NCCL refuses two ranks on one device), not a fast one: across real GPUs
//! `--backend nccl` moves the data on the device.
//!
//! **Placement.** Device memory must be on the stream's device and the stream a CUDA stream
//! (staging needs page-locked staging memory: [`fsdp_alloc::Device::cpu_pinned`]); host memory
//! is staged on any stream. A call whose buffers cannot be staged (device memory on a CPU
//! stream, another GPU's memory, a staging device that is not page-locked) still takes part in
//! the collective, with its own buffers, so that every rank fails with the wrapped group's
//! agreed placement error instead of waiting for this one.
//!
//! The same code stages CPU buffers (`cargo xtask mpi-test` runs FSDP through it on CPU
//! devices: [`HostStaged`] over `MpiGroup` equals the thread backend bit for bit); only the copy
//! function differs by device kind. `FSDP_HOST_STAGING=1` makes
//! [`Seat::join_for`](crate::Seat::join_for) stage CPU ranks too, for exactly that test.

#[cfg(all(test, feature = "cuda"))]
mod gpu_tests;

use std::sync::{Arc, Mutex};

use fsdp_alloc::{Buffer, BufferRef, Device, DeviceId, Event, Stream};

use crate::error::{CollectiveError, Result};
use crate::group::{fail_on_stream, ProcessGroup};
use crate::types::{DeviceSlice, OpKind, Outcome, ReduceOp, Work};

/// Alignment of the second staging range when input and output are staged apart (every element
/// type is at most 8 bytes; 16 keeps vector-width copies aligned).
const ALIGN: usize = 16;

/// One rank's handle to a host-side group (thread or MPI backend) used from device buffers; see
/// the [module docs](self). Cheap to share (`Arc<dyn ProcessGroup>`); [`ProcessGroup::split`]
/// stages the subgroups through the same staging device.
pub struct HostStaged {
    inner: Arc<dyn ProcessGroup>,
    /// The staging device: page-locked (`Device::cpu_pinned`) for CUDA buffers.
    host: Device,
    /// The stream staging buffers are allocated on. Nothing is ever launched on it, so it
    /// never fails: memory a failed stream touched could otherwise make a later allocation's
    /// stream wait for a failed event (and fail with it).
    alloc: Stream,
    /// The stream of `host` the wrapped collectives run on (replaced when it has failed; it
    /// owns no memory).
    stream: Mutex<Stream>,
    /// Staging buffers with the event recorded on the caller's stream after their last use
    /// there: each is freed once its event has completed (checked, never waited for, at each
    /// collective), so no copy can still touch a block the allocator hands out again.
    keep: Mutex<Vec<(Event, Buffer)>>,
}

impl std::fmt::Debug for HostStaged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostStaged")
            .field("inner", &self.inner)
            .field("staging", &self.host.id())
            .field("pinned", &self.host.is_pinned())
            .finish()
    }
}

impl Drop for HostStaged {
    fn drop(&mut self) {
        // A copy still queued on a caller's stream may read or write its staging buffer: leak
        // those few bytes rather than hand them out again (groups are dropped after their last
        // collective has been waited for, so this is almost never anything).
        let keep = std::mem::take(&mut *self.keep.lock().unwrap_or_else(|e| e.into_inner()));
        for (event, buf) in keep {
            if !event.query() {
                std::mem::forget(buf);
            }
        }
    }
}

/// Where a collective's staged buffers are, inside one staging allocation.
struct Layout {
    /// Bytes of the allocation.
    total: usize,
    /// Byte offset of the staged input, if the collective has one.
    input: Option<usize>,
    /// Byte offset of the staged output.
    output: usize,
}

impl Layout {
    /// The staging layout of `input`/`output`: overlapping buffers (in-place forms, or a bad
    /// alias the validation will reject) as one range covering both at the same relative
    /// offsets; separate buffers one after the other.
    fn of(input: Option<&DeviceSlice>, output: &DeviceSlice) -> Layout {
        let (out_seg, out_at) = output.data().location();
        match input {
            None => Layout {
                total: output.nbytes(),
                input: None,
                output: 0,
            },
            Some(i) if i.data().overlaps(output.data()) => {
                let (_, in_at) = i.data().location();
                let start = in_at.min(out_at);
                let end = (in_at + i.nbytes()).max(out_at + output.nbytes());
                debug_assert_eq!(i.data().location().0, out_seg);
                Layout {
                    total: end - start,
                    input: Some(in_at - start),
                    output: out_at - start,
                }
            }
            Some(i) => {
                let gap = i.nbytes().div_ceil(ALIGN) * ALIGN;
                Layout {
                    total: gap + output.nbytes(),
                    input: Some(0),
                    output: gap,
                }
            }
        }
    }
}

impl HostStaged {
    /// Stages the collectives of `inner` (a group whose collectives run on host threads: a
    /// `ThreadGroup` handle or an `MpiGroup`) through `staging`, a CPU device: page-locked
    /// ([`Device::cpu_pinned`]) for device buffers, any CPU device for host buffers.
    ///
    /// # Errors
    /// [`CollectiveError::InvalidGroup`] if `staging` is not a CPU device.
    pub fn new(inner: Arc<dyn ProcessGroup>, staging: Device) -> Result<HostStaged> {
        if !matches!(staging.id(), DeviceId::Cpu(_)) {
            return Err(CollectiveError::InvalidGroup {
                group: inner.name(),
                rank: inner.rank(),
                detail: format!(
                    "host staging needs a CPU staging device (page-locked for device buffers: \
                     Device::cpu_pinned), got {}",
                    staging.id()
                ),
            });
        }
        let stream = staging.new_stream("host-staging");
        let alloc = staging.new_stream("host-staging-alloc");
        Ok(HostStaged {
            inner,
            host: staging,
            alloc,
            stream: Mutex::new(stream),
            keep: Mutex::new(Vec::new()),
        })
    }

    /// The wrapped group.
    pub fn inner(&self) -> &Arc<dyn ProcessGroup> {
        &self.inner
    }

    /// The staging device.
    pub fn staging_device(&self) -> &Device {
        &self.host
    }

    /// The host stream for the next collective: a new one if the last one failed (a failed
    /// stream skips everything after it, and this rank must still take part in later
    /// collectives).
    fn host_stream(&self) -> Stream {
        let mut s = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        if s.check().is_err() {
            *s = self.host.new_stream("host-staging");
        }
        s.clone()
    }

    /// Drops the staging memory whose copies back have run (never waits).
    fn release_finished(&self) {
        self.keep
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(event, _)| !event.query());
    }

    /// Runs one collective through staging (see the module docs). `run` issues the wrapped
    /// group's collective on (input, output, host stream); the input of a one-buffer
    /// collective (all-reduce, broadcast) is its output.
    fn staged(
        &self,
        op: OpKind,
        input: Option<&DeviceSlice>,
        output: &DeviceSlice,
        stream: &Stream,
        run: impl FnOnce(&dyn ProcessGroup, &DeviceSlice, &DeviceSlice, &Stream) -> Work,
    ) -> Work {
        self.release_finished();
        let rank = self.inner.rank();
        let host_stream = self.host_stream();
        let mut buf = None;
        let staged = self.stage_in(op, input, output, stream, &mut buf);
        // The wrapped collective runs after the copy in (or, unstaged, after the caller's
        // stream's earlier work), on the host stream; a failed caller's stream fails the host
        // stream here, and the wrapped group then tells the peers this rank will not take part.
        host_stream.wait_event(&stream.record_event());
        let (work, local) = match &staged {
            Ok((sin, sout)) => (
                run(
                    &*self.inner,
                    sin.as_ref().unwrap_or(sout),
                    sout,
                    &host_stream,
                ),
                None,
            ),
            // Take part with the caller's own buffers: device memory gives every rank the
            // wrapped group's agreed placement error; host memory is correct as it is (the
            // collective runs after the stream's earlier work and needs no copy back).
            Err(e) => (
                run(&*self.inner, input.unwrap_or(output), output, &host_stream),
                Some(e.clone()),
            ),
        };
        let seq = work.seq();
        let outcome: Outcome = Arc::new(Mutex::new(None));
        // The one host wait of the collective (counted by `Work::wait`).
        let result = match (work.wait(), local) {
            (Ok(()), _) => Ok(()),
            (Err(e), None) => Err(e),
            (Err(_), Some(local)) => Err(local),
        };
        let result = result.and_then(|()| match &staged {
            Ok((_, sout)) => copy(stream, sout.data(), output.data(), op, rank),
            Err(_) => Ok(()),
        });
        let work = match result {
            Ok(()) => {
                *outcome.lock().unwrap_or_else(|e| e.into_inner()) = Some(Ok(()));
                Work::new(op, rank, seq, stream.record_event(), outcome)
            }
            Err(e) => fail_on_stream(op, rank, seq, stream, outcome, e),
        };
        if let Some(buf) = buf {
            // Freed once the caller's stream has passed its last copy (run or skipped).
            self.keep
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((work.event().clone(), buf));
        }
        work
    }

    /// Allocates the staging buffer of a call (into `keep`, so that every path frees it only
    /// after the caller's stream is done with it) and enqueues the copy in on `stream`; an
    /// error if the call's buffers cannot be staged (see the module docs).
    fn stage_in(
        &self,
        op: OpKind,
        input: Option<&DeviceSlice>,
        output: &DeviceSlice,
        stream: &Stream,
        keep: &mut Option<Buffer>,
    ) -> Result<(Option<DeviceSlice>, DeviceSlice)> {
        let rank = self.inner.rank();
        for s in input.into_iter().chain(Some(output)) {
            self.check_placement(op, s.data(), stream)?;
        }
        let layout = Layout::of(input, output);
        let buf_err = |source| CollectiveError::Buffer { op, rank, source };
        let buf = keep.insert(
            self.host
                .alloc(layout.total, &self.alloc)
                .map_err(buf_err)?,
        );
        let at = |off: usize, s: &DeviceSlice| -> Result<DeviceSlice> {
            let data = buf.data().slice(off, s.nbytes()).map_err(buf_err)?;
            DeviceSlice::new(data, s.dtype())
        };
        let sout = at(layout.output, output)?;
        let sin = match (input, layout.input) {
            (Some(i), Some(off)) => Some(at(off, i)?),
            _ => None,
        };
        // The bytes the collective reads: its input, else its one buffer.
        let (from, to) = match (input, &sin) {
            (Some(i), Some(s)) => (i.data(), s.data()),
            _ => (output.data(), sout.data()),
        };
        copy(stream, from, to, op, rank)?;
        Ok((sin, sout))
    }

    /// Whether `b` can be staged on `stream`: host memory always; device memory of the stream's
    /// own GPU on a CUDA stream, with a page-locked staging device.
    fn check_placement(&self, op: OpKind, b: &BufferRef, stream: &Stream) -> Result<()> {
        if b.device_ptr().is_none() {
            return Ok(());
        }
        let problem = if b.device() != stream.device() {
            Some(format!(
                "device memory of {} issued on a stream of {}",
                b.device(),
                stream.device()
            ))
        } else if !is_cuda(stream) {
            Some(format!(
                "device memory on stream `{}`, which is not a CUDA stream",
                stream.name()
            ))
        } else if !self.host.is_pinned() {
            Some(format!(
                "device memory, but the staging device {} is not page-locked (make it with \
                 Device::cpu_pinned)",
                self.host.id()
            ))
        } else {
            None
        };
        match problem {
            None => Ok(()),
            Some(detail) => Err(CollectiveError::InvalidBuffer {
                op,
                rank: self.inner.rank(),
                detail: format!("host staging: {detail}"),
            }),
        }
    }
}

/// Copies `from` into `to` (same length) in `stream`'s order: a byte copy launched on the
/// stream when both are host memory; an asynchronous CUDA copy between device memory and
/// page-locked host memory otherwise.
fn copy(stream: &Stream, from: &BufferRef, to: &BufferRef, op: OpKind, rank: usize) -> Result<()> {
    debug_assert_eq!(from.len(), to.len());
    if from.is_empty() {
        return Ok(());
    }
    match (from.device_ptr(), to.device_ptr()) {
        (None, None) => {
            let (from, to) = (from.clone(), to.clone());
            stream.launch_named("host-staging copy", move || {
                let src = from
                    .read::<u8>()
                    .unwrap_or_else(|e| panic!("host staging: reading the source: {e}"));
                to.write::<u8>()
                    .unwrap_or_else(|e| panic!("host staging: writing the copy: {e}"))
                    .copy_from_slice(&src);
            });
            Ok(())
        }
        _ => cuda::copy(stream, from, to, op, rank),
    }
}

#[cfg(feature = "cuda")]
fn is_cuda(stream: &Stream) -> bool {
    stream.cuda_stream().is_some()
}

#[cfg(not(feature = "cuda"))]
fn is_cuda(_stream: &Stream) -> bool {
    false
}

/// The asynchronous copies between device memory and page-locked staging memory.
#[cfg(feature = "cuda")]
mod cuda {
    use fsdp_alloc::{BufferRef, Stream};

    use crate::error::{CollectiveError, Result};
    use crate::types::OpKind;

    /// `cuMemcpyDtoHAsync` or `cuMemcpyHtoDAsync` of `from` into `to` on `stream` (one is
    /// device memory of the stream's GPU, the other page-locked host memory: `stage_in`
    /// checked the placement; the copy back reverses a checked pair).
    pub(super) fn copy(
        stream: &Stream,
        from: &BufferRef,
        to: &BufferRef,
        op: OpKind,
        rank: usize,
    ) -> Result<()> {
        let bad = |detail: &str| CollectiveError::InvalidBuffer {
            op,
            rank,
            detail: format!("host staging: {detail}"),
        };
        let cs = stream
            .cuda_stream()
            .ok_or_else(|| bad("device memory on a stream that is not a CUDA stream"))?;
        let driver = |call: &'static str| {
            move |e: cudarc::driver::DriverError| CollectiveError::Cuda {
                call,
                rank,
                message: format!("{op} (host staging): {e}"),
            }
        };
        cs.context()
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))?;
        let bytes = from.len();
        let mark = fsdp_alloc::trace::gpu_begin(stream.device(), cs);
        let (call, name, r) = match (from.device_ptr(), to.pinned_ptr(), from.pinned_ptr()) {
            (Some(src), Some(dst), _) => (
                "cuMemcpyDtoHAsync",
                "staging d2h",
                // SAFETY: `src..src + bytes` is device memory of this stream's context (placement
                // checked), live and ordered on this stream by the caller's contract (as for any
                // kernel on it); `dst..dst + bytes` is page-locked memory of a staging buffer
                // the group holds (`keep`) until an event recorded on this stream after the
                // copy has completed; the copy is ordered on `cs`.
                unsafe {
                    cudarc::driver::sys::cuMemcpyDtoHAsync_v2(
                        dst as *mut std::ffi::c_void,
                        src,
                        bytes,
                        cs.cu_stream(),
                    )
                }
                .result(),
            ),
            (None, _, Some(src)) => {
                let dst = to
                    .device_ptr()
                    .ok_or_else(|| bad("a copy back between two host ranges on a CUDA copy"))?;
                (
                    "cuMemcpyHtoDAsync",
                    "staging h2d",
                    // SAFETY: as above, with the page-locked staging range as the source and
                    // the caller's device output (checked placement) as the destination.
                    unsafe {
                        cudarc::driver::sys::cuMemcpyHtoDAsync_v2(
                            dst,
                            src as *const std::ffi::c_void,
                            bytes,
                            cs.cu_stream(),
                        )
                    }
                    .result(),
                )
            }
            _ => {
                return Err(bad(
                    "a copy between device memory and host memory that is not page-locked",
                ))
            }
        };
        fsdp_alloc::trace::gpu_end(mark, stream.name(), "copy", name.into());
        r.map_err(driver(call))
    }
}

/// Without CUDA there is no device memory to stage.
#[cfg(not(feature = "cuda"))]
mod cuda {
    use fsdp_alloc::{BufferRef, Stream};

    use crate::error::{CollectiveError, Result};
    use crate::types::OpKind;

    pub(super) fn copy(
        _stream: &Stream,
        _from: &BufferRef,
        _to: &BufferRef,
        op: OpKind,
        rank: usize,
    ) -> Result<()> {
        Err(CollectiveError::InvalidBuffer {
            op,
            rank,
            detail: "host staging: device memory in a build without CUDA support".into(),
        })
    }
}

impl ProcessGroup for HostStaged {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn name(&self) -> String {
        format!("{} (host-staged)", self.inner.name())
    }

    fn all_gather_into(&self, input: &DeviceSlice, output: &DeviceSlice, stream: &Stream) -> Work {
        self.staged(
            OpKind::AllGather,
            Some(input),
            output,
            stream,
            |g, i, o, s| g.all_gather_into(i, o, s),
        )
    }

    fn reduce_scatter_with(
        &self,
        input: &DeviceSlice,
        output: &DeviceSlice,
        op: ReduceOp,
        accum: fsdp_alloc::DType,
        stream: &Stream,
    ) -> Work {
        self.staged(
            OpKind::ReduceScatter,
            Some(input),
            output,
            stream,
            |g, i, o, s| g.reduce_scatter_with(i, o, op, accum, s),
        )
    }

    fn all_reduce_with(
        &self,
        buf: &DeviceSlice,
        op: ReduceOp,
        accum: fsdp_alloc::DType,
        stream: &Stream,
    ) -> Work {
        self.staged(OpKind::AllReduce, None, buf, stream, |g, _, o, s| {
            g.all_reduce_with(o, op, accum, s)
        })
    }

    fn broadcast(&self, buf: &DeviceSlice, root: usize, stream: &Stream) -> Work {
        self.staged(OpKind::Broadcast, None, buf, stream, |g, _, o, s| {
            g.broadcast(o, root, s)
        })
    }

    fn all_to_all_into(&self, input: &DeviceSlice, output: &DeviceSlice, stream: &Stream) -> Work {
        self.staged(
            OpKind::AllToAll,
            Some(input),
            output,
            stream,
            |g, i, o, s| g.all_to_all_into(i, o, s),
        )
    }

    fn barrier(&self) -> Result<()> {
        self.inner.barrier()
    }

    fn split(&self, parts: &[Vec<usize>]) -> Result<Arc<dyn ProcessGroup>> {
        let inner = self.inner.split(parts)?;
        Ok(Arc::new(HostStaged::new(inner, self.host.clone())?))
    }
}
