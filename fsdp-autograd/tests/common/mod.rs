//! Shared test helpers: deterministic data and a finite-difference gradient checker.
#![allow(dead_code)]

use fsdp_alloc::{DType, Device};
use fsdp_autograd::{no_grad, Result, Tensor};

thread_local! {
    static DEV: Device = Device::cpu(0);
}

/// This test thread's device (one per thread, shared by all helpers).
pub fn dev() -> Device {
    DEV.with(Device::clone)
}

/// A small deterministic generator (xorshift64*), uniform in [-1, 1).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform()).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Checks the gradients of `f` w.r.t. every input against central finite differences of the
/// scalar `sum(f(inputs) · r)` for a fixed random `r`. Inputs are f32 leaves.
pub fn gradcheck(
    name: &str,
    inputs: &[(Vec<f32>, Vec<usize>)],
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) {
    gradcheck_opts(name, inputs, &f, 1e-2, 2e-3, 2e-2, None)
}

/// [`gradcheck`] with explicit step, tolerances, and (optionally) the element indices to check
/// per input (all when `None`).
pub fn gradcheck_opts(
    name: &str,
    inputs: &[(Vec<f32>, Vec<usize>)],
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    eps: f32,
    atol: f32,
    rtol: f32,
    subset: Option<usize>,
) {
    let dev = dev();
    let leaves = |vals: &[Vec<f32>], grad: bool| -> Vec<Tensor> {
        vals.iter()
            .zip(inputs)
            .map(|(v, (_, s))| {
                let t = Tensor::from_vec(v.clone(), s, &dev).unwrap();
                t.set_requires_grad(grad).unwrap();
                t
            })
            .collect()
    };
    let base: Vec<Vec<f32>> = inputs.iter().map(|(v, _)| v.clone()).collect();
    // Random projection of the output.
    let xs = leaves(&base, true);
    let out = f(&xs).unwrap();
    let mut rng = Rng::new(4242);
    let r = Tensor::from_vec(rng.vec(out.numel()), out.shape(), &dev).unwrap();
    let r = r.to_dtype(out.dtype()).unwrap();
    let loss = out.mul(&r).unwrap().sum().unwrap();
    loss.backward().unwrap();
    let analytic: Vec<Vec<f32>> = xs
        .iter()
        .map(|x| match x.grad() {
            Some(g) => g.to_vec_f32().unwrap(),
            None => vec![0.0; x.numel()],
        })
        .collect();
    let eval = |vals: &[Vec<f32>]| -> f64 {
        no_grad(|| {
            let xs = leaves(vals, false);
            let out = f(&xs).unwrap();
            let r = r.to_dtype(out.dtype()).unwrap();
            out.mul(&r).unwrap().sum().unwrap().item().unwrap() as f64
        })
    };
    let mut pick = Rng::new(7);
    for (i, (v, _)) in inputs.iter().enumerate() {
        let idx: Vec<usize> = match subset {
            Some(k) if k < v.len() => (0..k).map(|_| pick.below(v.len())).collect(),
            _ => (0..v.len()).collect(),
        };
        for j in idx {
            let mut p = base.clone();
            p[i][j] += eps;
            let lp = eval(&p);
            p[i][j] -= 2.0 * eps;
            let lm = eval(&p);
            let num = ((lp - lm) / (2.0 * eps as f64)) as f32;
            let a = analytic[i][j];
            let tol = atol + rtol * a.abs().max(num.abs());
            assert!(
                (a - num).abs() <= tol,
                "{name}: input {i} element {j}: analytic {a} vs numeric {num} (tol {tol})"
            );
        }
    }
}

pub fn ones(shape: &[usize], dev: &Device) -> Tensor {
    Tensor::ones(shape, DType::F32, dev).unwrap()
}
