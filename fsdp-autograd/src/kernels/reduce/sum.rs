//! [`Sum`]: the sum or mean of all elements into one.

use fsdp_alloc::Stream;

use crate::error::Result;
use crate::kernels::cpu;
use crate::kernels::op::{invalid, n_is, Check, Op, Spec};
use crate::kernels::operand::Operand;
use crate::launch::launch_f32;

/// `out[0] = Σ x` (or the mean with `mean`), `n ≥ 1` elements.
#[derive(Debug, Clone, Copy)]
pub struct Sum<'a> {
    /// Elements of `x`.
    pub n: usize,
    /// The mean instead of the sum.
    pub mean: bool,
    /// Input.
    pub x: &'a Operand,
    /// One-element output.
    pub out: &'a Operand,
}

impl Op for Sum<'_> {
    fn name(&self) -> &'static str {
        if self.mean {
            "mean"
        } else {
            "sum"
        }
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, n) = (self.name(), self.n);
        c.args(op, n_is(n), &[Spec::float("x", self.x, n)])?;
        c.args(op, || "a scalar".into(), &[Spec::float("out", self.out, 1)])?;
        if n == 0 {
            return Err(invalid(op, "cannot reduce an empty tensor"));
        }
        Ok(true)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (n, mean) = (self.n, self.mean);
        launch_f32(
            s,
            self.name(),
            [self.x],
            [self.out],
            false,
            move |[x], [o]| {
                let s = cpu::sum(x);
                o[0] = if mean { s / n as f32 } else { s };
                Ok(())
            },
        );
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::{err, tb, typed};
        let (op, k, mean, x, out) = (self.name(), b.kernels(), self.mean, self.x, self.out);
        if typed(&[x, out]) {
            return k.sum_t(s, tb(x), tb(out), mean).map_err(err(op));
        }
        let mut f = b.scope(op, s);
        let (x, o) = (f.input(x)?, f.output(out, false)?);
        if mean {
            k.mean(s, &x, &o)
        } else {
            k.sum(s, &x, &o)
        }
        .map_err(err(op))?;
        f.finish()
    }
}

/// The CUDA side of the op (feature `cuda`): its kernels' declarations, launch plans and
/// [`CudaKernels`](crate::kernels::cuda::CudaKernels) methods.
#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use fsdp_alloc::{BufferRef, Stream};

    use crate::kernels::cuda::context::{expect_len, CudaKernels, Elem};
    use crate::kernels::cuda::error::Result;
    use crate::kernels::cuda::plan::{sum_parts, PArg, Plan, Ptr};
    use crate::kernels::cuda::typed::{operand, types_word, TBuf};
    use crate::kernels::KernelError;

    crate::kernels::cuda::kernel::declare_kernels! {
        SUM_PARTIAL = "sum_partial" [U64, Ptr, Ptr];
        SUM_FINAL = "sum_final" [U64, Ptr, F64, Ptr];
        SUM_FINAL_T = "sum_final_t" [U64, U64, Ptr, F64, Ptr];
        SUM_PARTIAL_T = "sum_partial_t" [U64, U64, Ptr, Ptr];
    }

    /// `out[0] = Σ x / divisor` in two launches through an f64 scratch of partial sums.
    pub(crate) fn plan_sum(n: u64, x: Ptr, out: Ptr, divisor: f64) -> Plan {
        let mut plan = Plan::new();
        let parts = sum_parts(n);
        let partial = plan.scratch(parts as usize, Elem::F64);
        plan.launch(
            SUM_PARTIAL,
            parts,
            vec![PArg::U64(n), PArg::Ptr(x), PArg::Ptr(Ptr::scratch(partial))],
        );
        plan.launch(
            SUM_FINAL,
            1,
            vec![
                PArg::U64(parts as u64),
                PArg::Ptr(Ptr::scratch(partial)),
                PArg::F64(divisor),
                PArg::Ptr(out),
            ],
        );
        plan
    }

    /// `out[0] = Σ x / divisor` (codes: x, out) through f64 partial sums, as `plan_sum`.
    pub(crate) fn plan_sum_t(codes: [u64; 2], n: u64, x: Ptr, out: Ptr, divisor: f64) -> Plan {
        let mut plan = Plan::new();
        let parts = sum_parts(n);
        let partial = Ptr::scratch(plan.scratch(parts as usize, Elem::F64));
        plan.launch(
            SUM_PARTIAL_T,
            parts,
            vec![
                PArg::U64(types_word(&[codes[0]])),
                PArg::U64(n),
                PArg::Ptr(x),
                PArg::Ptr(partial),
            ],
        );
        plan.launch(
            SUM_FINAL_T,
            1,
            vec![
                PArg::U64(types_word(&[0, codes[1]])),
                PArg::U64(parts as u64),
                PArg::Ptr(partial),
                PArg::F64(divisor),
                PArg::Ptr(out),
            ],
        );
        plan
    }

    impl CudaKernels {
        /// Writes `Σ x / divisor` to the one-element `out` (shared by sum and mean).
        fn reduce(
            &self,
            op: &'static str,
            stream: &Stream,
            x: &BufferRef,
            out: &BufferRef,
            mean: bool,
        ) -> Result<()> {
            let c = self.call(op, stream)?;
            let [dx, dout] = c.f32_bufs([("x", x), ("out", out)])?;
            expect_len(op, "out", dout.len, 1, || "a scalar output".into())?;
            c.disjoint(&[("out", out)], &[("x", x)])?;
            if mean && dx.len == 0 {
                return Err(KernelError::InvalidShape {
                    op,
                    reason: "the mean of an empty slice is undefined".into(),
                }
                .into());
            }
            let divisor = if mean { dx.len as f64 } else { 1.0 };
            let plan = plan_sum(dx.len as u64, dx.as_ptr(), dout.as_ptr(), divisor);
            // SAFETY: x holds n f32 and out one f32 on this device, disjoint; the partial sums live
            // in the plan's scratch slot, sized to the number of blocks of the first launch.
            unsafe { c.exec(&plan) }.map(drop)
        }

        /// `out[0] = Σ x`, accumulated in f64 (per-block grid-strided partial sums, then one block
        /// combining them, both fixed trees), rounded to f32. The empty sum is 0. The CPU kernel
        /// ([`cpu::sum`](crate::kernels::cpu::sum)) also sums in f64 but in another order, so results
        /// agree to f32 rounding, not bit for bit. `out` is a one-element device buffer, so no
        /// synchronization is needed.
        ///
        /// # Errors
        /// `out` must hold exactly one f32; buffer/stream errors; scratch allocation failure.
        pub fn sum(&self, stream: &Stream, x: &BufferRef, out: &BufferRef) -> Result<()> {
            self.reduce("sum", stream, x, out, false)
        }

        /// `out[0] = mean(x)` (see [`CudaKernels::sum`]).
        ///
        /// # Errors
        /// As [`CudaKernels::sum`], plus [`KernelError::InvalidShape`] for an empty `x`.
        pub fn mean(&self, stream: &Stream, x: &BufferRef, out: &BufferRef) -> Result<()> {
            self.reduce("mean", stream, x, out, true)
        }

        /// `out[0] = Σ x` (or the mean with `mean`), `x` and the one-element `out` each f32, f16 or
        /// bf16 (as [`CudaKernels::sum`] / [`CudaKernels::mean`]).
        pub(crate) fn sum_t(
            &self,
            stream: &Stream,
            x: TBuf<'_>,
            out: TBuf<'_>,
            mean: bool,
        ) -> Result<()> {
            let op = if mean { "mean" } else { "sum" };
            let c = self.call(op, stream)?;
            let (dx, cx) = operand(&c, op, "x", x)?;
            let (dout, co) = operand(&c, op, "out", out)?;
            expect_len(op, "out", dout.len, 1, || "a scalar output".into())?;
            c.disjoint(&[("out", out.0)], &[("x", x.0)])?;
            if mean && dx.len == 0 {
                return Err(KernelError::InvalidShape {
                    op,
                    reason: "the mean of an empty slice is undefined".into(),
                }
                .into());
            }
            let divisor = if mean { dx.len as f64 } else { 1.0 };
            let plan = plan_sum_t([cx, co], dx.len as u64, dx.as_ptr(), dout.as_ptr(), divisor);
            // SAFETY: x holds n elements and out one, of their dtypes, on this device, disjoint; the
            // partial sums live in the plan's scratch, sized to the first launch's blocks.
            unsafe { c.exec(&plan) }.map(drop)
        }
    }
}
