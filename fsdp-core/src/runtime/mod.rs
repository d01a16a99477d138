//! The FSDP runtime: everything that runs while a wrapped model trains.
//!
//! - `units`: the public unit descriptions and the module-tree walks.
//! - `handle`: one `FlatParamHandle` per unit (shard, unshard, reshard, gradient hooks).
//! - `comm`: the per-model communication context (streams, groups, rate limiter, statistics).
//! - `offload`: copies between a compute device and a CPU offload device.
//! - `fsdp`: [`Fsdp`](crate::Fsdp), the wrapper that drives the units through a step.
//!
//! Optimizers, clipping, the grad scaler and the state dicts live outside this
//! folder and depend on it, never the reverse.

pub(crate) mod comm;
pub(crate) mod fsdp;
pub(crate) mod handle;
pub(crate) mod offload;
pub(crate) mod units;
