//! Argument checks shared by the CPU kernels. Error values are only built on the failure path, so
//! the checks cost a comparison each on the hot path.

use crate::kernels::KernelError;

/// `Ok(())` if `actual == expected`, else a [`KernelError::LengthMismatch`] whose shape text is
/// produced by `shape` (called only on failure).
#[inline]
pub(crate) fn len(
    op: &'static str,
    arg: &'static str,
    actual: usize,
    expected: usize,
    shape: impl FnOnce() -> String,
) -> Result<(), KernelError> {
    if actual == expected {
        Ok(())
    } else {
        Err(KernelError::LengthMismatch {
            op,
            arg,
            expected,
            actual,
            shape: shape(),
        })
    }
}

/// `a * b`, or [`KernelError::InvalidShape`] on overflow.
#[inline]
pub(crate) fn mul(op: &'static str, a: usize, b: usize) -> Result<usize, KernelError> {
    a.checked_mul(b).ok_or_else(|| KernelError::InvalidShape {
        op,
        reason: format!("the size product {a} * {b} overflows usize"),
    })
}

/// Number of rows of a row-major matrix stored in `len` elements with `cols` columns.
///
/// Rejects `cols == 0` (the row count would be undefined) and lengths that are not a whole number
/// of rows.
#[inline]
pub(crate) fn rows(
    op: &'static str,
    arg: &'static str,
    len: usize,
    cols: usize,
) -> Result<usize, KernelError> {
    if cols == 0 {
        return Err(KernelError::InvalidShape {
            op,
            reason: format!(
                "cols must be positive (got 0 for `{arg}` of {len} elements); skip empty tensors \
                 before calling the kernel"
            ),
        });
    }
    if len % cols != 0 {
        return Err(KernelError::InvalidShape {
            op,
            reason: format!(
                "`{arg}` has {len} elements, which is not a whole number of rows of {cols} columns"
            ),
        });
    }
    Ok(len / cols)
}

/// Two slices that must have the same length (elementwise kernels).
#[inline]
pub(crate) fn same_len(
    op: &'static str,
    arg: &'static str,
    actual: usize,
    reference_arg: &'static str,
    expected: usize,
) -> Result<(), KernelError> {
    len(op, arg, actual, expected, || {
        format!("len({reference_arg})={expected}")
    })
}

/// `value` as an `isize` stride, or [`KernelError::InvalidShape`].
#[inline]
pub(crate) fn stride(op: &'static str, value: usize) -> Result<isize, KernelError> {
    isize::try_from(value).map_err(|_| KernelError::InvalidShape {
        op,
        reason: format!("the stride {value} does not fit in isize"),
    })
}
