//! Parameter initialization as data: [`InitOp`]s and a counter-based RNG that makes every
//! element's initial value a pure function of `(seed, parameter name, op index, element index)`.
//!
//! nn layers describe how each parameter is initialized by a list of [`InitOp`]s. The same list
//! is either executed at once (eager init, [`fill_whole`]) or recorded and replayed later, whole
//! or for any sub-range of the elements ([`fill_positionwise`]) — for example only the piece of a
//! parameter that one FSDP rank holds. Because the random numbers are counter-based, all of these
//! give the same bits.
//!
//! # The random stream
//!
//! Random ops draw from Philox4x32-10 ([`rand_philox`]):
//!
//! * **key**: `splitmix64(seed)`, split into two `u32` words (low word first). `splitmix64` is a
//!   bijection, so different seeds give different keys.
//! * **counter** (128 bits): bits 64..128 hold [`fnv1a64`]`(fqn)` (FNV-1a, 64-bit, over the UTF-8
//!   bytes of the parameter's fully-qualified name), bits 48..64 hold the op's index in its
//!   parameter's op list, bits 0..48 hold the element index (row-major, flat).
//!
//! Element `i` of op `k` of parameter `fqn` uses exactly one Philox block (four `u32` words) — the
//! block at that counter — and nothing else, so its value never depends on which other elements or
//! parameters were generated, or in which order. Limits that follow: at most 2⁴⁸ elements per
//! parameter and 2¹⁶ ops per parameter (larger requests return [`InitError::TooLarge`]); two
//! parameters whose names collide under FNV-1a would share streams (2⁻⁶⁴ per pair).
//!
//! # From words to values
//!
//! * A uniform `u ∈ (0, 1)` is built from the first two words (53 bits: `((w0 << 21) | (w1 >> 11))
//!   + 0.5) · 2⁻⁵³`), in `f64`.
//! * [`InitOp::Uniform`] (and Kaiming/Xavier uniform) is `low + (high − low)·u` in `f64`, rounded
//!   to `f32`, and kept in the half-open `[low, high)` (a value that rounds up to `high` becomes the
//!   largest `f32` below it).
//! * Normals use one Box–Muller branch per element: `sqrt(−2 ln u) · cos(2π v)` where `v` comes
//!   from the third word (`(w2 + 0.5) · 2⁻³²`). The sine branch is discarded so that every element
//!   owns its block.
//! * [`InitOp::TruncatedNormal`] uses the inverse CDF: `x = Φ⁻¹(Φ(α) + u·(Φ(β) − Φ(α)))` with
//!   `α, β` the standardized bounds, computed on the lower tail (bounds are mirrored when the
//!   interval lies mostly above the mean) for accuracy; see [`ndtr`] (once per op) and [`ndtri`]
//!   (Wichura's AS 241, once per element). No rejection
//!   loop, so it stays position-wise. The result is clamped to `[a, b]` against rounding.
//! * [`InitOp::Orthogonal`] draws the same standard normals (kept in `f64`), factors them with
//!   Householder QR in `f64` and rounds `gain · Q` to `f32`: deterministic like the rest, but a
//!   whole-tensor op, so a shard of it is cut from the whole parameter.
//!
//! All arithmetic is IEEE `f64` without fused operations; `ln`, `cos`, `exp` and `sqrt` come from
//! the platform's math library. Results are therefore bitwise reproducible on one platform (and in
//! practice across x86-64/aarch64 Linux), which is what deferred == eager needs; they are not
//! promised bit-identical across different libm implementations.
//!
//! # Fans and gains
//!
//! As PyTorch's `_calculate_fan_in_and_fan_out`: for a weight `[out, in, k…]`, `fan_in = in ·
//! prod(k…)` and `fan_out = out · prod(k…)`. Unlike PyTorch, 1-D tensors are allowed, with
//! `fan_in = fan_out = len`; 0-D tensors have no fan ([`InitError::FanUndefined`]). Gains follow
//! `torch.nn.init.calculate_gain` ([`Nonlinearity::gain`]).
//!
//! # Example
//!
//! ```
//! use fsdp_autograd::init::{fill_positionwise, fill_whole, InitOp, InitError};
//!
//! let ops = [InitOp::Normal { mean: 0.0, std: 0.02 }, InitOp::Scale(0.5)];
//! let shape = [4, 8];
//! let mut whole = vec![0.0f32; 32];
//! let mut no_copies = |src: &str| -> Result<Vec<f32>, InitError> {
//!     Err(InitError::Unresolved { source_fqn: src.to_string(), reason: "no sources".into() })
//! };
//! fill_whole(&ops, 7, "blocks.0.mlp.fc.weight", &shape, &mut whole, &mut no_copies)?;
//!
//! // Any sub-range, generated alone, equals the same slice of the whole tensor.
//! let mut part = vec![0.0f32; 10];
//! fill_positionwise(&ops, 7, "blocks.0.mlp.fc.weight", &shape, 13, &mut part)?;
//! assert_eq!(part, whole[13..23]);
//! # Ok::<(), InitError>(())
//! ```
//!
//! # Where things are
//!
//! | file | concern |
//! |---|---|
//! | `ops.rs` | [`InitOp`] and its arguments, [`compute_fans`] |
//! | `error.rs` | [`InitError`] |
//! | `rng.rs` | the counter-based Philox stream, [`fnv1a64`], words → uniforms and normals |
//! | `special.rs` | [`erfc`], [`ndtr`], [`ndtri`] |
//! | `fill.rs` | [`fill_positionwise`], [`apply_positionwise`], [`fill_whole`], [`last_overwrite`] |
//! | `orthogonal.rs` | Householder QR for [`InitOp::Orthogonal`] |
//!
//! This core lives in fsdp-autograd because eager init (an [`InitContext`](crate::InitContext) on
//! a real device) runs it when a layer is built; `fsdp-init` depends on this crate and re-exports
//! the whole API, so a user of deferred init needs only `fsdp-init`.

mod error;
mod fill;
mod ops;
mod orthogonal;
mod rng;
mod special;

pub use error::InitError;
pub use fill::{apply_positionwise, fill_positionwise, fill_whole, last_overwrite};
pub use ops::{compute_fans, CustomInit, CustomInitFn, FanMode, InitOp, Nonlinearity};
pub use rng::fnv1a64;
pub use special::{erfc, ndtr, ndtri};
