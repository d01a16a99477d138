//! The tensor-core flash attention forward (`attention/flash_mma.cu`) against the CPU kernels:
//! on the emulator its reference path (the same tiling and fragment registers, the mma computed
//! by a scalar routine), on a GPU the `mma.sync` code (compute capability 8.0+).

use fsdp_alloc::DType;
use half::{bf16, f16};

use crate::kernels::attention::{Attention, AttentionLayout};
use crate::kernels::cpu;

use super::cases::{assert_close, Rng};
use super::exec::{down_f32, down_u16, nan_f32, run, up_u16, Exec, Op, H};

/// `v` rounded to `dt` (bf16 or f16): the values (as f32) and the bits.
fn round(dt: DType, v: &[f32]) -> (Vec<f32>, Vec<u16>) {
    let bits: Vec<u16> = v
        .iter()
        .map(|&x| match dt {
            DType::BF16 => bf16::from_f32(x).to_bits(),
            _ => f16::from_f32(x).to_bits(),
        })
        .collect();
    (bits.iter().map(|&b| value(dt, b)).collect(), bits)
}

fn value(dt: DType, b: u16) -> f32 {
    match dt {
        DType::BF16 => bf16::from_bits(b).to_f32(),
        _ => f16::from_bits(b).to_f32(),
    }
}

fn down(dt: DType, e: &mut dyn Exec, h: H) -> Vec<f32> {
    down_u16(e, h).into_iter().map(|b| value(dt, b)).collect()
}

/// The unit roundoff of `dt`: `2^-p` for its `p` significant bits (bf16 8, f16 11).
fn unit(dt: DType) -> f32 {
    if dt == DType::BF16 {
        1.0 / 256.0
    } else {
        1.0 / 2048.0
    }
}

fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0.0f32, |m, x| m.max(x.abs()))
}

/// `(batch, heads, kv_heads, t, d, scale, dtype)`.
type Shape = (usize, usize, usize, usize, usize, Option<f32>, DType);

/// Partial query tiles (t not a multiple of 128), several key tiles of 64, one key,
/// grouped-query heads, explicit scales, both head dims.
const SHAPES: [Shape; 5] = [
    (1, 2, 2, 37, 64, None, DType::BF16),
    (2, 4, 2, 130, 64, Some(0.3), DType::BF16),
    (1, 1, 1, 1, 64, None, DType::F16),
    (1, 2, 1, 70, 128, None, DType::F16),
    (1, 2, 2, 129, 128, Some(0.125), DType::BF16),
];

/// Reference log-sum-exp of the scaled, causally masked scores, in f64 (head-split layout,
/// query head `h` reading key head `h / group`).
fn reference_lse(q: &[f32], k: &[f32], a: &Attention) -> Vec<f32> {
    let (t, d, g) = (a.t, a.d, a.group());
    let mut out = Vec::with_capacity(a.batch * a.heads * t);
    for bh in 0..a.batch * a.heads {
        let hk = (bh / a.heads) * a.kv_heads + (bh % a.heads) / g;
        for i in 0..t {
            let s: Vec<f64> = (0..=i)
                .map(|j| {
                    let dot: f64 = (0..d)
                        .map(|c| q[(bh * t + i) * d + c] as f64 * k[(hk * t + j) * d + c] as f64)
                        .sum();
                    dot * a.scale as f64
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            out.push((m + s.iter().map(|x| (x - m).exp()).sum::<f64>().ln()) as f32);
        }
    }
    out
}

/// `[batch, heads + 2·kv_heads, t, d]`-ordered q, k, v (head-split) as the packed
/// `[batch, t, heads + 2·kv_heads, d]` qkv.
fn pack(q: &[u16], k: &[u16], v: &[u16], a: &Attention) -> Vec<u16> {
    let (t, d, w) = (a.t, a.d, a.heads + 2 * a.kv_heads);
    let mut out = vec![0u16; a.batch * t * w * d];
    for b in 0..a.batch {
        for slot in 0..w {
            let (src, h, n) = if slot < a.heads {
                (q, slot, a.heads)
            } else if slot < a.heads + a.kv_heads {
                (k, slot - a.heads, a.kv_heads)
            } else {
                (v, slot - a.heads - a.kv_heads, a.kv_heads)
            };
            for i in 0..t {
                let from = ((b * n + h) * t + i) * d;
                let to = ((b * t + i) * w + slot) * d;
                out[to..to + d].copy_from_slice(&src[from..from + d]);
            }
        }
    }
    out
}

/// The tensor-core forward on bf16 / f16 operands (outputs poisoned with NaN first) against the
/// CPU kernels on the same rounded inputs, then the CUDA-core backward from its `out` and `lse`
/// against the CPU backward; the packed layout equal to the head-split one bit for bit.
///
/// Tolerances, with `u` the operand type's unit roundoff and `P` the CPU's probabilities: the
/// kernel rounds each unnormalized probability `p` to the operand type before `P·v` (relative
/// error ≤ u) while its normalizer sums the unrounded `p`, and rounds `out` once, so
/// `|out − want| ≤ u·|want| + u·Σⱼ Pᵢⱼ|vⱼ|` plus f32 rounding (scores, exponentials, sums:
/// `1e-5·max|want|`, the term the CUDA-core tests use) plus, for f16, probabilities below f16's
/// normal range (absolute error ≤ 2⁻²⁵ each, normalizer ≥ 1): `t·2⁻²⁵·max|v|`. The log-sum-exp
/// is f32 arithmetic on exact products: `1e-5·(1 + |lse|)`. The backward reads that `out`
/// through `δᵢ = Σ doutᵢ·outᵢ`, so `|Δδᵢ| ≤ Σ_c |doutᵢc|·tol_out(i, c)`, and as in
/// `flash_attention_half` `|Δdqᵢ| ≤ scale·Σⱼ Pᵢⱼ|Δδᵢ||kⱼ|`, `|Δdkⱼ| ≤ scale·Σᵢ Pᵢⱼ|Δδᵢ||qᵢ|`
/// (over the group's query heads), dv unaffected; plus the CUDA-core backward's own `u·|want|`
/// and f32 terms.
pub(super) fn flash_attention_mma(e: &mut dyn Exec) {
    let mut r = Rng::new(351);
    for (batch, heads, kv, t, d, scale, dt) in SHAPES {
        let a = Attention {
            kv_heads: kv,
            scale: scale.unwrap_or(Attention::default_scale(d)),
            ..Attention::new(batch, heads, t, d)
        };
        let what = format!("{dt:?} {}", a.describe());
        let u = unit(dt);
        let (bh, n, nkv) = (batch * heads, batch * heads * t * d, batch * kv * t * d);
        let (q, qb) = round(dt, &r.vec(n, 1.0));
        let (k, kb) = round(dt, &r.vec(nkv, 1.0));
        let (v, vb) = round(dt, &r.vec(nkv, 1.0));
        let (dout, gb) = round(dt, &r.vec(n, 1.0));
        let [hq, hk, hv, hg] = [&qb, &kb, &vb, &gb].map(|x| up_u16(e, x));
        let (out, lse) = (up_u16(e, &vec![0x7fc0; n]), nan_f32(e, bh * t));
        run(
            e,
            Op::FlashMma {
                dtype: dt,
                q: hq,
                k: hk,
                v: hv,
                out,
                lse,
                a,
            },
        );
        let (mut wo, mut wp) = (vec![0.0; n], vec![0.0; bh * t * t]);
        cpu::causal_attention_with(&q, &k, &v, &mut wo, &mut wp, &a).unwrap();
        let got = down(dt, e, out);
        let (f32_tol, vmax) = (1e-5 * max_abs(&wo), max_abs(&v));
        let sub = if dt == DType::F16 {
            t as f32 * (-25f32).exp2() * vmax
        } else {
            0.0
        };
        let g = a.group();
        let kv_of = |h: usize| (h / heads) * kv + (h % heads) / g;
        let row = |h: usize, i: usize| (h * t + i) * d;
        let mut out_tol = vec![0.0f32; n];
        for h in 0..bh {
            for i in 0..t {
                for c in 0..d {
                    let pv: f32 = (0..=i)
                        .map(|j| wp[(h * t + i) * t + j] * v[row(kv_of(h), j) + c].abs())
                        .sum();
                    let o = row(h, i) + c;
                    out_tol[o] = u * wo[o].abs() + 1.01 * u * pv + f32_tol + sub + 6e-8;
                }
            }
        }
        for (i, (&gv, &w)) in got.iter().zip(&wo).enumerate() {
            assert!(
                (gv - w).abs() <= out_tol[i],
                "mma flash out, {what} [{i}]: got {gv} want {w} (tolerance {:e})",
                out_tol[i]
            );
        }
        let got_lse = down_f32(e, lse);
        let wl = reference_lse(&q, &k, &a);
        assert_close(&format!("mma flash lse, {what}"), &got_lse, &wl, 1e-5, 1e-5);

        // The packed layout: the same kernel and arithmetic per element, bit for bit.
        let packed = Attention {
            layout: AttentionLayout::Packed,
            ..a
        };
        let hqkv = up_u16(e, &pack(&qb, &kb, &vb, &a));
        let (pout, plse) = (up_u16(e, &vec![0x7fc0; n]), nan_f32(e, bh * t));
        run(
            e,
            Op::FlashMma {
                dtype: dt,
                q: hqkv,
                k: hqkv,
                v: hqkv,
                out: pout,
                lse: plse,
                a: packed,
            },
        );
        let (pbits, hbits) = (down_u16(e, pout), down_u16(e, out));
        for b in 0..batch {
            for h in 0..heads {
                for i in 0..t {
                    let from = ((b * t + i) * heads + h) * d;
                    let to = row(b * heads + h, i);
                    assert_eq!(
                        pbits[from..from + d],
                        hbits[to..to + d],
                        "mma flash packed out, {what}: head {h} row {i}"
                    );
                }
            }
        }
        let plse = down_f32(e, plse);
        assert!(
            plse.iter()
                .zip(&got_lse)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "mma flash packed lse, {what}"
        );

        // The backward (CUDA-core kernels) from this forward's out and lse.
        let [dq, dk, dv] = [n, nkv, nkv].map(|len| up_u16(e, &vec![0x7fc0; len]));
        run(
            e,
            Op::FlashBackward {
                dtype: dt,
                q: hq,
                k: hk,
                v: hv,
                out,
                lse,
                dout: hg,
                dq,
                dk,
                dv,
                a,
            },
        );
        let (mut wdq, mut wdk, mut wdv) = (vec![0.0; n], vec![0.0; nkv], vec![0.0; nkv]);
        cpu::causal_attention_backward_with(
            &q, &k, &v, &wp, &dout, &mut wdq, &mut wdk, &mut wdv, &a,
        )
        .unwrap();
        let (mut ddq, mut ddk) = (vec![0.0f32; n], vec![0.0f32; nkv]);
        for h in 0..bh {
            let hk = kv_of(h);
            for i in 0..t {
                let o = row(h, i);
                let delta_err: f32 = (0..d).map(|c| dout[o + c].abs() * out_tol[o + c]).sum();
                for j in 0..=i {
                    let w = a.scale * wp[(h * t + i) * t + j] * delta_err;
                    for c in 0..d {
                        ddq[o + c] += w * k[row(hk, j) + c].abs();
                        ddk[row(hk, j) + c] += w * q[o + c].abs();
                    }
                }
            }
        }
        let zero = vec![0.0f32; nkv];
        for (name, h, w, extra) in [
            ("dq", dq, &wdq, &ddq),
            ("dk", dk, &wdk, &ddk),
            ("dv", dv, &wdv, &zero),
        ] {
            let got = down(dt, e, h);
            let base = 1e-5 * max_abs(w);
            for i in 0..w.len() {
                let tol = (u + 1e-5) * w[i].abs() + base + 1.01 * extra[i] + 6e-8;
                assert!(
                    (got[i] - w[i]).abs() <= tol,
                    "mma flash {name}, {what} [{i}]: got {} want {} (tolerance {tol:e})",
                    got[i],
                    w[i]
                );
            }
        }
    }
}
