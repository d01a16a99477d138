//! The edge to MPI: process-wide initialization through the `mpi` crate, and thin wrappers over
//! the raw calls (`mpi::ffi`) the backend needs — communicator split/dup/free, the shared-memory
//! window, and the byte-wise non-blocking collectives (polled with a deadline) of the MPI path. Every `unsafe` block of the MPI
//! backend is in this file.

use std::ffi::{c_char, c_int, c_void};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use mpi::ffi;
use mpi::Threading;

use crate::error::{CollectiveError, Result};

/// The MPI library, initialized once per process; finalized when the last handle is dropped.
pub(super) struct Runtime {
    _universe: mpi::environment::Universe,
    /// World rank (for messages before a group exists).
    pub(super) world_rank: usize,
}

// SAFETY: the universe is only held to finalize MPI when dropped (MPI_Finalize may be called
// from any thread once no other MPI call is in flight: every communicator and window holds an
// `Arc<Runtime>`, so they are all released first). MPI runs with MPI_THREAD_MULTIPLE.
unsafe impl Send for Runtime {}
// SAFETY: as above; `Runtime` exposes no interior mutability.
unsafe impl Sync for Runtime {}

static RUNTIME: Mutex<Option<Weak<Runtime>>> = Mutex::new(None);

/// The process's MPI runtime: initializes MPI (with `MPI_THREAD_MULTIPLE`) on the first call.
/// MPI can be initialized only once per process: after the last group was dropped (which
/// finalized MPI) this is an error.
pub(super) fn runtime() -> Result<Arc<Runtime>> {
    let mut slot = RUNTIME.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(weak) = slot.as_ref() {
        return weak.upgrade().ok_or_else(|| CollectiveError::Mpi {
            call: "MPI_Init_thread",
            rank: 0,
            message: "MPI was already finalized in this process (every MpiGroup was dropped); \
                      MPI can be initialized once per process, so keep the world group alive \
                      for the whole program"
                .into(),
        });
    }
    let (universe, provided) =
        mpi::initialize_with_threading(Threading::Multiple).ok_or_else(|| {
            CollectiveError::Mpi {
                call: "MPI_Init_thread",
                rank: 0,
                message: "MPI was already initialized by someone else in this process; create the \
                      MpiGroup before any other MPI use"
                    .into(),
            }
        })?;
    if provided != Threading::Multiple {
        return Err(CollectiveError::Mpi {
            call: "MPI_Init_thread",
            rank: 0,
            message: format!(
                "the MPI library provides {provided:?} threading, the backend needs Multiple \
                 (collectives run on stream threads); use an MPI built with thread support \
                 (Debian's OpenMPI is)"
            ),
        });
    }
    let mut world_rank: c_int = 0;
    // SAFETY: MPI is initialized; the out-pointer is a live local.
    unsafe {
        check(
            "MPI_Comm_rank",
            0,
            ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut world_rank),
        )?;
    }
    let rt = Arc::new(Runtime {
        _universe: universe,
        world_rank: world_rank as usize,
    });
    *slot = Some(Arc::downgrade(&rt));
    Ok(rt)
}

fn mpi_error(call: &'static str, rank: usize, code: c_int) -> CollectiveError {
    let mut buf = vec![0 as c_char; 512];
    let mut len: c_int = 0;
    // SAFETY: MPI_Error_string writes at most MPI_MAX_ERROR_STRING (256 in OpenMPI, < 512)
    // characters and their length into the two out-pointers, which point to live locals.
    let text = unsafe {
        ffi::MPI_Error_string(code, buf.as_mut_ptr(), &mut len);
        let bytes: Vec<u8> = buf[..len.max(0) as usize]
            .iter()
            .map(|&c| c as u8)
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    };
    CollectiveError::Mpi {
        call,
        rank,
        message: format!("error code {code}: {text}"),
    }
}

fn check(call: &'static str, rank: usize, code: c_int) -> Result<()> {
    if code == ffi::MPI_SUCCESS as c_int {
        Ok(())
    } else {
        Err(mpi_error(call, rank, code))
    }
}

fn count(call: &'static str, rank: usize, bytes: usize) -> Result<c_int> {
    c_int::try_from(bytes).map_err(|_| CollectiveError::Mpi {
        call,
        rank,
        message: format!("{bytes} bytes exceed MPI's int count; use a smaller slot size"),
    })
}

/// How long [`Comm::exchange`] polls with `yield`s before it sleeps 1 ms between tests.
const IDLE_BEFORE_SLEEP: Duration = Duration::from_millis(50);

/// Calls `test` until it returns true (`Ok(true)`) or `timeout` has passed since the first call
/// (`Ok(false)`); an error from `test` ends the wait. Between calls it yields the core, and after
/// [`IDLE_BEFORE_SLEEP`] without success it sleeps 1 ms, so a rank waiting on a stuck peer does
/// not burn a core. `test` is called at least once, and once more after the deadline passed
/// (a request that completed while the caller slept is not reported as a timeout).
pub(super) fn poll_until(
    timeout: Duration,
    mut test: impl FnMut() -> Result<bool>,
) -> Result<bool> {
    let start = Instant::now();
    loop {
        let waited = start.elapsed();
        if test()? {
            return Ok(true);
        }
        if waited > timeout {
            return Ok(false);
        }
        if waited < IDLE_BEFORE_SLEEP {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// What a communicator-creating call needs for its arrival handshake (see [`arrive`]): the
/// bound and the names the timeout error reports.
pub(super) struct Gate<'a> {
    /// How long to wait for every rank of the parent communicator.
    pub(super) timeout: Duration,
    /// The name of the group being created or split (for the error).
    pub(super) group: &'a str,
    /// The position in that group's collective sequence (for the error).
    pub(super) seq: u64,
}

/// The arrival handshake before a blocking communicator-creating collective on `comm`:
/// `MPI_Ibarrier` polled with `MPI_Test` against `gate.timeout`. On expiry it returns
/// [`CollectiveError::Timeout`] (op `barrier`, group `"<name> (group creation)"`, no `missing`
/// ranks: a barrier cannot tell which ranks did not arrive) instead of letting the caller enter
/// the blocking call. The timed-out barrier request is leaked (collectives cannot be cancelled):
/// the parent communicator must be treated as broken.
fn arrive(comm: ffi::MPI_Comm, rank: usize, gate: &Gate<'_>) -> Result<()> {
    let mut req = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
    // SAFETY: `comm` is a valid communicator (the world, or one a live `Comm` owns); MPI writes
    // the request handle into `req` on success.
    let req = unsafe {
        check(
            "MPI_Ibarrier",
            rank,
            ffi::MPI_Ibarrier(comm, req.as_mut_ptr()),
        )?;
        req.assume_init()
    };
    // A barrier moves no data: empty buffers, nothing to leak if it never completes.
    let pending = Pending {
        req,
        rank,
        done: false,
        bufs: Some((Vec::new(), Vec::new())),
    };
    match pending.wait(gate.timeout)? {
        Some(_) => Ok(()),
        None => Err(CollectiveError::Timeout {
            op: crate::types::OpKind::Barrier,
            group: format!("{} (group creation)", gate.group),
            seq: gate.seq,
            rank,
            waited: gate.timeout,
            missing: Vec::new(),
        }),
    }
}

/// The byte-wise non-blocking collectives of [`Comm::exchange`].
#[derive(Clone, Copy, Debug)]
pub(super) enum Xfer {
    /// `MPI_Iallgather`.
    Gather,
    /// `MPI_Ialltoall`.
    ToAll,
    /// `MPI_Ibcast` from this root.
    FromRoot(usize),
}

/// A started non-blocking collective and the buffers MPI reads and writes until it completes.
/// Dropped before completion (or timed out in [`Pending::wait`]), it leaks the buffers: MPI may
/// still access them and a collective request cannot be cancelled.
pub(super) struct Pending {
    req: ffi::MPI_Request,
    rank: usize,
    /// Set once `MPI_Test` reported completion (MPI freed the request).
    done: bool,
    /// `(send, recv)`; `None` once handed back or leaked.
    bufs: Option<(Vec<u8>, Vec<u8>)>,
}

// SAFETY: the request handle may be tested from any thread under MPI_THREAD_MULTIPLE; the
// buffers are plain heap memory owned by this value.
unsafe impl Send for Pending {}

impl Pending {
    /// Polls the request until it completes or `timeout` passes: `MPI_Test` in a loop that
    /// yields the core between tests (`MPI_Test` is what drives OpenMPI's progress, so the loop
    /// does not sleep while bytes are moving); after [`IDLE_BEFORE_SLEEP`] without completion it
    /// sleeps 1 ms between tests, so a rank waiting on a stuck peer does not burn a core.
    /// `Some((send, recv))` when done; `None` on timeout (the buffers are leaked).
    pub(super) fn wait(mut self, timeout: Duration) -> Result<Option<(Vec<u8>, Vec<u8>)>> {
        Ok(if poll_until(timeout, || self.test())? {
            self.bufs.take()
        } else {
            None
        })
    }

    /// One `MPI_Test`: true once the collective completed (also drives its progress).
    pub(super) fn test(&mut self) -> Result<bool> {
        if self.done {
            return Ok(true);
        }
        let mut flag: c_int = 0;
        // SAFETY: `req` is the live request started in `Comm::start`, not yet reported complete
        // (after completion MPI has freed it and `done` keeps us from testing it again).
        unsafe {
            check(
                "MPI_Test",
                self.rank,
                ffi::MPI_Test(&mut self.req, &mut flag, ffi::RSMPI_STATUS_IGNORE),
            )?;
        }
        self.done = flag != 0;
        Ok(self.done)
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some((send, recv)) = self.bufs.take() {
            if !self.done {
                // Not completed: MPI may still read `send` and write `recv`.
                std::mem::forget(send);
                std::mem::forget(recv);
            }
        }
    }
}

/// An owned communicator (a dup or split of the world), freed on drop.
pub(super) struct Comm {
    raw: ffi::MPI_Comm,
    rank: usize,
    size: usize,
    _rt: Arc<Runtime>,
}

// SAFETY: an MPI communicator handle may be used from any thread under MPI_THREAD_MULTIPLE
// (which `runtime` insists on). Collectives on one communicator are issued in one order on every
// rank because the backend runs them one at a time, in sequence order, under its turn lock.
unsafe impl Send for Comm {}
// SAFETY: as above; the handle itself is never mutated after creation.
unsafe impl Sync for Comm {}

impl Comm {
    fn from_raw(raw: ffi::MPI_Comm, rt: &Arc<Runtime>) -> Result<Comm> {
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: `raw` is a valid communicator just returned by MPI; the out-pointers are live.
        unsafe {
            // Errors come back as codes instead of aborting the job.
            check(
                "MPI_Comm_set_errhandler",
                rt.world_rank,
                ffi::MPI_Comm_set_errhandler(raw, ffi::RSMPI_ERRORS_RETURN),
            )?;
            check(
                "MPI_Comm_rank",
                rt.world_rank,
                ffi::MPI_Comm_rank(raw, &mut rank),
            )?;
            check(
                "MPI_Comm_size",
                rt.world_rank,
                ffi::MPI_Comm_size(raw, &mut size),
            )?;
        }
        Ok(Comm {
            raw,
            rank: rank as usize,
            size: size as usize,
            _rt: Arc::clone(rt),
        })
    }

    /// A private duplicate of `MPI_COMM_WORLD` (collective over the world), after the arrival
    /// handshake ([`arrive`]) on the world.
    pub(super) fn world_dup(rt: &Arc<Runtime>, gate: &Gate<'_>) -> Result<Comm> {
        // SAFETY: RSMPI_COMM_WORLD is a constant handle set by the MPI library, only read.
        let world = unsafe { ffi::RSMPI_COMM_WORLD };
        arrive(world, rt.world_rank, gate)?;
        let mut raw = std::mem::MaybeUninit::<ffi::MPI_Comm>::uninit();
        // SAFETY: MPI is initialized (`rt` exists); RSMPI_COMM_WORLD is the world handle and
        // MPI_Comm_dup writes the new handle into `raw` on success.
        let raw = unsafe {
            check(
                "MPI_Comm_dup",
                rt.world_rank,
                ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, raw.as_mut_ptr()),
            )?;
            raw.assume_init()
        };
        Comm::from_raw(raw, rt)
    }

    pub(super) fn rank(&self) -> usize {
        self.rank
    }

    pub(super) fn size(&self) -> usize {
        self.size
    }

    /// `MPI_Comm_split` (collective): ranks with the same `color` form one communicator, ordered
    /// by `key`; after the arrival handshake ([`arrive`]) on this communicator.
    pub(super) fn split(&self, color: usize, key: usize, gate: &Gate<'_>) -> Result<Comm> {
        arrive(self.raw, self.rank, gate)?;
        let mut raw = std::mem::MaybeUninit::<ffi::MPI_Comm>::uninit();
        // SAFETY: `self.raw` is valid; color and key are non-negative ints; the new handle is
        // written into `raw` on success.
        let raw = unsafe {
            check(
                "MPI_Comm_split",
                self.rank,
                ffi::MPI_Comm_split(self.raw, color as c_int, key as c_int, raw.as_mut_ptr()),
            )?;
            raw.assume_init()
        };
        Comm::from_raw(raw, &self._rt)
    }

    /// The ranks of this communicator that share memory with this one (collective), after the
    /// arrival handshake ([`arrive`]) on this communicator.
    pub(super) fn split_shared(&self, gate: &Gate<'_>) -> Result<Comm> {
        arrive(self.raw, self.rank, gate)?;
        let mut raw = std::mem::MaybeUninit::<ffi::MPI_Comm>::uninit();
        // SAFETY: as in `split`; RSMPI_COMM_TYPE_SHARED and RSMPI_INFO_NULL are MPI constants.
        let raw = unsafe {
            check(
                "MPI_Comm_split_type",
                self.rank,
                ffi::MPI_Comm_split_type(
                    self.raw,
                    ffi::RSMPI_COMM_TYPE_SHARED,
                    self.rank as c_int,
                    ffi::RSMPI_INFO_NULL,
                    raw.as_mut_ptr(),
                ),
            )?;
            raw.assume_init()
        };
        Comm::from_raw(raw, &self._rt)
    }

    /// A non-blocking byte-wise collective (`MPI_Iallgather`, `MPI_Ialltoall` or `MPI_Ibcast`,
    /// see [`Xfer`]) polled until done or `timeout` ([`Pending::wait`]). Returns `Ok(false)` on
    /// timeout: the buffers are leaked (`recv` is left empty) and the caller must treat the
    /// communicator as broken.
    pub(super) fn exchange(
        &self,
        kind: Xfer,
        send: Vec<u8>,
        recv: &mut Vec<u8>,
        timeout: Duration,
    ) -> Result<bool> {
        let pending = self.start(kind, send, std::mem::take(recv))?;
        Ok(match pending.wait(timeout)? {
            Some((_, r)) => {
                *recv = r;
                true
            }
            None => false,
        })
    }

    /// Starts a non-blocking byte-wise collective; the returned [`Pending`] owns both buffers
    /// until it completes.
    ///
    /// Sizes: `Gather` sends `send` (the same length on every rank) and receives
    /// `size × send.len()` bytes into `recv`; `ToAll` sends `send` (`size` equal pieces, piece
    /// `d` to rank `d`) and receives as many bytes (piece `s` from rank `s`); `FromRoot(root)`
    /// broadcasts `recv` in place from `root` (`send` is unused).
    pub(super) fn start(&self, kind: Xfer, send: Vec<u8>, mut recv: Vec<u8>) -> Result<Pending> {
        let (name, n) = match kind {
            Xfer::Gather => {
                recv.resize(send.len() * self.size, 0);
                ("MPI_Iallgather", send.len())
            }
            Xfer::ToAll => {
                if send.len() % self.size != 0 {
                    return Err(CollectiveError::Mpi {
                        call: "MPI_Ialltoall",
                        rank: self.rank,
                        message: format!(
                            "{} bytes do not split into {} equal pieces",
                            send.len(),
                            self.size
                        ),
                    });
                }
                recv.resize(send.len(), 0);
                ("MPI_Ialltoall", send.len() / self.size)
            }
            Xfer::FromRoot(root) => {
                if root >= self.size {
                    return Err(CollectiveError::Mpi {
                        call: "MPI_Ibcast",
                        rank: self.rank,
                        message: format!("root {root} is not a rank of a {}-rank group", self.size),
                    });
                }
                ("MPI_Ibcast", recv.len())
            }
        };
        let n = count(name, self.rank, n)?;
        let mut req = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
        let (sp, rp) = (
            send.as_ptr() as *const c_void,
            recv.as_mut_ptr() as *mut c_void,
        );
        // SAFETY: both buffers are live heap allocations sized for the call as checked above
        // (Gather: recv holds size × n bytes; ToAll: each holds size × n; FromRoot: recv holds
        // n); they move (heap blocks unchanged) into the returned `Pending`, which hands
        // them back only after the request completed and leaks them if it never does. The communicator is valid; `req` receives the request handle.
        let req = unsafe {
            let code = match kind {
                Xfer::Gather => ffi::MPI_Iallgather(
                    sp,
                    n,
                    ffi::RSMPI_UINT8_T,
                    rp,
                    n,
                    ffi::RSMPI_UINT8_T,
                    self.raw,
                    req.as_mut_ptr(),
                ),
                Xfer::ToAll => ffi::MPI_Ialltoall(
                    sp,
                    n,
                    ffi::RSMPI_UINT8_T,
                    rp,
                    n,
                    ffi::RSMPI_UINT8_T,
                    self.raw,
                    req.as_mut_ptr(),
                ),
                Xfer::FromRoot(root) => ffi::MPI_Ibcast(
                    rp,
                    n,
                    ffi::RSMPI_UINT8_T,
                    root as c_int,
                    self.raw,
                    req.as_mut_ptr(),
                ),
            };
            check(name, self.rank, code)?;
            req.assume_init()
        };
        Ok(Pending {
            req,
            rank: self.rank,
            done: false,
            bufs: Some((send, recv)),
        })
    }

    /// Ends the whole job (every process): for failures after which the ranks can no longer
    /// agree (the fallback path has no way to tell peers blocked inside MPI).
    pub(super) fn abort(&self, code: i32) -> ! {
        // SAFETY: MPI_Abort may be called at any time after initialization; it does not return.
        unsafe {
            ffi::MPI_Abort(self.raw, code as c_int);
        }
        std::process::abort()
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: `raw` is a communicator this struct created and nobody else frees; no call on
        // it is in flight (the backend's turn lock is released before the last handle drops).
        unsafe {
            ffi::MPI_Comm_free(&mut self.raw);
        }
    }
}

/// An MPI-3 shared-memory window over a communicator whose ranks are all on one node: every
/// rank's segment is mapped in every process, so ranks read each other's data directly.
pub(super) struct SharedWindow {
    win: ffi::MPI_Win,
    bases: Vec<*mut u8>,
    seg_bytes: usize,
    _comm: Arc<Comm>,
}

// SAFETY: the window's memory is process-shared and lives until `MPI_Win_free` in `Drop`; the
// raw pointers are only dereferenced under the synchronization protocol of `shm.rs` (a rank
// writes only its own segment, and only between the barriers that order it against readers).
unsafe impl Send for SharedWindow {}
// SAFETY: as above.
unsafe impl Sync for SharedWindow {}

impl SharedWindow {
    /// Allocates `seg_bytes` (a multiple of 4096) per rank, collectively over `comm` (whose
    /// ranks must share memory), zero-filled; after the arrival handshake ([`arrive`]) on
    /// `comm`.
    pub(super) fn allocate(
        comm: Arc<Comm>,
        seg_bytes: usize,
        gate: &Gate<'_>,
    ) -> Result<SharedWindow> {
        let rank = comm.rank;
        arrive(comm.raw, rank, gate)?;
        let mut base: *mut u8 = std::ptr::null_mut();
        let mut win = std::mem::MaybeUninit::<ffi::MPI_Win>::uninit();
        // SAFETY: the size is non-negative, disp_unit 1; MPI writes the segment's address into
        // `base` (passed as a pointer to the pointer, as the C API takes it) and the window
        // handle into `win`.
        let win = unsafe {
            check(
                "MPI_Win_allocate_shared",
                rank,
                ffi::MPI_Win_allocate_shared(
                    seg_bytes as ffi::MPI_Aint,
                    1,
                    ffi::RSMPI_INFO_NULL,
                    comm.raw,
                    &mut base as *mut *mut u8 as *mut c_void,
                    win.as_mut_ptr(),
                ),
            )?;
            win.assume_init()
        };
        let mut bases = Vec::with_capacity(comm.size);
        for r in 0..comm.size {
            let mut size: ffi::MPI_Aint = 0;
            let mut disp: c_int = 0;
            let mut ptr: *mut u8 = std::ptr::null_mut();
            // SAFETY: `win` is the window just created; MPI writes rank r's segment address and
            // size into the live out-pointers.
            unsafe {
                check(
                    "MPI_Win_shared_query",
                    rank,
                    ffi::MPI_Win_shared_query(
                        win,
                        r as c_int,
                        &mut size,
                        &mut disp,
                        &mut ptr as *mut *mut u8 as *mut c_void,
                    ),
                )?;
            }
            if (size as usize) < seg_bytes || ptr.is_null() {
                return Err(CollectiveError::Mpi {
                    call: "MPI_Win_shared_query",
                    rank,
                    message: format!(
                        "rank {r}'s shared segment has {size} bytes, expected {seg_bytes}"
                    ),
                });
            }
            bases.push(ptr);
        }
        // SAFETY: our own segment is `seg_bytes` long and not yet visible to any protocol step.
        unsafe { std::ptr::write_bytes(base, 0, seg_bytes) };
        // Nobody uses the window before every segment is zeroed (rank 0's header holds words
        // every rank updates).
        // SAFETY: `comm.raw` is a live communicator; MPI_Barrier takes no buffers.
        unsafe { check("MPI_Barrier", rank, ffi::MPI_Barrier(comm.raw))? };
        Ok(SharedWindow {
            win,
            bases,
            seg_bytes,
            _comm: comm,
        })
    }

    /// Rank `r`'s segment.
    pub(super) fn base(&self, r: usize) -> *mut u8 {
        self.bases[r]
    }

    /// Bytes per segment.
    pub(super) fn seg_bytes(&self) -> usize {
        self.seg_bytes
    }
}

impl Drop for SharedWindow {
    fn drop(&mut self) {
        // SAFETY: the window was created by `allocate` and is freed once; no rank of this
        // process reads it any more (the group's last handle is gone). MPI_Win_free is
        // collective: it returns when every rank of the communicator has freed it.
        unsafe {
            ffi::MPI_Win_free(&mut self.win);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_until_reports_completion_without_waiting_out_the_timeout() {
        let mut calls = 0;
        let t0 = Instant::now();
        let done = poll_until(Duration::from_secs(30), || {
            calls += 1;
            Ok(calls == 5)
        })
        .unwrap();
        assert!(done);
        assert_eq!(calls, 5);
        assert!(t0.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn poll_until_gives_up_after_the_timeout_and_tests_once_more() {
        let timeout = Duration::from_millis(120);
        let t0 = Instant::now();
        let mut last = None;
        let done = poll_until(timeout, || {
            last = Some(t0.elapsed());
            Ok(false)
        })
        .unwrap();
        let waited = t0.elapsed();
        assert!(!done);
        assert!(waited >= timeout, "gave up after {waited:?}");
        assert!(waited < timeout + Duration::from_secs(2), "{waited:?}");
        // The last test ran after the deadline passed.
        assert!(last.unwrap() >= timeout);
    }

    #[test]
    fn poll_until_accepts_a_completion_seen_at_the_deadline() {
        let timeout = Duration::from_millis(60);
        let t0 = Instant::now();
        // Completes only once the deadline has passed: still reported as done.
        let done = poll_until(timeout, || Ok(t0.elapsed() > timeout)).unwrap();
        assert!(done);
    }

    #[test]
    fn poll_until_passes_errors_through() {
        let mut calls = 0;
        let r = poll_until(Duration::from_secs(30), || {
            calls += 1;
            Err(CollectiveError::Mpi {
                call: "MPI_Test",
                rank: 0,
                message: "boom".into(),
            })
        });
        assert!(matches!(r, Err(CollectiveError::Mpi { .. })));
        assert_eq!(calls, 1);
    }

    #[test]
    fn group_creation_timeout_message_says_not_every_rank_arrived() {
        let e = CollectiveError::Timeout {
            op: crate::types::OpKind::Barrier,
            group: "mpi (group creation)".into(),
            seq: 0,
            rank: 1,
            waited: Duration::from_secs(3),
            missing: Vec::new(),
        };
        let text = e.to_string();
        assert!(text.contains("group mpi (group creation)"), "{text}");
        assert!(text.contains("not every one arrived"), "{text}");
        assert!(!text.contains("[]"), "{text}");
    }
}
