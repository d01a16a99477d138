//! GELU: [`GeluForward`] and [`GeluBackward`], exact or tanh ([`Gelu`]).

use fsdp_alloc::Stream;

use crate::error::Result;
use crate::kernels::op::{n_is, Check, Op, Spec};
use crate::kernels::operand::Operand;
use crate::kernels::{cpu, Gelu};
use crate::launch::launch_f32;

/// GELU of `kind` over `n` elements: `y = gelu(x)`.
#[derive(Debug, Clone, Copy)]
pub struct GeluForward<'a> {
    /// Exact or tanh.
    pub kind: Gelu,
    /// Elements.
    pub n: usize,
    /// Input.
    pub x: &'a Operand,
    /// Output.
    pub y: &'a Operand,
}

impl Op for GeluForward<'_> {
    fn name(&self) -> &'static str {
        "gelu"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let n = self.n;
        let table = [Spec::float("x", self.x, n), Spec::float("y", self.y, n)];
        c.args(self.name(), n_is(n), &table)?;
        Ok(n > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let kind = self.kind;
        launch_f32(
            s,
            "gelu",
            [self.x],
            [self.y],
            false,
            move |[x], [y]| match kind {
                Gelu::Tanh => cpu::gelu(x, y),
                Gelu::Exact => cpu::gelu_exact(x, y),
            },
        );
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::{err, tb, typed};
        let (k, kind, x, y) = (b.kernels(), self.kind, self.x, self.y);
        if typed(&[x, y]) {
            return k.gelu_t(s, kind, tb(x), tb(y)).map_err(err("gelu"));
        }
        let mut f = b.scope("gelu", s);
        let (x, y) = (f.input(x)?, f.output(y, false)?);
        k.gelu(s, kind, &x, &y).map_err(err("gelu"))?;
        f.finish()
    }
}

/// GELU backward from the forward input `x`: `dx = dy · gelu'(x)`.
#[derive(Debug, Clone, Copy)]
pub struct GeluBackward<'a> {
    /// Exact or tanh.
    pub kind: Gelu,
    /// Elements.
    pub n: usize,
    /// The forward input.
    pub x: &'a Operand,
    /// Upstream gradient.
    pub dy: &'a Operand,
    /// Gradient of `x`.
    pub dx: &'a Operand,
}

impl Op for GeluBackward<'_> {
    fn name(&self) -> &'static str {
        "gelu_backward"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let n = self.n;
        let table = [
            Spec::float("x", self.x, n),
            Spec::float("dy", self.dy, n),
            Spec::float("dx", self.dx, n),
        ];
        c.args(self.name(), n_is(n), &table)?;
        Ok(n > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (op, kind) = ("gelu_backward", self.kind);
        let (x, dy, dx) = (self.x, self.dy, self.dx);
        launch_f32(s, op, [x, dy], [dx], false, move |[x, g], [d]| match kind {
            Gelu::Tanh => cpu::gelu_backward(x, g, d),
            Gelu::Exact => cpu::gelu_exact_backward(x, g, d),
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::{err, tb, typed};
        let (op, k, kind) = ("gelu_backward", b.kernels(), self.kind);
        let (x, dy, dx) = (self.x, self.dy, self.dx);
        if typed(&[x, dy, dx]) {
            return k
                .gelu_backward_t(s, kind, tb(x), tb(dy), tb(dx))
                .map_err(err(op));
        }
        let mut f = b.scope(op, s);
        let (x, dy, dx) = (f.input(x)?, f.input(dy)?, f.output(dx, false)?);
        k.gelu_backward(s, kind, &x, &dy, &dx).map_err(err(op))?;
        f.finish()
    }
}

/// The CUDA side of the op (feature `cuda`): its kernels' declarations, launch plans and
/// [`CudaKernels`](crate::kernels::cuda::CudaKernels) methods.
#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use fsdp_alloc::{BufferRef, Stream};

    use crate::kernels::cuda::context::{expect_len, CudaKernels};
    use crate::kernels::cuda::error::Result;
    use crate::kernels::cuda::plan::{plan_map, PArg, Plan, Ptr};
    use crate::kernels::cuda::typed::{operand, plan_map_t, types_word, TBuf};
    use crate::kernels::Gelu;

    crate::kernels::cuda::kernel::declare_kernels! {
        GELU_FWD = "gelu_fwd" [U64, Ptr, Ptr];
        GELU_BWD = "gelu_bwd" [U64, Ptr, Ptr, Ptr];
        GELU_EXACT_FWD = "gelu_exact_fwd" [U64, Ptr, Ptr];
        GELU_EXACT_BWD = "gelu_exact_bwd" [U64, Ptr, Ptr, Ptr];
        GELU_FWD_T = "gelu_fwd_t" [U64, U64, Ptr, Ptr];
        GELU_BWD_T = "gelu_bwd_t" [U64, U64, Ptr, Ptr, Ptr];
        GELU_EXACT_FWD_T = "gelu_exact_fwd_t" [U64, U64, Ptr, Ptr];
        GELU_EXACT_BWD_T = "gelu_exact_bwd_t" [U64, U64, Ptr, Ptr, Ptr];
    }

    /// GELU forward.
    pub(crate) fn plan_gelu(kind: Gelu, n: u64, x: Ptr, y: Ptr) -> Plan {
        plan_map(
            match kind {
                Gelu::Tanh => GELU_FWD,
                Gelu::Exact => GELU_EXACT_FWD,
            },
            n,
            vec![PArg::U64(n), PArg::Ptr(x), PArg::Ptr(y)],
        )
    }

    /// GELU backward.
    pub(crate) fn plan_gelu_backward(kind: Gelu, n: u64, x: Ptr, dy: Ptr, dx: Ptr) -> Plan {
        plan_map(
            match kind {
                Gelu::Tanh => GELU_BWD,
                Gelu::Exact => GELU_EXACT_BWD,
            },
            n,
            vec![PArg::U64(n), PArg::Ptr(x), PArg::Ptr(dy), PArg::Ptr(dx)],
        )
    }

    /// GELU forward (codes: x, y).
    pub(crate) fn plan_gelu_t(kind: Gelu, types: u64, n: u64, x: Ptr, y: Ptr) -> Plan {
        let kernel = match kind {
            Gelu::Tanh => GELU_FWD_T,
            Gelu::Exact => GELU_EXACT_FWD_T,
        };
        let args = vec![PArg::U64(types), PArg::U64(n), PArg::Ptr(x), PArg::Ptr(y)];
        plan_map_t(kernel, n, args)
    }

    /// GELU backward (codes: x, dy, dx).
    pub(crate) fn plan_gelu_backward_t(
        kind: Gelu,
        types: u64,
        n: u64,
        x: Ptr,
        dy: Ptr,
        dx: Ptr,
    ) -> Plan {
        let kernel = match kind {
            Gelu::Tanh => GELU_BWD_T,
            Gelu::Exact => GELU_EXACT_BWD_T,
        };
        let args = vec![
            PArg::U64(types),
            PArg::U64(n),
            PArg::Ptr(x),
            PArg::Ptr(dy),
            PArg::Ptr(dx),
        ];
        plan_map_t(kernel, n, args)
    }

    impl CudaKernels {
        /// GELU of `kind`: the tanh approximation in the CPU kernel's form `x / (1 + exp(−2u))`
        /// (CPU: [`cpu::gelu`](crate::kernels::cpu::gelu)), or the exact form `½·x·erfc(−x/√2)`
        /// (CPU: [`cpu::gelu_exact`](crate::kernels::cpu::gelu_exact)). Uses CUDA's `expf` /
        /// `erfcf` (a few ulp), so results differ from the CPU by a few ulp.
        ///
        /// # Errors
        /// Length mismatch; buffer/stream errors; overlap of `y` and `x`.
        pub fn gelu(
            &self,
            stream: &Stream,
            kind: Gelu,
            x: &BufferRef,
            y: &BufferRef,
        ) -> Result<()> {
            let op = "gelu";
            let c = self.call(op, stream)?;
            let [dx, dy] = c.f32_bufs([("x", x), ("y", y)])?;
            expect_len(op, "y", dy.len, dx.len, || format!("len(x)={}", dx.len))?;
            c.disjoint(&[("y", y)], &[("x", x)])?;
            let plan = plan_gelu(kind, dx.len as u64, dx.as_ptr(), dy.as_ptr());
            // SAFETY: x and y hold n f32 each on this device and do not overlap.
            unsafe { c.exec(&plan) }.map(drop)
        }

        /// Gradient of [`CudaKernels::gelu`] of `kind` from the forward input `x` (CPU:
        /// [`cpu::gelu_backward`](crate::kernels::cpu::gelu_backward),
        /// [`cpu::gelu_exact_backward`](crate::kernels::cpu::gelu_exact_backward)); same formulas
        /// as the CPU.
        ///
        /// # Errors
        /// Length mismatch; buffer/stream errors; overlap of `dx` with `x` or `dy`.
        pub fn gelu_backward(
            &self,
            stream: &Stream,
            kind: Gelu,
            x: &BufferRef,
            dy: &BufferRef,
            dx: &BufferRef,
        ) -> Result<()> {
            let op = "gelu_backward";
            let c = self.call(op, stream)?;
            let [bx, bdy, bdx] = c.f32_bufs([("x", x), ("dy", dy), ("dx", dx)])?;
            let shape = || format!("len(x)={}", bx.len);
            expect_len(op, "dy", bdy.len, bx.len, shape)?;
            expect_len(op, "dx", bdx.len, bx.len, shape)?;
            c.disjoint(&[("dx", dx)], &[("x", x), ("dy", dy)])?;
            let plan =
                plan_gelu_backward(kind, bx.len as u64, bx.as_ptr(), bdy.as_ptr(), bdx.as_ptr());
            // SAFETY: x, dy and dx hold n f32 each on this device; dx overlaps neither input.
            unsafe { c.exec(&plan) }.map(drop)
        }

        /// GELU of `kind` (as [`CudaKernels::gelu`]), `x` and `y` each f32, f16 or bf16.
        pub(crate) fn gelu_t(
            &self,
            stream: &Stream,
            kind: Gelu,
            x: TBuf<'_>,
            y: TBuf<'_>,
        ) -> Result<()> {
            let op = "gelu";
            let c = self.call(op, stream)?;
            let (dx, cx) = operand(&c, op, "x", x)?;
            let (dy, cy) = operand(&c, op, "y", y)?;
            expect_len(op, "y", dy.len, dx.len, || format!("len(x)={}", dx.len))?;
            c.disjoint(&[("y", y.0)], &[("x", x.0)])?;
            let types = types_word(&[cx, cy]);
            let plan = plan_gelu_t(kind, types, dx.len as u64, dx.as_ptr(), dy.as_ptr());
            // SAFETY: x and y hold n elements of their dtypes on this device and do not overlap.
            unsafe { c.exec(&plan) }.map(drop)
        }

        /// Gradient of [`CudaKernels::gelu_t`], each operand f32, f16 or bf16.
        pub(crate) fn gelu_backward_t(
            &self,
            stream: &Stream,
            kind: Gelu,
            x: TBuf<'_>,
            dy: TBuf<'_>,
            dx: TBuf<'_>,
        ) -> Result<()> {
            let op = "gelu_backward";
            let c = self.call(op, stream)?;
            let (bx, cx) = operand(&c, op, "x", x)?;
            let (bdy, cdy) = operand(&c, op, "dy", dy)?;
            let (bdx, cdx) = operand(&c, op, "dx", dx)?;
            let shape = || format!("len(x)={}", bx.len);
            expect_len(op, "dy", bdy.len, bx.len, shape)?;
            expect_len(op, "dx", bdx.len, bx.len, shape)?;
            c.disjoint(&[("dx", dx.0)], &[("x", x.0), ("dy", dy.0)])?;
            let plan = plan_gelu_backward_t(
                kind,
                types_word(&[cx, cdy, cdx]),
                bx.len as u64,
                bx.as_ptr(),
                bdy.as_ptr(),
                bdx.as_ptr(),
            );
            // SAFETY: x, dy and dx hold n elements of their dtypes on this device; dx overlaps
            // neither input.
            unsafe { c.exec(&plan) }.map(drop)
        }
    }
}
