#![doc = include_str!("../README.md")]
//!
//! # How it works
//! Given a model, a cluster and a batch, the planner predicts every FSDP configuration's
//! per-rank peak memory and step time, drops the ones that do not fit, and ranks the rest by
//! predicted step time.
//!
//! - [`ModelDesc`]: units (parameter counts, as [`fsdp_core::Fsdp::wrap`] builds them) and the
//!   forward sequence of leaf computations (FLOPs and saved activation bytes per token);
//!   [`ModelDesc::gpt`] derives it from a [`fsdp_autograd::nn::GptConfig`] and a
//!   [`fsdp_core::WrapPolicy`], [`ModelDesc::llama`] from a
//!   [`fsdp_autograd::nn::LlamaConfig`].
//! - [`Cluster`]: nodes × ranks per node, device memory, compute rate, and intra-/inter-node
//!   [`Link`]s under the alpha-beta model; [`Batch`]: sequences per rank and their length.
//! - [`PlanConfig`]: one candidate (strategy, sharding factor F, backward prefetch, forward
//!   prefetch, rate limiter); [`Planner::candidates`] enumerates FullShard, ShardGradOp,
//!   NoShard and HybridShard with every F dividing W (1 < F < W), each with every prefetch and
//!   limiter setting.
//! - [`Planner::estimate`] replays one steady-state step as FSDP issues it (module `simulate`):
//!   the hooks in autograd's order drive a compute stream, an unshard stream, a reduce stream
//!   and one in-order link per process group; collectives cost `latency + ring bytes /
//!   bandwidth` (all-gather and reduce-scatter `M(n−1)/n`, all-reduce twice that); the rate
//!   limiter blocks the issuing thread as `fsdp_alloc::RateLimiter` does. So the overlap of
//!   communication with computation — FSDP's critical path — comes out of the schedule, with
//!   the paper's backward-prefetch effect (without it, the next all-gather queues behind the
//!   current reduce-scatter). The same walk counts allocated bytes in host order (allocator
//!   rounding to 512 B included) for the peak: shards, sharded gradients, optimizer slots,
//!   unsharded units in flight, flat gradients, activations.
//! - [`Planner::plan`]: every candidate estimated, the feasible ones (peak × (1 + headroom) ≤
//!   device memory) ranked by step time.
//!
//! - [`Hardware`] (presets [`Hardware::a100_80gb`], [`Hardware::h100_80gb`], every constant
//!   citing a vendor specification or a public GEMM/NCCL measurement): attached with
//!   [`Planner::with_hardware`], compute becomes a per-leaf roofline (`max(FLOPs / (peak of the
//!   compute dtype × GEMM efficiency), activation bytes / HBM bandwidth)`) and collectives are
//!   priced as NCCL's cost model prices its ring (and tree, for all-reduce) over nodes of
//!   NVLink joined by a network ([`Hardware::collective_time`], [`Cluster::group_shape`]): so
//!   per-GPU throughput vs cluster size comes out of the model. [`ModelDesc::gpt`] describes a
//!   GPT of any size without allocating it, [`ModelDesc::encoder_decoder`] a T5-style model;
//!   [`ModelDesc::with_activation_bytes`] for bf16 activations and
//!   [`Planner::with_activation_checkpointing`] for per-block recomputation.
//! - [`Planner::merged_table`] merges candidates whose predictions print the same into one row
//!   naming the settings that do not matter; [`Planner::bound`] says what bounds the top plan
//!   (compute, intra-node link, inter-node link, memory).
//!
//! Limits: without [`Hardware`], compute is `FLOPs / rate` (give the rate measured on the
//! model's own kernels); with it, a roofline per leaf that knows nothing of kernel launch
//! overheads, of communication kernels slowing the compute they overlap (they share SMs and
//! HBM), or of the allocator's retries when memory runs out (the paper's 128-GPU batch-2 case); the host thread is assumed to run ahead of the
//! device (true for FSDP's eager hooks unless the limiter blocks it), one link per group with no
//! contention between groups, and the memory model counts what fsdp-autograd's GPT and Llama ops
//! save; a
//! model described by hand must give its own activation figures.
#![deny(missing_docs)]

mod candidate;
mod cluster;
mod encdec;
mod error;
mod hardware;
mod llama;
mod model;
mod report;
mod search;
mod simulate;
#[cfg(test)]
mod tests;

pub use candidate::PlanConfig;
pub use cluster::{
    cross_node_bytes, ring_all_gather_bytes, ring_all_reduce_bytes, Batch, Cluster, GroupShape,
    Link,
};
pub use encdec::EncDecConfig;
pub use error::PlanError;
pub use hardware::{
    Collective, Hardware, NCCL_NET_STEP_LATENCY_US, NCCL_NVLINK_STEP_LATENCY_US,
    NCCL_RING_BASE_LATENCY_US, NCCL_TREE_BANDWIDTH_FRACTION, PRESETS,
};
pub use llama::llama_modules;
pub use model::{gpt_modules, Leaf, ModelDesc, UnitDesc};
pub use report::{merge_rows, Bound, MergedRow};
pub use search::{PlanEstimate, Planner};
pub use simulate::{MemoryBreakdown, StepEstimate};
