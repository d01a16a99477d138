//! Property tests over random shapes and values: algebraic laws the kernels must satisfy.

use half::{bf16, f16};
use proptest::prelude::*;

use super::testutil::reference;
use super::*;

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 48,
        ..ProptestConfig::default()
    }
}

/// Values in [-2, 2], as f32.
fn values(len: usize) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(-2.0f32..2.0, len)
}

proptest! {
    #![proptest_config(config())]

    /// Every transpose combination equals the f64 product within the dot-product rounding
    /// bound γ_{k+1}·Σ|a·b| (doubled).
    #[test]
    fn matmul_within_rounding_bound_of_f64(
        (m, k, n, a, b) in (1usize..20, 1usize..20, 1usize..20).prop_flat_map(|(m, k, n)| {
            (Just(m), Just(k), Just(n), values(m * k), values(k * n))
        }),
        trans_a in any::<bool>(),
        trans_b in any::<bool>(),
    ) {
        let mut c = vec![f32::NAN; m * n];
        matmul(&a, &b, &mut c, m, k, n, trans_a, trans_b, false).unwrap();
        let u = f32::EPSILON as f64 / 2.0;
        let gamma = (k + 1) as f64 * u / (1.0 - (k + 1) as f64 * u);
        let (want, mag) = reference(&a, &b, &[], (m, k, n), trans_a, trans_b, false);
        for ((&got, &w), &g) in c.iter().zip(&want).zip(&mag) {
            prop_assert!((got as f64 - w).abs() <= 2.0 * gamma * g + 1e-30);
        }
    }

    /// Softmax rows are probability vectors, and adding a constant to a row changes nothing
    /// beyond rounding.
    #[test]
    fn softmax_rows_are_distributions_and_shift_invariant(
        (_rows, cols, x) in (1usize..6, 1usize..40)
            .prop_flat_map(|(r, c)| (Just(r), Just(c), prop::collection::vec(-20.0f32..20.0, r * c))),
        shift in -50.0f32..50.0,
    ) {
        let mut y = vec![0.0; x.len()];
        softmax_rows(&x, &mut y, cols).unwrap();
        for row in y.chunks(cols) {
            let s: f64 = row.iter().map(|&v| v as f64).sum();
            prop_assert!((s - 1.0).abs() <= 4e-7 * cols as f64 + 1e-6);
            prop_assert!(row.iter().all(|&v| (0.0..=1.0).contains(&v)));
        }
        let xs: Vec<f32> = x.iter().map(|&v| v + shift).collect();
        let mut ys = vec![0.0; x.len()];
        softmax_rows(&xs, &mut ys, cols).unwrap();
        for (a, b) in y.iter().zip(&ys) {
            // x + shift is rounded (|x + shift| < 70: error ≤ 2⁻¹⁸ ≈ 3.8e-6 absolute), which
            // moves each probability by at most that much relatively, twice over.
            prop_assert!((a - b).abs() as f64 <= 1.6e-5 * (*a as f64) + 1e-7);
        }
    }

    /// Layer norm with gamma = 1, beta = 0 gives rows of mean 0 and (biased) variance
    /// var/(var + eps).
    #[test]
    fn layer_norm_standardizes_rows(
        (rows, cols, x) in (1usize..5, 2usize..50)
            .prop_flat_map(|(r, c)| (Just(r), Just(c), values(r * c))),
    ) {
        let eps = 1e-5f32;
        let (gamma, beta) = (vec![1.0; cols], vec![0.0; cols]);
        let (mut y, mut mean, mut rstd) = (vec![0.0; x.len()], vec![0.0; rows], vec![0.0; rows]);
        layer_norm(&x, &gamma, &beta, &mut y, &mut mean, &mut rstd, cols, eps).unwrap();
        for (xr, yr) in x.chunks(cols).zip(y.chunks(cols)) {
            let mu = xr.iter().map(|&v| v as f64).sum::<f64>() / cols as f64;
            let var = xr.iter().map(|&v| (v as f64 - mu).powi(2)).sum::<f64>() / cols as f64;
            let ym = yr.iter().map(|&v| v as f64).sum::<f64>() / cols as f64;
            let yv = yr.iter().map(|&v| (v as f64 - ym).powi(2)).sum::<f64>() / cols as f64;
            prop_assert!(ym.abs() <= 1e-5);
            prop_assert!((yv - var / (var + eps as f64)).abs() <= 1e-5);
        }
    }

    /// The embedding backward is the adjoint of the lookup: ⟨E(T), dy⟩ = ⟨T, Eᵀ(dy)⟩.
    #[test]
    fn embedding_backward_is_adjoint(
        (rows, dim, table, ids, dy) in (1usize..8, 1usize..6, 1usize..12)
            .prop_flat_map(|(r, d, n)| (
                Just(r), Just(d), values(r * d),
                prop::collection::vec(0..r as i64, n), values(n * d),
            )),
    ) {
        let mut out = vec![0.0; ids.len() * dim];
        embedding(&ids, &table, &mut out, dim).unwrap();
        let mut dtable = vec![0.0; rows * dim];
        embedding_backward(&ids, &dy, &mut dtable, dim).unwrap();
        let lhs: f64 = out.iter().zip(&dy).map(|(&a, &b)| a as f64 * b as f64).sum();
        let rhs: f64 = table.iter().zip(&dtable).map(|(&a, &b)| a as f64 * b as f64).sum();
        // dtable entries carry ≤ n f32 roundings of sums of |dy| ≤ 2.
        let bound = (ids.len() * ids.len()) as f64 * 2.0 * 2.0 * 1.2e-7 * (dim as f64) + 1e-9;
        prop_assert!((lhs - rhs).abs() <= bound, "{lhs} vs {rhs}");
    }

    /// Cross-entropy is non-negative and its gradient rows sum to zero (softmax minus a one-hot).
    #[test]
    fn cross_entropy_laws(
        (rows, cols, x, t) in (1usize..6, 1usize..30)
            .prop_flat_map(|(r, c)| (
                Just(r), Just(c), prop::collection::vec(-10.0f32..10.0, r * c),
                prop::collection::vec(0..c as i64, r),
            )),
    ) {
        let mut lse = vec![0.0; rows];
        let loss = cross_entropy(&x, &t, cols, &mut lse).unwrap();
        prop_assert!(loss >= -1e-6);
        let mut d = vec![0.0; x.len()];
        cross_entropy_backward(&x, &t, &lse, 1.0, &mut d, cols).unwrap();
        for row in d.chunks(cols) {
            let s: f64 = row.iter().map(|&v| v as f64).sum();
            prop_assert!(s.abs() <= 1e-6 * cols as f64);
        }
    }

    /// Attention outputs are convex combinations of the visible values.
    #[test]
    fn attention_outputs_are_convex_combinations(
        (bh, t, d, q, k, v) in (1usize..3, 1usize..9, 1usize..5)
            .prop_flat_map(|(bh, t, d)| (
                Just(bh), Just(t), Just(d),
                values(bh * t * d), values(bh * t * d), values(bh * t * d),
            )),
    ) {
        let mut out = vec![0.0; q.len()];
        let mut probs = vec![0.0; bh * t * t];
        causal_attention(&q, &k, &v, &mut out, &mut probs, bh, 1, t, d).unwrap();
        for h in 0..bh {
            for i in 0..t {
                let row = &probs[h * t * t + i * t..h * t * t + (i + 1) * t];
                let s: f64 = row.iter().map(|&p| p as f64).sum();
                prop_assert!((s - 1.0).abs() <= 1e-6);
                prop_assert!(row[i + 1..].iter().all(|&p| p == 0.0));
                for c in 0..d {
                    let vis = (0..=i).map(|j| v[h * t * d + j * d + c]);
                    let (lo, hi) = vis.fold((f32::MAX, f32::MIN), |(a, b), x| (a.min(x), b.max(x)));
                    let o = out[h * t * d + i * d + c];
                    prop_assert!(o >= lo - 1e-5 && o <= hi + 1e-5);
                }
            }
        }
    }

    /// Narrowing casts round once: converting back and forth again changes nothing.
    #[test]
    fn half_casts_are_idempotent(x in prop::collection::vec(-7e4f32..7e4, 0..64)) {
        let mut h = vec![f16::ZERO; x.len()];
        let mut back = vec![0.0f32; x.len()];
        cast_f32_to_f16(&x, &mut h).unwrap();
        cast_f16_to_f32(&h, &mut back).unwrap();
        let mut h2 = vec![f16::ZERO; x.len()];
        cast_f32_to_f16(&back, &mut h2).unwrap();
        prop_assert_eq!(&h, &h2);
        let mut b = vec![bf16::ZERO; x.len()];
        cast_f32_to_bf16(&x, &mut b).unwrap();
        cast_bf16_to_f32(&b, &mut back).unwrap();
        let mut b2 = vec![bf16::ZERO; x.len()];
        cast_f32_to_bf16(&back, &mut b2).unwrap();
        prop_assert_eq!(&b, &b2);
    }
}
