#![doc = include_str!("../README.md")]
//!
//! # Crate layout, bottom to top
//! - [`error`]: [`FsdpError`], a leaf (it imports nothing from the crate).
//! - What a run is told: [`strategy`] (the strategy table, [`STRATEGIES`]: every property of
//!   a [`ShardingStrategy`]), [`wrap`] (unit planning: [`WrapPolicy`], the paper's assignment
//!   rule, shared parameters; pure, no tensors), [`config`] ([`FsdpConfig`]: strategy, wrap
//!   policy, prefetch modes, rate limiter, buffer lifetime, mixed precision, offload,
//!   quantization).
//! - The runtime (private `runtime/`, its public types re-exported here): [`Fsdp`] — the
//!   hooks, the execution order and the prefetch decisions; each unit's own work (unshard,
//!   reshard, reduce its gradient, mixed precision, CPU offload copies) is done by its
//!   `FlatParamHandle` within a communication context (streams, groups, rate limiter);
//!   gradient accumulation with and without communication.
//! - [`optim`], the optimizer step's wing, above the runtime: update rules (SGD, AdamW, LAMB)
//!   run by a sharded driver (state sharded like the parameters) and a local one;
//!   [`optim::clip`] (also [`clip`]): global and exact per-parameter gradient norms across
//!   shards; [`optim::scaler`] (also [`scaler`]): the sharded gradient scaler; below all three,
//!   [`ShardedParams`]: what they need of a wrapped model, the f32 kernel launches and the sum
//!   over the shard group.
//! - [`state_dict`], at the top: full, sharded and local state dicts (safetensors on disk),
//!   optimizer state likewise; [`checkpoint`]: all-or-nothing training checkpoints (model,
//!   optimizer, scaler, metadata) with keep-last-K and resume.
//! - [`plumbing`]: low-level helpers for code that issues its own collectives on tensors.
//!
//! The cost-model planner that chooses among strategies is the `fsdp-plan` crate, above this
//! one.
#![deny(missing_docs)]

pub mod config;
pub mod error;
pub mod optim;
mod runtime;
pub mod state_dict;
pub mod strategy;
pub mod wrap;

pub use config::{AdaptiveLimiter, LimitAllGathers, Quantization};
pub use config::{
    BackwardPrefetch, BufferLifetime, DeferredInit, FsdpConfig, MixedPrecision, ShardingStrategy,
};
pub use error::{FsdpError, Result};
pub use optim::clip::{clip_grad_norm, grad_norm, grad_norms_per_param, param_norms_per_param};
pub use optim::scaler::{GradScalerConfig, LocalGradScaler, ShardedGradScaler};
pub use optim::{clip, scaler};
pub use optim::{
    AdamParams, AdamW, Lamb, LocalAdamW, LocalLamb, LocalOptimizer, LocalSgd, Sgd,
    ShardedOptimizer, ShardedParams,
};
pub use runtime::fsdp::LimiterStatus;
pub use runtime::fsdp::{Comm, CommStats, Fsdp, FullParameter, ParamBytes, UnitInfo, UnitShard};
pub use state_dict::checkpoint;
pub use state_dict::{FullStateDict, OptimState, ShardedStateDict, StateDictError};
pub use strategy::{ShardOver, StrategySpec, STRATEGIES};
pub use wrap::{plan_units, ModuleInfo, UnitPlan, WrapPolicy};

/// Low-level helpers for code that runs its own collectives on [`fsdp_autograd::Tensor`]s (a
/// training loop all-reducing a metric, say). Training with [`Fsdp`] does not need them.
pub mod plumbing {
    pub use crate::runtime::comm::tensor_slice;
}
