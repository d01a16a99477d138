//! The kernel-backend seam on CPU: argument checks above the trait, a backend swapped in
//! through `Kernels::with_backend`, `Tensor::to`, and the typed CUDA errors of this build.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use fsdp_alloc::{DType, Device, Stream};
use fsdp_autograd::kernels::attention::{
    Attention, AttentionLayout, AttentionSave, AttentionStats, CausalAttention,
};
use fsdp_autograd::kernels::gemm::{Gemm, MatMul};
use fsdp_autograd::kernels::norm::Softmax;
use fsdp_autograd::kernels::{Backend, CpuBackend, Kernels, Op, Operand, ReadFn, Rows};
use fsdp_autograd::{AutogradError, Tensor};

#[test]
fn the_seam_checks_operands_before_any_backend_runs() {
    let dev = Device::cpu(0);
    let k = Kernels::for_device(&dev).unwrap();
    let s = dev.default_stream();
    let a = Tensor::zeros(&[2, 3], DType::F32, &dev)
        .unwrap()
        .operand()
        .unwrap();
    let c = Tensor::zeros(&[2, 2], DType::F32, &dev)
        .unwrap()
        .operand()
        .unwrap();
    let g = Gemm {
        batch: 1,
        m: 2,
        k: 3,
        n: 2,
        trans_a: false,
        trans_b: false,
        accumulate: false,
    };
    // b has 6 elements: fine; c has 4: fine. With n = 3 the same operands are rejected.
    let bad = Gemm { n: 3, ..g };
    let gemm = |g: Gemm, a: &Operand, b: &Operand, c: &Operand| k.launch(s, &MatMul { g, a, b, c });
    let e = gemm(bad, &a, &a, &c).unwrap_err();
    assert!(matches!(e, AutogradError::Kernel(_)), "{e}");
    assert!(e.to_string().contains("`b`"), "{e}");
    // An i64 operand where floats are needed.
    let i = Tensor::arange(6, &dev).unwrap().operand().unwrap();
    assert!(matches!(
        gemm(g, &i, &a, &c),
        Err(AutogradError::DType { .. })
    ));
    // An operand of another device.
    let other = Device::cpu(1);
    let o = Tensor::zeros(&[2, 2], DType::F32, &other)
        .unwrap()
        .operand()
        .unwrap();
    assert!(matches!(
        gemm(g, &a, &a, &o),
        Err(AutogradError::Device { .. })
    ));
    s.synchronize().unwrap(); // nothing failed on the stream
}

/// A backend that counts launches and forwards to the CPU: what `Kernels` passes through.
#[derive(Debug, Default)]
struct Counting(AtomicUsize);

impl Backend for Counting {
    fn name(&self) -> &'static str {
        "counting"
    }
    fn launch(&self, s: &Stream, l: &dyn Op) -> fsdp_autograd::Result<()> {
        self.0.fetch_add(1, Ordering::Relaxed);
        CpuBackend.launch(s, l)
    }
    fn write(&self, s: &Stream, bytes: Vec<u8>, dst: &Operand) -> fsdp_autograd::Result<()> {
        CpuBackend.write(s, bytes, dst)
    }
    fn read(&self, s: &Stream, src: &Operand, f: ReadFn) -> fsdp_autograd::Result<()> {
        CpuBackend.read(s, src, f)
    }
}

#[test]
fn a_backend_behind_kernels_is_only_called_with_checked_arguments() {
    let dev = Device::cpu(0);
    let counting = Arc::new(Counting::default());
    let k = Kernels::with_backend(dev.id(), counting.clone());
    let s = dev.default_stream();
    let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2], &dev).unwrap();
    let y = Tensor::zeros(&[2, 2], DType::F32, &dev).unwrap();
    let r = Rows { rows: 2, cols: 2 };
    let (xo, yo) = (x.operand().unwrap(), y.operand().unwrap());
    k.launch(
        s,
        &Softmax {
            rows: r,
            x: &xo,
            y: &yo,
        },
    )
    .unwrap();
    assert_eq!(counting.0.load(Ordering::Relaxed), 1);
    let want = x.softmax().unwrap().to_vec::<f32>().unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap(), want);
    // A bad call never reaches the backend.
    let bad = Rows { rows: 3, cols: 2 };
    assert!(k
        .launch(
            s,
            &Softmax {
                rows: bad,
                x: &xo,
                y: &yo
            }
        )
        .is_err());
    assert_eq!(counting.0.load(Ordering::Relaxed), 1);
}

/// A backend whose readback blocks the calling thread like the CUDA backend's: it synchronizes
/// the stream (twice: the readback's own wait and, say, an index check on it) before handing
/// the bytes over, counting its own waits.
#[derive(Debug, Default)]
struct Synchronizing;

impl Backend for Synchronizing {
    fn name(&self) -> &'static str {
        "synchronizing"
    }
    fn launch(&self, s: &Stream, l: &dyn Op) -> fsdp_autograd::Result<()> {
        CpuBackend.launch(s, l)
    }
    fn write(&self, s: &Stream, bytes: Vec<u8>, dst: &Operand) -> fsdp_autograd::Result<()> {
        CpuBackend.write(s, bytes, dst)
    }
    fn read(&self, s: &Stream, src: &Operand, f: ReadFn) -> fsdp_autograd::Result<()> {
        s.synchronize()?;
        s.synchronize()?;
        let bytes = src.buf.read::<u8>()?.to_vec();
        f(&bytes);
        Ok(())
    }
}

#[test]
fn every_readback_is_counted_once_whoever_waits() {
    use fsdp_alloc::stream::host_syncs;
    let dev = Device::cpu(0);
    let s = dev.default_stream();
    let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3], &dev).unwrap();
    let src = x.operand().unwrap();
    // Writes and launches are no host waits.
    let before = host_syncs();
    let y = Tensor::from_vec(vec![4.0f32, 5.0, 6.0], &[3], &dev).unwrap();
    let z = x.add(&y).unwrap();
    assert_eq!(host_syncs(), before);
    // A tensor readback on the CPU: the stream's worker hands the bytes over; one wait.
    let before = host_syncs();
    assert_eq!(z.to_vec::<f32>().unwrap(), vec![5.0, 7.0, 9.0]);
    assert_eq!(host_syncs(), before + 1);
    // Through the seam with a backend that does not wait itself: counted once by the seam.
    let read = |k: &Kernels| {
        let (tx, rx) = std::sync::mpsc::channel();
        let before = host_syncs();
        k.read(
            s,
            &src,
            Box::new(move |b: &[u8]| {
                let _ = tx.send(b.to_vec());
            }),
        )
        .unwrap();
        let bytes = rx.recv().unwrap();
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&bytes), [1.0, 2.0, 3.0]);
        host_syncs() - before
    };
    assert_eq!(
        read(&Kernels::with_backend(dev.id(), Arc::new(CpuBackend))),
        1
    );
    // A backend that synchronizes (twice) counts its own waits; the seam adds none.
    assert_eq!(
        read(&Kernels::with_backend(dev.id(), Arc::new(Synchronizing))),
        2
    );
}

#[test]
fn to_moves_values_and_gradients_between_devices() {
    let (a, b) = (Device::cpu(0), Device::cpu(1));
    let x = Tensor::from_vec(vec![1.0f32, -2.0, 3.0], &[3], &a)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let y = x.to(&b).unwrap();
    assert_eq!(y.device().id(), b.id());
    let w = Tensor::from_vec(vec![2.0f32, 3.0, 4.0], &[3], &b).unwrap();
    y.mul(&w).unwrap().sum().unwrap().backward().unwrap();
    let g = x.grad().expect("gradient moved back");
    assert_eq!(g.device().id(), a.id());
    assert_eq!(g.to_vec::<f32>().unwrap(), vec![2.0, 3.0, 4.0]);
    // Half dtypes and strided views keep their values.
    let h = Tensor::from_vec(vec![0.1f32, 0.2, 0.3, 0.4, 0.5, 0.6], &[2, 3], &a)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let t = h.t().unwrap();
    assert_eq!(
        t.to(&b).unwrap().to_vec_f32().unwrap(),
        t.to_vec_f32().unwrap()
    );
}

#[test]
fn cuda_devices_are_a_typed_error_here_never_a_panic() {
    // No CUDA driver on this machine (and, without the `cuda` feature, no CUDA support):
    // creating the device is the typed error `train_gpt --device cuda` reports.
    match Device::cuda(0) {
        Ok(_) => eprintln!("a CUDA device exists here; the no-driver error was not exercised"),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains("cuda:0"), "{msg}");
            assert!(!msg.contains("not implemented"), "{msg}");
        }
    }
}

/// What attention saves is the backend's choice: the CPU keeps the probabilities (so its
/// attention is unchanged by the fused CUDA kernels), the launch is checked against the chosen
/// shape, and a CPU launch asking for the fused kernels' log-sum-exp is a typed error.
#[test]
fn attention_statistics_are_the_backends_choice() {
    let dev = Device::cpu(0);
    let k = Kernels::for_device(&dev).unwrap();
    let s = dev.default_stream();
    let a = Attention::new(1, 2, 3, 4);
    assert_eq!(a.layout, AttentionLayout::Heads);
    assert_eq!(k.attention_save(&a), AttentionSave::Probs);
    assert_eq!(AttentionSave::Probs.shape(&a), vec![1, 2, 3, 3]);
    assert_eq!(AttentionSave::Lse.shape(&a), vec![1, 2, 3]);
    // The tensors stay alive while their operands are used (else their memory is reused).
    let ts: Vec<Tensor> = [&[1, 2, 3, 4][..], &[1, 2, 3, 4], &[1, 2, 3, 3], &[1, 2, 3]]
        .iter()
        .map(|shape| Tensor::zeros(shape, DType::F32, &dev).unwrap())
        .collect();
    let [q, out, probs, lse] = [0, 1, 2, 3].map(|i| ts[i].operand().unwrap());
    let launch = |stats| {
        k.launch(
            s,
            &CausalAttention {
                a,
                q: &q,
                k: &q,
                v: &q,
                out: &out,
                stats,
            },
        )
    };
    launch(AttentionStats::Probs(&probs)).unwrap();
    // Statistics of the other kind's shape are a length error, before any backend runs.
    let e = launch(AttentionStats::Probs(&lse)).unwrap_err();
    assert!(matches!(e, AutogradError::Kernel(_)), "{e}");
    let e = launch(AttentionStats::Lse(&probs)).unwrap_err();
    assert!(matches!(e, AutogradError::Kernel(_)), "{e}");
    // The CPU has no fused kernels.
    let e = launch(AttentionStats::Lse(&lse)).unwrap_err();
    assert!(matches!(e, AutogradError::Unsupported { .. }), "{e}");
    assert!(e.to_string().contains("attention_save"), "{e}");
    // The packed layout: the CPU takes it; q, k, v must be one operand (the whole qkv tensor)
    // of 3x the head-split length.
    let p = Attention {
        layout: AttentionLayout::Packed,
        ..a
    };
    assert!(k.attention_packed(&p));
    let qkv_t = Tensor::zeros(&[1, 3, 3, 2, 4], DType::F32, &dev).unwrap();
    let qkv = qkv_t.operand().unwrap();
    let packed = |q: &Operand, kk: &Operand| {
        k.launch(
            s,
            &CausalAttention {
                a: p,
                q,
                k: kk,
                v: q,
                out: &out,
                stats: AttentionStats::Probs(&probs),
            },
        )
    };
    packed(&qkv, &qkv).unwrap();
    let e = packed(&qkv, &q).unwrap_err();
    assert!(matches!(e, AutogradError::Argument { .. }), "{e}");
    assert!(e.to_string().contains("same operand"), "{e}");
    let e = packed(&q, &q).unwrap_err();
    assert!(matches!(e, AutogradError::Kernel(_)), "{e}");
    // Grouped-query attention: k and v have kv_heads heads. A kv_heads that does not divide
    // heads, or a scale that is not finite and positive, is a typed error before any backend
    // runs.
    let kv_t = Tensor::zeros(&[1, 1, 3, 4], DType::F32, &dev).unwrap();
    let kv = kv_t.operand().unwrap();
    let grouped = |a: Attention, kk: &Operand| {
        k.launch(
            s,
            &CausalAttention {
                a,
                q: &q,
                k: kk,
                v: kk,
                out: &out,
                stats: AttentionStats::Probs(&probs),
            },
        )
    };
    let g = Attention {
        kv_heads: 1,
        scale: 0.5,
        ..a
    };
    grouped(g, &kv).unwrap();
    let e = grouped(g, &q).unwrap_err();
    assert!(e.to_string().contains("kv_heads=1"), "{e}");
    for bad in [
        Attention { kv_heads: 0, ..g },
        Attention { kv_heads: 3, ..g },
        Attention { scale: 0.0, ..g },
        Attention {
            scale: f32::NAN,
            ..g
        },
    ] {
        let e = grouped(bad, &kv).unwrap_err();
        assert!(
            matches!(
                e,
                AutogradError::Kernel(fsdp_autograd::kernels::KernelError::InvalidShape { .. })
            ),
            "{e}"
        );
    }
    s.synchronize().unwrap();
}
