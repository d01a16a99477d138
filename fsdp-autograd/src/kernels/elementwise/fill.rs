//! [`Fill`] (every element one value) and [`Arange`] (`out[i] = i`).

use fsdp_alloc::{DType, Stream};
use half::{bf16, f16};

use crate::error::Result;
use crate::kernels::op::{n_is, Check, Op, Spec};
use crate::kernels::operand::Operand;
use crate::launch::{launch, Arg};

/// Fills `n` elements with `value` converted to the operand's dtype.
#[derive(Debug, Clone, Copy)]
pub struct Fill<'a> {
    /// Elements.
    pub n: usize,
    /// The value.
    pub value: f64,
    /// Output.
    pub out: &'a Operand,
}

impl Op for Fill<'_> {
    fn name(&self) -> &'static str {
        "fill"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let n = self.n;
        c.args(self.name(), n_is(n), &[Spec::any("out", self.out, n)])?;
        Ok(n > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (a, value) = (self.out.clone(), self.value);
        launch(s, "fill", move || fill_arg("fill", &a, value));
        Ok(())
    }

    /// Zeros by a memset, else one element converted on the host and broadcast by a stride-0
    /// copy.
    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::err;
        let (k, n, value, out) = (b.kernels(), self.n, self.value, self.out);
        if value == 0.0 && value.is_sign_positive() {
            return k.zero(s, &out.buf).map_err(err("fill"));
        }
        let one = host_scalar_bytes(out.dtype, value);
        if out.dtype.size() == 1 {
            let bytes = vec![one[0]; n];
            return k.upload_async(s, &bytes, &out.buf).map_err(err("fill"));
        }
        let tmp = k.device().alloc(one.len(), s)?;
        k.upload_async(s, &one, tmp.data()).map_err(err("fill"))?;
        k.strided_copy(s, tmp.data(), 0, &[n], &[0], &out.buf, out.dtype)
            .map_err(err("fill"))
    }
}

/// `value` converted to `dtype`, as the bytes of one element.
#[cfg(feature = "cuda")]
fn host_scalar_bytes(dtype: DType, value: f64) -> Vec<u8> {
    match dtype {
        DType::F32 => (value as f32).to_ne_bytes().to_vec(),
        DType::F16 => f16::from_f64(value).to_bits().to_ne_bytes().to_vec(),
        DType::BF16 => bf16::from_f64(value).to_bits().to_ne_bytes().to_vec(),
        DType::I64 => (value as i64).to_ne_bytes().to_vec(),
        DType::I32 => (value as i32).to_ne_bytes().to_vec(),
        DType::U8 => vec![value as u8],
    }
}

/// Fills a kernel argument with `value` converted to its dtype (inside CPU stream work).
fn fill_arg(op: &'static str, a: &Arg, value: f64) {
    match a.dtype {
        DType::F32 => a.typed_mut::<f32, _>(op, |d| d.fill(value as f32)),
        DType::F16 => a.typed_mut::<f16, _>(op, |d| d.fill(f16::from_f64(value))),
        DType::BF16 => a.typed_mut::<bf16, _>(op, |d| d.fill(bf16::from_f64(value))),
        DType::I64 => a.typed_mut::<i64, _>(op, |d| d.fill(value as i64)),
        DType::I32 => a.typed_mut::<i32, _>(op, |d| d.fill(value as i32)),
        DType::U8 => a.typed_mut::<u8, _>(op, |d| d.fill(value as u8)),
    }
}

/// `out[i] = i` (`i64`).
#[derive(Debug, Clone, Copy)]
pub struct Arange<'a> {
    /// Elements.
    pub n: usize,
    /// Output.
    pub out: &'a Operand,
}

impl Op for Arange<'_> {
    fn name(&self) -> &'static str {
        "arange"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let n = self.n;
        let table = [Spec::exact("out", self.out, DType::I64, "arange output", n)];
        c.args(self.name(), n_is(n), &table)?;
        Ok(n > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let a = self.out.clone();
        launch(s, "arange", move || {
            a.typed_mut::<i64, _>("arange", |d| {
                for (i, x) in d.iter_mut().enumerate() {
                    *x = i as i64;
                }
            })
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::err;
        let host: Vec<i64> = (0..self.n as i64).collect();
        b.kernels()
            .upload_async(s, bytemuck::cast_slice(&host), &self.out.buf)
            .map_err(err("arange"))
    }
}
