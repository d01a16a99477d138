//! Where materialization generates values: on the target device itself, or on a host staging
//! device followed by one host→device copy per tensor.
//!
//! Init values are computed by host code (the counter-based RNG and the init ops run on the CPU).
//! A CPU device's memory is host-accessible, so values are written straight into it. A CUDA
//! device's memory is not: the tensor (a whole parameter, or one rank's shard) is generated on a
//! private CPU staging device and copied to the target with [`Tensor::to`] (the kernel seam's
//! upload on the target's current stream). The generating code is the same in both cases, so a
//! shard materialized on a GPU holds exactly the bits a CPU rank would generate.

use fsdp_alloc::{Device, DeviceConfig, DeviceId, StreamMode};
use fsdp_autograd::{current_stream, no_grad, Parameter, Tensor};

use crate::error::{MaterializeError, Result};

/// Where [`crate::InitPlan`]'s materialization generates a device's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InitPlacement {
    /// Written straight into the target device's memory (CPU devices: host-accessible memory).
    OnDevice,
    /// Generated on a host staging device, then copied to the target device one tensor at a
    /// time (CUDA devices). Peak host memory: one parameter (whole-tensor paths) or one shard
    /// plus the temporaries the CPU path would use; peak target memory: the same as on a CPU
    /// device.
    HostThenCopy,
}

#[cfg(test)]
thread_local! {
    /// Tests: take the host-then-copy path for CPU targets too (the same code CUDA targets run,
    /// with the CPU backend's upload), so the staging logic runs where no GPU exists.
    pub(crate) static FORCE_HOST_THEN_COPY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl InitPlacement {
    /// The placement materialization uses for `device`: [`InitPlacement::OnDevice`] for CPU
    /// devices, [`InitPlacement::HostThenCopy`] for CUDA devices.
    pub fn for_device(device: DeviceId) -> InitPlacement {
        #[cfg(test)]
        if FORCE_HOST_THEN_COPY.with(|f| f.get()) {
            return InitPlacement::HostThenCopy;
        }
        match device {
            DeviceId::Cpu(_) => InitPlacement::OnDevice,
            DeviceId::Cuda(_) => InitPlacement::HostThenCopy,
        }
    }
}

/// Index of the private CPU staging devices (shown in errors as `cpu:<index>`).
pub const HOST_STAGING_INDEX: usize = 1 << 30;

/// The device values for `device` are generated on: `device` itself, or a fresh CPU staging
/// device (inline stream, so generation runs on the calling thread; its memory is returned to the
/// system when the last tensor on it is dropped).
pub(crate) fn generation_device(device: &Device) -> Device {
    match InitPlacement::for_device(device.id()) {
        InitPlacement::OnDevice => device.clone(),
        InitPlacement::HostThenCopy => Device::cpu_with(
            HOST_STAGING_INDEX,
            DeviceConfig::default().with_stream_mode(StreamMode::Inline),
        ),
    }
}

/// A materialized parameter's tensor in memory the host can read while generating on `gen`:
/// itself when its memory is host-accessible, else a copy on `gen` (the whole parameter; e.g.
/// streaming a model that lives on a GPU).
///
/// A tensor without memory (released storage) is returned as is: reading a piece of it reports
/// [`MaterializeError::Unreadable`] later, as on the in-place path.
///
/// # Errors
/// [`MaterializeError::Unreadable`] for a non-contiguous device tensor; the copy's errors.
pub(crate) fn host_readable(p: &Parameter, t: Tensor, gen: &Device) -> Result<Tensor> {
    match t.storage().buffer_ref() {
        Some(buf) if buf.device_ptr().is_some() => {}
        _ => return Ok(t),
    }
    if !t.is_contiguous() {
        return Err(MaterializeError::Unreadable {
            param: p.name().to_string(),
            detail: "its tensor is not contiguous; store a contiguous tensor in the parameter"
                .into(),
        });
    }
    Ok(no_grad(|| t.to(gen))?)
}

/// Moves `t` (generated on `gen`) to `device` when they differ: waits for the generation (so its
/// errors surface here, before anything is copied), then copies with [`Tensor::to`] on the
/// target's current stream, outside autograd, and waits for the copy.
pub(crate) fn to_target(t: Tensor, gen: &Device, device: &Device) -> Result<Tensor> {
    if gen == device {
        return Ok(t);
    }
    gen.synchronize()?;
    let out = no_grad(|| t.to(device))?;
    current_stream(device).synchronize()?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use fsdp_alloc::DType;
    use fsdp_autograd::init::InitOp;
    use fsdp_autograd::InitContext;
    use fsdp_flatparam::FlatParamLayout;

    use super::*;
    use crate::InitPlan;

    /// Runs `f` with the host-then-copy path forced for CPU targets.
    fn via_host<R>(f: impl FnOnce() -> R) -> R {
        FORCE_HOST_THEN_COPY.with(|c| c.set(true));
        let r = f();
        FORCE_HOST_THEN_COPY.with(|c| c.set(false));
        r
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.to_vec_f32()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    }

    /// A unit with position-wise ops, a whole-tensor op (orthogonal) and a copy.
    fn unit(seed: u64, dtype: DType) -> Vec<Parameter> {
        let ctx = InitContext::fake(seed);
        let p = |n: &str, s: &[usize], ops| ctx.param(n, s, dtype, ops).unwrap();
        vec![
            p(
                "w",
                &[6, 5],
                vec![InitOp::Normal {
                    mean: 0.0,
                    std: 0.02,
                }],
            ),
            p("q", &[4, 4], vec![InitOp::Orthogonal { gain: 1.0 }]),
            p("b", &[7], vec![InitOp::Fill(0.5)]),
            p("c", &[6, 5], vec![InitOp::CopyFrom { source: "w".into() }]),
        ]
    }

    fn layout(unit: &[Parameter], ranks: usize) -> FlatParamLayout {
        let shapes: Vec<Vec<usize>> = unit.iter().map(|p| p.shape().to_vec()).collect();
        FlatParamLayout::new(&shapes, ranks).unwrap()
    }

    #[test]
    fn cpu_devices_generate_in_place_and_cuda_devices_on_the_host() {
        assert_eq!(
            InitPlacement::for_device(DeviceId::Cpu(3)),
            InitPlacement::OnDevice
        );
        assert_eq!(
            InitPlacement::for_device(DeviceId::Cuda(0)),
            InitPlacement::HostThenCopy
        );
        let dev = Device::cpu(0);
        assert!(generation_device(&dev) == dev);
        let staged = via_host(|| generation_device(&dev));
        assert!(staged != dev);
        assert_eq!(staged.id(), DeviceId::Cpu(HOST_STAGING_INDEX));
    }

    #[test]
    fn host_then_copy_shards_equal_in_place_shards_bit_for_bit() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let u = unit(9, dtype);
            let l = layout(&u, 3);
            let plan = InitPlan::new(u.clone()).unwrap();
            for rank in 0..3 {
                let target = Device::cpu(1);
                let want = plan.materialize_shard(&u, &l, rank, &target).unwrap();
                let got = via_host(|| plan.materialize_shard(&u, &l, rank, &target)).unwrap();
                assert!(
                    got.device() == &target,
                    "the shard lands on the target device"
                );
                assert_eq!((got.dtype(), got.shape()), (dtype, &[l.chunk_numel()][..]));
                assert_eq!(bits(&got), bits(&want), "{dtype} rank {rank}");
                let got2 =
                    via_host(|| plan.materialize_unit_sharded(&u, &l, rank, &target)).unwrap();
                assert_eq!(
                    bits(&got2),
                    bits(&want),
                    "{dtype} rank {rank} (unit by unit)"
                );
            }
            assert!(u.iter().all(|p| !p.is_materialized()));
        }
    }

    #[test]
    fn host_then_copy_keeps_only_the_shard_on_the_target() {
        let ctx = InitContext::fake(4);
        let u = vec![
            ctx.param("w", &[64, 64], DType::F32, vec![InitOp::Fill(1.0)])
                .unwrap(),
            ctx.param(
                "q",
                &[32, 32],
                DType::F32,
                vec![InitOp::Orthogonal { gain: 1.0 }],
            )
            .unwrap(),
        ];
        let l = layout(&u, 4);
        let plan = InitPlan::new(u.clone()).unwrap();
        let unit_bytes = l.padded_numel() * 4;
        // In place, the whole unit is built on the target first...
        let in_place = Device::cpu(3);
        let a = plan.materialize_unit_sharded(&u, &l, 1, &in_place).unwrap();
        let in_place_peak = in_place.memory_stats().peak_allocated_bytes;
        assert!(
            in_place_peak >= unit_bytes,
            "{in_place_peak} vs unit {unit_bytes}"
        );
        // ...through the host, the target only ever holds the shard (rounded up by the
        // allocator).
        let target = Device::cpu(2);
        let b = via_host(|| plan.materialize_unit_sharded(&u, &l, 1, &target)).unwrap();
        let peak = target.memory_stats().peak_allocated_bytes;
        assert!(peak >= l.chunk_numel() * 4, "peak {peak}");
        assert!(peak < unit_bytes / 2, "peak {peak} vs unit {unit_bytes}");
        assert_eq!(bits(&a), bits(&b));
    }

    #[test]
    fn host_then_copy_materializes_whole_parameters_on_the_target() {
        let (eager_dev, target) = (Device::cpu(0), Device::cpu(1));
        let want = {
            let ctx = InitContext::eager(&eager_dev, 9);
            let w = ctx
                .param(
                    "w",
                    &[6, 5],
                    DType::F32,
                    vec![InitOp::Normal {
                        mean: 0.0,
                        std: 0.02,
                    }],
                )
                .unwrap();
            bits(&w.get().unwrap())
        };
        let u = unit(9, DType::F32);
        via_host(|| crate::materialize_unit(&u[..1], &target)).unwrap();
        let t = u[0].get().unwrap();
        assert!(t.device() == &target);
        assert!(t.is_leaf() && t.requires_grad());
        assert_eq!(bits(&t), want);
    }

    #[test]
    fn host_then_copy_streams_materialized_sources_and_reports_errors() {
        let src_dev = Device::cpu(0);
        let ctx = InitContext::eager(&src_dev, 5);
        let a = ctx
            .param("a", &[3, 2], DType::F32, vec![InitOp::Fill(1.5)])
            .unwrap();
        let b = ctx
            .param("b", &[5], DType::F32, vec![InitOp::Fill(-2.0)])
            .unwrap();
        let u = vec![a, b];
        let l = layout(&u, 2);
        let target = Device::cpu(1);
        let s = via_host(|| crate::stream_shard(&u, &l, 1, &target)).unwrap();
        assert!(s.device() == &target);
        let want = crate::stream_shard(&u, &l, 1, &target).unwrap();
        assert_eq!(bits(&s), bits(&want));
        // Argument errors are the same as on the in-place path.
        let wrong = FlatParamLayout::new(&[vec![6]], 2).unwrap();
        assert!(matches!(
            via_host(|| crate::stream_shard(&u, &wrong, 0, &target)),
            Err(MaterializeError::LayoutMismatch { .. })
        ));
        assert!(matches!(
            via_host(|| crate::stream_shard(&u, &l, 2, &target)),
            Err(MaterializeError::Layout(_))
        ));
        // A released source is unreadable on both paths.
        drop(u[0].take());
        assert!(matches!(
            via_host(|| crate::stream_shard(&u, &l, 0, &target)),
            Err(MaterializeError::Unreadable { .. })
        ));
    }
}
