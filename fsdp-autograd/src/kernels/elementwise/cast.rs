//! [`Cast`]: float conversion between the operands' dtypes (round to nearest even).

use fsdp_alloc::Stream;

use crate::error::Result;
use crate::kernels::op::{n_is, Check, Op, Spec};
use crate::kernels::operand::Operand;
use crate::launch::launch_f32;

/// Float conversion of `n` elements between the operands' dtypes (round to nearest even).
#[derive(Debug, Clone, Copy)]
pub struct Cast<'a> {
    /// Elements.
    pub n: usize,
    /// Input.
    pub x: &'a Operand,
    /// Output.
    pub out: &'a Operand,
}

impl Op for Cast<'_> {
    fn name(&self) -> &'static str {
        "cast"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let n = self.n;
        let table = [Spec::float("x", self.x, n), Spec::float("out", self.out, n)];
        c.args(self.name(), n_is(n), &table)?;
        Ok(n > 0)
    }

    /// Through f32: the half → f32 and f32 → half conversions are `kernels::cpu::cast_*`.
    fn cpu(&self, s: &Stream) -> Result<()> {
        launch_f32(s, "cast", [self.x], [self.out], false, |[x], [o]| {
            o.copy_from_slice(x);
            Ok(())
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::err;
        use fsdp_alloc::DType;
        let (k, x, out) = (b.kernels(), self.x, self.out);
        if x.dtype == out.dtype {
            return k.copy(s, &x.buf, &out.buf).map_err(err("cast"));
        }
        // One cast kernel from x into out where one side is f32 (what the path through a
        // temporary computes, without the temporary and its copy).
        let (xb, ob) = (&x.buf, &out.buf);
        let direct = match (x.dtype, out.dtype) {
            (DType::F16, DType::F32) => Some(k.cast_f16_to_f32(s, xb, ob)),
            (DType::BF16, DType::F32) => Some(k.cast_bf16_to_f32(s, xb, ob)),
            (DType::F32, DType::F16) => Some(k.cast_f32_to_f16(s, xb, ob)),
            (DType::F32, DType::BF16) => Some(k.cast_f32_to_bf16(s, xb, ob)),
            _ => None,
        };
        if let Some(r) = direct {
            return r.map_err(err("cast"));
        }
        // Through f32, as on the CPU: x → f32 (a temporary unless x is f32), then → out.
        let mut f = b.scope("cast", s);
        let xf = f.input(x)?;
        let o = f.output(out, false)?;
        // f32 bits to f32 bits; `finish` casts a temporary output into a half `out`.
        k.copy(s, &xf, &o).map_err(err("cast"))?;
        f.finish()
    }
}
