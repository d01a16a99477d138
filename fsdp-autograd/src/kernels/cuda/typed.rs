//! Typed kernels: add, axpy, row bias, column sums, GELU and layer norm with each float operand
//! in `f32`, `f16` or `bf16` (`*_t` in `kernels.cu`). Half values are widened exactly on load,
//! computed in f32 by the f32 kernels' own expressions and rounded once on store, so a result is
//! bit for bit what the cast-around path gives (cast the half operands to f32 temporaries, run
//! the f32 kernel, cast the outputs back) without the temporaries, the casts' launches and their
//! memory traffic. [`CudaBackend`](super::CudaBackend) uses them for launches with a half
//! operand; all-f32 launches keep the f32 kernels.

use fsdp_alloc::{BufferRef, DType, Stream};

use super::context::{expect_len, grid_for, grid_rows, rows_of, Call, CudaKernels, Dev, Elem};
use super::elementwise::{grid_col_groups, sum_parts};
use super::error::Result;
use super::plan::{PArg, Plan, Ptr};
use super::program::Kernel;
use crate::kernels::{Gelu, KernelError};

/// A buffer with the element type it holds.
pub(crate) type TBuf<'a> = (&'a BufferRef, DType);

/// The element code of `dtype` in a typed kernel's `types` word (`TY_*` in `kernels.cu`), or
/// `None` for a dtype the typed kernels do not take.
pub(crate) fn type_code(dtype: DType) -> Option<u64> {
    match dtype {
        DType::F32 => Some(0),
        DType::F16 => Some(1),
        DType::BF16 => Some(2),
        _ => None,
    }
}

/// The `types` word: operand `i`'s code in bits `2i..2i+1`.
pub(crate) fn types_word(codes: &[u64]) -> u64 {
    codes
        .iter()
        .enumerate()
        .fold(0, |w, (i, &c)| w | (c << (2 * i)))
}

/// Validates a typed operand: its device, whole elements of its dtype, a float dtype.
fn operand(
    c: &Call<'_>,
    op: &'static str,
    arg: &'static str,
    (b, dtype): TBuf<'_>,
) -> Result<(Dev, u64)> {
    let Some(code) = type_code(dtype) else {
        return Err(KernelError::InvalidShape {
            op,
            reason: format!("`{arg}` is {dtype}; this kernel takes f32, f16 or bf16"),
        }
        .into());
    };
    let elem = if dtype == DType::F32 {
        Elem::F32
    } else {
        Elem::U16
    };
    Ok((c.buf(arg, b, elem)?, code))
}

/// One grid-strided typed launch over `n` elements (nothing for `n == 0`).
fn plan_map_t(kernel: Kernel, n: u64, args: Vec<PArg>) -> Plan {
    let mut plan = Plan::new();
    if n > 0 {
        plan.launch(kernel, grid_for(n), args);
    }
    plan
}

/// `out = a + b` ([`Kernel::AddT`]).
#[cfg(test)]
pub(crate) fn plan_add_t(types: u64, n: u64, a: Ptr, b: Ptr, out: Ptr) -> Plan {
    plan_binary_t(Kernel::AddT, types, n, a, b, out)
}

/// `out = a ∘ b` for the typed binary kernels ([`Kernel::AddT`], [`Kernel::MulT`]).
pub(crate) fn plan_binary_t(kernel: Kernel, types: u64, n: u64, a: Ptr, b: Ptr, out: Ptr) -> Plan {
    let args = vec![
        PArg::U64(types),
        PArg::U64(n),
        PArg::Ptr(a),
        PArg::Ptr(b),
        PArg::Ptr(out),
    ];
    plan_map_t(kernel, n, args)
}

/// `out = alpha·x` (codes: x, out).
pub(crate) fn plan_scale_t(types: u64, n: u64, x: Ptr, alpha: f32, out: Ptr) -> Plan {
    let args = vec![
        PArg::U64(types),
        PArg::U64(n),
        PArg::Ptr(x),
        PArg::F32(alpha),
        PArg::Ptr(out),
    ];
    plan_map_t(Kernel::ScaleT, n, args)
}

/// `y ← alpha·y` (code: y).
pub(crate) fn plan_scale_inplace_t(types: u64, n: u64, y: Ptr, alpha: f32) -> Plan {
    let args = vec![
        PArg::U64(types),
        PArg::U64(n),
        PArg::Ptr(y),
        PArg::F32(alpha),
    ];
    plan_map_t(Kernel::ScaleInplaceT, n, args)
}

/// `out[0] = Σ x / divisor` (codes: x, out) through f64 partial sums, as `plan_sum`.
pub(crate) fn plan_sum_t(codes: [u64; 2], n: u64, x: Ptr, out: Ptr, divisor: f64) -> Plan {
    let mut plan = Plan::new();
    let parts = sum_parts(n);
    let partial = Ptr::scratch(plan.scratch(parts as usize, Elem::F64));
    plan.launch(
        Kernel::SumPartialT,
        parts,
        vec![
            PArg::U64(types_word(&[codes[0]])),
            PArg::U64(n),
            PArg::Ptr(x),
            PArg::Ptr(partial),
        ],
    );
    plan.launch(
        Kernel::SumFinalT,
        1,
        vec![
            PArg::U64(types_word(&[0, codes[1]])),
            PArg::U64(parts as u64),
            PArg::Ptr(partial),
            PArg::F64(divisor),
            PArg::Ptr(out),
        ],
    );
    plan
}

/// `y ← y + alpha·x` ([`Kernel::AxpyT`]; codes: y, x).
pub(crate) fn plan_axpy_t(types: u64, n: u64, y: Ptr, alpha: f32, x: Ptr) -> Plan {
    let args = vec![
        PArg::U64(types),
        PArg::U64(n),
        PArg::Ptr(y),
        PArg::F32(alpha),
        PArg::Ptr(x),
    ];
    plan_map_t(Kernel::AxpyT, n, args)
}

/// `out = x + bias` per row (codes: x, bias, out; `cols > 0`).
pub(crate) fn plan_add_row_bias_t(
    types: u64,
    n: u64,
    cols: u64,
    x: Ptr,
    bias: Ptr,
    out: Ptr,
) -> Plan {
    let args = vec![
        PArg::U64(types),
        PArg::U64(n),
        PArg::U64(cols),
        PArg::Ptr(x),
        PArg::Ptr(bias),
        PArg::Ptr(out),
    ];
    plan_map_t(Kernel::AddRowBiasT, n, args)
}

/// `y += bias` per row (codes: y, bias; `cols > 0`).
pub(crate) fn plan_add_row_bias_inplace_t(
    types: u64,
    n: u64,
    cols: u64,
    y: Ptr,
    bias: Ptr,
) -> Plan {
    let args = vec![
        PArg::U64(types),
        PArg::U64(n),
        PArg::U64(cols),
        PArg::Ptr(y),
        PArg::Ptr(bias),
    ];
    plan_map_t(Kernel::AddRowBiasInplaceT, n, args)
}

/// Column sums (codes: x, out; `cols > 0`): one block per column group, as `col_sums`.
pub(crate) fn plan_col_sums_t(types: u64, rows: u64, cols: u64, x: Ptr, out: Ptr) -> Plan {
    let mut plan = Plan::new();
    plan.launch(
        Kernel::ColSumsT,
        grid_col_groups(cols),
        vec![
            PArg::U64(types),
            PArg::U64(rows),
            PArg::U64(cols),
            PArg::Ptr(x),
            PArg::Ptr(out),
        ],
    );
    plan
}

/// GELU forward (codes: x, y).
pub(crate) fn plan_gelu_t(kind: Gelu, types: u64, n: u64, x: Ptr, y: Ptr) -> Plan {
    let kernel = match kind {
        Gelu::Tanh => Kernel::GeluFwdT,
        Gelu::Exact => Kernel::GeluExactFwdT,
    };
    let args = vec![PArg::U64(types), PArg::U64(n), PArg::Ptr(x), PArg::Ptr(y)];
    plan_map_t(kernel, n, args)
}

/// GELU backward (codes: x, dy, dx).
pub(crate) fn plan_gelu_backward_t(
    kind: Gelu,
    types: u64,
    n: u64,
    x: Ptr,
    dy: Ptr,
    dx: Ptr,
) -> Plan {
    let kernel = match kind {
        Gelu::Tanh => Kernel::GeluBwdT,
        Gelu::Exact => Kernel::GeluExactBwdT,
    };
    let args = vec![
        PArg::U64(types),
        PArg::U64(n),
        PArg::Ptr(x),
        PArg::Ptr(dy),
        PArg::Ptr(dx),
    ];
    plan_map_t(kernel, n, args)
}

/// Layer norm forward; `p = [x, gamma, beta, y, mean, rstd]`, `codes = [x, gamma, beta, y]`
/// (mean and rstd are f32).
pub(crate) fn plan_layer_norm_t(
    codes: [u64; 4],
    rows: u64,
    cols: u64,
    eps: f32,
    p: [Ptr; 6],
) -> Plan {
    let mut plan = Plan::new();
    if rows > 0 {
        let mut args = vec![
            PArg::U64(types_word(&codes)),
            PArg::U64(rows),
            PArg::U64(cols),
            PArg::F32(eps),
        ];
        args.extend(p.iter().map(|&q| PArg::Ptr(q)));
        plan.launch(Kernel::LayerNormFwdT, grid_rows(rows), args);
    }
    plan
}

/// Layer norm backward; `p = [x, gamma, mean, rstd, dy, dx, dgamma, dbeta]`,
/// `codes = [x, gamma, dy, dx, dgamma, dbeta]` (mean and rstd are f32).
pub(crate) fn plan_layer_norm_backward_t(
    codes: [u64; 6],
    rows: u64,
    cols: u64,
    p: [Ptr; 8],
) -> Plan {
    let [x, gamma, mean, rstd, dy, dx, dgamma, dbeta] = p;
    let [cx, cg, cdy, cdx, cdg, cdb] = codes;
    let head = |types: u64| vec![PArg::U64(types), PArg::U64(rows), PArg::U64(cols)];
    let mut plan = Plan::new();
    if rows > 0 {
        let mut args = head(types_word(&[cx, cg, 0, 0, cdy, cdx]));
        args.extend([x, gamma, mean, rstd, dy, dx].map(PArg::Ptr));
        plan.launch(Kernel::LayerNormBwdDxT, grid_rows(rows), args);
    }
    // With zero rows the parameter gradients are empty sums: the kernel writes zeros.
    let mut args = head(types_word(&[cx, 0, 0, cdy, cdg, cdb]));
    args.extend([x, mean, rstd, dy, dgamma, dbeta].map(PArg::Ptr));
    plan.launch(Kernel::LayerNormBwdParamsT, grid_col_groups(cols), args);
    plan
}

impl CudaKernels {
    /// `out = a + b` elementwise, each operand f32, f16 or bf16 (see the module docs).
    pub(crate) fn add_t(
        &self,
        stream: &Stream,
        a: TBuf<'_>,
        b: TBuf<'_>,
        out: TBuf<'_>,
    ) -> Result<()> {
        self.binary_t("add", Kernel::AddT, stream, a, b, out)
    }

    /// `out = a ⊙ b` elementwise, each operand f32, f16 or bf16.
    pub(crate) fn mul_t(
        &self,
        stream: &Stream,
        a: TBuf<'_>,
        b: TBuf<'_>,
        out: TBuf<'_>,
    ) -> Result<()> {
        self.binary_t("mul", Kernel::MulT, stream, a, b, out)
    }

    /// `out = alpha·x`, each operand f32, f16 or bf16.
    pub(crate) fn scale_t(
        &self,
        stream: &Stream,
        x: TBuf<'_>,
        alpha: f32,
        out: TBuf<'_>,
    ) -> Result<()> {
        let op = "scale";
        let c = self.call(op, stream)?;
        let (dx, cx) = operand(&c, op, "x", x)?;
        let (dout, co) = operand(&c, op, "out", out)?;
        expect_len(op, "out", dout.len, dx.len, || format!("len(x)={}", dx.len))?;
        c.disjoint(&[("out", out.0)], &[("x", x.0)])?;
        let types = types_word(&[cx, co]);
        let plan = plan_scale_t(types, dx.len as u64, dx.as_ptr(), alpha, dout.as_ptr());
        // SAFETY: x and out hold n elements of their dtypes on this device and do not overlap.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// `y ← alpha·y` in place, `y` f32, f16 or bf16.
    pub(crate) fn scale_inplace_t(&self, stream: &Stream, y: TBuf<'_>, alpha: f32) -> Result<()> {
        let op = "scale_inplace";
        let c = self.call(op, stream)?;
        let (dy, cy) = operand(&c, op, "y", y)?;
        let plan = plan_scale_inplace_t(types_word(&[cy]), dy.len as u64, dy.as_ptr(), alpha);
        // SAFETY: y holds n elements of its dtype on this device; each is read and written by
        // one thread.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// `out[0] = Σ x` (or the mean with `mean`), `x` and the one-element `out` each f32, f16 or
    /// bf16 (as [`CudaKernels::sum`] / [`CudaKernels::mean`]).
    pub(crate) fn sum_t(
        &self,
        stream: &Stream,
        x: TBuf<'_>,
        out: TBuf<'_>,
        mean: bool,
    ) -> Result<()> {
        let op = if mean { "mean" } else { "sum" };
        let c = self.call(op, stream)?;
        let (dx, cx) = operand(&c, op, "x", x)?;
        let (dout, co) = operand(&c, op, "out", out)?;
        expect_len(op, "out", dout.len, 1, || "a scalar output".into())?;
        c.disjoint(&[("out", out.0)], &[("x", x.0)])?;
        if mean && dx.len == 0 {
            return Err(KernelError::InvalidShape {
                op,
                reason: "the mean of an empty slice is undefined".into(),
            }
            .into());
        }
        let divisor = if mean { dx.len as f64 } else { 1.0 };
        let plan = plan_sum_t([cx, co], dx.len as u64, dx.as_ptr(), dout.as_ptr(), divisor);
        // SAFETY: x holds n elements and out one, of their dtypes, on this device, disjoint; the
        // partial sums live in the plan's scratch, sized to the first launch's blocks.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// Shared body of [`CudaKernels::add_t`] and [`CudaKernels::mul_t`].
    fn binary_t(
        &self,
        op: &'static str,
        kernel: Kernel,
        stream: &Stream,
        a: TBuf<'_>,
        b: TBuf<'_>,
        out: TBuf<'_>,
    ) -> Result<()> {
        let c = self.call(op, stream)?;
        let (da, ca) = operand(&c, op, "a", a)?;
        let (db, cb) = operand(&c, op, "b", b)?;
        let (dout, co) = operand(&c, op, "out", out)?;
        let shape = || format!("len(a)={}", da.len);
        expect_len(op, "b", db.len, da.len, shape)?;
        expect_len(op, "out", dout.len, da.len, shape)?;
        c.disjoint(&[("out", out.0)], &[("a", a.0), ("b", b.0)])?;
        let plan = plan_binary_t(
            kernel,
            types_word(&[ca, cb, co]),
            da.len as u64,
            da.as_ptr(),
            db.as_ptr(),
            dout.as_ptr(),
        );
        // SAFETY: a, b and out hold n elements of their dtypes on this device (checked above);
        // out overlaps neither input.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// `y ← y + alpha·x`, each operand f32, f16 or bf16.
    pub(crate) fn add_scaled_t(
        &self,
        stream: &Stream,
        y: TBuf<'_>,
        alpha: f32,
        x: TBuf<'_>,
    ) -> Result<()> {
        let op = "add_scaled";
        let c = self.call(op, stream)?;
        let (dy, cy) = operand(&c, op, "y", y)?;
        let (dx, cx) = operand(&c, op, "x", x)?;
        expect_len(op, "x", dx.len, dy.len, || format!("len(y)={}", dy.len))?;
        c.disjoint(&[("y", y.0)], &[("x", x.0)])?;
        let plan = plan_axpy_t(
            types_word(&[cy, cx]),
            dy.len as u64,
            dy.as_ptr(),
            alpha,
            dx.as_ptr(),
        );
        // SAFETY: y and x hold n elements of their dtypes on this device and do not overlap.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// `out[r, j] = x[r, j] + bias[j]`, each operand f32, f16 or bf16.
    pub(crate) fn add_row_bias_t(
        &self,
        stream: &Stream,
        x: TBuf<'_>,
        bias: TBuf<'_>,
        out: TBuf<'_>,
    ) -> Result<()> {
        let op = "add_row_bias";
        let c = self.call(op, stream)?;
        let (dx, cx) = operand(&c, op, "x", x)?;
        let (db, cb) = operand(&c, op, "bias", bias)?;
        let (dout, co) = operand(&c, op, "out", out)?;
        rows_of(op, "x", dx.len, db.len)?;
        expect_len(op, "out", dout.len, dx.len, || format!("len(x)={}", dx.len))?;
        c.disjoint(&[("out", out.0)], &[("x", x.0), ("bias", bias.0)])?;
        let plan = plan_add_row_bias_t(
            types_word(&[cx, cb, co]),
            dx.len as u64,
            db.len as u64,
            dx.as_ptr(),
            db.as_ptr(),
            dout.as_ptr(),
        );
        // SAFETY: x and out hold n elements, bias cols (> 0, dividing n), all on this device in
        // their dtypes; out overlaps neither input.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// `y[r, j] += bias[j]`, each operand f32, f16 or bf16.
    pub(crate) fn add_row_bias_inplace_t(
        &self,
        stream: &Stream,
        y: TBuf<'_>,
        bias: TBuf<'_>,
    ) -> Result<()> {
        let op = "add_row_bias_inplace";
        let c = self.call(op, stream)?;
        let (dy, cy) = operand(&c, op, "y", y)?;
        let (db, cb) = operand(&c, op, "bias", bias)?;
        rows_of(op, "y", dy.len, db.len)?;
        c.disjoint(&[("y", y.0)], &[("bias", bias.0)])?;
        let plan = plan_add_row_bias_inplace_t(
            types_word(&[cy, cb]),
            dy.len as u64,
            db.len as u64,
            dy.as_ptr(),
            db.as_ptr(),
        );
        // SAFETY: y holds n elements and bias cols on this device, disjoint; each y element is
        // read and written by one thread.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// Column sums `out[j] = Σ_r x[r, j]` in row order (as
    /// [`CudaKernels::col_sums`]), `x` and `out` each f32, f16 or bf16.
    pub(crate) fn col_sums_t(&self, stream: &Stream, x: TBuf<'_>, out: TBuf<'_>) -> Result<()> {
        let op = "col_sums";
        let c = self.call(op, stream)?;
        let (dx, cx) = operand(&c, op, "x", x)?;
        let (dout, co) = operand(&c, op, "out", out)?;
        let rows = rows_of(op, "x", dx.len, dout.len)?;
        c.disjoint(&[("out", out.0)], &[("x", x.0)])?;
        let plan = plan_col_sums_t(
            types_word(&[cx, co]),
            rows as u64,
            dout.len as u64,
            dx.as_ptr(),
            dout.as_ptr(),
        );
        // SAFETY: x holds rows·cols and out cols (> 0) elements on this device, disjoint.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// GELU of `kind` (as [`CudaKernels::gelu`]), `x` and `y` each f32, f16 or bf16.
    pub(crate) fn gelu_t(
        &self,
        stream: &Stream,
        kind: Gelu,
        x: TBuf<'_>,
        y: TBuf<'_>,
    ) -> Result<()> {
        let op = "gelu";
        let c = self.call(op, stream)?;
        let (dx, cx) = operand(&c, op, "x", x)?;
        let (dy, cy) = operand(&c, op, "y", y)?;
        expect_len(op, "y", dy.len, dx.len, || format!("len(x)={}", dx.len))?;
        c.disjoint(&[("y", y.0)], &[("x", x.0)])?;
        let types = types_word(&[cx, cy]);
        let plan = plan_gelu_t(kind, types, dx.len as u64, dx.as_ptr(), dy.as_ptr());
        // SAFETY: x and y hold n elements of their dtypes on this device and do not overlap.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// Gradient of [`CudaKernels::gelu_t`], each operand f32, f16 or bf16.
    pub(crate) fn gelu_backward_t(
        &self,
        stream: &Stream,
        kind: Gelu,
        x: TBuf<'_>,
        dy: TBuf<'_>,
        dx: TBuf<'_>,
    ) -> Result<()> {
        let op = "gelu_backward";
        let c = self.call(op, stream)?;
        let (bx, cx) = operand(&c, op, "x", x)?;
        let (bdy, cdy) = operand(&c, op, "dy", dy)?;
        let (bdx, cdx) = operand(&c, op, "dx", dx)?;
        let shape = || format!("len(x)={}", bx.len);
        expect_len(op, "dy", bdy.len, bx.len, shape)?;
        expect_len(op, "dx", bdx.len, bx.len, shape)?;
        c.disjoint(&[("dx", dx.0)], &[("x", x.0), ("dy", dy.0)])?;
        let plan = plan_gelu_backward_t(
            kind,
            types_word(&[cx, cdy, cdx]),
            bx.len as u64,
            bx.as_ptr(),
            bdy.as_ptr(),
            bdx.as_ptr(),
        );
        // SAFETY: x, dy and dx hold n elements of their dtypes on this device; dx overlaps
        // neither input.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// Layer norm (as [`CudaKernels::layer_norm`]) with `x`, `gamma`, `beta` and `y` each f32,
    /// f16 or bf16; `mean` and `rstd` are f32.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn layer_norm_t(
        &self,
        stream: &Stream,
        x: TBuf<'_>,
        gamma: TBuf<'_>,
        beta: TBuf<'_>,
        y: TBuf<'_>,
        mean: &BufferRef,
        rstd: &BufferRef,
        cols: usize,
        eps: f32,
    ) -> Result<()> {
        let op = "layer_norm";
        let c = self.call(op, stream)?;
        let (bx, cx) = operand(&c, op, "x", x)?;
        let rows = rows_of(op, "x", bx.len, cols)?;
        let shape = || format!("rows={rows}, cols={cols}");
        let (bg, cg) = operand(&c, op, "gamma", gamma)?;
        let (bb, cb) = operand(&c, op, "beta", beta)?;
        let (by, cy) = operand(&c, op, "y", y)?;
        expect_len(op, "gamma", bg.len, cols, shape)?;
        expect_len(op, "beta", bb.len, cols, shape)?;
        expect_len(op, "y", by.len, bx.len, shape)?;
        let [bm, br] = c.f32_sized([("mean", mean, rows), ("rstd", rstd, rows)], shape)?;
        c.disjoint(
            &[("y", y.0), ("mean", mean), ("rstd", rstd)],
            &[("x", x.0), ("gamma", gamma.0), ("beta", beta.0)],
        )?;
        let plan = plan_layer_norm_t(
            [cx, cg, cb, cy],
            rows as u64,
            cols as u64,
            eps,
            [bx, bg, bb, by, bm, br].map(|d| d.as_ptr()),
        );
        // SAFETY: x and y hold rows·cols elements, gamma and beta cols, mean and rstd rows f32,
        // all on this device in their dtypes; the outputs overlap nothing else.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// Gradient of [`CudaKernels::layer_norm_t`] (as [`CudaKernels::layer_norm_backward`]),
    /// float operands each f32, f16 or bf16; `mean` and `rstd` are f32.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn layer_norm_backward_t(
        &self,
        stream: &Stream,
        x: TBuf<'_>,
        gamma: TBuf<'_>,
        mean: &BufferRef,
        rstd: &BufferRef,
        dy: TBuf<'_>,
        dx: TBuf<'_>,
        dgamma: TBuf<'_>,
        dbeta: TBuf<'_>,
        cols: usize,
    ) -> Result<()> {
        let op = "layer_norm_backward";
        let c = self.call(op, stream)?;
        let (bx, cx) = operand(&c, op, "x", x)?;
        let rows = rows_of(op, "x", bx.len, cols)?;
        let shape = || format!("rows={rows}, cols={cols}");
        let (bg, cg) = operand(&c, op, "gamma", gamma)?;
        let (bdy, cdy) = operand(&c, op, "dy", dy)?;
        let (bdx, cdx) = operand(&c, op, "dx", dx)?;
        let (bdg, cdg) = operand(&c, op, "dgamma", dgamma)?;
        let (bdb, cdb) = operand(&c, op, "dbeta", dbeta)?;
        expect_len(op, "gamma", bg.len, cols, shape)?;
        expect_len(op, "dy", bdy.len, bx.len, shape)?;
        expect_len(op, "dx", bdx.len, bx.len, shape)?;
        expect_len(op, "dgamma", bdg.len, cols, shape)?;
        expect_len(op, "dbeta", bdb.len, cols, shape)?;
        let [bm, br] = c.f32_sized([("mean", mean, rows), ("rstd", rstd, rows)], shape)?;
        c.disjoint(
            &[("dx", dx.0), ("dgamma", dgamma.0), ("dbeta", dbeta.0)],
            &[
                ("x", x.0),
                ("gamma", gamma.0),
                ("mean", mean),
                ("rstd", rstd),
                ("dy", dy.0),
            ],
        )?;
        let plan = plan_layer_norm_backward_t(
            [cx, cg, cdy, cdx, cdg, cdb],
            rows as u64,
            cols as u64,
            [bx, bg, bm, br, bdy, bdx, bdg, bdb].map(|d| d.as_ptr()),
        );
        // SAFETY: x, dy and dx hold rows·cols elements, gamma, dgamma and dbeta cols, mean and
        // rstd rows f32, all on this device in their dtypes; the outputs overlap no other
        // argument.
        unsafe { c.exec(&plan) }.map(drop)
    }
}
