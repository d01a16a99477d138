//! The kernel-backend seam: the one trait through which [`Tensor`](crate::Tensor) operations reach
//! their kernels, whatever the device.
//!
//! - [`Backend`] is implemented by [`CpuBackend`](super::CpuBackend) (the `kernels::cpu` functions launched on CPU
//!   streams) and by [`CudaBackend`](super::CudaBackend) (the `kernels::cuda` kernels enqueued on CUDA streams; with
//!   the `cuda` feature off it exists too and every constructor returns
//!   [`AutogradError::CudaNotBuilt`]).
//! - Each kernel has a *shape struct* ([`Gemm`], [`Rows`], [`LayerNormShape`], …) instead of a
//!   long list of sizes, and [`Operand`]s: a tensor's elements as a memory range plus a dtype.
//! - A [`Launch`] names one kernel call: the kernel, its shape struct and its operands by name.
//! - [`Kernels`] is the front the tensor layer calls: [`Kernels::launch`] checks every operand
//!   against the shape struct (element counts, dtypes, devices) **once**, here, from one table
//!   per launch, then hands the validated launch to the device's backend. Backends may assume
//!   their arguments are consistent.
//!
//! Backend methods *launch* work: they return once it is queued on the stream (CPU: a closure on
//! the stream's worker; CUDA: kernels on the CUDA stream). Errors that can only be seen while the
//! work runs fail the stream and surface at the next synchronization.
//!
//! ```
//! use fsdp_alloc::{DType, Device};
//! use fsdp_autograd::kernels::backend::{Gemm, Kernels, Launch};
//! use fsdp_autograd::Tensor;
//!
//! let dev = Device::cpu(0);
//! let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2], &dev)?;
//! let c = Tensor::zeros(&[2, 2], DType::F32, &dev)?;
//! let k = Kernels::for_device(&dev)?;
//! let g = Gemm { batch: 1, m: 2, k: 2, n: 2, trans_a: false, trans_b: false, accumulate: false };
//! let (ao, co) = (a.operand()?, c.operand()?);
//! k.launch(dev.default_stream(), &Launch::Gemm { g, a: &ao, b: &ao, c: &co })?;
//! assert_eq!(c.to_vec::<f32>()?, vec![7.0, 10.0, 15.0, 22.0]);
//! # Ok::<(), fsdp_autograd::AutogradError>(())
//! ```

use std::sync::Arc;

use fsdp_alloc::{BufferRef, DType, DeviceId, Stream};

use super::cpu::optim::{AdamCoeffs, LambCoeffs, SgdRule};
use super::{Gelu, KernelError};
use crate::error::{AutogradError, Result};

/// A kernel operand: a tensor's elements (contiguous, row-major, or the span of a strided view
/// for the layout kernels) as a range of device memory, and their element type.
#[derive(Clone, Debug)]
pub struct Operand {
    /// The memory range.
    pub buf: BufferRef,
    /// The element type of the range.
    pub dtype: DType,
}

impl Operand {
    /// Number of elements in the range.
    pub fn numel(&self) -> usize {
        self.buf.len() / self.dtype.size()
    }
}

/// What [`Backend::read`] hands the bytes to.
pub type ReadFn = Box<dyn FnOnce(&[u8]) + Send>;

/// Binary elementwise operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinaryOp {
    /// `a + b`.
    Add,
    /// `a · b`.
    Mul,
}

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

/// A row-major matrix of `rows × cols` (row-wise kernels, column sums, row broadcasts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rows {
    /// Number of rows.
    pub rows: usize,
    /// Number of columns (positive).
    pub cols: usize,
}

/// Layer normalization over the last dimension of `rows × cols`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerNormShape {
    /// The matrix.
    pub rows: Rows,
    /// Added to the variance.
    pub eps: f32,
}

/// Embedding lookup of `ids` (`i64`) into a `vocab × dim` table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbeddingShape {
    /// Number of ids.
    pub ids: usize,
    /// Table rows.
    pub vocab: usize,
    /// Table columns.
    pub dim: usize,
}

/// Causal attention over `[batch, heads, t, d]` tensors (or the packed layout, see
/// [`AttentionLayout`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attention {
    /// Batch size.
    pub batch: usize,
    /// Heads.
    pub heads: usize,
    /// Sequence length.
    pub t: usize,
    /// Head dimension.
    pub d: usize,
    /// How q, k, v, out and their gradients are laid out.
    pub layout: AttentionLayout,
}

/// The memory layout of causal attention's operands (the statistics are always
/// `[batch, heads, t(, t)]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionLayout {
    /// q, k, v, out, dout, dq, dk, dv: each its own contiguous `[batch, heads, t, d]` tensor.
    #[default]
    Heads,
    /// The layout of a GPT's qkv projection, without head split/merge copies: q, k and v are
    /// each the *whole* `[batch, t, 3, heads, d]` tensor (the same operand three times; the
    /// kernels read the query, key and value slices `[.., 0|1|2, ..]`), out and dout are
    /// `[batch, t, heads, d]` (= `[batch, t, heads·d]`), and dq, dk, dv are each the whole
    /// `[batch, t, 3, heads, d]` gradient (the same operand three times; each slice is written
    /// by exactly one of them, so together they write every element).
    Packed,
}

/// What causal attention keeps for its backward; the backend decides
/// ([`Kernels::attention_save`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionSave {
    /// The probabilities, `[batch, heads, t, t]` `f32` (the unfused kernels: CPU, and CUDA
    /// with [`set_fused_attention(false)`](crate::kernels::cuda::set_fused_attention) or large
    /// head dimensions).
    Probs,
    /// The log-sum-exp of each query's scaled scores, `[batch, heads, t]` `f32`, plus the
    /// forward's output (the fused flash-style kernels on CUDA).
    Lse,
}

impl AttentionSave {
    /// The shape of the saved statistics tensor for `a`.
    pub fn shape(self, a: &Attention) -> Vec<usize> {
        match self {
            AttentionSave::Probs => vec![a.batch, a.heads, a.t, a.t],
            AttentionSave::Lse => vec![a.batch, a.heads, a.t],
        }
    }
}

/// The statistics a causal attention forward writes (see [`AttentionSave`]).
#[derive(Debug, Clone, Copy)]
pub enum AttentionStats<'a> {
    /// The probabilities (`f32`, `[batch, heads, t, t]`, exactly 0 above the diagonal).
    Probs(&'a Operand),
    /// The per-query log-sum-exp of the scaled scores (`f32`, `[batch, heads, t]`).
    Lse(&'a Operand),
}

/// What a causal attention backward reads from its forward (see [`AttentionSave`]).
#[derive(Debug, Clone, Copy)]
pub enum AttentionSaved<'a> {
    /// The forward's probabilities.
    Probs(&'a Operand),
    /// The forward's log-sum-exp and output.
    Lse {
        /// Log-sum-exp (`f32`, `[batch, heads, t]`).
        lse: &'a Operand,
        /// The forward's output (`[batch, heads, t, d]`).
        out: &'a Operand,
    },
}

/// A strided view: `shape` indexed with `strides` from element `offset` of an operand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct View {
    /// The index space.
    pub shape: Vec<usize>,
    /// Element strides per dimension (0 broadcasts).
    pub strides: Vec<usize>,
    /// Element offset of index 0.
    pub offset: usize,
}

impl View {
    /// The contiguous row-major view of `shape` at `offset`.
    pub fn contiguous(shape: &[usize], offset: usize) -> View {
        View {
            shape: shape.to_vec(),
            strides: crate::launch::contiguous_strides(shape),
            offset,
        }
    }

    /// Number of elements in the index space.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// One past the largest element index the view touches (0 for an empty view), or `None` on
    /// overflow.
    fn end(&self) -> Option<usize> {
        if self.shape.contains(&0) {
            return Some(0);
        }
        self.shape
            .iter()
            .zip(&self.strides)
            .try_fold(self.offset.checked_add(1)?, |acc, (&n, &s)| {
                acc.checked_add((n - 1).checked_mul(s)?)
            })
    }

    /// True if the view is the contiguous row-major layout of its shape.
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1usize;
        for (&n, &s) in self.shape.iter().zip(&self.strides).rev() {
            if n != 1 && s != expected {
                return false;
            }
            expected *= n;
        }
        true
    }
}

/// A general broadcast-undoing sum: `out[t(i)] += x[i]` over `x`'s index space `shape`, with
/// `t(i) = Σ i·target_strides` (0 where the target broadcasts); `out` is overwritten.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SumTo {
    /// The index space of `x` (contiguous).
    pub shape: Vec<usize>,
    /// Strides into `out` per dimension of `shape`.
    pub target_strides: Vec<usize>,
    /// Elements of `out`.
    pub out_numel: usize,
}

/// One piece of a [`Launch::SumSquares`]: elements `start..start + len` of input `input`,
/// whose squares are added to output `out`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SqPiece {
    /// Index into the launch's inputs.
    pub input: usize,
    /// First element of the piece in that input.
    pub start: usize,
    /// Number of elements.
    pub len: usize,
    /// Index of the output element the squares are added to.
    pub out: usize,
}

/// One kernel launch through the seam: which kernel, its shape struct and sizes, and its
/// operands by name. [`Kernels::launch`] checks it, then hands it to the device's
/// [`Backend::launch`].
///
/// Float operands may be `f32`, `f16` or `bf16` (computed in `f32`); ids and targets are `i64`;
/// layer-norm statistics, attention probabilities and log-sum-exps are `f32`.
#[derive(Debug, Clone, Copy)]
pub enum Launch<'a> {
    /// [`Gemm`]: `c (+)= op(a) · op(b)`.
    Gemm {
        /// The product.
        g: Gemm,
        /// Left operand.
        a: &'a Operand,
        /// Right operand.
        b: &'a Operand,
        /// Output.
        c: &'a Operand,
    },
    /// `out[r, :] = a[r, :] op b[r % b_rows, :]` where `b` has `rows.cols` elements (one row,
    /// broadcast) or as many as `a`.
    Binary {
        /// The operation.
        op: BinaryOp,
        /// The shape of `a` and `out`.
        rows: Rows,
        /// Left operand.
        a: &'a Operand,
        /// Right operand (one row, or as many elements as `a`).
        b: &'a Operand,
        /// Output.
        out: &'a Operand,
    },
    /// `out = alpha · x` (`n` elements).
    Scale {
        /// Elements.
        n: usize,
        /// The factor.
        alpha: f32,
        /// Input.
        x: &'a Operand,
        /// Output.
        out: &'a Operand,
    },
    /// `y *= alpha` in place (`n` elements).
    ScaleInplace {
        /// Elements.
        n: usize,
        /// The factor.
        alpha: f32,
        /// Input and output.
        y: &'a Operand,
    },
    /// `y[r, :] += alpha · x` for every row `r` of `y` (`x` holds one row and must not overlap
    /// `y`).
    AxpyRows {
        /// The shape of `y`.
        rows: Rows,
        /// The factor.
        alpha: f32,
        /// One row.
        x: &'a Operand,
        /// Input and output.
        y: &'a Operand,
    },
    /// `out[0] = Σ x` (or the mean with `mean`), `n ≥ 1` elements.
    Sum {
        /// Elements of `x`.
        n: usize,
        /// The mean instead of the sum.
        mean: bool,
        /// Input.
        x: &'a Operand,
        /// One-element output.
        out: &'a Operand,
    },
    /// `out[c] = Σ_r x[r, c]`.
    ColSums {
        /// The shape of `x`.
        rows: Rows,
        /// Input.
        x: &'a Operand,
        /// Output (`rows.cols` elements).
        out: &'a Operand,
    },
    /// [`SumTo`].
    SumTo {
        /// The index spaces.
        shape: &'a SumTo,
        /// Input.
        x: &'a Operand,
        /// Output (overwritten).
        out: &'a Operand,
    },
    /// GELU of `kind` over `n` elements.
    Gelu {
        /// Exact or tanh.
        kind: Gelu,
        /// Elements.
        n: usize,
        /// Input.
        x: &'a Operand,
        /// Output.
        y: &'a Operand,
    },
    /// GELU backward from the forward input `x`.
    GeluBackward {
        /// Exact or tanh.
        kind: Gelu,
        /// Elements.
        n: usize,
        /// The forward input.
        x: &'a Operand,
        /// Upstream gradient.
        dy: &'a Operand,
        /// Gradient of `x`.
        dx: &'a Operand,
    },
    /// Row softmax.
    Softmax {
        /// The shape.
        rows: Rows,
        /// Input.
        x: &'a Operand,
        /// Output.
        y: &'a Operand,
    },
    /// Row softmax backward from the forward output `y`.
    SoftmaxBackward {
        /// The shape.
        rows: Rows,
        /// The forward output.
        y: &'a Operand,
        /// Upstream gradient.
        dy: &'a Operand,
        /// Gradient of the input.
        dx: &'a Operand,
    },
    /// Layer norm forward; writes `y` and the per-row `mean`/`rstd` (`f32`).
    LayerNorm {
        /// The shape and epsilon.
        ln: LayerNormShape,
        /// Input.
        x: &'a Operand,
        /// Scale (`cols`).
        gamma: &'a Operand,
        /// Shift (`cols`).
        beta: &'a Operand,
        /// Output.
        y: &'a Operand,
        /// Per-row mean (`f32`).
        mean: &'a Operand,
        /// Per-row reciprocal standard deviation (`f32`).
        rstd: &'a Operand,
    },
    /// Layer norm backward; overwrites `dx`, `dgamma`, `dbeta`.
    LayerNormBackward {
        /// The shape and epsilon.
        ln: LayerNormShape,
        /// The forward input.
        x: &'a Operand,
        /// Scale.
        gamma: &'a Operand,
        /// The forward's per-row mean.
        mean: &'a Operand,
        /// The forward's per-row reciprocal standard deviation.
        rstd: &'a Operand,
        /// Upstream gradient.
        dy: &'a Operand,
        /// Gradient of `x`.
        dx: &'a Operand,
        /// Gradient of `gamma`.
        dgamma: &'a Operand,
        /// Gradient of `beta`.
        dbeta: &'a Operand,
    },
    /// Embedding lookup; an id out of range fails the stream.
    Embedding {
        /// The sizes.
        e: EmbeddingShape,
        /// Ids (`i64`).
        ids: &'a Operand,
        /// The `vocab × dim` table.
        table: &'a Operand,
        /// Output rows.
        out: &'a Operand,
    },
    /// Embedding backward; overwrites `dtable` (deterministic order).
    EmbeddingBackward {
        /// The sizes.
        e: EmbeddingShape,
        /// Ids (`i64`).
        ids: &'a Operand,
        /// Upstream gradient.
        dy: &'a Operand,
        /// Gradient of the table.
        dtable: &'a Operand,
    },
    /// Causal attention forward; writes `out` and the statistics the backend saves for the
    /// backward ([`Kernels::attention_save`]).
    Attention {
        /// The sizes.
        a: Attention,
        /// Queries.
        q: &'a Operand,
        /// Keys.
        k: &'a Operand,
        /// Values.
        v: &'a Operand,
        /// Output.
        out: &'a Operand,
        /// Probabilities or log-sum-exp (`f32`), saved for the backward.
        stats: AttentionStats<'a>,
    },
    /// Causal attention backward.
    AttentionBackward {
        /// The sizes.
        a: Attention,
        /// Queries.
        q: &'a Operand,
        /// Keys.
        k: &'a Operand,
        /// Values.
        v: &'a Operand,
        /// What the forward saved.
        saved: AttentionSaved<'a>,
        /// Upstream gradient.
        dout: &'a Operand,
        /// Gradient of `q`.
        dq: &'a Operand,
        /// Gradient of `k`.
        dk: &'a Operand,
        /// Gradient of `v`.
        dv: &'a Operand,
    },
    /// Mean cross-entropy of `rows × cols` logits; writes the one-element `loss` and the
    /// per-row log-sum-exp `lse` (`f32`). A target out of range fails the stream.
    CrossEntropy {
        /// The shape of the logits.
        rows: Rows,
        /// Logits.
        logits: &'a Operand,
        /// Targets (`i64`).
        targets: &'a Operand,
        /// One-element loss.
        loss: &'a Operand,
        /// Per-row log-sum-exp (`f32`).
        lse: &'a Operand,
    },
    /// Cross-entropy backward, the upstream gradient read from the one-element `dloss`.
    CrossEntropyBackward {
        /// The shape of the logits.
        rows: Rows,
        /// Logits.
        logits: &'a Operand,
        /// Targets (`i64`).
        targets: &'a Operand,
        /// The forward's per-row log-sum-exp.
        lse: &'a Operand,
        /// One-element upstream gradient.
        dloss: &'a Operand,
        /// Gradient of the logits.
        dlogits: &'a Operand,
    },
    /// Float conversion of `n` elements between the operands' dtypes (round to nearest even).
    Cast {
        /// Elements.
        n: usize,
        /// Input.
        x: &'a Operand,
        /// Output.
        out: &'a Operand,
    },
    /// Fills `n` elements with `value` converted to the operand's dtype.
    Fill {
        /// Elements.
        n: usize,
        /// The value.
        value: f64,
        /// Output.
        out: &'a Operand,
    },
    /// `out[i] = i` (`i64`).
    Arange {
        /// Elements.
        n: usize,
        /// Output.
        out: &'a Operand,
    },
    /// Bit-exact copy of the view `src_view` of `src` into the view `dst_view` of `dst` (same
    /// shape and element size; the destination view must not overlap itself).
    Copy {
        /// What is read.
        src_view: &'a View,
        /// The source memory.
        src: &'a Operand,
        /// Where it is written.
        dst_view: &'a View,
        /// The destination memory.
        dst: &'a Operand,
    },
    // ---- optimizer, gradient clipping and grad scaler (fsdp-core's optimizers launch these;
    // CPU kernels in `cpu::optim`, CUDA kernels in the "optimizer" section of kernels.cu).
    // Every operand is f32 and no output overlaps another operand.
    /// Fused SGD step of `n` elements: [`SgdRule::update`] on `p` from `g` with the momentum
    /// buffer `buf` (`None` without momentum; `first`: the buffer holds no history yet).
    SgdStep {
        /// Elements.
        n: usize,
        /// The hyper-parameters.
        rule: SgdRule,
        /// The momentum buffer is fresh (overwritten, not decayed).
        first: bool,
        /// Parameters (updated).
        p: &'a Operand,
        /// Gradient.
        g: &'a Operand,
        /// Momentum buffer (updated), with momentum only.
        buf: Option<&'a Operand>,
    },
    /// Fused AdamW step of `n` elements, both state slots at once
    /// ([`cpu::optim::adamw_step`](super::cpu::optim::adamw_step)).
    AdamWStep {
        /// Elements.
        n: usize,
        /// The step's scalars.
        c: AdamCoeffs,
        /// Parameters (updated).
        p: &'a Operand,
        /// Gradient.
        g: &'a Operand,
        /// First moment (updated).
        m: &'a Operand,
        /// Second moment (updated).
        v: &'a Operand,
    },
    /// LAMB's moments and direction `u` over `n` elements
    /// ([`cpu::optim::lamb_direction`](super::cpu::optim::lamb_direction)).
    LambDirection {
        /// Elements.
        n: usize,
        /// The step's scalars.
        c: LambCoeffs,
        /// Parameters (read).
        p: &'a Operand,
        /// Gradient.
        g: &'a Operand,
        /// First moment (updated).
        m: &'a Operand,
        /// Second moment (updated).
        v: &'a Operand,
        /// Direction (written).
        u: &'a Operand,
    },
    /// `p += (−lr·ratio)·u` over `n` elements, the trust ratio computed on the device from the
    /// squared norms `sums[w_sq]` and `sums[u_sq]`
    /// ([`cpu::optim::lamb_apply`](super::cpu::optim::lamb_apply)).
    LambApply {
        /// Elements.
        n: usize,
        /// Learning rate.
        lr: f32,
        /// Index of `‖p‖²` in `sums`.
        w_sq: usize,
        /// Index of `‖u‖²` in `sums`.
        u_sq: usize,
        /// The squared norms.
        sums: &'a Operand,
        /// Direction.
        u: &'a Operand,
        /// Parameters (updated).
        p: &'a Operand,
    },
    /// Deterministic sums of squares: `out[o] = Σ` (over the pieces with `out == o`, in order)
    /// of the piece's `Σ x²`; every sum accumulates in f64 and is rounded to f32 once; outputs
    /// no piece names are 0. No float atomics (CPU: sequential; CUDA: fixed-shape blocked sums).
    SumSquares {
        /// The inputs.
        xs: &'a [Operand],
        /// The pieces, in summation order.
        pieces: &'a [SqPiece],
        /// The sums (overwritten).
        out: &'a Operand,
    },
    /// Grad-scaler unscale of `n` elements: `g *= inv`; `found_inf[0] = 1` if any element was
    /// inf or NaN before scaling (left alone otherwise).
    Unscale {
        /// Elements.
        n: usize,
        /// `1 / scale`.
        inv: f32,
        /// Gradient (updated).
        g: &'a Operand,
        /// One-element flag.
        found_inf: &'a Operand,
    },
}

impl Launch<'_> {
    /// The operation's name, as errors report it.
    pub fn name(&self) -> &'static str {
        match self {
            Launch::Gemm { .. } => "gemm",
            Launch::Binary {
                op: BinaryOp::Add, ..
            } => "add",
            Launch::Binary {
                op: BinaryOp::Mul, ..
            } => "mul",
            Launch::Scale { .. } => "scale",
            Launch::ScaleInplace { .. } => "scale_inplace",
            Launch::AxpyRows { .. } => "axpy",
            Launch::Sum { mean: true, .. } => "mean",
            Launch::Sum { mean: false, .. } => "sum",
            Launch::ColSums { .. } => "col_sums",
            Launch::SumTo { .. } => "sum_to",
            Launch::Gelu { .. } => "gelu",
            Launch::GeluBackward { .. } => "gelu_backward",
            Launch::Softmax { .. } => "softmax",
            Launch::SoftmaxBackward { .. } => "softmax_backward",
            Launch::LayerNorm { .. } => "layer_norm",
            Launch::LayerNormBackward { .. } => "layer_norm_backward",
            Launch::Embedding { .. } => "embedding",
            Launch::EmbeddingBackward { .. } => "embedding_backward",
            Launch::Attention { .. } => "attention",
            Launch::AttentionBackward { .. } => "attention_backward",
            Launch::CrossEntropy { .. } => "cross_entropy",
            Launch::CrossEntropyBackward { .. } => "cross_entropy_backward",
            Launch::Cast { .. } => "cast",
            Launch::Fill { .. } => "fill",
            Launch::Arange { .. } => "arange",
            Launch::Copy { .. } => "copy",
            Launch::SgdStep { .. } => "sgd_step",
            Launch::AdamWStep { .. } => "adamw_step",
            Launch::LambDirection { .. } => "lamb_direction",
            Launch::LambApply { .. } => "lamb_apply",
            Launch::SumSquares { .. } => "sum_squares",
            Launch::Unscale { .. } => "unscale",
        }
    }
}

/// The kernels a [`Tensor`](crate::Tensor) needs, for one kind of device.
///
/// Implementations receive launches already checked by [`Kernels`] (element counts match the
/// shape struct, dtypes are as documented on [`Launch`], every operand lives on the device, and
/// there is something to compute) and *launch* the work on `stream`.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// The backend's name (`"cpu"`, `"cuda"`).
    fn name(&self) -> &'static str;
    /// Launches `l` on `s`.
    fn launch(&self, s: &Stream, l: &Launch<'_>) -> Result<()>;
    /// Copies host bytes into `dst` (exactly its length), in stream order.
    fn write(&self, s: &Stream, bytes: Vec<u8>, dst: &Operand) -> Result<()>;
    /// Reads `src` to the host in stream order and hands the bytes to `f` once available
    /// (CPU: on the stream's worker; CUDA: after synchronizing the stream). A backend that
    /// blocks the calling thread here counts each such wait with
    /// `fsdp_alloc::stream::count_host_sync` (see [`Kernels::read`]).
    fn read(&self, s: &Stream, src: &Operand, f: ReadFn) -> Result<()>;
    /// What causal attention of shape `a` saves for its backward on this backend (the forward
    /// must be launched with matching [`AttentionStats`]). Default: the probabilities.
    fn attention_save(&self, a: &Attention) -> AttentionSave {
        let _ = a;
        AttentionSave::Probs
    }
    /// True if this backend's attention kernels take `a` in [`AttentionLayout::Packed`]
    /// (`a.layout` is ignored). Default: false (callers then split the heads themselves).
    fn attention_packed(&self, a: &Attention) -> bool {
        let _ = a;
        false
    }
    /// Copies `src` into `dst` (the same number of bytes, checked by [`Kernels::copy_host`]) in
    /// the order of `s`, without the issuing thread waiting: one side is this backend's device
    /// memory, the other host memory of a CPU device. Events recorded on `s` afterwards cover
    /// the copy; the host side must not be touched by other work until such an event.
    /// Default (host-accessible memory on both sides, the CPU backend): a byte copy launched on
    /// `s`. The CUDA backend copies page-locked host memory with the copy engine.
    fn copy_host(&self, s: &Stream, src: &BufferRef, dst: &BufferRef) -> Result<()> {
        let (src, dst) = (src.clone(), dst.clone());
        s.launch_named("copy_host", move || {
            let from = src
                .read::<u8>()
                .unwrap_or_else(|e| panic!("copy_host: source unreadable: {e}"));
            dst.write::<u8>()
                .unwrap_or_else(|e| panic!("copy_host: destination unwritable: {e}"))
                .copy_from_slice(&from);
        });
        Ok(())
    }
}

/// The seam's front: a device's [`Backend`] behind argument checks done once for every backend.
#[derive(Debug, Clone)]
pub struct Kernels {
    device: DeviceId,
    backend: Arc<dyn Backend>,
}

fn len_err(
    op: &'static str,
    arg: &'static str,
    expected: usize,
    actual: usize,
    shape: String,
) -> AutogradError {
    KernelError::LengthMismatch {
        op,
        arg,
        expected,
        actual,
        shape,
    }
    .into()
}

fn mul(op: &'static str, a: usize, b: usize) -> Result<usize> {
    Ok(super::check::mul(op, a, b)?)
}

fn invalid(op: &'static str, reason: impl Into<String>) -> AutogradError {
    KernelError::InvalidShape {
        op,
        reason: reason.into(),
    }
    .into()
}

/// The element type an operand of a launch must have.
#[derive(Debug, Clone, Copy)]
enum Want {
    /// `f32`, `f16` or `bf16`.
    Float,
    /// Exactly this dtype; the text says what the operand holds.
    Exact(DType, &'static str),
    /// Any (fills).
    Any,
}

/// One row of a launch's argument table: an operand, its element type and its element count.
struct Arg<'a> {
    name: &'static str,
    o: &'a Operand,
    want: Want,
    n: usize,
}

/// A float operand of `n` elements.
fn float<'a>(name: &'static str, o: &'a Operand, n: usize) -> Arg<'a> {
    Arg {
        name,
        o,
        want: Want::Float,
        n,
    }
}

/// An operand of exactly `dtype` (holding `what`) and `n` elements.
fn exact<'a>(
    name: &'static str,
    o: &'a Operand,
    dtype: DType,
    what: &'static str,
    n: usize,
) -> Arg<'a> {
    Arg {
        name,
        o,
        want: Want::Exact(dtype, what),
        n,
    }
}

const STATS: &str = "layer-norm statistics";
const PROBS: &str = "attention probabilities";
const LSE: &str = "attention log-sum-exp";

impl Kernels {
    /// Kernels of `device` that launch through `backend` (the constructor
    /// [`Kernels::for_device`] uses; it lives in `kernels/select.rs`, which knows the backends).
    pub(crate) fn from_backend(device: DeviceId, backend: Arc<dyn Backend>) -> Kernels {
        Kernels { device, backend }
    }

    /// Wraps an explicit backend for `device` (e.g. a test double).
    pub fn with_backend(device: DeviceId, backend: Arc<dyn Backend>) -> Kernels {
        Kernels { device, backend }
    }

    /// The backend behind the checks.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// What causal attention of shape `a` saves for its backward on this device: the CPU
    /// keeps the probabilities, CUDA (fused kernels, the default) the log-sum-exp and output.
    pub fn attention_save(&self, a: &Attention) -> AttentionSave {
        self.backend.attention_save(a)
    }

    /// True if this device's kernels take attention of shape `a` in
    /// [`AttentionLayout::Packed`] (see [`Backend::attention_packed`]).
    pub fn attention_packed(&self, a: &Attention) -> bool {
        self.backend.attention_packed(a)
    }

    fn dev(&self, op: &'static str, arg: &'static str, o: &Operand) -> Result<()> {
        if o.buf.device() != self.device {
            return Err(AutogradError::Device {
                op,
                a: format!("{} (the kernels' device)", self.device),
                b: format!("{} (operand `{arg}`)", o.buf.device()),
            });
        }
        Ok(())
    }

    /// Checks an argument table: every operand's element type first, then its device and
    /// exact element count (`shape` describes the launch in a length error).
    fn args(&self, op: &'static str, shape: impl Fn() -> String, args: &[Arg<'_>]) -> Result<()> {
        for a in args {
            let expected = match a.want {
                Want::Float if !a.o.dtype.is_float() => "a float dtype (f32, f16, bf16)".into(),
                Want::Exact(d, what) if a.o.dtype != d => format!("{d} ({what})"),
                _ => continue,
            };
            return Err(AutogradError::DType {
                op,
                got: a.o.dtype,
                expected,
            });
        }
        for a in args {
            self.dev(op, a.name, a.o)?;
            if a.o.numel() != a.n || a.o.buf.len() % a.o.dtype.size() != 0 {
                return Err(len_err(op, a.name, a.n, a.o.numel(), shape()));
            }
        }
        Ok(())
    }

    /// `rows · cols` of a row-wise launch (`cols` must be positive).
    fn rows(op: &'static str, r: Rows) -> Result<usize> {
        if r.cols == 0 {
            return Err(invalid(
                op,
                "cols must be positive; skip empty tensors before calling the kernel",
            ));
        }
        mul(op, r.rows, r.cols)
    }

    /// Checks `l` and launches it on `s` through the device's backend; a launch with nothing to
    /// compute (an empty product or tensor) returns at once.
    ///
    /// # Errors
    /// [`AutogradError::DType`] for an operand of the wrong element type,
    /// [`AutogradError::Device`] for an operand on another device, a [`KernelError`] for element
    /// counts that do not match the shape (or shapes that are invalid), the errors of the
    /// backend.
    pub fn launch(&self, s: &Stream, l: &Launch<'_>) -> Result<()> {
        if self.check(l)? {
            self.backend.launch(s, l)
        } else {
            Ok(())
        }
    }

    /// Checks every operand of `l` against its shape; `Ok(false)` if there is nothing to compute.
    fn check(&self, l: &Launch<'_>) -> Result<bool> {
        let op = l.name();
        let n_is = |n: usize| move || format!("n={n}");
        match *l {
            Launch::Gemm { g, a, b, c } => {
                let (mk, kn, mn) = (mul(op, g.m, g.k)?, mul(op, g.k, g.n)?, mul(op, g.m, g.n)?);
                let table = [
                    float("a", a, mul(op, g.batch, mk)?),
                    float("b", b, mul(op, g.batch, kn)?),
                    float("c", c, mul(op, g.batch, mn)?),
                ];
                self.args(op, || format!("{g:?}"), &table)?;
                Ok(g.batch > 0 && mn > 0)
            }
            Launch::Binary {
                rows, a, b, out, ..
            } => {
                let n = Kernels::rows(op, rows)?;
                // `b` is one row, broadcast, or as large as `a`.
                let nb = if b.numel() == n { n } else { rows.cols };
                let table = [float("a", a, n), float("out", out, n), float("b", b, nb)];
                self.args(op, || format!("{rows:?}"), &table)?;
                Ok(n > 0)
            }
            Launch::Gelu { n, x, y, .. } => {
                self.args(op, n_is(n), &[float("x", x, n), float("y", y, n)])?;
                Ok(n > 0)
            }
            Launch::Scale { n, x, out, .. } | Launch::Cast { n, x, out } => {
                self.args(op, n_is(n), &[float("x", x, n), float("out", out, n)])?;
                Ok(n > 0)
            }
            Launch::ScaleInplace { n, y, .. } => {
                self.args(op, n_is(n), &[float("y", y, n)])?;
                Ok(n > 0)
            }
            Launch::AxpyRows { rows, x, y, .. } => {
                let n = Kernels::rows(op, rows)?;
                let table = [float("x", x, rows.cols), float("y", y, n)];
                self.args(op, || format!("{rows:?}"), &table)?;
                if n > 0 && x.buf.overlaps(&y.buf) {
                    return Err(AutogradError::Argument {
                        op,
                        detail: "`x` overlaps the destination `y`; copy it first".into(),
                    });
                }
                Ok(n > 0)
            }
            Launch::Sum { n, x, out, .. } => {
                self.args(op, n_is(n), &[float("x", x, n)])?;
                self.args(op, || "a scalar".into(), &[float("out", out, 1)])?;
                if n == 0 {
                    return Err(invalid(op, "cannot reduce an empty tensor"));
                }
                Ok(true)
            }
            Launch::ColSums { rows, x, out } => {
                let n = Kernels::rows(op, rows)?;
                let table = [float("x", x, n), float("out", out, rows.cols)];
                self.args(op, || format!("{rows:?}"), &table)?;
                Ok(true)
            }
            Launch::SumTo { shape: st, x, out } => {
                let n: usize = st.shape.iter().product();
                let table = [float("x", x, n), float("out", out, st.out_numel)];
                self.args(op, || format!("{st:?}"), &table)?;
                let v = View {
                    shape: st.shape.clone(),
                    strides: st.target_strides.clone(),
                    offset: 0,
                };
                if st.shape.len() != st.target_strides.len()
                    || v.end().is_none_or(|e| e > st.out_numel)
                {
                    let reason = format!("target strides reach outside the output: {st:?}");
                    return Err(invalid(op, reason));
                }
                Ok(true)
            }
            Launch::GeluBackward { n, x, dy, dx, .. } => {
                let table = [float("x", x, n), float("dy", dy, n), float("dx", dx, n)];
                self.args(op, n_is(n), &table)?;
                Ok(n > 0)
            }
            Launch::Softmax { rows, x, y } => {
                let n = Kernels::rows(op, rows)?;
                self.args(
                    op,
                    || format!("{rows:?}"),
                    &[float("x", x, n), float("y", y, n)],
                )?;
                Ok(n > 0)
            }
            Launch::SoftmaxBackward { rows, y, dy, dx } => {
                let n = Kernels::rows(op, rows)?;
                let table = [float("y", y, n), float("dy", dy, n), float("dx", dx, n)];
                self.args(op, || format!("{rows:?}"), &table)?;
                Ok(n > 0)
            }
            Launch::LayerNorm {
                ln,
                x,
                gamma,
                beta,
                y,
                mean,
                rstd,
            } => {
                let (n, r) = (Kernels::rows(op, ln.rows)?, ln.rows);
                let table = [
                    float("x", x, n),
                    float("gamma", gamma, r.cols),
                    float("beta", beta, r.cols),
                    float("y", y, n),
                    exact("mean", mean, DType::F32, STATS, r.rows),
                    exact("rstd", rstd, DType::F32, STATS, r.rows),
                ];
                self.args(op, || format!("{ln:?}"), &table)?;
                Ok(n > 0)
            }
            Launch::LayerNormBackward {
                ln,
                x,
                gamma,
                mean,
                rstd,
                dy,
                dx,
                dgamma,
                dbeta,
            } => {
                let (n, r) = (Kernels::rows(op, ln.rows)?, ln.rows);
                let table = [
                    float("x", x, n),
                    float("gamma", gamma, r.cols),
                    exact("mean", mean, DType::F32, STATS, r.rows),
                    exact("rstd", rstd, DType::F32, STATS, r.rows),
                    float("dy", dy, n),
                    float("dx", dx, n),
                    float("dgamma", dgamma, r.cols),
                    float("dbeta", dbeta, r.cols),
                ];
                self.args(op, || format!("{ln:?}"), &table)?;
                Ok(true)
            }
            Launch::Embedding { e, ids, table, out } => {
                let args = [
                    exact("ids", ids, DType::I64, "ids", e.ids),
                    float("table", table, mul(op, e.vocab, e.dim)?),
                    float("out", out, mul(op, e.ids, e.dim)?),
                ];
                self.args(op, || format!("{e:?}"), &args)?;
                Ok(e.ids > 0 && e.dim > 0)
            }
            Launch::EmbeddingBackward { e, ids, dy, dtable } => {
                let args = [
                    exact("ids", ids, DType::I64, "ids", e.ids),
                    float("dy", dy, mul(op, e.ids, e.dim)?),
                    float("dtable", dtable, mul(op, e.vocab, e.dim)?),
                ];
                self.args(op, || format!("{e:?}"), &args)?;
                Ok(e.vocab > 0 && e.dim > 0)
            }
            Launch::Attention {
                a,
                q,
                k,
                v,
                out,
                stats,
            } => {
                let (n, np, nl) = Kernels::attention_sizes(op, a)?;
                let st = match stats {
                    AttentionStats::Probs(p) => exact("probs", p, DType::F32, PROBS, np),
                    AttentionStats::Lse(l) => exact("lse", l, DType::F32, LSE, nl),
                };
                let stats_n = st.n;
                Kernels::attention_packed_same(op, a, [("q", q), ("k", k), ("v", v)])?;
                let nqkv = Kernels::attention_qkv_len(op, a, n)?;
                let table = [
                    float("q", q, nqkv),
                    float("k", k, nqkv),
                    float("v", v, nqkv),
                    float("out", out, n),
                    st,
                ];
                self.args(op, || format!("{a:?}"), &table)?;
                Ok(n > 0 || stats_n > 0)
            }
            Launch::AttentionBackward {
                a,
                q,
                k,
                v,
                saved,
                dout,
                dq,
                dk,
                dv,
            } => {
                let (n, np, nl) = Kernels::attention_sizes(op, a)?;
                let (st, fwd_out) = match saved {
                    AttentionSaved::Probs(p) => (exact("probs", p, DType::F32, PROBS, np), None),
                    AttentionSaved::Lse { lse, out } => (
                        exact("lse", lse, DType::F32, LSE, nl),
                        Some(float("out", out, n)),
                    ),
                };
                Kernels::attention_packed_same(op, a, [("q", q), ("k", k), ("v", v)])?;
                Kernels::attention_packed_same(op, a, [("dq", dq), ("dk", dk), ("dv", dv)])?;
                let nqkv = Kernels::attention_qkv_len(op, a, n)?;
                let mut table = vec![
                    float("q", q, nqkv),
                    float("k", k, nqkv),
                    float("v", v, nqkv),
                    st,
                    float("dout", dout, n),
                    float("dq", dq, nqkv),
                    float("dk", dk, nqkv),
                    float("dv", dv, nqkv),
                ];
                table.extend(fwd_out);
                self.args(op, || format!("{a:?}"), &table)?;
                Ok(n > 0 || np > 0)
            }
            Launch::CrossEntropy {
                rows,
                logits,
                targets,
                loss,
                lse,
            } => {
                let n = Kernels::rows(op, rows)?;
                let table = [
                    float("logits", logits, n),
                    exact("targets", targets, DType::I64, "targets", rows.rows),
                    float("loss", loss, 1),
                    exact("lse", lse, DType::F32, "log-sum-exp", rows.rows),
                ];
                self.args(op, || format!("{rows:?}"), &table)?;
                if rows.rows == 0 {
                    return Err(invalid(op, "cross-entropy needs at least one row"));
                }
                Ok(true)
            }
            Launch::CrossEntropyBackward {
                rows,
                logits,
                targets,
                lse,
                dloss,
                dlogits,
            } => {
                let n = Kernels::rows(op, rows)?;
                let table = [
                    float("logits", logits, n),
                    float("dlogits", dlogits, n),
                    exact("targets", targets, DType::I64, "targets", rows.rows),
                    exact("lse", lse, DType::F32, "log-sum-exp", rows.rows),
                    float("dloss", dloss, 1),
                ];
                self.args(op, || format!("{rows:?}"), &table)?;
                Ok(rows.rows > 0)
            }
            Launch::Fill { n, out, .. } => {
                let table = [Arg {
                    name: "out",
                    o: out,
                    want: Want::Any,
                    n,
                }];
                self.args(op, n_is(n), &table)?;
                Ok(n > 0)
            }
            Launch::Arange { n, out } => {
                let table = [exact("out", out, DType::I64, "arange output", n)];
                self.args(op, n_is(n), &table)?;
                Ok(n > 0)
            }
            Launch::Copy {
                src_view,
                src,
                dst_view,
                dst,
            } => self.check_copy(src_view, src, dst_view, dst),
            Launch::SgdStep { .. }
            | Launch::AdamWStep { .. }
            | Launch::LambDirection { .. }
            | Launch::LambApply { .. }
            | Launch::SumSquares { .. }
            | Launch::Unscale { .. } => self.check_optim(l),
        }
    }

    /// Elements of each q / k / v (and dq / dk / dv) operand: `n` (one head-split tensor) or,
    /// packed, the whole qkv tensor, 3·`n`; packed, q = k = v and dq = dk = dv must be one
    /// operand each (checked where the operands are at hand).
    fn attention_qkv_len(op: &'static str, a: Attention, n: usize) -> Result<usize> {
        match a.layout {
            AttentionLayout::Heads => Ok(n),
            AttentionLayout::Packed => mul(op, n, 3),
        }
    }

    /// Packed layout: the three operands must be one range (the whole qkv tensor or its
    /// gradient).
    fn attention_packed_same(
        op: &'static str,
        a: Attention,
        ops: [(&'static str, &Operand); 3],
    ) -> Result<()> {
        if a.layout != AttentionLayout::Packed {
            return Ok(());
        }
        let [(n0, o0), (n1, o1), (n2, o2)] = ops;
        let same =
            |o: &Operand| o.buf.location() == o0.buf.location() && o.buf.len() == o0.buf.len();
        if same(o1) && same(o2) {
            return Ok(());
        }
        Err(AutogradError::Argument {
            op,
            detail: format!(
                "packed attention layout: `{n0}`, `{n1}` and `{n2}` must be the same operand (the whole [batch, t, 3, heads, d] tensor); pass it three times"
            ),
        })
    }

    /// Elements of q-shaped operands, of the probabilities and of the log-sum-exp.
    fn attention_sizes(op: &'static str, a: Attention) -> Result<(usize, usize, usize)> {
        let bh = mul(op, a.batch, a.heads)?;
        let rows = mul(op, bh, a.t)?;
        Ok((mul(op, rows, a.d)?, mul(op, rows, a.t)?, rows))
    }

    /// The checks of [`Launch::Copy`]: both operands here, equal element sizes, views of one
    /// shape that stay inside their operands.
    fn check_copy(
        &self,
        src_view: &View,
        src: &Operand,
        dst_view: &View,
        dst: &Operand,
    ) -> Result<bool> {
        let op = "copy";
        self.dev(op, "src", src)?;
        self.dev(op, "dst", dst)?;
        if src.dtype.size() != dst.dtype.size() {
            return Err(AutogradError::DType {
                op,
                got: dst.dtype,
                expected: format!(
                    "an element type of {} bytes like the source ({})",
                    src.dtype.size(),
                    src.dtype
                ),
            });
        }
        if src_view.shape != dst_view.shape
            || src_view.strides.len() != src_view.shape.len()
            || dst_view.strides.len() != dst_view.shape.len()
        {
            let reason = format!("views differ in shape or rank: {src_view:?} → {dst_view:?}");
            return Err(invalid(op, reason));
        }
        for (arg, v, o) in [("src", src_view, src), ("dst", dst_view, dst)] {
            if v.end().is_none_or(|e| e > o.numel()) {
                let n = o.numel();
                return Err(invalid(
                    op,
                    format!("the view {v:?} of `{arg}` reaches past its {n} elements"),
                ));
            }
        }
        Ok(src_view.numel() > 0)
    }

    /// Checked [`Backend::write`].
    ///
    /// # Errors
    /// `dst` on another device, `bytes` of another length than `dst`, the backend's errors.
    pub fn write(&self, s: &Stream, bytes: Vec<u8>, dst: &Operand) -> Result<()> {
        self.dev("write", "dst", dst)?;
        if bytes.len() != dst.buf.len() {
            return Err(len_err(
                "write",
                "bytes",
                dst.buf.len(),
                bytes.len(),
                "the destination's byte length".into(),
            ));
        }
        if bytes.is_empty() {
            return Ok(());
        }
        self.backend.write(s, bytes, dst)
    }

    /// Checked [`Backend::copy_host`]: copies `src` into `dst` in the order of `s`, a stream of
    /// this device, without the issuing thread waiting (what CPU offload moves shards and
    /// gradients with). One of the two lives on this device; the other on this device too (CPU
    /// devices) or on a CPU device (host memory; page-locked for a truly asynchronous copy to or
    /// from a GPU, see `fsdp_alloc::Device::cpu_pinned`).
    ///
    /// # Errors
    /// A stream of another device; neither buffer on this device; the other buffer neither on
    /// this device nor on a CPU device; buffers of different lengths; the backend's errors.
    pub fn copy_host(&self, s: &Stream, src: &BufferRef, dst: &BufferRef) -> Result<()> {
        const OP: &str = "copy_host";
        if s.device() != self.device {
            return Err(AutogradError::Device {
                op: OP,
                a: format!("{} (the kernels' device)", self.device),
                b: format!("{} (stream `{}`)", s.device(), s.name()),
            });
        }
        let ours = |b: &BufferRef| b.device() == self.device;
        let host = |b: &BufferRef| matches!(b.device(), DeviceId::Cpu(_));
        if !(ours(src) && (ours(dst) || host(dst)) || ours(dst) && host(src)) {
            return Err(AutogradError::Device {
                op: OP,
                a: format!("{} (`src`)", src.device()),
                b: format!(
                    "{} (`dst`); one side must be {} and the other {} or a CPU device",
                    dst.device(),
                    self.device,
                    self.device
                ),
            });
        }
        if src.len() != dst.len() {
            return Err(len_err(
                OP,
                "dst",
                src.len(),
                dst.len(),
                "the source's byte length".into(),
            ));
        }
        if src.is_empty() {
            return Ok(());
        }
        self.backend.copy_host(s, src, dst)
    }

    /// Checked [`Backend::read`]. A readback is a host wait of the caller, counted by
    /// `fsdp_alloc::stream::host_syncs`: a backend that waits inside `read` (CUDA: it
    /// synchronizes the stream) counts its own waits; for one that did not (CPU: the bytes
    /// arrive later from the stream's worker, and the caller waits for them) this counts one.
    /// Either way every readback is at least one counted wait and no wait is counted twice.
    ///
    /// # Errors
    /// `src` on another device, the backend's errors.
    pub fn read(&self, s: &Stream, src: &Operand, f: ReadFn) -> Result<()> {
        self.dev("read", "src", src)?;
        let before = fsdp_alloc::stream::host_syncs();
        self.backend.read(s, src, f)?;
        if fsdp_alloc::stream::host_syncs() == before {
            fsdp_alloc::stream::count_host_sync();
        }
        Ok(())
    }
}

/// What optimizer state, gradients and norm sums hold (for dtype errors).
const OPTIM: &str = "optimizer operands are f32";

impl Kernels {
    /// The checks of the optimizer launches ([`Launch::SgdStep`] … [`Launch::Unscale`]): every
    /// operand f32 of the stated size on this device, and no output overlapping another operand.
    fn check_optim(&self, l: &Launch<'_>) -> Result<bool> {
        let op = l.name();
        let f = |name, o, n| exact(name, o, DType::F32, OPTIM, n);
        let n_is = |n: usize| move || format!("n={n}");
        // (table, outputs, the number of elements computed)
        let (table, outs, n): (Vec<Arg<'_>>, Vec<&Operand>, usize) = match *l {
            Launch::SgdStep { n, p, g, buf, .. } => {
                let mut t = vec![f("p", p, n), f("g", g, n)];
                let mut outs = vec![p];
                if let Some(b) = buf {
                    t.push(f("buf", b, n));
                    outs.push(b);
                }
                (t, outs, n)
            }
            Launch::AdamWStep { n, p, g, m, v, .. } => (
                vec![f("p", p, n), f("g", g, n), f("m", m, n), f("v", v, n)],
                vec![p, m, v],
                n,
            ),
            Launch::LambDirection {
                n, p, g, m, v, u, ..
            } => (
                vec![
                    f("p", p, n),
                    f("g", g, n),
                    f("m", m, n),
                    f("v", v, n),
                    f("u", u, n),
                ],
                vec![m, v, u],
                n,
            ),
            Launch::LambApply {
                n,
                w_sq,
                u_sq,
                sums,
                u,
                p,
                ..
            } => {
                if w_sq >= sums.numel() || u_sq >= sums.numel() {
                    let reason = format!(
                        "norm indices {w_sq} and {u_sq} must lie below the {} sums",
                        sums.numel()
                    );
                    return Err(invalid(op, reason));
                }
                (
                    vec![f("u", u, n), f("p", p, n), f("sums", sums, sums.numel())],
                    vec![p],
                    n,
                )
            }
            Launch::SumSquares { xs, pieces, out } => {
                let mut t: Vec<Arg<'_>> = xs.iter().map(|x| f("xs", x, x.numel())).collect();
                t.push(f("out", out, out.numel()));
                for (i, pc) in pieces.iter().enumerate() {
                    let x = xs.get(pc.input).ok_or_else(|| {
                        invalid(
                            op,
                            format!("piece {i} names input {} of {}", pc.input, xs.len()),
                        )
                    })?;
                    if pc.start.checked_add(pc.len).is_none_or(|e| e > x.numel())
                        || pc.out >= out.numel()
                    {
                        let reason = format!(
                            "piece {i} ({pc:?}) reaches outside input {} ({} elements) or the \
                             {} outputs",
                            pc.input,
                            x.numel(),
                            out.numel()
                        );
                        return Err(invalid(op, reason));
                    }
                }
                (t, vec![out], out.numel())
            }
            Launch::Unscale {
                n, g, found_inf, ..
            } => (
                vec![f("g", g, n), f("found_inf", found_inf, 1)],
                vec![g, found_inf],
                n,
            ),
            _ => unreachable!("check_optim is called for the optimizer launches only"),
        };
        self.args(op, n_is(n), &table)?;
        // Outputs are identified by their row in the table (the same operand may be passed
        // under two names, which must fail too).
        let is_out = |a: &Arg<'_>| outs.iter().any(|o| std::ptr::eq(*o, a.o) && a.name != "xs");
        for (i, a) in table.iter().enumerate() {
            if !is_out(a) || a.o.buf.is_empty() {
                continue;
            }
            for (j, b) in table.iter().enumerate() {
                if i != j && a.o.buf.overlaps(&b.o.buf) {
                    return Err(AutogradError::Argument {
                        op,
                        detail: format!(
                            "the output `{}` overlaps `{}`; optimizer operands must be \
                             distinct memory",
                            a.name, b.name
                        ),
                    });
                }
            }
        }
        Ok(n > 0)
    }
}
