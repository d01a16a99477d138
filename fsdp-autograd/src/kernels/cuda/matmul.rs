//! Matrix products through cuBLAS (`cublasSgemmStridedBatched`, row-major via the transposition
//! trick of [`ColMajorGemm`]).

use cudarc::cublas::sys::cublasOperation_t;
use fsdp_alloc::{BufferRef, Stream};

use super::context::{expect_len, mul, Call, CudaKernels, Dev, Elem};
use super::error::{CudaKernelError, Result};
use super::plan::{ColMajorGemm, Plan, Ptr, Step};

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

/// The cuBLAS parameters of `batch` row-major products `C (m×n) = op(A)·op(B)` with A stored
/// `m×k` (`k×m` if `trans_a`) and B stored `k×n` (`n×k` if `trans_b`), in consecutive batches.
/// Requires `batch, m, n, k > 0` (callers handle empty products).
pub(crate) fn col_major_gemm(
    op: &'static str,
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
    trans_a: bool,
    trans_b: bool,
) -> Result<ColMajorGemm> {
    let t = |b: bool| {
        if b {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        }
    };
    let (mi, ki, ni) = (
        to_i32(op, "m", m)?,
        to_i32(op, "k", k)?,
        to_i32(op, "n", n)?,
    );
    Ok(ColMajorGemm {
        op_first: t(trans_b),
        op_second: t(trans_a),
        m: ni,
        n: mi,
        k: ki,
        // B stored k×n row-major is column-major n×k with ld n; stored n×k: ld k.
        ld_first: if trans_b { ki } else { ni },
        // A stored m×k row-major is column-major k×m with ld k; stored k×m: ld m.
        ld_second: if trans_a { mi } else { ki },
        ldc: ni,
        stride_first: stride(op, k, n)?,
        stride_second: stride(op, m, k)?,
        stride_c: stride(op, m, n)?,
        batch: to_i32(op, "batch", batch)?,
    })
}

/// Appends `batch` products `C = scale·op(A)·op(B) (+ C if accumulate)` on consecutive blocks
/// to `plan`. Empty products do nothing; `k == 0` zeroes C (or leaves it when accumulating), as
/// the CPU kernels do.
#[allow(clippy::too_many_arguments)]
pub(crate) fn plan_gemm(
    plan: &mut Plan,
    op: &'static str,
    (a, b, c): (Ptr, Ptr, Ptr),
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
    trans_a: bool,
    trans_b: bool,
    accumulate: bool,
    scale: f32,
) -> Result<()> {
    if batch == 0 || m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            plan.memset(c, 0, batch * m * n * 4);
        }
        return Ok(());
    }
    let g = col_major_gemm(op, batch, m, k, n, trans_a, trans_b)?;
    plan.steps.push(Step::Gemm {
        g,
        a,
        b,
        c,
        alpha: scale,
        beta: if accumulate { 1.0 } else { 0.0 },
    });
    Ok(())
}

/// Checks `batch` blocks of A (`m·k`), B (`k·n`) and C (`m·n`) f32 and returns the three
/// validated buffers.
#[allow(clippy::too_many_arguments)]
fn operands(
    c: &Call<'_>,
    a: &BufferRef,
    b: &BufferRef,
    out: &BufferRef,
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
) -> Result<(Dev, Dev, Dev)> {
    let op = c.op;
    let (da, db, dc) = (
        c.buf("a", a, Elem::F32)?,
        c.buf("b", b, Elem::F32)?,
        c.buf("c", out, Elem::F32)?,
    );
    let shape = || format!("batch={batch}, m={m}, k={k}, n={n}");
    expect_len(op, "a", da.len, mul(op, batch, mul(op, m, k)?)?, shape)?;
    expect_len(op, "b", db.len, mul(op, batch, mul(op, k, n)?)?, shape)?;
    expect_len(op, "c", dc.len, mul(op, batch, mul(op, m, n)?)?, shape)?;
    c.disjoint(&[("c", out)], &[("a", a), ("b", b)])?;
    Ok((da, db, dc))
}

impl CudaKernels {
    /// `C (m×n) = op(A)·op(B)`, plus `C` if `accumulate` (CPU:
    /// [`cpu::matmul`](crate::kernels::cpu::matmul)): A stored `m×k` (`k×m` if `trans_a`), B
    /// stored `k×n` (`n×k` if `trans_b`), all row-major f32.
    ///
    /// One `cublasSgemmStridedBatched` call with cuBLAS's default math mode (full f32, no TF32)
    /// on a per-stream handle, so results are reproducible on one GPU model and cuBLAS version
    /// (cuBLAS's documented guarantee) but are not bit-identical to the CPU `gemm` crate:
    /// summation order differs, errors are within the usual `k·u·Σ|a||b|` bound.
    ///
    /// # Errors
    /// The CPU kernel's length errors; [`CudaKernelError::TooLarge`] for dimensions above
    /// `i32::MAX`; buffer/stream errors; `c` overlapping `a` or `b`; cuBLAS failures.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        stream: &Stream,
        a: &BufferRef,
        b: &BufferRef,
        c: &BufferRef,
        m: usize,
        k: usize,
        n: usize,
        trans_a: bool,
        trans_b: bool,
        accumulate: bool,
    ) -> Result<()> {
        self.bmm_op(
            "matmul", stream, a, b, c, 1, m, k, n, trans_a, trans_b, accumulate,
        )
    }

    /// `batch` independent [`CudaKernels::matmul`]s on consecutive blocks (CPU:
    /// [`cpu::bmm`](crate::kernels::cpu::bmm)), as one strided-batched cuBLAS call.
    ///
    /// # Errors
    /// As [`CudaKernels::matmul`] (also `batch > i32::MAX`).
    #[allow(clippy::too_many_arguments)]
    pub fn bmm(
        &self,
        stream: &Stream,
        a: &BufferRef,
        b: &BufferRef,
        c: &BufferRef,
        batch: usize,
        m: usize,
        k: usize,
        n: usize,
        trans_a: bool,
        trans_b: bool,
        accumulate: bool,
    ) -> Result<()> {
        self.bmm_op(
            "bmm", stream, a, b, c, batch, m, k, n, trans_a, trans_b, accumulate,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn bmm_op(
        &self,
        op: &'static str,
        stream: &Stream,
        a: &BufferRef,
        b: &BufferRef,
        c: &BufferRef,
        batch: usize,
        m: usize,
        k: usize,
        n: usize,
        trans_a: bool,
        trans_b: bool,
        accumulate: bool,
    ) -> Result<()> {
        let call = self.call(op, stream)?;
        let (da, db, dc) = operands(&call, a, b, c, batch, m, k, n)?;
        let mut plan = Plan::new();
        plan_gemm(
            &mut plan,
            op,
            (Ptr::Dev(da.ptr), Ptr::Dev(db.ptr), Ptr::Dev(dc.ptr)),
            batch,
            m,
            k,
            n,
            trans_a,
            trans_b,
            accumulate,
            1.0,
        )?;
        // SAFETY: `operands` checked that a, b and c hold `batch` consecutive blocks of m·k, k·n
        // and m·n f32 on this device and that c overlaps neither a nor b; the plan's gemm (or
        // memset of C) describes exactly those blocks.
        unsafe { call.exec(&plan) }.map(drop)
    }
}
