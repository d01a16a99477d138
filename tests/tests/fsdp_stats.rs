//! FSDP's statistics count what is really there, whatever the mixed-precision setting:
//! - `CommStats` counts every collective's bytes in the dtype it communicates (regression: the
//!   reduce-scatter and all-reduce bytes were counted at 4 bytes per element under bf16/f16);
//! - `Fsdp::param_bytes` counts parameters in f32, so the parameter count and any prediction
//!   made from it do not change with mixed precision (regression: it returned bytes in the
//!   param dtype, halving the reported parameter count under bf16).

use std::sync::Arc;

use fsdp_alloc::{DType, Device};
use fsdp_autograd::nn::{named_parameters, Gpt, GptConfig};
use fsdp_autograd::InitContext;
use fsdp_collectives::DeviceMesh;
use fsdp_core::{
    Comm, CommStats, Fsdp, FsdpConfig, MixedPrecision, ParamBytes, ShardingStrategy, UnitInfo,
    WrapPolicy,
};
use fsdp_tests::{micro_loss, run_ranks, token_tensors};

const SEED: u64 = 77;
const STEPS: usize = 2;
const WORLD: usize = 4;

fn cfg() -> GptConfig {
    // d_model 18 and vocab 19 make the units' sizes indivisible by the world: padding exists.
    GptConfig::new(19, 18, 2, 2, 6)
}

/// What one rank saw: its communication statistics after `STEPS` steps, the parameter sizes,
/// and the units.
#[derive(Debug, Clone)]
struct Seen {
    stats: CommStats,
    params: ParamBytes,
    units: Vec<UnitInfo>,
}

/// Trains `STEPS` steps on `WORLD` ranks (`HybridShard` over shard groups of 2) and returns
/// rank 0's view.
fn train(strategy: ShardingStrategy, mp: Option<MixedPrecision>) -> Seen {
    let out = run_ranks(WORLD, move |rank, pg| {
        let dev = Device::cpu(rank);
        let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
        let comm: Comm = match strategy {
            ShardingStrategy::HybridShard => DeviceMesh::new(Arc::clone(&pg), 2).unwrap().into(),
            _ => pg.into(),
        };
        let config = FsdpConfig {
            strategy,
            wrap_policy: WrapPolicy::ModuleTypes(vec!["Block".into()]),
            mixed_precision: mp,
            ..FsdpConfig::default()
        };
        let fsdp = Fsdp::wrap(model, &dev, comm, config).unwrap();
        let c = cfg();
        for step in 0..STEPS {
            let (x, y) = token_tensors(step * WORLD + rank, 2, c.seq_len, c.vocab, &dev);
            micro_loss(&fsdp.forward(&x).unwrap(), &y, WORLD)
                .backward()
                .unwrap();
            fsdp.sgd_step(0.01).unwrap();
            fsdp.zero_grad();
        }
        fsdp.synchronize().unwrap();
        Seen {
            stats: fsdp.comm_stats(),
            params: fsdp.param_bytes(),
            units: fsdp.units(),
        }
    });
    out.into_iter().next().unwrap()
}

/// Elements of the model's parameters, counted on an unwrapped copy.
fn model_numel() -> usize {
    let dev = Device::cpu(900);
    let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
    named_parameters(&model)
        .iter()
        .map(|(_, p)| p.get().unwrap().numel())
        .sum()
}

fn reduce_in(d: DType) -> MixedPrecision {
    MixedPrecision {
        param_dtype: DType::F32,
        reduce_dtype: d,
    }
}

#[test]
fn reduction_bytes_are_counted_in_the_reduce_dtype() {
    for strategy in [
        ShardingStrategy::FullShard,
        ShardingStrategy::ShardGradOp,
        ShardingStrategy::HybridShard,
        ShardingStrategy::NoShard,
    ] {
        let f32_run = train(strategy, None);
        // The sharding factor: the shard group's size.
        let factor = match strategy {
            ShardingStrategy::FullShard | ShardingStrategy::ShardGradOp => WORLD,
            ShardingStrategy::HybridShard => 2,
            ShardingStrategy::NoShard => 1,
        };
        let padded: usize = f32_run.units.iter().map(|u| u.shard_numel * factor).sum();
        let shards: usize = f32_run.units.iter().map(|u| u.shard_numel).sum();
        for (dtype, size) in [(DType::F32, 4), (DType::BF16, 2), (DType::F16, 2)] {
            let s = train(strategy, Some(reduce_in(dtype))).stats;
            // Exact figures: every step reduces every unit's padded flat gradient once.
            let (rs, ar) = match strategy {
                ShardingStrategy::NoShard => (0, STEPS * padded * size),
                ShardingStrategy::HybridShard => (STEPS * padded * size, STEPS * shards * size),
                _ => (STEPS * padded * size, 0),
            };
            assert_eq!(
                (s.reduce_scatter_bytes, s.all_reduce_bytes),
                (rs as u64, ar as u64),
                "{strategy:?}, reduce dtype {dtype}: (reduce-scatter, all-reduce) bytes"
            );
            // The law: low-precision reductions move half the f32 bytes.
            assert_eq!(
                s.reduce_scatter_bytes * 4,
                f32_run.stats.reduce_scatter_bytes * size as u64,
                "{strategy:?} {dtype}"
            );
            assert_eq!(
                s.all_reduce_bytes * 4,
                f32_run.stats.all_reduce_bytes * size as u64,
                "{strategy:?} {dtype}"
            );
            // Parameters stay f32: the all-gathers are unchanged.
            assert_eq!(
                (s.all_gather_bytes, s.num_all_gathers),
                (
                    f32_run.stats.all_gather_bytes,
                    f32_run.stats.num_all_gathers
                ),
                "{strategy:?} {dtype}"
            );
        }
    }
}

#[test]
fn low_precision_parameters_halve_the_gather_and_reduce_bytes() {
    let f32_run = train(ShardingStrategy::FullShard, None);
    let bf16_run = train(
        ShardingStrategy::FullShard,
        Some(MixedPrecision::uniform(DType::BF16)),
    );
    let (a, b) = (f32_run.stats, bf16_run.stats);
    assert!(
        a.reduce_scatter_bytes > 0 && a.all_gather_bytes > 0,
        "{a:?}"
    );
    assert_eq!(b.num_all_gathers, a.num_all_gathers);
    assert_eq!(b.all_gather_bytes * 2, a.all_gather_bytes, "{a:?} vs {b:?}");
    assert_eq!(
        b.reduce_scatter_bytes * 2,
        a.reduce_scatter_bytes,
        "{a:?} vs {b:?}"
    );
}

#[test]
fn parameter_sizes_do_not_depend_on_mixed_precision() {
    let numel = model_numel();
    for strategy in [ShardingStrategy::FullShard, ShardingStrategy::NoShard] {
        let f32_run = train(strategy, None);
        let factor = if strategy == ShardingStrategy::NoShard {
            1
        } else {
            WORLD
        };
        let padded: Vec<usize> = f32_run
            .units
            .iter()
            .map(|u| u.shard_numel * factor)
            .collect();
        let expect = ParamBytes {
            max_unit: 4 * padded.iter().copied().max().unwrap(),
            total: 4 * padded.iter().sum::<usize>(),
        };
        assert_eq!(f32_run.params, expect, "{strategy:?}");
        // The unpadded sizes add up to the model; padding is less than one element per rank
        // and unit.
        let real: usize = f32_run.units.iter().map(|u| u.total_numel).sum();
        assert_eq!(real, numel);
        let total = f32_run.params.total_numel();
        assert!(
            total >= numel && total < numel + factor * f32_run.units.len(),
            "{strategy:?}: {total} vs {numel}"
        );
        let low: &[MixedPrecision] = if strategy == ShardingStrategy::NoShard {
            // NoShard keeps f32 parameters; only the reduce dtype can change.
            &[reduce_in(DType::BF16), reduce_in(DType::F16)]
        } else {
            &[
                MixedPrecision::uniform(DType::BF16),
                MixedPrecision::uniform(DType::F16),
                reduce_in(DType::BF16),
            ]
        };
        for &mp in low {
            let run = train(strategy, Some(mp));
            assert_eq!(run.params, f32_run.params, "{strategy:?} {mp:?}");
            assert_eq!(run.units, f32_run.units, "{strategy:?} {mp:?}");
        }
    }
}
