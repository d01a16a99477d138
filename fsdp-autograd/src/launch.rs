//! Launching kernels: what a kernel captures (memory handles, never tensors), typed access
//! inside stream work (half dtypes are computed in `f32`), and the layout kernels this layer
//! owns (strided copy).
//!
//! Errors *inside* stream work cannot be returned to the issuing thread (it has moved on); they
//! fail the stream, exactly like an asynchronous CUDA error, and surface from the next
//! synchronization (`to_vec`, `item`, `Stream::synchronize`) as an `AllocError::StreamFailed`
//! naming the kernel. Everything that can be checked at launch time (shapes, dtypes, released
//! storage) is checked there and returned as a typed error instead.

use std::ops::Deref;
use std::time::Instant;

use bytemuck::Pod;
use fsdp_alloc::{DType, ReadGuard, Stream, WriteGuard};
use half::{bf16, f16};

use crate::kernels::{cpu, KernelError};
use crate::profile;

/// Launches `work` on `stream`, timed under `op` when the profiler is on.
pub(crate) fn launch(stream: &Stream, op: &'static str, work: impl FnOnce() + Send + 'static) {
    if profile::is_enabled() {
        stream.launch_named(op, move || {
            let t = Instant::now();
            work();
            profile::record(op, t.elapsed());
        });
    } else {
        stream.launch_named(op, work);
    }
}

/// Launches `f` on `stream` (named `op`) over the float operands `ins`, read as `f32`, and
/// `outs`, written as `f32` (half dtypes through temporaries, holding the current values if
/// `load`). An error of `f` fails the stream.
pub(crate) fn launch_f32<const I: usize, const O: usize>(
    stream: &Stream,
    op: &'static str,
    ins: [&Arg; I],
    outs: [&Arg; O],
    load: bool,
    f: impl FnOnce([&[f32]; I], [&mut [f32]; O]) -> Result<(), KernelError> + Send + 'static,
) {
    let (ins, outs) = (ins.map(Arg::clone), outs.map(Arg::clone));
    launch(stream, op, move || {
        let reads = ins.each_ref().map(|a| a.read_f32(op));
        let mut writes = outs.each_ref().map(|a| a.write_f32(op, load));
        f(
            reads.each_ref().map(|r| &**r),
            writes.each_mut().map(F32Write::as_mut),
        )
        .unwrap_or_else(|e| fail(op, e));
        for w in writes {
            w.finish(op);
        }
    });
}

/// Fails the current stream work (the stream reports `msg` at the next synchronization).
#[cold]
pub(crate) fn fail(op: &'static str, msg: impl std::fmt::Display) -> ! {
    panic!("kernel `{op}` failed: {msg}")
}

/// A kernel argument: a tensor's elements as a memory range, captured at launch time.
pub(crate) type Arg = crate::kernels::operand::Operand;

/// A float range read as `f32` inside stream work: the memory itself (`f32`), or a converted
/// copy of a half range (whose guard is already released).
pub(crate) enum F32Read<'a> {
    Direct(ReadGuard<'a, f32>),
    Converted(Vec<f32>),
}

impl Deref for F32Read<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            F32Read::Direct(g) => g,
            F32Read::Converted(v) => v,
        }
    }
}

/// A float range written as `f32` inside stream work: the memory itself (`f32`), or an `f32`
/// temporary that [`F32Write::finish`] rounds back into the half range.
pub(crate) enum F32Write<'a> {
    Direct(WriteGuard<'a, f32>),
    F16(WriteGuard<'a, f16>, Vec<f32>),
    Bf16(WriteGuard<'a, bf16>, Vec<f32>),
}

impl F32Write<'_> {
    /// The `f32` elements to write.
    pub(crate) fn as_mut(&mut self) -> &mut [f32] {
        match self {
            F32Write::Direct(g) => g,
            F32Write::F16(_, v) | F32Write::Bf16(_, v) => v,
        }
    }

    /// Rounds a temporary back into its half range (nothing for `f32`).
    pub(crate) fn finish(self, op: &'static str) {
        match self {
            F32Write::Direct(_) => {}
            F32Write::F16(mut g, v) => {
                cpu::cast_f32_to_f16(&v, &mut g).unwrap_or_else(|e| fail(op, e))
            }
            F32Write::Bf16(mut g, v) => {
                cpu::cast_f32_to_bf16(&v, &mut g).unwrap_or_else(|e| fail(op, e))
            }
        }
    }
}

/// Typed host access inside CPU stream work.
impl Arg {
    /// The range as `f32` (half dtypes converted into a temporary).
    pub(crate) fn read_f32(&self, op: &'static str) -> F32Read<'_> {
        match self.dtype {
            DType::F32 => F32Read::Direct(self.buf.read::<f32>().unwrap_or_else(|e| fail(op, e))),
            DType::F16 => {
                let g = self.buf.read::<f16>().unwrap_or_else(|e| fail(op, e));
                let mut v = vec![0.0f32; g.len()];
                cpu::cast_f16_to_f32(&g, &mut v).unwrap_or_else(|e| fail(op, e));
                F32Read::Converted(v)
            }
            DType::BF16 => {
                let g = self.buf.read::<bf16>().unwrap_or_else(|e| fail(op, e));
                let mut v = vec![0.0f32; g.len()];
                cpu::cast_bf16_to_f32(&g, &mut v).unwrap_or_else(|e| fail(op, e));
                F32Read::Converted(v)
            }
            d => fail(op, format!("dtype {d} is not a float type")),
        }
    }

    /// The range for writing as `f32`. For half dtypes the temporary holds the current values
    /// if `load` (for accumulating kernels).
    pub(crate) fn write_f32(&self, op: &'static str, load: bool) -> F32Write<'_> {
        match self.dtype {
            DType::F32 => F32Write::Direct(self.buf.write::<f32>().unwrap_or_else(|e| fail(op, e))),
            DType::F16 => {
                let g = self.buf.write::<f16>().unwrap_or_else(|e| fail(op, e));
                let mut v = vec![0.0f32; g.len()];
                if load {
                    cpu::cast_f16_to_f32(&g, &mut v).unwrap_or_else(|e| fail(op, e));
                }
                F32Write::F16(g, v)
            }
            DType::BF16 => {
                let g = self.buf.write::<bf16>().unwrap_or_else(|e| fail(op, e));
                let mut v = vec![0.0f32; g.len()];
                if load {
                    cpu::cast_bf16_to_f32(&g, &mut v).unwrap_or_else(|e| fail(op, e));
                }
                F32Write::Bf16(g, v)
            }
            d => fail(op, format!("dtype {d} is not a float type")),
        }
    }

    /// Reads the range as `f32` (converted from half dtypes into a temporary).
    pub(crate) fn f32<R>(&self, op: &'static str, f: impl FnOnce(&[f32]) -> R) -> R {
        f(&self.read_f32(op))
    }

    /// Writes the range as `f32`. For half dtypes `f` works on an `f32` temporary that holds the
    /// current values if `load` (for accumulating kernels) and is converted back afterwards.
    pub(crate) fn f32_mut<R>(
        &self,
        op: &'static str,
        load: bool,
        f: impl FnOnce(&mut [f32]) -> R,
    ) -> R {
        let mut w = self.write_f32(op, load);
        let r = f(w.as_mut());
        w.finish(op);
        r
    }

    /// Reads the range as `T` (the caller checked the dtype at launch time).
    pub(crate) fn typed<T: Pod, R>(&self, op: &'static str, f: impl FnOnce(&[T]) -> R) -> R {
        let g = self.buf.read::<T>().unwrap_or_else(|e| fail(op, e));
        f(&g)
    }

    /// Writes the range as `T` (the caller checked the dtype at launch time).
    pub(crate) fn typed_mut<T: Pod, R>(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut [T]) -> R,
    ) -> R {
        let mut g = self.buf.write::<T>().unwrap_or_else(|e| fail(op, e));
        f(&mut g)
    }
}

/// Copies every element of an index space `shape`: `dst[dst_off + Σ i·dst_strides] =
/// src[src_off + Σ i·src_strides]`, innermost dimension as a slice copy when both strides are 1.
///
/// The tensor layer's own layout copy (strided source *and* destination, any element type, bit
/// exact): used for `contiguous`, readback, in-place `copy_` and the scatter of view gradients in
/// the `split`/`narrow` backward. `kernels::cpu::strided_copy` covers only contiguous
/// destinations of one type.
pub(crate) fn strided_copy<T: Copy>(
    src: &[T],
    src_off: usize,
    src_strides: &[usize],
    dst: &mut [T],
    dst_off: usize,
    dst_strides: &[usize],
    shape: &[usize],
) {
    if shape.contains(&0) {
        return;
    }
    let nd = shape.len();
    if nd == 0 {
        dst[dst_off] = src[src_off];
        return;
    }
    let n = shape[nd - 1];
    let (ss, ds) = (src_strides[nd - 1], dst_strides[nd - 1]);
    let mut idx = vec![0usize; nd - 1];
    let (mut so, mut d_o) = (src_off, dst_off);
    loop {
        if ss == 1 && ds == 1 {
            dst[d_o..d_o + n].copy_from_slice(&src[so..so + n]);
        } else {
            for j in 0..n {
                dst[d_o + j * ds] = src[so + j * ss];
            }
        }
        // Advance the outer index (odometer), updating both offsets incrementally.
        let mut d = nd - 1;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            so += src_strides[d];
            d_o += dst_strides[d];
            if idx[d] < shape[d] {
                break;
            }
            so -= src_strides[d] * shape[d];
            d_o -= dst_strides[d] * shape[d];
            idx[d] = 0;
        }
    }
}

/// Element-type dispatch of [`strided_copy`] on raw bytes of the same dtype.
#[allow(clippy::too_many_arguments)]
pub(crate) fn strided_copy_arg(
    op: &'static str,
    src: &Arg,
    src_off: usize,
    src_strides: &[usize],
    dst: &Arg,
    dst_off: usize,
    dst_strides: &[usize],
    shape: &[usize],
) {
    macro_rules! go {
        ($t:ty) => {
            src.typed::<$t, _>(op, |s| {
                dst.typed_mut::<$t, _>(op, |d| {
                    strided_copy(s, src_off, src_strides, d, dst_off, dst_strides, shape)
                })
            })
        };
    }
    match src.dtype.size() {
        1 => go!(u8),
        2 => go!(u16),
        4 => go!(u32),
        8 => go!(u64),
        _ => fail(op, "unsupported element size"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::operand::contiguous_strides;

    #[test]
    fn strided_copy_transposes_and_permutes() {
        // 2x3 row-major -> its transpose 3x2.
        let src: Vec<u32> = (0..6).collect();
        let mut dst = vec![0u32; 6];
        strided_copy(&src, 0, &[1, 3], &mut dst, 0, &[2, 1], &[3, 2]);
        assert_eq!(dst, vec![0, 3, 1, 4, 2, 5]);
        // 3-D permutation (2,0,1) of a 2x3x4 tensor against a naive reference.
        let src: Vec<u32> = (0..24).collect();
        let shape = [4, 2, 3]; // out[i,j,k] = in[j,k,i]
        let mut dst = vec![0u32; 24];
        strided_copy(
            &src,
            0,
            &[1, 12, 4],
            &mut dst,
            0,
            &contiguous_strides(&shape),
            &shape,
        );
        for i in 0..4 {
            for j in 0..2 {
                for k in 0..3 {
                    assert_eq!(dst[i * 6 + j * 3 + k], src[j * 12 + k * 4 + i]);
                }
            }
        }
        // Offsets and a scalar.
        let mut d = vec![9u32; 3];
        strided_copy(&src, 5, &[], &mut d, 1, &[], &[]);
        assert_eq!(d, vec![9, 5, 9]);
    }
}
