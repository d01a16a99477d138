//! Fused causal attention, FlashAttention-2 style (`flash.cu`): forward and backward without any
//! `t×t` buffer, in f32, bf16 or f16 (f32 arithmetic inside), for head dimensions
//! `1..=`[`FUSED_ATTENTION_MAX_D`].
//!
//! The forward saves the log-sum-exp of each query's scaled scores (`[batch, heads, t]`, f32)
//! instead of the probabilities; the backward recomputes the probabilities tile by tile from it.
//! The backward is deterministic: `delta = rowsum(dout ⊙ out)`, then one pass over key tiles
//! for `dk`/`dv` and a separate pass over query tiles for `dq`, so every output element is
//! summed by one thread in a fixed order (no atomics). Scratch: `delta`, `[batch, heads, t]`
//! f32.
//!
//! Head dims of exactly 64 and 128 take register-tiled kernels (compile-time head dim, each
//! thread a micro-tile of scores and output columns, 16-byte shared loads, fused multiply-adds
//! in a fixed order); other head dims take generic kernels that read the head dim at run time.
//! Both families multiply on the CUDA cores in f32, not on tensor cores.
//!
//! Layouts ([`FlashLayout`]): every operand `[batch, heads, t, d]`
//! ([`flash_attention`](CudaKernels::flash_attention)), or the packed layout of a GPT's qkv
//! projection ([`flash_attention_packed`](CudaKernels::flash_attention_packed): q, k, v slices of
//! `[batch, t, 3, heads, d]`, out `[batch, t, heads, d]`, one dqkv gradient) that spares the head
//! split / merge copies around attention. Same kernels, same arithmetic per element.

use fsdp_alloc::{BufferRef, DType, Stream};

use super::unfused::softmax_scale;
use crate::kernels::cuda::context::{mul, CudaKernels, Elem};
use crate::kernels::cuda::error::Result;
use crate::kernels::cuda::kernel::{Kernel, MAX_GRID};
use crate::kernels::cuda::plan::{grid_for, PArg, Plan, Ptr};
use crate::kernels::cuda::FUSED_ATTENTION_MAX_D;
use crate::kernels::KernelError;

crate::kernels::cuda::kernel::declare_kernels! {
    FLASH_FWD_F32_LE64 = "flash_fwd_f32_le64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_BF16_LE64 = "flash_fwd_bf16_le64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_F16_LE64 = "flash_fwd_f16_le64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_F32_LE128 = "flash_fwd_f32_le128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_BF16_LE128 = "flash_fwd_bf16_le128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_F16_LE128 = "flash_fwd_f16_le128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_PRE_F32 = "flash_bwd_pre_f32" [U64, U64, U64, U64, U64, Ptr, Ptr, Ptr];
    FLASH_BWD_PRE_BF16 = "flash_bwd_pre_bf16" [U64, U64, U64, U64, U64, Ptr, Ptr, Ptr];
    FLASH_BWD_PRE_F16 = "flash_bwd_pre_f16" [U64, U64, U64, U64, U64, Ptr, Ptr, Ptr];
    FLASH_BWD_DKDV_F32_LE64 = "flash_bwd_dkdv_f32_le64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DKDV_BF16_LE64 = "flash_bwd_dkdv_bf16_le64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DKDV_F16_LE64 = "flash_bwd_dkdv_f16_le64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DKDV_F32_LE128 = "flash_bwd_dkdv_f32_le128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DKDV_BF16_LE128 = "flash_bwd_dkdv_bf16_le128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DKDV_F16_LE128 = "flash_bwd_dkdv_f16_le128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DQ_F32_LE64 = "flash_bwd_dq_f32_le64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DQ_BF16_LE64 = "flash_bwd_dq_bf16_le64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DQ_F16_LE64 = "flash_bwd_dq_f16_le64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DQ_F32_LE128 = "flash_bwd_dq_f32_le128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DQ_BF16_LE128 = "flash_bwd_dq_bf16_le128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DQ_F16_LE128 = "flash_bwd_dq_f16_le128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_F32_D64 = "flash_fwd_f32_d64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_BF16_D64 = "flash_fwd_bf16_d64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_F16_D64 = "flash_fwd_f16_d64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_F32_D128 = "flash_fwd_f32_d128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_BF16_D128 = "flash_fwd_bf16_d128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_F16_D128 = "flash_fwd_f16_d128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DKDV_F32_D64 = "flash_bwd_dkdv_f32_d64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DKDV_BF16_D64 = "flash_bwd_dkdv_bf16_d64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DKDV_F16_D64 = "flash_bwd_dkdv_f16_d64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DKDV_F32_D128 = "flash_bwd_dkdv_f32_d128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DKDV_BF16_D128 = "flash_bwd_dkdv_bf16_d128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DKDV_F16_D128 = "flash_bwd_dkdv_f16_d128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DQ_F32_D64 = "flash_bwd_dq_f32_d64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DQ_BF16_D64 = "flash_bwd_dq_bf16_d64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DQ_F16_D64 = "flash_bwd_dq_f16_d64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DQ_F32_D128 = "flash_bwd_dq_f32_d128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DQ_BF16_D128 = "flash_bwd_dq_bf16_d128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DQ_F16_D128 = "flash_bwd_dq_f16_d128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
}

/// The element type of the fused kernels' tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FlashType {
    /// `f32`.
    F32,
    /// `bf16` bits.
    Bf16,
    /// `f16` bits.
    F16,
}

impl FlashType {
    /// The fused kernels' type for `d`, or an error naming the operation.
    pub(crate) fn of(op: &'static str, d: DType) -> Result<FlashType> {
        match d {
            DType::F32 => Ok(FlashType::F32),
            DType::BF16 => Ok(FlashType::Bf16),
            DType::F16 => Ok(FlashType::F16),
            other => Err(KernelError::InvalidShape {
                op,
                reason: format!("fused attention takes f32, bf16 or f16 tensors, not {other}"),
            }
            .into()),
        }
    }

    fn elem(self) -> Elem {
        match self {
            FlashType::F32 => Elem::F32,
            FlashType::Bf16 | FlashType::F16 => Elem::U16,
        }
    }
}

/// Query rows per forward block, and query/key rows per backward block, for head dimension
/// `d` (the tile constants of `flash.cu`'s entry points).
fn tiles(d: usize) -> (usize, usize) {
    if d <= 64 {
        (64, 32)
    } else {
        (32, 16)
    }
}

/// How the fused kernels find a head's rows (their `heads`, `packed` arguments; `flash.cu`'s
/// `fa_rows`): every operand `[batch·heads, t, d]`, or the packed layout of a GPT's qkv
/// projection ([`AttentionLayout::Packed`](crate::kernels::attention::AttentionLayout::Packed)):
/// q, k, v (and dq, dk, dv) slices of one `[batch, t, 3, heads, d]` tensor, out and dout
/// `[batch, t, heads, d]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FlashLayout {
    /// Heads per batch entry (used by the packed layout only).
    pub(crate) heads: usize,
    /// The packed layout.
    pub(crate) packed: bool,
}

impl FlashLayout {
    /// Every operand its own `[batch·heads, t, d]` tensor.
    pub(crate) const HEADS: FlashLayout = FlashLayout {
        heads: 1,
        packed: false,
    };

    /// The packed layout with `heads` heads.
    pub(crate) fn packed(heads: usize) -> FlashLayout {
        FlashLayout {
            heads,
            packed: true,
        }
    }

    /// The largest row stride of an operand (elements), `None` on overflow.
    fn max_row_stride(self, d: usize) -> Option<usize> {
        if self.packed {
            self.heads.checked_mul(3)?.checked_mul(d)
        } else {
            Some(d)
        }
    }
}

/// Whether the register-tiled kernels (`flash.cu`'s `_d64` / `_d128`: head dim a compile-time
/// constant, u32 index math inside a head) take `t` rows of head dimension `d` with row stride
/// up to `rs`; other shapes go to the generic kernels (`_le64` / `_le128`, head dim read at run
/// time, u64 index math).
fn register_tiled(t: usize, d: usize, rs: Option<usize>) -> bool {
    (d == 64 || d == 128)
        && rs
            .and_then(|rs| t.checked_mul(rs))
            .is_some_and(|n| n < 1 << 31)
}

/// The kernels for `ty`, `t` and `d` (row strides up to `rs`): forward, backward preprocessing,
/// dk/dv pass, dq pass. Both kernel families use the tiles of [`tiles`].
fn kernels(ty: FlashType, t: usize, d: usize, rs: Option<usize>) -> [Kernel; 4] {
    let pre = match ty {
        FlashType::F32 => FLASH_BWD_PRE_F32,
        FlashType::Bf16 => FLASH_BWD_PRE_BF16,
        FlashType::F16 => FLASH_BWD_PRE_F16,
    };
    let [fwd, dkdv, dq] = match (ty, register_tiled(t, d, rs), d <= 64) {
        (FlashType::F32, true, true) => [
            FLASH_FWD_F32_D64,
            FLASH_BWD_DKDV_F32_D64,
            FLASH_BWD_DQ_F32_D64,
        ],
        (FlashType::Bf16, true, true) => [
            FLASH_FWD_BF16_D64,
            FLASH_BWD_DKDV_BF16_D64,
            FLASH_BWD_DQ_BF16_D64,
        ],
        (FlashType::F16, true, true) => [
            FLASH_FWD_F16_D64,
            FLASH_BWD_DKDV_F16_D64,
            FLASH_BWD_DQ_F16_D64,
        ],
        (FlashType::F32, true, false) => [
            FLASH_FWD_F32_D128,
            FLASH_BWD_DKDV_F32_D128,
            FLASH_BWD_DQ_F32_D128,
        ],
        (FlashType::Bf16, true, false) => [
            FLASH_FWD_BF16_D128,
            FLASH_BWD_DKDV_BF16_D128,
            FLASH_BWD_DQ_BF16_D128,
        ],
        (FlashType::F16, true, false) => [
            FLASH_FWD_F16_D128,
            FLASH_BWD_DKDV_F16_D128,
            FLASH_BWD_DQ_F16_D128,
        ],
        (FlashType::F32, false, true) => [
            FLASH_FWD_F32_LE64,
            FLASH_BWD_DKDV_F32_LE64,
            FLASH_BWD_DQ_F32_LE64,
        ],
        (FlashType::Bf16, false, true) => [
            FLASH_FWD_BF16_LE64,
            FLASH_BWD_DKDV_BF16_LE64,
            FLASH_BWD_DQ_BF16_LE64,
        ],
        (FlashType::F16, false, true) => [
            FLASH_FWD_F16_LE64,
            FLASH_BWD_DKDV_F16_LE64,
            FLASH_BWD_DQ_F16_LE64,
        ],
        (FlashType::F32, false, false) => [
            FLASH_FWD_F32_LE128,
            FLASH_BWD_DKDV_F32_LE128,
            FLASH_BWD_DQ_F32_LE128,
        ],
        (FlashType::Bf16, false, false) => [
            FLASH_FWD_BF16_LE128,
            FLASH_BWD_DKDV_BF16_LE128,
            FLASH_BWD_DQ_BF16_LE128,
        ],
        (FlashType::F16, false, false) => [
            FLASH_FWD_F16_LE128,
            FLASH_BWD_DKDV_F16_LE128,
            FLASH_BWD_DQ_F16_LE128,
        ],
    };
    [fwd, pre, dkdv, dq]
}

fn check_d(op: &'static str, d: usize) -> Result<()> {
    if d == 0 || d > FUSED_ATTENTION_MAX_D {
        return Err(KernelError::InvalidShape {
            op,
            reason: format!(
                "fused attention takes head dimensions 1..={FUSED_ATTENTION_MAX_D}, got d={d}; \
                 use the unfused kernels (causal_attention) for other sizes"
            ),
        }
        .into());
    }
    Ok(())
}

/// Blocks for `bh` heads of `t` rows in tiles of `rows` (the kernels loop over the rest).
fn tile_grid(bh: usize, t: usize, rows: usize) -> u32 {
    ((bh as u64) * (t.div_ceil(rows) as u64)).clamp(1, MAX_GRID as u64) as u32
}

fn head_args(bh: usize, t: usize, d: usize, lay: FlashLayout) -> Vec<PArg> {
    vec![
        PArg::U64(bh as u64),
        PArg::U64(t as u64),
        PArg::U64(d as u64),
        PArg::U64(lay.heads as u64),
        PArg::U64(lay.packed as u64),
        PArg::F32(softmax_scale(d)),
    ]
}

/// A packed layout needs `heads ≥ 1` dividing `bh`.
fn check_layout(op: &'static str, bh: usize, lay: FlashLayout) -> Result<()> {
    if lay.packed && (lay.heads == 0 || bh % lay.heads != 0) {
        return Err(KernelError::InvalidShape {
            op,
            reason: format!(
                "packed attention layout: heads = {} must be positive and divide batch·heads = {bh}",
                lay.heads
            ),
        }
        .into());
    }
    Ok(())
}

/// The fused forward: `out = softmax(q·kᵀ/√d + causal mask)·v` and `lse` per query row.
#[cfg(test)]
pub(crate) fn plan_flash(
    ty: FlashType,
    bh: usize,
    t: usize,
    d: usize,
    ptrs: [Ptr; 5],
) -> Result<Plan> {
    plan_flash_in(ty, bh, t, d, FlashLayout::HEADS, ptrs)
}

/// [`plan_flash`] in layout `lay`.
pub(crate) fn plan_flash_in(
    ty: FlashType,
    bh: usize,
    t: usize,
    d: usize,
    lay: FlashLayout,
    [q, k, v, out, lse]: [Ptr; 5],
) -> Result<Plan> {
    let mut plan = Plan::new();
    if bh == 0 || t == 0 {
        return Ok(plan);
    }
    check_d("flash_attention", d)?;
    check_layout("flash_attention", bh, lay)?;
    let [fwd, ..] = kernels(ty, t, d, lay.max_row_stride(d));
    let mut args = head_args(bh, t, d, lay);
    args.extend([q, k, v, out, lse].map(PArg::Ptr));
    plan.launch(fwd, tile_grid(bh, t, tiles(d).0), args);
    Ok(plan)
}

/// The fused backward from the forward's `out` and `lse`; overwrites `dq`, `dk`, `dv`.
#[cfg(test)]
pub(crate) fn plan_flash_backward(
    ty: FlashType,
    bh: usize,
    t: usize,
    d: usize,
    ptrs: [Ptr; 9],
) -> Result<Plan> {
    plan_flash_backward_in(ty, bh, t, d, FlashLayout::HEADS, ptrs)
}

/// [`plan_flash_backward`] in layout `lay`.
pub(crate) fn plan_flash_backward_in(
    ty: FlashType,
    bh: usize,
    t: usize,
    d: usize,
    lay: FlashLayout,
    [q, k, v, out, lse, dout, dq, dk, dv]: [Ptr; 9],
) -> Result<Plan> {
    let mut plan = Plan::new();
    if bh == 0 || t == 0 {
        return Ok(plan);
    }
    check_d("flash_attention_backward", d)?;
    check_layout("flash_attention_backward", bh, lay)?;
    let [_, pre, dkdv, dqk] = kernels(ty, t, d, lay.max_row_stride(d));
    let rows = bh * t;
    let delta = Ptr::scratch(plan.scratch(rows, Elem::F32));
    plan.launch(
        pre,
        grid_for(rows as u64),
        vec![
            PArg::U64(rows as u64),
            PArg::U64(d as u64),
            PArg::U64(t as u64),
            PArg::U64(lay.heads as u64),
            PArg::U64(lay.packed as u64),
            PArg::Ptr(out),
            PArg::Ptr(dout),
            PArg::Ptr(delta),
        ],
    );
    let b = tiles(d).1;
    let mut args = head_args(bh, t, d, lay);
    args.extend([q, k, v, dout, lse, delta, dk, dv].map(PArg::Ptr));
    plan.launch(dkdv, tile_grid(bh, t, b), args);
    let mut args = head_args(bh, t, d, lay);
    args.extend([q, k, v, dout, lse, delta, dq].map(PArg::Ptr));
    plan.launch(dqk, tile_grid(bh, t, b), args);
    Ok(plan)
}

impl CudaKernels {
    /// Fused causal attention per (batch, head), FlashAttention-2 style: `out =
    /// softmax(q·kᵀ/√d + causal mask)·v` with `q`, `k`, `v`, `out` `[batch, heads, t, d]` of
    /// element type `dtype` (f32, bf16 or f16; arithmetic in f32), and `lse` (`[batch, heads,
    /// t]`, f32) the log-sum-exp of each query's scaled scores, saved for
    /// [`flash_attention_backward`](CudaKernels::flash_attention_backward). No `t×t` buffer:
    /// memory is linear in `t`. Agrees with [`causal_attention`](CudaKernels::causal_attention)
    /// to f32 rounding (different summation order and `exp` arguments), not bitwise.
    ///
    /// # Errors
    /// Shape errors as [`causal_attention`](CudaKernels::causal_attention) (with `lse` in place
    /// of `probs`); [`KernelError::InvalidShape`] for `d` outside `1..=`[`FUSED_ATTENTION_MAX_D`]
    /// (when there is work) or a non-float `dtype`; buffer/stream errors; `out`/`lse`
    /// overlapping any other argument.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention(
        &self,
        stream: &Stream,
        dtype: DType,
        q: &BufferRef,
        k: &BufferRef,
        v: &BufferRef,
        out: &BufferRef,
        lse: &BufferRef,
        batch: usize,
        heads: usize,
        t: usize,
        d: usize,
    ) -> Result<()> {
        let dims = [batch, heads, t, d];
        self.flash_fwd_in(stream, dtype, [q, k, v, out, lse], dims, FlashLayout::HEADS)
    }

    /// [`flash_attention`](CudaKernels::flash_attention) on the packed layout of a GPT's qkv
    /// projection, without head split / merge copies: `qkv` `[batch, t, 3, heads, d]` (queries,
    /// keys, values), `out` `[batch, t, heads, d]`, `lse` `[batch, heads, t]`. Same kernels and
    /// arithmetic as the head-split layout (bit for bit the same numbers per element).
    ///
    /// # Errors
    /// As [`flash_attention`](CudaKernels::flash_attention), with `qkv` of `3·batch·heads·t·d`
    /// elements.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention_packed(
        &self,
        stream: &Stream,
        dtype: DType,
        qkv: &BufferRef,
        out: &BufferRef,
        lse: &BufferRef,
        batch: usize,
        heads: usize,
        t: usize,
        d: usize,
    ) -> Result<()> {
        let dims = [batch, heads, t, d];
        let lay = FlashLayout::packed(heads);
        self.flash_fwd_in(stream, dtype, [qkv, qkv, qkv, out, lse], dims, lay)
    }

    fn flash_fwd_in(
        &self,
        stream: &Stream,
        dtype: DType,
        [q, k, v, out, lse]: [&BufferRef; 5],
        [batch, heads, t, d]: [usize; 4],
        lay: FlashLayout,
    ) -> Result<()> {
        let op = "flash_attention";
        let ty = FlashType::of(op, dtype)?;
        let c = self.call(op, stream)?;
        let bh = mul(op, batch, heads)?;
        let (n, nl) = (mul(op, bh, mul(op, t, d)?)?, mul(op, bh, t)?);
        // q, k, v: each the whole qkv tensor when packed.
        let nqkv = if lay.packed { mul(op, n, 3)? } else { n };
        let shape = || format!("batch={batch}, heads={heads}, t={t}, d={d}, {lay:?}");
        let e = ty.elem();
        let ptrs = c
            .sized(
                [
                    ("q", q, nqkv, e),
                    ("k", k, nqkv, e),
                    ("v", v, nqkv, e),
                    ("out", out, n, e),
                    ("lse", lse, nl, Elem::F32),
                ],
                shape,
            )?
            .map(|dev| dev.as_ptr());
        c.disjoint(
            &[("out", out), ("lse", lse)],
            &[("q", q), ("k", k), ("v", v)],
        )?;
        let plan = plan_flash_in(ty, bh, t, d, lay, ptrs)?;
        // SAFETY: q, k, v hold bh·t·d elements of `dtype` (3·bh·t·d packed: the whole qkv
        // tensor), out bh·t·d and lse bh·t f32 on this device (checked above); out and lse
        // overlap no other argument; the kernel reads and writes head h's t rows only (rows of
        // d elements at fa_rows' base and stride, inside those lengths for either layout, with
        // heads dividing bh: checked by the plan), with d ≤ FUSED_ATTENTION_MAX_D (checked by
        // the plan) matching its shared-memory tiles.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// Gradient of [`flash_attention`](CudaKernels::flash_attention) from `q`, `k`, `v`, the
    /// forward's `out` and `lse`, and `dout`; overwrites `dq`, `dk`, `dv` (all of `dtype`
    /// except `lse`). Three kernels: `delta = rowsum(dout ⊙ out)` (scratch, `[batch, heads,
    /// t]` f32), a pass over key tiles for `dk` and `dv`, a pass over query tiles for `dq`; no
    /// atomics, so bit-reproducible.
    ///
    /// # Errors
    /// As [`flash_attention`](CudaKernels::flash_attention); `dq`, `dk`, `dv` overlapping any
    /// argument; scratch allocation failure.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention_backward(
        &self,
        stream: &Stream,
        dtype: DType,
        q: &BufferRef,
        k: &BufferRef,
        v: &BufferRef,
        out: &BufferRef,
        lse: &BufferRef,
        dout: &BufferRef,
        dq: &BufferRef,
        dk: &BufferRef,
        dv: &BufferRef,
        batch: usize,
        heads: usize,
        t: usize,
        d: usize,
    ) -> Result<()> {
        let dims = [batch, heads, t, d];
        let bufs = [q, k, v, out, lse, dout, dq, dk, dv];
        self.flash_bwd_in(stream, dtype, bufs, dims, FlashLayout::HEADS)
    }

    /// [`flash_attention_backward`](CudaKernels::flash_attention_backward) on the packed layout
    /// of [`flash_attention_packed`](CudaKernels::flash_attention_packed): reads `qkv`, the
    /// forward's `out` and `lse`, and `dout` (`[batch, t, heads, d]`), overwrites all of `dqkv`
    /// (`[batch, t, 3, heads, d]`: dq, dk, dv side by side, as the qkv projection's backward
    /// reads them).
    ///
    /// # Errors
    /// As [`flash_attention_backward`](CudaKernels::flash_attention_backward).
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention_packed_backward(
        &self,
        stream: &Stream,
        dtype: DType,
        qkv: &BufferRef,
        out: &BufferRef,
        lse: &BufferRef,
        dout: &BufferRef,
        dqkv: &BufferRef,
        batch: usize,
        heads: usize,
        t: usize,
        d: usize,
    ) -> Result<()> {
        let dims = [batch, heads, t, d];
        let bufs = [qkv, qkv, qkv, out, lse, dout, dqkv, dqkv, dqkv];
        self.flash_bwd_in(stream, dtype, bufs, dims, FlashLayout::packed(heads))
    }

    fn flash_bwd_in(
        &self,
        stream: &Stream,
        dtype: DType,
        [q, k, v, out, lse, dout, dq, dk, dv]: [&BufferRef; 9],
        [batch, heads, t, d]: [usize; 4],
        lay: FlashLayout,
    ) -> Result<()> {
        let op = "flash_attention_backward";
        let ty = FlashType::of(op, dtype)?;
        let c = self.call(op, stream)?;
        let bh = mul(op, batch, heads)?;
        let (n, nl) = (mul(op, bh, mul(op, t, d)?)?, mul(op, bh, t)?);
        // q, k, v and dq, dk, dv: each the whole qkv tensor / its gradient when packed.
        let nqkv = if lay.packed { mul(op, n, 3)? } else { n };
        let shape = || format!("batch={batch}, heads={heads}, t={t}, d={d}, {lay:?}");
        let e = ty.elem();
        let ptrs = c
            .sized(
                [
                    ("q", q, nqkv, e),
                    ("k", k, nqkv, e),
                    ("v", v, nqkv, e),
                    ("out", out, n, e),
                    ("lse", lse, nl, Elem::F32),
                    ("dout", dout, n, e),
                    ("dq", dq, nqkv, e),
                    ("dk", dk, nqkv, e),
                    ("dv", dv, nqkv, e),
                ],
                shape,
            )?
            .map(|dev| dev.as_ptr());
        let inputs = [
            ("q", q),
            ("k", k),
            ("v", v),
            ("out", out),
            ("lse", lse),
            ("dout", dout),
        ];
        if lay.packed {
            // dq = dk = dv: one gradient tensor, each kernel writing its own slice.
            c.disjoint(&[("dqkv", dq)], &inputs)?;
            if dk.location() != dq.location() || dv.location() != dq.location() {
                return Err(KernelError::InvalidShape {
                    op,
                    reason: "packed layout: dq, dk and dv must be the one dqkv buffer".into(),
                }
                .into());
            }
        } else {
            c.disjoint(&[("dq", dq), ("dk", dk), ("dv", dv)], &inputs)?;
        }
        let plan = plan_flash_backward_in(ty, bh, t, d, lay, ptrs)?;
        // SAFETY: q, k, v, dq, dk, dv hold bh·t·d elements of `dtype` (3·bh·t·d packed: the
        // whole qkv tensor / its gradient, dq = dk = dv), out and dout bh·t·d, lse bh·t f32 on
        // this device (checked above); the gradients overlap no input; delta is the plan's bh·t
        // f32 scratch; every kernel stays within head h's rows (fa_rows' base and stride, inside
        // those lengths; packed, dq / dk / dv write disjoint slices: parts 0 / 1 / 2), with d ≤
        // FUSED_ATTENTION_MAX_D (checked by the plan).
        unsafe { c.exec(&plan) }.map(drop)
    }
}
