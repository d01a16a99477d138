//! The seam's `Backend` trait for [`CudaBackend`] (feature `cuda`): a launch runs the op's own
//! CUDA launch ([`Op::cuda`](crate::kernels::Op::cuda)); readback, upload and host copies go
//! through the device's `CudaKernels`. Without the feature the type exists with the same
//! constructor, which returns [`AutogradError::CudaNotBuilt`](crate::AutogradError::CudaNotBuilt).

#[cfg(not(feature = "cuda"))]
mod imp {
    use std::sync::Arc;

    use fsdp_alloc::Device;

    use crate::error::{AutogradError, Result};
    use crate::kernels::backend::Backend;
    use crate::kernels::cuda::CudaBackend;

    impl CudaBackend {
        /// The backend of a CUDA device.
        ///
        /// # Errors
        /// Always [`AutogradError::CudaNotBuilt`] in this build (the `cuda` feature is off).
        pub fn for_device(device: &Device) -> Result<Arc<dyn Backend>> {
            Err(AutogradError::CudaNotBuilt {
                op: "kernels",
                device: device.id().to_string(),
            })
        }
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};

    use fsdp_alloc::{BufferRef, Device, DeviceId, Stream};

    use crate::error::Result;
    use crate::kernels::attention::{Attention, AttentionSave};
    use crate::kernels::backend::{Backend, ReadFn};
    use crate::kernels::cuda::launcher::{err, CudaBackend};
    use crate::kernels::cuda::{fused_attention, CudaKernels, FUSED_ATTENTION_MAX_D};
    use crate::kernels::op::Op;
    use crate::kernels::operand::Operand;

    impl CudaBackend {
        /// The backend of a CUDA device (cached per device).
        ///
        /// # Errors
        /// [`AutogradError::Backend`](crate::AutogradError::Backend) if the kernels cannot be
        /// compiled or loaded (NVRTC, cuBLAS or the driver missing or failing).
        pub fn for_device(device: &Device) -> Result<Arc<dyn Backend>> {
            static CACHE: OnceLock<Mutex<HashMap<DeviceId, Arc<CudaBackend>>>> = OnceLock::new();
            let mut cache = CACHE
                .get_or_init(Default::default)
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if let Some(b) = cache.get(&device.id()) {
                return Ok(Arc::clone(b) as Arc<dyn Backend>);
            }
            let k = CudaKernels::new(device).map_err(err("kernels"))?;
            let b = Arc::new(CudaBackend::new(k));
            cache.insert(device.id(), Arc::clone(&b));
            Ok(b)
        }
    }

    impl Backend for CudaBackend {
        fn name(&self) -> &'static str {
            "cuda"
        }

        fn launch(&self, s: &Stream, op: &dyn Op) -> Result<()> {
            op.cuda(self, s)
        }

        fn write(&self, s: &Stream, bytes: Vec<u8>, dst: &Operand) -> Result<()> {
            self.kernels()
                .upload_async(s, &bytes, &dst.buf)
                .map_err(err("write"))
        }

        fn copy_host(&self, s: &Stream, src: &BufferRef, dst: &BufferRef) -> Result<()> {
            self.kernels()
                .copy_host(s, src, dst)
                .map_err(err("copy_host"))
        }

        fn attention_save(&self, a: &Attention) -> AttentionSave {
            if fused_attention() && (1..=FUSED_ATTENTION_MAX_D).contains(&a.d) {
                AttentionSave::Lse
            } else {
                AttentionSave::Probs
            }
        }

        /// The fused kernels take the packed layout; the unfused ones (probabilities) do not.
        fn attention_packed(&self, a: &Attention) -> bool {
            self.attention_save(a) == AttentionSave::Lse
        }

        fn read(&self, s: &Stream, src: &Operand, f: ReadFn) -> Result<()> {
            // The checks launched so far; the download synchronizes `s` (one counted host
            // wait), after which the checks of `s` are read without another one.
            let checks = self.take_checks();
            let mut host = vec![0u8; src.buf.len()];
            self.kernels()
                .download(s, &src.buf, &mut host)
                .map_err(err("read"))?;
            self.drain_checks(checks, s)?;
            f(&host);
            Ok(())
        }
    }
}
