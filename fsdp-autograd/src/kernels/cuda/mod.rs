//! CUDA kernels (feature `cuda`): the GPU counterparts of [`kernels::cpu`](super::cpu), on
//! device memory from `fsdp-alloc`'s CUDA backend, launched on CUDA [`Stream`](fsdp_alloc::Stream)s.
//!
//! # How it is checked
//!
//! The code is written and checked on machines without a GPU, CUDA driver or cuBLAS:
//! - the Rust code compiles and passes `clippy -D warnings` with `--features cuda`;
//! - NVRTC (the `nvidia-cuda-nvrtc-cu12` wheel; NVRTC is a compiler library and needs no GPU)
//!   compiles the program with the production options into PTX defining every kernel (test
//!   `nvrtc_compiles_the_kernels`, `cargo xtask nvrtc`; it skips where libnvrtc is absent);
//! - a host C++ emulation of the CUDA execution model (`emu/`: blocks of host threads,
//!   barriers, shared memory; cuBLAS's `SgemmStridedBatched` and `GemmStridedBatchedEx` by a
//!   plain loop with cuBLAS's argument checks) runs the program and the very launch plans the
//!   methods enqueue, and the shared test cases compare the results with the CPU kernels (tests
//!   `emulated::*`; they skip where no C++ compiler exists, and CI sets `FSDP_EMU_REQUIRED=1`).
//!   With `FSDP_EMU_SANITIZE=address` or `=thread` the emulator is built with that sanitizer,
//!   which catches out-of-bounds accesses and missing barriers.
//!
//! The emulator proves nothing about GPU-specific behaviour (timing, occupancy, the driver's
//! JIT, real concurrency between streams). The GPU tests (`on_gpu::*`, `gpu_only::*`, all
//! `#[ignore]`) run the same cases through this public API; run them with `cargo xtask
//! gpu-test` (which passes `--include-ignored` and `FSDP_GPU_TESTS=1`) on a GPU after a
//! change: CI cannot. What has run on which GPU is recorded in `docs/GPU-STATUS.md`, not here.
//!
//! # Where the code is
//!
//! This module is the machinery: the per-device handle ([`CudaKernels`], `context.rs`), launch
//! plans (`plan.rs`), kernel declarations (`kernel.rs`: `declare_kernels!`, `Family`), the index
//! check ([`IndexCheck`], `index.rs`), the typed-operand helpers (`typed.rs`), host transfers
//! (`transfer.rs`), the shared CUDA source (`common.cu`) and the seam's [`CudaBackend`]
//! (`launcher.rs`, `backend.rs`). Each op's CUDA side lives in the op's own file under
//! `kernels/<family>/` (its `gpu` module: its kernels' declarations, plans and `CudaKernels`
//! methods; its `.cu` code in the family's `.cu` file); `kernels/program.rs` joins every
//! family's source and kernel table into the one NVRTC program.
//!
//! # Use
//!
//! Build a [`CudaKernels`] for a CUDA [`Device`](fsdp_alloc::Device) (it compiles the program
//! with NVRTC once per process, loads it once per CUDA context, and creates one cuBLAS handle
//! per stream on first use), then call its methods with a stream of that device and
//! [`BufferRef`](fsdp_alloc::BufferRef)s of its memory:
//!
//! ```no_run
//! # #[cfg(feature = "cuda")]
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use fsdp_alloc::Device;
//! use fsdp_autograd::kernels::cuda::CudaKernels;
//!
//! let dev = Device::cuda(0)?; // AllocError::CudaUnavailable without a driver
//! let k = CudaKernels::new(&dev)?;
//! let s = dev.default_stream();
//! let x = dev.alloc(4 * 6, s)?;
//! let y = dev.alloc(4 * 6, s)?;
//! k.upload(s, &[1.0f32, 2.0, 3.0, 1.0, 1.0, 1.0], x.data())?;
//! k.softmax_rows(s, x.data(), y.data(), 3)?; // enqueued, not yet complete
//! let mut host = [0.0f32; 6];
//! k.download(s, y.data(), &mut host)?; // synchronizes the stream
//! assert!((host[3] - 1.0 / 3.0).abs() < 1e-6);
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "cuda"))]
//! # fn main() {} // without the `cuda` feature only `CudaBackend` is compiled here
//! ```
//!
//! | group | methods |
//! | --- | --- |
//! | matrix products (cuBLAS) | [`gemm`](CudaKernels::gemm) (one product or a batch, per a [`Gemm`](crate::kernels::gemm::Gemm)) |
//! | elementwise | [`add`](CudaKernels::add), [`mul`](CudaKernels::mul), [`scale`](CudaKernels::scale), [`scale_inplace`](CudaKernels::scale_inplace), [`add_scaled`](CudaKernels::add_scaled), [`gelu`](CudaKernels::gelu), [`gelu_backward`](CudaKernels::gelu_backward) |
//! | reductions / broadcasts | [`sum`](CudaKernels::sum), [`mean`](CudaKernels::mean), [`add_row_bias`](CudaKernels::add_row_bias), [`add_row_bias_inplace`](CudaKernels::add_row_bias_inplace), [`col_sums`](CudaKernels::col_sums) |
//! | row-wise | [`softmax_rows`](CudaKernels::softmax_rows), [`softmax_rows_backward`](CudaKernels::softmax_rows_backward), [`layer_norm`](CudaKernels::layer_norm), [`layer_norm_backward`](CudaKernels::layer_norm_backward) |
//! | lookup / loss | [`embedding`](CudaKernels::embedding), [`embedding_backward`](CudaKernels::embedding_backward), [`cross_entropy`](CudaKernels::cross_entropy), [`cross_entropy_backward`](CudaKernels::cross_entropy_backward) |
//! | matrix products, f16/bf16/TF32 (cuBLAS Ex) | [`gemm_ex`](CudaKernels::gemm_ex) with a [`GemmPrecision`](crate::kernels::gemm::GemmPrecision) |
//! | attention | [`causal_attention`](CudaKernels::causal_attention), [`causal_attention_backward`](CudaKernels::causal_attention_backward) (unfused: saves the `t×t` probabilities) |
//! | fused attention (`flash.cu`) | [`flash_attention`](CudaKernels::flash_attention), [`flash_attention_backward`](CudaKernels::flash_attention_backward) (FlashAttention-2 style: saves a per-query log-sum-exp; f32/bf16/f16) |
//! | layout (views) | [`strided_copy`](CudaKernels::strided_copy), [`strided_add_assign`](CudaKernels::strided_add_assign) |
//! | optimizer, clipping, scaler | [`sgd_step`](CudaKernels::sgd_step), [`adamw_step`](CudaKernels::adamw_step), [`lamb_direction`](CudaKernels::lamb_direction), [`lamb_apply`](CudaKernels::lamb_apply), [`sum_squares`](CudaKernels::sum_squares), [`unscale`](CudaKernels::unscale) |
//! | casts | [`cast_f32_to_f16`](CudaKernels::cast_f32_to_f16), [`cast_f16_to_f32`](CudaKernels::cast_f16_to_f32), [`cast_f32_to_bf16`](CudaKernels::cast_f32_to_bf16), [`cast_bf16_to_f32`](CudaKernels::cast_bf16_to_f32) |
//! | memory | [`upload`](CudaKernels::upload), [`upload_async`](CudaKernels::upload_async), [`download`](CudaKernels::download), [`copy_host`](CudaKernels::copy_host), [`zero`](CudaKernels::zero), [`copy`](CudaKernels::copy) |
//!
//! # Conventions (differences from the CPU kernels in bold)
//!
//! - Same argument order, shape arguments and shape/length errors ([`KernelError`](super::KernelError),
//!   wrapped in [`CudaKernelError::Kernel`]) as the CPU kernels, with every slice replaced by a
//!   `BufferRef` whose byte length must be exactly the element count times the element size.
//!   Buffers must be device memory of this device (else [`CudaKernelError::NotDeviceMemory`] /
//!   [`CudaKernelError::WrongDevice`]), aligned to their element type, and **outputs must not
//!   overlap other arguments** ([`CudaKernelError::Overlap`]; the CPU API rules this out through
//!   `&mut`). In-place variants say so.
//! - Methods return once the work is **enqueued on the stream** (kernels, cuBLAS calls, memsets
//!   are all stream-ordered); results are observed after an event or a synchronize, exactly as
//!   with `Stream::launch`. Only [`upload`](CudaKernels::upload), [`download`](CudaKernels::download),
//!   [`IndexCheck::wait`], the pageable paths of [`copy_host`](CudaKernels::copy_host) and
//!   writes larger than [`STAGED_WRITE_MAX`] through [`upload_async`](CudaKernels::upload_async)
//!   synchronize; each synchronization is a host wait counted by
//!   `fsdp_alloc::stream::host_syncs`.
//! - **Scalar results stay on the device**: [`sum`](CudaKernels::sum),
//!   [`mean`](CudaKernels::mean) and [`cross_entropy`](CudaKernels::cross_entropy) write a
//!   one-element buffer, and [`cross_entropy_backward`](CudaKernels::cross_entropy_backward)
//!   reads its upstream gradient from one.
//! - **Index errors are deferred**: embedding ids and cross-entropy targets are validated on the
//!   device; the methods return an [`IndexCheck`] whose [`wait`](IndexCheck::wait) reports the
//!   first out-of-range index as the CPU's [`KernelError::IndexOutOfRange`](super::KernelError::IndexOutOfRange).
//!   Out-of-range indices are never dereferenced; their outputs are NaN (forward) or skipped
//!   (embedding backward).
//! - Scratch memory (reduction partials, the embedding sort, attention's `dS`, status words)
//!   comes from the device's caching allocator on the launch stream and is released in stream
//!   order.
//!
//! # Determinism and accuracy
//!
//! No kernel uses floating-point atomics: reductions are fixed-shape trees inside one block or
//! sequential loops, so the same inputs give the same bits on every call on one GPU. The program
//! is compiled with `--fmad=false`, IEEE division/square root and no flush-to-zero, so
//! elementwise arithmetic is evaluated operation by operation like the CPU kernels:
//! [`add`](CudaKernels::add), [`mul`](CudaKernels::mul), [`scale`](CudaKernels::scale),
//! [`add_scaled`](CudaKernels::add_scaled), the row-bias kernels, [`col_sums`](CudaKernels::col_sums),
//! the layer-norm parameter gradients (given equal saved statistics), the embedding kernels,
//! the bf16 casts and the f16 casts of non-NaN values are expected to be **bit-identical** to the
//! CPU. Kernels with `exp` use CUDA's `expf` (≤ 2 ulp) instead of the CPU's polynomial, and
//! row reductions combine in a different (still fixed) order than the CPU's 8-lane f64 sums, so
//! softmax, layer norm, GELU, cross-entropy and attention agree with the CPU to a few ulp, not
//! bitwise. Matrix products use cuBLAS (default math mode: full f32, no TF32) with one handle
//! per stream; cuBLAS documents bitwise reproducibility for a fixed GPU architecture, SM count
//! and library version under those conditions, and its summation order differs from the `gemm`
//! crate's. [`set_allow_tf32`] (off by default, `train_gpt --tf32`) lets the seam's f32
//! products use TF32 tensor cores; f16/bf16 products ([`gemm_ex`](CudaKernels::gemm_ex)) always
//! use the tensor cores with f32 accumulation. The fused attention
//! ([`flash_attention`](CudaKernels::flash_attention), the seam's default, see
//! [`set_fused_attention`]) agrees with the unfused kernels and the CPU to f32 rounding (tests:
//! `1e-5` relative to each tensor's largest magnitude); its backward has no atomics, so it is
//! bit-reproducible too. Its bf16 / f16 forward at head dims 64 and 128 runs on the tensor
//! cores on compute capability 8.0+ (`mma.sync`, f32 accumulation, the probabilities rounded to
//! the operand type before `P·v`, as FlashAttention does; [`set_tensor_core_attention`]), which
//! adds up to `u·Σⱼ Pᵢⱼ|vⱼ|` per output element (`u` the type's unit roundoff).
//!
//! # Limitations
//!
//! - NVRTC compiles for its default virtual architecture (`sm_52` with NVRTC 12.9), or for
//!   `compute_80` on devices of compute capability 8.0+ (the tensor-core attention forward), and
//!   the driver JIT-compiles the PTX; the PTX ISA version follows the NVRTC release (8.8 for NVRTC
//!   12.9), so a driver older than the NVRTC in use rejects it
//!   (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`): keep NVRTC no newer than the driver.
//! - The first [`CudaKernels::new`] per process compiles the program (typically a fraction of
//!   a second); compile errors are cached for the process.
//! - f32 compute except matrix products, the fused attention and the typed kernels (add, mul,
//!   scale, axpy, row-bias add, sum/mean, column sums, GELU, layer norm, cross-entropy,
//!   embedding and their backwards, which take f16/bf16 operands directly with the cast-around
//!   path's bits): for the other kernels (softmax and the unfused attention, strided copies)
//!   the seam casts half-precision tensors to f32 temporaries around them (as on the CPU).
//! - Speed was not a goal beyond avoiding pathologies: [`col_sums`](CudaKernels::col_sums) and
//!   the layer-norm parameter gradients keep the CPU's serial row order per column (one block
//!   per 8 columns stages row tiles through shared memory, so the loads are coalesced and in
//!   flight, but each column is still one chain of additions); the embedding backward ranks
//!   positions in a single block; [`sum`](CudaKernels::sum) uses at most 1024 partial blocks.
//!   The fused attention keeps its tiles in shared memory but multiplies with plain f32 FMA-free
//!   arithmetic on the CUDA cores (no tensor-core `mma`); head dimensions above
//!   [`FUSED_ATTENTION_MAX_D`] fall back to the unfused kernels.
//! - [`strided_add_assign`](CudaKernels::strided_add_assign) refuses overlapping (broadcast)
//!   views, and views have at most [`MAX_VIEW_RANK`] dims.
//! - Limits: matrix dimensions and batch counts up to `i32::MAX` (cuBLAS), embedding id lists up
//!   to `u32::MAX` entries.
//! - Reached from `Tensor` operations through [`CudaBackend`] (the
//!   backend seam), which casts half-precision operands to `f32` temporaries around these
//!   kernels except for matrix products with one half type (and f32 or that type for C), the
//!   fused attention with one dtype throughout, and the typed kernels (any mix of f32, f16 and
//!   bf16), which read and write the half tensors directly.

// Without the `cuda` feature only `CudaBackend` (whose constructor says CUDA was not built) is
// compiled here, so the links above to the kernels cannot resolve in that build's docs.
#![cfg_attr(not(feature = "cuda"), allow(rustdoc::broken_intra_doc_links))]

// The seam's CUDA backend: compiled in every build (without the `cuda` feature its constructor
// says CUDA was not built); the kernels below it only with the feature.
mod backend;
mod config;

/// The CUDA kernels behind the seam. This build has no CUDA support (the `cuda` feature is off):
/// no value of this type can be created, and [`CudaBackend::for_device`] says so. (Defined here
/// rather than in `backend.rs` so that ops naming `cuda::CudaBackend` do not import the file that
/// implements the `Backend` trait, which imports the ops' shapes.)
#[cfg(not(feature = "cuda"))]
#[derive(Debug)]
pub struct CudaBackend {
    _never: std::convert::Infallible,
}
pub use config::{
    allow_tf32, fused_attention, set_allow_tf32, set_fused_attention, set_tensor_core_attention,
    tensor_core_attention, FUSED_ATTENTION_MAX_D,
};

#[cfg(feature = "cuda")]
pub(crate) mod context;
#[cfg(feature = "cuda")]
pub(crate) mod desc;
#[cfg(feature = "cuda")]
pub(crate) mod error;
#[cfg(feature = "cuda")]
pub(crate) mod index;
#[cfg(feature = "cuda")]
pub(crate) mod kernel;
#[cfg(feature = "cuda")]
pub(crate) mod launcher;
#[cfg(feature = "cuda")]
pub(crate) mod plan;
#[cfg(feature = "cuda")]
pub(crate) mod transfer;
#[cfg(feature = "cuda")]
pub(crate) mod typed;

#[cfg(feature = "cuda")]
pub use context::CudaKernels;
#[cfg(feature = "cuda")]
pub use desc::MAX_VIEW_RANK;
#[cfg(feature = "cuda")]
pub use error::{CudaKernelError, Result};
#[cfg(feature = "cuda")]
pub use index::IndexCheck;
#[cfg(feature = "cuda")]
pub use launcher::CudaBackend;
#[cfg(feature = "cuda")]
pub use transfer::STAGED_WRITE_MAX;

#[cfg(all(test, feature = "cuda"))]
mod tests;
