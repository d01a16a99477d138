//! [`Binary`]: `out = a + b` or `a · b`, `b` of one row broadcast or as large as `a`.

use fsdp_alloc::Stream;

use crate::error::Result;
use crate::kernels::cpu;
use crate::kernels::op::{Check, Op, Rows, Spec};
use crate::kernels::operand::Operand;
use crate::launch::launch_f32;

/// Binary elementwise operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinaryOp {
    /// `a + b`.
    Add,
    /// `a · b`.
    Mul,
}

/// `out[r, :] = a[r, :] op b[r % b_rows, :]` where `b` has `rows.cols` elements (one row,
/// broadcast) or as many as `a`.
#[derive(Debug, Clone, Copy)]
pub struct Binary<'a> {
    /// The operation.
    pub op: BinaryOp,
    /// The shape of `a` and `out`.
    pub rows: Rows,
    /// Left operand.
    pub a: &'a Operand,
    /// Right operand (one row, or as many elements as `a`).
    pub b: &'a Operand,
    /// Output.
    pub out: &'a Operand,
}

impl Op for Binary<'_> {
    fn name(&self) -> &'static str {
        match self.op {
            BinaryOp::Add => "add",
            BinaryOp::Mul => "mul",
        }
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, rows) = (self.name(), self.rows);
        let n = rows.numel(op)?;
        // `b` is one row, broadcast, or as large as `a`.
        let nb = if self.b.numel() == n { n } else { rows.cols };
        let table = [
            Spec::float("a", self.a, n),
            Spec::float("out", self.out, n),
            Spec::float("b", self.b, nb),
        ];
        c.args(op, || format!("{rows:?}"), &table)?;
        Ok(n > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (name, op, cols) = (self.name(), self.op, self.rows.cols);
        let run = move |a: &[f32], b: &[f32], o: &mut [f32]| match op {
            BinaryOp::Add => cpu::add(a, b, o),
            BinaryOp::Mul => cpu::mul(a, b, o),
        };
        let (a, b, out) = (self.a, self.b, self.out);
        launch_f32(s, name, [a, b], [out], false, move |[f, s], [o]| {
            if cols == f.len() || s.len() == f.len() {
                run(f, s, o)
            } else if op == BinaryOp::Add {
                cpu::add_row_bias(f, s, o)
            } else {
                f.chunks(cols)
                    .zip(o.chunks_mut(cols))
                    .try_for_each(|(fr, or)| run(fr, s, or))
            }
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, bk: &crate::kernels::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::{err, tb, typed};
        let (name, k) = (self.name(), bk.kernels());
        let (op, rows, a, b, out) = (self.op, self.rows, self.a, self.b, self.out);
        let full = b.numel() == a.numel();
        if typed(&[a, b, out]) {
            let (x, y, o) = (tb(a), tb(b), tb(out));
            let e = err(name);
            return match (op, full) {
                (BinaryOp::Add, true) => k.add_t(s, x, y, o).map_err(e),
                (BinaryOp::Mul, true) => k.mul_t(s, x, y, o).map_err(e),
                (BinaryOp::Add, false) => k.add_row_bias_t(s, x, y, o).map_err(e),
                (BinaryOp::Mul, false) => {
                    // One launch per row, as for f32.
                    let (xs, os) = (rows.cols * a.dtype.size(), rows.cols * out.dtype.size());
                    for r in 0..rows.rows {
                        let xr = a.buf.slice(r * xs, xs)?;
                        let or = out.buf.slice(r * os, os)?;
                        let (xr, or) = ((&xr, a.dtype), (&or, out.dtype));
                        k.mul_t(s, xr, y, or).map_err(err(name))?;
                    }
                    Ok(())
                }
            };
        }
        let mut f = bk.scope(name, s);
        let (x, y, o) = (f.input(a)?, f.input(b)?, f.output(out, false)?);
        let e = err(name);
        match (op, full) {
            (BinaryOp::Add, true) => k.add(s, &x, &y, &o).map_err(e)?,
            (BinaryOp::Mul, true) => k.mul(s, &x, &y, &o).map_err(e)?,
            (BinaryOp::Add, false) => k.add_row_bias(s, &x, &y, &o).map_err(e)?,
            (BinaryOp::Mul, false) => {
                // No row-broadcast product kernel: one launch per row.
                let bytes = rows.cols * 4;
                for r in 0..rows.rows {
                    let xr = x.slice(r * bytes, bytes)?;
                    let or = o.slice(r * bytes, bytes)?;
                    k.mul(s, &xr, &y, &or).map_err(err(name))?;
                }
            }
        }
        f.finish()
    }
}

/// The CUDA side of the op (feature `cuda`): its kernels' declarations, launch plans and
/// [`CudaKernels`](crate::kernels::cuda::CudaKernels) methods.
#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use fsdp_alloc::{BufferRef, Stream};

    use crate::kernels::cuda::context::{expect_len, rows_of, CudaKernels};
    use crate::kernels::cuda::error::Result;
    use crate::kernels::cuda::kernel::Kernel;
    use crate::kernels::cuda::plan::{plan_map, PArg, Plan, Ptr};
    use crate::kernels::cuda::typed::{operand, plan_map_t, types_word, TBuf};

    crate::kernels::cuda::kernel::declare_kernels! {
        EW_ADD = "ew_add" [U64, Ptr, Ptr, Ptr];
        EW_MUL = "ew_mul" [U64, Ptr, Ptr, Ptr];
        ADD_ROW_BIAS = "add_row_bias" [U64, U64, Ptr, Ptr, Ptr];
        EW_ADD_T = "ew_add_t" [U64, U64, Ptr, Ptr, Ptr];
        ADD_ROW_BIAS_T = "add_row_bias_t" [U64, U64, U64, Ptr, Ptr, Ptr];
        EW_MUL_T = "ew_mul_t" [U64, U64, Ptr, Ptr, Ptr];
    }

    /// `out = a ∘ b` for the binary kernels ([`EW_ADD`], [`EW_MUL`]).
    pub(crate) fn plan_binary(kernel: Kernel, n: u64, a: Ptr, b: Ptr, out: Ptr) -> Plan {
        plan_map(
            kernel,
            n,
            vec![PArg::U64(n), PArg::Ptr(a), PArg::Ptr(b), PArg::Ptr(out)],
        )
    }

    /// `out = x + bias` per row (`cols > 0`).
    pub(crate) fn plan_add_row_bias(n: u64, cols: u64, x: Ptr, bias: Ptr, out: Ptr) -> Plan {
        plan_map(
            ADD_ROW_BIAS,
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

    /// `out = a + b` ([`EW_ADD_T`]).
    #[cfg(test)]
    pub(crate) fn plan_add_t(types: u64, n: u64, a: Ptr, b: Ptr, out: Ptr) -> Plan {
        plan_binary_t(EW_ADD_T, types, n, a, b, out)
    }

    /// `out = a ∘ b` for the typed binary kernels ([`EW_ADD_T`], [`EW_MUL_T`]).
    pub(crate) fn plan_binary_t(
        kernel: Kernel,
        types: u64,
        n: u64,
        a: Ptr,
        b: Ptr,
        out: Ptr,
    ) -> Plan {
        let args = vec![
            PArg::U64(types),
            PArg::U64(n),
            PArg::Ptr(a),
            PArg::Ptr(b),
            PArg::Ptr(out),
        ];
        plan_map_t(kernel, n, args)
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
        plan_map_t(ADD_ROW_BIAS_T, n, args)
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
        /// [`KernelError::LengthMismatch`](crate::kernels::KernelError::LengthMismatch) unless
        /// all three buffers hold the same number of f32;
        /// the buffer/stream errors of [`CudaKernelError`](crate::kernels::cuda::CudaKernelError); `out` must not
        /// overlap `a` or `b`.
        pub fn add(
            &self,
            stream: &Stream,
            a: &BufferRef,
            b: &BufferRef,
            out: &BufferRef,
        ) -> Result<()> {
            self.binary("add", EW_ADD, stream, a, b, out)
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
            self.binary("mul", EW_MUL, stream, a, b, out)
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

        /// `out = a + b` elementwise, each operand f32, f16 or bf16 (see the module docs).
        pub(crate) fn add_t(
            &self,
            stream: &Stream,
            a: TBuf<'_>,
            b: TBuf<'_>,
            out: TBuf<'_>,
        ) -> Result<()> {
            self.binary_t("add", EW_ADD_T, stream, a, b, out)
        }

        /// `out = a ⊙ b` elementwise, each operand f32, f16 or bf16.
        pub(crate) fn mul_t(
            &self,
            stream: &Stream,
            a: TBuf<'_>,
            b: TBuf<'_>,
            out: TBuf<'_>,
        ) -> Result<()> {
            self.binary_t("mul", EW_MUL_T, stream, a, b, out)
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
    }
}
