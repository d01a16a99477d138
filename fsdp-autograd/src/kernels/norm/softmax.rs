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

/// The CUDA side of the op (feature `cuda`): its kernels' declarations, launch plans and
/// [`CudaKernels`](crate::kernels::cuda::CudaKernels) methods.
#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use fsdp_alloc::{BufferRef, Stream};

    use crate::kernels::cuda::context::{expect_len, row_args, rows_of, CudaKernels};
    use crate::kernels::cuda::error::Result;
    use crate::kernels::cuda::plan::{plan_rows, Plan, Ptr};

    crate::kernels::cuda::kernel::declare_kernels! {
        SOFTMAX_FWD = "softmax_fwd" [U64, U64, Ptr, Ptr];
        SOFTMAX_BWD = "softmax_bwd" [U64, U64, Ptr, Ptr, Ptr];
    }

    /// Row softmax of `rows × cols`.
    pub(crate) fn plan_softmax(rows: u64, cols: u64, x: Ptr, y: Ptr) -> Plan {
        plan_rows(SOFTMAX_FWD, rows, row_args(rows, cols, &[x, y]))
    }

    /// Row softmax backward.
    pub(crate) fn plan_softmax_backward(rows: u64, cols: u64, y: Ptr, dy: Ptr, dx: Ptr) -> Plan {
        plan_rows(SOFTMAX_BWD, rows, row_args(rows, cols, &[y, dy, dx]))
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
    }
}
