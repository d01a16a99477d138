//! Causal attention: the shape ([`Attention`], [`AttentionLayout`]), what the forward saves for
//! the backward ([`AttentionSave`], [`AttentionStats`], [`AttentionSaved`]; the backend
//! chooses), and the ops [`CausalAttention`] and [`CausalAttentionBackward`].

mod causal;
#[cfg(feature = "cuda")]
pub(crate) mod flash;
#[cfg(feature = "cuda")]
pub(crate) mod unfused;

pub use causal::{CausalAttention, CausalAttentionBackward};

use super::operand::Operand;

/// The family's part of the CUDA program: the unfused attention's row kernels (`attention.cu`)
/// and the fused flash kernels (`flash.cu`), with their kernel tables.
#[cfg(feature = "cuda")]
pub(crate) const FAMILY: super::cuda::kernel::Family = super::cuda::kernel::Family {
    sources: &[include_str!("attention.cu"), include_str!("flash.cu")],
    kernels: &[unfused::KERNELS, flash::KERNELS],
};

/// Causal attention over `[batch, heads, t, d]` tensors (or the packed layout, see
/// [`AttentionLayout`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attention {
    /// Batch size.
    pub batch: usize,
    /// Heads.
    pub heads: usize,
    /// Sequence length.
    pub t: usize,
    /// Head dimension.
    pub d: usize,
    /// How q, k, v, out and their gradients are laid out.
    pub layout: AttentionLayout,
}

/// The memory layout of causal attention's operands (the statistics are always
/// `[batch, heads, t(, t)]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionLayout {
    /// q, k, v, out, dout, dq, dk, dv: each its own contiguous `[batch, heads, t, d]` tensor.
    #[default]
    Heads,
    /// The layout of a GPT's qkv projection, without head split/merge copies: q, k and v are
    /// each the *whole* `[batch, t, 3, heads, d]` tensor (the same operand three times; the
    /// kernels read the query, key and value slices `[.., 0|1|2, ..]`), out and dout are
    /// `[batch, t, heads, d]` (= `[batch, t, heads·d]`), and dq, dk, dv are each the whole
    /// `[batch, t, 3, heads, d]` gradient (the same operand three times; each slice is written
    /// by exactly one of them, so together they write every element).
    Packed,
}

/// What causal attention keeps for its backward; the backend decides
/// ([`Kernels::attention_save`](crate::kernels::Kernels::attention_save)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionSave {
    /// The probabilities, `[batch, heads, t, t]` `f32` (the unfused kernels: CPU, and CUDA
    /// with [`set_fused_attention(false)`](crate::kernels::cuda::set_fused_attention) or large
    /// head dimensions).
    Probs,
    /// The log-sum-exp of each query's scaled scores, `[batch, heads, t]` `f32`, plus the
    /// forward's output (the fused flash-style kernels on CUDA).
    Lse,
}

impl AttentionSave {
    /// The shape of the saved statistics tensor for `a`.
    pub fn shape(self, a: &Attention) -> Vec<usize> {
        match self {
            AttentionSave::Probs => vec![a.batch, a.heads, a.t, a.t],
            AttentionSave::Lse => vec![a.batch, a.heads, a.t],
        }
    }
}

/// The statistics a causal attention forward writes (see [`AttentionSave`]).
#[derive(Debug, Clone, Copy)]
pub enum AttentionStats<'a> {
    /// The probabilities (`f32`, `[batch, heads, t, t]`, exactly 0 above the diagonal).
    Probs(&'a Operand),
    /// The per-query log-sum-exp of the scaled scores (`f32`, `[batch, heads, t]`).
    Lse(&'a Operand),
}

/// What a causal attention backward reads from its forward (see [`AttentionSave`]).
#[derive(Debug, Clone, Copy)]
pub enum AttentionSaved<'a> {
    /// The forward's probabilities.
    Probs(&'a Operand),
    /// The forward's log-sum-exp and output.
    Lse {
        /// Log-sum-exp (`f32`, `[batch, heads, t]`).
        lse: &'a Operand,
        /// The forward's output (`[batch, heads, t, d]`).
        out: &'a Operand,
    },
}
