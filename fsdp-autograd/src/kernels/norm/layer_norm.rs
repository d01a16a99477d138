//! Layer normalization over the last dimension: [`LayerNorm`] and [`LayerNormBackward`].

use fsdp_alloc::{DType, Stream};

use crate::error::Result;
use crate::kernels::cpu;
use crate::kernels::op::{Check, Op, Rows, Spec};
use crate::kernels::operand::Operand;
use crate::launch::launch_f32;

/// What the per-row statistics hold (for dtype errors).
const STATS: &str = "layer-norm statistics";

/// Layer normalization over the last dimension of `rows × cols`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerNormShape {
    /// The matrix.
    pub rows: Rows,
    /// Added to the variance.
    pub eps: f32,
}

/// Layer norm forward; writes `y` and the per-row `mean`/`rstd` (`f32`).
#[derive(Debug, Clone, Copy)]
pub struct LayerNorm<'a> {
    /// The shape and epsilon.
    pub ln: LayerNormShape,
    /// Input.
    pub x: &'a Operand,
    /// Scale (`cols`).
    pub gamma: &'a Operand,
    /// Shift (`cols`).
    pub beta: &'a Operand,
    /// Output.
    pub y: &'a Operand,
    /// Per-row mean (`f32`).
    pub mean: &'a Operand,
    /// Per-row reciprocal standard deviation (`f32`).
    pub rstd: &'a Operand,
}

impl Op for LayerNorm<'_> {
    fn name(&self) -> &'static str {
        "layer_norm"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, ln) = (self.name(), self.ln);
        let (n, r) = (ln.rows.numel(op)?, ln.rows);
        let table = [
            Spec::float("x", self.x, n),
            Spec::float("gamma", self.gamma, r.cols),
            Spec::float("beta", self.beta, r.cols),
            Spec::float("y", self.y, n),
            Spec::exact("mean", self.mean, DType::F32, STATS, r.rows),
            Spec::exact("rstd", self.rstd, DType::F32, STATS, r.rows),
        ];
        c.args(op, || format!("{ln:?}"), &table)?;
        Ok(n > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (cols, eps) = (self.ln.rows.cols, self.ln.eps);
        let ins = [self.x, self.gamma, self.beta];
        let outs = [self.y, self.mean, self.rstd];
        launch_f32(
            s,
            "layer_norm",
            ins,
            outs,
            false,
            move |[x, g, b], [y, m, r]| cpu::layer_norm(x, g, b, y, m, r, cols, eps),
        );
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::{err, tb, typed};
        let (op, k) = ("layer_norm", b.kernels());
        let (x, gamma, beta, y) = (self.x, self.gamma, self.beta, self.y);
        let (cols, eps) = (self.ln.rows.cols, self.ln.eps);
        let (m, r) = (&self.mean.buf, &self.rstd.buf);
        if typed(&[x, gamma, beta, y]) {
            let [x, g, bb, y] = [x, gamma, beta, y].map(tb);
            return k
                .layer_norm_t(s, x, g, bb, y, m, r, cols, eps)
                .map_err(err(op));
        }
        let mut f = b.scope(op, s);
        let [x, g, bb] = f.inputs([x, gamma, beta])?;
        let y = f.output(y, false)?;
        k.layer_norm(s, &x, &g, &bb, &y, m, r, cols, eps)
            .map_err(err(op))?;
        f.finish()
    }
}

/// Layer norm backward; overwrites `dx`, `dgamma`, `dbeta`.
#[derive(Debug, Clone, Copy)]
pub struct LayerNormBackward<'a> {
    /// The shape and epsilon.
    pub ln: LayerNormShape,
    /// The forward input.
    pub x: &'a Operand,
    /// Scale.
    pub gamma: &'a Operand,
    /// The forward's per-row mean.
    pub mean: &'a Operand,
    /// The forward's per-row reciprocal standard deviation.
    pub rstd: &'a Operand,
    /// Upstream gradient.
    pub dy: &'a Operand,
    /// Gradient of `x`.
    pub dx: &'a Operand,
    /// Gradient of `gamma`.
    pub dgamma: &'a Operand,
    /// Gradient of `beta`.
    pub dbeta: &'a Operand,
}

impl Op for LayerNormBackward<'_> {
    fn name(&self) -> &'static str {
        "layer_norm_backward"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, ln) = (self.name(), self.ln);
        let (n, r) = (ln.rows.numel(op)?, ln.rows);
        let table = [
            Spec::float("x", self.x, n),
            Spec::float("gamma", self.gamma, r.cols),
            Spec::exact("mean", self.mean, DType::F32, STATS, r.rows),
            Spec::exact("rstd", self.rstd, DType::F32, STATS, r.rows),
            Spec::float("dy", self.dy, n),
            Spec::float("dx", self.dx, n),
            Spec::float("dgamma", self.dgamma, r.cols),
            Spec::float("dbeta", self.dbeta, r.cols),
        ];
        c.args(op, || format!("{ln:?}"), &table)?;
        Ok(true)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let cols = self.ln.rows.cols;
        let ins = [self.x, self.gamma, self.mean, self.rstd, self.dy];
        let outs = [self.dx, self.dgamma, self.dbeta];
        let op = "layer_norm_backward";
        launch_f32(
            s,
            op,
            ins,
            outs,
            false,
            move |[x, g, m, r, dy], [dx, dg, db]| {
                cpu::layer_norm_backward(x, g, m, r, dy, dx, dg, db, cols)
            },
        );
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::{err, tb, typed};
        let (op, k, cols) = ("layer_norm_backward", b.kernels(), self.ln.rows.cols);
        let (x, gamma, dy) = (self.x, self.gamma, self.dy);
        let (dx, dgamma, dbeta) = (self.dx, self.dgamma, self.dbeta);
        let (m, r) = (&self.mean.buf, &self.rstd.buf);
        if typed(&[x, gamma, dy, dx, dgamma, dbeta]) {
            let [x, g, dy, dx, dg, db] = [x, gamma, dy, dx, dgamma, dbeta].map(tb);
            return k
                .layer_norm_backward_t(s, x, g, m, r, dy, dx, dg, db, cols)
                .map_err(err(op));
        }
        let mut f = b.scope(op, s);
        let [x, g, dy] = f.inputs([x, gamma, dy])?;
        let [dx, dg, db] = f.outputs([dx, dgamma, dbeta])?;
        k.layer_norm_backward(s, &x, &g, m, r, &dy, &dx, &dg, &db, cols)
            .map_err(err(op))?;
        f.finish()
    }
}

/// The CUDA side of the op (feature `cuda`): its kernels' declarations, launch plans and
/// [`CudaKernels`](crate::kernels::cuda::CudaKernels) methods.
#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use fsdp_alloc::{BufferRef, Stream};

    use crate::kernels::cuda::context::{expect_len, row_args, rows_of, CudaKernels, Elem};
    use crate::kernels::cuda::error::Result;
    use crate::kernels::cuda::plan::{grid_col_groups, grid_rows, plan_rows, PArg, Plan, Ptr};
    use crate::kernels::cuda::typed::{operand, types_word, TBuf};

    crate::kernels::cuda::kernel::declare_kernels! {
        LAYER_NORM_FWD = "layer_norm_fwd" [U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
        LAYER_NORM_BWD_DX = "layer_norm_bwd_dx" [U64, U64, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
        LAYER_NORM_BWD_PARAMS = "layer_norm_bwd_params" [U64, U64, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
        LAYER_NORM_FWD_T = "layer_norm_fwd_t" [U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
        LAYER_NORM_BWD_DX_T = "layer_norm_bwd_dx_t" [U64, U64, U64, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
        LAYER_NORM_BWD_PARAMS_T = "layer_norm_bwd_params_t" [U64, U64, U64, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    }

    /// Layer norm forward; `p = [x, gamma, beta, y, mean, rstd]`.
    pub(crate) fn plan_layer_norm(rows: u64, cols: u64, eps: f32, p: [Ptr; 6]) -> Plan {
        let mut args = vec![PArg::U64(rows), PArg::U64(cols), PArg::F32(eps)];
        args.extend(p.iter().map(|&q| PArg::Ptr(q)));
        plan_rows(LAYER_NORM_FWD, rows, args)
    }

    /// Layer norm backward; `p = [x, gamma, mean, rstd, dy, dx, dgamma, dbeta]`.
    pub(crate) fn plan_layer_norm_backward(rows: u64, cols: u64, p: [Ptr; 8]) -> Plan {
        let [x, gamma, mean, rstd, dy, dx, dgamma, dbeta] = p;
        let mut plan = plan_rows(
            LAYER_NORM_BWD_DX,
            rows,
            row_args(rows, cols, &[x, gamma, mean, rstd, dy, dx]),
        );
        // With zero rows the parameter gradients are empty sums: the kernel writes zeros.
        plan.launch(
            LAYER_NORM_BWD_PARAMS,
            grid_col_groups(cols),
            row_args(rows, cols, &[x, mean, rstd, dy, dgamma, dbeta]),
        );
        plan
    }

    /// Layer norm forward; `p = [x, gamma, beta, y, mean, rstd]`, `codes = [x, gamma, beta, y]`
    /// (mean and rstd are f32).
    pub(crate) fn plan_layer_norm_t(
        codes: [u64; 4],
        rows: u64,
        cols: u64,
        eps: f32,
        p: [Ptr; 6],
    ) -> Plan {
        let mut plan = Plan::new();
        if rows > 0 {
            let mut args = vec![
                PArg::U64(types_word(&codes)),
                PArg::U64(rows),
                PArg::U64(cols),
                PArg::F32(eps),
            ];
            args.extend(p.iter().map(|&q| PArg::Ptr(q)));
            plan.launch(LAYER_NORM_FWD_T, grid_rows(rows), args);
        }
        plan
    }

    /// Layer norm backward; `p = [x, gamma, mean, rstd, dy, dx, dgamma, dbeta]`,
    /// `codes = [x, gamma, dy, dx, dgamma, dbeta]` (mean and rstd are f32).
    pub(crate) fn plan_layer_norm_backward_t(
        codes: [u64; 6],
        rows: u64,
        cols: u64,
        p: [Ptr; 8],
    ) -> Plan {
        let [x, gamma, mean, rstd, dy, dx, dgamma, dbeta] = p;
        let [cx, cg, cdy, cdx, cdg, cdb] = codes;
        let head = |types: u64| vec![PArg::U64(types), PArg::U64(rows), PArg::U64(cols)];
        let mut plan = Plan::new();
        if rows > 0 {
            let mut args = head(types_word(&[cx, cg, 0, 0, cdy, cdx]));
            args.extend([x, gamma, mean, rstd, dy, dx].map(PArg::Ptr));
            plan.launch(LAYER_NORM_BWD_DX_T, grid_rows(rows), args);
        }
        // With zero rows the parameter gradients are empty sums: the kernel writes zeros.
        let mut args = head(types_word(&[cx, 0, 0, cdy, cdg, cdb]));
        args.extend([x, mean, rstd, dy, dgamma, dbeta].map(PArg::Ptr));
        plan.launch(LAYER_NORM_BWD_PARAMS_T, grid_col_groups(cols), args);
        plan
    }

    impl CudaKernels {
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

        /// Layer norm (as [`CudaKernels::layer_norm`]) with `x`, `gamma`, `beta` and `y` each f32,
        /// f16 or bf16; `mean` and `rstd` are f32.
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn layer_norm_t(
            &self,
            stream: &Stream,
            x: TBuf<'_>,
            gamma: TBuf<'_>,
            beta: TBuf<'_>,
            y: TBuf<'_>,
            mean: &BufferRef,
            rstd: &BufferRef,
            cols: usize,
            eps: f32,
        ) -> Result<()> {
            let op = "layer_norm";
            let c = self.call(op, stream)?;
            let (bx, cx) = operand(&c, op, "x", x)?;
            let rows = rows_of(op, "x", bx.len, cols)?;
            let shape = || format!("rows={rows}, cols={cols}");
            let (bg, cg) = operand(&c, op, "gamma", gamma)?;
            let (bb, cb) = operand(&c, op, "beta", beta)?;
            let (by, cy) = operand(&c, op, "y", y)?;
            expect_len(op, "gamma", bg.len, cols, shape)?;
            expect_len(op, "beta", bb.len, cols, shape)?;
            expect_len(op, "y", by.len, bx.len, shape)?;
            let [bm, br] = c.f32_sized([("mean", mean, rows), ("rstd", rstd, rows)], shape)?;
            c.disjoint(
                &[("y", y.0), ("mean", mean), ("rstd", rstd)],
                &[("x", x.0), ("gamma", gamma.0), ("beta", beta.0)],
            )?;
            let plan = plan_layer_norm_t(
                [cx, cg, cb, cy],
                rows as u64,
                cols as u64,
                eps,
                [bx, bg, bb, by, bm, br].map(|d| d.as_ptr()),
            );
            // SAFETY: x and y hold rows·cols elements, gamma and beta cols, mean and rstd rows f32,
            // all on this device in their dtypes; the outputs overlap nothing else.
            unsafe { c.exec(&plan) }.map(drop)
        }

        /// Gradient of [`CudaKernels::layer_norm_t`] (as [`CudaKernels::layer_norm_backward`]),
        /// float operands each f32, f16 or bf16; `mean` and `rstd` are f32.
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn layer_norm_backward_t(
            &self,
            stream: &Stream,
            x: TBuf<'_>,
            gamma: TBuf<'_>,
            mean: &BufferRef,
            rstd: &BufferRef,
            dy: TBuf<'_>,
            dx: TBuf<'_>,
            dgamma: TBuf<'_>,
            dbeta: TBuf<'_>,
            cols: usize,
        ) -> Result<()> {
            let op = "layer_norm_backward";
            let c = self.call(op, stream)?;
            let (bx, cx) = operand(&c, op, "x", x)?;
            let rows = rows_of(op, "x", bx.len, cols)?;
            let shape = || format!("rows={rows}, cols={cols}");
            let (bg, cg) = operand(&c, op, "gamma", gamma)?;
            let (bdy, cdy) = operand(&c, op, "dy", dy)?;
            let (bdx, cdx) = operand(&c, op, "dx", dx)?;
            let (bdg, cdg) = operand(&c, op, "dgamma", dgamma)?;
            let (bdb, cdb) = operand(&c, op, "dbeta", dbeta)?;
            expect_len(op, "gamma", bg.len, cols, shape)?;
            expect_len(op, "dy", bdy.len, bx.len, shape)?;
            expect_len(op, "dx", bdx.len, bx.len, shape)?;
            expect_len(op, "dgamma", bdg.len, cols, shape)?;
            expect_len(op, "dbeta", bdb.len, cols, shape)?;
            let [bm, br] = c.f32_sized([("mean", mean, rows), ("rstd", rstd, rows)], shape)?;
            c.disjoint(
                &[("dx", dx.0), ("dgamma", dgamma.0), ("dbeta", dbeta.0)],
                &[
                    ("x", x.0),
                    ("gamma", gamma.0),
                    ("mean", mean),
                    ("rstd", rstd),
                    ("dy", dy.0),
                ],
            )?;
            let plan = plan_layer_norm_backward_t(
                [cx, cg, cdy, cdx, cdg, cdb],
                rows as u64,
                cols as u64,
                [bx, bg, bm, br, bdy, bdx, bdg, bdb].map(|d| d.as_ptr()),
            );
            // SAFETY: x, dy and dx hold rows·cols elements, gamma, dgamma and dbeta cols, mean and
            // rstd rows f32, all on this device in their dtypes; the outputs overlap no other
            // argument.
            unsafe { c.exec(&plan) }.map(drop)
        }
    }
}
