//! Shared cases (emulator and GPU) of the tensor-core matrix products (`gemm_ex`: f16/bf16
//! operands, TF32) and of the fused flash-style attention, against the CPU kernels and against
//! the unfused CUDA attention.

use fsdp_alloc::DType;
use half::{bf16, f16};

use crate::kernels::attention::{Attention, AttentionLayout};
use crate::kernels::cpu;
use crate::kernels::gemm::Gemm;
use crate::kernels::gemm::GemmPrecision;

use super::cases::{assert_close, max_abs, Rng};
use super::exec::{down_f32, down_u16, nan_f32, run, up_f32, up_u16, Exec, Op, H};

/// A half type under test: its dtype, rounding of f32 values, and unit roundoff
/// `u = 2^-p` for its `p` significant bits (bf16: 8, f16: 11), the relative error bound of one
/// round-to-nearest.
#[derive(Clone, Copy)]
struct Half {
    dtype: DType,
    u: f32,
}

const BF16: Half = Half {
    dtype: DType::BF16,
    u: 1.0 / 256.0,
};
const F16: Half = Half {
    dtype: DType::F16,
    u: 1.0 / 2048.0,
};

impl Half {
    fn bits(self, x: f32) -> u16 {
        if self.dtype == DType::BF16 {
            bf16::from_f32(x).to_bits()
        } else {
            f16::from_f32(x).to_bits()
        }
    }

    fn value(self, b: u16) -> f32 {
        if self.dtype == DType::BF16 {
            bf16::from_bits(b).to_f32()
        } else {
            f16::from_bits(b).to_f32()
        }
    }

    /// `v` rounded to this type (as f32) and its bits.
    fn round(self, v: &[f32]) -> (Vec<f32>, Vec<u16>) {
        let bits: Vec<u16> = v.iter().map(|&x| self.bits(x)).collect();
        (bits.iter().map(|&b| self.value(b)).collect(), bits)
    }

    fn down(self, e: &mut dyn Exec, h: H) -> Vec<f32> {
        down_u16(e, h).into_iter().map(|b| self.value(b)).collect()
    }
}

/// `|a|·|b|` products through the CPU kernel (for rounding bounds).
#[allow(clippy::too_many_arguments)]
fn abs_bmm(a: &[f32], b: &[f32], g: &Gemm) -> Vec<f32> {
    let (aa, ab): (Vec<f32>, Vec<f32>) = (
        a.iter().map(|v| v.abs()).collect(),
        b.iter().map(|v| v.abs()).collect(),
    );
    let mut bound = vec![0.0; g.batch * g.m * g.n];
    let (bt, m, k, n) = (g.batch, g.m, g.k, g.n);
    cpu::bmm(
        &aa, &ab, &mut bound, bt, m, k, n, g.trans_a, g.trans_b, false,
    )
    .unwrap();
    bound
}

/// f16/bf16 products with f32 accumulation (`cublasGemmStridedBatchedEx`), C in the half type
/// or f32, with and without accumulation, against the CPU product of the same (rounded) inputs.
/// The product of two half values is exact in f32, so the only differences are the f32
/// accumulation order, bounded by `(k+2)·2u₃₂·Σ|a||b|`, and, for a half C, one final rounding
/// (`u·|c|`, u the half type's unit roundoff) plus the rounding of C's old value when
/// accumulating (also `u·|c₀|`, already in the reference since it reads the rounded C).
pub(super) fn gemm_half(e: &mut dyn Exec) {
    let mut r = Rng::new(251);
    for half in [BF16, F16] {
        for (batch, m, k, n) in [
            (1usize, 3usize, 4usize, 2usize),
            (3, 5, 33, 6),
            (2, 1, 0, 3),
        ] {
            for (ta, tb) in [(false, false), (true, false), (false, true)] {
                for half_c in [false, true] {
                    for acc in [false, true] {
                        let g = Gemm::new(batch, m, k, n)
                            .transposed(ta, tb)
                            .accumulating(acc);
                        let (a, ab) = half.round(&r.vec(batch * m * k, 2.0));
                        let (b, bb) = half.round(&r.vec(batch * k * n, 2.0));
                        let (c0, c0b) = half.round(&r.vec(batch * m * n, 2.0));
                        let (ha, hb) = (up_u16(e, &ab), up_u16(e, &bb));
                        let hc = if half_c {
                            up_u16(e, &c0b)
                        } else {
                            up_f32(e, &c0)
                        };
                        let p = GemmPrecision {
                            inputs: half.dtype,
                            output: if half_c { half.dtype } else { DType::F32 },
                            tf32: false,
                        };
                        run(
                            e,
                            Op::GemmEx {
                                a: ha,
                                b: hb,
                                c: hc,
                                g,
                                p,
                            },
                        );
                        let mut want = c0.clone();
                        cpu::bmm(&a, &b, &mut want, batch, m, k, n, ta, tb, acc).unwrap();
                        let bound = abs_bmm(&a, &b, &g);
                        let got = if half_c {
                            half.down(e, hc)
                        } else {
                            down_f32(e, hc)
                        };
                        for i in 0..got.len() {
                            let base = if acc { c0[i].abs() } else { 0.0 };
                            let sum = (k as f32 + 2.0) * 2.0 * f32::EPSILON * (bound[i] + base);
                            let round = if half_c { half.u * want[i].abs() } else { 0.0 };
                            // f16 results below its normal range round to multiples of 2^-24.
                            let tol = sum + round + if half_c { 6e-8 } else { 1e-30 };
                            assert!(
                                (got[i] - want[i]).abs() <= tol,
                                "gemm_ex {:?} batch={batch} m={m} k={k} n={n} ta={ta} tb={tb} \
                                 half_c={half_c} acc={acc} [{i}]: got {} want {} (tolerance \
                                 {tol:e})",
                                half.dtype,
                                got[i],
                                want[i]
                            );
                        }
                    }
                }
            }
        }
    }
}

/// TF32 products (`CUBLAS_COMPUTE_32F_FAST_TF32`): within the TF32 bound of the CPU product —
/// each input rounded to 11 significant bits (relative error ≤ 2⁻¹¹ each, so ≤ 2·2⁻¹¹ + 2⁻²²
/// per product) plus the f32 accumulation bound — and, for these random inputs, not equal to
/// the plain f32 product everywhere (the switch reaches the product).
///
/// The shape is chosen for the second check. TF32 is a permission, not an order: for a tiny
/// product (2×7×33×5, this case's old shape) cuBLAS may pick a kernel without tensor cores even
/// under `CUBLAS_COMPUTE_32F_FAST_TF32`, and then the TF32 product equals the f32 one (seen on an
/// H100). Batch 2 of 256×512·512×256 (all dimensions multiples of the tensor-core tiles, 67 M
/// multiply-adds, enough work that cuBLAS's heuristics choose a tensor-core kernel) makes "differs
/// somewhere" a valid test of the switch, while the emulator (which always rounds to TF32) still
/// runs it in a few seconds.
pub(super) fn gemm_tf32(e: &mut dyn Exec) {
    let mut r = Rng::new(252);
    let (batch, m, k, n) = (2usize, 256usize, 512usize, 256usize);
    let g = Gemm::new(batch, m, k, n);
    let (a, b) = (r.vec(batch * m * k, 1.0), r.vec(batch * k * n, 1.0));
    let (ha, hb) = (up_f32(e, &a), up_f32(e, &b));
    let (tc, fc) = (nan_f32(e, batch * m * n), nan_f32(e, batch * m * n));
    let p = GemmPrecision {
        tf32: true,
        ..GemmPrecision::F32
    };
    run(
        e,
        Op::GemmEx {
            a: ha,
            b: hb,
            c: tc,
            g,
            p,
        },
    );
    let p = GemmPrecision::F32;
    run(
        e,
        Op::GemmEx {
            a: ha,
            b: hb,
            c: fc,
            g,
            p,
        },
    );
    let mut want = vec![0.0; batch * m * n];
    cpu::bmm(&a, &b, &mut want, batch, m, k, n, false, false, false).unwrap();
    let bound = abs_bmm(&a, &b, &g);
    let (got, plain) = (down_f32(e, tc), down_f32(e, fc));
    let u11 = 1.0f32 / 2048.0;
    for i in 0..got.len() {
        let tol = (2.0 * u11 + u11 * u11 + (k as f32 + 2.0) * 2.0 * f32::EPSILON) * bound[i];
        assert!(
            (got[i] - want[i]).abs() <= tol,
            "tf32 [{i}]: got {} want {} (tolerance {tol:e})",
            got[i],
            want[i]
        );
    }
    assert!(
        got.iter().zip(&plain).any(|(x, y)| x != y),
        "TF32 products equal the f32 products everywhere: the TF32 mode did not reach cuBLAS"
    );
}

/// The log-sum-exp of each query's scaled, causally masked scores, in f64 on the host.
fn reference_lse(q: &[f32], k: &[f32], bh: usize, t: usize, d: usize) -> Vec<f32> {
    let scale = (1.0 / (d as f64).sqrt()) as f32 as f64;
    let mut out = Vec::with_capacity(bh * t);
    for h in 0..bh {
        for i in 0..t {
            let s: Vec<f64> = (0..=i)
                .map(|j| {
                    let dot: f64 = (0..d)
                        .map(|c| q[(h * t + i) * d + c] as f64 * k[(h * t + j) * d + c] as f64)
                        .sum();
                    dot * scale
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            out.push((m + s.iter().map(|x| (x - m).exp()).sum::<f64>().ln()) as f32);
        }
    }
    out
}

/// Shapes of the fused attention cases: t = 1, t not a multiple of any tile (5, 17, 21, 37, 70;
/// the forward tiles are 64/32 queries, the backward 32/16), several heads, and every kernel
/// family: the register-tiled kernels for d = 64 and d = 128 (t = 1, 37, 70) and the generic
/// ones for other head dims up to 64 (1, 4, 8, 16, the odd 33) and up to 128 (100).
const SHAPES: [(usize, usize, usize, usize); 10] = [
    (1, 1, 1, 1),
    (1, 1, 1, 64),
    (2, 3, 5, 4),
    (1, 2, 17, 8),
    (1, 1, 70, 16),
    (1, 1, 37, 100),
    (1, 2, 70, 64),
    (1, 1, 1, 128),
    (1, 1, 37, 128),
    (1, 1, 21, 33),
];

/// f32 fused attention, forward and backward, against the CPU kernels (and the forward against
/// the unfused CUDA kernels): every output within `1e-5` relative to the tensor's largest
/// magnitude, `|got − want| ≤ 1e-5·(|want| + max|want|)`; the log-sum-exp against an f64
/// reference within `1e-5` relative. The backward runs twice and must repeat bit for bit.
pub(super) fn flash_attention_f32(e: &mut dyn Exec) {
    let mut r = Rng::new(253);
    for (batch, heads, t, d) in SHAPES {
        let (bh, n, np) = (batch * heads, batch * heads * t * d, batch * heads * t * t);
        let what = format!("batch={batch} heads={heads} t={t} d={d}");
        let (q, k, v, dout) = (r.vec(n, 1.0), r.vec(n, 1.0), r.vec(n, 1.0), r.vec(n, 1.0));
        let [hq, hk, hv, hg] = [&q, &k, &v, &dout].map(|x| up_f32(e, x));
        let (out, lse) = (nan_f32(e, n), nan_f32(e, bh * t));
        let dtype = DType::F32;
        run(
            e,
            Op::Flash {
                dtype,
                q: hq,
                k: hk,
                v: hv,
                out,
                lse,
                a: Attention::new(batch, heads, t, d),
            },
        );
        let (mut wo, mut wp) = (vec![0.0; n], vec![0.0; np]);
        cpu::causal_attention(&q, &k, &v, &mut wo, &mut wp, batch, heads, t, d).unwrap();
        let got = down_f32(e, out);
        let tol = |w: &[f32]| 1e-5 * max_abs(w);
        assert_close(
            &format!("flash out vs cpu, {what}"),
            &got,
            &wo,
            1e-5,
            tol(&wo),
        );
        let wl = reference_lse(&q, &k, bh, t, d);
        assert_close(
            &format!("flash lse, {what}"),
            &down_f32(e, lse),
            &wl,
            1e-5,
            1e-5,
        );
        // Against the unfused CUDA kernels on the same executor.
        let (uo, up) = (nan_f32(e, n), nan_f32(e, np));
        let (qq, kk, vv) = (hq, hk, hv);
        run(
            e,
            Op::Attention {
                q: qq,
                k: kk,
                v: vv,
                out: uo,
                probs: up,
                a: Attention::new(batch, heads, t, d),
            },
        );
        let unfused = down_f32(e, uo);
        assert_close(
            &format!("flash out vs unfused, {what}"),
            &got,
            &unfused,
            1e-5,
            tol(&unfused),
        );

        let mut first: Option<Vec<Vec<f32>>> = None;
        for _ in 0..2 {
            let (dq, dk, dv) = (nan_f32(e, n), nan_f32(e, n), nan_f32(e, n));
            run(
                e,
                Op::FlashBackward {
                    dtype,
                    q: hq,
                    k: hk,
                    v: hv,
                    out,
                    lse,
                    dout: hg,
                    dq,
                    dk,
                    dv,
                    a: Attention::new(batch, heads, t, d),
                },
            );
            let grads: Vec<Vec<f32>> = [dq, dk, dv].iter().map(|&h| down_f32(e, h)).collect();
            match &first {
                None => first = Some(grads),
                Some(f) => {
                    let same = f.iter().flatten().zip(grads.iter().flatten());
                    assert!(
                        same.clone().all(|(a, b)| a.to_bits() == b.to_bits()),
                        "flash backward is not deterministic, {what}"
                    );
                }
            }
        }
        let grads = first.expect("ran");
        let (mut wdq, mut wdk, mut wdv) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        cpu::causal_attention_backward(
            &q, &k, &v, &wp, &dout, &mut wdq, &mut wdk, &mut wdv, batch, heads, t, d,
        )
        .unwrap();
        for (name, g, w) in [
            ("dq", &grads[0], &wdq),
            ("dk", &grads[1], &wdk),
            ("dv", &grads[2], &wdv),
        ] {
            assert_close(&format!("flash {name} vs cpu, {what}"), g, w, 1e-5, tol(w));
        }
    }
}

/// bf16 (all shapes) and f16 (four shapes: both kernel families) fused attention against the CPU kernels run in f32 on
/// the same rounded inputs. The kernels compute in f32 and round each output once, so the
/// tolerance is `u·|want|` (u = 2⁻⁸ for bf16, 2⁻¹¹ for f16: one round-to-nearest) plus the f32
/// term of [`flash_attention_f32`]; for the gradients add what the rounded forward output
/// contributes through `delta = rowsum(dout ⊙ out)`: `|Δδᵢ| ≤ u·Σ|doutᵢ||outᵢ|`, hence
/// `|Δdqᵢ| ≤ scale·|Δδᵢ|·Σⱼ Pᵢⱼ|kⱼ|` and `|Δdkⱼ| ≤ scale·Σᵢ Pᵢⱼ|Δδᵢ||qᵢ|` (dv does not use
/// delta), evaluated per element from the CPU's probabilities.
pub(super) fn flash_attention_half(e: &mut dyn Exec) {
    let mut r = Rng::new(254);
    let cases = SHAPES
        .iter()
        .map(|&s| (BF16, s))
        .chain([2, 5, 6, 8].map(|i| (F16, SHAPES[i])));
    for (half, (batch, heads, t, d)) in cases {
        let (bh, n, np) = (batch * heads, batch * heads * t * d, batch * heads * t * t);
        let what = format!("{:?} batch={batch} heads={heads} t={t} d={d}", half.dtype);
        let [(q, qb), (k, kb), (v, vb), (dout, gb)] = [(); 4].map(|()| half.round(&r.vec(n, 1.0)));
        let [hq, hk, hv, hg] = [&qb, &kb, &vb, &gb].map(|x| up_u16(e, x));
        let (out, lse) = (up_u16(e, &vec![0x7fc0; n]), nan_f32(e, bh * t));
        let dtype = half.dtype;
        run(
            e,
            Op::Flash {
                dtype,
                q: hq,
                k: hk,
                v: hv,
                out,
                lse,
                a: Attention::new(batch, heads, t, d),
            },
        );
        let (mut wo, mut wp) = (vec![0.0; n], vec![0.0; np]);
        cpu::causal_attention(&q, &k, &v, &mut wo, &mut wp, batch, heads, t, d).unwrap();
        let got_out = half.down(e, out);
        let f32_tol = |w: &[f32]| 1e-5 * max_abs(w);
        assert_close(
            &format!("flash out, {what}"),
            &got_out,
            &wo,
            half.u + 1e-5,
            f32_tol(&wo),
        );

        let (dq, dk, dv) = [(); 3].map(|()| up_u16(e, &vec![0x7fc0; n])).into();
        run(
            e,
            Op::FlashBackward {
                dtype,
                q: hq,
                k: hk,
                v: hv,
                out,
                lse,
                dout: hg,
                dq,
                dk,
                dv,
                a: Attention::new(batch, heads, t, d),
            },
        );
        let (mut wdq, mut wdk, mut wdv) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        cpu::causal_attention_backward(
            &q, &k, &v, &wp, &dout, &mut wdq, &mut wdk, &mut wdv, batch, heads, t, d,
        )
        .unwrap();
        // The delta perturbation bounds.
        let scale = (1.0 / (d as f64).sqrt()) as f32;
        let row = |h: usize, i: usize| (h * t + i) * d;
        let mut ddq = vec![0.0f32; n];
        let mut ddk = vec![0.0f32; n];
        for h in 0..bh {
            let delta_err: Vec<f32> = (0..t)
                .map(|i| {
                    let o = row(h, i);
                    half.u * (0..d).map(|c| (dout[o + c] * wo[o + c]).abs()).sum::<f32>()
                })
                .collect();
            for i in 0..t {
                for j in 0..=i {
                    let p = wp[h * t * t + i * t + j];
                    let w = scale * p * delta_err[i];
                    for c in 0..d {
                        ddq[row(h, i) + c] += w * k[row(h, j) + c].abs();
                        ddk[row(h, j) + c] += w * q[row(h, i) + c].abs();
                    }
                }
            }
        }
        let zero = vec![0.0f32; n];
        for (name, h, w, extra) in [
            ("dq", dq, &wdq, &ddq),
            ("dk", dk, &wdk, &ddk),
            ("dv", dv, &wdv, &zero),
        ] {
            let got = half.down(e, h);
            let base = f32_tol(w);
            for i in 0..n {
                let tol = (half.u + 1e-5) * w[i].abs() + base + 1.01 * extra[i] + 6e-8;
                assert!(
                    (got[i] - w[i]).abs() <= tol,
                    "flash {name}, {what} [{i}]: got {} want {} (tolerance {tol:e})",
                    got[i],
                    w[i]
                );
            }
        }
    }
}

/// Heads `first..first + count` of a packed `[batch, t, width, d]` tensor as
/// `[batch·count, t, d]`.
fn unpack<T: Copy>(
    x: &[T],
    [b, t, d]: [usize; 3],
    width: usize,
    first: usize,
    count: usize,
) -> Vec<T> {
    let mut out = Vec::with_capacity(b * count * t * d);
    for bi in 0..b {
        for hi in 0..count {
            for i in 0..t {
                let at = ((bi * t + i) * width + first + hi) * d;
                out.extend_from_slice(&x[at..at + d]);
            }
        }
    }
    out
}

/// `a` in the packed layout.
fn packed(a: Attention) -> Attention {
    Attention {
        layout: AttentionLayout::Packed,
        ..a
    }
}

fn up<T: bytemuck::Pod>(e: &mut dyn Exec, v: &[T]) -> H {
    e.upload(bytemuck::cast_slice(v))
}

fn down<T: bytemuck::Pod>(e: &mut dyn Exec, h: H) -> Vec<T> {
    let bytes = e.download(h);
    let mut v = vec![T::zeroed(); bytes.len() / std::mem::size_of::<T>()];
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(&bytes);
    v
}

/// One packed-layout case of shape `a` (head-split layout; any `kv_heads` and scale) with
/// element bits `T` (f32 bits or half bits): the fused kernels on the packed layout (`qkv`
/// `[batch, t, heads + 2·kv_heads, d]`, `dout` `[batch, t, heads, d]`) against the same kernels
/// on the head-split tensors gathered on the host: out, lse and every slice of dqkv equal bit
/// for bit, and every element of the outputs written (`nan` fill gone).
fn packed_case<T: bytemuck::Pod + PartialEq + std::fmt::Debug>(
    e: &mut dyn Exec,
    dtype: DType,
    a: Attention,
    qkv: &[T],
    dout: &[T],
    nan: T,
) {
    let what = format!("packed {dtype:?} {}", a.describe());
    let (batch, heads, kv, t, d) = (a.batch, a.heads, a.kv_heads, a.t, a.d);
    let (n, nkv, bh) = (batch * heads * t * d, batch * kv * t * d, batch * heads);
    let (dims, w) = ([batch, t, d], heads + 2 * kv);
    let (q, k, v) = (
        unpack(qkv, dims, w, 0, heads),
        unpack(qkv, dims, w, heads, kv),
        unpack(qkv, dims, w, heads + kv, kv),
    );
    let g = unpack(dout, dims, heads, 0, heads);
    let [hq, hk, hv, hg] = [&q, &k, &v, &g].map(|x| up(e, x));
    let (hqkv, hgp) = (up(e, qkv), up(e, dout));
    // Head-split layout.
    let (out, lse) = (up(e, &vec![nan; n]), nan_f32(e, bh * t));
    let (dq, dk, dv) = (
        up(e, &vec![nan; n]),
        up(e, &vec![nan; nkv]),
        up(e, &vec![nan; nkv]),
    );
    run(
        e,
        Op::Flash {
            dtype,
            q: hq,
            k: hk,
            v: hv,
            out,
            lse,
            a,
        },
    );
    run(
        e,
        Op::FlashBackward {
            dtype,
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
    // Packed layout.
    let (pout, plse, dqkv) = (
        up(e, &vec![nan; n]),
        nan_f32(e, bh * t),
        up(e, &vec![nan; qkv.len()]),
    );
    run(
        e,
        Op::Flash {
            dtype,
            q: hqkv,
            k: hqkv,
            v: hqkv,
            out: pout,
            lse: plse,
            a: packed(a),
        },
    );
    run(
        e,
        Op::FlashBackward {
            dtype,
            q: hqkv,
            k: hqkv,
            v: hqkv,
            out: pout,
            lse: plse,
            dout: hgp,
            dq: dqkv,
            dk: dqkv,
            dv: dqkv,
            a: packed(a),
        },
    );
    let po: Vec<T> = down(e, pout);
    assert!(!po.contains(&nan), "{what}: out not fully written");
    assert_eq!(
        unpack(&po, dims, heads, 0, heads),
        down::<T>(e, out),
        "{what}: out"
    );
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    assert_eq!(
        bits(down_f32(e, plse)),
        bits(down_f32(e, lse)),
        "{what}: lse"
    );
    let pg: Vec<T> = down(e, dqkv);
    assert!(!pg.contains(&nan), "{what}: dqkv not fully written");
    for (name, h, first, count) in [
        ("dq", dq, 0, heads),
        ("dk", dk, heads, kv),
        ("dv", dv, heads + kv, kv),
    ] {
        assert_eq!(
            unpack(&pg, dims, w, first, count),
            down::<T>(e, h),
            "{what}: {name}"
        );
    }
}

/// The fused kernels on the packed layout of a GPT's qkv projection (`FlashLayout::of` a packed
/// shape: no head split / merge copies) equal, bit for bit, the same kernels on the head-split
/// tensors, whose numerics [`flash_attention_f32`] / [`flash_attention_half`] check against the
/// CPU: f32 on both kernel families (generic d = 4, 33; register-tiled d = 64, 128; t = 1 and t
/// not a multiple of any tile; several batches and heads), bf16 and f16 on both families.
pub(super) fn flash_attention_packed(e: &mut dyn Exec) {
    let mut r = Rng::new(255);
    for (b, h, t, d) in [
        (2, 3, 5, 4),
        (1, 1, 1, 64),
        (2, 2, 37, 64),
        (1, 2, 21, 33),
        (2, 1, 19, 128),
    ] {
        let (qkv, dout) = (r.vec(3 * b * h * t * d, 1.0), r.vec(b * h * t * d, 1.0));
        let to_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        let nan = f32::NAN.to_bits();
        let a = Attention::new(b, h, t, d);
        packed_case(e, DType::F32, a, &to_bits(&qkv), &to_bits(&dout), nan);
    }
    for (half, (b, h, t, d)) in [
        (BF16, (2, 3, 5, 4)),
        (BF16, (2, 2, 37, 64)),
        (F16, (1, 2, 21, 128)),
    ] {
        let (qkv, dout) = (r.vec(3 * b * h * t * d, 1.0), r.vec(b * h * t * d, 1.0));
        let to_bits = |v: &[f32]| v.iter().map(|&x| half.bits(x)).collect::<Vec<u16>>();
        let nan = half.bits(f32::NAN);
        let a = Attention::new(b, h, t, d);
        packed_case(e, half.dtype, a, &to_bits(&qkv), &to_bits(&dout), nan);
    }
}

/// Shapes of the grouped-query cases: (batch, heads, kv_heads, t, d, scale) over both kernel
/// families (generic d = 4, 33, 100; register-tiled d = 64, 128), groups of 2, 3 and 4 and a
/// single key/value head, t = 1 and t not a multiple of any tile, default and other scales.
const GQA_SHAPES: [(usize, usize, usize, usize, usize, Option<f32>); 7] = [
    (2, 4, 2, 5, 4, None),
    (1, 6, 2, 37, 33, Some(0.5)),
    (1, 4, 1, 1, 64, None),
    (2, 4, 2, 37, 64, Some(0.2)),
    (1, 3, 1, 19, 128, None),
    (1, 2, 2, 21, 100, Some(1.0)),
    (1, 8, 2, 70, 64, None),
];

/// Grouped-query attention and non-default scales on the fused kernels (f32): forward and
/// backward against the CPU kernels (`causal_attention_with`, the tolerances of
/// [`flash_attention_f32`]), the backward repeating bit for bit; the forward and dq equal, bit
/// for bit, the same kernels on keys/values repeated per query head (multi-head: the same
/// arithmetic per query head), and dk/dv the group sums of that run's gradients to f32
/// rounding; the packed layout `[batch, t, heads + 2·kv_heads, d]` equals the head-split one
/// bit for bit (f32 and bf16).
pub(super) fn flash_attention_grouped(e: &mut dyn Exec) {
    let mut r = Rng::new(256);
    for (batch, heads, kv, t, d, scale) in GQA_SHAPES {
        let a = Attention {
            kv_heads: kv,
            scale: scale.unwrap_or(Attention::default_scale(d)),
            ..Attention::new(batch, heads, t, d)
        };
        let what = a.describe();
        let (g, td) = (heads / kv, t * d);
        let (n, nkv, bh) = (batch * heads * td, batch * kv * td, batch * heads);
        let (q, k, v, dout) = (
            r.vec(n, 1.0),
            r.vec(nkv, 1.0),
            r.vec(nkv, 1.0),
            r.vec(n, 1.0),
        );
        let [hq, hk, hv, hg] = [&q, &k, &v, &dout].map(|x| up_f32(e, x));
        let (out, lse) = (nan_f32(e, n), nan_f32(e, bh * t));
        let dtype = DType::F32;
        run(
            e,
            Op::Flash {
                dtype,
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
        let got = down_f32(e, out);
        let tol = |w: &[f32]| 1e-5 * max_abs(w);
        assert_close(
            &format!("gqa out vs cpu, {what}"),
            &got,
            &wo,
            1e-5,
            tol(&wo),
        );
        let mut first: Option<Vec<Vec<f32>>> = None;
        for _ in 0..2 {
            let (dq, dk, dv) = (nan_f32(e, n), nan_f32(e, nkv), nan_f32(e, nkv));
            run(
                e,
                Op::FlashBackward {
                    dtype,
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
            let grads: Vec<Vec<f32>> = [dq, dk, dv].iter().map(|&h| down_f32(e, h)).collect();
            match &first {
                None => first = Some(grads),
                Some(f) => {
                    let same = f.iter().flatten().zip(grads.iter().flatten());
                    assert!(
                        same.clone().all(|(a, b)| a.to_bits() == b.to_bits()),
                        "gqa backward is not deterministic, {what}"
                    );
                }
            }
        }
        let grads = first.expect("ran");
        let (mut wdq, mut wdk, mut wdv) = (vec![0.0; n], vec![0.0; nkv], vec![0.0; nkv]);
        cpu::causal_attention_backward_with(
            &q, &k, &v, &wp, &dout, &mut wdq, &mut wdk, &mut wdv, &a,
        )
        .unwrap();
        for (name, got, w) in [
            ("dq", &grads[0], &wdq),
            ("dk", &grads[1], &wdk),
            ("dv", &grads[2], &wdv),
        ] {
            assert_close(&format!("gqa {name} vs cpu, {what}"), got, w, 1e-5, tol(w));
        }

        // The same kernels on keys and values repeated per query head.
        let kv_of = |h: usize| (h / heads) * kv + (h % heads) / g;
        let repeat = |x: &[f32]| -> Vec<f32> {
            (0..bh)
                .flat_map(|h| x[kv_of(h) * td..(kv_of(h) + 1) * td].to_vec())
                .collect()
        };
        let m = Attention {
            kv_heads: heads,
            ..a
        };
        let (hkr, hvr) = (up_f32(e, &repeat(&k)), up_f32(e, &repeat(&v)));
        let (mout, mlse) = (nan_f32(e, n), nan_f32(e, bh * t));
        let (mdq, mdk, mdv) = (nan_f32(e, n), nan_f32(e, n), nan_f32(e, n));
        run(
            e,
            Op::Flash {
                dtype,
                q: hq,
                k: hkr,
                v: hvr,
                out: mout,
                lse: mlse,
                a: m,
            },
        );
        run(
            e,
            Op::FlashBackward {
                dtype,
                q: hq,
                k: hkr,
                v: hvr,
                out: mout,
                lse: mlse,
                dout: hg,
                dq: mdq,
                dk: mdk,
                dv: mdv,
                a: m,
            },
        );
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&down_f32(e, mout)),
            bits(&got),
            "gqa out vs repeated, {what}"
        );
        assert_eq!(
            bits(&down_f32(e, mlse)),
            bits(&down_f32(e, lse)),
            "gqa lse, {what}"
        );
        assert_eq!(
            bits(&down_f32(e, mdq)),
            bits(&grads[0]),
            "gqa dq vs repeated, {what}"
        );
        for (name, h, got) in [("dk", mdk, &grads[1]), ("dv", mdv, &grads[2])] {
            let per_head = down_f32(e, h);
            let mut sum = vec![0.0f32; nkv];
            for hh in 0..bh {
                for i in 0..td {
                    sum[kv_of(hh) * td + i] += per_head[hh * td + i];
                }
            }
            assert_close(
                &format!("gqa {name} = group sum, {what}"),
                got,
                &sum,
                1e-5,
                tol(&sum),
            );
        }

        // The packed layout, f32 and bf16.
        let w = heads + 2 * kv;
        let (qkv, gd) = (r.vec(batch * t * w * d, 1.0), r.vec(n, 1.0));
        let to_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        packed_case(
            e,
            dtype,
            a,
            &to_bits(&qkv),
            &to_bits(&gd),
            f32::NAN.to_bits(),
        );
        let to_half = |v: &[f32]| v.iter().map(|&x| BF16.bits(x)).collect::<Vec<u16>>();
        packed_case(
            e,
            BF16.dtype,
            a,
            &to_half(&qkv),
            &to_half(&gd),
            BF16.bits(f32::NAN),
        );
    }
}
