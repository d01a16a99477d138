//! The kernel-backend seam: the one trait through which [`Tensor`](crate::Tensor) operations reach
//! their kernels, whatever the device.
//!
//! - [`Backend`] is implemented by [`CpuBackend`] (the `kernels::cpu` functions launched on CPU
//!   streams) and by [`CudaBackend`] (the `kernels::cuda` kernels enqueued on CUDA streams; with
//!   the `cuda` feature off it exists too and every constructor returns
//!   [`AutogradError::CudaNotBuilt`]).
//! - Each kernel takes a *shape struct* ([`Gemm`], [`Rows`], [`LayerNormShape`], …) instead of a
//!   long list of sizes, and [`Operand`]s: a tensor's elements as a memory range plus a dtype.
//! - [`Kernels`] is the front the tensor layer calls: it checks every operand against the shape
//!   struct (element counts, dtypes, devices) **once**, here, then hands the validated call to the
//!   device's backend. Backends may assume their arguments are consistent.
//!
//! Backend methods *launch* work: they return once it is queued on the stream (CPU: a closure on
//! the stream's worker; CUDA: kernels on the CUDA stream). Errors that can only be seen while the
//! work runs fail the stream and surface at the next synchronization.
//!
//! ```
//! use fsdp_alloc::{DType, Device};
//! use fsdp_autograd::kernels::backend::{Gemm, Kernels};
//! use fsdp_autograd::Tensor;
//!
//! let dev = Device::cpu(0);
//! let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2], &dev)?;
//! let c = Tensor::zeros(&[2, 2], DType::F32, &dev)?;
//! let k = Kernels::for_device(&dev)?;
//! let g = Gemm { batch: 1, m: 2, k: 2, n: 2, trans_a: false, trans_b: false, accumulate: false };
//! k.gemm(dev.default_stream(), &g, &a.operand()?, &a.operand()?, &c.operand()?)?;
//! assert_eq!(c.to_vec::<f32>()?, vec![7.0, 10.0, 15.0, 22.0]);
//! # Ok::<(), fsdp_autograd::AutogradError>(())
//! ```

use std::sync::Arc;

use fsdp_alloc::{BufferRef, DType, Device, DeviceId, Stream};

use super::{Gelu, KernelError};
use crate::error::{AutogradError, Result};

pub use super::cpu::backend::CpuBackend;
pub use super::cuda_backend::CudaBackend;

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

/// Causal attention over `[batch, heads, t, d]` tensors.
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

/// The kernels a [`Tensor`](crate::Tensor) needs, for one kind of device.
///
/// Implementations receive arguments already checked by [`Kernels`] (element counts match the
/// shape struct, dtypes are as documented, every operand lives on the device) and *launch* the
/// work on `stream`. Float operands may be `f32`, `f16` or `bf16` (computed in `f32`); ids and
/// targets are `i64`; layer-norm statistics, attention probabilities and log-sum-exps are `f32`.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// The backend's name (`"cpu"`, `"cuda"`).
    fn name(&self) -> &'static str;
    /// [`Gemm`]: `c (+)= op(a) · op(b)`.
    fn gemm(&self, s: &Stream, g: &Gemm, a: &Operand, b: &Operand, c: &Operand) -> Result<()>;
    /// `out[r, :] = a[r, :] op b[r % b_rows, :]` where `b` has `rows.cols` elements (one row,
    /// broadcast) or as many as `a`.
    fn binary(
        &self,
        s: &Stream,
        op: BinaryOp,
        rows: Rows,
        a: &Operand,
        b: &Operand,
        out: &Operand,
    ) -> Result<()>;
    /// `out = alpha · x` (`n` elements).
    fn scale(&self, s: &Stream, n: usize, alpha: f32, x: &Operand, out: &Operand) -> Result<()>;
    /// `y *= alpha` in place.
    fn scale_inplace(&self, s: &Stream, n: usize, alpha: f32, y: &Operand) -> Result<()>;
    /// `y[r, :] += alpha · x` for every row `r` of `y` (`x` holds one row).
    fn axpy_rows(&self, s: &Stream, rows: Rows, alpha: f32, x: &Operand, y: &Operand)
        -> Result<()>;
    /// `out[0] = Σ x` (or the mean with `mean`), `n ≥ 1` elements.
    fn sum(&self, s: &Stream, n: usize, mean: bool, x: &Operand, out: &Operand) -> Result<()>;
    /// `out[c] = Σ_r x[r, c]`.
    fn col_sums(&self, s: &Stream, rows: Rows, x: &Operand, out: &Operand) -> Result<()>;
    /// [`SumTo`].
    fn sum_to(&self, s: &Stream, shape: &SumTo, x: &Operand, out: &Operand) -> Result<()>;
    /// GELU of `kind` over `n` elements.
    fn gelu(&self, s: &Stream, kind: Gelu, n: usize, x: &Operand, y: &Operand) -> Result<()>;
    /// GELU backward from the forward input `x`.
    fn gelu_backward(
        &self,
        s: &Stream,
        kind: Gelu,
        n: usize,
        x: &Operand,
        dy: &Operand,
        dx: &Operand,
    ) -> Result<()>;
    /// Row softmax.
    fn softmax(&self, s: &Stream, rows: Rows, x: &Operand, y: &Operand) -> Result<()>;
    /// Row softmax backward from the forward output `y`.
    fn softmax_backward(
        &self,
        s: &Stream,
        rows: Rows,
        y: &Operand,
        dy: &Operand,
        dx: &Operand,
    ) -> Result<()>;
    /// Layer norm forward; writes `y` and the per-row `mean`/`rstd` (`f32`).
    #[allow(clippy::too_many_arguments)]
    fn layer_norm(
        &self,
        s: &Stream,
        ln: LayerNormShape,
        x: &Operand,
        gamma: &Operand,
        beta: &Operand,
        y: &Operand,
        mean: &Operand,
        rstd: &Operand,
    ) -> Result<()>;
    /// Layer norm backward; overwrites `dx`, `dgamma`, `dbeta`.
    #[allow(clippy::too_many_arguments)]
    fn layer_norm_backward(
        &self,
        s: &Stream,
        ln: LayerNormShape,
        x: &Operand,
        gamma: &Operand,
        mean: &Operand,
        rstd: &Operand,
        dy: &Operand,
        dx: &Operand,
        dgamma: &Operand,
        dbeta: &Operand,
    ) -> Result<()>;
    /// Embedding lookup; an id out of range fails the stream.
    fn embedding(
        &self,
        s: &Stream,
        e: EmbeddingShape,
        ids: &Operand,
        table: &Operand,
        out: &Operand,
    ) -> Result<()>;
    /// Embedding backward; overwrites `dtable` (deterministic order).
    fn embedding_backward(
        &self,
        s: &Stream,
        e: EmbeddingShape,
        ids: &Operand,
        dy: &Operand,
        dtable: &Operand,
    ) -> Result<()>;
    /// Causal attention forward; writes `out` and the probabilities `probs` (`f32`).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        s: &Stream,
        a: Attention,
        q: &Operand,
        k: &Operand,
        v: &Operand,
        out: &Operand,
        probs: &Operand,
    ) -> Result<()>;
    /// Causal attention backward.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        s: &Stream,
        a: Attention,
        q: &Operand,
        k: &Operand,
        v: &Operand,
        probs: &Operand,
        dout: &Operand,
        dq: &Operand,
        dk: &Operand,
        dv: &Operand,
    ) -> Result<()>;
    /// Mean cross-entropy of `rows × cols` logits; writes the one-element `loss` and the
    /// per-row log-sum-exp `lse` (`f32`). A target out of range fails the stream.
    fn cross_entropy(
        &self,
        s: &Stream,
        rows: Rows,
        logits: &Operand,
        targets: &Operand,
        loss: &Operand,
        lse: &Operand,
    ) -> Result<()>;
    /// Cross-entropy backward, the upstream gradient read from the one-element `dloss`.
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy_backward(
        &self,
        s: &Stream,
        rows: Rows,
        logits: &Operand,
        targets: &Operand,
        lse: &Operand,
        dloss: &Operand,
        dlogits: &Operand,
    ) -> Result<()>;
    /// Float conversion of `n` elements between the operands' dtypes (round to nearest even).
    fn cast(&self, s: &Stream, n: usize, x: &Operand, out: &Operand) -> Result<()>;
    /// Fills `n` elements with `value` converted to the operand's dtype.
    fn fill(&self, s: &Stream, n: usize, value: f64, out: &Operand) -> Result<()>;
    /// `out[i] = i` (`i64`).
    fn arange(&self, s: &Stream, n: usize, out: &Operand) -> Result<()>;
    /// Bit-exact copy of the view `src_view` of `src` into the view `dst_view` of `dst` (same
    /// shape and dtype; the destination view must not overlap itself).
    fn copy(
        &self,
        s: &Stream,
        src_view: &View,
        src: &Operand,
        dst_view: &View,
        dst: &Operand,
    ) -> Result<()>;
    /// Copies host bytes into `dst` (exactly its length), in stream order.
    fn write(&self, s: &Stream, bytes: Vec<u8>, dst: &Operand) -> Result<()>;
    /// Reads `src` to the host in stream order and hands the bytes to `f` once available
    /// (CPU: on the stream's worker; CUDA: after synchronizing the stream).
    fn read(&self, s: &Stream, src: &Operand, f: ReadFn) -> Result<()>;
}

/// The seam's front: a device's [`Backend`] behind argument checks done once for every backend.
#[derive(Debug, Clone)]
pub struct Kernels {
    device: DeviceId,
    backend: Arc<dyn Backend>,
}

/// The CPU backend shared by every CPU device (it holds no state).
fn cpu_backend() -> Arc<dyn Backend> {
    static CPU: std::sync::OnceLock<Arc<dyn Backend>> = std::sync::OnceLock::new();
    Arc::clone(CPU.get_or_init(|| Arc::new(CpuBackend)))
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

impl Kernels {
    /// The kernels of `device`: [`CpuBackend`] for CPU devices, [`CudaBackend`] for CUDA devices
    /// (created once per device and cached).
    ///
    /// # Errors
    /// For a CUDA device: [`AutogradError::CudaNotBuilt`] without the `cuda` feature, or
    /// [`AutogradError::Backend`] if the CUDA kernels cannot be loaded (NVRTC, cuBLAS, driver).
    pub fn for_device(device: &Device) -> Result<Kernels> {
        let backend = match device.id() {
            DeviceId::Cpu(_) => cpu_backend(),
            DeviceId::Cuda(_) => CudaBackend::for_device(device)?,
        };
        Ok(Kernels {
            device: device.id(),
            backend,
        })
    }

    /// Wraps an explicit backend for `device` (e.g. a test double).
    pub fn with_backend(device: DeviceId, backend: Arc<dyn Backend>) -> Kernels {
        Kernels { device, backend }
    }

    /// The backend behind the checks.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
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

    /// Device + exact element count.
    fn n(
        &self,
        op: &'static str,
        arg: &'static str,
        o: &Operand,
        expected: usize,
        shape: impl Fn() -> String,
    ) -> Result<()> {
        self.dev(op, arg, o)?;
        if o.numel() != expected || o.buf.len() % o.dtype.size() != 0 {
            return Err(len_err(op, arg, expected, o.numel(), shape()));
        }
        Ok(())
    }

    fn float(op: &'static str, o: &Operand) -> Result<()> {
        if o.dtype.is_float() {
            Ok(())
        } else {
            Err(AutogradError::DType {
                op,
                got: o.dtype,
                expected: "a float dtype (f32, f16, bf16)".into(),
            })
        }
    }

    fn exact(op: &'static str, o: &Operand, dtype: DType, what: &str) -> Result<()> {
        if o.dtype == dtype {
            Ok(())
        } else {
            Err(AutogradError::DType {
                op,
                got: o.dtype,
                expected: format!("{dtype} ({what})"),
            })
        }
    }

    fn floats(op: &'static str, os: &[&Operand]) -> Result<()> {
        os.iter().try_for_each(|o| Kernels::float(op, o))
    }

    fn rows(op: &'static str, r: Rows) -> Result<usize> {
        if r.cols == 0 {
            return Err(KernelError::InvalidShape {
                op,
                reason: "cols must be positive; skip empty tensors before calling the kernel"
                    .into(),
            }
            .into());
        }
        mul(op, r.rows, r.cols)
    }

    /// Checked [`Backend::gemm`].
    pub fn gemm(&self, s: &Stream, g: &Gemm, a: &Operand, b: &Operand, c: &Operand) -> Result<()> {
        let op = "gemm";
        Kernels::floats(op, &[a, b, c])?;
        let shape = || format!("{g:?}");
        let mk = mul(op, g.m, g.k)?;
        let kn = mul(op, g.k, g.n)?;
        let mn = mul(op, g.m, g.n)?;
        self.n(op, "a", a, mul(op, g.batch, mk)?, shape)?;
        self.n(op, "b", b, mul(op, g.batch, kn)?, shape)?;
        self.n(op, "c", c, mul(op, g.batch, mn)?, shape)?;
        if g.batch == 0 || mn == 0 {
            return Ok(());
        }
        self.backend.gemm(s, g, a, b, c)
    }

    /// Checked [`Backend::binary`].
    pub fn binary(
        &self,
        s: &Stream,
        op: BinaryOp,
        r: Rows,
        a: &Operand,
        b: &Operand,
        out: &Operand,
    ) -> Result<()> {
        let name = match op {
            BinaryOp::Add => "add",
            BinaryOp::Mul => "mul",
        };
        Kernels::floats(name, &[a, b, out])?;
        let n = Kernels::rows(name, r)?;
        let shape = || format!("{r:?}");
        self.n(name, "a", a, n, shape)?;
        self.n(name, "out", out, n, shape)?;
        if b.numel() != n {
            self.n(name, "b", b, r.cols, shape)?;
        } else {
            self.dev(name, "b", b)?;
        }
        if n == 0 {
            return Ok(());
        }
        self.backend.binary(s, op, r, a, b, out)
    }

    /// Checked [`Backend::scale`].
    pub fn scale(
        &self,
        s: &Stream,
        n: usize,
        alpha: f32,
        x: &Operand,
        out: &Operand,
    ) -> Result<()> {
        let op = "scale";
        Kernels::floats(op, &[x, out])?;
        self.n(op, "x", x, n, || format!("n={n}"))?;
        self.n(op, "out", out, n, || format!("n={n}"))?;
        if n == 0 {
            return Ok(());
        }
        self.backend.scale(s, n, alpha, x, out)
    }

    /// Checked [`Backend::scale_inplace`].
    pub fn scale_inplace(&self, s: &Stream, n: usize, alpha: f32, y: &Operand) -> Result<()> {
        let op = "scale_inplace";
        Kernels::float(op, y)?;
        self.n(op, "y", y, n, || format!("n={n}"))?;
        if n == 0 {
            return Ok(());
        }
        self.backend.scale_inplace(s, n, alpha, y)
    }

    /// Checked [`Backend::axpy_rows`].
    pub fn axpy_rows(
        &self,
        s: &Stream,
        r: Rows,
        alpha: f32,
        x: &Operand,
        y: &Operand,
    ) -> Result<()> {
        let op = "axpy";
        Kernels::floats(op, &[x, y])?;
        let n = Kernels::rows(op, r)?;
        self.n(op, "x", x, r.cols, || format!("{r:?}"))?;
        self.n(op, "y", y, n, || format!("{r:?}"))?;
        if n == 0 {
            return Ok(());
        }
        if x.buf.overlaps(&y.buf) {
            return Err(AutogradError::Argument {
                op,
                detail: "`x` overlaps the destination `y`; copy it first".into(),
            });
        }
        self.backend.axpy_rows(s, r, alpha, x, y)
    }

    /// Checked [`Backend::sum`].
    pub fn sum(&self, s: &Stream, n: usize, mean: bool, x: &Operand, out: &Operand) -> Result<()> {
        let op = if mean { "mean" } else { "sum" };
        Kernels::floats(op, &[x, out])?;
        self.n(op, "x", x, n, || format!("n={n}"))?;
        self.n(op, "out", out, 1, || "a scalar".into())?;
        if n == 0 {
            return Err(KernelError::InvalidShape {
                op,
                reason: "cannot reduce an empty tensor".into(),
            }
            .into());
        }
        self.backend.sum(s, n, mean, x, out)
    }

    /// Checked [`Backend::col_sums`].
    pub fn col_sums(&self, s: &Stream, r: Rows, x: &Operand, out: &Operand) -> Result<()> {
        let op = "col_sums";
        Kernels::floats(op, &[x, out])?;
        let n = Kernels::rows(op, r)?;
        self.n(op, "x", x, n, || format!("{r:?}"))?;
        self.n(op, "out", out, r.cols, || format!("{r:?}"))?;
        self.backend.col_sums(s, r, x, out)
    }

    /// Checked [`Backend::sum_to`].
    pub fn sum_to(&self, s: &Stream, st: &SumTo, x: &Operand, out: &Operand) -> Result<()> {
        let op = "sum_to";
        Kernels::floats(op, &[x, out])?;
        let n: usize = st.shape.iter().product();
        self.n(op, "x", x, n, || format!("{st:?}"))?;
        self.n(op, "out", out, st.out_numel, || format!("{st:?}"))?;
        let v = View {
            shape: st.shape.clone(),
            strides: st.target_strides.clone(),
            offset: 0,
        };
        if st.shape.len() != st.target_strides.len() || v.end().is_none_or(|e| e > st.out_numel) {
            return Err(KernelError::InvalidShape {
                op,
                reason: format!("target strides reach outside the output: {st:?}"),
            }
            .into());
        }
        self.backend.sum_to(s, st, x, out)
    }

    /// Checked [`Backend::gelu`].
    pub fn gelu(&self, s: &Stream, kind: Gelu, n: usize, x: &Operand, y: &Operand) -> Result<()> {
        let op = "gelu";
        Kernels::floats(op, &[x, y])?;
        self.n(op, "x", x, n, || format!("n={n}"))?;
        self.n(op, "y", y, n, || format!("n={n}"))?;
        if n == 0 {
            return Ok(());
        }
        self.backend.gelu(s, kind, n, x, y)
    }

    /// Checked [`Backend::gelu_backward`].
    pub fn gelu_backward(
        &self,
        s: &Stream,
        kind: Gelu,
        n: usize,
        x: &Operand,
        dy: &Operand,
        dx: &Operand,
    ) -> Result<()> {
        let op = "gelu_backward";
        Kernels::floats(op, &[x, dy, dx])?;
        for (arg, o) in [("x", x), ("dy", dy), ("dx", dx)] {
            self.n(op, arg, o, n, || format!("n={n}"))?;
        }
        if n == 0 {
            return Ok(());
        }
        self.backend.gelu_backward(s, kind, n, x, dy, dx)
    }

    /// Checked [`Backend::softmax`].
    pub fn softmax(&self, s: &Stream, r: Rows, x: &Operand, y: &Operand) -> Result<()> {
        let op = "softmax";
        Kernels::floats(op, &[x, y])?;
        let n = Kernels::rows(op, r)?;
        self.n(op, "x", x, n, || format!("{r:?}"))?;
        self.n(op, "y", y, n, || format!("{r:?}"))?;
        if n == 0 {
            return Ok(());
        }
        self.backend.softmax(s, r, x, y)
    }

    /// Checked [`Backend::softmax_backward`].
    pub fn softmax_backward(
        &self,
        s: &Stream,
        r: Rows,
        y: &Operand,
        dy: &Operand,
        dx: &Operand,
    ) -> Result<()> {
        let op = "softmax_backward";
        Kernels::floats(op, &[y, dy, dx])?;
        let n = Kernels::rows(op, r)?;
        for (arg, o) in [("y", y), ("dy", dy), ("dx", dx)] {
            self.n(op, arg, o, n, || format!("{r:?}"))?;
        }
        if n == 0 {
            return Ok(());
        }
        self.backend.softmax_backward(s, r, y, dy, dx)
    }

    /// Checked [`Backend::layer_norm`].
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm(
        &self,
        s: &Stream,
        ln: LayerNormShape,
        x: &Operand,
        gamma: &Operand,
        beta: &Operand,
        y: &Operand,
        mean: &Operand,
        rstd: &Operand,
    ) -> Result<()> {
        let op = "layer_norm";
        let r = ln.rows;
        Kernels::floats(op, &[x, gamma, beta, y])?;
        Kernels::exact(op, mean, DType::F32, "layer-norm statistics")?;
        Kernels::exact(op, rstd, DType::F32, "layer-norm statistics")?;
        let n = Kernels::rows(op, r)?;
        let shape = || format!("{ln:?}");
        self.n(op, "x", x, n, shape)?;
        self.n(op, "y", y, n, shape)?;
        self.n(op, "gamma", gamma, r.cols, shape)?;
        self.n(op, "beta", beta, r.cols, shape)?;
        self.n(op, "mean", mean, r.rows, shape)?;
        self.n(op, "rstd", rstd, r.rows, shape)?;
        if n == 0 {
            return Ok(());
        }
        self.backend
            .layer_norm(s, ln, x, gamma, beta, y, mean, rstd)
    }

    /// Checked [`Backend::layer_norm_backward`].
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm_backward(
        &self,
        s: &Stream,
        ln: LayerNormShape,
        x: &Operand,
        gamma: &Operand,
        mean: &Operand,
        rstd: &Operand,
        dy: &Operand,
        dx: &Operand,
        dgamma: &Operand,
        dbeta: &Operand,
    ) -> Result<()> {
        let op = "layer_norm_backward";
        let r = ln.rows;
        Kernels::floats(op, &[x, gamma, dy, dx, dgamma, dbeta])?;
        Kernels::exact(op, mean, DType::F32, "layer-norm statistics")?;
        Kernels::exact(op, rstd, DType::F32, "layer-norm statistics")?;
        let n = Kernels::rows(op, r)?;
        let shape = || format!("{ln:?}");
        for (arg, o) in [("x", x), ("dy", dy), ("dx", dx)] {
            self.n(op, arg, o, n, shape)?;
        }
        for (arg, o) in [("gamma", gamma), ("dgamma", dgamma), ("dbeta", dbeta)] {
            self.n(op, arg, o, r.cols, shape)?;
        }
        self.n(op, "mean", mean, r.rows, shape)?;
        self.n(op, "rstd", rstd, r.rows, shape)?;
        self.backend
            .layer_norm_backward(s, ln, x, gamma, mean, rstd, dy, dx, dgamma, dbeta)
    }

    /// Checked [`Backend::embedding`].
    pub fn embedding(
        &self,
        s: &Stream,
        e: EmbeddingShape,
        ids: &Operand,
        table: &Operand,
        out: &Operand,
    ) -> Result<()> {
        let op = "embedding";
        Kernels::exact(op, ids, DType::I64, "ids")?;
        Kernels::floats(op, &[table, out])?;
        let shape = || format!("{e:?}");
        self.n(op, "ids", ids, e.ids, shape)?;
        self.n(op, "table", table, mul(op, e.vocab, e.dim)?, shape)?;
        self.n(op, "out", out, mul(op, e.ids, e.dim)?, shape)?;
        if e.ids == 0 || e.dim == 0 {
            return Ok(());
        }
        self.backend.embedding(s, e, ids, table, out)
    }

    /// Checked [`Backend::embedding_backward`].
    pub fn embedding_backward(
        &self,
        s: &Stream,
        e: EmbeddingShape,
        ids: &Operand,
        dy: &Operand,
        dtable: &Operand,
    ) -> Result<()> {
        let op = "embedding_backward";
        Kernels::exact(op, ids, DType::I64, "ids")?;
        Kernels::floats(op, &[dy, dtable])?;
        let shape = || format!("{e:?}");
        self.n(op, "ids", ids, e.ids, shape)?;
        self.n(op, "dy", dy, mul(op, e.ids, e.dim)?, shape)?;
        self.n(op, "dtable", dtable, mul(op, e.vocab, e.dim)?, shape)?;
        if e.vocab == 0 || e.dim == 0 {
            return Ok(());
        }
        self.backend.embedding_backward(s, e, ids, dy, dtable)
    }

    fn attention_sizes(op: &'static str, a: Attention) -> Result<(usize, usize)> {
        let bh = mul(op, a.batch, a.heads)?;
        Ok((
            mul(op, mul(op, bh, a.t)?, a.d)?,
            mul(op, mul(op, bh, a.t)?, a.t)?,
        ))
    }

    /// Checked [`Backend::attention`].
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        s: &Stream,
        a: Attention,
        q: &Operand,
        k: &Operand,
        v: &Operand,
        out: &Operand,
        probs: &Operand,
    ) -> Result<()> {
        let op = "attention";
        Kernels::floats(op, &[q, k, v, out])?;
        Kernels::exact(op, probs, DType::F32, "attention probabilities")?;
        let (n, np) = Kernels::attention_sizes(op, a)?;
        let shape = || format!("{a:?}");
        for (arg, o) in [("q", q), ("k", k), ("v", v), ("out", out)] {
            self.n(op, arg, o, n, shape)?;
        }
        self.n(op, "probs", probs, np, shape)?;
        if n == 0 && np == 0 {
            return Ok(());
        }
        self.backend.attention(s, a, q, k, v, out, probs)
    }

    /// Checked [`Backend::attention_backward`].
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward(
        &self,
        s: &Stream,
        a: Attention,
        q: &Operand,
        k: &Operand,
        v: &Operand,
        probs: &Operand,
        dout: &Operand,
        dq: &Operand,
        dk: &Operand,
        dv: &Operand,
    ) -> Result<()> {
        let op = "attention_backward";
        Kernels::floats(op, &[q, k, v, dout, dq, dk, dv])?;
        Kernels::exact(op, probs, DType::F32, "attention probabilities")?;
        let (n, np) = Kernels::attention_sizes(op, a)?;
        let shape = || format!("{a:?}");
        for (arg, o) in [
            ("q", q),
            ("k", k),
            ("v", v),
            ("dout", dout),
            ("dq", dq),
            ("dk", dk),
            ("dv", dv),
        ] {
            self.n(op, arg, o, n, shape)?;
        }
        self.n(op, "probs", probs, np, shape)?;
        if n == 0 && np == 0 {
            return Ok(());
        }
        self.backend
            .attention_backward(s, a, q, k, v, probs, dout, dq, dk, dv)
    }

    /// Checked [`Backend::cross_entropy`].
    pub fn cross_entropy(
        &self,
        s: &Stream,
        r: Rows,
        logits: &Operand,
        targets: &Operand,
        loss: &Operand,
        lse: &Operand,
    ) -> Result<()> {
        let op = "cross_entropy";
        Kernels::floats(op, &[logits, loss])?;
        Kernels::exact(op, targets, DType::I64, "targets")?;
        Kernels::exact(op, lse, DType::F32, "log-sum-exp")?;
        let n = Kernels::rows(op, r)?;
        let shape = || format!("{r:?}");
        self.n(op, "logits", logits, n, shape)?;
        self.n(op, "targets", targets, r.rows, shape)?;
        self.n(op, "loss", loss, 1, shape)?;
        self.n(op, "lse", lse, r.rows, shape)?;
        if r.rows == 0 {
            return Err(KernelError::InvalidShape {
                op,
                reason: "cross-entropy needs at least one row".into(),
            }
            .into());
        }
        self.backend.cross_entropy(s, r, logits, targets, loss, lse)
    }

    /// Checked [`Backend::cross_entropy_backward`].
    #[allow(clippy::too_many_arguments)]
    pub fn cross_entropy_backward(
        &self,
        s: &Stream,
        r: Rows,
        logits: &Operand,
        targets: &Operand,
        lse: &Operand,
        dloss: &Operand,
        dlogits: &Operand,
    ) -> Result<()> {
        let op = "cross_entropy_backward";
        Kernels::floats(op, &[logits, dloss, dlogits])?;
        Kernels::exact(op, targets, DType::I64, "targets")?;
        Kernels::exact(op, lse, DType::F32, "log-sum-exp")?;
        let n = Kernels::rows(op, r)?;
        let shape = || format!("{r:?}");
        self.n(op, "logits", logits, n, shape)?;
        self.n(op, "dlogits", dlogits, n, shape)?;
        self.n(op, "targets", targets, r.rows, shape)?;
        self.n(op, "lse", lse, r.rows, shape)?;
        self.n(op, "dloss", dloss, 1, shape)?;
        if r.rows == 0 {
            return Ok(());
        }
        self.backend
            .cross_entropy_backward(s, r, logits, targets, lse, dloss, dlogits)
    }

    /// Checked [`Backend::cast`].
    pub fn cast(&self, s: &Stream, n: usize, x: &Operand, out: &Operand) -> Result<()> {
        let op = "cast";
        Kernels::floats(op, &[x, out])?;
        self.n(op, "x", x, n, || format!("n={n}"))?;
        self.n(op, "out", out, n, || format!("n={n}"))?;
        if n == 0 {
            return Ok(());
        }
        self.backend.cast(s, n, x, out)
    }

    /// Checked [`Backend::fill`].
    pub fn fill(&self, s: &Stream, n: usize, value: f64, out: &Operand) -> Result<()> {
        self.n("fill", "out", out, n, || format!("n={n}"))?;
        if n == 0 {
            return Ok(());
        }
        self.backend.fill(s, n, value, out)
    }

    /// Checked [`Backend::arange`].
    pub fn arange(&self, s: &Stream, n: usize, out: &Operand) -> Result<()> {
        Kernels::exact("arange", out, DType::I64, "arange output")?;
        self.n("arange", "out", out, n, || format!("n={n}"))?;
        if n == 0 {
            return Ok(());
        }
        self.backend.arange(s, n, out)
    }

    /// Checked [`Backend::copy`].
    pub fn copy(
        &self,
        s: &Stream,
        src_view: &View,
        src: &Operand,
        dst_view: &View,
        dst: &Operand,
    ) -> Result<()> {
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
            return Err(KernelError::InvalidShape {
                op,
                reason: format!("views differ in shape or rank: {src_view:?} → {dst_view:?}"),
            }
            .into());
        }
        for (arg, v, o) in [("src", src_view, src), ("dst", dst_view, dst)] {
            if v.end().is_none_or(|e| e > o.numel()) {
                return Err(KernelError::InvalidShape {
                    op,
                    reason: format!(
                        "the view {v:?} of `{arg}` reaches past its {} elements",
                        o.numel()
                    ),
                }
                .into());
            }
        }
        if src_view.numel() == 0 {
            return Ok(());
        }
        self.backend.copy(s, src_view, src, dst_view, dst)
    }

    /// Checked [`Backend::write`].
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

    /// Checked [`Backend::read`].
    pub fn read(&self, s: &Stream, src: &Operand, f: ReadFn) -> Result<()> {
        self.dev("read", "src", src)?;
        self.backend.read(s, src, f)
    }
}
