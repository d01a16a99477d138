//! The GEMM-rate probe the MFU line divides by, on the device the model trains on.
//!
//! - CPU ranks: [`cpu_gemm_probe`], f32 on all cores (the `gemm` crate).
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
//!
//! [`reference_limit`] is the honest limit beside it: the f32 GEMM rate of an independent,
//! well-tuned BLAS on this machine (OpenBLAS's `cblas_sgemm`, loaded at run time, its kernels
//! matched to the CPU kernels' instruction-set level; `fsdp_autograd::kernels::cpu::
//! ReferenceGemm`), for CPU runs: the summary's `reference` line and `--json`'s
//! `gemm_reference_flops_per_s` / `model_flops_over_reference_gemm` ([`ReferenceProbe`]). Where
//! the library is missing they say why instead of a rate (`null` + `gemm_reference_note`), and
//! training is unaffected. `main` calls [`load_reference`] right after parsing the command line,
//! before any thread starts (loading OpenBLAS sets `OPENBLAS_CORETYPE` for the duration of the
//! load), and measures after training, in the reporting process only: the machine is then quiet
//! (the ranks' threads, or under MPI the other processes, are done), and training never waits
//! for it.

use std::time::{Duration, Instant};

use fsdp_alloc::{DType, Device, DeviceConfig};
use fsdp_autograd::kernels::cpu::{cpu_isa, CpuIsa, ReferenceGemm};
use fsdp_autograd::Tensor;
use serde_json::{json, Value};

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
            flops_per_s: cpu_gemm_probe(cores, budget)?,
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

/// The reference GEMM's result (see the module docs).
#[derive(Debug, Clone)]
pub struct ReferenceProbe {
    /// The machine's f32 GEMM limit through the reference, FLOP/s on 1024×1024×1024 products
    /// (2·n³ FLOPs): the highest of one call on all cores, one concurrent 1-thread call per
    /// core, and every core at the rate of one 1-thread call measured on thread CPU time (so
    /// neither a library's thread scaling nor other processes lower it). `None` where not
    /// measured.
    pub flops_per_s: Option<f64>,
    /// The library, its version and kernels (`gemm_reference` in `--json`).
    pub library: Option<String>,
    /// Why there is no rate (`gemm_reference_note` in `--json`).
    pub note: Option<String>,
    /// The CPU kernels' instruction-set level in this process (`cpu_isa` in `--json`).
    pub cpu_isa: CpuIsa,
}

impl ReferenceProbe {
    /// `model_flops_per_s` over the reference rate (`model_flops_over_reference_gemm`), if
    /// there is one.
    pub fn fraction(&self, model_flops_per_s: f64) -> Option<f64> {
        self.flops_per_s
            .filter(|r| *r > 0.0)
            .map(|r| model_flops_per_s / r)
    }

    /// The summary line, e.g. `reference  178.42 GFLOP/s model FLOPs vs 471.03 GFLOP/s f32 GEMM
    /// of OpenBLAS 0.3.21 (SkylakeX kernels, libopenblas.so.0) on all cores (38%); CPU kernels
    /// at avx512`.
    pub fn summary_line(&self, model_flops_per_s: f64) -> String {
        match (self.flops_per_s, &self.library) {
            (Some(r), Some(lib)) => format!(
                "  reference  {:.2} GFLOP/s model FLOPs vs {:.2} GFLOP/s f32 GEMM of {lib} on all \
                 cores ({:.0}%); CPU kernels at {}",
                model_flops_per_s / 1e9,
                r / 1e9,
                100.0 * model_flops_per_s / r,
                self.cpu_isa
            ),
            _ => format!(
                "  reference  none ({}); CPU kernels at {}",
                self.note.as_deref().unwrap_or("not measured"),
                self.cpu_isa
            ),
        }
    }

    /// The `--json` fields: `gemm_reference_flops_per_s`, `model_flops_over_reference_gemm`
    /// (both `null` without a rate), `gemm_reference`, `gemm_reference_note`, `cpu_isa`.
    pub fn json_fields(&self, model_flops_per_s: f64) -> Vec<(&'static str, Value)> {
        let finite = |v: Option<f64>| {
            v.filter(|x| x.is_finite())
                .map_or(Value::Null, |x| json!(x))
        };
        vec![
            ("gemm_reference_flops_per_s", finite(self.flops_per_s)),
            (
                "model_flops_over_reference_gemm",
                finite(self.fraction(model_flops_per_s)),
            ),
            ("gemm_reference", json!(self.library)),
            ("gemm_reference_note", json!(self.note)),
            ("cpu_isa", json!(self.cpu_isa.name())),
        ]
    }
}

/// Loads the reference BLAS now (see the module docs); later [`reference_limit`] calls reuse it.
/// Returns its name or why there is none.
pub fn load_reference() -> Result<String, String> {
    ReferenceGemm::load()
        .map(|r| r.name().to_string())
        .map_err(|e| e.to_string())
}

/// The reference GEMM rate for this run ([`ReferenceProbe::flops_per_s`]): on CPU runs f32 1024³
/// products, each way of running them repeated for about a third of the budget (at least
/// twice); for `--device cuda` runs `None` with a note (the reference is a CPU library).
pub fn reference_limit(c: &TrainConfig, cores: usize, budget: Duration) -> ReferenceProbe {
    let isa = cpu_isa();
    let none = |note: String| ReferenceProbe {
        flops_per_s: None,
        library: None,
        note: Some(note),
        cpu_isa: isa,
    };
    if c.cuda.is_some() {
        return none("the reference GEMM is a CPU BLAS; not measured for --device cuda".into());
    }
    let r = match ReferenceGemm::load() {
        Ok(r) => r,
        Err(e) => return none(e.to_string()),
    };
    match reference_rate(r, cores.max(1), 1024, budget) {
        Ok(rate) => ReferenceProbe {
            flops_per_s: Some(rate),
            library: Some(r.name().to_string()),
            note: None,
            cpu_isa: isa,
        },
        Err(e) => none(format!("{}: {e}", r.name())),
    }
}

/// The best rate of `r` on n³ products (see [`reference_limit`]).
fn reference_rate(
    r: &ReferenceGemm,
    cores: usize,
    n: usize,
    budget: Duration,
) -> Result<f64, String> {
    let a: Vec<f32> = (0..n * n).map(|i| (i % 13) as f32 * 0.01 - 0.06).collect();
    let b: Vec<f32> = (0..n * n).map(|i| (i % 11) as f32 * 0.01 - 0.05).collect();
    let mut cs: Vec<Vec<f32>> = (0..cores).map(|_| vec![0.0; n * n]).collect();
    let flops = 2.0 * (n as f64).powi(3);
    let mul = |c: &mut [f32]| {
        r.matmul(&a, &b, c, n, n, n, false, false, false)
            .map_err(|e| e.to_string())
    };
    r.set_threads(1);
    mul(&mut cs[0])?; // warm-up: the library's threads and buffers
    let third = budget / 3;
    // Every core at the 1-thread rate, measured on this thread's CPU time.
    let (mut one_core, t0) = (0.0f64, Instant::now());
    let mut reps = 0;
    while t0.elapsed() < third || reps < 2 {
        let Some(c0) = thread_cpu_secs() else { break };
        mul(&mut cs[0])?;
        let c1 = thread_cpu_secs().unwrap_or(c0);
        one_core = one_core.max(flops / (c1 - c0).max(1e-9));
        reps += 1;
    }
    let mut best = one_core * cores as f64;
    r.set_threads(cores);
    let t0 = Instant::now();
    let mut reps = 0;
    while t0.elapsed() < third || reps < 2 {
        let t = Instant::now();
        mul(&mut cs[0])?;
        best = best.max(flops / t.elapsed().as_secs_f64());
        reps += 1;
    }
    if cores > 1 {
        r.set_threads(1);
        let t0 = Instant::now();
        let mut reps = 0;
        while t0.elapsed() < third || reps < 2 {
            let t = Instant::now();
            std::thread::scope(|s| {
                let handles: Vec<_> = cs.iter_mut().map(|c| s.spawn(|| mul(c))).collect();
                handles
                    .into_iter()
                    .try_for_each(|h| h.join().map_err(|_| "a GEMM thread panicked".to_string())?)
            })?;
            best = best.max(cores as f64 * flops / t.elapsed().as_secs_f64());
            reps += 1;
        }
    }
    Ok(best)
}

/// This thread's CPU time in seconds (Linux `CLOCK_THREAD_CPUTIME_ID`; `None` elsewhere).
fn thread_cpu_secs() -> Option<f64> {
    #[cfg(target_os = "linux")]
    {
        #[repr(C)]
        struct Timespec {
            tv_sec: i64,
            tv_nsec: i64,
        }
        extern "C" {
            fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
        }
        const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
        let mut t = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one timespec (two 64-bit fields on 64-bit Linux) to `t`.
        let rc = unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut t) };
        (rc == 0).then_some(t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9)
    }
    #[cfg(not(target_os = "linux"))]
    None
}

/// The f32 GEMM rate this machine reaches with the project's matmul kernel (the `gemm` crate)
/// on `threads` threads: square 384×384×384 products repeated for about `budget`. Returns
/// FLOP/s (2·n³ per product).
pub fn cpu_gemm_probe(threads: usize, budget: Duration) -> Result<f64, String> {
    let n = 384usize;
    let dev = Device::cpu(20_000);
    let a = Tensor::full(&[n, n], 0.5, DType::F32, &dev).map_err(|e| e.to_string())?;
    let b = Tensor::full(&[n, n], 0.25, DType::F32, &dev).map_err(|e| e.to_string())?;
    fsdp_autograd::kernels::cpu::set_matmul_threads(threads);
    // Warm-up (packing buffers, thread pool).
    a.matmul(&b)
        .and_then(|c| c.item_at0())
        .map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let mut reps = 0u64;
    while t0.elapsed() < budget || reps < 2 {
        a.matmul(&b)
            .and_then(|c| c.item_at0())
            .map_err(|e| e.to_string())?;
        reps += 1;
    }
    let secs = t0.elapsed().as_secs_f64();
    Ok(2.0 * (n * n * n) as f64 * reps as f64 / secs)
}

/// Waiting for a result (the CPU stream runs the kernel asynchronously).
trait ItemAt0 {
    fn item_at0(&self) -> fsdp_autograd::Result<f32>;
}

impl ItemAt0 for Tensor {
    fn item_at0(&self) -> fsdp_autograd::Result<f32> {
        self.reshape(&[self.numel()])?.narrow(0, 0, 1)?.item()
    }
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

    /// With the library installed: a positive rate, its name, and the fractions and fields the
    /// summary uses; without it: no rate, a note saying what to install, `null` JSON fields.
    #[test]
    fn reference_probe_measures_or_says_why_not() {
        use clap::Parser;
        let c = crate::cli::Cli::try_parse_from(["train_gpt"])
            .unwrap()
            .into_config()
            .unwrap();
        let p = reference_limit(&c, 2, Duration::from_millis(30));
        let fields: std::collections::HashMap<_, _> = p.json_fields(1e9).into_iter().collect();
        assert_eq!(fields["cpu_isa"], json!(cpu_isa().name()));
        match p.flops_per_s {
            Some(rate) => {
                assert!(rate.is_finite() && rate > 0.0);
                assert!(p.library.is_some() && p.note.is_none());
                assert_eq!(p.fraction(rate / 2.0), Some(0.5));
                assert!(fields["model_flops_over_reference_gemm"].is_f64());
                assert!(p.summary_line(rate / 4.0).contains("(25%)"));
            }
            None => {
                let required = std::env::var("FSDP_REFERENCE_REQUIRED").is_ok_and(|v| v == "1");
                assert!(!required, "FSDP_REFERENCE_REQUIRED=1 but {:?}", p.note);
                assert!(p.note.as_deref().unwrap_or("").contains("libopenblas0"));
                assert!(fields["gemm_reference_flops_per_s"].is_null());
                assert!(p.summary_line(1e9).contains("reference  none"));
            }
        }
    }
}
