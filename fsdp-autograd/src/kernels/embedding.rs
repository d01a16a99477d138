//! Embedding lookup: [`Embedding`] (a gather of table rows by `i64` id) and
//! [`EmbeddingBackward`] (the rows' gradients summed per id, in position order).

use fsdp_alloc::{DType, Stream};

use super::cpu;
use super::op::{mul, Check, Op, Spec};
use super::operand::Operand;
use crate::error::Result;
use crate::launch::launch_f32;

/// Embedding lookup of `ids` (`i64`) into a `vocab × dim` table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbeddingShape {
    /// Number of ids.
    pub ids: usize,
    /// Table rows.
    pub vocab: usize,
    /// Table columns.
    pub dim: usize,
}

/// Embedding lookup; an id out of range fails the stream.
#[derive(Debug, Clone, Copy)]
pub struct Embedding<'a> {
    /// The sizes.
    pub e: EmbeddingShape,
    /// Ids (`i64`).
    pub ids: &'a Operand,
    /// The `vocab × dim` table.
    pub table: &'a Operand,
    /// Output rows.
    pub out: &'a Operand,
}

impl Op for Embedding<'_> {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, e) = (self.name(), self.e);
        let args = [
            Spec::exact("ids", self.ids, DType::I64, "ids", e.ids),
            Spec::float("table", self.table, mul(op, e.vocab, e.dim)?),
            Spec::float("out", self.out, mul(op, e.ids, e.dim)?),
        ];
        c.args(op, || format!("{e:?}"), &args)?;
        Ok(e.ids > 0 && e.dim > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (ids, dim, op) = (self.ids.clone(), self.e.dim, "embedding");
        launch_f32(s, op, [self.table], [self.out], false, move |[t], [o]| {
            ids.typed::<i64, _>(op, |i| cpu::embedding(i, t, o, dim))
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &super::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use super::cuda::launcher::{err, tb, typed};
        let (op, k, dim) = ("embedding", b.kernels(), self.e.dim);
        let (ids, table, out) = (&self.ids.buf, self.table, self.out);
        if typed(&[table, out]) {
            let check = k
                .embedding_t(s, ids, tb(table), tb(out), dim)
                .map_err(err(op))?;
            b.defer(check);
            return Ok(());
        }
        let mut f = b.scope(op, s);
        let (t, o) = (f.input(table)?, f.output(out, false)?);
        let check = k.embedding(s, ids, &t, &o, dim).map_err(err(op))?;
        b.defer(check);
        f.finish()
    }
}

/// Embedding backward; overwrites `dtable` (deterministic order).
#[derive(Debug, Clone, Copy)]
pub struct EmbeddingBackward<'a> {
    /// The sizes.
    pub e: EmbeddingShape,
    /// Ids (`i64`).
    pub ids: &'a Operand,
    /// Upstream gradient.
    pub dy: &'a Operand,
    /// Gradient of the table.
    pub dtable: &'a Operand,
}

impl Op for EmbeddingBackward<'_> {
    fn name(&self) -> &'static str {
        "embedding_backward"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, e) = (self.name(), self.e);
        let args = [
            Spec::exact("ids", self.ids, DType::I64, "ids", e.ids),
            Spec::float("dy", self.dy, mul(op, e.ids, e.dim)?),
            Spec::float("dtable", self.dtable, mul(op, e.vocab, e.dim)?),
        ];
        c.args(op, || format!("{e:?}"), &args)?;
        Ok(e.vocab > 0 && e.dim > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (ids, dim, op) = (self.ids.clone(), self.e.dim, "embedding_backward");
        launch_f32(s, op, [self.dy], [self.dtable], false, move |[g], [d]| {
            ids.typed::<i64, _>(op, |i| cpu::embedding_backward(i, g, d, dim))
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &super::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use super::cuda::launcher::{err, tb, typed};
        let (op, k, dim) = ("embedding_backward", b.kernels(), self.e.dim);
        let (ids, dy, dtable) = (&self.ids.buf, self.dy, self.dtable);
        if typed(&[dy, dtable]) {
            let check = k
                .embedding_backward_t(s, ids, tb(dy), tb(dtable), dim)
                .map_err(err(op))?;
            b.defer(check);
            return Ok(());
        }
        let mut f = b.scope(op, s);
        let (g, d) = (f.input(dy)?, f.output(dtable, false)?);
        let check = k.embedding_backward(s, ids, &g, &d, dim).map_err(err(op))?;
        b.defer(check);
        f.finish()
    }
}

/// The family's part of the CUDA program: `embedding.cu` and the op's kernel table.
#[cfg(feature = "cuda")]
pub(crate) const FAMILY: super::cuda::kernel::Family = super::cuda::kernel::Family {
    sources: &[include_str!("embedding.cu")],
    kernels: &[gpu::KERNELS],
};

/// The CUDA side of the op (feature `cuda`): its kernels' declarations, launch plans and
/// [`CudaKernels`](crate::kernels::cuda::CudaKernels) methods.
#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use fsdp_alloc::{BufferRef, DType, Stream};

    use crate::kernels::cuda::context::{expect_len, mul, rows_of, CudaKernels, Elem};
    use crate::kernels::cuda::error::{CudaKernelError, Result};
    use crate::kernels::cuda::index::{exec_checked, plan_check, IndexCheck};
    use crate::kernels::cuda::plan::{grid_for, grid_rows, PArg, Plan, Ptr};
    use crate::kernels::cuda::typed::{float_operand, types_word, TBuf};

    crate::kernels::cuda::kernel::declare_kernels! {
        EMBEDDING_FWD = "embedding_fwd" [U64, U64, U64, Ptr, Ptr, Ptr];
        EMB_RANK = "emb_rank" [U64, Ptr, U64, Ptr, Ptr];
        EMB_SCAN = "emb_scan" [U64, Ptr, Ptr];
        EMB_SCATTER = "emb_scatter" [U64, U64, Ptr, Ptr, Ptr, Ptr];
        EMB_ACCUM = "emb_accum" [U64, U64, Ptr, Ptr, Ptr, Ptr, Ptr];
        EMBEDDING_FWD_T = "embedding_fwd_t" [U64, U64, U64, U64, Ptr, Ptr, Ptr];
        EMB_ACCUM_T = "emb_accum_t" [U64, U64, U64, Ptr, Ptr, Ptr, Ptr, Ptr];
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
                EMBEDDING_FWD
            } else {
                args.insert(0, PArg::U64(types_word(&[0, codes[0], codes[1]])));
                EMBEDDING_FWD_T
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
            EMB_RANK,
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
            EMB_SCAN,
            1,
            vec![PArg::U64(rows), PArg::Ptr(count), PArg::Ptr(start)],
        );
        plan.launch(
            EMB_SCATTER,
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
            EMB_ACCUM
        } else {
            args.insert(0, PArg::U64(types_word(&[0, 0, 0, codes[0], codes[1]])));
            EMB_ACCUM_T
        };
        plan.launch(kernel, grid_rows(rows), args);
        (plan, status)
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
}
