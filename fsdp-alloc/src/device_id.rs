//! [`DeviceId`]: which device. A leaf file (`device.rs` re-exports it) so that `error.rs` and
//! `trace.rs`, which name devices, do not import `device.rs`, which imports them.

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
