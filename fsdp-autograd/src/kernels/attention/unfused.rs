//! Causal scaled-dot-product attention on `[batch, heads, t, d]` (multi-head, any scale):
//! cuBLAS strided-batched products around a causal row-softmax kernel. Grouped-query attention
//! is the fused kernels' (`flash.rs`): the products here are dense strided batches ([`Gemm`]
//! has no stride that maps a query head onto its shared key/value head), and a repeat would
//! materialize what grouped-query attention saves.

use fsdp_alloc::{BufferRef, Stream};

use super::shape::{Attention, AttentionLayout};
use crate::kernels::cuda::context::{expect_len, mul, Call, CudaKernels, Dev, Elem};
use crate::kernels::cuda::error::Result;
use crate::kernels::cuda::plan::{grid_rows, PArg, Plan, Ptr};
use crate::kernels::cuda::FUSED_ATTENTION_MAX_D;
use crate::kernels::gemm::gpu::plan_gemm;
use crate::kernels::gemm::Gemm;
use crate::kernels::KernelError;

crate::kernels::cuda::kernel::declare_kernels! {
    CAUSAL_SOFTMAX = "causal_softmax" [U64, U64, Ptr];
    CAUSAL_SOFTMAX_BWD = "causal_softmax_bwd" [U64, U64, Ptr, Ptr];
}

/// The validated sizes of one attention call.
struct Dims {
    bh: usize,
    t: usize,
    d: usize,
}

/// Validates `a` (multi-head, head-split: what these kernels take) and the q/k/v-shaped and
/// probs-shaped arguments (in that order) against it.
fn shapes(
    c: &Call<'_>,
    qkv_like: &[(&'static str, &BufferRef)],
    probs_like: &[(&'static str, &BufferRef)],
    a: &Attention,
) -> Result<(Vec<Dev>, Vec<Dev>, Dims)> {
    let op = c.op;
    a.check(op)?;
    if a.kv_heads != a.heads || a.layout != AttentionLayout::Heads {
        return Err(KernelError::InvalidShape {
            op,
            reason: format!(
                "the unfused attention kernels take multi-head attention in the head-split \
                 layout (kv_heads = heads, AttentionLayout::Heads), got {}; grouped-query and \
                 packed attention run on the fused kernels (flash_attention, head dims up to \
                 {FUSED_ATTENTION_MAX_D})",
                a.describe()
            ),
        }
        .into());
    }
    let (t, d) = (a.t, a.d);
    let bh = mul(op, a.batch, a.heads)?;
    let n_qkv = mul(op, bh, mul(op, t, d)?)?;
    let tt = mul(op, t, t)?;
    let n_probs = mul(op, bh, tt)?;
    let shape = || a.describe();
    let mut qkv = Vec::with_capacity(qkv_like.len());
    for &(arg, b) in qkv_like {
        let dev = c.buf(arg, b, Elem::F32)?;
        expect_len(op, arg, dev.len, n_qkv, shape)?;
        qkv.push(dev);
    }
    let mut probs = Vec::with_capacity(probs_like.len());
    for &(arg, b) in probs_like {
        let dev = c.buf(arg, b, Elem::F32)?;
        expect_len(op, arg, dev.len, n_probs, shape)?;
        probs.push(dev);
    }
    Ok((qkv, probs, Dims { bh, t, d }))
}

/// Causal attention forward: `probs = softmax(scale·q·kᵀ + mask)`, `out = probs·v` per head.
pub(crate) fn plan_attention(
    bh: usize,
    t: usize,
    d: usize,
    scale: f32,
    [q, k, v, out, probs]: [Ptr; 5],
) -> Result<Plan> {
    let op = "causal_attention";
    let mut plan = Plan::new();
    if bh == 0 || t == 0 {
        return Ok(plan);
    }
    // probs = scale·q·kᵀ per head.
    let scores = Gemm::new(bh, t, d, t).transposed(false, true);
    plan_gemm(&mut plan, op, (q, k, probs), &scores, scale)?;
    let rows = (bh * t) as u64;
    plan.launch(
        CAUSAL_SOFTMAX,
        grid_rows(rows),
        vec![PArg::U64(rows), PArg::U64(t as u64), PArg::Ptr(probs)],
    );
    // out = probs·v per head.
    plan_gemm(&mut plan, op, (probs, v, out), &Gemm::new(bh, t, t, d), 1.0)?;
    Ok(plan)
}

/// Causal attention backward; `p = [q, k, v, probs, dout, dq, dk, dv]`.
pub(crate) fn plan_attention_backward(
    bh: usize,
    t: usize,
    d: usize,
    scale: f32,
    [q, k, v, probs, dout, dq, dk, dv]: [Ptr; 8],
) -> Result<Plan> {
    let op = "causal_attention_backward";
    let mut plan = Plan::new();
    if bh == 0 || t == 0 || d == 0 {
        return Ok(plan);
    }
    // dv = Pᵀ·dout
    // P·X and Pᵀ·X per head ([t, t] · [t, d]).
    let p_x = Gemm::new(bh, t, t, d);
    let pt_x = p_x.transposed(true, false);
    plan_gemm(&mut plan, op, (probs, dout, dv), &pt_x, 1.0)?;
    // dP = dout·vᵀ, into a [bh, t, t] scratch that becomes dS in place.
    let ds = Ptr::scratch(plan.scratch(bh * t * t, Elem::F32));
    let scores = Gemm::new(bh, t, d, t).transposed(false, true);
    plan_gemm(&mut plan, op, (dout, v, ds), &scores, 1.0)?;
    let rows = (bh * t) as u64;
    plan.launch(
        CAUSAL_SOFTMAX_BWD,
        grid_rows(rows),
        vec![
            PArg::U64(rows),
            PArg::U64(t as u64),
            PArg::Ptr(probs),
            PArg::Ptr(ds),
        ],
    );
    // dq = scale·dS·k ; dk = scale·dSᵀ·q
    plan_gemm(&mut plan, op, (ds, k, dq), &p_x, scale)?;
    plan_gemm(&mut plan, op, (ds, q, dk), &pt_x, scale)?;
    Ok(plan)
}

impl CudaKernels {
    /// Causal scaled-dot-product attention of shape `a` per (batch, head) (CPU:
    /// [`cpu::causal_attention_with`](crate::kernels::cpu::causal_attention_with)):
    /// `probs = softmax(a.scale·q·kᵀ + causal mask)`, `out = probs·v`, with `probs`
    /// (`[batch, heads, t, t]`, exactly 0 above the diagonal) saved for the backward; f32
    /// `[batch, heads, t, d]` operands.
    ///
    /// Two `cublasSgemmStridedBatched` calls (the scale folded into the first) around an
    /// in-place causal softmax kernel (one block per query row). Like the CPU kernel, the full
    /// `t×t` score matrix is computed and the upper triangle discarded. Multi-head attention
    /// only: grouped-query attention (`kv_heads < heads`) and the packed layout need the fused
    /// kernels ([`flash_attention`](CudaKernels::flash_attention)).
    ///
    /// # Errors
    /// The CPU kernel's shape errors; [`KernelError::InvalidShape`] for `kv_heads != heads` or
    /// the packed layout; buffer/stream errors; `out`/`probs` overlapping any other argument;
    /// cuBLAS failures.
    #[allow(clippy::too_many_arguments)]
    pub fn causal_attention(
        &self,
        stream: &Stream,
        q: &BufferRef,
        k: &BufferRef,
        v: &BufferRef,
        out: &BufferRef,
        probs: &BufferRef,
        a: &Attention,
    ) -> Result<()> {
        let c = self.call("causal_attention", stream)?;
        let (qkv, p, dims) = shapes(
            &c,
            &[("q", q), ("k", k), ("v", v), ("out", out)],
            &[("probs", probs)],
            a,
        )?;
        c.disjoint(
            &[("out", out), ("probs", probs)],
            &[("q", q), ("k", k), ("v", v)],
        )?;
        let Dims { bh, t, d } = dims;
        let plan = plan_attention(
            bh,
            t,
            d,
            a.scale,
            [qkv[0], qkv[1], qkv[2], qkv[3], p[0]].map(|x| x.as_ptr()),
        )?;
        // SAFETY: q, k, v and out hold bh·t·d f32 and probs bh·t·t f32 on this device (checked
        // above); out and probs overlap no other argument; the plan's products and the softmax
        // (block r rewrites row r of probs) stay within those extents.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// Gradient of [`CudaKernels::causal_attention`] from `q`, `k`, `v`, the saved `probs` and
    /// `dout` (CPU: [`cpu::causal_attention_backward_with`](crate::kernels::cpu::causal_attention_backward_with)).
    /// Per head, with `P = probs`: `dv = Pᵀ·dout`, `dP = dout·vᵀ`,
    /// `dS = P ⊙ (dP − rowsum(P ⊙ dP))` (0 above the diagonal), `dq = scale·dS·k`,
    /// `dk = scale·dSᵀ·q`. `dq`, `dk`, `dv` are overwritten. Four strided-batched cuBLAS calls and
    /// one kernel; scratch: one `[batch, heads, t, t]` f32 buffer for `dP`/`dS`.
    ///
    /// # Errors
    /// As [`CudaKernels::causal_attention`], plus scratch allocation failure.
    #[allow(clippy::too_many_arguments)]
    pub fn causal_attention_backward(
        &self,
        stream: &Stream,
        q: &BufferRef,
        k: &BufferRef,
        v: &BufferRef,
        probs: &BufferRef,
        dout: &BufferRef,
        dq: &BufferRef,
        dk: &BufferRef,
        dv: &BufferRef,
        a: &Attention,
    ) -> Result<()> {
        let op = "causal_attention_backward";
        let c = self.call(op, stream)?;
        let (qkv, p, dims) = shapes(
            &c,
            &[
                ("q", q),
                ("k", k),
                ("v", v),
                ("dout", dout),
                ("dq", dq),
                ("dk", dk),
                ("dv", dv),
            ],
            &[("probs", probs)],
            a,
        )?;
        c.disjoint(
            &[("dq", dq), ("dk", dk), ("dv", dv)],
            &[
                ("q", q),
                ("k", k),
                ("v", v),
                ("probs", probs),
                ("dout", dout),
            ],
        )?;
        let Dims { bh, t, d } = dims;
        let plan = plan_attention_backward(
            bh,
            t,
            d,
            a.scale,
            [qkv[0], qkv[1], qkv[2], p[0], qkv[3], qkv[4], qkv[5], qkv[6]].map(|x| x.as_ptr()),
        )?;
        // SAFETY: q, k, v, dout, dq, dk and dv hold bh·t·d f32 and probs bh·t·t f32 on this
        // device (checked above); dq, dk and dv overlap no other argument; dP/dS live in the
        // plan's bh·t·t f32 scratch; every product and the softmax backward stay within those
        // extents.
        unsafe { c.exec(&plan) }.map(drop)
    }
}
