//! The grad scaler's unscale: the host kernel ([`unscale`]) and the op ([`Unscale`]).

use fsdp_alloc::Stream;

use super::common::{check_optim, f32_arg};
use crate::error::Result;
use crate::kernels::op::{Check, Op};
use crate::kernels::operand::Operand;
use crate::launch::launch_f32;

/// `g ← g·inv` in place; true if any element was inf or NaN before scaling.
pub fn unscale(g: &mut [f32], inv: f32) -> bool {
    let mut found = false;
    for x in g {
        found |= !x.is_finite();
        *x *= inv;
    }
    found
}

/// Grad-scaler unscale of `n` elements: `g *= inv`; `found_inf[0] = 1` if any element was inf
/// or NaN before scaling (left alone otherwise).
#[derive(Debug, Clone, Copy)]
pub struct Unscale<'a> {
    /// Elements.
    pub n: usize,
    /// `1 / scale`.
    pub inv: f32,
    /// Gradient (updated).
    pub g: &'a Operand,
    /// One-element flag.
    pub found_inf: &'a Operand,
}

impl Op for Unscale<'_> {
    fn name(&self) -> &'static str {
        "unscale"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (n, g, flag) = (self.n, self.g, self.found_inf);
        let t = [f32_arg("g", g, n), f32_arg("found_inf", flag, 1)];
        check_optim(c, self.name(), n, &t, &[g, flag])
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (op, inv) = (self.name(), self.inv);
        launch_f32(
            s,
            op,
            [],
            [self.g, self.found_inf],
            true,
            move |[], [g, flag]| {
                if unscale(g, inv) {
                    flag[0] = 1.0;
                }
                Ok(())
            },
        );
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::err;
        b.kernels()
            .unscale(s, self.inv, &self.g.buf, &self.found_inf.buf)
            .map_err(err(self.name()))
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

    crate::kernels::cuda::kernel::declare_kernels! {
        OPT_UNSCALE = "opt_unscale" [U64, F32, Ptr, Ptr];
    }

    /// Grad-scaler unscale of `n` elements.
    pub(crate) fn plan_unscale(n: u64, inv: f32, g: Ptr, flag: Ptr) -> Plan {
        plan_map(
            OPT_UNSCALE,
            n,
            vec![PArg::U64(n), PArg::F32(inv), PArg::Ptr(g), PArg::Ptr(flag)],
        )
    }

    impl CudaKernels {
        /// Grad-scaler unscale: `g *= inv`, `found_inf[0] = 1` where an element was inf or NaN
        /// (CPU: [`optim::unscale`](crate::kernels::optim::unscale)).
        ///
        /// # Errors
        /// A flag of another size than one element, buffer/stream errors, overlap.
        pub fn unscale(
            &self,
            stream: &Stream,
            inv: f32,
            g: &BufferRef,
            found_inf: &BufferRef,
        ) -> Result<()> {
            let op = "unscale";
            let c = self.call(op, stream)?;
            let [dg, df] = c.f32_bufs([("g", g), ("found_inf", found_inf)])?;
            expect_len(op, "found_inf", df.len, 1, || "a one-element flag".into())?;
            c.disjoint(&[("g", g), ("found_inf", found_inf)], &[])?;
            let plan = plan_unscale(dg.len as u64, inv, dg.as_ptr(), df.as_ptr());
            // SAFETY: g holds n f32 and the flag one, disjoint; each g element has one thread, the
            // flag is only ever set to 1.0.
            unsafe { c.exec(&plan) }.map(drop)
        }
    }
}
