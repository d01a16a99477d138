//! Row softmax: [`Softmax`] and [`SoftmaxBackward`].

use fsdp_alloc::Stream;

use crate::error::Result;
use crate::kernels::cpu;
use crate::kernels::op::{Check, Op, Rows, Spec};
use crate::kernels::operand::Operand;
use crate::launch::launch_f32;

/// Row softmax: `y[r, :] = softmax(x[r, :])`.
#[derive(Debug, Clone, Copy)]
pub struct Softmax<'a> {
    /// The shape.
    pub rows: Rows,
    /// Input.
    pub x: &'a Operand,
    /// Output.
    pub y: &'a Operand,
}

impl Op for Softmax<'_> {
    fn name(&self) -> &'static str {
        "softmax"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, rows) = (self.name(), self.rows);
        let n = rows.numel(op)?;
        let table = [Spec::float("x", self.x, n), Spec::float("y", self.y, n)];
        c.args(op, || format!("{rows:?}"), &table)?;
        Ok(n > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let cols = self.rows.cols;
        launch_f32(s, "softmax", [self.x], [self.y], false, move |[x], [y]| {
            cpu::softmax_rows(x, y, cols)
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::err;
        let mut f = b.scope("softmax", s);
        let (x, y) = (f.input(self.x)?, f.output(self.y, false)?);
        b.kernels()
            .softmax_rows(s, &x, &y, self.rows.cols)
            .map_err(err("softmax"))?;
        f.finish()
    }
}

/// Row softmax backward from the forward output `y`.
#[derive(Debug, Clone, Copy)]
pub struct SoftmaxBackward<'a> {
    /// The shape.
    pub rows: Rows,
    /// The forward output.
    pub y: &'a Operand,
    /// Upstream gradient.
    pub dy: &'a Operand,
    /// Gradient of the input.
    pub dx: &'a Operand,
}

impl Op for SoftmaxBackward<'_> {
    fn name(&self) -> &'static str {
        "softmax_backward"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, rows) = (self.name(), self.rows);
        let n = rows.numel(op)?;
        let table = [
            Spec::float("y", self.y, n),
            Spec::float("dy", self.dy, n),
            Spec::float("dx", self.dx, n),
        ];
        c.args(op, || format!("{rows:?}"), &table)?;
        Ok(n > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let cols = self.rows.cols;
        let (y, dy, dx) = (self.y, self.dy, self.dx);
        launch_f32(
            s,
            "softmax_backward",
            [y, dy],
            [dx],
            false,
            move |[y, g], [d]| cpu::softmax_rows_backward(y, g, d, cols),
        );
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::err;
        let op = "softmax_backward";
        let mut f = b.scope(op, s);
        let (y, dy, dx) = (
            f.input(self.y)?,
            f.input(self.dy)?,
            f.output(self.dx, false)?,
        );
        b.kernels()
            .softmax_rows_backward(s, &y, &dy, &dx, self.rows.cols)
            .map_err(err(op))?;
        f.finish()
    }
}
