//! Host ↔ device copies, device copies and zero-fill (what `from_vec`, `to_vec`, `zeros` and
//! `clone` of a CUDA tensor need).

use fsdp_alloc::{BufferRef, Stream};

use super::context::{expect_len, Call, CudaKernels, Dev, Elem};
use super::error::Result;
use super::plan::Plan;

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
