//! # fsdp-alloc: the device runtime of fsdp-rs
//!
//! Devices, asynchronous streams and events, and the per-device caching allocator that owns all
//! of a device's memory — the layer that lets FSDP's stream choreography and memory behaviour be
//! reproduced (and tested) on a CPU exactly as on a GPU.
//!
//! ```
//! use fsdp_alloc::{Device, Event};
//!
//! let dev = Device::cpu(0);
//! let compute = dev.default_stream().clone();
//! let comm = dev.new_stream("comm");
//!
//! // Fill a buffer on the comm stream, then read it on the compute stream after an event.
//! let buf = dev.alloc(4 * 1024, &comm).unwrap();
//! let data = buf.data().clone();
//! comm.launch(move || data.write::<f32>().unwrap().fill(1.5));
//! let filled: Event = comm.record_event();
//! compute.wait_event(&filled);
//! let (tx, rx) = std::sync::mpsc::channel();
//! let data = buf.data().clone();
//! compute.launch(move || tx.send(data.read::<f32>().unwrap().iter().sum::<f32>()).unwrap());
//! assert_eq!(rx.recv().unwrap(), 1536.0);
//! ```
#![deny(missing_docs)]

pub mod allocator;
mod checked;
#[cfg(feature = "cuda")]
mod cuda;
pub mod device;
pub mod dtype;
pub mod error;
pub mod memory;
pub mod rate_limiter;
pub mod stream;

pub use allocator::{
    AllocatorConfig, BlockInfo, BlockState, Buffer, CachingAllocator, MemoryStats, Pool,
    PoolStats, SegmentInfo,
};
pub use rate_limiter::{RateLimiter, RateLimiterStats};
pub use device::{Device, DeviceConfig, DeviceId};
pub use dtype::DType;
pub use error::{AllocError, Capacity, Result};
pub use memory::{BufferRef, ReadGuard, WriteGuard};
pub use stream::{Event, Stream, StreamId, StreamMode};
