//! The CUDA backend (feature `cuda`): the crate's only foreign-function code.
//!
//! - A CUDA [`crate::Device`] owns a `cudarc` [`CudaContext`] (the primary context of the
//!   ordinal) with cudarc's per-slice event tracking disabled: this crate never creates
//!   `CudaSlice`s, and its allocator and streams already order every block, so cudarc's extra
//!   events would only double-synchronize.
//! - A CUDA [`crate::Stream`] wraps a [`CudaStream`]. `launch(work)` enqueues `work` as a host
//!   function (`cuLaunchHostFunc`): it runs in stream order on a driver thread, after all work
//!   enqueued before it and before all work enqueued after it. As CUDA requires, such work must
//!   not call the CUDA API; a panic inside it fails the stream like on CPU.
//! - Events are CUDA events (`cuEventRecord`, `cuStreamWaitEvent`, `cuEventQuery`,
//!   `cuEventSynchronize`). Waiting a CUDA stream on a pending *CPU* event enqueues a host
//!   function that blocks until that event completes.
//! - Page-locked host segments (a CPU device built with `Device::cpu_pinned`) are
//!   `cuMemHostAlloc(PORTABLE)` / `cuMemFreeHost`, zero-filled like every CPU segment: host code
//!   reads and writes them through guards as usual, and copy engines reach them asynchronously
//!   (`cuMemcpyHtoDAsync` / `cuMemcpyDtoHAsync`, issued by fsdp-autograd's CUDA kernels).
//! - Raw segments are `cuMemAlloc` / `cuMemFree`. Device memory is not host-accessible:
//!   `BufferRef::read`/`write` refuse it and `BufferRef::device_ptr` gives kernels the address.
//!   It starts uninitialized (unlike CPU segments, which start zeroed).
//!
//! The checked mode is CPU-only (CUDA streams keep no vector clock).

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream};

use crate::error::{AllocError, Result};
use crate::health::Health;
use crate::work::{run_work, Work};

/// A CUDA stream under a [`crate::Stream`].
pub(crate) struct StreamBackend(Arc<CudaStream>);

impl StreamBackend {
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.0
    }
}

/// A CUDA event under an [`crate::Event`].
pub(crate) struct EventBackend(CudaEvent);

/// Opens `cuda:ordinal`: its primary context (event tracking off) and its default stream.
pub(crate) fn open(ordinal: usize) -> Result<(Arc<CudaContext>, StreamBackend)> {
    // SAFETY: `is_culib_present` only attempts to load the driver library and reports whether
    // it could; it has no precondition. Checking it first keeps cudarc from panicking later.
    if !unsafe { sys::is_culib_present() } {
        return Err(AllocError::CudaUnavailable(format!(
            "cuda:{ordinal}: the CUDA driver library (libcuda) was not found; install the NVIDIA \
             driver or use a CPU device"
        )));
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| {
        AllocError::CudaUnavailable(format!(
            "cuda:{ordinal}: could not create a context: {e}; check the ordinal and the driver"
        ))
    })?;
    // SAFETY: disabling tracking only affects CudaSlices created afterwards, which would then
    // not insert their own events; this crate creates none — every block's cross-stream use is
    // ordered by our streams' events and the allocator's record_stream bookkeeping.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.default_stream();
    Ok((ctx, StreamBackend(stream)))
}

/// A new CUDA stream of `ctx`; the driver's error if it refuses.
pub(crate) fn new_backend(ctx: &Arc<CudaContext>) -> std::result::Result<StreamBackend, String> {
    ctx.new_stream()
        .map(StreamBackend)
        .map_err(|e| e.to_string())
}

/// The default stream of `ctx` (a stand-in under a stream the driver refused to create).
pub(crate) fn default_backend(ctx: &Arc<CudaContext>) -> StreamBackend {
    StreamBackend(ctx.default_stream())
}

struct HostJob {
    work: Work,
    pos: u64,
    health: Arc<Health>,
}

/// Called by the CUDA driver, once, for each host function enqueued by [`launch_host`].
unsafe extern "C" fn host_trampoline(arg: *mut c_void) {
    // SAFETY: `arg` is the pointer `Box::into_raw` produced in `launch_host`; the driver calls a
    // successfully enqueued host function exactly once, so the box is reclaimed exactly once.
    let job = unsafe { Box::from_raw(arg.cast::<HostJob>()) };
    // `run_work` catches panics, so no unwind crosses this `extern "C"` boundary.
    run_work(job.work, job.pos, None, &job.health);
}

/// Enqueues `work` on the CUDA stream as a host function.
pub(crate) fn launch_host(
    s: &StreamBackend,
    work: Work,
    pos: u64,
    health: &Arc<Health>,
) -> std::result::Result<(), String> {
    s.0.context()
        .bind_to_thread()
        .map_err(|e| format!("binding the CUDA context: {e}"))?;
    let job = Box::into_raw(Box::new(HostJob {
        work,
        pos,
        health: Arc::clone(health),
    }));
    // SAFETY: the stream handle is valid for the life of `s.0`; `host_trampoline` matches the
    // CUhostFn signature and takes ownership of `job` when the driver runs it.
    let r = unsafe {
        result::stream::launch_host_function(s.0.cu_stream(), host_trampoline, job.cast())
    };
    if let Err(e) = r {
        // SAFETY: enqueueing failed, so the driver will never call the trampoline; we still own
        // the box and reclaim it here.
        drop(unsafe { Box::from_raw(job) });
        return Err(format!("cuLaunchHostFunc failed: {e}"));
    }
    Ok(())
}

/// Records a CUDA event at the current end of the stream.
pub(crate) fn record(s: &StreamBackend) -> std::result::Result<EventBackend, String> {
    s.0.record_event(None)
        .map(EventBackend)
        .map_err(|e| format!("cuEventRecord failed: {e}"))
}

/// Makes the CUDA stream wait for the CUDA event `ev` (`cuStreamWaitEvent`). Waiting on a
/// CPU event is `Stream::wait_event`'s business (a host function, see [`launch_host`]).
pub(crate) fn wait_event(s: &StreamBackend, ev: &EventBackend) -> std::result::Result<(), String> {
    s.0.wait(&ev.0)
        .map_err(|e| format!("cuStreamWaitEvent failed: {e}"))
}

/// True once the event's work completed (a query error counts as complete; the error surfaces
/// at synchronize).
pub(crate) fn query(ev: &EventBackend) -> bool {
    ev.0.try_is_complete().unwrap_or(true)
}

/// Blocks until the event completes.
pub(crate) fn synchronize(ev: &EventBackend) -> std::result::Result<(), String> {
    ev.0.synchronize()
        .map_err(|e| format!("cuEventSynchronize failed: {e}"))
}

/// One `cuMemAlloc` allocation, freed with `cuMemFree` on drop.
pub(crate) struct DeviceMemory {
    ptr: sys::CUdeviceptr,
    size: usize,
    ctx: Arc<CudaContext>,
}

impl DeviceMemory {
    /// `cuMemAlloc(size)`; the driver's error (typically out of memory) as a string.
    pub(crate) fn alloc(ctx: &Arc<CudaContext>, size: usize) -> std::result::Result<Self, String> {
        ctx.bind_to_thread().map_err(|e| e.to_string())?;
        // SAFETY: the context is bound to this thread; the memory is only ever handed to device
        // kernels through `BufferRef::device_ptr` (never read by the host), so it being
        // uninitialized is not observable as a Rust value.
        let ptr = unsafe { result::malloc_sync(size.max(1)) }.map_err(|e| e.to_string())?;
        Ok(DeviceMemory {
            ptr,
            size: size.max(1),
            ctx: Arc::clone(ctx),
        })
    }

    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return; // the context is gone; nothing can be freed
        }
        // Work on any stream may still use the block (device kernels hold raw pointers): wait
        // for the device, as PyTorch does before returning memory to the driver (a host wait
        // of the dropping thread, counted like every other).
        crate::host_waits::count_host_sync();
        let _ = self.ctx.synchronize();
        // SAFETY: `ptr` came from `malloc_sync` in this context and is freed exactly once (here);
        // the last `Arc<Segment>` is gone, so no `BufferRef` can hand it out any more, and the
        // device was synchronized just above.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// One `cuMemHostAlloc` allocation: page-locked host memory, portable to every context,
/// zero-filled at allocation, freed with `cuMemFreeHost` on drop.
pub(crate) struct PinnedMemory {
    ptr: NonNull<u8>,
    size: usize,
    ctx: Arc<CudaContext>,
}

impl PinnedMemory {
    /// `cuMemHostAlloc(size, CU_MEMHOSTALLOC_PORTABLE)`, then zero-filled; the driver's error
    /// (typically out of memory) as a string.
    pub(crate) fn alloc(ctx: &Arc<CudaContext>, size: usize) -> std::result::Result<Self, String> {
        let size = size.max(1);
        ctx.bind_to_thread().map_err(|e| e.to_string())?;
        // SAFETY: the context is bound to this thread; the call only writes the out pointer.
        let raw = unsafe { result::malloc_host(size, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(|e| e.to_string())?;
        let ptr = NonNull::new(raw.cast::<u8>())
            .ok_or_else(|| "cuMemHostAlloc returned a null pointer".to_string())?;
        // SAFETY: `ptr` is the start of a fresh host allocation of `size` bytes that nothing
        // else references yet; zeroing it makes every byte initialized (the CPU segments'
        // invariant 3 in `memory.rs`).
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, size) };
        Ok(PinnedMemory {
            ptr,
            size,
            ctx: Arc::clone(ctx),
        })
    }

    /// The host address of the first byte.
    pub(crate) fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }
}

impl Drop for PinnedMemory {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return; // the context is gone; the driver reclaimed the memory with it
        }
        // Copy engines may still use the memory (asynchronous copies hold raw addresses): wait
        // for the device, as for device memory (a counted host wait).
        crate::host_waits::count_host_sync();
        let _ = self.ctx.synchronize();
        // SAFETY: `ptr` came from `malloc_host` and is freed exactly once (here); the last
        // `Arc<Segment>` is gone, so no `BufferRef` or guard refers to it any more, and the
        // device was synchronized just above.
        let _ = unsafe { result::free_host(self.ptr.as_ptr().cast()) };
    }
}
