//! The shape of causal attention: [`Attention`] (sizes, grouped-query `kv_heads`, `scale`, and
//! the checks every op and kernel applies) and [`AttentionLayout`]. A leaf: the family's op,
//! kernel and plan files import it.

use crate::kernels::KernelError;

/// Causal attention over `[batch, heads, t, d]` queries and `[batch, kv_heads, t, d]` keys and
/// values (or the packed layout, see [`AttentionLayout`]):
/// `out = softmax(scale·q·kᵀ + causal mask)·v` per query head.
///
/// Grouped-query attention: `kv_heads` divides `heads`, and query head `h` (of its batch entry)
/// reads key/value head `h / (heads / kv_heads)`; nothing is repeated in memory. `kv_heads ==
/// heads` is multi-head attention. [`Attention::new`] gives that with the default scale
/// `1/√d` ([`Attention::default_scale`]); [`Attention::check`] says whether a shape is usable
/// (every op and kernel calls it).
///
/// ```
/// use fsdp_autograd::kernels::attention::{Attention, AttentionLayout};
/// let a = Attention::new(2, 8, 16, 64);
/// assert_eq!((a.kv_heads, a.scale, a.layout), (8, 0.125, AttentionLayout::Heads));
/// // Llama-style grouped-query attention: 8 query heads share 2 key/value heads.
/// let g = Attention { kv_heads: 2, ..a };
/// assert_eq!(g.group(), 4);
/// assert!(g.check("attention").is_ok());
/// assert!(Attention { kv_heads: 3, ..a }.check("attention").is_err());
/// assert!(Attention { scale: f32::NAN, ..a }.check("attention").is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Attention {
    /// Batch size.
    pub batch: usize,
    /// Query heads (and heads of out, dout, dq, and of the saved statistics).
    pub heads: usize,
    /// Key/value heads (and heads of dk, dv): divides `heads`; `heads` for multi-head attention.
    pub kv_heads: usize,
    /// Sequence length.
    pub t: usize,
    /// Head dimension.
    pub d: usize,
    /// The factor applied to `q·kᵀ` before the softmax: finite and positive;
    /// [`Attention::default_scale`] (`1/√d`) unless the model says otherwise.
    pub scale: f32,
    /// How q, k, v, out and their gradients are laid out.
    pub layout: AttentionLayout,
}

impl Attention {
    /// Multi-head attention (`kv_heads == heads`) in the head-split layout with the default scale
    /// `1/√d`: what every caller got before `kv_heads` and `scale` existed.
    pub fn new(batch: usize, heads: usize, t: usize, d: usize) -> Attention {
        Attention {
            batch,
            heads,
            kv_heads: heads,
            t,
            d,
            scale: Attention::default_scale(d),
            layout: AttentionLayout::Heads,
        }
    }

    /// The default softmax scale `1/√d`, computed in f64 and rounded once to f32 (the expression
    /// every attention kernel used before the scale became a field; `d = 0` gives `+∞`, which
    /// [`check`](Attention::check) rejects only where there is a head dimension to scale).
    pub fn default_scale(d: usize) -> f32 {
        (1.0 / (d as f64).sqrt()) as f32
    }

    /// Query heads per key/value head, `heads / kv_heads` (1 when there are no heads).
    pub fn group(&self) -> usize {
        self.heads.checked_div(self.kv_heads).unwrap_or(1)
    }

    /// Checks the shape's own rules: `kv_heads ≥ 1` dividing `heads` (both 0 is the empty
    /// attention), and a finite, positive `scale` (not checked when `d == 0`, where there are no
    /// scores to scale and the default `1/√0` is infinite).
    ///
    /// # Errors
    /// [`KernelError::InvalidShape`] naming `op` and what to change.
    pub fn check(&self, op: &'static str) -> Result<(), KernelError> {
        let (h, kv) = (self.heads, self.kv_heads);
        let reason = if kv == 0 && h > 0 {
            Some(format!(
                "kv_heads = 0 with heads = {h}: grouped-query attention needs at least one \
                 key/value head (kv_heads = heads for multi-head attention)"
            ))
        } else if kv > 0 && (h % kv != 0 || kv > h) {
            Some(format!(
                "kv_heads = {kv} does not divide heads = {h}: every key/value head serves the \
                 same number of query heads; choose kv_heads among the divisors of heads"
            ))
        } else if self.d > 0 && !(self.scale.is_finite() && self.scale > 0.0) {
            Some(format!(
                "attention scale {} is not a finite positive number; use \
                 Attention::default_scale(d) = 1/√d unless the model says otherwise",
                self.scale
            ))
        } else {
            None
        };
        match reason {
            Some(reason) => Err(KernelError::InvalidShape { op, reason }),
            None => Ok(()),
        }
    }

    /// Elements of a q-shaped head-split operand (`batch·heads·t·d`; also out, dout, dq) and
    /// of a k-shaped one (`batch·kv_heads·t·d`; also v, dk, dv), or `None` on overflow.
    pub(crate) fn head_split_lens(&self) -> Option<(usize, usize)> {
        let td = self.t.checked_mul(self.d)?;
        let nq = self.batch.checked_mul(self.heads)?.checked_mul(td)?;
        let nkv = self.batch.checked_mul(self.kv_heads)?.checked_mul(td)?;
        Some((nq, nkv))
    }

    /// Elements of the packed qkv tensor, `batch·t·(heads + 2·kv_heads)·d`, or `None` on
    /// overflow.
    pub(crate) fn packed_len(&self) -> Option<usize> {
        let width = self.kv_heads.checked_mul(2)?.checked_add(self.heads)?;
        self.batch
            .checked_mul(self.t)?
            .checked_mul(width)?
            .checked_mul(self.d)
    }

    /// The shape arguments as `name=value` pairs for error messages (`kv_heads` and `scale`
    /// only where they differ from [`Attention::new`]'s).
    pub(crate) fn describe(&self) -> String {
        let mut s = format!(
            "batch={}, heads={}, t={}, d={}",
            self.batch, self.heads, self.t, self.d
        );
        if self.kv_heads != self.heads {
            s += &format!(", kv_heads={}", self.kv_heads);
        }
        if self.scale.to_bits() != Attention::default_scale(self.d).to_bits() {
            s += &format!(", scale={}", self.scale);
        }
        if self.layout != AttentionLayout::Heads {
            s += &format!(", {:?}", self.layout);
        }
        s
    }
}

/// The memory layout of causal attention's operands (the statistics are always
/// `[batch, heads, t(, t)]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionLayout {
    /// q, out, dout, dq: each its own contiguous `[batch, heads, t, d]` tensor; k, v, dk, dv:
    /// each its own `[batch, kv_heads, t, d]` tensor.
    #[default]
    Heads,
    /// The layout of a fused qkv projection, without head split/merge copies: q, k and v are
    /// each the *whole* `[batch, t, heads + 2·kv_heads, d]` tensor (the same operand three
    /// times; per position, the `heads` query rows, then the `kv_heads` key rows, then the
    /// `kv_heads` value rows, which is GPT's `[batch, t, 3, heads, d]` when `kv_heads ==
    /// heads`), out and dout are `[batch, t, heads, d]` (= `[batch, t, heads·d]`), and dq, dk,
    /// dv are each the whole `[batch, t, heads + 2·kv_heads, d]` gradient (the same operand
    /// three times; each slice is written by exactly one of them, so together they write every
    /// element).
    Packed,
}
