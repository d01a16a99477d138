//! Causal attention on the packed layout of a fused qkv projection
//! ([`AttentionLayout::Packed`](crate::kernels::attention::AttentionLayout::Packed)): q, k, v are
//! slices of one `[batch, t, heads + 2·kv_heads, d]` tensor (GPT's `[batch, t, 3, heads, d]`
//! when `kv_heads == heads`), out / dout are `[batch, t, heads, d]`, and the gradient is one
//! tensor of the qkv shape.
//!
//! The kernels gather the heads into `[batch, heads, t, d]` (queries) and `[batch, kv_heads, t,
//! d]` (keys, values) temporaries, run [`causal_attention_with`] /
//! [`causal_attention_backward_with`] on them and scatter the results, so their numbers are bit
//! for bit those of the head-split layout (the CPU is the reference). The gathers are plain
//! loops inside the kernel (no extra launches); they cost memory traffic of the order of the
//! operands, small next to the attention's `t²·d` products.

use super::attention::{causal_attention_backward_with, causal_attention_with};
use crate::kernels::attention::{Attention, AttentionLayout};
use crate::kernels::check;
use crate::kernels::KernelError;

/// Which heads of a packed tensor a gather or scatter moves: `count` heads starting at head
/// slot `first` of rows `width` heads wide.
#[derive(Clone, Copy)]
struct Slots {
    width: usize,
    first: usize,
    count: usize,
}

/// The query, key and value slots of the qkv tensor of `a`, and the one slot range of out.
fn slots(a: &Attention) -> ([Slots; 3], Slots) {
    let (h, kv) = (a.heads, a.kv_heads);
    let width = h + 2 * kv;
    let part = |first, count| Slots {
        width,
        first,
        count,
    };
    let out = Slots {
        width: h,
        first: 0,
        count: h,
    };
    ([part(0, h), part(h, kv), part(h + kv, kv)], out)
}

/// Checks `a` (its own rules, the packed layout) and returns (elements of q-shaped head-split
/// tensors, of k-shaped ones, of the packed qkv tensor).
fn sizes(op: &'static str, a: &Attention) -> Result<(usize, usize, usize), KernelError> {
    a.check(op)?;
    if a.layout != AttentionLayout::Packed {
        return Err(KernelError::InvalidShape {
            op,
            reason: format!(
                "the packed kernel takes AttentionLayout::Packed, got {:?}; use \
                 causal_attention_with for the head-split layout",
                a.layout
            ),
        });
    }
    let overflow = || KernelError::InvalidShape {
        op,
        reason: format!("attention sizes overflow: {}", a.describe()),
    };
    let (nq, nkv) = a.head_split_lens().ok_or_else(overflow)?;
    Ok((nq, nkv, a.packed_len().ok_or_else(overflow)?))
}

/// Calls `f(packed_index, head_index)` for every element of the heads `s` of a packed
/// `[batch, t, s.width, d]` tensor: its index there and in the `[batch, s.count, t, d]` one.
fn each(batch: usize, t: usize, d: usize, s: Slots, mut f: impl FnMut(usize, usize)) {
    for b in 0..batch {
        for i in 0..t {
            for h in 0..s.count {
                let p = ((b * t + i) * s.width + s.first + h) * d;
                let o = ((b * s.count + h) * t + i) * d;
                for j in 0..d {
                    f(p + j, o + j);
                }
            }
        }
    }
}

fn gather(src: &[f32], a: &Attention, s: Slots) -> Vec<f32> {
    let mut dst = vec![0.0f32; a.batch * s.count * a.t * a.d];
    each(a.batch, a.t, a.d, s, |p, o| dst[o] = src[p]);
    dst
}

fn scatter(src: &[f32], dst: &mut [f32], a: &Attention, s: Slots) {
    each(a.batch, a.t, a.d, s, |p, o| dst[p] = src[o]);
}

/// Causal attention forward on the packed layout: [`causal_attention_packed_with`] for
/// [`Attention::new`]`(batch, heads, t, d)` in the packed layout (`qkv`
/// `[batch, t, 3, heads, d]`).
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
    let a = Attention {
        layout: AttentionLayout::Packed,
        ..Attention::new(batch, heads, t, d)
    };
    causal_attention_packed_with(qkv, out, probs, &a)
}

/// Causal attention forward of shape `a` (layout [`AttentionLayout::Packed`]): `qkv`
/// `[batch, t, heads + 2·kv_heads, d]` → `out` `[batch, t, heads, d]` and `probs`
/// `[batch, heads, t, t]`; bit for bit [`causal_attention_with`] on the split heads.
///
/// # Errors
/// [`KernelError`] if a length does not match the sizes (or they overflow), for a shape
/// [`Attention::check`] rejects, or a layout other than packed.
pub fn causal_attention_packed_with(
    qkv: &[f32],
    out: &mut [f32],
    probs: &mut [f32],
    a: &Attention,
) -> Result<(), KernelError> {
    let op = "causal_attention";
    let (n, _, n3) = sizes(op, a)?;
    let shape = || a.describe();
    check::len(op, "qkv", qkv.len(), n3, shape)?;
    check::len(op, "out", out.len(), n, shape)?;
    let ([sq, sk, sv], so) = slots(a);
    let [q, k, v] = [sq, sk, sv].map(|s| gather(qkv, a, s));
    let mut o = vec![0.0f32; n];
    let split = Attention {
        layout: AttentionLayout::Heads,
        ..*a
    };
    causal_attention_with(&q, &k, &v, &mut o, probs, &split)?;
    scatter(&o, out, a, so);
    Ok(())
}

/// Causal attention backward on the packed layout: [`causal_attention_packed_backward_with`]
/// for [`Attention::new`]`(batch, heads, t, d)` in the packed layout.
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
    let a = Attention {
        layout: AttentionLayout::Packed,
        ..Attention::new(batch, heads, t, d)
    };
    causal_attention_packed_backward_with(qkv, probs, dout, dqkv, &a)
}

/// Causal attention backward of shape `a` (layout [`AttentionLayout::Packed`]): from `qkv`
/// `[batch, t, heads + 2·kv_heads, d]`, the forward's `probs` and `dout` `[batch, t, heads,
/// d]`, writes all of `dqkv` (the qkv shape); bit for bit [`causal_attention_backward_with`]
/// on the split heads.
///
/// # Errors
/// As [`causal_attention_packed_with`].
pub fn causal_attention_packed_backward_with(
    qkv: &[f32],
    probs: &[f32],
    dout: &[f32],
    dqkv: &mut [f32],
    a: &Attention,
) -> Result<(), KernelError> {
    let op = "causal_attention_backward";
    let (n, nkv, n3) = sizes(op, a)?;
    let shape = || a.describe();
    check::len(op, "qkv", qkv.len(), n3, shape)?;
    check::len(op, "dout", dout.len(), n, shape)?;
    check::len(op, "dqkv", dqkv.len(), n3, shape)?;
    let ([sq, sk, sv], so) = slots(a);
    let [q, k, v] = [sq, sk, sv].map(|s| gather(qkv, a, s));
    let g = gather(dout, a, so);
    let (mut dq, mut dk, mut dv) = (vec![0.0f32; n], vec![0.0f32; nkv], vec![0.0f32; nkv]);
    let split = Attention {
        layout: AttentionLayout::Heads,
        ..*a
    };
    causal_attention_backward_with(&q, &k, &v, probs, &g, &mut dq, &mut dk, &mut dv, &split)?;
    for (grad, s) in [(&dq, sq), (&dk, sk), (&dv, sv)] {
        scatter(grad, dqkv, a, s);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::{causal_attention, causal_attention_backward};

    /// Part `part` of a `[batch, t, parts, heads, d]` tensor as `[batch, heads, t, d]`: GPT's
    /// packed layout, written out independently of the kernels' [`Slots`].
    fn gather(
        src: &[f32],
        [batch, heads, t, d]: [usize; 4],
        parts: usize,
        part: usize,
        n: usize,
    ) -> Vec<f32> {
        let mut dst = vec![0.0f32; n];
        for b in 0..batch {
            for i in 0..t {
                for h in 0..heads {
                    let p = (((b * t + i) * parts + part) * heads + h) * d;
                    let s = ((b * heads + h) * t + i) * d;
                    dst[s..s + d].copy_from_slice(&src[p..p + d]);
                }
            }
        }
        dst
    }

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

    /// Grouped-query packing `[batch, t, heads + 2·kv_heads, d]`: per position the query heads,
    /// then the key heads, then the value heads; bit for bit the head-split kernels on the
    /// gathered heads, and every element of dqkv written.
    #[test]
    fn grouped_packing_matches_head_split_bit_for_bit() {
        let (batch, heads, kv, t, d) = (2, 6, 2, 35, 3);
        let a = Attention {
            kv_heads: kv,
            scale: 0.3,
            layout: AttentionLayout::Packed,
            ..Attention::new(batch, heads, t, d)
        };
        let w = heads + 2 * kv;
        let (n, nkv) = (batch * heads * t * d, batch * kv * t * d);
        let qkv: Vec<f32> = (0..batch * t * w * d)
            .map(|i| ((i * 7919) % 1013) as f32 / 1013.0 - 0.5)
            .collect();
        let dout: Vec<f32> = (0..n)
            .map(|i| ((i * 104_729) % 997) as f32 / 997.0 - 0.5)
            .collect();
        // Head `h` of slot range [first, first + count) at position (b, i): an independent
        // statement of the layout.
        let heads_of = |x: &[f32], first: usize, count: usize, width: usize| -> Vec<f32> {
            let mut o = Vec::with_capacity(batch * count * t * d);
            for b in 0..batch {
                for h in 0..count {
                    for i in 0..t {
                        let at = ((b * t + i) * width + first + h) * d;
                        o.extend_from_slice(&x[at..at + d]);
                    }
                }
            }
            o
        };
        let (q, k, v) = (
            heads_of(&qkv, 0, heads, w),
            heads_of(&qkv, heads, kv, w),
            heads_of(&qkv, heads + kv, kv, w),
        );
        let split = Attention {
            layout: AttentionLayout::Heads,
            ..a
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let np = batch * heads * t * t;
        let (mut out, mut probs) = (vec![f32::NAN; n], vec![f32::NAN; np]);
        causal_attention_packed_with(&qkv, &mut out, &mut probs, &a).unwrap();
        let (mut wo, mut wp) = (vec![0.0; n], vec![0.0; np]);
        causal_attention_with(&q, &k, &v, &mut wo, &mut wp, &split).unwrap();
        assert_eq!(bits(&heads_of(&out, 0, heads, heads)), bits(&wo));
        assert_eq!(bits(&probs), bits(&wp));
        let mut dqkv = vec![f32::NAN; qkv.len()];
        causal_attention_packed_backward_with(&qkv, &probs, &dout, &mut dqkv, &a).unwrap();
        let g = heads_of(&dout, 0, heads, heads);
        let (mut dq, mut dk, mut dv) = (vec![0.0; n], vec![0.0; nkv], vec![0.0; nkv]);
        causal_attention_backward_with(&q, &k, &v, &wp, &g, &mut dq, &mut dk, &mut dv, &split)
            .unwrap();
        assert_eq!(bits(&heads_of(&dqkv, 0, heads, w)), bits(&dq));
        assert_eq!(bits(&heads_of(&dqkv, heads, kv, w)), bits(&dk));
        assert_eq!(bits(&heads_of(&dqkv, heads + kv, kv, w)), bits(&dv));
        assert!(dqkv.iter().all(|x| x.is_finite()));
        // A qkv sized for [batch, t, 3, heads, d] is a length error, not a panic; so is a
        // head-split shape or a kv_heads that does not divide heads.
        let mha = vec![0.0; 3 * n];
        assert!(causal_attention_packed_with(&mha, &mut out, &mut probs, &a).is_err());
        assert!(causal_attention_packed_with(&qkv, &mut out, &mut probs, &split).is_err());
        let bad = Attention { kv_heads: 4, ..a };
        assert!(causal_attention_packed_with(&qkv, &mut out, &mut probs, &bad).is_err());
    }
}
