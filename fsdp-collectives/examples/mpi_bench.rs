//! All-gather and reduce-scatter throughput of the MPI backend, against the thread backend in the
//! same run. Launched by `cargo xtask bench mpi` as `mpirun -n 4 mpi_bench`:
//!
//! - all-gather: f32, 64 MiB output per rank (16 MiB input at W = 4); GB/s = output bytes per
//!   rank per second (the bytes each rank receives, its own chunk included, as the thread bench
//!   counts).
//! - reduce-scatter: f32 sum, 64 MiB input per rank, 16 MiB output; GB/s = input bytes per rank
//!   per second (the bytes reduced into the outputs, as the thread bench counts).
//! - `thread_all_gather_gbps`: the same all-gather on a W-thread `ThreadGroup` in rank 0's
//!   process while the other processes wait (sleeping) in a barrier.
//!
//! Median of the timed repetitions; each repetition is the max over ranks (the collective is
//! done when the slowest rank is). Rank 0 prints one JSON object as its last line.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use fsdp_alloc::{Buffer, DType, Device, Stream};
use fsdp_collectives::{DeviceSlice, MpiGroup, ProcessGroup, ReduceOp, ThreadGroup};

const OUT_BYTES: usize = 64 << 20;
const REPS: usize = 7;

fn buffer(dev: &Device, st: &Stream, bytes: usize, fill: f32) -> Buffer {
    let b = dev.alloc(bytes, st).unwrap();
    b.data().write::<f32>().unwrap().fill(fill);
    b
}

fn slice(b: &Buffer) -> DeviceSlice {
    DeviceSlice::from_buffer(b, DType::F32).unwrap()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Times `REPS` repetitions of `op` (after one warm-up), each started together on every rank.
fn time_op(sync: &dyn Fn(), op: &dyn Fn() -> Duration) -> Vec<Duration> {
    sync();
    op();
    (0..REPS)
        .map(|_| {
            sync();
            op()
        })
        .collect()
}

fn max_over_ranks(pg: &dyn ProcessGroup, d: Duration) -> Duration {
    let dev = Device::cpu(pg.rank());
    let st = dev.new_stream("max");
    let b = buffer(&dev, &st, 4, d.as_secs_f32());
    pg.all_reduce(&slice(&b), ReduceOp::Max, &st)
        .wait()
        .unwrap();
    let v = b.data().read::<f32>().unwrap()[0];
    Duration::from_secs_f32(v)
}

fn all_gather_time(pg: &dyn ProcessGroup) -> Duration {
    let w = pg.size();
    let dev = Device::cpu(pg.rank());
    let st = dev.new_stream("comm");
    let input = buffer(&dev, &st, OUT_BYTES / w, pg.rank() as f32);
    let output = buffer(&dev, &st, OUT_BYTES, 0.0);
    let (i, o) = (slice(&input), slice(&output));
    let t0 = Instant::now();
    pg.all_gather_into(&i, &o, &st).wait().unwrap();
    t0.elapsed()
}

fn reduce_scatter_time(pg: &dyn ProcessGroup) -> Duration {
    let w = pg.size();
    let dev = Device::cpu(pg.rank());
    let st = dev.new_stream("comm");
    let input = buffer(&dev, &st, OUT_BYTES, 1.0 + pg.rank() as f32);
    let output = buffer(&dev, &st, OUT_BYTES / w, 0.0);
    let (i, o) = (slice(&input), slice(&output));
    let t0 = Instant::now();
    pg.reduce_scatter(&i, &o, ReduceOp::Sum, &st)
        .wait()
        .unwrap();
    t0.elapsed()
}

fn gbps(t: Duration) -> f64 {
    OUT_BYTES as f64 / t.as_secs_f64() / 1e9
}

fn main() {
    let mpi = MpiGroup::world().unwrap_or_else(|e| panic!("MPI world: {e}"));
    let w = mpi.size();
    let sync = || mpi.barrier().unwrap();
    let ag: Vec<Duration> = time_op(&sync, &|| all_gather_time(&mpi))
        .into_iter()
        .map(|d| max_over_ranks(&mpi, d))
        .collect();
    let rs: Vec<Duration> = time_op(&sync, &|| reduce_scatter_time(&mpi))
        .into_iter()
        .map(|d| max_over_ranks(&mpi, d))
        .collect();
    // The thread backend, same sizes, in rank 0's process only.
    let thread = if mpi.rank() == 0 {
        let groups = ThreadGroup::new(w);
        let bar = Arc::new(Barrier::new(w));
        let per_rank: Vec<Vec<Duration>> = std::thread::scope(|s| {
            let hs: Vec<_> = groups
                .into_iter()
                .map(|g| {
                    let bar = Arc::clone(&bar);
                    s.spawn(move || {
                        let sync = || {
                            bar.wait();
                        };
                        time_op(&sync, &|| all_gather_time(&g))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let reps: Vec<Duration> = (0..REPS)
            .map(|k| per_rank.iter().map(|v| v[k]).max().unwrap())
            .collect();
        Some(median(reps))
    } else {
        None
    };
    mpi.barrier().unwrap();
    if let Some(t) = thread {
        println!(
            "{{\"world\": {w}, \"shared_memory\": {}, \"mpi_all_gather_gbps\": {:.4}, \
             \"mpi_reduce_scatter_gbps\": {:.4}, \"thread_all_gather_gbps\": {:.4}}}",
            mpi.uses_shared_memory(),
            gbps(median(ag)),
            gbps(median(rs)),
            gbps(t)
        );
    }
}
