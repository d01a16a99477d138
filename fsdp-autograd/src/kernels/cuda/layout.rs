//! Strided gather/scatter for views (`contiguous()` and the gradient of a view).

use fsdp_alloc::{BufferRef, DType, Stream};

use super::context::{expect_len, CudaKernels, Elem};
pub(crate) use super::desc::{view_desc, ViewDesc};
use super::elementwise::plan_map;
use super::error::Result;
use super::plan::{PArg, Plan, Ptr};
use super::program::Kernel;
use crate::kernels::KernelError;

/// True if distinct indices of the view address distinct elements, by a sufficient condition:
/// sorted by stride, each dim of extent > 1 steps over everything the smaller dims reach.
pub(crate) fn is_injective(shape: &[usize], strides: &[usize]) -> bool {
    let mut dims: Vec<(usize, usize)> = shape
        .iter()
        .zip(strides)
        .filter(|&(&n, _)| n > 1)
        .map(|(&n, &s)| (s, n))
        .collect();
    dims.sort_unstable();
    let mut reach = 0usize; // largest offset the dims so far reach (relative)
    for (s, n) in dims {
        if s <= reach {
            return false;
        }
        match (n - 1).checked_mul(s).and_then(|v| v.checked_add(reach)) {
            Some(r) => reach = r,
            None => return false,
        }
    }
    true
}

/// A strided gather (`StridedCopyB*`) or scatter-add (`StridedAddF32`) over the view's `n`
/// elements; `first` is the strided buffer for the scatter and the source for the gather.
pub(crate) fn plan_strided(
    kernel: Kernel,
    n: u64,
    view: ViewDesc,
    first: Ptr,
    second: Ptr,
) -> Plan {
    plan_map(
        kernel,
        n,
        vec![
            PArg::U64(n),
            PArg::View(view),
            PArg::Ptr(first),
            PArg::Ptr(second),
        ],
    )
}

impl CudaKernels {
    /// Gathers the strided view `(offset, shape, strides)` (in elements) of `src` into the
    /// contiguous row-major `dst` (CPU: [`cpu::strided_copy`](crate::kernels::cpu::strided_copy)).
    /// Works for 2-, 4- and 8-byte element types (`f16`/`bf16`, `f32`/`i32`, `i64`), given by
    /// `dtype`; views of up to [`MAX_VIEW_RANK`](super::MAX_VIEW_RANK) dims; strides may be 0 (broadcast).
    ///
    /// # Errors
    /// The CPU kernel's view errors, a rank above [`MAX_VIEW_RANK`](super::MAX_VIEW_RANK), a 1-byte `dtype`
    /// ([`KernelError::InvalidShape`]); buffer/stream errors; `dst` overlapping `src`.
    #[allow(clippy::too_many_arguments)]
    pub fn strided_copy(
        &self,
        stream: &Stream,
        src: &BufferRef,
        offset: usize,
        shape: &[usize],
        strides: &[usize],
        dst: &BufferRef,
        dtype: DType,
    ) -> Result<()> {
        let op = "strided_copy";
        let (elem, kernel) = match dtype.size() {
            2 => (Elem::U16, Kernel::StridedCopyB2),
            4 => (Elem::F32, Kernel::StridedCopyB4),
            8 => (Elem::I64, Kernel::StridedCopyB8),
            _ => {
                return Err(KernelError::InvalidShape {
                    op,
                    reason: format!(
                        "the CUDA strided copy supports 2-, 4- and 8-byte elements, not {dtype}"
                    ),
                }
                .into())
            }
        };
        let c = self.call(op, stream)?;
        let (ds, dd) = (c.buf("src", src, elem)?, c.buf("dst", dst, elem)?);
        let (desc, numel) = view_desc(op, ds.len, offset, shape, strides)?;
        expect_len(op, "dst", dd.len, numel, || format!("shape={shape:?}"))?;
        c.disjoint(&[("dst", dst)], &[("src", src)])?;
        let plan = plan_strided(kernel, numel as u64, desc, ds.as_ptr(), dd.as_ptr());
        // SAFETY: every element the view addresses lies inside src (view_desc checked the last
        // offset against its length); dst holds numel elements of the same size; they do not
        // overlap.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// Scatter-adds the contiguous `src` into the strided view `(offset, shape, strides)` of the
    /// f32 buffer `dst`: `dst[view(i)] += src[i]` (CPU:
    /// [`cpu::strided_add_assign`](crate::kernels::cpu::strided_add_assign)); elements outside
    /// the view are untouched; bit-identical to the CPU.
    ///
    /// Limitation: the view must address each element at most once (checked conservatively:
    /// sorted by stride, each dim must step past everything the smaller dims reach). Overlapping
    /// views (zero strides, i.e. broadcasts) would need a deterministic reduction and are refused;
    /// reduce them with [`CudaKernels::col_sums`]/[`CudaKernels::sum`] instead.
    ///
    /// # Errors
    /// The CPU kernel's view errors, a rank above [`MAX_VIEW_RANK`](super::MAX_VIEW_RANK), an overlapping view
    /// ([`KernelError::InvalidShape`]); buffer/stream errors; `dst` overlapping `src`.
    pub fn strided_add_assign(
        &self,
        stream: &Stream,
        dst: &BufferRef,
        offset: usize,
        shape: &[usize],
        strides: &[usize],
        src: &BufferRef,
    ) -> Result<()> {
        let op = "strided_add_assign";
        let c = self.call(op, stream)?;
        let [dd, ds] = c.f32_bufs([("dst", dst), ("src", src)])?;
        let (desc, numel) = view_desc(op, dd.len, offset, shape, strides)?;
        expect_len(op, "src", ds.len, numel, || format!("shape={shape:?}"))?;
        if !is_injective(shape, strides) {
            return Err(KernelError::InvalidShape {
                op,
                reason: format!(
                    "the view (shape {shape:?}, strides {strides:?}) addresses some elements more \
                     than once; the CUDA kernel only scatters into non-overlapping views — reduce \
                     broadcast dims with col_sums/sum first"
                ),
            }
            .into());
        }
        c.disjoint(&[("dst", dst)], &[("src", src)])?;
        let plan = plan_strided(
            Kernel::StridedAddF32,
            numel as u64,
            desc,
            dd.as_ptr(),
            ds.as_ptr(),
        );
        // SAFETY: every element the view addresses lies inside dst and is addressed once
        // (checked above), so each is updated by exactly one thread; src holds numel f32; they
        // do not overlap.
        unsafe { c.exec(&plan) }.map(drop)
    }
}
