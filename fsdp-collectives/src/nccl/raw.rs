//! Raw NCCL and CUDA calls: error mapping, dtype and op codes, and the communicator handle the communicator thread owns.

use std::ffi::CStr;

use cudarc::nccl::{result, sys};
use fsdp_alloc::DType;

use crate::error::{CollectiveError, Result};
use crate::types::ReduceOp;

pub(super) fn nccl_error(
    call: &'static str,
    rank: usize,
    code: sys::ncclResult_t,
) -> CollectiveError {
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

pub(super) fn check(
    call: &'static str,
    rank: usize,
    r: std::result::Result<result::NcclStatus, result::NcclError>,
) -> Result<()> {
    r.map(|_| ()).map_err(|e| nccl_error(call, rank, e.0))
}

pub(super) fn cuda_error(
    call: &'static str,
    rank: usize,
) -> impl Fn(cudarc::driver::DriverError) -> CollectiveError {
    move |e| CollectiveError::Cuda {
        call,
        rank,
        message: e.to_string(),
    }
}

pub(super) fn nccl_dtype(d: DType) -> sys::ncclDataType_t {
    match d {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::I32 => sys::ncclDataType_t::ncclInt32,
        DType::I64 => sys::ncclDataType_t::ncclInt64,
        DType::U8 => sys::ncclDataType_t::ncclUint8,
    }
}

pub(super) fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
    }
}

/// All-to-all with equal chunks as grouped point-to-point calls (NCCL has no all-to-all
/// collective): inside one `ncclGroupStart`/`ncclGroupEnd`, chunk `p` of `send` goes to rank
/// `p` (`ncclSend`) and chunk `p` of `recv` comes from rank `p` (`ncclRecv`), `count` elements
/// of `dtype` each. `ncclGroupEnd` is called even when a send or receive failed.
///
/// # Safety
/// `send` and `recv` are device addresses of live, non-overlapping allocations of `comm`'s
/// context, each holding `world × count` elements of `dtype`, that stay alive until the enqueued
/// work completes; `world` is `comm`'s size; `stream` is a stream of that context.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn grouped_all_to_all(
    send: u64,
    recv: u64,
    count: usize,
    dtype: DType,
    world: usize,
    comm: sys::ncclComm_t,
    stream: sys::cudaStream_t,
) -> std::result::Result<result::NcclStatus, result::NcclError> {
    let bytes = (count * dtype.size()) as u64;
    let dt = nccl_dtype(dtype);
    result::group_start()?;
    let mut r = Ok(result::NcclStatus::Success);
    for peer in 0..world {
        if r.is_err() {
            break;
        }
        let off = peer as u64 * bytes;
        let sp = (send + off) as *const std::ffi::c_void;
        let rp = (recv + off) as *mut std::ffi::c_void;
        // SAFETY: per the function's contract, chunk `peer` of both buffers is in bounds and
        // alive; `peer` < world is a rank of `comm`.
        r = unsafe { result::send(sp, count, dt, peer as std::ffi::c_int, comm, stream) };
        if r.is_ok() {
            // SAFETY: as above.
            r = unsafe { result::recv(rp, count, dt, peer as std::ffi::c_int, comm, stream) };
        }
    }
    let end = result::group_end();
    r.and(end)
}

/// A communicator owned by the communicator thread; aborted if it timed out, destroyed on drop.
///
/// Each group has two NCCL communicators over the same ranks: `comm` carries the data (enqueued
/// on callers' streams in issue order) and `control` only the descriptor exchange (on the
/// thread's internal stream, host-synchronized). Keeping them apart means an exchange never runs
/// on the GPU concurrently with a data kernel *of the same communicator* on another stream.
pub(super) struct RawComm {
    pub(super) comm: sys::ncclComm_t,
    pub(super) control: sys::ncclComm_t,
    pub(super) size: usize,
    pub(super) broken: Option<String>,
}

impl RawComm {
    /// Makes the control communicator (collective over the ranks of `comm`).
    pub(super) fn new(rank: usize, comm: sys::ncclComm_t, size: usize) -> Result<RawComm> {
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
    pub(super) fn abort(&mut self, why: String) {
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
