#![doc = include_str!("../README.md")]
//!
//! ## Crate layout
//!
//! - [`device`]: [`Device`] (CPU index or CUDA ordinal), its [`DeviceConfig`], its streams and
//!   its allocator.
//! - [`stream`]: [`Stream`] (an in-order asynchronous queue; on CPU a worker thread, on CUDA a
//!   CUDA stream), [`Event`], panic propagation along event dependencies.
//! - [`allocator`]: [`CachingAllocator`] — PyTorch CUDA caching-allocator semantics (512 B
//!   rounding, small/large pools, per-stream best fit, split and coalesce, `record_stream`
//!   deferred frees, free-cache-and-retry, `empty_cache`), [`MemoryStats`] with per-pool
//!   [`PoolStats`], [`CachingAllocator::snapshot`] and [`CachingAllocator::validate`].
//! - [`memory`]: raw segments and the guarded [`BufferRef`]; with the CUDA module, the only
//!   `unsafe` code, its invariants written at the top.
//! - [`trace`]: a process-wide timeline recorder (stream work, stream waits, host spans) written
//!   as a Chrome trace; near-zero cost when off.
//! - [`rate_limiter`]: [`RateLimiter`], the all-gather rate limiter (FSDP1 release events and
//!   FSDP2 explicit buffer lifetime).
//! - [`dtype`], [`error`]: the element-type vocabulary and [`AllocError`].
//! - `checked` (private): the checked mode's vector clocks and access histories.
//! - private leaves under `stream`, `checked` and `cuda` (so their imports form no cycle):
//!   `stream_id` ([`StreamId`]), `clock` (the vector clock), `health` (a stream's failure and
//!   clock, shared with what runs its work), `work` (running one launched job, used by CPU
//!   workers and the CUDA host-function trampoline).
//! - `cuda` (private, feature `cuda`): cudarc contexts, streams, events, host functions and
//!   `cuMemAlloc`/`cuMemFree`.
//!
//! ## Checked mode
//!
//! With `DeviceConfig { checked: true, .. }` every stream keeps a vector clock (which positions
//! of which streams it is ordered after, through `wait_event`, and through host threads that
//! observed an event complete before launching). Each guard taken inside launched work is an
//! access by (stream, job position); each segment remembers the last write and the reads since
//! then of each byte range. A read not ordered after the last write, or a write not ordered
//! after earlier reads and writes, fails with [`AllocError::OrderingViolation`] naming the block
//! and both streams — and fails the stream, so the bug surfaces at the next synchronize. A
//! block freed without `record_stream` and reused on its stream while another stream still
//! used it is reported as such ("freed allocation ... reused"). Host accesses outside launched
//! work are not checked, and ordering established without events (thread barriers, channels)
//! is invisible unless the code reports it with [`OrderPoint`] (as the thread backend's
//! collectives do at their rendezvous); keep other such code out of checked devices. FSDP
//! training on thread ranks runs clean on checked devices in every strategy (a test in
//! `fsdp-tests` pins it). The cost is a clock copy per launched job and a lock per guard, which
//! is why it is off by default.
//!
//! ## CUDA
//!
//! With the `cuda` feature, [`Device::cuda`] opens a GPU through cudarc (and returns
//! [`AllocError::CudaUnavailable`] when the driver library is absent) and
//! [`Device::cpu_pinned`] makes a CPU device whose segments are page-locked. Without the feature
//! both exist and return [`AllocError::CudaUnavailable`] (saying this build has no CUDA support),
//! so code that only names devices compiles either way. Three items exist only with the feature,
//! because their signatures name cudarc types: `Stream::cuda_stream` (the `CudaStream` under a
//! CUDA stream) and `trace::{gpu_begin, gpu_end, GpuMark}` (GPU intervals on the timeline). See the
//! `cuda` module notes in the source for what `launch` means there (a host function) and what is
//! not available (checked mode, host access to device memory).
#![deny(missing_docs)]

pub mod allocator;
mod checked;
mod clock;
#[cfg(feature = "cuda")]
mod cuda;
pub mod device;
mod device_id;
pub mod dtype;
pub mod error;
mod health;
mod host_waits;
pub mod memory;
pub mod rate_limiter;
pub mod stream;
mod stream_id;
pub mod trace;
mod work;

pub use allocator::{
    AllocatorConfig, BlockInfo, BlockState, Buffer, CachingAllocator, MemoryStats, Pool, PoolStats,
    SegmentInfo,
};
pub use checked::OrderPoint;
pub use device::{Device, DeviceConfig};
pub use device_id::DeviceId;
pub use dtype::DType;
pub use error::{AllocError, Capacity, Result};
pub use memory::{AccessHold, BufferRef, ReadGuard, WriteGuard};
pub use rate_limiter::{RateLimiter, RateLimiterStats};
pub use stream::{Event, Stream, StreamMode};
pub use stream_id::StreamId;
