//! Bad calls and failing ranks: every rank gets a typed error, nobody hangs, and the group stays
//! usable where the ranks stayed in step.

mod common;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use fsdp_alloc::DType;
use fsdp_collectives::{CollectiveError, GroupConfig, OpKind, ProcessGroup, ReduceOp, ThreadGroup};

/// Long enough that a test passing quickly proves no timeout was involved.
fn patient() -> GroupConfig {
    GroupConfig::default().with_timeout(Duration::from_secs(30))
}

#[test]
fn size_mismatch_fails_on_every_rank_fast_and_the_group_stays_usable() {
    let w = 4;
    let t0 = Instant::now();
    let results = run_ranks(ThreadGroup::with_config(w, patient()), |r| {
        let (_ib, input) = upload(&r.dev, &r.stream, &data::<f32>(1, r.rank, 8));
        // Rank 2 passes a 31-element output instead of 32.
        let out_len = if r.rank == 2 { 31 } else { 32 };
        let (_ob, output) = alloc_out::<f32>(&r.dev, &r.stream, out_len);
        let err =
            r.pg.all_gather_into(&input, &output, &r.stream)
                .wait()
                .unwrap_err();
        // The failed collective failed its stream: later work there is skipped.
        assert!(r.stream.synchronize().is_err());
        // Same group, fresh stream, valid call: works.
        let fresh = r.dev.new_stream("fresh");
        let (_ob2, output2) = alloc_out::<f32>(&r.dev, &fresh, 32);
        r.pg.all_gather_into(&input, &output2, &fresh)
            .wait()
            .unwrap();
        assert_eq!(
            bits(&download::<f32>(&output2)[8..16]),
            bits(&data::<f32>(1, 1, 8))
        );
        err
    });
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t0.elapsed()
    );
    let want = CollectiveError::SizeMismatch {
        op: OpKind::AllGather,
        rank: 2,
        world_size: 4,
        input_len: 8,
        output_len: 31,
    };
    for e in &results {
        assert_eq!(e, &want);
    }
    assert_eq!(
        want.to_string(),
        "all_gather on rank 2: input has 8 elements and output has 31, but even-sized \
         collectives need output length = world size × input length with world size 4; pad the \
         flat buffer to a multiple of the world size (fsdp-flatparam's layout does) and pass \
         whole chunks"
    );
}

#[test]
fn reduce_scatter_size_mismatch_names_both_lengths_on_all_ranks() {
    let results = run_ranks(ThreadGroup::with_config(3, patient()), |r| {
        let in_len = if r.rank == 0 { 10 } else { 9 };
        let (_ib, input) = upload(&r.dev, &r.stream, &data::<f32>(2, r.rank, in_len));
        let (_ob, output) = alloc_out::<f32>(&r.dev, &r.stream, 3);
        r.pg.reduce_scatter(&input, &output, ReduceOp::Sum, &r.stream)
            .wait()
            .unwrap_err()
    });
    for e in results {
        assert!(
            matches!(
                e,
                CollectiveError::SizeMismatch {
                    op: OpKind::ReduceScatter,
                    rank: 0,
                    input_len: 10,
                    output_len: 3,
                    world_size: 3
                }
            ),
            "{e}"
        );
        assert!(e
            .to_string()
            .contains("input length = world size × output length"));
    }
}

#[test]
fn a_bad_rank_whose_stream_is_busy_still_fails_its_peers_at_once() {
    // Rank 1's stream is busy for a while; its (bad) descriptor is posted at issue time, so
    // the others fail long before rank 1's stream reaches the collective.
    let results = run_ranks(ThreadGroup::with_config(2, patient()), |r| {
        if r.rank == 1 {
            r.stream
                .launch(|| std::thread::sleep(Duration::from_millis(800)));
        }
        let (_ib, input) = upload(&r.dev, &r.stream, &data::<f32>(3, r.rank, 4));
        let out_len = if r.rank == 1 { 7 } else { 8 };
        let (_ob, output) = alloc_out::<f32>(&r.dev, &r.stream, out_len);
        let t0 = Instant::now();
        let e =
            r.pg.all_gather_into(&input, &output, &r.stream)
                .wait()
                .unwrap_err();
        (e, t0.elapsed())
    });
    assert!(matches!(
        results[0].0,
        CollectiveError::SizeMismatch { rank: 1, .. }
    ));
    assert!(
        results[0].1 < Duration::from_millis(500),
        "{:?}",
        results[0].1
    );
    assert_eq!(results[1].0, results[0].0);
}

#[test]
fn ranks_disagreeing_on_lengths_dtype_op_or_kind_all_fail() {
    // Locally valid but different input lengths.
    let errs = run_ranks(ThreadGroup::with_config(3, patient()), |r| {
        let n = if r.rank == 2 { 5 } else { 4 };
        let (_ib, input) = upload(&r.dev, &r.stream, &data::<f32>(4, r.rank, n));
        let (_ob, output) = alloc_out::<f32>(&r.dev, &r.stream, 3 * n);
        r.pg.all_gather_into(&input, &output, &r.stream)
            .wait()
            .unwrap_err()
    });
    for e in &errs {
        assert!(
            matches!(e, CollectiveError::InconsistentArgs { what: "input length", rank_b: 2, value_a, value_b, .. } if value_a == "4" && value_b == "5"),
            "{e}"
        );
    }
    // Different reduce ops.
    let errs = run_ranks(ThreadGroup::with_config(2, patient()), |r| {
        let op = if r.rank == 0 {
            ReduceOp::Sum
        } else {
            ReduceOp::Max
        };
        let (_b, buf) = upload(&r.dev, &r.stream, &data::<f32>(5, r.rank, 6));
        r.pg.all_reduce(&buf, op, &r.stream).wait().unwrap_err()
    });
    for e in &errs {
        assert!(
            matches!(
                e,
                CollectiveError::InconsistentArgs {
                    what: "reduce op",
                    ..
                }
            ),
            "{e}"
        );
    }
    // Different collectives at the same position.
    let errs = run_ranks(ThreadGroup::with_config(2, patient()), |r| {
        let (_b, buf) = upload(&r.dev, &r.stream, &data::<f32>(6, r.rank, 6));
        let w = if r.rank == 0 {
            r.pg.all_reduce(&buf, ReduceOp::Sum, &r.stream)
        } else {
            r.pg.broadcast(&buf, 0, &r.stream)
        };
        w.wait().unwrap_err()
    });
    for e in &errs {
        assert!(
            matches!(
                e,
                CollectiveError::OpMismatch {
                    op_a: OpKind::AllReduce,
                    rank_b: 1,
                    op_b: OpKind::Broadcast,
                    ..
                }
            ),
            "{e}"
        );
    }
}

#[test]
fn dtype_root_and_reducibility_errors_reach_every_rank() {
    // Input/output dtype mismatch on rank 1.
    let errs = run_ranks(ThreadGroup::with_config(2, patient()), |r| {
        let (_ib, input) = upload(&r.dev, &r.stream, &data::<f32>(7, r.rank, 4));
        let (_ob, output) = if r.rank == 1 {
            let (b, _) = alloc_out::<f32>(&r.dev, &r.stream, 8);
            let s = fsdp_collectives::DeviceSlice::new(b.data().slice(0, 16).unwrap(), DType::F16)
                .unwrap();
            (b, s)
        } else {
            alloc_out::<f32>(&r.dev, &r.stream, 8)
        };
        r.pg.all_gather_into(&input, &output, &r.stream)
            .wait()
            .unwrap_err()
    });
    for e in &errs {
        assert!(
            matches!(
                e,
                CollectiveError::DtypeMismatch {
                    rank: 1,
                    input: DType::F32,
                    output: DType::F16,
                    ..
                }
            ),
            "{e}"
        );
    }
    // Root out of range (on every rank).
    let errs = run_ranks(ThreadGroup::with_config(2, patient()), |r| {
        let (_b, buf) = upload(&r.dev, &r.stream, &data::<i32>(8, r.rank, 4));
        r.pg.broadcast(&buf, 2, &r.stream).wait().unwrap_err()
    });
    for e in &errs {
        assert!(
            matches!(
                e,
                CollectiveError::InvalidRoot {
                    root: 2,
                    world_size: 2,
                    rank: 0,
                    ..
                }
            ),
            "{e}"
        );
    }
    // u8 cannot be reduced; f32 cannot accumulate in f16.
    let errs = run_ranks(ThreadGroup::with_config(2, patient()), |r| {
        let (_b, buf) = upload(&r.dev, &r.stream, &data::<u8>(9, r.rank, 4));
        let a =
            r.pg.all_reduce(&buf, ReduceOp::Sum, &r.stream)
                .wait()
                .unwrap_err();
        let s2 = r.dev.new_stream("s2");
        let (_b2, buf2) = upload(&r.dev, &s2, &data::<f32>(9, r.rank, 4));
        let b =
            r.pg.all_reduce_with(&buf2, ReduceOp::Sum, DType::F16, &s2)
                .wait()
                .unwrap_err();
        (a, b)
    });
    for (a, b) in &errs {
        assert!(
            matches!(
                a,
                CollectiveError::UnsupportedDtype {
                    dtype: DType::U8,
                    ..
                }
            ),
            "{a}"
        );
        assert!(
            matches!(
                b,
                CollectiveError::UnsupportedDtype {
                    dtype: DType::F32,
                    accum: DType::F16,
                    ..
                }
            ),
            "{b}"
        );
    }
}

#[test]
fn a_dropped_handle_fails_the_others_at_once() {
    let w = 3;
    let t0 = Instant::now();
    let results = run_ranks(ThreadGroup::with_config(w, patient()), |r| {
        if r.rank == 2 {
            return None; // drops its handle without issuing anything
        }
        let (_ib, input) = upload(&r.dev, &r.stream, &data::<f32>(10, r.rank, 4));
        let (_ob, output) = alloc_out::<f32>(&r.dev, &r.stream, 12);
        Some(
            r.pg.all_gather_into(&input, &output, &r.stream)
                .wait()
                .unwrap_err(),
        )
    });
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    for e in results.into_iter().flatten() {
        assert!(
            matches!(
                e,
                CollectiveError::PeerGone {
                    peer: 2,
                    op: OpKind::AllGather,
                    seq: 0,
                    ..
                }
            ),
            "{e}"
        );
    }
}

#[test]
fn a_panicking_rank_fails_the_others_and_issued_work_still_completes() {
    let w = 3;
    let groups = ThreadGroup::with_config(w, patient());
    let t0 = Instant::now();
    let outcomes: Vec<std::thread::Result<Result<(), CollectiveError>>> = std::thread::scope(|s| {
        let hs: Vec<_> = groups
            .into_iter()
            .map(|pg| {
                s.spawn(move || {
                    let rank = pg.rank();
                    let dev = fsdp_alloc::Device::cpu(rank);
                    let st = dev.new_stream("comm");
                    // First collective: issued by everyone (rank 1 panics right after
                    // issuing it, but its stream still runs it).
                    let (_b, buf) = upload(&dev, &st, &data::<f32>(11, rank, 5));
                    let first = pg.all_reduce(&buf, ReduceOp::Sum, &st);
                    if rank == 1 {
                        panic!("rank 1 dies");
                    }
                    first.wait().unwrap();
                    // Second collective: rank 1 is gone.
                    let second = pg.all_reduce(&buf, ReduceOp::Sum, &st);
                    second.wait()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join()).collect()
    });
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert!(outcomes[1].is_err(), "rank 1 panicked");
    for r in [0, 2] {
        let e = outcomes[r].as_ref().unwrap().as_ref().unwrap_err();
        assert!(
            matches!(
                e,
                CollectiveError::PeerGone {
                    peer: 1,
                    seq: 1,
                    ..
                }
            ),
            "{e}"
        );
    }
}

#[test]
fn a_hung_rank_times_out_the_others_within_the_timeout() {
    let timeout = Duration::from_millis(300);
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let release_rx = std::sync::Mutex::new(release_rx);
    let groups = ThreadGroup::with_config(3, GroupConfig::default().with_timeout(timeout));
    let results = run_ranks(groups, |r| {
        if r.rank == 1 {
            // Alive (handle held) but late: only issues once the others gave up.
            release_rx.lock().unwrap().recv().unwrap();
        }
        let (_b, buf) = upload(&r.dev, &r.stream, &data::<f32>(12, r.rank, 4));
        let t0 = Instant::now();
        let e =
            r.pg.all_reduce(&buf, ReduceOp::Sum, &r.stream)
                .wait()
                .unwrap_err();
        let took = t0.elapsed();
        if r.rank == 0 {
            // Rank 2 is certainly done too once rank 0 has timed out and a little time passed.
            std::thread::sleep(Duration::from_millis(100));
            release_tx.send(()).unwrap();
        }
        (e, took)
    });
    // The first rank to give up waited the full timeout; it marks the collective failed, so
    // the other waiting rank (which started waiting a little later) may learn it slightly
    // before its own deadline.
    let first = results[0].1.max(results[2].1);
    assert!(first >= timeout, "gave up early: {first:?}");
    for (rank, (e, took)) in results.iter().enumerate() {
        assert!(
            matches!(e, CollectiveError::Timeout { .. }),
            "rank {rank}: {e}"
        );
        if rank != 1 {
            assert!(*took < timeout * 10, "rank {rank} took {took:?}");
            assert!(
                matches!(e, CollectiveError::Timeout { missing, .. } if missing.contains(&1)),
                "{e}"
            );
        } else {
            // The late rank learns of the failure at once instead of waiting a full timeout.
            assert!(*took < timeout, "late rank took {took:?}");
        }
    }
}

#[test]
fn a_rank_whose_stream_failed_earlier_fails_its_peers_fast() {
    let results = run_ranks(ThreadGroup::with_config(3, patient()), |r| {
        if r.rank == 0 {
            r.stream.launch(|| panic!("a compute kernel failed"));
        }
        let (_b, buf) = upload(&r.dev, &r.stream, &data::<f32>(13, r.rank, 4));
        let t0 = Instant::now();
        let e =
            r.pg.all_reduce(&buf, ReduceOp::Sum, &r.stream)
                .wait()
                .unwrap_err();
        (e, t0.elapsed())
    });
    match &results[0].0 {
        CollectiveError::StreamFailed {
            op: OpKind::AllReduce,
            rank: 0,
            message,
        } => {
            assert!(message.contains("a compute kernel failed"), "{message}")
        }
        e => panic!("rank 0: {e}"),
    }
    for (e, took) in &results[1..] {
        assert!(
            matches!(e, CollectiveError::PeerFailed { peer: 0, .. }),
            "{e}"
        );
        assert!(*took < Duration::from_secs(5), "{took:?}");
    }
}

#[test]
fn in_place_forms_work_and_other_aliasing_is_refused_everywhere() {
    let w = 4;
    let n = 6;
    let outs = run_ranks(ThreadGroup::with_config(w, patient()), |r| {
        // In-place all-gather: the input is chunk `rank` of the output.
        let (buf, full) = alloc_out::<f32>(&r.dev, &r.stream, w * n);
        let mine = full.chunk(r.rank, w).unwrap();
        mine.data()
            .write::<f32>()
            .unwrap()
            .copy_from_slice(&data::<f32>(14, r.rank, n));
        r.pg.all_gather_into(&mine, &full, &r.stream)
            .wait()
            .unwrap();
        let gathered = download::<f32>(&full);
        // In-place reduce-scatter: the output is chunk `rank` of the input.
        r.pg.reduce_scatter(&full, &mine, ReduceOp::Sum, &r.stream)
            .wait()
            .unwrap();
        let reduced = download::<f32>(&mine);
        // Overlapping but not the in-place form: refused on every rank.
        let skew = full.slice(1, n).unwrap();
        let e =
            r.pg.all_gather_into(&skew, &full, &r.stream)
                .wait()
                .unwrap_err();
        drop(buf);
        (gathered, reduced, e)
    });
    let gathered: Vec<f32> = (0..w).flat_map(|r| data::<f32>(14, r, n)).collect();
    for (rank, (g, red, e)) in outs.iter().enumerate() {
        assert_eq!(bits(g), bits(&gathered));
        let want: Vec<f32> = (0..n).map(|i| w as f32 * gathered[rank * n + i]).collect();
        // Every rank holds the same gathered vector: the sum is exactly W × x in rank order only
        // up to rounding, so compare with the rank-order fold.
        let fold: Vec<f32> = (0..n)
            .map(|i| {
                let x = gathered[rank * n + i];
                (1..w).fold(x, |a, _| a + x)
            })
            .collect();
        assert_eq!(bits(red), bits(&fold));
        assert!(red
            .iter()
            .zip(&want)
            .all(|(a, b)| (a - b).abs() <= 1e-3 * b.abs().max(1.0)));
        assert!(
            matches!(
                e,
                CollectiveError::InvalidBuffer {
                    op: OpKind::AllGather,
                    rank: 0,
                    ..
                }
            ),
            "{e}"
        );
    }
}

#[test]
fn deterministic_rank_order_reduction_is_bitwise_reproducible() {
    let w = 5;
    let len = 4096;
    let run = || {
        run_ranks(ThreadGroup::new(w), |r| {
            let (_ib, input) = upload(&r.dev, &r.stream, &data::<f32>(15, r.rank, w * len));
            let (_ob, output) = alloc_out::<f32>(&r.dev, &r.stream, len);
            r.pg.reduce_scatter(&input, &output, ReduceOp::Sum, &r.stream)
                .wait()
                .unwrap();
            bits(&download::<f32>(&output))
        })
    };
    let a = run();
    let b = run();
    assert_eq!(a, b, "two runs differ");
    // And the order is rank order, not some other fixed order: the reversed fold differs.
    let inputs: Vec<Vec<f32>> = (0..w).map(|r| data::<f32>(15, r, w * len)).collect();
    let forward: Vec<f32> = (0..len)
        .map(|i| (1..w).fold(inputs[0][i], |acc, s| acc + inputs[s][i]))
        .collect();
    let backward: Vec<f32> = (0..len)
        .map(|i| {
            (0..w - 1)
                .rev()
                .fold(inputs[w - 1][i], |acc, s| acc + inputs[s][i])
        })
        .collect();
    assert_eq!(a[0], bits(&forward));
    assert_ne!(
        bits(&forward),
        bits(&backward),
        "the data must be order-sensitive"
    );
}

#[test]
fn issuing_returns_at_once_and_events_order_other_streams() {
    let outs = run_ranks(ThreadGroup::with_config(2, patient()), |r| {
        let gate = std::sync::Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let g = gate.clone();
        // Block the comm stream until the gate opens.
        r.stream.launch(move || {
            let mut open = g.0.lock().unwrap();
            while !*open {
                open = g.1.wait(open).unwrap();
            }
        });
        let (_ib, input) = upload(&r.dev, &r.stream, &data::<i64>(16, r.rank, 3));
        let (_ob, output) = alloc_out::<i64>(&r.dev, &r.stream, 6);
        let t0 = Instant::now();
        let work = r.pg.all_gather_into(&input, &output, &r.stream);
        let issue_time = t0.elapsed();
        std::thread::sleep(Duration::from_millis(50));
        let done_before_gate = work.is_completed();
        // A compute stream that waits on the collective's event, then reads the output.
        let compute = r.dev.default_stream().clone();
        compute.wait_event(work.event());
        let (tx, rx) = mpsc::channel();
        let out = output.data().clone();
        compute.launch(move || tx.send(out.read::<i64>().unwrap().to_vec()).unwrap());
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
        let seen = rx.recv().unwrap();
        work.wait().unwrap();
        (issue_time, done_before_gate, seen)
    });
    let want: Vec<i64> = (0..2).flat_map(|r| data::<i64>(16, r, 3)).collect();
    for (issue, done, seen) in outs {
        assert!(
            issue < Duration::from_millis(150),
            "issuing blocked for {issue:?}"
        );
        assert!(
            !done,
            "the collective cannot finish while its stream is blocked"
        );
        assert_eq!(seen, want);
    }
}

#[test]
fn barrier_blocks_until_all_ranks_arrive() {
    let w = 4;
    let t0 = Instant::now();
    let after = run_ranks(ThreadGroup::with_config(w, patient()), |r| {
        std::thread::sleep(Duration::from_millis(40 * r.rank as u64));
        r.pg.barrier().unwrap();
        t0.elapsed()
    });
    for t in after {
        assert!(t >= Duration::from_millis(120), "left the barrier at {t:?}");
    }
    // A barrier with a missing rank fails instead of hanging.
    let errs = run_ranks(ThreadGroup::with_config(2, patient()), |r| {
        if r.rank == 1 {
            return None;
        }
        Some(r.pg.barrier().unwrap_err())
    });
    assert!(matches!(
        errs[0],
        Some(CollectiveError::PeerGone {
            op: OpKind::Barrier,
            peer: 1,
            ..
        })
    ));
}
