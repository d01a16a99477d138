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
