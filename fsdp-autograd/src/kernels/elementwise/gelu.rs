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
