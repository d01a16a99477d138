//! Element-wise operations: add/sub/mul with broadcasting, scale, GELU, dtype casts, and the
//! in-place updates (which bump the version counter).

use fsdp_alloc::DType;

use crate::autograd::{needs_grad, record1, single_grad, SavedTensor};
use crate::error::{shape_err, AutogradError, Result};
use crate::kernels::elementwise::{
    AxpyRows, Binary, BinaryOp, Cast, Fill, GeluBackward, GeluForward, Scale, ScaleInplace,
};
use crate::kernels::layout::StridedCopy;
use crate::kernels::{Gelu, Rows, View};
use crate::ops::reduce::sum_to;
use crate::ops::{check_pair, Ctx};
use crate::tensor::{numel_of, Tensor};

/// NumPy broadcasting of two shapes (aligned from the right; sizes equal or one of them 1).
pub(crate) fn broadcast_shape(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let nd = a.len().max(b.len());
    let mut out = vec![0; nd];
    for i in 0..nd {
        let x = if i + a.len() >= nd {
            a[i + a.len() - nd]
        } else {
            1
        };
        let y = if i + b.len() >= nd {
            b[i + b.len() - nd]
        } else {
            1
        };
        out[i] = match (x, y) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => {
                return Err(shape_err(
                    op,
                    format!("shapes {a:?} and {b:?} cannot be broadcast together"),
                ))
            }
        };
    }
    Ok(out)
}

/// True if `small` repeats over leading dimensions of `out` only (its shape, without leading
/// ones, is a suffix of `out`): then `out` is `rows × small.numel()` with `small` on every row.
fn is_row_broadcast(small: &[usize], out: &[usize]) -> bool {
    let first = small.iter().position(|&n| n != 1).unwrap_or(small.len());
    let s = &small[first..];
    s.len() <= out.len() && out[out.len() - s.len()..] == *s
}

#[derive(Clone, Copy, PartialEq)]
enum Bin {
    Add,
    Mul,
}

impl Bin {
    fn name(self) -> &'static str {
        match self {
            Bin::Add => "add",
            Bin::Mul => "mul",
        }
    }
    fn op(self) -> BinaryOp {
        match self {
            Bin::Add => BinaryOp::Add,
            Bin::Mul => BinaryOp::Mul,
        }
    }
}

/// `a op b` with broadcasting, no autograd.
fn binary_raw(op: Bin, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let name = op.name();
    check_pair(name, a, b)?;
    let out_shape = broadcast_shape(name, a.shape(), b.shape())?;
    let ctx = Ctx::of(a);
    // Put the full-size operand first (both ops are commutative).
    let (full, small) = if a.shape() == out_shape.as_slice() {
        (a, b)
    } else {
        (b, a)
    };
    let (full, small) = if full.shape() == out_shape.as_slice()
        && (small.shape() == out_shape.as_slice() || is_row_broadcast(small.shape(), &out_shape))
    {
        (full.contig()?, small.contig()?)
    } else {
        // General broadcast: materialize both operands at the output shape.
        (
            full.expand_raw(&out_shape)?.copy_raw(name)?,
            small.expand_raw(&out_shape)?.copy_raw(name)?,
        )
    };
    let out = ctx.empty(&out_shape, a.dtype())?;
    let (fa, sa, oa) = (
        full.operand_on(name, &ctx.stream)?,
        small.operand_on(name, &ctx.stream)?,
        out.operand_on(name, &ctx.stream)?,
    );
    let (n, cols) = (full.numel(), small.numel());
    if n == 0 {
        return Ok(out);
    }
    // `small` is either full-size (one row of n) or one row repeated over the leading dims.
    let rows = if cols == n {
        Rows { rows: 1, cols: n }
    } else {
        Rows {
            rows: n / cols,
            cols,
        }
    };
    ctx.k()?.launch(
        &ctx.stream,
        &Binary {
            op: op.op(),
            rows,
            a: &fa,
            b: &sa,
            out: &oa,
        },
    )?;
    Ok(out)
}

impl Tensor {
    /// `self + other` with NumPy broadcasting (same dtype).
    pub fn add(&self, other: &Tensor) -> Result<Tensor> {
        let out = binary_raw(Bin::Add, self, other)?;
        if !needs_grad(&[self, other]) {
            return Ok(out);
        }
        let (sa, sb) = (self.shape().to_vec(), other.shape().to_vec());
        let (na, nb) = (self.requires_grad(), other.requires_grad());
        Ok(record1(
            "add",
            &[self, other],
            out,
            move |g: Vec<Option<Tensor>>| {
                let g = single_grad("add", g);
                let ga = if na { Some(sum_to(&g, &sa)?) } else { None };
                let gb = if nb { Some(sum_to(&g, &sb)?) } else { None };
                Ok(vec![ga, gb])
            },
        ))
    }

    /// `self − other` with broadcasting.
    pub fn sub(&self, other: &Tensor) -> Result<Tensor> {
        self.add(&other.scale(-1.0)?)
    }

    /// `self · other` element-wise with NumPy broadcasting (same dtype).
    pub fn mul(&self, other: &Tensor) -> Result<Tensor> {
        let out = binary_raw(Bin::Mul, self, other)?;
        if !needs_grad(&[self, other]) {
            return Ok(out);
        }
        let (sa, sb) = (self.shape().to_vec(), other.shape().to_vec());
        let (na, nb) = (self.requires_grad(), other.requires_grad());
        let (mut a, mut b) = (SavedTensor::new(self), SavedTensor::new(other));
        Ok(record1(
            "mul",
            &[self, other],
            out,
            move |g: Vec<Option<Tensor>>| {
                let g = single_grad("mul", g);
                let (a, b) = (a.unpack("mul")?, b.unpack("mul")?);
                let ga = if na {
                    Some(sum_to(&g.mul(&b)?, &sa)?)
                } else {
                    None
                };
                let gb = if nb {
                    Some(sum_to(&g.mul(&a)?, &sb)?)
                } else {
                    None
                };
                Ok(vec![ga, gb])
            },
        ))
    }

    /// `s · self`.
    pub fn scale(&self, s: f32) -> Result<Tensor> {
        self.check_float("scale")?;
        let ctx = Ctx::of(self);
        let x = self.contig()?;
        let out = ctx.empty(self.shape(), self.dtype())?;
        let (xa, oa) = (
            x.operand_on("scale", &ctx.stream)?,
            out.operand_on("scale", &ctx.stream)?,
        );
        ctx.k()?.launch(
            &ctx.stream,
            &Scale {
                n: x.numel(),
                alpha: s,
                x: &xa,
                out: &oa,
            },
        )?;
        if !needs_grad(&[self]) {
            return Ok(out);
        }
        Ok(record1(
            "scale",
            &[self],
            out,
            move |g: Vec<Option<Tensor>>| {
                Ok(vec![g[0].as_ref().map(|g| g.scale(s)).transpose()?])
            },
        ))
    }

    /// GELU, tanh approximation (as GPT-2; PyTorch's `gelu(x, approximate="tanh")`).
    pub fn gelu(&self) -> Result<Tensor> {
        self.gelu_with(Gelu::Tanh)
    }

    /// GELU, exact (erf) form (PyTorch's default `gelu(x)`).
    pub fn gelu_exact(&self) -> Result<Tensor> {
        self.gelu_with(Gelu::Exact)
    }

    /// GELU of the given kind, with its backward.
    pub fn gelu_with(&self, kind: Gelu) -> Result<Tensor> {
        self.check_float("gelu")?;
        let ctx = Ctx::of(self);
        let x = self.contig()?;
        let out = ctx.empty(self.shape(), self.dtype())?;
        let (xa, oa) = (
            x.operand_on("gelu", &ctx.stream)?,
            out.operand_on("gelu", &ctx.stream)?,
        );
        ctx.k()?.launch(
            &ctx.stream,
            &GeluForward {
                kind,
                n: x.numel(),
                x: &xa,
                y: &oa,
            },
        )?;
        if !needs_grad(&[self]) {
            return Ok(out);
        }
        let mut saved = SavedTensor::new(&x);
        Ok(record1(
            "gelu",
            &[self],
            out,
            move |g: Vec<Option<Tensor>>| {
                let g = single_grad("gelu", g);
                let x = saved.unpack("gelu")?;
                let g = g.contig()?;
                let ctx = Ctx::of(&x);
                let dx = ctx.empty(x.shape(), x.dtype())?;
                let op = "gelu_backward";
                let (xa, ga, da) = (
                    x.operand_on(op, &ctx.stream)?,
                    g.operand_on(op, &ctx.stream)?,
                    dx.operand_on(op, &ctx.stream)?,
                );
                ctx.k()?.launch(
                    &ctx.stream,
                    &GeluBackward {
                        kind,
                        n: x.numel(),
                        x: &xa,
                        dy: &ga,
                        dx: &da,
                    },
                )?;
                Ok(vec![Some(dx)])
            },
        ))
    }

    /// Converts between floating-point dtypes (`f32`, `f16`, `bf16`; round to nearest even).
    /// Returns `self` when the dtype already matches. Backward casts the gradient back.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        self.check_float("to_dtype")?;
        if !dtype.is_float() {
            return Err(AutogradError::DType {
                op: "to_dtype",
                got: dtype,
                expected: "a float target dtype (f32, f16 or bf16)".into(),
            });
        }
        let ctx = Ctx::of(self);
        let x = self.contig()?;
        let out = ctx.empty(self.shape(), dtype)?;
        let (xa, oa) = (
            x.operand_on("cast", &ctx.stream)?,
            out.operand_on("cast", &ctx.stream)?,
        );
        ctx.k()?.launch(
            &ctx.stream,
            &Cast {
                n: x.numel(),
                x: &xa,
                out: &oa,
            },
        )?;
        if !needs_grad(&[self]) {
            return Ok(out);
        }
        let from = self.dtype();
        Ok(record1(
            "cast",
            &[self],
            out,
            move |g: Vec<Option<Tensor>>| {
                Ok(vec![g[0].as_ref().map(|g| g.to_dtype(from)).transpose()?])
            },
        ))
    }

    // ------------------------------------------------------------------ in-place

    /// `self += other` in place (`other` equal in shape or broadcast over leading dimensions;
    /// same dtype). Bumps the version counter.
    ///
    /// # Errors
    /// [`AutogradError::InPlaceOnGradTensor`] if `self` requires grad while grad mode is on;
    /// shape/dtype/device errors; [`AutogradError::StorageReleased`].
    pub fn add_(&self, other: &Tensor) -> Result<()> {
        self.add_scaled_inner(other, 1.0, "add_")
    }

    /// `self += alpha · other` in place (same shape and dtype, or `other` broadcast over leading
    /// dimensions). Bumps the version counter.
    pub fn add_scaled_(&self, other: &Tensor, alpha: f32) -> Result<()> {
        self.add_scaled_inner(other, alpha, "add_scaled_")
    }

    fn add_scaled_inner(&self, other: &Tensor, alpha: f32, op: &'static str) -> Result<()> {
        self.check_inplace(op)?;
        check_pair(op, self, other)?;
        let dst = self.inplace_dst(op)?;
        if other.shape() != self.shape() && !is_row_broadcast(other.shape(), self.shape()) {
            return Err(shape_err(
                op,
                format!(
                    "cannot add shape {:?} into shape {:?} in place",
                    other.shape(),
                    self.shape()
                ),
            ));
        }
        let ctx = Ctx::of(self);
        let mut src = other.contig()?;
        let mut sa = src.operand_on(op, &ctx.stream)?;
        let da = dst.operand_on(op, &ctx.stream)?;
        if sa.buf.overlaps(&da.buf) {
            src = src.copy_raw(op)?;
            sa = src.operand_on(op, &ctx.stream)?;
        }
        let cols = src.numel();
        if cols > 0 && dst.numel() > 0 {
            let rows = Rows {
                rows: dst.numel() / cols,
                cols,
            };
            ctx.k()?.launch(
                &ctx.stream,
                &AxpyRows {
                    rows,
                    alpha,
                    x: &sa,
                    y: &da,
                },
            )?;
        }
        self.storage().bump_version();
        Ok(())
    }

    /// `self *= s` in place. Bumps the version counter.
    pub fn scale_(&self, s: f32) -> Result<()> {
        self.check_inplace("scale_")?;
        self.check_float("scale_")?;
        let dst = self.inplace_dst("scale_")?;
        let ctx = Ctx::of(self);
        let da = dst.operand_on("scale_", &ctx.stream)?;
        ctx.k()?.launch(
            &ctx.stream,
            &ScaleInplace {
                n: dst.numel(),
                alpha: s,
                y: &da,
            },
        )?;
        self.storage().bump_version();
        Ok(())
    }

    /// Sets every element to `value` in place. Bumps the version counter.
    pub fn fill_(&self, value: f64) -> Result<()> {
        self.check_inplace("fill_")?;
        let dst = self.inplace_dst("fill_")?;
        let ctx = Ctx::of(self);
        let da = dst.operand_on("fill_", &ctx.stream)?;
        ctx.k()?.launch(
            &ctx.stream,
            &Fill {
                n: dst.numel(),
                value,
                out: &da,
            },
        )?;
        self.storage().bump_version();
        Ok(())
    }

    /// Sets every element to zero in place. Bumps the version counter.
    pub fn zero_(&self) -> Result<()> {
        self.fill_(0.0)
    }

    /// Copies `src` (same shape; any layout; any float dtype, converted) into `self` in place.
    /// Bumps the version counter.
    pub fn copy_(&self, src: &Tensor) -> Result<()> {
        self.check_inplace("copy_")?;
        self.check_same_device(src, "copy_")?;
        if src.shape() != self.shape() {
            return Err(shape_err(
                "copy_",
                format!(
                    "source shape {:?}, destination {:?}",
                    src.shape(),
                    self.shape()
                ),
            ));
        }
        let dst = self.inplace_dst("copy_")?;
        let ctx = Ctx::of(self);
        let src = if src.dtype() == self.dtype() {
            src.clone()
        } else {
            src.to_dtype(self.dtype())?
        };
        let mut src = src.contig()?;
        let mut sa = src.operand_on("copy_", &ctx.stream)?;
        let da = dst.operand_on("copy_", &ctx.stream)?;
        if sa.buf.overlaps(&da.buf) {
            src = src.copy_raw("copy_")?;
            sa = src.operand_on("copy_", &ctx.stream)?;
        }
        let n = numel_of(self.shape());
        let v = View::contiguous(&[n], 0);
        ctx.k()?.launch(
            &ctx.stream,
            &StridedCopy {
                src_view: &v,
                src: &sa,
                dst_view: &v,
                dst: &da,
            },
        )?;
        self.storage().bump_version();
        Ok(())
    }

    /// In-place destinations must be contiguous (views of a contiguous range).
    fn inplace_dst(&self, op: &'static str) -> Result<&Tensor> {
        if !self.is_contiguous() {
            return Err(shape_err(
                op,
                format!(
                    "in-place ops need a contiguous destination (shape {:?}, strides {:?})",
                    self.shape(),
                    self.strides()
                ),
            ));
        }
        Ok(self)
    }
}
