//! The NCCL backend (`cuda` feature). Without a GPU (this development machine) only the guard
//! test runs: creating a group must be a typed error, never a cudarc panic. The GPU test runs
//! under `cargo xtask gpu-test` (`FSDP_GPU_TESTS=1`) and has never run here.
#![cfg(feature = "cuda")]

use std::time::Duration;

use fsdp_alloc::{DType, Device};
use fsdp_collectives::{
    nccl_available, CollectiveError, DeviceSlice, NcclConfig, NcclGroup, ProcessGroup, ReduceOp,
    TcpStore,
};

fn gpu_tests() -> bool {
    std::env::var("FSDP_GPU_TESTS").as_deref() == Ok("1")
}

#[test]
fn without_cuda_libraries_creation_is_a_typed_error() {
    if nccl_available().is_ok() {
        eprintln!("SKIPPED: CUDA and NCCL libraries are present; the GPU test covers creation");
        return;
    }
    let e = nccl_available().unwrap_err();
    assert!(matches!(e, CollectiveError::CudaUnavailable(_)), "{e}");
    let store = TcpStore::host("127.0.0.1:0", Duration::from_secs(5)).unwrap();
    let e = NcclGroup::new(&store, 0, 1, NcclConfig::new(0)).unwrap_err();
    assert!(matches!(e, CollectiveError::CudaUnavailable(_)), "{e}");
}

#[test]
fn single_rank_collectives_on_the_host_path() {
    if !gpu_tests() {
        eprintln!("SKIPPED: GPU test; run with FSDP_GPU_TESTS=1 on a machine with a CUDA GPU");
        return;
    }
    let store = TcpStore::host("127.0.0.1:0", Duration::from_secs(30)).unwrap();
    let g = NcclGroup::new(&store, 0, 1, NcclConfig::new(0))
        .expect("FSDP_GPU_TESTS=1, but no NCCL group could be created on cuda:0");
    let dev = Device::cpu(0);
    let st = dev.new_stream("comm");
    let put = |v: &[f32]| {
        let b = dev.alloc(v.len() * 4, &st).unwrap();
        b.data().write::<f32>().unwrap().copy_from_slice(v);
        b
    };
    let input = put(&[1.0, 2.0, 3.0]);
    let output = put(&[0.0; 3]);
    let (i, o) = (
        DeviceSlice::from_buffer(&input, DType::F32).unwrap(),
        DeviceSlice::from_buffer(&output, DType::F32).unwrap(),
    );
    g.all_gather_into(&i, &o, &st).wait().unwrap();
    assert_eq!(*output.data().read::<f32>().unwrap(), [1.0, 2.0, 3.0]);
    g.all_reduce(&o, ReduceOp::Avg, &st).wait().unwrap();
    assert_eq!(*output.data().read::<f32>().unwrap(), [1.0, 2.0, 3.0]);
    g.reduce_scatter(&i, &o, ReduceOp::Sum, &st).wait().unwrap();
    g.broadcast(&o, 0, &st).wait().unwrap();
    g.barrier().unwrap();
    // A size mismatch is an error, agreed on through the descriptor exchange.
    let short = DeviceSlice::new(output.data().slice(0, 8).unwrap(), DType::F32).unwrap();
    let e = g
        .all_gather_into(&i, &short, &dev.new_stream("fresh"))
        .wait()
        .unwrap_err();
    assert!(matches!(e, CollectiveError::SizeMismatch { .. }), "{e}");
}
