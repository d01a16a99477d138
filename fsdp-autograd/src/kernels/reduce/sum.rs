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
