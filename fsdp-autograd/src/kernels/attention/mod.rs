//! Causal attention: the shape ([`Attention`]: sizes, grouped-query `kv_heads`, `scale`;
//! [`AttentionLayout`]), what the forward saves for
//! the backward ([`AttentionSave`], [`AttentionStats`], [`AttentionSaved`]; the backend
//! chooses), and the ops [`CausalAttention`] and [`CausalAttentionBackward`].

mod causal;
#[cfg(feature = "cuda")]
pub(crate) mod flash;
#[cfg(feature = "cuda")]
pub(crate) mod flash_mma;
mod shape;
#[cfg(feature = "cuda")]
pub(crate) mod unfused;

pub use causal::{CausalAttention, CausalAttentionBackward};
pub use shape::{Attention, AttentionLayout};

use super::operand::Operand;

/// The family's part of the CUDA program: the unfused attention's row kernels (`attention.cu`),
/// the fused flash kernels (`flash.cu`: contract, helpers, generic kernels; `flash_tiled.cu`:
/// the register-tiled ones) and the tensor-core flash forward (`flash_mma.cu`), the last two
/// after `flash.cu`, whose helpers they use, with their kernel tables.
#[cfg(feature = "cuda")]
pub(crate) const FAMILY: super::cuda::kernel::Family = super::cuda::kernel::Family {
    sources: &[
        include_str!("attention.cu"),
        include_str!("flash.cu"),
        include_str!("flash_tiled.cu"),
        include_str!("flash_mma.cu"),
    ],
    kernels: &[unfused::KERNELS, flash::KERNELS, flash_mma::KERNELS],
};

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
        /// The forward's output (`[batch, heads, t, d]`, or `[batch, t, heads, d]` packed).
        out: &'a Operand,
    },
}
