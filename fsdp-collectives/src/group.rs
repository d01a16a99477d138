//! The [`ProcessGroup`] trait every backend implements.

use std::sync::{Arc, Mutex};

use fsdp_alloc::{BufferRef, DType, Stream};

use crate::desc::{BufferProblem, OpDesc};
use crate::error::{CollectiveError, Result};
use crate::types::{default_accum, DeviceSlice, OpKind, Outcome, ReduceOp, Work};

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

    /// Personalized exchange with equal chunks: `input` and `output` have the same length, a
    /// multiple of `size()`; chunk `d` of this rank's `input` goes to rank `d`, and chunk `s` of
    /// this rank's `output` receives chunk `rank()` of rank `s`'s input. Any dtype (the bytes
    /// are moved, nothing is reduced); no in-place form (the buffers must not overlap).
    ///
    /// Implemented by the thread, MPI and NCCL backends. The default implementation, for other
    /// implementors of this trait, fails with [`CollectiveError::Unsupported`] and fails
    /// `stream` (so nothing consumes the unwritten output).
    fn all_to_all_into(&self, input: &DeviceSlice, output: &DeviceSlice, stream: &Stream) -> Work {
        let _ = (input, output);
        let error = CollectiveError::Unsupported {
            op: OpKind::AllToAll,
            rank: self.rank(),
            group: self.name(),
            detail: "this ProcessGroup does not implement all_to_all_into; implement it (the \
                     thread, MPI and NCCL backends do)"
                .into(),
        };
        let outcome: Outcome = Arc::new(Mutex::new(None));
        fail_on_stream(
            OpKind::AllToAll,
            self.rank(),
            u64::MAX,
            stream,
            outcome,
            error,
        )
    }

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

/// [`locate_in_partition`] with its message turned into the typed error every backend returns.
pub(crate) fn locate_part(
    parts: &[Vec<usize>],
    world: usize,
    rank: usize,
    group: &str,
) -> Result<(usize, usize)> {
    locate_in_partition(parts, world, rank).map_err(|detail| CollectiveError::InvalidGroup {
        group: group.to_string(),
        rank,
        detail,
    })
}

/// Marks `desc` as a placement problem when the buffers are not host memory (for backends whose
/// collectives run on host threads: thread, MPI). Every rank agrees on it through validation.
fn require_host(
    mut desc: OpDesc,
    input: Option<&DeviceSlice>,
    output: Option<&DeviceSlice>,
) -> OpDesc {
    let on_device = |s: Option<&DeviceSlice>| s.is_some_and(|s| s.data().device_ptr().is_some());
    if desc.bad_buffer.is_none() && (on_device(input) || on_device(output)) {
        desc.bad_buffer = Some(BufferProblem::Placement);
    }
    desc
}

/// Stores `r` as the collective's outcome and, if it failed, fails the stream it runs on (like
/// an asynchronous device error, without the panic hook's noise): later work on that stream is
/// skipped instead of consuming a bad output. Call it from inside work launched on a stream.
pub(crate) fn finish_on_stream(outcome: &Outcome, r: Result<()>) {
    let failed = r.as_ref().err().map(ToString::to_string);
    *outcome.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
    if let Some(message) = failed {
        std::panic::resume_unwind(Box::new(message));
    }
}

/// Runs the closure when dropped, unless it was taken out first.
struct OnDrop<F: FnOnce()>(Option<F>);

impl<F: FnOnce()> OnDrop<F> {
    /// Drops the closure without running it.
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl<F: FnOnce()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}

/// Launches `run` on `stream` as one collective and returns its [`Work`]: the outcome is
/// stored and a failure fails the stream ([`finish_on_stream`]). If the stream drops the work
/// without running it (it had failed before reaching it), `abandon` runs instead, so the
/// backend can tell the peers at once that this rank will not take part.
pub(crate) fn launch_collective(
    call: &Call<'_>,
    seq: u64,
    stream: &Stream,
    run: impl FnOnce() -> Result<()> + Send + 'static,
    abandon: impl FnOnce() + Send + 'static,
) -> Work {
    let outcome: Outcome = Arc::new(Mutex::new(None));
    let slot = Arc::clone(&outcome);
    let unrun = OnDrop(Some(abandon));
    stream.launch(move || {
        // It runs: `abandon` is dropped uncalled.
        unrun.disarm();
        finish_on_stream(&slot, run())
    });
    Work::new(
        call.desc.kind,
        call.rank,
        seq,
        stream.record_event(),
        outcome,
    )
}

/// A collective that failed before anything ran on the device: the error is the outcome and the
/// stream is failed after the work already on it, so later work is skipped as for a failure
/// during the collective.
pub(crate) fn fail_on_stream(
    op: OpKind,
    rank: usize,
    seq: u64,
    stream: &Stream,
    outcome: Outcome,
    error: CollectiveError,
) -> Work {
    let message = error.to_string();
    *outcome.lock().unwrap_or_else(|x| x.into_inner()) = Some(Err(error));
    stream.launch(move || std::panic::resume_unwind(Box::new(message)));
    Work::new(op, rank, seq, stream.record_event(), outcome)
}

/// One collective call as a backend receives it: the descriptor (validated later, against every
/// rank's) and the caller's buffers.
pub(crate) struct Call<'a> {
    /// What the caller asked for.
    pub desc: OpDesc,
    /// This rank in the group.
    pub rank: usize,
    /// The input buffer (all-gather, reduce-scatter).
    pub input: Option<&'a DeviceSlice>,
    /// The output buffer (the only buffer of all-reduce and broadcast).
    pub output: Option<&'a DeviceSlice>,
}

impl Call<'_> {
    /// The buffers' memory, for work that outlives the call.
    pub fn buffers(&self) -> (Option<BufferRef>, Option<BufferRef>) {
        let data = |s: Option<&DeviceSlice>| s.map(|s| s.data().clone());
        (data(self.input), data(self.output))
    }
}

/// The one thing a backend writes for the four stream collectives: launch a validated-later
/// descriptor with its buffers on a stream. [`collectives_via_issue!`] turns it into the
/// [`ProcessGroup`] methods, so the descriptor construction (and with it the in-place and
/// even-size rules) is written once for every backend.
pub(crate) trait Issue {
    /// This rank in the group (for the descriptors).
    fn issue_rank(&self) -> usize;

    /// True if the collectives run on host threads, so device buffers are an error every rank
    /// agrees on (thread, MPI); false if the backend places buffers itself (NCCL).
    const HOST_ONLY: bool = true;

    /// Launches `call` on `stream`.
    fn launch(&self, call: Call<'_>, stream: &Stream) -> Work;

    /// Launches the collective described by `desc` on `stream`.
    fn issue(
        &self,
        desc: OpDesc,
        input: Option<&DeviceSlice>,
        output: Option<&DeviceSlice>,
        stream: &Stream,
    ) -> Work {
        let desc = if Self::HOST_ONLY {
            require_host(desc, input, output)
        } else {
            desc
        };
        let rank = self.issue_rank();
        self.launch(
            Call {
                desc,
                rank,
                input,
                output,
            },
            stream,
        )
    }
}

/// Expands, inside an `impl ProcessGroup for X` where `X: Issue`, to the stream collectives
/// (`all_gather_into`, `reduce_scatter_with`, `all_reduce_with`, `broadcast`,
/// `all_to_all_into`).
macro_rules! collectives_via_issue {
    () => {
        fn all_gather_into(
            &self,
            input: &$crate::types::DeviceSlice,
            output: &$crate::types::DeviceSlice,
            stream: &fsdp_alloc::Stream,
        ) -> $crate::types::Work {
            let desc = $crate::desc::OpDesc::all_gather(
                input,
                output,
                $crate::group::Issue::issue_rank(self),
            );
            $crate::group::Issue::issue(self, desc, Some(input), Some(output), stream)
        }

        fn reduce_scatter_with(
            &self,
            input: &$crate::types::DeviceSlice,
            output: &$crate::types::DeviceSlice,
            op: $crate::types::ReduceOp,
            accum: fsdp_alloc::DType,
            stream: &fsdp_alloc::Stream,
        ) -> $crate::types::Work {
            let desc = $crate::desc::OpDesc::reduce_scatter(
                input,
                output,
                op,
                accum,
                $crate::group::Issue::issue_rank(self),
            );
            $crate::group::Issue::issue(self, desc, Some(input), Some(output), stream)
        }

        fn all_reduce_with(
            &self,
            buf: &$crate::types::DeviceSlice,
            op: $crate::types::ReduceOp,
            accum: fsdp_alloc::DType,
            stream: &fsdp_alloc::Stream,
        ) -> $crate::types::Work {
            let desc = $crate::desc::OpDesc::all_reduce(buf, op, accum);
            $crate::group::Issue::issue(self, desc, None, Some(buf), stream)
        }

        fn broadcast(
            &self,
            buf: &$crate::types::DeviceSlice,
            root: usize,
            stream: &fsdp_alloc::Stream,
        ) -> $crate::types::Work {
            let desc = $crate::desc::OpDesc::broadcast(buf, root);
            $crate::group::Issue::issue(self, desc, None, Some(buf), stream)
        }

        fn all_to_all_into(
            &self,
            input: &$crate::types::DeviceSlice,
            output: &$crate::types::DeviceSlice,
            stream: &fsdp_alloc::Stream,
        ) -> $crate::types::Work {
            let desc = $crate::desc::OpDesc::all_to_all(input, output);
            $crate::group::Issue::issue(self, desc, Some(input), Some(output), stream)
        }
    };
}
pub(crate) use collectives_via_issue;
