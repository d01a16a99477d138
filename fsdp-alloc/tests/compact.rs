//! The compact policy (the default): large segments of the rounded request, a stream's pending
//! frees reused behind a stream wait, entirely free segments of other streams adopted behind an
//! event on their old stream — and the memory held on a training-like pattern.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use fsdp_alloc::{Capacity, Device, DeviceConfig, RateLimiter, Stream};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// A gate: work launched with `blocker()` holds its stream until `open()`.
#[derive(Clone, Default)]
struct Gate(Arc<(Mutex<bool>, Condvar)>);
impl Gate {
    fn blocker(&self) -> impl FnOnce() + Send + 'static {
        let g = self.clone();
        move || {
            let mut open = g.0 .0.lock().unwrap();
            while !*open {
                open = g.0 .1.wait(open).unwrap();
            }
        }
    }
    fn open(&self) {
        *self.0 .0.lock().unwrap() = true;
        self.0 .1.notify_all();
    }
}

/// Launches work on `s` that sets a flag; returns the flag.
fn mark(s: &Stream) -> Arc<AtomicBool> {
    let flag = Arc::new(AtomicBool::new(false));
    let f = Arc::clone(&flag);
    s.launch(move || f.store(true, Ordering::SeqCst));
    flag
}

#[test]
fn large_segments_are_the_rounded_request() {
    let dev = Device::cpu(0);
    let s = dev.default_stream();
    let a = dev.alloc(MIB + 1, s).unwrap();
    let b = dev.alloc(16 * MIB + 4 * KIB, s).unwrap();
    let st = dev.memory_stats();
    assert_eq!(st.large.reserved_bytes, MIB + 512 + 16 * MIB + 4 * KIB);
    assert_eq!(st.large.segments, 2);
    drop((a, b));
    // Small requests share 1 MiB segments.
    let c = dev.alloc(3 * KIB, s).unwrap();
    let d = dev.alloc(MIB - 3 * KIB, s).unwrap();
    assert_eq!(d.data().location().0, c.data().location().0);
    assert_eq!(dev.memory_stats().small.reserved_bytes, MIB);
    drop(d);
    drop(c);
    dev.allocator().validate().unwrap();
}

#[test]
fn a_pending_block_is_reused_behind_a_stream_wait_not_a_new_segment() {
    // The device is full; the first block was freed on comm but compute may still read it.
    let dev = Device::cpu_with(
        0,
        DeviceConfig::default().with_capacity(Capacity::Bytes(2 * MIB)),
    );
    let comm = dev.new_stream("comm");
    let compute = dev.default_stream().clone();
    let gate = Gate::default();
    let mut a = dev.alloc(MIB, &comm).unwrap();
    let _b = dev.alloc(MIB, &comm).unwrap();
    compute.launch(gate.blocker());
    a.record_stream(&compute);
    let loc = a.data().location();
    drop(a);
    assert_eq!(dev.memory_stats().num_pending_frees, 1);
    // Reused at once (no host wait, no retry, no new segment) ...
    let c = dev.alloc(MIB, &comm).unwrap();
    assert_eq!(c.data().location(), loc);
    let st = dev.memory_stats();
    assert_eq!(
        (st.num_raw_mallocs, st.num_alloc_retries, st.num_ooms),
        (2, 0, 0)
    );
    // ... but comm's later work waits for compute's event.
    let done = mark(&comm);
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !done.load(Ordering::SeqCst),
        "comm ran before compute released the block"
    );
    gate.open();
    comm.synchronize().unwrap();
    assert!(done.load(Ordering::SeqCst));
    dev.allocator().validate().unwrap();
}

#[test]
fn a_free_segment_of_another_stream_is_adopted_after_that_streams_work() {
    let dev = Device::cpu(0);
    let (s1, s2) = (dev.default_stream().clone(), dev.new_stream("other"));
    let gate = Gate::default();
    let a = dev.alloc(4 * MIB, &s1).unwrap();
    let loc = a.data().location();
    // Work on s1 that still uses the memory after the buffer is dropped.
    s1.launch(gate.blocker());
    let r = a.data().clone();
    s1.launch(move || r.write::<u8>().unwrap().fill(9));
    drop(a);
    let b = dev.alloc(4 * MIB, &s2).unwrap();
    assert_eq!(b.data().location(), loc, "adopted, not a new segment");
    assert_eq!(dev.memory_stats().num_raw_mallocs, 1);
    let snap = dev.allocator().snapshot();
    assert_eq!(snap.len(), 1);
    assert_eq!(snap[0].stream, s2.id(), "the segment now belongs to s2");
    // s2's work runs only after s1's use of the memory.
    let w = b.data().clone();
    s2.launch(move || {
        let mut g = w.write::<u8>().unwrap();
        assert_eq!(g[0], 9, "s1's write came first");
        g.fill(1);
    });
    let done = mark(&s2);
    std::thread::sleep(Duration::from_millis(50));
    assert!(!done.load(Ordering::SeqCst), "s2 ran before s1's work");
    gate.open();
    s2.synchronize().unwrap();
    assert!(done.load(Ordering::SeqCst));
    dev.allocator().validate().unwrap();
}

#[test]
fn own_free_blocks_are_preferred_over_waiting() {
    // A free block of the stream that needs no wait is used before a pending one.
    let dev = Device::cpu(0);
    let (comm, compute) = (dev.new_stream("comm"), dev.default_stream().clone());
    let gate = Gate::default();
    compute.launch(gate.blocker());
    let mut a = dev.alloc(64 * KIB, &comm).unwrap();
    let loc = a.data().location();
    a.record_stream(&compute);
    drop(a);
    let b = dev.alloc(64 * KIB, &comm).unwrap();
    assert_ne!(b.data().location(), loc);
    let done = mark(&comm);
    comm.synchronize().unwrap();
    assert!(done.load(Ordering::SeqCst), "no wait on compute was needed");
    gate.open();
    dev.synchronize().unwrap();
}

#[test]
fn cross_stream_reuse_passes_the_checked_mode() {
    let dev = Device::cpu_with(0, DeviceConfig::default().with_checked(true));
    let (s1, s2) = (dev.default_stream().clone(), dev.new_stream("other"));
    for round in 0..10u8 {
        // s1 writes a large buffer late and frees it; s2 adopts the segment and writes it.
        let a = dev.alloc(3 * MIB, &s1).unwrap();
        let r = a.data().clone();
        s1.launch(move || {
            std::thread::sleep(Duration::from_millis(2));
            r.write::<u8>().unwrap().fill(round);
        });
        drop(a);
        let b = dev.alloc(3 * MIB, &s2).unwrap();
        let w = b.data().clone();
        s2.launch(move || w.write::<u8>().unwrap().fill(round + 100));
        drop(b);
        // And back: s1 adopts it again (or takes its own block).
        let c = dev.alloc(3 * MIB, &s1).unwrap();
        let w = c.data().clone();
        s1.launch(move || w.write::<u8>().unwrap().fill(round));
    }
    dev.synchronize().unwrap();
    s1.check().unwrap();
    s2.check().unwrap();
    assert_eq!(dev.memory_stats().num_raw_mallocs, 1);
}

/// One FSDP-like iteration (the `cargo xtask bench alloc` pattern, smaller): unshard on comm,
/// activations and gradients on compute, reduce-scatter outputs on comm, rate limited.
fn iteration(dev: &Device, compute: &Stream, comm: &Stream, limiter: &RateLimiter) {
    let (unit, units) = (4 * MIB + 4 * KIB, 6);
    let mut acts = Vec::new();
    for u in 0..units {
        limiter.acquire().unwrap();
        let mut full = dev.alloc(unit, comm).unwrap();
        compute.wait_event(&comm.record_event());
        acts.push(dev.alloc(MIB / 2 * (2 + u % 3) + 512 * u, compute).unwrap());
        drop(dev.alloc(96 * KIB * (1 + u % 4), compute).unwrap());
        full.record_stream(compute);
        drop(full);
        limiter.release(compute.record_event());
    }
    for _ in 0..units {
        limiter.acquire().unwrap();
        let mut full = dev.alloc(unit, comm).unwrap();
        compute.wait_event(&comm.record_event());
        let mut grad = dev.alloc(unit, compute).unwrap();
        drop(acts.pop());
        full.record_stream(compute);
        drop(full);
        limiter.release(compute.record_event());
        comm.wait_event(&compute.record_event());
        let shard = dev.alloc(unit / 4, comm).unwrap();
        grad.record_stream(comm);
        drop((grad, shard));
    }
    dev.synchronize().unwrap();
}

#[test]
fn training_pattern_reserves_little_more_than_it_allocates() {
    for compact in [true, false] {
        let dev = Device::cpu_with(0, DeviceConfig::default().with_compact(compact));
        let (compute, comm) = (dev.default_stream().clone(), dev.new_stream("comm"));
        let limiter = RateLimiter::new(2);
        for _ in 0..3 {
            iteration(&dev, &compute, &comm, &limiter);
        }
        let warm = dev.memory_stats();
        dev.reset_peak_stats();
        for _ in 0..5 {
            iteration(&dev, &compute, &comm, &limiter);
        }
        let st = dev.memory_stats();
        let ratio = st.peak_reserved_bytes as f64 / st.peak_allocated_bytes as f64;
        dev.allocator().validate().unwrap();
        if compact {
            assert!(ratio <= 1.15, "reserved / peak allocated = {ratio:.3}");
            assert_eq!(
                st.num_raw_mallocs, warm.num_raw_mallocs,
                "raw mallocs after warm-up"
            );
        } else {
            // PyTorch's policy on the same pattern: the gap this policy closes.
            assert!(ratio > 1.5, "PyTorch policy ratio {ratio:.3}");
        }
    }
}
