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

/// The CUDA side of the op (feature `cuda`): its kernels' declarations, launch plans and
/// [`CudaKernels`](crate::kernels::cuda::CudaKernels) methods.
#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use fsdp_alloc::{BufferRef, Stream};

    use crate::kernels::cuda::context::{rows_of, CudaKernels};
    use crate::kernels::cuda::error::Result;
    use crate::kernels::cuda::plan::{grid_col_groups, PArg, Plan, Ptr};
    use crate::kernels::cuda::typed::{operand, types_word, TBuf};

    crate::kernels::cuda::kernel::declare_kernels! {
        COL_SUMS = "col_sums" [U64, U64, Ptr, Ptr];
        COL_SUMS_T = "col_sums_t" [U64, U64, U64, Ptr, Ptr];
    }

    /// Column sums of a `rows × cols` matrix (`cols > 0`; zero rows give zeros).
    pub(crate) fn plan_col_sums(rows: u64, cols: u64, x: Ptr, out: Ptr) -> Plan {
        let mut plan = Plan::new();
        plan.launch(
            COL_SUMS,
            grid_col_groups(cols),
            vec![
                PArg::U64(rows),
                PArg::U64(cols),
                PArg::Ptr(x),
                PArg::Ptr(out),
            ],
        );
        plan
    }

    /// Column sums (codes: x, out; `cols > 0`): one block per column group, as `col_sums`.
    pub(crate) fn plan_col_sums_t(types: u64, rows: u64, cols: u64, x: Ptr, out: Ptr) -> Plan {
        let mut plan = Plan::new();
        plan.launch(
            COL_SUMS_T,
            grid_col_groups(cols),
            vec![
                PArg::U64(types),
                PArg::U64(rows),
                PArg::U64(cols),
                PArg::Ptr(x),
                PArg::Ptr(out),
            ],
        );
        plan
    }

    impl CudaKernels {
        /// Column sums `out[j] = Σ_r x[r, j]` (CPU: [`cpu::col_sums`](crate::kernels::cpu::col_sums)):
        /// each column's rows are added in order 0, 1, … in f32 — the CPU order, so the result is
        /// bit-identical. One block per group of 8 columns stages tiles of 256 rows through shared
        /// memory (coalesced loads, the next tile in flight while one thread per column adds the
        /// current one); the serial order per column bounds the speed for few columns and very many
        /// rows.
        ///
        /// # Errors
        /// Empty `out` or partial rows; buffer/stream errors; overlap of `out` and `x`.
        pub fn col_sums(&self, stream: &Stream, x: &BufferRef, out: &BufferRef) -> Result<()> {
            let op = "col_sums";
            let c = self.call(op, stream)?;
            let [dx, dout] = c.f32_bufs([("x", x), ("out", out)])?;
            let rows = rows_of(op, "x", dx.len, dout.len)?;
            c.disjoint(&[("out", out)], &[("x", x)])?;
            let plan = plan_col_sums(rows as u64, dout.len as u64, dx.as_ptr(), dout.as_ptr());
            // SAFETY: x holds rows·cols f32 and out cols f32 (cols > 0) on this device, disjoint.
            unsafe { c.exec(&plan) }.map(drop)
        }

        /// Column sums `out[j] = Σ_r x[r, j]` in row order (as
        /// [`CudaKernels::col_sums`]), `x` and `out` each f32, f16 or bf16.
        pub(crate) fn col_sums_t(&self, stream: &Stream, x: TBuf<'_>, out: TBuf<'_>) -> Result<()> {
            let op = "col_sums";
            let c = self.call(op, stream)?;
            let (dx, cx) = operand(&c, op, "x", x)?;
            let (dout, co) = operand(&c, op, "out", out)?;
            let rows = rows_of(op, "x", dx.len, dout.len)?;
            c.disjoint(&[("out", out.0)], &[("x", x.0)])?;
            let plan = plan_col_sums_t(
                types_word(&[cx, co]),
                rows as u64,
                dout.len as u64,
                dx.as_ptr(),
                dout.as_ptr(),
            );
            // SAFETY: x holds rows·cols and out cols (> 0) elements on this device, disjoint.
            unsafe { c.exec(&plan) }.map(drop)
        }
    }
}
