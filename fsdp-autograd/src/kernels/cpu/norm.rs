//! Row softmax and layer norm, with their backward passes.

use super::elementwise::{dot_f64, max_f32, sum_f64};
use super::math::{exp, vectorized, SimdKernel};
use crate::kernels::check;
use crate::kernels::KernelError;

/// Softmax of one row in place: `row[j] ← exp(row[j] − max) / Σ exp(row − max)`.
///
/// The exponentials (this module's vectorizable `exp`, ≤ 2 ulp) are summed in f64 in a fixed
/// order. A row whose maximum is not finite
/// (all `-inf`, or containing `+inf`/NaN) yields NaNs, as PyTorch does.
#[inline(always)]
pub(crate) fn softmax_row_inplace(row: &mut [f32]) {
    let max = max_f32(row);
    for v in row.iter_mut() {
        *v = exp(*v - max);
    }
    let inv = (1.0 / sum_f64(row)) as f32;
    for v in row.iter_mut() {
        *v *= inv;
    }
}

/// Softmax backward for one row: `dx = y ⊙ (dy − Σ y·dy)`, written over `dx`.
#[inline(always)]
pub(crate) fn softmax_row_backward(y: &[f32], dy: &[f32], dx: &mut [f32]) {
    let dot = dot_f64(y, dy) as f32;
    for ((o, &p), &g) in dx.iter_mut().zip(y).zip(dy) {
        *o = p * (g - dot);
    }
}

/// Row-wise softmax of a row-major matrix with `cols` columns: `y[r, :] = softmax(x[r, :])`.
///
/// Numerically stable (the row maximum is subtracted before `exp`); the normalizer is summed in
/// f64 in a fixed order and applied as one multiplication by its reciprocal. Rows whose maximum
/// is not finite produce NaNs (as in PyTorch).
///
/// # Errors
/// [`KernelError::InvalidShape`] if `cols == 0` or `x` is not a whole number of rows;
/// [`KernelError::LengthMismatch`] if `y` and `x` differ in length.
///
/// ```
/// let mut y = [0.0; 4];
/// fsdp_autograd::kernels::cpu::softmax_rows(&[0.0, 0.0, 1000.0, 1000.0], &mut y, 2).unwrap();
/// assert_eq!(y, [0.5; 4]);
/// ```
pub fn softmax_rows(x: &[f32], y: &mut [f32], cols: usize) -> Result<(), KernelError> {
    check::rows("softmax_rows", "x", x.len(), cols)?;
    check::same_len("softmax_rows", "y", y.len(), "x", x.len())?;
    y.copy_from_slice(x);
    for row in y.chunks_exact_mut(cols) {
        softmax_row_inplace(row);
    }
    Ok(())
}

/// Gradient of [`softmax_rows`] from its output `y`: `dx[r, :] = y ⊙ (dy − Σ_j y·dy)` per row.
///
/// # Errors
/// [`KernelError::InvalidShape`] if `cols == 0` or `y` is not a whole number of rows;
/// [`KernelError::LengthMismatch`] if `dy` or `dx` differ in length from `y`.
///
/// ```
/// let mut dx = [0.0; 2];
/// // A uniform upstream gradient has no effect on a softmax.
/// fsdp_autograd::kernels::cpu::softmax_rows_backward(&[0.25, 0.75], &[3.0, 3.0], &mut dx, 2)
///     .unwrap();
/// assert_eq!(dx, [0.0, 0.0]);
/// ```
pub fn softmax_rows_backward(
    y: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    cols: usize,
) -> Result<(), KernelError> {
    let op = "softmax_rows_backward";
    check::rows(op, "y", y.len(), cols)?;
    check::same_len(op, "dy", dy.len(), "y", y.len())?;
    check::same_len(op, "dx", dx.len(), "y", y.len())?;
    for ((o, yr), gr) in dx
        .chunks_exact_mut(cols)
        .zip(y.chunks_exact(cols))
        .zip(dy.chunks_exact(cols))
    {
        softmax_row_backward(yr, gr, o);
    }
    Ok(())
}

/// Layer norm over the last dimension (`cols` columns), PyTorch semantics:
/// `y = (x − mean) · rstd · gamma + beta` with `rstd = 1/√(var + eps)` and the biased variance.
///
/// Saves per-row `mean` and `rstd` (one value per row each) for [`layer_norm_backward`]. Mean and
/// variance are computed in f64 (two passes, fixed order) and stored rounded to f32.
///
/// # Errors
/// [`KernelError::InvalidShape`] if `cols == 0` or `x` is not a whole number of rows;
/// [`KernelError::LengthMismatch`] if `gamma`/`beta` do not have `cols` elements, `y` differs
/// from `x`, or `mean`/`rstd` do not have one element per row.
///
/// ```
/// use fsdp_autograd::kernels::cpu::layer_norm;
/// let (mut y, mut mean, mut rstd) = ([0.0; 2], [0.0], [0.0]);
/// layer_norm(&[1.0, 3.0], &[1.0, 1.0], &[0.0, 0.5], &mut y, &mut mean, &mut rstd, 2, 0.0)
///     .unwrap();
/// assert_eq!((mean[0], rstd[0]), (2.0, 1.0));
/// assert_eq!(y, [-1.0, 1.5]);
/// ```
#[allow(clippy::too_many_arguments)]
pub fn layer_norm(
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    y: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    cols: usize,
    eps: f32,
) -> Result<(), KernelError> {
    let op = "layer_norm";
    let rows = check::rows(op, "x", x.len(), cols)?;
    let shape = || format!("rows={rows}, cols={cols}");
    check::len(op, "gamma", gamma.len(), cols, shape)?;
    check::len(op, "beta", beta.len(), cols, shape)?;
    check::len(op, "y", y.len(), x.len(), shape)?;
    check::len(op, "mean", mean.len(), rows, shape)?;
    check::len(op, "rstd", rstd.len(), rows, shape)?;
    struct Body<'a> {
        x: &'a [f32],
        gamma: &'a [f32],
        beta: &'a [f32],
        y: &'a mut [f32],
        mean: &'a mut [f32],
        rstd: &'a mut [f32],
        cols: usize,
        eps: f32,
    }
    impl SimdKernel for Body<'_> {
        type Output = ();
        #[inline(always)]
        fn run(self) {
            let Body {
                x,
                gamma,
                beta,
                y,
                mean,
                rstd,
                cols,
                eps,
            } = self;
            let n = cols as f64;
            for (r, (xr, yr)) in x
                .chunks_exact(cols)
                .zip(y.chunks_exact_mut(cols))
                .enumerate()
            {
                let mu = sum_f64(xr) / n;
                let mut acc = [0.0f64; 8];
                let chunks = xr.chunks_exact(8);
                let tail: f64 = chunks
                    .remainder()
                    .iter()
                    .map(|&v| (v as f64 - mu) * (v as f64 - mu))
                    .sum();
                for c in chunks {
                    for l in 0..8 {
                        let d = c[l] as f64 - mu;
                        acc[l] += d * d;
                    }
                }
                let var = ((acc[0] + acc[4]) + (acc[1] + acc[5]))
                    + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
                    + tail;
                let rs = (1.0 / (var / n + eps as f64).sqrt()) as f32;
                let m = mu as f32;
                mean[r] = m;
                rstd[r] = rs;
                for (((o, &v), &g), &b) in yr.iter_mut().zip(xr).zip(gamma).zip(beta) {
                    *o = (v - m) * rs * g + b;
                }
            }
        }
    }
    vectorized(Body {
        x,
        gamma,
        beta,
        y,
        mean,
        rstd,
        cols,
        eps,
    });
    Ok(())
}

/// Gradient of [`layer_norm`] from its input `x`, `gamma`, and the saved `mean`/`rstd`.
///
/// With `x̂ = (x − mean)·rstd` and `g = dy·gamma`, per row:
/// `dx = rstd · (g − mean(g) − x̂·mean(g·x̂))`. Across rows: `dgamma = Σ_r dy·x̂`,
/// `dbeta = Σ_r dy`. `dx`, `dgamma` and `dbeta` are **overwritten** (rows are added in order
/// 0, 1, … in f32; the row means in f64).
///
/// # Errors
/// As [`layer_norm`], plus `dy`/`dx` must match `x` and `dgamma`/`dbeta` must have `cols`
/// elements.
///
/// ```
/// use fsdp_autograd::kernels::cpu::layer_norm_backward;
/// let (mut dx, mut dg, mut db) = ([0.0; 2], [0.0; 2], [0.0; 2]);
/// // x = [1, 3]: mean 2, rstd 1, x̂ = [-1, 1].
/// layer_norm_backward(&[1.0, 3.0], &[1.0, 1.0], &[2.0], &[1.0], &[1.0, 0.0],
///                     &mut dx, &mut dg, &mut db, 2).unwrap();
/// assert_eq!(dg, [-1.0, 0.0]);
/// assert_eq!(db, [1.0, 0.0]);
/// assert_eq!(dx, [0.0, 0.0]); // y₀ = x̂₀ = -1 for every x₀ (with 2 columns x̂ = ±1)
/// ```
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward(
    x: &[f32],
    gamma: &[f32],
    mean: &[f32],
    rstd: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    dgamma: &mut [f32],
    dbeta: &mut [f32],
    cols: usize,
) -> Result<(), KernelError> {
    let op = "layer_norm_backward";
    let rows = check::rows(op, "x", x.len(), cols)?;
    let shape = || format!("rows={rows}, cols={cols}");
    check::len(op, "gamma", gamma.len(), cols, shape)?;
    check::len(op, "mean", mean.len(), rows, shape)?;
    check::len(op, "rstd", rstd.len(), rows, shape)?;
    check::len(op, "dy", dy.len(), x.len(), shape)?;
    check::len(op, "dx", dx.len(), x.len(), shape)?;
    check::len(op, "dgamma", dgamma.len(), cols, shape)?;
    check::len(op, "dbeta", dbeta.len(), cols, shape)?;
    struct Body<'a> {
        x: &'a [f32],
        gamma: &'a [f32],
        mean: &'a [f32],
        rstd: &'a [f32],
        dy: &'a [f32],
        dx: &'a mut [f32],
        dgamma: &'a mut [f32],
        dbeta: &'a mut [f32],
        cols: usize,
    }
    impl SimdKernel for Body<'_> {
        type Output = ();
        #[inline(always)]
        fn run(self) {
            let Body {
                x,
                gamma,
                mean,
                rstd,
                dy,
                dx,
                dgamma,
                dbeta,
                cols,
            } = self;
            dgamma.fill(0.0);
            dbeta.fill(0.0);
            let n = cols as f64;
            for (r, ((xr, gr), dxr)) in x
                .chunks_exact(cols)
                .zip(dy.chunks_exact(cols))
                .zip(dx.chunks_exact_mut(cols))
                .enumerate()
            {
                let (m, rs) = (mean[r], rstd[r]);
                // Pass 1: the two row means (f64, lane j % 8 takes column j), and the parameter
                // gradients; in chunks of 8 so the lanes map onto SIMD registers.
                let mut s_g = [0.0f64; 8];
                let mut s_gx = [0.0f64; 8];
                let mut step = |l: usize, v: f32, d: f32, w: f32, dg: &mut f32, db: &mut f32| {
                    let xhat = (v - m) * rs;
                    let g = d * w;
                    s_g[l] += g as f64;
                    s_gx[l] += g as f64 * xhat as f64;
                    *dg += d * xhat;
                    *db += d;
                };
                let full = cols / 8 * 8;
                for ((((xs, ds), ws), dgs), dbs) in xr[..full]
                    .chunks_exact(8)
                    .zip(gr[..full].chunks_exact(8))
                    .zip(gamma[..full].chunks_exact(8))
                    .zip(dgamma[..full].chunks_exact_mut(8))
                    .zip(dbeta[..full].chunks_exact_mut(8))
                {
                    for l in 0..8 {
                        step(l, xs[l], ds[l], ws[l], &mut dgs[l], &mut dbs[l]);
                    }
                }
                for j in full..cols {
                    step(
                        j - full,
                        xr[j],
                        gr[j],
                        gamma[j],
                        &mut dgamma[j],
                        &mut dbeta[j],
                    );
                }
                let fold =
                    |a: [f64; 8]| ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
                let mean_g = (fold(s_g) / n) as f32;
                let mean_gx = (fold(s_gx) / n) as f32;
                // Pass 2: the input gradient.
                for (((o, &v), &d), &w) in dxr.iter_mut().zip(xr).zip(gr).zip(gamma) {
                    let xhat = (v - m) * rs;
                    *o = rs * (d * w - mean_g - xhat * mean_gx);
                }
            }
        }
    }
    vectorized(Body {
        x,
        gamma,
        mean,
        rstd,
        dy,
        dx,
        dgamma,
        dbeta,
        cols,
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::testutil::{assert_close, dot, f64s, fd_grad, Rng};

    fn softmax_ref(x: &[f64], cols: usize) -> Vec<f64> {
        let mut y = Vec::with_capacity(x.len());
        for row in x.chunks(cols) {
            let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let s: f64 = row.iter().map(|v| (v - max).exp()).sum();
            y.extend(row.iter().map(|v| (v - max).exp() / s));
        }
        y
    }

    #[test]
    fn softmax_matches_reference_and_gradient() {
        let mut rng = Rng::new(20);
        for (rows, cols) in [(1, 1), (1, 9), (7, 1), (4, 13), (3, 64)] {
            let x = rng.vec_scaled(rows * cols, 5.0);
            let mut y = vec![0.0; x.len()];
            softmax_rows(&x, &mut y, cols).unwrap();
            // x − max is rounded in f32 (|x − max| < 16, so absolute error ≤ 2⁻²¹ ≈ 4.8e-7,
            // i.e. that much relative error after exp), exp itself ≤ 1 ulp, then the rounded
            // reciprocal and the product: ≈ 4.8e-7 + 3·6e-8 < 1e-6 relative.
            assert_close("softmax", &y, &softmax_ref(&f64s(&x), cols), 1e-6, 1e-12);

            let dy = rng.vec(x.len());
            let mut dx = vec![f32::NAN; x.len()];
            softmax_rows_backward(&y, &dy, &mut dx, cols).unwrap();
            let want = fd_grad(|v| dot(&softmax_ref(v, cols), &dy), &f64s(&x), 1e-6);
            // The backward uses the f32 forward output (rel. error ~5e-7) and one cancellation
            // dy − Σy·dy; FD error O(h²) ≈ 1e-12.
            assert_close("softmax_backward", &dx, &want, 1e-5, 1e-6);
        }
        // Shift invariance and stability with huge logits.
        let mut y = [0.0; 3];
        softmax_rows(&[1e30, 1e30, -1e30], &mut y, 3).unwrap();
        assert_eq!(y, [0.5, 0.5, 0.0]);
    }

    #[test]
    fn softmax_shape_errors() {
        let mut y = [0.0; 6];
        assert!(matches!(
            softmax_rows(&[0.0; 6], &mut y, 0),
            Err(KernelError::InvalidShape { .. })
        ));
        assert!(matches!(
            softmax_rows(&[0.0; 6], &mut y, 4),
            Err(KernelError::InvalidShape { .. })
        ));
        assert!(softmax_rows(&[0.0; 6], &mut y[..5], 3).is_err());
        assert!(softmax_rows_backward(&[0.0; 6], &[0.0; 3], &mut y, 3).is_err());
        assert!(softmax_rows_backward(&[0.0; 6], &[0.0; 6], &mut y[..3], 3).is_err());
    }

    /// f64 layer norm; `p` = x ‖ gamma ‖ beta.
    fn ln_ref(p: &[f64], rows: usize, cols: usize, eps: f64) -> Vec<f64> {
        let (x, rest) = p.split_at(rows * cols);
        let (gamma, beta) = rest.split_at(cols);
        let mut y = Vec::with_capacity(x.len());
        for row in x.chunks(cols) {
            let mu = row.iter().sum::<f64>() / cols as f64;
            let var = row.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / cols as f64;
            let rs = 1.0 / (var + eps).sqrt();
            y.extend((0..cols).map(|j| (row[j] - mu) * rs * gamma[j] + beta[j]));
        }
        y
    }

    #[test]
    fn layer_norm_matches_reference_and_gradients() {
        let mut rng = Rng::new(21);
        let eps = 1e-5f32;
        for (rows, cols) in [(1, 1), (1, 8), (6, 1), (3, 10), (2, 37)] {
            let x: Vec<f32> = rng.vec_scaled(rows * cols, 3.0);
            let gamma: Vec<f32> = rng.vec(cols).iter().map(|v| 1.0 + 0.5 * v).collect();
            let beta = rng.vec(cols);
            let (mut y, mut mean, mut rstd) =
                (vec![0.0; x.len()], vec![0.0; rows], vec![0.0; rows]);
            layer_norm(&x, &gamma, &beta, &mut y, &mut mean, &mut rstd, cols, eps).unwrap();
            let mut p = f64s(&x);
            p.extend(f64s(&gamma));
            p.extend(f64s(&beta));
            // f64 statistics rounded to f32, then ~4 f32 roundings per element: |y| ≲ 10, so
            // 2e-6 relative plus 2e-6 absolute (for outputs near 0).
            assert_close(
                "layer_norm",
                &y,
                &ln_ref(&p, rows, cols, eps as f64),
                2e-6,
                2e-6,
            );

            let dy = rng.vec(x.len());
            let (mut dx, mut dg, mut db) = (
                vec![f32::NAN; x.len()],
                vec![f32::NAN; cols],
                vec![f32::NAN; cols],
            );
            layer_norm_backward(
                &x, &gamma, &mean, &rstd, &dy, &mut dx, &mut dg, &mut db, cols,
            )
            .unwrap();
            let want = fd_grad(|v| dot(&ln_ref(v, rows, cols, eps as f64), &dy), &p, 1e-6);
            // For cols == 1, x̂ is 0 and dx is exactly 0 in theory; the FD error is ~1e-10.
            // Cancellation in g − mean(g) − x̂·mean(g·x̂) with rstd up to ~1/√eps ≈ 316 (the
            // cols == 1 case) bounds the absolute error by ~1e-4.
            assert_close("layer_norm dx", &dx, &want[..x.len()], 1e-4, 1e-4);
            assert_close(
                "layer_norm dgamma",
                &dg,
                &want[x.len()..x.len() + cols],
                1e-5,
                1e-5,
            );
            assert_close("layer_norm dbeta", &db, &want[x.len() + cols..], 1e-5, 1e-5);
        }
    }

    #[test]
    fn layer_norm_shape_errors() {
        let (mut y, mut m, mut r) = ([0.0; 4], [0.0; 2], [0.0; 2]);
        let g = [1.0; 2];
        assert!(layer_norm(&[0.0; 4], &g, &g, &mut y, &mut m, &mut r, 0, 1e-5).is_err());
        assert!(layer_norm(&[0.0; 4], &g[..1], &g, &mut y, &mut m, &mut r, 2, 1e-5).is_err());
        assert!(layer_norm(&[0.0; 4], &g, &g, &mut y, &mut m[..1], &mut r, 2, 1e-5).is_err());
        let err = layer_norm(&[0.0; 4], &g, &g, &mut y, &mut m, &mut r[..1], 2, 1e-5).unwrap_err();
        assert!(matches!(
            err,
            KernelError::LengthMismatch {
                op: "layer_norm",
                arg: "rstd",
                expected: 2,
                actual: 1,
                ..
            }
        ));
        let (mut dx, mut dg, mut db) = ([0.0; 4], [0.0; 2], [0.0; 2]);
        assert!(layer_norm_backward(
            &[0.0; 4], &g, &m, &r, &[0.0; 3], &mut dx, &mut dg, &mut db, 2
        )
        .is_err());
        assert!(layer_norm_backward(
            &[0.0; 4],
            &g,
            &m,
            &r,
            &[0.0; 4],
            &mut dx,
            &mut dg[..1],
            &mut db,
            2
        )
        .is_err());
    }
}
