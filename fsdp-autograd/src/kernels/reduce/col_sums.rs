//! [`ColSums`]: `out[c] = Σ_r x[r, c]`, rows added in order (the bias gradient).

use fsdp_alloc::Stream;

use crate::error::Result;
use crate::kernels::cpu;
use crate::kernels::op::{Check, Op, Rows, Spec};
use crate::kernels::operand::Operand;
use crate::launch::launch_f32;

/// `out[c] = Σ_r x[r, c]`.
#[derive(Debug, Clone, Copy)]
pub struct ColSums<'a> {
    /// The shape of `x`.
    pub rows: Rows,
    /// Input.
    pub x: &'a Operand,
    /// Output (`rows.cols` elements).
    pub out: &'a Operand,
}

impl Op for ColSums<'_> {
    fn name(&self) -> &'static str {
        "col_sums"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, rows) = (self.name(), self.rows);
        let n = rows.numel(op)?;
        let table = [
            Spec::float("x", self.x, n),
            Spec::float("out", self.out, rows.cols),
        ];
        c.args(op, || format!("{rows:?}"), &table)?;
        Ok(true)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        launch_f32(s, "col_sums", [self.x], [self.out], false, |[x], [o]| {
            cpu::col_sums(x, o)
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::{err, tb, typed};
        let (k, x, out) = (b.kernels(), self.x, self.out);
        if typed(&[x, out]) {
            return k.col_sums_t(s, tb(x), tb(out)).map_err(err("col_sums"));
        }
        let mut f = b.scope("col_sums", s);
        let (x, o) = (f.input(x)?, f.output(out, false)?);
        k.col_sums(s, &x, &o).map_err(err("col_sums"))?;
        f.finish()
    }
}
