//! The kernels' argument descriptors: [`Elem`] (the element type a buffer argument is read as)
//! and [`ViewDesc`] (a strided view, by value). A leaf file (re-exported by `context.rs` and
//! `layout.rs`) so that `plan.rs`, `context.rs` and `layout.rs` do not import each other.

use cudarc::driver::DeviceRepr;

use super::error::Result;
use crate::kernels::KernelError;

/// The element type a buffer argument is read or written as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Elem {
    /// Raw bytes (copies, fills).
    U8,
    /// `f32`.
    F32,
    /// `f64` (scratch only).
    F64,
    /// `f16` or `bf16` bits.
    U16,
    /// `u32` (scratch only).
    U32,
    /// `i64` ids and targets.
    I64,
    /// `u64` (status words, 8-byte copies).
    U64,
}

impl Elem {
    /// Size (and alignment) in bytes.
    pub(crate) fn size(self) -> usize {
        match self {
            Elem::U8 => 1,
            Elem::U16 => 2,
            Elem::F32 | Elem::U32 => 4,
            Elem::F64 | Elem::I64 | Elem::U64 => 8,
        }
    }
}

/// Largest view rank the CUDA kernels accept (`MAX_RANK` in `kernels.cu`).
pub const MAX_VIEW_RANK: usize = 8;

/// A strided view, passed to the kernels by value; mirrors `struct View` in `kernels.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ViewDesc {
    rank: u64,
    offset: u64,
    shape: [u64; MAX_VIEW_RANK],
    strides: [u64; MAX_VIEW_RANK],
}

// SAFETY: `ViewDesc` is `#[repr(C)]` plain old data whose fields (u64 rank, u64 offset, two
// u64[8] arrays, no padding) have exactly the types and order of `struct View` in kernels.cu, so
// its bytes are a valid `View` kernel parameter.
unsafe impl DeviceRepr for ViewDesc {}

#[cfg(test)]
impl ViewDesc {
    /// The descriptor as the 18 words of `struct View` (rank, offset, shape, strides).
    pub(crate) fn words(&self) -> Vec<u64> {
        let mut w = vec![self.rank, self.offset];
        w.extend_from_slice(&self.shape);
        w.extend_from_slice(&self.strides);
        w
    }
}

/// Validates the view `(offset, shape, strides)` into a buffer of `len` elements (the CPU
/// kernels' rules, plus the rank limit) and returns its descriptor and element count.
pub(crate) fn view_desc(
    op: &'static str,
    len: usize,
    offset: usize,
    shape: &[usize],
    strides: &[usize],
) -> Result<(ViewDesc, usize)> {
    let invalid = |reason: String| KernelError::InvalidShape { op, reason };
    if shape.len() != strides.len() {
        return Err(invalid(format!(
            "shape {shape:?} has {} dims but strides {strides:?} has {}; give one stride per dim",
            shape.len(),
            strides.len()
        ))
        .into());
    }
    if shape.len() > MAX_VIEW_RANK {
        return Err(invalid(format!(
            "the CUDA kernels support views of at most {MAX_VIEW_RANK} dims, got {}; merge \
             contiguous dims first",
            shape.len()
        ))
        .into());
    }
    let mut numel = 1usize;
    let mut last = offset;
    for (&n, &s) in shape.iter().zip(strides) {
        numel = numel.checked_mul(n).ok_or_else(|| {
            invalid(format!(
                "the element count of shape {shape:?} overflows usize"
            ))
        })?;
        if n > 0 {
            last = (n - 1)
                .checked_mul(s)
                .and_then(|v| v.checked_add(last))
                .ok_or_else(|| {
                    invalid(format!(
                        "the view's last offset overflows usize (shape {shape:?})"
                    ))
                })?;
        }
    }
    if numel > 0 && last >= len {
        return Err(invalid(format!(
            "the view (offset {offset}, shape {shape:?}, strides {strides:?}) reaches element \
             {last} of a buffer of {len}; keep views inside their storage"
        ))
        .into());
    }
    let mut desc = ViewDesc {
        rank: shape.len() as u64,
        offset: offset as u64,
        shape: [1; MAX_VIEW_RANK],
        strides: [0; MAX_VIEW_RANK],
    };
    for (i, (&n, &s)) in shape.iter().zip(strides).enumerate() {
        desc.shape[i] = n as u64;
        desc.strides[i] = s as u64;
    }
    Ok((desc, numel))
}
