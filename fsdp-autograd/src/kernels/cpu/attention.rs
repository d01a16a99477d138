//! Causal scaled-dot-product attention on `[batch, heads, t, d]`, built on `gemm`, block-causal:
//! the sequence is cut into blocks of [`BLOCK`] positions and every product skips the blocks that
//! lie entirely above the diagonal (at t = 128 the products do 5/8 of the full square's work).

use super::math::{vectorized, SimdKernel};
use super::matmul::{gemm_view, matmul_parallelism, View};
use super::norm::softmax_row_inplace;
use crate::kernels::attention::{Attention, AttentionLayout};
use crate::kernels::check;
use crate::kernels::KernelError;

/// Checks `a` (its own rules and the head-split layout) and the q-shaped, k-shaped and
/// probs-shaped arguments; returns `(batch·heads, t·d, t·t)`.
fn shapes(
    op: &'static str,
    a: &Attention,
    q_like: &[(&'static str, usize)],
    kv_like: &[(&'static str, usize)],
    probs_like: &[(&'static str, usize)],
) -> Result<(usize, usize, usize), KernelError> {
    a.check(op)?;
    if a.layout != AttentionLayout::Heads {
        return Err(KernelError::InvalidShape {
            op,
            reason: format!(
                "the head-split kernel takes AttentionLayout::Heads, got {:?}; use the packed \
                 kernels (causal_attention_packed_with) for the packed layout",
                a.layout
            ),
        });
    }
    let bh = check::mul(op, a.batch, a.heads)?;
    let td = check::mul(op, a.t, a.d)?;
    let tt = check::mul(op, a.t, a.t)?;
    let n_q = check::mul(op, bh, td)?;
    let n_kv = check::mul(op, check::mul(op, a.batch, a.kv_heads)?, td)?;
    let n_probs = check::mul(op, bh, tt)?;
    let shape = || a.describe();
    for (args, n) in [(q_like, n_q), (kv_like, n_kv), (probs_like, n_probs)] {
        for &(arg, len) in args {
            check::len(op, arg, len, n, shape)?;
        }
    }
    Ok((bh, td, tt))
}

/// The key/value head that query head `h` (of all `batch·heads`) reads: head
/// `(h mod heads) / group` of its batch entry.
#[inline(always)]
fn kv_head(h: usize, heads: usize, group: usize) -> usize {
    (h / heads) * (heads / group) + (h % heads) / group
}

/// Positions per block of the block-causal products. Query block `b` (positions
/// `b·BLOCK..(b+1)·BLOCK`) only meets keys `0..(b+1)·BLOCK`; smaller blocks skip more of the masked
/// triangle but make smaller `gemm` calls (32 rows still fill gemm's 16-row microkernel twice).
pub(crate) const BLOCK: usize = 32;

/// `(start, end)` of each block of `0..t`.
fn blocks(t: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t)
        .step_by(BLOCK)
        .map(move |r0| (r0, (r0 + BLOCK).min(t)))
}

/// Rows `r0..r1` of a row-major matrix with `ld` columns, up to column `c1` of the last row: the
/// slice a [`View`] of those rows with `ld` needs.
fn rows(m: &[f32], ld: usize, r0: usize, r1: usize, c1: usize) -> &[f32] {
    &m[r0 * ld..(r1 - 1) * ld + c1]
}

/// Mutable [`rows`].
fn rows_mut(m: &mut [f32], ld: usize, r0: usize, r1: usize, c1: usize) -> &mut [f32] {
    &mut m[r0 * ld..(r1 - 1) * ld + c1]
}

/// Causal scaled-dot-product attention, per (batch, head):
/// `probs = softmax(q·kᵀ/√d + causal mask)`, `out = probs·v`: [`causal_attention_with`] for
/// [`Attention::new`]`(batch, heads, t, d)` (multi-head, default scale).
///
/// `q`, `k`, `v` and `out` are `[batch, heads, t, d]`, contiguous; `probs` is
/// `[batch, heads, t, t]` and is saved for [`causal_attention_backward`] (row `i` holds the
/// weights over positions `0..=i`; entries above the diagonal are exactly 0).
///
/// # Errors
/// As [`causal_attention_with`].
///
/// ```
/// use fsdp_autograd::kernels::cpu::causal_attention;
/// // One head, t = 2, d = 1: position 0 sees only itself.
/// let (q, k, v) = ([1.0, 1.0], [0.0, 0.0], [3.0, 5.0]);
/// let (mut out, mut probs) = ([0.0; 2], [0.0; 4]);
/// causal_attention(&q, &k, &v, &mut out, &mut probs, 1, 1, 2, 1).unwrap();
/// assert_eq!(probs, [1.0, 0.0, 0.5, 0.5]);
/// assert_eq!(out, [3.0, 4.0]);
/// ```
#[allow(clippy::too_many_arguments)]
pub fn causal_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    probs: &mut [f32],
    batch: usize,
    heads: usize,
    t: usize,
    d: usize,
) -> Result<(), KernelError> {
    causal_attention_with(q, k, v, out, probs, &Attention::new(batch, heads, t, d))
}

/// Causal scaled-dot-product attention of shape `a` (head-split layout), per (batch, query
/// head `h`) with key/value head `g = h / a.group()`:
/// `probs = softmax(a.scale·q_h·k_gᵀ + causal mask)`, `out_h = probs·v_g`.
///
/// `q` and `out` are `[batch, heads, t, d]`, `k` and `v` `[batch, kv_heads, t, d]`
/// (grouped-query attention reads each key/value head for its group of query heads, without
/// repeating it), contiguous; `probs` is `[batch, heads, t, t]` and is saved for
/// [`causal_attention_backward_with`] (row `i` holds the weights over positions `0..=i`;
/// entries above the diagonal are exactly 0). Both products are `gemm` calls per block of 32
/// queries over the keys up to the block's end (the scale is folded into the first), with the
/// current [`matmul_parallelism`](super::matmul_parallelism); the softmax is stable (max
/// subtraction). Blocks above the diagonal are never computed (zeros are written there).
///
/// # Errors
/// [`KernelError::LengthMismatch`] if a slice does not match the shape;
/// [`KernelError::InvalidShape`] on overflow, a shape [`Attention::check`] rejects, or the
/// packed layout. `d == 0` gives uniform causal weights and a zero-width output.
///
/// ```
/// use fsdp_autograd::kernels::attention::Attention;
/// use fsdp_autograd::kernels::cpu::causal_attention_with;
/// // Two query heads share one key/value head; scale 1: t = 2, d = 1.
/// let a = Attention { kv_heads: 1, scale: 1.0, ..Attention::new(1, 2, 2, 1) };
/// let (q, k, v) = ([0.0, 0.0, 0.0, 1.0], [0.0, 2.0f32.ln()], [3.0, 6.0]);
/// let (mut out, mut probs) = ([0.0; 4], [0.0; 8]);
/// causal_attention_with(&q, &k, &v, &mut out, &mut probs, &a).unwrap();
/// assert_eq!(out[..2], [3.0, 4.5]); // head 0, query 1: weights ½, ½
/// assert!((out[3] - 5.0).abs() < 1e-6); // head 1, query 1: weights ⅓, ⅔
/// ```
pub fn causal_attention_with(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    probs: &mut [f32],
    a: &Attention,
) -> Result<(), KernelError> {
    let op = "causal_attention";
    let (bh, _, tt) = shapes(
        op,
        a,
        &[("q", q.len()), ("out", out.len())],
        &[("k", k.len()), ("v", v.len())],
        &[("probs", probs.len())],
    )?;
    if tt == 0 {
        return Ok(());
    }
    struct Body<'a> {
        ins: [&'a [f32]; 3],
        out: &'a mut [f32],
        probs: &'a mut [f32],
        dims: [usize; 5],
        scale: f32,
    }
    impl SimdKernel for Body<'_> {
        type Output = Result<(), KernelError>;
        #[inline(always)]
        fn run(self) -> Result<(), KernelError> {
            forward_heads(self.ins, self.out, self.probs, self.dims, self.scale)
        }
    }
    vectorized(Body {
        ins: [q, k, v],
        out,
        probs,
        dims: [bh, a.t, a.d, a.heads, a.group()],
        scale: a.scale,
    })
}

/// The per-head loop of [`causal_attention_with`] (arguments already checked, so `t·d` and
/// `t·t` do not overflow): `ins` = q, k, v; `dims` = batch·heads, t, d, heads, group.
#[inline(always)]
fn forward_heads(
    [q, k, v]: [&[f32]; 3],
    out: &mut [f32],
    probs: &mut [f32],
    [bh, t, d, heads, group]: [usize; 5],
    scale: f32,
) -> Result<(), KernelError> {
    let (td, tt) = (t * d, t * t);
    let op = "causal_attention";
    let par = matmul_parallelism();
    for h in 0..bh {
        let g = kv_head(h, heads, group);
        let (qh, kh, vh) = (
            &q[h * td..(h + 1) * td],
            &k[g * td..(g + 1) * td],
            &v[g * td..(g + 1) * td],
        );
        let ph = &mut probs[h * tt..(h + 1) * tt];
        let oh = &mut out[h * td..(h + 1) * td];
        for (r0, r1) in blocks(t) {
            let nq = r1 - r0;
            // S[r0..r1, 0..r1] = q[r0..r1] · k[0..r1]ᵀ · scale
            gemm_view(
                op,
                &qh[r0 * d..r1 * d],
                View::dense(nq, d, false),
                &kh[..r1 * d],
                View::dense(d, r1, true),
                rows_mut(ph, t, r0, r1, r1),
                t,
                false,
                scale,
                par,
            )?;
            for i in r0..r1 {
                let row = &mut ph[i * t..(i + 1) * t];
                let (visible, masked) = row.split_at_mut(i + 1);
                softmax_row_inplace(visible);
                masked.fill(0.0);
            }
            // out[r0..r1] = P[r0..r1, 0..r1] · v[0..r1]
            gemm_view(
                op,
                rows(ph, t, r0, r1, r1),
                View {
                    rows: nq,
                    cols: r1,
                    ld: t,
                    trans: false,
                },
                &vh[..r1 * d],
                View::dense(r1, d, false),
                &mut oh[r0 * d..r1 * d],
                d,
                false,
                1.0,
                par,
            )?;
        }
    }
    Ok(())
}

/// Gradient of [`causal_attention`], from `q`, `k`, `v`, the saved `probs` and the upstream
/// `dout`: [`causal_attention_backward_with`] for [`Attention::new`]`(batch, heads, t, d)`.
/// Per (batch, head), with `P = probs`:
/// `dv = Pᵀ·dout`, `dP = dout·vᵀ`, `dS = P ⊙ (dP − rowsum(P ⊙ dP))` (zero above the diagonal),
/// `dq = dS·k/√d`, `dk = dSᵀ·q/√d`. `dq`, `dk` and `dv` are **overwritten**.
///
/// # Errors
/// As [`causal_attention_backward_with`].
///
/// ```
/// use fsdp_autograd::kernels::cpu::{causal_attention, causal_attention_backward};
/// let (q, k, v) = ([1.0, 1.0], [0.0, 0.0], [3.0, 5.0]);
/// let (mut out, mut probs) = ([0.0; 2], [0.0; 4]);
/// causal_attention(&q, &k, &v, &mut out, &mut probs, 1, 1, 2, 1).unwrap();
/// let (mut dq, mut dk, mut dv) = ([0.0; 2], [0.0; 2], [0.0; 2]);
/// causal_attention_backward(&q, &k, &v, &probs, &[1.0, 1.0], &mut dq, &mut dk, &mut dv,
///                           1, 1, 2, 1).unwrap();
/// assert_eq!(dv, [1.5, 0.5]); // v₀ feeds out₀ fully and out₁ by half
/// assert_eq!(dq[0], 0.0);     // a single visible position: scores do not matter
/// ```
#[allow(clippy::too_many_arguments)]
pub fn causal_attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    probs: &[f32],
    dout: &[f32],
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    batch: usize,
    heads: usize,
    t: usize,
    d: usize,
) -> Result<(), KernelError> {
    let a = Attention::new(batch, heads, t, d);
    causal_attention_backward_with(q, k, v, probs, dout, dq, dk, dv, &a)
}

/// Gradient of [`causal_attention_with`] for shape `a`, from `q`, `k`, `v`, the saved `probs`
/// and the upstream `dout` (`dq` like `q`; `dk`, `dv` like `k`). Per (batch, query head `h`)
/// with key/value head `g`, `P = probs_h`: `dP = dout_h·v_gᵀ`,
/// `dS = P ⊙ (dP − rowsum(P ⊙ dP))` (zero above the diagonal), `dq_h = scale·dS·k_g`; and per
/// key/value head, summed over its group's query heads in ascending order (so the result is
/// deterministic): `dv_g = Σ_h Pᵀ·dout_h`, `dk_g = Σ_h scale·dSᵀ·q_h`. `dq`, `dk` and `dv` are
/// **overwritten**.
///
/// The four products are block-causal `gemm` calls (as in the forward, blocks above the diagonal
/// are skipped; a group's later query heads accumulate into `dk`/`dv`); `dP`/`dS` live in one
/// `t×t` scratch buffer allocated once per call (the only allocation in the attention kernels).
///
/// # Errors
/// As [`causal_attention_with`].
#[allow(clippy::too_many_arguments)]
pub fn causal_attention_backward_with(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    probs: &[f32],
    dout: &[f32],
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    a: &Attention,
) -> Result<(), KernelError> {
    let op = "causal_attention_backward";
    let (bh, td, tt) = shapes(
        op,
        a,
        &[("q", q.len()), ("dout", dout.len()), ("dq", dq.len())],
        &[
            ("k", k.len()),
            ("v", v.len()),
            ("dk", dk.len()),
            ("dv", dv.len()),
        ],
        &[("probs", probs.len())],
    )?;
    if tt == 0 || td == 0 {
        return Ok(());
    }
    struct Body<'a> {
        ins: [&'a [f32]; 5],
        dq: &'a mut [f32],
        dk: &'a mut [f32],
        dv: &'a mut [f32],
        dims: [usize; 5],
        scale: f32,
    }
    impl SimdKernel for Body<'_> {
        type Output = Result<(), KernelError>;
        #[inline(always)]
        fn run(self) -> Result<(), KernelError> {
            backward_heads(self.ins, self.dq, self.dk, self.dv, self.dims, self.scale)
        }
    }
    vectorized(Body {
        ins: [q, k, v, probs, dout],
        dq,
        dk,
        dv,
        dims: [bh, a.t, a.d, a.heads, a.group()],
        scale: a.scale,
    })
}

/// The per-head loop of [`causal_attention_backward_with`] (arguments already checked, so
/// `t·d` and `t·t` do not overflow): `ins` = q, k, v, probs, dout; `dims` = batch·heads, t, d,
/// heads, group. Key/value head by key/value head; inside, the group's query heads in
/// ascending order (the first overwrites dk/dv, the others accumulate).
#[inline(always)]
fn backward_heads(
    [q, k, v, probs, dout]: [&[f32]; 5],
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    [bh, t, d, heads, group]: [usize; 5],
    scale: f32,
) -> Result<(), KernelError> {
    let op = "causal_attention_backward";
    let (td, tt) = (t * d, t * t);
    let par = matmul_parallelism();
    let mut ds = vec![0.0f32; tt];
    for hg in 0..bh / group {
        let rg = hg * td..(hg + 1) * td;
        let (kh, vh) = (&k[rg.clone()], &v[rg.clone()]);
        let (dkh, dvh) = (&mut dk[rg.clone()], &mut dv[rg]);
        for gi in 0..group {
            // The query heads of key/value head hg: kv_head(h, heads, group) == hg.
            let h = (hg / (heads / group)) * heads + (hg % (heads / group)) * group + gi;
            let acc = gi > 0;
            let r = h * td..(h + 1) * td;
            let (qh, doh) = (&q[r.clone()], &dout[r.clone()]);
            let ph = &probs[h * tt..(h + 1) * tt];
            let dqh = &mut dq[r];
            // Per query block: dP, then dS (rows r0..r1, columns 0..r1; the masked entries of the
            // diagonal block are zeroed), then dq = dS · k · scale.
            for (r0, r1) in blocks(t) {
                let nq = r1 - r0;
                gemm_view(
                    op,
                    &doh[r0 * d..r1 * d],
                    View::dense(nq, d, false),
                    &vh[..r1 * d],
                    View::dense(d, r1, true),
                    rows_mut(&mut ds, t, r0, r1, r1),
                    t,
                    false,
                    1.0,
                    par,
                )?;
                for i in r0..r1 {
                    let drow = &mut ds[i * t..i * t + r1];
                    let (dvis, dmasked) = drow.split_at_mut(i + 1);
                    let pvis = &ph[i * t..i * t + i + 1];
                    let dot = super::elementwise::dot_f64(pvis, dvis) as f32;
                    for (o, &p) in dvis.iter_mut().zip(pvis) {
                        *o = p * (*o - dot);
                    }
                    dmasked.fill(0.0);
                }
                gemm_view(
                    op,
                    rows(&ds, t, r0, r1, r1),
                    View {
                        rows: nq,
                        cols: r1,
                        ld: t,
                        trans: false,
                    },
                    &kh[..r1 * d],
                    View::dense(r1, d, false),
                    &mut dqh[r0 * d..r1 * d],
                    d,
                    false,
                    scale,
                    par,
                )?;
            }
            // Per key block c0..c1, over the queries c0..t that see it:
            // dv (+)= P[c0..t, c0..c1]ᵀ · dout[c0..t], dk (+)= dS[c0..t, c0..c1]ᵀ · q[c0..t] · scale.
            // (Query i ≥ c0 lies in a block at or after the key block, so its dS row was computed
            // up to at least c1.)
            for (c0, c1) in blocks(t) {
                let (nk, nq) = (c1 - c0, t - c0);
                let block_t = View {
                    rows: nk,
                    cols: nq,
                    ld: t,
                    trans: true,
                };
                gemm_view(
                    op,
                    &ph[c0 * t + c0..(t - 1) * t + c1],
                    block_t,
                    &doh[c0 * d..],
                    View::dense(nq, d, false),
                    &mut dvh[c0 * d..c1 * d],
                    d,
                    acc,
                    1.0,
                    par,
                )?;
                gemm_view(
                    op,
                    &ds[c0 * t + c0..(t - 1) * t + c1],
                    block_t,
                    &qh[c0 * d..],
                    View::dense(nq, d, false),
                    &mut dkh[c0 * d..c1 * d],
                    d,
                    acc,
                    scale,
                    par,
                )?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::testutil::{assert_close, bits, dot, f64s, fd_grad, Rng};

    /// f64 reference: returns (out, probs) for `p = q ‖ k ‖ v`.
    fn attn_ref(p: &[f64], bh: usize, t: usize, d: usize) -> (Vec<f64>, Vec<f64>) {
        let n = bh * t * d;
        let (q, rest) = p.split_at(n);
        let (k, v) = rest.split_at(n);
        let scale = 1.0 / (d as f64).sqrt();
        let mut out = vec![0.0; n];
        let mut probs = vec![0.0; bh * t * t];
        for h in 0..bh {
            let o = h * t * d;
            for i in 0..t {
                let s: Vec<f64> = (0..=i)
                    .map(|j| {
                        (0..d)
                            .map(|c| q[o + i * d + c] * k[o + j * d + c])
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - max).exp()).sum();
                for (j, sj) in s.iter().enumerate() {
                    let pj = (sj - max).exp() / z;
                    probs[h * t * t + i * t + j] = pj;
                    for c in 0..d {
                        out[o + i * d + c] += pj * v[o + j * d + c];
                    }
                }
            }
        }
        (out, probs)
    }

    #[test]
    fn forward_and_backward_match_reference() {
        let mut rng = Rng::new(50);
        for (batch, heads, t, d) in [
            (1, 1, 1, 1),
            (1, 1, 1, 4),
            (2, 1, 3, 1),
            (1, 2, 5, 3),
            (2, 2, 7, 4),
            // Several blocks: exactly two, and three with a partial last one.
            (1, 1, 2 * BLOCK, 2),
            (1, 2, 2 * BLOCK + 6, 3),
        ] {
            let n = batch * heads * t * d;
            let q = rng.vec_scaled(n, 1.5);
            let k = rng.vec_scaled(n, 1.5);
            let v = rng.vec(n);
            let (mut out, mut probs) = (vec![f32::NAN; n], vec![f32::NAN; batch * heads * t * t]);
            causal_attention(&q, &k, &v, &mut out, &mut probs, batch, heads, t, d).unwrap();
            let mut p = f64s(&q);
            p.extend(f64s(&k));
            p.extend(f64s(&v));
            let bh = batch * heads;
            let (want_out, want_probs) = attn_ref(&p, bh, t, d);
            // Scores: a length-d f32 dot (≤ d·u relative to Σ|q||k| ≲ d·2.25) then softmax and
            // a length-t dot with |v| ≤ 1: absolute 1e-5 covers these sizes with margin.
            assert_close("probs", &probs, &want_probs, 1e-5, 1e-6);
            assert_close("out", &out, &want_out, 1e-5, 1e-5);

            let dout = rng.vec(n);
            let (mut dq, mut dk, mut dv) =
                (vec![f32::NAN; n], vec![f32::NAN; n], vec![f32::NAN; n]);
            causal_attention_backward(
                &q, &k, &v, &probs, &dout, &mut dq, &mut dk, &mut dv, batch, heads, t, d,
            )
            .unwrap();
            let want = fd_grad(|x| dot(&attn_ref(x, bh, t, d).0, &dout), &p, 1e-6);
            assert_close("dq", &dq, &want[..n], 1e-4, 2e-5);
            assert_close("dk", &dk, &want[n..2 * n], 1e-4, 2e-5);
            assert_close("dv", &dv, &want[2 * n..], 1e-4, 2e-5);
        }
    }

    /// f64 reference for shape `a` (grouped heads, any scale): returns (out, probs) for
    /// `p = q ‖ k ‖ v`, q `[batch, heads, t, d]`, k and v `[batch, kv_heads, t, d]`.
    fn attn_ref_gqa(p: &[f64], a: &Attention) -> (Vec<f64>, Vec<f64>) {
        let (t, d, heads, kv) = (a.t, a.d, a.heads, a.kv_heads);
        let (n, nkv) = (a.batch * heads * t * d, a.batch * kv * t * d);
        let (q, rest) = p.split_at(n);
        let (k, v) = rest.split_at(nkv);
        let mut out = vec![0.0; n];
        let mut probs = vec![0.0; a.batch * heads * t * t];
        for b in 0..a.batch {
            for h in 0..heads {
                let (qo, ko) = (
                    ((b * heads) + h) * t * d,
                    (b * kv + h / (heads / kv)) * t * d,
                );
                let po = ((b * heads) + h) * t * t;
                for i in 0..t {
                    let s: Vec<f64> = (0..=i)
                        .map(|j| {
                            (0..d)
                                .map(|c| q[qo + i * d + c] * k[ko + j * d + c])
                                .sum::<f64>()
                                * a.scale as f64
                        })
                        .collect();
                    let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = s.iter().map(|x| (x - max).exp()).sum();
                    for (j, sj) in s.iter().enumerate() {
                        let pj = (sj - max).exp() / z;
                        probs[po + i * t + j] = pj;
                        for c in 0..d {
                            out[qo + i * d + c] += pj * v[ko + j * d + c];
                        }
                    }
                }
            }
        }
        (out, probs)
    }

    /// Grouped-query attention and a non-default scale against the f64 reference (forward) and
    /// its finite differences (backward: dk/dv of a key/value head sum over its group).
    #[test]
    fn grouped_heads_and_scale_match_reference() {
        let mut rng = Rng::new(52);
        for (batch, heads, kv_heads, t, d, scale) in [
            (1, 2, 1, 5, 3, 0.7f32),
            (2, 4, 2, 7, 4, 0.5),
            (1, 6, 3, 2 * BLOCK + 6, 3, 1.0),
            (1, 3, 3, 9, 2, 0.25),
            (2, 4, 1, 3, 1, Attention::default_scale(1)),
        ] {
            let a = Attention {
                kv_heads,
                scale,
                ..Attention::new(batch, heads, t, d)
            };
            let (n, nkv) = (batch * heads * t * d, batch * kv_heads * t * d);
            let q = rng.vec_scaled(n, 1.5);
            let k = rng.vec_scaled(nkv, 1.5);
            let v = rng.vec(nkv);
            let (mut out, mut probs) = (vec![f32::NAN; n], vec![f32::NAN; batch * heads * t * t]);
            causal_attention_with(&q, &k, &v, &mut out, &mut probs, &a).unwrap();
            let mut p = f64s(&q);
            p.extend(f64s(&k));
            p.extend(f64s(&v));
            let (want_out, want_probs) = attn_ref_gqa(&p, &a);
            assert_close("gqa probs", &probs, &want_probs, 1e-5, 1e-6);
            assert_close("gqa out", &out, &want_out, 1e-5, 1e-5);

            let dout = rng.vec(n);
            let (mut dq, mut dk, mut dv) =
                (vec![f32::NAN; n], vec![f32::NAN; nkv], vec![f32::NAN; nkv]);
            causal_attention_backward_with(
                &q, &k, &v, &probs, &dout, &mut dq, &mut dk, &mut dv, &a,
            )
            .unwrap();
            let want = fd_grad(|x| dot(&attn_ref_gqa(x, &a).0, &dout), &p, 1e-6);
            assert_close("gqa dq", &dq, &want[..n], 1e-4, 2e-5);
            assert_close("gqa dk", &dk, &want[n..n + nkv], 1e-4, 4e-5);
            assert_close("gqa dv", &dv, &want[n + nkv..], 1e-4, 4e-5);
        }
    }

    /// `kv_heads == heads` with the default scale is the multi-head kernel, bit for bit; a
    /// grouped call equals the multi-head kernel on keys/values repeated per query head (bit
    /// for bit forward; dk/dv are the group sums of the repeated gradients).
    #[test]
    fn grouped_heads_equal_repeated_heads() {
        let mut rng = Rng::new(53);
        let (batch, heads, kv, t, d) = (2, 6, 2, 37, 5);
        let g = heads / kv;
        let a = Attention {
            kv_heads: kv,
            ..Attention::new(batch, heads, t, d)
        };
        let (n, nkv, td) = (batch * heads * t * d, batch * kv * t * d, t * d);
        let (q, k, v, dout) = (rng.vec(n), rng.vec(nkv), rng.vec(nkv), rng.vec(n));
        let repeat = |x: &[f32]| -> Vec<f32> {
            (0..batch * heads)
                .flat_map(|h| {
                    let src = (h / heads) * kv + (h % heads) / g;
                    x[src * td..(src + 1) * td].to_vec()
                })
                .collect()
        };
        let (kr, vr) = (repeat(&k), repeat(&v));
        let np = batch * heads * t * t;
        let (mut o1, mut p1, mut o2, mut p2) =
            (vec![0.0; n], vec![0.0; np], vec![0.0; n], vec![0.0; np]);
        causal_attention_with(&q, &k, &v, &mut o1, &mut p1, &a).unwrap();
        causal_attention(&q, &kr, &vr, &mut o2, &mut p2, batch, heads, t, d).unwrap();
        assert_eq!(bits(&o1), bits(&o2));
        assert_eq!(bits(&p1), bits(&p2));
        let (mut dq1, mut dk1, mut dv1) = (vec![0.0; n], vec![0.0; nkv], vec![0.0; nkv]);
        causal_attention_backward_with(&q, &k, &v, &p1, &dout, &mut dq1, &mut dk1, &mut dv1, &a)
            .unwrap();
        let (mut dq2, mut dk2, mut dv2) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        causal_attention_backward(
            &q, &kr, &vr, &p2, &dout, &mut dq2, &mut dk2, &mut dv2, batch, heads, t, d,
        )
        .unwrap();
        assert_eq!(bits(&dq1), bits(&dq2));
        let sum = |x: &[f32]| -> Vec<f64> {
            let mut s = vec![0.0f64; nkv];
            for h in 0..batch * heads {
                let dst = (h / heads) * kv + (h % heads) / g;
                for i in 0..td {
                    s[dst * td + i] += x[h * td + i] as f64;
                }
            }
            s
        };
        assert_close("dk = group sum", &dk1, &sum(&dk2), 1e-5, 1e-6);
        assert_close("dv = group sum", &dv1, &sum(&dv2), 1e-5, 1e-6);
        // The multi-head shape through the general entry point: the same bits.
        let m = Attention::new(batch, heads, t, d);
        let (mut o3, mut p3) = (vec![0.0; n], vec![0.0; np]);
        causal_attention_with(&q, &kr, &vr, &mut o3, &mut p3, &m).unwrap();
        assert_eq!(bits(&o3), bits(&o2));
    }

    /// Bad grouped shapes and scales are typed errors naming what to change, not panics.
    #[test]
    fn bad_kv_heads_and_scale_are_errors() {
        let x = [0.0f32; 24];
        let (mut out, mut probs) = ([0.0; 24], [0.0; 48]);
        let base = Attention::new(1, 6, 2, 2);
        for (kv, scale, says) in [
            (0, 0.5, "kv_heads = 0"),
            (4, 0.5, "does not divide"),
            (12, 0.5, "does not divide"),
            (3, 0.0, "scale"),
            (3, -1.0, "scale"),
            (3, f32::INFINITY, "scale"),
            (3, f32::NAN, "scale"),
        ] {
            let a = Attention {
                kv_heads: kv,
                scale,
                ..base
            };
            let e = causal_attention_with(&x, &x[..12], &x[..12], &mut out, &mut probs, &a)
                .unwrap_err();
            assert!(matches!(e, KernelError::InvalidShape { .. }), "{e}");
            assert!(e.to_string().contains(says), "{e}");
            let mut g = [0.0f32; 24];
            let (mut dk, mut dv) = ([0.0f32; 12], [0.0f32; 12]);
            assert!(causal_attention_backward_with(
                &x,
                &x[..12],
                &x[..12],
                &probs,
                &x,
                &mut g,
                &mut dk,
                &mut dv,
                &a
            )
            .is_err());
        }
        // k sized for the query heads under kv_heads = 3 is a length error naming k.
        let a = Attention {
            kv_heads: 3,
            ..base
        };
        let e = causal_attention_with(&x, &x, &x[..12], &mut out, &mut probs, &a).unwrap_err();
        assert!(
            matches!(
                e,
                KernelError::LengthMismatch {
                    arg: "k",
                    expected: 12,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("kv_heads=3"), "{e}");
        // The packed layout is the packed kernels' business.
        let p = Attention {
            layout: AttentionLayout::Packed,
            ..base
        };
        assert!(causal_attention_with(&x, &x, &x, &mut out, &mut probs, &p).is_err());
    }

    #[test]
    fn t1_attends_to_itself_and_is_deterministic() {
        let mut rng = Rng::new(51);
        let (batch, heads, t, d) = (2, 3, 1, 5);
        let n = batch * heads * t * d;
        let (q, k, v) = (rng.vec(n), rng.vec(n), rng.vec(n));
        let (mut out, mut probs) = (vec![0.0; n], vec![0.0; batch * heads]);
        causal_attention(&q, &k, &v, &mut out, &mut probs, batch, heads, t, d).unwrap();
        assert_eq!(probs, vec![1.0; batch * heads]);
        assert_eq!(out, v);
        let dout = rng.vec(n);
        let (mut dq, mut dk, mut dv) = (vec![1.0; n], vec![1.0; n], vec![1.0; n]);
        causal_attention_backward(
            &q, &k, &v, &probs, &dout, &mut dq, &mut dk, &mut dv, batch, heads, t, d,
        )
        .unwrap();
        assert_eq!(dv, dout);
        assert_eq!(dq, vec![0.0; n]);
        assert_eq!(dk, vec![0.0; n]);

        // Bitwise repeatability on a shape large enough for gemm's threaded path.
        let (batch, heads, t, d) = (1, 2, 128, 64);
        let n = batch * heads * t * d;
        let (q, k, v) = (rng.vec(n), rng.vec(n), rng.vec(n));
        let run = || {
            let (mut out, mut probs) = (vec![0.0; n], vec![0.0; batch * heads * t * t]);
            causal_attention(&q, &k, &v, &mut out, &mut probs, batch, heads, t, d).unwrap();
            let (mut dq, mut dk, mut dv) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
            causal_attention_backward(
                &q, &k, &v, &probs, &out, &mut dq, &mut dk, &mut dv, batch, heads, t, d,
            )
            .unwrap();
            [bits(&out), bits(&probs), bits(&dq), bits(&dk), bits(&dv)]
        };
        assert_eq!(run(), run());
    }

    #[test]
    fn shape_errors_name_the_argument() {
        let x = [0.0; 8];
        let (mut out, mut probs) = ([0.0; 8], [0.0; 8]);
        assert!(causal_attention(&x, &x, &x, &mut out, &mut probs, 1, 2, 2, 2).is_ok());
        let err = causal_attention(&x[..7], &x, &x, &mut out, &mut probs, 1, 2, 2, 2).unwrap_err();
        assert!(matches!(
            err,
            KernelError::LengthMismatch {
                arg: "q",
                expected: 8,
                actual: 7,
                ..
            }
        ));
        assert!(
            err.to_string().contains("batch=1, heads=2, t=2, d=2"),
            "{err}"
        );
        let err = causal_attention(&x, &x, &x, &mut out, &mut probs[..4], 1, 2, 2, 2).unwrap_err();
        assert!(matches!(
            err,
            KernelError::LengthMismatch { arg: "probs", .. }
        ));
        let (mut dq, mut dk, mut dv) = ([0.0; 8], [0.0; 8], [0.0; 7]);
        let err = causal_attention_backward(
            &x, &x, &x, &probs, &x, &mut dq, &mut dk, &mut dv, 1, 2, 2, 2,
        )
        .unwrap_err();
        assert!(matches!(err, KernelError::LengthMismatch { arg: "dv", .. }));
        assert!(causal_attention(&x, &x, &x, &mut out, &mut probs, usize::MAX, 2, 2, 2).is_err());
    }
}
