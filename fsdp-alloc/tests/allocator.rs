//! Caching-allocator behaviour: rounding, pools, best fit, split/coalesce, streams, deferred
//! frees, free-and-retry, OOM, statistics.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use fsdp_alloc::allocator::{LARGE_BUFFER, SMALL_BUFFER};
use fsdp_alloc::{AllocError, BlockState, Capacity, Device, DeviceConfig, Stream};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

fn capped(bytes: usize) -> Device {
    Device::cpu_with(
        0,
        DeviceConfig::default().with_capacity(Capacity::Bytes(bytes)),
    )
}

/// A device with PyTorch's policy (20 MiB / 2 MiB-rounded segments, blocks never change
/// stream): the tests that pin that policy's exact sizes use it.
fn pytorch() -> Device {
    Device::cpu_with(0, DeviceConfig::default().with_compact(false))
}

/// [`pytorch`] under a capacity.
fn capped_pytorch(bytes: usize) -> Device {
    Device::cpu_with(
        0,
        DeviceConfig::default()
            .with_capacity(Capacity::Bytes(bytes))
            .with_compact(false),
    )
}

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

#[test]
fn sizes_round_to_512_and_pick_pools() {
    let dev = pytorch();
    let s = dev.default_stream();
    let a = dev.alloc(1, s).unwrap();
    assert_eq!(a.len(), 1);
    assert_eq!(a.allocated_size(), 512);
    let st = dev.memory_stats();
    assert_eq!(st.reserved_bytes, SMALL_BUFFER);
    assert_eq!(st.small.reserved_bytes, SMALL_BUFFER);
    assert_eq!(st.allocated_bytes, 512);
    assert_eq!(st.requested_bytes, 1);

    let b = dev.alloc(MIB + 1, s).unwrap(); // large pool, < 10 MiB: a 20 MiB segment
    assert_eq!(b.allocated_size(), MIB + 512);
    // >= 10 MiB and no free block fits: a segment of its own, rounded up to 2 MiB.
    let c = dev.alloc(20 * MIB + 1, s).unwrap();
    let st = dev.memory_stats();
    assert_eq!(st.large.reserved_bytes, LARGE_BUFFER + 22 * MIB);
    assert_eq!(st.large.segments, 2);
    assert_eq!(st.num_raw_mallocs, 3);
    assert_eq!(st.allocated_bytes, 512 + MIB + 512 + 20 * MIB + 512);
    // A 12 MiB request fits the 20 MiB segment's free remainder: no new segment.
    let d = dev.alloc(12 * MIB, s).unwrap();
    assert_eq!(d.data().location().0, b.data().location().0);
    assert_eq!(dev.memory_stats().num_raw_mallocs, 3);
    dev.allocator().validate().unwrap();
    drop((a, b, c, d));
    let st = dev.memory_stats();
    assert_eq!(st.allocated_bytes, 0);
    assert_eq!(st.num_allocations, 0);
    assert_eq!(st.requested_bytes, 0);
    assert_eq!(
        st.reserved_bytes,
        SMALL_BUFFER + LARGE_BUFFER + 22 * MIB,
        "cached"
    );
}

#[test]
fn freed_block_is_reused_on_its_stream_without_raw_malloc() {
    let dev = Device::cpu(0);
    let s = dev.default_stream();
    let a = dev.alloc(4 * KIB, s).unwrap();
    let loc = a.data().location();
    drop(a);
    for _ in 0..10 {
        let b = dev.alloc(4 * KIB, s).unwrap();
        assert_eq!(b.data().location(), loc);
    }
    assert_eq!(dev.memory_stats().num_raw_mallocs, 1);
}

#[test]
fn blocks_split_and_coalesce() {
    let dev = pytorch();
    let s = dev.default_stream();
    let a = dev.alloc(4 * KIB, s).unwrap();
    let b = dev.alloc(4 * KIB, s).unwrap();
    let c = dev.alloc(4 * KIB, s).unwrap();
    assert_eq!(a.data().location().1, 0);
    assert_eq!(b.data().location().1, 4 * KIB);
    assert_eq!(c.data().location().1, 8 * KIB);
    let snap = dev.allocator().snapshot();
    assert_eq!(snap.len(), 1);
    assert_eq!(
        snap[0].blocks.len(),
        4,
        "three allocated + the free remainder"
    );
    drop(b);
    drop(a); // coalesces with b
    let snap = dev.allocator().snapshot();
    let blocks = &snap[0].blocks;
    assert_eq!(blocks.len(), 3, "{blocks:?}");
    assert_eq!(
        (blocks[0].size, blocks[0].state),
        (8 * KIB, BlockState::Free)
    );
    assert_eq!(blocks[1].state, BlockState::Allocated);
    dev.allocator().validate().unwrap();
    drop(c); // coalesces both sides: one free block = the whole segment
    let snap = dev.allocator().snapshot();
    assert_eq!(snap[0].blocks.len(), 1);
    assert_eq!(snap[0].blocks[0].size, SMALL_BUFFER);
    dev.allocator().validate().unwrap();
    dev.empty_cache();
    assert_eq!(dev.memory_stats().reserved_bytes, 0);
    assert_eq!(dev.memory_stats().num_raw_frees, 1);
}

#[test]
fn best_fit_picks_the_smallest_sufficient_block() {
    let dev = Device::cpu(0);
    let s = dev.default_stream();
    let big = dev.alloc(8 * KIB, s).unwrap();
    let _sep1 = dev.alloc(512, s).unwrap();
    let small = dev.alloc(4 * KIB, s).unwrap();
    let _sep2 = dev.alloc(512, s).unwrap();
    let (big_loc, small_loc) = (big.data().location(), small.data().location());
    drop(big);
    drop(small);
    let x = dev.alloc(3 * KIB, s).unwrap();
    assert_eq!(x.data().location(), small_loc, "4 KiB hole is the best fit");
    let y = dev.alloc(6 * KIB, s).unwrap();
    assert_eq!(y.data().location(), big_loc);
    dev.allocator().validate().unwrap();
}

#[test]
fn large_pool_splits_only_when_remainder_exceeds_1mib() {
    let dev = pytorch();
    let s = dev.default_stream();
    let a = dev.alloc(19 * MIB + 512 * KIB, s).unwrap(); // remainder 0.5 MiB: not split
    assert_eq!(a.allocated_size(), LARGE_BUFFER);
    drop(a);
    let b = dev.alloc(2 * MIB, s).unwrap(); // remainder 18 MiB: split
    assert_eq!(b.allocated_size(), 2 * MIB);
    assert_eq!(dev.memory_stats().num_raw_mallocs, 1);
    dev.allocator().validate().unwrap();
}

#[test]
fn blocks_belong_to_their_stream() {
    let dev = pytorch();
    let (s1, s2) = (dev.default_stream().clone(), dev.new_stream("other"));
    let a = dev.alloc(4 * KIB, &s1).unwrap();
    let loc = a.data().location();
    drop(a);
    let b = dev.alloc(4 * KIB, &s2).unwrap();
    assert_ne!(
        b.data().location().0,
        loc.0,
        "another stream gets another segment"
    );
    assert_eq!(dev.memory_stats().num_raw_mallocs, 2);
    let snap = dev.allocator().snapshot();
    assert_eq!(snap[0].stream, s1.id());
    assert_eq!(snap[1].stream, s2.id());
}

#[test]
fn record_stream_defers_reuse_until_the_event_completes() {
    let dev = Device::cpu(0);
    let comm = dev.new_stream("comm");
    let compute = dev.default_stream().clone();
    let gate = Gate::default();
    compute.launch(gate.blocker());
    let mut a = dev.alloc(64 * KIB, &comm).unwrap();
    let loc = a.data().location();
    a.record_stream(&compute);
    drop(a);
    let st = dev.memory_stats();
    assert_eq!(st.allocated_bytes, 0);
    assert_eq!(st.active_bytes, 64 * KIB, "waiting for compute's event");
    assert_eq!(st.num_pending_frees, 1);
    let b = dev.alloc(64 * KIB, &comm).unwrap();
    assert_ne!(
        b.data().location(),
        loc,
        "not reused while compute may still use it"
    );
    drop(b);
    gate.open();
    compute.synchronize().unwrap();
    let c = dev.alloc(64 * KIB, &comm).unwrap();
    assert_eq!(c.data().location(), loc, "reused once the event completed");
    let st = dev.memory_stats();
    assert_eq!(st.num_pending_frees, 0);
    assert_eq!(st.active_bytes, st.allocated_bytes);
    dev.allocator().validate().unwrap();
}

#[test]
fn retry_releases_other_streams_cached_segments() {
    let dev = capped_pytorch(2 * SMALL_BUFFER);
    let (a, b, c) = (
        dev.new_stream("a"),
        dev.new_stream("b"),
        dev.new_stream("c"),
    );
    drop(dev.alloc(MIB, &a).unwrap()); // a's segment, now cached and free
    let _keep = dev.alloc(MIB, &b).unwrap();
    let _x = dev.alloc(512 * KIB, &c).unwrap(); // needs a third segment: flush a's, retry
    let st = dev.memory_stats();
    assert_eq!(st.num_alloc_retries, 1);
    assert_eq!(st.num_raw_frees, 1);
    assert_eq!(st.num_raw_mallocs, 3);
    assert_eq!(st.reserved_bytes, 2 * SMALL_BUFFER);
    assert_eq!(st.num_ooms, 0);
    dev.allocator().validate().unwrap();
}

#[test]
fn retry_waits_for_pending_frees() {
    let dev = capped_pytorch(SMALL_BUFFER);
    let comm = dev.new_stream("comm");
    let compute = dev.default_stream().clone();
    let mut a = dev.alloc(MIB, &comm).unwrap();
    let _b = dev.alloc(MIB, &comm).unwrap(); // the segment is full
    compute.launch(|| std::thread::sleep(Duration::from_millis(50)));
    a.record_stream(&compute);
    drop(a);
    let c = dev.alloc(MIB, &comm).unwrap(); // must wait for compute, then reuse a's block
    assert_eq!(c.data().location().1, 0);
    let st = dev.memory_stats();
    assert_eq!(st.num_alloc_retries, 1);
    assert_eq!(st.num_raw_mallocs, 1);
    assert_eq!(st.num_ooms, 0);
}

#[test]
fn oom_is_typed_and_counted() {
    let dev = capped(MIB);
    let err = dev.alloc(2 * MIB, dev.default_stream()).unwrap_err();
    match &err {
        AllocError::OutOfMemory {
            requested,
            allocated,
            reserved,
            capacity,
            ..
        } => {
            assert_eq!(*requested, 2 * MIB);
            assert_eq!(*allocated, 0);
            assert_eq!(*reserved, 0);
            assert_eq!(*capacity, Capacity::Bytes(MIB));
        }
        e => panic!("expected OutOfMemory, got {e}"),
    }
    assert!(
        err.to_string().contains("tried to allocate 2097152 bytes"),
        "{err}"
    );
    let st = dev.memory_stats();
    assert_eq!((st.num_ooms, st.num_alloc_retries), (1, 1));
    // An absurd request is an error too, not a panic.
    assert!(matches!(
        Device::cpu(1).alloc(usize::MAX, Device::cpu(1).default_stream()),
        Err(AllocError::OutOfMemory { .. })
    ));
}

#[test]
fn a_tight_segment_is_the_last_resort_under_a_cap() {
    // The standard segment (2 MiB small, 20 MiB large) does not fit under the cap; a segment of
    // just the rounded request does (after one counted retry).
    let dev = capped_pytorch(MIB);
    let s = dev.default_stream();
    let b = dev.alloc(100, s).unwrap();
    assert_eq!(b.allocated_size(), 512);
    let st = dev.memory_stats();
    assert_eq!(
        (st.reserved_bytes, st.num_alloc_retries, st.num_ooms),
        (512, 1, 0)
    );
    let dev = capped_pytorch(8 * MIB);
    let big = dev.alloc(3 * MIB, dev.default_stream()).unwrap();
    assert_eq!(dev.memory_stats().reserved_bytes, 3 * MIB);
    drop((b, big));
}

#[test]
fn a_small_request_may_use_a_free_large_block_under_a_cap() {
    // A 20 MiB large segment holds one live 1.5 MiB block; a new 2 MiB small segment would
    // exceed the cap, so the small request is carved from the large segment's free block.
    let dev = capped_pytorch(20 * MIB + 256 * 1024);
    let s = dev.default_stream();
    let big = dev.alloc(3 * MIB / 2, s).unwrap();
    assert_eq!(dev.memory_stats().reserved_bytes, 20 * MIB);
    let small = dev.alloc(300 * 1024, s).unwrap();
    assert_eq!(
        small.data().location().0,
        big.data().location().0,
        "same segment"
    );
    let st = dev.memory_stats();
    assert_eq!((st.reserved_bytes, st.num_ooms), (20 * MIB, 0));
    assert_eq!(st.num_alloc_retries, 1);
    // Freed, it goes back to the large pool and coalesces: the whole segment is free again.
    drop((big, small));
    dev.empty_cache();
    assert_eq!(dev.memory_stats().reserved_bytes, 0);
}

#[test]
fn non_caching_mode_mallocs_and_frees_every_time() {
    let dev = Device::cpu_with(0, DeviceConfig::default().with_caching(false));
    let s = dev.default_stream();
    for _ in 0..5 {
        let b = dev.alloc(3000, s).unwrap();
        assert_eq!(b.allocated_size(), 3072);
        assert_eq!(dev.memory_stats().reserved_bytes, 3072);
    }
    let st = dev.memory_stats();
    assert_eq!((st.num_raw_mallocs, st.num_raw_frees), (5, 5));
    assert_eq!(st.reserved_bytes, 0);
    // Deferred frees are honoured in this mode as well.
    let other = dev.new_stream("other");
    let gate = Gate::default();
    other.launch(gate.blocker());
    let mut b = dev.alloc(3000, s).unwrap();
    b.record_stream(&other);
    drop(b);
    assert_eq!(dev.memory_stats().reserved_bytes, 3072);
    gate.open();
    other.synchronize().unwrap();
    assert_eq!(dev.memory_stats().reserved_bytes, 0);
    dev.allocator().validate().unwrap();
}

#[test]
fn peaks_and_reset() {
    let dev = pytorch();
    let s = dev.default_stream();
    let a = dev.alloc(10 * KIB, s).unwrap();
    let b = dev.alloc(20 * KIB, s).unwrap();
    drop(a);
    let st = dev.memory_stats();
    assert_eq!(st.peak_allocated_bytes, 30 * KIB);
    assert_eq!(st.small.peak_allocated_bytes, 30 * KIB);
    assert_eq!(st.allocated_bytes, 20 * KIB);
    dev.reset_peak_stats();
    let st = dev.memory_stats();
    assert_eq!(st.peak_allocated_bytes, 20 * KIB);
    assert_eq!(st.small.peak_allocated_bytes, 20 * KIB);
    assert_eq!(st.peak_reserved_bytes, SMALL_BUFFER);
    drop(b);
}

#[test]
fn released_segment_stays_readable_through_a_buffer_ref() {
    let dev = Device::cpu(0);
    let s = dev.default_stream();
    let b = dev.alloc(4 * KIB, s).unwrap();
    b.data().write::<u32>().unwrap().fill(7);
    let r = b.data().clone();
    drop(b);
    dev.empty_cache();
    assert_eq!(dev.memory_stats().reserved_bytes, 0);
    assert!(r.read::<u32>().unwrap().iter().all(|&x| x == 7));
}

#[test]
fn concurrent_allocation_from_threads() {
    concurrent_allocation(&pytorch(), 4);
    // Compact: a thread may adopt another stream's free segment instead of its own.
    concurrent_allocation(&Device::cpu(0), 0);
}

/// Four threads allocate on four streams at once; `raw` raw mallocs expected (0: at most 4).
fn concurrent_allocation(dev: &Device, raw: u64) {
    let streams: Vec<Stream> = (0..4).map(|i| dev.new_stream(&format!("s{i}"))).collect();
    std::thread::scope(|sc| {
        for s in &streams {
            let dev = dev.clone();
            sc.spawn(move || {
                for i in 0..200 {
                    let b = dev.alloc(512 * (1 + i % 7), s).unwrap();
                    b.data().write::<u8>().unwrap().fill(i as u8);
                }
            });
        }
    });
    dev.allocator().validate().unwrap();
    assert_eq!(dev.memory_stats().allocated_bytes, 0);
    let mallocs = dev.memory_stats().num_raw_mallocs;
    if raw == 0 {
        assert!((1..=4).contains(&mallocs), "{mallocs}");
    } else {
        assert_eq!(mallocs, raw);
    }
}

#[test]
fn cuda_is_a_typed_error_when_unavailable() {
    match Device::cuda(0) {
        Err(AllocError::CudaUnavailable(msg)) => assert!(msg.contains("cuda:0"), "{msg}"),
        Err(e) => panic!("expected CudaUnavailable, got {e}"),
        // Only possible with the feature on a machine with a GPU.
        Ok(dev) => assert!(cfg!(feature = "cuda") && dev.id() == fsdp_alloc::DeviceId::Cuda(0)),
    }
}

#[test]
fn device_memory_is_not_host_accessible_but_host_memory_is() {
    let dev = Device::cpu(0);
    let b = dev.alloc(64, dev.default_stream()).unwrap();
    assert_eq!(b.data().device_ptr(), None);
    assert!(b.data().read::<f32>().is_ok());
}
