//! Device-side validation of ids and targets ([`IndexCheck`]): the `check_ids` kernel, its plan
//! step, and the check a launch returns (embedding ids, cross-entropy targets).

use fsdp_alloc::{Buffer, BufferRef, Stream};

use crate::kernels::cuda::context::{Call, CudaKernels, Elem};
use crate::kernels::cuda::error::{CudaKernelError, Result};
use crate::kernels::cuda::plan::{grid_for, PArg, Plan, Ptr};
use crate::kernels::KernelError;

crate::kernels::cuda::kernel::declare_kernels! {
    CHECK_IDS = "check_ids" [U64, Ptr, U64, Ptr];
}

/// The outcome of the device-side validation of ids (embedding) or targets (cross-entropy).
///
/// Checking indices on the host would need the ids on the host, i.e. a synchronization per call.
/// Instead the kernels validate on the device: out-of-range indices are never dereferenced (the
/// forward writes NaN rows for them, so an unchecked error cannot silently train; the backward
/// skips them), and the smallest offending position is recorded in a device status word.
/// [`IndexCheck::wait`] synchronizes the stream and turns that into the CPU kernels'
/// [`KernelError::IndexOutOfRange`]. Callers that cannot afford the synchronization on every
/// step may keep the check and wait on it later (e.g. once per step).
#[must_use = "out-of-range indices are only reported by `IndexCheck::wait`"]
pub struct IndexCheck {
    op: &'static str,
    what: &'static str,
    bound: usize,
    pending: Option<Pending>,
}

struct Pending {
    status: Buffer,
    ids: BufferRef,
    stream: Stream,
    kernels: CudaKernels,
}

impl std::fmt::Debug for IndexCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexCheck")
            .field("op", &self.op)
            .field("what", &self.what)
            .field("bound", &self.bound)
            .field("pending", &self.pending.is_some())
            .finish()
    }
}

impl IndexCheck {
    /// The kernel whose indices are checked.
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// Blocks until the stream's work up to the checked kernel has completed and reports the
    /// first out-of-range index, if any.
    ///
    /// # Errors
    /// [`KernelError::IndexOutOfRange`] (as [`CudaKernelError::Kernel`]) with the smallest
    /// offending position and its value; driver errors from the synchronization or the copies.
    pub fn wait(self) -> Result<()> {
        self.wait_after(None)
    }

    /// [`IndexCheck::wait`] for a caller that has just synchronized `synced` (a readback on
    /// it): a check of that stream reads its status word without synchronizing again, so
    /// draining the checks costs no host wait beyond the readback's; a check of another stream
    /// synchronizes that one (a counted host wait).
    pub(crate) fn wait_after(self, synced: Option<&Stream>) -> Result<()> {
        let Some(p) = self.pending else {
            return Ok(());
        };
        let c = p.kernels.call(self.op, &p.stream)?;
        let status = c.buf("status", p.status.data(), Elem::U64)?;
        let mut first = [0u64];
        if synced == Some(&p.stream) {
            // SAFETY: `status` is the live one-word scratch buffer the check kernel writes
            // (kept alive by `p.status`); the kernel was enqueued on `p.stream` before the
            // caller synchronized it (the check was deferred when it was launched).
            unsafe { c.read_to_host_synced(status.ptr, &mut first)? };
        } else {
            // SAFETY: as above; `read_to_host` synchronizes the stream first.
            unsafe { c.read_to_host(status.ptr, &mut first)? };
        }
        let position = first[0];
        if position == u64::MAX {
            return Ok(());
        }
        let ids = c.buf("ids", &p.ids, Elem::I64)?;
        if position >= ids.len as u64 {
            return Err(CudaKernelError::Internal {
                op: self.op,
                detail: format!(
                    "the index check reported position {position} of {} indices",
                    ids.len
                ),
            });
        }
        let mut value = [0i64];
        // SAFETY: position < ids.len, so the 8 bytes at ids.ptr + 8·position lie inside the live
        // ids buffer (kept alive by `p.ids`), whose writers ran before the check kernel, which
        // has completed (its status was read after a synchronize of `p.stream`).
        unsafe { c.read_to_host_synced(ids.ptr + 8 * position, &mut value)? };
        Err(KernelError::IndexOutOfRange {
            op: self.op,
            what: self.what,
            value: value[0],
            position: position as usize,
            bound: self.bound,
        }
        .into())
    }
}

/// Appends the validation of `n` indices at `ids` against `0..bound` and returns the scratch
/// slot of its status word (`None` when there is nothing to check).
pub(crate) fn plan_check(plan: &mut Plan, n: u64, ids: Ptr, bound: u64) -> Option<usize> {
    if n == 0 {
        return None;
    }
    let slot = plan.scratch(1, Elem::U64);
    // All-ones bytes are u64::MAX, the "no error" value.
    plan.memset(Ptr::scratch(slot), 0xff, 8);
    plan.launch(
        CHECK_IDS,
        grid_for(n),
        vec![
            PArg::U64(n),
            PArg::Ptr(ids),
            PArg::U64(bound),
            PArg::Ptr(Ptr::scratch(slot)),
        ],
    );
    Some(slot)
}

/// Executes `plan` and wraps its status slot (if any) in an [`IndexCheck`].
///
/// # Safety
/// As [`Call::exec`].
pub(crate) unsafe fn exec_checked(
    c: &Call<'_>,
    plan: &Plan,
    status: Option<usize>,
    what: &'static str,
    ids: &BufferRef,
    bound: usize,
) -> Result<IndexCheck> {
    // SAFETY: forwarded to the caller.
    let scratch = unsafe { c.exec(plan) }?;
    let pending = match status {
        None => None,
        Some(slot) => {
            let status =
                scratch
                    .into_iter()
                    .nth(slot)
                    .ok_or_else(|| CudaKernelError::Internal {
                        op: c.op,
                        detail: format!("the plan has no scratch slot {slot} for its status word"),
                    })?;
            Some(Pending {
                status,
                ids: ids.clone(),
                stream: c.stream.clone(),
                kernels: c.k.clone(),
            })
        }
    };
    Ok(IndexCheck {
        op: c.op,
        what,
        bound,
        pending,
    })
}
