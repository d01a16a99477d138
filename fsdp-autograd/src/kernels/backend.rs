//! The kernel-backend trait: what a device kind provides behind the seam.
//!
//! - [`Backend`] is implemented by [`CpuBackend`](super::CpuBackend) (every op's [`Op::cpu`],
//!   launched on CPU streams) and by [`CudaBackend`](super::CudaBackend) (every op's
//!   `Op::cuda` (feature `cuda`), enqueued on CUDA streams; with the `cuda` feature off it
//!   exists too and every constructor returns [`AutogradError::CudaNotBuilt`](crate::AutogradError::CudaNotBuilt)).
//! - Backends never see an unchecked op: [`Kernels`](super::Kernels), the front the tensor layer
//!   calls, checks every operand once, for all backends ([`Op::check`]).
//!
//! Backend methods *launch* work: they return once it is queued on the stream (CPU: a closure on
//! the stream's worker; CUDA: kernels on the CUDA stream). Errors that can only be seen while the
//! work runs fail the stream and surface at the next synchronization.

use fsdp_alloc::{BufferRef, Stream};

use super::attention::{Attention, AttentionSave};
use super::op::Op;
use super::operand::Operand;
use crate::error::Result;

/// What [`Backend::read`] hands the bytes to.
pub type ReadFn = Box<dyn FnOnce(&[u8]) + Send>;

/// The kernels a [`Tensor`](crate::Tensor) needs, for one kind of device.
///
/// Implementations receive ops already checked by [`Kernels`](super::Kernels) (element counts
/// match the shape arguments, dtypes are as each op documents, every operand lives on the
/// device, and there is something to compute) and *launch* the work on `stream`.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// The backend's name (`"cpu"`, `"cuda"`).
    fn name(&self) -> &'static str;
    /// Launches the checked `op` on `s` (the CPU backend runs [`Op::cpu`], the CUDA backend
    /// `Op::cuda`).
    fn launch(&self, s: &Stream, op: &dyn Op) -> Result<()>;
    /// Copies host bytes into `dst` (exactly its length), in stream order.
    fn write(&self, s: &Stream, bytes: Vec<u8>, dst: &Operand) -> Result<()>;
    /// Reads `src` to the host in stream order and hands the bytes to `f` once available
    /// (CPU: on the stream's worker; CUDA: after synchronizing the stream). A backend that
    /// blocks the calling thread here counts each such wait with
    /// `fsdp_alloc::stream::count_host_sync` (see [`Kernels::read`](super::Kernels::read)).
    fn read(&self, s: &Stream, src: &Operand, f: ReadFn) -> Result<()>;
    /// What causal attention of shape `a` saves for its backward on this backend (the forward
    /// must be launched with matching [`AttentionStats`](super::attention::AttentionStats)).
    /// Default: the probabilities.
    fn attention_save(&self, a: &Attention) -> AttentionSave {
        let _ = a;
        AttentionSave::Probs
    }
    /// True if this backend's attention kernels take `a` in
    /// [`AttentionLayout::Packed`](super::attention::AttentionLayout::Packed) (`a.layout` is
    /// ignored). Default: false (callers then split the heads themselves).
    fn attention_packed(&self, a: &Attention) -> bool {
        let _ = a;
        false
    }
    /// Copies `src` into `dst` (the same number of bytes, checked by
    /// [`Kernels::copy_host`](super::Kernels::copy_host)) in the order of `s`, without the
    /// issuing thread waiting: one side is this backend's device memory, the other host memory
    /// of a CPU device. Events recorded on `s` afterwards cover the copy; the host side must not
    /// be touched by other work until such an event. Default (host-accessible memory on both
    /// sides, the CPU backend): a byte copy launched on `s`. The CUDA backend copies page-locked
    /// host memory with the copy engine.
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
