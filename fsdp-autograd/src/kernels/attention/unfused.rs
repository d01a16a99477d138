//! Causal scaled-dot-product attention on `[batch, heads, t, d]`: cuBLAS strided-batched
//! products around a causal row-softmax kernel.

use fsdp_alloc::{BufferRef, Stream};

use crate::kernels::cuda::context::{expect_len, mul, Call, CudaKernels, Dev, Elem};
use crate::kernels::cuda::error::Result;
use crate::kernels::cuda::plan::{grid_rows, PArg, Plan, Ptr};
use crate::kernels::gemm::gpu::plan_gemm;
use crate::kernels::gemm::Gemm;

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

/// Validates q/k/v-shaped and probs-shaped arguments (in that order) against the shape.
fn shapes(
    c: &Call<'_>,
    qkv_like: &[(&'static str, &BufferRef)],
    probs_like: &[(&'static str, &BufferRef)],
    batch: usize,
    heads: usize,
    t: usize,
    d: usize,
) -> Result<(Vec<Dev>, Vec<Dev>, Dims)> {
    let op = c.op;
    let bh = mul(op, batch, heads)?;
    let n_qkv = mul(op, bh, mul(op, t, d)?)?;
    let tt = mul(op, t, t)?;
    let n_probs = mul(op, bh, tt)?;
    let shape = || format!("batch={batch}, heads={heads}, t={t}, d={d}");
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

/// The softmax scale `1/√d` in f32, as the CPU kernel computes it.
pub(crate) fn softmax_scale(d: usize) -> f32 {
    (1.0 / (d as f64).sqrt()) as f32
}

/// Causal attention forward: `probs = softmax(scale·q·kᵀ + mask)`, `out = probs·v` per head.
pub(crate) fn plan_attention(
    bh: usize,
    t: usize,
    d: usize,
    [q, k, v, out, probs]: [Ptr; 5],
) -> Result<Plan> {
    let op = "causal_attention";
    let mut plan = Plan::new();
    if bh == 0 || t == 0 {
        return Ok(plan);
    }
    // probs = (1/√d)·q·kᵀ per head.
    let scale = softmax_scale(d);
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
    [q, k, v, probs, dout, dq, dk, dv]: [Ptr; 8],
) -> Result<Plan> {
    let op = "causal_attention_backward";
    let mut plan = Plan::new();
    if bh == 0 || t == 0 || d == 0 {
        return Ok(plan);
    }
    let scale = softmax_scale(d);
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
    // dq = dS·k/√d ; dk = dSᵀ·q/√d
    plan_gemm(&mut plan, op, (ds, k, dq), &p_x, scale)?;
    plan_gemm(&mut plan, op, (ds, q, dk), &pt_x, scale)?;
    Ok(plan)
}

impl CudaKernels {
    /// Causal scaled-dot-product attention per (batch, head) (CPU:
    /// [`cpu::causal_attention`](crate::kernels::cpu::causal_attention)):
    /// `probs = softmax(q·kᵀ/√d + causal mask)`, `out = probs·v`, with `probs`
    /// (`[batch, heads, t, t]`, exactly 0 above the diagonal) saved for the backward.
    ///
    /// Two `cublasSgemmStridedBatched` calls (the `1/√d` scale folded into the first) around an
    /// in-place causal softmax kernel (one block per query row). Like the CPU kernel, the full
    /// `t×t` score matrix is computed and the upper triangle discarded.
    ///
    /// # Errors
    /// The CPU kernel's shape errors; buffer/stream errors; `out`/`probs` overlapping any other
    /// argument; cuBLAS failures.
    #[allow(clippy::too_many_arguments)]
    pub fn causal_attention(
        &self,
        stream: &Stream,
        q: &BufferRef,
        k: &BufferRef,
        v: &BufferRef,
        out: &BufferRef,
        probs: &BufferRef,
        batch: usize,
        heads: usize,
        t: usize,
        d: usize,
    ) -> Result<()> {
        let c = self.call("causal_attention", stream)?;
        let (qkv, p, dims) = shapes(
            &c,
            &[("q", q), ("k", k), ("v", v), ("out", out)],
            &[("probs", probs)],
            batch,
            heads,
            t,
            d,
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
            [qkv[0], qkv[1], qkv[2], qkv[3], p[0]].map(|x| x.as_ptr()),
        )?;
        // SAFETY: q, k, v and out hold bh·t·d f32 and probs bh·t·t f32 on this device (checked
        // above); out and probs overlap no other argument; the plan's products and the softmax
        // (block r rewrites row r of probs) stay within those extents.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// Gradient of [`CudaKernels::causal_attention`] from `q`, `k`, `v`, the saved `probs` and
    /// `dout` (CPU: [`cpu::causal_attention_backward`](crate::kernels::cpu::causal_attention_backward)).
    /// Per head, with `P = probs`: `dv = Pᵀ·dout`, `dP = dout·vᵀ`,
    /// `dS = P ⊙ (dP − rowsum(P ⊙ dP))` (0 above the diagonal), `dq = dS·k/√d`,
    /// `dk = dSᵀ·q/√d`. `dq`, `dk`, `dv` are overwritten. Four strided-batched cuBLAS calls and
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
        batch: usize,
        heads: usize,
        t: usize,
        d: usize,
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
            batch,
            heads,
            t,
            d,
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
            [qkv[0], qkv[1], qkv[2], p[0], qkv[3], qkv[4], qkv[5], qkv[6]].map(|x| x.as_ptr()),
        )?;
        // SAFETY: q, k, v, dout, dq, dk and dv hold bh·t·d f32 and probs bh·t·t f32 on this
        // device (checked above); dq, dk and dv overlap no other argument; dP/dS live in the
        // plan's bh·t·t f32 scratch; every product and the softmax backward stay within those
        // extents.
        unsafe { c.exec(&plan) }.map(drop)
    }
}
