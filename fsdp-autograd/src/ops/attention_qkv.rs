//! Causal self-attention straight from a GPT's qkv projection, without head split / merge
//! copies: [`causal_attention_qkv`].

use crate::autograd::{needs_grad, record1, single_grad, SavedTensor};
use crate::error::{shape_err, Result};
use crate::kernels::attention::{Attention, AttentionLayout, AttentionSave};
use crate::ops::nn::{attention_backward, attention_forward, causal_attention};
use crate::ops::Ctx;
use crate::tensor::Tensor;

/// Multi-head causal attention of a qkv projection: `qkv` `[batch, t, 3·d]`, read as
/// `[batch, t, 3, heads, d/heads]` (queries, keys, values; heads inside each), → `[batch, t, d]`
/// (the heads' outputs side by side, as the output projection reads them).
///
/// Equal, bit for bit, to splitting the heads into contiguous `[batch, heads, t, d/heads]`
/// tensors, [`causal_attention`], and merging the heads back — forward and gradient. Where the
/// device's kernels take the packed layout
/// ([`Kernels::attention_packed`](crate::kernels::Kernels::attention_packed): the
/// CPU) it launches no copies: the kernels read q, k, v in place, write the output in the
/// merged layout and the gradient as one `[batch, t, 3·d]` tensor. Elsewhere it is exactly that
/// split / attend / merge composition.
///
/// # Errors
/// [`AutogradError::Shape`](crate::AutogradError::Shape) unless `qkv` is 3-dimensional with a
/// last dimension that is a positive multiple of `3·heads`; the errors of [`causal_attention`].
pub fn causal_attention_qkv(qkv: &Tensor, heads: usize) -> Result<Tensor> {
    let op = "causal_attention_qkv";
    let s = qkv.shape();
    if s.len() != 3 || heads == 0 || s[2] == 0 || s[2] % (3 * heads) != 0 {
        return Err(shape_err(
            op,
            format!("qkv must be [batch, t, 3·heads·d] with heads = {heads}, got {s:?}"),
        ));
    }
    let (b, t, d) = (s[0], s[1], s[2] / 3);
    let dh = d / heads;
    let at = Attention {
        batch: b,
        heads,
        t,
        d: dh,
        layout: AttentionLayout::Packed,
    };
    let ctx = Ctx::of(qkv);
    if !ctx.k()?.attention_packed(&at) {
        return split_attend_merge(qkv, b, t, heads, dh);
    }
    qkv.check_float(op)?;
    let qc = qkv.contig()?;
    let (out, stats, save) = attention_forward(&ctx, at, &[&qc], &[b, t, d])?;
    if !needs_grad(&[qkv]) {
        return Ok(out);
    }
    let mut saved = [SavedTensor::new(&qc), SavedTensor::new(&stats)];
    // The fused backward also reads the forward's output (saved before it joins the graph).
    let mut saved_out = (save == AttentionSave::Lse).then(|| SavedTensor::new(&out));
    Ok(record1(
        "attention",
        &[qkv],
        out,
        move |g: Vec<Option<Tensor>>| {
            let dout = single_grad("attention", g).contig()?;
            let op = "attention_backward";
            let [sq, sp] = &mut saved;
            let (qkv, p) = (sq.unpack(op)?, sp.unpack(op)?);
            let fwd_out = saved_out.as_mut().map(|o| o.unpack(op)).transpose()?;
            let ctx = Ctx::of(&dout);
            let dqkv = ctx.empty(qkv.shape(), qkv.dtype())?;
            attention_backward(&ctx, at, &[&qkv], &p, fwd_out.as_ref(), &dout, &[&dqkv])?;
            Ok(vec![Some(dqkv)])
        },
    ))
}

/// The head split / attend / merge composition (copies around [`causal_attention`]); what
/// [`causal_attention_qkv`] computes on kernels without the packed layout, and its reference.
pub(crate) fn split_attend_merge(
    qkv: &Tensor,
    b: usize,
    t: usize,
    h: usize,
    dh: usize,
) -> Result<Tensor> {
    let qkv = qkv
        .view(&[b, t, 3, h, dh])?
        .permute(&[2, 0, 3, 1, 4])? // [3, b, h, t, dh]
        .contiguous()?;
    let parts = qkv.split(&[1, 1, 1])?;
    let q = parts[0].view(&[b, h, t, dh])?;
    let k = parts[1].view(&[b, h, t, dh])?;
    let v = parts[2].view(&[b, h, t, dh])?;
    let y = causal_attention(&q, &k, &v)?; // [b, h, t, dh]
    y.permute(&[0, 2, 1, 3])?
        .contiguous()?
        .view(&[b, t, h * dh])
}
