//! Devices: the unit that owns an allocator and a set of streams.

use std::sync::{Arc, Mutex};

use crate::allocator::{Buffer, CachingAllocator, MemoryStats};
use crate::error::{AllocError, Capacity, Result};
use crate::stream::{Stream, StreamMode};

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

/// How to build a CPU device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Memory capacity (e.g. `Capacity::Bytes(80 << 30)` to emulate an 80 GB GPU).
    pub capacity: Capacity,
    /// How the device's streams run work.
    pub stream_mode: StreamMode,
}

impl Default for DeviceConfig {
    fn default() -> Self {
        DeviceConfig {
            capacity: Capacity::Unlimited,
            stream_mode: StreamMode::Async,
        }
    }
}

struct DeviceInner {
    id: DeviceId,
    config: DeviceConfig,
    allocator: Arc<CachingAllocator>,
    default_stream: Stream,
    streams: Mutex<Vec<Stream>>,
}

/// A device handle. Cheap to clone; clones are the same device (same allocator and streams).
#[derive(Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("id", &self.inner.id)
            .field("config", &self.inner.config)
            .finish()
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Device {
    /// A CPU device with unlimited capacity and asynchronous streams.
    pub fn cpu(index: usize) -> Device {
        Device::cpu_with(index, DeviceConfig::default())
    }

    /// A CPU device with the given configuration.
    pub fn cpu_with(index: usize, config: DeviceConfig) -> Device {
        let id = DeviceId::Cpu(index);
        let default_stream = Stream::new(id, "default", config.stream_mode);
        Device {
            inner: Arc::new(DeviceInner {
                id,
                config,
                allocator: CachingAllocator::new(id, config.capacity),
                streams: Mutex::new(vec![default_stream.clone()]),
                default_stream,
            }),
        }
    }

    /// A CUDA device. Without the `cuda` feature, or without a CUDA driver and GPU, this is an
    /// [`AllocError::CudaUnavailable`] error saying which.
    pub fn cuda(ordinal: usize) -> Result<Device> {
        Err(AllocError::CudaUnavailable(format!(
            "cuda:{ordinal}: the CUDA device runtime is not available in this build"
        )))
    }

    /// Which device this is.
    pub fn id(&self) -> DeviceId {
        self.inner.id
    }

    /// The configuration it was built with.
    pub fn config(&self) -> DeviceConfig {
        self.inner.config
    }

    /// The device's default (compute) stream.
    pub fn default_stream(&self) -> &Stream {
        &self.inner.default_stream
    }

    /// A new stream on this device, covered by [`Device::synchronize`].
    pub fn new_stream(&self, name: &str) -> Stream {
        let s = Stream::new(self.inner.id, name, self.inner.config.stream_mode);
        self.inner
            .streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(s.clone());
        s
    }

    /// The device's allocator.
    pub fn allocator(&self) -> &Arc<CachingAllocator> {
        &self.inner.allocator
    }

    /// Allocates `nbytes` for use on `stream` (zeroed the first time the memory is used; reused
    /// memory keeps whatever it held).
    pub fn alloc(&self, nbytes: usize, stream: &Stream) -> Result<Buffer> {
        self.inner.allocator.allocate(nbytes, stream)
    }

    /// A snapshot of the memory statistics.
    pub fn memory_stats(&self) -> MemoryStats {
        self.inner.allocator.stats()
    }

    /// Resets peak statistics to the current values.
    pub fn reset_peak_stats(&self) {
        self.inner.allocator.reset_peak_stats()
    }

    /// Releases cached free memory back to the device.
    pub fn empty_cache(&self) {
        self.inner.allocator.empty_cache()
    }

    /// Waits for all work on every stream of this device; the first failure found is returned.
    pub fn synchronize(&self) -> Result<()> {
        let streams = self
            .inner
            .streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut first = Ok(());
        for s in &streams {
            let r = s.synchronize();
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}
