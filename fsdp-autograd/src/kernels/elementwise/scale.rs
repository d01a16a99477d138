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
