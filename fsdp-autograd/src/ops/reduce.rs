//! Reductions: sum and mean over all elements, and the broadcast-undoing `sum_to`.

use crate::autograd::{needs_grad, record1};
use crate::error::{shape_err, Result};
use crate::launch::{contiguous_strides, fail, launch, Arg};
use crate::ops::{kern, Ctx};
use crate::tensor::{numel_of, Tensor};

/// A tensor of `shape` (dtype of `g`) filled with `g`'s single value times `factor`.
pub(crate) fn fill_like_scalar(g: &Tensor, shape: &[usize], factor: f32) -> Result<Tensor> {
    let ctx = Ctx::of(g);
    let out = ctx.empty(shape, g.dtype())?;
    let ga = g.contig()?.arg("sum_backward", &ctx.stream)?;
    let oa = out.arg("sum_backward", &ctx.stream)?;
    launch(&ctx.stream, "sum_backward", move || {
        let v = ga.f32("sum_backward", |g| g[0]) * factor;
        oa.f32_mut("sum_backward", false, |o| o.fill(v))
    });
    Ok(out)
}

fn reduce_all(t: &Tensor, op: &'static str, mean: bool) -> Result<Tensor> {
    t.check_float(op)?;
    let ctx = Ctx::of(t);
    let x = t.contig()?;
    let out = ctx.empty(&[], t.dtype())?;
    let (xa, oa) = (x.arg(op, &ctx.stream)?, out.arg(op, &ctx.stream)?);
    let n = t.numel();
    launch(&ctx.stream, op, move || {
        let s = xa.f32(op, kern::sum);
        let v = if mean { s / n as f32 } else { s };
        oa.f32_mut(op, false, |o| o[0] = v)
    });
    if !needs_grad(&[t]) {
        return Ok(out);
    }
    let shape = t.shape().to_vec();
    let factor = if mean { 1.0 / n as f32 } else { 1.0 };
    Ok(record1(op, &[t], out, move |g: Vec<Option<Tensor>>| {
        let g = g.into_iter().next().flatten().expect("one gradient");
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
        x.arg("sum_to", &ctx.stream)?,
        out.arg("sum_to", &ctx.stream)?,
    );
    // Row broadcast (the common case: bias and positional-embedding gradients): column sums.
    let first = shape.iter().position(|&n| n != 1).unwrap_or(shape.len());
    let suffix = &shape[first..];
    if gs[gs.len() - suffix.len()..] == *suffix {
        launch(&ctx.stream, "col_sums", move || {
            xa.f32("sum_to", |x| {
                oa.f32_mut("sum_to", false, |o| {
                    kern::col_sums(x, o).unwrap_or_else(|e| fail("sum_to", e))
                })
            })
        });
        return Ok(out);
    }
    launch(&ctx.stream, "sum_to", move || {
        general_sum_to(&xa, &oa, &gs, &tstrides)
    });
    Ok(out)
}

fn general_sum_to(xa: &Arg, oa: &Arg, gs: &[usize], tstrides: &[usize]) {
    xa.f32("sum_to", |x| {
        oa.f32_mut("sum_to", false, |o| {
            o.fill(0.0);
            let nd = gs.len();
            let mut idx = vec![0usize; nd];
            let mut t = 0usize;
            for &v in x {
                o[t] += v;
                // odometer over g's index space
                let mut d = nd;
                while d > 0 {
                    d -= 1;
                    idx[d] += 1;
                    t += tstrides[d];
                    if idx[d] < gs[d] {
                        break;
                    }
                    t -= tstrides[d] * gs[d];
                    idx[d] = 0;
                }
            }
        })
    })
}
