//! [`StridedCopy`]: the bit-exact copy between strided views (contiguous, transpose, broadcast
//! and the scatter of view gradients).

use fsdp_alloc::Stream;

use super::op::{invalid, Check, Op};
use super::operand::{Operand, View};
use crate::error::{AutogradError, Result};
use crate::launch::{launch, strided_copy_arg};

/// Bit-exact copy of the view `src_view` of `src` into the view `dst_view` of `dst` (same
/// shape and element size; the destination view must not overlap itself).
#[derive(Debug, Clone, Copy)]
pub struct StridedCopy<'a> {
    /// What is read.
    pub src_view: &'a View,
    /// The source memory.
    pub src: &'a Operand,
    /// Where it is written.
    pub dst_view: &'a View,
    /// The destination memory.
    pub dst: &'a Operand,
}

impl Op for StridedCopy<'_> {
    fn name(&self) -> &'static str {
        "copy"
    }

    /// Both operands here, equal element sizes, views of one shape that stay inside their
    /// operands.
    fn check(&self, c: &Check) -> Result<bool> {
        let op = self.name();
        let (src_view, src, dst_view, dst) = (self.src_view, self.src, self.dst_view, self.dst);
        c.on_device(op, "src", src)?;
        c.on_device(op, "dst", dst)?;
        if src.dtype.size() != dst.dtype.size() {
            return Err(AutogradError::DType {
                op,
                got: dst.dtype,
                expected: format!(
                    "an element type of {} bytes like the source ({})",
                    src.dtype.size(),
                    src.dtype
                ),
            });
        }
        if src_view.shape != dst_view.shape
            || src_view.strides.len() != src_view.shape.len()
            || dst_view.strides.len() != dst_view.shape.len()
        {
            let reason = format!("views differ in shape or rank: {src_view:?} → {dst_view:?}");
            return Err(invalid(op, reason));
        }
        for (arg, v, o) in [("src", src_view, src), ("dst", dst_view, dst)] {
            if v.end().is_none_or(|e| e > o.numel()) {
                let n = o.numel();
                return Err(invalid(
                    op,
                    format!("the view {v:?} of `{arg}` reaches past its {n} elements"),
                ));
            }
        }
        Ok(src_view.numel() > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (sa, da) = (self.src.clone(), self.dst.clone());
        let (sv, dv) = (self.src_view.clone(), self.dst_view.clone());
        launch(s, "copy", move || {
            strided_copy_arg(
                "copy",
                &sa,
                sv.offset,
                &sv.strides,
                &da,
                dv.offset,
                &dv.strides,
                &sv.shape,
            )
        });
        Ok(())
    }

    /// Into a contiguous destination view (the only kind with a kernel).
    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &super::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use super::cuda::launcher::{elems, err, unsupported};
        let (src_view, src, dst_view, dst) = (self.src_view, self.src, self.dst_view, self.dst);
        if !dst_view.is_contiguous() {
            return Err(unsupported(
                "copy",
                "a copy into a non-contiguous destination view (the backward of `split` or \
                 `narrow` along an inner dimension) has no CUDA kernel; split along the first \
                 dimension",
            ));
        }
        if src.dtype.size() == 1 {
            return Err(unsupported("copy", "strided copies of 1-byte elements"));
        }
        let d = elems(dst, dst_view.offset, dst_view.numel())?;
        let v = src_view;
        b.kernels()
            .strided_copy(s, &src.buf, v.offset, &v.shape, &v.strides, &d, src.dtype)
            .map_err(err("copy"))
    }
}

/// The family's part of the CUDA program: `layout.cu` and the op's kernel table.
#[cfg(feature = "cuda")]
pub(crate) const FAMILY: super::cuda::kernel::Family = super::cuda::kernel::Family {
    sources: &[include_str!("layout.cu")],
    kernels: &[gpu::KERNELS],
};

/// The CUDA side of the op (feature `cuda`): its kernels' declarations, launch plans and
/// [`CudaKernels`](crate::kernels::cuda::CudaKernels) methods.
#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use fsdp_alloc::{BufferRef, DType, Stream};

    use crate::kernels::cuda::context::{expect_len, CudaKernels, Elem};
    use crate::kernels::cuda::desc::{view_desc, ViewDesc};
    use crate::kernels::cuda::error::Result;
    use crate::kernels::cuda::kernel::Kernel;
    use crate::kernels::cuda::plan::{plan_map, PArg, Plan, Ptr};
    use crate::kernels::KernelError;

    crate::kernels::cuda::kernel::declare_kernels! {
        STRIDED_COPY_B2 = "strided_copy_b2" [U64, View, Ptr, Ptr];
        STRIDED_COPY_B4 = "strided_copy_b4" [U64, View, Ptr, Ptr];
        STRIDED_COPY_B8 = "strided_copy_b8" [U64, View, Ptr, Ptr];
        STRIDED_ADD_F32 = "strided_add_f32" [U64, View, Ptr, Ptr];
    }

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
        /// `dtype`; views of up to [`MAX_VIEW_RANK`](crate::kernels::cuda::MAX_VIEW_RANK) dims; strides may be 0 (broadcast).
        ///
        /// # Errors
        /// The CPU kernel's view errors, a rank above [`MAX_VIEW_RANK`](crate::kernels::cuda::MAX_VIEW_RANK), a 1-byte `dtype`
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
                2 => (Elem::U16, STRIDED_COPY_B2),
                4 => (Elem::F32, STRIDED_COPY_B4),
                8 => (Elem::I64, STRIDED_COPY_B8),
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
        /// The CPU kernel's view errors, a rank above [`MAX_VIEW_RANK`](crate::kernels::cuda::MAX_VIEW_RANK), an overlapping view
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
                STRIDED_ADD_F32,
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
}
