//! Every collective of the thread backend against a plain reference: every world size in
//! {1, 2, 3, 4, 5, 8}, every dtype, every reduce op, both accumulation modes; a full sweep with
//! pipelined (not individually awaited) collectives, and proptests over lengths and values.

mod common;

use common::*;
use fsdp_alloc::DType;
use fsdp_collectives::{default_accum, DeviceSlice, ProcessGroup, ReduceOp, ThreadGroup, Work};
use proptest::prelude::*;

fn expected_gather<T: TestElem>(seed: u64, w: usize, n: usize) -> Vec<T> {
    (0..w).flat_map(|r| data::<T>(seed, r, n)).collect()
}

/// Elementwise reference reduction of every rank's `data(seed, r, len)`.
fn expected_reduce<T: TestElem>(
    seed: u64,
    w: usize,
    len: usize,
    op: ReduceOp,
    own: bool,
) -> Vec<T> {
    let inputs: Vec<Vec<T>> = (0..w).map(|r| data::<T>(seed, r, len)).collect();
    (0..len)
        .map(|i| {
            let vals: Vec<T> = inputs.iter().map(|v| v[i]).collect();
            T::reduce_ref(&vals, op, own)
        })
        .collect()
}

fn accum_for<T: TestElem>(own: bool) -> DType {
    if own {
        T::DTYPE
    } else {
        default_accum(T::DTYPE)
    }
}

fn check_all_gather<T: TestElem>(w: usize, n: usize, seed: u64) {
    let outs = run_ranks(ThreadGroup::new(w), |r| {
        let (_ib, input) = upload(&r.dev, &r.stream, &data::<T>(seed, r.rank, n));
        let (_ob, output) = alloc_out::<T>(&r.dev, &r.stream, w * n);
        r.pg.all_gather_into(&input, &output, &r.stream)
            .wait()
            .unwrap();
        download::<T>(&output)
    });
    let want = bits(&expected_gather::<T>(seed, w, n));
    for (rank, o) in outs.iter().enumerate() {
        assert_eq!(
            bits(o),
            want,
            "all_gather {} W={w} n={n} rank {rank}",
            T::DTYPE
        );
    }
}

fn check_reduce_scatter<T: TestElem>(w: usize, n: usize, op: ReduceOp, own: bool, seed: u64) {
    let accum = accum_for::<T>(own);
    let outs = run_ranks(ThreadGroup::new(w), |r| {
        let (_ib, input) = upload(&r.dev, &r.stream, &data::<T>(seed, r.rank, w * n));
        let (_ob, output) = alloc_out::<T>(&r.dev, &r.stream, n);
        r.pg.reduce_scatter_with(&input, &output, op, accum, &r.stream)
            .wait()
            .unwrap();
        download::<T>(&output)
    });
    let full = expected_reduce::<T>(seed, w, w * n, op, own);
    for (rank, o) in outs.iter().enumerate() {
        assert_eq!(
            bits(o),
            bits(&full[rank * n..(rank + 1) * n]),
            "reduce_scatter {} {op} accum {accum} W={w} n={n} rank {rank}",
            T::DTYPE
        );
    }
}

fn check_all_reduce<T: TestElem>(w: usize, len: usize, op: ReduceOp, own: bool, seed: u64) {
    let accum = accum_for::<T>(own);
    let outs = run_ranks(ThreadGroup::new(w), |r| {
        let (_b, buf) = upload(&r.dev, &r.stream, &data::<T>(seed, r.rank, len));
        r.pg.all_reduce_with(&buf, op, accum, &r.stream)
            .wait()
            .unwrap();
        download::<T>(&buf)
    });
    let want = bits(&expected_reduce::<T>(seed, w, len, op, own));
    for (rank, o) in outs.iter().enumerate() {
        assert_eq!(
            bits(o),
            want,
            "all_reduce {} {op} W={w} len={len} rank {rank}",
            T::DTYPE
        );
    }
}

fn check_broadcast<T: TestElem>(w: usize, len: usize, root: usize, seed: u64) {
    let outs = run_ranks(ThreadGroup::new(w), |r| {
        let (_b, buf) = upload(&r.dev, &r.stream, &data::<T>(seed, r.rank, len));
        r.pg.broadcast(&buf, root, &r.stream).wait().unwrap();
        download::<T>(&buf)
    });
    let want = bits(&data::<T>(seed, root, len));
    for (rank, o) in outs.iter().enumerate() {
        assert_eq!(
            bits(o),
            want,
            "broadcast {} root {root} W={w} rank {rank}",
            T::DTYPE
        );
    }
}

/// One issued collective of the sweep and how to check it afterwards.
struct Issued {
    work: Work,
    out: DeviceSlice,
    want: Vec<u8>,
    what: String,
    _keep: Vec<fsdp_alloc::Buffer>,
}

fn issue_sweep<T: TestElem>(r: &Rank<ThreadGroup>, w: usize, seed: u64, out: &mut Vec<Issued>) {
    let n = 7;
    let len = 3 * w + 2; // not a multiple of w: uneven all-reduce chunks
    let (ib, input) = upload(&r.dev, &r.stream, &data::<T>(seed, r.rank, n));
    let (ob, output) = alloc_out::<T>(&r.dev, &r.stream, w * n);
    out.push(Issued {
        work: r.pg.all_gather_into(&input, &output, &r.stream),
        out: output,
        want: bits(&expected_gather::<T>(seed, w, n)),
        what: format!("all_gather {}", T::DTYPE),
        _keep: vec![ib, ob],
    });
    let (bb, buf) = upload(&r.dev, &r.stream, &data::<T>(seed, r.rank, len));
    let root = (seed as usize) % w;
    out.push(Issued {
        work: r.pg.broadcast(&buf, root, &r.stream),
        out: buf,
        want: bits(&data::<T>(seed, root, len)),
        what: format!("broadcast {} root {root}", T::DTYPE),
        _keep: vec![bb],
    });
    if T::DTYPE == DType::U8 {
        return;
    }
    let owns: &[bool] = if matches!(T::DTYPE, DType::F16 | DType::BF16) {
        &[false, true]
    } else {
        &[false]
    };
    for &op in &OPS {
        for &own in owns {
            let accum = accum_for::<T>(own);
            let (ib, input) = upload(&r.dev, &r.stream, &data::<T>(seed, r.rank, w * n));
            let (ob, output) = alloc_out::<T>(&r.dev, &r.stream, n);
            let full = expected_reduce::<T>(seed, w, w * n, op, own);
            out.push(Issued {
                work: r
                    .pg
                    .reduce_scatter_with(&input, &output, op, accum, &r.stream),
                out: output,
                want: bits(&full[r.rank * n..(r.rank + 1) * n]),
                what: format!("reduce_scatter {} {op} accum {accum}", T::DTYPE),
                _keep: vec![ib, ob],
            });
            let (bb, buf) = upload(&r.dev, &r.stream, &data::<T>(seed, r.rank, len));
            out.push(Issued {
                work: r.pg.all_reduce_with(&buf, op, accum, &r.stream),
                out: buf,
                want: bits(&expected_reduce::<T>(seed, w, len, op, own)),
                what: format!("all_reduce {} {op} accum {accum}", T::DTYPE),
                _keep: vec![bb],
            });
        }
    }
}

/// Every op × dtype × reduce op × accumulation mode on every world size, issued back to back on
/// one stream (pipelined) and checked after one final wait.
#[test]
fn full_sweep_every_world_dtype_and_op() {
    for &w in &WORLDS {
        let checked = run_ranks(ThreadGroup::new(w), |r| {
            let mut issued = Vec::new();
            for (i, &dt) in ALL_DTYPES.iter().enumerate() {
                let seed = 1000 + i as u64;
                with_type!(dt, T => issue_sweep::<T>(&r, w, seed, &mut issued));
            }
            r.stream.synchronize().unwrap();
            for it in &issued {
                it.work
                    .wait()
                    .unwrap_or_else(|e| panic!("{}: {e}", it.what));
                let got: Vec<u8> = it.out.data().read::<u8>().unwrap().to_vec();
                assert_eq!(got, it.want, "{} W={w} rank {}", it.what, r.rank);
            }
            issued.len()
        });
        // 6 dtypes × (gather + broadcast) + reductions: f32/i32/i64 4 ops, f16/bf16 4 ops × 2 modes
        assert!(
            checked.iter().all(|&n| n == 12 + 2 * (3 * 4 + 2 * 8)),
            "{checked:?}"
        );
    }
}

#[test]
fn all_reduce_results_are_identical_on_every_rank() {
    let w = 5;
    let outs = run_ranks(ThreadGroup::new(w), |r| {
        let (_b, buf) = upload(&r.dev, &r.stream, &data::<f32>(9, r.rank, 1001));
        r.pg.all_reduce(&buf, ReduceOp::Avg, &r.stream)
            .wait()
            .unwrap();
        bits(&download::<f32>(&buf))
    });
    assert!(outs.windows(2).all(|p| p[0] == p[1]));
}

/// Regression test for the fused reduction kernel (up to four ranks folded per pass): every
/// remainder of the grouping, in and out of place, against the strict rank-order fold.
#[test]
fn fused_reduction_groups_keep_rank_order_for_any_world_size() {
    for w in [6, 7, 9, 13] {
        check_reduce_scatter::<f32>(w, 1500, ReduceOp::Sum, false, 40 + w as u64);
        check_all_reduce::<f32>(w, 3001, ReduceOp::Max, false, 50 + w as u64);
        check_all_reduce::<half::bf16>(w, 999, ReduceOp::Avg, true, 60 + w as u64);
    }
}

#[test]
fn large_reductions_cross_block_boundaries() {
    // 150_000 elements per chunk: several kernel blocks (and many tiles) per rank.
    check_reduce_scatter::<f32>(3, 150_000, ReduceOp::Sum, false, 5);
    check_all_reduce::<half::bf16>(4, 300_001, ReduceOp::Sum, false, 6);
    check_all_gather::<i64>(4, 50_000, 7);
}

fn world() -> impl Strategy<Value = usize> {
    prop::sample::select(WORLDS.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn all_gather_matches_reference(w in world(), dt in prop::sample::select(ALL_DTYPES.to_vec()), n in 0usize..48, seed in any::<u64>()) {
        with_type!(dt, T => check_all_gather::<T>(w, n, seed));
    }

    #[test]
    fn reduce_scatter_matches_reference(w in world(), dt in prop::sample::select(REDUCIBLE.to_vec()), op in prop::sample::select(OPS.to_vec()), own in any::<bool>(), n in 0usize..48, seed in any::<u64>()) {
        with_type!(dt, T => {
            if T::DTYPE != DType::U8 {
                check_reduce_scatter::<T>(w, n, op, own && matches!(dt, DType::F16 | DType::BF16), seed)
            }
        });
    }

    #[test]
    fn all_reduce_matches_reference(w in world(), dt in prop::sample::select(REDUCIBLE.to_vec()), op in prop::sample::select(OPS.to_vec()), own in any::<bool>(), len in 0usize..130, seed in any::<u64>()) {
        with_type!(dt, T => {
            if T::DTYPE != DType::U8 {
                check_all_reduce::<T>(w, len, op, own && matches!(dt, DType::F16 | DType::BF16), seed)
            }
        });
    }

    #[test]
    fn broadcast_matches_reference(w in world(), dt in prop::sample::select(ALL_DTYPES.to_vec()), root_pick in any::<usize>(), len in 0usize..100, seed in any::<u64>()) {
        with_type!(dt, T => check_broadcast::<T>(w, len, root_pick % w, seed));
    }
}
