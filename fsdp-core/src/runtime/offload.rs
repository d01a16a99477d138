//! CPU offload copies between a compute device and the host device when their memories are of
//! different kinds (a CUDA compute device with a CPU host): the bytes go through the kernel
//! seam's host↔device copies ([`Kernels::write`] uploads, [`Kernels::read`] downloads).
//!
//! Copies between two CPU devices never come here: [`crate::runtime::comm::copy_tensor`] keeps its
//! asynchronous host copy for them, so CPU-only runs are bit for bit what they were.
//!
//! These copies are synchronous for the issuing thread (the seam's CUDA upload and download
//! synchronize the stream), so under CPU offload with a GPU the shard uploads and gradient
//! downloads do not overlap compute. Compile-checked and exercised with CPU devices only: the
//! CUDA side has never run on a GPU.

use std::sync::mpsc;

use fsdp_alloc::{DeviceId, Stream};
use fsdp_autograd::kernels::backend::{Kernels, Operand};
use fsdp_autograd::Tensor;

use crate::error::{FsdpError, Result};
use crate::runtime::comm::tensor_slice;

/// Whether copying between these devices needs the seam (the memories are not both
/// host-accessible CPU memory).
pub(crate) fn needs_seam_copy(src: DeviceId, dst: DeviceId) -> bool {
    !matches!((src, dst), (DeviceId::Cpu(_), DeviceId::Cpu(_)))
}

/// Copies `src` into `dst` (contiguous, same dtype and length, one of them on the host) in the
/// order of `stream`, which must belong to the non-host side: after the work `stream` was
/// ordered after, and before the work launched on it afterwards.
///
/// * host → device: waits for `stream` (so the source is final), reads the source on this
///   thread and uploads it on `stream`;
/// * device → host: downloads the source after `stream`'s work and writes the host destination
///   as work launched on `stream` (a host function on a CUDA stream), so events recorded on
///   `stream` afterwards cover the write.
///
/// # Errors
/// [`FsdpError::InvalidArgument`] for different dtypes or lengths, [`FsdpError::Device`] for a
/// stream on neither the device side, or for two devices that are both not the host; the
/// stream's or the seam's errors.
pub(crate) fn copy_across(src: &Tensor, dst: &Tensor, stream: &Stream) -> Result<()> {
    if src.dtype() != dst.dtype() || src.numel() != dst.numel() {
        return Err(FsdpError::InvalidArgument(format!(
            "offload copy of {} {} elements into {} {} elements; give tensors of one dtype and \
             length",
            src.numel(),
            src.dtype(),
            dst.numel(),
            dst.dtype()
        )));
    }
    let (s, d) = (tensor_slice(src)?, tensor_slice(dst)?);
    let (s_host, d_host) = (
        s.data().device_ptr().is_none(),
        d.data().device_ptr().is_none(),
    );
    let dtype = src.dtype();
    match (s_host, d_host) {
        (true, false) => {
            check_stream(stream, dst, "the destination")?;
            stream.synchronize()?;
            let bytes = s.data().read::<u8>()?.to_vec();
            let op = Operand {
                buf: d.data().clone(),
                dtype,
            };
            Kernels::for_device(dst.device())?.write(stream, bytes, &op)?;
            Ok(())
        }
        (false, true) => {
            check_stream(stream, src, "the source")?;
            let (tx, rx) = mpsc::channel::<Vec<u8>>();
            let op = Operand {
                buf: s.data().clone(),
                dtype,
            };
            Kernels::for_device(src.device())?.read(
                stream,
                &op,
                Box::new(move |b: &[u8]| {
                    let _ = tx.send(b.to_vec());
                }),
            )?;
            // A host wait for the download (CUDA: the backend synchronized the stream).
            fsdp_alloc::stream::count_host_sync();
            let Ok(bytes) = rx.recv() else {
                // The read never ran: the stream failed before it.
                stream.synchronize()?;
                return Err(FsdpError::State(format!(
                    "offload copy: the download on stream `{}` did not run",
                    stream.name()
                )));
            };
            let d = d.data().clone();
            stream.launch(move || {
                d.write::<u8>()
                    .unwrap_or_else(|e| panic!("offload copy: host destination unwritable: {e}"))
                    .copy_from_slice(&bytes);
            });
            Ok(())
        }
        (true, true) => {
            // Two host memories (CPU devices): a plain host copy in stream order.
            let (s, d) = (s.data().clone(), d.data().clone());
            stream.launch(move || {
                let s = s
                    .read::<u8>()
                    .unwrap_or_else(|e| panic!("offload copy: source unreadable: {e}"));
                d.write::<u8>()
                    .unwrap_or_else(|e| panic!("offload copy: destination unwritable: {e}"))
                    .copy_from_slice(&s);
            });
            Ok(())
        }
        (false, false) => Err(FsdpError::Device(format!(
            "offload copy between {} and {}: neither is host memory; CPU offload needs a CPU \
             host device (cpu_offload: Some(Device::cpu(..)))",
            src.device().id(),
            dst.device().id()
        ))),
    }
}

fn check_stream(stream: &Stream, t: &Tensor, what: &str) -> Result<()> {
    if stream.device() != t.device().id() {
        return Err(FsdpError::Device(format!(
            "offload copy: {what} lives on {} but the copy was issued on stream `{}` of {}; \
             issue it on a stream of the device side",
            t.device().id(),
            stream.name(),
            stream.device()
        )));
    }
    Ok(())
}

/// The device pairs CPU offload supports: a CPU host with a CPU or CUDA compute device.
///
/// # Errors
/// [`FsdpError::Device`] naming both devices when the host is not a CPU device.
pub(crate) fn check_offload_devices(compute: DeviceId, host: DeviceId) -> Result<()> {
    match (compute, host) {
        (DeviceId::Cpu(_) | DeviceId::Cuda(_), DeviceId::Cpu(_)) => Ok(()),
        (c, h) => Err(FsdpError::Device(format!(
            "CPU offload from {c} to {h}: the offload device must be a CPU device (shards, \
             sharded gradients and the optimizer live in host memory); pass \
             cpu_offload: Some(Device::cpu(..))"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use fsdp_alloc::{DType, Device};

    use super::*;
    use crate::runtime::comm::copy_tensor;

    #[test]
    fn offload_pairs_need_a_cpu_host() {
        assert!(check_offload_devices(DeviceId::Cpu(0), DeviceId::Cpu(1)).is_ok());
        assert!(check_offload_devices(DeviceId::Cuda(0), DeviceId::Cpu(1)).is_ok());
        for (c, h) in [
            (DeviceId::Cpu(0), DeviceId::Cuda(0)),
            (DeviceId::Cuda(0), DeviceId::Cuda(1)),
        ] {
            let e = check_offload_devices(c, h).unwrap_err().to_string();
            assert!(
                e.contains(&h.to_string()) && e.contains("CPU device"),
                "{e}"
            );
        }
    }

    #[test]
    fn only_pairs_with_a_non_cpu_device_take_the_seam() {
        assert!(!needs_seam_copy(DeviceId::Cpu(0), DeviceId::Cpu(7)));
        assert!(needs_seam_copy(DeviceId::Cuda(0), DeviceId::Cpu(7)));
        assert!(needs_seam_copy(DeviceId::Cpu(7), DeviceId::Cuda(0)));
        assert!(needs_seam_copy(DeviceId::Cuda(0), DeviceId::Cuda(1)));
    }

    #[test]
    fn host_copies_are_bit_exact_and_arguments_are_checked() {
        let (a, b) = (Device::cpu(0), Device::cpu(1));
        let v: Vec<f32> = (0..37).map(|i| (i as f32).sin() * 1e-3).collect();
        let src = Tensor::from_vec(v.clone(), &[37], &a).unwrap();
        let via_copy_tensor = Tensor::zeros(&[37], DType::F32, &b).unwrap();
        let via_across = Tensor::zeros(&[37], DType::F32, &b).unwrap();
        let s = fsdp_autograd::current_stream(&b);
        s.wait_event(&fsdp_autograd::current_stream(&a).record_event());
        copy_tensor(&src, &via_copy_tensor, &s).unwrap();
        copy_across(&src, &via_across, &s).unwrap();
        let bits = |t: &Tensor| -> Vec<u32> {
            t.to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        };
        let want: Vec<u32> = v.iter().map(|x| x.to_bits()).collect();
        assert_eq!(bits(&via_copy_tensor), want);
        assert_eq!(bits(&via_across), want);
        let short = Tensor::zeros(&[36], DType::F32, &b).unwrap();
        assert!(matches!(
            copy_across(&src, &short, &s),
            Err(FsdpError::InvalidArgument(_))
        ));
        let half = Tensor::zeros(&[37], DType::BF16, &b).unwrap();
        assert!(matches!(
            copy_across(&src, &half, &s),
            Err(FsdpError::InvalidArgument(_))
        ));
    }
}
