//! # fsdp-init: deferred initialization, bit-identical to eager init
//!
//! Build a model far larger than one device without allocating anything, then materialize it —
//! whole, one FSDP unit at a time, or only one rank's shard of each unit — with exactly the
//! values eager init would have produced.
//!
//! ## How
//!
//! * **The fake device** is [`InitContext::fake`]: building any module there allocates nothing;
//!   every [`Parameter`] records its [`InitOp`]s (fill, uniform, normal, truncated normal,
//!   Kaiming/Xavier with the fan from the shape, scale, orthogonal, copy-from another parameter,
//!   named closures over the whole tensor).
//! * **Counter-based RNG**: element `i` of op `k` of parameter `fqn` is a pure function of
//!   `(seed, fqn, k, i)` (Philox4x32-10), so any element range can be generated alone
//!   ([`fill_positionwise`]) and eager init — which runs the same code ([`fill_whole`]) — gives the
//!   same bits.
//! * **Replay**: an [`InitPlan`] knows every parameter by name and turns each one's ops into a
//!   recipe; `CopyFrom` chains are followed to their sources, which are always regenerated from
//!   their recorded ops (position-wise sources for any element range).
//!
//! ## What lives where, and why
//!
//! This crate re-exports the whole deferred-init API, so depending on `fsdp-init` alone is enough
//! to record, evaluate and replay init ops:
//!
//! | item | defined in | why there |
//! |---|---|---|
//! | [`InitPlan`], [`materialize`], [`materialize_unit`], [`materialize_shard`], [`stream_shard`], [`MaterializeError`] | this crate | replay onto devices, unit by unit or shard by shard: deferred init's own job |
//! | [`InitOp`], [`FanMode`], [`Nonlinearity`], [`CustomInit`], [`InitError`], [`compute_fans`] | `fsdp_autograd::init` (`ops.rs`, `error.rs`) | nn layers declare their init with them |
//! | the counter-based RNG ([`fnv1a64`] and the stream layout), [`fill_positionwise`], [`apply_positionwise`], [`fill_whole`], [`last_overwrite`] | `fsdp_autograd::init` (`rng.rs`, `fill.rs`, `orthogonal.rs`) | eager init runs them while a layer is built |
//! | [`erfc`], [`ndtr`], [`ndtri`] | `fsdp_autograd::init` (`special.rs`) | the truncated normal needs them |
//! | [`InitContext`], [`Parameter`] | `fsdp_autograd` | every layer creates its parameters through them |
//! | [`Device`], [`DType`] | `fsdp_alloc` | the target of materialization, the parameter dtype |
//!
//! The core cannot move here: eager init ([`InitContext::eager`]) evaluates the same ops when a
//! layer is built, so `fsdp-autograd` needs it, and this crate depends on `fsdp-autograd` (it
//! materializes into its `Tensor`s and walks its `Module`s). Keeping the core below both crates
//! is what guarantees eager and deferred init run the same code, bit for bit.
//!
//! Used alone, without naming another crate of ours:
//!
//! ```
//! use fsdp_init::{fill_positionwise, materialize_unit, DType, Device, InitContext, InitOp};
//!
//! let ctx = InitContext::fake(7);
//! let w = ctx.param("w", &[4, 8], DType::F32, vec![InitOp::Normal { mean: 0.0, std: 0.02 }])?;
//! materialize_unit(std::slice::from_ref(&w), &Device::cpu(0))?;
//! // Host-side evaluation of the same ops, for any element range, gives the same bits.
//! let mut tail = vec![0.0f32; 8];
//! fill_positionwise(w.init_ops(), 7, "w", &[4, 8], 24, &mut tail)?;
//! assert_eq!(w.get()?.to_vec::<f32>()?[24..], tail[..]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Entry points
//!
//! | what | function | peak device memory |
//! |---|---|---|
//! | whole model | [`materialize`], [`InitPlan::materialize_all`] | the model |
//! | one unit's parameters | [`materialize_unit`], [`InitPlan::materialize_unit`] | the unit |
//! | unit → shard (build, shard, free) | [`InitPlan::materialize_unit_sharded`] | shards so far + one unit |
//! | shard only | [`materialize_shard`], [`InitPlan::materialize_shard`] | shards so far (+ one whole parameter for `Orthogonal` and `Custom` ops) |
//! | streaming an existing model | [`stream_shard`] ([`InitPlan::materialize_shard`] on materialized parameters) | shards so far |
//!
//! Cross-unit dependencies (a `CopyFrom` whose source is in another unit) are detected
//! ([`InitPlan::cross_unit_dependencies`]): replayed when the source is position-wise, refused
//! with [`MaterializeError::CrossUnitDependency`] (naming both parameters and suggesting one
//! unit) when the source needs a whole-tensor op.
//!
//! ```
//! use fsdp_alloc::Device;
//! use fsdp_autograd::{nn::{named_parameters, Gpt, GptConfig}, InitContext};
//! use fsdp_flatparam::FlatParamLayout;
//! use fsdp_init::InitPlan;
//!
//! // Build on the fake device: nothing is allocated.
//! let model = Gpt::new(&InitContext::fake(0), &GptConfig::tiny())?;
//! let plan = InitPlan::from_module(&model)?;
//!
//! // One FSDP unit: block 0's parameters, sharded over 2 ranks.
//! let unit: Vec<_> = named_parameters(&model)
//!     .into_iter()
//!     .filter(|(n, _)| n.starts_with("blocks.0."))
//!     .map(|(_, p)| p)
//!     .collect();
//! let shapes: Vec<Vec<usize>> = unit.iter().map(|p| p.shape().to_vec()).collect();
//! let layout = FlatParamLayout::new(&shapes, 2)?;
//! let dev = Device::cpu(1);
//! let shard = plan.materialize_shard(&unit, &layout, 1, &dev)?; // rank 1's chunk only
//! assert_eq!(shard.numel(), layout.chunk_numel());
//! assert!(unit.iter().all(|p| !p.is_materialized()));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Limitations
//!
//! * Values are generated by host code, so the target device must have host-accessible memory
//!   (CPU devices); CUDA devices return [`MaterializeError::UnsupportedDevice`].
//! * `CopyFrom` sources are regenerated from their recorded ops, never read from their current
//!   tensor; a source whose values were changed after init (or loaded) is not seen.
//! * A `Custom` closure may run more than once (a copy source is recomputed for each parameter
//!   that copies it) and must be deterministic.
//! * Bitwise equality relies on the platform's `f64` `ln`/`cos`/`exp` being the same for eager
//!   and deferred init, which holds within one build on one platform.
#![deny(missing_docs)]

mod error;
mod materialize;
mod plan;

pub use error::{MaterializeError, Result};
pub use materialize::{materialize, materialize_shard, materialize_unit, stream_shard};
pub use plan::{CrossUnitDependency, InitPlan};

pub use fsdp_alloc::{DType, Device};
pub use fsdp_autograd::init::{
    apply_positionwise, compute_fans, erfc, fill_positionwise, fill_whole, fnv1a64, last_overwrite,
    ndtr, ndtri, CustomInit, CustomInitFn, FanMode, InitError, InitOp, Nonlinearity,
};
pub use fsdp_autograd::{InitContext, Parameter};
