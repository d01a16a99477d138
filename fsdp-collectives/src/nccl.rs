//! The NCCL backend (`cuda` feature), over `cudarc::nccl`.
//!
//! **Status: compile-checked only.** This machine has no GPU, no CUDA driver and no NCCL; none
//! of this module has ever run. `cargo xtask gpu-test` is where it would be exercised.
//!
//! ## Design
//! - One **communicator thread** per rank owns the CUDA context, a dedicated CUDA *comm stream*
//!   and every communicator of the rank (the world communicator and those made by
//!   [`ProcessGroup::split`] with `ncclCommSplit`). cudarc's communicators are raw pointers that
//!   are not `Send`, so they never leave that thread; [`NcclGroup`] handles talk to it through a
//!   channel and are `Send + Sync`.
//! - Creation: rank 0 makes the NCCL unique id and publishes it in the [`TcpStore`]; the others
//!   read it from there (torchrun-style `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` with
//!   [`NcclGroup::from_env`]).
//! - **Device path** (the FSDP case): buffers in device memory ([`BufferRef::device_ptr`]) and a
//!   CUDA stream of the group's device ([`Stream::cuda_stream`]). The communicator thread agrees
//!   on the descriptors with the other ranks (below), then enqueues the NCCL kernel directly on
//!   the caller's CUDA stream, reading and writing the buffers in place, and returns; the
//!   issuing thread records the [`Work`]'s event after it. So issuing blocks until every rank
//!   has *issued* the same collective (a small host rendezvous), never until it has *run*. The
//!   communicator thread keeps the buffers alive until the kernel's completion event fires and
//!   acts as watchdog (polling once per millisecond while kernels are pending).
//! - **Host path**: host buffers on a CPU stream. The collective runs as work on the stream,
//!   which hands it to the communicator thread and waits: the input is copied to a device
//!   staging buffer, reduced on the thread's internal stream, and copied back. Correct, not fast.
//!   Any other mix (device memory on a CPU stream, host memory on a CUDA stream, another
//!   device) is an [`CollectiveError::InvalidBuffer`] agreed on by every rank.
//! - **No hangs on bad calls.** Before each collective the ranks all-gather a small descriptor
//!   (kind, dtype, lengths, op, accumulation dtype, root) and run the same validation as the
//!   thread backend, so a bad call fails on every rank instead of deadlocking NCCL. A rank whose
//!   stream had failed before reaching the collective still takes part in that exchange,
//!   flagged, so its peers fail at once.
//! - A watchdog polls the comm stream (sleeping between polls) and `ncclCommGetAsyncError`;
//!   past the timeout it aborts the communicator, which then refuses further collectives.
//!
//! ## Reduction precision
//! With the accumulation dtype equal to the buffer dtype NCCL reduces natively (its order and
//! internal precision). f16/bf16 buffers with f32 accumulation (the default): on the host path
//! they are widened to f32, reduced by NCCL in f32, and rounded once; on the device path there is
//! no cast kernel in this crate, so NCCL reduces them natively in the buffer dtype — reduce f32
//! buffers (FSDP's `reduce_dtype`) when f32 accumulation matters.

use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam::channel::{bounded, unbounded, Receiver, Sender};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr};
use cudarc::nccl::{result, sys};
use fsdp_alloc::{BufferRef, DType, DeviceId, Stream};
use half::{bf16, f16};

use crate::desc::{validate, BufferProblem, OpDesc, WORDS};
use crate::error::{CollectiveError, Result};
use crate::group::{locate_in_partition, ProcessGroup};
use crate::store::{RendezvousEnv, TcpStore};
use crate::types::{DeviceSlice, OpKind, Outcome, ReduceOp, Work};

/// Checks, without letting cudarc panic, that the CUDA driver and NCCL libraries can be loaded.
pub fn nccl_available() -> Result<()> {
    // SAFETY: `is_culib_present` only tries to dlopen the driver library and reports whether it
    // could; it has no preconditions.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CollectiveError::CudaUnavailable(
            "libcuda (the CUDA driver library) was not found; the NCCL backend needs a GPU \
             machine (use ThreadGroup on CPU)"
                .into(),
        ));
    }
    // SAFETY: as above, for libnccl.
    if !unsafe { sys::is_culib_present() } {
        return Err(CollectiveError::CudaUnavailable(
            "libnccl was not found; install NCCL or put it on the library path".into(),
        ));
    }
    Ok(())
}

fn nccl_error(call: &'static str, rank: usize, code: sys::ncclResult_t) -> CollectiveError {
    // SAFETY: ncclGetErrorString returns a pointer to a static, NUL-terminated string for any
    // result code (the library is loaded: we only get codes from calls that ran).
    let message = unsafe {
        let p = sys::ncclGetErrorString(code);
        if p.is_null() {
            String::from("(no error string)")
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    CollectiveError::Nccl {
        call,
        rank,
        code: format!("{code:?}"),
        message,
    }
}

fn check(
    call: &'static str,
    rank: usize,
    r: std::result::Result<result::NcclStatus, result::NcclError>,
) -> Result<()> {
    r.map(|_| ()).map_err(|e| nccl_error(call, rank, e.0))
}

fn cuda_error(
    call: &'static str,
    rank: usize,
) -> impl Fn(cudarc::driver::DriverError) -> CollectiveError {
    move |e| CollectiveError::Cuda {
        call,
        rank,
        message: e.to_string(),
    }
}

fn nccl_dtype(d: DType) -> sys::ncclDataType_t {
    match d {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::I32 => sys::ncclDataType_t::ncclInt32,
        DType::I64 => sys::ncclDataType_t::ncclInt64,
        DType::U8 => sys::ncclDataType_t::ncclUint8,
    }
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
    }
}

/// A communicator owned by the communicator thread; aborted if it timed out, destroyed on drop.
///
/// Each group has two NCCL communicators over the same ranks: `comm` carries the data (enqueued
/// on callers' streams in issue order) and `control` only the descriptor exchange (on the
/// thread's internal stream, host-synchronized). Keeping them apart means an exchange never runs
/// on the GPU concurrently with a data kernel *of the same communicator* on another stream.
struct RawComm {
    comm: sys::ncclComm_t,
    control: sys::ncclComm_t,
    size: usize,
    broken: Option<String>,
}

impl RawComm {
    /// Makes the control communicator (collective over the ranks of `comm`).
    fn new(rank: usize, comm: sys::ncclComm_t, size: usize) -> Result<RawComm> {
        let mut control: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a live communicator of this thread that every rank splits at the
        // same point; `control` is a valid out-pointer; a null config inherits the parent's.
        let r =
            unsafe { sys::ncclCommSplit(comm, 0, rank as i32, &mut control, std::ptr::null_mut()) };
        let mut raw = RawComm {
            comm,
            control,
            size,
            broken: None,
        };
        if r != sys::ncclResult_t::ncclSuccess {
            raw.control = std::ptr::null_mut();
            raw.broken = Some("ncclCommSplit of the control communicator failed".into());
            return Err(nccl_error("ncclCommSplit", rank, r)); // `raw` drop aborts `comm`
        }
        Ok(raw)
    }

    /// Aborts both communicators now (their pending kernels exit); later use is refused.
    fn abort(&mut self, why: String) {
        self.broken.get_or_insert(why);
        for c in [&mut self.comm, &mut self.control] {
            if !c.is_null() {
                // SAFETY: a live communicator of this thread, aborted exactly once (the pointer
                // is nulled right after, so neither a second abort nor Drop touches it).
                unsafe {
                    let _ = sys::ncclCommAbort(*c);
                }
                *c = std::ptr::null_mut();
            }
        }
    }
}

impl Drop for RawComm {
    fn drop(&mut self) {
        for c in [self.comm, self.control] {
            if c.is_null() {
                continue; // aborted already
            }
            // SAFETY: `c` came from ncclCommInitRank/ncclCommSplit on this thread and is
            // released exactly once; the thread waited for its pending kernels first (or the
            // communicator failed, and then it is aborted instead).
            unsafe {
                if self.broken.is_some() {
                    let _ = sys::ncclCommAbort(c);
                } else {
                    let _ = sys::ncclCommDestroy(c);
                }
            }
        }
    }
}

/// A request to the communicator thread. Requests of one communicator run strictly in the order
/// of `seq` (the order they were issued), whatever order the issuing streams deliver them in, so
/// every rank hands NCCL the same sequence.
enum Request {
    Op {
        comm: usize,
        seq: u64,
        desc: OpDesc,
        input: Option<BufferRef>,
        output: Option<BufferRef>,
        /// The issuing stream had failed: take part in the descriptor exchange only.
        abandoned: bool,
        reply: Sender<Result<()>>,
    },
    /// Device path: agree, then enqueue the NCCL kernel on `stream` over device memory.
    Enqueue {
        comm: usize,
        seq: u64,
        desc: OpDesc,
        input: Option<BufferRef>,
        output: BufferRef,
        stream: Arc<CudaStream>,
        outcome: Outcome,
        reply: Sender<Result<()>>,
    },
    Split {
        comm: usize,
        seq: u64,
        color: i32,
        key: i32,
        size: usize,
        reply: Sender<Result<usize>>,
    },
}

impl Request {
    fn key(&self) -> (usize, u64) {
        match self {
            Request::Op { comm, seq, .. }
            | Request::Enqueue { comm, seq, .. }
            | Request::Split { comm, seq, .. } => (*comm, *seq),
        }
    }
}

/// A kernel enqueued on a caller's stream, watched until it completes.
struct Pending {
    comm: usize,
    op: OpKind,
    done: CudaEvent,
    started: Instant,
    outcome: Outcome,
    /// Keeps the device memory alive until the kernel has run.
    _buffers: (Option<BufferRef>, BufferRef),
}

/// What the communicator thread owns.
struct CommThread {
    rank: usize,
    timeout: Duration,
    stream: Arc<CudaStream>,
    comms: Vec<RawComm>,
    pending: Vec<Pending>,
}

/// Host bytes of `b` (a copy), optionally widened from f16/bf16 to f32.
fn host_bytes(
    b: &BufferRef,
    dtype: DType,
    widen: bool,
) -> std::result::Result<Vec<u8>, fsdp_alloc::AllocError> {
    Ok(match (widen, dtype) {
        (true, DType::F16) => {
            let v: Vec<f32> = b.read::<f16>()?.iter().map(|x| x.to_f32()).collect();
            bytemuck::cast_slice(&v).to_vec()
        }
        (true, DType::BF16) => {
            let v: Vec<f32> = b.read::<bf16>()?.iter().map(|x| x.to_f32()).collect();
            bytemuck::cast_slice(&v).to_vec()
        }
        _ => b.read::<u8>()?.to_vec(),
    })
}

/// Writes `bytes` (f32 if `widen`, rounded back to `dtype`) into `b`.
fn store_bytes(
    b: &BufferRef,
    dtype: DType,
    widen: bool,
    bytes: &[u8],
) -> std::result::Result<(), fsdp_alloc::AllocError> {
    match (widen, dtype) {
        (true, DType::F16) | (true, DType::BF16) => {
            let v: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            if dtype == DType::F16 {
                let mut w = b.write::<f16>()?;
                w.iter_mut()
                    .zip(&v)
                    .for_each(|(d, &x)| *d = f16::from_f32(x));
            } else {
                let mut w = b.write::<bf16>()?;
                w.iter_mut()
                    .zip(&v)
                    .for_each(|(d, &x)| *d = bf16::from_f32(x));
            }
        }
        _ => b.write::<u8>()?.copy_from_slice(bytes),
    }
    Ok(())
}

impl CommThread {
    fn comm(&self, id: usize) -> Result<sys::ncclComm_t> {
        self.comms_of(id).map(|(data, _)| data)
    }

    /// (data, control) communicators of group `id`.
    fn comms_of(&self, id: usize) -> Result<(sys::ncclComm_t, sys::ncclComm_t)> {
        match self.comms.get(id) {
            Some(RawComm {
                broken: None,
                comm,
                control,
                ..
            }) => Ok((*comm, *control)),
            Some(RawComm {
                broken: Some(why), ..
            }) => Err(CollectiveError::CudaUnavailable(format!(
                "communicator {id} of rank {} was aborted earlier: {why}",
                self.rank
            ))),
            None => Err(CollectiveError::CudaUnavailable(format!(
                "no communicator {id}"
            ))),
        }
    }

    fn upload(&self, bytes: &[u8]) -> Result<CudaSlice<u8>> {
        let mut d = self
            .stream
            .alloc_zeros::<u8>(bytes.len().max(1))
            .map_err(cuda_error("cuMemAlloc", self.rank))?;
        if !bytes.is_empty() {
            self.stream
                .memcpy_htod(bytes, &mut d)
                .map_err(cuda_error("cuMemcpyHtoD", self.rank))?;
        }
        Ok(d)
    }

    fn download(&self, d: &CudaSlice<u8>, len: usize) -> Result<Vec<u8>> {
        let mut host = vec![0u8; d.len()];
        self.stream
            .memcpy_dtoh(d, &mut host[..])
            .map_err(cuda_error("cuMemcpyDtoH", self.rank))?;
        self.stream
            .synchronize()
            .map_err(cuda_error("cuStreamSynchronize", self.rank))?;
        host.truncate(len);
        Ok(host)
    }

    /// Waits for the comm stream, watching NCCL's asynchronous errors and the timeout (sleeping
    /// between polls). On failure the communicator is aborted.
    fn wait(&mut self, id: usize, op: OpKind, comm: sys::ncclComm_t) -> Result<()> {
        let rank = self.rank;
        let ev = self
            .stream
            .record_event(None)
            .map_err(cuda_error("cuEventRecord", rank))?;
        let started = Instant::now();
        let mut nap = Duration::from_micros(20);
        let failure = loop {
            match ev.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => break cuda_error("cuEventQuery", rank)(e),
            }
            let mut async_err = sys::ncclResult_t::ncclSuccess;
            // SAFETY: `comm` is a live communicator of this thread; `async_err` is a valid
            // out-pointer.
            let r = unsafe { sys::ncclCommGetAsyncError(comm, &mut async_err) };
            if r != sys::ncclResult_t::ncclSuccess {
                break nccl_error("ncclCommGetAsyncError", rank, r);
            }
            if async_err != sys::ncclResult_t::ncclSuccess
                && async_err != sys::ncclResult_t::ncclInProgress
            {
                break nccl_error("ncclCommGetAsyncError", rank, async_err);
            }
            if started.elapsed() >= self.timeout {
                break CollectiveError::Timeout {
                    op,
                    group: format!("nccl/comm{id}"),
                    seq: 0,
                    rank,
                    waited: started.elapsed(),
                    missing: Vec::new(),
                };
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(1));
        };
        if let Some(c) = self.comms.get_mut(id) {
            c.abort(failure.to_string());
        }
        Err(failure)
    }

    /// Exchanges descriptors (all-gather of a few integers) and validates them on every rank.
    fn agree(&mut self, id: usize, desc: &OpDesc, abandoned: bool) -> Result<()> {
        let (_, control) = self.comms_of(id)?;
        let rank = self.rank;
        let world = self.comms[id].size;
        let mut words = desc.to_words().to_vec();
        words.push(i64::from(abandoned));
        let send = self.upload(bytemuck::cast_slice(&words))?;
        let recv = self.upload(&vec![0u8; world * (WORDS + 1) * 8])?;
        {
            let (sp, _s) = send.device_ptr(&self.stream);
            let (rp, _r) = recv.device_ptr(&self.stream);
            // SAFETY: both device buffers live until after the wait below; sizes match
            // (WORDS+1 i64 per rank, `world` ranks); the stream belongs to this context.
            check("ncclAllGather", rank, unsafe {
                result::all_gather(
                    sp as *const c_void,
                    rp as *mut c_void,
                    WORDS + 1,
                    sys::ncclDataType_t::ncclInt64,
                    control,
                    self.stream.cu_stream() as sys::cudaStream_t,
                )
            })?;
        }
        self.wait(id, desc.kind, control)?;
        let bytes = self.download(&recv, world * (WORDS + 1) * 8)?;
        let all: Vec<i64> = bytes
            .chunks_exact(8)
            .map(|c| i64::from_ne_bytes(c.try_into().unwrap_or([0; 8])))
            .collect();
        let mut descs = Vec::with_capacity(world);
        for (r, w) in all.chunks_exact(WORDS + 1).enumerate() {
            if w[WORDS] != 0 {
                return Err(CollectiveError::PeerFailed {
                    op: desc.kind,
                    group: format!("nccl/comm{id}"),
                    seq: 0,
                    rank,
                    peer: r,
                    message: "its stream had failed before reaching the collective".into(),
                });
            }
            descs.push(OpDesc::from_words(&w[..WORDS]).ok_or_else(|| {
                CollectiveError::PeerFailed {
                    op: desc.kind,
                    group: format!("nccl/comm{id}"),
                    seq: 0,
                    rank,
                    peer: r,
                    message: "sent an undecodable collective descriptor".into(),
                }
            })?);
        }
        validate(&format!("nccl/comm{id}"), 0, &descs)
    }

    fn run(
        &mut self,
        id: usize,
        desc: OpDesc,
        input: Option<BufferRef>,
        output: Option<BufferRef>,
        abandoned: bool,
    ) -> Result<()> {
        let rank = self.rank;
        self.agree(id, &desc, abandoned)?;
        if abandoned {
            return Err(CollectiveError::StreamFailed {
                op: desc.kind,
                rank,
                message: "the issuing stream had failed".into(),
            });
        }
        let comm = self.comm(id)?;
        let op = desc.kind;
        let buf = |source| CollectiveError::Buffer { op, rank, source };
        let missing = || CollectiveError::InvalidBuffer {
            op,
            rank,
            detail: "descriptor without its buffer".into(),
        };
        let widen =
            desc.accum == Some(DType::F32) && matches!(desc.in_dtype, DType::F16 | DType::BF16);
        let wire = if widen { DType::F32 } else { desc.in_dtype };
        let esz = wire.size();
        let stream = self.stream.cu_stream() as sys::cudaStream_t;
        match op {
            // The descriptor exchange above was already a rendezvous of every rank.
            OpKind::Barrier => Ok(()),
            OpKind::AllGather => {
                let inp = input.ok_or_else(missing)?;
                let out = output.ok_or_else(missing)?;
                let send = self.upload(&host_bytes(&inp, desc.in_dtype, false).map_err(buf)?)?;
                let recv = self.upload(&vec![0u8; desc.out_len * esz])?;
                {
                    let (sp, _s) = send.device_ptr(&self.stream);
                    let (rp, _r) = recv.device_ptr(&self.stream);
                    // SAFETY: send holds in_len elements and recv world × in_len (validated on
                    // every rank); both live until after the wait.
                    check("ncclAllGather", rank, unsafe {
                        result::all_gather(
                            sp as *const c_void,
                            rp as *mut c_void,
                            desc.in_len,
                            nccl_dtype(wire),
                            comm,
                            stream,
                        )
                    })?;
                }
                self.wait(id, op, comm)?;
                let bytes = self.download(&recv, desc.out_len * esz)?;
                store_bytes(&out, desc.in_dtype, false, &bytes).map_err(buf)
            }
            OpKind::ReduceScatter => {
                let inp = input.ok_or_else(missing)?;
                let out = output.ok_or_else(missing)?;
                let send = self.upload(&host_bytes(&inp, desc.in_dtype, widen).map_err(buf)?)?;
                let recv = self.upload(&vec![0u8; desc.out_len * esz])?;
                {
                    let (sp, _s) = send.device_ptr(&self.stream);
                    let (rp, _r) = recv.device_ptr(&self.stream);
                    // SAFETY: send holds world × out_len elements of `wire`, recv out_len; both
                    // live until after the wait.
                    check("ncclReduceScatter", rank, unsafe {
                        result::reduce_scatter(
                            sp as *const c_void,
                            rp as *mut c_void,
                            desc.out_len,
                            nccl_dtype(wire),
                            nccl_op(desc.op.unwrap_or(ReduceOp::Sum)),
                            comm,
                            stream,
                        )
                    })?;
                }
                self.wait(id, op, comm)?;
                let bytes = self.download(&recv, desc.out_len * esz)?;
                store_bytes(&out, desc.in_dtype, widen, &bytes).map_err(buf)
            }
            OpKind::AllReduce | OpKind::Broadcast => {
                let b = output.ok_or_else(missing)?;
                let data = self.upload(&host_bytes(&b, desc.in_dtype, widen).map_err(buf)?)?;
                {
                    let (p, _g) = data.device_ptr(&self.stream);
                    if op == OpKind::AllReduce {
                        // SAFETY: in place over in_len elements of `wire` in a live buffer.
                        check("ncclAllReduce", rank, unsafe {
                            result::all_reduce(
                                p as *const c_void,
                                p as *mut c_void,
                                desc.in_len,
                                nccl_dtype(wire),
                                nccl_op(desc.op.unwrap_or(ReduceOp::Sum)),
                                comm,
                                stream,
                            )
                        })?;
                    } else {
                        let root = desc.root.unwrap_or(0) as i32;
                        // SAFETY: in place over in_len elements in a live buffer; root < world
                        // (validated).
                        check("ncclBroadcast", rank, unsafe {
                            result::broadcast(
                                p as *const c_void,
                                p as *mut c_void,
                                desc.in_len,
                                nccl_dtype(wire),
                                root,
                                comm,
                                stream,
                            )
                        })?;
                    }
                }
                self.wait(id, op, comm)?;
                let bytes = self.download(&data, desc.in_len * esz)?;
                store_bytes(&b, desc.in_dtype, widen, &bytes).map_err(buf)
            }
        }
    }

    /// Device path: agree with the other ranks, then enqueue the kernel on the caller's stream.
    fn enqueue(
        &mut self,
        id: usize,
        desc: OpDesc,
        input: Option<BufferRef>,
        output: BufferRef,
        user: &Arc<CudaStream>,
        outcome: Outcome,
    ) -> Result<()> {
        self.poll_pending();
        self.agree(id, &desc, false)?;
        let comm = self.comm(id)?;
        let rank = self.rank;
        let op = desc.kind;
        let placement = || CollectiveError::InvalidBuffer {
            op,
            rank,
            detail: "device path without device memory".into(),
        };
        let out = output.device_ptr().ok_or_else(placement)?;
        let inp = match &input {
            Some(b) => b.device_ptr().ok_or_else(placement)?,
            None => out,
        };
        let dt = nccl_dtype(desc.in_dtype);
        let red = nccl_op(desc.op.unwrap_or(ReduceOp::Sum));
        let cs = user.cu_stream() as sys::cudaStream_t;
        let (ip, optr) = (inp as *const c_void, out as *mut c_void);
        // SAFETY (every arm): the pointers are device addresses of live allocations of this
        // context (the BufferRefs, kept in `pending` until the kernel's completion event fires,
        // hold their segments); their lengths match the counts (validated from every rank's
        // descriptor); `cs` is a stream of this context, and stream order places the kernel
        // after the work that produced the inputs and before the work that reads the outputs.
        let r = unsafe {
            match op {
                OpKind::AllGather => result::all_gather(ip, optr, desc.in_len, dt, comm, cs),
                OpKind::ReduceScatter => {
                    result::reduce_scatter(ip, optr, desc.out_len, dt, red, comm, cs)
                }
                OpKind::AllReduce => result::all_reduce(ip, optr, desc.in_len, dt, red, comm, cs),
                OpKind::Broadcast => {
                    let root = desc.root.unwrap_or(0) as i32;
                    result::broadcast(ip, optr, desc.in_len, dt, root, comm, cs)
                }
                OpKind::Barrier => Ok(result::NcclStatus::Success),
            }
        };
        check(op.name(), rank, r)?;
        let done = user
            .record_event(None)
            .map_err(cuda_error("cuEventRecord", rank))?;
        self.pending.push(Pending {
            comm: id,
            op,
            done,
            started: Instant::now(),
            outcome,
            _buffers: (input, output),
        });
        Ok(())
    }

    /// Watchdog over enqueued kernels: retires completed ones (checking NCCL's asynchronous
    /// error); past the timeout, or on an asynchronous error, it records the error in the
    /// collective's [`Work`] and aborts the communicator, which makes its kernels exit.
    fn poll_pending(&mut self) {
        let rank = self.rank;
        let mut i = 0;
        while i < self.pending.len() {
            let p = &self.pending[i];
            let complete = p.done.try_is_complete();
            let failure = match (&complete, self.comms.get(p.comm)) {
                (Err(e), _) => Some(cuda_error("cuEventQuery", rank)(*e)),
                (
                    _,
                    Some(RawComm {
                        comm, broken: None, ..
                    }),
                ) => {
                    let mut async_err = sys::ncclResult_t::ncclSuccess;
                    // SAFETY: `comm` is a live communicator of this thread; valid out-pointer.
                    let r = unsafe { sys::ncclCommGetAsyncError(*comm, &mut async_err) };
                    if r != sys::ncclResult_t::ncclSuccess {
                        Some(nccl_error("ncclCommGetAsyncError", rank, r))
                    } else if async_err != sys::ncclResult_t::ncclSuccess
                        && async_err != sys::ncclResult_t::ncclInProgress
                    {
                        Some(nccl_error("ncclCommGetAsyncError", rank, async_err))
                    } else if !matches!(complete, Ok(true)) && p.started.elapsed() >= self.timeout {
                        Some(CollectiveError::Timeout {
                            op: p.op,
                            group: format!("nccl/comm{}", p.comm),
                            seq: 0,
                            rank,
                            waited: p.started.elapsed(),
                            missing: Vec::new(),
                        })
                    } else {
                        None
                    }
                }
                (_, _) => None,
            };
            if let Some(e) = failure {
                *p.outcome.lock().unwrap_or_else(|x| x.into_inner()) = Some(Err(e.clone()));
                let id = p.comm;
                if let Some(c) = self.comms.get_mut(id) {
                    // Aborting makes the communicator's pending kernels exit, so their
                    // completion events fire and the callers' streams move on.
                    c.abort(e.to_string());
                }
            }
            if matches!(complete, Ok(true) | Err(_)) {
                self.pending.swap_remove(i);
            } else {
                i += 1;
            }
        }
    }

    fn split(&mut self, id: usize, color: i32, key: i32, size: usize) -> Result<usize> {
        let parent = self.comm(id)?;
        let mut new: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `parent` is a live communicator of this thread, every rank of it calls split
        // collectively (ProcessGroup::split's contract), `new` is a valid out-pointer, and a
        // null config means "inherit the parent's".
        let r = unsafe { sys::ncclCommSplit(parent, color, key, &mut new, std::ptr::null_mut()) };
        if r != sys::ncclResult_t::ncclSuccess {
            return Err(nccl_error("ncclCommSplit", self.rank, r));
        }
        self.comms.push(RawComm::new(self.rank, new, size)?);
        Ok(self.comms.len() - 1)
    }
}

fn comm_thread_main(
    ordinal: usize,
    rank: usize,
    world: usize,
    id: sys::ncclUniqueId,
    timeout: Duration,
    ready: Sender<Result<()>>,
    rx: Receiver<Request>,
) {
    let init = (|| -> Result<CommThread> {
        let n = CudaContext::device_count().map_err(cuda_error("cuDeviceGetCount", rank))?;
        if ordinal >= n.max(0) as usize {
            return Err(CollectiveError::CudaUnavailable(format!(
                "rank {rank} asked for cuda:{ordinal}, but the driver reports {n} device(s)"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(cuda_error("cuCtxCreate", rank))?;
        // SAFETY: every device buffer of this module is used on the one comm stream only and
        // freed after that stream was synchronized, so cudarc's per-slice events are not needed.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(cuda_error("cuStreamCreate", rank))?;
        ctx.bind_to_thread()
            .map_err(cuda_error("cuCtxSetCurrent", rank))?;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; `id` came from rank 0's ncclGetUniqueId via the
        // store; rank < world.
        check("ncclCommInitRank", rank, unsafe {
            result::comm_init_rank(&mut comm, world as i32, id, rank as i32)
        })?;
        Ok(CommThread {
            rank,
            timeout,
            stream,
            comms: vec![RawComm::new(rank, comm, world)?],
            pending: Vec::new(),
        })
    })();
    let mut ct = match init {
        Ok(ct) => {
            let _ = ready.send(Ok(()));
            ct
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let mut pending: HashMap<(usize, u64), Request> = HashMap::new();
    let mut next: HashMap<usize, u64> = HashMap::new();
    loop {
        // Poll the watchdog once per millisecond while kernels are pending; otherwise block.
        let req = if ct.pending.is_empty() {
            match rx.recv() {
                Ok(r) => r,
                Err(_) => break,
            }
        } else {
            match rx.recv_timeout(Duration::from_millis(1)) {
                Ok(r) => r,
                Err(crossbeam::channel::RecvTimeoutError::Timeout) => {
                    ct.poll_pending();
                    continue;
                }
                Err(crossbeam::channel::RecvTimeoutError::Disconnected) => {
                    // Every handle is gone: let the enqueued kernels finish (bounded by the
                    // watchdog's timeout) before the communicators are destroyed.
                    while !ct.pending.is_empty() {
                        ct.poll_pending();
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    break;
                }
            }
        };
        pending.insert(req.key(), req);
        // Run every request that is next in its communicator's issue order.
        while let Some(key) = pending
            .keys()
            .find(|(c, s)| next.get(c).copied().unwrap_or(0) == *s)
            .copied()
        {
            *next.entry(key.0).or_insert(0) += 1;
            match pending.remove(&key) {
                Some(Request::Op {
                    comm,
                    desc,
                    input,
                    output,
                    abandoned,
                    reply,
                    ..
                }) => {
                    let _ = reply.send(ct.run(comm, desc, input, output, abandoned));
                }
                Some(Request::Enqueue {
                    comm,
                    desc,
                    input,
                    output,
                    stream,
                    outcome,
                    reply,
                    ..
                }) => {
                    let _ = reply.send(ct.enqueue(comm, desc, input, output, &stream, outcome));
                }
                Some(Request::Split {
                    comm,
                    color,
                    key,
                    size,
                    reply,
                    ..
                }) => {
                    let _ = reply.send(ct.split(comm, color, key, size));
                }
                None => {}
            }
        }
    }
}

/// Configuration of an [`NcclGroup`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclConfig {
    /// CUDA device of this rank.
    pub ordinal: usize,
    /// Bound on every wait (communicator creation, each collective).
    pub timeout: Duration,
    /// Distinguishes several groups rendezvousing through one store.
    pub name: String,
}

impl NcclConfig {
    /// Device `ordinal`, 10-minute timeout, name `world`.
    pub fn new(ordinal: usize) -> NcclConfig {
        NcclConfig {
            ordinal,
            timeout: Duration::from_secs(600),
            name: "world".into(),
        }
    }
}

/// One rank's handle to an NCCL communicator (see the module docs; never run here).
pub struct NcclGroup {
    rank: usize,
    size: usize,
    ordinal: usize,
    comm: usize,
    name: String,
    timeout: Duration,
    tx: Sender<Request>,
    seq: AtomicU64,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGroup")
            .field("name", &self.name)
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

impl NcclGroup {
    /// Creates this rank's communicator, collectively: rank 0 publishes the NCCL id in `store`,
    /// the others read it. Errors (typed, never a panic) if CUDA or NCCL is missing.
    pub fn new(
        store: &TcpStore,
        rank: usize,
        world_size: usize,
        config: NcclConfig,
    ) -> Result<NcclGroup> {
        nccl_available()?;
        if rank >= world_size {
            return Err(CollectiveError::InvalidGroup {
                group: config.name.clone(),
                rank,
                detail: format!("rank {rank} is not below the world size {world_size}"),
            });
        }
        let key = format!("fsdp-collectives/nccl/{}/id", config.name);
        let id = if rank == 0 {
            let id =
                result::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", rank, e.0))?;
            let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
            store.set(&key, &bytes)?;
            id
        } else {
            let bytes = store.get_timeout(&key, config.timeout)?;
            if bytes.len() != 128 {
                return Err(CollectiveError::StoreProtocol {
                    addr: store.addr().to_string(),
                    detail: format!(
                        "NCCL id under {key:?} has {} bytes, expected 128",
                        bytes.len()
                    ),
                });
            }
            let mut internal = [0 as std::ffi::c_char; 128];
            for (d, &b) in internal.iter_mut().zip(&bytes) {
                *d = b as std::ffi::c_char;
            }
            sys::ncclUniqueId { internal }
        };
        let (tx, rx) = unbounded();
        let (ready_tx, ready_rx) = bounded(1);
        let (ordinal, timeout) = (config.ordinal, config.timeout);
        std::thread::Builder::new()
            .name(format!("nccl-comm-rank{rank}"))
            .spawn(move || comm_thread_main(ordinal, rank, world_size, id, timeout, ready_tx, rx))
            .map_err(|e| {
                CollectiveError::CudaUnavailable(format!(
                    "cannot spawn the communicator thread: {e}"
                ))
            })?;
        match ready_rx.recv_timeout(timeout) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(CollectiveError::Timeout {
                    op: OpKind::Barrier,
                    group: config.name,
                    seq: 0,
                    rank,
                    waited: timeout,
                    missing: Vec::new(),
                })
            }
        }
        Ok(NcclGroup {
            rank,
            size: world_size,
            ordinal,
            comm: 0,
            name: format!("nccl/{}", config.name),
            timeout,
            tx,
            seq: AtomicU64::new(0),
        })
    }

    /// Torchrun-style creation: reads `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`
    /// (and `LOCAL_RANK` for the device, else the rank), rendezvouses through a [`TcpStore`] and
    /// creates the world communicator. Returns the store too (keep it alive on rank 0).
    pub fn from_env(timeout: Duration) -> Result<(NcclGroup, TcpStore)> {
        let env = RendezvousEnv::from_env()?;
        let ordinal = match std::env::var("LOCAL_RANK") {
            Ok(v) => v
                .trim()
                .parse::<usize>()
                .map_err(|e| CollectiveError::InvalidEnv {
                    var: "LOCAL_RANK",
                    value: v.clone(),
                    reason: format!("not a non-negative integer ({e})"),
                })?,
            Err(_) => env.rank,
        };
        let store = TcpStore::rendezvous(&env, timeout)?;
        let config = NcclConfig {
            timeout,
            ..NcclConfig::new(ordinal)
        };
        let group = NcclGroup::new(&store, env.rank, env.world_size, config)?;
        Ok((group, store))
    }

    fn issue(
        &self,
        desc: OpDesc,
        input: Option<&DeviceSlice>,
        output: Option<&DeviceSlice>,
        stream: &Stream,
    ) -> Work {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let outcome: Outcome = Arc::new(Mutex::new(None));
        let mut desc = desc;
        let on_device = |s: Option<&DeviceSlice>| s.map(|s| s.data().device_ptr().is_some());
        if let Some(cuda) = stream.cuda_stream() {
            let placed = stream.device() == DeviceId::Cuda(self.ordinal)
                && on_device(input) != Some(false)
                && on_device(output) == Some(true);
            if !placed && desc.bad_buffer.is_none() {
                desc.bad_buffer = Some(BufferProblem::Placement);
            }
            return self.issue_device(seq, desc, input, output, stream, cuda, outcome);
        }
        if (on_device(input) == Some(true) || on_device(output) == Some(true))
            && desc.bad_buffer.is_none()
        {
            desc.bad_buffer = Some(BufferProblem::Placement);
        }
        let ticket = Ticket {
            tx: self.tx.clone(),
            comm: self.comm,
            seq,
            desc,
            armed: true,
        };
        let (input, output) = (
            input.map(|s| s.data().clone()),
            output.map(|s| s.data().clone()),
        );
        let (slot, timeout, rank) = (Arc::clone(&outcome), self.timeout, self.rank);
        stream.launch(move || {
            let mut ticket = ticket;
            ticket.armed = false;
            let (reply, answer) = bounded(1);
            let sent = ticket.tx.send(Request::Op {
                comm: ticket.comm,
                seq,
                desc,
                input,
                output,
                abandoned: false,
                reply,
            });
            let r = match sent {
                Err(_) => Err(CollectiveError::CudaUnavailable(
                    "the communicator thread has exited".into(),
                )),
                Ok(()) => answer
                    .recv_timeout(timeout * 2 + Duration::from_secs(5))
                    .unwrap_or_else(|_| {
                        Err(CollectiveError::Timeout {
                            op: desc.kind,
                            group: "nccl".into(),
                            seq,
                            rank,
                            waited: timeout * 2,
                            missing: Vec::new(),
                        })
                    }),
            };
            let failed = r.as_ref().err().map(ToString::to_string);
            *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
            if let Some(message) = failed {
                std::panic::resume_unwind(Box::new(message));
            }
        });
        Work::new(desc.kind, self.rank, seq, stream.record_event(), outcome)
    }
}

impl NcclGroup {
    /// The device path: hand the collective to the communicator thread, which agrees on the
    /// descriptors with the other ranks and enqueues the kernel on `cuda`; then record the
    /// work's event after it. On failure nothing was enqueued; the stream is failed (a host
    /// function that fails it), as with the thread backend.
    #[allow(clippy::too_many_arguments)]
    fn issue_device(
        &self,
        seq: u64,
        desc: OpDesc,
        input: Option<&DeviceSlice>,
        output: Option<&DeviceSlice>,
        stream: &Stream,
        cuda: &Arc<CudaStream>,
        outcome: Outcome,
    ) -> Work {
        let rank = self.rank;
        let op = desc.kind;
        let Some(output) = output else {
            return Work::failed(
                op,
                rank,
                CollectiveError::InvalidBuffer {
                    op,
                    rank,
                    detail: "no output buffer".into(),
                },
            );
        };
        let (reply, answer) = bounded(1);
        let sent = self.tx.send(Request::Enqueue {
            comm: self.comm,
            seq,
            desc,
            input: input.map(|s| s.data().clone()),
            output: output.data().clone(),
            stream: Arc::clone(cuda),
            outcome: Arc::clone(&outcome),
            reply,
        });
        let r = match sent {
            Err(_) => Err(CollectiveError::CudaUnavailable(
                "the communicator thread has exited".into(),
            )),
            Ok(()) => answer
                .recv_timeout(self.timeout + Duration::from_secs(5))
                .unwrap_or_else(|_| {
                    Err(CollectiveError::Timeout {
                        op,
                        group: self.name.clone(),
                        seq,
                        rank,
                        waited: self.timeout,
                        missing: Vec::new(),
                    })
                }),
        };
        if let Err(e) = r {
            let message = e.to_string();
            *outcome.lock().unwrap_or_else(|x| x.into_inner()) = Some(Err(e));
            stream.launch(move || std::panic::resume_unwind(Box::new(message)));
        }
        Work::new(op, rank, seq, stream.record_event(), outcome)
    }
}

/// Dropped unrun (the stream had failed): still joins the descriptor exchange, flagged, so the
/// peers fail at once instead of waiting inside NCCL.
struct Ticket {
    tx: Sender<Request>,
    comm: usize,
    seq: u64,
    desc: OpDesc,
    armed: bool,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.armed {
            let (reply, _answer) = bounded(1);
            let _ = self.tx.send(Request::Op {
                comm: self.comm,
                seq: self.seq,
                desc: self.desc,
                input: None,
                output: None,
                abandoned: true,
                reply,
            });
        }
    }
}

impl ProcessGroup for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn name(&self) -> String {
        self.name.clone()
    }

    fn all_gather_into(&self, input: &DeviceSlice, output: &DeviceSlice, stream: &Stream) -> Work {
        self.issue(
            OpDesc::all_gather(input, output, self.rank),
            Some(input),
            Some(output),
            stream,
        )
    }

    fn reduce_scatter_with(
        &self,
        input: &DeviceSlice,
        output: &DeviceSlice,
        op: ReduceOp,
        accum: DType,
        stream: &Stream,
    ) -> Work {
        let desc = OpDesc::reduce_scatter(input, output, op, accum, self.rank);
        self.issue(desc, Some(input), Some(output), stream)
    }

    fn all_reduce_with(
        &self,
        buf: &DeviceSlice,
        op: ReduceOp,
        accum: DType,
        stream: &Stream,
    ) -> Work {
        self.issue(OpDesc::all_reduce(buf, op, accum), None, Some(buf), stream)
    }

    fn broadcast(&self, buf: &DeviceSlice, root: usize, stream: &Stream) -> Work {
        self.issue(OpDesc::broadcast(buf, root), None, Some(buf), stream)
    }

    fn barrier(&self) -> Result<()> {
        let (reply, answer) = bounded(1);
        self.tx
            .send(Request::Op {
                comm: self.comm,
                seq: self.seq.fetch_add(1, Ordering::Relaxed),
                desc: OpDesc::barrier(),
                input: None,
                output: None,
                abandoned: false,
                reply,
            })
            .map_err(|_| {
                CollectiveError::CudaUnavailable("the communicator thread has exited".into())
            })?;
        answer
            .recv_timeout(self.timeout * 2 + Duration::from_secs(5))
            .unwrap_or_else(|_| {
                Err(CollectiveError::Timeout {
                    op: OpKind::Barrier,
                    group: self.name.clone(),
                    seq: 0,
                    rank: self.rank,
                    waited: self.timeout * 2,
                    missing: Vec::new(),
                })
            })
    }

    fn split(&self, parts: &[Vec<usize>]) -> Result<Arc<dyn ProcessGroup>> {
        let (part, local) = locate_in_partition(parts, self.size, self.rank).map_err(|detail| {
            CollectiveError::InvalidGroup {
                group: self.name.clone(),
                rank: self.rank,
                detail,
            }
        })?;
        let (reply, answer) = bounded(1);
        self.tx
            .send(Request::Split {
                comm: self.comm,
                seq: self.seq.fetch_add(1, Ordering::Relaxed),
                color: part as i32,
                key: local as i32,
                size: parts[part].len(),
                reply,
            })
            .map_err(|_| {
                CollectiveError::CudaUnavailable("the communicator thread has exited".into())
            })?;
        let comm = answer
            .recv_timeout(self.timeout + Duration::from_secs(5))
            .map_err(|_| {
                CollectiveError::CudaUnavailable("ncclCommSplit did not return in time".into())
            })??;
        Ok(Arc::new(NcclGroup {
            rank: local,
            size: parts[part].len(),
            ordinal: self.ordinal,
            comm,
            name: format!("{}/split{part}", self.name),
            timeout: self.timeout,
            tx: self.tx.clone(),
            seq: AtomicU64::new(0),
        }))
    }
}
