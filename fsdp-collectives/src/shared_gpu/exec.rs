//! The CUDA side (feature `cuda`): `kernels.cu` compiled by NVRTC at first use, loaded once per
//! CUDA context, and the launches of a plan issued on a rank's CUDA stream.

use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{CompileOptions, Ptx};

use super::plan::{Launch, ReduceKernel, BLOCK, COPY_KERNEL, MAX_SOURCES};
use crate::error::{CollectiveError, Result};

/// The CUDA C source of the shared-GPU kernels.
pub(crate) const SOURCE: &str = include_str!("kernels.cu");

/// `struct SgSources` of `kernels.cu`: the source addresses, passed by value (0 = unused).
#[repr(C)]
#[derive(Clone, Copy)]
struct Sources([u64; MAX_SOURCES]);

// SAFETY: `Sources` is `#[repr(C)]` plain old data, 64 `u64`s without padding: exactly the
// layout of `struct SgSources { u64 p[SG_MAX_SOURCES]; }` with SG_MAX_SOURCES = 64, so its bytes
// are a valid kernel parameter of that type.
unsafe impl DeviceRepr for Sources {}

/// NVRTC options: no flush-to-zero, IEEE division, no FMA contraction (the fold is evaluated
/// operation by operation, as the thread backend's).
fn compile_options() -> CompileOptions {
    CompileOptions {
        ftz: Some(false),
        prec_sqrt: Some(true),
        prec_div: Some(true),
        fmad: Some(false),
        name: Some("fsdp_collectives_shared_gpu.cu".into()),
        ..Default::default()
    }
}

/// The PTX of [`SOURCE`], compiled on first use and cached for the process (an error too: the
/// source is fixed). A typed error, never a panic, when libnvrtc cannot be loaded.
pub(crate) fn ptx() -> Result<Ptx> {
    static PTX: OnceLock<Result<Ptx>> = OnceLock::new();
    PTX.get_or_init(|| {
        // SAFETY: `is_culib_present` only tries to load the library; no precondition.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(CollectiveError::CudaUnavailable(
                "the shared-GPU backend compiles its kernels with NVRTC, but libnvrtc could not \
                 be loaded; install the CUDA toolkit's NVRTC (or `pip install \
                 nvidia-cuda-nvrtc-cu12`) and put its lib directory on LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        cudarc::nvrtc::compile_ptx_with_opts(SOURCE, compile_options()).map_err(|e| {
            let message = match e {
                cudarc::nvrtc::CompileError::CompileError { nvrtc, log, .. } => {
                    format!("{nvrtc:?}: {}", log.to_string_lossy())
                }
                other => other.to_string(),
            };
            CollectiveError::Cuda {
                call: "nvrtcCompileProgram (shared-GPU kernels)",
                rank: 0,
                message,
            }
        })
    })
    .clone()
}

/// `kernels.cu` loaded into one CUDA context.
pub(crate) struct Kernels {
    /// One function per [`ReduceKernel::ALL`] entry, in that order.
    reduce: Vec<CudaFunction>,
    copy: CudaFunction,
    // Keeps the module (and through it the context) loaded.
    _module: Arc<CudaModule>,
}

impl Kernels {
    /// The kernels for `ctx`, compiled and loaded on first use (per process, per context).
    pub(crate) fn for_context(ctx: &Arc<CudaContext>) -> Result<Arc<Kernels>> {
        static LOADED: Mutex<Vec<(usize, Arc<Kernels>)>> = Mutex::new(Vec::new());
        // The context handle is the key: the cached module holds the context, so a cached
        // handle cannot be destroyed and reused for another context.
        let key = ctx.cu_ctx() as usize;
        let mut loaded = LOADED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, k)) = loaded.iter().find(|(k, _)| *k == key) {
            return Ok(Arc::clone(k));
        }
        let driver = |call: &'static str| {
            move |e: cudarc::driver::DriverError| CollectiveError::Cuda {
                call,
                rank: 0,
                message: e.to_string(),
            }
        };
        let module = ctx
            .load_module(ptx()?)
            .map_err(driver("cuModuleLoadData"))?;
        let reduce = ReduceKernel::ALL
            .iter()
            .map(|k| module.load_function(k.name()))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(driver("cuModuleGetFunction"))?;
        let copy = module
            .load_function(COPY_KERNEL)
            .map_err(driver("cuModuleGetFunction"))?;
        let k = Arc::new(Kernels {
            reduce,
            copy,
            _module: module,
        });
        loaded.push((key, Arc::clone(&k)));
        Ok(k)
    }

    /// Enqueues `launch` on `stream` (which must belong to the context these kernels were
    /// loaded into).
    ///
    /// # Safety
    /// Every address of `launch` must be device memory of this context that stays allocated,
    /// and is not written by other work, until the launch has run (the shared-GPU group orders
    /// it with events after the owners' writes and before their later work); each source and the
    /// destination must hold the bytes the launch reads or writes (what `plan` computes from
    /// validated descriptors).
    pub(crate) unsafe fn launch(
        &self,
        stream: &Arc<CudaStream>,
        launch: &Launch,
    ) -> std::result::Result<(), cudarc::driver::DriverError> {
        let (grid_x, grid_y) = launch.grid();
        let cfg = LaunchConfig {
            grid_dim: (grid_x, grid_y, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let sources = |srcs: &[u64]| {
            let mut s = Sources([0; MAX_SOURCES]);
            s.0[..srcs.len()].copy_from_slice(srcs);
            s
        };
        match launch {
            Launch::Reduce {
                kernel,
                srcs,
                dst,
                n,
                op,
                world,
                vec,
            } => {
                let func = &self.reduce[kernel.index()];
                let (s, nsrc, vec) = (sources(srcs), srcs.len() as u32, u32::from(*vec));
                let mut b = stream.launch_builder(func);
                b.arg(&s)
                    .arg(&nsrc)
                    .arg(dst)
                    .arg(n)
                    .arg(op)
                    .arg(world)
                    .arg(&vec);
                // SAFETY: the arguments are (SgSources, u32, u64, u64, u32, u32, u32), the
                // parameter list of every `sg_reduce_*` entry point; the values live until the
                // call returns (the driver copies them); the addresses are the caller's contract.
                unsafe { b.launch(cfg) }.map(|_| ())
            }
            Launch::Copy {
                srcs,
                dst,
                chunk,
                total,
                unit,
            } => {
                let (s, nsrc) = (sources(srcs), srcs.len() as u32);
                let mut b = stream.launch_builder(&self.copy);
                b.arg(&s)
                    .arg(&nsrc)
                    .arg(dst)
                    .arg(chunk)
                    .arg(total)
                    .arg(unit);
                // SAFETY: (SgSources, u32, u64, u64, u64, u32) is `sg_copy`'s parameter list; as
                // above for lifetimes and addresses.
                unsafe { b.launch(cfg) }.map(|_| ())
            }
        }
    }
}
