//! Gradient accumulation over micro-batches, with communication (reduce every micro-batch,
//! accumulate sharded gradients) and without (`no_sync`: accumulate unsharded gradients locally,
//! reduce once) — both equal local accumulation bitwise; the second costs more memory.

use fsdp_alloc::Device;
use fsdp_autograd::nn::{Gpt, GptConfig};
use fsdp_autograd::InitContext;
use fsdp_core::{Fsdp, FsdpConfig, WrapPolicy};
use fsdp_tests::{first_difference, full_named, micro_loss, run_ranks, token_tensors, train_local};
use fsdp_tests::{sorted_by_name as sorted, Named};

const SEED: u64 = 99;
const STEPS: usize = 2;
const MICRO: usize = 3;
const LR: f32 = 0.05;

fn cfg() -> GptConfig {
    GptConfig::new(23, 16, 2, 2, 5)
}

/// Data index of rank `r`'s micro-batch `m` at `step`: with sync every micro-batch, local
/// micro-batch `m * W + r` (groups of W); with `no_sync`, `r * MICRO + m` (groups of MICRO).
fn index(no_sync: bool, world: usize, step: usize, r: usize, m: usize) -> usize {
    let j = if no_sync {
        r * MICRO + m
    } else {
        m * world + r
    };
    step * world * MICRO + j
}

/// Returns (final parameters, peak allocated bytes of rank 0 during accumulation).
fn run_fsdp(world: usize, no_sync: bool) -> (Named, usize) {
    let out = run_ranks(world, move |rank, pg| {
        let dev = Device::cpu(rank);
        let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
        let config = FsdpConfig {
            wrap_policy: WrapPolicy::ModuleTypes(vec!["Block".into()]),
            ..FsdpConfig::default()
        };
        let fsdp = Fsdp::wrap(model, &dev, pg, config).unwrap();
        let c = cfg();
        let micro = |step: usize, m: usize| {
            let (x, y) = token_tensors(
                index(no_sync, world, step, rank, m),
                2,
                c.seq_len,
                c.vocab,
                &dev,
            );
            let loss = micro_loss(&fsdp.forward(&x).unwrap(), &y, world * MICRO);
            loss.backward().unwrap();
        };
        let mut peak = 0;
        for step in 0..STEPS {
            dev.synchronize().unwrap();
            dev.reset_peak_stats();
            if no_sync {
                fsdp.no_sync(|| (0..MICRO - 1).for_each(|m| micro(step, m)));
                micro(step, MICRO - 1);
            } else {
                (0..MICRO).for_each(|m| micro(step, m));
            }
            fsdp.synchronize().unwrap();
            peak = peak.max(dev.memory_stats().peak_allocated_bytes);
            fsdp.sgd_step(LR).unwrap();
            fsdp.zero_grad();
        }
        let p: Named = full_named(&fsdp);
        (p, peak)
    });
    let peak = out[0].1;
    (out.into_iter().next().unwrap().0, peak)
}

fn run_local(world: usize, no_sync: bool) -> Named {
    let dev = Device::cpu(1000);
    let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
    let c = cfg();
    let group = if no_sync { MICRO } else { world };
    let (_, p) = train_local(&model, &dev, world * MICRO, group, STEPS, LR, &|s, j, d| {
        token_tensors(s * world * MICRO + j, 2, c.seq_len, c.vocab, d)
    });
    p
}

#[test]
fn accumulation_with_and_without_communication_matches_local() {
    for world in [1, 2, 3] {
        let mut peaks = Vec::new();
        for no_sync in [false, true] {
            let (fp, peak) = run_fsdp(world, no_sync);
            let lp = run_local(world, no_sync);
            if let Some(d) = first_difference(&sorted(lp), &sorted(fp)) {
                panic!("W={world} no_sync={no_sync}: {d}");
            }
            peaks.push(peak);
        }
        if world > 1 {
            assert!(
                peaks[1] > peaks[0],
                "W={world}: no_sync keeps unsharded gradients, so its peak ({}) must exceed \
                 accumulation with communication ({})",
                peaks[1],
                peaks[0]
            );
        }
        eprintln!(
            "W={world}: peak with sync {} B, with no_sync {} B",
            peaks[0], peaks[1]
        );
    }
}
