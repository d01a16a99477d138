//! The communicator thread: one per rank, owning the CUDA context, the comm stream and every NCCL communicator of the rank; requests of one communicator run in issue order.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam::channel::{Receiver, Sender};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr};
use cudarc::nccl::{result, sys};
use fsdp_alloc::{BufferRef, DType};
use half::{bf16, f16};

use crate::desc::{validate, OpDesc, WORDS};
use crate::error::{CollectiveError, Result};
use crate::types::{OpKind, Outcome, ReduceOp};

use super::raw::*;

/// A request to the communicator thread. Requests of one communicator run strictly in the order
/// of `seq` (the order they were issued), whatever order the issuing streams deliver them in, so
/// every rank hands NCCL the same sequence.
pub(super) enum Request {
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
    /// The last group handle of this rank is being dropped: wait for the enqueued kernels,
    /// destroy every communicator and exit, so that the dropping thread can join this one.
    Shutdown,
}

impl Request {
    fn key(&self) -> (usize, u64) {
        match self {
            Request::Op { comm, seq, .. }
            | Request::Enqueue { comm, seq, .. }
            | Request::Split { comm, seq, .. } => (*comm, *seq),
            Request::Shutdown => (usize::MAX, u64::MAX),
        }
    }
}

/// A kernel enqueued on a caller's stream, watched until it completes.
pub(super) struct Pending {
    comm: usize,
    op: OpKind,
    done: CudaEvent,
    started: Instant,
    outcome: Outcome,
    /// Keeps the device memory alive until the kernel has run.
    _buffers: (Option<BufferRef>, BufferRef),
}

/// What the communicator thread owns.
pub(super) struct CommThread {
    rank: usize,
    timeout: Duration,
    stream: Arc<CudaStream>,
    comms: Vec<RawComm>,
    pending: Vec<Pending>,
}

/// Host bytes of `b` (a copy), optionally widened from f16/bf16 to f32.
pub(super) fn host_bytes(
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
pub(super) fn store_bytes(
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

/// Enqueues the NCCL collective `desc` describes (`Barrier`: nothing) on `stream`: input at
/// `ip`, output at `optr` (the same address for the in-place all-reduce and broadcast), elements
/// of `dt`.
///
/// # Safety
/// `ip` and `optr` are device addresses of allocations of `comm`'s context that hold the
/// element counts of `desc` (validated on every rank) and stay alive until the kernel has run;
/// `stream` is a stream of that context.
#[allow(clippy::too_many_arguments)]
unsafe fn launch_nccl(
    desc: &OpDesc,
    ip: *const c_void,
    optr: *mut c_void,
    wire: DType,
    world: usize,
    comm: sys::ncclComm_t,
    stream: sys::cudaStream_t,
) -> std::result::Result<result::NcclStatus, result::NcclError> {
    let red = nccl_op(desc.op.unwrap_or(ReduceOp::Sum));
    let dt = nccl_dtype(wire);
    // SAFETY: the caller's contract covers every arm.
    unsafe {
        match desc.kind {
            OpKind::AllGather => result::all_gather(ip, optr, desc.in_len, dt, comm, stream),
            OpKind::ReduceScatter => {
                result::reduce_scatter(ip, optr, desc.out_len, dt, red, comm, stream)
            }
            OpKind::AllReduce => result::all_reduce(ip, optr, desc.in_len, dt, red, comm, stream),
            OpKind::Broadcast => {
                let root = desc.root.unwrap_or(0) as i32;
                result::broadcast(ip, optr, desc.in_len, dt, root, comm, stream)
            }
            OpKind::AllToAll => {
                let world = world.max(1);
                grouped_all_to_all(
                    ip as u64,
                    optr as u64,
                    desc.in_len / world,
                    wire,
                    world,
                    comm,
                    stream,
                )
            }
            OpKind::Barrier => Ok(result::NcclStatus::Success),
        }
    }
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
        // Reductions with f32 accumulation of f16/bf16 go over the wire widened to f32.
        let widen = matches!(op, OpKind::ReduceScatter | OpKind::AllReduce)
            && desc.accum == Some(DType::F32)
            && matches!(desc.in_dtype, DType::F16 | DType::BF16);
        let esz = if widen { 4 } else { desc.in_dtype.size() };
        let (src, dst) = match op {
            // The descriptor exchange above was already a rendezvous of every rank.
            OpKind::Barrier => return Ok(()),
            OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll => {
                (input.ok_or_else(missing)?, output.ok_or_else(missing)?)
            }
            OpKind::AllReduce | OpKind::Broadcast => {
                let b = output.ok_or_else(missing)?;
                (b.clone(), b)
            }
        };
        // Staged through device memory: in place for all-reduce and broadcast.
        let send = self.upload(&host_bytes(&src, desc.in_dtype, widen).map_err(buf)?)?;
        let in_place = matches!(op, OpKind::AllReduce | OpKind::Broadcast);
        let recv_len = if in_place { desc.in_len } else { desc.out_len } * esz;
        let recv = match in_place {
            true => None,
            false => Some(self.upload(&vec![0u8; recv_len])?),
        };
        {
            let (sp, _s) = send.device_ptr(&self.stream);
            let recv_ptr = recv.as_ref().map(|r| r.device_ptr(&self.stream));
            let rp = recv_ptr.as_ref().map_or(sp, |(p, _)| *p);
            let wire = if widen { DType::F32 } else { desc.in_dtype };
            let world = self.comms.get(id).map_or(1, |c| c.size);
            let cs = self.stream.cu_stream() as sys::cudaStream_t;
            // SAFETY: `send` holds the input's elements of the wire dtype and `recv` (or `send`
            // itself, in place) the output's, as validated on every rank; both device buffers
            // of this context live until after the wait below; `cs` is this context's stream.
            let r = unsafe {
                launch_nccl(
                    &desc,
                    sp as *const c_void,
                    rp as *mut c_void,
                    wire,
                    world,
                    comm,
                    cs,
                )
            };
            check(op.name(), rank, r)?;
        }
        self.wait(id, op, comm)?;
        let bytes = self.download(recv.as_ref().unwrap_or(&send), recv_len)?;
        store_bytes(&dst, desc.in_dtype, widen, &bytes).map_err(buf)
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
        let cs = user.cu_stream() as sys::cudaStream_t;
        let (ip, optr) = (inp as *const c_void, out as *mut c_void);
        // SAFETY: the pointers are device addresses of live allocations of this context (the
        // BufferRefs, kept in `pending` until the kernel's completion event fires, hold their
        // segments); their lengths match the counts (validated from every rank's descriptor);
        // `cs` is a stream of this context, and stream order places the kernel after the work
        // that produced the inputs and before the work that reads the outputs.
        let world = self.comms.get(id).map_or(1, |c| c.size);
        let r = unsafe { launch_nccl(&desc, ip, optr, desc.in_dtype, world, comm, cs) };
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

pub(super) fn comm_thread_main(
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
        if let Request::Shutdown = req {
            // Requests still waiting for an earlier sequence number are dropped unrun (their
            // callers see "the communicator thread has exited"); enqueued kernels finish first
            // (bounded by the watchdog), then `ct` drops: every communicator is destroyed here,
            // before the thread that owns the group returns.
            while !ct.pending.is_empty() {
                ct.poll_pending();
                std::thread::sleep(Duration::from_millis(1));
            }
            break;
        }
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
                Some(Request::Shutdown) | None => {}
            }
        }
    }
}

/// Owns a rank's communicator thread: shared by the world group and every group split from it.
/// Dropping the last handle shuts the thread down and **joins** it, so that `ncclCommDestroy`
/// has returned before the owner goes on (issue #24: a detached thread still inside
/// `ncclCommDestroy` while `main` returned and the CUDA runtime was being unloaded crashed the
/// process at exit with rc 139).
pub(super) struct CommOwner {
    tx: Sender<Request>,
    done: Receiver<()>,
    thread: Option<std::thread::JoinHandle<()>>,
    rank: usize,
    /// Bound on the wait: the watchdog's timeout, plus time to destroy the communicators.
    wait: Duration,
}

impl CommOwner {
    /// `done` is disconnected when the thread's function has returned (its sender is dropped
    /// last in the thread).
    pub(super) fn new(
        tx: Sender<Request>,
        done: Receiver<()>,
        thread: std::thread::JoinHandle<()>,
        rank: usize,
        timeout: Duration,
    ) -> CommOwner {
        CommOwner {
            tx,
            done,
            thread: Some(thread),
            rank,
            wait: timeout + Duration::from_secs(30),
        }
    }
}

impl Drop for CommOwner {
    fn drop(&mut self) {
        let _ = self.tx.send(Request::Shutdown);
        match self.done.recv_timeout(self.wait) {
            Err(crossbeam::channel::RecvTimeoutError::Disconnected) | Ok(()) => {
                if let Some(t) = self.thread.take() {
                    let _ = t.join();
                }
            }
            Err(crossbeam::channel::RecvTimeoutError::Timeout) => {
                // Never hang a process on teardown: say so and leave the thread detached.
                eprintln!(
                    "fsdp-collectives: rank {}: the NCCL communicator thread did not finish \
                     within {:?} of shutdown; leaving it detached",
                    self.rank, self.wait
                );
            }
        }
    }
}
