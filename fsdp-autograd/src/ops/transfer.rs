//! Moving tensors between devices: [`Tensor::to`].

use fsdp_alloc::Device;

use crate::autograd::{needs_grad, record1};
use crate::context::current_stream;
use crate::error::Result;
use crate::kernels::Kernels;
use crate::tensor::Tensor;

impl Tensor {
    /// A copy of this tensor on `device` (host↔device or between devices of one kind), same
    /// shape and dtype, contiguous. Returns `self` when it already lives on `device`.
    ///
    /// The copy goes through host memory: it waits for the work producing `self` (the source's
    /// readback through the seam), then uploads on the destination's current stream. Autograd
    /// sees it: the gradient is moved back to the source device.
    ///
    /// ```
    /// use fsdp_alloc::Device;
    /// use fsdp_autograd::Tensor;
    ///
    /// let (a, b) = (Device::cpu(0), Device::cpu(1));
    /// let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3], &a)?;
    /// let y = x.to(&b)?;
    /// assert_eq!(y.device().id(), b.id());
    /// assert_eq!(y.to_vec::<f32>()?, vec![1.0, 2.0, 3.0]);
    /// # Ok::<(), fsdp_autograd::AutogradError>(())
    /// ```
    ///
    /// # Errors
    /// The seam's errors for either device (e.g. [`crate::AutogradError::CudaNotBuilt`]), the
    /// source stream's failure, or an allocation failure on `device`.
    pub fn to(&self, device: &Device) -> Result<Tensor> {
        if self.device() == device {
            return Ok(self.clone());
        }
        let src = self.contig()?;
        let bytes = src.read_bytes("to")?;
        let stream = current_stream(device);
        let out = Tensor::empty_on(self.shape(), self.dtype(), device, &stream)?;
        if !bytes.is_empty() {
            let o = out.operand_on("to", &stream)?;
            Kernels::for_device(device)?.write(&stream, bytes, &o)?;
        }
        if !needs_grad(&[self]) {
            return Ok(out);
        }
        let from = self.device().clone();
        Ok(record1(
            "to",
            &[self],
            out,
            move |g: Vec<Option<Tensor>>| {
                Ok(vec![g[0].as_ref().map(|g| g.to(&from)).transpose()?])
            },
        ))
    }
}
