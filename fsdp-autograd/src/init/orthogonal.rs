//! [`InitOp::Orthogonal`](super::InitOp::Orthogonal): standard normals from the op's counter-based
//! stream, factored by Householder QR in `f64`, `gain · Q` rounded to `f32`. A whole-tensor op.

use super::error::{invalid, InitError};
use super::ops::InitOp;
use super::rng::{fill_random, std_normal};

pub(super) fn check_orthogonal(
    fqn: &str,
    i: usize,
    op: &InitOp,
    gain: f32,
    shape: &[usize],
) -> Result<(), InitError> {
    if !gain.is_finite() {
        return Err(invalid(fqn, i, op, "gain must be finite"));
    }
    if shape.len() < 2 {
        return Err(invalid(
            fqn,
            i,
            op,
            format!(
                "needs a tensor of at least 2 dimensions (rows × the rest), got shape {shape:?}"
            ),
        ));
    }
    Ok(())
}

/// [`InitOp::Orthogonal`] for the whole tensor (arguments already checked).
pub(super) fn orthogonal_fill(
    key: [u32; 2],
    base: u128,
    shape: &[usize],
    gain: f64,
    out: &mut [f32],
) {
    let numel = out.len();
    if numel == 0 {
        return;
    }
    let rows = shape[0];
    let cols = numel / rows;
    // Standard normals, element i from Philox block i (row-major rows × cols).
    let mut a = vec![0f64; numel];
    fill_random(key, base, 0, &mut a, std_normal);
    // Factor the tall orientation m × n (m ≥ n): the matrix itself, or its transpose.
    let tall = rows >= cols;
    let (m, n) = if tall { (rows, cols) } else { (cols, rows) };
    // Column-major m × n.
    let mut t = vec![0f64; m * n];
    for r in 0..rows {
        for c in 0..cols {
            let (i, j) = if tall { (r, c) } else { (c, r) };
            t[j * m + i] = a[r * cols + c];
        }
    }
    let q = householder_q(&mut t, m, n);
    for r in 0..rows {
        for c in 0..cols {
            let (i, j) = if tall { (r, c) } else { (c, r) };
            out[r * cols + c] = (gain * q[j * m + i]) as f32;
        }
    }
}

/// `col ← (I − 2vvᵀ) col` for a unit vector `v` of `col`'s length.
fn reflect(v: &[f64], col: &mut [f64]) {
    let d: f64 = 2.0 * v.iter().zip(col.iter()).map(|(p, q)| p * q).sum::<f64>();
    col.iter_mut().zip(v).for_each(|(c, p)| *c -= d * p);
}

/// Thin `Q` (column-major m × n) of the QR factorization of column-major `a` (m × n, m ≥ n), with
/// the signs chosen so that `R` has a non-negative diagonal (the unique factorization when `a`
/// has full rank). `a` is overwritten.
fn householder_q(a: &mut [f64], m: usize, n: usize) -> Vec<f64> {
    // Reflectors v_k (unit vectors over rows k..m), and the sign of R's diagonal entry k.
    let mut vs: Vec<Vec<f64>> = Vec::with_capacity(n);
    let mut signs = vec![1f64; n];
    for k in 0..n {
        let x = &a[k * m + k..(k + 1) * m];
        let norm = x.iter().map(|v| v * v).sum::<f64>().sqrt();
        let mut v = x.to_vec();
        if norm == 0.0 {
            vs.push(v.iter().map(|_| 0.0).collect());
            continue;
        }
        // R_kk = alpha; choose its sign opposite to x_0 for stability.
        let alpha = if x[0] >= 0.0 { -norm } else { norm };
        v[0] -= alpha;
        let vnorm = v.iter().map(|e| e * e).sum::<f64>().sqrt();
        if vnorm > 0.0 {
            v.iter_mut().for_each(|e| *e /= vnorm);
        }
        // Apply H = I − 2vvᵀ to the remaining columns.
        for j in k..n {
            reflect(&v, &mut a[j * m + k..(j + 1) * m]);
        }
        signs[k] = if alpha < 0.0 { -1.0 } else { 1.0 };
        vs.push(v);
    }
    // Q = H_0 · … · H_{n−1} · I[:, :n], then column k times sign(R_kk).
    let mut q = vec![0f64; m * n];
    for j in 0..n {
        q[j * m + j] = 1.0;
    }
    for k in (0..n).rev() {
        for j in 0..n {
            reflect(&vs[k], &mut q[j * m + k..(j + 1) * m]);
        }
    }
    for (j, s) in signs.iter().enumerate() {
        q[j * m..(j + 1) * m].iter_mut().for_each(|e| *e *= s);
    }
    q
}

#[cfg(test)]
mod tests {
    use super::super::fill::tests::no_resolve;
    use super::super::{fill_positionwise, fill_whole};
    use super::*;

    mod laws {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(64))]
            /// Orthogonal init has orthonormal columns (tall) or rows (wide), times the gain,
            /// for any shape of 2 or more dimensions; it is deterministic, differs by seed, and
            /// replaces earlier values.
            #[test]
            fn orthogonal_is_orthonormal_times_gain(
                dims in proptest::collection::vec(1usize..9, 2..4),
                gain in 0.25f32..3.0,
                seed in any::<u64>(),
            ) {
                let numel: usize = dims.iter().product();
                let (rows, cols) = (dims[0], numel / dims[0]);
                let ops = [InitOp::Fill(5.0), InitOp::Orthogonal { gain }];
                let mut q = vec![0f32; numel];
                fill_whole(&ops, seed, "w", &dims, &mut q, &mut no_resolve).unwrap();
                let mut again = vec![1f32; numel];
                let ops2 = [InitOp::Fill(-1.0), InitOp::Orthogonal { gain }];
                fill_whole(&ops2, seed, "w", &dims, &mut again, &mut no_resolve).unwrap();
                prop_assert_eq!(&q, &again);
                // Gram matrix of the short side: columns if rows ≥ cols, else rows.
                let (k, len) = if rows >= cols { (cols, rows) } else { (rows, cols) };
                let at = |a: usize, i: usize| -> f64 {
                    let (r, c) = if rows >= cols { (i, a) } else { (a, i) };
                    f64::from(q[r * cols + c])
                };
                let g2 = f64::from(gain) * f64::from(gain);
                for a in 0..k {
                    for b in 0..k {
                        let dot: f64 = (0..len).map(|i| at(a, i) * at(b, i)).sum();
                        let want = if a == b { g2 } else { 0.0 };
                        prop_assert!((dot - want).abs() < 1e-5 * g2.max(1.0), "{dot} vs {want}");
                    }
                }
                if numel > 1 {
                    let mut other = vec![0f32; numel];
                    fill_whole(&ops, seed ^ 1, "w", &dims, &mut other, &mut no_resolve).unwrap();
                    prop_assert_ne!(&q, &other);
                }
            }
        }
    }

    #[test]
    fn orthogonal_needs_two_dimensions_and_a_finite_gain() {
        let op = InitOp::Orthogonal { gain: 1.0 };
        assert!(!op.is_positionwise() && op.overwrites());
        let mut v = vec![0f32; 4];
        let err = fill_whole(
            std::slice::from_ref(&op),
            0,
            "b",
            &[4],
            &mut v,
            &mut no_resolve,
        )
        .unwrap_err();
        assert!(err.to_string().contains("at least 2 dimensions"), "{err}");
        let nan = InitOp::Orthogonal { gain: f32::NAN };
        let err = fill_whole(&[nan], 0, "w", &[2, 2], &mut v, &mut no_resolve).unwrap_err();
        assert!(err.to_string().contains("gain must be finite"), "{err}");
        // Position-wise evaluation refuses it with the usual typed error.
        let err = fill_positionwise(&[op], 0, "w", &[2, 2], 0, &mut v).unwrap_err();
        assert!(matches!(err, InitError::NotPositionwise { .. }), "{err}");
        // Empty tensors have nothing to fill.
        let mut e: Vec<f32> = Vec::new();
        fill_whole(
            &[InitOp::Orthogonal { gain: 1.0 }],
            0,
            "w",
            &[0, 3],
            &mut e,
            &mut no_resolve,
        )
        .unwrap();
    }
}
