//! Host staging ([`HostStaged`]) over the thread backend on CPU devices: the code path GPU ranks
//! on a host backend (MPI processes sharing a GPU) take, with the copy function of host memory.
//! Every collective equals the unstaged thread backend bit for bit (in-place forms included);
//! the copies run in the order of the caller's stream (earlier writes are staged, later work
//! sees the result), on checked devices without an ordering violation; one counted host wait per
//! collective; errors are agreed on by every rank and fail the caller's stream, and the group
//! keeps working afterwards; splits stage too. `cargo xtask mpi-test` runs the same checks over
//! MPI (`examples/mpi_conformance.rs`) and FSDP through it (`tests/examples/mpi_parity.rs`);
//! the GPU form (device buffers, page-locked staging) is the `mpi-gpu` suite of `cargo xtask
//! gpu-test` (`staged::gpu_tests` in the crate's unit tests).

mod common;

use std::sync::Arc;

use common::*;
use fsdp_alloc::{Buffer, DType, Device, DeviceConfig, Stream};
use fsdp_collectives::{
    default_accum, CollectiveError, DeviceSlice, HostStaged, ProcessGroup, ReduceOp, ThreadGroup,
    Work,
};

/// W handles of one thread group, each staged through its own CPU staging device.
fn staged(w: usize, config: DeviceConfig) -> Vec<HostStaged> {
    ThreadGroup::new(w)
        .into_iter()
        .enumerate()
        .map(|(r, g)| HostStaged::new(Arc::new(g), Device::cpu_with(20_000 + r, config)).unwrap())
        .collect()
}

/// One collective as the tests issue it: rank `r` of `w`, `n` elements per chunk.
#[derive(Clone, Copy, Debug)]
enum Op {
    AllGather,
    AllGatherInPlace,
    ReduceScatter(ReduceOp, bool),
    ReduceScatterInPlace(ReduceOp),
    AllReduce(ReduceOp),
    Broadcast(usize),
    AllToAll,
}

/// A buffer and its typed view: the allocation lives as long as the pair.
type Made = (Buffer, DeviceSlice);

/// Issues `op` with rank `r`'s seeded data on `stream`, with buffers from `make` (given each
/// buffer's initial bytes); returns (work, the output to read back once it has run, the
/// allocations to keep until then).
fn issue(
    pg: &dyn ProcessGroup,
    op: Op,
    dtype: DType,
    n: usize,
    stream: &Stream,
    make: &dyn Fn(Vec<u8>) -> Made,
) -> (Work, DeviceSlice, Vec<Buffer>) {
    let (r, w) = (pg.rank(), pg.size());
    let es = dtype.size();
    let bytes = |len: usize| -> Vec<u8> {
        data::<u8>(7 + n as u64, r, len * es)
            .iter()
            .enumerate()
            // Keep floats finite and moderate: the high byte of each 2-byte group masked.
            .map(|(i, b)| if i % 2 == 1 { b & 0x3f } else { *b })
            .collect()
    };
    let keep = std::cell::RefCell::new(Vec::new());
    let buf = |len: usize, fill: bool| -> DeviceSlice {
        let (b, s) = make(if fill {
            bytes(len)
        } else {
            vec![0xA5; len * es]
        });
        keep.borrow_mut().push(b);
        s
    };
    let accum = |own: bool| if own { dtype } else { default_accum(dtype) };
    let (work, out) = match op {
        Op::AllGather => {
            let (i, o) = (buf(n, true), buf(w * n, false));
            (pg.all_gather_into(&i, &o, stream), o)
        }
        Op::AllGatherInPlace => {
            let o = buf(w * n, true);
            let i = o.slice(r * n, n).unwrap();
            (pg.all_gather_into(&i, &o, stream), o)
        }
        Op::ReduceScatter(rop, own) => {
            let (i, o) = (buf(w * n, true), buf(n, false));
            (pg.reduce_scatter_with(&i, &o, rop, accum(own), stream), o)
        }
        Op::ReduceScatterInPlace(rop) => {
            let i = buf(w * n, true);
            let o = i.slice(r * n, n).unwrap();
            (pg.reduce_scatter_with(&i, &o, rop, accum(false), stream), o)
        }
        Op::AllReduce(rop) => {
            let b = buf(n, true);
            (pg.all_reduce_with(&b, rop, accum(false), stream), b)
        }
        Op::Broadcast(root) => {
            let b = buf(n, true);
            (pg.broadcast(&b, root, stream), b)
        }
        Op::AllToAll => {
            let (i, o) = (buf(w * n, true), buf(w * n, false));
            (pg.all_to_all_into(&i, &o, stream), o)
        }
    };
    (work, out, keep.into_inner())
}

/// Host buffers of `dev` allocated on `stream`, written with their initial bytes.
fn host_buffers<'a>(
    dev: &'a Device,
    stream: &'a Stream,
    dtype: DType,
) -> impl Fn(Vec<u8>) -> Made + 'a {
    move |bytes: Vec<u8>| {
        let b = dev.alloc(bytes.len(), stream).unwrap();
        b.data().write::<u8>().unwrap().copy_from_slice(&bytes);
        let s = DeviceSlice::from_buffer(&b, dtype).unwrap();
        (b, s)
    }
}

/// Every rank's output bytes of `op` on `groups`.
fn outputs<G: ProcessGroup + 'static>(
    groups: Vec<G>,
    op: Op,
    dtype: DType,
    n: usize,
) -> Vec<Vec<u8>> {
    run_ranks(groups, |r| {
        let make = host_buffers(&r.dev, &r.stream, dtype);
        let (work, out, _keep) = issue(&r.pg, op, dtype, n, &r.stream, &make);
        work.wait()
            .unwrap_or_else(|e| panic!("{op:?} {dtype} rank {}: {e}", r.rank));
        r.stream.synchronize().unwrap();
        let bytes = out.data().read::<u8>().unwrap().to_vec();
        bytes
    })
}

const CASES: &[(Op, DType)] = &[
    (Op::AllGather, DType::F32),
    (Op::AllGather, DType::U8),
    (Op::AllGatherInPlace, DType::BF16),
    (Op::ReduceScatter(ReduceOp::Sum, false), DType::F32),
    (Op::ReduceScatter(ReduceOp::Avg, false), DType::BF16),
    (Op::ReduceScatter(ReduceOp::Sum, true), DType::F16),
    (Op::ReduceScatter(ReduceOp::Max, false), DType::I64),
    (Op::ReduceScatterInPlace(ReduceOp::Sum), DType::F32),
    (Op::AllReduce(ReduceOp::Sum), DType::F32),
    (Op::AllReduce(ReduceOp::Min), DType::I32),
    (Op::Broadcast(1), DType::F16),
    (Op::AllToAll, DType::I32),
];

#[test]
fn every_collective_equals_the_thread_backend_bit_for_bit() {
    for w in [1, 2, 3, 4] {
        for &(op, dtype) in CASES {
            if matches!(op, Op::Broadcast(root) if root >= w) {
                continue;
            }
            for n in [1, 37, 3000] {
                let want = outputs(ThreadGroup::new(w), op, dtype, n);
                let got = outputs(staged(w, DeviceConfig::default()), op, dtype, n);
                assert_eq!(got, want, "{op:?} {dtype} W={w} n={n}");
            }
        }
    }
}

#[test]
fn staging_copies_are_ordered_on_checked_devices() {
    // Checked devices verify that every access to the caller's buffers, the staging buffers
    // and the outputs is ordered after the conflicting ones (copies on the caller's stream,
    // the wrapped collective on the staging stream, the host wait between them).
    let checked = DeviceConfig::default().with_checked(true);
    let groups = staged(3, checked);
    let outs = std::thread::scope(|s| {
        let hs: Vec<_> = groups
            .into_iter()
            .map(|g| {
                s.spawn(move || {
                    let dev = Device::cpu_with(g.rank(), checked);
                    let st = dev.new_stream("comm");
                    let mut got = Vec::new();
                    for &(op, dtype) in CASES {
                        let make = host_buffers(&dev, &st, dtype);
                        let (work, out, _keep) = issue(&g, op, dtype, 37, &st, &make);
                        work.wait().unwrap_or_else(|e| panic!("{op:?}: {e}"));
                        got.push(out.data().read::<u8>().unwrap().to_vec());
                    }
                    st.synchronize().unwrap();
                    dev.synchronize().unwrap();
                    g.staging_device().synchronize().unwrap();
                    got
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    let want: Vec<Vec<Vec<u8>>> = CASES
        .iter()
        .map(|&(op, dtype)| outputs(ThreadGroup::new(3), op, dtype, 37))
        .collect();
    for (rank, got) in outs.iter().enumerate() {
        for (k, &(op, dtype)) in CASES.iter().enumerate() {
            assert_eq!(got[k], want[k][rank], "{op:?} {dtype} rank {rank}");
        }
    }
}

#[test]
fn the_collective_runs_in_the_callers_stream_order() {
    let outs = run_ranks(staged(2, DeviceConfig::default()), |r| {
        let (_ib, input) = upload(&r.dev, &r.stream, &[0f32; 64]);
        let (_ob, output) = alloc_out::<f32>(&r.dev, &r.stream, 128);
        // Earlier work on the stream writes the input, slowly: the staged copy must see it.
        let (i, rank) = (input.data().clone(), r.rank as f32);
        r.stream.launch(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            i.write::<f32>().unwrap().fill(rank + 1.0);
        });
        let work = r.pg.all_gather_into(&input, &output, &r.stream);
        // Later work on the stream sees the gathered output.
        let (o, seen) = (
            output.data().clone(),
            Arc::new(std::sync::Mutex::new(Vec::new())),
        );
        let into = Arc::clone(&seen);
        r.stream
            .launch(move || *into.lock().unwrap() = o.read::<f32>().unwrap().to_vec());
        work.wait().unwrap();
        r.stream.synchronize().unwrap();
        let v = seen.lock().unwrap().clone();
        v
    });
    for (rank, got) in outs.iter().enumerate() {
        let want: Vec<f32> = (0..128).map(|k| (k / 64) as f32 + 1.0).collect();
        assert_eq!(got, &want, "rank {rank}");
    }
}

#[test]
fn each_collective_is_one_counted_host_wait() {
    let counts = run_ranks(staged(3, DeviceConfig::default()), |r| {
        let (_ib, input) = upload(&r.dev, &r.stream, &data::<f32>(1, r.rank, 8));
        let (_ob, output) = alloc_out::<f32>(&r.dev, &r.stream, 24);
        let before = fsdp_alloc::stream::host_syncs();
        let work = r.pg.all_gather_into(&input, &output, &r.stream);
        let issued = fsdp_alloc::stream::host_syncs() - before;
        // The collective has run by the time the issue returns; only the copy back may still
        // be queued, so the Work completes without this thread waiting for a peer.
        work.wait().unwrap();
        issued
    });
    assert_eq!(counts, vec![1, 1, 1]);
}

#[test]
fn a_bad_call_is_the_same_error_on_every_rank_and_the_group_goes_on() {
    let results = run_ranks(staged(3, DeviceConfig::default()), |r| {
        // Rank 2 passes a longer input: every rank reports rank 2's size error.
        let n = if r.rank == 2 { 5 } else { 4 };
        let (_ib, input) = upload(&r.dev, &r.stream, &vec![1f32; n]);
        let (_ob, output) = alloc_out::<f32>(&r.dev, &r.stream, 12);
        let e =
            r.pg.all_gather_into(&input, &output, &r.stream)
                .wait()
                .unwrap_err();
        let stream_failed = r.stream.synchronize().is_err();
        // A fresh stream: the group still works.
        let st = r.dev.new_stream("fresh");
        let (_b, buf) = upload(&r.dev, &st, &[r.rank as f32 + 1.0; 3]);
        r.pg.all_reduce(&buf, ReduceOp::Sum, &st).wait().unwrap();
        st.synchronize().unwrap();
        let sum = download::<f32>(&buf);
        (e, stream_failed, sum)
    });
    let first = results[0].0.to_string();
    for (rank, (e, failed, sum)) in results.iter().enumerate() {
        assert!(
            matches!(e, CollectiveError::SizeMismatch { .. }) && e.to_string() == first,
            "rank {rank}: {e} (rank 0: {first})"
        );
        assert!(first.contains("rank 2"), "{first}");
        assert!(
            *failed,
            "rank {rank}: the failed collective fails the caller's stream"
        );
        assert_eq!(sum, &vec![6f32; 3], "rank {rank}");
    }
}

#[test]
fn a_rank_whose_stream_failed_does_not_hold_up_the_others() {
    let results = run_ranks(staged(3, DeviceConfig::default()), |r| {
        if r.rank == 0 {
            r.stream.launch(|| panic!("an earlier kernel failed"));
        }
        let (_ib, input) = upload(&r.dev, &r.stream, &[1f32; 4]);
        let (_ob, output) = alloc_out::<f32>(&r.dev, &r.stream, 12);
        let e =
            r.pg.all_gather_into(&input, &output, &r.stream)
                .wait()
                .unwrap_err();
        // Later collectives on healthy streams work again (a new staging stream replaces the
        // failed one).
        let st = r.dev.new_stream("fresh");
        let (_b, buf) = upload(&r.dev, &st, &[2f32; 2]);
        r.pg.all_reduce(&buf, ReduceOp::Sum, &st).wait().unwrap();
        st.synchronize().unwrap();
        (e, download::<f32>(&buf))
    });
    for (rank, (e, sum)) in results.iter().enumerate() {
        match rank {
            0 => assert!(matches!(e, CollectiveError::StreamFailed { .. }), "{e}"),
            _ => assert!(
                matches!(e, CollectiveError::PeerFailed { peer: 0, .. }),
                "rank {rank}: {e}"
            ),
        }
        assert_eq!(sum, &vec![6f32; 2], "rank {rank}");
    }
}

#[test]
fn splits_are_staged_too() {
    let outs = run_ranks(staged(4, DeviceConfig::default()), |r| {
        let parts = vec![vec![0, 2], vec![1, 3]];
        let sub = r.pg.split(&parts).unwrap();
        assert!(sub.name().contains("host-staged"), "{}", sub.name());
        let (_b, buf) = upload(&r.dev, &r.stream, &[r.rank as f32; 2]);
        sub.all_reduce(&buf, ReduceOp::Sum, &r.stream)
            .wait()
            .unwrap();
        r.stream.synchronize().unwrap();
        download::<f32>(&buf)
    });
    assert_eq!(
        outs,
        vec![vec![2f32; 2], vec![4.0; 2], vec![2.0; 2], vec![4.0; 2]]
    );
}

#[test]
fn the_staging_device_must_be_a_cpu_device() {
    // A CUDA staging device cannot be made here; a CPU one is accepted, pinned or not.
    let g = ThreadGroup::new(1).pop().unwrap();
    let s = HostStaged::new(Arc::new(g), Device::cpu(20_000)).unwrap();
    assert_eq!(s.inner().size(), 1);
    assert!(!s.staging_device().is_pinned());
    assert!(s.name().ends_with("(host-staged)"), "{}", s.name());
}
