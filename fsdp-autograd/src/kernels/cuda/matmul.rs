//! Matrix products through cuBLAS (`cublasSgemmStridedBatched`, row-major via the transposition
//! trick of [`ColMajorGemm`]).

use cudarc::cublas::sys::cublasOperation_t;
use fsdp_alloc::{BufferRef, Stream};

use super::context::{expect_len, mul, CudaKernels, Elem};
use super::error::{CudaKernelError, Result};
use super::plan::{ColMajorGemm, Plan, Ptr, Step};
use crate::kernels::backend::Gemm;

fn to_i32(op: &'static str, what: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| CudaKernelError::TooLarge {
        op,
        what,
        value: v as u64,
        limit: i32::MAX as u64,
    })
}

fn stride(op: &'static str, a: usize, b: usize) -> Result<i64> {
    a.checked_mul(b)
        .and_then(|v| i64::try_from(v).ok())
        .ok_or(CudaKernelError::TooLarge {
            op,
            what: "matrix elements",
            value: (a as u64).saturating_mul(b as u64),
            limit: i64::MAX as u64,
        })
}

/// The cuBLAS parameters of `g.batch` row-major products `C (m×n) = op(A)·op(B)` with A stored
/// `m×k` (`k×m` if `trans_a`) and B stored `k×n` (`n×k` if `trans_b`), in consecutive batches.
/// Requires `batch, m, n, k > 0` (callers handle empty products).
pub(crate) fn col_major_gemm(op: &'static str, g: &Gemm) -> Result<ColMajorGemm> {
    let t = |b: bool| {
        if b {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        }
    };
    let (m, k, n) = (g.m, g.k, g.n);
    let (mi, ki, ni) = (
        to_i32(op, "m", m)?,
        to_i32(op, "k", k)?,
        to_i32(op, "n", n)?,
    );
    Ok(ColMajorGemm {
        op_first: t(g.trans_b),
        op_second: t(g.trans_a),
        m: ni,
        n: mi,
        k: ki,
        // B stored k×n row-major is column-major n×k with ld n; stored n×k: ld k.
        ld_first: if g.trans_b { ki } else { ni },
        // A stored m×k row-major is column-major k×m with ld k; stored k×m: ld m.
        ld_second: if g.trans_a { mi } else { ki },
        ldc: ni,
        stride_first: stride(op, k, n)?,
        stride_second: stride(op, m, k)?,
        stride_c: stride(op, m, n)?,
        batch: to_i32(op, "batch", g.batch)?,
    })
}

/// Appends the products of `g`, scaled: `C = scale·op(A)·op(B) (+ C if g.accumulate)` on
/// consecutive blocks, to `plan`. Empty products do nothing; `k == 0` zeroes C (or leaves it
/// when accumulating), as the CPU kernels do.
pub(crate) fn plan_gemm(
    plan: &mut Plan,
    op: &'static str,
    (a, b, c): (Ptr, Ptr, Ptr),
    g: &Gemm,
    scale: f32,
) -> Result<()> {
    if g.batch == 0 || g.m == 0 || g.n == 0 {
        return Ok(());
    }
    if g.k == 0 {
        if !g.accumulate {
            plan.memset(c, 0, g.batch * g.m * g.n * 4);
        }
        return Ok(());
    }
    plan.steps.push(Step::Gemm {
        g: col_major_gemm(op, g)?,
        a,
        b,
        c,
        alpha: scale,
        beta: if g.accumulate { 1.0 } else { 0.0 },
    });
    Ok(())
}

impl CudaKernels {
    /// `g.batch` products `C (m×n) = op(A)·op(B)`, plus `C` if `g.accumulate`, on consecutive
    /// blocks (CPU: [`cpu::matmul`](crate::kernels::cpu::matmul) and
    /// [`cpu::bmm`](crate::kernels::cpu::bmm)): A stored `m×k` (`k×m` if `trans_a`), B stored
    /// `k×n` (`n×k` if `trans_b`), all row-major f32. Errors name the operation `matmul` for a
    /// single product and `bmm` for a batch.
    ///
    /// One `cublasSgemmStridedBatched` call with cuBLAS's default math mode (full f32, no TF32)
    /// on a per-stream handle, so results are reproducible on one GPU model and cuBLAS version
    /// (cuBLAS's documented guarantee) but are not bit-identical to the CPU `gemm` crate:
    /// summation order differs, errors are within the usual `k·u·Σ|a||b|` bound.
    ///
    /// # Errors
    /// The CPU kernel's length errors; [`CudaKernelError::TooLarge`] for dimensions (or a batch)
    /// above `i32::MAX`; buffer/stream errors; `c` overlapping `a` or `b`; cuBLAS failures.
    pub fn gemm(
        &self,
        stream: &Stream,
        g: &Gemm,
        a: &BufferRef,
        b: &BufferRef,
        c: &BufferRef,
    ) -> Result<()> {
        let op = if g.batch == 1 { "matmul" } else { "bmm" };
        let call = self.call(op, stream)?;
        let (da, db, dc) = (
            call.buf("a", a, Elem::F32)?,
            call.buf("b", b, Elem::F32)?,
            call.buf("c", c, Elem::F32)?,
        );
        let (batch, m, k, n) = (g.batch, g.m, g.k, g.n);
        let shape = || format!("batch={batch}, m={m}, k={k}, n={n}");
        expect_len(op, "a", da.len, mul(op, batch, mul(op, m, k)?)?, shape)?;
        expect_len(op, "b", db.len, mul(op, batch, mul(op, k, n)?)?, shape)?;
        expect_len(op, "c", dc.len, mul(op, batch, mul(op, m, n)?)?, shape)?;
        call.disjoint(&[("c", c)], &[("a", a), ("b", b)])?;
        let mut plan = Plan::new();
        let ptrs = (da.as_ptr(), db.as_ptr(), dc.as_ptr());
        plan_gemm(&mut plan, op, ptrs, g, 1.0)?;
        // SAFETY: a, b and c hold `batch` consecutive blocks of m·k, k·n and m·n f32 on this
        // device (checked above) and c overlaps neither a nor b; the plan's gemm (or memset of
        // C) describes exactly those blocks.
        unsafe { call.exec(&plan) }.map(drop)
    }
}
