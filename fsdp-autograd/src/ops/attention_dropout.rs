//! Causal self-attention of a qkv projection built from ops, with dropout on the attention
//! probabilities: [`causal_attention_qkv_dropout`] (GPT-2's `attn_pdrop` in training).
//!
//! The fused attention kernels (the CPU's and the flash kernels) take no dropout, so when the
//! probabilities must be dropped the attention is composed of plain ops instead: scores
//! `q·kᵀ` (a batched product), scaled, the causal mask added (`-inf` above the diagonal), a row
//! softmax, [`dropout`](crate::dropout) of the probabilities, and the product with `v`. Every
//! step is an ordinary differentiable op, so the backward is the chain of theirs.
//!
//! **Cost.** The scores and probabilities are materialized: `[batch, heads, t, t]` each, and the
//! backward keeps the probabilities (softmax output) and the dropped probabilities (the value
//! product's input) — memory quadratic in `t` per layer, where the fused kernels' is linear —
//! and the work runs as separate kernels (two products, scale, mask, softmax, dropout) instead
//! of one. Under mixed precision the scores and probabilities are rounded to the compute dtype
//! between the steps (the fused kernels keep them in f32). It is used only in training forwards
//! with `attn_pdrop > 0`; evaluation and sampling take the fused path.

use crate::error::{shape_err, Result};
use crate::kernels::dropout::DropoutKey;
use crate::ops::dropout::dropout;
use crate::tensor::Tensor;

/// The probabilities' dropout: probability, key, site.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProbDropout {
    /// Drop probability in `[0, 1)`.
    pub p: f32,
    /// The forward's key (row `r` of the batch is sample `key.sample + r`).
    pub key: DropoutKey,
    /// The site number of this attention's probabilities.
    pub site: u32,
}

/// Multi-head causal attention of `qkv` (`[batch, t, 3·d]`, read as `[batch, t, 3, heads,
/// d/heads]` like [`causal_attention_qkv`](crate::causal_attention_qkv)) → `[batch, t, d]`:
/// `softmax(scale · q·kᵀ + causal mask)`, its probabilities dropped by `drop` when given, times
/// `v` — composed of ops (see the module docs for the cost). Without `drop` it computes the
/// same attention as the fused kernels with the given `scale` (to rounding).
///
/// # Errors
/// As [`causal_attention_qkv`](crate::causal_attention_qkv); a `scale` that is not finite;
/// [`dropout`]'s errors.
pub fn causal_attention_qkv_dropout(
    qkv: &Tensor,
    heads: usize,
    scale: f32,
    drop: Option<ProbDropout>,
) -> Result<Tensor> {
    let op = "causal_attention_qkv_dropout";
    let s = qkv.shape();
    if s.len() != 3 || heads == 0 || s[2] == 0 || s[2] % (3 * heads) != 0 || s[1] == 0 {
        return Err(shape_err(
            op,
            format!("qkv must be [batch, t > 0, 3·heads·d] with heads = {heads}, got {s:?}"),
        ));
    }
    if !scale.is_finite() {
        return Err(shape_err(op, format!("scale {scale} is not finite")));
    }
    qkv.check_float(op)?;
    let (b, t, d) = (s[0], s[1], s[2] / 3);
    let dh = d / heads;
    let parts = qkv
        .view(&[b, t, 3, heads, dh])?
        .permute(&[2, 0, 3, 1, 4])? // [3, b, h, t, dh]
        .contiguous()?
        .split(&[1, 1, 1])?;
    let q = parts[0].view(&[b, heads, t, dh])?;
    let k = parts[1].view(&[b, heads, t, dh])?;
    let v = parts[2].view(&[b, heads, t, dh])?;
    let scores = q.matmul(&k.transpose(2, 3)?)?.scale(scale)?; // [b, h, t, t]
    let mask: Vec<f32> = (0..t * t)
        .map(|i| {
            if i % t > i / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, &[t, t], qkv.device())?.to_dtype(qkv.dtype())?;
    let probs = scores.add(&mask)?.softmax()?;
    let probs = match drop {
        Some(dr) => dropout(&probs, dr.p, dr.key, dr.site)?,
        None => probs,
    };
    probs
        .matmul(&v)? // [b, h, t, dh]
        .permute(&[0, 2, 1, 3])?
        .contiguous()?
        .view(&[b, t, d])
}

#[cfg(test)]
mod tests {
    use super::*;
    use fsdp_alloc::Device;

    fn qkv(dev: &Device, b: usize, t: usize, d: usize) -> Tensor {
        let mut s = 3u64;
        let v: Vec<f32> = (0..b * t * 3 * d)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect();
        Tensor::from_vec(v, &[b, t, 3 * d], dev).unwrap()
    }

    /// Without dropout and at the default scale the composition equals the fused attention
    /// (to f32 rounding); with scale 1 it differs.
    #[test]
    fn matches_the_fused_attention_without_dropout() {
        let dev = Device::cpu(0);
        let (b, t, d, h) = (2, 7, 12, 3);
        let x = qkv(&dev, b, t, d);
        let fused = crate::causal_attention_qkv(&x, h)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let scale = 1.0 / ((d / h) as f32).sqrt();
        let mine = causal_attention_qkv_dropout(&x, h, scale, None)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        for (a, c) in fused.iter().zip(&mine) {
            assert!((a - c).abs() < 1e-5, "{a} vs {c}");
        }
        let one = causal_attention_qkv_dropout(&x, h, 1.0, None)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        assert!(fused.iter().zip(&one).any(|(a, c)| (a - c).abs() > 1e-3));
    }

    /// With dropout, each output row is the dropped, rescaled probabilities times v: checked
    /// against a plain loop over the same mask (drawn by dropping a tensor of ones).
    #[test]
    fn drops_the_probabilities() {
        let dev = Device::cpu(0);
        let (b, t, d, h) = (2, 5, 8, 2);
        let dh = d / h;
        let x = qkv(&dev, b, t, d);
        let key = DropoutKey {
            seed: 3,
            step: 1,
            sample: 40,
        };
        let drop = ProbDropout {
            p: 0.4,
            key,
            site: 9,
        };
        let got = causal_attention_qkv_dropout(&x, h, 0.5, Some(drop))
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let ones = Tensor::from_vec(vec![1.0f32; b * h * t * t], &[b, h, t, t], &dev).unwrap();
        let m = dropout(&ones, 0.4, key, 9)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let xv = x.to_vec::<f32>().unwrap();
        let at = |bi: usize, ti: usize, part: usize, hi: usize, j: usize| {
            xv[((bi * t + ti) * 3 + part) * d + hi * dh + j] as f64
        };
        for bi in 0..b {
            for hi in 0..h {
                for qi in 0..t {
                    let s: Vec<f64> = (0..=qi)
                        .map(|ki| {
                            (0..dh)
                                .map(|j| at(bi, qi, 0, hi, j) * at(bi, ki, 1, hi, j))
                                .sum::<f64>()
                                * 0.5
                        })
                        .collect();
                    let mx = s.iter().cloned().fold(f64::MIN, f64::max);
                    let z: f64 = s.iter().map(|v| (v - mx).exp()).sum();
                    for j in 0..dh {
                        let want: f64 = (0..=qi)
                            .map(|ki| {
                                let p = (s[ki] - mx).exp() / z;
                                p * m[((bi * h + hi) * t + qi) * t + ki] as f64
                                    * at(bi, ki, 2, hi, j)
                            })
                            .sum();
                        let g = got[(bi * t + qi) * d + hi * dh + j] as f64;
                        assert!(
                            (g - want).abs() < 1e-5,
                            "b{bi} h{hi} q{qi} j{j}: {g} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
