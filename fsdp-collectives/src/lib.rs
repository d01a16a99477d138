#![doc = include_str!("../README.md")]
//!
//! ## Crate layout
//! - [`ProcessGroup`] ([`group`]): the backend-independent trait; [`Work`], [`DeviceSlice`],
//!   [`ReduceOp`] ([`types`]).
//! - [`ThreadGroup`] ([`thread`]): the embedded backend, W ranks as W threads; data moves
//!   directly between ranks' buffers, reductions fold in rank order (bitwise deterministic),
//!   dropped or failed ranks and timeouts become errors, optional [`LinkModel`].
//! - [`DeviceMesh`] ([`mesh`]): shard groups and replicate groups for hybrid sharding.
//! - [`TcpStore`] ([`store`]): rendezvous at `MASTER_ADDR:MASTER_PORT`, authenticated by a
//!   shared secret (`FSDP_STORE_SECRET`), bounded against hostile clients;
//!   [`store::LaunchEnv`] / [`RendezvousEnv`] read rank, world size and local rank from torchrun,
//!   `mpirun` (Open MPI, MPICH/PMI) or `srun`.
//! - `MpiGroup` (`mpi`, with the `mpi` feature): one rank per process over MPI; shared-memory
//!   windows inside a node, rank-ordered reductions (bit-equal to the thread backend).
//! - `NcclGroup` (`nccl`, with the `cuda` feature): the same trait over NCCL.
//! - [`SharedGpuGroup`] ([`shared_gpu`]): W thread ranks whose devices are one GPU (which NCCL
//!   refuses): device-to-device copies and a rank-ordered reduction kernel, bit-equal to the
//!   thread backend in f32; a typed error without the `cuda` feature or a GPU.
//! - [`HostStaged`] ([`staged`]): a thread or MPI group used from device buffers (MPI processes
//!   sharing a GPU): every collective copied to page-locked host memory, run there and copied
//!   back, in the order of the stream it is issued on.
//! - [`ProcessGroup::all_to_all_into`]: the personalized exchange with equal chunks (thread and
//!   MPI backends; NCCL through grouped `ncclSend`/`ncclRecv`), the wire
//!   of quantized reduce-scatters.
//! - [`Int8Codec`] ([`quant`]): int8 block quantization with a per-block f32 scale
//!   (ZeRO++-style), the codec of fsdp-core's quantized collectives.
//! - [`CollectiveBackend`], [`Launched`] and [`Seat`] ([`launch`]): one call that gives this
//!   process its ranks for a backend choice (thread, MPI, NCCL threads, NCCL processes, thread
//!   ranks sharing one GPU), each rank joining its group on its own thread (with host staging
//!   where a host backend meets GPU ranks: [`Seat::join_for`]).
//!
//! ## Reduction precision, per backend
//! - Thread backend: every (buffer, accumulation) pair in [`ReduceOp`]'s contract is computed
//!   exactly as stated: f32 accumulation rounds f16/bf16 once at the end; own-dtype
//!   accumulation rounds after every addition; ranks are folded in order 0..W.
//! - Shared-GPU backend ([`shared_gpu`]): the thread backend's folds and accumulators in a
//!   CUDA kernel, ranks in order 0..W, so the same bits (NaN payloads aside).
//! - NCCL backend (see `nccl`): NCCL reduces in its own order and internal
//!   precision, so results are deterministic only as far as NCCL makes them. With device
//!   buffers (the FSDP case) it reduces in the buffer dtype (there is no cast kernel in this
//!   crate: reduce f32 buffers when f32 accumulation matters); with host buffers, f32
//!   accumulation of f16/bf16 is honoured by widening on the staging path.
//!
//! ## Errors
//! One enum, [`CollectiveError`]. Argument errors are detected from the descriptors of *all*
//! ranks, so every rank of a bad collective reports the same error instead of hanging.
#![deny(missing_docs)]

mod desc;
pub mod error;
pub mod group;
mod kernels;
pub mod launch;
pub mod mesh;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "cuda")]
pub mod nccl;
mod op;
pub mod quant;
pub mod shared_gpu;
pub mod staged;
pub mod store;
pub mod thread;
pub mod types;

pub use error::{CollectiveError, Result};
pub use group::ProcessGroup;
pub use launch::{CollectiveBackend, Launched, Seat};
pub use mesh::DeviceMesh;
#[cfg(feature = "mpi")]
pub use mpi::{mpi_launched, MpiConfig, MpiGroup};
#[cfg(feature = "cuda")]
pub use nccl::{nccl_available, NcclConfig, NcclGroup};
pub use quant::Int8Codec;
pub use shared_gpu::{SharedGpuConfig, SharedGpuGroup};
pub use staged::HostStaged;
pub use store::{RendezvousEnv, StoreServer, TcpStore};
pub use thread::{GroupConfig, LinkModel, ThreadGroup};
pub use types::{default_accum, DeviceSlice, OpKind, ReduceOp, Work};
