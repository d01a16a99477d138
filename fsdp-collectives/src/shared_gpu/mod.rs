//! The shared-GPU backend: W thread ranks of one process whose devices are **the same GPU**
//! ([`SharedGpuGroup`]), for running a W-rank FSDP job — shard offsets, all-gathers landing in
//! another rank's buffer, reduce-scatters, per-rank memory, prefetch racing real streams — on
//! the one GPU at hand. NCCL refuses two ranks on one device, so this backend moves the data
//! itself.
//!
//! The kernels run on a host emulator in CI (bit-equal to the thread backend's fold,
//! `src/shared_gpu/tests.rs`) and are compiled by NVRTC (`cargo xtask nvrtc`); the GPU tests are
//! the `shared-gpu` suite of `cargo xtask gpu-test`. What has run on a GPU: `docs/GPU-STATUS.md`.
//!
//! ## What it does
//! - **One device, W allocators.** Each rank computes on its own `fsdp_alloc::Device::cuda(o)`
//!   (its own caching allocator, memory statistics and streams); all of them live in the
//!   device's primary CUDA context, so every rank's device addresses are valid on every rank's
//!   stream.
//! - **Rendezvous in process memory**, the thread backend's own ([`ThreadGroup`]'s arrival,
//!   middle and departure, with its validation, timeouts and dropped-rank detection), run on the
//!   issuing threads. Issuing a collective blocks until every rank has *issued* it (a host
//!   rendezvous, as NCCL's device path), never until it has *run*: when `all_gather_into`
//!   returns, every rank's part is enqueued on its stream, so waiting on any [`Work`] can never
//!   wait for a rank that has not issued yet. The rendezvous waits for the other rank threads,
//!   not for the device: it is not a host wait in the sense of
//!   `fsdp_alloc::stream::host_syncs` and is not counted. Nothing on the path waits for the
//!   device.
//! - **Stream/event contract of the NCCL group.** The collective runs after everything
//!   enqueued on the caller's stream before the call, and later work on that stream runs after
//!   it; [`Work::event`] orders other streams. Inside: each rank records a *ready* event on its
//!   stream at issue; after arrival every rank's stream waits (device-side, `cuStreamWaitEvent`)
//!   for the other ranks' ready events, runs this rank's kernels, records *done*; after the
//!   departure rendezvous it waits for every other rank's done event (no peer still reads this
//!   rank's input or writes what it reads), and the [`Work`]'s event is recorded after that.
//! - **Every rank pulls** (module `plan`): its kernels write only its own output.
//!   All-gather, broadcast and all-to-all are device-to-device copies of the peers' ranges into
//!   the rank's output (one `sg_copy` launch per rank and collective, 16-byte words where every
//!   address is aligned). Reduce-scatter is one `sg_reduce_*` launch reading chunk `rank` of
//!   every rank's input. All-reduce reduces this rank's chunk of every buffer into its own (in
//!   place), meets the others in the middle, then copies the others' reduced chunks.
//! - **Deterministic reductions**: the kernel folds the ranks in order 0, 1, …, W−1 with the
//!   thread backend's accumulators (f32 in f32; f16/bf16 widened to f32 and rounded once, or in
//!   their own precision rounded after every step; i32/i64 wrapping; average = sum / W), so in
//!   f32 a result is bit for bit the thread backend's, and the same for every W-way layout of
//!   the same data. Floats compile without FMA contraction or flush-to-zero. Known differences
//!   from the CPU fold: a sum involving NaNs gives the GPU's canonical NaN (the CPU keeps an
//!   operand's payload), and max/min of +0 and −0 may return either zero (Rust's `f32::max`
//!   leaves it unspecified too).
//! - **Errors** are the thread backend's, agreed on by every rank: size, dtype, root and alias
//!   rules, mismatched calls, dropped ranks, timeouts; buffers that are not device memory of the
//!   group's GPU, or a stream that is not a CUDA stream of it, are
//!   [`CollectiveError::InvalidBuffer`] on every rank. A rank whose stream had already failed
//!   does not take part (`StreamFailed`) and its peers fail at once (`PeerFailed`). Without the `cuda` feature, a CUDA
//!   driver, the device or NVRTC, [`SharedGpuGroup::new`] is a typed
//!   [`CollectiveError::CudaUnavailable`], never a panic.
//! - **`--profile`**: each collective is one GPU interval (category `"shared-gpu"`, named after
//!   the op) on the track of the stream it was issued on, from where the stream reaches it
//!   (waiting for the peers included) to the end of the rank's kernels.
//!
//! ## What it does not show
//! Link speeds. The data moves through the GPU's own memory (HBM bandwidth, shared by all W
//! ranks and their compute), not over NVLink or a network; a collective here costs what W
//! device-to-device copies or one reduction kernel cost, which says nothing about NCCL's rings
//! and trees on a real multi-GPU machine. Use it to check correctness, memory per rank, the
//! overlap structure of the trace and the host's behaviour — not communication time; the
//! planner's cost model (fsdp-core `plan/`) is what prices links. The W ranks also share the
//! GPU's SMs, so compute times are W ranks' worth of work on one device.
//!
//! ## Layout
//! - `group`: [`SharedGpuGroup`], [`SharedGpuConfig`]: the rendezvous, events and ordering.
//! - `plan`: which launches each rank makes, with which addresses and grids (pure arithmetic,
//!   shared with the emulator tests).
//! - `exec` (feature `cuda`): NVRTC compilation, the per-context module, kernel launches.
//! - `kernels.cu`: the CUDA C kernels; `emu/`: the host emulator that runs them in tests.
//!
//! [`ThreadGroup`]: crate::ThreadGroup
//! [`Work`]: crate::Work
//! [`Work::event`]: crate::Work::event
//! [`CollectiveError::InvalidBuffer`]: crate::CollectiveError::InvalidBuffer
//! [`CollectiveError::CudaUnavailable`]: crate::CollectiveError::CudaUnavailable

#[cfg(feature = "cuda")]
mod exec;
#[cfg(all(test, feature = "cuda"))]
mod gpu_tests;
mod group;
mod plan;
#[cfg(test)]
mod tests;

pub use group::{SharedGpuConfig, SharedGpuGroup, MAX_SHARED_GPU_RANKS};
