//! Gradient norms and clipping across shards, and a LAMB-style trust-ratio optimizer built on
//! exact per-parameter norms, against local references.
//!
//! **Tolerances.** FSDP's gradients equal the local accumulated gradients bitwise (see
//! `fsdp_parity.rs`), so norms differ only in how the squares are summed: each rank sums its
//! pieces in f64, rounds once to f32, and the shard group adds the W partial sums in f32; the
//! local reference sums each whole parameter in f64. That is at most W + 1 roundings of relative
//! size 2⁻²⁴ on the squared norm: ≤ 3·10⁻⁷ for W = 4, half of it on the norm. Norms are
//! therefore compared with a relative tolerance of 1e-6. Clipping and LAMB multiply gradients
//! or updates by factors derived from those norms, so parameters after a few steps differ by the
//! same relative amount times the update size; they are compared with a tolerance that is both
//! checked and shown to be far below the size of the updates.

use std::sync::Arc;

use fsdp_alloc::Device;
use fsdp_autograd::nn::{named_parameters, Gpt, GptConfig, Module};
use fsdp_autograd::{no_grad, InitContext, Parameter, Tensor};
use fsdp_collectives::{DeviceMesh, ProcessGroup};
use fsdp_core::clip::{
    clip_grad_norm, clip_grad_norm_local, grad_norm, grad_norms_per_param,
    grad_norms_per_param_local, param_norms_per_param, param_norms_per_param_local,
};
use fsdp_core::optim::{
    AdamParams, Lamb, LocalLamb, LocalOptimizer, LocalSgd, Sgd, ShardedOptimizer,
};
use fsdp_core::{Comm, Fsdp, FsdpConfig, ShardingStrategy, WrapPolicy};
use fsdp_tests::{full_named, micro_loss, run_ranks, token_tensors};
use fsdp_tests::{sorted_by_name as sorted, Named};

const SEED: u64 = 99;
const BATCH: usize = 2;
const STEPS: usize = 3;
/// Relative tolerance for norms (see the module docs).
const NORM_RTOL: f64 = 1e-6;

type Norms = Vec<(String, f64)>;

fn cfg() -> GptConfig {
    GptConfig::new(19, 12, 2, 2, 6)
}

fn batch(step: usize, rank: usize, world: usize, dev: &Device) -> (Tensor, Tensor) {
    let c = cfg();
    token_tensors(step * world + rank, BATCH, c.seq_len, c.vocab, dev)
}

fn full_shard() -> FsdpConfig {
    FsdpConfig {
        wrap_policy: WrapPolicy::ModuleTypes(vec!["Block".into()]),
        ..FsdpConfig::default()
    }
}

fn comm(pg: Arc<dyn ProcessGroup>, shard: Option<usize>) -> Comm {
    match shard {
        Some(f) => DeviceMesh::new(pg, f).unwrap().into(),
        None => pg.into(),
    }
}

/// Local W-way accumulation in groups (as in `fsdp_optim.rs`): leaves the total in `.grad`.
fn accumulate_local(
    model: &Gpt,
    params: &[(String, Parameter)],
    world: usize,
    group: usize,
    step: usize,
    dev: &Device,
) {
    let mut total: Vec<Option<Tensor>> = vec![None; params.len()];
    for g in 0..world / group {
        for r in g * group..(g + 1) * group {
            let (x, y) = batch(step, r, world, dev);
            micro_loss(&model.call(&x).unwrap(), &y, world)
                .backward()
                .unwrap();
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
}

fn plain(params: &[(String, Parameter)]) -> Vec<Parameter> {
    params.iter().map(|(_, p)| p.clone()).collect()
}

fn values(params: &[(String, Parameter)]) -> Named {
    let mut v: Named = params
        .iter()
        .map(|(n, p)| (n.clone(), p.get().unwrap().to_vec::<f32>().unwrap()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn full(fsdp: &Fsdp<Gpt>) -> Named {
    let mut v: Named = full_named(fsdp);
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn assert_norms_close(what: &str, got: &Norms, want: &Norms) {
    let (got, want) = (sorted(got.clone()), sorted(want.clone()));
    assert_eq!(got.len(), want.len(), "{what}: parameter counts");
    for ((ng, g), (nw, w)) in got.iter().zip(&want) {
        assert_eq!(ng, nw, "{what}: names");
        let tol = NORM_RTOL * w.abs().max(1e-30);
        assert!((g - w).abs() <= tol, "{what}: {ng}: {g} vs local {w}");
    }
}

/// Largest |a − b| over all elements, and largest |b − init| (how far training moved).
fn distances(a: &Named, b: &Named, init: &Named) -> (f32, f32) {
    let mut diff = 0f32;
    let mut moved = 0f32;
    for (((na, va), (nb, vb)), (ni, vi)) in a.iter().zip(b).zip(init) {
        assert_eq!((na, nb), (nb, ni));
        for ((x, y), z) in va.iter().zip(vb).zip(vi) {
            diff = diff.max((x - y).abs());
            moved = moved.max((y - z).abs());
        }
    }
    (diff, moved)
}

// ---------------------------------------------------------------- norms

/// FSDP after one backward: (per-parameter grad norms, weight norms, global norm), per rank.
fn sharded_norms(
    world: usize,
    shard: Option<usize>,
    config: FsdpConfig,
) -> Vec<(Norms, Norms, f64, usize)> {
    run_ranks(world, move |rank, pg| {
        let dev = Device::cpu(rank);
        let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
        let fsdp = Fsdp::wrap(model, &dev, comm(pg, shard), config.clone()).unwrap();
        let weights = param_norms_per_param(&fsdp).unwrap();
        let (x, y) = batch(0, rank, world, &dev);
        micro_loss(&fsdp.forward(&x).unwrap(), &y, world)
            .backward()
            .unwrap();
        let grads = grad_norms_per_param(&fsdp).unwrap();
        let total = grad_norm(&fsdp).unwrap();
        // How many parameters are split over more than one rank (the interesting case).
        let split: usize = fsdp
            .shards()
            .iter()
            .map(|s| {
                (0..s.layout.num_params())
                    .filter(|&i| s.layout.param_ranks(i).unwrap().len() > 1)
                    .count()
            })
            .sum();
        (grads, weights, total, split)
    })
}

fn local_norms(world: usize, group: usize) -> (Norms, Norms) {
    let dev = Device::cpu(1000);
    let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
    let params = named_parameters(&model);
    let weights = param_norms_per_param_local(&plain(&params)).unwrap();
    accumulate_local(&model, &params, world, group, 0, &dev);
    (
        grad_norms_per_param_local(&plain(&params)).unwrap(),
        weights,
    )
}

#[test]
fn per_parameter_grad_and_weight_norms_match_local_for_every_world_and_strategy() {
    let mut cases: Vec<(usize, Option<usize>, FsdpConfig)> =
        (1..=4).map(|w| (w, None, full_shard())).collect();
    cases.push((
        3,
        None,
        FsdpConfig {
            strategy: ShardingStrategy::ShardGradOp,
            ..full_shard()
        },
    ));
    // NoShard: every rank holds everything; summing across ranks would be wrong by √W.
    cases.push((
        2,
        None,
        FsdpConfig {
            strategy: ShardingStrategy::NoShard,
            ..full_shard()
        },
    ));
    // HybridShard: replicas hold identical gradients; only the shard group may be summed.
    cases.push((
        4,
        Some(2),
        FsdpConfig {
            strategy: ShardingStrategy::HybridShard,
            ..full_shard()
        },
    ));
    for (world, shard, config) in cases {
        let what = format!("W={world}, shard {shard:?}, {:?}", config.strategy);
        let (lg, lw) = local_norms(world, shard.unwrap_or(world));
        let ranks = sharded_norms(world, shard, config.clone());
        for (r, (g, w, total, split)) in ranks.iter().enumerate() {
            // Every rank gets bitwise the same answer.
            assert_eq!(g, &ranks[0].0, "{what}: rank {r} grad norms");
            assert_eq!(w, &ranks[0].1, "{what}: rank {r} weight norms");
            assert_eq!(
                total.to_bits(),
                ranks[0].2.to_bits(),
                "{what}: rank {r} total"
            );
            if config.strategy.is_sharded() && shard.unwrap_or(world) > 1 {
                assert!(*split > 0, "{what}: no parameter is split across ranks");
            }
        }
        let (g, w, total, _) = &ranks[0];
        assert_norms_close(&format!("{what} grad norms"), g, &lg);
        assert_norms_close(&format!("{what} weight norms"), w, &lw);
        let local_total = lg.iter().map(|(_, n)| n * n).sum::<f64>().sqrt();
        assert!(
            (total - local_total).abs() <= NORM_RTOL * local_total,
            "{what}: global norm {total} vs local {local_total}"
        );
        assert!(g.iter().all(|(_, n)| n.is_finite()) && *total > 0.0);
    }
}

// ---------------------------------------------------------------- clipping

#[test]
fn clip_grad_norm_scales_every_shard_like_local_and_leaves_small_norms_alone() {
    let world = 3;
    let max_norm = 0.05;
    let dev = Device::cpu(1001);
    let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
    let params = named_parameters(&model);
    accumulate_local(&model, &params, world, world, 0, &dev);
    let local_total = clip_grad_norm_local(&plain(&params), max_norm).unwrap();
    let local_after = grad_norms_per_param_local(&plain(&params)).unwrap();
    assert!(
        local_total > 10.0 * max_norm,
        "the test needs clipping to happen"
    );

    let ranks = run_ranks(world, move |rank, pg| {
        let dev = Device::cpu(rank);
        let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
        let fsdp = Fsdp::wrap(model, &dev, pg, full_shard()).unwrap();
        let (x, y) = batch(0, rank, world, &dev);
        micro_loss(&fsdp.forward(&x).unwrap(), &y, world)
            .backward()
            .unwrap();
        // A large max_norm changes nothing, bit for bit.
        let grads = |f: &Fsdp<Gpt>| -> Vec<Vec<f32>> {
            f.synchronize().unwrap();
            f.shards()
                .iter()
                .map(|s| s.grad.as_ref().unwrap().to_vec::<f32>().unwrap())
                .collect()
        };
        let before = grads(&fsdp);
        let total = clip_grad_norm(&fsdp, 1e6).unwrap();
        assert_eq!(grads(&fsdp), before);
        let again = clip_grad_norm(&fsdp, max_norm).unwrap();
        assert_eq!(total.to_bits(), again.to_bits());
        let after_total = grad_norm(&fsdp).unwrap();
        let after = grad_norms_per_param(&fsdp).unwrap();
        assert!(clip_grad_norm(&fsdp, -1.0).is_err());
        (total, after_total, after)
    });
    for (total, after_total, after) in ranks {
        assert!((total - local_total).abs() <= NORM_RTOL * local_total);
        // Clipped to max_norm (up to the 1e-6 in the coefficient and f32 rounding).
        assert!(
            (after_total - max_norm).abs() <= 1e-5 * max_norm,
            "{after_total} vs {max_norm}"
        );
        // The clipping coefficients differ by the norms' relative difference at most.
        let tol_after: Norms = after.clone();
        for ((n, a), (m, b)) in sorted(tol_after).iter().zip(&sorted(local_after.clone())) {
            assert_eq!(n, m);
            assert!(
                (a - b).abs() <= 3.0 * NORM_RTOL * b.max(1e-30),
                "{n}: {a} vs {b}"
            );
        }
    }
}

#[test]
fn training_with_clipping_tracks_local_training() {
    let world = 4;
    let max_norm = 0.05;
    let dev = Device::cpu(1002);
    let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
    let params = named_parameters(&model);
    let init = values(&params);
    let mut opt = LocalSgd::new(plain(&params), 0.5).with_momentum(0.9);
    for step in 0..STEPS {
        accumulate_local(&model, &params, world, world, step, &dev);
        clip_grad_norm_local(&plain(&params), max_norm).unwrap();
        opt.step().unwrap();
        opt.zero_grad();
    }
    let local = values(&params);
    let ranks = run_ranks(world, move |rank, pg| {
        let dev = Device::cpu(rank);
        let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
        let fsdp = Fsdp::wrap(model, &dev, pg, full_shard()).unwrap();
        let mut opt = Sgd::new(0.5).with_momentum(0.9);
        for step in 0..STEPS {
            let (x, y) = batch(step, rank, world, &dev);
            micro_loss(&fsdp.forward(&x).unwrap(), &y, world)
                .backward()
                .unwrap();
            clip_grad_norm(&fsdp, max_norm).unwrap();
            opt.step(&fsdp).unwrap();
            opt.zero_grad(&fsdp);
        }
        full(&fsdp)
    });
    for f in &ranks {
        assert_eq!(f, &ranks[0], "ranks disagree");
    }
    let (diff, moved) = distances(&ranks[0], &local, &init);
    // Updates are lr·coef·g with coef equal up to ~1e-7 relative: differences far below 1e-6.
    assert!(diff <= 1e-6, "max |fsdp − local| = {diff}");
    assert!(
        moved >= 1e-3,
        "training barely moved ({moved}); the comparison would be vacuous"
    );
}

// ---------------------------------------------------------------- LAMB

fn lamb() -> AdamParams {
    AdamParams {
        lr: 0.01,
        betas: (0.9, 0.999),
        eps: 1e-6,
        weight_decay: 0.01,
    }
}

#[test]
fn lamb_with_exact_per_parameter_trust_ratios_tracks_local_lamb() {
    for world in 1..=4 {
        let dev = Device::cpu(1003);
        let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
        let params = named_parameters(&model);
        let init = values(&params);
        let mut opt = LocalLamb::new(plain(&params), lamb());
        for step in 0..STEPS {
            accumulate_local(&model, &params, world, world, step, &dev);
            opt.step().unwrap();
            opt.zero_grad();
        }
        let local = values(&params);
        let ranks = run_ranks(world, move |rank, pg| {
            let dev = Device::cpu(rank);
            let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
            let fsdp = Fsdp::wrap(model, &dev, pg, full_shard()).unwrap();
            let mut opt = Lamb::new(lamb());
            for step in 0..STEPS {
                let (x, y) = batch(step, rank, world, &dev);
                micro_loss(&fsdp.forward(&x).unwrap(), &y, world)
                    .backward()
                    .unwrap();
                opt.step(&fsdp).unwrap();
                opt.zero_grad(&fsdp);
            }
            opt.synchronize().unwrap();
            full(&fsdp)
        });
        for f in &ranks {
            assert_eq!(f, &ranks[0], "W={world}: ranks disagree");
        }
        let (diff, moved) = distances(&ranks[0], &local, &init);
        // Each update is lr·ratio·u with ratios equal up to ~1e-7 relative and |u| ≲ 1 + λ|p|;
        // three steps: differences of order 1e-9, bounded here by 1e-6.
        assert!(diff <= 1e-6, "W={world}: max |fsdp − local| = {diff}");
        assert!(moved >= 1e-3, "W={world}: LAMB barely moved ({moved})");
    }
}

#[test]
fn lamb_ratios_use_whole_parameter_norms_not_shard_norms() {
    // With per-shard norms each rank would scale its piece of a split parameter by a different
    // ratio; the exact ratio is the same for the whole parameter. Check a split parameter's
    // update direction: after one step from zero state, Δp = −lr·ratio·u elementwise, so
    // Δp / u must be one constant across all pieces of the parameter.
    let world = 3;
    let ranks = run_ranks(world, move |rank, pg| {
        let dev = Device::cpu(rank);
        let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
        let fsdp = Fsdp::wrap(model, &dev, pg, full_shard()).unwrap();
        let before = full(&fsdp);
        let (x, y) = batch(0, rank, world, &dev);
        micro_loss(&fsdp.forward(&x).unwrap(), &y, world)
            .backward()
            .unwrap();
        let hp = AdamParams {
            weight_decay: 0.0,
            ..lamb()
        };
        let mut opt = Lamb::new(hp);
        opt.step(&fsdp).unwrap();
        opt.synchronize().unwrap();
        // Which parameters are split across ranks.
        let split: Vec<String> = fsdp
            .shards()
            .iter()
            .flat_map(|s| {
                (0..s.layout.num_params())
                    .filter(|&i| s.layout.param_ranks(i).unwrap().len() > 1)
                    .map(|i| s.names[i].clone())
                    .collect::<Vec<_>>()
            })
            .collect();
        (before, full(&fsdp), split)
    });
    let (before, after, split) = &ranks[0];
    assert!(!split.is_empty());
    // First step with zero state and no weight decay: u = g/(|g| + ε') ≈ sign(g), so Δp ≈
    // −lr·ratio·sign(g): |Δp| is (nearly) one constant over the whole parameter.
    let mut checked = 0;
    for name in split {
        let b = &before.iter().find(|(n, _)| n == name).unwrap().1;
        let a = &after.iter().find(|(n, _)| n == name).unwrap().1;
        let steps: Vec<f32> = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .filter(|d| *d > 0.0)
            .collect();
        if steps.len() < 2 {
            continue;
        }
        let (lo, hi) = steps
            .iter()
            .fold((f32::MAX, 0f32), |(lo, hi), &d| (lo.min(d), hi.max(d)));
        // u = g/(|g| + 1e-6) is 1 to within 1e-6/|g|; tiny gradients pull it lower, so compare
        // the bulk: the median step and the largest must agree to 1%.
        let mut s = steps.clone();
        s.sort_by(|x, y| x.partial_cmp(y).unwrap());
        let median = s[s.len() / 2];
        assert!(
            (hi - median) / hi < 0.01,
            "{name}: steps {lo}..{hi}, median {median}"
        );
        checked += 1;
    }
    assert!(checked > 0);
}
