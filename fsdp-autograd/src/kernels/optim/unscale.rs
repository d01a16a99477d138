//! The grad scaler's unscale: the host kernel ([`unscale`]) and the op ([`Unscale`]).

use fsdp_alloc::Stream;

use super::{check_optim, f32_arg};
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
