//! Tests that only make sense on a real GPU: argument validation against real device buffers,
//! ordering across streams, and deferred index checks. `#[ignore]`d; see `super::gpu`.

use fsdp_alloc::{DType, Device};

use crate::kernels::cuda::{CudaKernelError, CudaKernels};
use crate::kernels::KernelError;

use super::gpu::gpu_or_skip;

fn f32_buf(k: &CudaKernels, data: &[f32]) -> fsdp_alloc::Buffer {
    let s = k.device().default_stream();
    let b = k.device().alloc(4 * data.len(), s).expect("alloc");
    k.upload(s, data, b.data()).expect("upload");
    b
}

#[test]
#[ignore = "needs a CUDA GPU: run `cargo xtask gpu-test` (FSDP_GPU_TESTS=1)"]
fn argument_errors() {
    let Some(k) = gpu_or_skip("gpu_only::argument_errors") else {
        return;
    };
    let s = k.device().default_stream();
    let (a, b) = (f32_buf(&k, &[1.0; 8]), f32_buf(&k, &[2.0; 8]));
    let short = f32_buf(&k, &[0.0; 7]);

    // Host memory.
    let cpu = Device::cpu(0);
    let host = cpu.alloc(32, cpu.default_stream()).expect("cpu alloc");
    let err = k.add(s, host.data(), b.data(), a.data()).unwrap_err();
    assert!(
        matches!(
            err,
            CudaKernelError::NotDeviceMemory {
                op: "add",
                arg: "a",
                ..
            }
        ),
        "{err}"
    );

    // A stream of another device.
    let err = k.add(s, a.data(), b.data(), a.data()).unwrap_err();
    assert!(
        matches!(
            err,
            CudaKernelError::Overlap {
                op: "add",
                output: "out",
                other: "a"
            }
        ),
        "{err}"
    );
    let err = k
        .add(cpu.default_stream(), a.data(), b.data(), short.data())
        .unwrap_err();
    assert!(matches!(err, CudaKernelError::WrongStream { .. }), "{err}");

    // Lengths, as on the CPU.
    let err = k.add(s, a.data(), b.data(), short.data()).unwrap_err();
    assert!(
        matches!(
            err,
            CudaKernelError::Kernel(KernelError::LengthMismatch {
                op: "add",
                arg: "out",
                expected: 8,
                actual: 7,
                ..
            })
        ),
        "{err}"
    );
    let err = k.softmax_rows(s, a.data(), b.data(), 3).unwrap_err();
    assert!(
        matches!(
            err,
            CudaKernelError::Kernel(KernelError::InvalidShape { .. })
        ),
        "{err}"
    );

    // A sub-range that is not a whole number of f32, and one that is misaligned.
    let odd = a.data().slice(0, 6).expect("slice");
    let err = k.scale_inplace(s, &odd, 2.0).unwrap_err();
    assert!(
        matches!(
            err,
            CudaKernelError::Kernel(KernelError::InvalidShape { .. })
        ),
        "{err}"
    );
    let mis = a.data().slice(2, 4).expect("slice");
    let err = k.scale_inplace(s, &mis, 2.0).unwrap_err();
    assert!(
        matches!(err, CudaKernelError::Misaligned { align: 4, .. }),
        "{err}"
    );

    // Views the scatter-add cannot handle.
    let err = k
        .strided_add_assign(s, a.data(), 0, &[2, 4], &[0, 1], b.data())
        .unwrap_err();
    assert!(err.to_string().contains("more than once"), "{err}");
    let err = k
        .strided_copy(s, a.data(), 0, &[8], &[1], b.data(), DType::U8)
        .unwrap_err();
    assert!(
        matches!(
            err,
            CudaKernelError::Kernel(KernelError::InvalidShape { .. })
        ),
        "{err}"
    );

    // Nothing above ran a kernel on `a`.
    let mut host_a = [0.0f32; 8];
    k.download(s, a.data(), &mut host_a).expect("download");
    assert_eq!(host_a, [1.0; 8]);
}

#[test]
#[ignore = "needs a CUDA GPU: run `cargo xtask gpu-test` (FSDP_GPU_TESTS=1)"]
fn work_on_two_streams_is_ordered_by_events() {
    let Some(k) = gpu_or_skip("gpu_only::work_on_two_streams_is_ordered_by_events") else {
        return;
    };
    let dev = k.device().clone();
    let (s1, s2) = (dev.new_stream("producer"), dev.new_stream("consumer"));
    let n = 1 << 20;
    let x = dev.alloc(4 * n, &s1).expect("alloc");
    let y = dev.alloc(4 * n, &s2).expect("alloc");
    let out = dev.alloc(4, &s2).expect("alloc");
    k.upload(&s1, &vec![0.5f32; n], x.data()).expect("upload");
    // A long chain on s1, then s2 waits for it before reading x.
    for _ in 0..20 {
        k.scale_inplace(&s1, x.data(), 2.0).expect("scale");
    }
    let done = s1.record_event();
    s2.wait_event(&done);
    k.scale(&s2, x.data(), 1.0, y.data()).expect("scale");
    k.sum(&s2, y.data(), out.data()).expect("sum");
    let mut total = [0.0f32];
    k.download(&s2, out.data(), &mut total).expect("download");
    assert_eq!(total[0], n as f32 * 0.5 * (1u64 << 20) as f32);
}

#[test]
#[ignore = "needs a CUDA GPU: run `cargo xtask gpu-test` (FSDP_GPU_TESTS=1)"]
fn index_checks_can_be_waited_on_later() {
    let Some(k) = gpu_or_skip("gpu_only::index_checks_can_be_waited_on_later") else {
        return;
    };
    let s = k.device().default_stream();
    let dev = k.device();
    let ids = dev.alloc(8 * 3, s).expect("alloc");
    k.upload(s, &[0i64, 2, 1], ids.data()).expect("upload");
    let table = f32_buf(&k, &[1.0, 2.0, 3.0, 4.0]); // 2 rows × 2
    let out = dev.alloc(4 * 6, s).expect("alloc");
    let check = k
        .embedding(s, ids.data(), table.data(), out.data(), 2)
        .expect("enqueue");
    // Unrelated work in between; the check still reports the bad id afterwards.
    k.scale_inplace(s, table.data(), 3.0).expect("scale");
    let err = check.wait().unwrap_err();
    assert!(
        matches!(
            err,
            CudaKernelError::Kernel(KernelError::IndexOutOfRange {
                value: 2,
                position: 1,
                bound: 2,
                ..
            })
        ),
        "{err}"
    );
    let mut got = [0.0f32; 6];
    k.download(s, out.data(), &mut got).expect("download");
    assert_eq!(&got[..2], &[1.0, 2.0]);
    assert!(got[2].is_nan() && got[3].is_nan());
    assert_eq!(&got[4..], &[3.0, 4.0]);
}
