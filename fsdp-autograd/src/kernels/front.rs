//! [`Kernels`], the seam's front: a device's [`Backend`] behind the argument checks done once
//! for every backend. Every tensor operation, fill, copy, upload and readback goes through it.
//!
//! ```
//! use fsdp_alloc::{DType, Device};
//! use fsdp_autograd::kernels::gemm::{Gemm, MatMul};
//! use fsdp_autograd::kernels::Kernels;
//! use fsdp_autograd::Tensor;
//!
//! let dev = Device::cpu(0);
//! let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2], &dev)?;
//! let c = Tensor::zeros(&[2, 2], DType::F32, &dev)?;
//! let k = Kernels::for_device(&dev)?;
//! let g = Gemm { batch: 1, m: 2, k: 2, n: 2, trans_a: false, trans_b: false, accumulate: false };
//! let (ao, co) = (a.operand()?, c.operand()?);
//! k.launch(dev.default_stream(), &MatMul { g, a: &ao, b: &ao, c: &co })?;
//! assert_eq!(c.to_vec::<f32>()?, vec![7.0, 10.0, 15.0, 22.0]);
//! # Ok::<(), fsdp_autograd::AutogradError>(())
//! ```

use std::sync::Arc;

use fsdp_alloc::{BufferRef, DeviceId, Stream};

use super::attention::{Attention, AttentionSave};
use super::backend::{Backend, ReadFn};
use super::op::{len_err, Check, Op};
use super::operand::Operand;
use crate::error::{AutogradError, Result};

/// The seam's front: a device's [`Backend`] behind argument checks done once for every backend.
#[derive(Debug, Clone)]
pub struct Kernels {
    device: DeviceId,
    backend: Arc<dyn Backend>,
}

impl Kernels {
    /// Kernels of `device` that launch through `backend` (the constructor
    /// [`Kernels::for_device`] uses; it lives in `kernels/select.rs`, which knows the backends).
    pub(crate) fn from_backend(device: DeviceId, backend: Arc<dyn Backend>) -> Kernels {
        Kernels { device, backend }
    }

    /// Wraps an explicit backend for `device` (e.g. a test double).
    pub fn with_backend(device: DeviceId, backend: Arc<dyn Backend>) -> Kernels {
        Kernels { device, backend }
    }

    /// The backend behind the checks.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// What causal attention of shape `a` saves for its backward on this device: the CPU
    /// keeps the probabilities, CUDA (fused kernels, the default) the log-sum-exp and output.
    pub fn attention_save(&self, a: &Attention) -> AttentionSave {
        self.backend.attention_save(a)
    }

    /// True if this device's kernels take attention of shape `a` in
    /// [`AttentionLayout::Packed`](super::attention::AttentionLayout::Packed) (see
    /// [`Backend::attention_packed`]).
    pub fn attention_packed(&self, a: &Attention) -> bool {
        self.backend.attention_packed(a)
    }

    /// Checks `op` ([`Op::check`]) and launches it on `s` through the device's backend; an op
    /// with nothing to compute (an empty product or tensor) returns at once.
    ///
    /// # Errors
    /// [`AutogradError::DType`] for an operand of the wrong element type,
    /// [`AutogradError::Device`] for an operand on another device, a
    /// [`KernelError`](super::KernelError) for element counts that do not match the shape (or
    /// shapes that are invalid), the errors of the backend.
    pub fn launch(&self, s: &Stream, op: &dyn Op) -> Result<()> {
        if op.check(&Check::new(self.device))? {
            self.backend.launch(s, op)
        } else {
            Ok(())
        }
    }

    /// Checked [`Backend::write`].
    ///
    /// # Errors
    /// `dst` on another device, `bytes` of another length than `dst`, the backend's errors.
    pub fn write(&self, s: &Stream, bytes: Vec<u8>, dst: &Operand) -> Result<()> {
        Check::new(self.device).on_device("write", "dst", dst)?;
        if bytes.len() != dst.buf.len() {
            return Err(len_err(
                "write",
                "bytes",
                dst.buf.len(),
                bytes.len(),
                "the destination's byte length".into(),
            ));
        }
        if bytes.is_empty() {
            return Ok(());
        }
        self.backend.write(s, bytes, dst)
    }

    /// Checked [`Backend::copy_host`]: copies `src` into `dst` in the order of `s`, a stream of
    /// this device, without the issuing thread waiting (what CPU offload moves shards and
    /// gradients with). One of the two lives on this device; the other on this device too (CPU
    /// devices) or on a CPU device (host memory; page-locked for a truly asynchronous copy to or
    /// from a GPU, see `fsdp_alloc::Device::cpu_pinned`).
    ///
    /// # Errors
    /// A stream of another device; neither buffer on this device; the other buffer neither on
    /// this device nor on a CPU device; buffers of different lengths; the backend's errors.
    pub fn copy_host(&self, s: &Stream, src: &BufferRef, dst: &BufferRef) -> Result<()> {
        const OP: &str = "copy_host";
        if s.device() != self.device {
            return Err(AutogradError::Device {
                op: OP,
                a: format!("{} (the kernels' device)", self.device),
                b: format!("{} (stream `{}`)", s.device(), s.name()),
            });
        }
        let ours = |b: &BufferRef| b.device() == self.device;
        let host = |b: &BufferRef| matches!(b.device(), DeviceId::Cpu(_));
        if !(ours(src) && (ours(dst) || host(dst)) || ours(dst) && host(src)) {
            return Err(AutogradError::Device {
                op: OP,
                a: format!("{} (`src`)", src.device()),
                b: format!(
                    "{} (`dst`); one side must be {} and the other {} or a CPU device",
                    dst.device(),
                    self.device,
                    self.device
                ),
            });
        }
        if src.len() != dst.len() {
            return Err(len_err(
                OP,
                "dst",
                src.len(),
                dst.len(),
                "the source's byte length".into(),
            ));
        }
        if src.is_empty() {
            return Ok(());
        }
        self.backend.copy_host(s, src, dst)
    }

    /// Checked [`Backend::read`]. A readback is a host wait of the caller, counted by
    /// `fsdp_alloc::stream::host_syncs`: a backend that waits inside `read` (CUDA: it
    /// synchronizes the stream) counts its own waits; for one that did not (CPU: the bytes
    /// arrive later from the stream's worker, and the caller waits for them) this counts one.
    /// Either way every readback is at least one counted wait and no wait is counted twice.
    ///
    /// # Errors
    /// `src` on another device, the backend's errors.
    pub fn read(&self, s: &Stream, src: &Operand, f: ReadFn) -> Result<()> {
        Check::new(self.device).on_device("read", "src", src)?;
        let before = fsdp_alloc::stream::host_syncs();
        self.backend.read(s, src, f)?;
        if fsdp_alloc::stream::host_syncs() == before {
            fsdp_alloc::stream::count_host_sync();
        }
        Ok(())
    }
}

#[cfg(test)]
mod copy_host_tests {
    use fsdp_alloc::Device;

    use super::Kernels;
    use crate::AutogradError;

    /// The seam's host copy: in stream order, bit for bit, and refused for a stream of another
    /// device, a buffer on a third device, or lengths that differ.
    #[test]
    fn copy_host_checks_its_arguments_and_copies_in_stream_order() {
        let (dev, host, other) = (Device::cpu(0), Device::cpu(1), Device::cpu(2));
        let s = dev.new_stream("copy");
        let k = Kernels::for_device(&dev).unwrap();
        let src = host.alloc(64, &s).unwrap();
        let dst = dev.alloc(64, &s).unwrap();
        src.data()
            .write::<f32>()
            .unwrap()
            .copy_from_slice(&[-0.0f32; 16]);
        // A held-up stream: the copy must not run before the work launched ahead of it.
        s.launch(|| std::thread::sleep(std::time::Duration::from_millis(30)));
        k.copy_host(&s, src.data(), dst.data()).unwrap();
        s.synchronize().unwrap();
        let bits: Vec<u32> = dst
            .data()
            .read::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(bits, vec![(-0.0f32).to_bits(); 16]);

        let elsewhere = other.new_stream("x");
        assert!(matches!(
            k.copy_host(&elsewhere, src.data(), dst.data()),
            Err(AutogradError::Device { .. })
        ));
        let third = other.alloc(64, &elsewhere).unwrap();
        assert!(matches!(
            k.copy_host(&s, src.data(), third.data()),
            Err(AutogradError::Device { .. })
        ));
        let short = dev.alloc(32, &s).unwrap();
        assert!(k.copy_host(&s, src.data(), short.data()).is_err());
    }
}
