//! Cross-entropy with integer targets: [`CrossEntropy`] (mean loss, per-row log-sum-exp saved)
//! and [`CrossEntropyBackward`].

use fsdp_alloc::{DType, Stream};

use super::cpu;
use super::op::{invalid, Check, Op, Rows, Spec};
use super::operand::Operand;
use crate::error::Result;
use crate::launch::launch_f32;

/// Mean cross-entropy of `rows × cols` logits; writes the one-element `loss` and the per-row
/// log-sum-exp `lse` (`f32`). A target out of range fails the stream.
#[derive(Debug, Clone, Copy)]
pub struct CrossEntropy<'a> {
    /// The shape of the logits.
    pub rows: Rows,
    /// Logits.
    pub logits: &'a Operand,
    /// Targets (`i64`).
    pub targets: &'a Operand,
    /// One-element loss.
    pub loss: &'a Operand,
    /// Per-row log-sum-exp (`f32`).
    pub lse: &'a Operand,
}

impl Op for CrossEntropy<'_> {
    fn name(&self) -> &'static str {
        "cross_entropy"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, rows) = (self.name(), self.rows);
        let n = rows.numel(op)?;
        let table = [
            Spec::float("logits", self.logits, n),
            Spec::exact("targets", self.targets, DType::I64, "targets", rows.rows),
            Spec::float("loss", self.loss, 1),
            Spec::exact("lse", self.lse, DType::F32, "log-sum-exp", rows.rows),
        ];
        c.args(op, || format!("{rows:?}"), &table)?;
        if rows.rows == 0 {
            return Err(invalid(op, "cross-entropy needs at least one row"));
        }
        Ok(true)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (targets, cols, op) = (self.targets.clone(), self.rows.cols, "cross_entropy");
        let (logits, lse, loss) = (self.logits, self.lse, self.loss);
        launch_f32(s, op, [logits], [lse, loss], false, move |[l], [e, o]| {
            o[0] = targets.typed::<i64, _>(op, |t| cpu::cross_entropy(l, t, cols, e))?;
            Ok(())
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &super::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use super::cuda::launcher::{err, tb, typed};
        let (op, k, cols) = ("cross_entropy", b.kernels(), self.rows.cols);
        let (logits, loss) = (self.logits, self.loss);
        let (t, e) = (&self.targets.buf, &self.lse.buf);
        if typed(&[logits, loss]) {
            let check = k
                .cross_entropy_t(s, tb(logits), t, cols, e, tb(loss))
                .map_err(err(op))?;
            b.defer(check);
            return Ok(());
        }
        let mut f = b.scope(op, s);
        let (l, o) = (f.input(logits)?, f.output(loss, false)?);
        let check = k.cross_entropy(s, &l, t, cols, e, &o).map_err(err(op))?;
        b.defer(check);
        f.finish()
    }
}

/// Cross-entropy backward, the upstream gradient read from the one-element `dloss`.
#[derive(Debug, Clone, Copy)]
pub struct CrossEntropyBackward<'a> {
    /// The shape of the logits.
    pub rows: Rows,
    /// Logits.
    pub logits: &'a Operand,
    /// Targets (`i64`).
    pub targets: &'a Operand,
    /// The forward's per-row log-sum-exp.
    pub lse: &'a Operand,
    /// One-element upstream gradient.
    pub dloss: &'a Operand,
    /// Gradient of the logits.
    pub dlogits: &'a Operand,
}

impl Op for CrossEntropyBackward<'_> {
    fn name(&self) -> &'static str {
        "cross_entropy_backward"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, rows) = (self.name(), self.rows);
        let n = rows.numel(op)?;
        let table = [
            Spec::float("logits", self.logits, n),
            Spec::float("dlogits", self.dlogits, n),
            Spec::exact("targets", self.targets, DType::I64, "targets", rows.rows),
            Spec::exact("lse", self.lse, DType::F32, "log-sum-exp", rows.rows),
            Spec::float("dloss", self.dloss, 1),
        ];
        c.args(op, || format!("{rows:?}"), &table)?;
        Ok(rows.rows > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (targets, cols) = (self.targets.clone(), self.rows.cols);
        let op = "cross_entropy_backward";
        let ins = [self.logits, self.lse, self.dloss];
        launch_f32(s, op, ins, [self.dlogits], false, move |[l, e, g], [d]| {
            let dl = g[0];
            targets.typed::<i64, _>(op, |t| cpu::cross_entropy_backward(l, t, e, dl, d, cols))
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &super::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use super::cuda::launcher::{err, tb, typed};
        let (op, k, cols) = ("cross_entropy_backward", b.kernels(), self.rows.cols);
        let (logits, dloss, dlogits) = (self.logits, self.dloss, self.dlogits);
        let (t, e) = (&self.targets.buf, &self.lse.buf);
        if typed(&[logits, dloss, dlogits]) {
            let (l, g, d) = (tb(logits), tb(dloss), tb(dlogits));
            let check = k
                .cross_entropy_backward_t(s, l, t, e, g, d, cols)
                .map_err(err(op))?;
            b.defer(check);
            return Ok(());
        }
        let mut f = b.scope(op, s);
        let [l, g] = f.inputs([logits, dloss])?;
        let d = f.output(dlogits, false)?;
        let check = k
            .cross_entropy_backward(s, &l, t, e, &g, &d, cols)
            .map_err(err(op))?;
        b.defer(check);
        f.finish()
    }
}

/// The family's part of the CUDA program: `loss.cu` and the op's kernel table.
#[cfg(feature = "cuda")]
pub(crate) const FAMILY: super::cuda::kernel::Family = super::cuda::kernel::Family {
    sources: &[include_str!("loss.cu")],
    kernels: &[gpu::KERNELS],
};

/// The CUDA side of the op (feature `cuda`): its kernels' declarations, launch plans and
/// [`CudaKernels`](crate::kernels::cuda::CudaKernels) methods.
#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use fsdp_alloc::{BufferRef, DType, Stream};

    use crate::kernels::cuda::context::{
        expect_len, row_args, rows_of, Call, CudaKernels, Dev, Elem,
    };
    use crate::kernels::cuda::error::Result;
    use crate::kernels::cuda::index::{exec_checked, plan_check, IndexCheck};
    use crate::kernels::cuda::plan::{grid_rows, PArg, Plan, Ptr};
    use crate::kernels::cuda::typed::{float_operand, types_word, TBuf};
    use crate::kernels::reduce::sum::gpu::{SUM_FINAL, SUM_FINAL_T};
    use crate::kernels::KernelError;

    crate::kernels::cuda::kernel::declare_kernels! {
        CE_FWD = "ce_fwd" [U64, U64, Ptr, Ptr, Ptr, Ptr];
        CE_BWD = "ce_bwd" [U64, U64, Ptr, Ptr, Ptr, Ptr, Ptr];
        CE_FWD_T = "ce_fwd_t" [U64, U64, U64, Ptr, Ptr, Ptr, Ptr];
        CE_BWD_T = "ce_bwd_t" [U64, U64, U64, Ptr, Ptr, Ptr, Ptr, Ptr];
    }

    /// Element codes of a cross-entropy call's float operands (see `typed.rs`): the logits, the
    /// loss (forward) or upstream gradient (backward), and the logits' gradient (backward). All zero
    /// selects the f32 kernels.
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
    pub(crate) struct CeCodes {
        /// Code of `logits`.
        pub(crate) logits: u64,
        /// Code of `loss` (forward) or `dloss` (backward).
        pub(crate) scalar: u64,
        /// Code of `dlogits` (backward only).
        pub(crate) dlogits: u64,
    }

    /// Cross-entropy forward (`rows > 0`): target check, per-row lse and f64 loss into scratch, then
    /// the mean into `loss`. Returns the plan and its status slot.
    #[cfg(test)]
    pub(crate) fn plan_cross_entropy(
        rows: u64,
        cols: u64,
        logits: Ptr,
        targets: Ptr,
        lse: Ptr,
        loss: Ptr,
    ) -> (Plan, Option<usize>) {
        plan_cross_entropy_t(CeCodes::default(), rows, cols, logits, targets, lse, loss)
    }

    /// [`plan_cross_entropy`] with half `logits` and/or `loss` (the typed kernels `ce_fwd_t`,
    /// `sum_final_t`; the f32 kernels when every code is f32).
    pub(crate) fn plan_cross_entropy_t(
        codes: CeCodes,
        rows: u64,
        cols: u64,
        logits: Ptr,
        targets: Ptr,
        lse: Ptr,
        loss: Ptr,
    ) -> (Plan, Option<usize>) {
        let f32 = codes == CeCodes::default();
        let mut plan = Plan::new();
        let status = plan_check(&mut plan, rows, targets, cols);
        let row_loss = Ptr::scratch(plan.scratch(rows as usize, Elem::F64));
        let (mut fwd, mut fin) = (Vec::new(), Vec::new());
        if !f32 {
            fwd.push(PArg::U64(types_word(&[codes.logits])));
            fin.push(PArg::U64(types_word(&[0, codes.scalar])));
        }
        fwd.extend(row_args(rows, cols, &[logits, targets, lse, row_loss]));
        fin.extend([
            PArg::U64(rows),
            PArg::Ptr(row_loss),
            PArg::F64(rows as f64),
            PArg::Ptr(loss),
        ]);
        let (k_fwd, k_fin) = if f32 {
            (CE_FWD, SUM_FINAL)
        } else {
            (CE_FWD_T, SUM_FINAL_T)
        };
        plan.launch(k_fwd, grid_rows(rows), fwd);
        plan.launch(k_fin, 1, fin);
        (plan, status)
    }

    /// Cross-entropy backward (`rows > 0`), with the target check.
    #[cfg(test)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn plan_cross_entropy_backward(
        rows: u64,
        cols: u64,
        logits: Ptr,
        targets: Ptr,
        lse: Ptr,
        dloss: Ptr,
        dlogits: Ptr,
    ) -> (Plan, Option<usize>) {
        let p = [logits, targets, lse, dloss, dlogits];
        plan_cross_entropy_backward_t(CeCodes::default(), rows, cols, p)
    }

    /// [`plan_cross_entropy_backward`] with half operands (`ce_bwd_t`; `ce_bwd` when every code is
    /// f32); `p = [logits, targets, lse, dloss, dlogits]`.
    pub(crate) fn plan_cross_entropy_backward_t(
        codes: CeCodes,
        rows: u64,
        cols: u64,
        p: [Ptr; 5],
    ) -> (Plan, Option<usize>) {
        let mut plan = Plan::new();
        let status = plan_check(&mut plan, rows, p[1], cols);
        if codes == CeCodes::default() {
            plan.launch(CE_BWD, grid_rows(rows), row_args(rows, cols, &p));
        } else {
            let types = types_word(&[codes.logits, 0, 0, codes.scalar, codes.dlogits]);
            let mut args = vec![PArg::U64(types)];
            args.extend(row_args(rows, cols, &p));
            plan.launch(CE_BWD_T, grid_rows(rows), args);
        }
        (plan, status)
    }

    /// Shared checks: logits rows, one target and one lse per row, at least one row.
    fn shapes(
        c: &Call<'_>,
        logits: &BufferRef,
        logits_elem: Elem,
        targets: &BufferRef,
        lse: &BufferRef,
        cols: usize,
    ) -> Result<(Dev, Dev, Dev, usize)> {
        let op = c.op;
        let dl = c.buf("logits", logits, logits_elem)?;
        let rows = rows_of(op, "logits", dl.len, cols)?;
        let shape = || format!("rows={rows}, cols={cols}");
        let dt = c.buf("targets", targets, Elem::I64)?;
        expect_len(op, "targets", dt.len, rows, shape)?;
        let dlse = c.buf("lse", lse, Elem::F32)?;
        expect_len(op, "lse", dlse.len, rows, shape)?;
        if rows == 0 {
            return Err(KernelError::InvalidShape {
                op,
                reason: "the mean cross-entropy over zero rows is undefined; pass at least one row"
                    .into(),
            }
            .into());
        }
        Ok((dl, dt, dlse, rows))
    }

    impl CudaKernels {
        /// Mean cross-entropy of row-major `logits` (`rows × cols`) against `i64` class `targets`
        /// (CPU: [`cpu::cross_entropy`](crate::kernels::cpu::cross_entropy)), written to the
        /// one-element device buffer `loss` (no synchronization); saves the per-row log-sum-exp in
        /// `lse`.
        ///
        /// One block per row computes `lse_r` (max subtraction, f64 sum of CUDA `expf`, f64 `log`)
        /// and the f64 row loss; a fixed-tree f64 reduction takes the mean. Targets are validated
        /// on the device: a row with an out-of-range target has a NaN loss (so the mean is NaN) and
        /// is reported by the returned [`IndexCheck`].
        ///
        /// # Errors
        /// The CPU kernel's shape errors (including zero rows); buffer/stream errors; an output
        /// overlapping another argument; scratch allocation failure.
        pub fn cross_entropy(
            &self,
            stream: &Stream,
            logits: &BufferRef,
            targets: &BufferRef,
            cols: usize,
            lse: &BufferRef,
            loss: &BufferRef,
        ) -> Result<IndexCheck> {
            let (l, o) = ((logits, DType::F32), (loss, DType::F32));
            self.cross_entropy_t(stream, l, targets, cols, lse, o)
        }

        /// [`CudaKernels::cross_entropy`] with `logits` and `loss` each f32, f16 or bf16 (typed
        /// kernels: the bits of the cast-around path, see `typed.rs`).
        pub(crate) fn cross_entropy_t(
            &self,
            stream: &Stream,
            (logits, logits_dt): TBuf<'_>,
            targets: &BufferRef,
            cols: usize,
            lse: &BufferRef,
            (loss, loss_dt): TBuf<'_>,
        ) -> Result<IndexCheck> {
            let op = "cross_entropy";
            let c = self.call(op, stream)?;
            let (le, lc) = float_operand(op, "logits", logits_dt)?;
            let (oe, oc) = float_operand(op, "loss", loss_dt)?;
            let (dl, dt, dlse, rows) = shapes(&c, logits, le, targets, lse, cols)?;
            let dloss = c.buf("loss", loss, oe)?;
            expect_len(op, "loss", dloss.len, 1, || "a scalar output".into())?;
            c.disjoint(
                &[("lse", lse), ("loss", loss)],
                &[("logits", logits), ("targets", targets)],
            )?;
            let codes = CeCodes {
                logits: lc,
                scalar: oc,
                dlogits: 0,
            };
            let (plan, status) = plan_cross_entropy_t(
                codes,
                rows as u64,
                cols as u64,
                dl.as_ptr(),
                dt.as_ptr(),
                dlse.as_ptr(),
                dloss.as_ptr(),
            );
            // SAFETY: logits holds rows·cols elements of its dtype, targets rows i64, lse rows f32
            // and loss one element of its dtype on this device; the outputs overlap nothing else; the row losses live in the plan's
            // scratch (rows f64); block r writes lse[r] and row r's loss and reads logits only at
            // in-range targets.
            unsafe { exec_checked(&c, &plan, status, "target", targets, cols) }
        }

        /// Gradient of [`CudaKernels::cross_entropy`] scaled by the upstream gradient held in the
        /// one-element device buffer `dloss`:
        /// `dlogits[r, j] = (dloss / rows)·(exp(logits[r, j] − lse_r) − [j = targets[r]])` (CPU:
        /// [`cpu::cross_entropy_backward`](crate::kernels::cpu::cross_entropy_backward), which takes
        /// `dloss` as a host scalar). Rows with an out-of-range target become NaN and are reported by
        /// the returned [`IndexCheck`].
        ///
        /// # Errors
        /// As [`CudaKernels::cross_entropy`], plus `dloss` must hold one f32 and `dlogits` match
        /// `logits`.
        #[allow(clippy::too_many_arguments)]
        pub fn cross_entropy_backward(
            &self,
            stream: &Stream,
            logits: &BufferRef,
            targets: &BufferRef,
            lse: &BufferRef,
            dloss: &BufferRef,
            dlogits: &BufferRef,
            cols: usize,
        ) -> Result<IndexCheck> {
            let f = DType::F32;
            let (l, g, d) = ((logits, f), (dloss, f), (dlogits, f));
            self.cross_entropy_backward_t(stream, l, targets, lse, g, d, cols)
        }

        /// [`CudaKernels::cross_entropy_backward`] with `logits`, `dloss` and `dlogits` each f32,
        /// f16 or bf16 (typed kernels: the bits of the cast-around path, see `typed.rs`).
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn cross_entropy_backward_t(
            &self,
            stream: &Stream,
            (logits, logits_dt): TBuf<'_>,
            targets: &BufferRef,
            lse: &BufferRef,
            (dloss, dloss_dt): TBuf<'_>,
            (dlogits, dlogits_dt): TBuf<'_>,
            cols: usize,
        ) -> Result<IndexCheck> {
            let op = "cross_entropy_backward";
            let c = self.call(op, stream)?;
            let (le, lc) = float_operand(op, "logits", logits_dt)?;
            let (se, sc) = float_operand(op, "dloss", dloss_dt)?;
            let (ge, gc) = float_operand(op, "dlogits", dlogits_dt)?;
            let (dl, dt, dlse, rows) = shapes(&c, logits, le, targets, lse, cols)?;
            let dd = c.buf("dloss", dloss, se)?;
            expect_len(op, "dloss", dd.len, 1, || {
                "a scalar upstream gradient".into()
            })?;
            let dg = c.buf("dlogits", dlogits, ge)?;
            expect_len(op, "dlogits", dg.len, dl.len, || {
                format!("len(logits)={}", dl.len)
            })?;
            c.disjoint(
                &[("dlogits", dlogits)],
                &[
                    ("logits", logits),
                    ("targets", targets),
                    ("lse", lse),
                    ("dloss", dloss),
                ],
            )?;
            let codes = CeCodes {
                logits: lc,
                scalar: sc,
                dlogits: gc,
            };
            let (plan, status) = plan_cross_entropy_backward_t(
                codes,
                rows as u64,
                cols as u64,
                [dl, dt, dlse, dd, dg].map(|d| d.as_ptr()),
            );
            // SAFETY: logits and dlogits hold rows·cols elements of their dtypes, targets rows i64,
            // lse rows f32, dloss one element of its dtype, all on this device; dlogits overlaps nothing else; block r writes row r.
            unsafe { exec_checked(&c, &plan, status, "target", targets, cols) }
        }
    }
}
