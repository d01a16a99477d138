//! RateLimiter: blocking on release events, explicit-lifetime mode, errors.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use fsdp_alloc::{Device, DeviceConfig, RateLimiter, Stream};

#[derive(Clone, Default)]
struct Gate(Arc<(Mutex<bool>, Condvar)>);
impl Gate {
    fn block(&self, s: &Stream) {
        let g = self.clone();
        s.launch(move || {
            let mut open = g.0 .0.lock().unwrap();
            while !*open {
                open = g.0 .1.wait(open).unwrap();
            }
        });
    }
    fn open(&self) {
        *self.0 .0.lock().unwrap() = true;
        self.0 .1.notify_all();
    }
}

#[test]
fn acquire_blocks_until_the_oldest_release_event_completes() {
    let dev = Device::cpu(0);
    let compute = dev.default_stream().clone();
    let limiter = Arc::new(RateLimiter::new(2));
    assert_eq!(limiter.max_inflight(), 2);
    limiter.acquire().unwrap();
    limiter.acquire().unwrap();
    let gate = Gate::default();
    gate.block(&compute);
    limiter.release(compute.record_event());
    limiter.release(compute.record_event());
    assert_eq!(limiter.outstanding(), 2);
    let done = Arc::new(AtomicBool::new(false));
    let (l, d) = (Arc::clone(&limiter), Arc::clone(&done));
    let t = std::thread::spawn(move || {
        l.acquire().unwrap();
        d.store(true, Ordering::SeqCst);
    });
    std::thread::sleep(Duration::from_millis(50));
    assert!(!done.load(Ordering::SeqCst), "two releases are outstanding");
    gate.open();
    t.join().unwrap();
    assert!(done.load(Ordering::SeqCst));
    let st = limiter.stats();
    assert_eq!((st.acquires, st.blocked), (3, 1));
    assert_eq!(st.max_outstanding, 2);
    assert!(st.blocked_time >= Duration::from_millis(40));
}

#[test]
fn explicit_lifetime_holds_the_buffer_until_the_consumer_event() {
    let dev = Device::cpu_with(0, DeviceConfig::default().with_checked(true));
    let compute = dev.default_stream().clone();
    let comm = dev.new_stream("comm");
    let limiter = RateLimiter::default();
    let gate = Gate::default();
    let g = dev.alloc(64 << 10, &comm).unwrap();
    let loc = g.data().location();
    let w = g.data().clone();
    comm.launch(move || w.write::<f32>().unwrap().fill(1.0));
    compute.wait_event(&comm.record_event());
    gate.block(&compute);
    let r = g.data().clone();
    compute.launch(move || assert_eq!(r.read::<f32>().unwrap()[7], 1.0));
    limiter.release_buffer(g, compute.record_event()); // no record_stream
    assert_eq!(
        dev.memory_stats().allocated_bytes,
        64 << 10,
        "held by the limiter"
    );
    let other = dev.alloc(64 << 10, &comm).unwrap();
    assert_ne!(other.data().location(), loc);
    drop(other);
    gate.open();
    limiter.synchronize().unwrap();
    assert_eq!(limiter.outstanding(), 0);
    assert_eq!(dev.memory_stats().allocated_bytes, 0);
    assert_eq!(
        dev.memory_stats().num_pending_frees,
        0,
        "never a deferred free"
    );
    let reuse = dev.alloc(64 << 10, &comm).unwrap();
    assert_eq!(reuse.data().location(), loc, "back on comm's free list");
    let w = reuse.data().clone();
    comm.launch(move || w.write::<f32>().unwrap().fill(2.0));
    dev.synchronize().unwrap(); // checked mode: the reuse is ordered after compute's read
}

#[test]
fn zero_is_treated_as_one_and_failures_are_reported() {
    let limiter = RateLimiter::new(0);
    assert_eq!(limiter.max_inflight(), 1);
    let dev = Device::cpu(0);
    let s = dev.default_stream();
    s.launch(|| panic!("consumer kernel failed"));
    limiter.release(s.record_event());
    let err = limiter.acquire().unwrap_err();
    assert!(err.to_string().contains("consumer kernel failed"), "{err}");
    assert_eq!(limiter.outstanding(), 0, "the failed entry is gone");
    limiter.acquire().unwrap();
}
