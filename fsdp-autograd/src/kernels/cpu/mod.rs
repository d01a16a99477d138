//! CPU kernels: pure functions on contiguous row-major slices.
//!
//! | group | functions |
//! | --- | --- |
//! | matrix products (`gemm`) | [`matmul`], [`bmm`], [`set_matmul_threads`], [`matmul_threads`], [`matmul_parallelism`] |
//! | instruction-set level | [`cpu_isa`], [`detected_cpu_isa`], [`cpu_isa_cap`], [`CpuIsa`] (`FSDP_CPU_ISA`) |
//! | reference GEMM (benches, probe) | [`ReferenceGemm`] (OpenBLAS's `cblas_sgemm`, loaded at run time) |
//! | elementwise | [`add`], [`mul`], [`scale`], [`scale_inplace`], [`add_scaled`] (axpy), [`gelu`], [`gelu_backward`], [`gelu_exact`], [`gelu_exact_backward`] |
//! | reductions / broadcasts | [`sum`], [`mean`], [`add_row_bias`], [`add_row_bias_inplace`], [`col_sums`] |
//! | row-wise | [`softmax_rows`], [`softmax_rows_backward`], [`layer_norm`], [`layer_norm_backward`] |
//! | lookup / loss | [`embedding`], [`embedding_backward`], [`cross_entropy`], [`cross_entropy_backward`] |
//! | attention | [`causal_attention`], [`causal_attention_backward`], [`causal_attention_packed`], [`causal_attention_packed_backward`]; any [`Attention`](crate::kernels::attention::Attention) (grouped-query `kv_heads`, `scale`): the `*_with` forms |
//! | layout (views) | [`strided_copy`], [`strided_add_assign`] |
//! | optimizer, clipping, scaler (in [`kernels::optim`](crate::kernels::optim), with their ops) | [`sgd_step`](crate::kernels::optim::sgd_step), [`adamw_step`](crate::kernels::optim::adamw_step), [`lamb_direction`](crate::kernels::optim::lamb_direction), [`lamb_apply`](crate::kernels::optim::lamb_apply), [`sum_sq`](crate::kernels::optim::sum_sq), [`unscale`](crate::kernels::optim::unscale) |
//! | casts (`half`) | [`cast_f32_to_f16`], [`cast_f16_to_f32`], [`cast_f32_to_bf16`], [`cast_bf16_to_f32`] |
//!
//! Conventions:
//! - Every kernel checks its slice lengths against the shape arguments and returns
//!   [`KernelError`](crate::kernels::KernelError) instead of panicking; nothing is written when
//!   a check fails.
//! - "Rows" kernels take `cols` and derive `rows = len / cols`; `cols` must be positive and the
//!   length a whole number of rows (skip empty tensors before calling).
//! - Outputs are `&mut` slices that are **overwritten** unless a function says it accumulates
//!   ([`matmul`]/[`bmm`] with `accumulate`, [`add_scaled`], [`add_row_bias_inplace`],
//!   [`strided_add_assign`]).
//! - Backward kernels take what the forward saved (softmax outputs, layer-norm mean/rstd,
//!   attention probabilities, cross-entropy log-sum-exp) and return input gradients.
//! - **Determinism**: the same inputs give the same bits on every call. Matrix products are
//!   also independent of the thread setting and of slice alignment (tested, see [`matmul`]);
//!   all other kernels run on the calling thread in a fixed order, with reductions in f64 over
//!   fixed lanes. No fused multiply-adds are formed outside `gemm`. Results depend on the CPU
//!   only through the instruction-set level ([`cpu_isa`]: the widest the CPU has, capped by
//!   `FSDP_CPU_ISA=baseline|avx2|avx512`): the products use that level's `gemm` microkernels
//!   (AVX-512, AVX2 + FMA or scalar; different fused multiply-adds and blocking), so **they
//!   differ in the last bits between levels**, and with them a training run's losses; every
//!   other kernel gives the same bits on every level. At one level, runs are bit-reproducible
//!   across ranks, processes and machines of that level.
//! - `exp` inside GELU, softmax, attention and cross-entropy is a vectorizable polynomial
//!   (≤ 2 ulp from the exact value for normal results, subnormal results flushed to 0) rather
//!   than libm's; exact GELU's normal CDF is a vectorizable erfc fit (relative error below 4e-6
//!   for |x| < 5, `Φ(0) = ½` exactly) rather than libm's `erfcf`; `ln` (once per row in
//!   cross-entropy) is libm's, in f64.
//! - GELU, layer norm, column sums and attention's row loops are compiled once per level and
//!   picked at run time (`pulp`): AVX-512 lanes, AVX2 lanes or baseline SSE2, by [`cpu_isa`].
//!   The paths give the same bits (no fused multiply-adds are formed; tested on every level).
//!
//! Performance notes (2-core AMD EPYC VM with AVX-512, thread CPU time, one thread): [`matmul`]
//! runs at 0.95–1.0 of OpenBLAS's AVX-512 `sgemm` ([`ReferenceGemm`]) on the products of
//! GPT-mini and of a 25M GPT (FLOP-weighted over a step's products; `cargo xtask bench
//! scaling`'s table (d)), and at 0.99 of OpenBLAS's AVX2 kernels when capped at `avx2`; below
//! it: the forward `x·Wᵀ` products at 64 tokens per rank of the GPT-2 shape (0.70–0.84).
//! Element-wise kernels are single-threaded and vectorized (see above).
//! Causal attention is block-causal (blocks of 32 positions): products skip the blocks above
//! the diagonal, 5/8 of the full square's work at t = 128.

mod attention;
mod attention_packed;
pub(crate) mod backend;
mod cast;
mod elementwise;
mod embedding;
pub(crate) mod isa;
mod layout;
mod loss;
pub(crate) mod math;
mod matmul;
mod norm;
mod reference;
mod transpose;

pub use attention::{
    causal_attention, causal_attention_backward, causal_attention_backward_with,
    causal_attention_with,
};
pub use attention_packed::{
    causal_attention_packed, causal_attention_packed_backward,
    causal_attention_packed_backward_with, causal_attention_packed_with,
};
pub use cast::{cast_bf16_to_f32, cast_f16_to_f32, cast_f32_to_bf16, cast_f32_to_f16};
pub use elementwise::{
    add, add_row_bias, add_row_bias_inplace, add_scaled, col_sums, gelu, gelu_backward, gelu_exact,
    gelu_exact_backward, mean, mul, scale, scale_inplace, sum,
};
pub use embedding::{embedding, embedding_backward};
pub use isa::{cpu_isa, cpu_isa_cap, detected_cpu_isa, CpuIsa, CpuIsaError, CPU_ISA_ENV};
pub use layout::{strided_add_assign, strided_copy};
pub use loss::{cross_entropy, cross_entropy_backward};
pub use matmul::{bmm, matmul, matmul_parallelism, matmul_threads, set_matmul_threads};
pub use norm::{layer_norm, layer_norm_backward, softmax_rows, softmax_rows_backward};
pub use reference::{
    ReferenceGemm, ReferenceGemmError, REFERENCE_BLAS_ENV, REFERENCE_CORETYPE_ENV,
};

#[cfg(test)]
mod proptests;
#[cfg(test)]
mod testutil;
