//! [`Scale`] (`out = alpha · x`) and [`ScaleInplace`] (`y *= alpha`).

use fsdp_alloc::Stream;

use crate::error::Result;
use crate::kernels::cpu;
use crate::kernels::op::{n_is, Check, Op, Spec};
use crate::kernels::operand::Operand;
use crate::launch::{launch, launch_f32};

/// `out = alpha · x` (`n` elements).
#[derive(Debug, Clone, Copy)]
pub struct Scale<'a> {
    /// Elements.
    pub n: usize,
    /// The factor.
    pub alpha: f32,
    /// Input.
    pub x: &'a Operand,
    /// Output.
    pub out: &'a Operand,
}

impl Op for Scale<'_> {
    fn name(&self) -> &'static str {
        "scale"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let n = self.n;
        let table = [Spec::float("x", self.x, n), Spec::float("out", self.out, n)];
        c.args(self.name(), n_is(n), &table)?;
        Ok(n > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let alpha = self.alpha;
        launch_f32(s, "scale", [self.x], [self.out], false, move |[x], [o]| {
            cpu::scale(x, alpha, o)
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::{err, tb, typed};
        let (k, x, out, alpha) = (b.kernels(), self.x, self.out, self.alpha);
        if typed(&[x, out]) {
            return k.scale_t(s, tb(x), alpha, tb(out)).map_err(err("scale"));
        }
        let mut f = b.scope("scale", s);
        let (x, o) = (f.input(x)?, f.output(out, false)?);
        k.scale(s, &x, alpha, &o).map_err(err("scale"))?;
        f.finish()
    }
}

/// `y *= alpha` in place (`n` elements).
#[derive(Debug, Clone, Copy)]
pub struct ScaleInplace<'a> {
    /// Elements.
    pub n: usize,
    /// The factor.
    pub alpha: f32,
    /// Input and output.
    pub y: &'a Operand,
}

impl Op for ScaleInplace<'_> {
    fn name(&self) -> &'static str {
        "scale_inplace"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let n = self.n;
        c.args(self.name(), n_is(n), &[Spec::float("y", self.y, n)])?;
        Ok(n > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (ya, alpha) = (self.y.clone(), self.alpha);
        launch(s, "scale", move || {
            ya.f32_mut("scale_", true, |d| cpu::scale_inplace(d, alpha))
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::{err, tb, typed};
        let (k, y, alpha) = (b.kernels(), self.y, self.alpha);
        if typed(&[y]) {
            return k.scale_inplace_t(s, tb(y), alpha).map_err(err("scale_"));
        }
        let mut f = b.scope("scale_", s);
        let y = f.output(y, true)?;
        k.scale_inplace(s, &y, alpha).map_err(err("scale_"))?;
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
    use crate::kernels::cuda::plan::{plan_map, PArg, Plan, Ptr};
    use crate::kernels::cuda::typed::{operand, plan_map_t, types_word, TBuf};

    crate::kernels::cuda::kernel::declare_kernels! {
        EW_SCALE = "ew_scale" [U64, Ptr, F32, Ptr];
        EW_SCALE_INPLACE = "ew_scale_inplace" [U64, Ptr, F32];
        EW_SCALE_T = "ew_scale_t" [U64, U64, Ptr, F32, Ptr];
        EW_SCALE_INPLACE_T = "ew_scale_inplace_t" [U64, U64, Ptr, F32];
    }

    /// `out = alpha·x`.
    pub(crate) fn plan_scale(n: u64, x: Ptr, alpha: f32, out: Ptr) -> Plan {
        plan_map(
            EW_SCALE,
            n,
            vec![PArg::U64(n), PArg::Ptr(x), PArg::F32(alpha), PArg::Ptr(out)],
        )
    }

    /// `y ← alpha·y`.
    pub(crate) fn plan_scale_inplace(n: u64, y: Ptr, alpha: f32) -> Plan {
        plan_map(
            EW_SCALE_INPLACE,
            n,
            vec![PArg::U64(n), PArg::Ptr(y), PArg::F32(alpha)],
        )
    }

    /// `out = alpha·x` (codes: x, out).
    pub(crate) fn plan_scale_t(types: u64, n: u64, x: Ptr, alpha: f32, out: Ptr) -> Plan {
        let args = vec![
            PArg::U64(types),
            PArg::U64(n),
            PArg::Ptr(x),
            PArg::F32(alpha),
            PArg::Ptr(out),
        ];
        plan_map_t(EW_SCALE_T, n, args)
    }

    /// `y ← alpha·y` (code: y).
    pub(crate) fn plan_scale_inplace_t(types: u64, n: u64, y: Ptr, alpha: f32) -> Plan {
        let args = vec![
            PArg::U64(types),
            PArg::U64(n),
            PArg::Ptr(y),
            PArg::F32(alpha),
        ];
        plan_map_t(EW_SCALE_INPLACE_T, n, args)
    }

    impl CudaKernels {
        /// `out = alpha · x` (CPU: [`cpu::scale`](crate::kernels::cpu::scale)); bit-identical.
        ///
        /// # Errors
        /// Length mismatch between `x` and `out`; buffer/stream errors; overlap of `out` and `x`.
        pub fn scale(
            &self,
            stream: &Stream,
            x: &BufferRef,
            alpha: f32,
            out: &BufferRef,
        ) -> Result<()> {
            let op = "scale";
            let c = self.call(op, stream)?;
            let [dx, dout] = c.f32_bufs([("x", x), ("out", out)])?;
            expect_len(op, "out", dout.len, dx.len, || format!("len(x)={}", dx.len))?;
            c.disjoint(&[("out", out)], &[("x", x)])?;
            let plan = plan_scale(dx.len as u64, dx.as_ptr(), alpha, dout.as_ptr());
            // SAFETY: x and out hold n f32 each on this device and do not overlap.
            unsafe { c.exec(&plan) }.map(drop)
        }

        /// `y ← alpha · y` in place (CPU: [`cpu::scale_inplace`](crate::kernels::cpu::scale_inplace)).
        ///
        /// # Errors
        /// Buffer/stream errors only.
        pub fn scale_inplace(&self, stream: &Stream, y: &BufferRef, alpha: f32) -> Result<()> {
            let c = self.call("scale_inplace", stream)?;
            let dy = c.buf("y", y, Elem::F32)?;
            let plan = plan_scale_inplace(dy.len as u64, dy.as_ptr(), alpha);
            // SAFETY: y holds n f32 on this device; each element is read and written by one thread.
            unsafe { c.exec(&plan) }.map(drop)
        }

        /// `out = alpha·x`, each operand f32, f16 or bf16.
        pub(crate) fn scale_t(
            &self,
            stream: &Stream,
            x: TBuf<'_>,
            alpha: f32,
            out: TBuf<'_>,
        ) -> Result<()> {
            let op = "scale";
            let c = self.call(op, stream)?;
            let (dx, cx) = operand(&c, op, "x", x)?;
            let (dout, co) = operand(&c, op, "out", out)?;
            expect_len(op, "out", dout.len, dx.len, || format!("len(x)={}", dx.len))?;
            c.disjoint(&[("out", out.0)], &[("x", x.0)])?;
            let types = types_word(&[cx, co]);
            let plan = plan_scale_t(types, dx.len as u64, dx.as_ptr(), alpha, dout.as_ptr());
            // SAFETY: x and out hold n elements of their dtypes on this device and do not overlap.
            unsafe { c.exec(&plan) }.map(drop)
        }

        /// `y ← alpha·y` in place, `y` f32, f16 or bf16.
        pub(crate) fn scale_inplace_t(
            &self,
            stream: &Stream,
            y: TBuf<'_>,
            alpha: f32,
        ) -> Result<()> {
            let op = "scale_inplace";
            let c = self.call(op, stream)?;
            let (dy, cy) = operand(&c, op, "y", y)?;
            let plan = plan_scale_inplace_t(types_word(&[cy]), dy.len as u64, dy.as_ptr(), alpha);
            // SAFETY: y holds n elements of its dtype on this device; each is read and written by
            // one thread.
            unsafe { c.exec(&plan) }.map(drop)
        }
    }
}
