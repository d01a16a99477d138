//! The error type of the CUDA kernels.

use cudarc::cublas::result::CublasError;
use cudarc::driver::DriverError;
use fsdp_alloc::{AllocError, DeviceId};
use thiserror::Error;

use crate::kernels::KernelError;

/// Why a CUDA kernel could not run (or, for [`CudaKernelError::Driver`] and
/// [`CudaKernelError::Blas`], what the CUDA libraries reported).
///
/// Shape, length and index errors are the CPU kernels' [`KernelError`]s, so callers can handle
/// both back ends alike.
#[derive(Debug, Clone, Error)]
#[non_exhaustive]
pub enum CudaKernelError {
    /// No CUDA here: the device is not a CUDA device, or a CUDA library (driver, NVRTC, cuBLAS)
    /// could not be loaded.
    #[error(
        "CUDA kernels unavailable for {device}: {reason}; use a CUDA device on a machine with the \
         NVIDIA driver, NVRTC and cuBLAS installed, or run the CPU kernels"
    )]
    Unavailable {
        /// The device the kernels were requested for.
        device: DeviceId,
        /// What is missing.
        reason: String,
    },
    /// A buffer argument is host memory (or otherwise has no device address).
    #[error(
        "kernel `{op}`: `{arg}` ({buffer}) is not CUDA device memory; allocate it with \
         `Device::alloc` on the CUDA device the kernels run on"
    )]
    NotDeviceMemory {
        /// The kernel.
        op: &'static str,
        /// The argument.
        arg: &'static str,
        /// The buffer, as its `Debug` text (block, device, byte range).
        buffer: String,
    },
    /// A buffer lives on another device than the kernels.
    #[error(
        "kernel `{op}`: `{arg}` lives on {actual} but these kernels run on {expected}; copy it to \
         {expected} first"
    )]
    WrongDevice {
        /// The kernel.
        op: &'static str,
        /// The argument.
        arg: &'static str,
        /// The kernels' device.
        expected: DeviceId,
        /// The buffer's device.
        actual: DeviceId,
    },
    /// The stream is not a CUDA stream of the kernels' device.
    #[error(
        "kernel `{op}`: stream `{stream}` belongs to {stream_device}, not to {device}, or is not \
         a CUDA stream; launch on a stream of {device} (`Device::default_stream`/`new_stream`)"
    )]
    WrongStream {
        /// The kernel.
        op: &'static str,
        /// The stream's name.
        stream: String,
        /// The stream's device.
        stream_device: DeviceId,
        /// The kernels' device.
        device: DeviceId,
    },
    /// A buffer's device address is not aligned for its element type.
    #[error(
        "kernel `{op}`: `{arg}` starts at device address {addr:#x}, which is not aligned to \
         {align} bytes; slice buffers at whole elements"
    )]
    Misaligned {
        /// The kernel.
        op: &'static str,
        /// The argument.
        arg: &'static str,
        /// The device address.
        addr: u64,
        /// The required alignment in bytes.
        align: usize,
    },
    /// An output overlaps another argument (the CPU kernels rule this out with `&mut`).
    #[error(
        "kernel `{op}`: output `{output}` overlaps `{other}`; pass non-overlapping buffers (or \
         use the in-place variant of the kernel if there is one)"
    )]
    Overlap {
        /// The kernel.
        op: &'static str,
        /// The output argument.
        output: &'static str,
        /// The argument it overlaps.
        other: &'static str,
    },
    /// A size exceeds what the CUDA launch or cuBLAS interface can express.
    #[error("kernel `{op}`: {what} = {value} exceeds the limit {limit} of the CUDA interface; split the work into smaller calls")]
    TooLarge {
        /// The kernel.
        op: &'static str,
        /// Which size.
        what: &'static str,
        /// Its value.
        value: u64,
        /// The largest accepted value.
        limit: u64,
    },
    /// The arguments do not describe a valid computation (same checks and errors as the CPU
    /// kernels), or an id/target was out of range (reported by [`super::IndexCheck::wait`]).
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// A CUDA driver call failed (launch, copy, memset, module load, synchronize).
    #[error(
        "kernel `{op}`: CUDA driver call {call} failed: {source}; a failed kernel leaves the \
         context unusable — check earlier launches on the stream"
    )]
    Driver {
        /// The kernel (or `load kernels`).
        op: &'static str,
        /// The driver function.
        call: &'static str,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
    /// A cuBLAS call failed.
    #[error("kernel `{op}`: cuBLAS call {call} failed: {source}")]
    Blas {
        /// The kernel.
        op: &'static str,
        /// The cuBLAS function.
        call: &'static str,
        /// cuBLAS's status.
        #[source]
        source: CublasError,
    },
    /// NVRTC could not compile `kernels.cu` (a bug in the source or an NVRTC too old for it).
    #[error(
        "NVRTC failed to compile the CUDA kernels: {log}; this is a bug in \
         fsdp-autograd's kernels.cu or an unsupported NVRTC version"
    )]
    Compile {
        /// NVRTC's status and compile log.
        log: String,
    },
    /// Allocating scratch memory (or a status word) from the device's caching allocator failed.
    #[error("kernel `{op}`: allocating {bytes} bytes of scratch memory failed: {source}")]
    Alloc {
        /// The kernel.
        op: &'static str,
        /// The requested size.
        bytes: usize,
        /// The allocator's error.
        #[source]
        source: AllocError,
    },
    /// The host side of a host↔device copy could not be read or written (an unordered access
    /// to it is live, or it is not host memory).
    #[error("kernel `{op}`: the host buffer of the copy is not accessible: {source}")]
    Host {
        /// The copy.
        op: &'static str,
        /// The host memory's error.
        #[source]
        source: AllocError,
    },
    /// A launch did not match the kernel's parameter list: a bug in this module, not in the
    /// caller's arguments.
    #[error("kernel `{op}`: internal error: {detail}; please report this bug")]
    Internal {
        /// The kernel.
        op: &'static str,
        /// What went wrong.
        detail: String,
    },
}

/// Shorthand for results of the CUDA kernels.
pub type Result<T, E = CudaKernelError> = std::result::Result<T, E>;
