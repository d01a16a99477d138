//! Process-wide switches of the CUDA backend, read at every launch (like PyTorch's
//! `torch.backends.cuda.matmul.allow_tf32` and its SDPA backend choice). They exist in every
//! build, so a program can set them unconditionally; without the `cuda` feature nothing reads
//! them.

use std::sync::atomic::{AtomicBool, Ordering};

static ALLOW_TF32: AtomicBool = AtomicBool::new(false);
static FUSED_ATTENTION: AtomicBool = AtomicBool::new(true);

/// Lets f32 matrix products of tensors on CUDA devices run on the tensor cores in TF32
/// (`CUBLAS_COMPUTE_32F_FAST_TF32`: inputs rounded to 10 mantissa bits, f32 accumulation), like
/// PyTorch's `torch.backends.cuda.matmul.allow_tf32 = True`. **Off by default**, so f32 results
/// stay within f32 rounding of the CPU's. Affects launches made after the call, in every thread.
/// f16/bf16 products always use the tensor cores; attention's products are not affected.
pub fn set_allow_tf32(on: bool) {
    ALLOW_TF32.store(on, Ordering::Relaxed);
}

/// Whether f32 matrix products on CUDA devices may use TF32 (see [`set_allow_tf32`]).
pub fn allow_tf32() -> bool {
    ALLOW_TF32.load(Ordering::Relaxed)
}

/// Chooses the causal attention of tensors on CUDA devices: the fused flash-style kernels
/// (`true`, the default: the log-sum-exp per query is saved for backward, no `t×t` buffer) or
/// the unfused cuBLAS + softmax kernels (`false`: the `t×t` probabilities are saved). Head
/// dimensions above [`FUSED_ATTENTION_MAX_D`] always take the unfused kernels. Read when an
/// attention forward runs; its backward follows the forward's choice.
pub fn set_fused_attention(on: bool) {
    FUSED_ATTENTION.store(on, Ordering::Relaxed);
}

/// Whether causal attention on CUDA devices uses the fused kernels (see
/// [`set_fused_attention`]).
pub fn fused_attention() -> bool {
    FUSED_ATTENTION.load(Ordering::Relaxed)
}

static TENSOR_CORE_ATTENTION: AtomicBool = AtomicBool::new(true);

/// Lets the fused causal attention forward of bf16 / f16 tensors with head dimension 64 or 128
/// run its matrix products on the tensor cores (`mma.sync` m16n8k16, f32 accumulation;
/// `attention/flash_mma.cu`) on devices of compute capability 8.0+ (`true`, the default);
/// `false` keeps the CUDA-core flash kernels (f32 arithmetic on widened inputs). f32 tensors
/// always take the CUDA-core kernels; the backward takes them in either case. Read at every
/// fused attention forward.
pub fn set_tensor_core_attention(on: bool) {
    TENSOR_CORE_ATTENTION.store(on, Ordering::Relaxed);
}

/// Whether the fused attention forward may use the tensor cores (see
/// [`set_tensor_core_attention`]).
pub fn tensor_core_attention() -> bool {
    TENSOR_CORE_ATTENTION.load(Ordering::Relaxed)
}

/// The largest head dimension the fused attention kernels take (their tiles live in static
/// shared memory sized for it).
pub const FUSED_ATTENTION_MAX_D: usize = 128;
