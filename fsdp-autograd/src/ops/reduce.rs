//! Reductions: sum and mean over all elements, and the broadcast-undoing `sum_to`.

use crate::autograd::{needs_grad, record1, single_grad};
use crate::error::{shape_err, Result};
use crate::kernels::elementwise::ScaleInplace;
use crate::kernels::layout::StridedCopy;
use crate::kernels::operand::contiguous_strides;
use crate::kernels::reduce::{ColSums, Sum, SumTo, SumToShape};
use crate::kernels::{Rows, View};
use crate::ops::Ctx;
use crate::tensor::{numel_of, Tensor};

/// A tensor of `shape` (dtype of `g`) filled with `g`'s single value times `factor`.
pub(crate) fn fill_like_scalar(g: &Tensor, shape: &[usize], factor: f32) -> Result<Tensor> {
    let ctx = Ctx::of(g);
    let out = ctx.empty(shape, g.dtype())?;
    let g = g.contig()?;
    let n = out.numel();
    if n == 0 {
        return Ok(out);
    }
    let ga = g.operand_on("sum_backward", &ctx.stream)?;
    let oa = out.operand_on("sum_backward", &ctx.stream)?;
    let k = ctx.k()?;
    // g's one value on every element (a stride-0 copy), then scaled: `g·factor` per element,
    // one rounding, as a fill with the product would give.
    let broadcast = View {
        shape: vec![n],
        strides: vec![0],
        offset: 0,
    };
    k.launch(
        &ctx.stream,
        &StridedCopy {
            src_view: &broadcast,
            src: &ga,
            dst_view: &View::contiguous(&[n], 0),
            dst: &oa,
        },
    )?;
    if factor != 1.0 {
        k.launch(
            &ctx.stream,
            &ScaleInplace {
                n,
                alpha: factor,
                y: &oa,
            },
        )?;
    }
    Ok(out)
}

fn reduce_all(t: &Tensor, op: &'static str, mean: bool) -> Result<Tensor> {
    t.check_float(op)?;
    let ctx = Ctx::of(t);
    let x = t.contig()?;
    let out = ctx.empty(&[], t.dtype())?;
    let (xa, oa) = (
        x.operand_on(op, &ctx.stream)?,
        out.operand_on(op, &ctx.stream)?,
    );
    let n = t.numel();
    ctx.k()?.launch(
        &ctx.stream,
        &Sum {
            n,
            mean,
            x: &xa,
            out: &oa,
        },
    )?;
    if !needs_grad(&[t]) {
        return Ok(out);
    }
    let shape = t.shape().to_vec();
    let factor = if mean { 1.0 / n as f32 } else { 1.0 };
    Ok(record1(op, &[t], out, move |g: Vec<Option<Tensor>>| {
        let g = single_grad(op, g);
        Ok(vec![Some(fill_like_scalar(&g, &shape, factor)?)])
    }))
}

impl Tensor {
    /// Sum of all elements (a 0-dimensional tensor of the same dtype).
    pub fn sum(&self) -> Result<Tensor> {
        reduce_all(self, "sum", false)
    }

    /// Mean of all elements (a 0-dimensional tensor of the same dtype).
    pub fn mean(&self) -> Result<Tensor> {
        reduce_all(self, "mean", true)
    }
}

/// Sums `g` down to `shape` (the inverse of broadcasting `shape` up to `g`'s shape). Returns
/// `g` itself when the shapes are equal. No autograd.
pub(crate) fn sum_to(g: &Tensor, shape: &[usize]) -> Result<Tensor> {
    if g.shape() == shape {
        return Ok(g.clone());
    }
    let gs = g.shape().to_vec();
    if shape.len() > gs.len() || numel_of(shape) == 0 {
        return Err(shape_err(
            "sum_to",
            format!("cannot reduce {gs:?} to {shape:?}"),
        ));
    }
    let lead = gs.len() - shape.len();
    // Strides into the target for each dimension of g (0 where the target broadcasts).
    let tcs = contiguous_strides(shape);
    let mut tstrides = vec![0usize; gs.len()];
    for (j, &n) in shape.iter().enumerate() {
        let i = lead + j;
        if n == gs[i] {
            tstrides[i] = tcs[j];
        } else if n != 1 {
            return Err(shape_err(
                "sum_to",
                format!("cannot reduce {gs:?} to {shape:?}"),
            ));
        }
    }
    let ctx = Ctx::of(g);
    let x = g.contig()?;
    let out = ctx.empty(shape, g.dtype())?;
    let (xa, oa) = (
        x.operand_on("sum_to", &ctx.stream)?,
        out.operand_on("sum_to", &ctx.stream)?,
    );
    let k = ctx.k()?;
    // Row broadcast (the common case: bias and positional-embedding gradients): column sums.
    let first = shape.iter().position(|&n| n != 1).unwrap_or(shape.len());
    let suffix = &shape[first..];
    if gs[gs.len() - suffix.len()..] == *suffix {
        let cols = numel_of(shape);
        let rows = Rows {
            rows: x.numel() / cols,
            cols,
        };
        k.launch(
            &ctx.stream,
            &ColSums {
                rows,
                x: &xa,
                out: &oa,
            },
        )?;
        return Ok(out);
    }
    let st = SumToShape {
        shape: gs,
        target_strides: tstrides,
        out_numel: numel_of(shape),
    };
    k.launch(
        &ctx.stream,
        &SumTo {
            shape: &st,
            x: &xa,
            out: &oa,
        },
    )?;
    Ok(out)
}
