//! Host ↔ device copies, device copies and zero-fill (what `from_vec`, `to_vec`, `zeros` and
//! `clone` of a CUDA tensor need).

use fsdp_alloc::{BufferRef, Stream};

use super::context::{expect_len, Call, CudaKernels, Dev, Elem, PinnedCopy};
use super::error::CudaKernelError;
use super::error::Result;
use super::plan::Plan;

/// The largest write [`CudaKernels::upload_async`] stages in page-locked memory (4 MiB: a
/// step's batch of ids and targets, fills, position ids); larger writes are synchronous.
pub const STAGED_WRITE_MAX: usize = 4 << 20;

/// Validates `b` as device memory of this device holding exactly `expected` bytes.
fn bytes_arg(c: &Call<'_>, arg: &'static str, b: &BufferRef, expected: usize) -> Result<Dev> {
    let dev = c.buf(arg, b, Elem::U8)?;
    expect_len(c.op, arg, dev.len, expected, || "sizes in bytes".into())?;
    Ok(dev)
}

impl CudaKernels {
    /// Copies `src` into the device buffer `dst` (which must hold exactly `size_of_val(src)`
    /// bytes), after all work already enqueued on `stream`; the data is on the device when this
    /// returns. Synchronizes `stream` (meant for loading data, not for the hot path).
    ///
    /// # Errors
    /// [`KernelError::LengthMismatch`](crate::kernels::KernelError::LengthMismatch) (in bytes); buffer/stream errors; driver errors.
    pub fn upload<T: bytemuck::Pod>(
        &self,
        stream: &Stream,
        src: &[T],
        dst: &BufferRef,
    ) -> Result<()> {
        let c = self.call("upload", stream)?;
        let d = bytes_arg(&c, "dst", dst, std::mem::size_of_val(src))?;
        // SAFETY: `d` is this device's live buffer of exactly size_of_val(src) bytes.
        unsafe { c.write_from_host(src, d.ptr) }
    }

    /// Copies the host bytes `src` into the device buffer `dst` (exactly `src.len()` bytes) in
    /// the order of `stream`, **without the issuing thread waiting** — what `Tensor::from_vec`,
    /// fills and `arange` on a CUDA device use, so that a training step's batch upload (ids,
    /// targets), position ids and backward seed are no host waits. Up to
    /// [`STAGED_WRITE_MAX`] bytes are copied into page-locked staging memory of this device's
    /// staging host device first, then `cuMemcpyHtoDAsync` on `stream` (the staging block is
    /// freed in `stream`'s order: reused only after the copy ran). Larger writes (loading
    /// weights, not a step's hot path), or a driver that cannot pin host memory, take the
    /// synchronous path of [`CudaKernels::upload`] (a counted host wait).
    ///
    /// # Errors
    /// [`KernelError::LengthMismatch`](crate::kernels::KernelError::LengthMismatch) (in bytes); buffer/stream errors; driver errors.
    pub fn upload_async(&self, stream: &Stream, src: &[u8], dst: &BufferRef) -> Result<()> {
        let c = self.call("upload_async", stream)?;
        let d = bytes_arg(&c, "dst", dst, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let staging = if src.len() <= STAGED_WRITE_MAX {
            self.staging()
                .and_then(|h| h.alloc(src.len(), h.default_stream()).ok())
        } else {
            None
        };
        let Some(mut buf) = staging else {
            // SAFETY: `d` is this device's live buffer of exactly src.len() bytes.
            return unsafe { c.write_from_host(src, d.ptr) };
        };
        let host_err = |source| CudaKernelError::Host {
            op: "upload_async",
            source,
        };
        buf.data()
            .write::<u8>()
            .map_err(host_err)?
            .copy_from_slice(src);
        let Some(h) = buf.data().pinned_ptr() else {
            return Err(CudaKernelError::Internal {
                op: "upload_async",
                detail: format!("staging buffer {:?} is not page-locked", buf.data()),
            });
        };
        // SAFETY: `d` is this device's live buffer of src.len() bytes (bytes_arg) and `h` the
        // start of `buf`, src.len() bytes of live page-locked memory (written above; the write
        // guard is gone) that the BufferRef moved into the releasing host function keeps alive
        // until the copy has run.
        unsafe { c.copy_pinned(PinnedCopy::HostToDevice, buf.data(), h, d.ptr) }?;
        // The block goes back to the staging cache only once `stream` has passed this point,
        // i.e. after the copy read it.
        buf.record_stream(stream);
        Ok(())
    }

    /// Copies the device buffer `src` (exactly `size_of_val(dst)` bytes) to the host after all
    /// work enqueued on `stream`. Synchronizes `stream`.
    ///
    /// # Errors
    /// [`KernelError::LengthMismatch`](crate::kernels::KernelError::LengthMismatch) (in bytes); buffer/stream errors; driver errors (including
    /// those of earlier kernels on the stream, which surface at the synchronization).
    pub fn download<T: bytemuck::Pod>(
        &self,
        stream: &Stream,
        src: &BufferRef,
        dst: &mut [T],
    ) -> Result<()> {
        let c = self.call("download", stream)?;
        let s = bytes_arg(&c, "src", src, std::mem::size_of_val(dst))?;
        // SAFETY: `s` is this device's live buffer of exactly size_of_val(dst) bytes.
        unsafe { c.read_to_host(s.ptr, dst) }
    }

    /// Copies `src` into `dst` (the same number of bytes) in the order of `stream`, one of them
    /// this device's memory and the other host memory of a CPU device — what CPU offload moves
    /// shards and gradients with.
    ///
    /// From or into **page-locked** host memory (`fsdp_alloc::Device::cpu_pinned`) the copy is
    /// asynchronous: `cuMemcpyHtoDAsync` / `cuMemcpyDtoHAsync` on `stream`, bracketed by two
    /// host functions that take and release an [`fsdp_alloc::AccessHold`] on the host range
    /// (so host code touching it unordered is an access conflict, not a race) and keep its
    /// memory alive; the issuing thread does not wait. From **pageable** host memory the copy
    /// is synchronous for the issuing thread (the stream is synchronized first, counted as a
    /// host wait by `fsdp_alloc::stream::host_syncs`), as [`CudaKernels::upload`] and
    /// [`CudaKernels::download`] are.
    ///
    /// # Errors
    /// Neither or both buffers device memory of this device; lengths that differ; the host
    /// side inaccessible (pageable path); buffer/stream errors; driver errors.
    pub fn copy_host(&self, stream: &Stream, src: &BufferRef, dst: &BufferRef) -> Result<()> {
        let c = self.call("copy_host", stream)?;
        let n = src.len();
        let host_err = |source| CudaKernelError::Host {
            op: "copy_host",
            source,
        };
        match (src.device_ptr().is_some(), dst.device_ptr().is_some()) {
            (false, true) => {
                let d = bytes_arg(&c, "dst", dst, n)?;
                if let Some(h) = src.pinned_ptr() {
                    // SAFETY: `d` is this device's live buffer of n bytes (bytes_arg) and `h`
                    // the start of `src`, n bytes of live page-locked memory that `src` (moved
                    // into the releasing host function) keeps alive until the copy has run.
                    return unsafe { c.copy_pinned(PinnedCopy::HostToDevice, src, h, d.ptr) };
                }
                // Pageable: the host source is final once the stream's earlier work has run
                // (one counted host wait; the copy below belongs to it).
                stream.synchronize().map_err(host_err)?;
                let bytes = src.read::<u8>().map_err(host_err)?.to_vec();
                // SAFETY: `d` is this device's live buffer of exactly n bytes, and the stream
                // was synchronized just above.
                unsafe { c.write_from_host_synced(&bytes, d.ptr) }
            }
            (true, false) => {
                let s = bytes_arg(&c, "src", src, n)?;
                if let Some(h) = dst.pinned_ptr() {
                    // SAFETY: as above, with the roles swapped: `s` is this device's live
                    // buffer of n bytes, `h` n bytes of live page-locked memory kept alive by
                    // `dst` until the copy has run.
                    return unsafe { c.copy_pinned(PinnedCopy::DeviceToHost, dst, h, s.ptr) };
                }
                // Pageable: the download synchronizes the stream (a counted host wait).
                let mut host = vec![0u8; n];
                // SAFETY: `s` is this device's live buffer of exactly n bytes.
                unsafe { c.read_to_host(s.ptr, &mut host) }?;
                // Written in stream order, so events recorded on `stream` afterwards cover it.
                let dst = dst.clone();
                stream.launch(move || {
                    dst.write::<u8>()
                        .unwrap_or_else(|e| panic!("copy_host: host destination unwritable: {e}"))
                        .copy_from_slice(&host);
                });
                Ok(())
            }
            _ => Err(CudaKernelError::NotDeviceMemory {
                op: "copy_host",
                arg: "src/dst",
                buffer: format!(
                    "{src:?} → {dst:?}: exactly one side must be device memory of {}",
                    self.id()
                ),
            }),
        }
    }

    /// Enqueues a zero-fill of the device buffer `buf` on `stream` (all bytes 0, i.e. `0.0` for
    /// the float types).
    ///
    /// # Errors
    /// Buffer/stream errors; driver errors.
    pub fn zero(&self, stream: &Stream, buf: &BufferRef) -> Result<()> {
        let c = self.call("zero", stream)?;
        let b = bytes_arg(&c, "buf", buf, buf.len())?;
        let mut plan = Plan::new();
        plan.memset(b.as_ptr(), 0, b.len);
        // SAFETY: `b` is this device's live buffer of b.len bytes.
        unsafe { c.exec(&plan) }.map(drop)
    }

    /// Enqueues a copy of the device buffer `src` into `dst` (same byte length, not
    /// overlapping) on `stream`.
    ///
    /// # Errors
    /// [`KernelError::LengthMismatch`](crate::kernels::KernelError::LengthMismatch) (in bytes); buffer/stream errors; overlap; driver errors.
    pub fn copy(&self, stream: &Stream, src: &BufferRef, dst: &BufferRef) -> Result<()> {
        let c = self.call("copy", stream)?;
        let s = bytes_arg(&c, "src", src, src.len())?;
        let d = bytes_arg(&c, "dst", dst, src.len())?;
        c.disjoint(&[("dst", dst)], &[("src", src)])?;
        let mut plan = Plan::new();
        plan.copy(d.as_ptr(), s.as_ptr(), s.len);
        // SAFETY: both are this device's live buffers of s.len bytes and do not overlap.
        unsafe { c.exec(&plan) }.map(drop)
    }
}
