//! Embedding lookup and its (deterministic) scatter-add backward.

use crate::kernels::check;
use crate::kernels::KernelError;

/// Checks every id against `0..rows` before anything is written, returning the row indices.
fn validate_ids<'a>(
    op: &'static str,
    what: &'static str,
    ids: &'a [i64],
    rows: usize,
) -> Result<impl Iterator<Item = usize> + 'a, KernelError> {
    if let Some((position, &value)) = ids
        .iter()
        .enumerate()
        .find(|&(_, &id)| id < 0 || id as u64 >= rows as u64)
    {
        return Err(KernelError::IndexOutOfRange {
            op,
            what,
            value,
            position,
            bound: rows,
        });
    }
    // In range, hence non-negative and below `rows` (a usize): the cast is lossless.
    Ok(ids.iter().map(|&id| id as usize))
}

/// Embedding lookup: `out[i, :] = table[ids[i], :]` for a row-major `table` with `dim` columns.
///
/// All ids are validated before anything is written, so on error `out` is untouched.
///
/// # Errors
/// [`KernelError::InvalidShape`] if `dim == 0` or `table` is not a whole number of rows;
/// [`KernelError::LengthMismatch`] unless `out` has `ids.len()·dim` elements;
/// [`KernelError::IndexOutOfRange`] for an id outside `0..rows` (with its position).
///
/// ```
/// let table = [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]; // 3 rows × 2
/// let mut out = [0.0; 4];
/// fsdp_autograd::kernels::cpu::embedding(&[2, 0], &table, &mut out, 2).unwrap();
/// assert_eq!(out, [2.0, 2.5, 0.0, 0.5]);
/// assert!(fsdp_autograd::kernels::cpu::embedding(&[3], &table, &mut out[..2], 2).is_err());
/// ```
pub fn embedding(
    ids: &[i64],
    table: &[f32],
    out: &mut [f32],
    dim: usize,
) -> Result<(), KernelError> {
    let op = "embedding";
    let rows = check::rows(op, "table", table.len(), dim)?;
    let shape = || format!("ids={}, dim={dim}, table rows={rows}", ids.len());
    check::len(op, "out", out.len(), check::mul(op, ids.len(), dim)?, shape)?;
    let idx = validate_ids(op, "id", ids, rows)?;
    for (o, r) in out.chunks_exact_mut(dim).zip(idx) {
        o.copy_from_slice(&table[r * dim..(r + 1) * dim]);
    }
    Ok(())
}

/// Embedding backward: `dtable` is **overwritten** with `Σ_{i: ids[i] = r} dy[i, :]` in row `r`.
///
/// Deterministic: `dtable` is zeroed, then the rows of `dy` are added in position order
/// 0, 1, …, so repeated ids always sum in the same order. Rows that no id selects stay zero. All
/// ids are validated before anything is written.
///
/// # Errors
/// [`KernelError::InvalidShape`] if `dim == 0` or `dtable` is not a whole number of rows;
/// [`KernelError::LengthMismatch`] unless `dy` has `ids.len()·dim` elements;
/// [`KernelError::IndexOutOfRange`] for an id outside `0..rows`.
///
/// ```
/// let mut dtable = [9.0; 4]; // 2 rows × 2
/// fsdp_autograd::kernels::cpu::embedding_backward(&[1, 1], &[1.0, 2.0, 3.0, 4.0], &mut dtable, 2)
///     .unwrap();
/// assert_eq!(dtable, [0.0, 0.0, 4.0, 6.0]);
/// ```
pub fn embedding_backward(
    ids: &[i64],
    dy: &[f32],
    dtable: &mut [f32],
    dim: usize,
) -> Result<(), KernelError> {
    let op = "embedding_backward";
    let rows = check::rows(op, "dtable", dtable.len(), dim)?;
    let shape = || format!("ids={}, dim={dim}, table rows={rows}", ids.len());
    check::len(op, "dy", dy.len(), check::mul(op, ids.len(), dim)?, shape)?;
    let idx = validate_ids(op, "id", ids, rows)?;
    dtable.fill(0.0);
    for (g, r) in dy.chunks_exact(dim).zip(idx) {
        for (o, &v) in dtable[r * dim..(r + 1) * dim].iter_mut().zip(g) {
            *o += v;
        }
    }
    Ok(())
}

/// Shared with cross-entropy, which validates class targets the same way.
pub(crate) fn check_targets(
    op: &'static str,
    targets: &[i64],
    classes: usize,
) -> Result<(), KernelError> {
    validate_ids(op, "target", targets, classes).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::testutil::{assert_close, Rng};

    #[test]
    fn lookup_copies_rows_including_bounds() {
        let mut rng = Rng::new(30);
        for (rows, dim) in [(1, 1), (1, 5), (7, 1), (11, 6)] {
            let table = rng.vec(rows * dim);
            let mut ids: Vec<i64> = (0..9).map(|_| rng.below(rows) as i64).collect();
            ids.push(0);
            ids.push(rows as i64 - 1);
            let mut out = vec![f32::NAN; ids.len() * dim];
            embedding(&ids, &table, &mut out, dim).unwrap();
            for (i, &id) in ids.iter().enumerate() {
                let r = id as usize;
                assert_eq!(out[i * dim..(i + 1) * dim], table[r * dim..(r + 1) * dim]);
            }
        }
        // No ids: nothing to do.
        embedding(&[], &[1.0; 4], &mut [], 2).unwrap();
    }

    #[test]
    fn out_of_range_ids_are_errors_and_write_nothing() {
        let table = [1.0; 6];
        let mut out = [7.0; 6];
        for (bad, pos) in [(3i64, 2usize), (-1, 2), (i64::MAX, 2), (i64::MIN, 2)] {
            let err = embedding(&[0, 2, bad], &table, &mut out, 2).unwrap_err();
            assert_eq!(
                err,
                KernelError::IndexOutOfRange {
                    op: "embedding",
                    what: "id",
                    value: bad,
                    position: pos,
                    bound: 3
                }
            );
            assert!(err.to_string().contains("out of range 0..3"), "{err}");
            assert_eq!(out, [7.0; 6], "nothing written on error");
            let mut dtable = [5.0; 6];
            assert!(embedding_backward(&[0, 2, bad], &[0.0; 6], &mut dtable, 2).is_err());
            assert_eq!(dtable, [5.0; 6]);
        }
        assert!(matches!(
            embedding(&[0], &table, &mut out, 4),
            Err(KernelError::InvalidShape { .. })
        ));
        assert!(matches!(
            embedding(&[0], &table, &mut out, 2),
            Err(KernelError::LengthMismatch {
                arg: "out",
                expected: 2,
                actual: 6,
                ..
            })
        ));
        assert!(embedding_backward(&[0], &[0.0; 3], &mut [0.0; 6], 2).is_err());
        assert!(embedding_backward(&[0], &[0.0; 0], &mut [0.0; 0], 0).is_err());
    }

    #[test]
    fn backward_is_the_adjoint_with_repeated_ids() {
        // The lookup is linear, so its exact gradient is the f64 scatter-add of dy; repeated ids
        // sum in f32, error ≤ (repeats)·u·Σ|dy|.
        let mut rng = Rng::new(31);
        let (rows, dim) = (5, 3);
        let ids: Vec<i64> = vec![4, 0, 4, 4, 2, 0, 4];
        let dy = rng.vec(ids.len() * dim);
        let mut dtable = vec![f32::NAN; rows * dim];
        embedding_backward(&ids, &dy, &mut dtable, dim).unwrap();
        let mut want = vec![0.0f64; rows * dim];
        for (i, &id) in ids.iter().enumerate() {
            for j in 0..dim {
                want[id as usize * dim + j] += dy[i * dim + j] as f64;
            }
        }
        assert_close(
            "embedding_backward",
            &dtable,
            &want,
            0.0,
            4.0 * 1.2e-7 * 4.0,
        );
        // Rows 1 and 3 are never selected: exactly zero.
        assert_eq!(dtable[dim..2 * dim], [0.0; 3]);
        assert_eq!(dtable[3 * dim..4 * dim], [0.0; 3]);
        // Position order: row 4 = ((dy0 + dy2) + dy3) + dy6, bit for bit.
        for j in 0..dim {
            let s = ((dy[j] + dy[2 * dim + j]) + dy[3 * dim + j]) + dy[6 * dim + j];
            assert_eq!(dtable[4 * dim + j], s);
        }
    }
}
