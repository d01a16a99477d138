//! [`DeviceId`]: which device — a plain value that every layer of the crate names (errors,
//! memory segments, streams, the trace, the allocator). It sits below all of them, while
//! `device.rs` (the [`crate::Device`] that owns an allocator and streams) sits above them, so it
//! is a file of its own; the crate root and `device.rs` re-export it.

/// Which device: a CPU device (one per rank thread) or a CUDA device (with the `cuda` feature).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceId {
    /// A CPU device; several may exist in one process (one per rank thread).
    Cpu(usize),
    /// A CUDA device by ordinal. Usable only with the `cuda` feature and a GPU.
    Cuda(usize),
}

impl std::fmt::Display for DeviceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceId::Cpu(i) => write!(f, "cpu:{i}"),
            DeviceId::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}
