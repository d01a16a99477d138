//! The NCCL backend (`cuda` feature), over `cudarc::nccl`.
//!
//! `cargo xtask gpu-test` exercises it (the `nccl`, `fsdp` and `teardown` suites).
//!
//! ## Design
//! - One **communicator thread** per rank owns the CUDA context, a dedicated CUDA *comm stream*
//!   and every communicator of the rank (the world communicator and those made by
//!   [`ProcessGroup::split`](crate::ProcessGroup::split) with `ncclCommSplit`). cudarc's communicators are raw pointers that
//!   are not `Send`, so they never leave that thread; [`NcclGroup`] handles talk to it through a
//!   channel and are `Send + Sync`.
//! - Creation: rank 0 makes the NCCL unique id and publishes it in the [`TcpStore`](crate::TcpStore); the others
//!   read it from there (torchrun-style `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` with
//!   [`NcclGroup::from_env`]).
//! - **Device path** (the FSDP case): buffers in device memory ([`BufferRef::device_ptr`](fsdp_alloc::BufferRef::device_ptr)) and a
//!   CUDA stream of the group's device ([`Stream::cuda_stream`](fsdp_alloc::Stream::cuda_stream)). The communicator thread agrees
//!   on the descriptors with the other ranks (below), then enqueues the NCCL kernel directly on
//!   the caller's CUDA stream, reading and writing the buffers in place, and returns; the
//!   issuing thread records the [`Work`](crate::Work)'s event after it. So issuing blocks until every rank
//!   has *issued* the same collective (a small host rendezvous), never until it has *run*. The
//!   communicator thread keeps the buffers alive until the kernel's completion event fires and
//!   acts as watchdog (polling once per millisecond while kernels are pending).
//! - **Host path**: host buffers on a CPU stream. The collective runs as work on the stream,
//!   which hands it to the communicator thread and waits: the input is copied to a device
//!   staging buffer, reduced on the thread's internal stream, and copied back. Correct, not fast.
//!   Any other mix (device memory on a CPU stream, host memory on a CUDA stream, another
//!   device) is an [`CollectiveError::InvalidBuffer`] agreed on by every rank.
//! - **No hangs on bad calls.** Before each collective the ranks all-gather a small descriptor
//!   (kind, dtype, lengths, op, accumulation dtype, root) and run the same validation as the
//!   thread backend, so a bad call fails on every rank instead of deadlocking NCCL. A rank whose
//!   stream had failed before reaching the collective still takes part in that exchange,
//!   flagged, so its peers fail at once.
//! - A watchdog polls the comm stream (sleeping between polls) and `ncclCommGetAsyncError`;
//!   past the timeout it aborts the communicator, which then refuses further collectives.
//!
//! ## Reduction precision
//! With the accumulation dtype equal to the buffer dtype NCCL reduces natively (its order and
//! internal precision). f16/bf16 buffers with f32 accumulation (the default): on the host path
//! they are widened to f32, reduced by NCCL in f32, and rounded once; on the device path there is
//! no cast kernel in this crate, so NCCL reduces them natively in the buffer dtype — reduce f32
//! buffers (FSDP's `reduce_dtype`) when f32 accumulation matters.
//!
//! ## Layout
//! - `raw`: the raw NCCL/CUDA calls, their error mapping, and the communicator handle.
//! - `comm`: the communicator thread that owns every communicator of a rank.
//! - `group`: [`NcclGroup`], the [`crate::ProcessGroup`] over them.

mod comm;
mod group;
mod raw;

pub use group::{NcclConfig, NcclGroup};

use cudarc::nccl::sys;

use crate::error::{CollectiveError, Result};

/// Checks, without letting cudarc panic, that the CUDA driver and NCCL libraries can be loaded.
pub fn nccl_available() -> Result<()> {
    // SAFETY: `is_culib_present` only tries to dlopen the driver library and reports whether it
    // could; it has no preconditions.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CollectiveError::CudaUnavailable(
            "libcuda (the CUDA driver library) was not found; the NCCL backend needs a GPU \
             machine (use ThreadGroup on CPU)"
                .into(),
        ));
    }
    // SAFETY: as above, for libnccl.
    if !unsafe { sys::is_culib_present() } {
        return Err(CollectiveError::CudaUnavailable(
            "libnccl was not found; install NCCL or put it on the library path".into(),
        ));
    }
    Ok(())
}
