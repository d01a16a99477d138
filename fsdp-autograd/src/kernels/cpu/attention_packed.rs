//! Causal attention on the packed layout of a GPT's qkv projection
//! ([`AttentionLayout::Packed`](crate::kernels::attention::AttentionLayout::Packed)): q, k, v are
//! slices of one `[batch, t, 3, heads, d]` tensor, out / dout are `[batch, t, heads, d]`, and
//! the gradient is one `[batch, t, 3, heads, d]` tensor.
//!
//! The kernels gather the heads into `[batch, heads, t, d]` temporaries, run
//! [`causal_attention`] / [`causal_attention_backward`] on them and scatter the results, so
//! their numbers are bit for bit those of the head-split layout (the CPU is the reference). The
//! gathers are plain loops inside the kernel (no extra launches); they cost memory traffic of the
//! order of the operands, small next to the attention's `t²·d` products.

use super::attention::{causal_attention, causal_attention_backward};
use crate::kernels::check;
use crate::kernels::KernelError;

/// Sizes of the packed layout: (`batch·heads·t·d`, the qkv length `3·` that).
fn sizes(
    op: &'static str,
    batch: usize,
    heads: usize,
    t: usize,
    d: usize,
) -> Result<(usize, usize), KernelError> {
    let n = check::mul(op, check::mul(op, batch, heads)?, check::mul(op, t, d)?)?;
    Ok((n, check::mul(op, n, 3)?))
}

/// Calls `f(packed_start, head_start)` for every row of `d` elements of part `part` (0 = q,
/// 1 = k, 2 = v; `parts` = 3 for qkv-like tensors, `parts` = 1 and `part` = 0 for out-like
/// ones): where it starts in the packed `[batch, t, parts, heads, d]` tensor and in the
/// `[batch, heads, t, d]` one.
fn each_row(
    [batch, heads, t, d]: [usize; 4],
    parts: usize,
    part: usize,
    mut f: impl FnMut(usize, usize),
) {
    for b in 0..batch {
        for i in 0..t {
            for h in 0..heads {
                let p = (((b * t + i) * parts + part) * heads + h) * d;
                let s = ((b * heads + h) * t + i) * d;
                f(p, s);
            }
        }
    }
}

fn gather(src: &[f32], dims: [usize; 4], parts: usize, part: usize, n: usize) -> Vec<f32> {
    let d = dims[3];
    let mut dst = vec![0.0f32; n];
    each_row(dims, parts, part, |p, s| {
        dst[s..s + d].copy_from_slice(&src[p..p + d])
    });
    dst
}

fn scatter(src: &[f32], dst: &mut [f32], dims: [usize; 4], parts: usize, part: usize) {
    let d = dims[3];
    each_row(dims, parts, part, |p, s| {
        dst[p..p + d].copy_from_slice(&src[s..s + d])
    });
}

/// Causal attention forward on the packed layout: `qkv` `[batch, t, 3, heads, d]` → `out`
/// `[batch, t, heads, d]` and `probs` `[batch, heads, t, t]`; bit for bit
/// [`causal_attention`] on the split heads.
///
/// # Errors
/// [`KernelError`] if a length does not match the sizes (or they overflow).
#[allow(clippy::too_many_arguments)]
pub fn causal_attention_packed(
    qkv: &[f32],
    out: &mut [f32],
    probs: &mut [f32],
    batch: usize,
    heads: usize,
    t: usize,
    d: usize,
) -> Result<(), KernelError> {
    let op = "causal_attention";
    let (n, n3) = sizes(op, batch, heads, t, d)?;
    let shape = || format!("packed: batch={batch}, heads={heads}, t={t}, d={d}");
    check::len(op, "qkv", qkv.len(), n3, shape)?;
    check::len(op, "out", out.len(), n, shape)?;
    let dims = [batch, heads, t, d];
    let [q, k, v] = [0, 1, 2].map(|p| gather(qkv, dims, 3, p, n));
    let mut o = vec![0.0f32; n];
    causal_attention(&q, &k, &v, &mut o, probs, batch, heads, t, d)?;
    scatter(&o, out, dims, 1, 0);
    Ok(())
}

/// Causal attention backward on the packed layout: from `qkv` `[batch, t, 3, heads, d]`, the
/// forward's `probs` and `dout` `[batch, t, heads, d]`, writes all of `dqkv`
/// `[batch, t, 3, heads, d]`; bit for bit [`causal_attention_backward`] on the split heads.
///
/// # Errors
/// [`KernelError`] if a length does not match the sizes (or they overflow).
#[allow(clippy::too_many_arguments)]
pub fn causal_attention_packed_backward(
    qkv: &[f32],
    probs: &[f32],
    dout: &[f32],
    dqkv: &mut [f32],
    batch: usize,
    heads: usize,
    t: usize,
    d: usize,
) -> Result<(), KernelError> {
    let op = "causal_attention_backward";
    let (n, n3) = sizes(op, batch, heads, t, d)?;
    let shape = || format!("packed: batch={batch}, heads={heads}, t={t}, d={d}");
    check::len(op, "qkv", qkv.len(), n3, shape)?;
    check::len(op, "dout", dout.len(), n, shape)?;
    check::len(op, "dqkv", dqkv.len(), n3, shape)?;
    let dims = [batch, heads, t, d];
    let [q, k, v] = [0, 1, 2].map(|p| gather(qkv, dims, 3, p, n));
    let g = gather(dout, dims, 1, 0, n);
    let [mut dq, mut dk, mut dv] = [0, 1, 2].map(|_| vec![0.0f32; n]);
    causal_attention_backward(
        &q, &k, &v, probs, &g, &mut dq, &mut dk, &mut dv, batch, heads, t, d,
    )?;
    for (p, grad) in [&dq, &dk, &dv].into_iter().enumerate() {
        scatter(grad, dqkv, dims, 3, p);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The packed kernels equal the head-split ones on gathered inputs, bit for bit, and write
    /// every element of their outputs.
    #[test]
    fn packed_matches_head_split_bit_for_bit() {
        let (batch, heads, t, d) = (2, 3, 37, 5);
        let n = batch * heads * t * d;
        let mut x = 0x1234_5678u32;
        let mut rnd = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        };
        let qkv: Vec<f32> = (0..3 * n).map(|_| rnd()).collect();
        let dout: Vec<f32> = (0..n).map(|_| rnd()).collect();
        let dims = [batch, heads, t, d];
        let (mut out, mut probs) = (vec![f32::NAN; n], vec![f32::NAN; batch * heads * t * t]);
        causal_attention_packed(&qkv, &mut out, &mut probs, batch, heads, t, d).unwrap();
        let [q, k, v] = [0, 1, 2].map(|p| gather(&qkv, dims, 3, p, n));
        let (mut wo, mut wp) = (vec![0.0; n], vec![0.0; probs.len()]);
        causal_attention(&q, &k, &v, &mut wo, &mut wp, batch, heads, t, d).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&gather(&out, dims, 1, 0, n)), bits(&wo));
        assert_eq!(bits(&probs), bits(&wp));
        let mut dqkv = vec![f32::NAN; 3 * n];
        causal_attention_packed_backward(&qkv, &probs, &dout, &mut dqkv, batch, heads, t, d)
            .unwrap();
        let g = gather(&dout, dims, 1, 0, n);
        let [mut dq, mut dk, mut dv] = [0, 1, 2].map(|_| vec![0.0f32; n]);
        causal_attention_backward(
            &q, &k, &v, &wp, &g, &mut dq, &mut dk, &mut dv, batch, heads, t, d,
        )
        .unwrap();
        for (p, want) in [dq, dk, dv].iter().enumerate() {
            assert_eq!(bits(&gather(&dqkv, dims, 3, p, n)), bits(want));
        }
        assert!(dqkv.iter().all(|x| x.is_finite()));
        // The layout really is [batch, t, 3, heads, d]: q of (b=1, i=2, h=1) starts at
        // ((1·t + 2)·3 + 0)·heads + 1, in units of d.
        assert_eq!(
            q[((heads + 1) * t + 2) * d],
            qkv[(((t + 2) * 3) * heads + 1) * d]
        );
        // Bad lengths are errors, not panics.
        assert!(
            causal_attention_packed(&qkv[1..], &mut out, &mut probs, batch, heads, t, d).is_err()
        );
    }
}
