//! [`AxpyRows`]: `y[r, :] += alpha · x` for every row of `y`.

use fsdp_alloc::Stream;

use crate::error::{AutogradError, Result};
use crate::kernels::cpu;
use crate::kernels::op::{Check, Op, Rows, Spec};
use crate::kernels::operand::Operand;
use crate::launch::launch_f32;

/// `y[r, :] += alpha · x` for every row `r` of `y` (`x` holds one row and must not overlap
/// `y`).
#[derive(Debug, Clone, Copy)]
pub struct AxpyRows<'a> {
    /// The shape of `y`.
    pub rows: Rows,
    /// The factor.
    pub alpha: f32,
    /// One row.
    pub x: &'a Operand,
    /// Input and output.
    pub y: &'a Operand,
}

impl Op for AxpyRows<'_> {
    fn name(&self) -> &'static str {
        "axpy"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, rows, x, y) = (self.name(), self.rows, self.x, self.y);
        let n = rows.numel(op)?;
        let table = [Spec::float("x", x, rows.cols), Spec::float("y", y, n)];
        c.args(op, || format!("{rows:?}"), &table)?;
        if n > 0 && x.buf.overlaps(&y.buf) {
            return Err(AutogradError::Argument {
                op,
                detail: "`x` overlaps the destination `y`; copy it first".into(),
            });
        }
        Ok(n > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (cols, alpha) = (self.rows.cols, self.alpha);
        launch_f32(s, "axpy", [self.x], [self.y], true, move |[x], [y]| {
            y.chunks_mut(cols)
                .try_for_each(|row| cpu::add_scaled(row, alpha, x))
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::{err, tb, typed};
        let (k, rows, alpha, x, y) = (b.kernels(), self.rows, self.alpha, self.x, self.y);
        if typed(&[x, y]) {
            let e = err("axpy");
            if rows.rows == 1 {
                return k.add_scaled_t(s, tb(y), alpha, tb(x)).map_err(e);
            }
            if alpha == 1.0 {
                return k.add_row_bias_inplace_t(s, tb(y), tb(x)).map_err(e);
            }
            // One launch per row, as for f32.
            let bytes = rows.cols * y.dtype.size();
            for r in 0..rows.rows {
                let yr = y.buf.slice(r * bytes, bytes)?;
                let yr = (&yr, y.dtype);
                k.add_scaled_t(s, yr, alpha, tb(x)).map_err(err("axpy"))?;
            }
            return Ok(());
        }
        let mut f = b.scope("axpy", s);
        let (x, y) = (f.input(x)?, f.output(y, true)?);
        let e = err("axpy");
        if rows.rows == 1 {
            k.add_scaled(s, &y, alpha, &x).map_err(e)?;
        } else if alpha == 1.0 {
            k.add_row_bias_inplace(s, &y, &x).map_err(e)?;
        } else {
            let bytes = rows.cols * 4;
            for r in 0..rows.rows {
                let yr = y.slice(r * bytes, bytes)?;
                k.add_scaled(s, &yr, alpha, &x).map_err(err("axpy"))?;
            }
        }
        f.finish()
    }
}
