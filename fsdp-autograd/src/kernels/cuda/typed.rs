//! The helpers of the typed kernels (`*_t`): add, mul, scale, axpy, row bias, column sums, sum,
//! GELU, layer norm, cross-entropy and embedding with each float operand in `f32`, `f16` or
//! `bf16` (see `common.cu`; each op's file declares and launches its own). Half values are widened exactly on load,
//! computed in f32 by the f32 kernels' own expressions and rounded once on store, so a result is
//! bit for bit what the cast-around path gives (cast the half operands to f32 temporaries, run
//! the f32 kernel, cast the outputs back) without the temporaries, the casts' launches and their
//! memory traffic. The ops' CUDA launches use them for launches with a half
//! operand; all-f32 launches keep the f32 kernels.

use fsdp_alloc::{BufferRef, DType};

use super::context::{Call, Dev, Elem};
use super::error::Result;
use super::kernel::Kernel;
use super::plan::{grid_for, PArg, Plan};
use crate::kernels::KernelError;

/// A buffer with the element type it holds.
pub(crate) type TBuf<'a> = (&'a BufferRef, DType);

/// The element code of `dtype` in a typed kernel's `types` word (`TY_*` in `common.cu`), or
/// `None` for a dtype the typed kernels do not take.
pub(crate) fn type_code(dtype: DType) -> Option<u64> {
    match dtype {
        DType::F32 => Some(0),
        DType::F16 => Some(1),
        DType::BF16 => Some(2),
        _ => None,
    }
}

/// The `types` word: operand `i`'s code in bits `2i..2i+1`.
pub(crate) fn types_word(codes: &[u64]) -> u64 {
    codes
        .iter()
        .enumerate()
        .fold(0, |w, (i, &c)| w | (c << (2 * i)))
}

/// Validates a typed operand: its device, whole elements of its dtype, a float dtype.
pub(crate) fn operand(
    c: &Call<'_>,
    op: &'static str,
    arg: &'static str,
    (b, dtype): TBuf<'_>,
) -> Result<(Dev, u64)> {
    let Some(code) = type_code(dtype) else {
        return Err(KernelError::InvalidShape {
            op,
            reason: format!("`{arg}` is {dtype}; this kernel takes f32, f16 or bf16"),
        }
        .into());
    };
    let elem = if dtype == DType::F32 {
        Elem::F32
    } else {
        Elem::U16
    };
    Ok((c.buf(arg, b, elem)?, code))
}

/// One grid-strided typed launch over `n` elements (nothing for `n == 0`).
pub(crate) fn plan_map_t(kernel: Kernel, n: u64, args: Vec<PArg>) -> Plan {
    let mut plan = Plan::new();
    if n > 0 {
        plan.launch(kernel, grid_for(n), args);
    }
    plan
}

/// A float operand's element type for the buffer checks, and its code (see `typed.rs`).
pub(crate) fn float_operand(
    op: &'static str,
    arg: &'static str,
    dtype: DType,
) -> Result<(Elem, u64)> {
    match type_code(dtype) {
        Some(0) => Ok((Elem::F32, 0)),
        Some(code) => Ok((Elem::U16, code)),
        None => Err(KernelError::InvalidShape {
            op,
            reason: format!("`{arg}` is {dtype}; this kernel takes f32, f16 or bf16"),
        }
        .into()),
    }
}
