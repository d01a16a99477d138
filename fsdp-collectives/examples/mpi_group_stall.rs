//! The group-creation stall test of `cargo xtask mpi-test`: every rank creates the world group;
//! then every rank but the last creates a second world group (a communicator-creating
//! collective over `MPI_COMM_WORLD`) while the last rank never does. The others must get a
//! typed timeout within `FSDP_MPI_TIMEOUT_S` (+ a few seconds), not hang in `MPI_Comm_dup`.
//!
//! ```text
//! mpirun -n 3 -x FSDP_MPI_TIMEOUT_S=3 … mpi_group_stall DIR
//! ```
//!
//! Each rank writes `DIR/rank<r>.pid` once the first group exists. A rank whose second group
//! creation returns writes `DIR/rank<r>.result` (the error's variant and message, or `created`,
//! and how long the call took) and then waits to be ended by the test: the timed-out barrier
//! cannot be cancelled, so the job cannot finish cleanly.

use std::time::{Duration, Instant};

use fsdp_collectives::{CollectiveError, MpiGroup, ProcessGroup};

fn main() {
    let dir =
        std::path::PathBuf::from(std::env::args().nth(1).expect("usage: mpi_group_stall DIR"));
    let world = MpiGroup::world().unwrap_or_else(|e| panic!("MPI world: {e}"));
    let (r, w) = (world.rank(), world.size());
    std::fs::write(
        dir.join(format!("rank{r}.pid")),
        std::process::id().to_string(),
    )
    .unwrap();
    if r + 1 < w {
        let t0 = Instant::now();
        let line = match MpiGroup::world_with_config(world.config().clone()) {
            Ok(_) => format!("created after {:.2} s", t0.elapsed().as_secs_f64()),
            Err(e) => format!(
                "{} after {:.2} s (timeout {:?}): {e}",
                match e {
                    CollectiveError::Timeout { .. } => "Timeout",
                    _ => "other",
                },
                t0.elapsed().as_secs_f64(),
                world.config().timeout
            ),
        };
        eprintln!("mpi_group_stall: rank {r}: {line}");
        std::fs::write(dir.join(format!("rank{r}.result")), line).unwrap();
    }
    // The last rank never creates the second group; every rank waits to be ended.
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}
