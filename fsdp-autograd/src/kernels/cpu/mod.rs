//! CPU kernels: pure functions on contiguous row-major slices.
//!
//! Matrix products ([`matmul`], [`bmm`]) call the `gemm` crate; everything else is plain Rust
//! over whole rows in a fixed order. All kernels check their slice lengths against the shape
//! arguments and return [`KernelError`](crate::kernels::KernelError) instead of panicking.
//!
//! Conventions:
//! - "rows" kernels take `cols` and derive `rows = len / cols`; `cols` must be positive and the
//!   length a whole number of rows.
//! - Outputs are `&mut` slices that are **overwritten** unless a function says it accumulates.
//! - Backward kernels take what the forward saved (e.g. softmax outputs, layer-norm mean/rstd,
//!   attention probabilities, cross-entropy log-sum-exp) and return input gradients.
//! - Results are bit-for-bit reproducible: the same inputs give the same bits on every call.

mod attention;
mod cast;
mod check;
mod elementwise;
mod embedding;
mod layout;
mod loss;
mod math;
mod matmul;
mod norm;

pub use attention::{causal_attention, causal_attention_backward};
pub use cast::{cast_bf16_to_f32, cast_f16_to_f32, cast_f32_to_bf16, cast_f32_to_f16};
pub use elementwise::{
    add, add_row_bias, add_row_bias_inplace, add_scaled, col_sums, gelu, gelu_backward, mean, mul,
    scale, scale_inplace, sum,
};
pub use embedding::{embedding, embedding_backward};
pub use layout::{strided_add_assign, strided_copy};
pub use loss::{cross_entropy, cross_entropy_backward};
pub use matmul::{bmm, matmul, matmul_parallelism, matmul_threads, set_matmul_threads};
pub use norm::{layer_norm, layer_norm_backward, softmax_rows, softmax_rows_backward};

#[cfg(test)]
mod proptests;
#[cfg(test)]
mod testutil;
