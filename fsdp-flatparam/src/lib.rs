//! Flatten-concat-chunk layout math for fully sharded data parallel training.
//!
//! FSDP (PyTorch FSDP, VLDB 2023, §3.2.1) turns the parameters of one unit into a single
//! 1-D *flat parameter*: every parameter is flattened in row-major order, the results are
//! concatenated, and the whole is padded on the right with the fewest zeros (at most `F - 1`)
//! that make its length divisible by the sharding factor `F`. The flat parameter is cut into `F`
//! equal chunks and rank `r` keeps chunk `r`. Equal chunks are exactly what all-gather and
//! reduce-scatter want, so the collectives never need uneven sizes or extra copies.
//!
//! This crate is the pure half of that design: the layout is data, computed once from the
//! parameters' shapes and `F`, with no device, runtime or other fsdp-rs crate involved.
//!
//! # How to use
//! ```
//! use fsdp_flatparam::FlatParamLayout;
//!
//! // A linear layer's weight (2x3) and bias (2), sharded across 3 ranks.
//! let layout = FlatParamLayout::new(&[vec![2, 3], vec![2]], 3)?;
//! assert_eq!((layout.total_numel(), layout.padded_numel(), layout.chunk_numel()), (8, 9, 3));
//!
//! // Flatten (concat + zero pad), then take each rank's shard.
//! let weight = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
//! let bias = [7.0f32, 8.0];
//! let flat = layout.flatten(&[&weight[..], &bias[..]])?;
//! assert_eq!(layout.shard_of(&flat, 2)?, &[7.0, 8.0, 0.0]);
//!
//! // Which parts of which parameters does rank 1 hold?
//! for piece in layout.rank_pieces(1)? {
//!     println!("param {} elements {:?} at shard {:?}",
//!              piece.param_index, piece.param_range(), piece.shard_range());
//! }
//!
//! // The shards concatenated in rank order are the flat parameter again (this is what an
//! // all-gather produces), and unflattening gives views of the original parameters.
//! let mut gathered = Vec::new();
//! for rank in 0..3 {
//!     gathered.extend_from_slice(layout.shard_of(&flat, rank)?);
//! }
//! let views = layout.unflatten(&gathered)?;
//! assert_eq!((views[0], views[1]), (&weight[..], &bias[..]));
//! # Ok::<(), fsdp_flatparam::LayoutError>(())
//! ```
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
