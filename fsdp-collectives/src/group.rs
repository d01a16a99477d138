//! The [`ProcessGroup`] trait every backend implements.

use std::sync::Arc;

use fsdp_alloc::{DType, Stream};

use crate::error::Result;
use crate::types::{default_accum, DeviceSlice, ReduceOp, Work};

/// A group of ranks that run collectives together.
///
/// Every rank of the group must issue the same collectives in the same order with matching
/// arguments (like NCCL); a mismatch is detected and reported as an error on every rank.
///
/// **Issuing.** The collective methods *launch* the collective on `stream` and return at once
/// (they never block the calling thread): the collective runs after everything launched on
/// `stream` before it, so buffers written by earlier work on that stream are ready, and later
/// work on `stream` sees its result. [`Work::event`] orders other streams after it;
/// [`Work::wait`] blocks the host and returns the collective's error. Argument errors (the
/// even-size rule, dtypes, roots) come back through the [`Work`] as well, on *every* rank.
///
/// **Even sizes only.** All-gather needs `output.len() == size() × input.len()`; reduce-scatter
/// needs `input.len() == size() × output.len()`; all-reduce and broadcast need the same length on
/// every rank. Chunk `r` of the larger buffer belongs to rank `r`. The in-place forms (the
/// smaller buffer *is* this rank's chunk of the larger one) are allowed; other overlaps are not.
///
/// **Reductions** run in the accumulation dtype (`*_with` variants; the defaults use
/// [`default_accum`]: f32 for f16/bf16 buffers) and in rank order where the backend controls it.
pub trait ProcessGroup: Send + Sync + std::fmt::Debug {
    /// This rank's index in the group, `0..size()`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn size(&self) -> usize;

    /// Backend and group name for messages (e.g. `threads#2/shard0`).
    fn name(&self) -> String;

    /// Gathers every rank's `input` into `output` on every rank: chunk `r` of `output` (of length
    /// `input.len()`) receives rank `r`'s input.
    fn all_gather_into(&self, input: &DeviceSlice, output: &DeviceSlice, stream: &Stream) -> Work;

    /// Reduces every rank's `input` elementwise and leaves chunk `rank()` of the result (of length
    /// `output.len()`) in `output`. Accumulates in [`default_accum`] of the dtype.
    fn reduce_scatter(
        &self,
        input: &DeviceSlice,
        output: &DeviceSlice,
        op: ReduceOp,
        stream: &Stream,
    ) -> Work {
        self.reduce_scatter_with(input, output, op, default_accum(input.dtype()), stream)
    }

    /// [`ProcessGroup::reduce_scatter`] accumulating in `accum` (e.g. `DType::F32` for bf16
    /// buffers, or the buffer's own dtype to round after every step as a low-precision wire
    /// reduction would).
    fn reduce_scatter_with(
        &self,
        input: &DeviceSlice,
        output: &DeviceSlice,
        op: ReduceOp,
        accum: DType,
        stream: &Stream,
    ) -> Work;

    /// Reduces `buf` elementwise across ranks, leaving the result in `buf` on every rank.
    fn all_reduce(&self, buf: &DeviceSlice, op: ReduceOp, stream: &Stream) -> Work {
        self.all_reduce_with(buf, op, default_accum(buf.dtype()), stream)
    }

    /// [`ProcessGroup::all_reduce`] accumulating in `accum`.
    fn all_reduce_with(
        &self,
        buf: &DeviceSlice,
        op: ReduceOp,
        accum: DType,
        stream: &Stream,
    ) -> Work;

    /// Copies rank `root`'s `buf` into `buf` on every other rank.
    fn broadcast(&self, buf: &DeviceSlice, root: usize, stream: &Stream) -> Work;

    /// Blocks the calling thread until every rank of the group has called `barrier`.
    ///
    /// It orders host threads; it does not wait for work already launched on streams (wait on
    /// those [`Work`]s or synchronize the streams first if that is what you need).
    fn barrier(&self) -> Result<()>;

    /// Splits this group into disjoint subgroups, collectively: every rank calls `split` with the
    /// same partition of `0..size()` (each rank in exactly one part) and receives the subgroup
    /// containing it; its rank there is its position in its part.
    fn split(&self, parts: &[Vec<usize>]) -> Result<Arc<dyn ProcessGroup>>;
}

/// Checks that `parts` is a partition of `0..world` into non-empty parts; returns
/// (part index, position in part) of `rank`.
pub(crate) fn locate_in_partition(
    parts: &[Vec<usize>],
    world: usize,
    rank: usize,
) -> std::result::Result<(usize, usize), String> {
    let mut seen = vec![false; world];
    for (i, p) in parts.iter().enumerate() {
        if p.is_empty() {
            return Err(format!("part {i} of the partition is empty"));
        }
        for &r in p {
            if r >= world {
                return Err(format!(
                    "part {i} names rank {r}, but the group has {world} ranks"
                ));
            }
            if std::mem::replace(&mut seen[r], true) {
                return Err(format!(
                    "rank {r} appears in more than one place of the partition"
                ));
            }
        }
    }
    if let Some(r) = seen.iter().position(|s| !s) {
        return Err(format!("rank {r} is in no part of the partition"));
    }
    parts
        .iter()
        .enumerate()
        .find_map(|(i, p)| p.iter().position(|&r| r == rank).map(|j| (i, j)))
        .ok_or_else(|| format!("rank {rank} is in no part of the partition"))
}
