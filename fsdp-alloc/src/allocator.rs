//! The per-device caching allocator and the RAII [`Buffer`] it hands out.
//!
//! It follows PyTorch's CUDA caching allocator, because FSDP's memory behaviour depends on it,
//! with one change of policy (the *compact* policy, on by default, [`AllocatorConfig::compact`])
//! that closes the gap between the memory it reserves and the memory in use.
//!
//! - **Rounding.** Requests are rounded up to a multiple of [`ROUND`] (512 B).
//! - **Pools.** Requests of at most [`SMALL_SIZE`] (1 MiB) come from the *small* pool, carved out
//!   of shared segments; larger ones from the *large* pool. Compact policy on host memory:
//!   small segments of 1 MiB, and a new large segment is the rounded request itself (on a CUDA
//!   device both are rounded up to the driver's 2 MiB granularity). PyTorch's policy
//!   ([`segment_size`]): [`SMALL_BUFFER`] (2 MiB) small segments, [`LARGE_BUFFER`] (20 MiB)
//!   segments for requests under [`MIN_LARGE_ALLOC`] (10 MiB), otherwise the request rounded up
//!   to [`ROUND_LARGE`] (2 MiB).
//! - **Streams own blocks.** A segment belongs to one stream at a time; a request is served by
//!   the best-fitting (smallest sufficient) free block *of the same stream and pool*. A larger
//!   block is split when the remainder is worth keeping (≥ 512 B in the small pool, > 1 MiB in
//!   the large pool); a freed block is coalesced with free neighbours of its segment.
//! - **Freeing.** Dropping a [`Buffer`] returns its block to its stream's free list at once:
//!   work launched later on that stream is ordered after all earlier work, so reuse is safe. If
//!   the buffer was used on other streams ([`Buffer::record_stream`]), the drop records an event
//!   on each of them and the block stays *active but not allocated* until all those events have
//!   completed; completed ones are collected at the start of every allocation (PyTorch's
//!   `process_events`).
//! - **Before reserving more (compact policy).** When no free block of the stream fits, and
//!   before any raw allocation, the allocator (1) turns the stream's own pending frees into free
//!   blocks whose next owner's *stream* waits for their events ([`Stream::wait_event`]: the
//!   issuing thread never blocks), and (2) adopts the smallest entirely free cached segment of
//!   another stream, recording an event on that stream (it completes after every use of the
//!   memory there, all launched before the free) for the new owner's stream to wait for. Both
//!   keep the stream-safety rule — memory used on another stream is reused only by work ordered
//!   after that use — and trade a possible stream wait for not reserving memory; a block that
//!   needs no wait is always preferred.
//! - **Free-and-retry.** When a raw allocation fails (capacity exceeded or the host refuses),
//!   the allocator waits for every pending free's events, synchronizes the streams it has served
//!   (except the one whose work is calling it, which would deadlock), tries the stream's free
//!   list again (blocks whose events just completed), then releases every cached segment that is
//!   entirely free and tries a raw allocation once more; each such attempt counts in
//!   `num_alloc_retries`. Last (not in PyTorch, for capped devices): a small request may take a
//!   free block of the stream's large pool, and when the standard segment for the request does
//!   not fit under the capacity, a segment of just the rounded request is tried. If that fails
//!   too the result is [`AllocError::OutOfMemory`].
//! - **Statistics** as in `torch.cuda.memory_stats()` ([`MemoryStats`], per pool [`PoolStats`]).
//!
//! # Why reserved memory was 2.4–2.8× the peak in use, and what the compact policy does
//!
//! On `cargo xtask bench alloc`'s training-like pattern (16 MiB unit all-gathers on a comm
//! stream, 2–4 MiB activations and 16 MiB gradients on compute, 4 MiB reduce-scatter outputs)
//! PyTorch's policy reserved 152 MiB for a 55 MiB peak: every 2–4 MiB request opened a 20 MiB
//! segment and every 16 MiB + 4 KiB one an 18 MiB segment (*segment rounding*); all-gather
//! buffers and gradients freed with `record_stream` sat pending while the issuing thread ran
//! ahead and allocated fresh segments (*pending frees*: peak active 98 MiB); and memory freed on
//! one stream could never serve another (*stranding*). The compact policy removes all three:
//! 56 MiB reserved (1.02×), no raw allocation after warm-up. On `train_gpt` (GPT-mini, W = 4)
//! a rank held 90 MiB for a 53 MiB peak (1.70×: three 20 MiB segments and fifteen 2 MiB ones,
//! whose 0.75 MiB parameter / gradient / optimizer shards left a quarter of each idle); with the
//! compact policy it holds 1.10× (measured on a recorded trace of one rank's allocations).
//! Its cost is a stream wait where
//! PyTorch would reserve more memory: a stream reusing a pending block or adopting another
//! stream's segment may wait for that other stream's queued work.
//!
//! Not implemented from PyTorch: `max_split_size_mb`, expandable segments (a virtual range
//! mapped page by page, which would also let free space *inside* partly used segments serve a
//! new request), graph pools, the first "release only blocks of the needed size" stage before a
//! full cache flush, and garbage collection thresholds. Fragmentation inside partly used
//! segments is therefore still possible: a request that fits no single free block opens a new
//! segment even when the free bytes add up.
//!
//! Releasing a segment means dropping the allocator's `Arc<Segment>`; work already queued that
//! still holds a [`BufferRef`] into it keeps the memory alive until it finishes, so reuse and
//! release are always memory-safe (see [`crate::memory`]). The non-caching mode
//! ([`AllocatorConfig::caching`] = false) gives every allocation its own segment and releases it
//! as soon as the block is free: the "system allocator" baseline.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use crate::error::{AllocError, Capacity, Result};
use crate::memory::{BufferRef, Segment};
use crate::stream::{Event, Stream, StreamId, WeakStream};
use crate::DeviceId;

/// Allocation sizes are rounded up to a multiple of this.
pub const ROUND: usize = 512;
/// Largest request served from the small pool (1 MiB).
pub const SMALL_SIZE: usize = 1 << 20;
/// Segment size of the small pool (2 MiB).
pub const SMALL_BUFFER: usize = 2 << 20;
/// Requests of at least this size (10 MiB) get a segment of their own rounded size.
pub const MIN_LARGE_ALLOC: usize = 10 << 20;
/// Segment size for large-pool requests below [`MIN_LARGE_ALLOC`] (20 MiB).
pub const LARGE_BUFFER: usize = 20 << 20;
/// Large segments of at least [`MIN_LARGE_ALLOC`] are rounded up to a multiple of this (2 MiB).
pub const ROUND_LARGE: usize = 2 << 20;

fn round_up(n: usize) -> usize {
    n.max(1).div_ceil(ROUND) * ROUND
}

/// Which pool a block comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Pool {
    /// Requests of at most [`SMALL_SIZE`] bytes, carved from 2 MiB segments.
    Small,
    /// Larger requests.
    Large,
}

impl Pool {
    /// The pool a request of `rounded` bytes (already a multiple of 512) is served from.
    pub fn for_size(rounded: usize) -> Pool {
        if rounded <= SMALL_SIZE {
            Pool::Small
        } else {
            Pool::Large
        }
    }
}

/// Size of the raw segment the caching allocator reserves for a request of `rounded` bytes.
pub fn segment_size(rounded: usize) -> usize {
    if rounded <= SMALL_SIZE {
        SMALL_BUFFER
    } else if rounded < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        rounded.div_ceil(ROUND_LARGE).saturating_mul(ROUND_LARGE)
    }
}

/// The statistics of one pool (small or large).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes held by live allocations of this pool.
    pub allocated_bytes: usize,
    /// Peak of `allocated_bytes`.
    pub peak_allocated_bytes: usize,
    /// Live bytes plus freed bytes still waiting for other streams' events.
    pub active_bytes: usize,
    /// Peak of `active_bytes`.
    pub peak_active_bytes: usize,
    /// Bytes of this pool's segments.
    pub reserved_bytes: usize,
    /// Peak of `reserved_bytes`.
    pub peak_reserved_bytes: usize,
    /// Segments currently reserved.
    pub segments: u64,
    /// Raw allocations of this pool's segments.
    pub num_raw_mallocs: u64,
    /// Raw frees of this pool's segments.
    pub num_raw_frees: u64,
}

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
    /// Sum of the *requested* (unrounded) sizes of live allocations.
    pub requested_bytes: usize,
    /// Freed blocks whose reuse still waits for events on other streams.
    pub num_pending_frees: u64,
    /// Free blocks that are part of a segment with live blocks (fragmentation), in bytes.
    pub inactive_split_bytes: usize,
    /// Small-pool breakdown.
    pub small: PoolStats,
    /// Large-pool breakdown.
    pub large: PoolStats,
}

/// How an allocator behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocatorConfig {
    /// At most this many bytes may be reserved from the device.
    pub capacity: Capacity,
    /// Cache freed blocks (the default). `false` gives every allocation its own raw segment,
    /// released as soon as the block is free: a baseline without caching.
    pub caching: bool,
    /// The compact policy (the default; see the module docs): large segments of the rounded
    /// request instead of 20 MiB / 2 MiB-rounded ones, and before any raw allocation a stream
    /// reuses its own blocks still waiting for other streams' events, then adopts an entirely
    /// free cached segment of another stream — each time making its own later work wait for the
    /// events that guard the memory instead of reserving more. `false` is PyTorch's policy.
    pub compact: bool,
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig {
            capacity: Capacity::Unlimited,
            caching: true,
            compact: true,
        }
    }
}

/// State of a block in a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockState {
    /// Owned by a live [`Buffer`].
    Allocated,
    /// Freed, waiting for events recorded on the streams that used it.
    PendingEvents,
    /// In its stream's free list.
    Free,
}

/// One block of a segment in an [`CachingAllocator::snapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockInfo {
    /// Byte offset in the segment.
    pub offset: usize,
    /// Size in bytes.
    pub size: usize,
    /// State.
    pub state: BlockState,
}

/// One segment in an [`CachingAllocator::snapshot`] (like `torch.cuda.memory_snapshot()`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentInfo {
    /// Process-unique segment id (as in [`BufferRef::location`]).
    pub segment_id: u64,
    /// Size in bytes.
    pub size: usize,
    /// Pool.
    pub pool: Pool,
    /// The stream that owns it.
    pub stream: StreamId,
    /// Its blocks, in address order; they tile the segment.
    pub blocks: Vec<BlockInfo>,
}

struct Block {
    seg: u64,
    offset: usize,
    size: usize,
    stream: StreamId,
    pool: Pool,
    state: BlockState,
    prev: Option<u64>,
    next: Option<u64>,
    /// Checked mode: events this block's next owner must be ordered after.
    after: Vec<Event>,
    /// Events the stream of this block's next owner must wait for before using it (compact
    /// policy: blocks freed early from pending frees or adopted from another stream).
    waits: Vec<Event>,
}

struct SegEntry {
    seg: Arc<Segment>,
    pool: Pool,
    stream: StreamId,
    head: u64,
}

struct PendingFree {
    key: u64,
    events: Vec<Event>,
}

struct State {
    blocks: HashMap<u64, Block>,
    segs: HashMap<u64, SegEntry>,
    /// Free blocks, ordered for best fit: (pool, stream, size, key).
    free: BTreeSet<(Pool, StreamId, usize, u64)>,
    pending: Vec<PendingFree>,
    streams: HashMap<StreamId, WeakStream>,
    stats: MemoryStats,
    next_key: u64,
    next_alloc: u64,
}

impl State {
    fn pool_mut(&mut self, pool: Pool) -> &mut PoolStats {
        match pool {
            Pool::Small => &mut self.stats.small,
            Pool::Large => &mut self.stats.large,
        }
    }

    fn add_allocated(&mut self, pool: Pool, size: usize, requested: usize) {
        let s = &mut self.stats;
        s.allocated_bytes += size;
        s.active_bytes += size;
        s.requested_bytes += requested;
        s.num_allocations += 1;
        s.peak_allocated_bytes = s.peak_allocated_bytes.max(s.allocated_bytes);
        s.peak_active_bytes = s.peak_active_bytes.max(s.active_bytes);
        let p = self.pool_mut(pool);
        p.allocated_bytes += size;
        p.active_bytes += size;
        p.peak_allocated_bytes = p.peak_allocated_bytes.max(p.allocated_bytes);
        p.peak_active_bytes = p.peak_active_bytes.max(p.active_bytes);
    }

    fn add_segment(&mut self, pool: Pool, size: usize) {
        let s = &mut self.stats;
        s.reserved_bytes += size;
        s.num_raw_mallocs += 1;
        s.peak_reserved_bytes = s.peak_reserved_bytes.max(s.reserved_bytes);
        let p = self.pool_mut(pool);
        p.reserved_bytes += size;
        p.segments += 1;
        p.num_raw_mallocs += 1;
        p.peak_reserved_bytes = p.peak_reserved_bytes.max(p.reserved_bytes);
    }

    fn remove_segment(&mut self, pool: Pool, size: usize) {
        self.stats.reserved_bytes -= size;
        self.stats.num_raw_frees += 1;
        let p = self.pool_mut(pool);
        p.reserved_bytes -= size;
        p.segments -= 1;
        p.num_raw_frees += 1;
    }

    fn key(&mut self) -> u64 {
        self.next_key += 1;
        self.next_key
    }
}

/// One device's allocator. Thread-safe; shared by all streams of the device.
pub struct CachingAllocator {
    device: DeviceId,
    config: AllocatorConfig,
    backend: RawBackend,
    state: Mutex<State>,
}

/// Where raw segments come from.
enum RawBackend {
    Host,
    #[cfg(feature = "cuda")]
    Cuda(Arc<cudarc::driver::CudaContext>),
    /// Page-locked host memory (`cuMemHostAlloc`) for a CPU device paired with a GPU.
    #[cfg(feature = "cuda")]
    Pinned(Arc<cudarc::driver::CudaContext>),
}

impl std::fmt::Debug for CachingAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachingAllocator")
            .field("device", &self.device)
            .field("config", &self.config)
            .finish()
    }
}

/// What a successful search or raw allocation produced, to finish outside the lock.
struct Granted {
    key: u64,
    seg: Arc<Segment>,
    offset: usize,
    size: usize,
    alloc_id: u64,
    after: Vec<Event>,
    waits: Vec<Event>,
}

impl CachingAllocator {
    /// An allocator for `device` that may reserve at most `capacity` bytes (caching on).
    pub fn new(device: DeviceId, capacity: Capacity) -> Arc<CachingAllocator> {
        CachingAllocator::with_config(
            device,
            AllocatorConfig {
                capacity,
                ..AllocatorConfig::default()
            },
        )
    }

    /// An allocator for `device` with the given configuration.
    pub fn with_config(device: DeviceId, config: AllocatorConfig) -> Arc<CachingAllocator> {
        Arc::new(CachingAllocator::build(device, config, RawBackend::Host))
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn with_cuda(
        device: DeviceId,
        config: AllocatorConfig,
        ctx: Arc<cudarc::driver::CudaContext>,
    ) -> Arc<CachingAllocator> {
        Arc::new(CachingAllocator::build(
            device,
            config,
            RawBackend::Cuda(ctx),
        ))
    }

    /// True if raw segments are page-locked host memory.
    pub fn is_pinned(&self) -> bool {
        #[cfg(feature = "cuda")]
        if matches!(self.backend, RawBackend::Pinned(_)) {
            return true;
        }
        false
    }

    /// A host allocator whose segments are page-locked (`cuMemHostAlloc` in `ctx`).
    #[cfg(feature = "cuda")]
    pub(crate) fn with_pinned(
        device: DeviceId,
        config: AllocatorConfig,
        ctx: Arc<cudarc::driver::CudaContext>,
    ) -> Arc<CachingAllocator> {
        Arc::new(CachingAllocator::build(
            device,
            config,
            RawBackend::Pinned(ctx),
        ))
    }

    fn build(device: DeviceId, config: AllocatorConfig, backend: RawBackend) -> CachingAllocator {
        CachingAllocator {
            device,
            config,
            backend,
            state: Mutex::new(State {
                blocks: HashMap::new(),
                segs: HashMap::new(),
                free: BTreeSet::new(),
                pending: Vec::new(),
                streams: HashMap::new(),
                stats: MemoryStats::default(),
                next_key: 0,
                next_alloc: 0,
            }),
        }
    }

    /// The device this allocator serves.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// The capacity it enforces.
    pub fn capacity(&self) -> Capacity {
        self.config.capacity
    }

    /// Its configuration.
    pub fn config(&self) -> AllocatorConfig {
        self.config
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Allocates `nbytes` for use on `stream`. The block is reusable by later work on `stream`
    /// as soon as the returned [`Buffer`] is dropped.
    pub fn allocate(self: &Arc<Self>, nbytes: usize, stream: &Stream) -> Result<Buffer> {
        if nbytes > isize::MAX as usize / 2 {
            let st = self.lock();
            return Err(self.oom(&st, nbytes));
        }
        let size = round_up(nbytes);
        let pool = Pool::for_size(size);
        let sid = stream.id();
        let mut st = self.lock();
        if !st.streams.contains_key(&sid) {
            if st.streams.len() >= 64 {
                // Forget streams that are gone and own no segment any more.
                let owners: std::collections::HashSet<StreamId> =
                    st.segs.values().map(|e| e.stream).collect();
                st.streams
                    .retain(|id, w| owners.contains(id) || w.upgrade().is_some());
            }
            st.streams.insert(sid, stream.downgrade());
        }
        self.process_events(&mut st);
        let mut granted = if self.config.caching {
            self.take_free(&mut st, pool, sid, size, nbytes)
        } else {
            None
        };
        if granted.is_none() && self.config.caching && self.config.compact {
            granted = self.take_compact(&mut st, pool, sid, size, nbytes);
        }
        if granted.is_none() {
            granted = self.take_new(&mut st, pool, sid, size, nbytes, false);
        }
        if granted.is_none() {
            // Free-and-retry: wait for pending frees and in-flight work, empty the cache, retry.
            drop(st);
            self.synchronize_for_retry();
            st = self.lock();
            st.stats.num_alloc_retries += 1;
            self.process_events(&mut st);
            if self.config.caching {
                // Blocks whose events have now completed may fit (PyTorch would flush them and
                // still fail when their segment is partly in use).
                granted = self.take_free(&mut st, pool, sid, size, nbytes);
            }
            if granted.is_none() {
                self.release_free_segments(&mut st);
                granted = self.take_new(&mut st, pool, sid, size, nbytes, false);
            }
            // Last resorts (not in PyTorch), for capped devices: a small request from a free
            // block of this stream's large pool (whose 20 MiB segments may be mostly free but
            // pinned by a few live blocks), then a segment of just the request when the
            // standard 2 / 20 MiB segment no longer fits under the capacity.
            if granted.is_none() && self.config.caching && pool == Pool::Small {
                granted = self.take_free(&mut st, Pool::Large, sid, size, nbytes);
            }
            if granted.is_none() && self.config.caching {
                granted = self.take_new(&mut st, pool, sid, size, nbytes, true);
            }
        }
        let Some(g) = granted else {
            st.stats.num_ooms += 1;
            return Err(self.oom(&st, nbytes));
        };
        drop(st);
        if !g.after.is_empty() {
            stream.order_after(&g.after);
        }
        for e in &g.waits {
            // Later work on `stream` runs after the events guarding the block (a no-op for
            // events already complete).
            stream.wait_event(e);
        }
        Ok(Buffer {
            data: BufferRef::new(g.seg, g.offset, nbytes, g.alloc_id),
            size: g.size,
            requested: nbytes,
            key: g.key,
            stream: stream.clone(),
            allocator: Arc::clone(self),
            used_on: Vec::new(),
        })
    }

    fn oom(&self, st: &State, requested: usize) -> AllocError {
        AllocError::OutOfMemory {
            device: self.device,
            requested,
            allocated: st.stats.allocated_bytes,
            reserved: st.stats.reserved_bytes,
            capacity: self.config.capacity,
        }
    }

    /// Best fit among the free blocks of `stream` in `pool`, split if worthwhile.
    fn take_free(
        &self,
        st: &mut State,
        pool: Pool,
        sid: StreamId,
        size: usize,
        requested: usize,
    ) -> Option<Granted> {
        let &(_, _, bsize, key) = st
            .free
            .range((pool, sid, size, 0)..=(pool, sid, usize::MAX, u64::MAX))
            .next()?;
        st.free.remove(&(pool, sid, bsize, key));
        let remaining = bsize - size;
        let split = match pool {
            Pool::Small => remaining >= ROUND,
            Pool::Large => remaining > SMALL_SIZE,
        };
        let granted_size = if split {
            let rest_key = st.key();
            let b = st.blocks.get_mut(&key)?;
            let rest = Block {
                seg: b.seg,
                offset: b.offset + size,
                size: remaining,
                stream: b.stream,
                pool: b.pool,
                state: BlockState::Free,
                prev: Some(key),
                next: b.next,
                after: b.after.clone(),
                waits: b.waits.clone(),
            };
            b.size = size;
            b.next = Some(rest_key);
            if let Some(n) = rest.next {
                if let Some(nb) = st.blocks.get_mut(&n) {
                    nb.prev = Some(rest_key);
                }
            }
            st.free.insert((pool, sid, remaining, rest_key));
            st.blocks.insert(rest_key, rest);
            size
        } else {
            bsize
        };
        self.grant(st, key, granted_size, requested)
    }

    /// The compact policy's size of a new segment for a request of `rounded` bytes. On host
    /// memory: a [`SMALL_SIZE`] (1 MiB) segment for the small pool, shared by many small blocks
    /// (the largest small request fills it exactly, where a 2 MiB segment holding two 0.75 MiB
    /// blocks leaves a quarter idle), and the request itself for the large pool. On a CUDA
    /// device everything is rounded up to the driver's 2 MiB granularity (`cudaMalloc`
    /// reserves that much anyway): 2 MiB small segments, large ones rounded up to 2 MiB.
    fn compact_segment_size(&self, rounded: usize) -> usize {
        match &self.backend {
            RawBackend::Host if rounded <= SMALL_SIZE => SMALL_SIZE,
            RawBackend::Host => rounded,
            #[cfg(feature = "cuda")]
            RawBackend::Pinned(_) if rounded <= SMALL_SIZE => SMALL_SIZE,
            #[cfg(feature = "cuda")]
            RawBackend::Pinned(_) => rounded,
            #[cfg(feature = "cuda")]
            RawBackend::Cuda(_) if rounded <= SMALL_SIZE => SMALL_BUFFER,
            #[cfg(feature = "cuda")]
            RawBackend::Cuda(_) => rounded.div_ceil(ROUND_LARGE).saturating_mul(ROUND_LARGE),
        }
    }

    /// The compact policy's stages between "a free block of the stream" and "a raw allocation":
    ///
    /// 1. the stream's own pending frees (blocks freed on it, still waiting for events recorded
    ///    on other streams) become free blocks whose next owner's stream waits for those events;
    ///    best fit among the stream's blocks again;
    /// 2. the smallest entirely free cached segment of another stream (same pool, large enough)
    ///    is adopted: an event is recorded on its old stream now — after every use of the
    ///    memory there, all of which was launched before it was freed — and the new owner's
    ///    stream waits for it (and for the block's own waits).
    ///
    /// Both keep the stream-safety rule: memory used on another stream is reused only by work
    /// ordered after that use, through a stream wait instead of a host wait.
    fn take_compact(
        &self,
        st: &mut State,
        pool: Pool,
        sid: StreamId,
        size: usize,
        requested: usize,
    ) -> Option<Granted> {
        if st
            .pending
            .iter()
            .any(|p| st.blocks.get(&p.key).is_some_and(|b| b.stream == sid))
        {
            let pending = std::mem::take(&mut st.pending);
            for p in pending {
                if st.blocks.get(&p.key).is_some_and(|b| b.stream == sid) {
                    self.free_block(st, p.key, p.events, true);
                } else {
                    st.pending.push(p);
                }
            }
            if let Some(g) = self.take_free(st, pool, sid, size, requested) {
                return Some(g);
            }
        }
        // Smallest entirely free segment of another live stream.
        let mut best: Option<(usize, u64, u64)> = None; // (size, block key, segment id)
        for (&seg_id, e) in &st.segs {
            if e.pool != pool || e.stream == sid || e.seg.size() < size {
                continue;
            }
            let Some(b) = st.blocks.get(&e.head) else {
                continue;
            };
            let whole = b.state == BlockState::Free && b.prev.is_none() && b.next.is_none();
            if whole && best.is_none_or(|(bs, _, id)| (b.size, seg_id) < (bs, id)) {
                best = Some((b.size, e.head, seg_id));
            }
        }
        let (bsize, key, seg_id) = best?;
        let old = st.segs.get(&seg_id)?.stream;
        let owner = st.streams.get(&old).and_then(WeakStream::upgrade)?;
        let fence = owner.record_event();
        st.free.remove(&(pool, old, bsize, key));
        if let Some(e) = st.segs.get_mut(&seg_id) {
            e.stream = sid;
        }
        let b = st.blocks.get_mut(&key)?;
        b.stream = sid;
        b.waits.push(fence);
        st.free.insert((pool, sid, bsize, key));
        self.take_free(st, pool, sid, size, requested)
    }

    /// A new raw segment for the request; `None` if the device refuses.
    /// A new segment for `stream` holding the request: of the standard size for the request
    /// ([`segment_size`]), or with `tight` (and without caching) of the rounded request only.
    fn take_new(
        &self,
        st: &mut State,
        pool: Pool,
        sid: StreamId,
        size: usize,
        requested: usize,
        tight: bool,
    ) -> Option<Granted> {
        let seg_size = if !self.config.caching || tight {
            size
        } else if self.config.compact {
            self.compact_segment_size(size)
        } else {
            segment_size(size)
        };
        if let Capacity::Bytes(cap) = self.config.capacity {
            if st.stats.reserved_bytes.saturating_add(seg_size) > cap {
                return None;
            }
        }
        let seg = self.raw_alloc(seg_size)?;
        let key = st.key();
        let seg_id = seg.id();
        st.segs.insert(
            seg_id,
            SegEntry {
                seg,
                pool,
                stream: sid,
                head: key,
            },
        );
        st.blocks.insert(
            key,
            Block {
                seg: seg_id,
                offset: 0,
                size: seg_size,
                stream: sid,
                pool,
                state: BlockState::Free,
                prev: None,
                next: None,
                after: Vec::new(),
                waits: Vec::new(),
            },
        );
        st.add_segment(pool, seg_size);
        st.free.insert((pool, sid, seg_size, key));
        self.take_free(st, pool, sid, size, requested)
    }

    fn raw_alloc(&self, size: usize) -> Option<Arc<Segment>> {
        match &self.backend {
            RawBackend::Host => Segment::new_cpu(self.device, size),
            #[cfg(feature = "cuda")]
            RawBackend::Cuda(ctx) => crate::cuda::DeviceMemory::alloc(ctx, size)
                .ok()
                .map(|m| Segment::new_cuda(self.device, m)),
            #[cfg(feature = "cuda")]
            RawBackend::Pinned(ctx) => crate::cuda::PinnedMemory::alloc(ctx, size)
                .ok()
                .map(|m| Segment::new_pinned(self.device, m)),
        }
    }

    fn grant(&self, st: &mut State, key: u64, size: usize, requested: usize) -> Option<Granted> {
        st.next_alloc += 1;
        let alloc_id = st.next_alloc;
        let b = st.blocks.get_mut(&key)?;
        b.state = BlockState::Allocated;
        let after = std::mem::take(&mut b.after);
        let waits = std::mem::take(&mut b.waits);
        let (seg_id, offset, pool) = (b.seg, b.offset, b.pool);
        let seg = Arc::clone(&st.segs.get(&seg_id)?.seg);
        st.add_allocated(pool, size, requested);
        Some(Granted {
            key,
            seg,
            offset,
            size,
            alloc_id,
            after,
            waits,
        })
    }

    /// Frees the blocks of completed pending frees (PyTorch's `process_events`).
    fn process_events(&self, st: &mut State) {
        if st.pending.is_empty() {
            return;
        }
        let pending = std::mem::take(&mut st.pending);
        for p in pending {
            if p.events.iter().all(Event::query) {
                self.free_block(st, p.key, p.events, false);
            } else {
                st.pending.push(p);
            }
        }
    }

    /// Puts an allocated-or-pending block back on its stream's free list, coalescing it with
    /// free neighbours; releases the segment at once in non-caching mode.
    ///
    /// With `as_waits` the events may still be pending: they become the block's `waits`, which
    /// the stream of its next owner waits for (compact policy).
    fn free_block(&self, st: &mut State, key: u64, events: Vec<Event>, as_waits: bool) {
        let Some(owner) = st.blocks.get(&key).map(|b| b.stream) else {
            return;
        };
        let keep_events = !events.is_empty() && self.stream_checked(st, owner);
        let Some(b) = st.blocks.get_mut(&key) else {
            return;
        };
        let (pool, size) = (b.pool, b.size);
        b.state = BlockState::Free;
        if as_waits {
            b.waits
                .extend(events.iter().filter(|e| !e.query()).cloned());
        }
        if keep_events {
            b.after.extend(events);
        }
        st.stats.active_bytes -= size;
        st.pool_mut(pool).active_bytes -= size;
        let mut key = key;
        // Merge with the previous block, then the next one.
        let prev = st.blocks.get(&key).and_then(|b| b.prev);
        if let Some(p) = prev {
            if self.is_free(st, p) {
                key = self.merge(st, p, key);
            }
        }
        let next = st.blocks.get(&key).and_then(|b| b.next);
        if let Some(n) = next {
            if self.is_free(st, n) {
                key = self.merge(st, key, n);
            }
        }
        let Some(b) = st.blocks.get(&key) else {
            return;
        };
        let entry = (b.pool, b.stream, b.size, key);
        let whole = b.prev.is_none() && b.next.is_none();
        st.free.insert(entry);
        if whole && !self.config.caching {
            let seg = b.seg;
            self.release_segment(st, seg);
        }
    }

    fn stream_checked(&self, st: &State, sid: StreamId) -> bool {
        st.streams
            .get(&sid)
            .and_then(WeakStream::upgrade)
            .is_some_and(|s| s.is_checked())
    }

    fn is_free(&self, st: &State, key: u64) -> bool {
        st.blocks
            .get(&key)
            .is_some_and(|b| b.state == BlockState::Free)
    }

    /// Merges free block `b` into its predecessor `a` (both in `blocks`; `a` may be the one being
    /// freed, not yet in the free set). Returns `a`.
    fn merge(&self, st: &mut State, a: u64, b: u64) -> u64 {
        let Some(bb) = st.blocks.remove(&b) else {
            return a;
        };
        st.free.remove(&(bb.pool, bb.stream, bb.size, b));
        if let Some(ab) = st.blocks.get(&a) {
            st.free.remove(&(ab.pool, ab.stream, ab.size, a));
        }
        if let Some(n) = bb.next {
            if let Some(nb) = st.blocks.get_mut(&n) {
                nb.prev = Some(a);
            }
        }
        if let Some(ab) = st.blocks.get_mut(&a) {
            ab.size += bb.size;
            ab.next = bb.next;
            ab.after.extend(bb.after);
            ab.waits.extend(bb.waits);
        }
        a
    }

    fn release_segment(&self, st: &mut State, seg_id: u64) {
        let Some(e) = st.segs.remove(&seg_id) else {
            return;
        };
        if let Some(b) = st.blocks.remove(&e.head) {
            st.free.remove(&(b.pool, b.stream, b.size, e.head));
        }
        st.remove_segment(e.pool, e.seg.size());
        // Dropping the allocator's Arc: the memory goes once queued work holding a BufferRef
        // into it has finished.
        drop(e);
    }

    /// Releases every segment that is one free block.
    fn release_free_segments(&self, st: &mut State) {
        let whole: Vec<u64> = st
            .segs
            .iter()
            .filter(|(_, e)| {
                st.blocks.get(&e.head).is_some_and(|b| {
                    b.state == BlockState::Free && b.next.is_none() && b.prev.is_none()
                })
            })
            .map(|(&id, _)| id)
            .collect();
        for id in whole {
            self.release_segment(st, id);
        }
    }

    /// Waits for everything that could make memory free: pending frees' events, then the work
    /// of every live stream this allocator served — except the stream whose work is running on
    /// this thread (waiting for it would wait for ourselves).
    fn synchronize_for_retry(&self) {
        let (events, streams): (Vec<Event>, Vec<WeakStream>) = {
            let st = self.lock();
            (
                st.pending
                    .iter()
                    .flat_map(|p| p.events.iter().cloned())
                    .collect(),
                st.streams.values().cloned().collect(),
            )
        };
        let me = crate::checked::running_on();
        for e in events {
            if e.stream_id().is_some() && e.stream_id() == me {
                continue;
            }
            let _ = e.synchronize(); // a failed stream's event is complete as well
        }
        for s in streams.iter().filter_map(WeakStream::upgrade) {
            if Some(s.id()) != me {
                let _ = s.synchronize();
            }
        }
    }

    fn release(&self, key: u64, stream: &Stream, used_on: &[Stream], requested: usize) {
        let events: Vec<Event> = used_on
            .iter()
            .filter(|s| *s != stream)
            .map(Stream::record_event)
            .collect();
        // Checked mode: whoever reuses the block must be ordered after what the freeing thread
        // (or the job it runs) has seen — that is the point after which the free happened.
        let point = if stream.is_checked() {
            crate::checked::free_point().map(Event::observed_at)
        } else {
            None
        };
        let mut st = self.lock();
        let Some(b) = st.blocks.get_mut(&key) else {
            return;
        };
        b.after.extend(point);
        let (pool, size) = (b.pool, b.size);
        st.stats.allocated_bytes -= size;
        st.stats.requested_bytes -= requested;
        st.stats.num_allocations -= 1;
        st.pool_mut(pool).allocated_bytes -= size;
        if events.is_empty() {
            self.free_block(&mut st, key, events, false);
        } else {
            if let Some(b) = st.blocks.get_mut(&key) {
                b.state = BlockState::PendingEvents;
            }
            st.pending.push(PendingFree { key, events });
        }
    }

    /// A snapshot of the statistics (collecting completed pending frees first).
    pub fn stats(&self) -> MemoryStats {
        let mut st = self.lock();
        self.process_events(&mut st);
        let mut s = st.stats;
        s.num_pending_frees = st.pending.len() as u64;
        s.inactive_split_bytes = st
            .blocks
            .values()
            .filter(|b| b.state == BlockState::Free && (b.prev.is_some() || b.next.is_some()))
            .map(|b| b.size)
            .sum();
        s
    }

    /// Resets the peak counters to the current values.
    pub fn reset_peak_stats(&self) {
        let mut st = self.lock();
        let s = &mut st.stats;
        s.peak_allocated_bytes = s.allocated_bytes;
        s.peak_active_bytes = s.active_bytes;
        s.peak_reserved_bytes = s.reserved_bytes;
        for p in [&mut s.small, &mut s.large] {
            p.peak_allocated_bytes = p.allocated_bytes;
            p.peak_active_bytes = p.active_bytes;
            p.peak_reserved_bytes = p.reserved_bytes;
        }
    }

    /// Releases cached, unused segments (those entirely free) back to the device. Blocks still
    /// waiting for events are not waited for.
    pub fn empty_cache(&self) {
        let mut st = self.lock();
        self.process_events(&mut st);
        self.release_free_segments(&mut st);
    }

    /// Every segment and its blocks (like `torch.cuda.memory_snapshot()`), sorted by segment id.
    pub fn snapshot(&self) -> Vec<SegmentInfo> {
        let st = self.lock();
        let mut out: Vec<SegmentInfo> = st
            .segs
            .iter()
            .map(|(&id, e)| {
                let mut blocks = Vec::new();
                let mut k = Some(e.head);
                while let Some(key) = k {
                    let Some(b) = st.blocks.get(&key) else { break };
                    blocks.push(BlockInfo {
                        offset: b.offset,
                        size: b.size,
                        state: b.state,
                    });
                    k = b.next;
                }
                SegmentInfo {
                    segment_id: id,
                    size: e.seg.size(),
                    pool: e.pool,
                    stream: e.stream,
                    blocks,
                }
            })
            .collect();
        out.sort_by_key(|s| s.segment_id);
        out
    }

    /// Checks the allocator's internal invariants; `Err` describes the first one broken. Meant
    /// for tests and debugging: blocks tile their segments, no two free neighbours are left
    /// uncoalesced, the free lists hold exactly the free blocks, and the statistics equal the
    /// sums over blocks and segments.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let st = self.lock();
        let mut allocated = 0usize;
        let mut active = 0usize;
        let mut reserved = 0usize;
        let mut nblocks = 0usize;
        let mut nfree = 0usize;
        for (&id, e) in &st.segs {
            reserved += e.seg.size();
            let mut off = 0usize;
            let mut prev: Option<u64> = None;
            let mut prev_free = false;
            let mut k = Some(e.head);
            while let Some(key) = k {
                let b = st
                    .blocks
                    .get(&key)
                    .ok_or_else(|| format!("segment {id}: missing block {key}"))?;
                nblocks += 1;
                if b.seg != id || b.offset != off || b.prev != prev || b.stream != e.stream {
                    return Err(format!(
                        "segment {id}: block {key} at {} (expected {off}) is not linked in order",
                        b.offset
                    ));
                }
                let free = b.state == BlockState::Free;
                if free && prev_free {
                    return Err(format!("segment {id}: free neighbours left uncoalesced"));
                }
                if free {
                    nfree += 1;
                    if !st.free.contains(&(b.pool, b.stream, b.size, key)) {
                        return Err(format!("free block {key} missing from its free list"));
                    }
                }
                if b.state == BlockState::Allocated {
                    allocated += b.size;
                }
                if b.state != BlockState::Free {
                    active += b.size;
                }
                prev_free = free;
                off += b.size;
                prev = Some(key);
                k = b.next;
            }
            if off != e.seg.size() {
                return Err(format!(
                    "segment {id}: blocks cover {off} of {} bytes",
                    e.seg.size()
                ));
            }
        }
        if nblocks != st.blocks.len() {
            return Err(format!(
                "{} blocks exist but {nblocks} are linked into segments",
                st.blocks.len()
            ));
        }
        if nfree != st.free.len() {
            return Err(format!(
                "free lists hold {} entries for {nfree} free blocks",
                st.free.len()
            ));
        }
        let s = &st.stats;
        if s.allocated_bytes != allocated
            || s.active_bytes != active
            || s.reserved_bytes != reserved
        {
            return Err(format!(
                "stats say allocated/active/reserved = {}/{}/{}, blocks say {allocated}/{active}/{reserved}",
                s.allocated_bytes, s.active_bytes, s.reserved_bytes
            ));
        }
        let (sm, lg) = (&s.small, &s.large);
        if sm.allocated_bytes + lg.allocated_bytes != allocated
            || sm.active_bytes + lg.active_bytes != active
            || sm.reserved_bytes + lg.reserved_bytes != reserved
            || sm.num_raw_mallocs + lg.num_raw_mallocs != s.num_raw_mallocs
            || sm.num_raw_frees + lg.num_raw_frees != s.num_raw_frees
            || (sm.segments + lg.segments) as usize != st.segs.len()
        {
            return Err("per-pool statistics do not add up to the totals".to_string());
        }
        if s.num_raw_mallocs - s.num_raw_frees != st.segs.len() as u64 {
            return Err("raw mallocs minus frees differ from the number of segments".to_string());
        }
        Ok(())
    }
}

/// An allocation: RAII owner of a block of device memory, tied to the stream it was allocated on.
///
/// Dropping it returns the block to the allocator at once; it is reusable immediately by later
/// work on the same stream (stream order makes that safe) and, if [`Buffer::record_stream`] was
/// called, by other streams only after events recorded on those streams complete.
pub struct Buffer {
    data: BufferRef,
    size: usize,
    requested: usize,
    key: u64,
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

    /// Bytes actually reserved for it (rounded; a whole free block when splitting it was not
    /// worthwhile).
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

    /// The allocator it came from.
    pub fn allocator(&self) -> &Arc<CachingAllocator> {
        &self.allocator
    }

    /// Marks the buffer as used by work on `stream`, so that after it is freed the block is not
    /// reused until everything launched on `stream` up to the free has completed.
    pub fn record_stream(&mut self, stream: &Stream) {
        if *stream != self.stream && !self.used_on.contains(stream) {
            self.used_on.push(stream.clone());
        }
    }

    /// The streams recorded with [`Buffer::record_stream`].
    pub fn recorded_streams(&self) -> &[Stream] {
        &self.used_on
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        self.allocator
            .release(self.key, &self.stream, &self.used_on, self.requested);
    }
}
