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

/// The CUDA side of the op (feature `cuda`): its kernels' declarations, launch plans and
/// [`CudaKernels`](crate::kernels::cuda::CudaKernels) methods.
#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use fsdp_alloc::{BufferRef, Stream};

    use crate::kernels::cuda::context::{expect_len, rows_of, CudaKernels};
    use crate::kernels::cuda::error::Result;
    use crate::kernels::cuda::plan::{plan_map, PArg, Plan, Ptr};
    use crate::kernels::cuda::typed::{operand, plan_map_t, types_word, TBuf};

    crate::kernels::cuda::kernel::declare_kernels! {
        EW_AXPY = "ew_axpy" [U64, Ptr, F32, Ptr];
        ADD_ROW_BIAS_INPLACE = "add_row_bias_inplace" [U64, U64, Ptr, Ptr];
        EW_AXPY_T = "ew_axpy_t" [U64, U64, Ptr, F32, Ptr];
        ADD_ROW_BIAS_INPLACE_T = "add_row_bias_inplace_t" [U64, U64, U64, Ptr, Ptr];
    }

    /// `y ← y + alpha·x`.
    pub(crate) fn plan_axpy(n: u64, y: Ptr, alpha: f32, x: Ptr) -> Plan {
        plan_map(
            EW_AXPY,
            n,
            vec![PArg::U64(n), PArg::Ptr(y), PArg::F32(alpha), PArg::Ptr(x)],
        )
    }

    /// `y += bias` per row (`cols > 0`).
    pub(crate) fn plan_add_row_bias_inplace(n: u64, cols: u64, y: Ptr, bias: Ptr) -> Plan {
        plan_map(
            ADD_ROW_BIAS_INPLACE,
            n,
            vec![PArg::U64(n), PArg::U64(cols), PArg::Ptr(y), PArg::Ptr(bias)],
        )
    }

    /// `y ← y + alpha·x` ([`EW_AXPY_T`]; codes: y, x).
    pub(crate) fn plan_axpy_t(types: u64, n: u64, y: Ptr, alpha: f32, x: Ptr) -> Plan {
        let args = vec![
            PArg::U64(types),
            PArg::U64(n),
            PArg::Ptr(y),
            PArg::F32(alpha),
            PArg::Ptr(x),
        ];
        plan_map_t(EW_AXPY_T, n, args)
    }

    /// `y += bias` per row (codes: y, bias; `cols > 0`).
    pub(crate) fn plan_add_row_bias_inplace_t(
        types: u64,
        n: u64,
        cols: u64,
        y: Ptr,
        bias: Ptr,
    ) -> Plan {
        let args = vec![
            PArg::U64(types),
            PArg::U64(n),
            PArg::U64(cols),
            PArg::Ptr(y),
            PArg::Ptr(bias),
        ];
        plan_map_t(ADD_ROW_BIAS_INPLACE_T, n, args)
    }

    impl CudaKernels {
        /// `y ← y + alpha · x` (axpy; CPU: [`cpu::add_scaled`](crate::kernels::cpu::add_scaled)),
        /// without fused multiply-add, so bit-identical to the CPU (with `alpha == 1` exactly
        /// `y + x`).
        ///
        /// # Errors
        /// Length mismatch between `x` and `y`; buffer/stream errors; overlap of `y` and `x`.
        pub fn add_scaled(
            &self,
            stream: &Stream,
            y: &BufferRef,
            alpha: f32,
            x: &BufferRef,
        ) -> Result<()> {
            let op = "add_scaled";
            let c = self.call(op, stream)?;
            let [dy, dx] = c.f32_bufs([("y", y), ("x", x)])?;
            expect_len(op, "x", dx.len, dy.len, || format!("len(y)={}", dy.len))?;
            c.disjoint(&[("y", y)], &[("x", x)])?;
            let plan = plan_axpy(dy.len as u64, dy.as_ptr(), alpha, dx.as_ptr());
            // SAFETY: y and x hold n f32 each on this device and do not overlap.
            unsafe { c.exec(&plan) }.map(drop)
        }

        /// `y[r, j] += bias[j]` in place (CPU:
        /// [`cpu::add_row_bias_inplace`](crate::kernels::cpu::add_row_bias_inplace)).
        ///
        /// # Errors
        /// Empty `bias` or partial rows; buffer/stream errors; overlap of `y` and `bias`.
        pub fn add_row_bias_inplace(
            &self,
            stream: &Stream,
            y: &BufferRef,
            bias: &BufferRef,
        ) -> Result<()> {
            let op = "add_row_bias_inplace";
            let c = self.call(op, stream)?;
            let [dy, db] = c.f32_bufs([("y", y), ("bias", bias)])?;
            rows_of(op, "y", dy.len, db.len)?;
            c.disjoint(&[("y", y)], &[("bias", bias)])?;
            let plan =
                plan_add_row_bias_inplace(dy.len as u64, db.len as u64, dy.as_ptr(), db.as_ptr());
            // SAFETY: y holds n f32 and bias cols f32 on this device, disjoint; each y element is
            // read and written by one thread.
            unsafe { c.exec(&plan) }.map(drop)
        }

        /// `y ← y + alpha·x`, each operand f32, f16 or bf16.
        pub(crate) fn add_scaled_t(
            &self,
            stream: &Stream,
            y: TBuf<'_>,
            alpha: f32,
            x: TBuf<'_>,
        ) -> Result<()> {
            let op = "add_scaled";
            let c = self.call(op, stream)?;
            let (dy, cy) = operand(&c, op, "y", y)?;
            let (dx, cx) = operand(&c, op, "x", x)?;
            expect_len(op, "x", dx.len, dy.len, || format!("len(y)={}", dy.len))?;
            c.disjoint(&[("y", y.0)], &[("x", x.0)])?;
            let plan = plan_axpy_t(
                types_word(&[cy, cx]),
                dy.len as u64,
                dy.as_ptr(),
                alpha,
                dx.as_ptr(),
            );
            // SAFETY: y and x hold n elements of their dtypes on this device and do not overlap.
            unsafe { c.exec(&plan) }.map(drop)
        }

        /// `y[r, j] += bias[j]`, each operand f32, f16 or bf16.
        pub(crate) fn add_row_bias_inplace_t(
            &self,
            stream: &Stream,
            y: TBuf<'_>,
            bias: TBuf<'_>,
        ) -> Result<()> {
            let op = "add_row_bias_inplace";
            let c = self.call(op, stream)?;
            let (dy, cy) = operand(&c, op, "y", y)?;
            let (db, cb) = operand(&c, op, "bias", bias)?;
            rows_of(op, "y", dy.len, db.len)?;
            c.disjoint(&[("y", y.0)], &[("bias", bias.0)])?;
            let plan = plan_add_row_bias_inplace_t(
                types_word(&[cy, cb]),
                dy.len as u64,
                db.len as u64,
                dy.as_ptr(),
                db.as_ptr(),
            );
            // SAFETY: y holds n elements and bias cols on this device, disjoint; each y element is
            // read and written by one thread.
            unsafe { c.exec(&plan) }.map(drop)
        }
    }
}
