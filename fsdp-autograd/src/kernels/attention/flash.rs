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
//! Both families multiply on the CUDA cores in f32, not on tensor cores; the bf16 / f16 forward
//! for head dims 64 and 128 has a tensor-core kernel on compute capability 8.0+
//! ([`flash_mma`](super::flash_mma), chosen in `flash_fwd_in`).
//!
//! The shape is an [`Attention`]: its `scale` multiplies the scores, and its `kv_heads` makes
//! grouped-query attention (query head `h` reads key/value head `h / (heads / kv_heads)` in
//! place; the dk/dv pass sums a key/value head's gradient over its group's query heads in
//! ascending order inside one thread, so it stays deterministic).
//!
//! Layouts ([`FlashLayout`]): q, out `[batch, heads, t, d]` and k, v `[batch, kv_heads, t, d]`
//! ([`flash_attention`](CudaKernels::flash_attention)), or the packed layout of a fused qkv
//! projection ([`flash_attention_packed`](CudaKernels::flash_attention_packed): q, k, v slices of
//! `[batch, t, heads + 2·kv_heads, d]`, out `[batch, t, heads, d]`, one dqkv gradient) that
//! spares the head split / merge copies around attention. Same kernels, same arithmetic per
//! element.

use fsdp_alloc::{BufferRef, DType, Stream};

use super::shape::{Attention, AttentionLayout};
use crate::kernels::cuda::context::{mul, CudaKernels, Elem};
use crate::kernels::cuda::error::Result;
use crate::kernels::cuda::kernel::{Kernel, MAX_GRID};
use crate::kernels::cuda::plan::{grid_for, PArg, Plan, Ptr};
use crate::kernels::cuda::FUSED_ATTENTION_MAX_D;
use crate::kernels::KernelError;

crate::kernels::cuda::kernel::declare_kernels! {
    FLASH_FWD_F32_LE64 = "flash_fwd_f32_le64" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_BF16_LE64 = "flash_fwd_bf16_le64" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_F16_LE64 = "flash_fwd_f16_le64" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_F32_LE128 = "flash_fwd_f32_le128" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_BF16_LE128 = "flash_fwd_bf16_le128" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_F16_LE128 = "flash_fwd_f16_le128" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_PRE_F32 = "flash_bwd_pre_f32" [U64, U64, U64, U64, U64, Ptr, Ptr, Ptr];
    FLASH_BWD_PRE_BF16 = "flash_bwd_pre_bf16" [U64, U64, U64, U64, U64, Ptr, Ptr, Ptr];
    FLASH_BWD_PRE_F16 = "flash_bwd_pre_f16" [U64, U64, U64, U64, U64, Ptr, Ptr, Ptr];
    FLASH_BWD_DKDV_F32_LE64 = "flash_bwd_dkdv_f32_le64" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DKDV_BF16_LE64 = "flash_bwd_dkdv_bf16_le64" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DKDV_F16_LE64 = "flash_bwd_dkdv_f16_le64" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DKDV_F32_LE128 = "flash_bwd_dkdv_f32_le128" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DKDV_BF16_LE128 = "flash_bwd_dkdv_bf16_le128" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DKDV_F16_LE128 = "flash_bwd_dkdv_f16_le128" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DQ_F32_LE64 = "flash_bwd_dq_f32_le64" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DQ_BF16_LE64 = "flash_bwd_dq_bf16_le64" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DQ_F16_LE64 = "flash_bwd_dq_f16_le64" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DQ_F32_LE128 = "flash_bwd_dq_f32_le128" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DQ_BF16_LE128 = "flash_bwd_dq_bf16_le128" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DQ_F16_LE128 = "flash_bwd_dq_f16_le128" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_F32_D64 = "flash_fwd_f32_d64" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_BF16_D64 = "flash_fwd_bf16_d64" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_F16_D64 = "flash_fwd_f16_d64" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_F32_D128 = "flash_fwd_f32_d128" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_BF16_D128 = "flash_fwd_bf16_d128" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_F16_D128 = "flash_fwd_f16_d128" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DKDV_F32_D64 = "flash_bwd_dkdv_f32_d64" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DKDV_BF16_D64 = "flash_bwd_dkdv_bf16_d64" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DKDV_F16_D64 = "flash_bwd_dkdv_f16_d64" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DKDV_F32_D128 = "flash_bwd_dkdv_f32_d128" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DKDV_BF16_D128 = "flash_bwd_dkdv_bf16_d128" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DKDV_F16_D128 = "flash_bwd_dkdv_f16_d128" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DQ_F32_D64 = "flash_bwd_dq_f32_d64" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DQ_BF16_D64 = "flash_bwd_dq_bf16_d64" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DQ_F16_D64 = "flash_bwd_dq_f16_d64" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DQ_F32_D128 = "flash_bwd_dq_f32_d128" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DQ_BF16_D128 = "flash_bwd_dq_bf16_d128" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_BWD_DQ_F16_D128 = "flash_bwd_dq_f16_d128" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
}

/// Which kernels run a fused attention forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FlashPath {
    /// The tensor-core forward where it applies (device, operand type, head dimension,
    /// [`tensor_core_attention`](crate::kernels::cuda::tensor_core_attention)), else the
    /// CUDA-core kernels: what the public methods do.
    Auto,
    /// The CUDA-core kernels of `flash.cu`.
    #[cfg_attr(not(test), allow(dead_code))]
    CudaCores,
    /// The tensor-core forward of `flash_mma.cu` (an error where it does not apply).
    #[cfg_attr(not(test), allow(dead_code))]
    TensorCores,
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

/// How the fused kernels find a head's rows (their `heads`, `kv_heads`, `packed` arguments;
/// `flash.cu`'s `fa_rows`): q, out `[batch·heads, t, d]` and k, v `[batch·kv_heads, t, d]`, or
/// the packed layout of a fused qkv projection
/// ([`AttentionLayout::Packed`]): q, k, v (and dq, dk, dv) slices of one
/// `[batch, t, heads + 2·kv_heads, d]` tensor, out and dout `[batch, t, heads, d]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FlashLayout {
    /// Query heads per batch entry.
    pub(crate) heads: usize,
    /// Key/value heads per batch entry (divides `heads`).
    pub(crate) kv_heads: usize,
    /// The packed layout.
    pub(crate) packed: bool,
}

impl FlashLayout {
    /// The layout of `a`.
    pub(crate) fn of(a: &Attention) -> FlashLayout {
        FlashLayout {
            heads: a.heads,
            kv_heads: a.kv_heads,
            packed: a.layout == AttentionLayout::Packed,
        }
    }

    /// The largest row stride of an operand (elements), `None` on overflow.
    fn max_row_stride(self, d: usize) -> Option<usize> {
        if self.packed {
            self.kv_heads
                .checked_mul(2)?
                .checked_add(self.heads)?
                .checked_mul(d)
        } else {
            Some(d)
        }
    }
}

/// Whether the register-tiled kernels (`flash_tiled.cu`'s `_d64` / `_d128`: head dim a compile-time
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

fn head_args(a: &Attention, bh: usize, lay: FlashLayout) -> Vec<PArg> {
    vec![
        PArg::U64(bh as u64),
        PArg::U64(a.t as u64),
        PArg::U64(a.d as u64),
        PArg::U64(lay.heads as u64),
        PArg::U64(lay.kv_heads as u64),
        PArg::U64(lay.packed as u64),
        PArg::F32(a.scale),
    ]
}

/// The fused forward for shape `a` (either layout): `out = softmax(scale·q·kᵀ + causal
/// mask)·v` and `lse` per query row.
pub(crate) fn plan_flash(
    ty: FlashType,
    a: &Attention,
    [q, k, v, out, lse]: [Ptr; 5],
) -> Result<Plan> {
    let op = "flash_attention";
    let mut plan = Plan::new();
    a.check(op)?;
    let bh = mul(op, a.batch, a.heads)?;
    if bh == 0 || a.t == 0 {
        return Ok(plan);
    }
    check_d(op, a.d)?;
    let lay = FlashLayout::of(a);
    let [fwd, ..] = kernels(ty, a.t, a.d, lay.max_row_stride(a.d));
    let mut args = head_args(a, bh, lay);
    args.extend([q, k, v, out, lse].map(PArg::Ptr));
    plan.launch(fwd, tile_grid(bh, a.t, tiles(a.d).0), args);
    Ok(plan)
}

/// The fused backward for shape `a` (either layout) from the forward's `out` and `lse`;
/// overwrites `dq`, `dk`, `dv`. The dk/dv pass has one block per key/value head and key tile.
pub(crate) fn plan_flash_backward(
    ty: FlashType,
    a: &Attention,
    [q, k, v, out, lse, dout, dq, dk, dv]: [Ptr; 9],
) -> Result<Plan> {
    let op = "flash_attention_backward";
    let mut plan = Plan::new();
    a.check(op)?;
    let bh = mul(op, a.batch, a.heads)?;
    if bh == 0 || a.t == 0 {
        return Ok(plan);
    }
    check_d(op, a.d)?;
    let (t, d, lay) = (a.t, a.d, FlashLayout::of(a));
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
    let mut args = head_args(a, bh, lay);
    args.extend([q, k, v, dout, lse, delta, dk, dv].map(PArg::Ptr));
    plan.launch(dkdv, tile_grid(bh / a.group(), t, b), args);
    let mut args = head_args(a, bh, lay);
    args.extend([q, k, v, dout, lse, delta, dq].map(PArg::Ptr));
    plan.launch(dqk, tile_grid(bh, t, b), args);
    Ok(plan)
}

/// `a` must be in `layout` (each public method takes one layout).
fn expect_layout(op: &'static str, a: &Attention, layout: AttentionLayout) -> Result<()> {
    if a.layout != layout {
        return Err(KernelError::InvalidShape {
            op,
            reason: format!(
                "this method takes AttentionLayout::{layout:?}, got {:?}; use the {} method",
                a.layout,
                if layout == AttentionLayout::Packed {
                    "head-split"
                } else {
                    "packed"
                }
            ),
        }
        .into());
    }
    Ok(())
}

impl CudaKernels {
    /// Fused causal attention of shape `a` (layout [`AttentionLayout::Heads`]) per (batch,
    /// query head), FlashAttention-2 style: `out = softmax(a.scale·q·kᵀ + causal mask)·v` with
    /// `q`, `out` `[batch, heads, t, d]` and `k`, `v` `[batch, kv_heads, t, d]` (query head `h`
    /// reads key/value head `h / (heads / kv_heads)`, nothing repeated) of element type `dtype`
    /// (f32, bf16 or f16; arithmetic in f32, except that bf16 / f16 operands with `d` 64 or 128
    /// on a compute-capability-8.0+ device multiply on the tensor cores — `mma.sync`, f32
    /// accumulation, P rounded to `dtype` before `P·v` — unless
    /// [`set_tensor_core_attention(false)`](crate::kernels::cuda::set_tensor_core_attention)),
    /// and `lse` (`[batch, heads, t]`, f32) the
    /// log-sum-exp of each query's scaled scores, saved for
    /// [`flash_attention_backward`](CudaKernels::flash_attention_backward). No `t×t` buffer:
    /// memory is linear in `t`. Agrees with [`causal_attention`](CudaKernels::causal_attention)
    /// to f32 rounding (different summation order and `exp` arguments), not bitwise.
    ///
    /// # Errors
    /// Shape errors as [`causal_attention`](CudaKernels::causal_attention) (with `lse` in place
    /// of `probs`); [`KernelError::InvalidShape`] for a shape [`Attention::check`] rejects, the
    /// packed layout, `d` outside `1..=`[`FUSED_ATTENTION_MAX_D`] (when there is work) or a
    /// non-float `dtype`; buffer/stream errors; `out`/`lse` overlapping any other argument.
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
        a: &Attention,
    ) -> Result<()> {
        expect_layout("flash_attention", a, AttentionLayout::Heads)?;
        self.flash_fwd_in(stream, dtype, [q, k, v, out, lse], a)
    }

    /// [`flash_attention`](CudaKernels::flash_attention) on the packed layout of a fused qkv
    /// projection (`a.layout` [`AttentionLayout::Packed`]), without head split / merge copies:
    /// `qkv` `[batch, t, heads + 2·kv_heads, d]` (queries, keys, values; GPT's `[batch, t, 3,
    /// heads, d]` when `kv_heads == heads`), `out` `[batch, t, heads, d]`, `lse` `[batch,
    /// heads, t]`. Same kernels and arithmetic as the head-split layout (bit for bit the same
    /// numbers per element).
    ///
    /// # Errors
    /// As [`flash_attention`](CudaKernels::flash_attention), with `qkv` of
    /// `batch·t·(heads + 2·kv_heads)·d` elements and the head-split layout the error.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention_packed(
        &self,
        stream: &Stream,
        dtype: DType,
        qkv: &BufferRef,
        out: &BufferRef,
        lse: &BufferRef,
        a: &Attention,
    ) -> Result<()> {
        expect_layout("flash_attention", a, AttentionLayout::Packed)?;
        self.flash_fwd_in(stream, dtype, [qkv, qkv, qkv, out, lse], a)
    }

    fn flash_fwd_in(
        &self,
        stream: &Stream,
        dtype: DType,
        bufs: [&BufferRef; 5],
        a: &Attention,
    ) -> Result<()> {
        self.flash_forward_on(stream, dtype, bufs, a, FlashPath::Auto)
    }

    /// The fused forward (either layout: packed passes the qkv buffer as q, k and v) on the
    /// kernels `path` names; the public methods take [`FlashPath::Auto`], the kernel tests
    /// name each path.
    ///
    /// # Errors
    /// As [`flash_attention`](CudaKernels::flash_attention); [`KernelError::InvalidShape`] for
    /// [`FlashPath::TensorCores`] where the tensor-core forward does not apply (operand type,
    /// head dimension) or this device's program has no tensor-core code
    /// ([`tensor_cores`](CudaKernels::tensor_cores)).
    pub(crate) fn flash_forward_on(
        &self,
        stream: &Stream,
        dtype: DType,
        [q, k, v, out, lse]: [&BufferRef; 5],
        a: &Attention,
        path: FlashPath,
    ) -> Result<()> {
        let op = "flash_attention";
        let ty = FlashType::of(op, dtype)?;
        let c = self.call(op, stream)?;
        let [nq, nkv, n, nl] = operand_lens(op, a)?;
        let shape = || a.describe();
        let e = ty.elem();
        let ptrs = c
            .sized(
                [
                    ("q", q, nq, e),
                    ("k", k, nkv, e),
                    ("v", v, nkv, e),
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
        let mma = match path {
            FlashPath::Auto => {
                self.tensor_cores()
                    && crate::kernels::cuda::tensor_core_attention()
                    && super::flash_mma::applies(dtype, a.d)
            }
            FlashPath::CudaCores => false,
            FlashPath::TensorCores if self.tensor_cores() => true,
            FlashPath::TensorCores => {
                return Err(KernelError::InvalidShape {
                    op,
                    reason: "the tensor-core attention forward needs a device of compute \
                             capability 8.0+ (mma.sync)"
                        .into(),
                }
                .into())
            }
        };
        let plan = if mma {
            super::flash_mma::plan_flash_mma(dtype, a, ptrs)?
        } else {
            plan_flash(ty, a, ptrs)?
        };
        // SAFETY: q and out hold batch·heads·t·d elements of `dtype`, k and v
        // batch·kv_heads·t·d (packed: q, k, v are each the whole batch·t·(heads + 2·kv_heads)·d
        // qkv tensor), lse batch·heads·t f32 on this device (checked above); out and lse overlap
        // no other argument; the kernel reads and writes head h's t rows only (rows of d
        // elements at fa_rows' base and stride, inside those lengths for either layout, with
        // kv_heads dividing heads: checked by the plan through Attention::check), with d ≤
        // FUSED_ATTENTION_MAX_D (checked by the plan) matching its shared-memory tiles (the
        // tensor-core kernel: d exactly 64 or 128, checked by its plan, and the program compiled
        // for compute_80 on a compute-capability-8.0+ device, checked by tensor_cores()).
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// Gradient of [`flash_attention`](CudaKernels::flash_attention) from `q`, `k`, `v`, the
    /// forward's `out` and `lse`, and `dout`; overwrites `dq` (like `q`), `dk`, `dv` (like `k`;
    /// all of `dtype` except `lse`). Three kernels: `delta = rowsum(dout ⊙ out)` (scratch,
    /// `[batch, heads, t]` f32), a pass over key tiles of each key/value head for `dk` and `dv`
    /// (summing its group's query heads in ascending order), a pass over query tiles for `dq`;
    /// no atomics, so bit-reproducible.
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
        a: &Attention,
    ) -> Result<()> {
        expect_layout("flash_attention_backward", a, AttentionLayout::Heads)?;
        let bufs = [q, k, v, out, lse, dout, dq, dk, dv];
        self.flash_bwd_in(stream, dtype, bufs, a)
    }

    /// [`flash_attention_backward`](CudaKernels::flash_attention_backward) on the packed layout
    /// of [`flash_attention_packed`](CudaKernels::flash_attention_packed): reads `qkv`, the
    /// forward's `out` and `lse`, and `dout` (`[batch, t, heads, d]`), overwrites all of `dqkv`
    /// (the qkv shape: dq, dk, dv side by side, as the qkv projection's backward reads them).
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
        a: &Attention,
    ) -> Result<()> {
        expect_layout("flash_attention_backward", a, AttentionLayout::Packed)?;
        let bufs = [qkv, qkv, qkv, out, lse, dout, dqkv, dqkv, dqkv];
        self.flash_bwd_in(stream, dtype, bufs, a)
    }

    fn flash_bwd_in(
        &self,
        stream: &Stream,
        dtype: DType,
        [q, k, v, out, lse, dout, dq, dk, dv]: [&BufferRef; 9],
        a: &Attention,
    ) -> Result<()> {
        let op = "flash_attention_backward";
        let ty = FlashType::of(op, dtype)?;
        let c = self.call(op, stream)?;
        let [nq, nkv, n, nl] = operand_lens(op, a)?;
        let shape = || a.describe();
        let e = ty.elem();
        let ptrs = c
            .sized(
                [
                    ("q", q, nq, e),
                    ("k", k, nkv, e),
                    ("v", v, nkv, e),
                    ("out", out, n, e),
                    ("lse", lse, nl, Elem::F32),
                    ("dout", dout, n, e),
                    ("dq", dq, nq, e),
                    ("dk", dk, nkv, e),
                    ("dv", dv, nkv, e),
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
        if a.layout == AttentionLayout::Packed {
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
        let plan = plan_flash_backward(ty, a, ptrs)?;
        // SAFETY: q, dq hold batch·heads·t·d elements of `dtype`, k, v, dk, dv
        // batch·kv_heads·t·d (packed: each is the whole batch·t·(heads + 2·kv_heads)·d qkv
        // tensor / its gradient, dq = dk = dv), out and dout batch·heads·t·d, lse
        // batch·heads·t f32 on this device (checked above); the gradients overlap no input;
        // delta is the plan's batch·heads·t f32 scratch; every kernel stays within its head's
        // rows (fa_rows' base and stride, inside those lengths with kv_heads dividing heads:
        // checked by the plan; packed, dq / dk / dv write disjoint head slots), with d ≤
        // FUSED_ATTENTION_MAX_D (checked by the plan).
        unsafe { c.exec(&plan) }.map(drop)
    }
}

/// The element counts of `a`'s operands for the fused kernels: q and dq, k and v (and dk, dv;
/// packed: each of the six is the whole qkv tensor), out and dout, lse.
fn operand_lens(op: &'static str, a: &Attention) -> Result<[usize; 4]> {
    a.check(op)?;
    let overflow = || KernelError::InvalidShape {
        op,
        reason: format!("attention sizes overflow: {}", a.describe()),
    };
    let (n, nkv) = a.head_split_lens().ok_or_else(overflow)?;
    let nl = mul(op, mul(op, a.batch, a.heads)?, a.t)?;
    Ok(match a.layout {
        AttentionLayout::Heads => [n, nkv, n, nl],
        AttentionLayout::Packed => {
            let p = a.packed_len().ok_or_else(overflow)?;
            [p, p, n, nl]
        }
    })
}
