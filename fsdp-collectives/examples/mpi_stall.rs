//! The stall test of `cargo xtask mpi-test --nodes 2`: every rank loops over 64 MiB all-gathers
//! (f32, 64 MiB output per rank) with the timeout of `FSDP_MPI_TIMEOUT_S`; the test stops or
//! kills one rank in the middle and checks that every other one ends in time.
//!
//! ```text
//! mpirun -n 4 … mpi_stall DIR
//! ```
//!
//! Each rank writes `DIR/rank<r>.pid` after its first all-gather. A rank whose all-gather fails
//! writes `DIR/rank<r>.result` (the error's variant and message, and how long after the start
//! of the failing all-gather it came) and then waits to be ended by the test (exiting would make
//! `mpirun` end the job before the other ranks have written theirs).

use std::time::{Duration, Instant};

use fsdp_alloc::{DType, Device};
use fsdp_collectives::{CollectiveError, DeviceSlice, MpiGroup, ProcessGroup};

const OUT_BYTES: usize = 64 << 20;

fn variant(e: &CollectiveError) -> &'static str {
    match e {
        CollectiveError::Timeout { .. } => "Timeout",
        CollectiveError::PeerFailed { .. } => "PeerFailed",
        CollectiveError::Mpi { .. } => "Mpi",
        _ => "other",
    }
}

fn main() {
    let dir = std::path::PathBuf::from(std::env::args().nth(1).expect("usage: mpi_stall DIR"));
    let mpi = MpiGroup::world().unwrap_or_else(|e| panic!("MPI world: {e}"));
    let (r, w) = (mpi.rank(), mpi.size());
    let dev = Device::cpu(r);
    let st = dev.new_stream("comm");
    let input = dev.alloc(OUT_BYTES / w, &st).unwrap();
    let output = dev.alloc(OUT_BYTES, &st).unwrap();
    input.data().write::<f32>().unwrap().fill(r as f32);
    let (i, o) = (
        DeviceSlice::from_buffer(&input, DType::F32).unwrap(),
        DeviceSlice::from_buffer(&output, DType::F32).unwrap(),
    );
    for n in 0u64.. {
        let t0 = Instant::now();
        if let Err(e) = mpi.all_gather_into(&i, &o, &st).wait() {
            let line = format!(
                "{} after {:.2} s in all-gather #{n} (timeout {:?}): {e}",
                variant(&e),
                t0.elapsed().as_secs_f64(),
                mpi.config().timeout
            );
            eprintln!("mpi_stall: rank {r}: {line}");
            std::fs::write(dir.join(format!("rank{r}.result")), line).unwrap();
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        if n == 0 {
            std::fs::write(
                dir.join(format!("rank{r}.pid")),
                std::process::id().to_string(),
            )
            .unwrap();
        }
    }
}
