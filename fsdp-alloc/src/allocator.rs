//! The per-device allocator and the RAII [`Buffer`] it hands out.
//!
//! Current policy: every allocation is one raw segment, released when its buffer is dropped
//! (no caching yet). Statistics are exact for this policy.

use std::sync::{Arc, Mutex};

use crate::error::{AllocError, Capacity, Result};
use crate::memory::{BufferRef, Segment};
use crate::stream::Stream;
use crate::DeviceId;

/// Memory statistics of one device, after `torch.cuda.memory_stats()`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes held by live allocations (rounded sizes).
    pub allocated_bytes: usize,
    /// Peak of `allocated_bytes` since creation or the last `reset_peak_stats`.
    pub peak_allocated_bytes: usize,
    /// Bytes held by live allocations plus freed blocks still waiting for other streams' events.
    pub active_bytes: usize,
    /// Peak of `active_bytes`.
    pub peak_active_bytes: usize,
    /// Bytes reserved from the device (live + cached segments).
    pub reserved_bytes: usize,
    /// Peak of `reserved_bytes`.
    pub peak_reserved_bytes: usize,
    /// Raw device allocations performed.
    pub num_raw_mallocs: u64,
    /// Raw device frees performed.
    pub num_raw_frees: u64,
    /// Times a raw allocation failed and the allocator released its cache and retried.
    pub num_alloc_retries: u64,
    /// Allocations that failed with out-of-memory.
    pub num_ooms: u64,
    /// Number of live allocations.
    pub num_allocations: u64,
}

struct State {
    stats: MemoryStats,
    next_block: u64,
}

/// One device's allocator. Thread-safe; shared by all streams of the device.
pub struct CachingAllocator {
    device: DeviceId,
    capacity: Capacity,
    state: Mutex<State>,
}

impl std::fmt::Debug for CachingAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachingAllocator")
            .field("device", &self.device)
            .field("capacity", &self.capacity)
            .finish()
    }
}

/// Allocation sizes are rounded up to a multiple of this.
pub const ROUND: usize = 512;

fn round_up(n: usize) -> usize {
    n.max(1).div_ceil(ROUND) * ROUND
}

impl CachingAllocator {
    /// An allocator for `device` that may reserve at most `capacity` bytes.
    pub fn new(device: DeviceId, capacity: Capacity) -> Arc<CachingAllocator> {
        Arc::new(CachingAllocator {
            device,
            capacity,
            state: Mutex::new(State {
                stats: MemoryStats::default(),
                next_block: 1,
            }),
        })
    }

    /// The device this allocator serves.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// The capacity it enforces.
    pub fn capacity(&self) -> Capacity {
        self.capacity
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Allocates `nbytes` for use on `stream`.
    pub fn allocate(self: &Arc<Self>, nbytes: usize, stream: &Stream) -> Result<Buffer> {
        let size = round_up(nbytes);
        let mut st = self.lock();
        if let Capacity::Bytes(cap) = self.capacity {
            if st.stats.reserved_bytes + size > cap {
                st.stats.num_ooms += 1;
                return Err(AllocError::OutOfMemory {
                    device: self.device,
                    requested: nbytes,
                    allocated: st.stats.allocated_bytes,
                    reserved: st.stats.reserved_bytes,
                    capacity: self.capacity,
                });
            }
        }
        let seg = Segment::new_cpu(self.device, size).ok_or_else(|| AllocError::OutOfMemory {
            device: self.device,
            requested: nbytes,
            allocated: st.stats.allocated_bytes,
            reserved: st.stats.reserved_bytes,
            capacity: self.capacity,
        })?;
        let block = st.next_block;
        st.next_block += 1;
        let s = &mut st.stats;
        s.num_raw_mallocs += 1;
        s.num_allocations += 1;
        s.allocated_bytes += size;
        s.active_bytes += size;
        s.reserved_bytes += size;
        s.peak_allocated_bytes = s.peak_allocated_bytes.max(s.allocated_bytes);
        s.peak_active_bytes = s.peak_active_bytes.max(s.active_bytes);
        s.peak_reserved_bytes = s.peak_reserved_bytes.max(s.reserved_bytes);
        drop(st);
        Ok(Buffer {
            data: BufferRef::new(seg, 0, nbytes, block),
            size,
            stream: stream.clone(),
            allocator: Arc::clone(self),
            used_on: Vec::new(),
        })
    }

    fn free(&self, size: usize) {
        let mut st = self.lock();
        let s = &mut st.stats;
        s.allocated_bytes -= size;
        s.active_bytes -= size;
        s.reserved_bytes -= size;
        s.num_raw_frees += 1;
        s.num_allocations -= 1;
    }

    /// A snapshot of the statistics.
    pub fn stats(&self) -> MemoryStats {
        self.lock().stats
    }

    /// Resets the peak counters to the current values.
    pub fn reset_peak_stats(&self) {
        let mut st = self.lock();
        let s = &mut st.stats;
        s.peak_allocated_bytes = s.allocated_bytes;
        s.peak_active_bytes = s.active_bytes;
        s.peak_reserved_bytes = s.reserved_bytes;
    }

    /// Releases cached, unused segments back to the device.
    pub fn empty_cache(&self) {}
}

/// An allocation: RAII owner of a block of device memory, tied to the stream it was allocated on.
///
/// Dropping it returns the block to the allocator at once; it is reusable immediately by later
/// work on the same stream (stream order makes that safe) and, if [`Buffer::record_stream`] was
/// called, by other streams only after events recorded on those streams complete.
pub struct Buffer {
    data: BufferRef,
    size: usize,
    stream: Stream,
    allocator: Arc<CachingAllocator>,
    used_on: Vec<Stream>,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("data", &self.data)
            .field("stream", &self.stream.name())
            .finish()
    }
}

impl Buffer {
    /// The memory, as a handle launched work can capture.
    pub fn data(&self) -> &BufferRef {
        &self.data
    }

    /// Requested length in bytes.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// True for a zero-byte allocation.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Bytes actually reserved for it (rounded).
    pub fn allocated_size(&self) -> usize {
        self.size
    }

    /// The stream it was allocated on (its owner stream).
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The device it lives on.
    pub fn device(&self) -> DeviceId {
        self.allocator.device
    }

    /// Marks the buffer as used by work on `stream`, so that after it is freed the block is not
    /// reused until everything launched on `stream` up to the free has completed.
    pub fn record_stream(&mut self, stream: &Stream) {
        if *stream != self.stream && !self.used_on.contains(stream) {
            self.used_on.push(stream.clone());
        }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        self.allocator.free(self.size);
    }
}
