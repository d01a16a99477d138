//! What an op's arguments are made of: [`Operand`] (a tensor's elements as a range of device
//! memory plus their element type) and [`View`] (a strided index space over an operand), with
//! the row-major strides both are built from. A leaf of the kernel seam: everything else in
//! `kernels/` and the tensor layer import it, it imports nothing of the crate.

use fsdp_alloc::{BufferRef, DType};

/// A kernel operand: a tensor's elements (contiguous, row-major, or the span of a strided view
/// for the layout kernels) as a range of device memory, and their element type.
#[derive(Clone, Debug)]
pub struct Operand {
    /// The memory range.
    pub buf: BufferRef,
    /// The element type of the range.
    pub dtype: DType,
}

impl Operand {
    /// Number of elements in the range.
    pub fn numel(&self) -> usize {
        self.buf.len() / self.dtype.size()
    }
}

/// Row-major (contiguous) strides of `shape`.
pub(crate) fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![0; shape.len()];
    let mut acc = 1usize;
    for i in (0..shape.len()).rev() {
        s[i] = acc;
        acc *= shape[i];
    }
    s
}

/// A strided view: `shape` indexed with `strides` from element `offset` of an operand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct View {
    /// The index space.
    pub shape: Vec<usize>,
    /// Element strides per dimension (0 broadcasts).
    pub strides: Vec<usize>,
    /// Element offset of index 0.
    pub offset: usize,
}

impl View {
    /// The contiguous row-major view of `shape` at `offset`.
    pub fn contiguous(shape: &[usize], offset: usize) -> View {
        View {
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset,
        }
    }

    /// Number of elements in the index space.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// One past the largest element index the view touches (0 for an empty view), or `None` on
    /// overflow.
    pub(crate) fn end(&self) -> Option<usize> {
        if self.shape.contains(&0) {
            return Some(0);
        }
        self.shape
            .iter()
            .zip(&self.strides)
            .try_fold(self.offset.checked_add(1)?, |acc, (&n, &s)| {
                acc.checked_add((n - 1).checked_mul(s)?)
            })
    }

    /// True if the view is the contiguous row-major layout of its shape.
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1usize;
        for (&n, &s) in self.shape.iter().zip(&self.strides).rev() {
            if n != 1 && s != expected {
                return false;
            }
            expected *= n;
        }
        true
    }
}
