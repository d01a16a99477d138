//! Raw device memory and the only `unsafe` code that touches it.
//!
//! A [`Segment`] is one raw allocation from the device (on CPU: `std::alloc`, zero-filled, 4 KiB
//! aligned). The caching allocator carves segments into blocks. Code above this crate never sees a
//! pointer: it holds [`BufferRef`]s (a segment, a byte range) and reads or writes through
//! [`ReadGuard`] / [`WriteGuard`].
//!
//! ## The invariants that make this sound
//! 1. A segment's memory lives as long as any `Arc<Segment>` — every `BufferRef` holds one — so a
//!    queued kernel can never touch released memory, whatever the allocator has done meanwhile.
//! 2. Every guard registers its byte range in the segment's table of active accesses before it
//!    creates a slice, and removes it on drop. A write guard is refused while any overlapping guard
//!    is live; a read guard is refused while an overlapping write guard is live. So a `&mut [T]`
//!    never aliases another live slice: what would be a data race between unordered streams
//!    becomes an [`AllocError::AccessConflict`] (and the stream that hit it fails) instead of
//!    undefined behaviour.
//! 3. Slices are created only for `T: bytemuck::Pod` at an address aligned for `T` and a length
//!    that is a whole number of `T`s, inside the segment. Memory starts zeroed, so every byte is
//!    initialized and every bit pattern is a valid `T`.
//!
//! 4. Device (CUDA) segments have no host pointer: guards refuse them with
//!    [`AllocError::BadAccess`]; their memory is reached only through [`BufferRef::device_ptr`]
//!    by device kernels, and released by the CUDA module when the last `Arc<Segment>` goes.
//!
//! Ordering (that a reader on stream B runs after the writer on stream A) is *not* enforced by
//! invariant 2 alone: that is stream order plus events, verified by the checked mode, whose hook
//! (`checked::on_access`) every guard calls before it registers.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::checked::{self, History};
use crate::error::{AllocError, Result};
use crate::DeviceId;

/// Alignment of every segment (and so of every block start, which is a multiple of 512 inside it).
pub const SEGMENT_ALIGN: usize = 4096;

static NEXT_SEGMENT_ID: AtomicU64 = AtomicU64::new(1);
static NEXT_GUARD_ID: AtomicU64 = AtomicU64::new(1);

#[derive(Debug, Clone, Copy)]
struct ActiveAccess {
    start: usize,
    end: usize,
    write: bool,
    token: u64,
}

/// One raw allocation from a device.
pub struct Segment {
    /// Host-accessible memory (`None` for device memory that the host cannot touch).
    ptr: Option<NonNull<u8>>,
    size: usize,
    id: u64,
    device: DeviceId,
    active: Mutex<Vec<ActiveAccess>>,
    history: History,
    #[cfg(feature = "cuda")]
    cuda: Option<crate::cuda::DeviceMemory>,
    /// Page-locked host memory (`ptr` points into it; freed by its own Drop).
    #[cfg(feature = "cuda")]
    pinned: Option<crate::cuda::PinnedMemory>,
}

// SAFETY: the segment owns its memory exclusively (no other code holds the raw pointer), and all
// access goes through guards that exclude overlapping mutable access (invariant 2 above).
unsafe impl Send for Segment {}
// SAFETY: as above; shared access from several threads is mediated by the `active` table.
unsafe impl Sync for Segment {}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("id", &self.id)
            .field("size", &self.size)
            .field("device", &self.device)
            .finish()
    }
}

impl Segment {
    /// Allocates `size` zeroed bytes (size > 0) on the host for a CPU device. `None` if the host
    /// allocator refuses (the caller turns that into an OOM error).
    pub fn new_cpu(device: DeviceId, size: usize) -> Option<Arc<Segment>> {
        let size = size.max(1);
        let layout = Layout::from_size_align(size, SEGMENT_ALIGN).ok()?;
        // SAFETY: `layout` has non-zero size (size.max(1)) and a valid power-of-two alignment.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw)?;
        Some(Arc::new(Segment {
            ptr: Some(ptr),
            size,
            id: NEXT_SEGMENT_ID.fetch_add(1, Ordering::Relaxed),
            device,
            active: Mutex::new(Vec::new()),
            history: History::default(),
            #[cfg(feature = "cuda")]
            cuda: None,
            #[cfg(feature = "cuda")]
            pinned: None,
        }))
    }

    /// A segment over page-locked host memory (host-accessible like a CPU segment, and
    /// reachable by asynchronous device copies through [`BufferRef::pinned_ptr`]).
    #[cfg(feature = "cuda")]
    pub(crate) fn new_pinned(device: DeviceId, mem: crate::cuda::PinnedMemory) -> Arc<Segment> {
        Arc::new(Segment {
            ptr: Some(mem.ptr()),
            size: mem.size(),
            id: NEXT_SEGMENT_ID.fetch_add(1, Ordering::Relaxed),
            device,
            active: Mutex::new(Vec::new()),
            history: History::default(),
            cuda: None,
            pinned: Some(mem),
        })
    }

    /// True for page-locked host memory.
    pub fn is_pinned(&self) -> bool {
        #[cfg(feature = "cuda")]
        if self.pinned.is_some() {
            return true;
        }
        false
    }

    /// A segment over CUDA device memory (not host-accessible: guards refuse it).
    #[cfg(feature = "cuda")]
    pub(crate) fn new_cuda(device: DeviceId, mem: crate::cuda::DeviceMemory) -> Arc<Segment> {
        Arc::new(Segment {
            ptr: None,
            size: mem.size(),
            id: NEXT_SEGMENT_ID.fetch_add(1, Ordering::Relaxed),
            device,
            active: Mutex::new(Vec::new()),
            history: History::default(),
            cuda: Some(mem),
            pinned: None,
        })
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Process-unique id (for messages).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Owning device.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// Number of guards currently reading or writing this segment.
    pub fn active_accesses(&self) -> usize {
        self.active.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    fn register(
        &self,
        start: usize,
        end: usize,
        write: bool,
        what: &dyn Fn() -> String,
    ) -> Result<u64> {
        let mut active = self.active.lock().unwrap_or_else(|e| e.into_inner());
        if start < end {
            if let Some(c) = active
                .iter()
                .find(|a| a.start < end && start < a.end && (write || a.write))
            {
                return Err(AllocError::AccessConflict {
                    what: what(),
                    detail: format!(
                        "a {} of bytes {start}..{end} overlaps a live {} of bytes {}..{} in segment {}; \
                         the two were not ordered (missing stream wait_event?)",
                        if write { "write" } else { "read" },
                        if c.write { "write" } else { "read" },
                        c.start,
                        c.end,
                        self.id
                    ),
                });
            }
        }
        let token = NEXT_GUARD_ID.fetch_add(1, Ordering::Relaxed);
        active.push(ActiveAccess {
            start,
            end,
            write,
            token,
        });
        Ok(token)
    }

    fn unregister(&self, token: u64) {
        let mut active = self.active.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = active.iter().position(|a| a.token == token) {
            active.swap_remove(i);
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // (CUDA memory is released by `DeviceMemory`'s own Drop, page-locked memory by
        // `PinnedMemory`'s.)
        if self.is_pinned() {
            return;
        }
        let Some(ptr) = self.ptr else { return };
        let Ok(layout) = Layout::from_size_align(self.size, SEGMENT_ALIGN) else {
            return; // unreachable: the same layout was valid at allocation
        };
        // SAFETY: `ptr` came from `alloc_zeroed(layout)` with this exact layout, and no guard can
        // be alive (guards borrow a `BufferRef` that holds an `Arc` of this segment).
        unsafe { dealloc(ptr.as_ptr(), layout) }
    }
}

/// A non-owning handle to a byte range of device memory: what launched work captures.
///
/// It keeps the segment's memory alive but does not keep the *allocation* alive: once the owning
/// [`crate::Buffer`] is dropped, the allocator may hand the same bytes to a new allocation that is
/// ordered after this one on the same stream — exactly the CUDA caching allocator's contract.
#[derive(Clone)]
pub struct BufferRef {
    seg: Arc<Segment>,
    offset: usize,
    len: usize,
    block: u64,
}

impl std::fmt::Debug for BufferRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "BufferRef(block {} on {}: segment {} bytes {}..{})",
            self.block,
            self.seg.device,
            self.seg.id,
            self.offset,
            self.offset + self.len
        )
    }
}

impl BufferRef {
    /// A reference to `len` bytes at `offset` of `seg`, belonging to allocation `block`.
    pub(crate) fn new(seg: Arc<Segment>, offset: usize, len: usize, block: u64) -> BufferRef {
        assert!(offset + len <= seg.size, "block outside its segment");
        BufferRef {
            seg,
            offset,
            len,
            block,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length range.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The allocation (block) id this range belongs to.
    pub fn block_id(&self) -> u64 {
        self.block
    }

    /// The device holding the memory.
    pub fn device(&self) -> DeviceId {
        self.seg.device
    }

    /// (segment id, byte offset in the segment): identifies the physical location.
    pub fn location(&self) -> (u64, usize) {
        (self.seg.id, self.offset)
    }

    /// True if the two ranges share at least one byte.
    pub fn overlaps(&self, other: &BufferRef) -> bool {
        self.seg.id == other.seg.id
            && self.offset < other.offset + other.len
            && other.offset < self.offset + self.len
    }

    /// A sub-range: `len` bytes starting `offset` bytes into this one.
    pub fn slice(&self, offset: usize, len: usize) -> Result<BufferRef> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(AllocError::BadAccess(format!(
                "sub-range {offset}..{} of a {}-byte buffer (block {})",
                offset.saturating_add(len),
                self.len,
                self.block
            )));
        }
        Ok(BufferRef {
            seg: Arc::clone(&self.seg),
            offset: self.offset + offset,
            len,
            block: self.block,
        })
    }

    /// A sub-range in elements of `T`: `count` elements starting at element `start`.
    pub fn slice_elems<T>(&self, start: usize, count: usize) -> Result<BufferRef> {
        let sz = std::mem::size_of::<T>();
        self.slice(start * sz, count * sz)
    }

    /// The raw device address of the range's first byte, for device kernels (CUDA memory only;
    /// `None` for host memory, which is accessed through [`BufferRef::read`] / [`BufferRef::write`]).
    pub fn device_ptr(&self) -> Option<u64> {
        #[cfg(feature = "cuda")]
        if let Some(m) = &self.seg.cuda {
            return Some(m.ptr() + self.offset as u64);
        }
        None
    }

    /// True if the range is page-locked host memory (a CPU device built with
    /// [`crate::Device::cpu_pinned`]): device copy engines can read and write it asynchronously.
    pub fn is_pinned(&self) -> bool {
        self.seg.is_pinned()
    }

    /// The host address of the range's first byte if it is page-locked host memory (for
    /// asynchronous device copies, which must hold an [`AccessHold`] over the range while they
    /// run); `None` otherwise.
    pub fn pinned_ptr(&self) -> Option<u64> {
        if !self.is_pinned() {
            return None;
        }
        let base = self.seg.ptr?;
        Some(base.as_ptr() as u64 + self.offset as u64)
    }

    /// Registers a read (`write == false`) or write of the whole range, held until the returned
    /// [`AccessHold`] is dropped, without creating a slice: for accesses by something other than
    /// host code (a copy engine's asynchronous copy of pinned memory). Like a guard, it is
    /// refused while a conflicting guard or hold is live, and it keeps conflicting guards from
    /// being taken while it lives; in checked mode it is checked as an access of the current
    /// launched work.
    ///
    /// # Errors
    /// [`AllocError::BadAccess`] for device memory; [`AllocError::AccessConflict`];
    /// [`AllocError::OrderingViolation`] (checked mode).
    pub fn hold(&self, write: bool) -> Result<AccessHold> {
        self.host_ptr()?;
        let (start, end) = (self.offset, self.offset + self.len);
        checked::on_access(
            &self.seg.history,
            self.seg.id,
            start,
            end,
            write,
            self.block,
        )?;
        let token = self.seg.register(start, end, write, &|| self.describe())?;
        Ok(AccessHold {
            seg: Arc::clone(&self.seg),
            token,
        })
    }

    fn host_ptr(&self) -> Result<NonNull<u8>> {
        self.seg.ptr.ok_or_else(|| {
            AllocError::BadAccess(format!(
                "{self:?} is device memory the host cannot access; launch a device kernel on \
                 its device_ptr() instead"
            ))
        })
    }

    fn check_typed<T: bytemuck::Pod>(&self) -> Result<usize> {
        let sz = std::mem::size_of::<T>();
        let addr = self.host_ptr()?.as_ptr() as usize + self.offset;
        if sz == 0 || self.len % sz != 0 || addr % std::mem::align_of::<T>() != 0 {
            return Err(AllocError::BadAccess(format!(
                "{} bytes at offset {} of block {} are not a whole, aligned slice of {}",
                self.len,
                self.offset,
                self.block,
                std::any::type_name::<T>()
            )));
        }
        Ok(self.len / sz)
    }

    fn describe(&self) -> String {
        format!("{self:?}")
    }

    /// The checks and bookkeeping of a host access to the whole range as `T` (a `write` or a
    /// read): the typed check, the checked-stream ordering check, and the registration of the
    /// guard. Returns the range's host address, its number of `T`s and the guard's token.
    fn access<T: bytemuck::Pod>(&self, write: bool) -> Result<(*mut u8, usize, u64)> {
        let n = self.check_typed::<T>()?;
        let base = self.host_ptr()?;
        let (start, end) = (self.offset, self.offset + self.len);
        checked::on_access(
            &self.seg.history,
            self.seg.id,
            start,
            end,
            write,
            self.block,
        )?;
        let token = self.seg.register(start, end, write, &|| self.describe())?;
        // SAFETY: `offset` lies within the live segment (checked in `new`/`slice`), so the
        // offset pointer stays inside the same allocation.
        Ok((unsafe { base.as_ptr().add(self.offset) }, n, token))
    }

    /// Shared access as `&[T]`. Fails if the range is being written right now (an unordered race)
    /// or does not hold a whole, aligned number of `T`, or is device memory. Inside work launched
    /// on a checked stream, also fails with [`AllocError::OrderingViolation`] (and fails that
    /// stream) if the last write of these bytes is not ordered before this read.
    pub fn read<T: bytemuck::Pod>(&self) -> Result<ReadGuard<'_, T>> {
        let (ptr, n, token) = self.access::<T>(false)?;
        // SAFETY: `ptr` is the start of the range in the live segment, aligned for `T` and
        // followed by `n` whole `T`s (access), initialized (zeroed at allocation; Pod has no
        // invalid bit patterns), and no overlapping write guard exists (register), so no `&mut`
        // aliases it for the guard's lifetime.
        let slice = unsafe { std::slice::from_raw_parts(ptr as *const T, n) };
        Ok(ReadGuard {
            r: self,
            slice,
            token,
        })
    }

    /// Exclusive access as `&mut [T]`. Fails if any overlapping access is live, or (checked
    /// mode, inside launched work) if an earlier read or write of these bytes is not ordered
    /// before this write — which is also how a block freed without `record_stream` and reused
    /// by another stream is caught.
    pub fn write<T: bytemuck::Pod>(&self) -> Result<WriteGuard<'_, T>> {
        let (ptr, n, token) = self.access::<T>(true)?;
        // SAFETY: as in `read`, and `register` refused if any overlapping guard (read or write)
        // is live, so this `&mut` is the only reference to these bytes while the guard lives.
        let slice = unsafe { std::slice::from_raw_parts_mut(ptr as *mut T, n) };
        Ok(WriteGuard {
            r: self,
            slice,
            token,
            _p: PhantomData,
        })
    }
}

/// A registered access to a [`BufferRef`]'s range without a slice ([`BufferRef::hold`]);
/// releases the range on drop. Owns a reference to the segment, so it can be moved into work
/// that runs later (a host function after an asynchronous copy).
pub struct AccessHold {
    seg: Arc<Segment>,
    token: u64,
}

impl std::fmt::Debug for AccessHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "AccessHold(segment {}, token {})",
            self.seg.id, self.token
        )
    }
}

impl Drop for AccessHold {
    fn drop(&mut self) {
        self.seg.unregister(self.token);
    }
}

/// Shared access to a [`BufferRef`]'s elements; releases the range on drop.
pub struct ReadGuard<'a, T> {
    r: &'a BufferRef,
    slice: &'a [T],
    token: u64,
}

impl<T> std::ops::Deref for ReadGuard<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.slice
    }
}

impl<T> Drop for ReadGuard<'_, T> {
    fn drop(&mut self) {
        self.r.seg.unregister(self.token);
    }
}

/// Exclusive access to a [`BufferRef`]'s elements; releases the range on drop.
pub struct WriteGuard<'a, T> {
    r: &'a BufferRef,
    slice: &'a mut [T],
    token: u64,
    _p: PhantomData<&'a mut [T]>,
}

impl<T> std::ops::Deref for WriteGuard<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.slice
    }
}

impl<T> std::ops::DerefMut for WriteGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.slice
    }
}

impl<T> Drop for WriteGuard<'_, T> {
    fn drop(&mut self) {
        self.r.seg.unregister(self.token);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf(bytes: usize) -> BufferRef {
        let seg = Segment::new_cpu(DeviceId::Cpu(0), bytes).unwrap();
        BufferRef::new(seg, 0, bytes, 1)
    }

    #[test]
    fn starts_zeroed_and_round_trips() {
        let b = buf(64);
        assert!(b.read::<f32>().unwrap().iter().all(|&x| x == 0.0));
        b.write::<f32>().unwrap()[3] = 2.5;
        assert_eq!(b.read::<f32>().unwrap()[3], 2.5);
    }

    #[test]
    fn overlapping_write_is_refused() {
        let b = buf(64);
        let r = b.read::<f32>().unwrap();
        let sub = b.slice(8, 8).unwrap();
        let e = sub.write::<f32>().err().unwrap();
        assert!(matches!(e, AllocError::AccessConflict { .. }), "{e}");
        let _r2 = sub.read::<f32>().unwrap(); // two readers are fine
        drop(r);
        drop(_r2);
        let _w = sub.write::<f32>().unwrap();
        // a disjoint range may be written concurrently
        let other = b.slice(32, 8).unwrap();
        let _w2 = other.write::<f32>().unwrap();
    }

    #[test]
    fn holds_conflict_like_guards_and_release_on_drop() {
        let b = buf(64);
        assert!(
            !b.is_pinned() && b.pinned_ptr().is_none(),
            "CPU memory is pageable"
        );
        let h = b.slice(0, 16).unwrap().hold(true).unwrap();
        let e = b.read::<f32>().err().unwrap();
        assert!(matches!(e, AllocError::AccessConflict { .. }), "{e}");
        assert!(
            b.slice(16, 16).unwrap().hold(false).is_ok(),
            "disjoint ranges are free"
        );
        // A hold outlives the reference it was taken from.
        let moved = std::thread::spawn(move || h).join().unwrap();
        assert!(b.slice(8, 8).unwrap().hold(false).is_err());
        drop(moved);
        assert_eq!(b.seg.active_accesses(), 0);
        let r = b.read::<f32>().unwrap();
        assert!(b.hold(false).is_ok(), "two reads are fine");
        assert!(
            b.hold(true).is_err(),
            "a write hold waits for the read guard"
        );
        drop(r);
    }

    #[test]
    fn misaligned_or_ragged_access_is_an_error() {
        let b = buf(64);
        assert!(b.slice(2, 8).unwrap().read::<f32>().is_err());
        assert!(b.slice(0, 6).unwrap().read::<f32>().is_err());
        assert!(b.slice(60, 8).is_err());
    }
}
