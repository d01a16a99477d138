//! The op contract of the kernel seam: [`Op`], the one trait every kernel call implements, and
//! the argument table its check is written in ([`Check`], [`Spec`]).
//!
//! An op is one struct (its shape arguments and its operands by name) in one file under
//! `kernels/<family>/`, implementing [`Op`]: its name, its argument check (one table of
//! operands with their element types and counts, checked by [`Check::args`]), its CPU launch
//! and, with the `cuda` feature, its CUDA launch. [`Kernels::launch`](super::Kernels::launch)
//! runs the check once for every backend, then hands the op to the device's
//! [`Backend`](super::Backend), which calls [`Op::cpu`] or `Op::cuda` (feature `cuda`). Adding an op therefore
//! edits no dispatch code: not the seam's front, not the backends.

use fsdp_alloc::{DType, DeviceId, Stream};

use super::operand::Operand;
use super::KernelError;
use crate::error::{AutogradError, Result};

#[cfg(feature = "cuda")]
use super::cuda::CudaBackend;

/// One kernel call through the seam: which kernel, its shape arguments and its operands.
///
/// Float operands may be `f32`, `f16` or `bf16` (computed in `f32`) unless an op says
/// otherwise; ids and targets are `i64`; saved statistics are `f32`.
pub trait Op {
    /// The operation's name, as errors report it.
    fn name(&self) -> &'static str;

    /// Checks every operand against the shape arguments (element types, devices, exact element
    /// counts, through `c`); `Ok(false)` if there is nothing to compute (the launch then
    /// returns at once). The backends' launches may assume a checked op.
    ///
    /// # Errors
    /// [`AutogradError::DType`], [`AutogradError::Device`], a [`KernelError`] for counts that do
    /// not match the shape, [`AutogradError::Argument`] for other inconsistent arguments.
    fn check(&self, c: &Check) -> Result<bool>;

    /// Launches the op's CPU kernel on the CPU stream `s` (a closure on its worker).
    ///
    /// # Errors
    /// What can be seen at launch; failures inside the work fail the stream.
    fn cpu(&self, s: &Stream) -> Result<()>;

    /// Launches the op's CUDA kernels on the CUDA stream `s` through the device's
    /// [`CudaBackend`] (feature `cuda`). Default: [`AutogradError::Unsupported`].
    ///
    /// # Errors
    /// The launch errors of the kernels; [`AutogradError::Unsupported`] for an op without a
    /// CUDA kernel.
    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &CudaBackend, s: &Stream) -> Result<()> {
        let _ = (b, s);
        Err(AutogradError::Unsupported {
            op: self.name(),
            detail: "on a CUDA device: this op has no CUDA kernel".into(),
        })
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

impl Rows {
    /// `rows · cols`, the element count of the matrix: [`KernelError::InvalidShape`] for
    /// `cols == 0` or an overflow.
    ///
    /// # Errors
    /// As above, naming `op`.
    pub fn numel(self, op: &'static str) -> Result<usize> {
        if self.cols == 0 {
            return Err(invalid(
                op,
                "cols must be positive; skip empty tensors before calling the kernel",
            ));
        }
        mul(op, self.rows, self.cols)
    }
}

/// The element type an operand of an op must have.
#[derive(Debug, Clone, Copy)]
enum Want {
    /// `f32`, `f16` or `bf16`.
    Float,
    /// Exactly this dtype; the text says what the operand holds.
    Exact(DType, &'static str),
    /// Any (fills).
    Any,
}

/// One row of an op's argument table: an operand by name, the element type it must have and its
/// exact element count. Built by [`Spec::float`], [`Spec::exact`], [`Spec::any`].
#[derive(Debug, Clone, Copy)]
pub struct Spec<'a> {
    name: &'static str,
    o: &'a Operand,
    want: Want,
    n: usize,
}

impl<'a> Spec<'a> {
    /// A float operand (`f32`, `f16` or `bf16`) of `n` elements.
    pub fn float(name: &'static str, o: &'a Operand, n: usize) -> Spec<'a> {
        Spec {
            name,
            o,
            want: Want::Float,
            n,
        }
    }

    /// An operand of exactly `dtype` (holding `what`, for the error) and `n` elements.
    pub fn exact(
        name: &'static str,
        o: &'a Operand,
        dtype: DType,
        what: &'static str,
        n: usize,
    ) -> Spec<'a> {
        Spec {
            name,
            o,
            want: Want::Exact(dtype, what),
            n,
        }
    }

    /// An operand of any element type and `n` elements.
    pub fn any(name: &'static str, o: &'a Operand, n: usize) -> Spec<'a> {
        Spec {
            name,
            o,
            want: Want::Any,
            n,
        }
    }

    /// The operand's name in the table.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The operand.
    pub fn operand(&self) -> &'a Operand {
        self.o
    }

    /// The element count it must have.
    pub fn len(&self) -> usize {
        self.n
    }

    /// True if it must be empty.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }
}

/// The checks of one device's launches: what [`Op::check`] is given. Every operand must live on
/// [`Check::device`].
#[derive(Debug, Clone, Copy)]
pub struct Check {
    device: DeviceId,
}

impl Check {
    /// Checks for launches on `device`.
    pub fn new(device: DeviceId) -> Check {
        Check { device }
    }

    /// The device the operands must live on.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// `Ok` if `o` (operand `arg` of `op`) lives on [`Check::device`].
    ///
    /// # Errors
    /// [`AutogradError::Device`].
    pub fn on_device(&self, op: &'static str, arg: &'static str, o: &Operand) -> Result<()> {
        if o.buf.device() != self.device {
            return Err(AutogradError::Device {
                op,
                a: format!("{} (the kernels' device)", self.device),
                b: format!("{} (operand `{arg}`)", o.buf.device()),
            });
        }
        Ok(())
    }

    /// Checks an argument table: every operand's element type first, then its device and exact
    /// element count (`shape` describes the launch in a length error).
    ///
    /// # Errors
    /// [`AutogradError::DType`], [`AutogradError::Device`], [`KernelError::LengthMismatch`].
    pub fn args(
        &self,
        op: &'static str,
        shape: impl Fn() -> String,
        args: &[Spec<'_>],
    ) -> Result<()> {
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
            self.on_device(op, a.name, a.o)?;
            if a.o.numel() != a.n || a.o.buf.len() % a.o.dtype.size() != 0 {
                return Err(len_err(op, a.name, a.n, a.o.numel(), shape()));
            }
        }
        Ok(())
    }
}

/// The length error of operand `arg`.
pub(crate) fn len_err(
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

/// `a · b`, or [`KernelError::InvalidShape`] on overflow.
pub(crate) fn mul(op: &'static str, a: usize, b: usize) -> Result<usize> {
    Ok(super::check::mul(op, a, b)?)
}

/// [`KernelError::InvalidShape`] with `reason`.
pub(crate) fn invalid(op: &'static str, reason: impl Into<String>) -> AutogradError {
    KernelError::InvalidShape {
        op,
        reason: reason.into(),
    }
    .into()
}

/// The shape text of a launch over `n` elements.
pub(crate) fn n_is(n: usize) -> impl Fn() -> String {
    move || format!("n={n}")
}
