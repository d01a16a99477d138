//! Parity on small odd models: parameters smaller than W, numels not divisible by W, a
//! 1-element parameter, an unused parameter, a frozen parameter in a trainable unit, and a
//! module called twice in one forward — FSDP on W ranks equals local W-way accumulation, bitwise.

use fsdp_alloc::{DType, Device};
use fsdp_autograd::init::InitOp;
use fsdp_autograd::nn::{Linear, Module, ModuleHooks};
use fsdp_autograd::{InitContext, Parameter, Result, Tensor};
use fsdp_core::{BackwardPrefetch, Fsdp, FsdpConfig, ShardingStrategy, WrapPolicy};
use fsdp_tests::{first_difference, full_named, micro_loss, run_ranks, train_local};
use fsdp_tests::{sorted_by_name as sorted, Named};

const SEED: u64 = 77;
const VOCAB: usize = 7;
const BATCH: usize = 3;
const STEPS: usize = 3;
const LR: f32 = 0.1;

/// x[B,3] → a (3→5) → gelu → twice (5→5) applied twice → · tiny[1] + frozen[5] → head (5→7).
struct Odd {
    a: Linear,
    twice: Linear,
    head: Linear,
    tiny: Parameter,
    unused: Parameter,
    frozen: Parameter,
    hooks: ModuleHooks,
}

impl Odd {
    fn new(dev: &Device) -> Odd {
        let ctx = InitContext::eager(dev, SEED);
        let frozen_vals: Vec<f32> = (0..5).map(|i| 0.1 * i as f32 - 0.2).collect();
        let frozen = Parameter::new(
            "frozen",
            Tensor::from_vec(frozen_vals, &[5], dev).unwrap(),
            false,
            vec![],
            SEED,
        )
        .unwrap();
        Odd {
            a: Linear::new(&ctx.child("a"), 3, 5, true).unwrap(),
            twice: Linear::new(&ctx.child("twice"), 5, 5, true).unwrap(),
            head: Linear::new(&ctx.child("head"), 5, VOCAB, true).unwrap(),
            tiny: ctx
                .param("tiny", &[1], DType::F32, vec![InitOp::Fill(1.5)])
                .unwrap(),
            unused: ctx
                .param("unused", &[2], DType::F32, vec![InitOp::Fill(3.0)])
                .unwrap(),
            frozen,
            hooks: ModuleHooks::new(),
        }
    }
}

impl Module for Odd {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.a.call(x)?.gelu()?;
        let h = self.twice.call(&h)?;
        let h = self.twice.call(&h)?;
        let h = h.mul(&self.tiny.get()?)?.add(&self.frozen.get()?)?;
        self.head.call(&h)
    }
    fn visit_params(&self, f: &mut dyn FnMut(&str, &Parameter)) {
        f("tiny", &self.tiny);
        f("unused", &self.unused);
        f("frozen", &self.frozen);
    }
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(&str, &'a dyn Module)) {
        f("a", &self.a);
        f("twice", &self.twice);
        f("head", &self.head);
    }
    fn type_name(&self) -> &'static str {
        "Odd"
    }
    fn hooks(&self) -> &ModuleHooks {
        &self.hooks
    }
}

fn batch(step: usize, rank: usize, world: usize, dev: &Device) -> (Tensor, Tensor) {
    let k = step * world + rank;
    let x: Vec<f32> = (0..BATCH * 3)
        .map(|i| (((k * 31 + i * 7) % 11) as f32 - 5.0) * 0.2)
        .collect();
    let y: Vec<i64> = (0..BATCH)
        .map(|b| ((k * 3 + b * 5) % VOCAB) as i64)
        .collect();
    (
        Tensor::from_vec(x, &[BATCH, 3], dev).unwrap(),
        Tensor::from_vec(y, &[BATCH], dev).unwrap(),
    )
}

fn check(world: usize, config: FsdpConfig) {
    let dev = Device::cpu(1000);
    let (local_losses, local_params) = train_local(
        &Odd::new(&dev),
        &dev,
        world,
        world,
        STEPS,
        LR,
        &|s, r, d| batch(s, r, world, d),
    );
    let cfg = config.clone();
    let ranks = run_ranks(world, move |rank, pg| {
        let dev = Device::cpu(rank);
        let fsdp = Fsdp::wrap(Odd::new(&dev), &dev, pg, cfg.clone()).unwrap();
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let (x, y) = batch(step, rank, world, &dev);
            let loss = micro_loss(&fsdp.forward(&x).unwrap(), &y, world);
            losses.push(loss.item().unwrap());
            loss.backward().unwrap();
            fsdp.sgd_step(LR).unwrap();
            fsdp.zero_grad();
        }
        let p: Named = full_named(&fsdp);
        (losses, p)
    });
    for step in 0..STEPS {
        for (r, (l, _)) in ranks.iter().enumerate() {
            assert_eq!(
                l[step].to_bits(),
                local_losses[step][r].to_bits(),
                "loss of rank {r} at step {step} (W={world}, {config:?})"
            );
        }
    }
    let fsdp_params = sorted(ranks[0].1.clone());
    if let Some(d) = first_difference(&sorted(local_params.clone()), &fsdp_params) {
        panic!("parameters differ (W={world}, {config:?}): {d}");
    }
    // The frozen and unused parameters did not move; the trained ones did.
    let get = |n: &str| fsdp_params.iter().find(|(m, _)| m == n).unwrap().1.clone();
    let frozen_init: Vec<f32> = (0..5).map(|i| 0.1 * i as f32 - 0.2).collect();
    assert_eq!(get("frozen"), frozen_init);
    assert_eq!(get("unused"), vec![3.0, 3.0]);
    assert_ne!(get("tiny"), vec![1.5]);
}

#[test]
fn odd_model_matches_local_for_every_world_and_strategy() {
    for world in [1, 2, 3, 4, 8] {
        for strategy in [
            ShardingStrategy::FullShard,
            ShardingStrategy::ShardGradOp,
            ShardingStrategy::NoShard,
        ] {
            check(
                world,
                FsdpConfig {
                    strategy,
                    wrap_policy: WrapPolicy::Paths(vec!["twice".into(), "head".into()]),
                    ..FsdpConfig::default()
                },
            );
        }
    }
}

#[test]
fn odd_model_with_every_prefetch_mode_and_unit_per_linear() {
    for prefetch in [
        BackwardPrefetch::None,
        BackwardPrefetch::BackwardPre,
        BackwardPrefetch::BackwardPost,
    ] {
        check(
            4,
            FsdpConfig {
                wrap_policy: WrapPolicy::ModuleTypes(vec!["Linear".into()]),
                backward_prefetch: prefetch,
                forward_prefetch: true,
                ..FsdpConfig::default()
            },
        );
    }
}
