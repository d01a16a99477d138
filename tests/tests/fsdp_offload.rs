//! CPU offload's copies are ordered by events on their own copy stream, never by host waits:
//! holding that stream up (work that sleeps, launched on it before the forward and before the
//! backward) changes no bit of the result, and from the first forward until the optimizer step
//! has been launched the issuing thread waits on the host not once — the same code path as on
//! CUDA devices, where the copies are `cuMemcpy*Async` of page-locked memory.

use std::time::Duration;

use fsdp_alloc::{Device, DeviceConfig};
use fsdp_autograd::nn::{Gpt, GptConfig};
use fsdp_autograd::InitContext;
use fsdp_core::{BackwardPrefetch, Fsdp, FsdpConfig, ShardingStrategy, WrapPolicy};
use fsdp_tests::{first_difference, full_named, micro_loss, run_ranks, token_tensors, Named};

const SEED: u64 = 77;
const BATCH: usize = 2;
const STEPS: usize = 3;
const MICRO: usize = 2;
const LR: f32 = 0.05;

fn model_cfg() -> GptConfig {
    GptConfig::new(19, 12, 2, 2, 6)
}

/// What one run gives: per rank, (every micro-batch's loss, the host waits of every step from the
/// first forward until `sgd_step` returned), and rank 0's full parameters at the end.
type Run = (Vec<(Vec<f32>, Vec<u64>)>, Named);

/// `STEPS` SGD steps of `MICRO` micro-batches on `world` thread ranks; with `offload`, each rank's shards live on its own
/// host device and, with `delay`, the copy stream is held up by that long before every forward
/// and every backward.
fn train(
    world: usize,
    strategy: ShardingStrategy,
    offload: bool,
    delay: Option<Duration>,
    checked: bool,
) -> Run {
    let per_rank = run_ranks(world, move |rank, pg| {
        let devices = DeviceConfig::default().with_checked(checked);
        let dev = Device::cpu_with(rank, devices);
        let model = Gpt::new(&InitContext::eager(&dev, SEED), &model_cfg()).unwrap();
        let config = FsdpConfig {
            strategy,
            wrap_policy: WrapPolicy::ModuleTypes(vec!["Block".into()]),
            backward_prefetch: BackwardPrefetch::BackwardPre,
            forward_prefetch: true,
            // The limiter and the order check wait on the host by design; both off here.
            limit_all_gathers: false,
            verify_execution_order: 0,
            cpu_offload: offload.then(|| Device::cpu_with(900 + rank, devices)),
            ..FsdpConfig::default()
        };
        let fsdp = Fsdp::wrap(model, &dev, pg, config).unwrap();
        assert_eq!(fsdp.offload_copy_stream().is_some(), offload);
        let hold_up = |fsdp: &Fsdp<Gpt>| {
            if let (Some(d), Some(copy)) = (delay, fsdp.offload_copy_stream()) {
                copy.launch(move || std::thread::sleep(d));
            }
        };
        let (mut losses, mut waits) = (Vec::new(), Vec::new());
        for step in 0..STEPS {
            let before = fsdp_alloc::stream::host_syncs();
            // Two micro-batches: the second one's gradients are downloaded and added to the
            // first one's on the host stream.
            let mut step_losses = Vec::new();
            for micro in 0..MICRO {
                let (x, y) =
                    token_tensors((step * MICRO + micro) * world + rank, BATCH, 6, 19, &dev);
                hold_up(&fsdp);
                let logits = fsdp.forward(&x).unwrap();
                let loss = micro_loss(&logits, &y, world);
                hold_up(&fsdp);
                loss.backward().unwrap();
                step_losses.push(loss);
            }
            fsdp.sgd_step(LR).unwrap();
            waits.push(fsdp_alloc::stream::host_syncs() - before);
            for loss in step_losses {
                losses.push(loss.item().unwrap());
            }
            fsdp.zero_grad();
        }
        ((losses, waits), full_named(&fsdp))
    });
    let full = per_rank[0].1.clone();
    (per_rank.into_iter().map(|(r, _)| r).collect(), full)
}

#[test]
fn held_up_offload_copies_change_no_bit_and_the_host_never_waits() {
    for (world, strategy) in [
        (2, ShardingStrategy::FullShard),
        (3, ShardingStrategy::ShardGradOp),
    ] {
        let (plain, plain_full) = train(world, strategy, false, None, false);
        let (off, off_full) = train(
            world,
            strategy,
            true,
            Some(Duration::from_millis(40)),
            false,
        );
        for (rank, ((pl, _), (ol, waits))) in plain.iter().zip(&off).enumerate() {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(ol),
                bits(pl),
                "{strategy:?} W={world} rank {rank}: losses"
            );
            assert_eq!(
                waits,
                &vec![0; STEPS],
                "{strategy:?} W={world} rank {rank}: host waits between the first forward and \
                 the launched optimizer step"
            );
        }
        assert_eq!(
            first_difference(&plain_full, &off_full),
            None,
            "{strategy:?} W={world}: parameters after {STEPS} steps"
        );
    }
}

/// On checked devices every access of the copies (host shards read by uploads, host gradients
/// written by downloads and read by the optimizer) must be ordered by events: a missing wait
/// fails a stream, and with it the run.
#[test]
fn held_up_offload_copies_are_ordered_on_checked_devices() {
    let (plain, plain_full) = train(2, ShardingStrategy::FullShard, false, None, true);
    let (off, off_full) = train(
        2,
        ShardingStrategy::FullShard,
        true,
        Some(Duration::from_millis(20)),
        true,
    );
    assert_eq!(plain[0].0, off[0].0);
    assert_eq!(first_difference(&plain_full, &off_full), None);
}
