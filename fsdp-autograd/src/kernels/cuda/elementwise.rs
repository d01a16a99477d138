//! Elementwise kernels, GELU, row bias, column sums, sum and mean.

use fsdp_alloc::{BufferRef, Stream};

use super::context::{expect_len, grid_for, rows_of, CudaKernels, Elem};
use super::error::Result;
use super::plan::{PArg, Plan, Ptr};
use super::program::{Kernel, BLOCK, MAX_GRID};
use crate::kernels::{Gelu, KernelError};

/// One grid-strided launch over `n` elements (nothing for `n == 0`).
pub(crate) fn plan_map(kernel: Kernel, n: u64, args: Vec<PArg>) -> Plan {
    let mut plan = Plan::new();
    if n > 0 {
        plan.launch(kernel, grid_for(n), args);
    }
    plan
}

/// `out = a ∘ b` for the binary kernels ([`Kernel::Add`], [`Kernel::Mul`]).
pub(crate) fn plan_binary(kernel: Kernel, n: u64, a: Ptr, b: Ptr, out: Ptr) -> Plan {
    plan_map(
        kernel,
        n,
        vec![PArg::U64(n), PArg::Ptr(a), PArg::Ptr(b), PArg::Ptr(out)],
    )
}

/// `out = alpha·x`.
pub(crate) fn plan_scale(n: u64, x: Ptr, alpha: f32, out: Ptr) -> Plan {
    plan_map(
        Kernel::Scale,
        n,
        vec![PArg::U64(n), PArg::Ptr(x), PArg::F32(alpha), PArg::Ptr(out)],
    )
}

/// `y ← alpha·y`.
pub(crate) fn plan_scale_inplace(n: u64, y: Ptr, alpha: f32) -> Plan {
    plan_map(
        Kernel::ScaleInplace,
        n,
        vec![PArg::U64(n), PArg::Ptr(y), PArg::F32(alpha)],
    )
}

/// `y ← y + alpha·x`.
pub(crate) fn plan_axpy(n: u64, y: Ptr, alpha: f32, x: Ptr) -> Plan {
    plan_map(
        Kernel::Axpy,
        n,
        vec![PArg::U64(n), PArg::Ptr(y), PArg::F32(alpha), PArg::Ptr(x)],
    )
}

/// `out = x + bias` per row (`cols > 0`).
pub(crate) fn plan_add_row_bias(n: u64, cols: u64, x: Ptr, bias: Ptr, out: Ptr) -> Plan {
    plan_map(
        Kernel::AddRowBias,
        n,
        vec![
            PArg::U64(n),
            PArg::U64(cols),
            PArg::Ptr(x),
            PArg::Ptr(bias),
            PArg::Ptr(out),
        ],
    )
}

/// `y += bias` per row (`cols > 0`).
pub(crate) fn plan_add_row_bias_inplace(n: u64, cols: u64, y: Ptr, bias: Ptr) -> Plan {
    plan_map(
        Kernel::AddRowBiasInplace,
        n,
        vec![PArg::U64(n), PArg::U64(cols), PArg::Ptr(y), PArg::Ptr(bias)],
    )
}

/// Columns per block of the column reductions (`COL_GROUP` in `kernels.cu`, checked by a test):
/// one 32-byte sector of an f32 row.
pub(crate) const COL_GROUP: u64 = 8;

/// The grid of a column reduction (`col_sums`, `layer_norm_bwd_params`): one block per group of
/// [`COL_GROUP`] columns (4096×768 gets 96 blocks, ×3072 gets 384), capped at the grid limit
/// (the blocks loop over the groups).
pub(crate) fn grid_col_groups(cols: u64) -> u32 {
    cols.div_ceil(COL_GROUP).clamp(1, MAX_GRID as u64) as u32
}

/// Column sums of a `rows × cols` matrix (`cols > 0`; zero rows give zeros).
pub(crate) fn plan_col_sums(rows: u64, cols: u64, x: Ptr, out: Ptr) -> Plan {
    let mut plan = Plan::new();
    plan.launch(
        Kernel::ColSums,
        grid_col_groups(cols),
        vec![
            PArg::U64(rows),
            PArg::U64(cols),
            PArg::Ptr(x),
            PArg::Ptr(out),
        ],
    );
    plan
}

/// Number of partial sums for `n` elements: a function of `n` only, so the summation tree (and
/// the result) is the same on every call.
pub(crate) fn sum_parts(n: u64) -> u32 {
    n.div_ceil(BLOCK as u64 * 8).clamp(1, 1024) as u32
}

/// `out[0] = Σ x / divisor` in two launches through an f64 scratch of partial sums.
pub(crate) fn plan_sum(n: u64, x: Ptr, out: Ptr, divisor: f64) -> Plan {
    let mut plan = Plan::new();
    let parts = sum_parts(n);
    let partial = plan.scratch(parts as usize, Elem::F64);
    plan.launch(
        Kernel::SumPartial,
        parts,
        vec![PArg::U64(n), PArg::Ptr(x), PArg::Ptr(Ptr::scratch(partial))],
    );
    plan.launch(
        Kernel::SumFinal,
        1,
        vec![
            PArg::U64(parts as u64),
            PArg::Ptr(Ptr::scratch(partial)),
            PArg::F64(divisor),
            PArg::Ptr(out),
        ],
    );
    plan
}

/// GELU forward.
pub(crate) fn plan_gelu(kind: Gelu, n: u64, x: Ptr, y: Ptr) -> Plan {
    plan_map(
        match kind {
            Gelu::Tanh => Kernel::GeluFwd,
            Gelu::Exact => Kernel::GeluExactFwd,
        },
        n,
        vec![PArg::U64(n), PArg::Ptr(x), PArg::Ptr(y)],
    )
}

/// GELU backward.
pub(crate) fn plan_gelu_backward(kind: Gelu, n: u64, x: Ptr, dy: Ptr, dx: Ptr) -> Plan {
    plan_map(
        match kind {
            Gelu::Tanh => Kernel::GeluBwd,
            Gelu::Exact => Kernel::GeluExactBwd,
        },
        n,
        vec![PArg::U64(n), PArg::Ptr(x), PArg::Ptr(dy), PArg::Ptr(dx)],
    )
}

impl CudaKernels {
    /// Shared body of the three-operand elementwise kernels `out = f(a, b)`.
    fn binary(
        &self,
        op: &'static str,
        kernel: Kernel,
        stream: &Stream,
        a: &BufferRef,
        b: &BufferRef,
        out: &BufferRef,
    ) -> Result<()> {
        let c = self.call(op, stream)?;
        let [da, db, dout] = c.f32_bufs([("a", a), ("b", b), ("out", out)])?;
        let shape = || format!("len(a)={}", da.len);
        expect_len(op, "b", db.len, da.len, shape)?;
        expect_len(op, "out", dout.len, da.len, shape)?;
        c.disjoint(&[("out", out)], &[("a", a), ("b", b)])?;
        let plan = plan_binary(
            kernel,
            da.len as u64,
            da.as_ptr(),
            db.as_ptr(),
            dout.as_ptr(),
        );
        // SAFETY: a, b and out are device buffers of this device holding n f32 each (checked
        // above), out overlaps neither input; the kernel touches elements 0..n of each.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// `out = a + b`, elementwise (CPU: [`cpu::add`](crate::kernels::cpu::add)). Bit-identical
    /// to the CPU kernel (one correctly rounded f32 addition per element).
    ///
    /// # Errors
    /// [`KernelError::LengthMismatch`] unless all three buffers hold the same number of f32;
    /// the buffer/stream errors of [`CudaKernelError`](super::CudaKernelError); `out` must not
    /// overlap `a` or `b`.
    pub fn add(
        &self,
        stream: &Stream,
        a: &BufferRef,
        b: &BufferRef,
        out: &BufferRef,
    ) -> Result<()> {
        self.binary("add", Kernel::Add, stream, a, b, out)
    }

    /// `out = a ⊙ b` (CPU: [`cpu::mul`](crate::kernels::cpu::mul)); bit-identical to the CPU.
    ///
    /// # Errors
    /// As [`CudaKernels::add`].
    pub fn mul(
        &self,
        stream: &Stream,
        a: &BufferRef,
        b: &BufferRef,
        out: &BufferRef,
    ) -> Result<()> {
        self.binary("mul", Kernel::Mul, stream, a, b, out)
    }

    /// `out = alpha · x` (CPU: [`cpu::scale`](crate::kernels::cpu::scale)); bit-identical.
    ///
    /// # Errors
    /// Length mismatch between `x` and `out`; buffer/stream errors; overlap of `out` and `x`.
    pub fn scale(&self, stream: &Stream, x: &BufferRef, alpha: f32, out: &BufferRef) -> Result<()> {
        let op = "scale";
        let c = self.call(op, stream)?;
        let [dx, dout] = c.f32_bufs([("x", x), ("out", out)])?;
        expect_len(op, "out", dout.len, dx.len, || format!("len(x)={}", dx.len))?;
        c.disjoint(&[("out", out)], &[("x", x)])?;
        let plan = plan_scale(dx.len as u64, dx.as_ptr(), alpha, dout.as_ptr());
        // SAFETY: x and out hold n f32 each on this device and do not overlap.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// `y ← alpha · y` in place (CPU: [`cpu::scale_inplace`](crate::kernels::cpu::scale_inplace)).
    ///
    /// # Errors
    /// Buffer/stream errors only.
    pub fn scale_inplace(&self, stream: &Stream, y: &BufferRef, alpha: f32) -> Result<()> {
        let c = self.call("scale_inplace", stream)?;
        let dy = c.buf("y", y, Elem::F32)?;
        let plan = plan_scale_inplace(dy.len as u64, dy.as_ptr(), alpha);
        // SAFETY: y holds n f32 on this device; each element is read and written by one thread.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// `y ← y + alpha · x` (axpy; CPU: [`cpu::add_scaled`](crate::kernels::cpu::add_scaled)),
    /// without fused multiply-add, so bit-identical to the CPU (with `alpha == 1` exactly
    /// `y + x`).
    ///
    /// # Errors
    /// Length mismatch between `x` and `y`; buffer/stream errors; overlap of `y` and `x`.
    pub fn add_scaled(
        &self,
        stream: &Stream,
        y: &BufferRef,
        alpha: f32,
        x: &BufferRef,
    ) -> Result<()> {
        let op = "add_scaled";
        let c = self.call(op, stream)?;
        let [dy, dx] = c.f32_bufs([("y", y), ("x", x)])?;
        expect_len(op, "x", dx.len, dy.len, || format!("len(y)={}", dy.len))?;
        c.disjoint(&[("y", y)], &[("x", x)])?;
        let plan = plan_axpy(dy.len as u64, dy.as_ptr(), alpha, dx.as_ptr());
        // SAFETY: y and x hold n f32 each on this device and do not overlap.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// `out[r, j] = x[r, j] + bias[j]` (CPU: [`cpu::add_row_bias`](crate::kernels::cpu::add_row_bias));
    /// bit-identical.
    ///
    /// # Errors
    /// The CPU kernel's shape errors (empty `bias`, partial rows, `out` length); buffer/stream
    /// errors; overlap of `out` with `x` or `bias`.
    pub fn add_row_bias(
        &self,
        stream: &Stream,
        x: &BufferRef,
        bias: &BufferRef,
        out: &BufferRef,
    ) -> Result<()> {
        let op = "add_row_bias";
        let c = self.call(op, stream)?;
        let [dx, db, dout] = c.f32_bufs([("x", x), ("bias", bias), ("out", out)])?;
        rows_of(op, "x", dx.len, db.len)?;
        expect_len(op, "out", dout.len, dx.len, || format!("len(x)={}", dx.len))?;
        c.disjoint(&[("out", out)], &[("x", x), ("bias", bias)])?;
        let plan = plan_add_row_bias(
            dx.len as u64,
            db.len as u64,
            dx.as_ptr(),
            db.as_ptr(),
            dout.as_ptr(),
        );
        // SAFETY: x and out hold n f32, bias holds cols f32 (cols > 0 divides n), all on this
        // device; out overlaps neither input.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// `y[r, j] += bias[j]` in place (CPU:
    /// [`cpu::add_row_bias_inplace`](crate::kernels::cpu::add_row_bias_inplace)).
    ///
    /// # Errors
    /// Empty `bias` or partial rows; buffer/stream errors; overlap of `y` and `bias`.
    pub fn add_row_bias_inplace(
        &self,
        stream: &Stream,
        y: &BufferRef,
        bias: &BufferRef,
    ) -> Result<()> {
        let op = "add_row_bias_inplace";
        let c = self.call(op, stream)?;
        let [dy, db] = c.f32_bufs([("y", y), ("bias", bias)])?;
        rows_of(op, "y", dy.len, db.len)?;
        c.disjoint(&[("y", y)], &[("bias", bias)])?;
        let plan =
            plan_add_row_bias_inplace(dy.len as u64, db.len as u64, dy.as_ptr(), db.as_ptr());
        // SAFETY: y holds n f32 and bias cols f32 on this device, disjoint; each y element is
        // read and written by one thread.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// Column sums `out[j] = Σ_r x[r, j]` (CPU: [`cpu::col_sums`](crate::kernels::cpu::col_sums)):
    /// each column's rows are added in order 0, 1, … in f32 — the CPU order, so the result is
    /// bit-identical. One block per group of 8 columns stages tiles of 256 rows through shared
    /// memory (coalesced loads, the next tile in flight while one thread per column adds the
    /// current one); the serial order per column bounds the speed for few columns and very many
    /// rows.
    ///
    /// # Errors
    /// Empty `out` or partial rows; buffer/stream errors; overlap of `out` and `x`.
    pub fn col_sums(&self, stream: &Stream, x: &BufferRef, out: &BufferRef) -> Result<()> {
        let op = "col_sums";
        let c = self.call(op, stream)?;
        let [dx, dout] = c.f32_bufs([("x", x), ("out", out)])?;
        let rows = rows_of(op, "x", dx.len, dout.len)?;
        c.disjoint(&[("out", out)], &[("x", x)])?;
        let plan = plan_col_sums(rows as u64, dout.len as u64, dx.as_ptr(), dout.as_ptr());
        // SAFETY: x holds rows·cols f32 and out cols f32 (cols > 0) on this device, disjoint.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// Writes `Σ x / divisor` to the one-element `out` (shared by sum and mean).
    fn reduce(
        &self,
        op: &'static str,
        stream: &Stream,
        x: &BufferRef,
        out: &BufferRef,
        mean: bool,
    ) -> Result<()> {
        let c = self.call(op, stream)?;
        let [dx, dout] = c.f32_bufs([("x", x), ("out", out)])?;
        expect_len(op, "out", dout.len, 1, || "a scalar output".into())?;
        c.disjoint(&[("out", out)], &[("x", x)])?;
        if mean && dx.len == 0 {
            return Err(KernelError::InvalidShape {
                op,
                reason: "the mean of an empty slice is undefined".into(),
            }
            .into());
        }
        let divisor = if mean { dx.len as f64 } else { 1.0 };
        let plan = plan_sum(dx.len as u64, dx.as_ptr(), dout.as_ptr(), divisor);
        // SAFETY: x holds n f32 and out one f32 on this device, disjoint; the partial sums live
        // in the plan's scratch slot, sized to the number of blocks of the first launch.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// `out[0] = Σ x`, accumulated in f64 (per-block grid-strided partial sums, then one block
    /// combining them, both fixed trees), rounded to f32. The empty sum is 0. The CPU kernel
    /// ([`cpu::sum`](crate::kernels::cpu::sum)) also sums in f64 but in another order, so results
    /// agree to f32 rounding, not bit for bit. `out` is a one-element device buffer, so no
    /// synchronization is needed.
    ///
    /// # Errors
    /// `out` must hold exactly one f32; buffer/stream errors; scratch allocation failure.
    pub fn sum(&self, stream: &Stream, x: &BufferRef, out: &BufferRef) -> Result<()> {
        self.reduce("sum", stream, x, out, false)
    }

    /// `out[0] = mean(x)` (see [`CudaKernels::sum`]).
    ///
    /// # Errors
    /// As [`CudaKernels::sum`], plus [`KernelError::InvalidShape`] for an empty `x`.
    pub fn mean(&self, stream: &Stream, x: &BufferRef, out: &BufferRef) -> Result<()> {
        self.reduce("mean", stream, x, out, true)
    }

    /// GELU of `kind`: the tanh approximation in the CPU kernel's form `x / (1 + exp(−2u))`
    /// (CPU: [`cpu::gelu`](crate::kernels::cpu::gelu)), or the exact form `½·x·erfc(−x/√2)`
    /// (CPU: [`cpu::gelu_exact`](crate::kernels::cpu::gelu_exact)). Uses CUDA's `expf` /
    /// `erfcf` (a few ulp), so results differ from the CPU by a few ulp.
    ///
    /// # Errors
    /// Length mismatch; buffer/stream errors; overlap of `y` and `x`.
    pub fn gelu(&self, stream: &Stream, kind: Gelu, x: &BufferRef, y: &BufferRef) -> Result<()> {
        let op = "gelu";
        let c = self.call(op, stream)?;
        let [dx, dy] = c.f32_bufs([("x", x), ("y", y)])?;
        expect_len(op, "y", dy.len, dx.len, || format!("len(x)={}", dx.len))?;
        c.disjoint(&[("y", y)], &[("x", x)])?;
        let plan = plan_gelu(kind, dx.len as u64, dx.as_ptr(), dy.as_ptr());
        // SAFETY: x and y hold n f32 each on this device and do not overlap.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// Gradient of [`CudaKernels::gelu`] of `kind` from the forward input `x` (CPU:
    /// [`cpu::gelu_backward`](crate::kernels::cpu::gelu_backward),
    /// [`cpu::gelu_exact_backward`](crate::kernels::cpu::gelu_exact_backward)); same formulas
    /// as the CPU.
    ///
    /// # Errors
    /// Length mismatch; buffer/stream errors; overlap of `dx` with `x` or `dy`.
    pub fn gelu_backward(
        &self,
        stream: &Stream,
        kind: Gelu,
        x: &BufferRef,
        dy: &BufferRef,
        dx: &BufferRef,
    ) -> Result<()> {
        let op = "gelu_backward";
        let c = self.call(op, stream)?;
        let [bx, bdy, bdx] = c.f32_bufs([("x", x), ("dy", dy), ("dx", dx)])?;
        let shape = || format!("len(x)={}", bx.len);
        expect_len(op, "dy", bdy.len, bx.len, shape)?;
        expect_len(op, "dx", bdx.len, bx.len, shape)?;
        c.disjoint(&[("dx", dx)], &[("x", x), ("dy", dy)])?;
        let plan = plan_gelu_backward(kind, bx.len as u64, bx.as_ptr(), bdy.as_ptr(), bdx.as_ptr());
        // SAFETY: x, dy and dx hold n f32 each on this device; dx overlaps neither input.
        unsafe { c.exec(&plan) }.map(drop)
    }
}
