//! Strided gather/scatter between a strided view and a contiguous buffer: what `contiguous()`
//! of a transposed/narrowed/permuted view needs, and the gradient of such a view.

use crate::kernels::check;
use crate::kernels::KernelError;

/// Validates a strided view `(offset, shape, strides)` into a buffer of `len` elements and
/// returns the number of elements it covers.
fn view_numel(
    op: &'static str,
    len: usize,
    offset: usize,
    shape: &[usize],
    strides: &[usize],
) -> Result<usize, KernelError> {
    if shape.len() != strides.len() {
        return Err(KernelError::InvalidShape {
            op,
            reason: format!(
                "shape {shape:?} has {} dims but strides {strides:?} has {}; give one stride \
                 per dim",
                shape.len(),
                strides.len()
            ),
        });
    }
    let mut numel = 1usize;
    let mut last = offset;
    for (&n, &s) in shape.iter().zip(strides) {
        numel = check::mul(op, numel, n)?;
        if n > 0 {
            last = check::mul(op, n - 1, s)?.checked_add(last).ok_or_else(|| {
                KernelError::InvalidShape {
                    op,
                    reason: format!("the view's last offset overflows usize (shape {shape:?})"),
                }
            })?;
        }
    }
    if numel > 0 && last >= len {
        return Err(KernelError::InvalidShape {
            op,
            reason: format!(
                "the view (offset {offset}, shape {shape:?}, strides {strides:?}) reaches \
                 element {last} of a buffer of {len}; keep views inside their storage"
            ),
        });
    }
    Ok(numel)
}

/// Calls `f(base, inner)` for every innermost row of the view in row-major order, where `base`
/// is the buffer offset of the row's first element and `inner` its index in the contiguous
/// layout. The innermost dim has `shape[last]` elements at stride `strides[last]`.
fn for_each_row(
    offset: usize,
    shape: &[usize],
    strides: &[usize],
    mut f: impl FnMut(usize, usize),
) {
    let nd = shape.len();
    if nd == 0 {
        f(offset, 0);
        return;
    }
    let row_len = shape[nd - 1];
    let outer = &shape[..nd - 1];
    let rows: usize = outer.iter().product();
    let mut idx = vec![0usize; outer.len()];
    let mut base = offset;
    for r in 0..rows {
        f(base, r * row_len);
        // Odometer increment of the outer index, updating `base` incrementally. Wrapping
        // arithmetic: a dim of size 1 may carry any stride (PyTorch allows that), and stepping
        // past it is undone modulo 2⁶⁴ before `base` is used again.
        for dim in (0..outer.len()).rev() {
            idx[dim] += 1;
            base = base.wrapping_add(strides[dim]);
            if idx[dim] < outer[dim] {
                break;
            }
            base = base.wrapping_sub(strides[dim].wrapping_mul(outer[dim]));
            idx[dim] = 0;
        }
    }
}

/// Gathers the strided view `(offset, shape, strides)` of `src` into the contiguous row-major
/// buffer `dst` (`dst` has `Π shape` elements): `dst[i₀, …, iₙ] = src[offset + Σ iₖ·strideₖ]`.
///
/// Works for any element type (f32, f16, bf16, i64, …). Strides are in elements and may be 0
/// (broadcast). A 0-dim view (`shape = []`) is one element. Rows with unit inner stride are
/// copied with `copy_from_slice`.
///
/// # Errors
/// [`KernelError::InvalidShape`] if `shape` and `strides` differ in length or the view reaches
/// past `src`; [`KernelError::LengthMismatch`] unless `dst` has `Π shape` elements.
///
/// ```
/// use fsdp_autograd::kernels::cpu::strided_copy;
/// // The transpose of a 2×3 row-major matrix: shape [3, 2], strides [1, 3].
/// let src = [1, 2, 3, 4, 5, 6];
/// let mut dst = [0; 6];
/// strided_copy(&src, 0, &[3, 2], &[1, 3], &mut dst).unwrap();
/// assert_eq!(dst, [1, 4, 2, 5, 3, 6]);
/// ```
pub fn strided_copy<T: Copy>(
    src: &[T],
    offset: usize,
    shape: &[usize],
    strides: &[usize],
    dst: &mut [T],
) -> Result<(), KernelError> {
    let op = "strided_copy";
    let numel = view_numel(op, src.len(), offset, shape, strides)?;
    check::len(op, "dst", dst.len(), numel, || format!("shape={shape:?}"))?;
    if numel == 0 {
        return Ok(());
    }
    let (row_len, inner) = match (shape.last(), strides.last()) {
        (Some(&n), Some(&s)) => (n, s),
        _ => (1, 1),
    };
    for_each_row(offset, shape, strides, |base, out| {
        let o = &mut dst[out..out + row_len];
        if inner == 1 {
            o.copy_from_slice(&src[base..base + row_len]);
        } else {
            for (j, v) in o.iter_mut().enumerate() {
                *v = src[base + j * inner];
            }
        }
    });
    Ok(())
}

/// Scatter-adds the contiguous row-major `src` (`Π shape` elements) into the strided view
/// `(offset, shape, strides)` of `dst`: `dst[offset + Σ iₖ·strideₖ] += src[i₀, …, iₙ]`.
///
/// The gradient of [`strided_copy`] (and of any view: narrow, transpose, permute, expand):
/// elements of `dst` outside the view are untouched. When the view overlaps itself (a zero
/// stride, i.e. a broadcast), the contributions are added in row-major order of `src`, so the
/// result is deterministic.
///
/// # Errors
/// As [`strided_copy`], with `src` in the role of `dst`.
///
/// ```
/// use fsdp_autograd::kernels::cpu::strided_add_assign;
/// // Gradient of broadcasting a length-2 row to 3 rows (stride 0 over rows): a column sum.
/// let mut dbias = [0.0f32; 2];
/// strided_add_assign(&mut dbias, 0, &[3, 2], &[0, 1], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
/// assert_eq!(dbias, [9.0, 12.0]);
/// ```
pub fn strided_add_assign(
    dst: &mut [f32],
    offset: usize,
    shape: &[usize],
    strides: &[usize],
    src: &[f32],
) -> Result<(), KernelError> {
    let op = "strided_add_assign";
    let numel = view_numel(op, dst.len(), offset, shape, strides)?;
    check::len(op, "src", src.len(), numel, || format!("shape={shape:?}"))?;
    if numel == 0 {
        return Ok(());
    }
    let (row_len, inner) = match (shape.last(), strides.last()) {
        (Some(&n), Some(&s)) => (n, s),
        _ => (1, 1),
    };
    for_each_row(offset, shape, strides, |base, at| {
        let s = &src[at..at + row_len];
        if inner == 1 {
            for (o, &v) in dst[base..base + row_len].iter_mut().zip(s) {
                *o += v;
            }
        } else {
            for (j, &v) in s.iter().enumerate() {
                dst[base + j * inner] += v;
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::testutil::Rng;

    /// Reference: the element offset of every index of the view, in row-major order.
    fn offsets(offset: usize, shape: &[usize], strides: &[usize]) -> Vec<usize> {
        let numel: usize = shape.iter().product();
        (0..numel)
            .map(|mut lin| {
                let mut o = offset;
                for d in (0..shape.len()).rev() {
                    o += (lin % shape[d]) * strides[d];
                    lin /= shape[d];
                }
                o
            })
            .collect()
    }

    #[test]
    fn copy_and_scatter_match_the_index_reference() {
        let mut rng = Rng::new(80);
        // (buffer len, offset, shape, strides): permutes, narrows, broadcasts, 0-dim, size 1.
        let cases: Vec<(usize, usize, Vec<usize>, Vec<usize>)> = vec![
            (24, 0, vec![2, 3, 4], vec![12, 4, 1]),
            (24, 0, vec![4, 3, 2], vec![1, 4, 12]),
            (24, 0, vec![3, 2, 4], vec![4, 12, 1]),
            (30, 7, vec![2, 2, 3], vec![10, 4, 1]),
            (10, 3, vec![], vec![]),
            (5, 0, vec![4, 5], vec![0, 1]),
            (5, 4, vec![1, 1, 1], vec![9, 9, 9]),
            (5, 2, vec![1, 3, 1], vec![usize::MAX, 1, usize::MAX]),
            (6, 0, vec![3, 0, 2], vec![2, 5, 1]),
            (64, 1, vec![2, 3, 2, 2], vec![32, 2, 8, 1]),
        ];
        for (len, offset, shape, strides) in cases {
            let src = rng.vec(len);
            let offs = offsets(offset, &shape, &strides);
            let mut dst = vec![f32::NAN; offs.len()];
            strided_copy(&src, offset, &shape, &strides, &mut dst).unwrap();
            let want: Vec<f32> = offs.iter().map(|&o| src[o]).collect();
            assert_eq!(dst, want, "copy shape {shape:?} strides {strides:?}");

            let g = rng.vec(offs.len());
            let base = rng.vec(len);
            let mut acc = base.clone();
            strided_add_assign(&mut acc, offset, &shape, &strides, &g).unwrap();
            let mut want = base.clone();
            for (i, &o) in offs.iter().enumerate() {
                want[o] += g[i];
            }
            assert_eq!(acc, want, "scatter shape {shape:?} strides {strides:?}");
        }
    }

    #[test]
    fn works_for_other_element_types() {
        let src: Vec<i64> = (0..6).collect();
        let mut dst = [0i64; 3];
        strided_copy(&src, 1, &[3], &[2], &mut dst).unwrap();
        assert_eq!(dst, [1, 3, 5]);
    }

    #[test]
    fn out_of_bounds_views_and_bad_lengths_are_errors() {
        let src = [0.0f32; 6];
        let mut dst = [0.0f32; 6];
        // Last element at 0 + 1·3 + 2·1 = 5: fits; one more offset does not.
        assert!(strided_copy(&src, 0, &[2, 3], &[3, 1], &mut dst).is_ok());
        let err = strided_copy(&src, 1, &[2, 3], &[3, 1], &mut dst).unwrap_err();
        assert!(matches!(err, KernelError::InvalidShape { .. }), "{err}");
        assert!(
            err.to_string()
                .contains("reaches element 6 of a buffer of 6"),
            "{err}"
        );
        assert!(strided_copy(&src, 0, &[2, 3], &[3], &mut dst).is_err());
        assert!(strided_copy(&src, 0, &[2, 3], &[3, 1], &mut dst[..5]).is_err());
        assert!(strided_copy(&src, 0, &[2, usize::MAX], &[1, 1], &mut dst).is_err());
        assert!(strided_copy(&src, usize::MAX, &[2], &[1], &mut dst[..2]).is_err());
        // Empty views never touch the buffer, whatever the offset.
        strided_copy(&src, 100, &[0, 3], &[3, 1], &mut []).unwrap();
        let mut acc = [0.0f32; 6];
        assert!(strided_add_assign(&mut acc, 0, &[2, 3], &[3, 1], &[1.0; 5]).is_err());
        assert!(strided_add_assign(&mut acc, 4, &[2], &[2], &[1.0; 2]).is_err());
        assert_eq!(acc, [0.0; 6]);
    }
}
