//! Cross-entropy with integer class targets.

use super::elementwise::max_f32;
use super::embedding::check_targets;
use super::math::exp;
use crate::kernels::check;
use crate::kernels::KernelError;

/// Shape checks shared by forward and backward; returns the number of rows.
fn check_shapes(
    op: &'static str,
    logits: &[f32],
    targets: &[i64],
    lse: &[f32],
    cols: usize,
) -> Result<usize, KernelError> {
    let rows = check::rows(op, "logits", logits.len(), cols)?;
    let shape = || format!("rows={rows}, cols={cols}");
    check::len(op, "targets", targets.len(), rows, shape)?;
    check::len(op, "lse", lse.len(), rows, shape)?;
    if rows == 0 {
        return Err(KernelError::InvalidShape {
            op,
            reason: "the mean cross-entropy over zero rows is undefined; pass at least one row"
                .into(),
        });
    }
    check_targets(op, targets, cols)?;
    Ok(rows)
}

/// Mean cross-entropy of row-major `logits` (`rows × cols`) against class `targets` (one per
/// row): `loss = (1/rows) · Σ_r (lse_r − logits[r, targets[r]])` with
/// `lse_r = log Σ_j exp(logits[r, j])`.
///
/// Numerically stable (the row maximum is subtracted inside the log-sum-exp, summed in f64).
/// Saves the per-row log-sum-exp in `lse` for [`cross_entropy_backward`]. The mean is taken in
/// f64 over rows in order and returned as f32. There is no `ignore_index`: every target must be
/// a valid class.
///
/// # Errors
/// [`KernelError::InvalidShape`] if `cols == 0`, `logits` is not a whole number of rows, or there
/// are no rows; [`KernelError::LengthMismatch`] unless `targets` and `lse` have one element per
/// row; [`KernelError::IndexOutOfRange`] for a target outside `0..cols`.
///
/// ```
/// let mut lse = [0.0];
/// let loss = fsdp_autograd::kernels::cpu::cross_entropy(&[0.0, 0.0], &[1], 2, &mut lse).unwrap();
/// assert!((loss - std::f32::consts::LN_2).abs() < 1e-7);
/// ```
pub fn cross_entropy(
    logits: &[f32],
    targets: &[i64],
    cols: usize,
    lse: &mut [f32],
) -> Result<f32, KernelError> {
    let rows = check_shapes("cross_entropy", logits, targets, lse, cols)?;
    let mut total = 0.0f64;
    for (r, row) in logits.chunks_exact(cols).enumerate() {
        let max = max_f32(row);
        let mut acc = [0.0f64; 8];
        let chunks = row.chunks_exact(8);
        let tail: f64 = chunks
            .remainder()
            .iter()
            .map(|&v| exp(v - max) as f64)
            .sum();
        for c in chunks {
            for l in 0..8 {
                acc[l] += exp(c[l] - max) as f64;
            }
        }
        let s = ((acc[0] + acc[4]) + (acc[1] + acc[5]))
            + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
            + tail;
        let l = max as f64 + s.ln();
        lse[r] = l as f32;
        // `check_targets` guaranteed 0 ≤ target < cols.
        total += l - row[targets[r] as usize] as f64;
    }
    Ok((total / rows as f64) as f32)
}

/// Gradient of [`cross_entropy`] scaled by the upstream gradient `dloss`:
/// `dlogits[r, j] = (dloss / rows) · (exp(logits[r, j] − lse_r) − [j = targets[r]])`.
/// `dlogits` is overwritten.
///
/// # Errors
/// As [`cross_entropy`], plus [`KernelError::LengthMismatch`] unless `dlogits` matches `logits`.
///
/// ```
/// use fsdp_autograd::kernels::cpu::{cross_entropy, cross_entropy_backward};
/// let logits = [0.0, 0.0];
/// let mut lse = [0.0];
/// cross_entropy(&logits, &[1], 2, &mut lse).unwrap();
/// let mut d = [0.0; 2];
/// cross_entropy_backward(&logits, &[1], &lse, 1.0, &mut d, 2).unwrap();
/// assert!((d[0] - 0.5).abs() < 1e-7 && (d[1] + 0.5).abs() < 1e-7);
/// ```
pub fn cross_entropy_backward(
    logits: &[f32],
    targets: &[i64],
    lse: &[f32],
    dloss: f32,
    dlogits: &mut [f32],
    cols: usize,
) -> Result<(), KernelError> {
    let op = "cross_entropy_backward";
    let rows = check_shapes(op, logits, targets, lse, cols)?;
    check::same_len(op, "dlogits", dlogits.len(), "logits", logits.len())?;
    let g = dloss / rows as f32;
    for (r, (row, drow)) in logits
        .chunks_exact(cols)
        .zip(dlogits.chunks_exact_mut(cols))
        .enumerate()
    {
        let l = lse[r];
        for (o, &v) in drow.iter_mut().zip(row) {
            *o = g * exp(v - l);
        }
        let t = targets[r] as usize;
        drow[t] = g * (exp(row[t] - l) - 1.0);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::testutil::{assert_close, f64s, fd_grad, Rng};

    fn ce_ref(x: &[f64], targets: &[i64], cols: usize) -> f64 {
        let rows = x.len() / cols;
        let mut total = 0.0;
        for (r, row) in x.chunks(cols).enumerate() {
            let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
            total += lse - row[targets[r] as usize];
        }
        total / rows as f64
    }

    #[test]
    fn matches_reference_and_finite_differences() {
        let mut rng = Rng::new(40);
        for (rows, cols) in [(1, 1), (1, 5), (4, 1), (6, 11), (3, 40)] {
            let x = rng.vec_scaled(rows * cols, 4.0);
            let mut targets: Vec<i64> = (0..rows).map(|_| rng.below(cols) as i64).collect();
            targets[0] = cols as i64 - 1; // upper bound
            *targets.last_mut().unwrap() = 0; // lower bound (overrides for rows == 1)
            let mut lse = vec![f32::NAN; rows];
            let loss = cross_entropy(&x, &targets, cols, &mut lse).unwrap();
            let xs = f64s(&x);
            // f64 accumulation, one f32 rounding of each exp; loss of order 1 to 10.
            assert_close("loss", &[loss], &[ce_ref(&xs, &targets, cols)], 1e-6, 1e-6);

            let dloss = 1.7f32;
            let mut d = vec![f32::NAN; x.len()];
            cross_entropy_backward(&x, &targets, &lse, dloss, &mut d, cols).unwrap();
            let want: Vec<f64> = fd_grad(|v| ce_ref(v, &targets, cols), &xs, 1e-6)
                .iter()
                .map(|g| g * dloss as f64)
                .collect();
            // lse is stored in f32 (error ≤ ½ ulp ≈ 2e-7·|lse|, |lse| ≲ 8): exp(x − lse) has a
            // relative error ~2e-6; FD error ≈ 1e-10.
            assert_close("dlogits", &d, &want, 1e-5, 1e-6);
        }
    }

    #[test]
    fn stable_with_huge_logits() {
        let mut lse = [0.0];
        let loss = cross_entropy(&[1e30, 0.0, -1e30], &[0], 3, &mut lse).unwrap();
        assert_eq!(loss, 0.0);
        assert_eq!(lse[0], 1e30);
        let loss = cross_entropy(&[100.0, 0.0], &[1], 2, &mut lse).unwrap();
        assert!((loss - 100.0).abs() < 1e-4, "{loss}");
    }

    #[test]
    fn bad_targets_and_shapes_are_errors() {
        let mut lse = [0.0; 2];
        let x = [0.0; 6];
        let err = cross_entropy(&x, &[0, 3], 3, &mut lse).unwrap_err();
        assert_eq!(
            err,
            KernelError::IndexOutOfRange {
                op: "cross_entropy",
                what: "target",
                value: 3,
                position: 1,
                bound: 3
            }
        );
        assert!(cross_entropy(&x, &[-1, 0], 3, &mut lse).is_err());
        assert!(cross_entropy(&x, &[0], 3, &mut lse).is_err());
        assert!(cross_entropy(&x, &[0, 0], 3, &mut lse[..1]).is_err());
        assert!(cross_entropy(&x, &[0, 0], 4, &mut lse).is_err());
        assert!(cross_entropy(&[], &[], 3, &mut []).is_err());
        let mut d = [0.0; 5];
        assert!(cross_entropy_backward(&x, &[0, 0], &lse, 1.0, &mut d, 3).is_err());
        assert!(cross_entropy_backward(&x, &[0, 9], &lse, 1.0, &mut [0.0; 6], 3).is_err());
    }
}
