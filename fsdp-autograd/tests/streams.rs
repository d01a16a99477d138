//! Operations are launched, not run: they return before their kernels execute, run on the
//! thread's current stream, and keep memory safe across streams (record_stream on use).

mod common;

use std::sync::mpsc;

use fsdp_alloc::{DType, Device, DeviceConfig, Stream};
use fsdp_autograd::{current_stream, with_stream, Tensor};

/// Blocks `stream` until the returned sender is dropped or sent to.
fn gate(stream: &Stream) -> mpsc::Sender<()> {
    let (tx, rx) = mpsc::channel::<()>();
    stream.launch(move || {
        let _ = rx.recv();
    });
    tx
}

#[test]
fn operations_return_before_their_kernels_run() {
    let dev = Device::cpu(10);
    let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2], &dev).unwrap();
    let g = gate(dev.default_stream());
    // Everything below is only enqueued: the stream is blocked.
    let c = a.matmul(&a).unwrap().gelu().unwrap().sum().unwrap();
    let done = dev.default_stream().record_event();
    assert!(
        !done.query(),
        "kernels cannot have run while the stream is gated"
    );
    drop(g);
    let expect: f32 = [7.0f32, 10.0, 15.0, 22.0]
        .iter()
        .map(|&x| 0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044715 * x * x * x)).tanh()))
        .sum();
    assert!((c.item().unwrap() - expect).abs() < 1e-3);
}

#[test]
fn with_stream_directs_ops_and_events_order_them() {
    let dev = Device::cpu_with(11, DeviceConfig::default().with_checked(true));
    let side = dev.new_stream("side");
    let a = Tensor::from_vec((0..64).map(|i| i as f32).collect(), &[8, 8], &dev).unwrap();
    side.wait_event(&dev.default_stream().record_event());
    let b = with_stream(&side, || {
        assert_eq!(current_stream(&dev), side);
        a.matmul(&a).unwrap().scale(0.5).unwrap()
    });
    dev.default_stream().wait_event(&side.record_event());
    let c = b.add(&a).unwrap();
    let got = c.to_vec::<f32>().unwrap();
    dev.synchronize().unwrap(); // the checked mode found no unordered access
    let av: Vec<f32> = (0..64).map(|i| i as f32).collect();
    for i in 0..8 {
        for j in 0..8 {
            let dot: f32 = (0..8).map(|k| av[i * 8 + k] * av[k * 8 + j]).sum();
            assert_eq!(got[i * 8 + j], 0.5 * dot + av[i * 8 + j]);
        }
    }
}

#[test]
fn checked_mode_reports_a_missing_wait() {
    let dev = Device::cpu_with(12, DeviceConfig::default().with_checked(true));
    let side = dev.new_stream("side");
    let a = Tensor::zeros(&[256], DType::F32, &dev).unwrap();
    dev.synchronize().unwrap();
    let g = gate(dev.default_stream());
    a.fill_(1.0).unwrap(); // a write, queued behind the gate on the default stream
    let b = with_stream(&side, || a.scale(2.0).unwrap()); // a read on `side`, no wait_event
    side.synchronize().unwrap();
    drop(g);
    let err = dev.synchronize().unwrap_err();
    assert!(err.to_string().contains("ordering"), "{err}");
    drop(b);
}

#[test]
fn memory_used_on_another_stream_is_not_reused_too_early() {
    // PyTorch's policy: the block stays out of the pool until the side stream's use completes,
    // so the default stream gets other memory and never waits for the (blocked) side stream.
    reuse_after_cross_stream_use(
        Device::cpu_with(13, DeviceConfig::default().with_compact(false)),
        false,
    );
    // The compact policy (the default): the default stream may take the pending block, but only
    // behind a wait on the side stream's event — so it finishes only after the gate opens
    // (synchronizing it with the gate closed would wait forever, which is the point).
    reuse_after_cross_stream_use(Device::cpu(113), true);
}

/// `b` reads `a` on a blocked side stream, `a` is dropped on the host, the default stream
/// allocates and fills new tensors: whatever memory they get, `b` must read `a`'s values.
fn reuse_after_cross_stream_use(dev: Device, open_gate_before_sync: bool) {
    let side = dev.new_stream("side");
    let n = 1 << 16;
    let a = Tensor::full(&[n], 3.0, DType::F32, &dev).unwrap();
    side.wait_event(&dev.default_stream().record_event());
    let g = gate(&side);
    // `b` reads `a` on the (blocked) side stream; then `a` is dropped on the host.
    let b = with_stream(&side, || a.scale(2.0).unwrap());
    drop(a);
    // New allocations on the default stream must not overwrite `a`'s memory while `side` still
    // needs it (the tensor layer recorded the side stream on a's buffer).
    let mut others = Vec::new();
    for _ in 0..4 {
        others.push(Tensor::full(&[n], -1.0, DType::F32, &dev).unwrap());
    }
    if open_gate_before_sync {
        drop(g);
        dev.default_stream().synchronize().unwrap();
    } else {
        dev.default_stream().synchronize().unwrap();
        drop(g);
    }
    let got = with_stream(&side, || b.to_vec::<f32>().unwrap());
    assert!(
        got.iter().all(|&v| v == 6.0),
        "b read reused memory: {:?}",
        &got[..4]
    );
    for o in &others {
        assert!(o.to_vec::<f32>().unwrap().iter().all(|&v| v == -1.0));
    }
}

#[test]
fn kernel_failures_surface_at_synchronization() {
    let dev = Device::cpu(14);
    let table = Tensor::zeros(&[4, 2], DType::F32, &dev).unwrap();
    let ids = Tensor::from_vec(vec![0i64, 7], &[2], &dev).unwrap();
    // The id is only seen by the kernel: the launch succeeds, the readback reports it.
    let out = fsdp_autograd::embedding(&ids, &table).unwrap();
    let err = out.to_vec::<f32>().unwrap_err();
    assert!(err.to_string().contains("out of range"), "{err}");
}
