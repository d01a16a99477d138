//! Activation checkpointing: bitwise equal to no checkpointing, hooks fire once, less memory
//! held between forward and backward, clear errors.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::{dev, Rng};
use fsdp_autograd::nn::{named_modules, named_parameters, Gpt, GptConfig, Module};
use fsdp_autograd::{checkpoint, cross_entropy, no_grad, AutogradError, InitContext, Tensor};

fn batch(cfg: &GptConfig, b: usize, seed: u64) -> (Tensor, Tensor) {
    let mut r = Rng::new(seed);
    let n = b * cfg.seq_len;
    let ids: Vec<i64> = (0..n).map(|_| r.below(cfg.vocab) as i64).collect();
    let tg: Vec<i64> = (0..n).map(|_| r.below(cfg.vocab) as i64).collect();
    (
        Tensor::from_vec(ids, &[b, cfg.seq_len], &dev()).unwrap(),
        Tensor::from_vec(tg, &[b, cfg.seq_len], &dev()).unwrap(),
    )
}

fn grads_bits(m: &Gpt) -> Vec<(String, Vec<u32>)> {
    named_parameters(m)
        .into_iter()
        .map(|(n, p)| {
            let g = p.grad().unwrap_or_else(|| panic!("{n} has no grad"));
            (
                n,
                g.to_vec::<f32>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect(),
            )
        })
        .collect()
}

#[test]
fn checkpointed_gpt_is_bitwise_equal_to_plain() {
    let base = GptConfig::new(16, 16, 2, 2, 8);
    let (ids, tg) = batch(&base, 2, 1);
    let mut results = Vec::new();
    for ckpt in [false, true] {
        let cfg = base.with_checkpoint(ckpt);
        let m = Gpt::new(&InitContext::eager(&dev(), 7), &cfg).unwrap();
        for _ in 0..2 {
            // two iterations: accumulation through checkpointed graphs too
            let loss = cross_entropy(&m.call(&ids).unwrap(), &tg).unwrap();
            loss.backward().unwrap();
        }
        let loss = no_grad(|| {
            cross_entropy(&m.call(&ids).unwrap(), &tg)
                .unwrap()
                .item()
                .unwrap()
        });
        results.push((loss.to_bits(), grads_bits(&m)));
    }
    assert_eq!(results[0].0, results[1].0);
    assert_eq!(results[0].1, results[1].1);
}

#[test]
fn hooks_fire_once_with_checkpointing() {
    let cfg = GptConfig::new(16, 16, 2, 2, 8).with_checkpoint(true);
    let m = Gpt::new(&InitContext::eager(&dev(), 7), &cfg).unwrap();
    let (ids, tg) = batch(&cfg, 2, 2);
    let pre_forward = Arc::new(AtomicUsize::new(0));
    let tensor_hooks = Arc::new(AtomicUsize::new(0));
    let post_acc = Arc::new(AtomicUsize::new(0));
    // Module hooks on every block and every linear: count forwards, and register a tensor hook
    // on each output (FSDP's pre-backward hook).
    for (name, module) in named_modules(&m) {
        if name.starts_with("blocks.")
            && (module.type_name() == "Block" || module.type_name() == "Linear")
        {
            let c = pre_forward.clone();
            module.hooks().register_forward_pre_hook(move |_| {
                c.fetch_add(1, Ordering::SeqCst);
                Ok(None)
            });
            let th = tensor_hooks.clone();
            module.hooks().register_forward_hook(move |_, y| {
                if y.requires_grad() {
                    let th = th.clone();
                    y.register_hook(move |_| {
                        th.fetch_add(1, Ordering::SeqCst);
                        None
                    })?;
                }
                Ok(None)
            });
        }
    }
    let mut n_params = 0;
    for (_, p) in named_parameters(&m) {
        n_params += 1;
        let c = post_acc.clone();
        p.get()
            .unwrap()
            .register_post_accumulate_grad_hook(move |_| {
                c.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
    }
    let modules_hooked = 2 * (1 + 4); // per block: the block and its 4 linears
    let loss = cross_entropy(&m.call(&ids).unwrap(), &tg).unwrap();
    assert_eq!(pre_forward.load(Ordering::SeqCst), modules_hooked);
    loss.backward().unwrap();
    // Forward hooks run again during recomputation (as in PyTorch)...
    assert_eq!(pre_forward.load(Ordering::SeqCst), 2 * modules_hooked - 2); // blocks are not re-called
                                                                            // ...but tensor hooks and post-accumulate hooks fire exactly once each.
    assert_eq!(tensor_hooks.load(Ordering::SeqCst), modules_hooked);
    assert_eq!(post_acc.load(Ordering::SeqCst), n_params);
}

#[test]
fn checkpointing_holds_less_memory_between_forward_and_backward() {
    let base = GptConfig::new(32, 32, 4, 2, 16);
    let (ids, tg) = batch(&base, 4, 3);
    let mut held = Vec::new();
    for ckpt in [false, true] {
        let d = fsdp_alloc::Device::cpu(1);
        let m = Gpt::new(&InitContext::eager(&d, 7), &base.with_checkpoint(ckpt)).unwrap();
        let ids = Tensor::from_vec(ids.to_vec::<i64>().unwrap(), ids.shape(), &d).unwrap();
        let tg = Tensor::from_vec(tg.to_vec::<i64>().unwrap(), tg.shape(), &d).unwrap();
        let before = d.memory_stats().allocated_bytes;
        let loss = cross_entropy(&m.call(&ids).unwrap(), &tg).unwrap();
        held.push(d.memory_stats().allocated_bytes - before);
        loss.backward().unwrap();
    }
    assert!(
        held[1] * 2 < held[0],
        "checkpointed {} vs plain {}",
        held[1],
        held[0]
    );
}

#[test]
fn nesting_and_modified_inputs_are_errors() {
    let x = Tensor::from_vec(vec![1.0f32, 2.0], &[2], &dev())
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let err = checkpoint(
        |xs: &[Tensor]| checkpoint(|ys: &[Tensor]| Ok(vec![ys[0].gelu()?]), xs),
        std::slice::from_ref(&x),
    )
    .unwrap_err();
    assert!(matches!(err, AutogradError::Checkpoint(_)), "{err:?}");

    let c = Tensor::from_vec(vec![3.0f32, 4.0], &[2], &dev()).unwrap();
    let y = checkpoint(
        |xs: &[Tensor]| Ok(vec![xs[0].mul(&xs[1])?]),
        &[x.clone(), c.clone()],
    )
    .unwrap();
    c.scale_(2.0).unwrap();
    let err = y[0].sum().unwrap().backward().unwrap_err();
    assert!(
        matches!(err, AutogradError::SavedTensorModified { .. }),
        "{err:?}"
    );
}
