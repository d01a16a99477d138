//! The all-gather rate limiter (the paper's §3.4 "rate limiter", FSDP1's `_FreeEventQueue`).
//!
//! The CPU thread that issues FSDP's all-gathers can run far ahead of the GPU. Each all-gather
//! allocates its output on the communication stream; when the consumer (compute) stream is done
//! with it, the buffer is freed — but with `record_stream` the block cannot be reused by the
//! communication stream until the consumer's event completes. A thread that runs ahead therefore
//! piles up blocks the allocator cannot hand out, and under memory pressure the allocator must
//! synchronize and flush its cache (`num_alloc_retries`), which is slow.
//!
//! A [`RateLimiter`] bounds that: before issuing an all-gather the issuing thread calls
//! [`RateLimiter::acquire`], which blocks until fewer than `max_inflight` gathered buffers are
//! *outstanding*. A buffer is outstanding from the moment its release is registered until the
//! event registered with it completes. Two ways to register a release:
//!
//! - **FSDP1 (`record_stream`):** free the buffer with [`crate::Buffer::record_stream`] on the
//!   consumer stream, record an event on the consumer stream, and hand the event to
//!   [`RateLimiter::release`]. The allocator defers the block's reuse until that event; the
//!   limiter keeps the issuer from allocating more than `max_inflight` such blocks ahead.
//! - **FSDP2 (explicit lifetime):** do *not* call `record_stream`; hand the buffer itself and the
//!   consumer's event to [`RateLimiter::release_buffer`]. The limiter keeps the buffer alive until
//!   the event completes and then drops it on the issuing thread, so the block goes straight back
//!   to the communication stream's free list (no deferred free, memory accounted as allocated
//!   while in flight).
//!
//! ```
//! use fsdp_alloc::{Device, RateLimiter};
//!
//! let dev = Device::cpu(0);
//! let (compute, comm) = (dev.default_stream().clone(), dev.new_stream("comm"));
//! let limiter = RateLimiter::new(2);
//! for _unit in 0..4 {
//!     limiter.acquire().unwrap(); // blocks while 2 gathered buffers are still in use
//!     let gathered = dev.alloc(1 << 16, &comm).unwrap();
//!     let out = gathered.data().clone();
//!     comm.launch(move || out.write::<f32>().unwrap().fill(1.0)); // the "all-gather"
//!     compute.wait_event(&comm.record_event());
//!     let inp = gathered.data().clone();
//!     compute.launch(move || assert_eq!(inp.read::<f32>().unwrap()[0], 1.0));
//!     // FSDP2 style: keep the buffer until compute is done with it.
//!     limiter.release_buffer(gathered, compute.record_event());
//! }
//! limiter.synchronize().unwrap();
//! assert_eq!(dev.memory_stats().allocated_bytes, 0);
//! ```

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::allocator::Buffer;
use crate::error::Result;
use crate::stream::Event;

/// Counters of a [`RateLimiter`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateLimiterStats {
    /// Calls to [`RateLimiter::acquire`].
    pub acquires: u64,
    /// Acquires that had to wait for a release event.
    pub blocked: u64,
    /// Total time acquires spent waiting.
    pub blocked_time: Duration,
    /// Most releases outstanding at once (observed at acquire/release time).
    pub max_outstanding: usize,
}

struct Outstanding {
    event: Event,
    buffer: Option<Buffer>,
}

struct LimiterState {
    queue: VecDeque<Outstanding>,
    stats: RateLimiterStats,
}

/// Bounds how many all-gathered buffers are in flight; see the module docs. Thread-safe.
pub struct RateLimiter {
    max_inflight: usize,
    state: Mutex<LimiterState>,
}

impl std::fmt::Debug for RateLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimiter")
            .field("max_inflight", &self.max_inflight)
            .field("outstanding", &self.outstanding())
            .finish()
    }
}

impl Default for RateLimiter {
    fn default() -> Self {
        RateLimiter::new(RateLimiter::DEFAULT_MAX_INFLIGHT)
    }
}

impl RateLimiter {
    /// The paper's default: at most two all-gathers in flight.
    pub const DEFAULT_MAX_INFLIGHT: usize = 2;

    /// A limiter allowing `max_inflight` outstanding buffers (0 is treated as 1: a limiter that
    /// allows nothing would block forever).
    pub fn new(max_inflight: usize) -> RateLimiter {
        RateLimiter {
            max_inflight: max_inflight.max(1),
            state: Mutex::new(LimiterState {
                queue: VecDeque::new(),
                stats: RateLimiterStats::default(),
            }),
        }
    }

    /// The limit.
    pub fn max_inflight(&self) -> usize {
        self.max_inflight
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LimiterState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Drops completed entries from the front; returns their buffers (to drop outside the lock).
    fn pop_completed(st: &mut LimiterState) -> Vec<Buffer> {
        let mut done = Vec::new();
        while st.queue.front().is_some_and(|o| o.event.query()) {
            if let Some(o) = st.queue.pop_front() {
                done.extend(o.buffer);
            }
        }
        done
    }

    /// Blocks the calling thread until fewer than `max_inflight` releases are outstanding,
    /// waiting on the oldest release event first (FIFO, like FSDP1). Buffers held in
    /// explicit-lifetime mode are dropped as their events complete. An error if a waited-for
    /// event's stream failed (the entry is dropped anyway, so the limiter stays usable).
    pub fn acquire(&self) -> Result<()> {
        let start = Instant::now();
        let mut waited = false;
        let mut first_err = Ok(());
        loop {
            let (done, oldest) = {
                let mut st = self.lock();
                let done = Self::pop_completed(&mut st);
                if st.queue.len() < self.max_inflight {
                    st.stats.acquires += 1;
                    if waited {
                        st.stats.blocked += 1;
                        st.stats.blocked_time += start.elapsed();
                    }
                    drop(st);
                    drop(done);
                    return first_err;
                }
                (done, st.queue.pop_front())
            };
            drop(done);
            if let Some(o) = oldest {
                waited = true;
                let r = o.event.synchronize();
                if first_err.is_ok() {
                    first_err = r;
                }
                drop(o.buffer);
            }
        }
    }

    fn push(&self, event: Event, buffer: Option<Buffer>) {
        let done = {
            let mut st = self.lock();
            st.queue.push_back(Outstanding { event, buffer });
            let done = Self::pop_completed(&mut st);
            st.stats.max_outstanding = st.stats.max_outstanding.max(st.queue.len());
            done
        };
        drop(done);
    }

    /// Registers a release (FSDP1 style): `event` is recorded on the consumer stream after its
    /// last use of a gathered buffer that was freed with `record_stream`.
    pub fn release(&self, event: Event) {
        self.push(event, None);
    }

    /// Registers a release in explicit-lifetime mode (FSDP2 style): the limiter keeps `buffer`
    /// alive until `event` (recorded on the consumer stream after its last use) completes, then
    /// drops it, returning the block to its own stream's free list — no `record_stream` needed.
    pub fn release_buffer(&self, buffer: Buffer, event: Event) {
        self.push(event, Some(buffer));
    }

    /// Collects completed releases; returns how many are still outstanding.
    pub fn poll(&self) -> usize {
        let (done, n) = {
            let mut st = self.lock();
            let done = Self::pop_completed(&mut st);
            (done, st.queue.len())
        };
        drop(done);
        n
    }

    /// Releases still outstanding (after collecting completed ones).
    pub fn outstanding(&self) -> usize {
        self.poll()
    }

    /// Waits for every outstanding release (dropping held buffers). Returns the first failure.
    pub fn synchronize(&self) -> Result<()> {
        let mut first = Ok(());
        loop {
            let Some(o) = self.lock().queue.pop_front() else {
                return first;
            };
            let r = o.event.synchronize();
            if first.is_ok() {
                first = r;
            }
            drop(o.buffer);
        }
    }

    /// The counters so far.
    pub fn stats(&self) -> RateLimiterStats {
        self.lock().stats
    }
}
