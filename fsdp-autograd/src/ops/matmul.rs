//! Matrix products: `matmul` (2-D, batched, and batched × 2-D) and `linear` (x·Wᵀ + b).
//!
//! Operands that are transposed views of contiguous matrices (e.g. `w.t()`) are passed to the
//! kernel with a transpose flag instead of being copied.

use crate::autograd::{needs_grad, record1, single_grad, SavedTensor};
use crate::error::{shape_err, Result};
use crate::kernels::gemm::{Gemm, MatMul};
use crate::kernels::layout::StridedCopy;
use crate::kernels::{Operand, View};
use crate::ops::{check_pair, Ctx};
use crate::tensor::Tensor;

fn layout_is_contiguous(shape: &[usize], strides: &[usize]) -> bool {
    let mut expected = 1usize;
    for (&n, &s) in shape.iter().zip(strides).rev() {
        if n != 1 && s != expected {
            return false;
        }
        expected *= n;
    }
    true
}

/// True if the last two dimensions are a transposed view of contiguous memory.
fn is_transposed_contiguous(t: &Tensor) -> bool {
    let nd = t.dim();
    if nd < 2 {
        return false;
    }
    let mut shape = t.shape().to_vec();
    let mut strides = t.strides().to_vec();
    shape.swap(nd - 2, nd - 1);
    strides.swap(nd - 2, nd - 1);
    layout_is_contiguous(&shape, &strides)
}

/// The operand as stored for the kernel: (tensor, transposed?).
fn prep(t: &Tensor) -> Result<(Tensor, bool)> {
    if t.is_contiguous() {
        Ok((t.clone(), false))
    } else if is_transposed_contiguous(t) {
        Ok((t.clone(), true))
    } else {
        Ok((t.contig()?, false))
    }
}

/// One `matmul`/`bmm` launch: `c = op(a) · op(b)` per batch block.
#[allow(clippy::too_many_arguments)]
fn launch_mm(
    ctx: &Ctx,
    a: Operand,
    ta: bool,
    b: Operand,
    tb: bool,
    c: Operand,
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    let g = Gemm {
        batch,
        m,
        k,
        n,
        trans_a: ta,
        trans_b: tb,
        accumulate: false,
    };
    ctx.k()?.launch(
        &ctx.stream,
        &MatMul {
            g,
            a: &a,
            b: &b,
            c: &c,
        },
    )
}

impl Tensor {
    /// Matrix product over the last two dimensions: `[.., m, k] · [.., k, n] → [.., m, n]`
    /// with equal batch dimensions, or `[.., m, k] · [k, n]` (the batch folded into `m`).
    ///
    /// # Errors
    /// [`crate::AutogradError::Shape`] for 1-D operands, mismatched inner sizes or batch
    /// dimensions that are neither equal nor absent on the right.
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        check_pair("matmul", self, other)?;
        let (a, b) = (self, other);
        if a.dim() < 2 || b.dim() < 2 {
            return Err(shape_err(
                "matmul",
                format!(
                    "operands need at least 2 dimensions, got {:?} and {:?}",
                    a.shape(),
                    b.shape()
                ),
            ));
        }
        let (na, nb) = (a.dim(), b.dim());
        let (m, k) = (a.shape()[na - 2], a.shape()[na - 1]);
        let (k2, n) = (b.shape()[nb - 2], b.shape()[nb - 1]);
        let a_batch = &a.shape()[..na - 2];
        let b_batch = &b.shape()[..nb - 2];
        if k != k2 || !(b_batch.is_empty() || a_batch == b_batch) {
            return Err(shape_err(
                "matmul",
                format!("cannot multiply {:?} by {:?}", a.shape(), b.shape()),
            ));
        }
        let batch: usize = a_batch.iter().product();
        let fold = b_batch.is_empty() && batch > 1;
        let (pa, ta) = prep(a)?;
        let (pa, ta) = if fold && ta {
            (pa.contig()?, false) // folding rows needs a non-transposed layout
        } else {
            (pa, ta)
        };
        let (pb, tb) = prep(b)?;
        let mut out_shape = a_batch.to_vec();
        out_shape.extend([m, n]);
        let ctx = Ctx::of(a);
        let out = ctx.empty(&out_shape, a.dtype())?;
        // Folded: one product with batch·m rows.
        let (kb, km) = if fold { (1, batch * m) } else { (batch, m) };
        launch_mm(
            &ctx,
            pa.span_operand("matmul", &ctx.stream)?,
            ta,
            pb.span_operand("matmul", &ctx.stream)?,
            tb,
            out.operand_on("matmul", &ctx.stream)?,
            kb.max(1),
            km,
            k,
            n,
        )?;
        if !needs_grad(&[a, b]) {
            return Ok(out);
        }
        let (ga_needed, gb_needed) = (a.requires_grad(), b.requires_grad());
        let (mut sa, mut sb) = (SavedTensor::new(&pa), SavedTensor::new(&pb));
        let (a_shape, b_shape) = (a.shape().to_vec(), b.shape().to_vec());
        Ok(record1(
            "matmul",
            &[a, b],
            out,
            move |g: Vec<Option<Tensor>>| {
                let g = single_grad("matmul", g);
                let g = g.contig()?;
                let (pa, pb) = (sa.unpack("matmul")?, sb.unpack("matmul")?);
                let ctx = Ctx::of(&g);
                let s = &ctx.stream;
                let bs = kb.max(1);
                let da = if ga_needed {
                    // dA = dC · Bᵀ  (per block: km×n · n×k)
                    let da = ctx.empty(&a_shape, g.dtype())?;
                    launch_mm(
                        &ctx,
                        g.operand_on("matmul", s)?,
                        false,
                        pb.span_operand("matmul", s)?,
                        !tb,
                        da.operand_on("matmul", s)?,
                        if fold { 1 } else { bs },
                        km,
                        n,
                        k,
                    )?;
                    Some(da)
                } else {
                    None
                };
                let db = if gb_needed {
                    // dB = Aᵀ · dC  (per block: k×km · km×n); folded: summed over the batch.
                    let db = ctx.empty(&b_shape, g.dtype())?;
                    launch_mm(
                        &ctx,
                        pa.span_operand("matmul", s)?,
                        !ta,
                        g.operand_on("matmul", s)?,
                        false,
                        db.operand_on("matmul", s)?,
                        if fold { 1 } else { bs },
                        k,
                        km,
                        n,
                    )?;
                    Some(db)
                } else {
                    None
                };
                Ok(vec![da, db])
            },
        ))
    }
}

/// `x · Wᵀ + b`: `x` `[.., in]`, `weight` `[out, in]`, `bias` `[out]` → `[.., out]` (PyTorch's
/// `nn.functional.linear`). The bias is written first and the product accumulated onto it (one
/// pass). Backward: `dx = dy·W`, `dW = dyᵀ·x`, `db = Σ_rows dy`, each only if needed.
///
/// ```
/// use fsdp_alloc::Device;
/// use fsdp_autograd::{linear, Tensor};
///
/// let dev = Device::cpu(0);
/// let x = Tensor::from_vec(vec![1.0f32, 2.0], &[1, 2], &dev)?;
/// let w = Tensor::from_vec(vec![1.0f32, 0.0, 0.0, 1.0, 1.0, 1.0], &[3, 2], &dev)?;
/// let b = Tensor::from_vec(vec![0.5f32, 0.5, 0.5], &[3], &dev)?;
/// assert_eq!(linear(&x, &w, Some(&b))?.to_vec::<f32>()?, vec![1.5, 2.5, 3.5]);
/// # Ok::<(), fsdp_autograd::AutogradError>(())
/// ```
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    check_pair("linear", x, weight)?;
    if let Some(b) = bias {
        check_pair("linear", x, b)?;
    }
    let in_f = *x.shape().last().unwrap_or(&0);
    if x.dim() == 0 || weight.dim() != 2 || weight.shape()[1] != in_f {
        return Err(shape_err(
            "linear",
            format!(
                "input {:?} and weight {:?} (expected [out, {in_f}])",
                x.shape(),
                weight.shape()
            ),
        ));
    }
    let out_f = weight.shape()[0];
    if let Some(b) = bias {
        if b.shape() != [out_f] {
            return Err(shape_err(
                "linear",
                format!("bias {:?}, expected [{out_f}]", b.shape()),
            ));
        }
    }
    let ctx = Ctx::of(x);
    let xc = x.contig()?;
    let rows = x.numel().checked_div(in_f).unwrap_or(0);
    // W stored as [out, in] (contiguous) → trans_b; stored as [in, out] (w = v.t()) → no trans.
    let (pw, w_t) = prep(weight)?;
    let w_rows_out = !w_t;
    let bc = bias.map(Tensor::contig).transpose()?;
    let mut out_shape = x.shape().to_vec();
    *out_shape.last_mut().expect("x has a dimension") = out_f;
    let out = ctx.empty(&out_shape, x.dtype())?;
    {
        let s = &ctx.stream;
        let k = ctx.k()?;
        let (xa, wa, oa) = (
            xc.operand_on("linear", s)?,
            pw.span_operand("linear", s)?,
            out.operand_on("linear", s)?,
        );
        if let Some(b) = &bc {
            // The bias on every row (a stride-0 copy), then the product accumulated onto it.
            let rows_view = View {
                shape: vec![rows, out_f],
                strides: vec![0, 1],
                offset: 0,
            };
            let ba = b.operand_on("linear", s)?;
            k.launch(
                s,
                &StridedCopy {
                    src_view: &rows_view,
                    src: &ba,
                    dst_view: &View::contiguous(&[rows, out_f], 0),
                    dst: &oa,
                },
            )?;
        }
        let g = Gemm {
            batch: 1,
            m: rows,
            k: in_f,
            n: out_f,
            trans_a: false,
            trans_b: w_rows_out,
            accumulate: bc.is_some(),
        };
        k.launch(
            s,
            &MatMul {
                g,
                a: &xa,
                b: &wa,
                c: &oa,
            },
        )?;
    }
    let inputs: Vec<&Tensor> = match bias {
        Some(b) => vec![x, weight, b],
        None => vec![x, weight],
    };
    if !needs_grad(&inputs) {
        return Ok(out);
    }
    let needs: Vec<bool> = inputs.iter().map(|t| t.requires_grad()).collect();
    let (mut sx, mut sw) = (SavedTensor::new(&xc), SavedTensor::new(&pw));
    let (x_shape, w_shape) = (x.shape().to_vec(), weight.shape().to_vec());
    let has_bias = bias.is_some();
    Ok(record1(
        "linear",
        &inputs,
        out,
        move |g: Vec<Option<Tensor>>| {
            let g = single_grad("linear", g);
            let g = g.contig()?;
            let (xc, pw) = (sx.unpack("linear")?, sw.unpack("linear")?);
            let ctx = Ctx::of(&g);
            let s = &ctx.stream;
            let mut grads = Vec::with_capacity(3);
            grads.push(if needs[0] {
                // dx [rows, in] = dy [rows, out] · W [out, in]
                let dx = ctx.empty(&x_shape, g.dtype())?;
                launch_mm(
                    &ctx,
                    g.operand_on("linear", s)?,
                    false,
                    pw.span_operand("linear", s)?,
                    !w_rows_out,
                    dx.operand_on("linear", s)?,
                    1,
                    rows,
                    out_f,
                    in_f,
                )?;
                Some(dx)
            } else {
                None
            });
            grads.push(if needs[1] {
                // dW [out, in] = dyᵀ [out, rows] · x [rows, in]
                let dw = ctx.empty(&w_shape, g.dtype())?;
                launch_mm(
                    &ctx,
                    g.operand_on("linear", s)?,
                    true,
                    xc.operand_on("linear", s)?,
                    false,
                    dw.operand_on("linear", s)?,
                    1,
                    out_f,
                    rows,
                    in_f,
                )?;
                Some(dw)
            } else {
                None
            });
            if has_bias {
                grads.push(if needs[2] {
                    Some(crate::ops::reduce::sum_to(&g, &[out_f])?)
                } else {
                    None
                });
            }
            Ok(grads)
        },
    ))
}
