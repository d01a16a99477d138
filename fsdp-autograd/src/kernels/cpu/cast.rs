//! Conversions between f32 and the 16-bit float formats, via `half`'s slice conversions (which
//! use the CPU's conversion instructions where available).

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::kernels::check;
use crate::kernels::KernelError;

/// `dst[i] = f16::from_f32(src[i])`: round to nearest, ties to even; values beyond f16's range
/// become ±∞, NaN stays NaN.
///
/// # Errors
/// [`KernelError::LengthMismatch`] unless `src` and `dst` have the same length.
///
/// ```
/// use half::f16;
/// let mut dst = [f16::ZERO; 2];
/// fsdp_autograd::kernels::cpu::cast_f32_to_f16(&[1.5, 1e6], &mut dst).unwrap();
/// assert_eq!(dst, [f16::from_f32(1.5), f16::INFINITY]);
/// ```
pub fn cast_f32_to_f16(src: &[f32], dst: &mut [f16]) -> Result<(), KernelError> {
    check::same_len("cast_f32_to_f16", "dst", dst.len(), "src", src.len())?;
    dst.convert_from_f32_slice(src);
    Ok(())
}

/// `dst[i] = src[i].to_f32()` (exact: every f16 is an f32).
///
/// # Errors
/// [`KernelError::LengthMismatch`] unless `src` and `dst` have the same length.
///
/// ```
/// use half::f16;
/// let mut dst = [0.0f32; 1];
/// fsdp_autograd::kernels::cpu::cast_f16_to_f32(&[f16::from_f32(0.25)], &mut dst).unwrap();
/// assert_eq!(dst, [0.25]);
/// ```
pub fn cast_f16_to_f32(src: &[f16], dst: &mut [f32]) -> Result<(), KernelError> {
    check::same_len("cast_f16_to_f32", "dst", dst.len(), "src", src.len())?;
    src.convert_to_f32_slice(dst);
    Ok(())
}

/// `dst[i] = bf16::from_f32(src[i])`: round to nearest, ties to even; NaN stays NaN.
///
/// # Errors
/// [`KernelError::LengthMismatch`] unless `src` and `dst` have the same length.
///
/// ```
/// use half::bf16;
/// let mut dst = [bf16::ZERO; 1];
/// fsdp_autograd::kernels::cpu::cast_f32_to_bf16(&[3.0e38], &mut dst).unwrap();
/// assert_eq!(dst, [bf16::from_f32(3.0e38)]);
/// ```
pub fn cast_f32_to_bf16(src: &[f32], dst: &mut [bf16]) -> Result<(), KernelError> {
    check::same_len("cast_f32_to_bf16", "dst", dst.len(), "src", src.len())?;
    dst.convert_from_f32_slice(src);
    Ok(())
}

/// `dst[i] = src[i].to_f32()` (exact: every bf16 is an f32).
///
/// # Errors
/// [`KernelError::LengthMismatch`] unless `src` and `dst` have the same length.
///
/// ```
/// use half::bf16;
/// let mut dst = [0.0f32; 1];
/// fsdp_autograd::kernels::cpu::cast_bf16_to_f32(&[bf16::from_f32(-2.0)], &mut dst).unwrap();
/// assert_eq!(dst, [-2.0]);
/// ```
pub fn cast_bf16_to_f32(src: &[bf16], dst: &mut [f32]) -> Result<(), KernelError> {
    check::same_len("cast_bf16_to_f32", "dst", dst.len(), "src", src.len())?;
    src.convert_to_f32_slice(dst);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::testutil::Rng;

    /// Round-to-nearest-even to a format with `mant` explicit mantissa bits, in f64, for normal
    /// values: the reference the conversions must agree with exactly.
    fn round_ref(x: f32, mant: i32) -> f64 {
        let x = x as f64;
        if x == 0.0 {
            return x;
        }
        let e = x.abs().log2().floor() as i32;
        let ulp = 2f64.powi(e - mant);
        let q = x / ulp;
        let r = q.round();
        let r = if (q - q.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
            r - q.signum()
        } else {
            r
        };
        r * ulp
    }

    #[test]
    fn f16_round_trip_matches_round_to_nearest_even() {
        let mut rng = Rng::new(60);
        // Normal f16 range: |x| in [2^-14, 65504].
        let mut src: Vec<f32> = (0..500)
            .map(|_| rng.f32() * 2f32.powi(rng.below(28) as i32 - 13))
            .filter(|v| v.abs() >= 2f32.powi(-14) && v.abs() <= 65504.0)
            .collect();
        src.extend_from_slice(&[1.0, -1.0, 65504.0, 2f32.powi(-14), 1.0 + 2f32.powi(-11)]);
        let mut h = vec![f16::ZERO; src.len()];
        cast_f32_to_f16(&src, &mut h).unwrap();
        let mut back = vec![0.0f32; src.len()];
        cast_f16_to_f32(&h, &mut back).unwrap();
        for (i, (&s, &b)) in src.iter().zip(&back).enumerate() {
            assert_eq!(b as f64, round_ref(s, 10), "element {i}: {s}");
            assert_eq!(h[i], f16::from_f32(s));
        }
        // 1 + 2⁻¹¹ is a tie between 1 and 1 + 2⁻¹⁰: to even, i.e. 1.
        assert_eq!(*back.last().unwrap(), 1.0);
        let mut h = [f16::ZERO; 3];
        cast_f32_to_f16(&[f32::NAN, 1e6, -1e6], &mut h).unwrap();
        assert!(h[0].is_nan());
        assert_eq!(h[1..], [f16::INFINITY, f16::NEG_INFINITY]);
    }

    #[test]
    fn bf16_round_trip_matches_round_to_nearest_even() {
        let mut rng = Rng::new(61);
        let mut src: Vec<f32> = (0..500)
            .map(|_| rng.f32() * 2f32.powi(rng.below(200) as i32 - 100))
            .filter(|v| *v != 0.0)
            .collect();
        src.push(1.0 + 2f32.powi(-8)); // tie → 1
        src.push(1.0 + 3.0 * 2f32.powi(-8)); // tie → 1 + 2⁻⁶
        let mut h = vec![bf16::ZERO; src.len()];
        cast_f32_to_bf16(&src, &mut h).unwrap();
        let mut back = vec![0.0f32; src.len()];
        cast_bf16_to_f32(&h, &mut back).unwrap();
        for (i, (&s, &b)) in src.iter().zip(&back).enumerate() {
            assert_eq!(b as f64, round_ref(s, 7), "element {i}: {s}");
        }
        let n = back.len();
        assert_eq!(back[n - 2..], [1.0, 1.0 + 2f32.powi(-6)]);
        let mut h = [bf16::ZERO; 1];
        cast_f32_to_bf16(&[f32::NAN], &mut h).unwrap();
        assert!(h[0].is_nan());
    }

    #[test]
    fn length_mismatches_are_errors() {
        assert!(cast_f32_to_f16(&[1.0; 3], &mut [f16::ZERO; 2]).is_err());
        assert!(cast_f16_to_f32(&[f16::ZERO; 2], &mut [0.0; 3]).is_err());
        assert!(cast_f32_to_bf16(&[1.0; 1], &mut []).is_err());
        let err = cast_bf16_to_f32(&[], &mut [0.0; 1]).unwrap_err();
        assert!(matches!(
            err,
            KernelError::LengthMismatch {
                op: "cast_bf16_to_f32",
                arg: "dst",
                expected: 0,
                actual: 1,
                ..
            }
        ));
    }
}
