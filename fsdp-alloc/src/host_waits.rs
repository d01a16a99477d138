//! The per-thread count of host waits (re-exported as `fsdp_alloc::stream::{host_syncs,
//! count_host_sync}`): one counter that `stream.rs` (event and stream synchronization), `cuda.rs`
//! (device synchronization before freeing driver memory) and `trace.rs` (reading GPU intervals)
//! all add to. `stream.rs` imports `cuda.rs` and `trace.rs`, so the counter sits below the three.

thread_local! {
    /// Host-side waits of this thread (see [`host_syncs`]).
    static HOST_SYNCS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many times the calling thread has waited on the host for device work so far: every
/// [`Event::synchronize`](crate::Event::synchronize) /
/// [`Event::synchronize_timeout`](crate::Event::synchronize_timeout) (hence every
/// [`Stream::synchronize`](crate::Stream::synchronize) and every collective `wait`), whether or
/// not it actually had to block, plus the waits by other means reported through
/// [`count_host_sync`]: fsdp-autograd's tensor readback on CPU devices, every stream
/// synchronization of its CUDA kernels (readbacks, synchronous uploads, index checks), and the
/// device synchronization before driver memory is freed. The same code path counts on CPU and
/// CUDA devices; waits of stream workers on other streams' events (device-side ordering) are not
/// host waits and are not counted. Per thread, so concurrent ranks on threads do not mix their
/// counts.
pub fn host_syncs() -> u64 {
    HOST_SYNCS.with(|c| c.get())
}

/// Counts one host-side wait of the calling thread (for waits that do not go through
/// [`Event::synchronize`](crate::Event::synchronize), e.g. a readback that blocks on a channel
/// fed by a stream).
pub fn count_host_sync() {
    HOST_SYNCS.with(|c| c.set(c.get() + 1));
}
