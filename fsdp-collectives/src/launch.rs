//! One launch path: given a backend choice, this process's ranks and how each joins its group.
//!
//! [`CollectiveBackend::launch`] returns [`Launched`]: one [`Seat`] per rank this process runs
//! (W for the in-process backends, one for the process-per-rank backends) and what the seats
//! share (a rendezvous store, kept until [`Launched`] is dropped). Each rank calls
//! [`Seat::join`] **on its own thread** and gets its `Arc<dyn ProcessGroup>`: creating NCCL
//! communicators is collective, so the ranks of one process must join concurrently.
//!
//! - [`CollectiveBackend::Thread`]: W ranks as W threads of this process, the handles of one
//!   [`ThreadGroup`].
//! - [`CollectiveBackend::Mpi`]: one rank per process, started by an MPI launcher (`mpirun -n W
//!   …`, `srun --mpi=pmix …`); rank and world size come from MPI itself. Needs the `mpi`
//!   feature.
//! - [`CollectiveBackend::NcclThreads`]: W ranks as W threads of this process, rank `r` on GPU
//!   `r`, each with its own `NcclGroup`; the communicators rendezvous through a [`TcpStore`]
//!   on 127.0.0.1 (rank 0 uses the hosting store, the others connect to it). Needs `cuda`.
//! - [`CollectiveBackend::Nccl`]: one rank per process under a launcher (torchrun-style
//!   `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT`, `mpirun` or `srun`; read by
//!   [`crate::RendezvousEnv`]), on GPU [`crate::RendezvousEnv::device_ordinal`]. Needs `cuda`.
//! - [`CollectiveBackend::SharedGpu`]: W ranks as W threads of this process whose devices are
//!   **one** GPU (NCCL refuses that), the handles of one [`SharedGpuGroup`]: collectives move
//!   through the GPU's memory, so a W-rank job runs on the one GPU at hand (link speeds are not
//!   modelled). Needs `cuda`.
//!
//! **Device buffers on a host backend.** The thread and MPI backends run their collectives on
//! host threads. A rank that computes on a GPU with one of them (`mpirun -n 2 train_gpt
//! --backend mpi --device cuda`: processes sharing a GPU) joins with [`Seat::join_for`], which
//! wraps the group in [`HostStaged`]: each collective is copied to page-locked host memory,
//! run there and copied back, in the order of the stream it is issued on.
//!
//! A backend whose feature is off is still a choice: its launch is a typed error that says how
//! to rebuild. Adding a backend is a variant (with its [`CollectiveBackend::name`] and
//! [`CollectiveBackend::in_process`]) and its arm in [`CollectiveBackend::launch`] (the seats
//! it makes; a new way of joining is a case of the private `Join` beside [`Seat`]).

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use fsdp_alloc::{Device, DeviceConfig, DeviceId};

use crate::error::{CollectiveError, Result};
use crate::group::ProcessGroup;
use crate::shared_gpu::SharedGpuGroup;
use crate::staged::HostStaged;
use crate::store::TcpStore;
use crate::thread::ThreadGroup;

/// Bound on an NCCL rendezvous (the store and the communicator creation) and on every NCCL
/// collective of a launched group: 10 minutes.
pub const LAUNCH_TIMEOUT: Duration = Duration::from_secs(600);

/// Which collective backend a program runs on. Not to be confused with fsdp-autograd's
/// `Backend` (the kernel trait).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CollectiveBackend {
    /// W ranks as W threads of this process ([`ThreadGroup`]); the default.
    #[default]
    Thread,
    /// One rank per process over MPI (`MpiGroup`, feature `mpi`).
    Mpi,
    /// W ranks as W threads of this process, a GPU and an `NcclGroup` each (feature `cuda`).
    NcclThreads,
    /// One rank per process under a launcher, over NCCL (`NcclGroup`, feature `cuda`).
    Nccl,
    /// W ranks as W threads of this process sharing GPU `ordinal` ([`SharedGpuGroup`], feature
    /// `cuda`); parsed from `shared-gpu` (GPU 0).
    SharedGpu {
        /// The GPU every rank computes on.
        ordinal: usize,
    },
}

impl CollectiveBackend {
    /// Every backend, in the order of the docs (the shared-GPU one on GPU 0).
    pub const ALL: [CollectiveBackend; 5] = [
        CollectiveBackend::Thread,
        CollectiveBackend::Mpi,
        CollectiveBackend::NcclThreads,
        CollectiveBackend::Nccl,
        CollectiveBackend::SharedGpu { ordinal: 0 },
    ];

    /// The name used on command lines and in messages.
    pub const fn name(self) -> &'static str {
        match self {
            CollectiveBackend::Thread => "thread",
            CollectiveBackend::Mpi => "mpi",
            CollectiveBackend::NcclThreads => "nccl-threads",
            CollectiveBackend::Nccl => "nccl",
            CollectiveBackend::SharedGpu { .. } => "shared-gpu",
        }
    }

    /// Whether the backend's collectives run on host threads over host memory (thread, MPI):
    /// ranks computing on a GPU join such a group through host staging
    /// ([`Seat::join_for`]).
    pub const fn host_only(self) -> bool {
        matches!(self, CollectiveBackend::Thread | CollectiveBackend::Mpi)
    }

    /// Whether all ranks are threads of this process (their seats are joined on threads the
    /// caller spawns); otherwise this process is one rank of a multi-process job.
    pub const fn in_process(self) -> bool {
        match self {
            CollectiveBackend::Thread
            | CollectiveBackend::NcclThreads
            | CollectiveBackend::SharedGpu { .. } => true,
            CollectiveBackend::Mpi | CollectiveBackend::Nccl => false,
        }
    }

    /// This process's seats: for the in-process backends `thread_ranks` of them (ranks
    /// `0..thread_ranks`); for the process-per-rank backends this process's one rank of the
    /// launcher's world (collective: every process of the job calls it; `thread_ranks` is
    /// ignored, the launcher decides the size). NCCL waits at most [`LAUNCH_TIMEOUT`].
    ///
    /// # Errors
    /// No rank ([`CollectiveError::InvalidGroup`]); a backend whose feature is off (a typed
    /// error saying how to rebuild); the launcher's environment, the rendezvous store, MPI;
    /// for the shared-GPU backend no CUDA driver, device or NVRTC
    /// ([`CollectiveError::CudaUnavailable`]) or more than
    /// [`MAX_SHARED_GPU_RANKS`](crate::shared_gpu::MAX_SHARED_GPU_RANKS) ranks.
    pub fn launch(self, thread_ranks: usize) -> Result<Launched> {
        if self.in_process() && thread_ranks == 0 {
            return Err(CollectiveError::InvalidGroup {
                group: self.name().into(),
                rank: 0,
                detail: "an in-process group needs at least one rank".into(),
            });
        }
        match self {
            CollectiveBackend::Thread => {
                let seats = ThreadGroup::new(thread_ranks)
                    .into_iter()
                    .enumerate()
                    .map(|(rank, g)| Seat::ready(self, rank, thread_ranks, Arc::new(g)))
                    .collect();
                Ok(Launched::new(self, seats, None))
            }
            CollectiveBackend::Mpi => {
                let g = launch_mpi()?;
                let seat = Seat::ready(self, g.rank(), g.size(), g);
                Ok(Launched::new(self, vec![seat], None))
            }
            CollectiveBackend::NcclThreads => nccl::threads(thread_ranks),
            CollectiveBackend::Nccl => nccl::process(),
            CollectiveBackend::SharedGpu { ordinal } => {
                let seats = SharedGpuGroup::new(thread_ranks, ordinal)?
                    .into_iter()
                    .enumerate()
                    .map(|(rank, g)| Seat::ready(self, rank, thread_ranks, Arc::new(g)))
                    .collect();
                Ok(Launched::new(self, seats, None))
            }
        }
    }
}

#[cfg(feature = "mpi")]
fn launch_mpi() -> Result<Arc<dyn ProcessGroup>> {
    Ok(Arc::new(crate::mpi::MpiGroup::world()?))
}

#[cfg(not(feature = "mpi"))]
fn launch_mpi() -> Result<Arc<dyn ProcessGroup>> {
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
        let s = s.trim().to_ascii_lowercase();
        match s.as_str() {
            "threads" => return Ok(CollectiveBackend::Thread),
            "shared-gpu" => return Ok(CollectiveBackend::SharedGpu { ordinal: 0 }),
            _ => {}
        }
        CollectiveBackend::ALL
            .into_iter()
            .find(|b| b.name() == s)
            .ok_or_else(|| {
                let names: Vec<String> = CollectiveBackend::ALL
                    .iter()
                    .map(|b| format!("`{}`", b.name()))
                    .collect();
                format!("unknown backend {s:?}; expected {}", names.join(", "))
            })
    }
}

impl std::fmt::Display for CollectiveBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What [`CollectiveBackend::launch`] gives this process: its ranks' seats and what they
/// share. Keep it until every rank of this process is done (it holds the rendezvous store
/// that rank 0 hosts).
pub struct Launched {
    backend: CollectiveBackend,
    seats: Vec<Seat>,
    /// The rendezvous store the seats share, if any.
    _store: Option<Arc<TcpStore>>,
}

impl std::fmt::Debug for Launched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Launched")
            .field("backend", &self.backend)
            .field("seats", &self.seats)
            .finish()
    }
}

impl Launched {
    fn new(backend: CollectiveBackend, seats: Vec<Seat>, store: Option<Arc<TcpStore>>) -> Self {
        Launched {
            backend,
            seats,
            _store: store,
        }
    }

    /// The backend launched.
    pub fn backend(&self) -> CollectiveBackend {
        self.backend
    }

    /// The seats not taken yet, in rank order.
    pub fn seats(&self) -> &[Seat] {
        &self.seats
    }

    /// Takes the seats (in rank order) to hand each to its rank's thread; `self` stays alive
    /// for what they share.
    pub fn take_seats(&mut self) -> Vec<Seat> {
        std::mem::take(&mut self.seats)
    }
}

/// One rank's place in a launched job: its rank, the world size and how it joins the group.
pub struct Seat {
    backend: CollectiveBackend,
    rank: usize,
    world: usize,
    join: Join,
}

/// The environment variable that makes [`Seat::join_for`] stage CPU ranks through host memory
/// too (`FSDP_HOST_STAGING=1`): the host-staging path of GPU ranks, exercised on CPU devices
/// (`cargo xtask mpi-test`).
pub const HOST_STAGING_ENV: &str = "FSDP_HOST_STAGING";

/// CPU device index base of the staging devices [`Seat::join_for`] makes (index base + rank).
pub const STAGING_DEVICE_BASE: usize = 20_000;

/// How a seat becomes a group.
enum Join {
    /// The group exists (thread and MPI backends).
    Ready(Arc<dyn ProcessGroup>),
    /// An NCCL communicator, created collectively on the rank's own thread.
    #[cfg(feature = "cuda")]
    Nccl(nccl::Pending),
}

impl std::fmt::Debug for Seat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seat")
            .field("backend", &self.backend)
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

impl Seat {
    fn ready(
        backend: CollectiveBackend,
        rank: usize,
        world: usize,
        group: Arc<dyn ProcessGroup>,
    ) -> Seat {
        Seat {
            backend,
            rank,
            world,
            join: Join::Ready(group),
        }
    }

    /// This seat's rank in the world.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The world size.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The backend this seat joins.
    pub fn backend(&self) -> CollectiveBackend {
        self.backend
    }

    /// Whether [`Seat::join_for`] on `device` stages the collectives through host memory: a
    /// host backend (thread, MPI) with a GPU `device`, or any device with
    /// `FSDP_HOST_STAGING=1` ([`HOST_STAGING_ENV`]).
    pub fn stages_for(&self, device: &Device) -> bool {
        self.backend.host_only()
            && (matches!(device.id(), DeviceId::Cuda(_))
                || std::env::var(HOST_STAGING_ENV).is_ok_and(|v| v.trim() == "1"))
    }

    /// The rank's group for computing on `device`, on the thread that runs the rank: as
    /// [`Seat::join`], but where the backend's collectives run on host threads (thread, MPI)
    /// and `device` is a GPU ([`Seat::stages_for`]) the group is wrapped in [`HostStaged`]
    /// with a page-locked staging device for `device` (`Device::cpu_pinned`, CPU index
    /// [`STAGING_DEVICE_BASE`] + rank; a plain CPU device for CPU ranks under
    /// `FSDP_HOST_STAGING=1`).
    ///
    /// # Errors
    /// As [`Seat::join`]; the staging device (page-locked memory needs the GPU's driver).
    pub fn join_for(self, device: &Device) -> Result<Arc<dyn ProcessGroup>> {
        let stage = self.stages_for(device);
        let (rank, config) = (self.rank, DeviceConfig::default());
        let group = self.join()?;
        if !stage {
            return Ok(group);
        }
        let index = STAGING_DEVICE_BASE + rank;
        let staging = match device.id() {
            DeviceId::Cuda(_) => Device::cpu_pinned(index, config, device).map_err(|e| {
                CollectiveError::CudaUnavailable(format!(
                    "host staging for {}: page-locked staging memory: {e}",
                    device.id()
                ))
            })?,
            DeviceId::Cpu(_) => Device::cpu_with(index, config),
        };
        Ok(Arc::new(HostStaged::new(group, staging)?))
    }

    /// The rank's group. Call it on the thread that runs the rank: for NCCL this creates the
    /// communicator, which waits until every rank of the world joins.
    ///
    /// # Errors
    /// NCCL: the rendezvous store, the communicator creation (each bounded by
    /// [`LAUNCH_TIMEOUT`]).
    pub fn join(self) -> Result<Arc<dyn ProcessGroup>> {
        match self.join {
            Join::Ready(g) => Ok(g),
            #[cfg(feature = "cuda")]
            Join::Nccl(p) => p.join(self.rank, self.world),
        }
    }
}

/// The NCCL arms of the launch (feature `cuda`).
#[cfg(feature = "cuda")]
mod nccl {
    use std::sync::Arc;

    use super::{CollectiveBackend, Join, Launched, Seat, LAUNCH_TIMEOUT};
    use crate::error::Result;
    use crate::group::ProcessGroup;
    use crate::nccl::{NcclConfig, NcclGroup};
    use crate::store::{RendezvousEnv, TcpStore};

    /// An NCCL seat before its communicator exists.
    pub(super) struct Pending {
        store: Store,
        ordinal: usize,
    }

    /// The rendezvous store a seat uses.
    enum Store {
        /// The hosting store (rank 0 of a threads launch) or this process's rendezvous.
        Shared(Arc<TcpStore>),
        /// Connect to this address on the rank's thread.
        Connect(String),
    }

    impl Pending {
        pub(super) fn join(self, rank: usize, world: usize) -> Result<Arc<dyn ProcessGroup>> {
            let own;
            let store: &TcpStore = match &self.store {
                Store::Shared(s) => s,
                Store::Connect(addr) => {
                    own = TcpStore::connect(addr, LAUNCH_TIMEOUT)?;
                    &own
                }
            };
            let config = NcclConfig {
                timeout: LAUNCH_TIMEOUT,
                ..NcclConfig::new(self.ordinal)
            };
            Ok(Arc::new(NcclGroup::new(store, rank, world, config)?))
        }
    }

    fn seat(
        backend: CollectiveBackend,
        rank: usize,
        world: usize,
        store: Store,
        ordinal: usize,
    ) -> Seat {
        Seat {
            backend,
            rank,
            world,
            join: Join::Nccl(Pending { store, ordinal }),
        }
    }

    /// `world` thread ranks, rank `r` on GPU `r`, meeting at a store on 127.0.0.1.
    pub(super) fn threads(world: usize) -> Result<Launched> {
        let store = Arc::new(TcpStore::host("127.0.0.1:0", LAUNCH_TIMEOUT)?);
        let addr = store.addr().to_string();
        let seats = (0..world)
            .map(|rank| {
                let s = match rank {
                    0 => Store::Shared(Arc::clone(&store)),
                    _ => Store::Connect(addr.clone()),
                };
                seat(CollectiveBackend::NcclThreads, rank, world, s, rank)
            })
            .collect();
        Ok(Launched::new(
            CollectiveBackend::NcclThreads,
            seats,
            Some(store),
        ))
    }

    /// This process's rank of a launcher's job.
    pub(super) fn process() -> Result<Launched> {
        let env = RendezvousEnv::from_env()?;
        let store = Arc::new(TcpStore::rendezvous(&env, LAUNCH_TIMEOUT)?);
        let s = seat(
            CollectiveBackend::Nccl,
            env.rank,
            env.world_size,
            Store::Shared(Arc::clone(&store)),
            env.device_ordinal(),
        );
        Ok(Launched::new(CollectiveBackend::Nccl, vec![s], Some(store)))
    }
}

/// Without the `cuda` feature the NCCL backends are typed errors.
#[cfg(not(feature = "cuda"))]
mod nccl {
    use super::Launched;
    use crate::error::{CollectiveError, Result};

    fn unavailable() -> CollectiveError {
        CollectiveError::CudaUnavailable(
            "this binary was built without the `cuda` feature, so there is no NCCL; rebuild \
             with `--features cuda` (needs the NVIDIA driver and NCCL at run time)"
                .into(),
        )
    }

    pub(super) fn threads(_world: usize) -> Result<Launched> {
        Err(unavailable())
    }

    pub(super) fn process() -> Result<Launched> {
        Err(unavailable())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_name() {
        for b in CollectiveBackend::ALL {
            assert_eq!(b.name().parse::<CollectiveBackend>(), Ok(b));
            assert_eq!(b.to_string(), b.name());
        }
        assert_eq!(
            " MPI ".parse::<CollectiveBackend>(),
            Ok(CollectiveBackend::Mpi)
        );
        assert_eq!(
            "threads".parse::<CollectiveBackend>(),
            Ok(CollectiveBackend::Thread)
        );
        let e = "gloo".parse::<CollectiveBackend>().unwrap_err();
        assert!(e.contains("`thread`") && e.contains("`nccl`"), "{e}");
    }

    #[test]
    fn thread_seats_join_one_group_in_rank_order() {
        let mut l = CollectiveBackend::Thread.launch(3).unwrap();
        assert_eq!(l.backend(), CollectiveBackend::Thread);
        let seats = l.take_seats();
        assert!(l.seats().is_empty());
        assert_eq!(seats.len(), 3);
        for (r, s) in seats.into_iter().enumerate() {
            assert_eq!((s.rank(), s.world_size()), (r, 3));
            let g = s.join().unwrap();
            assert_eq!((g.rank(), g.size()), (r, 3));
        }
        assert!(CollectiveBackend::Thread.launch(0).is_err());
        assert!(CollectiveBackend::NcclThreads.launch(0).is_err());
        assert!(CollectiveBackend::SharedGpu { ordinal: 0 }
            .launch(0)
            .is_err());
    }

    #[test]
    fn shared_gpu_is_an_in_process_device_backend() {
        let b = CollectiveBackend::SharedGpu { ordinal: 0 };
        assert_eq!(b.name(), "shared-gpu");
        assert_eq!("Shared-GPU".parse::<CollectiveBackend>(), Ok(b));
        assert!(b.in_process() && !b.host_only());
        for (b, host) in [
            (CollectiveBackend::Thread, true),
            (CollectiveBackend::Mpi, true),
            (CollectiveBackend::NcclThreads, false),
            (CollectiveBackend::Nccl, false),
        ] {
            assert_eq!(b.host_only(), host, "{b}");
        }
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn shared_gpu_without_cuda_is_a_typed_error() {
        let e = CollectiveBackend::SharedGpu { ordinal: 0 }
            .launch(2)
            .unwrap_err();
        assert!(
            matches!(e, CollectiveError::CudaUnavailable(_)) && e.to_string().contains("cuda:0"),
            "{e}"
        );
    }

    #[test]
    fn cpu_seats_join_unstaged_unless_asked() {
        // FSDP_HOST_STAGING is not set by the test harness: CPU ranks get the plain group.
        if std::env::var(HOST_STAGING_ENV).is_ok() {
            return;
        }
        let mut l = CollectiveBackend::Thread.launch(2).unwrap();
        let dev = Device::cpu(0);
        for s in l.take_seats() {
            assert!(!s.stages_for(&dev));
            assert_eq!(s.backend(), CollectiveBackend::Thread);
            let g = s.join_for(&dev).unwrap();
            assert!(!g.name().contains("host-staged"), "{}", g.name());
        }
    }

    #[cfg(not(feature = "mpi"))]
    #[test]
    fn mpi_without_the_feature_says_how_to_rebuild() {
        let e = CollectiveBackend::Mpi.launch(1).unwrap_err();
        assert!(e.to_string().contains("--features mpi"), "{e}");
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn nccl_without_the_feature_says_how_to_rebuild() {
        for b in [CollectiveBackend::NcclThreads, CollectiveBackend::Nccl] {
            let e = b.launch(2).unwrap_err();
            assert!(
                matches!(e, CollectiveError::CudaUnavailable(_))
                    && e.to_string().contains("--features cuda"),
                "{e}"
            );
        }
    }
}
