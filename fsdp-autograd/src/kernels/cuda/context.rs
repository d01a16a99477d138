//! [`CudaKernels`]: the per-device handle, argument validation, the launch and cuBLAS helpers,
//! scratch memory and host transfers.

use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaStream, LaunchConfig, PushKernelArg};
use fsdp_alloc::{Buffer, BufferRef, Device, DeviceId, Stream};

pub(crate) use super::desc::Elem;
use super::desc::ViewDesc;
use super::error::{CudaKernelError, Result};
use super::kernel::{ArgKind, LoadedModule, BLOCK};
use super::plan::{GemmType, PArg, Plan, Ptr, Step};
use crate::kernels::{check, KernelError};

/// A resolved kernel parameter (pointers are plain `u64` addresses by now).
#[derive(Debug, Clone, Copy)]
enum Arg {
    U64(u64),
    F32(f32),
    F64(f64),
    View(ViewDesc),
}

/// A validated device buffer argument: its address and element count.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dev {
    /// Device address of the first element.
    pub(crate) ptr: u64,
    /// Number of elements.
    pub(crate) len: usize,
}

impl Dev {
    /// The buffer as a plan argument.
    pub(crate) fn as_ptr(&self) -> Ptr {
        Ptr::Dev(self.ptr)
    }
}

/// Bytes of a count of elements, or [`CudaKernelError::TooLarge`].
pub(crate) fn bytes_of(op: &'static str, count: usize, elem: Elem) -> Result<usize> {
    count
        .checked_mul(elem.size())
        .ok_or(CudaKernelError::TooLarge {
            op,
            what: "bytes",
            value: u64::MAX,
            limit: usize::MAX as u64,
        })
}

/// `a · b` or [`KernelError::InvalidShape`] (the shared check of every kernel).
pub(crate) fn mul(op: &'static str, a: usize, b: usize) -> Result<usize> {
    Ok(check::mul(op, a, b)?)
}

/// `len / cols` rows (the shared check: errors for `cols == 0` or a partial row).
pub(crate) fn rows_of(
    op: &'static str,
    arg: &'static str,
    len: usize,
    cols: usize,
) -> Result<usize> {
    Ok(check::rows(op, arg, len, cols)?)
}

/// `Ok` if `actual == expected`, else the shared [`KernelError::LengthMismatch`].
pub(crate) fn expect_len(
    op: &'static str,
    arg: &'static str,
    actual: usize,
    expected: usize,
    shape: impl FnOnce() -> String,
) -> Result<()> {
    Ok(check::len(op, arg, actual, expected, shape)?)
}

/// The arguments of a row-wise kernel: `rows`, `cols`, then the buffers.
pub(crate) fn row_args(rows: u64, cols: u64, bufs: &[Ptr]) -> Vec<PArg> {
    let mut args = vec![PArg::U64(rows), PArg::U64(cols)];
    args.extend(bufs.iter().map(|&p| PArg::Ptr(p)));
    args
}

/// One stream's cuBLAS handle. `stream` is our own reference, used to find the entry and to
/// notice when nobody else holds the stream any more.
struct BlasEntry {
    stream: Arc<CudaStream>,
    blas: Arc<CudaBlas>,
}

/// The index of the CPU device that holds CUDA device `n`'s staging memory is
/// `STAGING_CPU_INDEX + n`: far above the indices ranks give their own CPU devices.
pub(crate) const STAGING_CPU_INDEX: usize = 1 << 16;

struct Inner {
    device: Device,
    ordinal: usize,
    ctx: Arc<CudaContext>,
    module: Arc<LoadedModule>,
    /// One cuBLAS handle per stream: a handle bound to one stream keeps its workspace private to
    /// that stream, which cuBLAS requires for reproducible results.
    blas: Mutex<Vec<BlasEntry>>,
    /// Page-locked host memory that small host→device writes are staged in
    /// ([`CudaKernels::upload_async`]); created on first use, `Err` (and never retried) if the
    /// driver refuses to pin memory.
    staging: std::sync::OnceLock<std::result::Result<Device, String>>,
}

/// The CUDA kernels of one CUDA [`Device`]: compiled and loaded on construction, with one cuBLAS
/// handle per stream created on first use. Cheap to clone (clones share everything).
///
/// Every kernel method takes the [`Stream`] to launch on (a stream of this device) and
/// [`BufferRef`]s of device memory from this device's allocator, and returns once the work is
/// *enqueued*: like the CPU streams, completion is observed through events or `synchronize`.
#[derive(Clone)]
pub struct CudaKernels {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for CudaKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaKernels")
            .field("device", &self.inner.device.id())
            .finish()
    }
}

/// A validated launch context: the op name, this device's kernels and the CUDA stream.
pub(crate) struct Call<'a> {
    pub(crate) op: &'static str,
    pub(crate) k: &'a CudaKernels,
    pub(crate) stream: &'a Stream,
    pub(crate) cs: &'a Arc<CudaStream>,
}

impl CudaKernels {
    /// The kernels of CUDA device `device` (ordinal `ordinal`, context `ctx`) with the loaded
    /// `module` ([`CudaKernels::new`], in `kernels/program.rs`, compiles and loads it).
    pub(crate) fn from_parts(
        device: &Device,
        ordinal: usize,
        ctx: Arc<CudaContext>,
        module: Arc<LoadedModule>,
    ) -> CudaKernels {
        CudaKernels {
            inner: Arc::new(Inner {
                device: device.clone(),
                ordinal,
                ctx,
                module,
                blas: Mutex::new(Vec::new()),
                staging: std::sync::OnceLock::new(),
            }),
        }
    }

    /// Whether this device's program runs `mma.sync` on the tensor cores (compute capability
    /// 8.0+, program compiled for compute_80): the tensor-core attention forward is available.
    pub fn tensor_cores(&self) -> bool {
        self.inner.module.tensor_cores()
    }

    /// The page-locked host device that [`CudaKernels::upload_async`] stages small writes in
    /// (`DeviceId::Cpu(STAGING_CPU_INDEX + ordinal)`, inline stream, PyTorch's allocator
    /// policy), created on first use; `None` if this driver cannot pin host memory.
    pub(crate) fn staging(&self) -> Option<&Device> {
        self.inner
            .staging
            .get_or_init(|| {
                // Inline stream: allocating needs no worker thread. Not compact: a block whose
                // copy has not run yet is never handed out with a wait attached (on an inline
                // stream that wait would block the issuing thread); it stays pending instead.
                let config = fsdp_alloc::DeviceConfig::default()
                    .with_stream_mode(fsdp_alloc::StreamMode::Inline)
                    .with_compact(false);
                Device::cpu_pinned(
                    STAGING_CPU_INDEX + self.inner.ordinal,
                    config,
                    &self.inner.device,
                )
                .map_err(|e| e.to_string())
            })
            .as_ref()
            .ok()
    }

    /// The device these kernels run on.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// The device's id.
    pub(crate) fn id(&self) -> DeviceId {
        DeviceId::Cuda(self.inner.ordinal)
    }

    /// Checks that `stream` is a CUDA stream of this device.
    pub(crate) fn call<'a>(&'a self, op: &'static str, stream: &'a Stream) -> Result<Call<'a>> {
        let wrong = || CudaKernelError::WrongStream {
            op,
            stream: stream.name().to_string(),
            stream_device: stream.device(),
            device: self.id(),
        };
        if stream.device() != self.id() {
            return Err(wrong());
        }
        let cs = stream.cuda_stream().ok_or_else(wrong)?;
        if cs.context().cu_ctx() != self.inner.ctx.cu_ctx() {
            return Err(wrong());
        }
        Ok(Call {
            op,
            k: self,
            stream,
            cs,
        })
    }

    /// Allocates `count` elements of scratch memory on `stream` from the device's caching
    /// allocator. Dropping the returned buffer after launching work on `stream` is safe: the
    /// allocator only hands the block out again in `stream` order (the CUDA caching allocator
    /// contract).
    pub(crate) fn scratch(
        &self,
        op: &'static str,
        stream: &Stream,
        count: usize,
        elem: Elem,
    ) -> Result<Buffer> {
        let bytes = bytes_of(op, count, elem)?;
        self.inner
            .device
            .alloc(bytes, stream)
            .map_err(|source| CudaKernelError::Alloc { op, bytes, source })
    }

    /// The cuBLAS handle of `cs`, created on first use.
    fn blas_for(&self, op: &'static str, cs: &Arc<CudaStream>) -> Result<Arc<CudaBlas>> {
        let mut entries = self.inner.blas.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = entries.iter().find(|e| Arc::ptr_eq(&e.stream, cs)) {
            return Ok(Arc::clone(&e.blas));
        }
        // Forget handles of streams only we (and the handle itself) still hold.
        entries.retain(|e| Arc::strong_count(&e.stream) > 2);
        let blas = CudaBlas::new(Arc::clone(cs)).map_err(|source| CudaKernelError::Blas {
            op,
            call: "cublasCreate",
            source,
        })?;
        let blas = Arc::new(blas);
        entries.push(BlasEntry {
            stream: Arc::clone(cs),
            blas: Arc::clone(&blas),
        });
        Ok(blas)
    }
}

impl Call<'_> {
    /// Validates a buffer argument read or written as `elem`: device memory of this device, a
    /// whole number of elements, aligned. Returns its address and element count.
    pub(crate) fn buf(&self, arg: &'static str, b: &BufferRef, elem: Elem) -> Result<Dev> {
        let op = self.op;
        let Some(ptr) = b.device_ptr() else {
            return Err(CudaKernelError::NotDeviceMemory {
                op,
                arg,
                buffer: format!("{b:?}"),
            });
        };
        if b.device() != self.k.id() {
            return Err(CudaKernelError::WrongDevice {
                op,
                arg,
                expected: self.k.id(),
                actual: b.device(),
            });
        }
        let size = elem.size();
        if b.len() % size != 0 {
            return Err(KernelError::InvalidShape {
                op,
                reason: format!(
                    "`{arg}` has {} bytes, which is not a whole number of {size}-byte elements",
                    b.len()
                ),
            }
            .into());
        }
        if ptr % size as u64 != 0 {
            return Err(CudaKernelError::Misaligned {
                op,
                arg,
                addr: ptr,
                align: size,
            });
        }
        Ok(Dev {
            ptr,
            len: b.len() / size,
        })
    }

    /// [`Call::buf`] of each named `f32` buffer, in order.
    pub(crate) fn f32_bufs<const N: usize>(
        &self,
        bufs: [(&'static str, &BufferRef); N],
    ) -> Result<[Dev; N]> {
        let mut devs = [Dev { ptr: 0, len: 0 }; N];
        for (d, (arg, b)) in devs.iter_mut().zip(bufs) {
            *d = self.buf(arg, b, Elem::F32)?;
        }
        Ok(devs)
    }

    /// [`Call::buf`] of each named `f32` buffer, in order, each holding exactly its element
    /// count (else the shared length error, with `shape` describing the call).
    pub(crate) fn f32_sized<const N: usize>(
        &self,
        bufs: [(&'static str, &BufferRef, usize); N],
        shape: impl Fn() -> String,
    ) -> Result<[Dev; N]> {
        self.sized(bufs.map(|(arg, b, n)| (arg, b, n, Elem::F32)), shape)
    }

    /// [`Call::buf`] of each named buffer read or written as its `Elem`, in order, each holding
    /// exactly its element count (else the shared length error, with `shape` describing the
    /// call).
    pub(crate) fn sized<const N: usize>(
        &self,
        bufs: [(&'static str, &BufferRef, usize, Elem); N],
        shape: impl Fn() -> String,
    ) -> Result<[Dev; N]> {
        let mut devs = [Dev { ptr: 0, len: 0 }; N];
        for (d, (arg, b, n, elem)) in devs.iter_mut().zip(bufs) {
            *d = self.buf(arg, b, elem)?;
            expect_len(self.op, arg, d.len, n, &shape)?;
        }
        Ok(devs)
    }

    /// Errors if any output overlaps any other argument (outputs included).
    pub(crate) fn disjoint(
        &self,
        outputs: &[(&'static str, &BufferRef)],
        inputs: &[(&'static str, &BufferRef)],
    ) -> Result<()> {
        for (i, &(oname, o)) in outputs.iter().enumerate() {
            let others = outputs
                .iter()
                .enumerate()
                .filter(|&(j, _)| j != i)
                .map(|(_, x)| x)
                .chain(inputs.iter());
            for &(xname, x) in others {
                if o.overlaps(x) {
                    return Err(CudaKernelError::Overlap {
                        op: self.op,
                        output: oname,
                        other: xname,
                    });
                }
            }
        }
        Ok(())
    }

    fn driver(
        &self,
        call: &'static str,
    ) -> impl FnOnce(cudarc::driver::DriverError) -> CudaKernelError {
        let op = self.op;
        move |source| CudaKernelError::Driver { op, call, source }
    }

    /// Enqueues `plan` on the stream: allocates its scratch slots from the device's caching
    /// allocator (on this stream), then issues its steps in order. Returns the scratch buffers
    /// (slot order); dropping them afterwards is safe (stream-ordered reuse).
    ///
    /// # Safety
    /// Every [`Ptr::Dev`] in the plan must lie in a live device allocation of this context that
    /// extends over every element the step using it reads or writes (given the sizes the step
    /// carries); outputs must not overlap inputs unless the kernel is documented in-place; and
    /// the caller's buffers must only be used by other streams in an order established with
    /// events (the stream-ordering contract of all launched work).
    pub(crate) unsafe fn exec(&self, plan: &Plan) -> Result<Vec<Buffer>> {
        let op = self.op;
        let mut scratch = Vec::with_capacity(plan.scratch.len());
        let mut bases = Vec::with_capacity(plan.scratch.len());
        for &(count, elem) in &plan.scratch {
            let buf = self.k.scratch(op, self.stream, count, elem)?;
            bases.push(self.buf("scratch", buf.data(), elem)?.ptr);
            scratch.push(buf);
        }
        let resolve = |p: Ptr| -> u64 {
            match p {
                Ptr::Dev(a) => a,
                Ptr::Scratch { slot, offset } => bases[slot] + offset,
            }
        };
        self.k
            .inner
            .ctx
            .bind_to_thread()
            .map_err(self.driver("cuCtxSetCurrent"))?;
        for step in &plan.steps {
            // `--profile`: a pair of CUDA events around the step (nothing when not recording).
            let mark = fsdp_alloc::trace::gpu_begin(self.k.device().id(), self.cs);
            self.issue(step, &resolve)?;
            if mark.is_some() {
                let (cat, name) = step_label(step);
                fsdp_alloc::trace::gpu_end(mark, self.stream.name(), cat, name.into());
            }
        }
        Ok(scratch)
    }

    /// Issues one step of a plan on the stream (see [`Call::exec`] for the contract).
    ///
    /// # Safety
    /// As for [`Call::exec`], for this step.
    unsafe fn issue(&self, step: &Step, resolve: &dyn Fn(Ptr) -> u64) -> Result<()> {
        let op = self.op;
        {
            match step {
                Step::Memset { dst, byte, bytes } => {
                    // SAFETY: the range is inside a live allocation (the caller's contract for
                    // `Ptr::Dev`; scratch slots are sized by the plan); ordered on `self.cs`.
                    unsafe {
                        cudarc::driver::result::memset_d8_async(
                            resolve(*dst),
                            *byte,
                            *bytes,
                            self.cs.cu_stream(),
                        )
                    }
                    .map_err(self.driver("cuMemsetD8Async"))?;
                }
                Step::Copy { dst, src, bytes } => {
                    // SAFETY: both ranges are inside live, disjoint allocations (the caller's
                    // contract); ordered on `self.cs`.
                    unsafe {
                        cudarc::driver::result::memcpy_dtod_async(
                            resolve(*dst),
                            resolve(*src),
                            *bytes,
                            self.cs.cu_stream(),
                        )
                    }
                    .map_err(self.driver("cuMemcpyDtoDAsync"))?;
                }
                Step::Launch { kernel, grid, args } => {
                    let sig = kernel.signature();
                    let kinds: Vec<ArgKind> = args.iter().map(PArg::kind).collect();
                    if sig != kinds.as_slice() {
                        return Err(CudaKernelError::Internal {
                            op,
                            detail: format!(
                                "kernel {} takes {sig:?} but the plan gives {kinds:?}",
                                kernel.name()
                            ),
                        });
                    }
                    let args: Vec<Arg> = args
                        .iter()
                        .map(|a| match *a {
                            PArg::U64(v) => Arg::U64(v),
                            PArg::F32(v) => Arg::F32(v),
                            PArg::F64(v) => Arg::F64(v),
                            PArg::Ptr(p) => Arg::U64(resolve(p)),
                            PArg::View(v) => Arg::View(v),
                        })
                        .collect();
                    let func = self.k.inner.module.function(*kernel).ok_or_else(|| {
                        CudaKernelError::Internal {
                            op,
                            detail: format!(
                                "kernel {} is not in the program's table (program::FAMILIES)",
                                kernel.name()
                            ),
                        }
                    })?;
                    let mut builder = self.cs.launch_builder(func);
                    for a in &args {
                        match a {
                            Arg::U64(v) => builder.arg(v),
                            Arg::F32(v) => builder.arg(v),
                            Arg::F64(v) => builder.arg(v),
                            Arg::View(v) => builder.arg(v),
                        };
                    }
                    let cfg = LaunchConfig {
                        grid_dim: ((*grid).max(1), 1, 1),
                        block_dim: (BLOCK, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    // SAFETY: the parameter kinds and count match the kernel's parameter list
                    // (checked above; each `Kernel`'s declaration is checked against the CUDA source
                    // by a unit test); each value lives in `args` until the launch returns (the
                    // driver copies parameters at launch); pointer validity, extents and
                    // ordering are the caller's contract; the launch goes to `self.cs`, a
                    // stream of this context.
                    unsafe { builder.launch(cfg) }.map_err(self.driver("cuLaunchKernel"))?;
                }
                Step::Gemm {
                    g,
                    a,
                    b,
                    c,
                    alpha,
                    beta,
                    types,
                } => {
                    let blas = self.k.blas_for(op, self.cs)?;
                    if types.is_plain_f32() {
                        // SAFETY: the handle is bound to `self.cs` (one handle per stream, never
                        // re-bound); the operands hold the f32 batches `g` describes (the
                        // caller's contract); alpha and beta are host scalars (the handle's
                        // default pointer mode) that outlive the call. With beta = 0 cuBLAS does
                        // not read C.
                        unsafe {
                            cudarc::cublas::result::sgemm_strided_batched(
                                *blas.handle(),
                                g.op_first,
                                g.op_second,
                                g.m,
                                g.n,
                                g.k,
                                alpha,
                                resolve(*b) as *const f32,
                                g.ld_first,
                                g.stride_first,
                                resolve(*a) as *const f32,
                                g.ld_second,
                                g.stride_second,
                                beta,
                                resolve(*c) as *mut f32,
                                g.ldc,
                                g.stride_c,
                                g.batch,
                            )
                        }
                        .map_err(|source| CudaKernelError::Blas {
                            op,
                            call: "cublasSgemmStridedBatched",
                            source,
                        })?;
                    } else {
                        use cudarc::cublas::sys::{
                            cublasComputeType_t::{
                                CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32,
                            },
                            cublasGemmAlgo_t,
                            cudaDataType_t::{CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F},
                        };
                        let dt = |t: GemmType| match t {
                            GemmType::F32 => CUDA_R_32F,
                            GemmType::F16 => CUDA_R_16F,
                            GemmType::Bf16 => CUDA_R_16BF,
                        };
                        let compute = if types.tf32 {
                            CUBLAS_COMPUTE_32F_FAST_TF32
                        } else {
                            CUBLAS_COMPUTE_32F
                        };
                        // SAFETY: as for the f32 call above; the operands hold elements of the
                        // types passed (the plan's `types`, checked by the caller against the
                        // buffers); with CUBLAS_COMPUTE_32F(_FAST_TF32) alpha and beta are f32
                        // host scalars, as passed, and live until the call returns.
                        unsafe {
                            cudarc::cublas::result::gemm_strided_batched_ex(
                                *blas.handle(),
                                g.op_first,
                                g.op_second,
                                g.m,
                                g.n,
                                g.k,
                                (alpha as *const f32).cast(),
                                resolve(*b) as *const std::ffi::c_void,
                                dt(types.ab),
                                g.ld_first,
                                g.stride_first,
                                resolve(*a) as *const std::ffi::c_void,
                                dt(types.ab),
                                g.ld_second,
                                g.stride_second,
                                (beta as *const f32).cast(),
                                resolve(*c) as *mut std::ffi::c_void,
                                dt(types.c),
                                g.ldc,
                                g.stride_c,
                                g.batch,
                                compute,
                                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                            )
                        }
                        .map_err(|source| CudaKernelError::Blas {
                            op,
                            call: "cublasGemmStridedBatchedEx",
                            source,
                        })?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Blocks until all work enqueued on the stream so far has completed: a host wait of the
    /// calling thread, counted by `fsdp_alloc::stream::host_syncs` (every host wait of these
    /// kernels goes through here).
    pub(crate) fn synchronize(&self) -> Result<()> {
        fsdp_alloc::stream::count_host_sync();
        self.cs
            .synchronize()
            .map_err(self.driver("cuStreamSynchronize"))
    }

    /// [`Call::read_to_host`] without the synchronization, for a caller that has just
    /// synchronized this stream itself (the copy is part of that host wait).
    ///
    /// # Safety
    /// As [`Call::read_to_host`], and the stream's work that writes `src` has completed (the
    /// caller synchronized the stream after enqueueing it).
    pub(crate) unsafe fn read_to_host_synced<T: bytemuck::Pod>(
        &self,
        src: u64,
        dst: &mut [T],
    ) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: the source range is live (the caller's contract) and its writers have
        // completed (the caller synchronized the stream); the copy is synchronous, so `dst` is
        // written before the call returns and is not used by the driver afterwards; any bit
        // pattern is a valid `T` (Pod).
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(dst, src) }
            .map_err(self.driver("cuMemcpyDtoH"))
    }

    /// [`Call::write_from_host`] without the synchronization, for a caller that has just
    /// synchronized this stream itself (the copy is part of that host wait).
    ///
    /// # Safety
    /// As [`Call::write_from_host`], and no work enqueued on the stream still uses `dst` (the
    /// caller synchronized the stream).
    pub(crate) unsafe fn write_from_host_synced<T: bytemuck::Pod>(
        &self,
        src: &[T],
        dst: u64,
    ) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: the destination range is live (the caller's contract) and no earlier work on
        // the stream still uses it (the caller synchronized it); the copy is synchronous, so
        // `src` is read completely before the call returns.
        unsafe { cudarc::driver::result::memcpy_htod_sync(dst, src) }
            .map_err(self.driver("cuMemcpyHtoD"))
    }

    /// Copies `dst.len()` elements at device address `src` to the host, after the stream's work.
    ///
    /// # Safety
    /// `src..src + size_of_val(dst)` must lie in a live device allocation of this context.
    pub(crate) unsafe fn read_to_host<T: bytemuck::Pod>(
        &self,
        src: u64,
        dst: &mut [T],
    ) -> Result<()> {
        self.synchronize()?;
        // SAFETY: the caller's contract, and the stream was synchronized above.
        unsafe { self.read_to_host_synced(src, dst) }
    }

    /// Copies `src` from the host to device address `dst`, after the stream's work; the data is
    /// on the device when this returns.
    ///
    /// # Safety
    /// `dst..dst + size_of_val(src)` must lie in a live device allocation of this context.
    pub(crate) unsafe fn write_from_host<T: bytemuck::Pod>(
        &self,
        src: &[T],
        dst: u64,
    ) -> Result<()> {
        // Earlier work on the stream may still read the destination.
        self.synchronize()?;
        // SAFETY: the caller's contract, and the stream was synchronized above.
        unsafe { self.write_from_host_synced(src, dst) }
    }
}

/// The direction of [`Call::copy_pinned`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PinnedCopy {
    /// Page-locked host memory to device memory (`cuMemcpyHtoDAsync`).
    HostToDevice,
    /// Device memory to page-locked host memory (`cuMemcpyDtoHAsync`).
    DeviceToHost,
}

impl Call<'_> {
    /// Enqueues an asynchronous copy of `host.len()` bytes between the page-locked host range
    /// `host` (whose first byte is at `host_ptr`) and device address `dev` on the stream, in
    /// stream order, without waiting: a host function takes an [`fsdp_alloc::AccessHold`] on
    /// `host` (a read for host→device, a write for device→host) right before the copy runs, and
    /// a second one releases it — and drops the last reference this call holds to `host`'s
    /// memory — right after. A conflicting host access live at that point fails the stream
    /// (reported at the next synchronize).
    ///
    /// # Safety
    /// `dev..dev + host.len()` must lie in a live device allocation of this context, used by
    /// other streams only in an order established with events; `host_ptr` must be
    /// `host.pinned_ptr()`.
    pub(crate) unsafe fn copy_pinned(
        &self,
        dir: PinnedCopy,
        host: &BufferRef,
        host_ptr: u64,
        dev: u64,
    ) -> Result<()> {
        let bytes = host.len();
        let held: Arc<Mutex<Option<fsdp_alloc::AccessHold>>> = Arc::default();
        let (take, range) = (Arc::clone(&held), host.clone());
        let write = dir == PinnedCopy::DeviceToHost;
        self.stream.launch(move || {
            let h = range.hold(write).unwrap_or_else(|e| {
                panic!("asynchronous copy: the page-locked host range is in use: {e}")
            });
            *take.lock().unwrap_or_else(|e| e.into_inner()) = Some(h);
        });
        self.k
            .inner
            .ctx
            .bind_to_thread()
            .map_err(self.driver("cuCtxSetCurrent"))?;
        let mark = fsdp_alloc::trace::gpu_begin(self.k.device().id(), self.cs);
        let (call, r) = match dir {
            // SAFETY: `host_ptr..+bytes` is live page-locked memory (the caller's contract;
            // `host`'s clone in the releasing host function keeps the segment alive until the
            // copy has run, and the hold keeps host code off the range meanwhile); the device
            // range is live (the caller's contract); the copy is ordered on `self.cs`.
            PinnedCopy::HostToDevice => ("cuMemcpyHtoDAsync", unsafe {
                cudarc::driver::sys::cuMemcpyHtoDAsync_v2(
                    dev,
                    host_ptr as *const std::ffi::c_void,
                    bytes,
                    self.cs.cu_stream(),
                )
                .result()
            }),
            // SAFETY: as above, the copy writing the host range instead of reading it.
            PinnedCopy::DeviceToHost => ("cuMemcpyDtoHAsync", unsafe {
                cudarc::driver::sys::cuMemcpyDtoHAsync_v2(
                    host_ptr as *mut std::ffi::c_void,
                    dev,
                    bytes,
                    self.cs.cu_stream(),
                )
                .result()
            }),
        };
        if mark.is_some() {
            let name = match dir {
                PinnedCopy::HostToDevice => "copy h2d",
                PinnedCopy::DeviceToHost => "copy d2h",
            };
            fsdp_alloc::trace::gpu_end(mark, self.stream.name(), "copy", name.into());
        }
        let keep = host.clone();
        self.stream.launch(move || {
            drop(held.lock().unwrap_or_else(|e| e.into_inner()).take());
            drop(keep);
        });
        r.map_err(self.driver(call))
    }
}

/// The GPU timeline's category and name of a plan step (`--profile`).
fn step_label(step: &Step) -> (&'static str, &'static str) {
    match step {
        Step::Memset { .. } => ("copy", "memset"),
        Step::Copy { .. } => ("copy", "copy d2d"),
        Step::Launch { kernel, .. } => ("kernel", kernel.name()),
        Step::Gemm { .. } => ("kernel", "cublasSgemmStridedBatched"),
    }
}
