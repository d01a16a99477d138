//! SiLU·mul, differentiable ([`silu_mul`], [`Tensor::silu_mul`]): the gate of a SwiGLU
//! feed-forward (`nn::LlamaMlp`), one fused kernel (`kernels/elementwise/silu_mul.rs`).

use crate::autograd::{needs_grad, record1, single_grad, SavedTensor};
use crate::error::{shape_err, Result};
use crate::kernels::elementwise::{SiluMul, SiluMulBackward};
use crate::ops::{check_pair, Ctx};
use crate::tensor::Tensor;

/// `silu(gate) · up` elementwise, `silu(g) = g / (1 + e^(−g))` (transformers' Llama MLP:
/// `act_fn(gate_proj(x)) * up_proj(x)`), in one kernel: no SiLU tensor is materialized, in
/// forward or backward. `gate` and `up` have the same shape and float dtype; computed in `f32`,
/// rounded once. Differentiable in both (the backward recomputes the sigmoid from the saved
/// inputs).
///
/// # Errors
/// Different shapes, dtypes or devices; a non-float dtype.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let op = "silu_mul";
    check_pair(op, gate, up)?;
    if gate.shape() != up.shape() {
        return Err(shape_err(
            op,
            format!(
                "gate {:?} and up {:?} must have the same shape",
                gate.shape(),
                up.shape()
            ),
        ));
    }
    let ctx = Ctx::of(gate);
    let st = &ctx.stream;
    let (gc, uc) = (gate.contig()?, up.contig()?);
    let y = ctx.empty(gate.shape(), gate.dtype())?;
    let n = gate.numel();
    let (ga, ua, ya) = (
        gc.operand_on(op, st)?,
        uc.operand_on(op, st)?,
        y.operand_on(op, st)?,
    );
    let fwd = SiluMul {
        n,
        gate: &ga,
        up: &ua,
        y: &ya,
    };
    ctx.k()?.launch(st, &fwd)?;
    if !needs_grad(&[gate, up]) {
        return Ok(y);
    }
    let needs = [gate.requires_grad(), up.requires_grad()];
    let (mut sg, mut su) = (SavedTensor::new(&gc), SavedTensor::new(&uc));
    Ok(record1(
        op,
        &[gate, up],
        y,
        move |g: Vec<Option<Tensor>>| {
            let dy = single_grad("silu_mul", g).contig()?;
            let op = "silu_mul_backward";
            let (gate, up) = (sg.unpack(op)?, su.unpack(op)?);
            let ctx = Ctx::of(&dy);
            let st = &ctx.stream;
            let dg = ctx.empty(gate.shape(), gate.dtype())?;
            let du = ctx.empty(gate.shape(), gate.dtype())?;
            let (ga, ua, ya, dga, dua) = (
                gate.operand_on(op, st)?,
                up.operand_on(op, st)?,
                dy.operand_on(op, st)?,
                dg.operand_on(op, st)?,
                du.operand_on(op, st)?,
            );
            let bwd = SiluMulBackward {
                n,
                gate: &ga,
                up: &ua,
                dy: &ya,
                dgate: &dga,
                dup: &dua,
            };
            ctx.k()?.launch(st, &bwd)?;
            Ok(vec![needs[0].then_some(dg), needs[1].then_some(du)])
        },
    ))
}

impl Tensor {
    /// `silu(self) · up` in one kernel (`self` is the gate): see [`silu_mul`].
    ///
    /// ```
    /// use fsdp_alloc::Device;
    /// use fsdp_autograd::Tensor;
    ///
    /// let dev = Device::cpu(0);
    /// let gate = Tensor::from_vec(vec![0.0f32, 2.0], &[2], &dev)?;
    /// let up = Tensor::from_vec(vec![5.0f32, 3.0], &[2], &dev)?;
    /// let y = gate.silu_mul(&up)?.to_vec::<f32>()?;
    /// let silu2 = 2.0 / (1.0 + (-2.0f32).exp());
    /// assert_eq!(y, vec![0.0, silu2 * 3.0]);
    /// # Ok::<(), fsdp_autograd::AutogradError>(())
    /// ```
    ///
    /// # Errors
    /// As [`silu_mul`].
    pub fn silu_mul(&self, up: &Tensor) -> Result<Tensor> {
        silu_mul(self, up)
    }
}
