//! Test cases shared by the emulator and the GPU: every CUDA kernel against the CPU kernel on
//! random inputs (bit for bit where the module documents bit-identity, within stated
//! tolerances elsewhere), plus edge cases and index errors.

use fsdp_alloc::DType;
use half::{bf16, f16};

use crate::kernels::attention::Attention;
use crate::kernels::cpu;
use crate::kernels::cuda::CudaKernelError;
use crate::kernels::{Gelu, KernelError};

use super::exec::{
    down_f32, down_u16, down_u64, nan_f32, run, up_f32, up_i64, up_u16, up_u64, CastKind, Exec, Op,
    TypedOp, H, TH,
};
pub(super) use super::flash_mma::flash_attention_mma;
pub(super) use super::fused::{
    flash_attention_f32, flash_attention_grouped, flash_attention_half, flash_attention_packed,
    gemm_half, gemm_tf32,
};

/// SplitMix64: a small deterministic generator.
pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub(super) fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    pub(super) fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| scale * self.f32()).collect()
    }

    pub(super) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn same_bits(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// Bitwise equality (any NaN equals any NaN).
pub(super) fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            same_bits(g, w),
            "{what}[{i}]: got {g:e} ({:#x}), want {w:e} ({:#x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}

/// `|got − want| ≤ rel·|want| + abs` elementwise (NaN only where the reference is NaN).
pub(super) fn assert_close(what: &str, got: &[f32], want: &[f32], rel: f32, abs: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_nan() {
            assert!(g.is_nan(), "{what}[{i}]: got {g:e}, want NaN");
            continue;
        }
        if w.is_infinite() {
            assert_eq!(g, w, "{what}[{i}]");
            continue;
        }
        let tol = rel * w.abs() + abs;
        assert!(
            (g - w).abs() <= tol,
            "{what}[{i}]: got {g:e}, want {w:e} (tolerance {tol:e})"
        );
    }
}

pub(super) fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0.0f32, |m, x| m.max(x.abs()))
}

fn index_error(r: Result<(), CudaKernelError>) -> KernelError {
    match r {
        Err(CudaKernelError::Kernel(e @ KernelError::IndexOutOfRange { .. })) => e,
        other => panic!("expected an index error, got {other:?}"),
    }
}

/// add, mul, scale, scale_inplace, add_scaled: bit-identical to the CPU.
pub(super) fn elementwise(e: &mut dyn Exec) {
    let mut r = Rng::new(1);
    for n in [0usize, 1, 257, 3000] {
        let a = r.vec(n, 3.0);
        let b = r.vec(n, 3.0);
        let (ha, hb) = (up_f32(e, &a), up_f32(e, &b));
        let mut want = vec![0.0; n];

        let out = nan_f32(e, n);
        run(e, Op::Add { a: ha, b: hb, out });
        cpu::add(&a, &b, &mut want).unwrap();
        assert_bits("add", &down_f32(e, out), &want);

        let out = nan_f32(e, n);
        run(e, Op::Mul { a: ha, b: hb, out });
        cpu::mul(&a, &b, &mut want).unwrap();
        assert_bits("mul", &down_f32(e, out), &want);

        let out = nan_f32(e, n);
        run(
            e,
            Op::Scale {
                x: ha,
                alpha: -0.375,
                out,
            },
        );
        cpu::scale(&a, -0.375, &mut want).unwrap();
        assert_bits("scale", &down_f32(e, out), &want);

        let y = up_f32(e, &a);
        run(e, Op::ScaleInplace { y, alpha: 1.7 });
        let mut w = a.clone();
        cpu::scale_inplace(&mut w, 1.7);
        assert_bits("scale_inplace", &down_f32(e, y), &w);

        for alpha in [1.0f32, 0.3] {
            let y = up_f32(e, &b);
            run(e, Op::AddScaled { y, alpha, x: ha });
            let mut w = b.clone();
            cpu::add_scaled(&mut w, alpha, &a).unwrap();
            assert_bits("add_scaled", &down_f32(e, y), &w);
        }
    }
}

/// Row bias (out of place and in place) and column sums: bit-identical. The column sums stage
/// tiles of 256 rows × 8 columns: the shapes include one row, one column, rows and columns that
/// are not multiples of the tile (several tiles with a partial last one), and exact multiples.
pub(super) fn row_bias_and_col_sums(e: &mut dyn Exec) {
    let mut r = Rng::new(2);
    for (rows, cols) in [
        (1usize, 1usize),
        (37, 19),
        (3, 300),
        (0, 5),
        (1, 17),
        (600, 1),
        (513, 13),
        (256, 16),
    ] {
        let x = r.vec(rows * cols, 2.0);
        let bias = r.vec(cols, 2.0);
        let (hx, hb) = (up_f32(e, &x), up_f32(e, &bias));
        let mut want = vec![0.0; x.len()];

        let out = nan_f32(e, x.len());
        run(
            e,
            Op::AddRowBias {
                x: hx,
                bias: hb,
                out,
            },
        );
        cpu::add_row_bias(&x, &bias, &mut want).unwrap();
        assert_bits("add_row_bias", &down_f32(e, out), &want);

        let y = up_f32(e, &x);
        run(e, Op::AddRowBiasInplace { y, bias: hb });
        assert_bits("add_row_bias_inplace", &down_f32(e, y), &want);

        let out = nan_f32(e, cols);
        run(e, Op::ColSums { x: hx, out });
        let mut w = vec![0.0; cols];
        cpu::col_sums(&x, &mut w).unwrap();
        assert_bits("col_sums", &down_f32(e, out), &w);
    }
}

/// sum and mean: f64 accumulation in another order than the CPU, so equal up to the final
/// rounding.
pub(super) fn sum_and_mean(e: &mut dyn Exec) {
    let mut r = Rng::new(3);
    for n in [0usize, 1, 1000, 20_000] {
        let x: Vec<f32> = r.vec(n, 5.0).iter().map(|v| v + 1.0).collect();
        let hx = up_f32(e, &x);
        let total: f32 = x.iter().map(|v| v.abs()).sum();
        let out = nan_f32(e, 1);
        run(e, Op::Sum { x: hx, out });
        assert_close("sum", &down_f32(e, out), &[cpu::sum(&x)], 0.0, 1e-6 * total);
        if n > 0 {
            let out = nan_f32(e, 1);
            run(e, Op::Mean { x: hx, out });
            let want = cpu::mean(&x).unwrap();
            assert_close(
                "mean",
                &down_f32(e, out),
                &[want],
                0.0,
                1e-6 * total / n as f32,
            );
        }
    }
}

/// GELU and its backward: CUDA's expf vs the CPU's polynomial (≤ 2 ulp each).
pub(super) fn gelu(e: &mut dyn Exec) {
    let mut r = Rng::new(4);
    let mut x = r.vec(2000, 6.0);
    x.extend([
        0.0, -0.0, 1e-3, -1e-3, 10.0, -10.0, 50.0, -50.0, 100.0, -100.0,
    ]);
    let dy = r.vec(x.len(), 1.0);
    let (hx, hdy) = (up_f32(e, &x), up_f32(e, &dy));
    let y = nan_f32(e, x.len());
    let kind = Gelu::Tanh;
    run(e, Op::Gelu { kind, x: hx, y });
    let mut want = vec![0.0; x.len()];
    cpu::gelu(&x, &mut want).unwrap();
    assert_close("gelu", &down_f32(e, y), &want, 2e-6, 1e-37);
    let dx = nan_f32(e, x.len());
    run(
        e,
        Op::GeluBackward {
            kind,
            x: hx,
            dy: hdy,
            dx,
        },
    );
    cpu::gelu_backward(&x, &dy, &mut want).unwrap();
    assert_close("gelu_backward", &down_f32(e, dx), &want, 1e-5, 1e-6);
}

/// Exact (erf) GELU and its backward: the device's erfcf/expf vs the CPU's vectorizable normal
/// CDF (relative error below 4e-6 for |x| < 5) and polynomial exp.
pub(super) fn gelu_exact(e: &mut dyn Exec) {
    let mut r = Rng::new(41);
    let mut x = r.vec(2000, 6.0);
    x.extend([
        0.0, -0.0, 1e-3, -1e-3, 3.0, -3.0, 10.0, -10.0, 50.0, -50.0, 100.0, -100.0,
    ]);
    let dy = r.vec(x.len(), 1.0);
    let (hx, hdy) = (up_f32(e, &x), up_f32(e, &dy));
    let y = nan_f32(e, x.len());
    let kind = Gelu::Exact;
    run(e, Op::Gelu { kind, x: hx, y });
    let mut want = vec![0.0; x.len()];
    cpu::gelu_exact(&x, &mut want).unwrap();
    // The CPU's Φ is within 4e-6 relative for |x| < 5 and ~1e-5 at x = −10 (the rounding of
    // x²/2 amplified by exp(−x²/2)).
    assert_close("gelu_exact", &down_f32(e, y), &want, 1.5e-5, 1e-37);
    let dx = nan_f32(e, x.len());
    run(
        e,
        Op::GeluBackward {
            kind,
            x: hx,
            dy: hdy,
            dx,
        },
    );
    cpu::gelu_exact_backward(&x, &dy, &mut want).unwrap();
    assert_close("gelu_exact_backward", &down_f32(e, dx), &want, 1e-5, 1e-6);
}

/// Row softmax and its backward (the backward is fed the CPU's forward output).
pub(super) fn softmax(e: &mut dyn Exec) {
    let mut r = Rng::new(5);
    for (rows, cols) in [(1usize, 1usize), (3, 5), (4, 300), (37, 7), (2, 1000)] {
        let mut x = r.vec(rows * cols, 5.0);
        if cols >= 3 {
            x[..3].copy_from_slice(&[1e30, 1e30, -1e30]);
        }
        let hx = up_f32(e, &x);
        let y = nan_f32(e, x.len());
        run(e, Op::Softmax { x: hx, y, cols });
        let mut want = vec![0.0; x.len()];
        cpu::softmax_rows(&x, &mut want, cols).unwrap();
        assert_close("softmax", &down_f32(e, y), &want, 5e-6, 1e-30);

        let dy = r.vec(x.len(), 1.0);
        let (hy, hdy) = (up_f32(e, &want), up_f32(e, &dy));
        let dx = nan_f32(e, x.len());
        run(
            e,
            Op::SoftmaxBackward {
                y: hy,
                dy: hdy,
                dx,
                cols,
            },
        );
        let mut wdx = vec![0.0; x.len()];
        cpu::softmax_rows_backward(&want, &dy, &mut wdx, cols).unwrap();
        assert_close("softmax_backward", &down_f32(e, dx), &wdx, 1e-5, 1e-6);
    }
}

/// Layer norm: forward within f32 rounding of the CPU; the backward, fed the CPU's saved
/// statistics, gives bit-identical parameter gradients (column reductions over tiles of 256
/// rows × 8 columns: one row, one column, partial tiles and several tiles are covered).
pub(super) fn layer_norm(e: &mut dyn Exec) {
    let mut r = Rng::new(6);
    let eps = 1e-5f32;
    for (rows, cols) in [
        (1usize, 1usize),
        (5, 8),
        (3, 300),
        (64, 33),
        (0, 4),
        (1, 21),
        (300, 1),
        (530, 11),
    ] {
        let x: Vec<f32> = r.vec(rows * cols, 3.0).iter().map(|v| v + 10.0).collect();
        let gamma: Vec<f32> = r.vec(cols, 0.5).iter().map(|v| v + 1.0).collect();
        let beta = r.vec(cols, 1.0);
        let (hx, hg, hb) = (up_f32(e, &x), up_f32(e, &gamma), up_f32(e, &beta));
        let (y, mean, rstd) = (nan_f32(e, x.len()), nan_f32(e, rows), nan_f32(e, rows));
        run(
            e,
            Op::LayerNorm {
                x: hx,
                gamma: hg,
                beta: hb,
                y,
                mean,
                rstd,
                cols,
                eps,
            },
        );
        let (mut wy, mut wm, mut wr) = (vec![0.0; x.len()], vec![0.0; rows], vec![0.0; rows]);
        cpu::layer_norm(&x, &gamma, &beta, &mut wy, &mut wm, &mut wr, cols, eps).unwrap();
        assert_close("layer_norm mean", &down_f32(e, mean), &wm, 2e-7, 0.0);
        assert_close("layer_norm rstd", &down_f32(e, rstd), &wr, 2e-7, 0.0);
        assert_close("layer_norm y", &down_f32(e, y), &wy, 1e-5, 1e-5);

        let dy = r.vec(x.len(), 1.0);
        let (hm, hr, hdy) = (up_f32(e, &wm), up_f32(e, &wr), up_f32(e, &dy));
        let (dx, dg, db) = (nan_f32(e, x.len()), nan_f32(e, cols), nan_f32(e, cols));
        run(
            e,
            Op::LayerNormBackward {
                x: hx,
                gamma: hg,
                mean: hm,
                rstd: hr,
                dy: hdy,
                dx,
                dgamma: dg,
                dbeta: db,
                cols,
            },
        );
        let (mut wdx, mut wdg, mut wdb) = (vec![0.0; x.len()], vec![0.0; cols], vec![0.0; cols]);
        cpu::layer_norm_backward(
            &x, &gamma, &wm, &wr, &dy, &mut wdx, &mut wdg, &mut wdb, cols,
        )
        .unwrap();
        let scale = max_abs(&wdx).max(1.0);
        assert_close("layer_norm dx", &down_f32(e, dx), &wdx, 1e-4, 1e-5 * scale);
        assert_bits("layer_norm dgamma", &down_f32(e, dg), &wdg);
        assert_bits("layer_norm dbeta", &down_f32(e, db), &wdb);
    }
}

/// Embedding forward and the sorted, atomic-free backward: bit-identical (position order).
pub(super) fn embedding(e: &mut dyn Exec) {
    let mut r = Rng::new(7);
    for (vocab, dim, n) in [
        (37usize, 5usize, 700usize),
        (4, 300, 9),
        (3, 2, 1),
        (5, 3, 0),
    ] {
        let table = r.vec(vocab * dim, 1.0);
        let ids: Vec<i64> = (0..n)
            .map(|i| if i % 3 == 0 { 1 } else { r.below(vocab) as i64 })
            .collect();
        let (hids, ht) = (up_i64(e, &ids), up_f32(e, &table));
        let out = nan_f32(e, n * dim);
        run(
            e,
            Op::Embedding {
                ids: hids,
                table: ht,
                out,
                dim,
            },
        );
        let mut want = vec![0.0; n * dim];
        cpu::embedding(&ids, &table, &mut want, dim).unwrap();
        assert_bits("embedding", &down_f32(e, out), &want);

        let dy = r.vec(n * dim, 1.0);
        let hdy = up_f32(e, &dy);
        let mut wdt = vec![0.0; vocab * dim];
        cpu::embedding_backward(&ids, &dy, &mut wdt, dim).unwrap();
        for round in 0..2 {
            let dt = nan_f32(e, vocab * dim);
            run(
                e,
                Op::EmbeddingBackward {
                    ids: hids,
                    dy: hdy,
                    dtable: dt,
                    dim,
                },
            );
            assert_bits(
                &format!("embedding_backward (run {round})"),
                &down_f32(e, dt),
                &wdt,
            );
        }
    }
}

/// Out-of-range ids: reported with the first position and its value; the forward writes NaN
/// rows for them, the backward skips them.
pub(super) fn embedding_bad_ids(e: &mut dyn Exec) {
    let (vocab, dim) = (37usize, 3usize);
    let mut r = Rng::new(8);
    let table = r.vec(vocab * dim, 1.0);
    let ids: Vec<i64> = vec![3, 40, 5, -1, 2, 3];
    let (hids, ht) = (up_i64(e, &ids), up_f32(e, &table));
    let out = nan_f32(e, ids.len() * dim);
    let err = index_error(e.run(&Op::Embedding {
        ids: hids,
        table: ht,
        out,
        dim,
    }));
    assert_eq!(
        err,
        KernelError::IndexOutOfRange {
            op: "embedding",
            what: "id",
            value: 40,
            position: 1,
            bound: vocab
        }
    );
    let got = down_f32(e, out);
    for (i, &id) in ids.iter().enumerate() {
        let row = &got[i * dim..(i + 1) * dim];
        if (0..vocab as i64).contains(&id) {
            assert_bits(
                "embedding valid row",
                row,
                &table[id as usize * dim..(id as usize + 1) * dim],
            );
        } else {
            assert!(
                row.iter().all(|v| v.is_nan()),
                "row {i} of bad id {id}: {row:?}"
            );
        }
    }
    let dy = r.vec(ids.len() * dim, 1.0);
    let hdy = up_f32(e, &dy);
    let dt = nan_f32(e, vocab * dim);
    let err = index_error(e.run(&Op::EmbeddingBackward {
        ids: hids,
        dy: hdy,
        dtable: dt,
        dim,
    }));
    assert_eq!(
        err,
        KernelError::IndexOutOfRange {
            op: "embedding_backward",
            what: "id",
            value: 40,
            position: 1,
            bound: vocab
        }
    );
    // The valid positions alone, in order, give the same sums.
    let keep: Vec<usize> = (0..ids.len())
        .filter(|&i| (0..vocab as i64).contains(&ids[i]))
        .collect();
    let vids: Vec<i64> = keep.iter().map(|&i| ids[i]).collect();
    let vdy: Vec<f32> = keep
        .iter()
        .flat_map(|&i| dy[i * dim..(i + 1) * dim].to_vec())
        .collect();
    let mut want = vec![0.0; vocab * dim];
    cpu::embedding_backward(&vids, &vdy, &mut want, dim).unwrap();
    assert_bits(
        "embedding_backward skipping bad ids",
        &down_f32(e, dt),
        &want,
    );
}

/// Cross-entropy forward (loss, lse) and backward; a bad target is reported and poisons its row.
pub(super) fn cross_entropy(e: &mut dyn Exec) {
    let mut r = Rng::new(9);
    for (rows, cols) in [(1usize, 1usize), (6, 11), (3, 300), (40, 5)] {
        let x = r.vec(rows * cols, 4.0);
        let targets: Vec<i64> = (0..rows)
            .map(|i| {
                if i == 0 {
                    cols as i64 - 1
                } else {
                    r.below(cols) as i64
                }
            })
            .collect();
        let (hx, ht) = (up_f32(e, &x), up_i64(e, &targets));
        let (lse, loss) = (nan_f32(e, rows), nan_f32(e, 1));
        run(
            e,
            Op::CrossEntropy {
                logits: hx,
                targets: ht,
                cols,
                lse,
                loss,
            },
        );
        let mut wl = vec![0.0; rows];
        let wloss = cpu::cross_entropy(&x, &targets, cols, &mut wl).unwrap();
        assert_close("cross_entropy lse", &down_f32(e, lse), &wl, 1e-6, 1e-6);
        assert_close(
            "cross_entropy loss",
            &down_f32(e, loss),
            &[wloss],
            1e-5,
            1e-6,
        );

        let hl = up_f32(e, &wl);
        let dloss = up_f32(e, &[1.7]);
        let dl = nan_f32(e, x.len());
        run(
            e,
            Op::CrossEntropyBackward {
                logits: hx,
                targets: ht,
                lse: hl,
                dloss,
                dlogits: dl,
                cols,
            },
        );
        let mut want = vec![0.0; x.len()];
        cpu::cross_entropy_backward(&x, &targets, &wl, 1.7, &mut want, cols).unwrap();
        assert_close(
            "cross_entropy_backward",
            &down_f32(e, dl),
            &want,
            1e-5,
            1e-6 * max_abs(&want),
        );
    }
    // A target out of range.
    let (rows, cols) = (3usize, 4usize);
    let x = r.vec(rows * cols, 1.0);
    let (hx, ht) = (up_f32(e, &x), up_i64(e, &[0, 4, 1]));
    let (lse, loss) = (nan_f32(e, rows), nan_f32(e, 1));
    let err = index_error(e.run(&Op::CrossEntropy {
        logits: hx,
        targets: ht,
        cols,
        lse,
        loss,
    }));
    assert_eq!(
        err,
        KernelError::IndexOutOfRange {
            op: "cross_entropy",
            what: "target",
            value: 4,
            position: 1,
            bound: cols
        }
    );
    assert!(
        down_f32(e, loss)[0].is_nan(),
        "the mean over a bad row is NaN"
    );
    let dloss = up_f32(e, &[1.0]);
    let dl = nan_f32(e, x.len());
    let err = index_error(e.run(&Op::CrossEntropyBackward {
        logits: hx,
        targets: ht,
        lse,
        dloss,
        dlogits: dl,
        cols,
    }));
    assert!(err.to_string().contains("target 4 at position 1"), "{err}");
    let got = down_f32(e, dl);
    assert!(got[cols..2 * cols].iter().all(|v| v.is_nan()));
    assert!(got[..cols]
        .iter()
        .chain(&got[2 * cols..])
        .all(|v| v.is_finite()));
}

/// Causal attention forward and backward (the backward is fed the CPU's probabilities), with
/// the default scale and, on two shapes, another one.
pub(super) fn attention(e: &mut dyn Exec) {
    let mut r = Rng::new(10);
    for (batch, heads, t, d, scale) in [
        (1usize, 1usize, 1usize, 1usize, None),
        (2, 3, 5, 4, None),
        (1, 2, 17, 8, None),
        (1, 1, 40, 16, None),
        (1, 1, 3, 0, None),
        (2, 3, 5, 4, Some(1.0f32)),
        (1, 2, 17, 8, Some(0.07)),
    ] {
        let a = Attention {
            scale: scale.unwrap_or(Attention::default_scale(d)),
            ..Attention::new(batch, heads, t, d)
        };
        let n = batch * heads * t * d;
        let np = batch * heads * t * t;
        let (q, k, v) = (r.vec(n, 1.0), r.vec(n, 1.0), r.vec(n, 1.0));
        let (hq, hk, hv) = (up_f32(e, &q), up_f32(e, &k), up_f32(e, &v));
        let (out, probs) = (nan_f32(e, n), nan_f32(e, np));
        run(
            e,
            Op::Attention {
                q: hq,
                k: hk,
                v: hv,
                out,
                probs,
                a,
            },
        );
        let (mut wo, mut wp) = (vec![0.0; n], vec![0.0; np]);
        cpu::causal_attention_with(&q, &k, &v, &mut wo, &mut wp, &a).unwrap();
        let gp = down_f32(e, probs);
        assert_close("attention probs", &gp, &wp, 1e-5, 1e-6);
        for (i, (&g, &w)) in gp.iter().zip(&wp).enumerate() {
            if (i % t) > (i / t) % t {
                assert_eq!(
                    (g, w),
                    (0.0, 0.0),
                    "masked probability {i} must be exactly 0"
                );
            }
        }
        assert_close("attention out", &down_f32(e, out), &wo, 1e-4, 1e-5);

        let dout = r.vec(n, 1.0);
        let (hp, hdo) = (up_f32(e, &wp), up_f32(e, &dout));
        let (dq, dk, dv) = (nan_f32(e, n), nan_f32(e, n), nan_f32(e, n));
        run(
            e,
            Op::AttentionBackward {
                q: hq,
                k: hk,
                v: hv,
                probs: hp,
                dout: hdo,
                dq,
                dk,
                dv,
                a,
            },
        );
        let (mut wdq, mut wdk, mut wdv) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        cpu::causal_attention_backward_with(
            &q, &k, &v, &wp, &dout, &mut wdq, &mut wdk, &mut wdv, &a,
        )
        .unwrap();
        for (name, h, w) in [("dq", dq, &wdq), ("dk", dk, &wdk), ("dv", dv, &wdv)] {
            let tol = 1e-5 * max_abs(w).max(1.0);
            assert_close(&format!("attention {name}"), &down_f32(e, h), w, 1e-4, tol);
        }
    }
}

/// Batched matrix products for every transposition, with and without accumulation, and the
/// empty-inner-dimension cases; tolerance from the rounding bound `(k + 2)·2u·Σ|a||b|`.
pub(super) fn bmm(e: &mut dyn Exec) {
    let mut r = Rng::new(11);
    for (batch, m, k, n) in [
        (1usize, 3usize, 4usize, 2usize),
        (3, 5, 7, 6),
        (2, 1, 33, 1),
        (1, 2, 0, 3),
    ] {
        for ta in [false, true] {
            for tb in [false, true] {
                for acc in [false, true] {
                    let (a, b) = (r.vec(batch * m * k, 1.0), r.vec(batch * k * n, 1.0));
                    let c0 = r.vec(batch * m * n, 1.0);
                    let (ha, hb, hc) = (up_f32(e, &a), up_f32(e, &b), up_f32(e, &c0));
                    run(
                        e,
                        Op::Bmm {
                            a: ha,
                            b: hb,
                            c: hc,
                            batch,
                            m,
                            k,
                            n,
                            ta,
                            tb,
                            acc,
                        },
                    );
                    let mut want = c0.clone();
                    cpu::bmm(&a, &b, &mut want, batch, m, k, n, ta, tb, acc).unwrap();
                    let (aa, ab): (Vec<f32>, Vec<f32>) = (
                        a.iter().map(|v| v.abs()).collect(),
                        b.iter().map(|v| v.abs()).collect(),
                    );
                    let mut bound = vec![0.0; batch * m * n];
                    cpu::bmm(&aa, &ab, &mut bound, batch, m, k, n, ta, tb, false).unwrap();
                    let got = down_f32(e, hc);
                    for i in 0..got.len() {
                        let base = if acc { c0[i].abs() } else { 0.0 };
                        let tol = (k as f32 + 2.0) * 2.0 * f32::EPSILON * (bound[i] + base) + 1e-30;
                        assert!(
                            (got[i] - want[i]).abs() <= tol,
                            "bmm batch={batch} m={m} k={k} n={n} ta={ta} tb={tb} acc={acc} [{i}]: \
                             got {} want {} (tolerance {tol:e})",
                            got[i],
                            want[i]
                        );
                    }
                }
            }
        }
    }
}

/// f16/bf16 casts: bit-identical to `half` (NaN payloads excepted for f16).
pub(super) fn casts(e: &mut dyn Exec) {
    let mut r = Rng::new(12);
    let mut x: Vec<f32> = vec![
        0.0,
        -0.0,
        1.0,
        -1.5,
        65504.0,
        65519.0,
        65520.0,
        1e6,
        1e-8,
        6e-8,
        3e-5,
        1.0 + 1.0 / 2048.0,
        1.0 + 3.0 / 2048.0,
        1.0 + 1.0 / 256.0,
        1.0 + 3.0 / 256.0,
        f32::MAX,
        f32::MIN_POSITIVE,
        1e-40,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(0x7f80_0001),
    ];
    x.extend(r.vec(500, 100.0));
    let hx = up_f32(e, &x);

    let dst = up_u16(e, &vec![0xdead; x.len()]);
    run(
        e,
        Op::Cast {
            kind: CastKind::F32ToF16,
            src: hx,
            dst,
        },
    );
    let mut want = vec![f16::ZERO; x.len()];
    cpu::cast_f32_to_f16(&x, &mut want).unwrap();
    for (i, (g, w)) in down_u16(e, dst).iter().zip(&want).enumerate() {
        let g = f16::from_bits(*g);
        assert!(
            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
            "f32→f16 of {:e}: got {:#x} want {:#x}",
            x[i],
            g.to_bits(),
            w.to_bits()
        );
    }

    let dst = up_u16(e, &vec![0xdead; x.len()]);
    run(
        e,
        Op::Cast {
            kind: CastKind::F32ToBf16,
            src: hx,
            dst,
        },
    );
    let mut want = vec![bf16::ZERO; x.len()];
    cpu::cast_f32_to_bf16(&x, &mut want).unwrap();
    let got = down_u16(e, dst);
    let want: Vec<u16> = want.iter().map(|v| v.to_bits()).collect();
    assert_eq!(got, want, "f32→bf16 bits");

    let all: Vec<u16> = (0..=u16::MAX).collect();
    let hall = up_u16(e, &all);
    let dst = nan_f32(e, all.len());
    run(
        e,
        Op::Cast {
            kind: CastKind::F16ToF32,
            src: hall,
            dst,
        },
    );
    let src: Vec<f16> = all.iter().map(|&b| f16::from_bits(b)).collect();
    let mut want = vec![0.0f32; all.len()];
    cpu::cast_f16_to_f32(&src, &mut want).unwrap();
    assert_bits("f16→f32 (every bit pattern)", &down_f32(e, dst), &want);

    let dst = nan_f32(e, all.len());
    run(
        e,
        Op::Cast {
            kind: CastKind::Bf16ToF32,
            src: hall,
            dst,
        },
    );
    let src: Vec<bf16> = all.iter().map(|&b| bf16::from_bits(b)).collect();
    cpu::cast_bf16_to_f32(&src, &mut want).unwrap();
    let got = down_f32(e, dst);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "bf16→f32 of {i:#x}");
    }
}

/// Strided gathers of 2-, 4- and 8-byte elements and the scatter-add into injective views.
pub(super) fn strided(e: &mut dyn Exec) {
    let mut r = Rng::new(13);
    let views: [(usize, Vec<usize>, Vec<usize>); 5] = [
        (0, vec![6, 4], vec![1, 6]),        // transpose of 4×6
        (7, vec![2, 3], vec![6, 1]),        // narrow
        (0, vec![3, 4], vec![0, 1]),        // broadcast (copy only)
        (5, vec![], vec![]),                // one element
        (1, vec![2, 2, 3], vec![12, 1, 4]), // permuted 3-D
    ];
    let src = r.vec(24, 1.0);
    let hs = up_f32(e, &src);
    let src64: Vec<u64> = (0..24u64).map(|i| i * 0x0101_0101_0101 + 7).collect();
    let hs64 = up_u64(e, &src64);
    let src16: Vec<u16> = (0..24u16).map(|i| i * 0x0301 + 1).collect();
    let hs16 = up_u16(e, &src16);
    for (offset, shape, strides) in &views {
        let numel: usize = shape.iter().product();
        let dst = nan_f32(e, numel);
        run(
            e,
            Op::StridedCopy {
                src: hs,
                offset: *offset,
                shape: shape.clone(),
                strides: strides.clone(),
                dst,
                dtype: DType::F32,
            },
        );
        let mut want = vec![0.0f32; numel];
        cpu::strided_copy(&src, *offset, shape, strides, &mut want).unwrap();
        assert_bits("strided_copy f32", &down_f32(e, dst), &want);

        let dst = up_u64(e, &vec![0; numel]);
        run(
            e,
            Op::StridedCopy {
                src: hs64,
                offset: *offset,
                shape: shape.clone(),
                strides: strides.clone(),
                dst,
                dtype: DType::I64,
            },
        );
        let mut want = vec![0u64; numel];
        cpu::strided_copy(&src64, *offset, shape, strides, &mut want).unwrap();
        assert_eq!(down_u64(e, dst), want, "strided_copy 8-byte");

        let dst = up_u16(e, &vec![0; numel]);
        run(
            e,
            Op::StridedCopy {
                src: hs16,
                offset: *offset,
                shape: shape.clone(),
                strides: strides.clone(),
                dst,
                dtype: DType::BF16,
            },
        );
        let mut want = vec![0u16; numel];
        cpu::strided_copy(&src16, *offset, shape, strides, &mut want).unwrap();
        assert_eq!(down_u16(e, dst), want, "strided_copy 2-byte");

        if strides.contains(&0) {
            continue;
        }
        let add = r.vec(numel, 1.0);
        let (hd, ha) = (up_f32(e, &src), up_f32(e, &add));
        run(
            e,
            Op::StridedAdd {
                dst: hd,
                offset: *offset,
                shape: shape.clone(),
                strides: strides.clone(),
                src: ha,
            },
        );
        let mut want = src.clone();
        cpu::strided_add_assign(&mut want, *offset, shape, strides, &add).unwrap();
        assert_bits("strided_add_assign", &down_f32(e, hd), &want);
    }
}

/// zero and copy.
pub(super) fn zero_and_copy(e: &mut dyn Exec) {
    let mut r = Rng::new(14);
    let x = r.vec(1001, 1.0);
    let hx = up_f32(e, &x);
    let dst = nan_f32(e, x.len());
    run(e, Op::Copy { src: hx, dst });
    assert_bits("copy", &down_f32(e, dst), &x);
    run(e, Op::Zero { buf: dst });
    assert_bits("zero", &down_f32(e, dst), &vec![0.0; x.len()]);
}

/// Repeated calls give the same bits (no atomics, fixed reduction trees, fixed cuBLAS handle).
pub(super) fn deterministic(e: &mut dyn Exec) {
    let mut r = Rng::new(15);
    let (rows, cols) = (50usize, 700usize);
    let x = r.vec(rows * cols, 8.0);
    let hx = up_f32(e, &x);
    let mut first: Option<Vec<Vec<f32>>> = None;
    for _ in 0..3 {
        let y = nan_f32(e, x.len());
        run(e, Op::Softmax { x: hx, y, cols });
        let s = nan_f32(e, 1);
        run(e, Op::Sum { x: hx, out: s });
        let c = nan_f32(e, rows * rows);
        run(
            e,
            Op::Bmm {
                a: hx,
                b: hx,
                c,
                batch: 1,
                m: rows,
                k: cols,
                n: rows,
                ta: false,
                tb: true,
                acc: false,
            },
        );
        let now = vec![down_f32(e, y), down_f32(e, s), down_f32(e, c)];
        match &first {
            None => first = Some(now),
            Some(f) => {
                for (a, b) in f.iter().zip(&now) {
                    assert_bits("repeated call", b, a);
                }
            }
        }
    }
}

/// SGD (plain, momentum, Nesterov, weight decay), AdamW and LAMB's two halves over two steps:
/// bit-identical to the CPU kernels (same operations in the same order, no FMA).
pub(super) fn optimizer_steps(e: &mut dyn Exec) {
    use crate::kernels::optim::{self as co, AdamCoeffs, LambCoeffs, SgdRule};
    let mut r = Rng::new(21);
    for n in [1usize, 257, 3000] {
        let p0 = r.vec(n, 2.0);
        let grads = [r.vec(n, 1.0), r.vec(n, 1.0)];
        // SGD, every configuration.
        let rules = [
            SgdRule::new(0.1),
            SgdRule::new(0.1).with_weight_decay(0.01),
            SgdRule::new(0.05).with_momentum(0.9),
            SgdRule::new(0.05)
                .with_momentum(0.9)
                .with_weight_decay(0.1)
                .with_nesterov(true),
        ];
        for rule in rules {
            let (hp, hb) = (up_f32(e, &p0), up_f32(e, &vec![0.0; n]));
            let (mut p, mut b) = (p0.clone(), vec![0.0; n]);
            for (step, g) in grads.iter().enumerate() {
                let hg = up_f32(e, g);
                let first = step == 0;
                let buf = rule.has_momentum().then_some(hb);
                run(
                    e,
                    Op::SgdStep {
                        rule,
                        first,
                        p: hp,
                        g: hg,
                        buf,
                    },
                );
                let cb = rule.has_momentum().then_some(&mut b[..]);
                co::sgd_step(&rule, &mut p, g, cb, first).unwrap();
            }
            assert_bits("sgd p", &down_f32(e, hp), &p);
            if rule.has_momentum() {
                assert_bits("sgd buf", &down_f32(e, hb), &b);
            }
        }
        // AdamW.
        let (hp, hm, hv) = (
            up_f32(e, &p0),
            up_f32(e, &vec![0.0; n]),
            up_f32(e, &vec![0.0; n]),
        );
        let (mut p, mut m, mut v) = (p0.clone(), vec![0.0; n], vec![0.0; n]);
        for (step, g) in grads.iter().enumerate() {
            let c = AdamCoeffs::new(1e-2, (0.9, 0.999), 1e-8, 0.01, step as u64 + 1);
            let hg = up_f32(e, g);
            run(
                e,
                Op::AdamWStep {
                    c,
                    p: hp,
                    g: hg,
                    m: hm,
                    v: hv,
                },
            );
            co::adamw_step(&c, &mut p, g, &mut m, &mut v).unwrap();
        }
        assert_bits("adamw p", &down_f32(e, hp), &p);
        assert_bits("adamw m", &down_f32(e, hm), &m);
        assert_bits("adamw v", &down_f32(e, hv), &v);
        // LAMB: direction, then apply with norms given as sums.
        let c = LambCoeffs::new(1e-2, (0.9, 0.999), 1e-6, 0.01, 1);
        let (hp, hm, hv, hu) = (
            up_f32(e, &p0),
            up_f32(e, &vec![0.0; n]),
            up_f32(e, &vec![0.0; n]),
            nan_f32(e, n),
        );
        let hg = up_f32(e, &grads[0]);
        run(
            e,
            Op::LambDirection {
                c,
                p: hp,
                g: hg,
                m: hm,
                v: hv,
                u: hu,
            },
        );
        let (mut m, mut v, mut u) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        co::lamb_direction(&c, &p0, &grads[0], &mut m, &mut v, &mut u).unwrap();
        assert_bits("lamb u", &down_f32(e, hu), &u);
        assert_bits("lamb m", &down_f32(e, hm), &m);
        let sums = [co::sum_sq(&p0) as f32, co::sum_sq(&u) as f32, 0.0];
        let hs = up_f32(e, &sums);
        for (w_sq, u_sq) in [(0, 1), (2, 1)] {
            let hp2 = up_f32(e, &p0);
            run(
                e,
                Op::LambApply {
                    lr: 0.1,
                    w_sq,
                    u_sq,
                    sums: hs,
                    u: hu,
                    p: hp2,
                },
            );
            let mut p = p0.clone();
            co::lamb_apply(&mut p, &u, 0.1, sums[w_sq] as f64, sums[u_sq] as f64).unwrap();
            assert_bits("lamb p", &down_f32(e, hp2), &p);
        }
    }
}

/// Sums of squares over pieces (several inputs, pieces sharing an output, an output no piece
/// names, an empty piece) within 1 f32 ulp-scale of the CPU's sequential f64 sums and
/// bit-identical on repetition; unscale bit-identical with the inf/NaN flag.
pub(super) fn sum_squares_and_unscale(e: &mut dyn Exec) {
    use crate::kernels::optim as co;
    use crate::kernels::optim::SqPiece;
    let mut r = Rng::new(22);
    let a = r.vec(5000, 3.0);
    let b = r.vec(300, 1.0);
    let (ha, hb) = (up_f32(e, &a), up_f32(e, &b));
    let pc = |input, start, len, out| SqPiece {
        input,
        start,
        len,
        out,
    };
    let pieces = vec![
        pc(0, 0, 4000, 0),
        pc(1, 0, 300, 0),
        pc(0, 4000, 1000, 2),
        pc(1, 10, 0, 3),
        pc(1, 7, 1, 3),
    ];
    let mut want = [0f64; 5];
    for p in &pieces {
        let x = if p.input == 0 { &a } else { &b };
        want[p.out] += co::sum_sq(&x[p.start..p.start + p.len]);
    }
    let want: Vec<f32> = want.iter().map(|&s| s as f32).collect();
    let mut first: Option<Vec<f32>> = None;
    for _ in 0..2 {
        let out = nan_f32(e, 5);
        run(
            e,
            Op::SumSquares {
                xs: vec![ha, hb],
                pieces: pieces.clone(),
                out,
            },
        );
        let got = down_f32(e, out);
        assert_close("sum_squares", &got, &want, 2e-7, 0.0);
        assert_eq!((got[1], got[4]), (0.0, 0.0), "outputs without pieces are 0");
        match &first {
            None => first = Some(got),
            Some(f) => assert_bits("sum_squares repeated", &got, f),
        }
    }
    for poison in [None, Some(f32::INFINITY), Some(f32::NAN)] {
        let mut g = r.vec(1000, 4.0);
        if let Some(x) = poison {
            g[777] = x;
        }
        let (hg, hf) = (up_f32(e, &g), up_f32(e, &[0.0]));
        run(
            e,
            Op::Unscale {
                inv: 0.125,
                g: hg,
                flag: hf,
            },
        );
        let found = co::unscale(&mut g, 0.125);
        assert_bits("unscale g", &down_f32(e, hg), &g);
        assert_eq!(down_f32(e, hf)[0], if found { 1.0 } else { 0.0 }, "flag");
        assert_eq!(found, poison.is_some());
    }
}

/// One float operand of a typed-kernel case: the buffer in its dtype, and an f32 copy for the
/// cast-around reference (a cast of the half buffer by the cast kernels, or a second upload).
struct TArg {
    t: TH,
    f: H,
    n: usize,
}

/// The bits of `v` rounded to `dtype` (f32 unchanged), as a byte vector.
fn half_bytes(dtype: DType, v: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F16 => v
            .iter()
            .flat_map(|x| f16::from_f32(*x).to_bits().to_le_bytes())
            .collect(),
        DType::BF16 => v
            .iter()
            .flat_map(|x| bf16::from_f32(*x).to_bits().to_le_bytes())
            .collect(),
        _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

fn to_f32_kind(dtype: DType) -> CastKind {
    if dtype == DType::F16 {
        CastKind::F16ToF32
    } else {
        CastKind::Bf16ToF32
    }
}

/// An input (also used for in-place outputs): `v` rounded to `dtype`, plus its f32 copy.
fn t_input(e: &mut dyn Exec, dtype: DType, v: &[f32]) -> TArg {
    let h = e.upload(&half_bytes(dtype, v));
    let f = if dtype == DType::F32 {
        up_f32(e, v)
    } else {
        let f = nan_f32(e, v.len());
        run(
            e,
            Op::Cast {
                kind: to_f32_kind(dtype),
                src: h,
                dst: f,
            },
        );
        f
    };
    TArg {
        t: (h, dtype),
        f,
        n: v.len(),
    }
}

/// An output of `n` elements in `dtype`, plus its f32 reference buffer.
fn t_output(e: &mut dyn Exec, dtype: DType, n: usize) -> TArg {
    let h = e.upload(&half_bytes(dtype, &vec![f32::NAN; n]));
    TArg {
        t: (h, dtype),
        f: nan_f32(e, n),
        n,
    }
}

/// Asserts the typed result equals the cast-around result bit for bit: the f32 reference cast
/// to the output's dtype by the cast kernels.
fn t_check(e: &mut dyn Exec, what: &str, a: &TArg) {
    let (h, dtype) = a.t;
    let want = if dtype == DType::F32 {
        e.download(a.f)
    } else {
        let r = e.upload(&vec![0u8; 2 * a.n]);
        let kind = if dtype == DType::F16 {
            CastKind::F32ToF16
        } else {
            CastKind::F32ToBf16
        };
        run(
            e,
            Op::Cast {
                kind,
                src: a.f,
                dst: r,
            },
        );
        e.download(r)
    };
    let got = e.download(h);
    assert_eq!(got.len(), want.len(), "{what}: length");
    let size = dtype.size();
    for i in 0..a.n {
        let (g, w) = (
            &got[i * size..(i + 1) * size],
            &want[i * size..(i + 1) * size],
        );
        assert_eq!(
            g, w,
            "{what} ({dtype}) [{i}]: typed kernel vs cast-around path"
        );
    }
}

/// The typed kernels (f32 / f16 / bf16 operands, `kernels/cuda/typed.rs`) against the
/// cast-around path (half inputs cast to f32 by the cast kernels, the f32 kernel, outputs cast
/// back): bit for bit, with every operand half, and with operands alternating between a half
/// type and f32 (the per-operand codes). Layer norm's saved mean and rstd (f32) too.
pub(super) fn typed_kernels(e: &mut dyn Exec) {
    let mut r = Rng::new(31);
    for half in [DType::BF16, DType::F16] {
        for mixed in [false, true] {
            // Operand i's dtype: the half type, or with `mixed` f32 for every odd i.
            let ty = |i: usize| {
                if mixed && i % 2 == 1 {
                    DType::F32
                } else {
                    half
                }
            };
            let tag = |op: &str| format!("{op} {half} mixed={mixed}");

            for n in [0usize, 1, 700] {
                let (av, bv) = (r.vec(n, 4.0), r.vec(n, 4.0));
                let (a, b, out) = (
                    t_input(e, ty(0), &av),
                    t_input(e, ty(1), &bv),
                    t_output(e, ty(2), n),
                );
                run(
                    e,
                    Op::Typed(TypedOp::Add {
                        a: a.t,
                        b: b.t,
                        out: out.t,
                    }),
                );
                run(
                    e,
                    Op::Add {
                        a: a.f,
                        b: b.f,
                        out: out.f,
                    },
                );
                t_check(e, &tag("add"), &out);

                let (a2, b2, out) = (
                    t_input(e, ty(0), &av),
                    t_input(e, ty(1), &bv),
                    t_output(e, ty(2), n),
                );
                run(
                    e,
                    Op::Typed(TypedOp::Mul {
                        a: a2.t,
                        b: b2.t,
                        out: out.t,
                    }),
                );
                run(
                    e,
                    Op::Mul {
                        a: a2.f,
                        b: b2.f,
                        out: out.f,
                    },
                );
                t_check(e, &tag("mul"), &out);

                let out = t_output(e, ty(1), n);
                run(
                    e,
                    Op::Typed(TypedOp::Scale {
                        x: a2.t,
                        alpha: -0.375,
                        out: out.t,
                    }),
                );
                run(
                    e,
                    Op::Scale {
                        x: a2.f,
                        alpha: -0.375,
                        out: out.f,
                    },
                );
                t_check(e, &tag("scale"), &out);

                let y = t_input(e, ty(0), &av);
                run(e, Op::Typed(TypedOp::ScaleInplace { y: y.t, alpha: 1.7 }));
                run(e, Op::ScaleInplace { y: y.f, alpha: 1.7 });
                t_check(e, &tag("scale_inplace"), &y);

                for mean in [false, true] {
                    if mean && n == 0 {
                        continue;
                    }
                    let out = t_output(e, ty(1), 1);
                    run(
                        e,
                        Op::Typed(TypedOp::Sum {
                            x: a2.t,
                            out: out.t,
                            mean,
                        }),
                    );
                    if mean {
                        run(
                            e,
                            Op::Mean {
                                x: a2.f,
                                out: out.f,
                            },
                        );
                    } else {
                        run(
                            e,
                            Op::Sum {
                                x: a2.f,
                                out: out.f,
                            },
                        );
                    }
                    t_check(e, &tag(if mean { "mean" } else { "sum" }), &out);
                }

                let (y, x) = (t_input(e, ty(0), &av), t_input(e, ty(1), &bv));
                run(
                    e,
                    Op::Typed(TypedOp::AddScaled {
                        y: y.t,
                        alpha: 0.3,
                        x: x.t,
                    }),
                );
                run(
                    e,
                    Op::AddScaled {
                        y: y.f,
                        alpha: 0.3,
                        x: x.f,
                    },
                );
                t_check(e, &tag("add_scaled"), &y);

                for (kind, name) in [(Gelu::Tanh, "gelu"), (Gelu::Exact, "gelu_exact")] {
                    let (x, y) = (t_input(e, ty(0), &av), t_output(e, ty(1), n));
                    run(
                        e,
                        Op::Typed(TypedOp::Gelu {
                            kind,
                            x: x.t,
                            y: y.t,
                        }),
                    );
                    run(
                        e,
                        Op::Gelu {
                            kind,
                            x: x.f,
                            y: y.f,
                        },
                    );
                    t_check(e, &tag(name), &y);
                    let (dy, dx) = (t_input(e, ty(1), &bv), t_output(e, ty(2), n));
                    run(
                        e,
                        Op::Typed(TypedOp::GeluBackward {
                            kind,
                            x: x.t,
                            dy: dy.t,
                            dx: dx.t,
                        }),
                    );
                    run(
                        e,
                        Op::GeluBackward {
                            kind,
                            x: x.f,
                            dy: dy.f,
                            dx: dx.f,
                        },
                    );
                    t_check(e, &tag(&format!("{name}_backward")), &dx);
                }
            }

            for (rows, cols) in [(1usize, 1usize), (37, 19), (300, 13), (0, 5)] {
                let xv = r.vec(rows * cols, 3.0);
                let bv = r.vec(cols, 2.0);
                let (x, bias, out) = (
                    t_input(e, ty(0), &xv),
                    t_input(e, ty(1), &bv),
                    t_output(e, ty(2), rows * cols),
                );
                run(
                    e,
                    Op::Typed(TypedOp::AddRowBias {
                        x: x.t,
                        bias: bias.t,
                        out: out.t,
                    }),
                );
                run(
                    e,
                    Op::AddRowBias {
                        x: x.f,
                        bias: bias.f,
                        out: out.f,
                    },
                );
                t_check(e, &tag("add_row_bias"), &out);

                let y = t_input(e, ty(0), &xv);
                run(
                    e,
                    Op::Typed(TypedOp::AddRowBiasInplace {
                        y: y.t,
                        bias: bias.t,
                    }),
                );
                run(
                    e,
                    Op::AddRowBiasInplace {
                        y: y.f,
                        bias: bias.f,
                    },
                );
                t_check(e, &tag("add_row_bias_inplace"), &y);

                let sums = t_output(e, ty(1), cols);
                run(
                    e,
                    Op::Typed(TypedOp::ColSums {
                        x: x.t,
                        out: sums.t,
                    }),
                );
                run(
                    e,
                    Op::ColSums {
                        x: x.f,
                        out: sums.f,
                    },
                );
                t_check(e, &tag("col_sums"), &sums);
            }

            let eps = 1e-5f32;
            for (rows, cols) in [(1usize, 1usize), (5, 300), (20, 33), (0, 4)] {
                let xv: Vec<f32> = r.vec(rows * cols, 3.0).iter().map(|v| v + 2.0).collect();
                let gv: Vec<f32> = r.vec(cols, 0.5).iter().map(|v| v + 1.0).collect();
                let bv = r.vec(cols, 1.0);
                let (x, g, b, y) = (
                    t_input(e, ty(0), &xv),
                    t_input(e, ty(1), &gv),
                    t_input(e, ty(2), &bv),
                    t_output(e, ty(3), rows * cols),
                );
                let (tm, tr) = (nan_f32(e, rows), nan_f32(e, rows));
                let (fm, fr) = (nan_f32(e, rows), nan_f32(e, rows));
                run(
                    e,
                    Op::Typed(TypedOp::LayerNorm {
                        x: x.t,
                        gamma: g.t,
                        beta: b.t,
                        y: y.t,
                        mean: tm,
                        rstd: tr,
                        cols,
                        eps,
                    }),
                );
                run(
                    e,
                    Op::LayerNorm {
                        x: x.f,
                        gamma: g.f,
                        beta: b.f,
                        y: y.f,
                        mean: fm,
                        rstd: fr,
                        cols,
                        eps,
                    },
                );
                t_check(e, &tag("layer_norm y"), &y);
                assert_bits(&tag("layer_norm mean"), &down_f32(e, tm), &down_f32(e, fm));
                assert_bits(&tag("layer_norm rstd"), &down_f32(e, tr), &down_f32(e, fr));

                let dyv = r.vec(rows * cols, 1.0);
                let dy = t_input(e, ty(1), &dyv);
                let (dx, dg, db) = (
                    t_output(e, ty(0), rows * cols),
                    t_output(e, ty(3), cols),
                    t_output(e, ty(4), cols),
                );
                run(
                    e,
                    Op::Typed(TypedOp::LayerNormBackward {
                        x: x.t,
                        gamma: g.t,
                        mean: fm,
                        rstd: fr,
                        dy: dy.t,
                        dx: dx.t,
                        dgamma: dg.t,
                        dbeta: db.t,
                        cols,
                    }),
                );
                run(
                    e,
                    Op::LayerNormBackward {
                        x: x.f,
                        gamma: g.f,
                        mean: fm,
                        rstd: fr,
                        dy: dy.f,
                        dx: dx.f,
                        dgamma: dg.f,
                        dbeta: db.f,
                        cols,
                    },
                );
                t_check(e, &tag("layer_norm_backward dx"), &dx);
                t_check(e, &tag("layer_norm_backward dgamma"), &dg);
                t_check(e, &tag("layer_norm_backward dbeta"), &db);
            }
        }
    }
}

/// Typed cross-entropy (logits, loss, dloss, dlogits in f32 / f16 / bf16) against the
/// cast-around path, bit for bit (the saved lse, f32, too); an invalid target still reports
/// the index error and gives NaN rows.
pub(super) fn typed_cross_entropy(e: &mut dyn Exec) {
    let mut r = Rng::new(32);
    for half in [DType::BF16, DType::F16] {
        for mixed in [false, true] {
            let ty = |i: usize| {
                if mixed && i % 2 == 1 {
                    DType::F32
                } else {
                    half
                }
            };
            let tag = |op: &str| format!("{op} {half} mixed={mixed}");
            for (rows, cols, bad) in [(1usize, 1usize, false), (9, 300, false), (5, 7, true)] {
                let lv = r.vec(rows * cols, 4.0);
                let mut tv: Vec<i64> = (0..rows).map(|_| r.below(cols) as i64).collect();
                if bad {
                    tv[2] = cols as i64;
                }
                let targets = up_i64(e, &tv);
                let logits = t_input(e, ty(0), &lv);
                let loss = t_output(e, ty(1), 1);
                let (tl, fl) = (nan_f32(e, rows), nan_f32(e, rows));
                let got = e.run(&Op::Typed(TypedOp::CrossEntropy {
                    logits: logits.t,
                    targets,
                    cols,
                    lse: tl,
                    loss: loss.t,
                }));
                let want = e.run(&Op::CrossEntropy {
                    logits: logits.f,
                    targets,
                    cols,
                    lse: fl,
                    loss: loss.f,
                });
                assert_eq!(got.is_err(), bad, "{}", tag("cross_entropy status"));
                assert_eq!(want.is_err(), bad);
                t_check(e, &tag("cross_entropy loss"), &loss);
                assert_bits(
                    &tag("cross_entropy lse"),
                    &down_f32(e, tl),
                    &down_f32(e, fl),
                );

                let dloss = t_input(e, ty(1), &[0.75]);
                let dlogits = t_output(e, ty(2), rows * cols);
                let got = e.run(&Op::Typed(TypedOp::CrossEntropyBackward {
                    logits: logits.t,
                    targets,
                    lse: fl,
                    dloss: dloss.t,
                    dlogits: dlogits.t,
                    cols,
                }));
                let want = e.run(&Op::CrossEntropyBackward {
                    logits: logits.f,
                    targets,
                    lse: fl,
                    dloss: dloss.f,
                    dlogits: dlogits.f,
                    cols,
                });
                assert_eq!(
                    got.is_err(),
                    bad,
                    "{}",
                    tag("cross_entropy_backward status")
                );
                assert_eq!(want.is_err(), bad);
                t_check(e, &tag("cross_entropy_backward dlogits"), &dlogits);
            }
        }
    }
}

/// Typed embedding (table, out, dy, dtable in f32 / f16 / bf16) against the cast-around path,
/// bit for bit; an out-of-range id is still reported (NaN row forward, skipped backward).
pub(super) fn typed_embedding(e: &mut dyn Exec) {
    let mut r = Rng::new(33);
    for half in [DType::BF16, DType::F16] {
        for mixed in [false, true] {
            let ty = |i: usize| {
                if mixed && i % 2 == 1 {
                    DType::F32
                } else {
                    half
                }
            };
            let tag = |op: &str| format!("{op} {half} mixed={mixed}");
            for (vocab, dim, n, bad) in [
                (37usize, 5usize, 300usize, false),
                (4, 300, 9, false),
                (5, 3, 0, false),
                (6, 4, 10, true),
            ] {
                let mut idv: Vec<i64> = (0..n)
                    .map(|i| if i % 3 == 0 { 1 } else { r.below(vocab) as i64 })
                    .collect();
                if bad {
                    idv[4] = vocab as i64 + 2;
                }
                let ids = up_i64(e, &idv);
                let table = t_input(e, ty(0), &r.vec(vocab * dim, 2.0));
                let out = t_output(e, ty(1), n * dim);
                let got = e.run(&Op::Typed(TypedOp::Embedding {
                    ids,
                    table: table.t,
                    out: out.t,
                    dim,
                }));
                let want = e.run(&Op::Embedding {
                    ids,
                    table: table.f,
                    out: out.f,
                    dim,
                });
                assert_eq!(got.is_err(), bad, "{}", tag("embedding status"));
                assert_eq!(want.is_err(), bad);
                t_check(e, &tag("embedding"), &out);

                let dy = t_input(e, ty(1), &r.vec(n * dim, 1.0));
                let dtable = t_output(e, ty(0), vocab * dim);
                let got = e.run(&Op::Typed(TypedOp::EmbeddingBackward {
                    ids,
                    dy: dy.t,
                    dtable: dtable.t,
                    dim,
                }));
                let want = e.run(&Op::EmbeddingBackward {
                    ids,
                    dy: dy.f,
                    dtable: dtable.f,
                    dim,
                });
                assert_eq!(got.is_err(), bad, "{}", tag("embedding_backward status"));
                assert_eq!(want.is_err(), bad);
                t_check(e, &tag("embedding_backward"), &dtable);
            }
        }
    }
}

/// `v` as its `dtype` holds it (f16/bf16 rounded to nearest even, f32 unchanged), back in f32.
fn as_dtype(dtype: DType, v: &[f32]) -> Vec<f32> {
    match dtype {
        DType::F16 => v.iter().map(|x| f16::from_f32(*x).to_f32()).collect(),
        DType::BF16 => v.iter().map(|x| bf16::from_f32(*x).to_f32()).collect(),
        _ => v.to_vec(),
    }
}

/// RMS norm (one set of typed kernels for every dtype) against the CPU kernel
/// (`kernels::norm::rms_norm`), **bit for bit**: in f32 y, the saved rstd, dx and dgamma equal
/// the CPU's bits (the row sums follow the same lane-then-tree order, dgamma the row order); in
/// bf16 and f16 every output is the CPU's f32 result on the same half inputs, rounded once.
/// Shapes below, at and above the 256 lanes, zero rows (dgamma zeros) and one column.
pub(super) fn rms_norm(e: &mut dyn Exec) {
    use crate::kernels::norm::{rms_norm as cpu_rms_norm, rms_norm_backward};
    let mut r = Rng::new(61);
    let eps = 1e-5f32;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for (rows, cols) in [
            (1usize, 1usize),
            (5, 8),
            (3, 300),
            (64, 33),
            (0, 4),
            (2, 1030),
            (300, 1),
            (530, 11),
        ] {
            let tag = |what: &str| format!("rms_norm {what} {dtype} rows={rows} cols={cols}");
            let xv = as_dtype(dtype, &r.vec(rows * cols, 3.0));
            let gv: Vec<f32> = r.vec(cols, 0.5).iter().map(|v| v + 1.0).collect();
            let gv = as_dtype(dtype, &gv);
            let dyv = as_dtype(dtype, &r.vec(rows * cols, 1.0));
            let (x, g, dy) = (
                (e.upload(&half_bytes(dtype, &xv)), dtype),
                (e.upload(&half_bytes(dtype, &gv)), dtype),
                (e.upload(&half_bytes(dtype, &dyv)), dtype),
            );
            let nan = |e: &mut dyn Exec, n: usize| {
                (e.upload(&half_bytes(dtype, &vec![f32::NAN; n])), dtype)
            };
            let (y, rstd) = (nan(e, rows * cols), nan_f32(e, rows));
            run(
                e,
                Op::Typed(TypedOp::RmsNorm {
                    x,
                    gamma: g,
                    y,
                    rstd,
                    cols,
                    eps,
                }),
            );
            let (mut wy, mut wr) = (vec![0.0; rows * cols], vec![0.0; rows]);
            cpu_rms_norm(&xv, &gv, &mut wy, &mut wr, cols, eps).unwrap();
            assert_eq!(e.download(y.0), half_bytes(dtype, &wy), "{}", tag("y"));
            assert_bits(&tag("rstd"), &down_f32(e, rstd), &wr);

            let (dx, dg) = (nan(e, rows * cols), nan(e, cols));
            run(
                e,
                Op::Typed(TypedOp::RmsNormBackward {
                    x,
                    gamma: g,
                    rstd,
                    dy,
                    dx,
                    dgamma: dg,
                    cols,
                }),
            );
            let (mut wdx, mut wdg) = (vec![0.0; rows * cols], vec![0.0; cols]);
            rms_norm_backward(&xv, &gv, &wr, &dyv, &mut wdx, &mut wdg, cols).unwrap();
            assert_eq!(e.download(dx.0), half_bytes(dtype, &wdx), "{}", tag("dx"));
            assert_eq!(
                e.download(dg.0),
                half_bytes(dtype, &wdg),
                "{}",
                tag("dgamma")
            );
        }
    }
}

/// Bytes of `dtype` values back in f32.
fn bytes_as_f32(dtype: DType, b: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F16 => b
            .chunks(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::BF16 => b
            .chunks(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => b
            .chunks(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    }
}

/// SiLU·mul and its backward (one set of typed kernels for every dtype) against the CPU kernels
/// (`kernels::elementwise::silu_mul`): the same expressions in the same order, so they differ
/// only by CUDA's `expf` (a few ulp in f32; at most one ulp of a half dtype after rounding).
/// Gates over the saturating ends (±60), lengths around the grid-stride boundary, zero length.
pub(super) fn silu_mul(e: &mut dyn Exec) {
    use crate::kernels::elementwise::{silu_mul as cpu_fwd, silu_mul_backward as cpu_bwd};
    let mut r = Rng::new(39);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        // A dtype ulp at 1, relative: f32 2⁻²³ (the expf difference needs a few), bf16 2⁻⁷,
        // f16 2⁻¹⁰.
        let (rel, abs) = match dtype {
            DType::F32 => (2e-6, 1e-6),
            DType::BF16 => (8e-3, 1e-5),
            _ => (1e-3, 1e-5),
        };
        for n in [0usize, 1, 7, 1000, 70_001] {
            let tag = |what: &str| format!("silu_mul {what} {dtype} n={n}");
            let mut gv = r.vec(n, 6.0);
            if n >= 4 {
                gv[..4].copy_from_slice(&[60.0, -60.0, 0.0, -0.0]);
            }
            let (gv, uv, dyv) = (
                as_dtype(dtype, &gv),
                as_dtype(dtype, &r.vec(n, 2.0)),
                as_dtype(dtype, &r.vec(n, 1.0)),
            );
            let up = |e: &mut dyn Exec, v: &[f32]| (e.upload(&half_bytes(dtype, v)), dtype);
            let (g, u, dy) = (up(e, &gv), up(e, &uv), up(e, &dyv));
            let nan = vec![f32::NAN; n];
            let y = up(e, &nan);
            run(e, Op::Typed(TypedOp::SiluMul { gate: g, up: u, y }));
            let mut wy = vec![0.0; n];
            cpu_fwd(&gv, &uv, &mut wy).unwrap();
            let got = bytes_as_f32(dtype, &e.download(y.0));
            assert_close(&tag("y"), &got, &as_dtype(dtype, &wy), rel, abs);
            let (dg, du) = (up(e, &nan), up(e, &nan));
            run(
                e,
                Op::Typed(TypedOp::SiluMulBackward {
                    gate: g,
                    up: u,
                    dy,
                    dgate: dg,
                    dup: du,
                }),
            );
            let (mut wdg, mut wdu) = (vec![0.0; n], vec![0.0; n]);
            cpu_bwd(&gv, &uv, &dyv, &mut wdg, &mut wdu).unwrap();
            let got = bytes_as_f32(dtype, &e.download(dg.0));
            assert_close(&tag("dgate"), &got, &as_dtype(dtype, &wdg), rel, abs);
            let got = bytes_as_f32(dtype, &e.download(du.0));
            assert_close(&tag("dup"), &got, &as_dtype(dtype, &wdu), rel, abs);
        }
    }
}

/// RoPE and its backward (typed kernels) against the CPU kernels (`kernels::rope`), **bit for
/// bit** in every dtype (no transcendental on the device: the tables come from the host): the
/// head split/merge layouts, offset positions, one position (a decoder step), several heads and
/// batches, head dims 2, 8 and 128.
pub(super) fn rope(e: &mut dyn Exec) {
    use crate::kernels::rope::{rope as cpu_rope, rope_backward as cpu_back, RopeShape};
    let mut r = Rng::new(40);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for (batch, seq, heads, head_dim, pos0) in [
            (1usize, 1usize, 1usize, 2usize, 0usize),
            (2, 5, 3, 8, 0),
            (1, 1, 4, 8, 6),
            (3, 7, 2, 128, 2),
            (1, 0, 2, 8, 0),
        ] {
            let s = RopeShape {
                batch,
                seq,
                heads,
                head_dim,
                pos0,
                table_rows: pos0 + seq + 1,
            };
            let tag = |what: &str| format!("rope {what} {dtype} {s:?}");
            let n = batch * seq * heads * head_dim;
            let t = s.table_rows * head_dim / 2;
            let cv: Vec<f32> = (0..t).map(|i| (i as f32 * 0.3).cos()).collect();
            let sv: Vec<f32> = (0..t).map(|i| (i as f32 * 0.3).sin()).collect();
            let (c, sn) = (up_f32(e, &cv), up_f32(e, &sv));
            let xv = as_dtype(dtype, &r.vec(n, 3.0));
            let up = |e: &mut dyn Exec, v: &[f32]| (e.upload(&half_bytes(dtype, v)), dtype);
            let x = up(e, &xv);
            let y = up(e, &vec![f32::NAN; n]);
            let op = |backward, input, output| {
                Op::Typed(TypedOp::Rope {
                    backward,
                    input,
                    cos: c,
                    sin: sn,
                    output,
                    s,
                })
            };
            run(e, op(false, x, y));
            let mut wy = vec![0.0; n];
            cpu_rope(&xv, &cv, &sv, &mut wy, &s).unwrap();
            assert_eq!(e.download(y.0), half_bytes(dtype, &wy), "{}", tag("y"));
            let dyv = as_dtype(dtype, &r.vec(n, 1.0));
            let dy = up(e, &dyv);
            let dx = up(e, &vec![f32::NAN; n]);
            run(e, op(true, dy, dx));
            let mut wdx = vec![0.0; n];
            cpu_back(&dyv, &cv, &sv, &mut wdx, &s).unwrap();
            assert_eq!(e.download(dx.0), half_bytes(dtype, &wdx), "{}", tag("dx"));
        }
    }
}

/// Dropout (one typed kernel for every dtype) against the CPU kernel
/// (`kernels::dropout::dropout`), **bit for bit**: the same Philox words, the same kept elements
/// and the same products, in f32 and (rounded once) in bf16 and f16. Rows of one element, of a
/// partial last block (cols not a multiple of 4), many rows, a sample index above 2³² and zero
/// rows; NaN inputs stay NaN where dropped.
pub(super) fn dropout(e: &mut dyn Exec) {
    use crate::kernels::dropout::{dropout as cpu_dropout, DropoutKey, DropoutMask};
    let mut r = Rng::new(67);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for (rows, cols, p, sample) in [
            (1usize, 1usize, 0.5f32, 0u64),
            (3, 10, 0.1, 7),
            (64, 33, 0.9, (1u64 << 32) - 2),
            (2, 1030, 0.25, 1 << 40),
            (0, 4, 0.5, 3),
        ] {
            let tag = format!("dropout {dtype} rows={rows} cols={cols} p={p}");
            let mut xv = r.vec(rows * cols, 3.0);
            if let Some(v) = xv.get_mut(1) {
                *v = f32::NAN;
            }
            let xv = as_dtype(dtype, &xv);
            let mask = DropoutMask {
                p,
                key: DropoutKey {
                    seed: 11,
                    step: 3,
                    sample,
                },
                site: 5,
            };
            let x = (e.upload(&half_bytes(dtype, &xv)), dtype);
            let y = (e.upload(&half_bytes(dtype, &vec![1.5; rows * cols])), dtype);
            run(e, Op::Typed(TypedOp::Dropout { x, y, cols, mask }));
            let mut want = vec![0.0; rows * cols];
            cpu_dropout(&xv, &mut want, cols, &mask).unwrap();
            assert_eq!(e.download(y.0), half_bytes(dtype, &want), "{tag}");
        }
    }
}
