//! The kernel-backend seam on CPU: argument checks above the trait, a backend swapped in
//! through `Kernels::with_backend`, `Tensor::to`, and the typed CUDA errors of this build.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use fsdp_alloc::{DType, Device, Stream};
use fsdp_autograd::kernels::backend::{Backend, CpuBackend, Gemm, Kernels, Operand, Rows};
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
    let e = k.gemm(s, &bad, &a, &a, &c).unwrap_err();
    assert!(matches!(e, AutogradError::Kernel(_)), "{e}");
    assert!(e.to_string().contains("`b`"), "{e}");
    // An i64 operand where floats are needed.
    let i = Tensor::arange(6, &dev).unwrap().operand().unwrap();
    assert!(matches!(
        k.gemm(s, &g, &i, &a, &c),
        Err(AutogradError::DType { .. })
    ));
    // An operand of another device.
    let other = Device::cpu(1);
    let o = Tensor::zeros(&[2, 2], DType::F32, &other)
        .unwrap()
        .operand()
        .unwrap();
    assert!(matches!(
        k.gemm(s, &g, &a, &a, &o),
        Err(AutogradError::Device { .. })
    ));
    s.synchronize().unwrap(); // nothing failed on the stream
}

/// A backend that counts calls and forwards to the CPU: what `Kernels` passes through.
#[derive(Debug, Default)]
struct Counting(AtomicUsize);

macro_rules! forward {
    ($($name:ident($($arg:ident: $ty:ty),*);)*) => {
        $(fn $name(&self, s: &Stream, $($arg: $ty),*) -> fsdp_autograd::Result<()> {
            self.0.fetch_add(1, Ordering::Relaxed);
            CpuBackend.$name(s, $($arg),*)
        })*
    };
}

use fsdp_autograd::kernels::backend::{
    Attention, BinaryOp, EmbeddingShape, LayerNormShape, ReadFn, SumTo, View,
};
use fsdp_autograd::Gelu;

impl Backend for Counting {
    fn name(&self) -> &'static str {
        "counting"
    }
    forward! {
        gemm(g: &Gemm, a: &Operand, b: &Operand, c: &Operand);
        binary(op: BinaryOp, r: Rows, a: &Operand, b: &Operand, o: &Operand);
        scale(n: usize, al: f32, x: &Operand, o: &Operand);
        scale_inplace(n: usize, al: f32, y: &Operand);
        axpy_rows(r: Rows, al: f32, x: &Operand, y: &Operand);
        sum(n: usize, m: bool, x: &Operand, o: &Operand);
        col_sums(r: Rows, x: &Operand, o: &Operand);
        sum_to(st: &SumTo, x: &Operand, o: &Operand);
        gelu(k: Gelu, n: usize, x: &Operand, y: &Operand);
        gelu_backward(k: Gelu, n: usize, x: &Operand, dy: &Operand, dx: &Operand);
        softmax(r: Rows, x: &Operand, y: &Operand);
        softmax_backward(r: Rows, y: &Operand, dy: &Operand, dx: &Operand);
        layer_norm(l: LayerNormShape, x: &Operand, g: &Operand, b: &Operand, y: &Operand, m: &Operand, r: &Operand);
        layer_norm_backward(l: LayerNormShape, x: &Operand, g: &Operand, m: &Operand, r: &Operand, dy: &Operand, dx: &Operand, dg: &Operand, db: &Operand);
        embedding(e: EmbeddingShape, i: &Operand, t: &Operand, o: &Operand);
        embedding_backward(e: EmbeddingShape, i: &Operand, dy: &Operand, dt: &Operand);
        attention(a: Attention, q: &Operand, k: &Operand, v: &Operand, o: &Operand, p: &Operand);
        attention_backward(a: Attention, q: &Operand, k: &Operand, v: &Operand, p: &Operand, g: &Operand, dq: &Operand, dk: &Operand, dv: &Operand);
        cross_entropy(r: Rows, l: &Operand, t: &Operand, o: &Operand, e: &Operand);
        cross_entropy_backward(r: Rows, l: &Operand, t: &Operand, e: &Operand, g: &Operand, d: &Operand);
        cast(n: usize, x: &Operand, o: &Operand);
        fill(n: usize, v: f64, o: &Operand);
        arange(n: usize, o: &Operand);
        copy(sv: &View, src: &Operand, dv: &View, dst: &Operand);
        write(b: Vec<u8>, d: &Operand);
        read(src: &Operand, f: ReadFn);
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
    k.softmax(s, r, &x.operand().unwrap(), &y.operand().unwrap())
        .unwrap();
    assert_eq!(counting.0.load(Ordering::Relaxed), 1);
    let want = x.softmax().unwrap().to_vec::<f32>().unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap(), want);
    // A bad call never reaches the backend.
    let bad = Rows { rows: 3, cols: 2 };
    assert!(k
        .softmax(s, bad, &x.operand().unwrap(), &y.operand().unwrap())
        .is_err());
    assert_eq!(counting.0.load(Ordering::Relaxed), 1);
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
