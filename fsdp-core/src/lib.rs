//! # fsdp-core: Fully Sharded Data Parallel for Rust
//!
//! Wrap a model built from [`fsdp_autograd::nn`] modules with [`Fsdp::wrap`] on every rank; each
//! FSDP *unit* (chosen by a [`WrapPolicy`]) is flattened with the flatten-concat-chunk layout of
//! [`fsdp_flatparam`], sharded over the ranks of a [`fsdp_collectives::ProcessGroup`], gathered
//! just before it computes and freed right after, and its gradient is reduce-scattered as soon as
//! it is final — communication on its own streams, overlapping compute.
//!
//! # Crate layout
//! - [`wrap`]: unit planning (policies, the paper's assignment rule, shared parameters).
//! - [`config`]: strategies, prefetch modes, buffer lifetime.
//! - [`Fsdp`]: the runtime (hooks, unshard / reshard / reduce, mixed precision, gradient
//!   accumulation with and without communication, CPU offload, SGD on shards).
//! - [`optim`]: sharded SGD / AdamW / LAMB (state sharded like the parameters) and their local
//!   twins; [`clip`]: global and exact per-parameter gradient norms across shards;
//!   [`scaler`]: the sharded gradient scaler; [`state_dict`]: full, sharded and local state dicts
//!   (safetensors on disk), optimizer state likewise; [`checkpoint`]: all-or-nothing training
//!   checkpoints (model, optimizer, scaler, metadata) with keep-last-K and resume.
#![deny(missing_docs)]

pub mod clip;
pub mod config;
pub mod error;
mod fsdp;
mod handle;
pub mod optim;
pub mod scaler;
pub mod state_dict;
pub mod wrap;

pub use clip::{clip_grad_norm, grad_norm, grad_norms_per_param, param_norms_per_param};
pub use config::{
    BackwardPrefetch, BufferLifetime, DeferredInit, FsdpConfig, MixedPrecision, ShardingStrategy,
};
pub use error::{FsdpError, Result};
pub use fsdp::{tensor_slice, Comm, CommStats, Fsdp, FullParameter, UnitShard};
pub use optim::{
    AdamParams, AdamW, Lamb, LocalAdamW, LocalLamb, LocalOptimizer, LocalSgd, Sgd,
    ShardedOptimizer, ShardedParams,
};
pub use scaler::{GradScalerConfig, LocalGradScaler, ShardedGradScaler};
pub use state_dict::checkpoint;
pub use state_dict::{FullStateDict, OptimState, ShardedStateDict, StateDictError};
pub use wrap::{plan_units, ModuleInfo, UnitPlan, WrapPolicy};
