//! Link emulation: collectives complete no earlier than the modelled time, the issuing thread
//! never waits for it, compute on another stream overlaps it, and the waiting costs no CPU.

mod common;

use std::time::{Duration, Instant};

use common::*;
use fsdp_collectives::{GroupConfig, LinkModel, ProcessGroup, ReduceOp, ThreadGroup};

fn linked(latency_ms: u64, bytes_per_sec: f64) -> GroupConfig {
    GroupConfig::default()
        .with_timeout(Duration::from_secs(30))
        .with_link(LinkModel {
            latency: Duration::from_millis(latency_ms),
            bytes_per_sec,
        })
}

#[test]
fn transfer_time_is_latency_plus_bytes_over_bandwidth() {
    let l = LinkModel {
        latency: Duration::from_millis(5),
        bytes_per_sec: 1e6,
    };
    assert_eq!(l.transfer_time(0), Duration::from_millis(5));
    assert_eq!(l.transfer_time(2_000_000), Duration::from_millis(2005));
}

#[test]
fn latency_delays_completion_but_not_issuing_and_compute_overlaps() {
    let lat = Duration::from_millis(400);
    let outs = run_ranks(ThreadGroup::with_config(2, linked(400, 1e12)), |r| {
        let (_b, buf) = upload(&r.dev, &r.stream, &data::<f32>(1, r.rank, 16));
        r.pg.barrier().unwrap(); // start together (the barrier itself also pays the latency)
        let t0 = Instant::now();
        let work = r.pg.all_reduce(&buf, ReduceOp::Sum, &r.stream);
        let issued = t0.elapsed();
        // "Compute" on the default stream while the collective is on the wire.
        let compute = r.dev.default_stream().clone();
        compute.launch(|| std::thread::sleep(Duration::from_millis(400)));
        compute.synchronize().unwrap();
        work.wait().unwrap();
        (issued, t0.elapsed())
    });
    for (issued, total) in outs {
        assert!(
            issued < Duration::from_millis(150),
            "issue blocked {issued:?}"
        );
        assert!(
            total >= lat,
            "completed before the modelled latency: {total:?}"
        );
        // Overlapped: well under latency + compute (800 ms).
        assert!(total < Duration::from_millis(700), "no overlap: {total:?}");
    }
}

#[test]
fn bandwidth_delays_large_collectives() {
    // W = 2 all-gather of 1 MiB per rank: each rank receives 1 MiB at 10 MB/s ≈ 105 ms.
    let n = 256 * 1024;
    let outs = run_ranks(ThreadGroup::with_config(2, linked(0, 10e6)), |r| {
        let (_ib, input) = upload(&r.dev, &r.stream, &data::<f32>(2, r.rank, n));
        let (_ob, output) = alloc_out::<f32>(&r.dev, &r.stream, 2 * n);
        r.pg.barrier().unwrap();
        let t0 = Instant::now();
        r.pg.all_gather_into(&input, &output, &r.stream)
            .wait()
            .unwrap();
        t0.elapsed()
    });
    for t in outs {
        assert!(t >= Duration::from_millis(104), "{t:?}");
        assert!(t < Duration::from_millis(1000), "{t:?}");
    }
}

#[test]
fn concurrent_collectives_on_two_streams_share_one_link() {
    // Two all-reduces issued at once on two streams of the same rank: with one link per rank
    // they queue (≈ 2 × 300 ms), they do not overlap (≈ 300 ms).
    let outs = run_ranks(ThreadGroup::with_config(2, linked(300, 1e12)), |r| {
        let other = r.dev.new_stream("second");
        let (_a, a) = upload(&r.dev, &r.stream, &data::<f32>(3, r.rank, 16));
        let (_b, b) = upload(&r.dev, &other, &data::<f32>(4, r.rank, 16));
        r.stream.synchronize().unwrap();
        other.synchronize().unwrap();
        r.pg.barrier().unwrap();
        let t0 = Instant::now();
        let w1 = r.pg.all_reduce(&a, ReduceOp::Sum, &r.stream);
        let w2 = r.pg.all_reduce(&b, ReduceOp::Sum, &other);
        w1.wait().unwrap();
        w2.wait().unwrap();
        t0.elapsed()
    });
    for t in outs {
        assert!(
            t >= Duration::from_millis(590),
            "the two transfers overlapped: {t:?}"
        );
        assert!(t < Duration::from_millis(1500), "{t:?}");
    }
}

#[test]
fn with_a_link_collectives_run_in_issue_order_across_streams() {
    // The first collective is issued on a stream that is busy for 300 ms; the second, issued
    // later on an idle stream, must still finish after the first (one communicator, one order).
    let outs = run_ranks(ThreadGroup::with_config(2, linked(1, 1e12)), |r| {
        let busy = r.dev.new_stream("busy");
        let (_a, a) = upload(&r.dev, &busy, &data::<f32>(5, r.rank, 16));
        let (_b, b) = upload(&r.dev, &r.stream, &data::<f32>(6, r.rank, 16));
        busy.synchronize().unwrap();
        r.stream.synchronize().unwrap();
        r.pg.barrier().unwrap();
        let t0 = Instant::now();
        busy.launch(|| std::thread::sleep(Duration::from_millis(300)));
        let first = r.pg.all_reduce(&a, ReduceOp::Sum, &busy);
        let second = r.pg.all_reduce(&b, ReduceOp::Sum, &r.stream);
        second.wait().unwrap();
        let second_done = t0.elapsed();
        first.wait().unwrap();
        second_done
    });
    for t in outs {
        assert!(
            t >= Duration::from_millis(300),
            "the later collective overtook: {t:?}"
        );
    }
}

/// utime + stime of this process, in clock ticks (Linux).
#[cfg(target_os = "linux")]
fn cpu_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    // Fields after the command name (which is in parentheses and may contain spaces).
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest[0] is field 3 (state); utime is field 14, stime field 15.
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

#[cfg(target_os = "linux")]
#[test]
fn waiting_on_the_link_burns_no_cpu() {
    let before = cpu_ticks();
    let t0 = Instant::now();
    run_ranks(ThreadGroup::with_config(4, linked(600, 1e12)), |r| {
        let (_b, buf) = upload(&r.dev, &r.stream, &data::<f32>(3, r.rank, 8));
        r.pg.all_reduce(&buf, ReduceOp::Sum, &r.stream)
            .wait()
            .unwrap();
    });
    let wall = t0.elapsed();
    let ticks = cpu_ticks() - before;
    assert!(wall >= Duration::from_millis(600), "{wall:?}");
    // 4 waiting rank threads + 4 sleeping stream threads for 600 ms would be ~240 ticks (at
    // 100 Hz) if they spun; sleeping they cost next to nothing (other tests of this binary may
    // run meanwhile, hence the generous bound).
    assert!(ticks < 40, "{ticks} ticks of CPU in {wall:?}");
}
