//! FSDP's features on checked (race-detecting) devices: AdamW, gradient clipping, bf16 mixed
//! precision, gradient accumulation with `no_sync`, CPU offload and hybrid sharding together
//! run without a stream-ordering violation, and checking changes no bit. (The strategy,
//! prefetch, limiter and deferred-init matrix is checked in `fsdp_parity`.)

use std::sync::Arc;

use fsdp_alloc::{DType, Device, DeviceConfig};
use fsdp_autograd::nn::{Gpt, GptConfig};
use fsdp_autograd::InitContext;
use fsdp_collectives::DeviceMesh;
use fsdp_core::{
    clip_grad_norm, AdamW, Comm, Fsdp, FsdpConfig, MixedPrecision, ShardedOptimizer,
    ShardingStrategy, WrapPolicy,
};
use fsdp_tests::{first_difference, full_named, micro_loss, run_ranks, token_tensors, Named};

const STEPS: usize = 3;
const ACCUM: usize = 2;

fn cfg() -> GptConfig {
    GptConfig::new(23, 16, 2, 2, 5).with_tied(true)
}

/// Per rank: the losses of every micro-batch and the full parameters after training.
fn train(
    world: usize,
    shard: Option<usize>,
    strategy: ShardingStrategy,
    checked: bool,
) -> Vec<(Vec<u32>, Named)> {
    let devices = DeviceConfig::default().with_checked(checked);
    run_ranks(world, move |rank, pg| {
        let dev = Device::cpu_with(rank, devices);
        let model = Gpt::new(&InitContext::eager(&dev, 7), &cfg()).unwrap();
        let config = FsdpConfig {
            strategy,
            wrap_policy: WrapPolicy::ModuleTypes(vec!["Block".into()]),
            mixed_precision: Some(MixedPrecision::uniform(DType::BF16)),
            cpu_offload: Some(Device::cpu_with(700 + rank, devices)),
            ..FsdpConfig::default()
        };
        let comm: Comm = match shard {
            Some(f) => DeviceMesh::new(Arc::clone(&pg), f).unwrap().into(),
            None => pg.into(),
        };
        let fsdp = Fsdp::wrap(model, &dev, comm, config).unwrap();
        let mut opt = AdamW::new(0.01);
        let mut losses = Vec::new();
        for step in 0..STEPS {
            for micro in 0..ACCUM {
                let c = cfg();
                let (x, y) = token_tensors(
                    (step * ACCUM + micro) * world + rank,
                    2,
                    c.seq_len,
                    c.vocab,
                    &dev,
                );
                let mut fwd_bwd = || {
                    let loss = micro_loss(&fsdp.forward(&x).unwrap(), &y, world * ACCUM);
                    losses.push(loss.item().unwrap().to_bits());
                    loss.backward().unwrap();
                };
                if micro + 1 < ACCUM {
                    fsdp.no_sync(fwd_bwd);
                } else {
                    fwd_bwd();
                }
            }
            clip_grad_norm(&fsdp, 0.5).unwrap();
            opt.step(&fsdp).unwrap();
            opt.zero_grad(&fsdp);
            fsdp.synchronize().unwrap();
        }
        let full: Named = full_named(&fsdp);
        (losses, full)
    })
}

#[test]
fn every_feature_together_runs_clean_on_checked_devices_and_bit_for_bit() {
    for (world, shard, strategy) in [
        (2, None, ShardingStrategy::FullShard),
        (3, None, ShardingStrategy::ShardGradOp),
        (4, Some(2), ShardingStrategy::HybridShard),
    ] {
        let plain = train(world, shard, strategy, false);
        let checked = train(world, shard, strategy, true);
        for (rank, (p, c)) in plain.iter().zip(&checked).enumerate() {
            assert_eq!(
                p.0, c.0,
                "W={world} {strategy:?} rank {rank}: losses differ"
            );
            assert_eq!(
                first_difference(&p.1, &c.1),
                None,
                "W={world} {strategy:?} rank {rank}: parameters differ"
            );
        }
    }
}
