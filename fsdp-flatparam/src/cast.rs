//! Mixed-precision helpers: cast a shard (or any buffer) between `f32` and a 16-bit float.
//!
//! FSDP's mixed precision keeps the sharded parameter in full precision and casts it to a low
//! precision before the all-gather, and casts gradients back for the optimizer. These helpers do
//! those casts with `half`'s vectorised slice conversions (`HalfFloatSliceExt`), which use the
//! CPU's F16C instructions for `f16` when available.
//!
//! Rounding is round-to-nearest-even; values too large for the target become ±infinity, NaN stays
//! NaN. `f16 → f32` and `bf16 → f32` are exact, so `f32 → half → f32` returns exactly the values
//! that are representable in the half type.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::error::{LayoutError, Result};

mod sealed {
    /// The conversions, kept out of the public trait so that only `f16` and `bf16` implement it.
    pub trait Sealed: Sized {
        fn from_f32s(dst: &mut [Self], src: &[f32]);
        fn to_f32s(src: &[Self], dst: &mut [f32]);
    }
}

/// A 16-bit float type a shard can be cast to and from: [`half::f16`] or [`half::bf16`].
///
/// This trait is sealed.
pub trait HalfFloat: sealed::Sealed + bytemuck::Pod {
    /// The type's name, used in error messages (`"f16"` or `"bf16"`).
    const DTYPE: &'static str;
}

impl sealed::Sealed for f16 {
    fn from_f32s(dst: &mut [Self], src: &[f32]) {
        dst.convert_from_f32_slice(src);
    }
    fn to_f32s(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
}

impl HalfFloat for f16 {
    const DTYPE: &'static str = "f16";
}

impl sealed::Sealed for bf16 {
    fn from_f32s(dst: &mut [Self], src: &[f32]) {
        dst.convert_from_f32_slice(src);
    }
    fn to_f32s(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
}

impl HalfFloat for bf16 {
    const DTYPE: &'static str = "bf16";
}

/// Casts `src` (`f32`) into `dst` (`f16` or `bf16`), element by element.
///
/// ```
/// use fsdp_flatparam::cast_f32_to_half_into;
/// use half::bf16;
///
/// let shard = [1.0f32, -2.5, 3.0e38];
/// let mut low = [bf16::ZERO; 3];
/// cast_f32_to_half_into(&shard, &mut low)?;
/// assert_eq!(low[1], bf16::from_f32(-2.5));
/// # Ok::<(), fsdp_flatparam::LayoutError>(())
/// ```
///
/// # Errors
/// [`LayoutError::CastLenMismatch`] if the lengths differ (nothing is written).
pub fn cast_f32_to_half_into<H: HalfFloat>(src: &[f32], dst: &mut [H]) -> Result<()> {
    check_len(
        "cast_f32_to_half_into",
        "f32",
        H::DTYPE,
        src.len(),
        dst.len(),
    )?;
    H::from_f32s(dst, src);
    Ok(())
}

/// Casts `src` (`f16` or `bf16`) into `dst` (`f32`), exactly.
///
/// ```
/// use fsdp_flatparam::cast_half_to_f32_into;
/// use half::f16;
///
/// let low = [f16::from_f32(0.5), f16::from_f32(-3.0)];
/// let mut full = [0.0f32; 2];
/// cast_half_to_f32_into(&low, &mut full)?;
/// assert_eq!(full, [0.5, -3.0]);
/// # Ok::<(), fsdp_flatparam::LayoutError>(())
/// ```
///
/// # Errors
/// [`LayoutError::CastLenMismatch`] if the lengths differ (nothing is written).
pub fn cast_half_to_f32_into<H: HalfFloat>(src: &[H], dst: &mut [f32]) -> Result<()> {
    check_len(
        "cast_half_to_f32_into",
        H::DTYPE,
        "f32",
        src.len(),
        dst.len(),
    )?;
    H::to_f32s(src, dst);
    Ok(())
}

/// Allocating variant of [`cast_f32_to_half_into`]. Pick the target type with a turbofish or
/// an annotation.
///
/// ```
/// use fsdp_flatparam::cast_f32_to_half;
/// use half::f16;
///
/// let low: Vec<f16> = cast_f32_to_half(&[1.0, 65504.0, 1.0e6]);
/// assert_eq!(low[1], f16::MAX);
/// assert!(low[2].is_infinite()); // too large for f16
/// ```
pub fn cast_f32_to_half<H: HalfFloat>(src: &[f32]) -> Vec<H> {
    let mut dst = vec![H::zeroed(); src.len()];
    H::from_f32s(&mut dst, src);
    dst
}

/// Allocating variant of [`cast_half_to_f32_into`].
///
/// ```
/// use fsdp_flatparam::{cast_f32_to_half, cast_half_to_f32};
/// use half::bf16;
///
/// let low = cast_f32_to_half::<bf16>(&[1.0, 0.25]);
/// assert_eq!(cast_half_to_f32(&low), [1.0, 0.25]);
/// ```
pub fn cast_half_to_f32<H: HalfFloat>(src: &[H]) -> Vec<f32> {
    let mut dst = vec![0.0f32; src.len()];
    H::to_f32s(src, &mut dst);
    dst
}

fn check_len(
    op: &'static str,
    src_dtype: &'static str,
    dst_dtype: &'static str,
    src_len: usize,
    dst_len: usize,
) -> Result<()> {
    if src_len == dst_len {
        Ok(())
    } else {
        Err(LayoutError::CastLenMismatch {
            op,
            src_dtype,
            dst_dtype,
            src_len,
            dst_len,
        })
    }
}
