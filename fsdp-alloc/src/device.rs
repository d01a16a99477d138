//! Devices: the unit that owns an allocator and a set of streams.

use std::sync::{Arc, Mutex};

use crate::allocator::{AllocatorConfig, Buffer, CachingAllocator, MemoryStats};
pub use crate::device_id::DeviceId;
use crate::error::{Capacity, Result};
use crate::stream::{Stream, StreamMode};

/// How to build a device. Build it with struct update syntax
/// (`DeviceConfig { capacity: Capacity::Bytes(1 << 30), ..Default::default() }`) or the `with_*`
/// methods, so that new fields do not break your code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Memory capacity (e.g. `Capacity::Bytes(80 << 30)` to emulate an 80 GB GPU).
    pub capacity: Capacity,
    /// How the device's streams run work.
    pub stream_mode: StreamMode,
    /// Checked mode: the device's streams track their ordering and every guard taken inside
    /// launched work verifies it is ordered after the conflicting accesses before it (see the
    /// crate docs, "Checked mode"). Off by default: it costs a clock per job and a history per
    /// segment, and synchronization outside events (barriers) is invisible to it unless reported
    /// with [`crate::OrderPoint`] (the thread backend's collectives do).
    pub checked: bool,
    /// Cache freed blocks (default). `false` makes every allocation a raw allocation and every
    /// free a raw free: the no-caching baseline.
    pub caching: bool,
    /// The allocator's compact policy (default on; see [`AllocatorConfig::compact`]). `false`
    /// gives PyTorch's segment sizes and per-stream ownership.
    pub compact: bool,
}

impl Default for DeviceConfig {
    fn default() -> Self {
        DeviceConfig {
            capacity: Capacity::Unlimited,
            stream_mode: StreamMode::Async,
            checked: false,
            caching: true,
            compact: true,
        }
    }
}

impl DeviceConfig {
    /// This configuration with another capacity.
    pub fn with_capacity(mut self, capacity: Capacity) -> Self {
        self.capacity = capacity;
        self
    }

    /// This configuration with another stream mode.
    pub fn with_stream_mode(mut self, mode: StreamMode) -> Self {
        self.stream_mode = mode;
        self
    }

    /// This configuration with the checked mode on or off.
    pub fn with_checked(mut self, checked: bool) -> Self {
        self.checked = checked;
        self
    }

    /// This configuration with caching on or off.
    pub fn with_caching(mut self, caching: bool) -> Self {
        self.caching = caching;
        self
    }

    /// This configuration with the allocator's compact policy on or off.
    pub fn with_compact(mut self, compact: bool) -> Self {
        self.compact = compact;
        self
    }

    /// The allocator part of this configuration.
    pub fn allocator_config(&self) -> AllocatorConfig {
        AllocatorConfig {
            capacity: self.capacity,
            caching: self.caching,
            compact: self.compact,
        }
    }
}

struct DeviceInner {
    id: DeviceId,
    config: DeviceConfig,
    #[cfg(feature = "cuda")]
    cuda: Option<Arc<cudarc::driver::CudaContext>>,
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
        let default_stream =
            Stream::with_checking(id, "default", config.stream_mode, config.checked);
        Device {
            inner: Arc::new(DeviceInner {
                id,
                config,
                #[cfg(feature = "cuda")]
                cuda: None,
                allocator: CachingAllocator::with_config(id, config.allocator_config()),
                streams: Mutex::new(vec![default_stream.clone()]),
                default_stream,
            }),
        }
    }

    /// A CPU device whose memory is page-locked host memory of `gpu`'s driver
    /// (`cuMemHostAlloc`, portable to every context): an offload host for `gpu`. It behaves like
    /// [`Device::cpu_with`] (host code reads and writes it; streams are CPU streams) and, in
    /// addition, device copy engines can read and write its buffers asynchronously
    /// ([`crate::BufferRef::pinned_ptr`]), which is what makes host↔device copies overlap
    /// compute. Page-locked memory is a scarce system resource: use it for what is copied
    /// often (CPU-offloaded shards and gradients), not for everything.
    ///
    /// # Errors
    /// [`crate::AllocError::CudaUnavailable`] if `gpu` is not a CUDA device (or this build has
    /// no CUDA support).
    pub fn cpu_pinned(index: usize, config: DeviceConfig, gpu: &Device) -> Result<Device> {
        #[cfg(feature = "cuda")]
        if let Some(ctx) = &gpu.inner.cuda {
            let id = DeviceId::Cpu(index);
            let default_stream =
                Stream::with_checking(id, "default", config.stream_mode, config.checked);
            return Ok(Device {
                inner: Arc::new(DeviceInner {
                    id,
                    config,
                    cuda: None,
                    allocator: CachingAllocator::with_pinned(
                        id,
                        config.allocator_config(),
                        Arc::clone(ctx),
                    ),
                    streams: Mutex::new(vec![default_stream.clone()]),
                    default_stream,
                }),
            });
        }
        let _ = config;
        Err(crate::AllocError::CudaUnavailable(format!(
            "cpu:{index}: page-locked host memory needs a CUDA device to pin it for, got {}{}",
            gpu.id(),
            if cfg!(feature = "cuda") {
                ""
            } else {
                " (and this build of fsdp-alloc has no CUDA support; rebuild with `--features cuda`)"
            }
        )))
    }

    /// True if this is a CPU device built with [`Device::cpu_pinned`] (its memory is
    /// page-locked).
    pub fn is_pinned(&self) -> bool {
        self.inner.allocator.is_pinned()
    }

    /// A CUDA device with the default configuration. Without the `cuda` feature, or without a
    /// CUDA driver and GPU, this is an [`crate::AllocError::CudaUnavailable`] error saying which.
    pub fn cuda(ordinal: usize) -> Result<Device> {
        Device::cuda_with(ordinal, DeviceConfig::default())
    }

    /// A CUDA device: its streams are CUDA streams, its events CUDA events, and its allocator
    /// carves `cuMemAlloc` segments (with cudarc's per-slice event tracking disabled, since the
    /// allocator and streams already order the memory). `stream_mode` and `checked` are ignored
    /// (CUDA streams are always asynchronous; the checked mode is CPU-only).
    pub fn cuda_with(ordinal: usize, config: DeviceConfig) -> Result<Device> {
        #[cfg(feature = "cuda")]
        {
            let (ctx, default_backend) = crate::cuda::open(ordinal)?;
            let id = DeviceId::Cuda(ordinal);
            let default_stream = Stream::new_cuda(id, "default", default_backend);
            Ok(Device {
                inner: Arc::new(DeviceInner {
                    id,
                    config,
                    allocator: CachingAllocator::with_cuda(
                        id,
                        config.allocator_config(),
                        Arc::clone(&ctx),
                    ),
                    cuda: Some(ctx),
                    streams: Mutex::new(vec![default_stream.clone()]),
                    default_stream,
                }),
            })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = config;
            Err(crate::AllocError::CudaUnavailable(format!(
                "cuda:{ordinal}: this build of fsdp-alloc has no CUDA support; rebuild with \
                 `--features cuda`"
            )))
        }
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
    ///
    /// On a CUDA device, if the driver cannot create a stream, the returned stream is already
    /// failed with the driver's error (reported by its `check`/`synchronize`).
    pub fn new_stream(&self, name: &str) -> Stream {
        #[cfg(feature = "cuda")]
        if let Some(ctx) = &self.inner.cuda {
            let s = Stream::new_cuda_on(self.inner.id, name, ctx);
            self.inner
                .streams
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(s.clone());
            return s;
        }
        let s = Stream::with_checking(
            self.inner.id,
            name,
            self.inner.config.stream_mode,
            self.inner.config.checked,
        );
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
