//! Choosing a device's backend: [`Kernels::for_device`]. Its own file, above the front
//! (`front.rs`) and the backends that implement the seam, so that the front does not import the
//! backends.

use std::sync::Arc;

use fsdp_alloc::{Device, DeviceId};

use super::backend::Backend;
use super::cpu::backend::CpuBackend;
use super::cuda::CudaBackend;
use super::front::Kernels;
use crate::error::Result;

/// The CPU backend shared by every CPU device (it holds no state).
fn cpu_backend() -> Arc<dyn Backend> {
    static CPU: std::sync::OnceLock<Arc<dyn Backend>> = std::sync::OnceLock::new();
    Arc::clone(CPU.get_or_init(|| Arc::new(CpuBackend)))
}

impl Kernels {
    /// The kernels of `device`: [`CpuBackend`] for CPU devices, [`CudaBackend`] for CUDA devices
    /// (created once per device and cached).
    ///
    /// # Errors
    /// For a CUDA device: [`AutogradError::CudaNotBuilt`](crate::AutogradError::CudaNotBuilt) without the `cuda` feature, or
    /// [`AutogradError::Backend`](crate::AutogradError::Backend) if the CUDA kernels cannot be loaded (NVRTC, cuBLAS, driver).
    pub fn for_device(device: &Device) -> Result<Kernels> {
        let backend = match device.id() {
            DeviceId::Cpu(_) => cpu_backend(),
            DeviceId::Cuda(_) => CudaBackend::for_device(device)?,
        };
        Ok(Kernels::from_backend(device.id(), backend))
    }
}
