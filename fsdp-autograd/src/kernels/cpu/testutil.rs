//! Test helpers: a small deterministic generator, f64 finite differences and tolerance checks.

/// SplitMix64: deterministic, seedable, good enough for test data.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub(crate) fn f32(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// `len` values uniform in [-1, 1).
    pub(crate) fn vec(&mut self, len: usize) -> Vec<f32> {
        (0..len).map(|_| self.f32()).collect()
    }

    /// `len` values uniform in [-scale, scale).
    pub(crate) fn vec_scaled(&mut self, len: usize, scale: f32) -> Vec<f32> {
        (0..len).map(|_| self.f32() * scale).collect()
    }

    /// Uniform in 0..bound.
    pub(crate) fn below(&mut self, bound: usize) -> usize {
        (self.next_u64() % bound as u64) as usize
    }
}

/// Widens to f64.
pub(crate) fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// Central finite differences of a scalar f64 function at `x` (step `h`, error O(h²)).
pub(crate) fn fd_grad(f: impl Fn(&[f64]) -> f64, x: &[f64], h: f64) -> Vec<f64> {
    let mut xp = x.to_vec();
    (0..x.len())
        .map(|i| {
            let orig = xp[i];
            xp[i] = orig + h;
            let up = f(&xp);
            xp[i] = orig - h;
            let down = f(&xp);
            xp[i] = orig;
            (up - down) / (2.0 * h)
        })
        .collect()
}

/// Dot product in f64 (the scalar loss `Σ dy·y` used to turn a vector function into a scalar
/// one for gradient checks).
pub(crate) fn dot(a: &[f64], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x * y as f64).sum()
}

/// Asserts `|got − want| ≤ atol + rtol·|want|` elementwise, naming `what` and the index.
#[track_caller]
pub(crate) fn assert_close(what: &str, got: &[f32], want: &[f64], rtol: f64, atol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(
            err <= atol + rtol * w.abs(),
            "{what}[{i}]: got {g}, want {w}, |err| = {err:e} > {atol:e} + {rtol:e}·|want|"
        );
    }
}

/// Bit patterns, for bitwise comparisons.
pub(crate) fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// f64 reference of `C = op(A)·op(B) (+ C0 if accumulate)` (one product, row-major, stored as
/// [`super::matmul`] takes them), and per element the sum of |a_ip·b_pj| (+ |c0|) for the rounding
/// bound.
pub(crate) fn reference(
    a: &[f32],
    b: &[f32],
    c0: &[f32],
    (m, k, n): (usize, usize, usize),
    trans_a: bool,
    trans_b: bool,
    accumulate: bool,
) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0.0; m * n];
    let mut mag = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let (mut s, mut g) = (0.0f64, 0.0f64);
            for p in 0..k {
                let av = if trans_a { a[p * m + i] } else { a[i * k + p] } as f64;
                let bv = if trans_b { b[j * k + p] } else { b[p * n + j] } as f64;
                s += av * bv;
                g += (av * bv).abs();
            }
            if accumulate {
                s += c0[i * n + j] as f64;
                g += (c0[i * n + j] as f64).abs();
            }
            out[i * n + j] = s;
            mag[i * n + j] = g;
        }
    }
    (out, mag)
}
