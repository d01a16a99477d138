//! Row-wise kernels: softmax and layer norm, with their backward passes (one thread block per
//! row, fixed-tree f64 reductions).

use fsdp_alloc::{BufferRef, Stream};

use super::context::{expect_len, grid_rows, row_args, rows_of, CudaKernels, Elem};
use super::elementwise::grid_col_groups;
use super::error::Result;
use super::plan::{PArg, Plan, Ptr};
use super::program::Kernel;

/// One block per row of a row-wise kernel (nothing for zero rows).
fn plan_rows(kernel: Kernel, rows: u64, args: Vec<PArg>) -> Plan {
    let mut plan = Plan::new();
    if rows > 0 {
        plan.launch(kernel, grid_rows(rows), args);
    }
    plan
}

/// Row softmax of `rows × cols`.
pub(crate) fn plan_softmax(rows: u64, cols: u64, x: Ptr, y: Ptr) -> Plan {
    plan_rows(Kernel::SoftmaxFwd, rows, row_args(rows, cols, &[x, y]))
}

/// Row softmax backward.
pub(crate) fn plan_softmax_backward(rows: u64, cols: u64, y: Ptr, dy: Ptr, dx: Ptr) -> Plan {
    plan_rows(Kernel::SoftmaxBwd, rows, row_args(rows, cols, &[y, dy, dx]))
}

/// Layer norm forward; `p = [x, gamma, beta, y, mean, rstd]`.
pub(crate) fn plan_layer_norm(rows: u64, cols: u64, eps: f32, p: [Ptr; 6]) -> Plan {
    let mut args = vec![PArg::U64(rows), PArg::U64(cols), PArg::F32(eps)];
    args.extend(p.iter().map(|&q| PArg::Ptr(q)));
    plan_rows(Kernel::LayerNormFwd, rows, args)
}

/// Layer norm backward; `p = [x, gamma, mean, rstd, dy, dx, dgamma, dbeta]`.
pub(crate) fn plan_layer_norm_backward(rows: u64, cols: u64, p: [Ptr; 8]) -> Plan {
    let [x, gamma, mean, rstd, dy, dx, dgamma, dbeta] = p;
    let mut plan = plan_rows(
        Kernel::LayerNormBwdDx,
        rows,
        row_args(rows, cols, &[x, gamma, mean, rstd, dy, dx]),
    );
    // With zero rows the parameter gradients are empty sums: the kernel writes zeros.
    plan.launch(
        Kernel::LayerNormBwdParams,
        grid_col_groups(cols),
        row_args(rows, cols, &[x, mean, rstd, dy, dgamma, dbeta]),
    );
    plan
}

impl CudaKernels {
    /// Row-wise softmax of a row-major matrix with `cols` columns (CPU:
    /// [`cpu::softmax_rows`](crate::kernels::cpu::softmax_rows)): the row maximum is subtracted,
    /// the exponentials (CUDA `expf`) are summed in f64 over a fixed tree, and the row is scaled
    /// by the rounded reciprocal, as on the CPU. Rows whose maximum is not finite give NaNs.
    ///
    /// # Errors
    /// The CPU kernel's shape errors; buffer/stream errors; `y` overlapping `x`.
    pub fn softmax_rows(
        &self,
        stream: &Stream,
        x: &BufferRef,
        y: &BufferRef,
        cols: usize,
    ) -> Result<()> {
        let op = "softmax_rows";
        let c = self.call(op, stream)?;
        let [dx, dy] = c.f32_bufs([("x", x), ("y", y)])?;
        let rows = rows_of(op, "x", dx.len, cols)?;
        expect_len(op, "y", dy.len, dx.len, || format!("len(x)={}", dx.len))?;
        c.disjoint(&[("y", y)], &[("x", x)])?;
        let plan = plan_softmax(rows as u64, cols as u64, dx.as_ptr(), dy.as_ptr());
        // SAFETY: x and y hold rows·cols f32 each on this device and do not overlap; block r
        // touches row r only.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// Gradient of [`CudaKernels::softmax_rows`] from its output `y`:
    /// `dx = y ⊙ (dy − Σ_j y·dy)` per row (CPU:
    /// [`cpu::softmax_rows_backward`](crate::kernels::cpu::softmax_rows_backward)).
    ///
    /// # Errors
    /// The CPU kernel's shape errors; buffer/stream errors; `dx` overlapping `y` or `dy`.
    pub fn softmax_rows_backward(
        &self,
        stream: &Stream,
        y: &BufferRef,
        dy: &BufferRef,
        dx: &BufferRef,
        cols: usize,
    ) -> Result<()> {
        let op = "softmax_rows_backward";
        let c = self.call(op, stream)?;
        let [by, bdy, bdx] = c.f32_bufs([("y", y), ("dy", dy), ("dx", dx)])?;
        let rows = rows_of(op, "y", by.len, cols)?;
        let shape = || format!("len(y)={}", by.len);
        expect_len(op, "dy", bdy.len, by.len, shape)?;
        expect_len(op, "dx", bdx.len, by.len, shape)?;
        c.disjoint(&[("dx", dx)], &[("y", y), ("dy", dy)])?;
        let plan = plan_softmax_backward(
            rows as u64,
            cols as u64,
            by.as_ptr(),
            bdy.as_ptr(),
            bdx.as_ptr(),
        );
        // SAFETY: y, dy and dx hold rows·cols f32 each on this device; dx overlaps neither input.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// Layer norm over the last dimension (CPU: [`cpu::layer_norm`](crate::kernels::cpu::layer_norm)):
    /// `y = (x − mean)·rstd·gamma + beta`, biased variance, two-pass f64 statistics (fixed tree),
    /// saving per-row `mean` and `rstd` (f32) for the backward.
    ///
    /// # Errors
    /// The CPU kernel's shape errors (`gamma`/`beta` of `cols`, `mean`/`rstd` of one per row);
    /// buffer/stream errors; an output overlapping any other argument.
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm(
        &self,
        stream: &Stream,
        x: &BufferRef,
        gamma: &BufferRef,
        beta: &BufferRef,
        y: &BufferRef,
        mean: &BufferRef,
        rstd: &BufferRef,
        cols: usize,
        eps: f32,
    ) -> Result<()> {
        let op = "layer_norm";
        let c = self.call(op, stream)?;
        let bx = c.buf("x", x, Elem::F32)?;
        let rows = rows_of(op, "x", bx.len, cols)?;
        let shape = || format!("rows={rows}, cols={cols}");
        let [bg, bb, by, bm, br] = c.f32_sized(
            [
                ("gamma", gamma, cols),
                ("beta", beta, cols),
                ("y", y, bx.len),
                ("mean", mean, rows),
                ("rstd", rstd, rows),
            ],
            shape,
        )?;
        c.disjoint(
            &[("y", y), ("mean", mean), ("rstd", rstd)],
            &[("x", x), ("gamma", gamma), ("beta", beta)],
        )?;
        let plan = plan_layer_norm(
            rows as u64,
            cols as u64,
            eps,
            [bx, bg, bb, by, bm, br].map(|d| d.as_ptr()),
        );
        // SAFETY: x and y hold rows·cols f32, gamma and beta cols f32, mean and rstd rows f32,
        // all on this device; the outputs overlap nothing else; block r writes row r and
        // mean[r], rstd[r].
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// Gradient of [`CudaKernels::layer_norm`] (CPU:
    /// [`cpu::layer_norm_backward`](crate::kernels::cpu::layer_norm_backward)): `dx` per row
    /// (one block per row, f64 row means), and `dgamma = Σ_r dy·x̂`, `dbeta = Σ_r dy`, each
    /// column's rows added in order 0, 1, … in f32 (the CPU's order; one block per group of 8
    /// columns staging row tiles through shared memory, as [`CudaKernels::col_sums`]). All three
    /// are overwritten.
    ///
    /// # Errors
    /// As [`CudaKernels::layer_norm`], with `dy`/`dx` matching `x` and `dgamma`/`dbeta` of `cols`.
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm_backward(
        &self,
        stream: &Stream,
        x: &BufferRef,
        gamma: &BufferRef,
        mean: &BufferRef,
        rstd: &BufferRef,
        dy: &BufferRef,
        dx: &BufferRef,
        dgamma: &BufferRef,
        dbeta: &BufferRef,
        cols: usize,
    ) -> Result<()> {
        let op = "layer_norm_backward";
        let c = self.call(op, stream)?;
        let bx = c.buf("x", x, Elem::F32)?;
        let rows = rows_of(op, "x", bx.len, cols)?;
        let shape = || format!("rows={rows}, cols={cols}");
        let [bg, bm, br, bdy, bdx, bdg, bdb] = c.f32_sized(
            [
                ("gamma", gamma, cols),
                ("mean", mean, rows),
                ("rstd", rstd, rows),
                ("dy", dy, bx.len),
                ("dx", dx, bx.len),
                ("dgamma", dgamma, cols),
                ("dbeta", dbeta, cols),
            ],
            shape,
        )?;
        c.disjoint(
            &[("dx", dx), ("dgamma", dgamma), ("dbeta", dbeta)],
            &[
                ("x", x),
                ("gamma", gamma),
                ("mean", mean),
                ("rstd", rstd),
                ("dy", dy),
            ],
        )?;
        let plan = plan_layer_norm_backward(
            rows as u64,
            cols as u64,
            [bx, bg, bm, br, bdy, bdx, bdg, bdb].map(|d| d.as_ptr()),
        );
        // SAFETY: x, dy and dx hold rows·cols f32, gamma, dgamma and dbeta cols f32, mean and
        // rstd rows f32, all on this device; the outputs overlap no other argument; block r
        // writes row r of dx, and the block owning column j's group writes dgamma[j], dbeta[j].
        unsafe { c.exec(&plan) }.map(drop)
    }
}
