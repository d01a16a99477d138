//! Neural-network operations: softmax, layer norm, RMS norm, embedding, causal
//! scaled-dot-product attention and cross-entropy.

use fsdp_alloc::DType;

use crate::autograd::{needs_grad, record, record1, single_grad, SavedTensor};
use crate::error::{shape_err, AutogradError, Result};
use crate::kernels::attention::{
    Attention, AttentionSave, AttentionSaved, AttentionStats, CausalAttention,
    CausalAttentionBackward,
};
use crate::kernels::embedding::{Embedding, EmbeddingBackward, EmbeddingShape};
use crate::kernels::loss::{CrossEntropy, CrossEntropyBackward};
use crate::kernels::norm::{
    LayerNorm, LayerNormBackward, LayerNormShape, RmsNorm, RmsNormBackward, RmsNormShape, Softmax,
    SoftmaxBackward,
};
use crate::kernels::Rows;
use crate::ops::{check_pair, Ctx};
use crate::tensor::Tensor;

fn last_dim(t: &Tensor, op: &'static str) -> Result<usize> {
    match t.shape().last() {
        Some(&c) if c > 0 => Ok(c),
        _ => Err(shape_err(
            op,
            format!(
                "needs a non-empty last dimension, got shape {:?}",
                t.shape()
            ),
        )),
    }
}

impl Tensor {
    /// Softmax over the last dimension (numerically stable).
    pub fn softmax(&self) -> Result<Tensor> {
        self.check_float("softmax")?;
        let cols = last_dim(self, "softmax")?;
        let ctx = Ctx::of(self);
        let x = self.contig()?;
        let y = ctx.empty(self.shape(), self.dtype())?;
        let rows = Rows {
            rows: x.numel() / cols,
            cols,
        };
        let (xa, ya) = (
            x.operand_on("softmax", &ctx.stream)?,
            y.operand_on("softmax", &ctx.stream)?,
        );
        ctx.k()?.launch(
            &ctx.stream,
            &Softmax {
                rows,
                x: &xa,
                y: &ya,
            },
        )?;
        if !needs_grad(&[self]) {
            return Ok(y);
        }
        let mut saved = SavedTensor::new(&y);
        Ok(record1(
            "softmax",
            &[self],
            y,
            move |g: Vec<Option<Tensor>>| {
                let g = single_grad("softmax", g);
                let g = g.contig()?;
                let y = saved.unpack("softmax")?;
                let ctx = Ctx::of(&g);
                let dx = ctx.empty(y.shape(), y.dtype())?;
                let op = "softmax_backward";
                let (ya, ga, da) = (
                    y.operand_on(op, &ctx.stream)?,
                    g.operand_on(op, &ctx.stream)?,
                    dx.operand_on(op, &ctx.stream)?,
                );
                ctx.k()?.launch(
                    &ctx.stream,
                    &SoftmaxBackward {
                        rows,
                        y: &ya,
                        dy: &ga,
                        dx: &da,
                    },
                )?;
                Ok(vec![Some(dx)])
            },
        ))
    }
}

/// Layer normalization over the last dimension: `(x − mean) / sqrt(var + eps) · gamma + beta`,
/// `gamma` and `beta` of shape `[D]` (same dtype as `x`). Statistics are computed in `f32`.
pub fn layer_norm(x: &Tensor, gamma: &Tensor, beta: &Tensor, eps: f32) -> Result<Tensor> {
    check_pair("layer_norm", x, gamma)?;
    check_pair("layer_norm", x, beta)?;
    let cols = last_dim(x, "layer_norm")?;
    if gamma.shape() != [cols] || beta.shape() != [cols] {
        return Err(shape_err(
            "layer_norm",
            format!(
                "gamma {:?} and beta {:?} must be [{cols}] for input {:?}",
                gamma.shape(),
                beta.shape(),
                x.shape()
            ),
        ));
    }
    let rows = x.numel() / cols;
    let ctx = Ctx::of(x);
    let s = &ctx.stream;
    let (xc, gc, bc) = (x.contig()?, gamma.contig()?, beta.contig()?);
    let y = ctx.empty(x.shape(), x.dtype())?;
    let mean = ctx.empty(&[rows], DType::F32)?;
    let rstd = ctx.empty(&[rows], DType::F32)?;
    let op = "layer_norm";
    let ln = LayerNormShape {
        rows: Rows { rows, cols },
        eps,
    };
    let (xa, ga, ba, ya, ma, ra) = (
        xc.operand_on(op, s)?,
        gc.operand_on(op, s)?,
        bc.operand_on(op, s)?,
        y.operand_on(op, s)?,
        mean.operand_on(op, s)?,
        rstd.operand_on(op, s)?,
    );
    ctx.k()?.launch(
        s,
        &LayerNorm {
            ln,
            x: &xa,
            gamma: &ga,
            beta: &ba,
            y: &ya,
            mean: &ma,
            rstd: &ra,
        },
    )?;
    if !needs_grad(&[x, gamma, beta]) {
        return Ok(y);
    }
    let needs = [
        x.requires_grad(),
        gamma.requires_grad(),
        beta.requires_grad(),
    ];
    let (mut sx, mut sg, mut sm, mut sr) = (
        SavedTensor::new(&xc),
        SavedTensor::new(&gc),
        SavedTensor::new(&mean),
        SavedTensor::new(&rstd),
    );
    Ok(record1(
        op,
        &[x, gamma, beta],
        y,
        move |g: Vec<Option<Tensor>>| {
            let dy = single_grad("layer_norm", g);
            let dy = dy.contig()?;
            let op = "layer_norm_backward";
            let (x, gamma, mean, rstd) = (
                sx.unpack(op)?,
                sg.unpack(op)?,
                sm.unpack(op)?,
                sr.unpack(op)?,
            );
            let ctx = Ctx::of(&dy);
            let s = &ctx.stream;
            let dx = ctx.empty(x.shape(), x.dtype())?;
            let dg = ctx.empty(&[cols], x.dtype())?;
            let db = ctx.empty(&[cols], x.dtype())?;
            let (xa, ga, ma, ra, dya, dxa, dga, dba) = (
                x.operand_on(op, s)?,
                gamma.operand_on(op, s)?,
                mean.operand_on(op, s)?,
                rstd.operand_on(op, s)?,
                dy.operand_on(op, s)?,
                dx.operand_on(op, s)?,
                dg.operand_on(op, s)?,
                db.operand_on(op, s)?,
            );
            ctx.k()?.launch(
                s,
                &LayerNormBackward {
                    ln,
                    x: &xa,
                    gamma: &ga,
                    mean: &ma,
                    rstd: &ra,
                    dy: &dya,
                    dx: &dxa,
                    dgamma: &dga,
                    dbeta: &dba,
                },
            )?;
            Ok(vec![
                needs[0].then_some(dx),
                needs[1].then_some(dg),
                needs[2].then_some(db),
            ])
        },
    ))
}

/// RMS normalization over the last dimension (Llama's `RMSNorm`): `x · rstd · gamma` with
/// `rstd = 1/√(mean(x²) + eps)` per row, `gamma` of shape `[D]` (same dtype as `x`). Computed in
/// `f32` (the row sums in `f64`) and rounded once to `x`'s dtype; bit for bit the same on the CPU
/// and CUDA kernels. Also [`Tensor::rms_norm`] and the module [`crate::nn::RmsNorm`].
pub fn rms_norm(x: &Tensor, gamma: &Tensor, eps: f32) -> Result<Tensor> {
    let op = "rms_norm";
    check_pair(op, x, gamma)?;
    let cols = last_dim(x, op)?;
    if gamma.shape() != [cols] {
        return Err(shape_err(
            op,
            format!(
                "gamma {:?} must be [{cols}] for input {:?}",
                gamma.shape(),
                x.shape()
            ),
        ));
    }
    let rows = x.numel() / cols;
    let ctx = Ctx::of(x);
    let s = &ctx.stream;
    let (xc, gc) = (x.contig()?, gamma.contig()?);
    let y = ctx.empty(x.shape(), x.dtype())?;
    let rstd = ctx.empty(&[rows], DType::F32)?;
    let shape = RmsNormShape {
        rows: Rows { rows, cols },
        eps,
    };
    let (xa, ga, ya, ra) = (
        xc.operand_on(op, s)?,
        gc.operand_on(op, s)?,
        y.operand_on(op, s)?,
        rstd.operand_on(op, s)?,
    );
    let fwd = RmsNorm {
        s: shape,
        x: &xa,
        gamma: &ga,
        y: &ya,
        rstd: &ra,
    };
    ctx.k()?.launch(s, &fwd)?;
    if !needs_grad(&[x, gamma]) {
        return Ok(y);
    }
    let needs = [x.requires_grad(), gamma.requires_grad()];
    let (mut sx, mut sg, mut sr) = (
        SavedTensor::new(&xc),
        SavedTensor::new(&gc),
        SavedTensor::new(&rstd),
    );
    Ok(record1(
        op,
        &[x, gamma],
        y,
        move |g: Vec<Option<Tensor>>| {
            let dy = single_grad("rms_norm", g).contig()?;
            let op = "rms_norm_backward";
            let (x, gamma, rstd) = (sx.unpack(op)?, sg.unpack(op)?, sr.unpack(op)?);
            let ctx = Ctx::of(&dy);
            let s = &ctx.stream;
            let dx = ctx.empty(x.shape(), x.dtype())?;
            let dg = ctx.empty(&[cols], x.dtype())?;
            let (xa, ga, ra, dya, dxa, dga) = (
                x.operand_on(op, s)?,
                gamma.operand_on(op, s)?,
                rstd.operand_on(op, s)?,
                dy.operand_on(op, s)?,
                dx.operand_on(op, s)?,
                dg.operand_on(op, s)?,
            );
            let bwd = RmsNormBackward {
                s: shape,
                x: &xa,
                gamma: &ga,
                rstd: &ra,
                dy: &dya,
                dx: &dxa,
                dgamma: &dga,
            };
            ctx.k()?.launch(s, &bwd)?;
            Ok(vec![needs[0].then_some(dx), needs[1].then_some(dg)])
        },
    ))
}

impl Tensor {
    /// RMS normalization over the last dimension (Llama's `RMSNorm`): `self · rstd · gamma` with
    /// `rstd = 1/√(mean(self²) + eps)` per row, `gamma` of shape `[D]` (the last dimension, same
    /// dtype). Computed in `f32` (the row sums in `f64`, in one fixed order) and rounded once to
    /// the input's dtype; bit for bit the same on the CPU and CUDA kernels. Differentiable in
    /// `self` and `gamma`.
    ///
    /// ```
    /// use fsdp_alloc::Device;
    /// use fsdp_autograd::Tensor;
    ///
    /// let dev = Device::cpu(0);
    /// let x = Tensor::from_vec(vec![3.0f32, 4.0], &[1, 2], &dev)?;
    /// let g = Tensor::from_vec(vec![1.0f32, 2.0], &[2], &dev)?;
    /// // rms(x) = √((9 + 16) / 2) = √12.5.
    /// let y = x.rms_norm(&g, 0.0)?.to_vec::<f32>()?;
    /// let r = 12.5f32.sqrt();
    /// assert!((y[0] - 3.0 / r).abs() < 1e-6 && (y[1] - 8.0 / r).abs() < 1e-6);
    /// # Ok::<(), fsdp_autograd::AutogradError>(())
    /// ```
    ///
    /// # Errors
    /// `gamma` not `[D]` or of another dtype or device; an empty last dimension; a non-float
    /// dtype.
    pub fn rms_norm(&self, gamma: &Tensor, eps: f32) -> Result<Tensor> {
        rms_norm(self, gamma, eps)
    }
}

/// Looks up rows of `table` (`[V, D]`, float) for `ids` (`i64`, any shape) → `[ids.., D]`.
/// An id outside `0..V` fails the stream (reported at the next synchronization). Backward
/// scatter-adds into a zero `[V, D]` gradient in a fixed order (deterministic).
pub fn embedding(ids: &Tensor, table: &Tensor) -> Result<Tensor> {
    ids.check_same_device(table, "embedding")?;
    if ids.dtype() != DType::I64 {
        return Err(AutogradError::DType {
            op: "embedding",
            got: ids.dtype(),
            expected: "i64 ids".into(),
        });
    }
    table.check_float("embedding")?;
    if table.dim() != 2 {
        return Err(shape_err(
            "embedding",
            format!("table must be [V, D], got {:?}", table.shape()),
        ));
    }
    let dim = table.shape()[1];
    let ctx = Ctx::of(table);
    let s = &ctx.stream;
    let (ic, tc) = (ids.contig()?, table.contig()?);
    let mut out_shape = ids.shape().to_vec();
    out_shape.push(dim);
    let out = ctx.empty(&out_shape, table.dtype())?;
    let op = "embedding";
    let es = EmbeddingShape {
        ids: ic.numel(),
        vocab: table.shape()[0],
        dim,
    };
    let (ia, ta, oa) = (
        ic.operand_on(op, s)?,
        tc.operand_on(op, s)?,
        out.operand_on(op, s)?,
    );
    ctx.k()?.launch(
        s,
        &Embedding {
            e: es,
            ids: &ia,
            table: &ta,
            out: &oa,
        },
    )?;
    if !needs_grad(&[table]) {
        return Ok(out);
    }
    let mut si = SavedTensor::new(&ic);
    let t_shape = table.shape().to_vec();
    Ok(record1(op, &[table], out, move |g: Vec<Option<Tensor>>| {
        let dy = single_grad("embedding", g);
        let dy = dy.contig()?;
        let op = "embedding_backward";
        let ids = si.unpack(op)?;
        let ctx = Ctx::of(&dy);
        let s = &ctx.stream;
        let dt = ctx.empty(&t_shape, dy.dtype())?;
        let (ia, ga, da) = (
            ids.operand_on(op, s)?,
            dy.operand_on(op, s)?,
            dt.operand_on(op, s)?,
        );
        ctx.k()?.launch(
            s,
            &EmbeddingBackward {
                e: es,
                ids: &ia,
                dy: &ga,
                dtable: &da,
            },
        )?;
        Ok(vec![Some(dt)])
    }))
}

/// Causal scaled-dot-product attention with the default scale `1/√d`:
/// [`causal_attention_scaled`]`(q, k, v, `[`Attention::default_scale`]`(d))`. `q` is
/// `[batch, heads, t, d]`; `k`, `v` are `[batch, kv_heads, t, d]` with `kv_heads` dividing
/// `heads` (`kv_heads == heads`: multi-head attention; fewer: grouped-query attention) →
/// `softmax(q·kᵀ/√d + causal mask) · v`, `[batch, heads, t, d]`. Saves for backward what the
/// device's kernels ask for ([`Kernels::attention_save`](crate::kernels::Kernels::attention_save)):
/// on the CPU the probabilities (`[batch, heads, t, t]`, `f32`); on CUDA, with the fused
/// kernels (the default), the per-query log-sum-exp (`[batch, heads, t]`, `f32`) and the output,
/// so memory stays linear in `t`.
///
/// # Errors
/// As [`causal_attention_scaled`].
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let d = q.shape().last().copied().unwrap_or(0);
    causal_attention_scaled(q, k, v, Attention::default_scale(d))
}

/// Causal attention with scale `scale` applied to `q·kᵀ` before the softmax:
/// `softmax(scale·q·kᵀ + causal mask) · v`, per query head `h`, reading key/value head
/// `h / (heads / kv_heads)` (grouped-query attention, nothing repeated in memory; the
/// gradient of a key/value head sums its group's query heads in a fixed order, so results are
/// deterministic). Shapes and saved statistics as [`causal_attention`]; the number of key/value
/// heads is `k`'s second dimension.
///
/// ```
/// use fsdp_alloc::{DType, Device};
/// use fsdp_autograd::{causal_attention, causal_attention_scaled, Tensor};
/// let dev = Device::cpu(0);
/// // 4 query heads share 2 key/value heads; GPT-2's `scale_attn_weights: false` is scale 1.
/// let q = Tensor::zeros(&[1, 4, 3, 8], DType::F32, &dev).unwrap();
/// let kv = Tensor::zeros(&[1, 2, 3, 8], DType::F32, &dev).unwrap();
/// let y = causal_attention_scaled(&q, &kv, &kv, 1.0).unwrap();
/// assert_eq!(y.shape(), &[1, 4, 3, 8]);
/// assert!(causal_attention(&q, &q.narrow(1, 0, 3).unwrap(), &q.narrow(1, 0, 3).unwrap()).is_err());
/// ```
///
/// # Errors
/// [`AutogradError::Shape`](crate::AutogradError::Shape) unless `q` is `[batch, heads, t, d]`
/// and `k`, `v` are both `[batch, kv_heads, t, d]` with `kv_heads ≥ 1` dividing `heads`, or
/// for a `scale` that is not finite and positive; dtype/device mismatches; on CUDA with the
/// fused kernels off (or `d > 128`), [`AutogradError::Unsupported`](crate::AutogradError::Unsupported)
/// for grouped-query attention.
pub fn causal_attention_scaled(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<Tensor> {
    check_pair("causal_attention", q, k)?;
    check_pair("causal_attention", q, v)?;
    let (qs, ks) = (q.shape(), k.shape());
    if q.dim() != 4 || k.dim() != 4 || v.shape() != ks || ks[0] != qs[0] || ks[2..] != qs[2..] {
        return Err(shape_err(
            "causal_attention",
            format!(
                "q must be [batch, heads, t, d] and k, v both [batch, kv_heads, t, d] with \
                 kv_heads dividing heads; got {:?}, {:?}, {:?}",
                q.shape(),
                k.shape(),
                v.shape()
            ),
        ));
    }
    let (b, h, t, d) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
    let at = Attention {
        kv_heads: ks[1],
        scale,
        ..Attention::new(b, h, t, d)
    };
    at.check("causal_attention")
        .map_err(|e| shape_err("causal_attention", e.to_string()))?;
    let ctx = Ctx::of(q);
    let (qc, kc, vc) = (q.contig()?, k.contig()?, v.contig()?);
    let (out, stats, save) = attention_forward(&ctx, at, &[&qc, &kc, &vc], q.shape())?;
    if !needs_grad(&[q, k, v]) {
        return Ok(out);
    }
    let needs = [q.requires_grad(), k.requires_grad(), v.requires_grad()];
    let mut saved = [
        SavedTensor::new(&qc),
        SavedTensor::new(&kc),
        SavedTensor::new(&vc),
        SavedTensor::new(&stats),
    ];
    // The fused backward also reads the forward's output (saved before it joins the graph).
    let mut saved_out = (save == AttentionSave::Lse).then(|| SavedTensor::new(&out));
    Ok(record1(
        "attention",
        &[q, k, v],
        out,
        move |g: Vec<Option<Tensor>>| {
            let dout = single_grad("attention", g);
            let dout = dout.contig()?;
            let op = "attention_backward";
            let [sq, sk, sv, sp] = &mut saved;
            let (q, k, v, p) = (
                sq.unpack(op)?,
                sk.unpack(op)?,
                sv.unpack(op)?,
                sp.unpack(op)?,
            );
            let fwd_out = saved_out.as_mut().map(|o| o.unpack(op)).transpose()?;
            let ctx = Ctx::of(&dout);
            let dq = ctx.empty(q.shape(), q.dtype())?;
            let dk = ctx.empty(k.shape(), k.dtype())?;
            let dv = ctx.empty(v.shape(), v.dtype())?;
            let grads = [&dq, &dk, &dv];
            attention_backward(&ctx, at, &[&q, &k, &v], &p, fwd_out.as_ref(), &dout, &grads)?;
            Ok(vec![
                needs[0].then_some(dq),
                needs[1].then_some(dk),
                needs[2].then_some(dv),
            ])
        },
    ))
}

/// q, k and v of an attention launch: three operands, or one read as all three (the packed
/// layout).
fn qkv_of<T>(ops: &[T]) -> (&T, &T, &T) {
    match ops {
        [one] => (one, one, one),
        [q, k, v] => (q, k, v),
        _ => unreachable!("attention takes q, k, v or one packed qkv operand"),
    }
}

/// The attention forward through the seam (shared by [`causal_attention`] and
/// [`causal_attention_qkv`](crate::ops::attention_qkv::causal_attention_qkv)): `ins` is the
/// contiguous q, k, v, or the one qkv tensor read as all three under
/// [`AttentionLayout::Packed`](crate::kernels::attention::AttentionLayout::Packed). Returns the output (`out_shape`, the inputs' dtype), the
/// statistics the device's kernels save for backward, and which statistics they are.
pub(crate) fn attention_forward(
    ctx: &Ctx,
    at: Attention,
    ins: &[&Tensor],
    out_shape: &[usize],
) -> Result<(Tensor, Tensor, AttentionSave)> {
    let s = &ctx.stream;
    let out = ctx.empty(out_shape, ins[0].dtype())?;
    let save = ctx.k()?.attention_save(&at);
    let stats = ctx.empty(&save.shape(&at), DType::F32)?;
    let op = "attention";
    let ia = ins
        .iter()
        .map(|t| t.operand_on(op, s))
        .collect::<Result<Vec<_>>>()?;
    let (q, k, v) = qkv_of(&ia);
    let (oa, sa) = (out.operand_on(op, s)?, stats.operand_on(op, s)?);
    ctx.k()?.launch(
        s,
        &CausalAttention {
            a: at,
            q,
            k,
            v,
            out: &oa,
            stats: match save {
                AttentionSave::Probs => AttentionStats::Probs(&sa),
                AttentionSave::Lse => AttentionStats::Lse(&sa),
            },
        },
    )?;
    Ok((out, stats, save))
}

/// The attention backward through the seam, from [`attention_forward`]'s inputs `ins`, its
/// `stats` and (when the kernels saved the log-sum-exp) its output `fwd_out`: writes `grads`
/// (dq, dk, dv, or the one dqkv of the packed layout).
pub(crate) fn attention_backward(
    ctx: &Ctx,
    at: Attention,
    ins: &[&Tensor],
    stats: &Tensor,
    fwd_out: Option<&Tensor>,
    dout: &Tensor,
    grads: &[&Tensor],
) -> Result<()> {
    let s = &ctx.stream;
    let op = "attention_backward";
    let ia = ins
        .iter()
        .map(|t| t.operand_on(op, s))
        .collect::<Result<Vec<_>>>()?;
    let (pa, ga) = (stats.operand_on(op, s)?, dout.operand_on(op, s)?);
    let da = grads
        .iter()
        .map(|t| t.operand_on(op, s))
        .collect::<Result<Vec<_>>>()?;
    let oa = fwd_out.map(|o| o.operand_on(op, s)).transpose()?;
    let saved = match &oa {
        Some(out) => AttentionSaved::Lse { lse: &pa, out },
        None => AttentionSaved::Probs(&pa),
    };
    let ((q, k, v), (dq, dk, dv)) = (qkv_of(&ia), qkv_of(&da));
    ctx.k()?.launch(
        s,
        &CausalAttentionBackward {
            a: at,
            q,
            k,
            v,
            saved,
            dout: &ga,
            dq,
            dk,
            dv,
        },
    )
}

/// Mean cross-entropy of `logits` (`[.., C]`, float) against `targets` (`i64`, one per row,
/// values in `0..C`) → a 0-dimensional tensor of the logits' dtype. A target out of range fails
/// the stream (reported at the next synchronization).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    logits.check_same_device(targets, "cross_entropy")?;
    logits.check_float("cross_entropy")?;
    if targets.dtype() != DType::I64 {
        return Err(AutogradError::DType {
            op: "cross_entropy",
            got: targets.dtype(),
            expected: "i64 targets".into(),
        });
    }
    let cols = last_dim(logits, "cross_entropy")?;
    let rows = logits.numel() / cols;
    if targets.numel() != rows || rows == 0 {
        return Err(shape_err(
            "cross_entropy",
            format!(
                "{} targets for logits {:?} ({rows} rows)",
                targets.numel(),
                logits.shape()
            ),
        ));
    }
    let ctx = Ctx::of(logits);
    let s = &ctx.stream;
    let (lc, tc) = (logits.contig()?, targets.contig()?);
    let loss = ctx.empty(&[], logits.dtype())?;
    let lse = ctx.empty(&[rows], DType::F32)?;
    let op = "cross_entropy";
    let rs = Rows { rows, cols };
    let (la, ta, oa, sa) = (
        lc.operand_on(op, s)?,
        tc.operand_on(op, s)?,
        loss.operand_on(op, s)?,
        lse.operand_on(op, s)?,
    );
    ctx.k()?.launch(
        s,
        &CrossEntropy {
            rows: rs,
            logits: &la,
            targets: &ta,
            loss: &oa,
            lse: &sa,
        },
    )?;
    if !needs_grad(&[logits]) {
        return Ok(loss);
    }
    let mut saved = (
        SavedTensor::new(&lc),
        SavedTensor::new(&tc),
        SavedTensor::new(&lse),
    );
    let l_shape = logits.shape().to_vec();
    Ok(
        record(op, &[logits], &[loss], move |g: Vec<Option<Tensor>>| {
            let dl = single_grad("cross_entropy", g);
            let op = "cross_entropy_backward";
            let (l, t, e) = (
                saved.0.unpack(op)?,
                saved.1.unpack(op)?,
                saved.2.unpack(op)?,
            );
            let ctx = Ctx::of(&l);
            let s = &ctx.stream;
            let dlogits = ctx.empty(&l_shape, l.dtype())?;
            let dl = dl.contig()?;
            let (la, ta, ea, ga, da) = (
                l.operand_on(op, s)?,
                t.operand_on(op, s)?,
                e.operand_on(op, s)?,
                dl.operand_on(op, s)?,
                dlogits.operand_on(op, s)?,
            );
            ctx.k()?.launch(
                s,
                &CrossEntropyBackward {
                    rows: rs,
                    logits: &la,
                    targets: &ta,
                    lse: &ea,
                    dloss: &ga,
                    dlogits: &da,
                },
            )?;
            Ok(vec![Some(dlogits)])
        })
        .pop()
        .expect("one output"),
    )
}
