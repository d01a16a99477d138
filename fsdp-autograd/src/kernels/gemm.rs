//! Matrix products: the [`Gemm`] shape and the [`MatMul`] op (`c (+)= op(a) · op(b)`, batched).
//! CPU: [`cpu::matmul`] / [`cpu::bmm`] (the `gemm` crate); CUDA: cuBLAS, f32 (TF32 when
//! allowed) or f16/bf16 operands straight to `GemmStridedBatchedEx`.

use fsdp_alloc::Stream;

use super::cpu;
/// The CPU products' thread setting (`gemm`'s parallelism), re-exported with the op.
pub use super::cpu::{matmul_parallelism, matmul_threads, set_matmul_threads};
use super::op::{mul, Check, Op, Spec};
use super::operand::Operand;
use crate::error::Result;
use crate::launch::launch_f32;
#[cfg(feature = "cuda")]
pub use gpu::GemmPrecision;

/// Batched matrix product `c[i] (+)= op(a[i]) · op(b[i])` for `i < batch`, row-major;
/// `op(a)` is `m × k`, `op(b)` is `k × n` (a shared right operand is folded into `m` by the
/// caller). `accumulate` adds into `c`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gemm {
    /// Number of matrix products.
    pub batch: usize,
    /// Rows of `op(a)` and `c`.
    pub m: usize,
    /// Inner dimension.
    pub k: usize,
    /// Columns of `op(b)` and `c`.
    pub n: usize,
    /// `a` is stored `k × m` (transposed).
    pub trans_a: bool,
    /// `b` is stored `n × k` (transposed).
    pub trans_b: bool,
    /// Add into `c` instead of overwriting it.
    pub accumulate: bool,
}

impl Gemm {
    /// `batch` products `m×k · k×n`, neither operand transposed, overwriting `c`.
    pub fn new(batch: usize, m: usize, k: usize, n: usize) -> Gemm {
        Gemm {
            batch,
            m,
            k,
            n,
            trans_a: false,
            trans_b: false,
            accumulate: false,
        }
    }

    /// With `a` and `b` stored transposed as given.
    pub fn transposed(self, trans_a: bool, trans_b: bool) -> Gemm {
        Gemm {
            trans_a,
            trans_b,
            ..self
        }
    }

    /// Adding into `c` if `accumulate`.
    pub fn accumulating(self, accumulate: bool) -> Gemm {
        Gemm { accumulate, ..self }
    }
}

/// [`Gemm`]: `c (+)= op(a) · op(b)` (float operands).
#[derive(Debug, Clone, Copy)]
pub struct MatMul<'a> {
    /// The product.
    pub g: Gemm,
    /// Left operand.
    pub a: &'a Operand,
    /// Right operand.
    pub b: &'a Operand,
    /// Output.
    pub c: &'a Operand,
}

impl Op for MatMul<'_> {
    fn name(&self) -> &'static str {
        "gemm"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, g) = (self.name(), self.g);
        let (mk, kn, mn) = (mul(op, g.m, g.k)?, mul(op, g.k, g.n)?, mul(op, g.m, g.n)?);
        let table = [
            Spec::float("a", self.a, mul(op, g.batch, mk)?),
            Spec::float("b", self.b, mul(op, g.batch, kn)?),
            Spec::float("c", self.c, mul(op, g.batch, mn)?),
        ];
        c.args(op, || format!("{g:?}"), &table)?;
        Ok(g.batch > 0 && mn > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let g = self.g;
        let (a, b, c) = (self.a, self.b, self.c);
        launch_f32(
            s,
            "matmul",
            [a, b],
            [c],
            g.accumulate,
            move |[a, b], [c]| {
                let (m, k, n, ta, tb, acc) = (g.m, g.k, g.n, g.trans_a, g.trans_b, g.accumulate);
                if g.batch == 1 {
                    cpu::matmul(a, b, c, m, k, n, ta, tb, acc)
                } else {
                    cpu::bmm(a, b, c, g.batch, m, k, n, ta, tb, acc)
                }
            },
        );
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &super::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use super::cuda::allow_tf32;
        use super::cuda::launcher::err;
        use gpu::direct_gemm;
        use gpu::GemmPrecision;
        let (g, k) = (self.g, b.kernels());
        let tf32 = allow_tf32();
        if let Some(p) = direct_gemm(self.a.dtype, self.b.dtype, self.c.dtype, tf32) {
            // f32 (maybe TF32), or f16/bf16 on the tensor cores with f32 accumulation, reading
            // and writing the operands as they are.
            let (a, bb, c) = (&self.a.buf, &self.b.buf, &self.c.buf);
            return k.gemm_ex(s, &g, p, a, bb, c).map_err(err("matmul"));
        }
        let mut f = b.scope("matmul", s);
        let (a, bb, c) = (
            f.input(self.a)?,
            f.input(self.b)?,
            f.output(self.c, g.accumulate)?,
        );
        let p = GemmPrecision {
            tf32,
            ..GemmPrecision::F32
        };
        k.gemm_ex(s, &g, p, &a, &bb, &c).map_err(err("matmul"))?;
        f.finish()
    }
}

/// The CUDA side of the product (feature `cuda`): matrix products through cuBLAS
/// (`cublasSgemmStridedBatched` for plain f32, `cublasGemmStridedBatchedEx` for TF32 and for
/// f16/bf16 operands on the tensor cores with f32 accumulation), row-major via the
/// transposition trick of `ColMajorGemm`, as a plan, and the
/// [`CudaKernels`](crate::kernels::cuda::CudaKernels) methods.
#[cfg(feature = "cuda")]
pub(crate) mod gpu {

    use cudarc::cublas::sys::cublasOperation_t;
    use fsdp_alloc::{BufferRef, DType, Stream};

    use super::Gemm;
    use crate::kernels::cuda::context::{expect_len, mul, CudaKernels, Elem};
    use crate::kernels::cuda::error::{CudaKernelError, Result};
    use crate::kernels::cuda::plan::{ColMajorGemm, GemmType, GemmTypes, Plan, Ptr, Step};
    use crate::kernels::KernelError;

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

    /// Appends the f32 products of `g`, scaled: `C = scale·op(A)·op(B) (+ C if g.accumulate)` on
    /// consecutive blocks, to `plan`. Empty products do nothing; `k == 0` zeroes C (or leaves it
    /// when accumulating), as the CPU kernels do.
    pub(crate) fn plan_gemm(
        plan: &mut Plan,
        op: &'static str,
        ptrs: (Ptr, Ptr, Ptr),
        g: &Gemm,
        scale: f32,
    ) -> Result<()> {
        plan_gemm_typed(plan, op, ptrs, g, scale, GemmTypes::F32)
    }

    /// [`plan_gemm`] with operand types and math mode `types` (C's zeroing for `k == 0` covers
    /// C's element size).
    pub(crate) fn plan_gemm_typed(
        plan: &mut Plan,
        op: &'static str,
        (a, b, c): (Ptr, Ptr, Ptr),
        g: &Gemm,
        scale: f32,
        types: GemmTypes,
    ) -> Result<()> {
        if g.batch == 0 || g.m == 0 || g.n == 0 {
            return Ok(());
        }
        if g.k == 0 {
            if !g.accumulate {
                plan.memset(c, 0, g.batch * g.m * g.n * types.c.size());
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
            types,
        });
        Ok(())
    }

    /// The cuBLAS element type of a float dtype.
    fn gemm_type(op: &'static str, arg: &str, d: DType) -> Result<GemmType> {
        match d {
            DType::F32 => Ok(GemmType::F32),
            DType::F16 => Ok(GemmType::F16),
            DType::BF16 => Ok(GemmType::Bf16),
            other => Err(KernelError::InvalidShape {
                op,
                reason: format!(
                    "`{arg}` of a matrix product must be f32, f16 or bf16, not {other}"
                ),
            }
            .into()),
        }
    }

    /// The element types and math mode of a [`CudaKernels::gemm_ex`] call.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct GemmPrecision {
        /// Element type of A and B: `f32`, `f16` or `bf16`.
        pub inputs: DType,
        /// Element type of C: `f32`, or the inputs' half type.
        pub output: DType,
        /// With f32 inputs: let cuBLAS round them to TF32 on the tensor cores
        /// (`CUBLAS_COMPUTE_32F_FAST_TF32`, like PyTorch's `allow_tf32`). Ignored for half inputs,
        /// which always use the tensor cores.
        pub tf32: bool,
    }

    impl GemmPrecision {
        /// Plain f32: `cublasSgemmStridedBatched` in full precision (what [`CudaKernels::gemm`]
        /// does).
        pub const F32: GemmPrecision = GemmPrecision {
            inputs: DType::F32,
            output: DType::F32,
            tf32: false,
        };

        /// The plan-level types, or an error for an unsupported combination.
        pub(crate) fn types(self, op: &'static str) -> Result<GemmTypes> {
            let ab = gemm_type(op, "a/b", self.inputs)?;
            let c = gemm_type(op, "c", self.output)?;
            if c != GemmType::F32 && c != ab {
                return Err(KernelError::InvalidShape {
                    op,
                    reason: format!(
                        "a {} product cannot write {} (cuBLAS writes f32 or the inputs' type)",
                        self.inputs, self.output
                    ),
                }
                .into());
            }
            Ok(GemmTypes {
                ab,
                c,
                tf32: self.tf32 && ab == GemmType::F32,
            })
        }
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
            self.gemm_ex(stream, g, GemmPrecision::F32, a, b, c)
        }

        /// [`CudaKernels::gemm`] with the element types and math mode of `p`: A and B hold
        /// `p.inputs` (f32, f16 or bf16), C holds `p.output` (f32 or the inputs' half type);
        /// products accumulate in f32 (`CUBLAS_COMPUTE_32F`). f16/bf16 inputs, and f32 inputs with
        /// `p.tf32`, go through `cublasGemmStridedBatchedEx` (tensor cores; TF32 rounds f32 inputs
        /// to 10 mantissa bits, so results differ from the plain f32 product by about `2⁻¹¹`
        /// relative per term); plain f32 goes through `cublasSgemmStridedBatched`. With half C the
        /// f32 result (`alpha·AB + beta·C`) is rounded once to C's type.
        ///
        /// # Errors
        /// As [`CudaKernels::gemm`], plus [`KernelError::InvalidShape`] for a non-float type or a
        /// half C of another type than A and B.
        pub fn gemm_ex(
            &self,
            stream: &Stream,
            g: &Gemm,
            p: GemmPrecision,
            a: &BufferRef,
            b: &BufferRef,
            c: &BufferRef,
        ) -> Result<()> {
            let op = if g.batch == 1 { "matmul" } else { "bmm" };
            let types = p.types(op)?;
            let call = self.call(op, stream)?;
            let elem = |t: GemmType| {
                if t == GemmType::F32 {
                    Elem::F32
                } else {
                    Elem::U16
                }
            };
            let (da, db, dc) = (
                call.buf("a", a, elem(types.ab))?,
                call.buf("b", b, elem(types.ab))?,
                call.buf("c", c, elem(types.c))?,
            );
            let (batch, m, k, n) = (g.batch, g.m, g.k, g.n);
            let shape = || format!("batch={batch}, m={m}, k={k}, n={n}");
            expect_len(op, "a", da.len, mul(op, batch, mul(op, m, k)?)?, shape)?;
            expect_len(op, "b", db.len, mul(op, batch, mul(op, k, n)?)?, shape)?;
            expect_len(op, "c", dc.len, mul(op, batch, mul(op, m, n)?)?, shape)?;
            call.disjoint(&[("c", c)], &[("a", a), ("b", b)])?;
            let mut plan = Plan::new();
            let ptrs = (da.as_ptr(), db.as_ptr(), dc.as_ptr());
            plan_gemm_typed(&mut plan, op, ptrs, g, 1.0, types)?;
            // SAFETY: a, b and c hold `batch` consecutive blocks of m·k, k·n and m·n elements of the
            // types in `types` on this device (checked above) and c overlaps neither a nor b; the
            // plan's gemm (or memset of C) describes exactly those blocks.
            unsafe { call.exec(&plan) }.map(drop)
        }
    }

    /// The cuBLAS call that takes a product's operands as they are: all f32, or A and B of one
    /// half type with C of that type or f32. Mixed operand types return `None` (they go through
    /// f32 temporaries).
    pub(crate) fn direct_gemm(a: DType, b: DType, c: DType, tf32: bool) -> Option<GemmPrecision> {
        let half = |d: DType| d == DType::F16 || d == DType::BF16;
        let ok = match (a, c) {
            (DType::F32, DType::F32) => b == DType::F32,
            (x, y) if half(x) => b == x && (y == x || y == DType::F32),
            _ => false,
        };
        ok.then_some(GemmPrecision {
            inputs: a,
            output: c,
            tf32,
        })
    }
}
