//! The sharded grad scaler: every rank takes the same skip/scale decisions, including when an
//! inf/NaN is visible on one rank's shard only, and FSDP + sharded scaler + sharded AdamW equals
//! local training with the local scaler and local AdamW bitwise (same skip sequence, same scale
//! sequence, same parameters).

use std::sync::Arc;

use fsdp_alloc::Device;
use fsdp_autograd::nn::{named_parameters, Gpt, GptConfig, Module};
use fsdp_autograd::{no_grad, with_stream, InitContext, Parameter, Tensor};
use fsdp_collectives::{DeviceMesh, ProcessGroup};
use fsdp_core::optim::{
    AdamParams, AdamW, LocalAdamW, LocalOptimizer, ShardedOptimizer, ShardedParams,
};
use fsdp_core::scaler::{GradScalerConfig, LocalGradScaler, ShardedGradScaler};
use fsdp_core::{Comm, Fsdp, FsdpConfig, ShardingStrategy, WrapPolicy};
use fsdp_tests::{first_difference, full_named, micro_loss, run_ranks, token_tensors};
use fsdp_tests::{sorted_by_name as sorted, Named};

const SEED: u64 = 2024;
const BATCH: usize = 2;

fn cfg() -> GptConfig {
    GptConfig::new(19, 12, 2, 2, 6)
}

fn batch(step: usize, rank: usize, world: usize, dev: &Device) -> (Tensor, Tensor) {
    let c = cfg();
    token_tensors(step * world + rank, BATCH, c.seq_len, c.vocab, dev)
}

fn adam() -> AdamParams {
    AdamParams {
        lr: 0.01,
        betas: (0.9, 0.99),
        eps: 1e-8,
        weight_decay: 0.01,
    }
}

fn comm(pg: Arc<dyn ProcessGroup>, shard: Option<usize>) -> Comm {
    match shard {
        Some(f) => DeviceMesh::new(pg, f).unwrap().into(),
        None => pg.into(),
    }
}

/// An inf planted after backward: at `step`, on `rank`'s copy of unit `unit`'s gradient, at the
/// first element of that rank's first trainable piece.
#[derive(Debug, Clone, Copy)]
struct Plant {
    step: usize,
    rank: usize,
    unit: usize,
}

/// What each rank saw per step: (found inf, stepped, scale after update).
type Trace = Vec<(bool, bool, f32)>;

#[derive(Debug, Clone)]
struct Run {
    world: usize,
    shard: Option<usize>,
    config: FsdpConfig,
    scaler: GradScalerConfig,
    steps: usize,
    plant: Option<Plant>,
    /// (step, rank, factor): that micro-batch's loss is multiplied by `factor` (a batch with a
    /// huge sample weight), so its backward overflows for real.
    heavy: Option<(usize, usize, f32)>,
}

/// The micro-batch loss, with the heavy weight where `run` asks for it.
fn weighted(run: &Run, loss: Tensor, step: usize, rank: usize) -> Tensor {
    match run.heavy {
        Some((s, r, k)) if s == step && r == rank => loss.scale(k).unwrap(),
        _ => loss,
    }
}

/// FSDP run: per rank the trace; rank 0's parameters; the planted element as (parameter name,
/// offset in the parameter) if one was planted.
fn sharded(run: Run) -> (Vec<Trace>, Named, Option<(String, usize)>) {
    let world = run.world;
    let per_rank = run_ranks(world, move |rank, pg| {
        let dev = Device::cpu(rank);
        let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
        let fsdp = Fsdp::wrap(model, &dev, comm(pg, run.shard), run.config.clone()).unwrap();
        let mut opt = AdamW::with_params(adam());
        let mut scaler = ShardedGradScaler::new(run.scaler).unwrap();
        let mut trace = Vec::new();
        let mut planted = None;
        for step in 0..run.steps {
            let (x, y) = batch(step, rank, world, &dev);
            let loss = micro_loss(&fsdp.forward(&x).unwrap(), &y, world);
            let loss = weighted(&run, loss, step, rank);
            scaler.scale(&loss).unwrap().backward().unwrap();
            if let Some(p) = run.plant.filter(|p| p.step == step && p.rank == rank) {
                let s = &fsdp.shards()[p.unit];
                let piece = s
                    .layout
                    .rank_pieces(s.rank)
                    .unwrap()
                    .into_iter()
                    .find(|q| s.requires_grad[q.param_index])
                    .expect("a trainable piece on the planting rank");
                let mut v = vec![0f32; s.shard.numel()];
                v[piece.offset_in_shard] = f32::INFINITY;
                let g = s.grad.clone().expect("a gradient");
                with_stream(fsdp.optimizer_stream(), || {
                    let t = Tensor::from_vec(v, &[s.shard.numel()], &dev).unwrap();
                    no_grad(|| g.add_(&t)).unwrap();
                });
                planted = Some((s.names[piece.param_index].clone(), piece.offset_in_param));
            }
            let found = scaler.unscale(&fsdp).unwrap();
            let stepped = scaler.step(&fsdp, &mut opt).unwrap();
            let scale = scaler.update().unwrap();
            opt.zero_grad(&fsdp);
            trace.push((found, stepped, scale));
        }
        let params: Named = full_named(&fsdp);
        (trace, params, planted)
    });
    let planted = per_rank.iter().find_map(|(_, _, p)| p.clone());
    let traces = per_rank.iter().map(|(t, _, _)| t.clone()).collect();
    let params = per_rank.into_iter().next().unwrap().1;
    (traces, params, planted)
}

/// The local reference: grouped W-way accumulation of the scaled losses, the same planted inf,
/// the local scaler and local AdamW.
fn local(run: &Run, planted: Option<&(String, usize)>) -> (Trace, Named) {
    let world = run.world;
    let group = run.shard.unwrap_or(world);
    let dev = Device::cpu(1000);
    let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
    let params = named_parameters(&model);
    let plain: Vec<Parameter> = params.iter().map(|(_, p)| p.clone()).collect();
    let mut opt = LocalAdamW::new(plain, adam());
    let mut scaler = LocalGradScaler::new(run.scaler).unwrap();
    let mut trace = Vec::new();
    for step in 0..run.steps {
        let mut total: Vec<Option<Tensor>> = vec![None; params.len()];
        for g in 0..world / group {
            for r in g * group..(g + 1) * group {
                let (x, y) = batch(step, r, world, &dev);
                let loss = micro_loss(&model.call(&x).unwrap(), &y, world);
                let loss = weighted(run, loss, step, r);
                scaler.scale(&loss).unwrap().backward().unwrap();
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
        for ((name, p), acc) in params.iter().zip(total) {
            let t = p.get().unwrap();
            if let (Some(plant), Some((pname, off))) = (run.plant, planted) {
                if plant.step == step && pname == name {
                    let mut v = vec![0f32; t.numel()];
                    v[*off] = f32::INFINITY;
                    let inf = Tensor::from_vec(v, t.shape(), &dev).unwrap();
                    no_grad(|| acc.as_ref().unwrap().add_(&inf)).unwrap();
                }
            }
            t.set_grad(acc).unwrap();
        }
        let found = scaler.unscale(opt.params()).unwrap();
        let stepped = scaler.step(&mut opt).unwrap();
        let scale = scaler.update().unwrap();
        opt.zero_grad();
        trace.push((found, stepped, scale));
    }
    let finals = params
        .iter()
        .map(|(n, p)| (n.clone(), p.get().unwrap().to_vec::<f32>().unwrap()))
        .collect();
    (trace, finals)
}

/// Runs FSDP and local, checks agreement; returns the trace.
fn check(run: Run) -> Trace {
    let what = format!(
        "W={}, shard {:?}, {:?}, plant {:?}",
        run.world, run.shard, run.config.strategy, run.plant
    );
    let (traces, fp, planted) = sharded(run.clone());
    for (r, t) in traces.iter().enumerate() {
        assert_eq!(
            t, &traces[0],
            "{what}: rank {r} decided differently from rank 0"
        );
    }
    if run.plant.is_some() {
        assert!(planted.is_some(), "{what}: nothing was planted");
    }
    let (lt, lp) = local(&run, planted.as_ref());
    assert_eq!(traces[0], lt, "{what}: FSDP vs local skip/scale sequence");
    if let Some(d) = first_difference(&sorted(lp), &sorted(fp)) {
        panic!("{what}: parameters differ: {d}");
    }
    traces[0].clone()
}

fn blocks() -> FsdpConfig {
    FsdpConfig {
        wrap_policy: WrapPolicy::ModuleTypes(vec!["Block".into()]),
        ..FsdpConfig::default()
    }
}

fn small_scale() -> GradScalerConfig {
    GradScalerConfig {
        init_scale: 1024.0,
        growth_factor: 2.0,
        backoff_factor: 0.5,
        growth_interval: 2,
    }
}

#[test]
fn an_inf_on_one_ranks_shard_makes_every_rank_skip_like_local() {
    for world in [1, 2, 3, 4] {
        let trace = check(Run {
            world,
            shard: None,
            config: blocks(),
            scaler: small_scale(),
            steps: 5,
            // Planted on the last rank only: the others see finite shards.
            plant: Some(Plant {
                step: 2,
                rank: world - 1,
                unit: 1,
            }),
            heavy: None,
        });
        let skipped: Vec<bool> = trace.iter().map(|t| !t.1).collect();
        assert_eq!(skipped, [false, false, true, false, false], "W={world}");
        // 1024 → grows after 2 good steps → backs off → grows again after 2 more.
        let scales: Vec<f32> = trace.iter().map(|t| t.2).collect();
        assert_eq!(
            scales,
            [1024.0, 2048.0, 1024.0, 1024.0, 2048.0],
            "W={world}"
        );
    }
}

#[test]
fn every_strategy_agrees_on_a_single_rank_inf() {
    // NoShard: every rank holds the full gradient; an inf on one rank's copy must still stop
    // everyone. HybridShard: planted on a rank of the second replica group, so only the
    // replicate-group reduction can carry it to the first.
    let cases = [
        (3, None, ShardingStrategy::ShardGradOp, 1),
        (2, None, ShardingStrategy::NoShard, 1),
        (4, Some(2), ShardingStrategy::HybridShard, 3),
        (4, Some(2), ShardingStrategy::HybridShard, 2),
    ];
    for (world, shard, strategy, rank) in cases {
        let trace = check(Run {
            world,
            shard,
            config: FsdpConfig {
                strategy,
                ..blocks()
            },
            scaler: small_scale(),
            steps: 3,
            plant: Some(Plant {
                step: 1,
                rank,
                unit: 0,
            }),
            heavy: None,
        });
        let found: Vec<bool> = trace.iter().map(|t| t.0).collect();
        assert_eq!(
            found,
            [false, true, false],
            "{strategy:?} W={world} rank {rank}"
        );
    }
}

#[test]
fn a_real_overflow_in_one_ranks_backward_backs_off_identically_to_local() {
    // Even the largest finite scale (f32::MAX) does not overflow this model's gradients (they
    // are all below 1), so the overflow comes from the data: one micro-batch of rank 1 carries
    // a sample weight of 2¹²⁰, and with the default scale 2¹⁶ its backward overflows to inf/NaN
    // through autograd — nothing is planted. Every rank and the local reference skip that step
    // and back off.
    for (world, shard, strategy) in [
        (3, None, ShardingStrategy::FullShard),
        (4, Some(2), ShardingStrategy::HybridShard),
    ] {
        let trace = check(Run {
            world,
            shard,
            config: FsdpConfig {
                strategy,
                ..blocks()
            },
            scaler: GradScalerConfig {
                growth_interval: 2,
                ..GradScalerConfig::default()
            },
            steps: 4,
            plant: None,
            heavy: Some((1, 1, 2f32.powi(120))),
        });
        let stepped: Vec<bool> = trace.iter().map(|t| t.1).collect();
        assert_eq!(
            stepped,
            [true, false, true, true],
            "{strategy:?}: {trace:?}"
        );
        let scales: Vec<f32> = trace.iter().map(|t| t.2).collect();
        assert_eq!(scales, [65536.0, 32768.0, 32768.0, 65536.0], "{strategy:?}");
    }
}

#[test]
fn the_largest_finite_scale_alone_does_not_overflow_here() {
    // The premise of the test above, checked: at f32::MAX no step is skipped (and FSDP still
    // equals local bitwise, with gradients near the top of f32's range).
    let trace = check(Run {
        world: 2,
        shard: None,
        config: blocks(),
        scaler: GradScalerConfig {
            init_scale: f32::MAX,
            ..small_scale()
        },
        steps: 2,
        plant: None,
        heavy: None,
    });
    assert!(trace.iter().all(|t| t.1), "{trace:?}");
}

#[test]
fn the_scaler_enforces_its_iteration_protocol() {
    run_ranks(2, |rank, pg| {
        let dev = Device::cpu(rank);
        let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
        let fsdp = Fsdp::wrap(model, &dev, pg, blocks()).unwrap();
        let mut opt = AdamW::with_params(adam());
        let mut scaler = ShardedGradScaler::new(small_scale()).unwrap();
        assert!(scaler.update().is_err(), "update before any check");
        let (x, y) = batch(0, rank, 2, &dev);
        let loss = micro_loss(&fsdp.forward(&x).unwrap(), &y, 2);
        let scaled = scaler.scale(&loss).unwrap();
        assert_eq!(scaled.item().unwrap(), loss.item().unwrap() * 1024.0);
        scaled.backward().unwrap();
        // Unscaling multiplies by exactly 1/1024 (a power of two: exact).
        fsdp.synchronize().unwrap();
        let before: Vec<Vec<f32>> = ShardedParams::shards(&fsdp)
            .iter()
            .map(|s| s.grad.as_ref().unwrap().to_vec::<f32>().unwrap())
            .collect();
        assert!(!scaler.unscale(&fsdp).unwrap());
        assert_eq!(scaler.found_inf(), Some(false));
        let after: Vec<Vec<f32>> = fsdp
            .shards()
            .iter()
            .map(|s| s.grad.as_ref().unwrap().to_vec::<f32>().unwrap())
            .collect();
        for (b, a) in before.iter().zip(&after) {
            for (x, y) in b.iter().zip(a) {
                assert_eq!(x / 1024.0, *y);
            }
        }
        assert!(scaler.unscale(&fsdp).is_err(), "second unscale");
        assert!(scaler.step(&fsdp, &mut opt).unwrap());
        assert!(scaler.step(&fsdp, &mut opt).is_err(), "second step");
        assert_eq!(scaler.update().unwrap(), 1024.0);
        assert_eq!(scaler.growth_tracker(), 1);
        assert_eq!(scaler.found_inf(), None);
        assert!(scaler.load_state(0.0, 0).is_err());
        scaler.load_state(8.0, 1).unwrap();
        assert_eq!(scaler.get_scale(), 8.0);
        assert!(ShardedGradScaler::new(GradScalerConfig {
            backoff_factor: 2.0,
            ..small_scale()
        })
        .is_err());
        fsdp.synchronize().unwrap();
    });
}
