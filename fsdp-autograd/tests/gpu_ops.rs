//! `cargo xtask gpu-test` suite 1 of 4 (**ops**): every tensor operation the GPT uses on a CUDA
//! device against the CPU backend — forward values and input gradients, in f32, bf16 and f16.
//!
//! Each test is `#[ignore]`d and also needs
//! `FSDP_GPU_TESTS=1` (set by `cargo xtask gpu-test`); without it the test says so and returns.
//! With it but without a usable GPU it fails with the device's typed error.
//!
//! Tolerances (relative to the larger magnitude, plus an absolute floor): f32 `2e-4`/`1e-5`
//! (cuBLAS sums in another order than the `gemm` crate and CUDA's `expf`/`erfcf` differ from the
//! CPU's by a few ulp); bf16 `3e-2`/`1e-2` and f16 `4e-3`/`1e-3` (one half rounding of each
//! output and input, differing f32 intermediate sums can round to neighbouring half values).
#![cfg(feature = "cuda")]

mod common;

use common::Rng;
use fsdp_alloc::{DType, Device};
use fsdp_autograd::{
    causal_attention, cross_entropy, embedding, layer_norm, linear, Gelu, Result, Tensor,
};

fn gpu() -> Option<Device> {
    if std::env::var("FSDP_GPU_TESTS").as_deref() != Ok("1") {
        eprintln!("skipped: set FSDP_GPU_TESTS=1 on a machine with a GPU (cargo xtask gpu-test)");
        return None;
    }
    Some(Device::cuda(0).expect("FSDP_GPU_TESTS=1 but no usable CUDA device 0"))
}

fn tol(dtype: DType) -> (f32, f32) {
    match dtype {
        DType::F32 => (2e-4, 1e-5),
        DType::BF16 => (3e-2, 1e-2),
        _ => (4e-3, 1e-3),
    }
}

fn close(what: &str, dtype: DType, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let (rtol, atol) = tol(dtype);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        assert!(
            err <= atol + rtol * g.abs().max(w.abs()),
            "{what} ({dtype})[{i}]: cuda {g} vs cpu {w} (|err| {err:e})"
        );
    }
}

/// A float leaf of `shape` in `dtype` on `dev`, the same values on every device.
fn leaf(values: &[f32], shape: &[usize], dtype: DType, dev: &Device) -> Tensor {
    Tensor::from_slice(values, shape, dev)
        .and_then(|t| t.to_dtype(dtype))
        .and_then(|t| t.requires_grad_(true))
        .unwrap()
}

/// Runs `f` on CPU and CUDA leaves built from `inputs`, backward of `Σ f(x)·r` on both, and
/// compares outputs and every input gradient.
fn compare(
    name: &str,
    cpu: &Device,
    gpu: &Device,
    dtype: DType,
    inputs: &[(Vec<f32>, Vec<usize>)],
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
) {
    let run = |dev: &Device| -> (Vec<f32>, Vec<Vec<f32>>) {
        let xs: Vec<Tensor> = inputs.iter().map(|(v, s)| leaf(v, s, dtype, dev)).collect();
        let y = f(&xs).unwrap_or_else(|e| panic!("{name} on {}: {e}", dev.id()));
        let mut rng = Rng::new(99);
        let r = Tensor::from_vec(rng.vec(y.numel()), y.shape(), dev)
            .and_then(|r| r.to_dtype(y.dtype()))
            .unwrap();
        y.mul(&r).unwrap().sum().unwrap().backward().unwrap();
        let grads = xs
            .iter()
            .map(|x| {
                x.grad()
                    .map(|g| g.to_vec_f32().unwrap())
                    .unwrap_or_default()
            })
            .collect();
        (y.to_vec_f32().unwrap(), grads)
    };
    let (want, want_g) = run(cpu);
    let (got, got_g) = run(gpu);
    close(&format!("{name} forward"), dtype, &got, &want);
    for (i, (g, w)) in got_g.iter().zip(&want_g).enumerate() {
        close(&format!("{name} grad {i}"), dtype, g, w);
    }
}

fn input(rng: &mut Rng, shape: &[usize]) -> (Vec<f32>, Vec<usize>) {
    (rng.vec(shape.iter().product()), shape.to_vec())
}

fn all_float_ops(cpu: &Device, gpu: &Device, dtype: DType) {
    let mut r = Rng::new(7);
    let c =
        |name: &str, ins: Vec<(Vec<f32>, Vec<usize>)>, f: &dyn Fn(&[Tensor]) -> Result<Tensor>| {
            compare(name, cpu, gpu, dtype, &ins, f)
        };
    c(
        "matmul",
        vec![input(&mut r, &[5, 7]), input(&mut r, &[7, 3])],
        &|x| x[0].matmul(&x[1]),
    );
    c(
        "bmm",
        vec![input(&mut r, &[2, 4, 6]), input(&mut r, &[2, 6, 3])],
        &|x| x[0].matmul(&x[1]),
    );
    c(
        "matmul transposed",
        vec![input(&mut r, &[5, 7]), input(&mut r, &[3, 7])],
        &|x| x[0].matmul(&x[1].t()?),
    );
    c(
        "linear",
        vec![
            input(&mut r, &[2, 3, 8]),
            input(&mut r, &[5, 8]),
            input(&mut r, &[5]),
        ],
        &|x| linear(&x[0], &x[1], Some(&x[2])),
    );
    c(
        "add",
        vec![input(&mut r, &[4, 6]), input(&mut r, &[4, 6])],
        &|x| x[0].add(&x[1]),
    );
    c(
        "add row broadcast",
        vec![input(&mut r, &[4, 6]), input(&mut r, &[6])],
        &|x| x[0].add(&x[1]),
    );
    c(
        "mul",
        vec![input(&mut r, &[4, 6]), input(&mut r, &[4, 6])],
        &|x| x[0].mul(&x[1]),
    );
    c(
        "mul row broadcast",
        vec![input(&mut r, &[4, 6]), input(&mut r, &[6])],
        &|x| x[0].mul(&x[1]),
    );
    c("scale", vec![input(&mut r, &[9])], &|x| x[0].scale(-1.5));
    c("gelu exact", vec![input(&mut r, &[3, 17])], &|x| {
        x[0].gelu_with(Gelu::Exact)
    });
    c("gelu tanh", vec![input(&mut r, &[3, 17])], &|x| {
        x[0].gelu_with(Gelu::Tanh)
    });
    c("softmax", vec![input(&mut r, &[5, 11])], &|x| {
        x[0].softmax()
    });
    c(
        "layer_norm",
        vec![
            input(&mut r, &[6, 16]),
            input(&mut r, &[16]),
            input(&mut r, &[16]),
        ],
        &|x| layer_norm(&x[0], &x[1], &x[2], 1e-5),
    );
    c(
        "attention",
        vec![
            input(&mut r, &[2, 2, 5, 4]),
            input(&mut r, &[2, 2, 5, 4]),
            input(&mut r, &[2, 2, 5, 4]),
        ],
        &|x| causal_attention(&x[0], &x[1], &x[2]),
    );
    c("sum", vec![input(&mut r, &[7, 5])], &|x| x[0].sum());
    c("mean", vec![input(&mut r, &[7, 5])], &|x| x[0].mean());
    c(
        "permute + contiguous",
        vec![input(&mut r, &[2, 3, 4])],
        &|x| x[0].permute(&[2, 0, 1])?.contiguous(),
    );
    c(
        "split (dim 0) backward",
        vec![input(&mut r, &[6, 4])],
        &|x| {
            let p = x[0].split(&[2, 4])?;
            p[0].sum()?.add(&p[1].scale(2.0)?.sum()?)
        },
    );
    c("cast to f32 and back", vec![input(&mut r, &[10])], &|x| {
        x[0].to_dtype(DType::F32)?.to_dtype(x[0].dtype())
    });
}

fn ids(rng: &mut Rng, n: usize, bound: usize, dev: &Device) -> Tensor {
    let v: Vec<i64> = (0..n).map(|_| rng.below(bound) as i64).collect();
    Tensor::from_vec(v, &[n], dev).unwrap()
}

/// The CPU reference uses the one `cpu` device object for ids and weights: tensors built on two
/// `Device::cpu(0)` objects are on different devices, and mixing them is an error.
fn index_ops(cpu: &Device, gpu: &Device, dtype: DType) {
    let mut r = Rng::new(11);
    let table = input(&mut r, &[13, 8]);
    // The same ids on both devices.
    let ci = ids(&mut Rng::new(5), 9, 13, cpu);
    let gi = ids(&mut Rng::new(5), 9, 13, gpu);
    let emb = |x: &[Tensor]| {
        let i = if x[0].device().id() == gpu.id() {
            &gi
        } else {
            &ci
        };
        embedding(i, &x[0])
    };
    compare("embedding", cpu, gpu, dtype, &[table], &emb);
    let logits = input(&mut r, &[9, 13]);
    let ce = |x: &[Tensor]| {
        let t = if x[0].device().id() == gpu.id() {
            &gi
        } else {
            &ci
        };
        cross_entropy(&x[0], t)
    };
    compare("cross_entropy", cpu, gpu, dtype, &[logits], &ce);
}

#[test]
#[ignore = "needs a CUDA GPU: run `cargo xtask gpu-test` (FSDP_GPU_TESTS=1)"]
fn every_op_on_cuda_matches_cpu_f32_bf16_f16() {
    let Some(gpu) = gpu() else { return };
    let cpu = Device::cpu(0);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        all_float_ops(&cpu, &gpu, dtype);
        index_ops(&cpu, &gpu, dtype);
    }
}

/// Regression (issue #24): the reference side of `index_ops` built its ids on a second
/// `Device::cpu(0)` and failed with "tensors live on different devices" before any GPU work.
/// Runs the whole comparison with the CPU device on both sides, so it runs without a GPU.
#[test]
fn index_ops_reference_runs_on_one_cpu_device() {
    let cpu = Device::cpu(0);
    for dtype in [DType::F32, DType::BF16] {
        index_ops(&cpu, &cpu, dtype);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run `cargo xtask gpu-test` (FSDP_GPU_TESTS=1)"]
fn host_device_copies_round_trip_bit_exactly() {
    let Some(gpu) = gpu() else { return };
    let cpu = Device::cpu(0);
    let mut r = Rng::new(3);
    let v = r.vec(1000);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let x = Tensor::from_slice(&v, &[10, 100], &cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let back = x.to(&gpu).unwrap().to(&cpu).unwrap();
        assert_eq!(
            back.to_vec_f32().unwrap(),
            x.to_vec_f32().unwrap(),
            "{dtype}"
        );
        // Strided views move as their values.
        let t = x.t().unwrap();
        assert_eq!(
            t.to(&gpu).unwrap().to_vec_f32().unwrap(),
            t.to_vec_f32().unwrap()
        );
    }
    let i = Tensor::arange(17, &gpu).unwrap();
    assert_eq!(i.to_vec::<i64>().unwrap(), (0..17).collect::<Vec<_>>());
    let f = Tensor::full(&[5], 2.5, DType::BF16, &gpu).unwrap();
    assert_eq!(f.to_vec_f32().unwrap(), vec![2.5; 5]);
}

#[test]
#[ignore = "needs a CUDA GPU: run `cargo xtask gpu-test` (FSDP_GPU_TESTS=1)"]
fn out_of_range_ids_fail_at_the_next_readback() {
    let Some(gpu) = gpu() else { return };
    let table = Tensor::zeros(&[4, 3], DType::F32, &gpu).unwrap();
    let ids = Tensor::from_vec(vec![0i64, 9], &[2], &gpu).unwrap();
    let out = embedding(&ids, &table).unwrap();
    assert!(out.to_vec::<f32>().is_err());
}
