//! The NVRTC program (feature `cuda`): every op family's CUDA source and kernel table joined into one program
//! ([`FAMILIES`], the one list of families), compiled at first use, loaded per context, and
//! [`CudaKernels::new`], which does both for a device.
//!
//! The source is `common.cu` followed by each family's `.cu` files; the kernel table is each
//! family's modules' `KERNELS` (declared with `declare_kernels!` next to the ops that launch
//! them). The program is compiled to PTX once per process and target (NVRTC's default virtual
//! architecture, or `compute_80` for devices of compute capability 8.0+, where the tensor-core
//! attention kernels' `mma.sync` is available; the driver JIT-compiles the PTX for the GPU that
//! loads it) and loaded once per CUDA context;
//! both are cached for the life of the process. The cached module keeps its context alive (a
//! primary context stays retained), which is what makes the context pointer a stable cache key.
//! The emulator build (`cuda/tests/emu.rs`) writes [`source`] out and generates its kernel table from
//! [`all`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::CudaContext;
use cudarc::nvrtc::{CompileOptions, Ptx};
use fsdp_alloc::{Device, DeviceId};

use super::cuda::context::CudaKernels;
use super::cuda::error::{CudaKernelError, Result};
use super::cuda::kernel::{Family, Kernel, LoadedModule};
use super::{attention, dropout, elementwise, embedding, layout, loss, norm, optim, reduce, rope};

/// Every part of the program, in program order: the shared helpers (with the index check's
/// kernel), then one entry per op family (its `FAMILY`: `.cu` files and kernel tables).
const FAMILIES: &[Family] = &[
    Family {
        sources: &[include_str!("cuda/common.cu")],
        kernels: &[super::cuda::index::KERNELS],
    },
    elementwise::FAMILY,
    reduce::FAMILY,
    norm::FAMILY,
    embedding::FAMILY,
    loss::FAMILY,
    attention::FAMILY,
    layout::FAMILY,
    optim::FAMILY,
    rope::FAMILY,
    dropout::FAMILY,
];

/// The CUDA C source of the whole program: every family's files, in [`FAMILIES`] order.
pub(crate) fn source() -> &'static str {
    static SOURCE: OnceLock<String> = OnceLock::new();
    SOURCE.get_or_init(|| {
        FAMILIES
            .iter()
            .flat_map(|f| f.sources.iter().copied())
            .collect::<Vec<_>>()
            .join("\n")
    })
}

/// Every kernel of the program, in [`FAMILIES`] order (the functions loaded per context).
pub(crate) fn all() -> &'static [Kernel] {
    static ALL: OnceLock<Vec<Kernel>> = OnceLock::new();
    ALL.get_or_init(|| {
        FAMILIES
            .iter()
            .flat_map(|f| f.kernels.iter().flat_map(|t| t.iter().copied()))
            .collect()
    })
}

impl CudaKernels {
    /// Compiles (once per process) and loads (once per CUDA context) the kernels for `device`.
    ///
    /// # Errors
    /// [`CudaKernelError::Unavailable`] if `device` is not a CUDA device or NVRTC / cuBLAS cannot
    /// be loaded; [`CudaKernelError::Compile`] or [`CudaKernelError::Driver`] if compiling or
    /// loading the program fails.
    ///
    /// ```
    /// use fsdp_alloc::{Device, DeviceId};
    /// use fsdp_autograd::kernels::cuda::{CudaKernelError, CudaKernels};
    /// // A CPU device has no CUDA kernels (and without a GPU there is no CUDA device at all).
    /// let err = CudaKernels::new(&Device::cpu(0)).unwrap_err();
    /// assert!(matches!(err, CudaKernelError::Unavailable { device: DeviceId::Cpu(0), .. }));
    /// ```
    pub fn new(device: &Device) -> Result<CudaKernels> {
        let unavailable = |reason: String| CudaKernelError::Unavailable {
            device: device.id(),
            reason,
        };
        let ordinal = match device.id() {
            DeviceId::Cuda(o) => o,
            DeviceId::Cpu(_) => return Err(unavailable("it is not a CUDA device".into())),
        };
        let Some(cs) = device.default_stream().cuda_stream() else {
            return Err(unavailable(
                "its default stream is not a CUDA stream".into(),
            ));
        };
        let ctx = Arc::clone(cs.context());
        // SAFETY: `is_culib_present` only tries to load the shared library and reports whether
        // it could; it has no precondition. Checking first keeps cudarc from panicking later.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(unavailable(
                "the NVRTC library (libnvrtc) was not found; install the CUDA toolkit's NVRTC"
                    .into(),
            ));
        }
        // SAFETY: as above, for cuBLAS.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(unavailable(
                "the cuBLAS library (libcublas) was not found; install the CUDA toolkit's cuBLAS"
                    .into(),
            ));
        }
        let module = module_for(&ctx)?;
        Ok(CudaKernels::from_parts(device, ordinal, ctx, module))
    }
}

/// NVRTC options: IEEE division and square root, no flush-to-zero, and no FMA contraction, so
/// the device evaluates each expression operation by operation as the CPU kernels do.
pub(crate) fn compile_options() -> CompileOptions {
    CompileOptions {
        ftz: Some(false),
        prec_sqrt: Some(true),
        prec_div: Some(true),
        fmad: Some(false),
        name: Some("fsdp_autograd_kernels.cu".into()),
        ..Default::default()
    }
}

/// The PTX of [`source`], compiled on first use per target (an error is cached too: the source
/// is fixed): `compute_80` when `tensor_cores` (the `mma.sync` kernels of
/// `attention/flash_mma.cu` become tensor-core code; the PTX then loads on compute capability
/// 8.0+ only), else NVRTC's default virtual architecture (those kernels compile to their
/// emulated reference path, which the host never selects there).
pub(crate) fn ptx_for(tensor_cores: bool) -> Result<Ptx, CudaKernelError> {
    static PTX: [OnceLock<Result<Ptx, String>>; 2] = [OnceLock::new(), OnceLock::new()];
    PTX[usize::from(tensor_cores)]
        .get_or_init(|| {
            let mut opts = compile_options();
            if tensor_cores {
                opts.arch = Some("compute_80");
            }
            cudarc::nvrtc::compile_ptx_with_opts(source(), opts).map_err(|e| match e {
                cudarc::nvrtc::CompileError::CompileError { nvrtc, log, .. } => {
                    format!("{nvrtc:?}: {}", log.to_string_lossy())
                }
                other => other.to_string(),
            })
        })
        .clone()
        .map_err(|log| CudaKernelError::Compile { log })
}

/// The module for `ctx`, compiling and loading it on first use (per process, per context).
pub(crate) fn module_for(ctx: &Arc<CudaContext>) -> Result<Arc<LoadedModule>, CudaKernelError> {
    static MODULES: Mutex<Vec<(usize, Arc<LoadedModule>)>> = Mutex::new(Vec::new());
    // The context handle is the key: the cached module holds the context, so a cached handle
    // cannot be destroyed and reused for another context.
    let key = ctx.cu_ctx() as usize;
    let mut modules = MODULES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, m)) = modules.iter().find(|(k, _)| *k == key) {
        return Ok(Arc::clone(m));
    }
    // Compute capability 8.0+ (Ampere, Hopper, ...): compile for compute_80, so the tensor-core
    // attention kernels use mma.sync. A failed query falls back to the default target.
    let tensor_cores = ctx.compute_capability().is_ok_and(|(major, _)| major >= 8);
    let ptx = ptx_for(tensor_cores)?;
    let module = ctx
        .load_module(ptx)
        .map_err(|source| CudaKernelError::Driver {
            op: "load kernels",
            call: "cuModuleLoadData",
            source,
        })?;
    let functions = all()
        .iter()
        .map(|k| {
            let f = module
                .load_function(k.name())
                .map_err(|source| CudaKernelError::Driver {
                    op: "load kernels",
                    call: "cuModuleGetFunction",
                    source,
                })?;
            Ok((k.name(), f))
        })
        .collect::<Result<HashMap<_, _>, CudaKernelError>>()?;
    let loaded = Arc::new(LoadedModule::new(module, functions, tensor_cores));
    modules.push((key, Arc::clone(&loaded)));
    Ok(loaded)
}
