//! FSDP through host staging equals FSDP on the thread backend, bit for bit: W = 4 thread ranks
//! whose groups are wrapped in [`HostStaged`] (every collective copied to a staging device, run
//! there and copied back on the caller's stream — the path GPU ranks on MPI take, here with CPU
//! devices) train GPT with FullShard, ShardGradOp, HybridShard (F = 2) and bf16 mixed precision;
//! every loss and every final parameter equals the unstaged run's. `cargo xtask mpi-test` runs
//! the same over MPI (`tests/examples/mpi_parity.rs`).

use std::sync::Arc;

use fsdp_alloc::{DType, Device};
use fsdp_autograd::nn::{Gpt, GptConfig};
use fsdp_autograd::InitContext;
use fsdp_collectives::{DeviceMesh, HostStaged, ProcessGroup};
use fsdp_core::{Comm, Fsdp, FsdpConfig, MixedPrecision, ShardingStrategy, WrapPolicy};
use fsdp_tests::{first_difference, full_named, micro_loss, run_ranks, token_tensors, Named};

const W: usize = 4;
const STEPS: usize = 3;

fn cfg() -> GptConfig {
    GptConfig::new(19, 12, 2, 2, 6)
}

/// Trains on W thread ranks, staged or not: per rank (losses, final full parameters).
fn train(
    staged: bool,
    strategy: ShardingStrategy,
    shard: Option<usize>,
    mixed: Option<MixedPrecision>,
) -> Vec<(Vec<f32>, Named)> {
    run_ranks(W, move |rank, pg| {
        let pg: Arc<dyn ProcessGroup> = if staged {
            Arc::new(HostStaged::new(pg, Device::cpu(20_000 + rank)).unwrap())
        } else {
            pg
        };
        let dev = Device::cpu(rank);
        let c = cfg();
        let model = Gpt::new(&InitContext::eager(&dev, 5), &c).unwrap();
        let comm: Comm = match shard {
            Some(f) => DeviceMesh::new(pg, f).unwrap().into(),
            None => pg.into(),
        };
        let config = FsdpConfig {
            strategy,
            wrap_policy: WrapPolicy::ModuleTypes(vec!["Block".into()]),
            mixed_precision: mixed,
            ..FsdpConfig::default()
        };
        let fsdp = Fsdp::wrap(model, &dev, comm, config).unwrap();
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let (x, y) = token_tensors(step * W + rank, 2, c.seq_len, c.vocab, &dev);
            let loss = micro_loss(&fsdp.forward(&x).unwrap(), &y, W);
            loss.backward().unwrap();
            losses.push(loss.item().unwrap());
            fsdp.sgd_step(0.05).unwrap();
            fsdp.zero_grad();
        }
        fsdp.synchronize().unwrap();
        (losses, full_named(&fsdp))
    })
}

#[test]
fn fsdp_through_host_staging_equals_the_thread_backend_bit_for_bit() {
    let cases = [
        (ShardingStrategy::FullShard, None, None),
        (ShardingStrategy::ShardGradOp, None, None),
        (ShardingStrategy::HybridShard, Some(2), None),
        (
            ShardingStrategy::FullShard,
            None,
            Some(MixedPrecision::uniform(DType::BF16)),
        ),
    ];
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (strategy, shard, mixed) in cases {
        let want = train(false, strategy, shard, mixed);
        let got = train(true, strategy, shard, mixed);
        for (rank, ((gl, gp), (wl, wp))) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                bits(gl),
                bits(wl),
                "{strategy:?} {mixed:?} rank {rank}: staged losses {gl:?} vs {wl:?}"
            );
            if let Some(d) = first_difference(gp, wp) {
                panic!("{strategy:?} {mixed:?} rank {rank}: parameters differ: {d}");
            }
        }
    }
}
