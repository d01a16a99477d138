//! One launch path: given a backend choice, the group(s) this process runs.
//!
//! - [`CollectiveBackend::Thread`]: every rank is a thread of this process; [`CollectiveBackend::launch`] returns
//!   the W handles of one [`ThreadGroup`] (hand one to each rank thread).
//! - [`CollectiveBackend::Mpi`]: one rank per process, started by an MPI launcher (`mpirun -n W …`,
//!   `srun --mpi=pmix …`); rank and world size come from MPI itself. Needs the `mpi` feature;
//!   without it the choice is a typed error that says how to rebuild.
//!
//! (NCCL groups need a device and a rendezvous store: see `NcclGroup::from_env`.)

use std::str::FromStr;
use std::sync::Arc;

use crate::error::{CollectiveError, Result};
use crate::group::ProcessGroup;
use crate::thread::ThreadGroup;

/// Which collective backend a program runs on (`--backend thread|mpi`). Not to be confused with
/// fsdp-autograd's `Backend` (the kernel trait).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CollectiveBackend {
    /// W ranks as W threads of this process ([`ThreadGroup`]); the default.
    #[default]
    Thread,
    /// One rank per process over MPI (`MpiGroup`, feature `mpi`).
    Mpi,
}

impl CollectiveBackend {
    /// The name used on command lines.
    pub const fn name(self) -> &'static str {
        match self {
            CollectiveBackend::Thread => "thread",
            CollectiveBackend::Mpi => "mpi",
        }
    }

    /// This process's group(s): for [`CollectiveBackend::Thread`] the `thread_ranks` handles of a new
    /// thread group; for [`CollectiveBackend::Mpi`] this process's rank of the MPI world (collective: every
    /// process of the job calls it; `thread_ranks` is ignored, the launcher decides the size).
    pub fn launch(self, thread_ranks: usize) -> Result<Launched> {
        match self {
            CollectiveBackend::Thread => {
                if thread_ranks == 0 {
                    return Err(CollectiveError::InvalidGroup {
                        group: "threads".into(),
                        rank: 0,
                        detail: "a thread group needs at least one rank".into(),
                    });
                }
                Ok(Launched::Threads(ThreadGroup::new(thread_ranks)))
            }
            CollectiveBackend::Mpi => launch_mpi(),
        }
    }
}

#[cfg(feature = "mpi")]
fn launch_mpi() -> Result<Launched> {
    Ok(Launched::Process(Arc::new(crate::mpi::MpiGroup::world()?)))
}

#[cfg(not(feature = "mpi"))]
fn launch_mpi() -> Result<Launched> {
    Err(CollectiveError::Mpi {
        call: "launch",
        rank: 0,
        message: "this binary was built without the `mpi` feature; rebuild with `--features mpi` \
                  (needs libopenmpi-dev and libclang-dev)"
            .into(),
    })
}

impl FromStr for CollectiveBackend {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<CollectiveBackend, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "thread" | "threads" => Ok(CollectiveBackend::Thread),
            "mpi" => Ok(CollectiveBackend::Mpi),
            other => Err(format!(
                "unknown backend {other:?}; expected `thread` or `mpi`"
            )),
        }
    }
}

impl std::fmt::Display for CollectiveBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What [`CollectiveBackend::launch`] gives this process.
#[derive(Debug)]
pub enum Launched {
    /// The handles of an in-process group, one per rank thread, in rank order.
    Threads(Vec<ThreadGroup>),
    /// This process's handle of a multi-process group (it is one rank).
    Process(Arc<dyn ProcessGroup>),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_launches_threads() {
        assert_eq!(
            "thread".parse::<CollectiveBackend>(),
            Ok(CollectiveBackend::Thread)
        );
        assert_eq!(
            " MPI ".parse::<CollectiveBackend>(),
            Ok(CollectiveBackend::Mpi)
        );
        assert!("gloo"
            .parse::<CollectiveBackend>()
            .unwrap_err()
            .contains("`thread` or `mpi`"));
        match CollectiveBackend::Thread.launch(3).unwrap() {
            Launched::Threads(g) => {
                assert_eq!(g.len(), 3);
                assert_eq!(g[2].rank(), 2);
            }
            other => panic!("{other:?}"),
        }
        assert!(CollectiveBackend::Thread.launch(0).is_err());
    }

    #[cfg(not(feature = "mpi"))]
    #[test]
    fn mpi_without_the_feature_says_how_to_rebuild() {
        let e = CollectiveBackend::Mpi.launch(1).unwrap_err();
        assert!(e.to_string().contains("--features mpi"), "{e}");
    }
}
