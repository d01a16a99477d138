//! The edge to MPI: process-wide initialization through the `mpi` crate, and thin wrappers over
//! the raw calls (`mpi::ffi`) the backend needs — communicator split/dup/free, the shared-memory
//! window, and the byte-wise collectives of the fallback path. Every `unsafe` block of the MPI
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

    /// A private duplicate of `MPI_COMM_WORLD` (collective over the world).
    pub(super) fn world_dup(rt: &Arc<Runtime>) -> Result<Comm> {
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
    /// by `key`.
    pub(super) fn split(&self, color: usize, key: usize) -> Result<Comm> {
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

    /// The ranks of this communicator that share memory with this one (collective).
    pub(super) fn split_shared(&self) -> Result<Comm> {
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

    /// Non-blocking all-gather of `send` (same length on every rank) into `recv`
    /// (`size × send.len()`), polled with sleeps (never a busy loop) until done or `timeout`.
    /// On timeout the request cannot be cancelled (MPI has no cancel for collectives): the
    /// buffers are leaked to keep them valid and the caller must treat the communicator as
    /// broken. Returns `Ok(false)` on timeout.
    pub(super) fn all_gather_polled(
        &self,
        send: Vec<u8>,
        recv: &mut Vec<u8>,
        timeout: Duration,
    ) -> Result<bool> {
        let n = count("MPI_Iallgather", self.rank, send.len())?;
        recv.resize(send.len() * self.size, 0);
        let mut req = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
        // SAFETY: both buffers are live and sized for the call (recv holds size × n bytes); they
        // are not touched until the request completes, or leaked below if it never does.
        let mut req = unsafe {
            check(
                "MPI_Iallgather",
                self.rank,
                ffi::MPI_Iallgather(
                    send.as_ptr() as *const c_void,
                    n,
                    ffi::RSMPI_UINT8_T,
                    recv.as_mut_ptr() as *mut c_void,
                    n,
                    ffi::RSMPI_UINT8_T,
                    self.raw,
                    req.as_mut_ptr(),
                ),
            )?;
            req.assume_init()
        };
        let start = Instant::now();
        let mut pause = Duration::from_micros(5);
        loop {
            let mut flag: c_int = 0;
            // SAFETY: `req` is the live request from MPI_Iallgather above.
            unsafe {
                check(
                    "MPI_Test",
                    self.rank,
                    ffi::MPI_Test(&mut req, &mut flag, ffi::RSMPI_STATUS_IGNORE),
                )?;
            }
            if flag != 0 {
                return Ok(true);
            }
            if start.elapsed() > timeout {
                std::mem::forget(send);
                std::mem::forget(std::mem::take(recv));
                return Ok(false);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_micros(500));
        }
    }

    /// Blocking byte-wise `MPI_Allgather`.
    pub(super) fn all_gather(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        let n = count("MPI_Allgather", self.rank, send.len())?;
        assert_eq!(recv.len(), send.len() * self.size, "all_gather sizes");
        // SAFETY: the buffers are live for the call and sized as MPI expects (checked above).
        unsafe {
            check(
                "MPI_Allgather",
                self.rank,
                ffi::MPI_Allgather(
                    send.as_ptr() as *const c_void,
                    n,
                    ffi::RSMPI_UINT8_T,
                    recv.as_mut_ptr() as *mut c_void,
                    n,
                    ffi::RSMPI_UINT8_T,
                    self.raw,
                ),
            )
        }
    }

    /// Blocking byte-wise `MPI_Alltoall`: piece `d` of `send` goes to rank `d`; piece `s` of
    /// `recv` comes from rank `s`.
    pub(super) fn all_to_all(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        assert_eq!(send.len(), recv.len(), "all_to_all sizes");
        assert_eq!(send.len() % self.size, 0, "all_to_all pieces");
        let n = count("MPI_Alltoall", self.rank, send.len() / self.size)?;
        // SAFETY: the buffers are live for the call and hold size × n bytes each.
        unsafe {
            check(
                "MPI_Alltoall",
                self.rank,
                ffi::MPI_Alltoall(
                    send.as_ptr() as *const c_void,
                    n,
                    ffi::RSMPI_UINT8_T,
                    recv.as_mut_ptr() as *mut c_void,
                    n,
                    ffi::RSMPI_UINT8_T,
                    self.raw,
                ),
            )
        }
    }

    /// Blocking byte-wise `MPI_Bcast` from `root`.
    pub(super) fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<()> {
        let n = count("MPI_Bcast", self.rank, buf.len())?;
        // SAFETY: the buffer is live and `n` bytes long; root < size was validated by every rank.
        unsafe {
            check(
                "MPI_Bcast",
                self.rank,
                ffi::MPI_Bcast(
                    buf.as_mut_ptr() as *mut c_void,
                    n,
                    ffi::RSMPI_UINT8_T,
                    root as c_int,
                    self.raw,
                ),
            )
        }
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
    /// ranks must share memory), zero-filled.
    pub(super) fn allocate(comm: Arc<Comm>, seg_bytes: usize) -> Result<SharedWindow> {
        let rank = comm.rank;
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
