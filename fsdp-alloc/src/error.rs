//! The crate's error type.

use crate::DeviceId;

/// Everything that can go wrong in the device runtime.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// The device could not provide `requested` bytes even after releasing every cached block.
    #[error(
        "out of memory on {device}: tried to allocate {requested} bytes; {allocated} bytes allocated, \
         {reserved} bytes reserved by the caching allocator, capacity {capacity}; free tensors, \
         shard more (smaller units or a larger sharding factor) or raise the device capacity"
    )]
    OutOfMemory {
        /// Device that ran out.
        device: DeviceId,
        /// Bytes asked for (before rounding).
        requested: usize,
        /// Bytes held by live allocations at the time.
        allocated: usize,
        /// Bytes reserved from the device (live + cached) at the time.
        reserved: usize,
        /// Device capacity, or `unlimited`.
        capacity: Capacity,
    },
    /// Work launched on a stream panicked or waited on a failed event.
    #[error("stream `{stream}` on {device} failed: {message}")]
    StreamFailed {
        /// Device of the stream.
        device: DeviceId,
        /// Name of the stream.
        stream: String,
        /// The panic message, or which failed stream it waited on.
        message: String,
    },
    /// Two accesses to overlapping device memory were not ordered (a data race was prevented).
    #[error("conflicting access to {what}: {detail}")]
    AccessConflict {
        /// Which block and range.
        what: String,
        /// What the conflicting accesses were.
        detail: String,
    },
    /// An access did not fit the buffer (length or alignment of the element type).
    #[error("bad access to a device buffer: {0}")]
    BadAccess(String),
    /// The checked mode found a stream-ordering bug.
    #[error("stream-ordering violation: {0}")]
    OrderingViolation(String),
    /// CUDA was requested but is not available.
    #[error("CUDA unavailable: {0}")]
    CudaUnavailable(String),
}

/// A device capacity in bytes, or unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capacity {
    /// No cap other than the host's memory.
    Unlimited,
    /// At most this many bytes may be reserved from the device.
    Bytes(usize),
}

impl std::fmt::Display for Capacity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Capacity::Unlimited => write!(f, "unlimited"),
            Capacity::Bytes(b) => write!(f, "{b} bytes"),
        }
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = AllocError> = std::result::Result<T, E>;
