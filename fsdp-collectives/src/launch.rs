//! One launch path: given a backend choice, the group(s) this process runs.
//!
//! - [`Backend::Thread`]: every rank is a thread of this process; [`Backend::launch`] returns
//!   the W handles of one [`ThreadGroup`] (hand one to each rank thread).
//! - [`Backend::Mpi`]: one rank per process, started by an MPI launcher (`mpirun -n W …`,
//!   `srun --mpi=pmix …`); rank and world size come from MPI itself. Needs the `mpi` feature;
//!   without it the choice is a typed error that says how to rebuild.
//!
//! (NCCL groups need a device and a rendezvous store: see `NcclGroup::from_env`.)

use std::str::FromStr;
use std::sync::Arc;

use crate::error::{CollectiveError, Result};
use crate::group::ProcessGroup;
use crate::thread::ThreadGroup;

/// Which data backend a program runs on (`--backend thread|mpi`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// W ranks as W threads of this process ([`ThreadGroup`]); the default.
    #[default]
    Thread,
    /// One rank per process over MPI (`MpiGroup`, feature `mpi`).
    Mpi,
}

impl Backend {
    /// The name used on command lines.
    pub const fn name(self) -> &'static str {
        match self {
            Backend::Thread => "thread",
            Backend::Mpi => "mpi",
        }
    }

    /// This process's group(s): for [`Backend::Thread`] the `thread_ranks` handles of a new
    /// thread group; for [`Backend::Mpi`] this process's rank of the MPI world (collective: every
    /// process of the job calls it; `thread_ranks` is ignored, the launcher decides the size).
    pub fn launch(self, thread_ranks: usize) -> Result<Launched> {
        match self {
            Backend::Thread => {
                if thread_ranks == 0 {
                    return Err(CollectiveError::InvalidGroup {
                        group: "threads".into(),
                        rank: 0,
                        detail: "a thread group needs at least one rank".into(),
                    });
                }
                Ok(Launched::Threads(ThreadGroup::new(thread_ranks)))
            }
            Backend::Mpi => launch_mpi(),
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

impl FromStr for Backend {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Backend, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "thread" | "threads" => Ok(Backend::Thread),
            "mpi" => Ok(Backend::Mpi),
            other => Err(format!(
                "unknown backend {other:?}; expected `thread` or `mpi`"
            )),
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What [`Backend::launch`] gives this process.
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
        assert_eq!("thread".parse::<Backend>(), Ok(Backend::Thread));
        assert_eq!(" MPI ".parse::<Backend>(), Ok(Backend::Mpi));
        assert!("gloo"
            .parse::<Backend>()
            .unwrap_err()
            .contains("`thread` or `mpi`"));
        match Backend::Thread.launch(3).unwrap() {
            Launched::Threads(g) => {
                assert_eq!(g.len(), 3);
                assert_eq!(g[2].rank(), 2);
            }
            other => panic!("{other:?}"),
        }
        assert!(Backend::Thread.launch(0).is_err());
    }

    #[cfg(not(feature = "mpi"))]
    #[test]
    fn mpi_without_the_feature_says_how_to_rebuild() {
        let e = Backend::Mpi.launch(1).unwrap_err();
        assert!(e.to_string().contains("--features mpi"), "{e}");
    }
}
