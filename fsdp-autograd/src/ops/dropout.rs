//! Dropout with a counter-based mask ([`dropout`], [`Tensor::dropout`]): the mask is a function
//! of the key, the site, the sample and the element (see [`crate::kernels::dropout`]), so the
//! backward recomputes it instead of saving it.

use crate::autograd::{needs_grad, record1, single_grad};
use crate::error::{shape_err, AutogradError, Result};
use crate::kernels::dropout::{Dropout, DropoutKey, DropoutMask};
use crate::kernels::Rows;
use crate::ops::Ctx;
use crate::tensor::Tensor;

/// `x · m` through the seam (no autograd): `x` is `[samples, ..]`, row `r` sample
/// `mask.key.sample + r`.
fn dropout_raw(x: &Tensor, mask: DropoutMask) -> Result<Tensor> {
    let op = "dropout";
    let ctx = Ctx::of(x);
    let xc = x.contig()?;
    let y = ctx.empty(x.shape(), x.dtype())?;
    let rows = x.shape()[0];
    let cols = x.numel() / rows;
    let (xa, ya) = (
        xc.operand_on(op, &ctx.stream)?,
        y.operand_on(op, &ctx.stream)?,
    );
    ctx.k()?.launch(
        &ctx.stream,
        &Dropout {
            rows: Rows { rows, cols },
            mask,
            x: &xa,
            y: &ya,
        },
    )?;
    Ok(y)
}

/// Dropout of `x` (`[samples, ..]`, float): each element kept with probability `1 − p` and
/// scaled by `1/(1 − p)`, or zeroed. The mask is drawn from `key` (seed, step, the global index
/// of `x`'s first sample; row `r` of `x` is sample `key.sample + r`), `site` (which dropout of
/// the model this is) and the element's index inside its sample, never stored: the backward
/// (`dx = dy · m`) draws it again, so a sample gets the same mask on whichever rank, micro-batch
/// or recomputation it is processed. `p = 0` returns `x` itself.
///
/// ```
/// use fsdp_alloc::Device;
/// use fsdp_autograd::kernels::dropout::DropoutKey;
/// use fsdp_autograd::{dropout, Tensor};
///
/// let dev = Device::cpu(0);
/// let x = Tensor::from_vec(vec![1.0f32; 8], &[2, 4], &dev)?;
/// let key = DropoutKey { seed: 0, step: 0, sample: 0 };
/// let y = dropout(&x, 0.5, key, 0)?.to_vec::<f32>()?;
/// assert!(y.iter().all(|&v| v == 0.0 || v == 2.0));
/// # Ok::<(), fsdp_autograd::AutogradError>(())
/// ```
///
/// # Errors
/// `p` outside `[0, 1)`; a 0-dimensional or non-float `x`; more than 2³⁴ elements a sample.
pub fn dropout(x: &Tensor, p: f32, key: DropoutKey, site: u32) -> Result<Tensor> {
    let op = "dropout";
    x.check_float(op)?;
    if x.dim() == 0 {
        return Err(shape_err(
            op,
            "needs a leading sample dimension, got a 0-dimensional tensor",
        ));
    }
    if !(0.0..1.0).contains(&p) {
        return Err(AutogradError::Argument {
            op,
            detail: format!("drop probability {p} is not in [0, 1)"),
        });
    }
    let mask = DropoutMask { p, key, site };
    if p == 0.0 || x.numel() == 0 {
        return Ok(x.clone());
    }
    let y = dropout_raw(x, mask)?;
    if !needs_grad(&[x]) {
        return Ok(y);
    }
    Ok(record1(op, &[x], y, move |g: Vec<Option<Tensor>>| {
        let g = single_grad(op, g);
        Ok(vec![Some(dropout_raw(&g, mask)?)])
    }))
}

impl Tensor {
    /// [`dropout`] of `self`.
    ///
    /// # Errors
    /// As [`dropout`].
    pub fn dropout(&self, p: f32, key: DropoutKey, site: u32) -> Result<Tensor> {
        dropout(self, p, key, site)
    }
}
