#![doc = include_str!("../README.md")]
//!
//! # Crate layout
//! - [`FlatParamLayout`]: the layout (per-parameter [`ParamInfo`], total/padded/chunk numels),
//!   each rank's [`RankShard`] (interval, [`ParamPiece`]s, padding) and the reverse map from a
//!   parameter to the pieces held by each rank.
//! - Data movement on a layout, generic over `T: bytemuck::Pod` (`f32`, [`f16`](struct@f16),
//!   [`bf16`], …):
//!   [`flatten_into`](FlatParamLayout::flatten_into), [`flatten`](FlatParamLayout::flatten),
//!   [`flatten_shard_into`](FlatParamLayout::flatten_shard_into),
//!   [`unflatten`](FlatParamLayout::unflatten) / [`unflatten_mut`](FlatParamLayout::unflatten_mut),
//!   [`shard_of`](FlatParamLayout::shard_of) / [`shard_of_mut`](FlatParamLayout::shard_of_mut),
//!   [`split_shard`](FlatParamLayout::split_shard) /
//!   [`split_shard_mut`](FlatParamLayout::split_shard_mut).
//! - Mixed precision: [`cast_f32_to_half_into`], [`cast_half_to_f32_into`] and their allocating
//!   forms, for [`HalfFloat`] types ([`f16`](struct@f16), [`bf16`]).
//! - [`LayoutError`]: every failure, with the operation and sizes involved. No public function
//!   panics on bad sizes, ranks or indices.
#![deny(missing_docs)]

mod cast;
mod error;
mod flat;
mod layout;

pub use cast::{
    cast_f32_to_half, cast_f32_to_half_into, cast_half_to_f32, cast_half_to_f32_into, HalfFloat,
};
pub use error::{LayoutError, Result};
pub use half::{bf16, f16};
pub use layout::{FlatParamLayout, ParamInfo, ParamPiece, RankShard};
