//! Conformance of the MPI backend against the thread backend, run under an MPI launcher:
//!
//! ```text
//! cargo build -p fsdp-collectives --features mpi --example mpi_conformance
//! mpirun -n 4 --oversubscribe target/debug/examples/mpi_conformance
//! ```
//!
//! Each process is one rank of an [`MpiGroup`] over the world; it also runs a [`ThreadGroup`] of
//! the same size in-process with the same per-rank inputs and checks that its own output is the
//! thread backend's output for its rank, bit for bit, for every op, reduce op, dtype and
//! accumulation dtype; that splits (the hybrid-sharding mesh) work; that a mismatched call gives
//! every rank the same typed error and the group keeps working. `FSDP_MPI_SHM=0` runs the same
//! checks over MPI collectives instead of the shared-memory window; on ranks spread over
//! several nodes the group takes the hierarchical path (`FSDP_MPI_HIER=0`: the flat MPI path),
//! and `FSDP_EXPECT_LAYOUT=hierarchical|flat` makes it fail unless the group took that path.
//! The same checks run through [`HostStaged`] (the host staging GPU ranks use, here on CPU
//! devices: every collective copied to a staging device and back on the caller's stream), and
//! through a staged hybrid-sharding mesh. Exits non-zero on failure.

use std::sync::Arc;

use fsdp_alloc::{DType, Device, Stream};
use fsdp_collectives::{
    CollectiveError, DeviceMesh, DeviceSlice, HostStaged, MpiGroup, ProcessGroup, ReduceOp,
    ThreadGroup,
};
use half::{bf16, f16};

/// Deterministic, order-sensitive values for rank `r`.
fn values(r: usize, n: usize, salt: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = (i * 2654435761 + r * 97 + salt * 7919) % 100_003;
            (x as f32 / 997.0 - 50.0) * 1.000_1f32.powi((r * 3 + i % 11) as i32)
        })
        .collect()
}

fn encode(v: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => bytemuck::cast_slice(v).to_vec(),
        DType::BF16 => v
            .iter()
            .flat_map(|&x| bf16::from_f32(x).to_bits().to_le_bytes())
            .collect(),
        DType::F16 => v
            .iter()
            .flat_map(|&x| f16::from_f32(x / 64.0).to_bits().to_le_bytes())
            .collect(),
        other => panic!("no test values for {other}"),
    }
}

#[derive(Clone, Copy, Debug)]
enum Op {
    AllGather,
    ReduceScatter(ReduceOp, DType),
    AllReduce(ReduceOp, DType),
    Broadcast(usize),
    /// All-gather whose input is this rank's chunk of the output.
    AllGatherInPlace,
    /// Reduce-scatter whose output is this rank's chunk of the input.
    ReduceScatterInPlace(ReduceOp, DType),
    AllToAll,
}

/// Runs `op` on `pg` with rank `r`'s input (`n` elements per chunk) and returns the output bytes.
fn run(pg: &dyn ProcessGroup, op: Op, dtype: DType, n: usize, salt: usize) -> Vec<u8> {
    let (r, w) = (pg.rank(), pg.size());
    let dev = Device::cpu(r);
    let st: Stream = dev.new_stream("comm");
    let (in_n, out_n) = match op {
        Op::AllGather => (n, w * n),
        Op::ReduceScatter(..) => (w * n, n),
        Op::AllReduce(..) | Op::Broadcast(_) => (n, n),
        Op::AllGatherInPlace => (w * n, 1),
        Op::ReduceScatterInPlace(..) => (w * n, 1),
        Op::AllToAll => (w * n, w * n),
    };
    let es = dtype.size();
    let input = dev.alloc(in_n * es, &st).unwrap();
    let mut init = encode(&values(r, in_n, salt), dtype);
    if let Op::AllGatherInPlace = op {
        // Only this rank's chunk holds data; the rest is what the peers' chunks overwrite.
        for (k, b) in init.iter_mut().enumerate() {
            if k / (n * es) != r {
                *b = 0xEE;
            }
        }
    }
    input.data().write::<u8>().unwrap().copy_from_slice(&init);
    let output = dev.alloc(out_n * es, &st).unwrap();
    let i = DeviceSlice::from_buffer(&input, dtype).unwrap();
    let o = DeviceSlice::from_buffer(&output, dtype).unwrap();
    let work = match op {
        Op::AllGather => pg.all_gather_into(&i, &o, &st),
        Op::ReduceScatter(rop, accum) => pg.reduce_scatter_with(&i, &o, rop, accum, &st),
        Op::AllReduce(rop, accum) => pg.all_reduce_with(&i, rop, accum, &st),
        Op::Broadcast(root) => pg.broadcast(&i, root, &st),
        Op::AllGatherInPlace => pg.all_gather_into(&i.slice(r * n, n).unwrap(), &i, &st),
        Op::ReduceScatterInPlace(rop, accum) => {
            pg.reduce_scatter_with(&i, &i.slice(r * n, n).unwrap(), rop, accum, &st)
        }
        Op::AllToAll => pg.all_to_all_into(&i, &o, &st),
    };
    work.wait()
        .unwrap_or_else(|e| panic!("{op:?} {dtype} on rank {r}: {e}"));
    let bytes = |b: &fsdp_alloc::Buffer| b.data().read::<u8>().unwrap().to_vec();
    match op {
        Op::AllReduce(..) | Op::Broadcast(_) | Op::AllGatherInPlace => bytes(&input),
        Op::ReduceScatterInPlace(..) => bytes(&input)[r * n * es..(r + 1) * n * es].to_vec(),
        _ => bytes(&output),
    }
}

/// The thread backend's output for rank `rank` (all W ranks run here as threads).
fn reference(w: usize, rank: usize, op: Op, dtype: DType, n: usize, salt: usize) -> Vec<u8> {
    let outs: Vec<Vec<u8>> = std::thread::scope(|s| {
        let hs: Vec<_> = ThreadGroup::new(w)
            .into_iter()
            .map(|g| s.spawn(move || run(&g, op, dtype, n, salt)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    outs.into_iter().nth(rank).unwrap()
}

fn main() {
    let mpi = MpiGroup::world().unwrap_or_else(|e| panic!("MPI world: {e}"));
    let (r, w) = (mpi.rank(), mpi.size());
    let path = if mpi.uses_shared_memory() {
        "shared memory"
    } else if mpi.uses_hierarchical() {
        "hierarchical"
    } else {
        "MPI collectives"
    };
    // `FSDP_EXPECT_LAYOUT=hierarchical|flat` (the two-node run of `cargo xtask mpi-test`):
    // fail unless the group took that path, so a cluster that is not one is not reported as
    // tested.
    match std::env::var("FSDP_EXPECT_LAYOUT").as_deref() {
        Ok("hierarchical") => assert!(
            mpi.uses_hierarchical(),
            "rank {r}: expected the hierarchical path, got {path} ({mpi:?})"
        ),
        Ok("flat") => assert!(
            !mpi.uses_hierarchical() && !mpi.uses_shared_memory(),
            "rank {r}: expected the flat MPI path across nodes, got {path}"
        ),
        _ => {}
    }
    let mut checked = 0;
    // Sizes: tiny, odd, and larger than one staging slot (forces several steps).
    let small = MpiGroup::world_with_config(fsdp_collectives::MpiConfig {
        slot_bytes: 4096,
        ..mpi.config().clone()
    })
    .unwrap();
    let groups: [(&str, &MpiGroup); 2] = [("default slots", &mpi), ("4 KiB slots", &small)];
    for (label, g) in groups {
        for &n in &[1usize, 7, 3000] {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let mut ops = vec![Op::AllGather, Op::Broadcast(w - 1), Op::AllToAll];
                for rop in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                    let mut accums = vec![DType::F32];
                    if dtype != DType::F32 {
                        accums.push(dtype);
                    }
                    for a in accums {
                        ops.push(Op::ReduceScatter(rop, a));
                        ops.push(Op::AllReduce(rop, a));
                    }
                }
                for (k, op) in ops.into_iter().enumerate() {
                    let salt = n * 31 + k;
                    let got = run(g, op, dtype, n, salt);
                    let want = reference(w, r, op, dtype, n, salt);
                    assert!(
                        got == want,
                        "rank {r} ({label}, {path}): {op:?} {dtype} n={n} differs from the thread \
                         backend"
                    );
                    checked += 1;
                }
            }
        }
    }
    // In-place forms, and outputs large enough (≥ 9 MiB) for the streaming-store copies and
    // many steps through the ring.
    let big = (9 << 20) / 4 / w + 3;
    for (label, g) in groups {
        for &n in &[7usize, 3000, big] {
            let ops = [
                (Op::AllGatherInPlace, DType::F32),
                (
                    Op::ReduceScatterInPlace(ReduceOp::Sum, DType::F32),
                    DType::F32,
                ),
                (
                    Op::ReduceScatterInPlace(ReduceOp::Avg, DType::F32),
                    DType::BF16,
                ),
                (Op::AllGather, DType::BF16),
                (Op::ReduceScatter(ReduceOp::Sum, DType::F32), DType::F32),
                (Op::AllReduce(ReduceOp::Sum, DType::F32), DType::F32),
                (Op::Broadcast(0), DType::F32),
            ];
            for (k, (op, dtype)) in ops.into_iter().enumerate() {
                if n == big && label != "default slots" {
                    continue;
                }
                let salt = n * 17 + k;
                let got = run(g, op, dtype, n, salt);
                let want = reference(w, r, op, dtype, n, salt);
                assert!(
                    got == want,
                    "rank {r} ({label}, {path}): {op:?} {dtype} n={n} differs from the thread \
                     backend"
                );
                checked += 1;
            }
        }
    }
    // Mismatched sizes: the same typed error on every rank, then the group still works.
    {
        let dev = Device::cpu(r);
        let st = dev.new_stream("comm");
        let n = if r == w - 1 { 5 } else { 4 };
        let a = dev.alloc(n * 4, &st).unwrap();
        // At W = 1 nobody disagrees: break the even-size rule locally instead.
        let b = dev.alloc((w * n + usize::from(w == 1)) * 4, &st).unwrap();
        let e = mpi
            .all_gather_into(
                &DeviceSlice::from_buffer(&a, DType::F32).unwrap(),
                &DeviceSlice::from_buffer(&b, DType::F32).unwrap(),
                &st,
            )
            .wait()
            .unwrap_err();
        if w == 1 {
            assert!(
                matches!(&e, CollectiveError::SizeMismatch { .. }),
                "rank {r}: {e}"
            );
        } else {
            assert!(
                matches!(
                    &e,
                    CollectiveError::InconsistentArgs { what: "input length", rank_b, .. }
                        if *rank_b == w - 1
                ),
                "rank {r}: {e}"
            );
        }
        let bad_dtype = mpi
            .all_reduce_with(
                &DeviceSlice::from_buffer(&a, DType::F32).unwrap(),
                ReduceOp::Sum,
                DType::BF16,
                &dev.new_stream("fresh"),
            )
            .wait()
            .unwrap_err();
        assert!(
            matches!(bad_dtype, CollectiveError::UnsupportedDtype { .. }),
            "rank {r}: {bad_dtype}"
        );
        mpi.barrier().unwrap();
        let got = run(
            &mpi,
            Op::AllReduce(ReduceOp::Sum, DType::F32),
            DType::F32,
            9,
            1,
        );
        assert_eq!(
            got,
            reference(
                w,
                r,
                Op::AllReduce(ReduceOp::Sum, DType::F32),
                DType::F32,
                9,
                1
            )
        );
        checked += 3;
    }
    // The hybrid-sharding mesh over MPI sub-communicators.
    for f in (1..=w).filter(|f| w % f == 0) {
        let world: Arc<dyn ProcessGroup> = Arc::new(mpi.clone());
        let mesh = DeviceMesh::new(world, f).unwrap_or_else(|e| panic!("mesh F={f}: {e}"));
        assert_eq!(mesh.shard_group().size(), f);
        assert_eq!(mesh.replicate_group().size(), w / f);
        let s = mesh.shard_group().rank();
        let got = run(mesh.shard_group().as_ref(), Op::AllGather, DType::F32, 5, f);
        let want = reference(f, s, Op::AllGather, DType::F32, 5, f);
        assert_eq!(got, want, "rank {r}: shard-group all-gather (F={f})");
        let rr = mesh.replicate_group().rank();
        let op = Op::AllReduce(ReduceOp::Avg, DType::F32);
        let got = run(mesh.replicate_group().as_ref(), op, DType::F32, 6, f);
        assert_eq!(
            got,
            reference(w / f, rr, op, DType::F32, 6, f),
            "rank {r}: replicate all-reduce (F={f})"
        );
        checked += 2;
    }
    // Host staging (what GPU ranks on a host backend use), on CPU devices: every op, the
    // in-place forms, a large output, a mismatched call, and a staged mesh.
    {
        let staged = HostStaged::new(Arc::new(mpi.clone()), Device::cpu(20_000 + r))
            .unwrap_or_else(|e| panic!("rank {r}: host staging: {e}"));
        let big = (9 << 20) / 4 / w + 3;
        let mut ops = vec![
            (Op::AllGather, DType::F32, 7),
            (Op::AllGather, DType::BF16, 3000),
            (Op::AllGatherInPlace, DType::F32, 7),
            (Op::AllGatherInPlace, DType::F32, big),
            (Op::Broadcast(w - 1), DType::F16, 33),
            (Op::AllToAll, DType::F32, 9),
        ];
        for rop in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
            ops.push((Op::ReduceScatter(rop, DType::F32), DType::BF16, 11));
            ops.push((Op::ReduceScatter(rop, DType::BF16), DType::BF16, 11));
            ops.push((Op::AllReduce(rop, DType::F32), DType::F32, 3000));
            ops.push((Op::ReduceScatterInPlace(rop, DType::F32), DType::F32, 5));
        }
        for (k, (op, dtype, n)) in ops.into_iter().enumerate() {
            let salt = n * 13 + k;
            let got = run(&staged, op, dtype, n, salt);
            let want = reference(w, r, op, dtype, n, salt);
            assert!(
                got == want,
                "rank {r} (host-staged, {path}): {op:?} {dtype} n={n} differs from the thread \
                 backend"
            );
            checked += 1;
        }
        let dev = Device::cpu(r);
        let st = dev.new_stream("comm");
        let n = if r == w - 1 { 5 } else { 4 };
        let a = dev.alloc(n * 4, &st).unwrap();
        let b = dev.alloc((w * n + usize::from(w == 1)) * 4, &st).unwrap();
        let e = staged
            .all_gather_into(
                &DeviceSlice::from_buffer(&a, DType::F32).unwrap(),
                &DeviceSlice::from_buffer(&b, DType::F32).unwrap(),
                &st,
            )
            .wait()
            .unwrap_err();
        assert!(
            matches!(
                &e,
                CollectiveError::InconsistentArgs { .. } | CollectiveError::SizeMismatch { .. }
            ),
            "rank {r}: host-staged mismatched all-gather: {e}"
        );
        assert!(
            st.synchronize().is_err(),
            "rank {r}: the failed collective fails its stream"
        );
        let op = Op::AllReduce(ReduceOp::Sum, DType::F32);
        assert_eq!(
            run(&staged, op, DType::F32, 9, 2),
            reference(w, r, op, DType::F32, 9, 2),
            "rank {r}: host staging after a failed collective"
        );
        if w % 2 == 0 {
            let mesh = DeviceMesh::new(Arc::new(staged), 2)
                .unwrap_or_else(|e| panic!("rank {r}: staged mesh: {e}"));
            let s = mesh.shard_group().rank();
            assert!(mesh.shard_group().name().contains("host-staged"));
            let got = run(mesh.shard_group().as_ref(), Op::AllGather, DType::F32, 5, 3);
            assert_eq!(got, reference(2, s, Op::AllGather, DType::F32, 5, 3));
            let rr = mesh.replicate_group().rank();
            let op = Op::AllReduce(ReduceOp::Avg, DType::F32);
            let got = run(mesh.replicate_group().as_ref(), op, DType::F32, 6, 3);
            assert_eq!(got, reference(w / 2, rr, op, DType::F32, 6, 3));
            checked += 2;
        }
        checked += 2;
    }
    // A rank that is late by more than the timeout: the others get a typed timeout naming it.
    if w > 1 {
        let quick = MpiGroup::world_with_config(fsdp_collectives::MpiConfig {
            timeout: std::time::Duration::from_millis(500),
            ..mpi.config().clone()
        })
        .unwrap();
        if r == w - 1 {
            std::thread::sleep(std::time::Duration::from_millis(1500));
            let late = quick.barrier();
            // Shared memory: the others published their failure, so the late rank fails too.
            // MPI path: their non-blocking header exchange was posted, so it may complete.
            assert!(
                !quick.uses_shared_memory() || late.is_err(),
                "rank {r}: the late rank's barrier succeeded although its peers gave up"
            );
        } else {
            let e = quick.barrier().unwrap_err();
            // A typed timeout naming the late rank — or, when another waiting rank timed out
            // first and published it, that rank's failure.
            assert!(
                matches!(&e, CollectiveError::Timeout { missing, .. }
                    if missing.is_empty() || missing.contains(&(w - 1)))
                    || matches!(&e, CollectiveError::PeerFailed { .. }),
                "rank {r}: {e}"
            );
        }
        checked += 1;
        mpi.barrier().unwrap();
    }
    mpi.barrier().unwrap();
    if r == 0 {
        println!("mpi_conformance: W={w} ({path}): {checked} checks per rank, all bit-equal to the thread backend");
    }
}
