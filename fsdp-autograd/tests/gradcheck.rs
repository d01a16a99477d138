//! Finite-difference gradient checks for every differentiable operation (f32, central
//! differences of a random projection of the output).

mod common;

use common::{gradcheck, gradcheck_opts, Rng};
use fsdp_alloc::DType;
use fsdp_autograd::{
    causal_attention, causal_attention_qkv_grouped, causal_attention_scaled, cross_entropy,
    embedding, layer_norm, linear, Tensor,
};

fn inp(rng: &mut Rng, shape: &[usize]) -> (Vec<f32>, Vec<usize>) {
    (rng.vec(common::numel(shape)), shape.to_vec())
}

#[test]
fn add_mul_sub_scale_with_broadcasting() {
    let mut r = Rng::new(1);
    gradcheck(
        "add same",
        &[inp(&mut r, &[2, 3]), inp(&mut r, &[2, 3])],
        |x| x[0].add(&x[1]),
    );
    gradcheck(
        "add row",
        &[inp(&mut r, &[2, 3, 4]), inp(&mut r, &[3, 4])],
        |x| x[0].add(&x[1]),
    );
    gradcheck(
        "add row (small first)",
        &[inp(&mut r, &[4]), inp(&mut r, &[2, 4])],
        |x| x[0].add(&x[1]),
    );
    gradcheck(
        "add general",
        &[inp(&mut r, &[3, 1]), inp(&mut r, &[1, 4])],
        |x| x[0].add(&x[1]),
    );
    gradcheck("add same input twice", &[inp(&mut r, &[5])], |x| {
        x[0].add(&x[0])
    });
    gradcheck(
        "mul same",
        &[inp(&mut r, &[2, 3]), inp(&mut r, &[2, 3])],
        |x| x[0].mul(&x[1]),
    );
    gradcheck("mul row", &[inp(&mut r, &[2, 3]), inp(&mut r, &[3])], |x| {
        x[0].mul(&x[1])
    });
    gradcheck(
        "mul col",
        &[inp(&mut r, &[2, 3]), inp(&mut r, &[2, 1])],
        |x| x[0].mul(&x[1]),
    );
    gradcheck("mul square", &[inp(&mut r, &[4])], |x| x[0].mul(&x[0]));
    gradcheck("sub", &[inp(&mut r, &[2, 3]), inp(&mut r, &[3])], |x| {
        x[0].sub(&x[1])
    });
    gradcheck("scale", &[inp(&mut r, &[2, 3])], |x| x[0].scale(-1.5));
}

#[test]
fn unary_and_reductions() {
    let mut r = Rng::new(2);
    gradcheck("gelu", &[inp(&mut r, &[3, 5])], |x| x[0].gelu());
    gradcheck("gelu_exact", &[inp(&mut r, &[3, 5])], |x| x[0].gelu_exact());
    gradcheck("softmax", &[inp(&mut r, &[3, 5])], |x| x[0].softmax());
    gradcheck("sum", &[inp(&mut r, &[3, 4])], |x| x[0].sum());
    gradcheck("mean", &[inp(&mut r, &[3, 4])], |x| x[0].mean());
    gradcheck(
        "mean of product",
        &[inp(&mut r, &[6]), inp(&mut r, &[6])],
        |x| x[0].mul(&x[1])?.mean(),
    );
}

#[test]
fn matmul_variants() {
    let mut r = Rng::new(3);
    gradcheck(
        "matmul 2d",
        &[inp(&mut r, &[3, 4]), inp(&mut r, &[4, 2])],
        |x| x[0].matmul(&x[1]),
    );
    gradcheck(
        "matmul a transposed view",
        &[inp(&mut r, &[4, 3]), inp(&mut r, &[4, 2])],
        |x| x[0].t()?.matmul(&x[1]),
    );
    gradcheck(
        "matmul b transposed view",
        &[inp(&mut r, &[3, 4]), inp(&mut r, &[2, 4])],
        |x| x[0].matmul(&x[1].t()?),
    );
    gradcheck(
        "matmul batched",
        &[inp(&mut r, &[2, 3, 4]), inp(&mut r, &[2, 4, 2])],
        |x| x[0].matmul(&x[1]),
    );
    gradcheck(
        "matmul batched transposed",
        &[inp(&mut r, &[2, 4, 3]), inp(&mut r, &[2, 2, 4])],
        |x| x[0].transpose(1, 2)?.matmul(&x[1].transpose(1, 2)?),
    );
    gradcheck(
        "matmul batched x 2d (folded)",
        &[inp(&mut r, &[2, 3, 4]), inp(&mut r, &[4, 5])],
        |x| x[0].matmul(&x[1]),
    );
    gradcheck(
        "matmul strided (non-contiguous) operand",
        &[inp(&mut r, &[3, 8]), inp(&mut r, &[4, 2])],
        |x| x[0].narrow(1, 2, 4)?.matmul(&x[1]),
    );
}

#[test]
fn linear_variants() {
    let mut r = Rng::new(4);
    gradcheck(
        "linear bias",
        &[
            inp(&mut r, &[3, 4]),
            inp(&mut r, &[5, 4]),
            inp(&mut r, &[5]),
        ],
        |x| linear(&x[0], &x[1], Some(&x[2])),
    );
    gradcheck(
        "linear no bias 3d",
        &[inp(&mut r, &[2, 3, 4]), inp(&mut r, &[5, 4])],
        |x| linear(&x[0], &x[1], None),
    );
    gradcheck(
        "linear transposed weight",
        &[inp(&mut r, &[3, 4]), inp(&mut r, &[4, 5])],
        |x| linear(&x[0], &x[1].t()?, None),
    );
}

#[test]
fn layer_norm_rms_norm_embedding_attention_cross_entropy() {
    let mut r = Rng::new(5);
    gradcheck_opts(
        "layer_norm",
        &[inp(&mut r, &[3, 6]), inp(&mut r, &[6]), inp(&mut r, &[6])],
        &|x| layer_norm(&x[0], &x[1], &x[2], 1e-5),
        3e-3,
        3e-3,
        3e-2,
        None,
    );
    gradcheck_opts(
        "rms_norm",
        &[inp(&mut r, &[3, 6]), inp(&mut r, &[6])],
        &|x| x[0].rms_norm(&x[1], 1e-5),
        3e-3,
        3e-3,
        3e-2,
        None,
    );
    let dev = common::dev();
    gradcheck("embedding (repeated ids)", &[inp(&mut r, &[5, 3])], |x| {
        let ids = Tensor::from_vec(vec![4i64, 0, 4, 2, 1, 4], &[2, 3], &dev)?;
        embedding(&ids, &x[0])
    });
    gradcheck(
        "causal_attention",
        &[
            inp(&mut r, &[1, 2, 3, 4]),
            inp(&mut r, &[1, 2, 3, 4]),
            inp(&mut r, &[1, 2, 3, 4]),
        ],
        |x| causal_attention(&x[0], &x[1], &x[2]),
    );
    gradcheck(
        "causal_attention_scaled, grouped heads (4 query heads, 2 key/value heads)",
        &[
            inp(&mut r, &[2, 4, 3, 4]),
            inp(&mut r, &[2, 2, 3, 4]),
            inp(&mut r, &[2, 2, 3, 4]),
        ],
        |x| causal_attention_scaled(&x[0], &x[1], &x[2], 0.7),
    );
    gradcheck(
        "causal_attention_scaled, one key/value head, scale 1",
        &[
            inp(&mut r, &[1, 3, 4, 2]),
            inp(&mut r, &[1, 1, 4, 2]),
            inp(&mut r, &[1, 1, 4, 2]),
        ],
        |x| causal_attention_scaled(&x[0], &x[1], &x[2], 1.0),
    );
    gradcheck(
        "causal_attention_qkv_grouped (4 heads, 2 key/value heads, head dim 2)",
        &[inp(&mut r, &[2, 3, 16])],
        |x| causal_attention_qkv_grouped(&x[0], 4, 2, 0.4),
    );
    gradcheck("cross_entropy", &[inp(&mut r, &[2, 3, 5])], |x| {
        let t = Tensor::from_vec(vec![0i64, 4, 2, 2, 1, 3], &[2, 3], &dev)?;
        cross_entropy(&x[0], &t)
    });
}

#[test]
fn views() {
    let mut r = Rng::new(6);
    gradcheck("reshape", &[inp(&mut r, &[2, 6])], |x| {
        x[0].reshape(&[3, 4])?.gelu()
    });
    gradcheck("transpose+contiguous", &[inp(&mut r, &[2, 3])], |x| {
        x[0].transpose(0, 1)?.contiguous()?.view(&[6])
    });
    gradcheck("permute", &[inp(&mut r, &[2, 3, 4])], |x| {
        x[0].permute(&[2, 0, 1])?.gelu()
    });
    gradcheck("reshape of non-contiguous", &[inp(&mut r, &[2, 3])], |x| {
        x[0].t()?.reshape(&[6])
    });
    gradcheck("narrow", &[inp(&mut r, &[4, 3])], |x| x[0].narrow(0, 1, 2));
    gradcheck("narrow dim 1", &[inp(&mut r, &[4, 3])], |x| {
        x[0].narrow(1, 1, 2)?.gelu()
    });
    gradcheck("split dim 0", &[inp(&mut r, &[7])], |x| {
        let p = x[0].split(&[2, 4, 1])?;
        p[0].sum()?.add(&p[1].mul(&p[1])?.sum()?) // piece 2 unused
    });
    gradcheck("split dim 1", &[inp(&mut r, &[2, 5])], |x| {
        let p = x[0].split_dim(&[2, 3], 1)?;
        p[1].gelu()
    });
    gradcheck("expand", &[inp(&mut r, &[3, 1])], |x| {
        x[0].expand(&[2, 3, 4])?.gelu()
    });
    gradcheck("unsqueeze", &[inp(&mut r, &[3])], |x| {
        x[0].unsqueeze(0)?.gelu()
    });
}

#[test]
fn cast_backward_casts_the_gradient_back() {
    let dev = common::dev();
    let x = Tensor::from_vec(vec![1.0f32, -2.0, 3.5], &[3], &dev)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let w = Tensor::from_vec(vec![0.1f32, 0.2, 0.3], &[3], &dev).unwrap();
    let y = x.to_dtype(DType::BF16).unwrap();
    assert_eq!(y.dtype(), DType::BF16);
    y.to_dtype(DType::F32)
        .unwrap()
        .mul(&w)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    let g = x.grad().unwrap();
    assert_eq!(g.dtype(), DType::F32);
    let expect: Vec<f32> = [0.1f32, 0.2, 0.3]
        .iter()
        .map(|&v| f32::from(half::bf16::from_f32(v)))
        .collect();
    assert_eq!(g.to_vec::<f32>().unwrap(), expect);
}

#[test]
fn half_precision_ops_compute_in_f32() {
    let dev = common::dev();
    let mut r = Rng::new(9);
    let (a, b) = (r.vec(12), r.vec(8));
    for dt in [DType::F16, DType::BF16] {
        let ta = Tensor::from_vec(a.clone(), &[3, 4], &dev)
            .unwrap()
            .to_dtype(dt)
            .unwrap();
        let tb = Tensor::from_vec(b.clone(), &[4, 2], &dev)
            .unwrap()
            .to_dtype(dt)
            .unwrap();
        ta.set_requires_grad(false).unwrap();
        let leaf_a = ta.detach().requires_grad_(true).unwrap();
        let c = leaf_a.matmul(&tb).unwrap().gelu().unwrap();
        assert_eq!(c.dtype(), dt);
        // Reference: the same rounded inputs in f32, rounded on output.
        let fa = ta.to_dtype(DType::F32).unwrap();
        let fb = tb.to_dtype(DType::F32).unwrap();
        let reference = fa
            .matmul(&fb)
            .unwrap()
            .gelu()
            .unwrap()
            .to_dtype(dt)
            .unwrap();
        let got = c.to_vec_f32().unwrap();
        let want = reference.to_vec_f32().unwrap();
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-2 * w.abs().max(1.0), "{dt}: {g} vs {w}");
        }
        c.sum().unwrap().backward().unwrap();
        let g = leaf_a.grad().unwrap();
        assert_eq!(g.dtype(), dt);
        assert_eq!(g.shape(), &[3, 4]);
    }
}

/// Llama's two new ops: RoPE (the rotation with the head split, at an offset position) and the
/// fused SiLU·mul (both inputs).
#[test]
fn rope_and_silu_mul() {
    let mut r = Rng::new(39);
    let dev = common::dev();
    let (rows, half) = (6usize, 2usize);
    let angle = |p: usize, j: usize| p as f64 * 10000f64.powf(-(2.0 * j as f64) / 4.0);
    let cos: Vec<f32> = (0..rows * half)
        .map(|i| angle(i / half, i % half).cos() as f32)
        .collect();
    let sin: Vec<f32> = (0..rows * half)
        .map(|i| angle(i / half, i % half).sin() as f32)
        .collect();
    gradcheck("rope", &[inp(&mut r, &[2, 3, 2, 4])], |x| {
        let c = Tensor::from_vec(cos.clone(), &[rows, half], &dev)?;
        let s = Tensor::from_vec(sin.clone(), &[rows, half], &dev)?;
        x[0].rope(&c, &s, 2)
    });
    gradcheck(
        "silu_mul",
        &[inp(&mut r, &[3, 5]), inp(&mut r, &[3, 5])],
        |x| x[0].silu_mul(&x[1]),
    );
}

/// Dropout (the mask is a function of key, site, sample and element, so the finite differences
/// see the same mask) and the composite attention with dropout on the probabilities.
#[test]
fn dropout_and_attention_with_dropped_probabilities() {
    use fsdp_autograd::kernels::dropout::DropoutKey;
    use fsdp_autograd::ops::{causal_attention_qkv_dropout, ProbDropout};
    let mut r = Rng::new(12);
    let key = DropoutKey {
        seed: 4,
        step: 2,
        sample: 17,
    };
    gradcheck("dropout", &[inp(&mut r, &[3, 2, 5])], |x| {
        x[0].dropout(0.3, key, 5)
    });
    let drop = ProbDropout {
        p: 0.25,
        key,
        site: 7,
    };
    gradcheck("attention with dropout", &[inp(&mut r, &[2, 4, 12])], |x| {
        causal_attention_qkv_dropout(&x[0], 2, 0.7, Some(drop))
    });
    gradcheck("attention scale 1", &[inp(&mut r, &[1, 3, 6])], |x| {
        causal_attention_qkv_dropout(&x[0], 1, 1.0, None)
    });
}
