//! Rotary position embedding, differentiable ([`rope`], [`Tensor::rope`]): the op behind
//! Llama's attention (`nn::LlamaAttention`), over the kernels of `kernels/rope.rs`.

use fsdp_alloc::DType;

use crate::autograd::{needs_grad, record1, single_grad};
use crate::error::{shape_err, AutogradError, Result};
use crate::kernels::rope::{Rope, RopeBackward, RopeShape};
use crate::ops::Ctx;
use crate::tensor::Tensor;

/// Rotary position embedding of `x` (`[batch, t, heads, d]`, float, `d` even) at positions
/// `pos0 .. pos0 + t`, in transformers' `rotate_half` convention: with `x₁`, `x₂` a head's two
/// halves and the tables' row `p = pos0 + t`, `y₁ = x₁·cos − x₂·sin`, `y₂ = x₂·cos + x₁·sin`.
/// `cos` and `sin` are `[rows, d/2]` `f32` tables (row `p`: `cos(p·θ_j)`, see
/// `nn::RotaryTables`), constants (not differentiated). Returns `[batch, heads, t, d]`, the
/// attention's layout: the head split is done by the same kernel, no copy besides. Computed in
/// `f32` and rounded once to `x`'s dtype; the CPU and CUDA kernels agree bit for bit in f32.
/// Differentiable in `x` (the backward rotates back into `[batch, t, heads, d]`).
///
/// # Errors
/// `x` not 4-D or of an odd last dimension, tables of another shape, dtype (not `f32`) or
/// device, positions past the tables, a non-float `x`.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, pos0: usize) -> Result<Tensor> {
    let op = "rope";
    x.check_float(op)?;
    x.check_same_device(cos, op)?;
    x.check_same_device(sin, op)?;
    let [b, t, h, d] = match *x.shape() {
        [b, t, h, d] => [b, t, h, d],
        _ => {
            return Err(shape_err(
                op,
                format!("x must be [batch, t, heads, head_dim], got {:?}", x.shape()),
            ))
        }
    };
    for (name, tab) in [("cos", cos), ("sin", sin)] {
        if tab.dtype() != DType::F32 {
            return Err(AutogradError::DType {
                op,
                got: tab.dtype(),
                expected: format!("f32 (the `{name}` table)"),
            });
        }
        if tab.dim() != 2 || tab.shape()[1] * 2 != d || tab.shape() != cos.shape() {
            return Err(shape_err(
                op,
                format!(
                    "the tables must both be [positions, {}] for head_dim {d}; got cos {:?}, \
                     sin {:?}",
                    d / 2,
                    cos.shape(),
                    sin.shape()
                ),
            ));
        }
    }
    let s = RopeShape {
        batch: b,
        seq: t,
        heads: h,
        head_dim: d,
        pos0,
        table_rows: cos.shape()[0],
    };
    let ctx = Ctx::of(x);
    let st = &ctx.stream;
    let (xc, cc, sc) = (x.contig()?, cos.contig()?, sin.contig()?);
    let y = ctx.empty(&[b, h, t, d], x.dtype())?;
    let (xa, ca, sa, ya) = (
        xc.operand_on(op, st)?,
        cc.operand_on(op, st)?,
        sc.operand_on(op, st)?,
        y.operand_on(op, st)?,
    );
    let fwd = Rope {
        s,
        x: &xa,
        cos: &ca,
        sin: &sa,
        y: &ya,
    };
    ctx.k()?.launch(st, &fwd)?;
    if !needs_grad(&[x]) {
        return Ok(y);
    }
    Ok(record1(op, &[x], y, move |g: Vec<Option<Tensor>>| {
        let dy = single_grad("rope", g).contig()?;
        let op = "rope_backward";
        let ctx = Ctx::of(&dy);
        let st = &ctx.stream;
        let dx = ctx.empty(&[b, t, h, d], dy.dtype())?;
        let (ga, ca, sa, da) = (
            dy.operand_on(op, st)?,
            cc.operand_on(op, st)?,
            sc.operand_on(op, st)?,
            dx.operand_on(op, st)?,
        );
        let bwd = RopeBackward {
            s,
            dy: &ga,
            cos: &ca,
            sin: &sa,
            dx: &da,
        };
        ctx.k()?.launch(st, &bwd)?;
        Ok(vec![Some(dx)])
    }))
}

impl Tensor {
    /// Rotary position embedding of `self` (`[batch, t, heads, d]`) at positions
    /// `pos0 .. pos0 + t` with the `f32` tables `cos`/`sin` (`[rows, d/2]`), returned in the
    /// attention's layout `[batch, heads, t, d]`: see [`rope`].
    ///
    /// ```
    /// use fsdp_alloc::Device;
    /// use fsdp_autograd::Tensor;
    ///
    /// let dev = Device::cpu(0);
    /// // One head of d = 2 at position 1 with angle π/2: (x₁, x₂) → (−x₂, x₁).
    /// let x = Tensor::from_vec(vec![3.0f32, 4.0], &[1, 1, 1, 2], &dev)?;
    /// let cos = Tensor::from_vec(vec![1.0f32, 0.0], &[2, 1], &dev)?;
    /// let sin = Tensor::from_vec(vec![0.0f32, 1.0], &[2, 1], &dev)?;
    /// assert_eq!(x.rope(&cos, &sin, 1)?.to_vec::<f32>()?, vec![-4.0, 3.0]);
    /// # Ok::<(), fsdp_autograd::AutogradError>(())
    /// ```
    ///
    /// # Errors
    /// As [`rope`].
    pub fn rope(&self, cos: &Tensor, sin: &Tensor, pos0: usize) -> Result<Tensor> {
        rope(self, cos, sin, pos0)
    }
}
