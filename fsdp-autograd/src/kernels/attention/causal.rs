//! The causal attention ops: [`CausalAttention`] (forward: output plus the statistics the
//! backend saves) and [`CausalAttentionBackward`]. CPU: `kernels::cpu::causal_attention*`
//! (probabilities saved); CUDA: the fused flash kernels (log-sum-exp saved) or the unfused ones.

use fsdp_alloc::{DType, Stream};

use super::{Attention, AttentionLayout, AttentionSaved, AttentionStats};
use crate::error::{AutogradError, Result};
use crate::kernels::cpu;
use crate::kernels::op::{mul, Check, Op, Spec};
use crate::kernels::operand::Operand;
use crate::launch::launch_f32;

const PROBS: &str = "attention probabilities";
const LSE: &str = "attention log-sum-exp";

/// Causal attention forward; writes `out` and the statistics the backend saves for the
/// backward ([`Kernels::attention_save`](crate::kernels::Kernels::attention_save)).
#[derive(Debug, Clone, Copy)]
pub struct CausalAttention<'a> {
    /// The sizes.
    pub a: Attention,
    /// Queries.
    pub q: &'a Operand,
    /// Keys.
    pub k: &'a Operand,
    /// Values.
    pub v: &'a Operand,
    /// Output.
    pub out: &'a Operand,
    /// Probabilities or log-sum-exp (`f32`), saved for the backward.
    pub stats: AttentionStats<'a>,
}

/// Causal attention backward.
#[derive(Debug, Clone, Copy)]
pub struct CausalAttentionBackward<'a> {
    /// The sizes.
    pub a: Attention,
    /// Queries.
    pub q: &'a Operand,
    /// Keys.
    pub k: &'a Operand,
    /// Values.
    pub v: &'a Operand,
    /// What the forward saved.
    pub saved: AttentionSaved<'a>,
    /// Upstream gradient.
    pub dout: &'a Operand,
    /// Gradient of `q`.
    pub dq: &'a Operand,
    /// Gradient of `k`.
    pub dk: &'a Operand,
    /// Gradient of `v`.
    pub dv: &'a Operand,
}

/// The element counts of `a`'s operands (after [`Attention::check`]).
struct Lens {
    /// q and dq: `[batch, heads, t, d]`, or packed the whole qkv tensor.
    q: usize,
    /// k, v, dk, dv: `[batch, kv_heads, t, d]`, or packed the whole qkv tensor (q = k = v and
    /// dq = dk = dv must then be one operand each, checked by [`packed_same`]).
    kv: usize,
    /// out and dout (and the saved forward output): `[batch, heads, t, d]` elements.
    out: usize,
    /// The probabilities, `[batch, heads, t, t]`.
    probs: usize,
    /// The log-sum-exp, `[batch, heads, t]`.
    lse: usize,
}

fn lens(op: &'static str, a: Attention) -> Result<Lens> {
    a.check(op)?;
    let rows = mul(op, mul(op, a.batch, a.heads)?, a.t)?;
    let out = mul(op, rows, a.d)?;
    let (q, kv) = match a.layout {
        AttentionLayout::Heads => (
            out,
            mul(op, mul(op, mul(op, a.batch, a.kv_heads)?, a.t)?, a.d)?,
        ),
        AttentionLayout::Packed => {
            let n = a.packed_len().ok_or_else(|| AutogradError::Argument {
                op,
                detail: format!("attention sizes overflow: {}", a.describe()),
            })?;
            (n, n)
        }
    };
    Ok(Lens {
        q,
        kv,
        out,
        probs: mul(op, rows, a.t)?,
        lse: rows,
    })
}

/// Packed layout: the three operands must be one range (the whole qkv tensor or its
/// gradient).
fn packed_same(op: &'static str, a: Attention, ops: [(&'static str, &Operand); 3]) -> Result<()> {
    if a.layout != AttentionLayout::Packed {
        return Ok(());
    }
    let [(n0, o0), (n1, o1), (n2, o2)] = ops;
    let same = |o: &Operand| o.buf.location() == o0.buf.location() && o.buf.len() == o0.buf.len();
    if same(o1) && same(o2) {
        return Ok(());
    }
    Err(AutogradError::Argument {
        op,
        detail: format!(
            "packed attention layout: `{n0}`, `{n1}` and `{n2}` must be the same operand (the whole [batch, t, heads + 2·kv_heads, d] tensor); pass it three times"
        ),
    })
}

/// The CPU attention saves probabilities (its `attention_save` is the default `Probs`); a launch
/// asking for the fused kernels' log-sum-exp is an error.
fn lse_unsupported(op: &'static str) -> AutogradError {
    AutogradError::Unsupported {
        op,
        detail: "the CPU attention saves the probabilities, not the log-sum-exp; launch it with \
                 the statistics `Kernels::attention_save` names"
            .into(),
    }
}

impl Op for CausalAttention<'_> {
    fn name(&self) -> &'static str {
        "attention"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, a) = (self.name(), self.a);
        let (q, k, v) = (self.q, self.k, self.v);
        let l = lens(op, a)?;
        let st = match self.stats {
            AttentionStats::Probs(p) => Spec::exact("probs", p, DType::F32, PROBS, l.probs),
            AttentionStats::Lse(s) => Spec::exact("lse", s, DType::F32, LSE, l.lse),
        };
        let stats_n = st.len();
        packed_same(op, a, [("q", q), ("k", k), ("v", v)])?;
        let table = [
            Spec::float("q", q, l.q),
            Spec::float("k", k, l.kv),
            Spec::float("v", v, l.kv),
            Spec::float("out", self.out, l.out),
            st,
        ];
        c.args(op, || a.describe(), &table)?;
        Ok(l.out > 0 || stats_n > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let a = self.a;
        let (q, k, v, out) = (self.q, self.k, self.v, self.out);
        let AttentionStats::Probs(probs) = self.stats else {
            return Err(lse_unsupported("attention"));
        };
        if a.layout == AttentionLayout::Packed {
            // q = k = v: the whole qkv tensor (checked by the seam's front).
            let (ins, outs) = ([q], [out, probs]);
            launch_f32(s, "attention", ins, outs, false, move |[qkv], [o, p]| {
                cpu::causal_attention_packed_with(qkv, o, p, &a)
            });
            return Ok(());
        }
        let (ins, outs) = ([q, k, v], [out, probs]);
        launch_f32(
            s,
            "attention",
            ins,
            outs,
            false,
            move |[q, k, v], [o, p]| cpu::causal_attention_with(q, k, v, o, p, &a),
        );
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::{err, one_dtype};
        let (op, kk, a) = ("attention", b.kernels(), self.a);
        let (q, k, v, out) = (self.q, self.k, self.v, self.out);
        let probs = match self.stats {
            AttentionStats::Probs(p) => p,
            AttentionStats::Lse(lse) => {
                let l = &lse.buf;
                if a.layout == AttentionLayout::Packed {
                    // q = k = v: the whole qkv tensor (checked by the seam's front).
                    let dt = one_dtype(&[q, out]).ok_or_else(|| packed_mixed(op))?;
                    return kk
                        .flash_attention_packed(s, dt, &q.buf, &out.buf, l, &a)
                        .map_err(err(op));
                }
                if let Some(dt) = one_dtype(&[q, k, v, out]) {
                    let [q, k, v, o] = [q, k, v, out].map(|o| &o.buf);
                    return kk
                        .flash_attention(s, dt, q, k, v, o, l, &a)
                        .map_err(err(op));
                }
                let mut f = b.scope(op, s);
                let [q, k, v] = f.inputs([q, k, v])?;
                let o = f.output(out, false)?;
                kk.flash_attention(s, DType::F32, &q, &k, &v, &o, l, &a)
                    .map_err(err(op))?;
                return f.finish();
            }
        };
        unfused_unsupported(op, &a)?;
        let mut f = b.scope(op, s);
        let [q, k, v] = f.inputs([q, k, v])?;
        let o = f.output(out, false)?;
        kk.causal_attention(s, &q, &k, &v, &o, &probs.buf, &a)
            .map_err(err(op))?;
        f.finish()
    }
}

impl Op for CausalAttentionBackward<'_> {
    fn name(&self) -> &'static str {
        "attention_backward"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, a) = (self.name(), self.a);
        let (q, k, v) = (self.q, self.k, self.v);
        let (dq, dk, dv) = (self.dq, self.dk, self.dv);
        let l = lens(op, a)?;
        let (st, fwd_out) = match self.saved {
            AttentionSaved::Probs(p) => (Spec::exact("probs", p, DType::F32, PROBS, l.probs), None),
            AttentionSaved::Lse { lse, out } => (
                Spec::exact("lse", lse, DType::F32, LSE, l.lse),
                Some(Spec::float("out", out, l.out)),
            ),
        };
        packed_same(op, a, [("q", q), ("k", k), ("v", v)])?;
        packed_same(op, a, [("dq", dq), ("dk", dk), ("dv", dv)])?;
        let mut table = vec![
            Spec::float("q", q, l.q),
            Spec::float("k", k, l.kv),
            Spec::float("v", v, l.kv),
            st,
            Spec::float("dout", self.dout, l.out),
            Spec::float("dq", dq, l.q),
            Spec::float("dk", dk, l.kv),
            Spec::float("dv", dv, l.kv),
        ];
        table.extend(fwd_out);
        c.args(op, || a.describe(), &table)?;
        Ok(l.out > 0 || l.probs > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let a = self.a;
        let (q, k, v, dout) = (self.q, self.k, self.v, self.dout);
        let (dq, dk, dv) = (self.dq, self.dk, self.dv);
        let AttentionSaved::Probs(probs) = self.saved else {
            return Err(lse_unsupported("attention_backward"));
        };
        let op = "attention_backward";
        if a.layout == AttentionLayout::Packed {
            // q = k = v and dq = dk = dv: whole tensors (checked by the seam's front).
            let (ins, outs) = ([q, probs, dout], [dq]);
            launch_f32(s, op, ins, outs, false, move |[qkv, p, g], [dqkv]| {
                cpu::causal_attention_packed_backward_with(qkv, p, g, dqkv, &a)
            });
            return Ok(());
        }
        let (ins, outs) = ([q, k, v, probs, dout], [dq, dk, dv]);
        launch_f32(
            s,
            op,
            ins,
            outs,
            false,
            move |[q, k, v, p, g], [dq, dk, dv]| {
                cpu::causal_attention_backward_with(q, k, v, p, g, dq, dk, dv, &a)
            },
        );
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::{err, one_dtype};
        let (op, kk, a) = ("attention_backward", b.kernels(), self.a);
        let (q, k, v, dout) = (self.q, self.k, self.v, self.dout);
        let (dq, dk, dv) = (self.dq, self.dk, self.dv);
        let probs = match self.saved {
            AttentionSaved::Probs(p) => p,
            AttentionSaved::Lse { lse, out } => {
                let l = &lse.buf;
                if a.layout == AttentionLayout::Packed {
                    // q = k = v and dq = dk = dv (checked by the seam's front).
                    let dt = one_dtype(&[q, out, dout, dq]).ok_or_else(|| packed_mixed(op))?;
                    let [q, o, g, dqkv] = [q, out, dout, dq].map(|o| &o.buf);
                    return kk
                        .flash_attention_packed_backward(s, dt, q, o, l, g, dqkv, &a)
                        .map_err(err(op));
                }
                let all = [q, k, v, out, dout, dq, dk, dv];
                if let Some(dt) = one_dtype(&all) {
                    let [q, k, v, o, g, dq, dk, dv] = all.map(|o| &o.buf);
                    return kk
                        .flash_attention_backward(s, dt, q, k, v, o, l, g, dq, dk, dv, &a)
                        .map_err(err(op));
                }
                let mut f = b.scope(op, s);
                let [q, k, v, o, g] = f.inputs([q, k, v, out, dout])?;
                let [dq, dk, dv] = f.outputs([dq, dk, dv])?;
                kk.flash_attention_backward(
                    s,
                    DType::F32,
                    &q,
                    &k,
                    &v,
                    &o,
                    l,
                    &g,
                    &dq,
                    &dk,
                    &dv,
                    &a,
                )
                .map_err(err(op))?;
                return f.finish();
            }
        };
        unfused_unsupported(op, &a)?;
        let mut f = b.scope(op, s);
        let [q, k, v, g] = f.inputs([q, k, v, dout])?;
        let [dq, dk, dv] = f.outputs([dq, dk, dv])?;
        kk.causal_attention_backward(s, &q, &k, &v, &probs.buf, &g, &dq, &dk, &dv, &a)
            .map_err(err(op))?;
        f.finish()
    }
}

/// The unfused CUDA kernels (probabilities saved) take multi-head attention in
/// [`AttentionLayout::Heads`] only: `attention_packed` says false for them, so
/// `causal_attention_qkv` splits the heads itself; grouped-query attention (`kv_heads < heads`)
/// there is a typed [`AutogradError::Unsupported`] (the fused kernels, on by default for head
/// dims up to 128, take it).
#[cfg(feature = "cuda")]
fn unfused_unsupported(op: &'static str, a: &Attention) -> Result<()> {
    if a.layout == AttentionLayout::Packed {
        return Err(AutogradError::Argument {
            op,
            detail: "the unfused CUDA attention kernels take the head-split layout only (AttentionLayout::Heads); split the heads first (ops::causal_attention_qkv does where Kernels::attention_packed is false)".into(),
        });
    }
    if a.kv_heads != a.heads {
        return Err(AutogradError::Unsupported {
            op,
            detail: format!(
                "grouped-query attention (kv_heads = {} < heads = {}) runs on the fused CUDA \
                 kernels only, and they are off here (set_fused_attention(false), or head \
                 dimension {} above {}); turn them on, or repeat the key/value heads yourself",
                a.kv_heads,
                a.heads,
                a.d,
                crate::kernels::cuda::FUSED_ATTENTION_MAX_D
            ),
        });
    }
    Ok(())
}

/// The packed layout on CUDA needs one float dtype for qkv, out, dout and the gradient.
#[cfg(feature = "cuda")]
fn packed_mixed(op: &'static str) -> AutogradError {
    AutogradError::Argument {
        op,
        detail: "packed attention layout on CUDA: qkv, out, dout and dqkv must share one float dtype (f32, bf16 or f16); cast them first".into(),
    }
}
