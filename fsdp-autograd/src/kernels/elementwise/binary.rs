//! [`Binary`]: `out = a + b` or `a · b`, `b` of one row broadcast or as large as `a`.

use fsdp_alloc::Stream;

use crate::error::Result;
use crate::kernels::cpu;
use crate::kernels::op::{Check, Op, Rows, Spec};
use crate::kernels::operand::Operand;
use crate::launch::launch_f32;

/// Binary elementwise operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinaryOp {
    /// `a + b`.
    Add,
    /// `a · b`.
    Mul,
}

/// `out[r, :] = a[r, :] op b[r % b_rows, :]` where `b` has `rows.cols` elements (one row,
/// broadcast) or as many as `a`.
#[derive(Debug, Clone, Copy)]
pub struct Binary<'a> {
    /// The operation.
    pub op: BinaryOp,
    /// The shape of `a` and `out`.
    pub rows: Rows,
    /// Left operand.
    pub a: &'a Operand,
    /// Right operand (one row, or as many elements as `a`).
    pub b: &'a Operand,
    /// Output.
    pub out: &'a Operand,
}

impl Op for Binary<'_> {
    fn name(&self) -> &'static str {
        match self.op {
            BinaryOp::Add => "add",
            BinaryOp::Mul => "mul",
        }
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, rows) = (self.name(), self.rows);
        let n = rows.numel(op)?;
        // `b` is one row, broadcast, or as large as `a`.
        let nb = if self.b.numel() == n { n } else { rows.cols };
        let table = [
            Spec::float("a", self.a, n),
            Spec::float("out", self.out, n),
            Spec::float("b", self.b, nb),
        ];
        c.args(op, || format!("{rows:?}"), &table)?;
        Ok(n > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (name, op, cols) = (self.name(), self.op, self.rows.cols);
        let run = move |a: &[f32], b: &[f32], o: &mut [f32]| match op {
            BinaryOp::Add => cpu::add(a, b, o),
            BinaryOp::Mul => cpu::mul(a, b, o),
        };
        let (a, b, out) = (self.a, self.b, self.out);
        launch_f32(s, name, [a, b], [out], false, move |[f, s], [o]| {
            if cols == f.len() || s.len() == f.len() {
                run(f, s, o)
            } else if op == BinaryOp::Add {
                cpu::add_row_bias(f, s, o)
            } else {
                f.chunks(cols)
                    .zip(o.chunks_mut(cols))
                    .try_for_each(|(fr, or)| run(fr, s, or))
            }
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, bk: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::{err, tb, typed};
        let (name, k) = (self.name(), bk.kernels());
        let (op, rows, a, b, out) = (self.op, self.rows, self.a, self.b, self.out);
        let full = b.numel() == a.numel();
        if typed(&[a, b, out]) {
            let (x, y, o) = (tb(a), tb(b), tb(out));
            let e = err(name);
            return match (op, full) {
                (BinaryOp::Add, true) => k.add_t(s, x, y, o).map_err(e),
                (BinaryOp::Mul, true) => k.mul_t(s, x, y, o).map_err(e),
                (BinaryOp::Add, false) => k.add_row_bias_t(s, x, y, o).map_err(e),
                (BinaryOp::Mul, false) => {
                    // One launch per row, as for f32.
                    let (xs, os) = (rows.cols * a.dtype.size(), rows.cols * out.dtype.size());
                    for r in 0..rows.rows {
                        let xr = a.buf.slice(r * xs, xs)?;
                        let or = out.buf.slice(r * os, os)?;
                        let (xr, or) = ((&xr, a.dtype), (&or, out.dtype));
                        k.mul_t(s, xr, y, or).map_err(err(name))?;
                    }
                    Ok(())
                }
            };
        }
        let mut f = bk.scope(name, s);
        let (x, y, o) = (f.input(a)?, f.input(b)?, f.output(out, false)?);
        let e = err(name);
        match (op, full) {
            (BinaryOp::Add, true) => k.add(s, &x, &y, &o).map_err(e)?,
            (BinaryOp::Mul, true) => k.mul(s, &x, &y, &o).map_err(e)?,
            (BinaryOp::Add, false) => k.add_row_bias(s, &x, &y, &o).map_err(e)?,
            (BinaryOp::Mul, false) => {
                // No row-broadcast product kernel: one launch per row.
                let bytes = rows.cols * 4;
                for r in 0..rows.rows {
                    let xr = x.slice(r * bytes, bytes)?;
                    let or = o.slice(r * bytes, bytes)?;
                    k.mul(s, &xr, &y, &or).map_err(err(name))?;
                }
            }
        }
        f.finish()
    }
}
