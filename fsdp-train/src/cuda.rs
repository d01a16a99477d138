//! `--device cuda`: the same FSDP training loop on GPUs, over NCCL.
//!
//! - `--device cuda` (`--backend thread`, the default): one process drives the GPUs, a thread per
//!   GPU; rank `r` computes on `cuda:r` and talks to the others through its own `NcclGroup`
//!   (the communicators rendezvous through a `TcpStore` on 127.0.0.1 hosted by rank 0's
//!   thread). The world is `--ranks` GPUs, by default every visible one.
//! - `--device cuda --backend nccl`: one process per GPU under a launcher (`torchrun`-style
//!   `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT`, `mpirun`, or Slurm's `srun`; read by
//!   [`RendezvousEnv`]); the process's GPU is its local rank.
//!
//! GPU ranks keep shards, sharded gradients and optimizer state on their GPU: the optimizer,
//! gradient-norm, clipping and scaler kernels run there through the kernel seam (fsdp-core's
//! optimizers launch `Launch::AdamWStep`, `SgdStep`, `SumSquares`, … on the shard device). With
//! eager init the model is first built on a host device (eager init writes parameters with host
//! code) and FSDP copies each rank's shards onto the GPU; `--deferred-init` generates only the
//! shards. CPU offload happens only when asked (`--cpu-offload`): then the shards, sharded
//! gradients and optimizer state live on that host device and the optimizer runs there.

//! CI compiles this path (`cargo check -p fsdp-train --features cuda`); without a CUDA driver
//! `--device cuda` exits with a one-line error naming what is missing. On one H100 it trained
//! GPT-mini to GPT-2 (f32, TF32, bf16, CPU offload; README "GPUs"); `--backend nccl` and more
//! than one GPU have not run since the device-resident optimizer.

use std::sync::Arc;

use fsdp_alloc::{AllocError, Device, DeviceConfig};
use fsdp_collectives::{ProcessGroup, RendezvousEnv};

use crate::job::{CudaLaunch, Observer, Report, TrainConfig, TrainError};

/// Opens the first GPU this process would use (a typed error, never a panic, when the build has
/// no CUDA support or there is no driver or device) and returns how many CUDA devices are
/// visible (1 for one process per GPU, which uses only its own).
///
/// # Errors
/// [`AllocError::CudaUnavailable`] naming what is missing.
pub fn preflight(launch: CudaLaunch) -> Result<usize, AllocError> {
    if !cfg!(feature = "cuda") {
        return Err(AllocError::CudaUnavailable(format!(
            "cuda:{}: this train_gpt was built without CUDA support, so no CUDA driver was looked \
             for; rebuild it with `cargo build --release -p fsdp-train --features cuda --bin \
             train_gpt` (needs the NVIDIA driver and NCCL at run time)",
            launch.ordinal(0)
        )));
    }
    match launch {
        CudaLaunch::Threads => {
            Device::cuda(0)?;
            Ok(1 + (1..64).take_while(|&i| Device::cuda(i).is_ok()).count())
        }
        CudaLaunch::Processes => {
            Device::cuda(launch.ordinal(0))?;
            Ok(1)
        }
    }
}

/// The world size of a CUDA run: the launcher's for processes; for threads `--ranks` (at most
/// the visible GPUs: NCCL allows one rank per GPU in a communicator), by default every visible
/// GPU.
///
/// # Errors
/// A usage message naming the problem.
pub fn world_size(launch: CudaLaunch, ranks: Option<u64>) -> Result<usize, String> {
    match launch {
        CudaLaunch::Processes => {
            let env = RendezvousEnv::from_env().map_err(|e| {
                format!(
                    "--backend nccl: not launched by torchrun, mpirun or srun ({e}); set RANK, \
                     WORLD_SIZE, MASTER_ADDR and MASTER_PORT or use a launcher"
                )
            })?;
            if ranks.is_some_and(|r| r as usize != env.world_size) {
                return Err(format!(
                    "--ranks {} disagrees with the launcher's world size {}; drop --ranks",
                    ranks.unwrap_or(0),
                    env.world_size
                ));
            }
            Ok(env.world_size)
        }
        CudaLaunch::Threads => {
            let gpus = preflight(launch).map_err(|e| format!("--device cuda: {e}"))?;
            match ranks {
                None => Ok(gpus),
                Some(r) if r as usize <= gpus => Ok(r as usize),
                Some(r) => Err(format!(
                    "--ranks {r} but only {gpus} CUDA device(s) are visible: a thread rank per \
                     GPU; lower --ranks or launch one process per GPU (--backend nccl)"
                )),
            }
        }
    }
}

/// Rank `rank`'s compute device and its host device (ids apart from the compute devices): CPU
/// ranks get a host device only with `--cpu-offload`; CUDA ranks always get one, to build the
/// model on with eager init (see [`init_device`]), which is their offload device only with
/// `--cpu-offload` (see `train.rs`) — and then page-locked (`Device::cpu_pinned`).
///
/// # Errors
/// The device's error (no CUDA support, no driver, a bad ordinal).
pub fn rank_devices(
    rank: usize,
    cfg: &TrainConfig,
    devices: DeviceConfig,
) -> Result<(Device, Option<Device>), AllocError> {
    let host = || Device::cpu_with(10_000 + rank, devices);
    match cfg.cuda {
        None => Ok((Device::cpu_with(rank, devices), cfg.cpu_offload.then(host))),
        Some(launch) => {
            let gpu = Device::cuda_with(launch.ordinal(rank), devices)?;
            // Offloaded shards and gradients go back and forth every step: page-locked memory,
            // so the copies are asynchronous (fsdp-core's offload copy stream).
            let host = if cfg.cpu_offload {
                Device::cpu_pinned(10_000 + rank, devices, &gpu)?
            } else {
                host()
            };
            Ok((gpu, Some(host)))
        }
    }
}

/// The device eager init builds the model on: the compute device, except for CUDA ranks, whose
/// model is built on their host device (eager init writes parameters with host code, which
/// fsdp-autograd refuses on device memory; FSDP copies the shards from there).
pub fn init_device<'a>(cfg: &TrainConfig, dev: &'a Device, host: Option<&'a Device>) -> &'a Device {
    match (cfg.cuda, host) {
        (Some(_), Some(h)) => h,
        _ => dev,
    }
}

/// What one rank runs once its group exists: build the model, wrap it and train.
pub type RunRank<'a> = dyn Fn(usize, Arc<dyn ProcessGroup>, Box<dyn Observer>) -> Result<Report, TrainError>
    + Sync
    + 'a;

#[cfg(feature = "cuda")]
mod imp {
    use std::time::Duration;

    use fsdp_collectives::{CollectiveError, NcclConfig, NcclGroup, TcpStore};
    use fsdp_core::FsdpError;

    use super::{
        Arc, CudaLaunch, Observer, RendezvousEnv, Report, RunRank, TrainConfig, TrainError,
    };
    use crate::job::Quiet;

    /// Bound on the rendezvous and on every collective.
    const TIMEOUT: Duration = Duration::from_secs(600);

    /// The first error that is not another rank's echo ([`TrainError::PeerFailed`]).
    fn first_cause(mut errors: Vec<TrainError>) -> TrainError {
        let pos = errors
            .iter()
            .position(|e| !matches!(e, TrainError::PeerFailed { .. }))
            .unwrap_or(0);
        errors.swap_remove(pos)
    }

    fn coll_err(rank: usize, context: &str) -> impl FnOnce(CollectiveError) -> TrainError {
        let context = context.to_string();
        move |e| TrainError::Fsdp {
            rank,
            context,
            source: Box::new(FsdpError::from(e)),
        }
    }

    /// Runs the job (see the module docs); rank 0 feeds `observer`.
    pub fn run_job(
        cfg: &TrainConfig,
        launch: CudaLaunch,
        observer: Box<dyn Observer>,
        run_rank: &RunRank<'_>,
    ) -> Result<Report, TrainError> {
        match launch {
            CudaLaunch::Processes => {
                let env = RendezvousEnv::from_env().map_err(coll_err(0, "reading the launch"))?;
                let rank = env.rank;
                let store = TcpStore::rendezvous(&env, TIMEOUT)
                    .map_err(coll_err(rank, "rendezvous (MASTER_ADDR:MASTER_PORT)"))?;
                let config = NcclConfig {
                    timeout: TIMEOUT,
                    ..NcclConfig::new(launch.ordinal(rank))
                };
                let g = NcclGroup::new(&store, rank, env.world_size, config)
                    .map_err(coll_err(rank, "creating the NCCL communicator"))?;
                let obs = if rank == 0 { observer } else { Box::new(Quiet) };
                let report = run_rank(rank, Arc::new(g), obs);
                // Rank 0 hosts the store: keep it until this rank is done.
                drop(store);
                report
            }
            CudaLaunch::Threads => {
                let world = cfg.ranks;
                let store = TcpStore::host("127.0.0.1:0", TIMEOUT)
                    .map_err(coll_err(0, "hosting the NCCL rendezvous store"))?;
                let addr = store.addr().to_string();
                let mut observer = Some(observer);
                let results: Vec<Result<Report, TrainError>> = std::thread::scope(|s| {
                    let handles: Vec<_> = (0..world)
                        .map(|rank| {
                            let obs = if rank == 0 { observer.take() } else { None };
                            let (store, addr) = (&store, addr.clone());
                            std::thread::Builder::new()
                                .name(format!("gpu-rank{rank}"))
                                .spawn_scoped(s, move || {
                                    let own;
                                    let st: &TcpStore = if rank == 0 {
                                        store
                                    } else {
                                        own = TcpStore::connect(&addr, TIMEOUT).map_err(
                                            coll_err(rank, "connecting to the rendezvous store"),
                                        )?;
                                        &own
                                    };
                                    let g = NcclGroup::new(st, rank, world, NcclConfig::new(rank))
                                        .map_err(coll_err(
                                            rank,
                                            "creating the NCCL communicator",
                                        ))?;
                                    run_rank(rank, Arc::new(g), obs.unwrap_or(Box::new(Quiet)))
                                })
                        })
                        .collect();
                    handles
                        .into_iter()
                        .enumerate()
                        .map(|(r, h)| match h {
                            Err(e) => Err(TrainError::Thread(format!("spawning rank {r}: {e}"))),
                            Ok(h) => h.join().unwrap_or_else(|_| {
                                Err(TrainError::Thread(format!("GPU rank {r} panicked")))
                            }),
                        })
                        .collect()
                });
                let mut report = None;
                let mut errors = Vec::new();
                for (r, res) in results.into_iter().enumerate() {
                    match res {
                        Ok(rep) if r == 0 => report = Some(rep),
                        Ok(_) => {}
                        Err(e) => errors.push(e),
                    }
                }
                if !errors.is_empty() {
                    return Err(first_cause(errors));
                }
                report.ok_or_else(|| TrainError::Thread("rank 0 returned no report".into()))
            }
        }
    }
}

#[cfg(feature = "cuda")]
pub use imp::run_job;

/// Without the `cuda` feature `--device cuda` stops at [`preflight`]; this is never reached.
#[cfg(not(feature = "cuda"))]
pub fn run_job(
    _cfg: &TrainConfig,
    _launch: CudaLaunch,
    _observer: Box<dyn Observer>,
    _run_rank: &RunRank<'_>,
) -> Result<Report, TrainError> {
    Err(TrainError::Thread(
        "--device cuda: this binary was built without the `cuda` feature; rebuild with \
         `-p fsdp-train --features cuda`"
            .into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_gpu_cuda_runs_are_typed_errors() {
        // No CUDA driver here (or a build without CUDA): the preflight names what is missing.
        if let Err(e) = preflight(CudaLaunch::Threads) {
            assert!(matches!(e, AllocError::CudaUnavailable(_)), "{e}");
            assert!(e.to_string().contains("cuda:0"), "{e}");
            assert!(world_size(CudaLaunch::Threads, None)
                .unwrap_err()
                .starts_with("--device cuda: "));
        }
    }
}
