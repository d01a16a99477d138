//! The shared-memory path: steps over an MPI-3 shared window.
//!
//! Segment of rank `r` (one per rank, mapped in every process of the group):
//! `[0, 4096)` header — an `AtomicU64` step counter at offset 0 (`u64::MAX`: the rank failed);
//! rank 0's header also holds the group's *bell* (`AtomicU32` at offset 64, bumped after every
//! counter change) and *sleeper count* (offset 128);
//! then a ring of `slots` staging slots of `slot` bytes each. Step `g` uses slot `g % slots`: a
//! rank writes its contribution into its own slot, publishes `counter = g + 1` (release), waits
//! until every counter is `≥ g + 1` (acquire), then reads the peers' slots.
//!
//! **Reuse of a slot.** A rank writes slot `g % slots` again in step `g + slots`. A peer has
//! finished reading it (step `g`) once it published `counter ≥ g + 2` (it publishes step
//! `g + 1` only after it consumed step `g`). So before filling step `g` a rank waits until every
//! counter is `≥ g + 2 − slots`; with two slots that holds already (it passed barrier `g − 1`),
//! with more slots a fast rank runs up to `slots − 2` steps ahead of the slowest reader instead
//! of meeting it at every step. Small slots (about 1 MiB, the default) keep a step's staged
//! bytes in the shared last-level cache while the peers read them, so the staging copy costs
//! little memory traffic.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::exec::{Exec, Pattern};
use super::raw::SharedWindow;
use crate::error::{CollectiveError, Result};

const HEADER: usize = 4096;
const FAILED: u64 = u64::MAX;

fn round_up(n: usize) -> usize {
    n.div_ceil(HEADER) * HEADER
}

/// Bytes of one rank's segment for `slots` slots of `slot_bytes`.
pub(super) fn segment_bytes(slot_bytes: usize, slots: usize) -> usize {
    HEADER + slots * round_up(slot_bytes)
}

/// Why a step failed.
pub(super) enum StepError {
    /// These ranks did not arrive in time.
    Timeout(Vec<usize>),
    /// This rank marked itself failed.
    PeerFailed(usize),
    /// This rank's own contribution failed.
    Local(CollectiveError),
}

/// The window plus the group's geometry.
pub(super) struct Shm {
    win: SharedWindow,
    rank: usize,
    size: usize,
    slot: usize,
    slots: usize,
    timeout: Duration,
}

impl Shm {
    pub(super) fn new(
        win: SharedWindow,
        rank: usize,
        size: usize,
        slot_bytes: usize,
        slots: usize,
        timeout: Duration,
    ) -> Shm {
        debug_assert!(slots >= 2);
        debug_assert!(win.seg_bytes() >= segment_bytes(slot_bytes, slots));
        Shm {
            win,
            rank,
            size,
            slot: round_up(slot_bytes),
            slots,
            timeout,
        }
    }

    fn counter(&self, r: usize) -> &AtomicU64 {
        // SAFETY: every segment starts with 4096 header bytes, page-aligned (MPI allocates the
        // segments page-aligned and `seg_bytes` is a multiple of 4096), so offset 0 holds an
        // aligned u64 that lives as long as the window (`&self`); it is only ever accessed
        // atomically, by every process of the group.
        unsafe { &*(self.win.base(r) as *const AtomicU64) }
    }

    /// Rank 0's header word at `offset` (64 or 128: the bell and the sleeper count).
    fn word(&self, offset: usize) -> &AtomicU32 {
        // SAFETY: offsets 64 and 128 lie in rank 0's 4096-byte header, 4-byte aligned (the
        // segment is page-aligned); the words live as long as the window and are only accessed
        // atomically, by every process of the group (zeroed at allocation).
        unsafe { &*(self.win.base(0).wrapping_add(offset) as *const AtomicU32) }
    }

    /// Publishes this rank's counter and wakes the ranks sleeping on the bell.
    fn publish(&self, value: u64) {
        self.counter(self.rank).store(value, Ordering::SeqCst);
        let bell = self.word(64);
        bell.fetch_add(1, Ordering::SeqCst);
        if self.word(128).load(Ordering::SeqCst) > 0 {
            futex::wake_all(bell);
        }
    }

    fn slot_ptr(&self, r: usize, step: u64) -> *mut u8 {
        let index = (step % self.slots as u64) as usize;
        // SAFETY (of the arithmetic): HEADER + `slots` slots fit in the segment
        // (`segment_bytes`).
        self.win.base(r).wrapping_add(HEADER + index * self.slot)
    }

    /// Publishes that this rank failed: peers waiting in a step fail with
    /// [`StepError::PeerFailed`] instead of waiting for the timeout.
    pub(super) fn fail(&self, _ex: &mut Exec) {
        self.publish(FAILED);
    }

    /// `Ok(true)` once every rank's counter is `≥ target`; a failed peer is an error.
    fn arrived(&self, target: u64) -> std::result::Result<bool, StepError> {
        let mut all = true;
        for p in 0..self.size {
            let c = self.counter(p).load(Ordering::SeqCst);
            if c == FAILED && p != self.rank {
                return Err(StepError::PeerFailed(p));
            }
            all &= c >= target;
        }
        Ok(all)
    }

    /// Waits until every rank's counter is `≥ target`, without burning a core: a few spins and
    /// `yield`s (the peers are often a moment away), then it sleeps on the group's bell — a
    /// futex in the shared window on Linux (woken by the publishing rank at once), short sleeps
    /// elsewhere — so ranks sharing cores leave them to the peers they wait for.
    ///
    /// No lost wake-up: a waiter announces itself (sleeper count) before reading the bell and
    /// re-checking; a publisher bumps the bell before reading the sleeper count (all SeqCst), so
    /// either the publisher sees the sleeper and wakes it, or the waiter's re-check sees the
    /// new counter; and the futex only sleeps while the bell still has the value read.
    ///
    /// `progress` is called on every round of the wait (the hierarchical path drives its next
    /// cross-node MPI exchange with it); with one, futex sleeps last at most 1 ms.
    fn wait_all(
        &self,
        target: u64,
        progress: &mut dyn FnMut(),
        has_progress: bool,
    ) -> std::result::Result<(), StepError> {
        for tries in 0..64 {
            if self.arrived(target)? {
                return Ok(());
            }
            progress();
            if tries < 16 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        let start = Instant::now();
        let (bell, sleepers) = (self.word(64), self.word(128));
        let nap = if has_progress {
            Duration::from_millis(1)
        } else {
            Duration::from_millis(20)
        };
        loop {
            progress();
            sleepers.fetch_add(1, Ordering::SeqCst);
            let seen = bell.load(Ordering::SeqCst);
            let ready = self.arrived(target);
            if matches!(ready, Ok(false)) {
                // Bounded, so the overall timeout is checked even if nobody publishes.
                futex::wait(bell, seen, nap);
            }
            sleepers.fetch_sub(1, Ordering::SeqCst);
            if ready? || self.arrived(target)? {
                return Ok(());
            }
            if start.elapsed() > self.timeout {
                let missing = (0..self.size)
                    .filter(|&p| self.counter(p).load(Ordering::SeqCst) < target)
                    .collect();
                return Err(StepError::Timeout(missing));
            }
        }
    }

    /// One step: `fill` writes this rank's contribution (`len` bytes, or `size × len` for
    /// [`Pattern::ToAll`]; not called for a non-root rank of [`Pattern::FromRoot`]) into its
    /// slot; after the barrier the returned views are every rank's piece for this rank, in rank
    /// order. The views are valid until this rank's next step (callers consume them at once).
    pub(super) fn step<'s>(
        &'s self,
        ex: &mut Exec,
        pattern: Pattern,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> Result<()>,
    ) -> std::result::Result<Vec<&'s [u8]>, StepError> {
        self.step_with(ex, pattern, len, fill, None)
    }

    /// [`Shm::step`] calling `progress` while it waits for the peers.
    pub(super) fn step_with<'s>(
        &'s self,
        ex: &mut Exec,
        pattern: Pattern,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> Result<()>,
        progress: Option<&mut dyn FnMut()>,
    ) -> std::result::Result<Vec<&'s [u8]>, StepError> {
        let has_progress = progress.is_some();
        let mut noop = || {};
        let progress: &mut dyn FnMut() = match progress {
            Some(p) => p,
            None => &mut noop,
        };
        let g = ex.step;
        let contrib = match pattern {
            Pattern::ToAll => self.size * len,
            _ => len,
        };
        if contrib > self.slot {
            return Err(StepError::Local(CollectiveError::Mpi {
                call: "shared-memory step",
                rank: self.rank,
                message: format!(
                    "a {contrib}-byte piece does not fit a {}-byte slot",
                    self.slot
                ),
            }));
        }
        let contributes = !matches!(pattern, Pattern::FromRoot(root) if root != self.rank);
        if contributes {
            // Every peer must be done reading this slot's previous use (step g − slots).
            let free_at = (g + 2).saturating_sub(self.slots as u64);
            if let Err(e) = self.wait_all(free_at, &mut *progress, has_progress) {
                self.fail(ex);
                return Err(e);
            }
            // SAFETY: this rank's slot for step g is `self.slot ≥ contrib` bytes inside its own
            // segment, and no peer reads it now: each finished reading its previous use (step
            // g − slots) before publishing counter g − slots + 2, which we just observed (or it
            // was never used); nobody else writes it.
            let dst =
                unsafe { std::slice::from_raw_parts_mut(self.slot_ptr(self.rank, g), contrib) };
            if let Err(e) = fill(dst) {
                self.fail(ex);
                return Err(StepError::Local(e));
            }
        }
        ex.step = g + 1;
        self.publish(g + 1);
        if let Err(e) = self.wait_all(g + 1, progress, has_progress) {
            self.fail(ex);
            return Err(e);
        }
        let view = |r: usize, offset: usize| {
            // SAFETY: rank r wrote these bytes of its slot for step g before publishing counter
            // g + 1, which we observed with acquire ordering; it will not write that slot again
            // before this rank publishes counter g + 2 (its next step, after the caller consumed
            // the views), and the window outlives `&'s self`. The range lies inside the slot
            // (`offset + len ≤ contrib ≤ slot`).
            unsafe {
                std::slice::from_raw_parts(
                    self.slot_ptr(r, g).wrapping_add(offset) as *const u8,
                    len,
                )
            }
        };
        Ok((0..self.size)
            .map(|p| match pattern {
                Pattern::Gather => view(p, 0),
                Pattern::ToAll => view(p, self.rank * len),
                Pattern::FromRoot(root) => view(root, 0),
            })
            .collect())
    }
}

/// Sleeping on a word of the shared window until another process changes it.
#[cfg(target_os = "linux")]
mod futex {
    use std::sync::atomic::AtomicU32;
    use std::time::Duration;

    /// Sleeps while `word == expected`, at most `timeout` (a spurious or early return is fine:
    /// callers re-check their condition).
    pub(super) fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: FUTEX_WAIT (shared, not FUTEX_PRIVATE: the word is in memory mapped by several
        // processes) reads the aligned 32-bit word, which lives as long as `&word`, and sleeps
        // only while it equals `expected`; `ts` is a live relative timeout; the unused
        // arguments are null/0 as the call requires.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAIT,
                expected,
                &ts as *const libc::timespec,
                std::ptr::null::<u32>(),
                0u32,
            );
        }
    }

    /// Wakes every process sleeping in [`wait`] on `word`.
    pub(super) fn wake_all(word: &AtomicU32) {
        // SAFETY: FUTEX_WAKE only uses the word's address as a key; it lives as long as `&word`.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAKE,
                i32::MAX,
                std::ptr::null::<libc::timespec>(),
                std::ptr::null::<u32>(),
                0u32,
            );
        }
    }
}

/// Without futexes: short sleeps instead of a wake-up.
#[cfg(not(target_os = "linux"))]
mod futex {
    use std::sync::atomic::AtomicU32;
    use std::time::Duration;

    pub(super) fn wait(_word: &AtomicU32, _expected: u32, timeout: Duration) {
        std::thread::sleep(timeout.min(Duration::from_micros(50)));
    }

    pub(super) fn wake_all(_word: &AtomicU32) {}
}
