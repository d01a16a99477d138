//! Elementwise kernels, reductions, row-bias broadcast and GELU.

use super::math::{exp, map1, map2, normal_cdf, normal_pdf, vectorized, Map1, Map2, SimdKernel};
use crate::kernels::check;
use crate::kernels::KernelError;

/// Number of interleaved accumulators in the fixed-order reductions below. Independent lanes let
/// the compiler vectorize the loop without reassociating anything, so results stay reproducible.
const LANES: usize = 8;

/// Combines the lanes in a fixed tree order, then adds the tail.
#[inline(always)]
fn combine(acc: [f64; LANES], tail: f64) -> f64 {
    (((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))) + tail
}

/// `Σ x` in f64, in a fixed order (8 interleaved lanes, then the tail).
#[inline(always)]
pub(crate) fn sum_f64(x: &[f32]) -> f64 {
    let mut acc = [0.0f64; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail: f64 = chunks.remainder().iter().map(|&v| v as f64).sum();
    for c in chunks {
        for l in 0..LANES {
            acc[l] += c[l] as f64;
        }
    }
    combine(acc, tail)
}

/// Maximum of `x` (`-∞` for an empty slice; NaNs are skipped, as by `f32::max`), in 8 lanes so
/// the loop vectorizes. The maximum is exact, so the lane order does not affect the result.
#[inline(always)]
pub(crate) fn max_f32(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks
        .remainder()
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    for c in chunks {
        for l in 0..LANES {
            acc[l] = acc[l].max(c[l]);
        }
    }
    acc.iter().copied().fold(tail, f32::max)
}

/// `Σ a·b` in f64 (products formed in f64), in the same fixed order as [`sum_f64`].
#[inline(always)]
pub(crate) fn dot_f64(a: &[f32], b: &[f32]) -> f64 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f64; LANES];
    let ca = a.chunks_exact(LANES);
    let cb = b.chunks_exact(LANES);
    let tail: f64 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(&x, &y)| x as f64 * y as f64)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] as f64 * y[l] as f64;
        }
    }
    combine(acc, tail)
}

/// `out = a + b`, elementwise.
///
/// # Errors
/// [`KernelError::LengthMismatch`] unless all three slices have the same length.
///
/// ```
/// let mut out = [0.0; 2];
/// fsdp_autograd::kernels::cpu::add(&[1.0, 2.0], &[0.5, -2.0], &mut out).unwrap();
/// assert_eq!(out, [1.5, 0.0]);
/// ```
pub fn add(a: &[f32], b: &[f32], out: &mut [f32]) -> Result<(), KernelError> {
    check::same_len("add", "b", b.len(), "a", a.len())?;
    check::same_len("add", "out", out.len(), "a", a.len())?;
    for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
        *o = x + y;
    }
    Ok(())
}

/// `out = a ⊙ b` (elementwise product).
///
/// # Errors
/// [`KernelError::LengthMismatch`] unless all three slices have the same length.
///
/// ```
/// let mut out = [0.0; 2];
/// fsdp_autograd::kernels::cpu::mul(&[1.0, 2.0], &[0.5, -2.0], &mut out).unwrap();
/// assert_eq!(out, [0.5, -4.0]);
/// ```
pub fn mul(a: &[f32], b: &[f32], out: &mut [f32]) -> Result<(), KernelError> {
    check::same_len("mul", "b", b.len(), "a", a.len())?;
    check::same_len("mul", "out", out.len(), "a", a.len())?;
    for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
        *o = x * y;
    }
    Ok(())
}

/// `out = alpha · x`.
///
/// # Errors
/// [`KernelError::LengthMismatch`] unless `x` and `out` have the same length.
///
/// ```
/// let mut out = [0.0; 2];
/// fsdp_autograd::kernels::cpu::scale(&[1.0, -3.0], 2.0, &mut out).unwrap();
/// assert_eq!(out, [2.0, -6.0]);
/// ```
pub fn scale(x: &[f32], alpha: f32, out: &mut [f32]) -> Result<(), KernelError> {
    check::same_len("scale", "out", out.len(), "x", x.len())?;
    for (o, &v) in out.iter_mut().zip(x) {
        *o = alpha * v;
    }
    Ok(())
}

/// `y ← alpha · y`, in place (cannot fail).
///
/// ```
/// let mut y = [1.0, -3.0];
/// fsdp_autograd::kernels::cpu::scale_inplace(&mut y, 0.5);
/// assert_eq!(y, [0.5, -1.5]);
/// ```
pub fn scale_inplace(y: &mut [f32], alpha: f32) {
    for v in y.iter_mut() {
        *v *= alpha;
    }
}

/// `y ← y + alpha · x` (axpy), in place. With `alpha == 1` this is exactly `y + x` (gradient
/// accumulation); no fused multiply-add is used, so results do not depend on the CPU.
///
/// # Errors
/// [`KernelError::LengthMismatch`] unless `x` and `y` have the same length.
///
/// ```
/// let mut y = [1.0, 1.0];
/// fsdp_autograd::kernels::cpu::add_scaled(&mut y, 2.0, &[0.5, -1.0]).unwrap();
/// assert_eq!(y, [2.0, -1.0]);
/// ```
pub fn add_scaled(y: &mut [f32], alpha: f32, x: &[f32]) -> Result<(), KernelError> {
    check::same_len("add_scaled", "x", x.len(), "y", y.len())?;
    for (o, &v) in y.iter_mut().zip(x) {
        *o += alpha * v;
    }
    Ok(())
}

/// `Σ x`, accumulated in f64 in a fixed order (8 interleaved lanes), returned as f32. The empty
/// sum is 0.
///
/// ```
/// assert_eq!(fsdp_autograd::kernels::cpu::sum(&[1.0, 2.0, 3.5]), 6.5);
/// ```
pub fn sum(x: &[f32]) -> f32 {
    sum_f64(x) as f32
}

/// Mean of `x` (f64 accumulation, see [`sum`]).
///
/// # Errors
/// [`KernelError::InvalidShape`] if `x` is empty (the mean is undefined).
///
/// ```
/// assert_eq!(fsdp_autograd::kernels::cpu::mean(&[1.0, 2.0]).unwrap(), 1.5);
/// ```
pub fn mean(x: &[f32]) -> Result<f32, KernelError> {
    if x.is_empty() {
        return Err(KernelError::InvalidShape {
            op: "mean",
            reason: "the mean of an empty slice is undefined".into(),
        });
    }
    Ok((sum_f64(x) / x.len() as f64) as f32)
}

/// `out[r, j] = x[r, j] + bias[j]` for a row-major `x` with `bias.len()` columns (a linear
/// layer's bias).
///
/// # Errors
/// [`KernelError::InvalidShape`] if `bias` is empty or `x` is not a whole number of rows;
/// [`KernelError::LengthMismatch`] if `out` and `x` differ in length.
///
/// ```
/// let mut out = [0.0; 4];
/// fsdp_autograd::kernels::cpu::add_row_bias(&[1.0, 2.0, 3.0, 4.0], &[10.0, 20.0], &mut out)
///     .unwrap();
/// assert_eq!(out, [11.0, 22.0, 13.0, 24.0]);
/// ```
pub fn add_row_bias(x: &[f32], bias: &[f32], out: &mut [f32]) -> Result<(), KernelError> {
    check::rows("add_row_bias", "x", x.len(), bias.len())?;
    check::same_len("add_row_bias", "out", out.len(), "x", x.len())?;
    for (orow, xrow) in out
        .chunks_exact_mut(bias.len())
        .zip(x.chunks_exact(bias.len()))
    {
        for ((o, &v), &b) in orow.iter_mut().zip(xrow).zip(bias) {
            *o = v + b;
        }
    }
    Ok(())
}

/// In-place [`add_row_bias`]: `y[r, j] += bias[j]` (e.g. right after a [`matmul`](super::matmul)
/// into `y`).
///
/// # Errors
/// [`KernelError::InvalidShape`] if `bias` is empty or `y` is not a whole number of rows.
///
/// ```
/// let mut y = [1.0, 2.0, 3.0, 4.0];
/// fsdp_autograd::kernels::cpu::add_row_bias_inplace(&mut y, &[10.0, 20.0]).unwrap();
/// assert_eq!(y, [11.0, 22.0, 13.0, 24.0]);
/// ```
pub fn add_row_bias_inplace(y: &mut [f32], bias: &[f32]) -> Result<(), KernelError> {
    check::rows("add_row_bias_inplace", "y", y.len(), bias.len())?;
    for row in y.chunks_exact_mut(bias.len()) {
        for (o, &b) in row.iter_mut().zip(bias) {
            *o += b;
        }
    }
    Ok(())
}

/// Column sums `out[j] = Σ_r x[r, j]` of a row-major `x` with `out.len()` columns (the bias
/// gradient of a linear layer). `out` is overwritten; rows are added in order 0, 1, … in f32.
///
/// # Errors
/// [`KernelError::InvalidShape`] if `out` is empty or `x` is not a whole number of rows.
///
/// ```
/// let mut out = [0.0; 2];
/// fsdp_autograd::kernels::cpu::col_sums(&[1.0, 2.0, 3.0, 4.0], &mut out).unwrap();
/// assert_eq!(out, [4.0, 6.0]);
/// ```
pub fn col_sums(x: &[f32], out: &mut [f32]) -> Result<(), KernelError> {
    check::rows("col_sums", "x", x.len(), out.len())?;
    struct Body<'a>(&'a [f32], &'a mut [f32]);
    impl SimdKernel for Body<'_> {
        type Output = ();
        #[inline(always)]
        fn run(self) {
            let Body(x, out) = self;
            out.fill(0.0);
            let cols = out.len();
            for row in x.chunks_exact(cols) {
                for (o, &v) in out.iter_mut().zip(row) {
                    *o += v;
                }
            }
        }
    }
    vectorized(Body(x, out));
    Ok(())
}

/// √(2/π), the GELU tanh-approximation constant.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// The cubic coefficient of the GELU tanh approximation.
const GELU_C: f32 = 0.044_715;

/// `u(x) = √(2/π)·(x + 0.044715·x³)`, the argument of tanh in the GELU approximation.
#[inline(always)]
fn gelu_arg(x: f32) -> f32 {
    SQRT_2_OVER_PI * (x + GELU_C * x * x * x)
}

/// `exp(−2u)`, with the argument capped at 88 so it stays finite (the capped value already makes
/// the sigmoid below 1e-38, so nothing observable changes).
#[inline(always)]
fn exp_neg_2u(u: f32) -> f32 {
    exp((-2.0 * u).min(88.0))
}

/// One element of [`gelu`].
struct GeluTanh;
impl Map1 for GeluTanh {
    #[inline(always)]
    fn one(v: f32) -> f32 {
        v / (1.0 + exp_neg_2u(gelu_arg(v)))
    }
}

/// One element of [`gelu_backward`]: `x`, then `dy`.
struct GeluTanhGrad;
impl Map2 for GeluTanhGrad {
    #[inline(always)]
    fn one(v: f32, g: f32) -> f32 {
        let e = exp_neg_2u(gelu_arg(v));
        let s = 1.0 / (1.0 + e);
        let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * v * v);
        g * (s + 2.0 * v * (e * s * s) * du)
    }
}

/// One element of [`gelu_exact`].
struct GeluExact;
impl Map1 for GeluExact {
    #[inline(always)]
    fn one(v: f32) -> f32 {
        v * normal_cdf(v)
    }
}

/// One element of [`gelu_exact_backward`]: `x`, then `dy`.
struct GeluExactGrad;
impl Map2 for GeluExactGrad {
    #[inline(always)]
    fn one(v: f32, g: f32) -> f32 {
        g * (normal_cdf(v) + v * normal_pdf(v))
    }
}

/// GELU, tanh approximation (GPT-2's, PyTorch's `approximate="tanh"`):
/// `y = ½·x·(1 + tanh(u))`, `u = √(2/π)·(x + 0.044715·x³)`.
///
/// Evaluated as the equal `x / (1 + exp(−2u))`, which has no cancellation for negative `x`, with
/// this module's vectorizable `exp` (≤ 2 ulp), so the loop runs on SIMD lanes.
///
/// # Errors
/// [`KernelError::LengthMismatch`] unless `x` and `y` have the same length.
///
/// ```
/// let mut y = [0.0; 3];
/// fsdp_autograd::kernels::cpu::gelu(&[0.0, 10.0, -10.0], &mut y).unwrap();
/// assert_eq!(y[0], 0.0);
/// assert!((y[1] - 10.0).abs() < 1e-6 && y[2].abs() < 1e-6);
/// ```
pub fn gelu(x: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
    check::same_len("gelu", "y", y.len(), "x", x.len())?;
    map1::<GeluTanh>(x, y);
    Ok(())
}

/// Gradient of [`gelu`]: with `s = 1/(1 + exp(−2u))` (so `½(1 + tanh u) = s`),
/// `dx = dy · (s + 2·x·s·(1 − s)·u′(x))`, `u′(x) = √(2/π)·(1 + 3·0.044715·x²)`, where
/// `s·(1 − s)` is formed as `exp(−2u)·s²` to avoid cancellation. `x` is the forward input.
///
/// # Errors
/// [`KernelError::LengthMismatch`] unless `x`, `dy` and `dx` have the same length.
///
/// ```
/// let mut dx = [0.0];
/// fsdp_autograd::kernels::cpu::gelu_backward(&[0.0], &[2.0], &mut dx).unwrap();
/// assert_eq!(dx, [1.0]); // GELU'(0) = ½
/// ```
pub fn gelu_backward(x: &[f32], dy: &[f32], dx: &mut [f32]) -> Result<(), KernelError> {
    check::same_len("gelu_backward", "dy", dy.len(), "x", x.len())?;
    check::same_len("gelu_backward", "dx", dx.len(), "x", x.len())?;
    map2::<GeluTanhGrad>(x, dy, dx);
    Ok(())
}

/// GELU, exact form (PyTorch's default `approximate="none"`): `y = x·Φ(x)` with `Φ` the
/// standard normal CDF (a vectorizable evaluation: relative error below 4e-6 for `|x| < 5`,
/// `Φ(0) = ½` exactly).
///
/// # Errors
/// [`KernelError::LengthMismatch`] unless `x` and `y` have the same length.
///
/// ```
/// let mut y = [0.0; 3];
/// fsdp_autograd::kernels::cpu::gelu_exact(&[0.0, 10.0, -10.0], &mut y).unwrap();
/// assert_eq!(y[0], 0.0);
/// assert!((y[1] - 10.0).abs() < 1e-6 && y[2].abs() < 1e-6);
/// ```
pub fn gelu_exact(x: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
    check::same_len("gelu_exact", "y", y.len(), "x", x.len())?;
    map1::<GeluExact>(x, y);
    Ok(())
}

/// Gradient of [`gelu_exact`]: `dx = dy·(Φ(x) + x·φ(x))`, `φ(x) = exp(−x²/2)/√(2π)`, where `x`
/// is the forward input.
///
/// # Errors
/// [`KernelError::LengthMismatch`] unless `x`, `dy` and `dx` have the same length.
///
/// ```
/// let mut dx = [0.0];
/// fsdp_autograd::kernels::cpu::gelu_exact_backward(&[0.0], &[2.0], &mut dx).unwrap();
/// assert_eq!(dx, [1.0]); // GELU'(0) = ½
/// ```
pub fn gelu_exact_backward(x: &[f32], dy: &[f32], dx: &mut [f32]) -> Result<(), KernelError> {
    check::same_len("gelu_exact_backward", "dy", dy.len(), "x", x.len())?;
    check::same_len("gelu_exact_backward", "dx", dx.len(), "x", x.len())?;
    map2::<GeluExactGrad>(x, dy, dx);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::testutil::{assert_close, bits, f64s, fd_grad, Rng};

    // Elementwise f32 ops are single correctly rounded operations, so they must equal the f64
    // result rounded once to f32 — exactly.
    #[test]
    fn add_mul_scale_axpy_are_correctly_rounded() {
        let mut rng = Rng::new(10);
        for len in [0, 1, 7, 8, 9, 100] {
            let a = rng.vec(len);
            let b = rng.vec(len);
            let mut out = vec![0.0; len];
            add(&a, &b, &mut out).unwrap();
            for i in 0..len {
                assert_eq!(out[i], (a[i] as f64 + b[i] as f64) as f32);
            }
            mul(&a, &b, &mut out).unwrap();
            for i in 0..len {
                assert_eq!(out[i], (a[i] as f64 * b[i] as f64) as f32);
            }
            scale(&a, -0.375, &mut out).unwrap();
            for i in 0..len {
                assert_eq!(out[i], (a[i] as f64 * -0.375) as f32);
            }
            let mut y = b.clone();
            scale_inplace(&mut y, 3.0);
            for i in 0..len {
                assert_eq!(y[i], (b[i] as f64 * 3.0) as f32);
            }
            // alpha = 1: exactly y + x.
            let mut y = b.clone();
            add_scaled(&mut y, 1.0, &a).unwrap();
            for i in 0..len {
                assert_eq!(y[i], (a[i] as f64 + b[i] as f64) as f32);
            }
            // General alpha: two roundings (product, then sum).
            let mut y = b.clone();
            add_scaled(&mut y, 0.3, &a).unwrap();
            for i in 0..len {
                let want = ((0.3f32 * a[i]) as f64 + b[i] as f64) as f32;
                assert_eq!(y[i], want);
            }
        }
    }

    #[test]
    fn elementwise_length_errors() {
        let mut out = [0.0; 3];
        assert!(matches!(
            add(&[1.0; 3], &[1.0; 2], &mut out),
            Err(KernelError::LengthMismatch {
                op: "add",
                arg: "b",
                expected: 3,
                actual: 2,
                ..
            })
        ));
        assert!(matches!(
            mul(&[1.0; 3], &[1.0; 3], &mut out[..1]),
            Err(KernelError::LengthMismatch { arg: "out", .. })
        ));
        assert!(scale(&[1.0; 2], 1.0, &mut out).is_err());
        assert!(add_scaled(&mut out, 1.0, &[1.0; 4]).is_err());
        assert!(gelu(&[1.0; 2], &mut out).is_err());
        assert!(gelu_backward(&[1.0; 3], &[1.0; 2], &mut out).is_err());
        assert!(matches!(
            add_row_bias(&[1.0; 5], &[1.0; 2], &mut [0.0; 5]),
            Err(KernelError::InvalidShape { .. })
        ));
        assert!(add_row_bias(&[1.0; 4], &[1.0; 2], &mut [0.0; 5]).is_err());
        assert!(add_row_bias_inplace(&mut [1.0; 4], &[]).is_err());
        assert!(col_sums(&[1.0; 4], &mut [0.0; 3]).is_err());
        assert!(col_sums(&[1.0; 4], &mut []).is_err());
        assert!(mean(&[]).is_err());
    }

    #[test]
    fn sums_match_f64_reference() {
        let mut rng = Rng::new(11);
        for len in [0, 1, 7, 8, 9, 1000, 100_003] {
            let x = rng.vec(len);
            let want: f64 = x.iter().map(|&v| v as f64).sum();
            // f64 accumulation of ≤ 1e5 terms: error ≪ f32 rounding of the result.
            assert_close("sum", &[sum(&x)], &[want], 1e-6, 1e-9);
            let y = rng.vec(len);
            let want: f64 = x.iter().zip(&y).map(|(&a, &b)| a as f64 * b as f64).sum();
            assert!((dot_f64(&x, &y) - want).abs() <= 1e-9 * (1.0 + want.abs()));
            let want_max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max_f32(&x), want_max);
            if len > 0 {
                let m = mean(&x).unwrap();
                assert_close("mean", &[m], &[want_mean(&x)], 1e-6, 1e-9);
            }
        }
        assert_eq!(sum(&[]), 0.0);
    }

    fn want_mean(x: &[f32]) -> f64 {
        x.iter().map(|&v| v as f64).sum::<f64>() / x.len() as f64
    }

    #[test]
    fn row_bias_and_col_sums_match_reference() {
        let mut rng = Rng::new(12);
        for (rows, cols) in [(1, 1), (1, 9), (9, 1), (5, 17)] {
            let x = rng.vec(rows * cols);
            let bias = rng.vec(cols);
            let mut out = vec![0.0; rows * cols];
            add_row_bias(&x, &bias, &mut out).unwrap();
            let mut inplace = x.clone();
            add_row_bias_inplace(&mut inplace, &bias).unwrap();
            assert_eq!(bits(&out), bits(&inplace));
            for r in 0..rows {
                for j in 0..cols {
                    let want = (x[r * cols + j] as f64 + bias[j] as f64) as f32;
                    assert_eq!(out[r * cols + j], want);
                }
            }
            let mut cs = vec![f32::NAN; cols];
            col_sums(&x, &mut cs).unwrap();
            let want: Vec<f64> = (0..cols)
                .map(|j| (0..rows).map(|r| x[r * cols + j] as f64).sum())
                .collect();
            // ≤ rows f32 additions of values in [-1, 1]: error ≤ rows²·u.
            assert_close("col_sums", &cs, &want, 0.0, (rows * rows) as f64 * 1.2e-7);
        }
    }

    fn gelu_ref(x: f64) -> f64 {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
    }

    /// erf in f64 by its Maclaurin series (|x| ≤ 3) or the continued fraction of erfc (|x| > 3),
    /// independent of the kernel's evaluation.
    fn erf_ref(x: f64) -> f64 {
        let a = x.abs();
        let r = if a <= 3.0 {
            let (mut term, mut sum, mut n) = (a, a, 0.0f64);
            while term.abs() > 1e-18 * sum.abs() {
                n += 1.0;
                term *= -a * a / n;
                sum += term / (2.0 * n + 1.0);
            }
            2.0 / std::f64::consts::PI.sqrt() * sum
        } else {
            // erfc(a) = exp(-a²)/√π · 1/(a + 1/2/(a + 1/(a + 3/2/(a + 2/(a + ...)))))
            let mut f = a;
            for k in (1..60).rev() {
                f = a + (k as f64 / 2.0) / f;
            }
            1.0 - (-a * a).exp() / std::f64::consts::PI.sqrt() / f
        };
        r.copysign(x)
    }

    fn gelu_exact_ref(x: f64) -> f64 {
        0.5 * x * (1.0 + erf_ref(x / std::f64::consts::SQRT_2))
    }

    #[test]
    fn gelu_exact_matches_f64_reference_and_finite_differences() {
        let mut rng = Rng::new(29);
        let mut x = rng.vec_scaled(300, 6.0);
        x.extend_from_slice(&[
            0.0, -0.0, 1e-30, -1e-30, 3.0, -3.0, 20.0, -20.0, 80.0, -80.0,
        ]);
        let mut y = vec![0.0; x.len()];
        gelu_exact(&x, &mut y).unwrap();
        let want: Vec<f64> = x.iter().map(|&v| gelu_exact_ref(v as f64)).collect();
        // Φ is within 4e-6 relative for |x| < 5 (below that gelu is under 1e-6); one product after it.
        assert_close("gelu_exact", &y, &want, 1e-5, 1e-6);
        assert!(y.iter().all(|v| v.is_finite()));
        // The exact form differs from the tanh approximation (by up to ~5e-4 near |x| = 2).
        let mut tanh = vec![0.0; x.len()];
        gelu(&x, &mut tanh).unwrap();
        assert!(y.iter().zip(&tanh).any(|(a, b)| (a - b).abs() > 1e-5));

        let dy = rng.vec(x.len());
        let mut dx = vec![0.0; x.len()];
        gelu_exact_backward(&x, &dy, &mut dx).unwrap();
        let xs = f64s(&x);
        let dys = f64s(&dy);
        let want: Vec<f64> = (0..x.len())
            .map(|i| dys[i] * fd_grad(|v| gelu_exact_ref(v[0]), &[xs[i]], 1e-6)[0])
            .collect();
        assert_close("gelu_exact_backward", &dx, &want, 1e-4, 1e-5);
        assert!(gelu_exact(&[1.0; 2], &mut [0.0; 3]).is_err());
        assert!(gelu_exact_backward(&[1.0; 3], &[1.0; 2], &mut [0.0; 3]).is_err());
    }

    /// Every instruction-set level of the element-wise maps and row kernels gives the same bits
    /// (the claim that lets them pick the lane width at run time without breaking determinism).
    /// Attention's products stay at the process's level, so only its row loops vary.
    #[test]
    fn simd_dispatch_paths_give_the_same_bits() {
        use crate::kernels::cpu::isa::forced;
        let levels = forced::available();
        let mut rng = Rng::new(77);
        let mut x = rng.vec_scaled(4099, 8.0);
        x.extend_from_slice(&[0.0, -0.0, 1e-30, 1.0 / 64.0, 20.0, -20.0, 80.0, -80.0]);
        let dy = rng.vec(x.len());
        let every = |name: &str, f: &dyn Fn() -> Vec<Vec<f32>>| {
            let base = forced::with_simd(levels[0], f);
            for &l in &levels[1..] {
                let got = forced::with_simd(l, f);
                for (i, (a, b)) in got.iter().zip(&base).enumerate() {
                    assert_eq!(bits(a), bits(b), "{name}: output {i} at {l}");
                }
            }
        };
        type Unary = fn(&[f32], &mut [f32]) -> Result<(), KernelError>;
        type Binary = fn(&[f32], &[f32], &mut [f32]) -> Result<(), KernelError>;
        let unary: [(&str, Unary); 2] = [("gelu", gelu), ("gelu_exact", gelu_exact)];
        let binary: [(&str, Binary); 5] = [
            ("gelu_backward", gelu_backward),
            ("gelu_exact_backward", gelu_exact_backward),
            ("add", add),
            ("mul", mul),
            ("scale", |a, _, o| scale(a, -0.37, o)),
        ];
        for (name, f) in unary {
            every(name, &|| {
                let mut y = vec![0.0; x.len()];
                f(&x, &mut y).unwrap();
                vec![y]
            });
        }
        for (name, f) in binary {
            every(name, &|| {
                let mut y = vec![0.0; x.len()];
                f(&x, &dy, &mut y).unwrap();
                vec![y]
            });
        }
        every("sums", &|| {
            let mut y = dy.clone();
            add_scaled(&mut y, 0.3, &x).unwrap();
            scale_inplace(&mut y, 1.7);
            let s = [sum(&x), mean(&x).unwrap(), max_f32(&x)];
            let d = [dot_f64(&x, &dy) as f32, (dot_f64(&x, &dy) * 1e-7) as f32];
            vec![y, s.to_vec(), d.to_vec()]
        });
        // The row kernels: col_sums, row bias, layer norm and attention, forward and backward.
        let cols = 37;
        let rows = x.len() / cols;
        let xs = &x[..rows * cols];
        let gamma = rng.vec(cols);
        let beta = rng.vec(cols);
        every("col_sums, row bias", &|| {
            let mut out = vec![0.0; cols];
            col_sums(xs, &mut out).unwrap();
            let mut biased = vec![0.0; xs.len()];
            add_row_bias(xs, &gamma, &mut biased).unwrap();
            add_row_bias_inplace(&mut biased, &beta).unwrap();
            vec![out, biased]
        });
        let dys = &dy[..rows * cols];
        every("layer norm", &|| {
            use crate::kernels::cpu::{layer_norm, layer_norm_backward};
            let (mut y, mut mean, mut rstd) =
                (vec![0.0; xs.len()], vec![0.0; rows], vec![0.0; rows]);
            layer_norm(xs, &gamma, &beta, &mut y, &mut mean, &mut rstd, cols, 1e-5).unwrap();
            let (mut dx, mut dg, mut db) = (vec![0.0; xs.len()], vec![0.0; cols], vec![0.0; cols]);
            layer_norm_backward(
                xs, &gamma, &mean, &rstd, dys, &mut dx, &mut dg, &mut db, cols,
            )
            .unwrap();
            vec![y, mean, rstd, dx, dg, db]
        });
        let (bh, t, d) = (3, 70, 8);
        let n = bh * t * d;
        let (q, k, v, dout) = (&x[..n], &x[n..2 * n], &dy[..n], &dy[n..2 * n]);
        every("attention", &|| {
            use crate::kernels::cpu::{causal_attention, causal_attention_backward};
            let (mut out, mut probs) = (vec![0.0; n], vec![0.0; bh * t * t]);
            causal_attention(q, k, v, &mut out, &mut probs, bh, 1, t, d).unwrap();
            let (mut dq, mut dk, mut dv) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
            causal_attention_backward(
                q, k, v, &probs, dout, &mut dq, &mut dk, &mut dv, bh, 1, t, d,
            )
            .unwrap();
            vec![out, probs, dq, dk, dv]
        });
    }

    #[test]
    fn gelu_matches_f64_reference_and_finite_differences() {
        let mut rng = Rng::new(13);
        let mut x = rng.vec_scaled(200, 6.0);
        x.extend_from_slice(&[0.0, -0.0, 1e-30, 20.0, -20.0, 80.0, -80.0]);
        let mut y = vec![0.0; x.len()];
        gelu(&x, &mut y).unwrap();
        let want: Vec<f64> = x.iter().map(|&v| gelu_ref(v as f64)).collect();
        // A handful of f32 roundings (tanh is ≤ 1 ulp in libm): relative 1e-5 plus an absolute
        // term for the cancellation 1 + tanh(u) → 0 at large negative x.
        assert_close("gelu", &y, &want, 1e-5, 1e-6);
        assert!(y.iter().all(|v| v.is_finite()));

        let dy = rng.vec(x.len());
        let mut dx = vec![0.0; x.len()];
        gelu_backward(&x, &dy, &mut dx).unwrap();
        let xs = f64s(&x);
        let dys = f64s(&dy);
        // Gradient of L = Σ dy·gelu(x), an elementwise function: check each coordinate.
        let want: Vec<f64> = (0..x.len())
            .map(|i| dys[i] * fd_grad(|v| gelu_ref(v[0]), &[xs[i]], 1e-6)[0])
            .collect();
        assert_close("gelu_backward", &dx, &want, 1e-4, 1e-5);
    }
}
