//! The vocabulary shared by every backend: operations, reduce ops, typed device slices, and the
//! [`Work`] handle an issued collective returns.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use fsdp_alloc::{Buffer, BufferRef, DType, Event};

use crate::error::{CollectiveError, Result};

pub use crate::op::OpKind;

/// How a reduction combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum (wrapping for integers).
    Sum,
    /// Sum divided by the group size (truncating division for integers).
    Avg,
    /// Maximum (for floats IEEE `maxNum`: a NaN loses against a number).
    Max,
    /// Minimum (for floats IEEE `minNum`: a NaN loses against a number).
    Min,
}

impl ReduceOp {
    /// Lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }

    pub(crate) const fn code(self) -> i64 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Avg => 2,
            ReduceOp::Max => 3,
            ReduceOp::Min => 4,
        }
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) const fn from_code(c: i64) -> Option<ReduceOp> {
        Some(match c {
            1 => ReduceOp::Sum,
            2 => ReduceOp::Avg,
            3 => ReduceOp::Max,
            4 => ReduceOp::Min,
            _ => return None,
        })
    }
}

impl std::fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The accumulation dtype used when none is given: `f32` for `f16`/`bf16` buffers (round once at
/// the end), the buffer's own dtype otherwise.
pub const fn default_accum(dtype: DType) -> DType {
    match dtype {
        DType::F16 | DType::BF16 => DType::F32,
        d => d,
    }
}

/// A typed, contiguous range of device memory: what collectives read and write.
///
/// Lengths are in elements of `dtype`. Cheap to clone (it holds a [`BufferRef`]).
#[derive(Clone, Debug)]
pub struct DeviceSlice {
    data: BufferRef,
    dtype: DType,
}

impl DeviceSlice {
    /// Views `data` as elements of `dtype`; an error if the byte length is not a whole number of
    /// elements.
    pub fn new(data: BufferRef, dtype: DType) -> Result<DeviceSlice> {
        if data.len() % dtype.size() != 0 {
            return Err(CollectiveError::InvalidSlice(format!(
                "a {}-byte range is not a whole number of {dtype} elements ({} bytes each); \
                 slice it to a multiple of the element size",
                data.len(),
                dtype.size()
            )));
        }
        Ok(DeviceSlice { data, dtype })
    }

    /// Views a whole allocation as elements of `dtype`.
    pub fn from_buffer(buffer: &Buffer, dtype: DType) -> Result<DeviceSlice> {
        DeviceSlice::new(buffer.data().clone(), dtype)
    }

    /// The memory.
    pub fn data(&self) -> &BufferRef {
        &self.data
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Length in elements.
    pub fn len(&self) -> usize {
        self.data.len() / self.dtype.size()
    }

    /// True if it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Length in bytes.
    pub fn nbytes(&self) -> usize {
        self.data.len()
    }

    /// `count` elements starting at element `start`.
    pub fn slice(&self, start: usize, count: usize) -> Result<DeviceSlice> {
        let sz = self.dtype.size();
        let data = start
            .checked_mul(sz)
            .zip(count.checked_mul(sz))
            .ok_or_else(|| {
                CollectiveError::InvalidSlice(format!("element range {start}+{count} overflows"))
            })
            .and_then(|(off, len)| {
                self.data
                    .slice(off, len)
                    .map_err(|e| CollectiveError::InvalidSlice(e.to_string()))
            })?;
        Ok(DeviceSlice {
            data,
            dtype: self.dtype,
        })
    }

    /// Chunk `index` of `chunks` equal chunks (the length must divide evenly).
    pub fn chunk(&self, index: usize, chunks: usize) -> Result<DeviceSlice> {
        if chunks == 0 || self.len() % chunks != 0 || index >= chunks {
            return Err(CollectiveError::InvalidSlice(format!(
                "cannot take chunk {index} of {chunks} equal chunks of a {}-element slice",
                self.len()
            )));
        }
        let n = self.len() / chunks;
        self.slice(index * n, n)
    }
}

/// The shared outcome of one issued collective.
pub(crate) type Outcome = Arc<Mutex<Option<Result<()>>>>;

/// A collective in flight: an [`Event`] that completes when the collective has finished on its
/// stream, plus the collective's result.
///
/// A failed collective also *fails its stream* (like an asynchronous CUDA/NCCL error): work
/// launched after it on that stream is skipped and events recorded after it report the failure,
/// so nothing consumes a half-written output by accident. [`Work::wait`] returns the typed error.
#[derive(Clone)]
#[must_use = "a collective's errors arrive through its Work: wait on it (or keep it and check it later)"]
pub struct Work {
    op: OpKind,
    rank: usize,
    seq: u64,
    event: Event,
    outcome: Outcome,
}

impl std::fmt::Debug for Work {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("op", &self.op)
            .field("rank", &self.rank)
            .field("seq", &self.seq)
            .field("completed", &self.is_completed())
            .finish()
    }
}

impl Work {
    pub(crate) fn new(op: OpKind, rank: usize, seq: u64, event: Event, outcome: Outcome) -> Work {
        Work {
            op,
            rank,
            seq,
            event,
            outcome,
        }
    }

    /// A work item that has already failed with `error` (nothing was launched).
    pub fn failed(op: OpKind, rank: usize, error: CollectiveError) -> Work {
        Work {
            op,
            rank,
            seq: u64::MAX,
            event: Event::completed(),
            outcome: Arc::new(Mutex::new(Some(Err(error)))),
        }
    }

    /// Which collective this is.
    pub fn op(&self) -> OpKind {
        self.op
    }

    /// The issuing rank (group-local).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Position of this collective in its group's sequence (`u64::MAX` for [`Work::failed`]).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The completion event: `other_stream.wait_event(work.event())` orders later work on
    /// another stream after the collective without blocking the host.
    pub fn event(&self) -> &Event {
        &self.event
    }

    /// True once the collective has finished (successfully or not). Never blocks.
    pub fn is_completed(&self) -> bool {
        self.event.query()
    }

    /// The outcome of a finished collective without waiting: `None` while it runs, else what
    /// [`Work::wait`] would return. Never blocks, so it is not a host wait
    /// (`fsdp_alloc::stream::host_syncs` does not count it).
    pub fn try_result(&self) -> Option<Result<()>> {
        if !self.is_completed() {
            return None;
        }
        let stored = self
            .outcome
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        Some(match (stored, self.event.error()) {
            (Some(r), _) => r,
            (None, None) => Ok(()),
            (None, Some(message)) => Err(CollectiveError::StreamFailed {
                op: self.op,
                rank: self.rank,
                message,
            }),
        })
    }

    fn result(&self, event: fsdp_alloc::Result<()>) -> Result<()> {
        let stored = self
            .outcome
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        match (stored, event) {
            (Some(r), _) => r,
            (None, Ok(())) => Ok(()),
            (None, Err(e)) => Err(CollectiveError::StreamFailed {
                op: self.op,
                rank: self.rank,
                message: e.to_string(),
            }),
        }
    }

    /// Blocks the calling thread until the collective has finished; its error, if it failed.
    pub fn wait(&self) -> Result<()> {
        let ev = self.event.synchronize();
        self.result(ev)
    }

    /// Like [`Work::wait`] but gives up after `timeout`: `Ok(false)` if still running.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<bool> {
        match self.event.synchronize_timeout(timeout) {
            Ok(false) => Ok(false),
            Ok(true) => self.result(Ok(())).map(|()| true),
            Err(e) => self.result(Err(e)).map(|()| true),
        }
    }
}
