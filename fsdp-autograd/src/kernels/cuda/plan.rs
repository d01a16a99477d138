//! Launch plans: what an op enqueues, as data.
//!
//! Every op validates its buffers, then builds a [`Plan`] with a pure function of the sizes and
//! device addresses (the `plan_*` functions next to each op), and executes it on its stream
//! ([`super::context::Call::exec`]). Keeping the orchestration (kernel sequence, grid sizes,
//! argument order, scratch sizes, cuBLAS parameters) in plain data lets the tests run the very
//! same plans through the host emulator in `emu/` on machines without a GPU.

use super::desc::{Elem, ViewDesc};
use super::kernel::{ArgKind, Kernel, BLOCK, MAX_GRID};
use cudarc::cublas::sys::cublasOperation_t;

/// A device address: a caller's buffer, or a byte offset into one of the plan's scratch slots.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Ptr {
    /// An address inside a validated caller buffer.
    Dev(u64),
    /// `offset` bytes into scratch slot `slot`.
    Scratch {
        /// Index into [`Plan::scratch`].
        slot: usize,
        /// Byte offset.
        offset: u64,
    },
}

impl Ptr {
    /// The start of scratch slot `slot`.
    pub(crate) fn scratch(slot: usize) -> Ptr {
        Ptr::Scratch { slot, offset: 0 }
    }
}

/// One kernel parameter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum PArg {
    /// `u64`.
    U64(u64),
    /// `float`.
    F32(f32),
    /// `double`.
    F64(f64),
    /// A device address.
    Ptr(Ptr),
    /// A `View` by value.
    View(ViewDesc),
}

impl PArg {
    /// The parameter kind (checked against [`Kernel::signature`] before launching).
    pub(crate) fn kind(&self) -> ArgKind {
        match self {
            PArg::U64(_) => ArgKind::U64,
            PArg::F32(_) => ArgKind::F32,
            PArg::F64(_) => ArgKind::F64,
            PArg::Ptr(_) => ArgKind::Ptr,
            PArg::View(_) => ArgKind::View,
        }
    }
}

/// A row-major matrix product expressed as one column-major cuBLAS `gemm` call.
///
/// Row-major `C (m×n) = op(A) · op(B)` is column-major `Cᵀ (n×m) = op(B)ᵀ · op(A)ᵀ`, and a
/// row-major matrix read column-major is its transpose. So cuBLAS gets B's buffer as its first
/// operand and A's as its second, with the row-major transposition flags unchanged and the
/// leading dimensions of the stored (row-major) matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ColMajorGemm {
    /// `transa` of the call (applies to the first operand, B's buffer).
    pub(crate) op_first: cublasOperation_t,
    /// `transb` of the call (applies to the second operand, A's buffer).
    pub(crate) op_second: cublasOperation_t,
    /// cuBLAS `m` (= row-major `n`).
    pub(crate) m: i32,
    /// cuBLAS `n` (= row-major `m`).
    pub(crate) n: i32,
    /// cuBLAS `k`.
    pub(crate) k: i32,
    /// Leading dimension of the first operand (B's buffer).
    pub(crate) ld_first: i32,
    /// Leading dimension of the second operand (A's buffer).
    pub(crate) ld_second: i32,
    /// Leading dimension of C.
    pub(crate) ldc: i32,
    /// Elements between consecutive batches of B's buffer.
    pub(crate) stride_first: i64,
    /// Elements between consecutive batches of A's buffer.
    pub(crate) stride_second: i64,
    /// Elements between consecutive batches of C.
    pub(crate) stride_c: i64,
    /// Number of batches.
    pub(crate) batch: i32,
}

/// The element type of a matrix-product operand as cuBLAS sees it (`cudaDataType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GemmType {
    /// `CUDA_R_32F`.
    F32,
    /// `CUDA_R_16F`.
    F16,
    /// `CUDA_R_16BF`.
    Bf16,
}

impl GemmType {
    /// Bytes per element.
    pub(crate) fn size(self) -> usize {
        match self {
            GemmType::F32 => 4,
            GemmType::F16 | GemmType::Bf16 => 2,
        }
    }
}

/// Element types and math mode of one [`Step::Gemm`]: A and B of type `ab`, C of type `c`,
/// always accumulated in f32 (`CUBLAS_COMPUTE_32F`), or with `tf32` (f32 operands only)
/// `CUBLAS_COMPUTE_32F_FAST_TF32` (inputs rounded to TF32 on the tensor cores).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GemmTypes {
    /// Type of A and B.
    pub(crate) ab: GemmType,
    /// Type of C.
    pub(crate) c: GemmType,
    /// TF32 tensor-core math for f32 operands.
    pub(crate) tf32: bool,
}

impl GemmTypes {
    /// All f32, full-precision math: `cublasSgemmStridedBatched`.
    pub(crate) const F32: GemmTypes = GemmTypes {
        ab: GemmType::F32,
        c: GemmType::F32,
        tf32: false,
    };

    /// Whether this is the plain f32 product (`cublasSgemmStridedBatched`); everything else goes
    /// through `cublasGemmStridedBatchedEx`.
    pub(crate) fn is_plain_f32(self) -> bool {
        self == GemmTypes::F32
    }
}

/// One enqueued operation.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Step {
    /// `memset(dst, byte, bytes)`.
    Memset {
        /// Destination.
        dst: Ptr,
        /// Fill byte.
        byte: u8,
        /// Length in bytes.
        bytes: usize,
    },
    /// Device-to-device copy of `bytes`.
    Copy {
        /// Destination.
        dst: Ptr,
        /// Source.
        src: Ptr,
        /// Length in bytes.
        bytes: usize,
    },
    /// A kernel launch with `grid` blocks of `BLOCK` threads.
    Launch {
        /// The kernel.
        kernel: Kernel,
        /// Number of blocks.
        grid: u32,
        /// Its parameters.
        args: Vec<PArg>,
    },
    /// `C = alpha·op(A)·op(B) + beta·C` for row-major A, B, C (see [`ColMajorGemm`]).
    Gemm {
        /// The cuBLAS parameters.
        g: ColMajorGemm,
        /// A's buffer (cuBLAS's second operand).
        a: Ptr,
        /// B's buffer (cuBLAS's first operand).
        b: Ptr,
        /// C.
        c: Ptr,
        /// Scale of the product.
        alpha: f32,
        /// Scale of the old C (0: C is not read).
        beta: f32,
        /// Element types and math mode.
        types: GemmTypes,
    },
}

/// Scratch memory a plan needs and the steps it enqueues, in order.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Plan {
    /// Scratch slots: element count and type of each.
    pub(crate) scratch: Vec<(usize, Elem)>,
    /// The steps.
    pub(crate) steps: Vec<Step>,
}

impl Plan {
    /// An empty plan.
    pub(crate) fn new() -> Plan {
        Plan::default()
    }

    /// Adds a scratch slot of `count` elements of `elem`; returns its index.
    pub(crate) fn scratch(&mut self, count: usize, elem: Elem) -> usize {
        self.scratch.push((count, elem));
        self.scratch.len() - 1
    }

    /// Appends a kernel launch.
    pub(crate) fn launch(&mut self, kernel: Kernel, grid: u32, args: Vec<PArg>) {
        self.steps.push(Step::Launch { kernel, grid, args });
    }

    /// Appends a memset.
    pub(crate) fn memset(&mut self, dst: Ptr, byte: u8, bytes: usize) {
        if bytes > 0 {
            self.steps.push(Step::Memset { dst, byte, bytes });
        }
    }

    /// Appends a device copy.
    pub(crate) fn copy(&mut self, dst: Ptr, src: Ptr, bytes: usize) {
        if bytes > 0 {
            self.steps.push(Step::Copy { dst, src, bytes });
        }
    }
}

/// A grid for `n` grid-strided work items.
pub(crate) fn grid_for(n: u64) -> u32 {
    n.div_ceil(BLOCK as u64).clamp(1, MAX_GRID as u64) as u32
}

/// A grid for `rows` row-looping blocks.
pub(crate) fn grid_rows(rows: u64) -> u32 {
    rows.clamp(1, MAX_GRID as u64) as u32
}

/// One grid-strided launch over `n` elements (nothing for `n == 0`).
pub(crate) fn plan_map(kernel: Kernel, n: u64, args: Vec<PArg>) -> Plan {
    let mut plan = Plan::new();
    if n > 0 {
        plan.launch(kernel, grid_for(n), args);
    }
    plan
}

/// One block per row of a row-wise kernel (nothing for zero rows).
pub(crate) fn plan_rows(kernel: Kernel, rows: u64, args: Vec<PArg>) -> Plan {
    let mut plan = Plan::new();
    if rows > 0 {
        plan.launch(kernel, grid_rows(rows), args);
    }
    plan
}

/// Columns per block of the column reductions (`COL_GROUP` in `common.cu`, checked by a test):
/// one 32-byte sector of an f32 row.
pub(crate) const COL_GROUP: u64 = 8;

/// The grid of a column reduction (`col_sums`, `layer_norm_bwd_params`): one block per group of
/// [`COL_GROUP`] columns (4096×768 gets 96 blocks, ×3072 gets 384), capped at the grid limit
/// (the blocks loop over the groups).
pub(crate) fn grid_col_groups(cols: u64) -> u32 {
    cols.div_ceil(COL_GROUP).clamp(1, MAX_GRID as u64) as u32
}

/// Number of partial sums for `n` elements: a function of `n` only, so the summation tree (and
/// the result) is the same on every call.
pub(crate) fn sum_parts(n: u64) -> u32 {
    n.div_ceil(BLOCK as u64 * 8).clamp(1, 1024) as u32
}
