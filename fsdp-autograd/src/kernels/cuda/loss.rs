//! Cross-entropy with integer class targets.

use fsdp_alloc::{BufferRef, Stream};

use super::context::{expect_len, grid_rows, row_args, rows_of, Call, CudaKernels, Dev, Elem};
use super::embedding::{exec_checked, plan_check, IndexCheck};
use super::error::Result;
use super::plan::{PArg, Plan, Ptr};
use super::program::Kernel;
use crate::kernels::KernelError;

/// Cross-entropy forward (`rows > 0`): target check, per-row lse and f64 loss into scratch, then
/// the mean into `loss`. Returns the plan and its status slot.
pub(crate) fn plan_cross_entropy(
    rows: u64,
    cols: u64,
    logits: Ptr,
    targets: Ptr,
    lse: Ptr,
    loss: Ptr,
) -> (Plan, Option<usize>) {
    let mut plan = Plan::new();
    let status = plan_check(&mut plan, rows, targets, cols);
    let row_loss = Ptr::scratch(plan.scratch(rows as usize, Elem::F64));
    plan.launch(
        Kernel::CeFwd,
        grid_rows(rows),
        row_args(rows, cols, &[logits, targets, lse, row_loss]),
    );
    plan.launch(
        Kernel::SumFinal,
        1,
        vec![
            PArg::U64(rows),
            PArg::Ptr(row_loss),
            PArg::F64(rows as f64),
            PArg::Ptr(loss),
        ],
    );
    (plan, status)
}

/// Cross-entropy backward (`rows > 0`), with the target check.
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
    let mut plan = Plan::new();
    let status = plan_check(&mut plan, rows, targets, cols);
    plan.launch(
        Kernel::CeBwd,
        grid_rows(rows),
        row_args(rows, cols, &[logits, targets, lse, dloss, dlogits]),
    );
    (plan, status)
}

/// Shared checks: logits rows, one target and one lse per row, at least one row.
fn shapes(
    c: &Call<'_>,
    logits: &BufferRef,
    targets: &BufferRef,
    lse: &BufferRef,
    cols: usize,
) -> Result<(Dev, Dev, Dev, usize)> {
    let op = c.op;
    let dl = c.buf("logits", logits, Elem::F32)?;
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
        let op = "cross_entropy";
        let c = self.call(op, stream)?;
        let (dl, dt, dlse, rows) = shapes(&c, logits, targets, lse, cols)?;
        let dloss = c.buf("loss", loss, Elem::F32)?;
        expect_len(op, "loss", dloss.len, 1, || "a scalar output".into())?;
        c.disjoint(
            &[("lse", lse), ("loss", loss)],
            &[("logits", logits), ("targets", targets)],
        )?;
        let (plan, status) = plan_cross_entropy(
            rows as u64,
            cols as u64,
            dl.as_ptr(),
            dt.as_ptr(),
            dlse.as_ptr(),
            dloss.as_ptr(),
        );
        // SAFETY: logits holds rows·cols f32, targets rows i64, lse rows f32 and loss one f32 on
        // this device; the outputs overlap nothing else; the row losses live in the plan's
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
        let op = "cross_entropy_backward";
        let c = self.call(op, stream)?;
        let (dl, dt, dlse, rows) = shapes(&c, logits, targets, lse, cols)?;
        let dd = c.buf("dloss", dloss, Elem::F32)?;
        expect_len(op, "dloss", dd.len, 1, || {
            "a scalar upstream gradient".into()
        })?;
        let dg = c.buf("dlogits", dlogits, Elem::F32)?;
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
        let (plan, status) = plan_cross_entropy_backward(
            rows as u64,
            cols as u64,
            dl.as_ptr(),
            dt.as_ptr(),
            dlse.as_ptr(),
            dd.as_ptr(),
            dg.as_ptr(),
        );
        // SAFETY: logits and dlogits hold rows·cols f32, targets rows i64, lse rows f32, dloss
        // one f32, all on this device; dlogits overlaps nothing else; block r writes row r.
        unsafe { exec_checked(&c, &plan, status, "target", targets, cols) }
    }
}
