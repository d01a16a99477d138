//! The GEMM-rate probe the MFU line divides by, on the device the model trains on.
//!
//! - CPU ranks: [`crate::report::gemm_probe`], f32 on all cores (the `gemm` crate).
//! - `--device cuda`: square matmuls through the same tensor op the model uses, on this
//!   process's first GPU, built by [`crate::cuda::rank_devices`] exactly like rank 0's compute
//!   device (so a device-level setting such as TF32 applies to both), in the model's compute
//!   precision: f32 (TF32 where the device enables it), or the `--mixed-precision` dtype (bf16,
//!   f16). So the model FLOP rate is compared like with like.
//!
//! The GPU probe times 4096×4096×4096 products, launched back to back and waited for once per
//! batch of 8 (one read-back of one element), for about the budget after a warm-up batch. On
//! CUDA `main` runs it after training (unless `--plan` needs the rate first): the CUDA kernel
//! backend is cached per device id, and its first user should be the training device.

use std::time::{Duration, Instant};

use fsdp_alloc::{DType, Device, DeviceConfig};
use fsdp_autograd::Tensor;

use crate::job::TrainConfig;

/// A probe's result.
pub struct Probe {
    /// FLOP/s (2·n³ per product).
    pub flops_per_s: f64,
    /// The device it ran on: `"cpu"` or `"cuda:N"` (`gemm_probe_device` in `--json`).
    pub device: String,
    /// The precision it ran at.
    pub dtype: DType,
}

/// The probe for this run's device and precision (see the module docs).
///
/// # Errors
/// The device's or the kernels' error, as a line of text.
pub fn run(c: &TrainConfig, cores: usize, budget: Duration) -> Result<Probe, String> {
    if c.cuda.is_none() {
        return Ok(Probe {
            flops_per_s: crate::report::gemm_probe(cores, budget)?,
            device: "cpu".into(),
            dtype: DType::F32,
        });
    }
    let (dev, _host) =
        crate::cuda::rank_devices(0, c, DeviceConfig::default()).map_err(|e| e.to_string())?;
    let dtype = c.mixed_precision.unwrap_or(DType::F32);
    let flops_per_s = device_probe(&dev, dtype, 4096, budget).map_err(|e| e.to_string())?;
    Ok(Probe {
        flops_per_s,
        device: dev.id().to_string(),
        dtype,
    })
}

/// The matmul rate on `dev` at `dtype` for n×n×n products (see the module docs).
pub fn device_probe(
    dev: &Device,
    dtype: DType,
    n: usize,
    budget: Duration,
) -> fsdp_autograd::Result<f64> {
    let a = Tensor::full(&[n, n], 0.5, DType::F32, dev)?.to_dtype(dtype)?;
    let b = Tensor::full(&[n, n], 0.25, DType::F32, dev)?.to_dtype(dtype)?;
    const BATCH: u64 = 8;
    let batch = || -> fsdp_autograd::Result<()> {
        let mut last = None;
        for _ in 0..BATCH {
            last = Some(a.matmul(&b)?);
        }
        // One element read back: waits for the batch (stream order).
        if let Some(c) = last {
            c.reshape(&[n * n])?.narrow(0, 0, 1)?.to_vec_f32()?;
        }
        Ok(())
    };
    batch()?; // warm-up: kernels loaded, handles and workspace made, allocator segments cached
    let t0 = Instant::now();
    let mut reps = 0u64;
    while t0.elapsed() < budget || reps < 2 * BATCH {
        batch()?;
        reps += BATCH;
    }
    let secs = t0.elapsed().as_secs_f64();
    Ok(2.0 * (n as f64).powi(3) * reps as f64 / secs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The device probe's arithmetic on a CPU device (the GPU path runs the same code): a
    /// positive, finite rate, in each precision the model may compute in.
    #[test]
    fn device_probe_measures_a_rate_at_each_precision() {
        let dev = Device::cpu(30_000);
        for dtype in [DType::F32, DType::BF16] {
            let r = device_probe(&dev, dtype, 64, Duration::from_millis(20)).unwrap();
            assert!(r.is_finite() && r > 0.0, "{dtype}: {r}");
        }
    }
}
