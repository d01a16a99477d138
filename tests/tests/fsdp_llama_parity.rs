//! The parity law of `fsdp_parity.rs` on a Llama (`nn::Llama`: RMSNorm, RoPE, grouped-query
//! attention, SwiGLU, untied or tied head): FSDP on W thread ranks equals local training of the
//! same model with W-way gradient accumulation, bit for bit in f32 — every micro-batch loss and
//! the parameters after N steps — with one unit per decoder layer, for full and hybrid sharding,
//! deferred init and activation checkpointing.

use std::sync::Arc;

use fsdp_alloc::Device;
use fsdp_autograd::nn::{Llama, Llama3Scaling, LlamaConfig};
use fsdp_autograd::InitContext;
use fsdp_collectives::{DeviceMesh, ProcessGroup};
use fsdp_core::{
    BackwardPrefetch, Comm, DeferredInit, Fsdp, FsdpConfig, ShardingStrategy, WrapPolicy,
};
use fsdp_tests::{first_difference, full_named, micro_loss, run_ranks, token_tensors, train_local};
use fsdp_tests::{sorted_by_name as sorted, Named};

const SEED: u64 = 4321;
const BATCH: usize = 2;
const STEPS: usize = 3;
const LR: f32 = 0.05;

/// Vocab 19, d 16, 2 layers, 4 query heads over 2 key/value heads, ffn 24, seq 6.
fn llama() -> LlamaConfig {
    LlamaConfig::new(19, 16, 2, 4, 2, 24, 6)
}

fn batch(
    step: usize,
    rank: usize,
    world: usize,
    dev: &Device,
    c: &LlamaConfig,
) -> (fsdp_autograd::Tensor, fsdp_autograd::Tensor) {
    token_tensors(step * world + rank, BATCH, c.seq_len, c.vocab, dev)
}

fn local(world: usize, group: usize, c: &LlamaConfig) -> (Vec<Vec<f32>>, Named) {
    let dev = Device::cpu(1000);
    let model = Llama::new(&InitContext::eager(&dev, SEED), c).unwrap();
    train_local(&model, &dev, world, group, STEPS, LR, &|s, r, d| {
        batch(s, r, world, d, c)
    })
}

fn fsdp(
    world: usize,
    shard: Option<usize>,
    config: FsdpConfig,
    deferred: bool,
    c: &LlamaConfig,
) -> (Vec<Vec<f32>>, Named) {
    let c = *c;
    let per_rank = run_ranks(world, move |rank, pg| {
        let dev = Device::cpu(rank);
        let ctx = if deferred {
            InitContext::fake(SEED)
        } else {
            InitContext::eager(&dev, SEED)
        };
        let model = Llama::new(&ctx, &c).unwrap();
        let comm: Comm = match shard {
            Some(f) => DeviceMesh::new(Arc::clone(&pg) as Arc<dyn ProcessGroup>, f)
                .unwrap()
                .into(),
            None => pg.into(),
        };
        let fsdp = Fsdp::wrap(model, &dev, comm, config.clone()).unwrap();
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let (x, y) = batch(step, rank, world, &dev, &c);
            let logits = fsdp.forward(&x).unwrap();
            let loss = micro_loss(&logits, &y, world);
            losses.push(loss.item().unwrap());
            loss.backward().unwrap();
            fsdp.sgd_step(LR).unwrap();
            fsdp.zero_grad();
        }
        (losses, full_named(&fsdp))
    });
    for (r, (_, p)) in per_rank.iter().enumerate().skip(1) {
        assert_eq!(
            first_difference(&per_rank[0].1, p),
            None,
            "rank {r} disagrees with rank 0"
        );
    }
    let losses = (0..STEPS)
        .map(|s| per_rank.iter().map(|(l, _)| l[s]).collect())
        .collect();
    (losses, per_rank.into_iter().next().unwrap().1)
}

fn check(world: usize, shard: Option<usize>, config: FsdpConfig, deferred: bool, c: &LlamaConfig) {
    let (ll, lp) = local(world, shard.unwrap_or(world), c);
    let (fl, fp) = fsdp(world, shard, config.clone(), deferred, c);
    assert_eq!(
        ll.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>(),
        fl.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>(),
        "losses differ (W={world}, {c:?}, {config:?}): local {ll:?} vs fsdp {fl:?}"
    );
    if let Some(d) = first_difference(&sorted(lp), &sorted(fp)) {
        panic!("parameters differ (W={world}, shard {shard:?}, {c:?}, {config:?}): {d}");
    }
}

fn layers() -> FsdpConfig {
    FsdpConfig {
        wrap_policy: WrapPolicy::ModuleTypes(vec!["LlamaDecoderLayer".into()]),
        ..FsdpConfig::default()
    }
}

#[test]
fn full_shard_llama_matches_local_on_1_2_3_4_ranks() {
    for w in [1, 2, 3, 4] {
        check(w, None, layers(), false, &llama());
    }
}

#[test]
fn multi_query_and_llama3_scaled_llamas_match_local() {
    let mqa = LlamaConfig::new(19, 16, 2, 4, 1, 24, 6);
    let scaled = llama()
        .with_rope_theta(5e5)
        .with_rope_scaling(Some(Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 4,
        }));
    for c in [mqa, scaled] {
        check(3, None, layers(), false, &c);
    }
}

#[test]
fn hybrid_shard_llama_matches_grouped_local_accumulation() {
    for (w, f) in [(4, 2), (8, 4)] {
        let config = FsdpConfig {
            strategy: ShardingStrategy::HybridShard,
            ..layers()
        };
        check(w, Some(f), config, false, &llama());
    }
}

#[test]
fn deferred_init_llama_trains_exactly_like_eager() {
    for mode in [DeferredInit::ShardOnly, DeferredInit::UnitByUnit] {
        for (w, strategy) in [
            (2, ShardingStrategy::FullShard),
            (3, ShardingStrategy::ShardGradOp),
        ] {
            let config = FsdpConfig {
                strategy,
                deferred_init: mode,
                ..layers()
            };
            check(w, None, config, true, &llama());
        }
    }
}

#[test]
fn activation_checkpointed_llama_trains_exactly_like_local() {
    let c = llama().with_checkpoint(true);
    for (w, bp) in [
        (2, BackwardPrefetch::BackwardPre),
        (3, BackwardPrefetch::BackwardPost),
    ] {
        let config = FsdpConfig {
            backward_prefetch: bp,
            ..layers()
        };
        check(w, None, config, false, &c);
    }
}

#[test]
fn tied_llama_with_embedding_and_head_units_matches_local() {
    let tied = llama().with_tied(true);
    let config = FsdpConfig {
        wrap_policy: WrapPolicy::ModuleTypes(vec![
            "LlamaDecoderLayer".into(),
            "Embedding".into(),
            "Linear".into(),
        ]),
        ..FsdpConfig::default()
    };
    for w in [2, 3] {
        check(w, None, config.clone(), false, &tied);
    }
}
