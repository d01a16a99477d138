//! Causal self-attention straight from a fused qkv projection, without head split / merge
//! copies: [`causal_attention_qkv`] (GPT: multi-head, default scale) and
//! [`causal_attention_qkv_grouped`] (any `kv_heads` and scale).

use crate::autograd::{needs_grad, record1, single_grad, SavedTensor};
use crate::error::{shape_err, Result};
use crate::kernels::attention::{Attention, AttentionLayout, AttentionSave};
use crate::ops::nn::{attention_backward, attention_forward, causal_attention_scaled};
use crate::ops::Ctx;
use crate::tensor::Tensor;

/// Multi-head causal attention of a qkv projection with the default scale (GPT's call):
/// [`causal_attention_qkv_grouped`]`(qkv, heads, heads, `[`Attention::default_scale`]`(d/heads))`.
/// `qkv` `[batch, t, 3·d]`, read as `[batch, t, 3, heads, d/heads]` (queries, keys, values;
/// heads inside each), → `[batch, t, d]` (the heads' outputs side by side, as the output
/// projection reads them).
///
/// Equal, bit for bit, to splitting the heads into contiguous `[batch, heads, t, d/heads]`
/// tensors, [`causal_attention`](crate::causal_attention), and merging the heads back — forward
/// and gradient. Where the device's kernels take the packed layout
/// ([`Kernels::attention_packed`](crate::kernels::Kernels::attention_packed): the
/// CPU) it launches no copies: the kernels read q, k, v in place, write the output in the
/// merged layout and the gradient as one `[batch, t, 3·d]` tensor. Elsewhere it is exactly that
/// split / attend / merge composition.
///
/// # Errors
/// [`AutogradError::Shape`](crate::AutogradError::Shape) unless `qkv` is 3-dimensional with a
/// last dimension that is a positive multiple of `3·heads`; the errors of
/// [`causal_attention`](crate::causal_attention).
pub fn causal_attention_qkv(qkv: &Tensor, heads: usize) -> Result<Tensor> {
    let op = "causal_attention_qkv";
    let s = qkv.shape();
    if s.len() != 3 || heads == 0 || s[2] == 0 || s[2] % (3 * heads) != 0 {
        return Err(shape_err(
            op,
            format!("qkv must be [batch, t, 3·heads·d] with heads = {heads}, got {s:?}"),
        ));
    }
    let dh = s[2] / (3 * heads);
    causal_attention_qkv_grouped(qkv, heads, heads, Attention::default_scale(dh))
}

/// Causal attention of a fused qkv projection with `kv_heads` key/value heads (grouped-query
/// attention when fewer than `heads`) and scale `scale` on `q·kᵀ`: `qkv` `[batch, t, (heads +
/// 2·kv_heads)·dh]`, read per position as the `heads` query heads, then the `kv_heads` key
/// heads, then the `kv_heads` value heads, each `dh` wide (GPT's `[batch, t, 3, heads, dh]`
/// when `kv_heads == heads`), → `[batch, t, heads·dh]`. Query head `h` attends with key/value
/// head `h / (heads / kv_heads)`.
///
/// Equal, bit for bit, to splitting q `[batch, heads, t, dh]` and k, v `[batch, kv_heads, t,
/// dh]` out of `qkv`, [`causal_attention_scaled`], and merging the heads back — forward and
/// gradient; on kernels that take the packed layout (the CPU, the fused CUDA kernels) without
/// those copies.
///
/// ```
/// use fsdp_alloc::{DType, Device};
/// use fsdp_autograd::{causal_attention_qkv_grouped, Tensor};
/// let dev = Device::cpu(0);
/// // 4 query heads, 2 key/value heads, head dim 8: (4 + 2·2)·8 = 64 columns.
/// let qkv = Tensor::zeros(&[2, 5, 64], DType::F32, &dev).unwrap();
/// let y = causal_attention_qkv_grouped(&qkv, 4, 2, 0.25).unwrap();
/// assert_eq!(y.shape(), &[2, 5, 32]);
/// assert!(causal_attention_qkv_grouped(&qkv, 4, 3, 0.25).is_err());
/// ```
///
/// # Errors
/// [`AutogradError::Shape`](crate::AutogradError::Shape) unless `qkv` is 3-dimensional with a
/// last dimension that is a positive multiple of `heads + 2·kv_heads`, `kv_heads ≥ 1` divides
/// `heads`, and `scale` is finite and positive; the errors of [`causal_attention_scaled`].
pub fn causal_attention_qkv_grouped(
    qkv: &Tensor,
    heads: usize,
    kv_heads: usize,
    scale: f32,
) -> Result<Tensor> {
    let op = "causal_attention_qkv";
    let s = qkv.shape();
    let width = kv_heads.checked_mul(2).and_then(|w| w.checked_add(heads));
    let Some(width) =
        width.filter(|&w| s.len() == 3 && heads > 0 && kv_heads > 0 && s[2] > 0 && s[2] % w == 0)
    else {
        return Err(shape_err(
            op,
            format!(
                "qkv must be [batch, t, (heads + 2·kv_heads)·dh] with heads = {heads}, \
                 kv_heads = {kv_heads} (both positive), got {s:?}"
            ),
        ));
    };
    let (b, t, dh) = (s[0], s[1], s[2] / width);
    let at = Attention {
        kv_heads,
        scale,
        layout: AttentionLayout::Packed,
        ..Attention::new(b, heads, t, dh)
    };
    at.check(op).map_err(|e| shape_err(op, e.to_string()))?;
    let ctx = Ctx::of(qkv);
    if !ctx.k()?.attention_packed(&at) {
        return split_attend_merge(qkv, &at);
    }
    qkv.check_float(op)?;
    let qc = qkv.contig()?;
    let (out, stats, save) = attention_forward(&ctx, at, &[&qc], &[b, t, heads * dh])?;
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

/// The head split / attend / merge composition (copies around [`causal_attention_scaled`]);
/// what [`causal_attention_qkv_grouped`] computes on kernels without the packed layout, and
/// its reference. Multi-head attention keeps the split GPT blocks have always used (one
/// `[3, b, h, t, dh]` copy); grouped heads are split from a `[b, heads + 2·kv_heads, t, dh]`
/// copy.
pub(crate) fn split_attend_merge(qkv: &Tensor, a: &Attention) -> Result<Tensor> {
    let (b, t, h, kv, dh) = (a.batch, a.t, a.heads, a.kv_heads, a.d);
    let (q, k, v) = if kv == h {
        let qkv = qkv
            .view(&[b, t, 3, h, dh])?
            .permute(&[2, 0, 3, 1, 4])? // [3, b, h, t, dh]
            .contiguous()?;
        let parts = qkv.split(&[1, 1, 1])?;
        (
            parts[0].view(&[b, h, t, dh])?,
            parts[1].view(&[b, h, t, dh])?,
            parts[2].view(&[b, h, t, dh])?,
        )
    } else {
        let qkv = qkv
            .view(&[b, t, h + 2 * kv, dh])?
            .permute(&[0, 2, 1, 3])? // [b, h + 2·kv, t, dh]
            .contiguous()?;
        let parts = qkv.split_dim(&[h, kv, kv], 1)?;
        (parts[0].clone(), parts[1].clone(), parts[2].clone())
    };
    let y = causal_attention_scaled(&q, &k, &v, a.scale)?; // [b, h, t, dh]
    y.permute(&[0, 2, 1, 3])?
        .contiguous()?
        .view(&[b, t, h * dh])
}
