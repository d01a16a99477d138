//! Sharded optimizers: FSDP on W thread ranks with sharded SGD (momentum, weight decay) or AdamW
//! equals the local model trained with W-way gradient accumulation and the local optimizer,
//! **bitwise** in f32 (parameters and every micro-batch loss), for every strategy; the state is
//! sharded like the parameters, round-trips through `state()` / `load_state`, and bad state is
//! refused.

use std::sync::Arc;

use fsdp_alloc::{DType, Device};
use fsdp_autograd::init::InitOp;
use fsdp_autograd::nn::{named_parameters, Gpt, GptConfig, Linear, Module, ModuleHooks};
use fsdp_autograd::{no_grad, InitContext, Parameter, Tensor};
use fsdp_collectives::{DeviceMesh, ProcessGroup};
use fsdp_core::optim::{
    AdamParams, AdamW, LocalAdamW, LocalOptimizer, LocalSgd, OptimizerState, Sgd, ShardedOptimizer,
};
use fsdp_core::{Comm, Fsdp, FsdpConfig, ShardingStrategy, WrapPolicy};
use fsdp_tests::{first_difference, full_named, micro_loss, run_ranks, token_tensors};
use fsdp_tests::{sorted_by_name as sorted, Named};

const SEED: u64 = 4321;
const BATCH: usize = 2;
const STEPS: usize = 3;

fn cfg() -> GptConfig {
    GptConfig::new(19, 12, 2, 2, 6)
}

fn batch(step: usize, rank: usize, world: usize, dev: &Device) -> (Tensor, Tensor) {
    let c = cfg();
    token_tensors(step * world + rank, BATCH, c.seq_len, c.vocab, dev)
}

fn blocks() -> WrapPolicy {
    WrapPolicy::ModuleTypes(vec!["Block".into()])
}

/// The optimizers under test, buildable on every rank thread.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Sgd,
    AdamW,
}

impl Kind {
    fn sharded(self) -> Box<dyn ShardedOptimizer> {
        match self {
            Kind::Sgd => Box::new(Sgd::new(0.05).with_momentum(0.9).with_weight_decay(0.01)),
            Kind::AdamW => Box::new(AdamW::with_params(adam())),
        }
    }
    fn local(self, params: Vec<Parameter>) -> Box<dyn LocalOptimizer> {
        match self {
            Kind::Sgd => Box::new(
                LocalSgd::new(params, 0.05)
                    .with_momentum(0.9)
                    .with_weight_decay(0.01),
            ),
            Kind::AdamW => Box::new(LocalAdamW::new(params, adam())),
        }
    }
}

fn adam() -> AdamParams {
    AdamParams {
        lr: 0.01,
        betas: (0.9, 0.99),
        eps: 1e-8,
        weight_decay: 0.05,
    }
}

/// Local W-way accumulation in groups of `group` micro-batches (the group totals are added in
/// group order, as hybrid sharding's replicate all-reduce does): leaves the total in `.grad`.
fn accumulate_local(
    model: &Gpt,
    params: &[(String, Parameter)],
    world: usize,
    group: usize,
    step: usize,
    dev: &Device,
) -> Vec<f32> {
    let mut losses = Vec::new();
    let mut total: Vec<Option<Tensor>> = vec![None; params.len()];
    for g in 0..world / group {
        for r in g * group..(g + 1) * group {
            let (x, y) = batch(step, r, world, dev);
            let loss = micro_loss(&model.call(&x).unwrap(), &y, world);
            losses.push(loss.item().unwrap());
            loss.backward().unwrap();
        }
        for ((_, p), acc) in params.iter().zip(total.iter_mut()) {
            let t = p.get().unwrap();
            let Some(gr) = t.grad() else { continue };
            let gr = gr.contiguous_copy().unwrap();
            match acc {
                None => *acc = Some(gr),
                Some(a) => no_grad(|| a.add_(&gr)).unwrap(),
            }
            t.zero_grad();
        }
    }
    for ((_, p), acc) in params.iter().zip(total) {
        p.get().unwrap().set_grad(acc).unwrap();
    }
    losses
}

fn local(world: usize, group: usize, kind: Kind) -> (Vec<f32>, Named) {
    let dev = Device::cpu(1000);
    let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
    let params = named_parameters(&model);
    let mut opt = kind.local(params.iter().map(|(_, p)| p.clone()).collect());
    let mut losses = Vec::new();
    for step in 0..STEPS {
        losses.extend(accumulate_local(&model, &params, world, group, step, &dev));
        opt.step().unwrap();
        opt.zero_grad();
    }
    let finals = params
        .iter()
        .map(|(n, p)| (n.clone(), p.get().unwrap().to_vec::<f32>().unwrap()))
        .collect();
    (losses, finals)
}

fn comm(pg: Arc<dyn ProcessGroup>, shard: Option<usize>) -> Comm {
    match shard {
        Some(f) => DeviceMesh::new(pg, f).unwrap().into(),
        None => pg.into(),
    }
}

fn full(fsdp: &Fsdp<Gpt>) -> Named {
    full_named(fsdp)
}

fn sharded(
    world: usize,
    shard: Option<usize>,
    config: FsdpConfig,
    kind: Kind,
) -> (Vec<f32>, Named) {
    let ranks = run_ranks(world, move |rank, pg| {
        let dev = Device::cpu(rank);
        let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
        let fsdp = Fsdp::wrap(model, &dev, comm(pg, shard), config.clone()).unwrap();
        let mut opt = kind.sharded();
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let (x, y) = batch(step, rank, world, &dev);
            let loss = micro_loss(&fsdp.forward(&x).unwrap(), &y, world);
            losses.push(loss.item().unwrap());
            loss.backward().unwrap();
            opt.step(&fsdp).unwrap();
            opt.zero_grad(&fsdp);
        }
        assert_eq!(opt.step_counts(), vec![STEPS as u64; fsdp.num_units()]);
        (losses, full(&fsdp))
    });
    for (r, (_, p)) in ranks.iter().enumerate().skip(1) {
        assert_eq!(first_difference(&ranks[0].1, p), None, "rank {r} vs rank 0");
    }
    // Losses in the local order: step-major, then rank.
    let losses = (0..STEPS)
        .flat_map(|s| ranks.iter().map(move |(l, _)| l[s]))
        .collect();
    (losses, ranks.into_iter().next().unwrap().1)
}

fn check(world: usize, shard: Option<usize>, config: FsdpConfig, kind: Kind) {
    let (ll, lp) = local(world, shard.unwrap_or(world), kind);
    let (fl, fp) = sharded(world, shard, config.clone(), kind);
    assert_eq!(
        ll.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        fl.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        "losses differ ({kind:?}, W={world}, {config:?})"
    );
    if let Some(d) = first_difference(&sorted(lp), &sorted(fp)) {
        panic!("parameters differ ({kind:?}, W={world}, shard {shard:?}, {config:?}): {d}");
    }
}

fn full_shard() -> FsdpConfig {
    FsdpConfig {
        wrap_policy: blocks(),
        ..FsdpConfig::default()
    }
}

#[test]
fn sgd_with_momentum_and_weight_decay_matches_local_bitwise_on_1_to_4_ranks() {
    for w in 1..=4 {
        check(w, None, full_shard(), Kind::Sgd);
    }
}

#[test]
fn adamw_matches_local_bitwise_on_1_to_4_ranks() {
    for w in 1..=4 {
        check(w, None, full_shard(), Kind::AdamW);
    }
}

#[test]
fn every_strategy_and_policy_matches_local_bitwise() {
    for kind in [Kind::Sgd, Kind::AdamW] {
        for strategy in [ShardingStrategy::ShardGradOp, ShardingStrategy::NoShard] {
            let config = FsdpConfig {
                strategy,
                ..full_shard()
            };
            check(3, None, config, kind);
        }
        let hybrid = FsdpConfig {
            strategy: ShardingStrategy::HybridShard,
            ..full_shard()
        };
        check(4, Some(2), hybrid, kind);
        let root_only = FsdpConfig {
            wrap_policy: WrapPolicy::RootOnly,
            ..FsdpConfig::default()
        };
        check(2, None, root_only, kind);
    }
}

#[test]
fn plain_sharded_sgd_is_exactly_fsdp_sgd_step() {
    let ranks = run_ranks(3, |rank, pg| {
        let dev = Device::cpu(rank);
        let mk = || {
            let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
            Fsdp::wrap(model, &dev, pg.clone(), full_shard()).unwrap()
        };
        let (a, b) = (mk(), mk());
        let mut opt = Sgd::new(0.05);
        for step in 0..STEPS {
            for (i, f) in [&a, &b].into_iter().enumerate() {
                let (x, y) = batch(step, rank, 3, &dev);
                micro_loss(&f.forward(&x).unwrap(), &y, 3)
                    .backward()
                    .unwrap();
                if i == 0 {
                    opt.step(f).unwrap();
                } else {
                    f.sgd_step(0.05).unwrap();
                }
                f.zero_grad();
            }
        }
        // Plain SGD keeps no state.
        assert!(opt.state()[0].1.iter().all(Option::is_none));
        (full(&a), full(&b))
    });
    for (a, b) in ranks {
        assert_eq!(first_difference(&a, &b), None);
    }
}

#[test]
fn local_sgd_equals_the_autograd_crates_independent_sgd() {
    let dev = Device::cpu(1001);
    let run = |ours: bool| {
        let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
        let params = named_parameters(&model);
        let ps: Vec<Parameter> = params.iter().map(|(_, p)| p.clone()).collect();
        let mut a = LocalSgd::new(ps.clone(), 0.05)
            .with_momentum(0.9)
            .with_weight_decay(0.01);
        let mut b = fsdp_autograd::optim::Sgd::new(ps, 0.05)
            .with_momentum(0.9)
            .with_weight_decay(0.01);
        for step in 0..STEPS {
            accumulate_local(&model, &params, 2, 2, step, &dev);
            if ours {
                a.step().unwrap();
                a.zero_grad();
            } else {
                b.step().unwrap();
                b.zero_grad();
            }
        }
        params
            .iter()
            .map(|(n, p)| (n.clone(), p.get().unwrap().to_vec::<f32>().unwrap()))
            .collect::<Named>()
    };
    assert_eq!(first_difference(&run(true), &run(false)), None);
}

#[test]
fn optimizer_state_is_sharded_like_the_parameters() {
    let world = 3;
    let per_rank = run_ranks(world, move |rank, pg| {
        let dev = Device::cpu(rank);
        let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
        let fsdp = Fsdp::wrap(model, &dev, pg, full_shard()).unwrap();
        let mut opt = AdamW::with_params(adam());
        let (x, y) = batch(0, rank, world, &dev);
        micro_loss(&fsdp.forward(&x).unwrap(), &y, world)
            .backward()
            .unwrap();
        opt.step(&fsdp).unwrap();
        let state = opt.state();
        assert_eq!(
            state.iter().map(|(s, _)| s.as_str()).collect::<Vec<_>>(),
            ["exp_avg", "exp_avg_sq"]
        );
        let units = fsdp.units();
        let mut state_numel = 0;
        for (_, per_unit) in &state {
            assert_eq!(per_unit.len(), units.len());
            for (t, unit) in per_unit.iter().zip(&units) {
                let t = t.as_ref().expect("every unit stepped");
                assert_eq!(t.numel(), unit.shard_numel);
                state_numel += t.numel();
            }
        }
        let total: usize = units.iter().map(|u| u.total_numel).sum();
        (state_numel, total)
    });
    for (state_numel, total) in per_rank {
        // Two slots, each a 1/W share of the (padded) parameters.
        assert!(
            state_numel <= 2 * (total / world + 3 * 4),
            "{state_numel} vs {total}"
        );
        assert!(state_numel >= 2 * total / world);
    }
}

/// Host copies of a state, re-created as fresh tensors (what a state dict would do).
fn copy_state(state: &OptimizerState, dev: &Device) -> OptimizerState {
    state
        .iter()
        .map(|(s, per)| {
            let per = per
                .iter()
                .map(|t| {
                    t.as_ref().map(|t| {
                        let v = t.to_vec::<f32>().unwrap();
                        let n = v.len();
                        Tensor::from_vec(v, &[n], dev).unwrap()
                    })
                })
                .collect();
            (s.clone(), per)
        })
        .collect()
}

#[test]
fn state_round_trip_resumes_bitwise() {
    let world = 2;
    for kind in [Kind::Sgd, Kind::AdamW] {
        let ranks = run_ranks(world, move |rank, pg| {
            let dev = Device::cpu(rank);
            let mk = || {
                let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
                Fsdp::wrap(model, &dev, pg.clone(), full_shard()).unwrap()
            };
            let (a, b) = (mk(), mk());
            let mut oa = kind.sharded();
            let mut ob = kind.sharded();
            for step in 0..STEPS {
                if step == STEPS - 1 {
                    // Replace b's optimizer by a fresh one loaded from a copy of its state.
                    b.synchronize().unwrap();
                    let state = copy_state(&ob.state(), &dev);
                    let steps = ob.step_counts();
                    ob = kind.sharded();
                    ob.load_state(&b, state, steps).unwrap();
                }
                for (f, o) in [(&a, &mut oa), (&b, &mut ob)] {
                    let (x, y) = batch(step, rank, world, &dev);
                    micro_loss(&f.forward(&x).unwrap(), &y, world)
                        .backward()
                        .unwrap();
                    o.step(f).unwrap();
                    o.zero_grad(f);
                }
            }
            assert_eq!(oa.step_counts(), ob.step_counts());
            (full(&a), full(&b))
        });
        for (a, b) in ranks {
            assert_eq!(first_difference(&a, &b), None, "{kind:?}");
        }
    }
}

#[test]
fn local_state_round_trip_resumes_bitwise() {
    let dev = Device::cpu(1002);
    let run = |reload: bool| {
        let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
        let params = named_parameters(&model);
        let ps: Vec<Parameter> = params.iter().map(|(_, p)| p.clone()).collect();
        let mut opt = LocalAdamW::new(ps.clone(), adam());
        for step in 0..STEPS {
            if reload && step == STEPS - 1 {
                let (state, steps) = (copy_state(&opt.state(), &dev), opt.step_counts());
                opt = LocalAdamW::new(ps.clone(), adam());
                opt.load_state(state, steps).unwrap();
            }
            accumulate_local(&model, &params, 2, 2, step, &dev);
            opt.step().unwrap();
            opt.zero_grad();
        }
        params
            .iter()
            .map(|(n, p)| (n.clone(), p.get().unwrap().to_vec::<f32>().unwrap()))
            .collect::<Named>()
    };
    assert_eq!(first_difference(&run(false), &run(true)), None);
}

#[test]
fn bad_state_and_foreign_models_are_refused() {
    run_ranks(2, |rank, pg| {
        let dev = Device::cpu(rank);
        let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
        let fsdp = Fsdp::wrap(model, &dev, pg.clone(), full_shard()).unwrap();
        let n = fsdp.num_units();
        let mut opt = AdamW::new(0.01);
        let t = |k: usize| Some(Tensor::zeros(&[k], DType::F32, &dev).unwrap());
        let chunk0 = fsdp.units()[0].shard_numel;
        let good = |first: Option<Tensor>| -> OptimizerState {
            let mut e = vec![None; n];
            e[0] = first;
            vec![("exp_avg".into(), e.clone()), ("exp_avg_sq".into(), e)]
        };
        // Accepted: the right slots, sizes and counts.
        opt.load_state(&fsdp, good(t(chunk0)), vec![1; n]).unwrap();
        // Wrong size, wrong slot name, missing slot, wrong counts, wrong dtype.
        let err = opt
            .load_state(&fsdp, good(t(chunk0 + 1)), vec![1; n])
            .unwrap_err()
            .to_string();
        assert!(err.contains("elements"), "{err}");
        let mut renamed = good(t(chunk0));
        renamed[1].0 = "momentum_buffer".into();
        let err = opt.load_state(&fsdp, renamed, vec![1; n]).unwrap_err();
        assert!(err.to_string().contains("slots"), "{err}");
        let mut missing = good(None);
        missing.pop();
        assert!(opt.load_state(&fsdp, missing, vec![1; n]).is_err());
        assert!(opt.load_state(&fsdp, good(None), vec![1; n + 1]).is_err());
        let ints = Some(Tensor::from_vec(vec![0i64; chunk0], &[chunk0], &dev).unwrap());
        assert!(opt.load_state(&fsdp, good(ints), vec![1; n]).is_err());
        // An optimizer that stepped one model refuses a model with another unit count.
        let other = Fsdp::wrap(
            Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap(),
            &dev,
            pg,
            FsdpConfig::default(), // root only: one unit
        )
        .unwrap();
        let mut sgd = Sgd::new(0.1).with_momentum(0.9);
        let (x, y) = batch(0, rank, 2, &dev);
        micro_loss(&fsdp.forward(&x).unwrap(), &y, 2)
            .backward()
            .unwrap();
        sgd.step(&fsdp).unwrap();
        let err = sgd.step(&other).unwrap_err().to_string();
        assert!(err.contains("units"), "{err}");
        // Non-finite hyper-parameters are refused before anything is launched.
        let mut nan = Sgd::new(f32::NAN);
        assert!(nan.step(&fsdp).is_err());
        fsdp.synchronize().unwrap();
        other.synchronize().unwrap();
    });
}

// ---------------------------------------------------------------- frozen and unused parameters

/// x[B,3] → a (3→5) → gelu → + frozen[5] → head (5→7); `unused[3]` takes no part. All in the
/// root unit (with trainable parameters), so the flat gradient holds zero pieces for both.
struct Mixed {
    a: Linear,
    head: Linear,
    frozen: Parameter,
    unused: Parameter,
    hooks: ModuleHooks,
}

impl Mixed {
    fn new(dev: &Device) -> Mixed {
        let ctx = InitContext::eager(dev, SEED);
        let vals: Vec<f32> = (0..5).map(|i| 0.1 * i as f32 - 0.2).collect();
        Mixed {
            a: Linear::new(&ctx.child("a"), 3, 5, true).unwrap(),
            head: Linear::new(&ctx.child("head"), 5, 7, true).unwrap(),
            frozen: Parameter::new(
                "frozen",
                Tensor::from_vec(vals, &[5], dev).unwrap(),
                false,
                vec![],
                SEED,
            )
            .unwrap(),
            unused: ctx
                .param("unused", &[3], DType::F32, vec![InitOp::Fill(2.0)])
                .unwrap(),
            hooks: ModuleHooks::new(),
        }
    }
}

impl Module for Mixed {
    fn forward(&self, x: &Tensor) -> fsdp_autograd::Result<Tensor> {
        let h = self.a.call(x)?.gelu()?.add(&self.frozen.get()?)?;
        self.head.call(&h)
    }
    fn visit_params(&self, f: &mut dyn FnMut(&str, &Parameter)) {
        f("frozen", &self.frozen);
        f("unused", &self.unused);
    }
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(&str, &'a dyn Module)) {
        f("a", &self.a);
        f("head", &self.head);
    }
    fn type_name(&self) -> &'static str {
        "Mixed"
    }
    fn hooks(&self) -> &ModuleHooks {
        &self.hooks
    }
}

fn mixed_batch(step: usize, rank: usize, world: usize, dev: &Device) -> (Tensor, Tensor) {
    let k = step * world + rank;
    let x: Vec<f32> = (0..4 * 3)
        .map(|i| (((k * 31 + i * 7) % 11) as f32 - 5.0) * 0.2)
        .collect();
    let y: Vec<i64> = (0..4).map(|b| ((k * 3 + b * 5) % 7) as i64).collect();
    (
        Tensor::from_vec(x, &[4, 3], dev).unwrap(),
        Tensor::from_vec(y, &[4], dev).unwrap(),
    )
}

fn mixed_local(world: usize, hp: AdamParams) -> Named {
    let dev = Device::cpu(1003);
    let model = Mixed::new(&dev);
    let params = named_parameters(&model);
    let mut opt = LocalAdamW::new(params.iter().map(|(_, p)| p.clone()).collect(), hp);
    for step in 0..STEPS {
        for r in 0..world {
            let (x, y) = mixed_batch(step, r, world, &dev);
            micro_loss(&model.call(&x).unwrap(), &y, world)
                .backward()
                .unwrap();
        }
        opt.step().unwrap();
        opt.zero_grad();
    }
    params
        .iter()
        .map(|(n, p)| (n.clone(), p.get().unwrap().to_vec::<f32>().unwrap()))
        .collect()
}

fn mixed_sharded(world: usize, hp: AdamParams) -> Named {
    let ranks = run_ranks(world, move |rank, pg| {
        let dev = Device::cpu(rank);
        let fsdp = Fsdp::wrap(Mixed::new(&dev), &dev, pg, FsdpConfig::default()).unwrap();
        assert_eq!(fsdp.num_units(), 1);
        let mut opt = AdamW::with_params(hp);
        for step in 0..STEPS {
            let (x, y) = mixed_batch(step, rank, world, &dev);
            micro_loss(&fsdp.forward(&x).unwrap(), &y, world)
                .backward()
                .unwrap();
            opt.step(&fsdp).unwrap();
            opt.zero_grad(&fsdp);
        }
        full_named(&fsdp)
    });
    ranks.into_iter().next().unwrap()
}

fn get(v: &Named, name: &str) -> Vec<f32> {
    v.iter().find(|(n, _)| n == name).unwrap().1.clone()
}

#[test]
fn frozen_parameters_in_a_trainable_unit_stay_put_and_match_local() {
    // Without weight decay an unused parameter's zero gradient piece leaves it alone too, so
    // FSDP equals local bitwise.
    let hp = AdamParams {
        weight_decay: 0.0,
        ..adam()
    };
    for world in [2, 3] {
        let (l, f) = (
            sorted(mixed_local(world, hp)),
            sorted(mixed_sharded(world, hp)),
        );
        assert_eq!(first_difference(&l, &f), None, "W={world}");
    }
    // With weight decay the frozen parameter still stays (only trainable pieces are updated)...
    let hp = adam();
    let dev = Device::cpu(1004);
    let init = Mixed::new(&dev);
    let f = mixed_sharded(3, hp);
    assert_eq!(
        get(&f, "frozen"),
        init.frozen.get().unwrap().to_vec::<f32>().unwrap()
    );
    assert_ne!(
        get(&f, "a.weight"),
        init.a.weight.get().unwrap().to_vec::<f32>().unwrap()
    );
    // ...but the unused parameter decays under FSDP (a zero gradient piece, not no gradient),
    // while the local optimizer skips it: the documented limitation.
    let l = mixed_local(3, hp);
    assert_eq!(get(&l, "unused"), vec![2.0; 3]);
    let decayed = get(&f, "unused");
    assert!(decayed.iter().all(|&x| x < 2.0), "{decayed:?}");
    // Everything else still matches local bitwise.
    let others =
        |v: Named| -> Named { sorted(v.into_iter().filter(|(n, _)| n != "unused").collect()) };
    assert_eq!(first_difference(&others(l), &others(f)), None);
}
