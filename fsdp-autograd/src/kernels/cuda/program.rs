//! The NVRTC program: the kernel table, compilation at first use, and the per-context module
//! cache.
//!
//! `kernels.cu` is compiled to PTX once per process (NVRTC's default virtual architecture, so the
//! driver JIT-compiles it for whatever GPU loads it) and loaded once per CUDA context; both are
//! cached for the life of the process. The cached module keeps its context alive (a primary
//! context stays retained), which is what makes the context pointer a stable cache key.

use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{CompileOptions, Ptx};

use super::error::CudaKernelError;

/// The CUDA C source of every kernel: `kernels.cu`, then the fused attention of `flash.cu`
/// (one program, so `flash.cu` uses `kernels.cu`'s helpers).
pub(crate) const SOURCE: &str = concat!(include_str!("kernels.cu"), include_str!("flash.cu"));

/// Threads per block of every launch (`BLOCK` in `kernels.cu`; the block reductions need a power
/// of two).
pub(crate) const BLOCK: u32 = 256;

/// Largest grid the launch code uses; kernels loop over the grid, so this only bounds
/// parallelism.
pub(crate) const MAX_GRID: u32 = 65_535;

/// The kind of one kernel parameter, as pushed by the launch code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ArgKind {
    /// `u64` (sizes, counts).
    U64,
    /// `float` scalar.
    F32,
    /// `double` scalar.
    F64,
    /// A device address (any pointer type in the CUDA source).
    Ptr,
    /// The `View` struct (by value).
    View,
}

macro_rules! kernels {
    ($($variant:ident => $name:literal [$($kind:ident),*];)*) => {
        /// Every `extern "C" __global__` function of `kernels.cu`, with its parameter kinds.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub(crate) enum Kernel {
            $(#[doc = concat!("`", $name, "`")] $variant,)*
        }

        impl Kernel {
            /// All kernels, in table order (the order of the loaded `CudaFunction`s).
            pub(crate) const ALL: &'static [Kernel] = &[$(Kernel::$variant,)*];

            /// The function's name in `kernels.cu`.
            pub(crate) fn name(self) -> &'static str {
                match self { $(Kernel::$variant => $name,)* }
            }

            /// The kinds of its parameters, in order.
            pub(crate) fn signature(self) -> &'static [ArgKind] {
                match self { $(Kernel::$variant => &[$(ArgKind::$kind),*],)* }
            }

            /// Index into [`Kernel::ALL`].
            pub(crate) fn index(self) -> usize {
                self as usize
            }
        }
    };
}

kernels! {
    Add => "ew_add" [U64, Ptr, Ptr, Ptr];
    Mul => "ew_mul" [U64, Ptr, Ptr, Ptr];
    Scale => "ew_scale" [U64, Ptr, F32, Ptr];
    ScaleInplace => "ew_scale_inplace" [U64, Ptr, F32];
    Axpy => "ew_axpy" [U64, Ptr, F32, Ptr];
    AddRowBias => "add_row_bias" [U64, U64, Ptr, Ptr, Ptr];
    AddRowBiasInplace => "add_row_bias_inplace" [U64, U64, Ptr, Ptr];
    ColSums => "col_sums" [U64, U64, Ptr, Ptr];
    SumPartial => "sum_partial" [U64, Ptr, Ptr];
    SumFinal => "sum_final" [U64, Ptr, F64, Ptr];
    GeluFwd => "gelu_fwd" [U64, Ptr, Ptr];
    GeluBwd => "gelu_bwd" [U64, Ptr, Ptr, Ptr];
    GeluExactFwd => "gelu_exact_fwd" [U64, Ptr, Ptr];
    GeluExactBwd => "gelu_exact_bwd" [U64, Ptr, Ptr, Ptr];
    SoftmaxFwd => "softmax_fwd" [U64, U64, Ptr, Ptr];
    SoftmaxBwd => "softmax_bwd" [U64, U64, Ptr, Ptr, Ptr];
    CausalSoftmax => "causal_softmax" [U64, U64, Ptr];
    CausalSoftmaxBwd => "causal_softmax_bwd" [U64, U64, Ptr, Ptr];
    LayerNormFwd => "layer_norm_fwd" [U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    LayerNormBwdDx => "layer_norm_bwd_dx" [U64, U64, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    LayerNormBwdParams => "layer_norm_bwd_params" [U64, U64, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    CheckIds => "check_ids" [U64, Ptr, U64, Ptr];
    EmbeddingFwd => "embedding_fwd" [U64, U64, U64, Ptr, Ptr, Ptr];
    EmbRank => "emb_rank" [U64, Ptr, U64, Ptr, Ptr];
    EmbScan => "emb_scan" [U64, Ptr, Ptr];
    EmbScatter => "emb_scatter" [U64, U64, Ptr, Ptr, Ptr, Ptr];
    EmbAccum => "emb_accum" [U64, U64, Ptr, Ptr, Ptr, Ptr, Ptr];
    CeFwd => "ce_fwd" [U64, U64, Ptr, Ptr, Ptr, Ptr];
    CeBwd => "ce_bwd" [U64, U64, Ptr, Ptr, Ptr, Ptr, Ptr];
    CastF32F16 => "cast_f32_f16" [U64, Ptr, Ptr];
    CastF16F32 => "cast_f16_f32" [U64, Ptr, Ptr];
    CastF32Bf16 => "cast_f32_bf16" [U64, Ptr, Ptr];
    CastBf16F32 => "cast_bf16_f32" [U64, Ptr, Ptr];
    StridedCopyB2 => "strided_copy_b2" [U64, View, Ptr, Ptr];
    StridedCopyB4 => "strided_copy_b4" [U64, View, Ptr, Ptr];
    StridedCopyB8 => "strided_copy_b8" [U64, View, Ptr, Ptr];
    StridedAddF32 => "strided_add_f32" [U64, View, Ptr, Ptr];
    // Typed (f32 / f16 / bf16 operands; kernels/cuda/typed.rs).
    AddT => "ew_add_t" [U64, U64, Ptr, Ptr, Ptr];
    AxpyT => "ew_axpy_t" [U64, U64, Ptr, F32, Ptr];
    AddRowBiasT => "add_row_bias_t" [U64, U64, U64, Ptr, Ptr, Ptr];
    AddRowBiasInplaceT => "add_row_bias_inplace_t" [U64, U64, U64, Ptr, Ptr];
    ColSumsT => "col_sums_t" [U64, U64, U64, Ptr, Ptr];
    GeluFwdT => "gelu_fwd_t" [U64, U64, Ptr, Ptr];
    GeluBwdT => "gelu_bwd_t" [U64, U64, Ptr, Ptr, Ptr];
    GeluExactFwdT => "gelu_exact_fwd_t" [U64, U64, Ptr, Ptr];
    GeluExactBwdT => "gelu_exact_bwd_t" [U64, U64, Ptr, Ptr, Ptr];
    LayerNormFwdT => "layer_norm_fwd_t" [U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    LayerNormBwdDxT => "layer_norm_bwd_dx_t" [U64, U64, U64, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    LayerNormBwdParamsT => "layer_norm_bwd_params_t" [U64, U64, U64, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    SumFinalT => "sum_final_t" [U64, U64, Ptr, F64, Ptr];
    CeFwdT => "ce_fwd_t" [U64, U64, U64, Ptr, Ptr, Ptr, Ptr];
    CeBwdT => "ce_bwd_t" [U64, U64, U64, Ptr, Ptr, Ptr, Ptr, Ptr];
    EmbeddingFwdT => "embedding_fwd_t" [U64, U64, U64, U64, Ptr, Ptr, Ptr];
    EmbAccumT => "emb_accum_t" [U64, U64, U64, Ptr, Ptr, Ptr, Ptr, Ptr];
    MulT => "ew_mul_t" [U64, U64, Ptr, Ptr, Ptr];
    ScaleT => "ew_scale_t" [U64, U64, Ptr, F32, Ptr];
    ScaleInplaceT => "ew_scale_inplace_t" [U64, U64, Ptr, F32];
    SumPartialT => "sum_partial_t" [U64, U64, Ptr, Ptr];
    // flash.cu: fused causal attention.
    FlashFwdF32Le64 => "flash_fwd_f32_le64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashFwdBf16Le64 => "flash_fwd_bf16_le64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashFwdF16Le64 => "flash_fwd_f16_le64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashFwdF32Le128 => "flash_fwd_f32_le128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashFwdBf16Le128 => "flash_fwd_bf16_le128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashFwdF16Le128 => "flash_fwd_f16_le128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashBwdPreF32 => "flash_bwd_pre_f32" [U64, U64, U64, U64, U64, Ptr, Ptr, Ptr];
    FlashBwdPreBf16 => "flash_bwd_pre_bf16" [U64, U64, U64, U64, U64, Ptr, Ptr, Ptr];
    FlashBwdPreF16 => "flash_bwd_pre_f16" [U64, U64, U64, U64, U64, Ptr, Ptr, Ptr];
    FlashBwdDkdvF32Le64 => "flash_bwd_dkdv_f32_le64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashBwdDkdvBf16Le64 => "flash_bwd_dkdv_bf16_le64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashBwdDkdvF16Le64 => "flash_bwd_dkdv_f16_le64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashBwdDkdvF32Le128 => "flash_bwd_dkdv_f32_le128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashBwdDkdvBf16Le128 => "flash_bwd_dkdv_bf16_le128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashBwdDkdvF16Le128 => "flash_bwd_dkdv_f16_le128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashBwdDqF32Le64 => "flash_bwd_dq_f32_le64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashBwdDqBf16Le64 => "flash_bwd_dq_bf16_le64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashBwdDqF16Le64 => "flash_bwd_dq_f16_le64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashBwdDqF32Le128 => "flash_bwd_dq_f32_le128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashBwdDqBf16Le128 => "flash_bwd_dq_bf16_le128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashBwdDqF16Le128 => "flash_bwd_dq_f16_le128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    // flash.cu: the register-tiled kernels for head dims exactly 64 and 128.
    FlashFwdF32D64 => "flash_fwd_f32_d64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashFwdBf16D64 => "flash_fwd_bf16_d64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashFwdF16D64 => "flash_fwd_f16_d64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashFwdF32D128 => "flash_fwd_f32_d128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashFwdBf16D128 => "flash_fwd_bf16_d128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashFwdF16D128 => "flash_fwd_f16_d128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashBwdDkdvF32D64 => "flash_bwd_dkdv_f32_d64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashBwdDkdvBf16D64 => "flash_bwd_dkdv_bf16_d64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashBwdDkdvF16D64 => "flash_bwd_dkdv_f16_d64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashBwdDkdvF32D128 => "flash_bwd_dkdv_f32_d128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashBwdDkdvBf16D128 => "flash_bwd_dkdv_bf16_d128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashBwdDkdvF16D128 => "flash_bwd_dkdv_f16_d128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashBwdDqF32D64 => "flash_bwd_dq_f32_d64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashBwdDqBf16D64 => "flash_bwd_dq_bf16_d64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashBwdDqF16D64 => "flash_bwd_dq_f16_d64" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashBwdDqF32D128 => "flash_bwd_dq_f32_d128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashBwdDqBf16D128 => "flash_bwd_dq_bf16_d128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    FlashBwdDqF16D128 => "flash_bwd_dq_f16_d128" [U64, U64, U64, U64, U64, F32, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr];
    // Optimizer, clipping, grad scaler (kernels/cuda/optim.rs).
    OptSgd => "opt_sgd" [U64, F32, F32, Ptr, Ptr];
    OptSgdMomentum => "opt_sgd_momentum" [U64, U64, F32, F32, F32, Ptr, Ptr, Ptr];
    OptAdamW => "opt_adamw" [U64, F32, F32, F32, F32, F32, F32, F32, Ptr, Ptr, Ptr, Ptr];
    OptLambDir => "opt_lamb_dir" [U64, F32, F32, F32, F32, F32, F32, F32, Ptr, Ptr, Ptr, Ptr, Ptr];
    OptLambApply => "opt_lamb_apply" [U64, F32, U64, U64, Ptr, Ptr, Ptr];
    OptSumsqPartial => "opt_sumsq_partial" [U64, Ptr, Ptr];
    OptSumsqAccum => "opt_sumsq_accum" [U64, Ptr, Ptr];
    OptSumsqFinal => "opt_sumsq_final" [U64, Ptr, Ptr];
    OptUnscale => "opt_unscale" [U64, F32, Ptr, Ptr];
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

/// The PTX of [`SOURCE`], compiled on first use (an error is cached too: the source is fixed).
pub(crate) fn ptx() -> Result<Ptx, CudaKernelError> {
    static PTX: OnceLock<Result<Ptx, String>> = OnceLock::new();
    PTX.get_or_init(|| {
        cudarc::nvrtc::compile_ptx_with_opts(SOURCE, compile_options()).map_err(|e| match e {
            cudarc::nvrtc::CompileError::CompileError { nvrtc, log, .. } => {
                format!("{nvrtc:?}: {}", log.to_string_lossy())
            }
            other => other.to_string(),
        })
    })
    .clone()
    .map_err(|log| CudaKernelError::Compile { log })
}

/// `kernels.cu` loaded into one CUDA context: one function per [`Kernel`].
pub(crate) struct LoadedModule {
    functions: Vec<CudaFunction>,
    // Keeps the module (and through it the context) loaded for the cached functions.
    _module: Arc<CudaModule>,
}

impl LoadedModule {
    /// The loaded function of `kernel`.
    pub(crate) fn function(&self, kernel: Kernel) -> &CudaFunction {
        &self.functions[kernel.index()]
    }
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
    let ptx = ptx()?;
    let module = ctx
        .load_module(ptx)
        .map_err(|source| CudaKernelError::Driver {
            op: "load kernels",
            call: "cuModuleLoadData",
            source,
        })?;
    let functions = Kernel::ALL
        .iter()
        .map(|k| {
            module
                .load_function(k.name())
                .map_err(|source| CudaKernelError::Driver {
                    op: "load kernels",
                    call: "cuModuleGetFunction",
                    source,
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let loaded = Arc::new(LoadedModule {
        functions,
        _module: module,
    });
    modules.push((key, Arc::clone(&loaded)));
    Ok(loaded)
}
