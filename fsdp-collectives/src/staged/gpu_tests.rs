//! Host staging on a real GPU: `cargo xtask gpu-test`, suite `mpi-gpu` (`FSDP_GPU_TESTS=1`,
//! `#[ignore]`d otherwise). Written without a GPU; none of these tests has run yet.
//!
//! Two thread ranks on `cuda:0`, each with its own `Device` and a page-locked staging device,
//! over the thread backend staged by [`HostStaged`] (the path `mpirun -n 2 train_gpt --backend
//! mpi --device cuda` takes, without MPI): every collective and in-place form, from device
//! buffers on a CUDA stream, bit for bit against the thread backend on CPU devices from the same
//! bytes; one counted host wait per collective; consumers on another stream ordered by the
//! work's event.

use std::sync::Arc;

use fsdp_alloc::{Buffer, DType, Device, DeviceConfig, Stream};

use super::HostStaged;
use crate::group::ProcessGroup;
use crate::thread::ThreadGroup;
use crate::types::{default_accum, DeviceSlice, ReduceOp, Work};

fn gpu_tests() -> bool {
    if std::env::var("FSDP_GPU_TESTS").as_deref() == Ok("1") {
        return true;
    }
    eprintln!("skipped: set FSDP_GPU_TESTS=1 on a machine with a GPU (cargo xtask gpu-test)");
    false
}

#[derive(Clone, Copy, Debug)]
enum Op {
    AllGather,
    AllGatherInPlace,
    ReduceScatter(ReduceOp, bool),
    ReduceScatterInPlace,
    AllReduce(ReduceOp),
    Broadcast(usize),
    AllToAll,
}

const CASES: &[(Op, DType)] = &[
    (Op::AllGather, DType::F32),
    (Op::AllGather, DType::U8),
    (Op::AllGatherInPlace, DType::BF16),
    (Op::ReduceScatter(ReduceOp::Sum, false), DType::F32),
    (Op::ReduceScatter(ReduceOp::Avg, false), DType::BF16),
    (Op::ReduceScatter(ReduceOp::Sum, true), DType::F16),
    (Op::ReduceScatterInPlace, DType::F32),
    (Op::AllReduce(ReduceOp::Sum), DType::F32),
    (Op::AllReduce(ReduceOp::Max), DType::I64),
    (Op::Broadcast(1), DType::F16),
    (Op::AllToAll, DType::I32),
];

/// Seeded bytes of `rank` with finite floats (the high byte of each 2-byte group masked).
fn bytes(rank: usize, len: usize) -> Vec<u8> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (rank as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407);
    (0..len)
        .map(|i| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let b = (x >> 56) as u8;
            if i % 2 == 1 {
                b & 0x3f
            } else {
                b
            }
        })
        .collect()
}

/// Issues `op` with `make`'s buffers (given their initial bytes); returns the work, the output
/// and the allocations to keep until it has run.
fn issue(
    pg: &dyn ProcessGroup,
    op: Op,
    dtype: DType,
    n: usize,
    stream: &Stream,
    make: &dyn Fn(Vec<u8>) -> (Buffer, DeviceSlice),
) -> (Work, DeviceSlice, Vec<Buffer>) {
    let (r, w, es) = (pg.rank(), pg.size(), dtype.size());
    let mut keep = Vec::new();
    let mut buf = |len: usize, fill: bool| {
        let (b, s) = make(if fill {
            bytes(r, len * es)
        } else {
            vec![0xA5; len * es]
        });
        keep.push(b);
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
        Op::ReduceScatterInPlace => {
            let i = buf(w * n, true);
            let o = i.slice(r * n, n).unwrap();
            (
                pg.reduce_scatter_with(&i, &o, ReduceOp::Sum, accum(false), stream),
                o,
            )
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
    (work, out, keep)
}

/// The thread backend on CPU devices: every rank's output bytes.
fn on_cpu(w: usize, op: Op, dtype: DType, n: usize) -> Vec<Vec<u8>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = ThreadGroup::new(w)
            .into_iter()
            .map(|g| {
                s.spawn(move || {
                    let dev = Device::cpu(g.rank());
                    let st = dev.new_stream("comm");
                    let make = |b: Vec<u8>| {
                        let buf = dev.alloc(b.len(), &st).unwrap();
                        buf.data().write::<u8>().unwrap().copy_from_slice(&b);
                        let s = DeviceSlice::from_buffer(&buf, dtype).unwrap();
                        (buf, s)
                    };
                    let (work, out, _keep) = issue(&g, op, dtype, n, &st, &make);
                    work.wait().unwrap();
                    st.synchronize().unwrap();
                    let v = out.data().read::<u8>().unwrap().to_vec();
                    v
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// W thread ranks on `cuda:0`, staged: every rank's output bytes, and the host waits its issue
/// counted.
fn on_gpu(w: usize, op: Op, dtype: DType, n: usize) -> Vec<(Vec<u8>, u64)> {
    std::thread::scope(|s| {
        let hs: Vec<_> = ThreadGroup::new(w)
            .into_iter()
            .enumerate()
            .map(|(rank, g)| {
                s.spawn(move || {
                    let gpu = Device::cuda(0).expect("FSDP_GPU_TESTS=1 but no cuda:0");
                    let pinned =
                        Device::cpu_pinned(20_000 + rank, DeviceConfig::default(), &gpu).unwrap();
                    let pg = HostStaged::new(Arc::new(g), pinned).unwrap();
                    let st = gpu.new_stream("comm");
                    let ctx = Arc::clone(st.cuda_stream().expect("a CUDA stream").context());
                    let make = |b: Vec<u8>| {
                        let buf = gpu.alloc(b.len(), &st).unwrap();
                        ctx.bind_to_thread().unwrap();
                        let ptr = buf.data().device_ptr().expect("device memory");
                        // SAFETY: `ptr` is the first of `b.len()` bytes of a new device
                        // allocation of this context that no work uses yet (synchronous copy).
                        unsafe { cudarc::driver::result::memcpy_htod_sync(ptr, &b) }.unwrap();
                        let s = DeviceSlice::from_buffer(&buf, dtype).unwrap();
                        (buf, s)
                    };
                    let before = fsdp_alloc::stream::host_syncs();
                    let (work, out, _keep) = issue(&pg, op, dtype, n, &st, &make);
                    let waits = fsdp_alloc::stream::host_syncs() - before;
                    // A consumer on another stream, ordered by the work's event only.
                    let other = gpu.new_stream("consumer");
                    other.wait_event(work.event());
                    let copy = gpu.alloc(out.nbytes(), &other).unwrap();
                    let dst = copy.data().device_ptr().unwrap();
                    let cs = other.cuda_stream().unwrap();
                    ctx.bind_to_thread().unwrap();
                    // SAFETY: both ranges are `out.nbytes()` bytes of live device memory of
                    // this context; the copy is ordered after the collective by the event.
                    unsafe {
                        cudarc::driver::sys::cuMemcpyDtoDAsync_v2(
                            dst,
                            out.data().device_ptr().unwrap(),
                            out.nbytes(),
                            cs.cu_stream(),
                        )
                    }
                    .result()
                    .unwrap();
                    work.wait()
                        .unwrap_or_else(|e| panic!("{op:?} {dtype} rank {rank}: {e}"));
                    other.synchronize().unwrap();
                    let mut host = vec![0u8; out.nbytes()];
                    // SAFETY: `copy` is `host.len()` bytes of device memory of this context;
                    // its stream has been synchronized.
                    unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut host, dst) }.unwrap();
                    (host, waits)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
#[ignore = "needs a CUDA GPU: run `cargo xtask gpu-test` (FSDP_GPU_TESTS=1)"]
fn staged_thread_ranks_on_one_gpu_equal_the_thread_backend() {
    if !gpu_tests() {
        return;
    }
    let w = 2;
    for &(op, dtype) in CASES {
        // Lengths: tiny, odd, and a 4 MiB f32 buffer.
        for n in [1, 37, 3000, 1 << 20] {
            let want = on_cpu(w, op, dtype, n);
            let got = on_gpu(w, op, dtype, n);
            for (rank, ((g, waits), c)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g == c,
                    "{op:?} {dtype} n={n} rank {rank}: differs from the thread backend"
                );
                assert_eq!(*waits, 1, "{op:?}: one counted host wait per collective");
            }
        }
    }
}
