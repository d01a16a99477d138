//! The GPT: parameter names, fake vs eager construction, tied weights, the loss gradient against
//! finite differences, memory after a step, and training on a learnable task.

mod common;

use common::{dev, Rng};
use fsdp_alloc::{DType, Device};
use fsdp_autograd::nn::{
    named_parameters, named_parameters_with_duplicates, parameters, Gpt, GptConfig, Module,
};
use fsdp_autograd::optim::Sgd;
use fsdp_autograd::{cross_entropy, no_grad, InitContext, Tensor};

fn random_batch(cfg: &GptConfig, b: usize, seed: u64, d: &Device) -> (Tensor, Tensor) {
    let mut r = Rng::new(seed);
    let n = b * cfg.seq_len;
    let ids: Vec<i64> = (0..n).map(|_| r.below(cfg.vocab) as i64).collect();
    let tg: Vec<i64> = (0..n).map(|_| r.below(cfg.vocab) as i64).collect();
    (
        Tensor::from_vec(ids, &[b, cfg.seq_len], d).unwrap(),
        Tensor::from_vec(tg, &[b, cfg.seq_len], d).unwrap(),
    )
}

#[test]
fn parameter_names_are_stable_and_fake_matches_eager() {
    let cfg = GptConfig::new(8, 8, 2, 2, 4);
    let eager = Gpt::new(&InitContext::eager(&dev(), 0), &cfg).unwrap();
    let fake = Gpt::new(&InitContext::fake(0), &cfg).unwrap();
    let names = |m: &Gpt| -> Vec<(String, Vec<usize>, String, String)> {
        named_parameters(m)
            .into_iter()
            .map(|(n, p)| {
                let ops: Vec<String> = p.init_ops().iter().map(|o| o.describe()).collect();
                (n, p.shape().to_vec(), p.name().to_string(), ops.join(","))
            })
            .collect()
    };
    let (e, f) = (names(&eager), names(&fake));
    assert_eq!(e, f);
    let just: Vec<&str> = e.iter().map(|x| x.0.as_str()).collect();
    assert_eq!(
        &just[..4],
        [
            "tok_emb.weight",
            "pos_emb.weight",
            "blocks.0.ln1.weight",
            "blocks.0.ln1.bias"
        ]
    );
    assert!(just.contains(&"blocks.1.attn.qkv.weight"));
    assert!(just.contains(&"blocks.1.mlp.proj.bias"));
    assert_eq!(just.last(), Some(&"head.weight"));
    // The name a parameter was created with is its fully-qualified name.
    assert!(e.iter().all(|x| x.0 == x.2));
    assert!(e
        .iter()
        .find(|x| x.0 == "blocks.0.attn.proj.weight")
        .unwrap()
        .3
        .contains("scale("));
    // The fake model allocated nothing and has no tensors.
    assert!(parameters(&fake).iter().all(|p| !p.is_materialized()));
    assert!(fake
        .call(&Tensor::zeros(&[1, 4], DType::I64, &dev()).unwrap())
        .is_err());
}

#[test]
fn tied_head_is_one_parameter_in_two_modules() {
    let cfg = GptConfig::new(8, 8, 1, 2, 4).with_tied(true);
    let m = Gpt::new(&InitContext::eager(&dev(), 0), &cfg).unwrap();
    assert!(m.head.weight.ptr_eq(&m.tok_emb.weight));
    let named = named_parameters(&m);
    assert!(named.iter().all(|(n, _)| n != "head.weight"));
    let dups = named_parameters_with_duplicates(&m);
    assert_eq!(dups.len(), named.len() + 1);
    assert!(dups.iter().any(|(n, _)| n == "head.weight"));
}

/// Finite-difference check of d(loss)/d(param) on a few elements of every parameter.
fn check_gpt_loss_gradient(cfg: GptConfig) {
    let d = dev();
    let m = Gpt::new(&InitContext::eager(&d, 3), &cfg).unwrap();
    // Larger weights than GPT-2's 0.02 so that every path matters numerically.
    no_grad(|| {
        for p in parameters(&m) {
            let t = p.get().unwrap();
            t.scale_(10.0).unwrap();
        }
    });
    let (ids, tg) = random_batch(&cfg, 2, 9, &d);
    let loss = cross_entropy(&m.call(&ids).unwrap(), &tg).unwrap();
    loss.backward().unwrap();
    let eval = || {
        no_grad(|| {
            cross_entropy(&m.call(&ids).unwrap(), &tg)
                .unwrap()
                .item()
                .unwrap() as f64
        })
    };
    let mut pick = Rng::new(1);
    let eps = 2e-3f32;
    for (name, p) in named_parameters(&m) {
        let t = p.get().unwrap();
        let g = t.grad().unwrap().to_vec::<f32>().unwrap();
        let vals = t.to_vec::<f32>().unwrap();
        for _ in 0..3 {
            let j = pick.below(vals.len());
            let set = |v: f32| {
                let mut w = vals.clone();
                w[j] = v;
                no_grad(|| t.copy_(&Tensor::from_vec(w, t.shape(), &d).unwrap())).unwrap();
            };
            set(vals[j] + eps);
            let lp = eval();
            set(vals[j] - eps);
            let lm = eval();
            set(vals[j]);
            let num = ((lp - lm) / (2.0 * eps as f64)) as f32;
            let tol = 2e-3 + 5e-2 * g[j].abs().max(num.abs());
            assert!(
                (g[j] - num).abs() <= tol,
                "{name}[{j}]: analytic {} numeric {num}",
                g[j]
            );
        }
    }
}

#[test]
fn gpt_loss_gradient_matches_finite_differences() {
    check_gpt_loss_gradient(GptConfig::new(8, 8, 2, 2, 4));
}

#[test]
fn tied_gpt_loss_gradient_matches_finite_differences() {
    check_gpt_loss_gradient(GptConfig::new(8, 8, 1, 2, 4).with_tied(true));
}

#[test]
fn after_a_step_only_parameters_and_gradients_remain_allocated() {
    let d = Device::cpu(3);
    let cfg = GptConfig::tiny();
    let m = Gpt::new(&InitContext::eager(&d, 0), &cfg).unwrap();
    let mut opt = Sgd::new(parameters(&m), 0.1).with_momentum(0.0);
    for step in 0..2 {
        let (ids, tg) = random_batch(&cfg, 2, step, &d);
        let loss = cross_entropy(&m.call(&ids).unwrap(), &tg).unwrap();
        loss.backward().unwrap();
        opt.step().unwrap();
        let _ = loss.item().unwrap();
    }
    d.synchronize().unwrap();
    let expected: usize = parameters(&m)
        .iter()
        .map(|p| {
            let t = p.get().unwrap();
            t.storage().allocated_size() + t.grad().unwrap().storage().allocated_size()
        })
        .sum();
    let stats = d.memory_stats();
    assert_eq!(stats.allocated_bytes, expected, "{stats:?}");
    // And the gradients really are separate allocations of exactly the parameter sizes.
    for p in parameters(&m) {
        let t = p.get().unwrap();
        let g = t.grad().unwrap();
        assert_eq!(g.shape(), t.shape());
        assert!(!g.storage().ptr_eq(t.storage()));
    }
}

/// A learnable task: every sequence walks a fixed random permutation of the vocabulary, so the
/// next token is a function of the current one.
fn successor_batch(
    perm: &[usize],
    b: usize,
    t: usize,
    r: &mut Rng,
    d: &Device,
) -> (Tensor, Tensor) {
    let mut ids = Vec::with_capacity(b * t);
    let mut tg = Vec::with_capacity(b * t);
    for _ in 0..b {
        let mut tok = r.below(perm.len());
        for _ in 0..t {
            ids.push(tok as i64);
            tok = perm[tok];
            tg.push(tok as i64);
        }
    }
    (
        Tensor::from_vec(ids, &[b, t], d).unwrap(),
        Tensor::from_vec(tg, &[b, t], d).unwrap(),
    )
}

#[test]
fn gpt_mini_loss_falls_on_a_learnable_task() {
    let d = dev();
    let cfg = GptConfig::tiny(); // vocab 32, d 32, 2 layers, 2 heads, seq 16
    let m = Gpt::new(&InitContext::eager(&d, 0), &cfg).unwrap();
    let mut r = Rng::new(5);
    let mut perm: Vec<usize> = (0..cfg.vocab).collect();
    for i in (1..perm.len()).rev() {
        perm.swap(i, r.below(i + 1));
    }
    let mut opt = Sgd::new(parameters(&m), 0.1).with_momentum(0.9);
    let mut losses = Vec::new();
    for _ in 0..200 {
        let (ids, tg) = successor_batch(&perm, 8, cfg.seq_len, &mut r, &d);
        let loss = cross_entropy(&m.call(&ids).unwrap(), &tg).unwrap();
        loss.backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad();
        losses.push(loss.item().unwrap());
    }
    let first = losses[0];
    let last: f32 = losses[190..].iter().sum::<f32>() / 10.0;
    assert!(
        (first - (cfg.vocab as f32).ln()).abs() < 0.3,
        "initial loss {first}"
    );
    assert!(
        last < 0.5,
        "loss after 200 steps {last} (from {first}); {losses:?}"
    );
}
