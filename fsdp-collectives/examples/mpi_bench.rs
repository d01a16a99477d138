//! All-gather and reduce-scatter throughput of the MPI backend, against the thread backend in the
//! same run. Launched by `cargo xtask bench mpi` as `mpirun -n 4 mpi_bench`:
//!
//! - all-gather: f32, 64 MiB output per rank (16 MiB input at W = 4); GB/s = output bytes per
//!   rank per second (the bytes each rank receives, its own chunk included, as the thread bench
//!   counts).
//! - reduce-scatter: f32 sum, 64 MiB input per rank, 16 MiB output; GB/s = input bytes per rank
//!   per second (the bytes reduced into the outputs, as the thread bench counts).
//! - `thread_all_gather_gbps`, `thread_reduce_scatter_gbps`: the same collectives on a W-thread
//!   `ThreadGroup` in rank 0's process while the other processes wait (sleeping) in a barrier.
//!
//! The variants are interleaved repetition by repetition (MPI all-gather, MPI reduce-scatter,
//! thread all-gather, thread reduce-scatter, then again), so machine noise hits them alike; each
//! figure is the median of `REPS` repetitions after a warm-up, each repetition the max over ranks
//! (the collective is done when the slowest rank is). Rank 0 prints one JSON object as its last
//! line, with the 1-minute load average when the run ended (the machine is shared), and
//! `all_reduce_bytes_over_buffer` (bytes a rank sends in one all-reduce over the buffer's size,
//! the max over ranks). `--no-thread` leaves out the thread backend (its figures print as `null`).

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

/// Which collective a repetition times.
#[derive(Clone, Copy)]
enum Kind {
    AllGather,
    ReduceScatter,
}

/// Allocates and fills this rank's buffers for `kind`, meets the other ranks at `sync` (so no
/// rank's buffer preparation is timed), then times the collective until it completed here.
fn timed(pg: &dyn ProcessGroup, kind: Kind, sync: &dyn Fn()) -> Duration {
    let (r, w) = (pg.rank(), pg.size());
    let dev = Device::cpu(r);
    let st = dev.new_stream("comm");
    let (in_bytes, out_bytes) = match kind {
        Kind::AllGather => (OUT_BYTES / w, OUT_BYTES),
        Kind::ReduceScatter => (OUT_BYTES, OUT_BYTES / w),
    };
    let input = buffer(&dev, &st, in_bytes, 1.0 + r as f32);
    let output = buffer(&dev, &st, out_bytes, 0.0);
    let (i, o) = (slice(&input), slice(&output));
    st.synchronize().unwrap();
    sync();
    let t0 = Instant::now();
    match kind {
        Kind::AllGather => pg.all_gather_into(&i, &o, &st),
        Kind::ReduceScatter => pg.reduce_scatter(&i, &o, ReduceOp::Sum, &st),
    }
    .wait()
    .unwrap();
    t0.elapsed()
}

fn gbps(t: Duration) -> f64 {
    OUT_BYTES as f64 / t.as_secs_f64() / 1e9
}

/// Time of the thread backend running `kind` on W rank threads of this process (the slowest
/// rank's).
fn thread_time(w: usize, kind: Kind) -> Duration {
    let groups = ThreadGroup::new(w);
    let bar = Arc::new(Barrier::new(w));
    let per_rank: Vec<Duration> = std::thread::scope(|s| {
        let hs: Vec<_> = groups
            .into_iter()
            .map(|g| {
                let bar = Arc::clone(&bar);
                s.spawn(move || {
                    timed(&g, kind, &|| {
                        bar.wait();
                    })
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    per_rank.into_iter().max().unwrap()
}

fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// `all_reduce_bytes_over_buffer`: bytes this rank sent during one f32 all-reduce of
/// `OUT_BYTES / W` over the buffer's size ([`MpiGroup::bytes_sent`]), the max over ranks.
fn all_reduce_bytes(mpi: &MpiGroup) -> f64 {
    let (r, w) = (mpi.rank(), mpi.size());
    let dev = Device::cpu(r);
    let st = dev.new_stream("ar");
    let bytes = OUT_BYTES / w;
    let b = buffer(&dev, &st, bytes, 1.0 + r as f32);
    st.synchronize().unwrap();
    let before = mpi.bytes_sent();
    mpi.all_reduce(&slice(&b), ReduceOp::Sum, &st)
        .wait()
        .unwrap();
    let ratio = (mpi.bytes_sent() - before) as f64 / bytes as f64;
    max_over_ranks(mpi, Duration::from_secs_f64(ratio)).as_secs_f64()
}

fn main() {
    let mpi = MpiGroup::world().unwrap_or_else(|e| panic!("MPI world: {e}"));
    let w = mpi.size();
    // `--no-thread`: skip the thread backend (the two-node bench compares MPI paths only).
    let with_thread = !std::env::args().any(|a| a == "--no-thread");
    let ar_bytes = all_reduce_bytes(&mpi);
    let kinds = [Kind::AllGather, Kind::ReduceScatter];
    let sync = || mpi.barrier().unwrap();
    // [mpi all-gather, mpi reduce-scatter, thread all-gather, thread reduce-scatter]
    let mut times: [Vec<Duration>; 4] = Default::default();
    for rep in 0..=REPS {
        for (k, &kind) in kinds.iter().enumerate() {
            let t = max_over_ranks(&mpi, timed(&mpi, kind, &sync));
            // The thread backend, same sizes, in rank 0's process only (the others sleep in
            // the barrier).
            mpi.barrier().unwrap();
            let thread = (with_thread && mpi.rank() == 0).then(|| thread_time(w, kind));
            if rep > 0 {
                times[k].push(t);
                times[2 + k].extend(thread);
            }
        }
    }
    mpi.barrier().unwrap();
    if mpi.rank() == 0 {
        // JSON `null` for a figure that was not measured (`--no-thread`).
        let [ag, rs, tag, trs] = times.map(|v| {
            if v.is_empty() {
                "null".to_string()
            } else {
                format!("{:.4}", gbps(median(v)))
            }
        });
        println!(
            "{{\"world\": {w}, \"shared_memory\": {}, \"hierarchical\": {}, \
             \"mpi_all_gather_gbps\": {ag}, \"mpi_reduce_scatter_gbps\": {rs}, \
             \"thread_all_gather_gbps\": {tag}, \"thread_reduce_scatter_gbps\": {trs}, \
             \"all_reduce_bytes_over_buffer\": {ar_bytes:.4}, \"load_average\": {:.2}}}",
            mpi.uses_shared_memory(),
            mpi.uses_hierarchical(),
            load_average()
        );
    }
}
