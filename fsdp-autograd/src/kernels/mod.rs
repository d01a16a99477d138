//! Compute kernels and the backend seam the tensor layer reaches them through.
//!
//! # Layout
//! - The seam: [`Op`] (`op.rs`: the one trait every kernel call implements — name, argument
//!   check, CPU launch, CUDA launch — and the argument table its check is written in), the
//!   [`Backend`] trait (`backend.rs`: what a device kind provides: launch an op, write, read,
//!   host copies, attention choices), [`Kernels`] (`front.rs`: the front the tensor layer calls;
//!   it checks every op once, for all backends, then hands it to the device's backend), chosen
//!   per device by [`Kernels::for_device`] (`select.rs`); [`Operand`] and [`View`]
//!   (`operand.rs`). Every tensor operation, fill, copy, upload and readback goes through it.
//! - The ops, one file each, grouped by family: [`gemm`] (matrix products), [`elementwise`],
//!   [`reduce`], [`norm`] (softmax, layer norm), [`embedding`], [`loss`] (cross-entropy),
//!   [`attention`], [`layout`] (strided copies), [`optim`] (optimizer, clipping, grad scaler),
//!   [`rope`] (rotary position embedding), [`dropout`] (the counter-based dropout mask).
//!   An op's file holds its shape struct, its check, its CPU launch and (feature `cuda`) its
//!   CUDA launch.
//! - [`cpu`]: the CPU kernels, pure functions on contiguous row-major slices, and
//!   [`CpuBackend`]. Matrix products go through the [`gemm`](https://docs.rs/gemm) crate;
//!   everything else is plain Rust that processes whole rows in a fixed order. As public slice
//!   functions they still reject slices that do not match their shape arguments
//!   ([`KernelError`], never a panic), through the same checks the CUDA kernels use.
//! - [`cuda`]: [`CudaBackend`] and (feature `cuda`) the CUDA machinery: NVRTC program, launch
//!   plans, cuBLAS, the host emulator the tests run the kernels on.
//!
//! # Determinism
//! Every CPU kernel returns bit-identical results for bit-identical inputs, on every call and
//! (for matrix products) under every parallelism setting and at every slice alignment; see
//! [`cpu::matmul`] for how this was established for `gemm` and what it rests on.

pub mod attention;
pub mod backend;
mod check;
pub mod cpu;
pub mod cuda;
pub mod dropout;
pub mod elementwise;
pub mod embedding;
mod front;
pub mod gemm;
pub mod layout;
pub mod loss;
pub mod norm;
pub mod op;
pub mod operand;
pub mod optim;
#[cfg(feature = "cuda")]
pub(crate) mod program;
pub mod reduce;
pub mod rope;
mod select;

pub use backend::{Backend, ReadFn};
pub use cpu::backend::CpuBackend;
pub use cuda::CudaBackend;
pub use front::Kernels;
pub use op::{Check, Op, Rows, Spec};
pub use operand::{Operand, View};

use thiserror::Error;

/// Which GELU: the exact form `x·Φ(x)` (PyTorch's default, `approximate="none"`) or GPT-2's tanh
/// approximation (`approximate="tanh"`). The default is [`Gelu::Exact`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Gelu {
    /// `x·Φ(x) = ½·x·(1 + erf(x/√2))`.
    #[default]
    Exact,
    /// `½·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
    Tanh,
}

impl Gelu {
    /// The name PyTorch's `approximate=` argument uses for it with `Exact` as `"none"`; here
    /// `"exact"` or `"tanh"` (as `train_gpt --gelu` spells them).
    pub fn name(self) -> &'static str {
        match self {
            Gelu::Exact => "exact",
            Gelu::Tanh => "tanh",
        }
    }
}

impl std::str::FromStr for Gelu {
    type Err = String;
    /// Parses `"exact"` (also `"none"`, `"erf"`) or `"tanh"`.
    fn from_str(s: &str) -> Result<Gelu, String> {
        match s {
            "exact" | "none" | "erf" => Ok(Gelu::Exact),
            "tanh" => Ok(Gelu::Tanh),
            other => Err(format!(
                "unknown GELU `{other}`: use `exact` (erf, PyTorch's default) or `tanh`"
            )),
        }
    }
}

impl std::fmt::Display for Gelu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A kernel was called with arguments that do not describe a valid computation.
///
/// Each variant names the kernel (`op`) and enough of the arguments to find the caller's mistake.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum KernelError {
    /// A slice's length differs from what the shape arguments require.
    #[error(
        "kernel `{op}`: `{arg}` has {actual} elements but the shape arguments ({shape}) require \
         {expected}; pass slices whose lengths match the shapes (contiguous, row-major)"
    )]
    LengthMismatch {
        /// The kernel that rejected its arguments.
        op: &'static str,
        /// The argument whose length is wrong.
        arg: &'static str,
        /// The length the shape arguments require.
        expected: usize,
        /// The length that was passed.
        actual: usize,
        /// The shape arguments, rendered as `name=value` pairs.
        shape: String,
    },
    /// The shape arguments themselves are unusable (zero columns for a row-wise kernel, a length
    /// that is not a whole number of rows, or a product that overflows `usize`/`isize`).
    #[error("kernel `{op}`: {reason}")]
    InvalidShape {
        /// The kernel that rejected its arguments.
        op: &'static str,
        /// What is wrong, with the offending sizes.
        reason: String,
    },
    /// An id (embedding index or class target) lies outside `0..bound`.
    #[error(
        "kernel `{op}`: {what} {value} at position {position} is out of range 0..{bound}; \
         every {what} must be non-negative and below {bound}"
    )]
    IndexOutOfRange {
        /// The kernel that rejected its arguments.
        op: &'static str,
        /// What kind of index it is (`"id"`, `"target"`).
        what: &'static str,
        /// The offending value.
        value: i64,
        /// Its position in the index slice.
        position: usize,
        /// The exclusive upper bound (table rows, number of classes).
        bound: usize,
    },
}
