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

/// The CUDA side of the op (feature `cuda`): its kernels' declarations, launch plans and
/// [`CudaKernels`](crate::kernels::cuda::CudaKernels) methods.
#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use fsdp_alloc::{BufferRef, Stream};

    use crate::kernels::cuda::context::{expect_len, CudaKernels, Elem};
    use crate::kernels::cuda::error::Result;
    use crate::kernels::cuda::kernel::Kernel;
    use crate::kernels::cuda::plan::{plan_map, PArg, Plan, Ptr};

    crate::kernels::cuda::kernel::declare_kernels! {
        CAST_F32_F16 = "cast_f32_f16" [U64, Ptr, Ptr];
        CAST_F16_F32 = "cast_f16_f32" [U64, Ptr, Ptr];
        CAST_F32_BF16 = "cast_f32_bf16" [U64, Ptr, Ptr];
        CAST_BF16_F32 = "cast_bf16_f32" [U64, Ptr, Ptr];
    }

    /// A cast kernel over `n` elements.
    pub(crate) fn plan_cast(kernel: Kernel, n: u64, src: Ptr, dst: Ptr) -> Plan {
        plan_map(
            kernel,
            n,
            vec![PArg::U64(n), PArg::Ptr(src), PArg::Ptr(dst)],
        )
    }

    /// One conversion: its name (for errors), its kernel, and the source and destination element
    /// types.
    struct Cast(&'static str, Kernel, Elem, Elem);

    const F32_TO_F16: Cast = Cast("cast_f32_to_f16", CAST_F32_F16, Elem::F32, Elem::U16);

    const F16_TO_F32: Cast = Cast("cast_f16_to_f32", CAST_F16_F32, Elem::U16, Elem::F32);

    const F32_TO_BF16: Cast = Cast("cast_f32_to_bf16", CAST_F32_BF16, Elem::F32, Elem::U16);

    const BF16_TO_F32: Cast = Cast("cast_bf16_to_f32", CAST_BF16_F32, Elem::U16, Elem::F32);

    impl CudaKernels {
        fn cast(
            &self,
            cast: Cast,
            stream: &Stream,
            src: &BufferRef,
            dst: &BufferRef,
        ) -> Result<()> {
            let Cast(op, kernel, src_elem, dst_elem) = cast;
            let c = self.call(op, stream)?;
            let (ds, dd) = (c.buf("src", src, src_elem)?, c.buf("dst", dst, dst_elem)?);
            expect_len(op, "dst", dd.len, ds.len, || format!("len(src)={}", ds.len))?;
            c.disjoint(&[("dst", dst)], &[("src", src)])?;
            let plan = plan_cast(kernel, ds.len as u64, ds.as_ptr(), dd.as_ptr());
            // SAFETY: src and dst hold n elements of their types on this device and do not overlap.
            unsafe { c.exec(&plan) }.map(drop)
        }

        /// `dst[i] = f16(src[i])`, round to nearest even (PTX `cvt.rn.f16.f32`); overflow gives ±∞
        /// (CPU: [`cpu::cast_f32_to_f16`](crate::kernels::cpu::cast_f32_to_f16), bit-identical for
        /// non-NaN inputs). NaNs become the canonical f16 NaN rather than keeping their payload.
        ///
        /// # Errors
        /// Length mismatch (elements); buffer/stream errors; overlap.
        pub fn cast_f32_to_f16(
            &self,
            stream: &Stream,
            src: &BufferRef,
            dst: &BufferRef,
        ) -> Result<()> {
            self.cast(F32_TO_F16, stream, src, dst)
        }

        /// `dst[i] = f32(src[i])`, exact (CPU: [`cpu::cast_f16_to_f32`](crate::kernels::cpu::cast_f16_to_f32)).
        ///
        /// # Errors
        /// As [`CudaKernels::cast_f32_to_f16`].
        pub fn cast_f16_to_f32(
            &self,
            stream: &Stream,
            src: &BufferRef,
            dst: &BufferRef,
        ) -> Result<()> {
            self.cast(F16_TO_F32, stream, src, dst)
        }

        /// `dst[i] = bf16(src[i])` with the `half` crate's algorithm (round to nearest even, NaN kept
        /// quiet with its high payload bits), so bit-identical to
        /// [`cpu::cast_f32_to_bf16`](crate::kernels::cpu::cast_f32_to_bf16).
        ///
        /// # Errors
        /// As [`CudaKernels::cast_f32_to_f16`].
        pub fn cast_f32_to_bf16(
            &self,
            stream: &Stream,
            src: &BufferRef,
            dst: &BufferRef,
        ) -> Result<()> {
            self.cast(F32_TO_BF16, stream, src, dst)
        }

        /// `dst[i] = f32(src[i])`, exact (a 16-bit shift, quieting signaling NaNs as `half` does),
        /// so bit-identical to [`cpu::cast_bf16_to_f32`](crate::kernels::cpu::cast_bf16_to_f32).
        ///
        /// # Errors
        /// As [`CudaKernels::cast_f32_to_f16`].
        pub fn cast_bf16_to_f32(
            &self,
            stream: &Stream,
            src: &BufferRef,
            dst: &BufferRef,
        ) -> Result<()> {
            self.cast(BF16_TO_F32, stream, src, dst)
        }
    }
}
