//! `cargo xtask gpu-test` suite 2 of 4 (**nccl**): NCCL collectives on every visible GPU with
//! asserted results — all-gather, reduce-scatter sum/avg in f32 and bf16, all-reduce, broadcast —
//! in one process (a thread per GPU) and, through `cargo xtask gpu-launch-2`, in two processes
//! launched with a torchrun-style environment.
//!
//! The thread test ran on one H100 (one GPU: passed); the 2-process launch needs two GPUs and
//! has never run. `#[ignore]`d and gated on
//! `FSDP_GPU_TESTS=1`; values are small integers, exact in bf16, so every result is asserted
//! exactly.
#![cfg(feature = "cuda")]

use std::sync::Arc;
use std::time::Duration;

use fsdp_alloc::{DType, Device};
use fsdp_autograd::Tensor;
use fsdp_collectives::{DeviceSlice, NcclConfig, NcclGroup, ProcessGroup, ReduceOp, TcpStore};

fn gpu_tests() -> bool {
    if std::env::var("FSDP_GPU_TESTS").as_deref() == Ok("1") {
        return true;
    }
    eprintln!("skipped: set FSDP_GPU_TESTS=1 on a machine with a GPU (cargo xtask gpu-test)");
    false
}

fn visible_gpus() -> usize {
    (0..64).take_while(|&i| Device::cuda(i).is_ok()).count()
}

fn slice(t: &Tensor) -> DeviceSlice {
    DeviceSlice::new(t.operand().unwrap().buf, t.dtype()).unwrap()
}

fn on(dev: &Device, v: &[f32], dtype: DType) -> Tensor {
    Tensor::from_slice(v, &[v.len()], dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// Every collective on one rank of a `world`-rank group, results asserted.
fn exercise(g: &dyn ProcessGroup, dev: &Device) {
    let (rank, world) = (g.rank(), g.size());
    let s = dev.default_stream();
    let n = 4usize;
    for dtype in [DType::F32, DType::BF16] {
        // all-gather: rank r contributes [r*10 + i].
        let mine: Vec<f32> = (0..n).map(|i| (rank * 10 + i) as f32).collect();
        let input = on(dev, &mine, dtype);
        let out = Tensor::zeros(&[n * world], dtype, dev).unwrap();
        g.all_gather_into(&slice(&input), &slice(&out), s)
            .wait()
            .unwrap();
        let want: Vec<f32> = (0..world)
            .flat_map(|r| (0..n).map(move |i| (r * 10 + i) as f32))
            .collect();
        assert_eq!(out.to_vec_f32().unwrap(), want, "all-gather {dtype}");

        // reduce-scatter sum and avg: rank r contributes [r + i] over world·n elements.
        let full: Vec<f32> = (0..n * world).map(|i| (rank + i) as f32).collect();
        for (op, div) in [(ReduceOp::Sum, 1.0f32), (ReduceOp::Avg, world as f32)] {
            let input = on(dev, &full, dtype);
            let out = Tensor::zeros(&[n], dtype, dev).unwrap();
            g.reduce_scatter(&slice(&input), &slice(&out), op, s)
                .wait()
                .unwrap();
            let ranks_sum = (world * (world - 1) / 2) as f32;
            let want: Vec<f32> = (0..n)
                .map(|i| ((rank * n + i) as f32 * world as f32 + ranks_sum) / div)
                .collect();
            let got = out.to_vec_f32().unwrap();
            for (g, w) in got.iter().zip(&want) {
                // Avg of integers may be a fraction: bf16 keeps 8 bits, so compare at its
                // precision.
                let tol = if dtype == DType::BF16 {
                    w.abs() / 128.0
                } else {
                    0.0
                };
                assert!(
                    (g - w).abs() <= tol,
                    "reduce-scatter {op:?} {dtype}: {got:?} vs {want:?}"
                );
            }
        }

        // all-reduce sum.
        let buf = on(dev, &[rank as f32 + 1.0; 3], dtype);
        g.all_reduce(&slice(&buf), ReduceOp::Sum, s).wait().unwrap();
        let total = (world * (world + 1) / 2) as f32;
        assert_eq!(
            buf.to_vec_f32().unwrap(),
            vec![total; 3],
            "all-reduce {dtype}"
        );

        // broadcast from the last rank.
        let root = world - 1;
        let buf = on(dev, &[rank as f32 * 3.0; 5], dtype);
        g.broadcast(&slice(&buf), root, s).wait().unwrap();
        assert_eq!(
            buf.to_vec_f32().unwrap(),
            vec![root as f32 * 3.0; 5],
            "broadcast {dtype}"
        );
    }
    g.barrier().unwrap();
}

#[test]
#[ignore = "needs CUDA GPUs and NCCL: run `cargo xtask gpu-test` (FSDP_GPU_TESTS=1)"]
fn threads_one_per_visible_gpu() {
    if !gpu_tests() {
        return;
    }
    let world = visible_gpus();
    assert!(
        world >= 1,
        "FSDP_GPU_TESTS=1 but no CUDA device could be opened"
    );
    let store = Arc::new(TcpStore::host("127.0.0.1:0", Duration::from_secs(60)).unwrap());
    let addr = store.addr().to_string();
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let store = Arc::clone(&store);
            let addr = addr.clone();
            std::thread::spawn(move || {
                let own;
                let st: &TcpStore = if rank == 0 {
                    &store
                } else {
                    own = TcpStore::connect(&addr, Duration::from_secs(60)).unwrap();
                    &own
                };
                let dev = Device::cuda(rank).unwrap();
                let g = NcclGroup::new(st, rank, world, NcclConfig::new(rank)).unwrap();
                exercise(&g, &dev);
            })
        })
        .collect();
    for (r, h) in handles.into_iter().enumerate() {
        h.join().unwrap_or_else(|_| panic!("rank {r} failed"));
    }
}

/// One rank of a job launched by `cargo xtask gpu-launch-2` (`RANK`, `WORLD_SIZE`,
/// `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`). Run alone it skips.
#[test]
#[ignore = "needs CUDA GPUs and a launcher: run `cargo xtask gpu-test` (FSDP_GPU_TESTS=1)"]
fn one_rank_of_a_launched_job() {
    if !gpu_tests() {
        return;
    }
    if std::env::var("WORLD_SIZE").is_err() {
        eprintln!("skipped: not launched by `cargo xtask gpu-launch-2` (no WORLD_SIZE)");
        return;
    }
    let (g, _store) = NcclGroup::from_env(Duration::from_secs(120)).unwrap();
    let local: usize = std::env::var("LOCAL_RANK")
        .map(|v| v.parse().unwrap())
        .unwrap_or(g.rank());
    let dev = Device::cuda(local).unwrap();
    exercise(&g, &dev);
}
