//! Conversions between f32 and the 16-bit float formats.

use fsdp_alloc::{BufferRef, Stream};

use super::context::{expect_len, CudaKernels, Elem};
use super::elementwise::plan_map;
use super::error::Result;
use super::plan::{PArg, Plan, Ptr};
use super::program::Kernel;

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

const F32_TO_F16: Cast = Cast("cast_f32_to_f16", Kernel::CastF32F16, Elem::F32, Elem::U16);
const F16_TO_F32: Cast = Cast("cast_f16_to_f32", Kernel::CastF16F32, Elem::U16, Elem::F32);
const F32_TO_BF16: Cast = Cast(
    "cast_f32_to_bf16",
    Kernel::CastF32Bf16,
    Elem::F32,
    Elem::U16,
);
const BF16_TO_F32: Cast = Cast(
    "cast_bf16_to_f32",
    Kernel::CastBf16F32,
    Elem::U16,
    Elem::F32,
);

impl CudaKernels {
    fn cast(&self, cast: Cast, stream: &Stream, src: &BufferRef, dst: &BufferRef) -> Result<()> {
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
    pub fn cast_f32_to_f16(&self, stream: &Stream, src: &BufferRef, dst: &BufferRef) -> Result<()> {
        self.cast(F32_TO_F16, stream, src, dst)
    }

    /// `dst[i] = f32(src[i])`, exact (CPU: [`cpu::cast_f16_to_f32`](crate::kernels::cpu::cast_f16_to_f32)).
    ///
    /// # Errors
    /// As [`CudaKernels::cast_f32_to_f16`].
    pub fn cast_f16_to_f32(&self, stream: &Stream, src: &BufferRef, dst: &BufferRef) -> Result<()> {
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
