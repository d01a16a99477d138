//! Embedding lookup and its deterministic backward, and the deferred index check shared with
//! cross-entropy.

use fsdp_alloc::{Buffer, BufferRef, DType, Stream};

use super::context::{expect_len, grid_for, grid_rows, mul, rows_of, Call, CudaKernels, Elem};
use super::error::{CudaKernelError, Result};
use super::plan::{PArg, Plan, Ptr};
use super::program::Kernel;
use super::typed::{type_code, types_word, TBuf};
use crate::kernels::KernelError;

/// The outcome of the device-side validation of ids (embedding) or targets (cross-entropy).
///
/// Checking indices on the host would need the ids on the host, i.e. a synchronization per call.
/// Instead the kernels validate on the device: out-of-range indices are never dereferenced (the
/// forward writes NaN rows for them, so an unchecked error cannot silently train; the backward
/// skips them), and the smallest offending position is recorded in a device status word.
/// [`IndexCheck::wait`] synchronizes the stream and turns that into the CPU kernels'
/// [`KernelError::IndexOutOfRange`]. Callers that cannot afford the synchronization on every
/// step may keep the check and wait on it later (e.g. once per step).
#[must_use = "out-of-range indices are only reported by `IndexCheck::wait`"]
pub struct IndexCheck {
    op: &'static str,
    what: &'static str,
    bound: usize,
    pending: Option<Pending>,
}

struct Pending {
    status: Buffer,
    ids: BufferRef,
    stream: Stream,
    kernels: CudaKernels,
}

impl std::fmt::Debug for IndexCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexCheck")
            .field("op", &self.op)
            .field("what", &self.what)
            .field("bound", &self.bound)
            .field("pending", &self.pending.is_some())
            .finish()
    }
}

impl IndexCheck {
    /// The kernel whose indices are checked.
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// Blocks until the stream's work up to the checked kernel has completed and reports the
    /// first out-of-range index, if any.
    ///
    /// # Errors
    /// [`KernelError::IndexOutOfRange`] (as [`CudaKernelError::Kernel`]) with the smallest
    /// offending position and its value; driver errors from the synchronization or the copies.
    pub fn wait(self) -> Result<()> {
        self.wait_after(None)
    }

    /// [`IndexCheck::wait`] for a caller that has just synchronized `synced` (a readback on
    /// it): a check of that stream reads its status word without synchronizing again, so
    /// draining the checks costs no host wait beyond the readback's; a check of another stream
    /// synchronizes that one (a counted host wait).
    pub(crate) fn wait_after(self, synced: Option<&Stream>) -> Result<()> {
        let Some(p) = self.pending else {
            return Ok(());
        };
        let c = p.kernels.call(self.op, &p.stream)?;
        let status = c.buf("status", p.status.data(), Elem::U64)?;
        let mut first = [0u64];
        if synced == Some(&p.stream) {
            // SAFETY: `status` is the live one-word scratch buffer the check kernel writes
            // (kept alive by `p.status`); the kernel was enqueued on `p.stream` before the
            // caller synchronized it (the check was deferred when it was launched).
            unsafe { c.read_to_host_synced(status.ptr, &mut first)? };
        } else {
            // SAFETY: as above; `read_to_host` synchronizes the stream first.
            unsafe { c.read_to_host(status.ptr, &mut first)? };
        }
        let position = first[0];
        if position == u64::MAX {
            return Ok(());
        }
        let ids = c.buf("ids", &p.ids, Elem::I64)?;
        if position >= ids.len as u64 {
            return Err(CudaKernelError::Internal {
                op: self.op,
                detail: format!(
                    "the index check reported position {position} of {} indices",
                    ids.len
                ),
            });
        }
        let mut value = [0i64];
        // SAFETY: position < ids.len, so the 8 bytes at ids.ptr + 8·position lie inside the live
        // ids buffer (kept alive by `p.ids`), whose writers ran before the check kernel, which
        // has completed (its status was read after a synchronize of `p.stream`).
        unsafe { c.read_to_host_synced(ids.ptr + 8 * position, &mut value)? };
        Err(KernelError::IndexOutOfRange {
            op: self.op,
            what: self.what,
            value: value[0],
            position: position as usize,
            bound: self.bound,
        }
        .into())
    }
}

/// Appends the validation of `n` indices at `ids` against `0..bound` and returns the scratch
/// slot of its status word (`None` when there is nothing to check).
pub(crate) fn plan_check(plan: &mut Plan, n: u64, ids: Ptr, bound: u64) -> Option<usize> {
    if n == 0 {
        return None;
    }
    let slot = plan.scratch(1, Elem::U64);
    // All-ones bytes are u64::MAX, the "no error" value.
    plan.memset(Ptr::scratch(slot), 0xff, 8);
    plan.launch(
        Kernel::CheckIds,
        grid_for(n),
        vec![
            PArg::U64(n),
            PArg::Ptr(ids),
            PArg::U64(bound),
            PArg::Ptr(Ptr::scratch(slot)),
        ],
    );
    Some(slot)
}

/// Executes `plan` and wraps its status slot (if any) in an [`IndexCheck`].
///
/// # Safety
/// As [`Call::exec`].
pub(crate) unsafe fn exec_checked(
    c: &Call<'_>,
    plan: &Plan,
    status: Option<usize>,
    what: &'static str,
    ids: &BufferRef,
    bound: usize,
) -> Result<IndexCheck> {
    // SAFETY: forwarded to the caller.
    let scratch = unsafe { c.exec(plan) }?;
    let pending = match status {
        None => None,
        Some(slot) => {
            let status =
                scratch
                    .into_iter()
                    .nth(slot)
                    .ok_or_else(|| CudaKernelError::Internal {
                        op: c.op,
                        detail: format!("the plan has no scratch slot {slot} for its status word"),
                    })?;
            Some(Pending {
                status,
                ids: ids.clone(),
                stream: c.stream.clone(),
                kernels: c.k.clone(),
            })
        }
    };
    Ok(IndexCheck {
        op: c.op,
        what,
        bound,
        pending,
    })
}

/// The embedding gather, with the id check; returns the plan and its status slot.
#[cfg(test)]
pub(crate) fn plan_embedding(
    n: u64,
    dim: u64,
    rows: u64,
    ids: Ptr,
    table: Ptr,
    out: Ptr,
) -> (Plan, Option<usize>) {
    plan_embedding_t([0, 0], n, dim, rows, ids, table, out)
}

/// [`plan_embedding`] with `codes = [table, out]` element codes (see `typed.rs`): the typed
/// kernel `embedding_fwd_t`, or `embedding_fwd` when both are f32.
pub(crate) fn plan_embedding_t(
    codes: [u64; 2],
    n: u64,
    dim: u64,
    rows: u64,
    ids: Ptr,
    table: Ptr,
    out: Ptr,
) -> (Plan, Option<usize>) {
    let mut plan = Plan::new();
    let status = plan_check(&mut plan, n, ids, rows);
    let total = n * dim;
    if total > 0 {
        let mut args = vec![
            PArg::U64(total),
            PArg::U64(dim),
            PArg::U64(rows),
            PArg::Ptr(ids),
            PArg::Ptr(table),
            PArg::Ptr(out),
        ];
        let kernel = if codes == [0, 0] {
            Kernel::EmbeddingFwd
        } else {
            args.insert(0, PArg::U64(types_word(&[0, codes[0], codes[1]])));
            Kernel::EmbeddingFwdT
        };
        plan.launch(kernel, grid_for(total), args);
    }
    (plan, status)
}

/// The embedding backward (counting sort, then per-row accumulation), with the id check;
/// returns the plan and its status slot.
#[cfg(test)]
pub(crate) fn plan_embedding_backward(
    n: u64,
    dim: u64,
    rows: u64,
    ids: Ptr,
    dy: Ptr,
    dtable: Ptr,
) -> (Plan, Option<usize>) {
    plan_embedding_backward_t([0, 0], n, dim, rows, ids, dy, dtable)
}

/// [`plan_embedding_backward`] with `codes = [dy, dtable]` element codes (see `typed.rs`): the
/// accumulation by `emb_accum_t`, or `emb_accum` when both are f32.
pub(crate) fn plan_embedding_backward_t(
    codes: [u64; 2],
    n: u64,
    dim: u64,
    rows: u64,
    ids: Ptr,
    dy: Ptr,
    dtable: Ptr,
) -> (Plan, Option<usize>) {
    let mut plan = Plan::new();
    let status = plan_check(&mut plan, n, ids, rows);
    if rows == 0 || dim == 0 {
        return (plan, status);
    }
    if n == 0 {
        // Zero bits are +0.0 in f32, f16 and bf16.
        let size = if codes[1] == 0 { 4 } else { 2 };
        plan.memset(dtable, 0, (rows * dim * size) as usize);
        return (plan, status);
    }
    let count = Ptr::scratch(plan.scratch(rows as usize, Elem::U32));
    let start = Ptr::scratch(plan.scratch(rows as usize, Elem::U32));
    let rank = Ptr::scratch(plan.scratch(n as usize, Elem::U32));
    let order = Ptr::scratch(plan.scratch(n as usize, Elem::U32));
    plan.memset(count, 0, rows as usize * 4);
    plan.launch(
        Kernel::EmbRank,
        1,
        vec![
            PArg::U64(n),
            PArg::Ptr(ids),
            PArg::U64(rows),
            PArg::Ptr(count),
            PArg::Ptr(rank),
        ],
    );
    plan.launch(
        Kernel::EmbScan,
        1,
        vec![PArg::U64(rows), PArg::Ptr(count), PArg::Ptr(start)],
    );
    plan.launch(
        Kernel::EmbScatter,
        grid_for(n),
        vec![
            PArg::U64(n),
            PArg::U64(rows),
            PArg::Ptr(ids),
            PArg::Ptr(start),
            PArg::Ptr(rank),
            PArg::Ptr(order),
        ],
    );
    let mut args = vec![
        PArg::U64(rows),
        PArg::U64(dim),
        PArg::Ptr(start),
        PArg::Ptr(count),
        PArg::Ptr(order),
        PArg::Ptr(dy),
        PArg::Ptr(dtable),
    ];
    let kernel = if codes == [0, 0] {
        Kernel::EmbAccum
    } else {
        args.insert(0, PArg::U64(types_word(&[0, 0, 0, codes[0], codes[1]])));
        Kernel::EmbAccumT
    };
    plan.launch(kernel, grid_rows(rows), args);
    (plan, status)
}

/// A float operand's element type for the buffer checks, and its code (see `typed.rs`).
pub(crate) fn float_operand(
    op: &'static str,
    arg: &'static str,
    dtype: DType,
) -> Result<(Elem, u64)> {
    match type_code(dtype) {
        Some(0) => Ok((Elem::F32, 0)),
        Some(code) => Ok((Elem::U16, code)),
        None => Err(KernelError::InvalidShape {
            op,
            reason: format!("`{arg}` is {dtype}; this kernel takes f32, f16 or bf16"),
        }
        .into()),
    }
}

/// `u32` positions are used by the backward's sort.
fn check_u32(op: &'static str, what: &'static str, v: usize) -> Result<()> {
    if v as u64 > u32::MAX as u64 {
        return Err(CudaKernelError::TooLarge {
            op,
            what,
            value: v as u64,
            limit: u32::MAX as u64,
        });
    }
    Ok(())
}

impl CudaKernels {
    /// Embedding lookup `out[i, :] = table[ids[i], :]` (CPU:
    /// [`cpu::embedding`](crate::kernels::cpu::embedding)); ids are `i64` on the device.
    ///
    /// Ids are validated on the device (see [`IndexCheck`]): rows of out-of-range ids are filled
    /// with NaN and reported by the returned check's [`IndexCheck::wait`]. Valid rows are exact
    /// copies, bit-identical to the CPU.
    ///
    /// # Errors
    /// The CPU kernel's shape errors; buffer/stream errors; `out` overlapping `ids` or `table`;
    /// scratch allocation failure.
    pub fn embedding(
        &self,
        stream: &Stream,
        ids: &BufferRef,
        table: &BufferRef,
        out: &BufferRef,
        dim: usize,
    ) -> Result<IndexCheck> {
        let f = DType::F32;
        self.embedding_t(stream, ids, (table, f), (out, f), dim)
    }

    /// [`CudaKernels::embedding`] with `table` and `out` each f32, f16 or bf16 (typed kernels:
    /// the bits of the cast-around path, see `typed.rs`).
    pub(crate) fn embedding_t(
        &self,
        stream: &Stream,
        ids: &BufferRef,
        (table, table_dt): TBuf<'_>,
        (out, out_dt): TBuf<'_>,
        dim: usize,
    ) -> Result<IndexCheck> {
        let op = "embedding";
        let c = self.call(op, stream)?;
        let (te, tc) = float_operand(op, "table", table_dt)?;
        let (oe, oc) = float_operand(op, "out", out_dt)?;
        let dids = c.buf("ids", ids, Elem::I64)?;
        let dt = c.buf("table", table, te)?;
        let rows = rows_of(op, "table", dt.len, dim)?;
        let dout = c.buf("out", out, oe)?;
        let total = mul(op, dids.len, dim)?;
        expect_len(op, "out", dout.len, total, || {
            format!("ids={}, dim={dim}, table rows={rows}", dids.len)
        })?;
        c.disjoint(&[("out", out)], &[("ids", ids), ("table", table)])?;
        let (plan, status) = plan_embedding_t(
            [tc, oc],
            dids.len as u64,
            dim as u64,
            rows as u64,
            dids.as_ptr(),
            dt.as_ptr(),
            dout.as_ptr(),
        );
        // SAFETY: ids holds total/dim i64, table rows·dim and out total elements of their dtypes
        // on this device;
        // out overlaps neither input; the kernels read table only at in-range ids.
        unsafe { exec_checked(&c, &plan, status, "id", ids, rows) }
    }

    /// Embedding backward: `dtable` is **overwritten** with `Σ_{i: ids[i] = r} dy[i, :]` in row
    /// `r` (CPU: [`cpu::embedding_backward`](crate::kernels::cpu::embedding_backward)).
    ///
    /// Deterministic without atomics: a stable counting sort groups the positions by id (one
    /// block ranks positions in tiles, an exclusive scan gives each id's start, a scatter writes
    /// the grouped order), then one block per table row adds its `dy` rows in position order —
    /// the CPU kernel's order, so the result is bit-identical. Out-of-range ids are skipped and
    /// reported by the returned [`IndexCheck`]. Scratch: `2·rows + 2·n` `u32`. The ranking pass
    /// runs on one block (`O(n)` steps per thread), which bounds its speed for very long id
    /// lists.
    ///
    /// # Errors
    /// The CPU kernel's shape errors; [`CudaKernelError::TooLarge`] for more than `u32::MAX`
    /// ids; buffer/stream errors; `dtable` overlapping `ids` or `dy`; scratch allocation
    /// failure.
    pub fn embedding_backward(
        &self,
        stream: &Stream,
        ids: &BufferRef,
        dy: &BufferRef,
        dtable: &BufferRef,
        dim: usize,
    ) -> Result<IndexCheck> {
        let f = DType::F32;
        self.embedding_backward_t(stream, ids, (dy, f), (dtable, f), dim)
    }

    /// [`CudaKernels::embedding_backward`] with `dy` and `dtable` each f32, f16 or bf16 (typed
    /// kernels: the bits of the cast-around path, see `typed.rs`).
    pub(crate) fn embedding_backward_t(
        &self,
        stream: &Stream,
        ids: &BufferRef,
        (dy, dy_dt): TBuf<'_>,
        (dtable, dtable_dt): TBuf<'_>,
        dim: usize,
    ) -> Result<IndexCheck> {
        let op = "embedding_backward";
        let c = self.call(op, stream)?;
        let (ge, gc) = float_operand(op, "dy", dy_dt)?;
        let (de, dc) = float_operand(op, "dtable", dtable_dt)?;
        let dids = c.buf("ids", ids, Elem::I64)?;
        let ddt = c.buf("dtable", dtable, de)?;
        let rows = rows_of(op, "dtable", ddt.len, dim)?;
        let ddy = c.buf("dy", dy, ge)?;
        let n = dids.len;
        expect_len(op, "dy", ddy.len, mul(op, n, dim)?, || {
            format!("ids={n}, dim={dim}, table rows={rows}")
        })?;
        check_u32(op, "ids", n)?;
        c.disjoint(&[("dtable", dtable)], &[("ids", ids), ("dy", dy)])?;
        let (plan, status) = plan_embedding_backward_t(
            [gc, dc],
            n as u64,
            dim as u64,
            rows as u64,
            dids.as_ptr(),
            ddy.as_ptr(),
            ddt.as_ptr(),
        );
        // SAFETY: ids holds n i64, dy n·dim and dtable rows·dim elements of their dtypes on this
        // device; dtable
        // overlaps neither input. The sort's scratch is sized by the plan (rows and n u32
        // slots); for every valid position i, start[id] + rank[i] < n, so the scatter writes
        // `order` in bounds and the accumulation reads dy only at positions < n; block r writes
        // row r of dtable only.
        unsafe { exec_checked(&c, &plan, status, "id", ids, rows) }
    }
}
