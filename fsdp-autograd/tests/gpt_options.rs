//! The GPT's GPT-2 options: a position table larger than the training sequence, the MLP width,
//! the layer-norm epsilon, attention scaling, and dropout (training forwards only, the same masks
//! when a checkpointed block recomputes, keyed by the sample's global index).

mod common;

use common::{dev, Rng};
use fsdp_autograd::kernels::dropout::DropoutKey;
use fsdp_autograd::nn::{named_parameters, AttnScaling, Gpt, GptConfig, GptDropout, Module};
use fsdp_autograd::{cross_entropy, no_grad, InitContext, Tensor};

fn ids(cfg: &GptConfig, b: usize, t: usize, seed: u64) -> Tensor {
    let mut r = Rng::new(seed);
    let v: Vec<i64> = (0..b * t).map(|_| r.below(cfg.vocab) as i64).collect();
    Tensor::from_vec(v, &[b, t], &dev()).unwrap()
}

fn logits(m: &Gpt, x: &Tensor) -> Vec<f32> {
    no_grad(|| m.forward(x)).unwrap().to_vec::<f32>().unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Loss and every parameter's gradient after one forward/backward of `x` (targets `x`).
fn loss_and_grads(m: &Gpt, x: &Tensor) -> (u32, Vec<(String, Vec<u32>)>) {
    let logits = m.forward(x).unwrap();
    let v = m.config.vocab;
    let flat = logits.reshape(&[logits.numel() / v, v]).unwrap();
    let t = x.reshape(&[x.numel()]).unwrap();
    let loss = cross_entropy(&flat, &t).unwrap();
    loss.backward().unwrap();
    let l = loss.item().unwrap().to_bits();
    let grads = named_parameters(m)
        .into_iter()
        .map(|(n, p)| {
            let g = p.grad().unwrap().to_vec::<f32>().unwrap();
            (n, bits(&g))
        })
        .collect();
    (l, grads)
}

#[test]
fn the_position_table_may_be_longer_than_the_sequence() {
    let cfg = GptConfig::new(16, 8, 1, 2, 4).with_positions(10);
    assert_eq!(cfg.positions(), 10);
    let m = Gpt::new(&InitContext::eager(&dev(), 1), &cfg).unwrap();
    assert_eq!(m.pos_emb.weight.shape(), &[10, 8]);
    // Sequences up to the table's length run (as transformers' n_positions); longer ones fail.
    assert_eq!(logits(&m, &ids(&cfg, 1, 10, 2)).len(), 10 * 16);
    assert!(no_grad(|| m.forward(&ids(&cfg, 1, 11, 2))).is_err());
    // A table shorter than the sequence is refused.
    let bad = GptConfig::new(16, 8, 1, 2, 4).with_positions(3);
    assert!(Gpt::new(&InitContext::eager(&dev(), 1), &bad).is_err());
}

#[test]
fn mlp_width_and_layer_norm_epsilon_are_used() {
    let cfg = GptConfig::new(16, 8, 1, 2, 4).with_inner(12);
    let m = Gpt::new(&InitContext::eager(&dev(), 1), &cfg).unwrap();
    let shapes: Vec<(String, Vec<usize>)> = named_parameters(&m)
        .into_iter()
        .map(|(n, p)| (n, p.shape().to_vec()))
        .collect();
    assert!(shapes.contains(&("blocks.0.mlp.fc.weight".into(), vec![12, 8])));
    assert!(shapes.contains(&("blocks.0.mlp.proj.weight".into(), vec![8, 12])));
    // The epsilon reaches the layer norms: a large one changes the logits.
    let x = ids(&cfg, 2, 4, 3);
    let a = logits(&m, &x);
    let wide = Gpt::new(&InitContext::eager(&dev(), 1), &cfg.with_ln_eps(0.5)).unwrap();
    let b = logits(&wide, &x);
    assert!(a.iter().zip(&b).any(|(p, q)| (p - q).abs() > 1e-3));
}

/// Attention scaling: the default equals the fused attention's `1/√head_dim`; no scaling and
/// scaling by the inverse layer index give other logits (and the layer index matters only from
/// the second block on).
#[test]
fn attention_scaling_changes_the_scores() {
    let base = GptConfig::new(16, 8, 2, 2, 5);
    let x = ids(&base, 2, 5, 4);
    let run = |s: AttnScaling, layers: usize| {
        let mut cfg = base.with_attn_scaling(s);
        cfg.n_layers = layers;
        let m = Gpt::new(&InitContext::eager(&dev(), 9), &cfg).unwrap();
        // Larger q/k weights than the init's 0.02, so the scale visibly changes the softmax.
        for (n, p) in named_parameters(&m) {
            if n.ends_with("attn.qkv.weight") {
                no_grad(|| p.get().unwrap().scale_(40.0)).unwrap();
            }
        }
        logits(&m, &x)
    };
    let plain = AttnScaling::default();
    let none = AttnScaling {
        by_head_dim: false,
        by_inverse_layer: false,
    };
    let inverse = AttnScaling {
        by_head_dim: true,
        by_inverse_layer: true,
    };
    assert_eq!(base.attn_scale(1), 0.5);
    assert_eq!(base.with_attn_scaling(inverse).attn_scale(1), 0.25);
    assert_eq!(base.with_attn_scaling(none).attn_scale(3), 1.0);
    let d = run(plain, 2);
    let differs = |a: &[f32], b: &[f32]| a.iter().zip(b).any(|(p, q)| (p - q).abs() > 1e-4);
    assert!(differs(&d, &run(none, 2)));
    assert!(differs(&d, &run(inverse, 2)));
    // One block: layer 0's inverse factor is 1, the same scores (the composite attention
    // against the fused one, to rounding).
    let (one, one_inv) = (run(plain, 1), run(inverse, 1));
    assert!(!differs(&one, &one_inv));
}

/// Dropout only with a key: without one (the default, evaluation) the logits are the no-dropout
/// model's bit for bit; with one they differ, are reproducible, and depend on the key; cleared,
/// the model is deterministic again.
#[test]
fn dropout_applies_only_in_training_forwards() {
    let cfg = GptConfig::new(16, 8, 2, 2, 6);
    let plain = Gpt::new(&InitContext::eager(&dev(), 3), &cfg).unwrap();
    let dropped = Gpt::new(
        &InitContext::eager(&dev(), 3),
        &cfg.with_dropout(GptDropout::all(0.2)),
    )
    .unwrap();
    let x = ids(&cfg, 3, 6, 5);
    let eval = logits(&plain, &x);
    assert_eq!(bits(&logits(&dropped, &x)), bits(&eval));
    let key = DropoutKey {
        seed: 1,
        step: 0,
        sample: 12,
    };
    dropped.set_dropout_key(Some(key));
    let a = logits(&dropped, &x);
    assert_ne!(bits(&a), bits(&eval));
    assert_eq!(bits(&logits(&dropped, &x)), bits(&a));
    dropped.set_dropout_key(Some(DropoutKey { step: 1, ..key }));
    assert_ne!(bits(&logits(&dropped, &x)), bits(&a));
    // A model without dropout probabilities ignores the key.
    plain.set_dropout_key(Some(key));
    assert_eq!(bits(&logits(&plain, &x)), bits(&eval));
    dropped.set_dropout_key(None);
    assert_eq!(bits(&logits(&dropped, &x)), bits(&eval));
}

/// Each of the three places drops: turning one on alone changes the logits.
#[test]
fn each_dropout_place_acts() {
    let cfg = GptConfig::new(16, 8, 2, 2, 6);
    let x = ids(&cfg, 2, 6, 7);
    let key = DropoutKey {
        seed: 2,
        step: 5,
        sample: 0,
    };
    let run = |d: GptDropout| {
        let m = Gpt::new(&InitContext::eager(&dev(), 3), &cfg.with_dropout(d)).unwrap();
        m.set_dropout_key(Some(key));
        logits(&m, &x)
    };
    let none = run(GptDropout::default());
    let off = GptDropout::default();
    for d in [
        GptDropout { embd: 0.3, ..off },
        GptDropout { attn: 0.3, ..off },
        GptDropout { resid: 0.3, ..off },
    ] {
        assert_ne!(bits(&run(d)), bits(&none), "{d:?}");
    }
}

/// An activation-checkpointed block recomputes with the masks of its forward: loss and
/// gradients equal the non-checkpointed model's bit for bit, with all three dropouts on.
#[test]
fn checkpointed_blocks_redraw_the_same_masks() {
    let cfg = GptConfig::new(16, 8, 2, 2, 6).with_dropout(GptDropout::all(0.25));
    let x = ids(&cfg, 3, 6, 8);
    let key = DropoutKey {
        seed: 7,
        step: 3,
        sample: 30,
    };
    let run = |checkpoint: bool| {
        let m = Gpt::new(
            &InitContext::eager(&dev(), 4),
            &cfg.with_checkpoint(checkpoint),
        )
        .unwrap();
        m.set_dropout_key(Some(key));
        loss_and_grads(&m, &x)
    };
    assert_eq!(run(false), run(true));
}

/// A sample's masks follow its global index: rows 1..3 of a batch keyed at sample 10 get the
/// logits of a batch of those two rows keyed at sample 11 (to rounding of the batch size).
#[test]
fn masks_follow_the_sample_index() {
    let cfg = GptConfig::new(16, 8, 2, 2, 6).with_dropout(GptDropout::all(0.3));
    let m = Gpt::new(&InitContext::eager(&dev(), 4), &cfg).unwrap();
    let x = ids(&cfg, 3, 6, 9);
    let key = DropoutKey {
        seed: 1,
        step: 2,
        sample: 10,
    };
    m.set_dropout_key(Some(key));
    let all = logits(&m, &x);
    let part = x.narrow(0, 1, 2).unwrap().contiguous().unwrap();
    m.set_dropout_key(Some(DropoutKey { sample: 11, ..key }));
    let two = logits(&m, &part);
    let row = 6 * 16;
    for (a, b) in all[row..].iter().zip(&two) {
        assert!((a - b).abs() <= 1e-5 * a.abs().max(1.0), "{a} vs {b}");
    }
    m.set_dropout_key(Some(DropoutKey { sample: 12, ..key }));
    let shifted = logits(&m, &part);
    assert!(shifted.iter().zip(&two).any(|(a, b)| (a - b).abs() > 1e-3));
}
