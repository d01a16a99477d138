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
