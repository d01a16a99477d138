//! Row-major strides: a leaf file (`launch.rs` re-exports it) so that the kernel seam and
//! `launch.rs`, which imports the seam, do not import each other.

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
