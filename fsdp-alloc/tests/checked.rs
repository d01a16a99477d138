//! The checked mode catches stream-ordering bugs (planted here) and passes correct code.

use std::time::Duration;

use fsdp_alloc::{AllocError, Device, DeviceConfig, OrderPoint, Stream};

fn checked_device() -> (Device, Stream, Stream) {
    let dev = Device::cpu_with(0, DeviceConfig::default().with_checked(true));
    let compute = dev.default_stream().clone();
    let comm = dev.new_stream("comm");
    assert!(compute.is_checked() && comm.is_checked());
    (dev, compute, comm)
}

fn fill(s: &Stream, b: &fsdp_alloc::BufferRef, v: f32) {
    let b = b.clone();
    s.launch(move || b.write::<f32>().expect("write").fill(v));
}

fn read_later(s: &Stream, b: &fsdp_alloc::BufferRef, delay_ms: u64) {
    let b = b.clone();
    s.launch(move || {
        std::thread::sleep(Duration::from_millis(delay_ms));
        let _ = b.read::<f32>().map(|g| g[0]);
    });
}

fn violation(e: &AllocError) -> &str {
    match e {
        AllocError::StreamFailed { message, .. } => message,
        e => panic!("expected a failed stream, got {e}"),
    }
}

#[test]
fn correct_choreography_passes() {
    let (dev, compute, comm) = checked_device();
    for round in 0..20 {
        let mut g = dev.alloc(4096, &comm).unwrap();
        fill(&comm, g.data(), round as f32);
        compute.wait_event(&comm.record_event());
        read_later(&compute, g.data(), (round % 3) as u64);
        g.record_stream(&compute);
        drop(g); // reuse on comm only after compute's event
    }
    // Host synchronization followed by a launch is an ordering too.
    let b = dev.alloc(4096, &comm).unwrap();
    fill(&comm, b.data(), 1.0);
    comm.synchronize().unwrap();
    read_later(&compute, b.data(), 0);
    // An event observed complete by query() orders as well.
    comm.wait_event(&compute.record_event()); // comm's next write must follow compute's read
    fill(&comm, b.data(), 2.0);
    let ev = comm.record_event();
    while !ev.query() {
        std::thread::yield_now();
    }
    read_later(&compute, b.data(), 0);
    dev.synchronize().unwrap();
}

#[test]
fn missing_wait_event_is_reported() {
    let (dev, compute, comm) = checked_device();
    let b = dev.alloc(4096, &comm).unwrap();
    fill(&comm, b.data(), 1.0);
    // BUG: no compute.wait_event(&comm.record_event())
    read_later(&compute, b.data(), 30);
    let err = compute.synchronize().unwrap_err();
    let msg = violation(&err);
    assert!(msg.contains("stream-ordering violation"), "{msg}");
    assert!(
        msg.contains("`cpu:0/default`") && msg.contains("`cpu:0/comm`"),
        "{msg}"
    );
    assert!(
        msg.contains(&format!("block {}", b.data().block_id())),
        "{msg}"
    );
    assert!(msg.contains("wait_event"), "{msg}");
}

#[test]
fn missing_wait_is_reported_whichever_access_runs_first() {
    // The read runs before the (unordered) write: the write is the one that fails.
    let (dev, compute, comm) = checked_device();
    let b = dev.alloc(4096, &comm).unwrap();
    read_later(&compute, b.data(), 0);
    // Wait in real time without observing any event: no ordering is established.
    std::thread::sleep(Duration::from_millis(30));
    fill(&comm, b.data(), 1.0); // BUG: comm never waited for compute's read
    let err = comm.synchronize().unwrap_err();
    assert!(violation(&err).contains("`cpu:0/default`"), "{err}");
}

#[test]
fn free_without_record_stream_then_reuse_is_reported() {
    let (dev, compute, comm) = checked_device();
    let g = dev.alloc(4096, &comm).unwrap();
    let loc = g.data().location();
    fill(&comm, g.data(), 1.0);
    compute.wait_event(&comm.record_event());
    read_later(&compute, g.data(), 40); // compute still uses it for a while
    drop(g); // BUG: no record_stream(&compute)
    let reuse = dev.alloc(4096, &comm).unwrap();
    assert_eq!(reuse.data().location(), loc, "the block is reused at once");
    fill(&comm, reuse.data(), 2.0);
    let err = dev.synchronize().unwrap_err();
    let msg = violation(&err);
    assert!(msg.contains("freed allocation"), "{msg}");
    assert!(msg.contains("record_stream"), "{msg}");
}

#[test]
fn record_stream_makes_the_same_pattern_correct() {
    let (dev, compute, comm) = checked_device();
    let mut g = dev.alloc(4096, &comm).unwrap();
    let loc = g.data().location();
    fill(&comm, g.data(), 1.0);
    compute.wait_event(&comm.record_event());
    read_later(&compute, g.data(), 20);
    g.record_stream(&compute);
    drop(g);
    let early = dev.alloc(4096, &comm).unwrap();
    assert_ne!(
        early.data().location(),
        loc,
        "not reused before compute's event"
    );
    fill(&comm, early.data(), 3.0);
    compute.synchronize().unwrap();
    let reuse = dev.alloc(4096, &comm).unwrap();
    assert_eq!(reuse.data().location(), loc, "reused after the event");
    fill(&comm, reuse.data(), 2.0);
    dev.synchronize().unwrap();
}

#[test]
fn ordering_is_transitive_through_events() {
    // comm writes; mid waits for comm; compute waits only for mid: ordered after comm too.
    let (dev, compute, comm) = checked_device();
    let mid = dev.new_stream("mid");
    let b = dev.alloc(4096, &comm).unwrap();
    fill(&comm, b.data(), 1.0);
    mid.wait_event(&comm.record_event());
    mid.launch(|| std::thread::sleep(Duration::from_millis(5)));
    compute.wait_event(&mid.record_event());
    read_later(&compute, b.data(), 0);
    dev.synchronize().unwrap();
}

#[test]
fn violation_is_returned_to_the_work_as_a_typed_error() {
    let (dev, compute, comm) = checked_device();
    let b = dev.alloc(4096, &comm).unwrap();
    fill(&comm, b.data(), 1.0);
    comm.synchronize().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let r = b.data().clone();
    // A thread that never observed comm's completion launches the read: unordered.
    let c2 = compute.clone();
    std::thread::spawn(move || {
        c2.launch(move || {
            tx.send(r.read::<f32>().map(|_| ()).err()).unwrap();
        })
    })
    .join()
    .unwrap();
    let e = rx.recv().unwrap().expect("the read must be refused");
    assert!(matches!(e, AllocError::OrderingViolation(_)), "{e}");
    assert!(compute.synchronize().is_err(), "the stream is failed too");
}

#[test]
fn unchecked_devices_do_not_check() {
    let dev = Device::cpu(0);
    let (compute, comm) = (dev.default_stream().clone(), dev.new_stream("comm"));
    let b = dev.alloc(4096, &comm).unwrap();
    fill(&comm, b.data(), 1.0);
    comm.synchronize().unwrap();
    let r = b.data().clone();
    std::thread::spawn(move || compute.launch(move || drop(r.read::<f32>().unwrap())))
        .join()
        .unwrap();
    dev.synchronize().unwrap();
}

#[test]
fn free_on_one_thread_after_sync_and_reuse_on_another_is_ordered() {
    // FSDP2 style across threads: thread A waits for compute, then frees without record_stream;
    // thread B reuses the block on comm. Correct, and must not be reported.
    let (dev, compute, comm) = checked_device();
    let g = dev.alloc(4096, &comm).unwrap();
    let loc = g.data().location();
    fill(&comm, g.data(), 1.0);
    compute.wait_event(&comm.record_event());
    read_later(&compute, g.data(), 10);
    let done = compute.record_event();
    std::thread::spawn(move || {
        done.synchronize().unwrap();
        drop(g);
    })
    .join()
    .unwrap();
    let (d2, c2) = (dev.clone(), comm.clone());
    std::thread::spawn(move || {
        let reuse = d2.alloc(4096, &c2).unwrap();
        assert_eq!(reuse.data().location(), loc);
        fill(&c2, reuse.data(), 2.0);
    })
    .join()
    .unwrap();
    dev.synchronize().unwrap();
}

/// Two jobs on different streams meet at a rendezvous (a barrier inside their work), each
/// leaving a point taken by `take` and, when `join` is set, joining both points afterwards.
/// Before the meeting `a` writes `x`; after it `a` writes `y` and `b` reads `x` and then `y`
/// (after a delay, so `a`'s write of `y` has run). Returns `b`'s stream result.
fn rendezvous(take: fn() -> OrderPoint, join: bool) -> Result<(), AllocError> {
    use std::sync::{Arc, Barrier, Mutex};
    let (dev, a, b) = checked_device();
    let (x, y) = (dev.alloc(64, &a).unwrap(), dev.alloc(64, &a).unwrap());
    let points = Arc::new(Mutex::new(Vec::new()));
    let barrier = Arc::new(Barrier::new(2));
    let (p, bar, xa, ya) = (
        Arc::clone(&points),
        Arc::clone(&barrier),
        x.data().clone(),
        y.data().clone(),
    );
    a.launch(move || {
        xa.write::<f32>().unwrap().fill(1.0);
        p.lock().unwrap().push(take());
        bar.wait();
        if join {
            OrderPoint::join(&p.lock().unwrap());
        }
        ya.write::<f32>().unwrap().fill(2.0); // after the meeting
    });
    let (p, bar, xb, yb) = (points, barrier, x.data().clone(), y.data().clone());
    b.launch(move || {
        p.lock().unwrap().push(take());
        bar.wait();
        if join {
            OrderPoint::join(&p.lock().unwrap());
        }
        let _ = xb.read::<f32>().map(|g| g[0]);
        std::thread::sleep(Duration::from_millis(30));
        let _ = yb.read::<f32>().map(|g| g[0]);
    });
    let r = b.synchronize();
    let _ = dev.synchronize();
    r
}

#[test]
fn a_rendezvous_is_invisible_without_order_points() {
    let err = rendezvous(OrderPoint::current, false).unwrap_err();
    assert!(
        violation(&err).contains("stream-ordering violation"),
        "{err}"
    );
}

#[test]
fn joined_current_points_order_a_rendezvous() {
    // `current` covers each job's accesses, before and after the meeting (the job is the unit):
    // both reads are ordered.
    rendezvous(OrderPoint::current, true).unwrap();
}

#[test]
fn points_before_the_job_order_only_what_came_before_it() {
    // `before_current_job` leaves `a`'s own accesses out: its write of `x` (before the meeting)
    // is unordered with `b`'s read too — it is the arrival point, meant for rendezvous at which
    // a job has not touched shared memory yet.
    let err = rendezvous(OrderPoint::before_current_job, true).unwrap_err();
    assert!(violation(&err).contains("`cpu:0/comm`"), "{err}");
}

#[test]
fn points_carry_ordering_between_host_threads() {
    // A host thread synchronizes a stream (so its clock covers the stream's write), hands its
    // point to another thread, which joins it and launches a reader on another stream.
    for join in [true, false] {
        let (dev, compute, comm) = checked_device();
        let b = dev.alloc(4096, &comm).unwrap();
        fill(&comm, b.data(), 1.0);
        let (tx, rx) = std::sync::mpsc::channel();
        let comm2 = comm.clone();
        std::thread::spawn(move || {
            comm2.synchronize().unwrap();
            let p = OrderPoint::current();
            assert!(!p.is_empty());
            tx.send(p).unwrap();
        })
        .join()
        .unwrap();
        let data = b.data().clone();
        let compute2 = compute.clone();
        let r = std::thread::spawn(move || {
            let p = rx.recv().unwrap();
            if join {
                OrderPoint::join(&[p]);
            }
            read_later(&compute2, &data, 0);
            compute2.synchronize()
        })
        .join()
        .unwrap();
        assert_eq!(r.is_ok(), join, "join = {join}: {r:?}");
        let _ = dev.synchronize();
    }
}

#[test]
fn points_are_empty_on_unchecked_streams() {
    let dev = Device::cpu(1);
    let s = dev.new_stream("plain");
    let (tx, rx) = std::sync::mpsc::channel();
    s.launch(move || {
        tx.send((OrderPoint::current(), OrderPoint::before_current_job()))
            .unwrap()
    });
    let (p, q) = rx.recv().unwrap();
    assert!(p.is_empty() && q.is_empty());
    OrderPoint::join(&[p, q]); // a no-op
    dev.synchronize().unwrap();
}
