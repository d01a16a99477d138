//! The shared-GPU group on a real GPU: `cargo xtask gpu-test`, suite `shared-gpu`
//! (`FSDP_GPU_TESTS=1`, `#[ignore]`d otherwise). Written without a GPU; none of these tests has
//! run yet.
//!
//! W = 2, 3, 4 thread ranks share `cuda:0`, each with its own `Device` (allocator, statistics,
//! streams). Results are compared with the thread backend on CPU devices from the same bytes
//! (the cases of `tests.rs`): bit for bit, except that where both sides hold a NaN its payload
//! may differ (a max/min of two NaNs gives the GPU's canonical NaN).

use std::sync::Arc;

use fsdp_alloc::{BufferRef, DType, Device, Stream};
use half::{bf16, f16};

use super::tests::{issue, on_threads, Case, Coll, Rng, OPS, REDUCTIONS};
use super::SharedGpuGroup;
use crate::error::CollectiveError;
use crate::group::ProcessGroup;
use crate::types::{DeviceSlice, ReduceOp, Work};

fn gpu_tests() -> bool {
    if std::env::var("FSDP_GPU_TESTS").as_deref() == Ok("1") {
        return true;
    }
    eprintln!("skipped: set FSDP_GPU_TESTS=1 on a machine with a GPU (cargo xtask gpu-test)");
    false
}

/// Copies `bytes` into the device memory `buf` and waits for the device (test setup).
fn upload(stream: &Stream, buf: &BufferRef, bytes: &[u8]) {
    assert_eq!(buf.len(), bytes.len());
    let ctx = stream.cuda_stream().expect("a CUDA stream").context();
    ctx.bind_to_thread().unwrap();
    let ptr = buf.device_ptr().expect("device memory");
    // SAFETY: `ptr` is the first of `buf.len()` bytes of device memory of this context, which
    // no work uses yet; the device is synchronized before anything reads them.
    unsafe { cudarc::driver::result::memcpy_htod_sync(ptr, bytes) }.unwrap();
    ctx.synchronize().unwrap();
}

/// The bytes of the device memory `buf`, after everything on the device has run.
fn download(stream: &Stream, buf: &BufferRef) -> Vec<u8> {
    let ctx = stream.cuda_stream().expect("a CUDA stream").context();
    ctx.bind_to_thread().unwrap();
    ctx.synchronize().unwrap();
    let mut out = vec![0u8; buf.len()];
    // SAFETY: `buf` is `out.len()` bytes of device memory of this context; the device is idle.
    unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut out, buf.device_ptr().unwrap()) }
        .unwrap();
    out
}

/// The arenas after `case` on W thread ranks sharing `cuda:0`.
fn on_gpu(case: &Case, arenas: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let groups = SharedGpuGroup::new(case.world, 0)
        .expect("FSDP_GPU_TESTS=1 but no shared-GPU group could be made on cuda:0");
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, g)| {
                let bytes = &arenas[rank];
                s.spawn(move || {
                    let dev = Device::cuda(0).unwrap();
                    let st = dev.new_stream("comm");
                    let arena = dev.alloc(bytes.len(), &st).unwrap();
                    upload(&st, arena.data(), bytes);
                    issue(&g, case, rank, arena.data(), &st)
                        .wait()
                        .unwrap_or_else(|e| panic!("{case:?}: shared-GPU rank {rank}: {e}"));
                    download(&st, arena.data())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn is_nan(dtype: DType, e: &[u8]) -> bool {
    match dtype {
        DType::F32 => f32::from_le_bytes([e[0], e[1], e[2], e[3]]).is_nan(),
        DType::F16 => f16::from_bits(u16::from_le_bytes([e[0], e[1]])).is_nan(),
        DType::BF16 => bf16::from_bits(u16::from_le_bytes([e[0], e[1]])).is_nan(),
        _ => false,
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run `cargo xtask gpu-test` (FSDP_GPU_TESTS=1)"]
fn collectives_on_one_gpu_equal_the_thread_backend_bit_for_bit() {
    if !gpu_tests() {
        return;
    }
    let mut cases = Vec::new();
    for world in 2..=4 {
        for (dtype, accum) in REDUCTIONS {
            for op in OPS {
                for (n, offset) in [(1000, 0), (37, 1)] {
                    for in_place in [false, true] {
                        cases.push(Case {
                            coll: Coll::ReduceScatter(op, accum),
                            dtype,
                            world,
                            n,
                            offset,
                            in_place,
                        });
                    }
                    cases.push(Case {
                        coll: Coll::AllReduce(op, accum),
                        dtype,
                        world,
                        n: n * world + 5,
                        offset,
                        in_place: false,
                    });
                }
            }
        }
        for dtype in [DType::F32, DType::BF16, DType::U8] {
            for (n, offset) in [(1000, 0), (33, 1)] {
                for in_place in [false, true] {
                    cases.push(Case {
                        coll: Coll::AllGather,
                        dtype,
                        world,
                        n,
                        offset,
                        in_place,
                    });
                }
                cases.push(Case {
                    coll: Coll::AllToAll,
                    dtype,
                    world,
                    n,
                    offset,
                    in_place: false,
                });
                cases.push(Case {
                    coll: Coll::Broadcast(1),
                    dtype,
                    world,
                    n,
                    offset,
                    in_place: false,
                });
            }
        }
    }
    let mut rng = Rng(0x5eed_0003);
    let mut nan_payloads = 0usize;
    for case in &cases {
        let arenas: Vec<Vec<u8>> = (0..case.world)
            .map(|r| rng.elems(case.dtype, case.layout(r).len, case.specials()))
            .collect();
        let want = on_threads(case, &arenas);
        let got = on_gpu(case, &arenas);
        let sz = case.dtype.size();
        for (rank, (g, w)) in got.iter().zip(&want).enumerate() {
            for (i, (ge, we)) in g.chunks_exact(sz).zip(w.chunks_exact(sz)).enumerate() {
                if ge == we {
                    continue;
                }
                if is_nan(case.dtype, ge) && is_nan(case.dtype, we) {
                    nan_payloads += 1;
                    continue;
                }
                panic!(
                    "{case:?}: rank {rank} element {i}: GPU {ge:02x?} vs thread backend {we:02x?}"
                );
            }
        }
    }
    eprintln!(
        "{} cases at W = 2..4 on one GPU equal the thread backend bit for bit ({nan_payloads} \
         elements where both hold a NaN with different payloads)",
        cases.len()
    );
}

/// f32 values that are exact whatever the order of their sums.
fn exact(rank: usize, step: usize, len: usize) -> Vec<u8> {
    (0..len)
        .flat_map(|j| ((rank * 1000 + step * 10 + j % 7) as f32).to_le_bytes())
        .collect()
}

fn slice(buf: &BufferRef) -> DeviceSlice {
    DeviceSlice::new(buf.clone(), DType::F32).unwrap()
}

/// Each rank issues all-gathers on an "unshard" stream and reduce-scatters on a "reduce"
/// stream, ten steps of both without waiting, then all-reduces the gathered output on a third
/// stream ordered only by the all-gather's event. Issuing is not a host wait; every result is
/// exact; each rank's allocator counts only its own memory.
#[test]
#[ignore = "needs a CUDA GPU: run `cargo xtask gpu-test` (FSDP_GPU_TESTS=1)"]
fn overlapping_streams_order_by_events_without_host_waits() {
    if !gpu_tests() {
        return;
    }
    const STEPS: usize = 10;
    const N: usize = 4096;
    let world = 3;
    let groups = SharedGpuGroup::new(world, 0).expect("a shared-GPU group on cuda:0");
    std::thread::scope(|s| {
        for (rank, g) in groups.into_iter().enumerate() {
            s.spawn(move || {
                let dev = Device::cuda(0).unwrap();
                let (unshard, reduce, compute) = (
                    dev.new_stream("unshard"),
                    dev.new_stream("reduce"),
                    dev.new_stream("compute"),
                );
                let alloc = |st: &Stream, bytes: usize| dev.alloc(bytes, st).unwrap();
                let shards: Vec<_> = (0..STEPS).map(|_| alloc(&unshard, N * 4)).collect();
                let grads: Vec<_> = (0..STEPS).map(|_| alloc(&reduce, world * N * 4)).collect();
                for (i, (sh, gr)) in shards.iter().zip(&grads).enumerate() {
                    upload(&unshard, sh.data(), &exact(rank, i, N));
                    upload(&reduce, gr.data(), &exact(rank, i, world * N));
                }
                let fulls: Vec<_> = (0..STEPS).map(|_| alloc(&unshard, world * N * 4)).collect();
                let outs: Vec<_> = (0..STEPS).map(|_| alloc(&reduce, N * 4)).collect();
                // Rank r also holds (r + 1) MiB of its own: the statistics are per rank.
                let own = alloc(&compute, (rank + 1) << 20);
                let before = fsdp_alloc::stream::host_syncs();
                let mut works: Vec<Work> = Vec::new();
                for i in 0..STEPS {
                    let ag = g.all_gather_into(
                        &slice(shards[i].data()),
                        &slice(fulls[i].data()),
                        &unshard,
                    );
                    compute.wait_event(ag.event());
                    works.push(g.all_reduce(&slice(fulls[i].data()), ReduceOp::Sum, &compute));
                    works.push(ag);
                    works.push(g.reduce_scatter(
                        &slice(grads[i].data()),
                        &slice(outs[i].data()),
                        ReduceOp::Sum,
                        &reduce,
                    ));
                }
                assert_eq!(
                    fsdp_alloc::stream::host_syncs(),
                    before,
                    "rank {rank}: issuing collectives waited on the host"
                );
                for w in &works {
                    w.wait().unwrap();
                }
                let f32s = |b: Vec<u8>| -> Vec<f32> {
                    b.chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect()
                };
                for i in 0..STEPS {
                    // all-gather then all-reduce: chunk p holds W × rank p's shard.
                    let full = f32s(download(&compute, fulls[i].data()));
                    let want: Vec<f32> = (0..world)
                        .flat_map(|p| f32s(exact(p, i, N)))
                        .map(|v| v * world as f32)
                        .collect();
                    assert_eq!(full, want, "rank {rank} step {i}: all-gather + all-reduce");
                    // reduce-scatter: chunk `rank` of every rank's gradient, summed.
                    let out = f32s(download(&reduce, outs[i].data()));
                    let want: Vec<f32> = (0..N)
                        .map(|j| {
                            (0..world)
                                .map(|p| f32s(exact(p, i, world * N))[rank * N + j])
                                .sum()
                        })
                        .collect();
                    assert_eq!(out, want, "rank {rank} step {i}: reduce-scatter");
                }
                // What this rank allocated (a large block may count up to its 2 MiB segment
                // rounding), and nothing of the others' 1 to 3 MiB.
                let stats = dev.memory_stats();
                let mine = ((rank + 1) << 20) + STEPS * (2 + 2 * world) * N * 4;
                assert!(
                    stats.allocated_bytes >= mine && stats.allocated_bytes < mine + (3 << 19),
                    "rank {rank}: {stats:?}"
                );
                drop(own);
            });
        }
    });
}

/// Bad calls fail on every rank with the same typed error, a rank whose stream had failed makes
/// its peers fail at once, and the group works afterwards.
#[test]
#[ignore = "needs a CUDA GPU: run `cargo xtask gpu-test` (FSDP_GPU_TESTS=1)"]
fn misuse_is_the_same_typed_error_on_every_rank() {
    if !gpu_tests() {
        return;
    }
    let groups = SharedGpuGroup::new(2, 0).expect("a shared-GPU group on cuda:0");
    let errors: Vec<Vec<CollectiveError>> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, g)| {
                s.spawn(move || {
                    let dev = Device::cuda(0).unwrap();
                    let host = Device::cpu(rank);
                    let mut errs = Vec::new();
                    // Rank 1 passes host memory on a CPU stream.
                    let st = dev.new_stream("a");
                    let (inp, out) = if rank == 1 {
                        let hs = host.new_stream("h");
                        (host.alloc(16, &hs).unwrap(), host.alloc(32, &hs).unwrap())
                    } else {
                        (dev.alloc(16, &st).unwrap(), dev.alloc(32, &st).unwrap())
                    };
                    let s1 = if rank == 1 {
                        host.new_stream("h2")
                    } else {
                        st.clone()
                    };
                    let w = g.all_gather_into(&slice(inp.data()), &slice(out.data()), &s1);
                    errs.push(w.wait().unwrap_err());
                    // Rank 0 issues again on its stream, failed by that collective: it does not
                    // take part (StreamFailed), and rank 1 fails at once (PeerFailed, peer 0).
                    let st2 = if rank == 0 { st } else { dev.new_stream("a2") };
                    let (inp, out) = (dev.alloc(16, &st2).unwrap(), dev.alloc(32, &st2).unwrap());
                    let w = g.all_gather_into(&slice(inp.data()), &slice(out.data()), &st2);
                    let e = w.wait().unwrap_err();
                    if rank == 0 {
                        assert!(matches!(e, CollectiveError::StreamFailed { .. }), "{e}");
                    } else {
                        assert!(
                            matches!(e, CollectiveError::PeerFailed { peer: 0, .. }),
                            "{e}"
                        );
                    }
                    // Rank 0 passes an output one element short.
                    let st = dev.new_stream("b");
                    let inp = dev.alloc(16, &st).unwrap();
                    let out = dev.alloc(if rank == 0 { 28 } else { 32 }, &st).unwrap();
                    let w = g.all_gather_into(&slice(inp.data()), &slice(out.data()), &st);
                    errs.push(w.wait().unwrap_err());
                    // A good call on a fresh stream still works.
                    let st = dev.new_stream("c");
                    let inp = dev.alloc(16, &st).unwrap();
                    upload(&st, inp.data(), &exact(rank, 0, 4));
                    let out = dev.alloc(32, &st).unwrap();
                    g.all_gather_into(&slice(inp.data()), &slice(out.data()), &st)
                        .wait()
                        .unwrap();
                    let got = download(&st, out.data());
                    assert_eq!(got, [exact(0, 0, 4), exact(1, 0, 4)].concat());
                    errs
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for errs in &errors {
        assert!(
            matches!(&errs[0], CollectiveError::InvalidBuffer { rank: 1, .. }),
            "{}",
            errs[0]
        );
        assert!(
            matches!(&errs[1], CollectiveError::SizeMismatch { rank: 0, .. }),
            "{}",
            errs[1]
        );
    }
    assert_eq!(errors[0], errors[1], "every rank reports the same errors");
}

/// `--profile`: one `"shared-gpu"` GPU interval per rank and collective, on its stream's track.
#[test]
#[ignore = "needs a CUDA GPU: run `cargo xtask gpu-test` (FSDP_GPU_TESTS=1)"]
fn profile_has_one_shared_gpu_interval_per_rank_and_collective() {
    if !gpu_tests() {
        return;
    }
    let groups = SharedGpuGroup::new(2, 0).expect("a shared-GPU group on cuda:0");
    let groups: Vec<Arc<SharedGpuGroup>> = groups.into_iter().map(Arc::new).collect();
    fsdp_alloc::trace::start();
    std::thread::scope(|s| {
        for (rank, g) in groups.iter().enumerate() {
            s.spawn(move || {
                let dev = Device::cuda(0).unwrap();
                let st = dev.new_stream(&format!("comm{rank}"));
                let inp = dev.alloc(1 << 20, &st).unwrap();
                let out = dev.alloc(2 << 20, &st).unwrap();
                g.all_gather_into(&slice(inp.data()), &slice(out.data()), &st)
                    .wait()
                    .unwrap();
                g.reduce_scatter(&slice(out.data()), &slice(inp.data()), ReduceOp::Sum, &st)
                    .wait()
                    .unwrap();
                dev.synchronize().unwrap();
            });
        }
    });
    let trace = fsdp_alloc::trace::stop();
    for rank in 0..2 {
        for name in ["all_gather", "reduce_scatter"] {
            let n = trace
                .events()
                .iter()
                .filter(|e| {
                    e.cat == "shared-gpu"
                        && &*e.name == name
                        && e.track == format!("gpu comm{rank}")
                })
                .count();
            assert_eq!(n, 1, "rank {rank} {name}: {:?}", trace.events());
        }
    }
}
