//! `--device cuda`: the devices of GPU ranks. The ranks themselves run the one path of
//! `train::run_job`; their NCCL groups come from fsdp-collectives' `CollectiveBackend`
//! ([`TrainConfig::backend`]).
//!
//! - `--device cuda` (`--backend thread`, the default): one process drives the GPUs, a thread per
//!   GPU; rank `r` computes on `cuda:r` and talks to the others through its own `NcclGroup`
//!   (`CollectiveBackend::NcclThreads`: the communicators rendezvous through a `TcpStore` on
//!   127.0.0.1 hosted for rank 0). The world is `--ranks` GPUs, by default every visible one.
//! - `--device cuda --backend nccl`: one process per GPU under a launcher (`torchrun`-style
//!   `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT`, `mpirun`, or Slurm's `srun`; read by
//!   [`RendezvousEnv`]); the process's GPU is its local rank (`CollectiveBackend::Nccl`).
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
use fsdp_collectives::RendezvousEnv;

use crate::job::{CudaLaunch, TrainConfig};

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
