//! `--device cuda`: the devices of GPU ranks and how they are laid out ([`CudaLaunch`]). The
//! ranks themselves run the one path of `train::run_job`; their groups come from
//! fsdp-collectives' `CollectiveBackend` ([`TrainConfig::backend`]).
//!
//! - `--device cuda` (`--backend thread`, the default) with at most as many ranks as visible
//!   GPUs: one process drives the GPUs, a thread per GPU; rank `r` computes on `cuda:r` and
//!   talks to the others through its own `NcclGroup` (`CollectiveBackend::NcclThreads`: the
//!   communicators rendezvous through a `TcpStore` on 127.0.0.1 hosted for rank 0). The world
//!   is `--ranks` GPUs, by default every visible one.
//! - `--device cuda --ranks W` with fewer than W visible GPUs: W thread ranks **share
//!   `cuda:0`** ([`CudaLaunch::SharedGpu`], `CollectiveBackend::SharedGpu`): each rank its own
//!   `Device` (its own caching allocator, memory statistics and streams), collectives by
//!   device-to-device copies and a rank-ordered reduction kernel (NCCL refuses two ranks on one
//!   GPU). Shard offsets, gathers into other ranks' buffers, per-rank memory and the overlap of
//!   the `--profile` timeline (a timeline per rank: `fsdp_alloc::trace::lane`) are those of a
//!   W-GPU job; communication time is not (no link is crossed). `CUDA_VISIBLE_DEVICES` picks
//!   the GPU. Limitation: fsdp-autograd caches its CUDA kernel backend per device index, so the
//!   kernels' own scratch allocations (a few KiB per launch, freed after it) of every rank come
//!   from the first rank's allocator.
//! - `--device cuda --backend nccl`: one process per GPU under a launcher (`torchrun`-style
//!   `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT`, `mpirun`, or Slurm's `srun`; read by
//!   [`RendezvousEnv`]); the process's GPU is its local rank (`CollectiveBackend::Nccl`).
//! - `--device cuda --backend mpi` under `mpirun`: one process per rank on its local rank's GPU
//!   modulo the visible GPUs (so `mpirun -n 2` on a one-GPU machine puts both on `cuda:0`),
//!   over MPI with **host staging** (fsdp-collectives' `HostStaged`, joined through
//!   `Seat::join_for`): every collective is copied to page-locked host memory on its stream,
//!   run by MPI and copied back, with one counted host wait each. Correct, not fast; across real
//!   GPUs use `--backend nccl`.
//!
//! GPU ranks keep shards, sharded gradients and optimizer state on their GPU: the optimizer,
//! gradient-norm, clipping and scaler kernels run there through the kernel seam (fsdp-core's
//! optimizers launch `Launch::AdamWStep`, `SgdStep`, `SumSquares`, … on the shard device). With
//! eager init the model is first built on a host device (eager init writes parameters with host
//! code) and FSDP copies each rank's shards onto the GPU; `--deferred-init` generates only the
//! shards. CPU offload happens only when asked (`--cpu-offload`): then the shards, sharded
//! gradients and optimizer state live on that host device and the optimizer runs there.
//!
//! CI compiles this path (`cargo check -p fsdp-train --features cuda`); without a CUDA driver
//! `--device cuda` exits with a one-line error naming what is missing. What has run on which
//! GPU is recorded in `docs/GPU-STATUS.md`, not here.

use fsdp_alloc::{AllocError, Device, DeviceConfig};
use fsdp_collectives::shared_gpu::MAX_SHARED_GPU_RANKS;
use fsdp_collectives::RendezvousEnv;

use crate::job::{CudaLaunch, TrainConfig};

/// How many CUDA devices this process sees (0 without a driver or a CUDA build).
pub fn visible_gpus() -> usize {
    (0..64).take_while(|&i| Device::cuda(i).is_ok()).count()
}

/// Opens the first GPU this process would use (a typed error, never a panic, when the build has
/// no CUDA support or there is no driver or device) and returns how many CUDA devices are
/// visible (1 for one process per GPU under NCCL, which uses only its own).
///
/// # Errors
/// [`AllocError::CudaUnavailable`] naming what is missing.
pub fn preflight(launch: CudaLaunch) -> Result<usize, AllocError> {
    if !cfg!(feature = "cuda") {
        return Err(AllocError::CudaUnavailable(format!(
            "cuda:{}: this train_gpt was built without CUDA support, so no CUDA driver was looked \
             for; rebuild it with `cargo build --release -p fsdp-train --features cuda --bin \
             train_gpt` (needs the NVIDIA driver and NCCL at run time)",
            launch.ordinal(0, 1)
        )));
    }
    match launch {
        CudaLaunch::Threads | CudaLaunch::SharedGpu | CudaLaunch::Mpi => {
            Device::cuda(0)?;
            Ok(visible_gpus())
        }
        CudaLaunch::Processes => {
            Device::cuda(launch.ordinal(0, 1))?;
            Ok(1)
        }
    }
}

/// How `--ranks` thread ranks are laid out on `gpus` visible GPUs: a thread per GPU over NCCL
/// while they fit (by default every visible GPU), else all of them sharing `cuda:0`. Pure, so
/// the rule is tested without a GPU.
///
/// # Errors
/// A usage message when the ranks would share a GPU and are more than the shared-GPU backend
/// takes.
pub fn thread_layout(gpus: usize, ranks: Option<u64>) -> Result<(CudaLaunch, usize), String> {
    match ranks {
        None => Ok((CudaLaunch::Threads, gpus)),
        Some(r) if r as usize <= gpus => Ok((CudaLaunch::Threads, r as usize)),
        Some(r) if r as usize <= MAX_SHARED_GPU_RANKS => Ok((CudaLaunch::SharedGpu, r as usize)),
        Some(r) => Err(format!(
            "--ranks {r} with {gpus} CUDA device(s) visible: ranks beyond the GPUs share cuda:0, \
             and at most {MAX_SHARED_GPU_RANKS} ranks can share one GPU; lower --ranks or launch \
             one process per GPU (--backend nccl)"
        )),
    }
}

/// The layout and world size of a CUDA run with thread ranks or NCCL processes: the launcher's
/// size for processes; for threads [`thread_layout`] on the visible GPUs. (`--backend mpi`
/// takes its size from the MPI launcher.)
///
/// # Errors
/// A usage message naming the problem.
pub fn world_size(launch: CudaLaunch, ranks: Option<u64>) -> Result<(CudaLaunch, usize), String> {
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
            Ok((launch, env.world_size))
        }
        CudaLaunch::Threads | CudaLaunch::SharedGpu | CudaLaunch::Mpi => {
            let gpus = preflight(launch).map_err(|e| format!("--device cuda: {e}"))?;
            thread_layout(gpus, ranks)
        }
    }
}

/// Rank `rank`'s compute device and its host device (ids apart from the compute devices): CPU
/// ranks get a host device only with `--cpu-offload`; CUDA ranks always get one, to build the
/// model on with eager init (see [`init_device`]), which is their offload device only with
/// `--cpu-offload` (see `train.rs`) — and then page-locked (`Device::cpu_pinned`). Every rank
/// gets its own device, also where ranks share a GPU (shared-GPU thread ranks, MPI processes
/// on one GPU): its own allocator and statistics.
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
            let visible = match launch {
                CudaLaunch::Mpi => visible_gpus(),
                _ => 1,
            };
            let gpu = Device::cuda_with(launch.ordinal(rank, visible), devices)?;
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

    #[test]
    fn more_thread_ranks_than_gpus_share_the_first_gpu() {
        assert_eq!(thread_layout(2, None), Ok((CudaLaunch::Threads, 2)));
        assert_eq!(thread_layout(2, Some(2)), Ok((CudaLaunch::Threads, 2)));
        assert_eq!(thread_layout(1, Some(1)), Ok((CudaLaunch::Threads, 1)));
        assert_eq!(thread_layout(1, Some(4)), Ok((CudaLaunch::SharedGpu, 4)));
        assert_eq!(thread_layout(2, Some(3)), Ok((CudaLaunch::SharedGpu, 3)));
        let max = MAX_SHARED_GPU_RANKS as u64;
        assert_eq!(
            thread_layout(1, Some(max)),
            Ok((CudaLaunch::SharedGpu, MAX_SHARED_GPU_RANKS))
        );
        let e = thread_layout(1, Some(max + 1)).unwrap_err();
        assert!(
            e.contains("share cuda:0") && e.contains("--backend nccl"),
            "{e}"
        );
        // Every shared-GPU rank computes on cuda:0; MPI processes on their local rank's GPU
        // modulo the visible ones (outside a launcher: the rank).
        assert_eq!(CudaLaunch::SharedGpu.ordinal(3, 1), 0);
        assert_eq!(CudaLaunch::Threads.ordinal(3, 4), 3);
        if fsdp_collectives::store::LaunchEnv::from_env().is_err() {
            assert_eq!(CudaLaunch::Mpi.ordinal(3, 2), 1);
            assert_eq!(CudaLaunch::Mpi.ordinal(3, 0), 0);
        }
    }
}
