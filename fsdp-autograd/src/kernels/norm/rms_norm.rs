//! RMS normalization over the last dimension (Llama's `RMSNorm`): [`RmsNorm`] and
//! [`RmsNormBackward`], with their host-slice kernels [`rms_norm`] and [`rms_norm_backward`].
//!
//! `y = x · rstd · gamma` with `rstd = 1/√(mean(x²) + eps)` per row, computed in f32 with the
//! row's sum in f64, each output rounded once to its dtype (transformers' `LlamaRMSNorm` also
//! computes in f32; for a half input it rounds `x · rstd` to the input's dtype before the `gamma`
//! product, which is rounded again: here the product is rounded once). The forward saves `rstd`
//! (`f32`, one per row) for the backward.
//!
//! Both row sums (the forward's `Σ x²` and the backward's `Σ dy·gamma·x`) are added in one fixed
//! order on every backend: `LANES` (256) lanes, lane `l` adding the elements `l, l + LANES, …` in
//! order, then the lanes combined pairwise (`lane[l] += lane[l + s]` for `s = LANES/2, …, 1`),
//! which is the CUDA block reduction's order; `dgamma` is a column reduction in row order (the
//! CUDA `col_reduce`). So the CPU and CUDA kernels give the same bits in f32, and in f16/bf16 (the
//! same f32 values rounded once).

use fsdp_alloc::{DType, Stream};

use crate::error::Result;
use crate::kernels::check;
use crate::kernels::op::{Check, Op, Rows, Spec};
use crate::kernels::operand::Operand;
use crate::kernels::KernelError;
use crate::launch::launch_f32;

/// What the saved statistic holds (for dtype errors).
const RSTD: &str = "RMS-norm statistics";

/// Lanes of the row sums: the CUDA kernels' threads per block (`BLOCK` in `common.cu`).
const LANES: usize = 256;

/// `Σ v` over a row in the CUDA block reduction's order: lane `l` adds the values at positions
/// `l, l + LANES, …` in order (in f64), then the lanes are combined pairwise
/// (`lane[l] += lane[l + s]` for `s = LANES/2, …, 1`).
fn row_sum(values: impl Iterator<Item = f64>) -> f64 {
    let mut lanes = [0f64; LANES];
    for (j, v) in values.enumerate() {
        let l = j % LANES;
        lanes[l] += v;
    }
    let mut s = LANES / 2;
    while s > 0 {
        for l in 0..s {
            lanes[l] += lanes[l + s];
        }
        s /= 2;
    }
    lanes[0]
}

/// RMS norm of the rows of `x` (`cols` columns): `y = x · rstd · gamma`, `rstd[r] =
/// 1/√(Σ x² / cols + eps)` (written to `rstd`, one per row), the sum in f64 in a fixed order:
/// 256 lanes (lane `l` adds the elements `l, l + 256, …`), then the lanes pairwise — the order of
/// the CUDA kernel's block reduction, so both give the same bits.
///
/// # Errors
/// [`KernelError`] for `cols == 0`, a partial row, or `gamma`/`y`/`rstd` of other lengths than
/// `cols`, `x`'s and the number of rows.
pub fn rms_norm(
    x: &[f32],
    gamma: &[f32],
    y: &mut [f32],
    rstd: &mut [f32],
    cols: usize,
    eps: f32,
) -> std::result::Result<(), KernelError> {
    const OP: &str = "rms_norm";
    let rows = check::rows(OP, "x", x.len(), cols)?;
    let shape = || format!("rows={rows}, cols={cols}");
    check::len(OP, "gamma", gamma.len(), cols, shape)?;
    check::len(OP, "y", y.len(), x.len(), shape)?;
    check::len(OP, "rstd", rstd.len(), rows, shape)?;
    let rows = x.chunks_exact(cols).zip(y.chunks_exact_mut(cols));
    for ((xr, yr), rs) in rows.zip(rstd.iter_mut()) {
        let ss = row_sum(xr.iter().map(|&v| v as f64 * v as f64));
        let r = (1.0 / (ss / cols as f64 + eps as f64).sqrt()) as f32;
        *rs = r;
        for ((y, &x), &g) in yr.iter_mut().zip(xr).zip(gamma) {
            *y = x * r * g;
        }
    }
    Ok(())
}

/// Gradient of [`rms_norm`] from the forward input `x`, `gamma` and the saved `rstd`:
/// `dx = rstd · (g − x · rstd² · mean(g · x))` per row with `g = dy · gamma` (the row sum in
/// [`rms_norm`]'s order), and `dgamma[j] = Σ_r dy · (x · rstd)`, rows added in order (both
/// overwritten).
///
/// # Errors
/// As [`rms_norm`], for `dy`/`dx` (`x`'s length), `dgamma` (`cols`) and `rstd` (one per row).
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_backward(
    x: &[f32],
    gamma: &[f32],
    rstd: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    dgamma: &mut [f32],
    cols: usize,
) -> std::result::Result<(), KernelError> {
    const OP: &str = "rms_norm_backward";
    let rows = check::rows(OP, "x", x.len(), cols)?;
    let shape = || format!("rows={rows}, cols={cols}");
    check::len(OP, "gamma", gamma.len(), cols, shape)?;
    check::len(OP, "rstd", rstd.len(), rows, shape)?;
    check::len(OP, "dy", dy.len(), x.len(), shape)?;
    check::len(OP, "dx", dx.len(), x.len(), shape)?;
    check::len(OP, "dgamma", dgamma.len(), cols, shape)?;
    dgamma.fill(0.0);
    let rows = x.chunks_exact(cols).zip(dy.chunks_exact(cols));
    for (((xr, dyr), dxr), &rs) in rows.zip(dx.chunks_exact_mut(cols)).zip(rstd) {
        for ((dg, &d), &x) in dgamma.iter_mut().zip(dyr).zip(xr) {
            *dg += d * (x * rs);
        }
        let gx = dyr.iter().zip(gamma).zip(xr);
        let dot = row_sum(gx.map(|((&d, &g), &x)| (d * g) as f64 * x as f64));
        let k = (dot / cols as f64) as f32 * rs * rs;
        for (((dx, &d), &g), &x) in dxr.iter_mut().zip(dyr).zip(gamma).zip(xr) {
            *dx = rs * (d * g - x * k);
        }
    }
    Ok(())
}

/// RMS normalization over the last dimension of `rows × cols`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RmsNormShape {
    /// The matrix.
    pub rows: Rows,
    /// Added to the mean square.
    pub eps: f32,
}

/// RMS norm forward; writes `y` and the per-row `rstd` (`f32`).
#[derive(Debug, Clone, Copy)]
pub struct RmsNorm<'a> {
    /// The shape and epsilon.
    pub s: RmsNormShape,
    /// Input.
    pub x: &'a Operand,
    /// Scale (`cols`).
    pub gamma: &'a Operand,
    /// Output.
    pub y: &'a Operand,
    /// Per-row reciprocal root mean square (`f32`).
    pub rstd: &'a Operand,
}

impl Op for RmsNorm<'_> {
    fn name(&self) -> &'static str {
        "rms_norm"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, s) = (self.name(), self.s);
        let (n, r) = (s.rows.numel(op)?, s.rows);
        let table = [
            Spec::float("x", self.x, n),
            Spec::float("gamma", self.gamma, r.cols),
            Spec::float("y", self.y, n),
            Spec::exact("rstd", self.rstd, DType::F32, RSTD, r.rows),
        ];
        c.args(op, || format!("{s:?}"), &table)?;
        Ok(n > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (cols, eps) = (self.s.rows.cols, self.s.eps);
        let (ins, outs) = ([self.x, self.gamma], [self.y, self.rstd]);
        launch_f32(s, "rms_norm", ins, outs, false, move |[x, g], [y, r]| {
            rms_norm(x, g, y, r, cols, eps)
        });
        Ok(())
    }

    /// The typed kernel (every float operand f32, f16 or bf16, read and written directly).
    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::{err, tb};
        let (cols, eps) = (self.s.rows.cols, self.s.eps);
        let [x, g, y] = [self.x, self.gamma, self.y].map(tb);
        b.kernels()
            .rms_norm_t(s, x, g, y, &self.rstd.buf, cols, eps)
            .map_err(err("rms_norm"))
    }
}

/// RMS norm backward; overwrites `dx` and `dgamma`.
#[derive(Debug, Clone, Copy)]
pub struct RmsNormBackward<'a> {
    /// The shape and epsilon.
    pub s: RmsNormShape,
    /// The forward input.
    pub x: &'a Operand,
    /// Scale.
    pub gamma: &'a Operand,
    /// The forward's per-row reciprocal root mean square.
    pub rstd: &'a Operand,
    /// Upstream gradient.
    pub dy: &'a Operand,
    /// Gradient of `x`.
    pub dx: &'a Operand,
    /// Gradient of `gamma`.
    pub dgamma: &'a Operand,
}

impl Op for RmsNormBackward<'_> {
    fn name(&self) -> &'static str {
        "rms_norm_backward"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, s) = (self.name(), self.s);
        let (n, r) = (s.rows.numel(op)?, s.rows);
        let table = [
            Spec::float("x", self.x, n),
            Spec::float("gamma", self.gamma, r.cols),
            Spec::exact("rstd", self.rstd, DType::F32, RSTD, r.rows),
            Spec::float("dy", self.dy, n),
            Spec::float("dx", self.dx, n),
            Spec::float("dgamma", self.dgamma, r.cols),
        ];
        c.args(op, || format!("{s:?}"), &table)?;
        Ok(true)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let cols = self.s.rows.cols;
        let ins = [self.x, self.gamma, self.rstd, self.dy];
        let outs = [self.dx, self.dgamma];
        let op = "rms_norm_backward";
        launch_f32(s, op, ins, outs, false, move |[x, g, r, dy], [dx, dg]| {
            rms_norm_backward(x, g, r, dy, dx, dg, cols)
        });
        Ok(())
    }

    /// The typed kernels (every float operand f32, f16 or bf16, read and written directly).
    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::{err, tb};
        let cols = self.s.rows.cols;
        let [x, g, dy, dx, dg] = [self.x, self.gamma, self.dy, self.dx, self.dgamma].map(tb);
        b.kernels()
            .rms_norm_backward_t(s, x, g, &self.rstd.buf, dy, dx, dg, cols)
            .map_err(err("rms_norm_backward"))
    }
}

/// The CUDA side of the op (feature `cuda`): its kernels' declarations, launch plans and
/// [`CudaKernels`](crate::kernels::cuda::CudaKernels) methods. One set of typed kernels serves
/// every dtype (all-f32 operands have the code word 0).
#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use fsdp_alloc::{BufferRef, Stream};

    use crate::kernels::cuda::context::{expect_len, rows_of, CudaKernels};
    use crate::kernels::cuda::error::Result;
    use crate::kernels::cuda::plan::{grid_col_groups, grid_rows, PArg, Plan, Ptr};
    use crate::kernels::cuda::typed::{operand, types_word, TBuf};

    crate::kernels::cuda::kernel::declare_kernels! {
        RMS_NORM_FWD = "rms_norm_fwd" [U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr];
        RMS_NORM_BWD_DX = "rms_norm_bwd_dx" [U64, U64, U64, Ptr, Ptr, Ptr, Ptr, Ptr];
        RMS_NORM_BWD_DGAMMA = "rms_norm_bwd_dgamma" [U64, U64, U64, Ptr, Ptr, Ptr, Ptr];
    }

    /// RMS norm forward; `p = [x, gamma, y, rstd]`, `codes = [x, gamma, y]` (rstd is f32).
    pub(crate) fn plan_rms_norm(
        codes: [u64; 3],
        rows: u64,
        cols: u64,
        eps: f32,
        p: [Ptr; 4],
    ) -> Plan {
        let mut plan = Plan::new();
        if rows > 0 {
            let mut args = vec![
                PArg::U64(types_word(&codes)),
                PArg::U64(rows),
                PArg::U64(cols),
                PArg::F32(eps),
            ];
            args.extend(p.map(PArg::Ptr));
            plan.launch(RMS_NORM_FWD, grid_rows(rows), args);
        }
        plan
    }

    /// RMS norm backward; `p = [x, gamma, rstd, dy, dx, dgamma]`,
    /// `codes = [x, gamma, dy, dx, dgamma]` (rstd is f32).
    pub(crate) fn plan_rms_norm_backward(
        codes: [u64; 5],
        rows: u64,
        cols: u64,
        p: [Ptr; 6],
    ) -> Plan {
        let [x, gamma, rstd, dy, dx, dgamma] = p;
        let [cx, cg, cdy, cdx, cdg] = codes;
        let head = |types: u64| vec![PArg::U64(types), PArg::U64(rows), PArg::U64(cols)];
        let mut plan = Plan::new();
        if rows > 0 {
            let mut args = head(types_word(&[cx, cg, 0, cdy, cdx]));
            args.extend([x, gamma, rstd, dy, dx].map(PArg::Ptr));
            plan.launch(RMS_NORM_BWD_DX, grid_rows(rows), args);
        }
        // With zero rows dgamma is an empty sum: the kernel writes zeros.
        let mut args = head(types_word(&[cx, 0, cdy, cdg]));
        args.extend([x, rstd, dy, dgamma].map(PArg::Ptr));
        plan.launch(RMS_NORM_BWD_DGAMMA, grid_col_groups(cols), args);
        plan
    }

    impl CudaKernels {
        /// RMS norm over the last dimension (CPU: [`rms_norm`](super::rms_norm)), `x`, `gamma`
        /// and `y` each f32, f16 or bf16, `rstd` f32 (one per row, saved for the backward); one
        /// block per row, the same bits as the CPU kernel.
        ///
        /// # Errors
        /// The CPU kernel's shape errors; a non-float operand; buffer/stream errors; an output
        /// overlapping any other argument.
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn rms_norm_t(
            &self,
            stream: &Stream,
            x: TBuf<'_>,
            gamma: TBuf<'_>,
            y: TBuf<'_>,
            rstd: &BufferRef,
            cols: usize,
            eps: f32,
        ) -> Result<()> {
            let op = "rms_norm";
            let c = self.call(op, stream)?;
            let (bx, cx) = operand(&c, op, "x", x)?;
            let rows = rows_of(op, "x", bx.len, cols)?;
            let shape = || format!("rows={rows}, cols={cols}");
            let (bg, cg) = operand(&c, op, "gamma", gamma)?;
            let (by, cy) = operand(&c, op, "y", y)?;
            expect_len(op, "gamma", bg.len, cols, shape)?;
            expect_len(op, "y", by.len, bx.len, shape)?;
            let [br] = c.f32_sized([("rstd", rstd, rows)], shape)?;
            c.disjoint(
                &[("y", y.0), ("rstd", rstd)],
                &[("x", x.0), ("gamma", gamma.0)],
            )?;
            let plan = plan_rms_norm(
                [cx, cg, cy],
                rows as u64,
                cols as u64,
                eps,
                [bx, bg, by, br].map(|d| d.as_ptr()),
            );
            // SAFETY: x and y hold rows·cols elements and gamma cols of their dtypes, rstd rows
            // f32, all on this device; the outputs overlap nothing else; block r writes row r of
            // y and rstd[r].
            unsafe { c.exec(&plan) }.map(drop)
        }

        /// Gradient of [`CudaKernels::rms_norm_t`] (CPU:
        /// [`rms_norm_backward`](super::rms_norm_backward)): `dx` per row (one block per row),
        /// and `dgamma = Σ_r dy·(x·rstd)`, each column's rows added in order 0, 1, … in f32 (the
        /// CPU's order, through `col_reduce`); float operands each f32, f16 or bf16, `rstd` f32.
        ///
        /// # Errors
        /// As [`CudaKernels::rms_norm_t`], with `dy`/`dx` matching `x` and `dgamma` of `cols`.
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn rms_norm_backward_t(
            &self,
            stream: &Stream,
            x: TBuf<'_>,
            gamma: TBuf<'_>,
            rstd: &BufferRef,
            dy: TBuf<'_>,
            dx: TBuf<'_>,
            dgamma: TBuf<'_>,
            cols: usize,
        ) -> Result<()> {
            let op = "rms_norm_backward";
            let c = self.call(op, stream)?;
            let (bx, cx) = operand(&c, op, "x", x)?;
            let rows = rows_of(op, "x", bx.len, cols)?;
            let shape = || format!("rows={rows}, cols={cols}");
            let (bg, cg) = operand(&c, op, "gamma", gamma)?;
            let (bdy, cdy) = operand(&c, op, "dy", dy)?;
            let (bdx, cdx) = operand(&c, op, "dx", dx)?;
            let (bdg, cdg) = operand(&c, op, "dgamma", dgamma)?;
            expect_len(op, "gamma", bg.len, cols, shape)?;
            expect_len(op, "dy", bdy.len, bx.len, shape)?;
            expect_len(op, "dx", bdx.len, bx.len, shape)?;
            expect_len(op, "dgamma", bdg.len, cols, shape)?;
            let [br] = c.f32_sized([("rstd", rstd, rows)], shape)?;
            c.disjoint(
                &[("dx", dx.0), ("dgamma", dgamma.0)],
                &[("x", x.0), ("gamma", gamma.0), ("rstd", rstd), ("dy", dy.0)],
            )?;
            let plan = plan_rms_norm_backward(
                [cx, cg, cdy, cdx, cdg],
                rows as u64,
                cols as u64,
                [bx, bg, br, bdy, bdx, bdg].map(|d| d.as_ptr()),
            );
            // SAFETY: x, dy and dx hold rows·cols elements, gamma and dgamma cols, of their
            // dtypes, rstd rows f32, all on this device; the outputs overlap nothing else; block
            // r writes row r of dx, the column blocks write dgamma.
            unsafe { c.exec(&plan) }.map(drop)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain definition in f64: `y = x / √(mean(x²) + eps) · gamma` and its gradients.
    fn reference(
        x: &[f32],
        gamma: &[f32],
        dy: &[f32],
        cols: usize,
        eps: f32,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
        let (mut y, mut rstd, mut dx, mut dg) =
            (vec![], vec![], vec![0f64; x.len()], vec![0f64; cols]);
        for (r, (xr, dyr)) in x.chunks(cols).zip(dy.chunks(cols)).enumerate() {
            let ms = xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / cols as f64;
            let rs = 1.0 / (ms + eps as f64).sqrt();
            rstd.push(rs);
            y.extend(
                xr.iter()
                    .zip(gamma)
                    .map(|(&v, &g)| v as f64 * rs * g as f64),
            );
            // ∂L/∂x_k = rs·g_k·dy_k − x_k·rs³/n · Σ_j dy_j·g_j·x_j.
            let dot: f64 = (0..cols)
                .map(|j| dyr[j] as f64 * gamma[j] as f64 * xr[j] as f64)
                .sum();
            for k in 0..cols {
                let (xk, gk, dk) = (xr[k] as f64, gamma[k] as f64, dyr[k] as f64);
                dx[r * cols + k] = rs * gk * dk - xk * rs * rs * rs * dot / cols as f64;
                dg[k] += dk * xk * rs;
            }
        }
        (y, rstd, dx, dg)
    }

    fn close(what: &str, got: &[f32], want: &[f64], tol: f64) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        let scale = want.iter().fold(1f64, |m, v| m.max(v.abs()));
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g as f64 - w).abs() <= tol * scale,
                "{what}[{i}]: {g} vs {w}"
            );
        }
    }

    /// Forward and backward against the f64 definition, over shapes below, at and above the
    /// 256 lanes of the row sums.
    #[test]
    fn forward_and_backward_match_the_f64_definition() {
        let mut seed = 7u64;
        let mut val = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        };
        for (rows, cols) in [
            (1usize, 1usize),
            (3, 8),
            (2, 256),
            (4, 300),
            (1, 1030),
            (0, 5),
        ] {
            let x: Vec<f32> = (0..rows * cols).map(|_| val()).collect();
            let gamma: Vec<f32> = (0..cols).map(|_| val() * 0.5 + 1.0).collect();
            let dy: Vec<f32> = (0..rows * cols).map(|_| val()).collect();
            let eps = 1e-6;
            let (mut y, mut rstd) = (vec![0.0; x.len()], vec![0.0; rows]);
            rms_norm(&x, &gamma, &mut y, &mut rstd, cols, eps).unwrap();
            let (mut dx, mut dg) = (vec![0.0; x.len()], vec![f32::NAN; cols]);
            rms_norm_backward(&x, &gamma, &rstd, &dy, &mut dx, &mut dg, cols).unwrap();
            let (wy, wr, wdx, wdg) = reference(&x, &gamma, &dy, cols, eps);
            let tag = format!("rows={rows} cols={cols}");
            close(&format!("{tag} y"), &y, &wy, 1e-6);
            close(&format!("{tag} rstd"), &rstd, &wr, 1e-6);
            close(&format!("{tag} dx"), &dx, &wdx, 1e-5);
            close(&format!("{tag} dgamma"), &dg, &wdg, 1e-5);
        }
    }

    /// The row sums' fixed order (the CUDA block reduction's), not a sequential sum: with
    /// `1.0` at position 0, `-1.0` at 1 and `1e-16` at 256, lane 0 rounds `1.0 + 1e-16` to `1.0`
    /// and the tree then cancels it exactly, where a sequential sum keeps `1e-16`.
    #[test]
    fn row_sums_follow_the_lane_tree() {
        let mut v = vec![0f64; 300];
        (v[0], v[1], v[256]) = (1.0, -1.0, 1e-16);
        assert_eq!(v.iter().sum::<f64>(), 1e-16);
        assert_eq!(row_sum(v.iter().copied()), 0.0);
        let w: Vec<f64> = (0..1000).map(|i| i as f64).collect();
        assert_eq!(row_sum(w.iter().copied()), 499_500.0);
    }

    #[test]
    fn mismatched_lengths_are_errors() {
        let (mut y, mut r) = (vec![0.0; 6], vec![0.0; 2]);
        assert!(rms_norm(&[1.0; 6], &[1.0; 2], &mut y, &mut r, 3, 1e-6).is_err());
        assert!(rms_norm(&[1.0; 6], &[1.0; 3], &mut y, &mut r, 0, 1e-6).is_err());
        let (mut dx, mut dg) = (vec![0.0; 6], vec![0.0; 3]);
        let e = rms_norm_backward(
            &[1.0; 6], &[1.0; 3], &[1.0; 2], &[1.0; 5], &mut dx, &mut dg, 3,
        );
        assert!(
            matches!(e, Err(KernelError::LengthMismatch { arg: "dy", .. })),
            "{e:?}"
        );
    }
}
