//! CPU offload's copies between the compute device and the host device that holds the shards,
//! sharded gradients and optimizer state, all on one dedicated **copy stream** of the compute
//! device (`fsdp-offload-copy`), ordered by events, never by host waits:
//!
//! - [`upload`] (an unshard's input): the copy stream waits for the last optimizer update of
//!   the shards (`params_ready`, an event of the host stream), copies the host shard into a new
//!   compute-device tensor, and the consumer (the unshard stream, whose all-gather reads it)
//!   waits for the copy's event. Issued with the unshard — for a prefetched unit while the
//!   current unit computes — so uploads overlap compute like the prefetched all-gathers.
//! - [`download`] (a reduced gradient shard): the copy stream waits for the reduction, copies
//!   the gradient into a new host tensor, and the consumer (the host stream, which accumulates
//!   it and runs the optimizer) waits for the copy's event.
//!
//! Both go through the kernel seam's [`Kernels::copy_host`], the same code path on CPU and CUDA
//! devices: on CPU devices a byte copy launched on the copy stream (bit for bit what offload did
//! before), on CUDA `cuMemcpyHtoDAsync` / `cuMemcpyDtoHAsync` from and into page-locked host
//! memory (`fsdp_alloc::Device::cpu_pinned`; from pageable memory the seam falls back to a
//! synchronous copy and counts the host wait). The issuing thread never blocks per unit: the
//! only waits are device-side (a stream waiting on an event).

use fsdp_alloc::{Device, DeviceId, Event, Stream};
use fsdp_autograd::kernels::Kernels;
use fsdp_autograd::{with_stream, Tensor};

use crate::error::{ArgumentError, DeviceError, DtypeError, ExpectedDevice, FsdpError, Result};
use crate::runtime::comm::{tensor_slice, CommContext};

/// The shard as a tensor on `ctx`'s compute device for work launched on `stream`: itself, or
/// (CPU offload) a copy [`upload`]ed on the copy stream after `ready` (the last optimizer
/// update), which `stream` waits for.
///
/// # Errors
/// [`upload`]'s errors.
pub(crate) fn shard_on_device(
    ctx: &CommContext,
    shard: &Tensor,
    stream: &Stream,
    ready: &Event,
) -> Result<Tensor> {
    if !ctx.offload {
        return Ok(shard.clone());
    }
    upload(shard, &ctx.device, &ctx.copy_stream, ready, stream)
}

/// Copies the host `shard` into a new tensor on `device` for `consumer`: on the copy stream
/// `copy` (of `device`) after `ready` (the shards' last update), and `consumer` waits for the
/// copy.
///
/// The new tensor belongs to `consumer` (allocated on it, so its block is recycled in the
/// consumer's order exactly as when the consumer copied the shard itself: no more compute-device
/// memory than before the copy stream); the copy stream first waits for the consumer's earlier
/// work, so a recycled block's last reader has finished before the copy overwrites it.
///
/// # Errors
/// The allocator's, the seam's and [`copy_across`]'s errors.
pub(crate) fn upload(
    shard: &Tensor,
    device: &Device,
    copy: &Stream,
    ready: &Event,
    consumer: &Stream,
) -> Result<Tensor> {
    let dev = with_stream(consumer, || {
        Tensor::empty(&[shard.numel()], shard.dtype(), device)
    })?;
    copy.wait_event(&consumer.record_event());
    copy.wait_event(ready);
    copy_across(shard, &dev, copy)?;
    consumer.wait_event(&copy.record_event());
    Ok(dev)
}

/// Copies `reduced` (a gradient shard on the compute device, produced on `produced_on`) into a
/// new tensor on the `host` device for `consumer`: on the copy stream `copy` after the work
/// launched on `produced_on` so far, and `consumer` waits for the copy. `reduced`'s memory is
/// released in `copy`'s order.
///
/// # Errors
/// The allocator's, the seam's and [`copy_across`]'s errors.
pub(crate) fn download(
    reduced: Tensor,
    host: &Device,
    copy: &Stream,
    produced_on: &Stream,
    consumer: &Stream,
) -> Result<Tensor> {
    copy.wait_event(&produced_on.record_event());
    // Owned by the copy stream, which writes it first; it is freed after the optimizer read it
    // on the host stream, and the copy stream's next write of it comes after its next wait on
    // `params_ready` (an upload of the next iteration precedes any download in it).
    let buf = host.alloc(reduced.numel() * reduced.dtype().size(), copy)?;
    let host_grad = Tensor::from_buffer(buf, &[reduced.numel()], reduced.dtype(), host)?;
    copy_across(&reduced, &host_grad, copy)?;
    reduced.storage().with_buffer(|b| b.record_stream(copy));
    drop(reduced);
    consumer.wait_event(&copy.record_event());
    Ok(host_grad)
}

/// Copies `src` into `dst` (contiguous, same dtype and length) in the order of `stream`
/// through the seam's [`Kernels::copy_host`], without the issuing thread waiting: after the
/// work `stream` was ordered after, before the work launched on it afterwards (events recorded
/// on `stream` afterwards cover the copy). One tensor lives on `stream`'s device, the other on
/// that device or on a CPU device.
///
/// # Errors
/// [`FsdpError::Dtype`] for different dtypes, [`FsdpError::InvalidArgument`] for different
/// lengths, [`FsdpError::Device`] for a stream on neither tensor's device; the seam's errors
/// (e.g. two non-CPU devices).
pub(crate) fn copy_across(src: &Tensor, dst: &Tensor, stream: &Stream) -> Result<()> {
    if src.dtype() != dst.dtype() {
        return Err(FsdpError::Dtype(DtypeError {
            op: "offload copy".into(),
            what: "the destination".into(),
            actual: dst.dtype(),
            expected: src.dtype(),
            why: "a copy keeps the source's dtype; give tensors of one dtype and length",
        }));
    }
    if src.numel() != dst.numel() {
        return Err(FsdpError::InvalidArgument(ArgumentError::Count {
            op: "offload copy".into(),
            what: "the destination".into(),
            counted: "elements",
            actual: dst.numel(),
            expected: src.numel(),
        }));
    }
    let side = if stream.device() == dst.device().id() {
        dst
    } else {
        check_stream(stream, src, "the source")?;
        src
    };
    let (s, d) = (tensor_slice(src)?, tensor_slice(dst)?);
    Kernels::for_device(side.device())?.copy_host(stream, s.data(), d.data())?;
    Ok(())
}

fn check_stream(stream: &Stream, t: &Tensor, what: &str) -> Result<()> {
    if stream.device() != t.device().id() {
        return Err(FsdpError::Device(DeviceError {
            op: "offload copy".into(),
            what: what.into(),
            actual: t.device().id(),
            expected: ExpectedDevice::Exactly(stream.device()),
            fix: format!(
                "the copy was issued on stream `{}`; issue it on a stream of the device side",
                stream.name()
            ),
        }));
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
        (c, h) => Err(FsdpError::Device(DeviceError {
            op: format!("CPU offload from {c}"),
            what: "the offload device".into(),
            actual: h,
            expected: ExpectedDevice::Cpu,
            fix: "shards, sharded gradients and the optimizer live in host memory; pass \
                  cpu_offload: Some(Device::cpu(..))"
                .into(),
        })),
    }
}

#[cfg(test)]
mod tests {
    use fsdp_alloc::{DType, Device};

    use super::*;

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
    fn host_copies_are_bit_exact_and_arguments_are_checked() {
        let (a, b) = (Device::cpu(0), Device::cpu(1));
        let v: Vec<f32> = (0..37).map(|i| (i as f32).sin() * 1e-3).collect();
        let src = Tensor::from_vec(v.clone(), &[37], &a).unwrap();
        let via_across = Tensor::zeros(&[37], DType::F32, &b).unwrap();
        let s = fsdp_autograd::current_stream(&b);
        s.wait_event(&fsdp_autograd::current_stream(&a).record_event());
        copy_across(&src, &via_across, &s).unwrap();
        let bits = |t: &Tensor| -> Vec<u32> {
            t.to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        };
        let want: Vec<u32> = v.iter().map(|x| x.to_bits()).collect();
        assert_eq!(bits(&via_across), want);
        let short = Tensor::zeros(&[36], DType::F32, &b).unwrap();
        assert!(matches!(
            copy_across(&src, &short, &s),
            Err(FsdpError::InvalidArgument(_))
        ));
        let half = Tensor::zeros(&[37], DType::BF16, &b).unwrap();
        assert!(matches!(
            copy_across(&src, &half, &s),
            Err(FsdpError::Dtype(DtypeError {
                actual: DType::BF16,
                expected: DType::F32,
                ..
            }))
        ));
        let elsewhere = fsdp_autograd::current_stream(&Device::cpu(2));
        assert!(matches!(
            copy_across(&src, &via_across, &elsewhere),
            Err(FsdpError::Device(_))
        ));
    }

    /// Uploads and downloads are ordered by events alone: with the copy stream held up (a
    /// sleep launched on it first), the consumer still sees the copied values, and the issuing
    /// thread never waits.
    #[test]
    fn uploads_and_downloads_wait_for_the_copy_stream_not_the_host() {
        let (dev, host) = (Device::cpu(0), Device::cpu(1));
        let (copy, consumer) = (dev.new_stream("copy"), dev.new_stream("consumer"));
        let host_stream = fsdp_autograd::current_stream(&host);
        let v: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.0).collect();
        let shard =
            with_stream(&host_stream, || Tensor::from_vec(v.clone(), &[1000], &host)).unwrap();
        let ready = host_stream.record_event();
        let waits = fsdp_alloc::stream::host_syncs();
        copy.launch(|| std::thread::sleep(std::time::Duration::from_millis(100)));
        let up = upload(&shard, &dev, &copy, &ready, &consumer).unwrap();
        // The consumer doubles what it received (reads it after the copy).
        let doubled = with_stream(&consumer, || up.scale(2.0)).unwrap();
        copy.launch(|| std::thread::sleep(std::time::Duration::from_millis(50)));
        let back = download(doubled, &host, &copy, &consumer, &host_stream).unwrap();
        assert_eq!(
            fsdp_alloc::stream::host_syncs(),
            waits,
            "issuing the copies never waits on the host"
        );
        let got = with_stream(&host_stream, || back.to_vec::<f32>()).unwrap();
        let want: Vec<f32> = v.iter().map(|x| x * 2.0).collect();
        assert_eq!(got, want);
    }
}
