//! The tensor-core flash attention forward (`flash_mma.cu`): the contract of
//! [`plan_flash`](super::flash::plan_flash) (either layout, grouped-query heads, `scale`, causal
//! mask, `out` and the log-sum-exp `lse`) for bf16 / f16 operands and head dimensions 64 and
//! 128, with both matrix products on the tensor cores (`mma.sync` m16n8k16, f32 accumulation).
//!
//! [`CudaKernels::flash_attention`](crate::kernels::cuda::CudaKernels::flash_attention) and its
//! packed twin take it when [`applies`] holds, the device runs the program's `mma.sync` code
//! ([`CudaKernels::tensor_cores`](crate::kernels::cuda::CudaKernels::tensor_cores): compute
//! capability 8.0+, program compiled for `compute_80`) and
//! [`tensor_core_attention`](crate::kernels::cuda::tensor_core_attention) is on. The backward
//! reads this forward's `out` and `lse` with the CUDA-core kernels of `flash.cu` (not yet on the
//! tensor cores).
//!
//! Numerics: P is rounded to the operand type before `P·V` (as FlashAttention does), the
//! normalizer sums the unrounded f32 P, and `out` is rounded once at the end; so each output
//! element is within about `2^-p·(Σ P·|v|)/l + ulp_E(out)` of the exact result (`p` the
//! operand's mantissa bits: 8 for bf16, 11 for f16) plus f32 rounding. The tests derive their
//! tolerances from that bound.

use fsdp_alloc::DType;

use super::shape::Attention;
use crate::kernels::cuda::context::mul;
use crate::kernels::cuda::error::Result;
use crate::kernels::cuda::kernel::{Kernel, BLOCK, MAX_GRID};
use crate::kernels::cuda::plan::{PArg, Plan, Ptr};

crate::kernels::cuda::kernel::declare_kernels! {
    FLASH_FWD_MMA_BF16_D64 = "flash_fwd_mma_bf16_d64" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_MMA_F16_D64 = "flash_fwd_mma_f16_d64" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_MMA_BF16_D128 = "flash_fwd_mma_bf16_d128" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FLASH_FWD_MMA_F16_D128 = "flash_fwd_mma_f16_d128" [U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
}

/// Queries per block of the tensor-core forward (`flash_mma.cu`'s `BR`: 16 per warp).
const QUERY_TILE: usize = (BLOCK as usize / 32) * 16;

/// The tensor-core forward kernel for operands of type `ty` and head dimension `d`, `None` where
/// it does not apply (other types, other head dimensions).
fn kernel(ty: DType, d: usize) -> Option<Kernel> {
    match (ty, d) {
        (DType::BF16, 64) => Some(FLASH_FWD_MMA_BF16_D64),
        (DType::F16, 64) => Some(FLASH_FWD_MMA_F16_D64),
        (DType::BF16, 128) => Some(FLASH_FWD_MMA_BF16_D128),
        (DType::F16, 128) => Some(FLASH_FWD_MMA_F16_D128),
        _ => None,
    }
}

/// Whether the tensor-core forward takes operands of type `ty` with head dimension `d` (bf16 or
/// f16, `d` 64 or 128; any `t`, heads, `kv_heads`, layout).
pub(crate) fn applies(ty: DType, d: usize) -> bool {
    kernel(ty, d).is_some()
}

/// The tensor-core forward for shape `a` (either layout), the same operands as
/// [`plan_flash`](super::flash::plan_flash). One block per tile of [`QUERY_TILE`] queries of
/// one query head.
///
/// # Errors
/// [`KernelError::InvalidShape`](crate::kernels::KernelError::InvalidShape) for a shape
/// [`Attention::check`] rejects or where [`applies`] does not hold (when there is work).
pub(crate) fn plan_flash_mma(
    ty: DType,
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
    let Some(kernel) = kernel(ty, a.d) else {
        return Err(crate::kernels::KernelError::InvalidShape {
            op,
            reason: format!(
                "the tensor-core attention forward takes bf16 or f16 operands with head \
                 dimension 64 or 128, got {ty} with d={}",
                a.d
            ),
        }
        .into());
    };
    let blocks = (bh as u64) * (a.t.div_ceil(QUERY_TILE) as u64);
    let grid = blocks.clamp(1, MAX_GRID as u64) as u32;
    let mut args = vec![
        PArg::U64(bh as u64),
        PArg::U64(a.t as u64),
        PArg::U64(a.d as u64),
        PArg::U64(a.heads as u64),
        PArg::U64(a.kv_heads as u64),
        PArg::U64(u64::from(a.layout == super::AttentionLayout::Packed)),
        PArg::F32(a.scale),
    ];
    args.extend([q, k, v, out, lse].map(PArg::Ptr));
    plan.launch(kernel, grid, args);
    Ok(plan)
}
