//! A branch-free `exp` for f32 that the compiler can vectorize (libm's `expf` is an opaque call
//! per element, which made GELU and softmax cost more than the matrix products around them),
//! and the standard normal CDF and density built on it for exact GELU (libm's `erfcf`, a branchy
//! scalar call, made exact GELU's forward and backward 21% of a GPT-mini training step).
//!
//! Method: Cody–Waite range reduction `x = n·ln2 + r`, `|r| ≤ ln2/2`, then the degree-7 Taylor
//! polynomial of `exp(r)` (truncation error `r⁸/8! < 6e-9` relative, below f32's 6e-8 unit
//! roundoff) and a scale by `2ⁿ` built from the exponent bits. Checked against f64 `exp` in the
//! tests on 250 000 points: within 2 ulp (the worst seen was 1.11 ulp) wherever the result is a
//! normal f32; subnormal results are flushed to 0. Pure f32
//! arithmetic without fused multiply-adds, so results are identical on every x86-64 CPU.

/// A kernel body for [`vectorized`]: a struct holding the kernel's arguments whose `run` is
/// `#[inline(always)]` (and calls only `#[inline(always)]` helpers in its hot loops), so that the
/// whole body is compiled inside the AVX2-enabled function. (A closure or a function item goes
/// through a `Fn::call` shim that LLVM may keep out of line, compiled for the baseline ISA.)
pub(crate) trait SimdKernel {
    /// What the kernel returns.
    type Output;
    /// The kernel body.
    fn run(self) -> Self::Output;
}

/// Runs `kernel` compiled for the CPU kernels' instruction-set level ([`super::isa`]): AVX-512
/// (16 f32 lanes) on x86-64-v4 machines, AVX2 (8 lanes) on x86-64-v3 ones, the baseline (SSE2,
/// 4 lanes) otherwise or when `FSDP_CPU_ISA` caps it, chosen at run time through `pulp`
/// (already a dependency of `gemm`). Only the lane width changes: Rust never contracts `a·b + c`
/// into a fused multiply-add, and every other operation is correctly rounded or exact, so each
/// path gives the same bits (tested by running the kernels under every level).
#[inline(always)]
pub(crate) fn vectorized<K: SimdKernel>(kernel: K) -> K::Output {
    struct Op<K>(K);
    impl<K: SimdKernel> pulp::WithSimd for Op<K> {
        type Output = K::Output;
        #[inline(always)]
        fn with_simd<S: pulp::Simd>(self, _: S) -> K::Output {
            self.0.run()
        }
    }
    dispatch(Op(kernel))
}

/// An element-wise function of one input, for [`map1`]: a unit struct whose `one` is
/// `#[inline(always)]` (see [`SimdKernel`] for why not a closure).
pub(crate) trait Map1 {
    /// The value for one element.
    fn one(x: f32) -> f32;
}

/// An element-wise function of two inputs, for [`map2`]; as [`Map1`].
pub(crate) trait Map2 {
    /// The value for one pair of elements.
    fn one(a: f32, b: f32) -> f32;
}

/// `y[i] = M::one(x[i])`, [`vectorized`].
#[inline(always)]
pub(crate) fn map1<M: Map1>(x: &[f32], y: &mut [f32]) {
    struct Op<'a, M>(&'a [f32], &'a mut [f32], std::marker::PhantomData<M>);
    impl<M: Map1> SimdKernel for Op<'_, M> {
        type Output = ();
        #[inline(always)]
        fn run(self) {
            for (o, &v) in self.1.iter_mut().zip(self.0) {
                *o = M::one(v);
            }
        }
    }
    vectorized(Op::<M>(x, y, std::marker::PhantomData))
}

/// `y[i] = M::one(a[i], b[i])`, [`vectorized`].
#[inline(always)]
pub(crate) fn map2<M: Map2>(a: &[f32], b: &[f32], y: &mut [f32]) {
    struct Op<'a, M>(
        &'a [f32],
        &'a [f32],
        &'a mut [f32],
        std::marker::PhantomData<M>,
    );
    impl<M: Map2> SimdKernel for Op<'_, M> {
        type Output = ();
        #[inline(always)]
        fn run(self) {
            for ((o, &u), &v) in self.2.iter_mut().zip(self.0).zip(self.1) {
                *o = M::one(u, v);
            }
        }
    }
    vectorized(Op::<M>(a, b, y, std::marker::PhantomData))
}

/// Runs `op` at the kernels' level ([`super::isa::simd_level`]).
#[inline(always)]
fn dispatch<Op: pulp::WithSimd>(op: Op) -> Op::Output {
    #[cfg(target_arch = "x86_64")]
    {
        use super::isa::{simd_level, CpuIsa};
        // `try_new` re-checks the (cached) CPUID bits: a level is only entered where it runs.
        let arch = match simd_level() {
            CpuIsa::Avx512 => pulp::x86::V4::try_new().map(pulp::Arch::V4),
            CpuIsa::Avx2 => pulp::x86::V3::try_new().map(pulp::Arch::V3),
            CpuIsa::Baseline => None,
        };
        arch.unwrap_or(pulp::Arch::Scalar).dispatch(op)
    }
    #[cfg(not(target_arch = "x86_64"))]
    pulp::Arch::new().dispatch(op)
}

/// ≈ ln(f32::MIN_POSITIVE): below this the true value is subnormal and 0 is returned (flush).
const EXP_LO: f32 = -87.336_54;
/// Above this, `exp(x)` overflows f32 and is returned as +∞.
const EXP_HI: f32 = 88.722_83;
/// 1.5·2²³: adding and subtracting it rounds an f32 of magnitude < 2²² to the nearest integer.
const ROUND_MAGIC: f32 = 12_582_912.0;
const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split so that `n·LN2_HI` is exact for |n| ≤ 2⁸ (LN2_HI = 355/512 has 9 significant bits).
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;

/// `exp(x)` in f32 within 2 ulp; `exp(-∞) = 0`, `exp(+∞) = +∞`, NaN stays NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    // Clamp so the reduction below stays in range; the selects at the end restore the limits.
    let xc = x.clamp(EXP_LO, EXP_HI);
    // `t` is an integer-valued float in [2²³, 2²⁴): its low mantissa bits hold n (offset by
    // the magic constant's bits), which gives n as an integer without a float→int conversion
    // (Rust's saturating `as i32` does not vectorize on baseline x86-64).
    let t = xc * LOG2_E + ROUND_MAGIC;
    let n = t - ROUND_MAGIC;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    // n ∈ [-126, 128]: split 2ⁿ into two normal factors so n = 128 (x near EXP_HI) works.
    // For a NaN input `t` is NaN and these bits are meaningless (the result is replaced below);
    // wrapping arithmetic makes it evident that no input can cause an overflow panic.
    let ni = (t.to_bits() as i32).wrapping_sub(ROUND_MAGIC.to_bits() as i32);
    let h = ni >> 1;
    let s1 = f32::from_bits((h.wrapping_add(127) as u32) << 23);
    let s2 = f32::from_bits((ni.wrapping_sub(h).wrapping_add(127) as u32) << 23);
    let y = p * s1 * s2;
    if x < EXP_LO {
        0.0
    } else if x > EXP_HI {
        f32::INFINITY
    } else if x.is_nan() {
        x
    } else {
        y
    }
}

/// 1/√2.
const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// 1/√(2π), the standard normal density at 0.
const INV_SQRT_2PI: f32 = 0.398_942_3;
/// Below this `|x|`, `Φ(x) = ½ + x·φ(0)·(1 − x²/6)` (erf's series to its second term; the
/// third, `x⁴/40` relative, is below 2e-10 here), which makes `Φ(0) = ½` exactly.
const SMALL: f32 = 1.0 / 64.0;
/// The Chebyshev fit of `erfc` in Numerical Recipes (2nd ed., §6.2, `erfcc`):
/// `erfc(z) ≈ t·exp(−z² + P(t))`, `t = 1/(1 + z/2)`, `P(t) = Σ cₖ tᵏ`, with a fractional
/// error below 1.2e-7 for every `z ≥ 0`. Coefficients c₀…c₉.
const ERFC_FIT: [f32; 10] = [
    -1.265_512_2,
    1.000_023_7,
    0.374_091_96,
    0.096_784_18,
    -0.186_288_06,
    0.278_868_07,
    -1.135_204,
    1.488_515_9,
    -0.822_152_23,
    0.170_872_77,
];

/// `Φ(x)`, the standard normal CDF, in f32, branch-free so loops over it vectorize (one `exp`,
/// one division and a degree-9 polynomial per element).
///
/// `Φ(−|x|) = ½·erfc(|x|/√2)` from the Chebyshev fit above, with `z² = x²/2` formed with a
/// single rounding (not through `x/√2`), and `Φ(|x|) = 1 − Φ(−|x|)`, so `Φ(x) + Φ(−x) = 1`
/// up to one rounding; for `|x| < 1/64` erf's two-term series, so `Φ(0) = ½` exactly. The tests
/// check it against an f64 reference wherever the value is a normal f32: relative error below
/// `1e-6 + 2.4e-7·x²/2` (the second term is the rounding of `x²/2` and of the exponent's sum,
/// amplified by `exp`: in the far tail, `|x| > 5`, where `Φ` is below 3e-7, it grows to ~2e-5
/// at `|x| = 13`).
#[inline(always)]
pub(crate) fn normal_cdf(x: f32) -> f32 {
    let half_x2 = 0.5 * x * x;
    let z = x.abs() * FRAC_1_SQRT_2;
    let t = 1.0 / (1.0 + 0.5 * z);
    let mut p = ERFC_FIT[9];
    for &c in ERFC_FIT[..9].iter().rev() {
        p = p * t + c;
    }
    // Capped so exp never sees a huge negative argument (the value is 0 in f32 long before).
    let lower = 0.5 * t * exp((p - half_x2).max(-104.0));
    let tail = if x < 0.0 { lower } else { 1.0 - lower };
    let series = 0.5 + x * INV_SQRT_2PI * (1.0 - half_x2 * (1.0 / 3.0));
    if x.abs() < SMALL {
        series
    } else {
        tail
    }
}

/// `φ(x) = exp(−x²/2)/√(2π)`, the standard normal density, branch-free: relative error below
/// `3e-7 + 1.2e-7·x²/2` where the value is a normal f32 (`exp`'s 2 ulp and the rounding of
/// `x²/2`), 0 below.
#[inline(always)]
pub(crate) fn normal_pdf(x: f32) -> f32 {
    INV_SQRT_2PI * exp((-0.5 * x * x).max(-104.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::testutil::Rng;

    fn ulp_err(got: f32, want: f64) -> f64 {
        let w = want as f32;
        let ulp = (f32::from_bits(w.to_bits() + 1) - w) as f64;
        (got as f64 - want).abs() / ulp
    }

    #[test]
    fn within_two_ulp_of_f64_exp_over_the_finite_range() {
        let mut rng = Rng::new(70);
        let mut worst = 0.0f64;
        let mut check = |x: f32| {
            let want = (x as f64).exp();
            if want >= f32::MIN_POSITIVE as f64 && want <= f32::MAX as f64 {
                let e = ulp_err(exp(x), want);
                worst = worst.max(e);
                assert!(e <= 2.0, "exp({x}) = {}, want {want}: {e} ulp", exp(x));
            }
        };
        for _ in 0..200_000 {
            check(rng.f32() * 88.0);
        }
        for _ in 0..50_000 {
            check(rng.f32() * 1e-3);
        }
        for x in [
            0.0, -0.0, 1.0, -1.0, 0.5, 88.0, 88.7, -87.0, -87.3, 1e-8, -1e-8,
        ] {
            check(x);
        }
        assert!(worst > 0.0, "the check compared something");
    }

    /// Φ in f64 from erf's Maclaurin series (|z| ≤ 3) or erfc's continued fraction (|z| > 3).
    fn cdf_ref(x: f64) -> f64 {
        let z = x / std::f64::consts::SQRT_2;
        let a = z.abs();
        // erfc(a) for a ≥ 0.
        let erfc = if a <= 3.0 {
            let (mut term, mut sum, mut n) = (a, a, 0.0f64);
            while term.abs() > 1e-18 * sum.abs() {
                n += 1.0;
                term *= -a * a / n;
                sum += term / (2.0 * n + 1.0);
            }
            1.0 - 2.0 / std::f64::consts::PI.sqrt() * sum
        } else {
            let mut f = a;
            for k in (1..80).rev() {
                f = a + (k as f64 / 2.0) / f;
            }
            (-a * a).exp() / std::f64::consts::PI.sqrt() / f
        };
        if z < 0.0 {
            0.5 * erfc
        } else {
            1.0 - 0.5 * erfc
        }
    }

    #[test]
    fn normal_cdf_and_pdf_match_f64_references() {
        let mut rng = Rng::new(71);
        let mut worst_cdf = 0.0f64;
        let mut worst_pdf = 0.0f64;
        let mut check = |x: f32| {
            let (cdf, pdf) = (normal_cdf(x), normal_pdf(x));
            let want = cdf_ref(x as f64);
            if want >= f32::MIN_POSITIVE as f64 {
                let e = ((cdf as f64 - want) / want).abs();
                worst_cdf = worst_cdf.max(e);
                let bound = 1e-6 + 2.4e-7 * 0.5 * (x as f64) * (x as f64);
                assert!(e < bound, "Φ({x}) = {cdf}, want {want}: relative error {e}");
            } else {
                assert!(cdf.abs() < 1e-37, "Φ({x}) = {cdf}, want {want}");
            }
            let want = (-0.5 * (x as f64) * (x as f64)).exp() / (2.0 * std::f64::consts::PI).sqrt();
            if want >= f32::MIN_POSITIVE as f64 {
                let e = ((pdf as f64 - want) / want).abs();
                worst_pdf = worst_pdf.max(e);
                // exp's 2 ulp, the rounding of x²/2 (relative 6e-8·x²/2 on the result) and a
                // product.
                let bound = 3e-7 + 1.2e-7 * 0.5 * (x as f64) * (x as f64);
                assert!(e < bound, "φ({x}) = {pdf}, want {want}: relative error {e}");
            }
        };
        for _ in 0..200_000 {
            check(rng.f32() * 14.0);
        }
        for _ in 0..20_000 {
            check(rng.f32() * 1e-3);
        }
        for x in [
            0.0,
            -0.0,
            1.0,
            -1.0,
            5.0,
            -5.0,
            13.0,
            -13.0,
            SMALL,
            -SMALL,
            0.015_624_999,
            -0.015_624_999,
        ] {
            check(x);
        }
        // Symmetry: Φ(x) + Φ(−x) = 1 up to the rounding of one subtraction.
        for i in 0..10_000 {
            let x = i as f32 * 1e-3;
            let s = normal_cdf(x) as f64 + normal_cdf(-x) as f64;
            assert!((s - 1.0).abs() <= 6e-8, "Φ({x}) + Φ(−{x}) = {s}");
        }
        assert!(
            worst_cdf > 0.0 && worst_pdf > 0.0,
            "the checks compared something"
        );
        assert_eq!(normal_cdf(0.0), 0.5);
        assert_eq!(normal_cdf(-0.0), 0.5);
        assert_eq!((normal_cdf(40.0), normal_pdf(40.0)), (1.0, 0.0));
        assert_eq!((normal_cdf(-40.0), normal_pdf(-40.0)), (0.0, 0.0));
        assert_eq!(normal_cdf(f32::INFINITY), 1.0);
        assert_eq!(normal_cdf(f32::NEG_INFINITY), 0.0);
        assert_eq!(normal_pdf(0.0), INV_SQRT_2PI);
    }

    #[test]
    fn limits() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-1000.0), 0.0);
        assert_eq!(exp(-87.34), 0.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        // NaNs of either sign and any payload.
        assert!(exp(-f32::NAN).is_nan());
        assert!(exp(f32::from_bits(0xFFFF_FFFF)).is_nan());
        assert!(exp(88.72).is_finite() && exp(-87.336).is_normal());
    }
}
