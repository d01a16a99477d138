//! The Llama: its forward against a plain f64 reference written from the definition
//! (transformers' `LlamaForCausalLM`: RMSNorm, RoPE in the `rotate_half` convention, grouped-query
//! attention with `repeat_kv`'s head mapping, SwiGLU, untied or tied head), parameter names and
//! counts, activation checkpointing bit for bit, Llama 3's rotary frequencies against
//! transformers' values, and training on a learnable task.

mod common;

use common::{dev, Rng};
use fsdp_alloc::Device;
use fsdp_autograd::nn::{
    named_parameters, named_parameters_with_duplicates, parameters, rope_inv_freq, Llama,
    Llama3Scaling, LlamaConfig, Module,
};
use fsdp_autograd::optim::Sgd;
use fsdp_autograd::{cross_entropy, no_grad, InitContext, Tensor};

/// The model's parameters by name, as f64.
fn params(m: &Llama) -> std::collections::HashMap<String, Vec<f64>> {
    named_parameters_with_duplicates(m)
        .into_iter()
        .map(|(n, p)| {
            let v = p.get().unwrap().to_vec::<f32>().unwrap();
            (n, v.into_iter().map(f64::from).collect())
        })
        .collect()
}

/// `x [n, k] · wᵀ` with `w [m, k]`.
fn mm(x: &[f64], w: &[f64], k: usize) -> Vec<f64> {
    let (n, m) = (x.len() / k, w.len() / k);
    let mut y = vec![0.0; n * m];
    for i in 0..n {
        for j in 0..m {
            y[i * m + j] = (0..k).map(|l| x[i * k + l] * w[j * k + l]).sum();
        }
    }
    y
}

fn rms(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let d = w.len();
    x.chunks(d)
        .flat_map(|r| {
            let s = 1.0 / (r.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
            r.iter().zip(w).map(move |(v, g)| v * s * g)
        })
        .collect()
}

/// The logits of `ids` (`[t]`, one sequence) from the definition, in f64.
fn reference(m: &Llama, ids: &[usize]) -> Vec<f64> {
    let c = m.config;
    let p = params(m);
    let (d, h, kvh, dh, t) = (c.d_model, c.n_heads, c.n_kv_heads, c.head_dim(), ids.len());
    let eps = c.rms_eps;
    let emb = &p["embed_tokens.weight"];
    let mut x: Vec<f64> = ids
        .iter()
        .flat_map(|&i| emb[i * d..(i + 1) * d].to_vec())
        .collect();
    // θ_j from the definition (f64), no scaling in these configurations.
    let theta: Vec<f64> = (0..dh / 2)
        .map(|j| c.rope_theta.powf(-((2 * j) as f64) / dh as f64))
        .collect();
    let rope = |v: &mut [f64], pos: usize| {
        let half = dh / 2;
        let (a, b) = v.split_at_mut(half);
        for j in 0..half {
            let (cs, sn) = ((pos as f64 * theta[j]).cos(), (pos as f64 * theta[j]).sin());
            let (x1, x2) = (a[j], b[j]);
            a[j] = x1 * cs - x2 * sn;
            b[j] = x2 * cs + x1 * sn;
        }
    };
    for l in 0..c.n_layers {
        let w = |n: &str| &p[&format!("layers.{l}.{n}.weight")];
        let hn = rms(&x, w("input_layernorm"), eps);
        let mut q = mm(&hn, w("self_attn.q_proj"), d);
        let mut k = mm(&hn, w("self_attn.k_proj"), d);
        let v = mm(&hn, w("self_attn.v_proj"), d);
        for pos in 0..t {
            for head in 0..h {
                rope(&mut q[(pos * h + head) * dh..][..dh], pos);
            }
            for head in 0..kvh {
                rope(&mut k[(pos * kvh + head) * dh..][..dh], pos);
            }
        }
        let mut att = vec![0.0; t * h * dh];
        for head in 0..h {
            let kv = head / (h / kvh); // transformers' repeat_kv
            for i in 0..t {
                let qi = &q[(i * h + head) * dh..][..dh];
                let s: Vec<f64> = (0..=i)
                    .map(|j| {
                        let kj = &k[(j * kvh + kv) * dh..][..dh];
                        qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() / (dh as f64).sqrt()
                    })
                    .collect();
                let mx = s.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                for (j, ej) in e.iter().enumerate() {
                    let vj = &v[(j * kvh + kv) * dh..][..dh];
                    for r in 0..dh {
                        att[(i * h + head) * dh + r] += ej / z * vj[r];
                    }
                }
            }
        }
        let o = mm(&att, w("self_attn.o_proj"), h * dh);
        x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        let hn = rms(&x, w("post_attention_layernorm"), eps);
        let g = mm(&hn, w("mlp.gate_proj"), d);
        let u = mm(&hn, w("mlp.up_proj"), d);
        let a: Vec<f64> = g
            .iter()
            .zip(&u)
            .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        let m2 = mm(&a, w("mlp.down_proj"), c.ffn_dim);
        x.iter_mut().zip(&m2).for_each(|(a, b)| *a += b);
    }
    let x = rms(&x, &p["norm.weight"], eps);
    mm(&x, &p["lm_head.weight"], d)
}

fn logits(m: &Llama, ids: &[usize], dev: &Device) -> Vec<f32> {
    let v: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
    let x = Tensor::from_vec(v, &[1, ids.len()], dev).unwrap();
    no_grad(|| m.forward(&x)).unwrap().to_vec::<f32>().unwrap()
}

/// The forward equals the f64 definition within 1e-5 of each row's largest |logit|: grouped
/// (4 heads over 2 key/value heads), multi-head (kv = heads) and tied configurations.
#[test]
fn forward_matches_the_definition() {
    for (name, c) in [
        ("gqa", LlamaConfig::tiny()),
        (
            "mha tied",
            LlamaConfig::new(40, 24, 3, 3, 3, 40, 12)
                .with_tied(true)
                .with_rms_eps(1e-6)
                .with_rope_theta(500.0),
        ),
        ("mqa", LlamaConfig::new(32, 32, 1, 4, 1, 48, 16)),
    ] {
        // Larger weights than the 0.02 init so that attention and the MLP matter.
        let m = Llama::new(&InitContext::eager(&dev(), 7), &c).unwrap();
        let mut r = Rng::new(3);
        for p in parameters(&m) {
            let t = p.get().unwrap();
            let v: Vec<f32> = r.vec(t.numel()).iter().map(|x| x * 0.3).collect();
            no_grad(|| t.copy_(&Tensor::from_vec(v, t.shape(), &dev())?)).unwrap();
        }
        let ids: Vec<usize> = (0..c.seq_len.min(11))
            .map(|i| (i * 7 + 3) % c.vocab)
            .collect();
        let got = logits(&m, &ids, &dev());
        let want = reference(&m, &ids);
        for (row, (g, w)) in got.chunks(c.vocab).zip(want.chunks(c.vocab)).enumerate() {
            let scale = w.iter().fold(0f64, |a, x| a.max(x.abs()));
            for (a, b) in g.iter().zip(w) {
                assert!(
                    (*a as f64 - b).abs() <= 1e-5 * scale,
                    "{name}: position {row}: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn names_counts_and_tying() {
    let c = LlamaConfig::tiny();
    let m = Llama::new(&InitContext::fake(0), &c).unwrap();
    let names: Vec<String> = named_parameters(&m).into_iter().map(|(n, _)| n).collect();
    assert_eq!(names[0], "embed_tokens.weight");
    assert_eq!(
        &names[1..10],
        [
            "layers.0.input_layernorm.weight",
            "layers.0.self_attn.q_proj.weight",
            "layers.0.self_attn.k_proj.weight",
            "layers.0.self_attn.v_proj.weight",
            "layers.0.self_attn.o_proj.weight",
            "layers.0.post_attention_layernorm.weight",
            "layers.0.mlp.gate_proj.weight",
            "layers.0.mlp.up_proj.weight",
            "layers.0.mlp.down_proj.weight",
        ]
    );
    assert_eq!(names[names.len() - 2..], ["norm.weight", "lm_head.weight"]);
    let count = |m: &Llama| -> u64 { parameters(m).iter().map(|p| p.numel() as u64).sum() };
    assert_eq!(count(&m), c.num_params());
    let k = named_parameters(&m)
        .into_iter()
        .find(|(n, _)| n == "layers.1.self_attn.k_proj.weight")
        .unwrap()
        .1;
    assert_eq!(k.shape(), [2 * 8, 32], "2 key/value heads of 8");
    let tied = Llama::new(&InitContext::fake(0), &c.with_tied(true)).unwrap();
    assert!(tied.lm_head.weight.ptr_eq(&tied.embed_tokens.weight));
    assert_eq!(count(&tied), c.with_tied(true).num_params());
    assert_eq!(c.num_params() - count(&tied), (c.vocab * c.d_model) as u64);
    let types: Vec<&str> = fsdp_autograd::nn::named_modules(&m)
        .iter()
        .map(|(_, m)| m.type_name())
        .collect();
    assert_eq!(
        types.iter().filter(|t| **t == "LlamaDecoderLayer").count(),
        2
    );
    for bad in [
        LlamaConfig::new(32, 30, 1, 4, 2, 8, 4), // 30 % 4
        LlamaConfig::new(32, 12, 1, 4, 2, 8, 4), // odd head dim 3
        LlamaConfig::new(32, 32, 1, 4, 3, 8, 4), // 4 % 3
        LlamaConfig::tiny().with_rope_theta(0.5),
    ] {
        assert!(Llama::new(&InitContext::fake(0), &bad).is_err(), "{bad:?}");
    }
    // A sequence longer than the rotary tables is refused.
    let e = Llama::new(&InitContext::eager(&dev(), 0), &c).unwrap();
    let ids = Tensor::from_vec(vec![0i64; 17], &[1, 17], &dev()).unwrap();
    assert!(e.forward(&ids).is_err());
}

/// Activation-checkpointed layers give the same loss and gradients, bit for bit.
#[test]
fn checkpointing_is_bitwise() {
    let run = |checkpoint: bool| {
        let c = LlamaConfig::tiny().with_checkpoint(checkpoint);
        let m = Llama::new(&InitContext::eager(&dev(), 11), &c).unwrap();
        let mut r = Rng::new(5);
        let ids: Vec<i64> = (0..2 * 16).map(|_| r.below(32) as i64).collect();
        let tg: Vec<i64> = (0..2 * 16).map(|_| r.below(32) as i64).collect();
        let x = Tensor::from_vec(ids, &[2, 16], &dev()).unwrap();
        let y = Tensor::from_vec(tg, &[32], &dev()).unwrap();
        let loss = cross_entropy(&m.forward(&x).unwrap().reshape(&[32, 32]).unwrap(), &y).unwrap();
        loss.backward().unwrap();
        let grads: Vec<Vec<u32>> = parameters(&m)
            .iter()
            .map(|p| {
                let g = p.get().unwrap().grad().unwrap().to_vec::<f32>().unwrap();
                g.iter().map(|v| v.to_bits()).collect()
            })
            .collect();
        (loss.item().unwrap().to_bits(), grads)
    };
    assert_eq!(run(false), run(true));
}

/// The rotary frequencies equal transformers' (`float32`, read from transformers 5.24) within one
/// ulp: the default and Llama 3.2's `llama3` scaling (θ 500,000, factor 32, head dim 64).
#[test]
fn rotary_frequencies_match_transformers() {
    let default = [
        0x3f800000u32,
        0x3f3ff911,
        0x3f0ff59a,
        0x3ed7e89b,
        0x3ea1e89b,
        0x3e72d423,
        0x3e361887,
        0x3e088d77,
        0x3dcccccd,
        0x3d99940d,
        0x3d6655c2,
        0x3d2cba15,
        0x3d0186e3,
        0x3cc2434f,
        0x3c91ad39,
        0x3c5a7bf2,
        0x3c23d70a,
        0x3bf5b9b0,
        0x3bb8449c,
        0x3b8a2e77,
        0x3b4f3e38,
        0x3b1b690d,
        0x3ae91528,
        0x3aaec98e,
        0x3a83126f,
        0x3a44948c,
        0x3a136a16,
        0x39dd1725,
        0x39a5cb60,
        0x3978a815,
        0x393a7753,
        0x390bd472,
    ];
    let llama3 = [
        0x3f800000u32,
        0x3f29e1c6,
        0x3ee177bc,
        0x3e959ee3,
        0x3e4693b0,
        0x3e03c6a0,
        0x3daee4ad,
        0x3d681e67,
        0x3d1a08c8,
        0x3ccc6f49,
        0x3c87a9c3,
        0x3c340d6d,
        0x3beef74f,
        0x3b9e9402,
        0x3b527720,
        0x3aa9279b,
        0x39e13620,
        0x38cb98f7,
        0x37a3418d,
        0x3758ac81,
        0x370fc8f8,
        0x36bed4f4,
        0x367d45c3,
        0x3628126b,
        0x35df10c4,
        0x359406cb,
        0x35447610,
        0x35025f34,
        0x34ad07a7,
        0x3465a54d,
        0x341864a7,
        0x33ca41b0,
    ];
    let scaling = Llama3Scaling {
        factor: 32.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position: 8192,
    };
    for (got, want) in [
        (rope_inv_freq(64, 10_000.0, None), default),
        (rope_inv_freq(64, 500_000.0, Some(scaling)), llama3),
    ] {
        for (j, (g, w)) in got.iter().zip(want).enumerate() {
            let ulps = (g.to_bits() as i64 - w as i64).abs();
            assert!(ulps <= 1, "θ_{j}: {g:e} vs {:e}", f32::from_bits(w));
        }
    }
}

/// A few SGD steps on a repeating sequence lower the loss.
#[test]
fn trains_on_a_learnable_task() {
    let c = LlamaConfig::tiny();
    let m = Llama::new(&InitContext::eager(&dev(), 1), &c).unwrap();
    let ids: Vec<i64> = (0..16).map(|i| (i % 5) as i64).collect();
    let tg: Vec<i64> = (1..17).map(|i| (i % 5) as i64).collect();
    let x = Tensor::from_vec(ids, &[1, 16], &dev()).unwrap();
    let y = Tensor::from_vec(tg, &[16], &dev()).unwrap();
    let mut opt = Sgd::new(parameters(&m), 0.1);
    let mut losses = Vec::new();
    for _ in 0..60 {
        let loss = cross_entropy(&m.forward(&x).unwrap().reshape(&[16, 32]).unwrap(), &y).unwrap();
        loss.backward().unwrap();
        losses.push(loss.item().unwrap());
        opt.step().unwrap();
        opt.zero_grad();
    }
    assert!(losses[59] < 0.5 * losses[0], "{losses:?}");
}
