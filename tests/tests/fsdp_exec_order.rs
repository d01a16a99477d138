//! Every rank must run FSDP units in the same order: the all-gathers are paired by issue order,
//! so two same-sized units run in different orders would silently gather one rank's shard of
//! one unit with another rank's shard of the other. FSDP compares the forward order across
//! ranks in the first iterations and fails with both orders named.

use std::sync::atomic::{AtomicBool, Ordering};

use fsdp_alloc::Device;
use fsdp_autograd::nn::{Linear, Module, ModuleHooks};
use fsdp_autograd::{InitContext, Parameter, Result, Tensor};
use fsdp_core::{Fsdp, FsdpConfig, FsdpError, WrapPolicy};
use fsdp_tests::{micro_loss, run_ranks};

const VOCAB: usize = 5;

/// x[2,4] → l1 → l2 → head, or l2 → l1 → head when `swapped` (a data- or rank-dependent graph).
struct TwoPaths {
    l1: Linear,
    l2: Linear,
    head: Linear,
    swapped: AtomicBool,
    hooks: ModuleHooks,
}

impl TwoPaths {
    fn new(dev: &Device) -> TwoPaths {
        let ctx = InitContext::eager(dev, 3);
        TwoPaths {
            l1: Linear::new(&ctx.child("l1"), 4, 4, true).unwrap(),
            l2: Linear::new(&ctx.child("l2"), 4, 4, true).unwrap(),
            head: Linear::new(&ctx.child("head"), 4, VOCAB, true).unwrap(),
            swapped: AtomicBool::new(false),
            hooks: ModuleHooks::new(),
        }
    }
}

impl Module for TwoPaths {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (a, b) = if self.swapped.load(Ordering::Relaxed) {
            (&self.l2, &self.l1)
        } else {
            (&self.l1, &self.l2)
        };
        let h = b.call(&a.call(x)?.gelu()?)?.gelu()?;
        self.head.call(&h)
    }
    fn visit_params(&self, _f: &mut dyn FnMut(&str, &Parameter)) {}
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(&str, &'a dyn Module)) {
        f("l1", &self.l1);
        f("l2", &self.l2);
        f("head", &self.head);
    }
    fn type_name(&self) -> &'static str {
        "TwoPaths"
    }
    fn hooks(&self) -> &ModuleHooks {
        &self.hooks
    }
}

fn run(swap_rank: Option<usize>, swap_step: usize, config: FsdpConfig) -> Vec<Vec<String>> {
    run_ranks(2, move |rank, pg| {
        let dev = Device::cpu(rank);
        let fsdp = Fsdp::wrap(TwoPaths::new(&dev), &dev, pg, config.clone()).unwrap();
        let mut outcomes = Vec::new();
        for step in 0..3 {
            fsdp.module().swapped.store(
                swap_rank == Some(rank) && step >= swap_step,
                Ordering::Relaxed,
            );
            let x = Tensor::from_vec(
                vec![0.1f32, -0.2, 0.3, 0.4, 0.5, -0.6, 0.7, 0.8],
                &[2, 4],
                &dev,
            )
            .unwrap();
            let y = Tensor::from_vec(vec![1i64, 3], &[2], &dev).unwrap();
            let r = fsdp
                .forward(&x)
                .and_then(|l| Ok(micro_loss(&l, &y, 2).backward()?))
                .and_then(|()| fsdp.sgd_step(0.1))
                .and_then(|()| fsdp.synchronize());
            fsdp.zero_grad();
            outcomes.push(match r {
                Ok(()) => "ok".to_string(),
                // Raised in a hook, returned through autograd, recovered by type.
                Err(e) if matches!(e.root(), FsdpError::ExecutionOrder { .. }) => {
                    format!("[typed] {e}")
                }
                Err(e) => e.to_string(),
            });
            if outcomes.last().unwrap() != "ok" {
                break;
            }
        }
        outcomes
    })
}

fn config(verify: usize) -> FsdpConfig {
    FsdpConfig {
        wrap_policy: WrapPolicy::Paths(vec!["l1".into(), "l2".into()]),
        verify_execution_order: verify,
        ..FsdpConfig::default()
    }
}

#[test]
fn a_rank_running_units_in_another_order_fails_every_rank() {
    // Default: the first iteration is verified.
    let out = run(Some(1), 0, config(1));
    for (rank, steps) in out.iter().enumerate() {
        assert_eq!(
            steps.len(),
            1,
            "rank {rank} stops at the first step: {steps:?}"
        );
        let msg = &steps[0];
        eprintln!("rank {rank}: {msg}");
        assert!(msg.starts_with("[typed] "), "rank {rank}: {msg}");
        assert!(msg.contains("different orders"), "rank {rank}: {msg}");
        assert!(
            msg.contains("[(root), l1, l2]") && msg.contains("[(root), l2, l1]"),
            "rank {rank}: both orders are named: {msg}"
        );
    }
}

#[test]
fn a_later_divergence_is_caught_when_every_iteration_is_verified() {
    let out = run(Some(0), 2, config(usize::MAX));
    for (rank, steps) in out.iter().enumerate() {
        assert_eq!(steps[..2], ["ok", "ok"], "rank {rank}: {steps:?}");
        assert!(
            steps[2].contains("different orders"),
            "rank {rank}: {steps:?}"
        );
    }
    // With only the first iteration verified, the same divergence goes unnoticed — the hazard
    // the check exists for (the gathered parameters are silently wrong from step 2 on).
    let out = run(Some(0), 2, config(1));
    assert!(out.iter().all(|s| s == &["ok", "ok", "ok"]), "{out:?}");
}

#[test]
fn the_same_order_on_every_rank_passes_verification() {
    let out = run(None, 0, config(usize::MAX));
    assert!(out.iter().all(|s| s == &["ok", "ok", "ok"]), "{out:?}");
    // Both ranks swapped: still the same order everywhere.
    let both = run_ranks(2, |rank, pg| {
        let dev = Device::cpu(rank);
        let fsdp = Fsdp::wrap(TwoPaths::new(&dev), &dev, pg, config(usize::MAX)).unwrap();
        fsdp.module().swapped.store(true, Ordering::Relaxed);
        let x = Tensor::from_vec(vec![0.5f32; 8], &[2, 4], &dev).unwrap();
        let y = Tensor::from_vec(vec![0i64, 2], &[2], &dev).unwrap();
        micro_loss(&fsdp.forward(&x).unwrap(), &y, 2).backward()
    });
    assert!(both.iter().all(|r| r.is_ok()), "{both:?}");
}
