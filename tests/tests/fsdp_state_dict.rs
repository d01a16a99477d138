//! State dicts: full (gathered), sharded (pieces with global offsets) and local (flat shards),
//! in memory and through safetensors files, loaded back at the same and at other world sizes and
//! wrap policies — and training resumed from them equals an uninterrupted local run bit for bit.
//! Optimizer state (a momentum buffer per unit, kept by a small sharded momentum-SGD written
//! here) is resharded the same way. Error cases name the offending entry.

use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use fsdp_alloc::Device;
use fsdp_autograd::nn::{named_parameters, parameters, Gpt, GptConfig, Module};
use fsdp_autograd::{no_grad, with_stream, InitContext, Tensor};
use fsdp_collectives::{DeviceMesh, ProcessGroup};
use fsdp_core::optim::{
    AdamParams, AdamW, LocalAdamW, LocalOptimizer, LocalSgd, Sgd, ShardedOptimizer,
};
use fsdp_core::state_dict::{
    self, FullStateDict, OptimState, ShardedOptimStateDict, ShardedStateDict, StateDictError,
    TensorEntry,
};
use fsdp_core::{Comm, Fsdp, FsdpConfig, ShardingStrategy, WrapPolicy};
use fsdp_tests::{first_difference, full_named, micro_loss, run_ranks, token_tensors, train_local};
use fsdp_tests::{sorted_by_name as sorted, Named};

const SEED: u64 = 4321;
const BATCH: usize = 2;
const LR: f32 = 0.05;
const MU: f32 = 0.9;
/// Steps before the checkpoint and after it.
const K: usize = 2;
const M: usize = 2;
const SLOT: &str = "momentum_buffer";

fn cfg() -> GptConfig {
    GptConfig::new(19, 12, 2, 2, 6)
}

fn blocks() -> WrapPolicy {
    WrapPolicy::ModuleTypes(vec!["Block".into()])
}

/// Micro-batch `r` of global step `step`: the same data whatever the world size.
fn batch(step: usize, r: usize, dev: &Device) -> (Tensor, Tensor) {
    let c = cfg();
    token_tensors(step * 16 + r, BATCH, c.seq_len, c.vocab, dev)
}

fn temp_dir(tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    std::env::temp_dir().join(format!(
        "fsdp-state-dict-{tag}-{}-{}-{nanos}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Removes the directory when dropped (also when a test fails).
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        TempDir(temp_dir(tag))
    }
    fn join(&self, p: &str) -> PathBuf {
        self.0.join(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn wrap_with(
    rank: usize,
    comm: Comm,
    seed: u64,
    strategy: ShardingStrategy,
    policy: WrapPolicy,
) -> (Device, Fsdp<Gpt>) {
    let dev = Device::cpu(rank);
    let model = Gpt::new(&InitContext::eager(&dev, seed), &cfg()).unwrap();
    let config = FsdpConfig {
        strategy,
        wrap_policy: policy,
        ..FsdpConfig::default()
    };
    let fsdp = Fsdp::wrap(model, &dev, comm, config).unwrap();
    (dev, fsdp)
}

fn wrap(
    rank: usize,
    pg: Arc<dyn ProcessGroup>,
    seed: u64,
    policy: WrapPolicy,
) -> (Device, Fsdp<Gpt>) {
    wrap_with(rank, pg.into(), seed, ShardingStrategy::FullShard, policy)
}

fn forward_backward(fsdp: &Fsdp<Gpt>, dev: &Device, step: usize, rank: usize, world: usize) {
    let (x, y) = batch(step, rank, dev);
    let logits = fsdp.forward(&x).unwrap();
    micro_loss(&logits, &y, world).backward().unwrap();
}

/// Plain SGD steps `steps` on `world` ranks.
fn train_sgd(fsdp: &Fsdp<Gpt>, dev: &Device, rank: usize, world: usize, steps: Range<usize>) {
    for step in steps {
        forward_backward(fsdp, dev, step, rank, world);
        fsdp.sgd_step(LR).unwrap();
        fsdp.zero_grad();
    }
}

fn gathered(fsdp: &Fsdp<Gpt>) -> Named {
    sorted(full_named(fsdp))
}

fn named(d: &FullStateDict) -> Named {
    sorted(
        d.entries
            .iter()
            .map(|e| (e.name.clone(), e.values.clone()))
            .collect(),
    )
}

fn assert_same(what: &str, a: &Named, b: &Named) {
    if let Some(d) = first_difference(a, b) {
        panic!("{what}: {d}");
    }
}

/// Local reference with plain SGD: phases of (world size, global steps), one model throughout;
/// the parameters after each phase.
fn local_sgd(phases: &[(usize, Range<usize>)]) -> Vec<Named> {
    local_sgd_with(&cfg(), phases)
}

fn local_sgd_with(config: &GptConfig, phases: &[(usize, Range<usize>)]) -> Vec<Named> {
    let dev = Device::cpu(900);
    let model = Gpt::new(&InitContext::eager(&dev, SEED), config).unwrap();
    phases
        .iter()
        .map(|(w, steps)| {
            let start = steps.start;
            let (_, params) = train_local(&model, &dev, *w, *w, steps.len(), LR, &|s, r, d| {
                batch(start + s, r, d)
            });
            sorted(params)
        })
        .collect()
}

// ------------------------------------------------------------------ momentum SGD, both sides

/// Sharded momentum SGD on FSDP's flat shards (torch semantics: the first step's buffer is the
/// gradient; then `buf = mu * buf + g`; `p -= lr * buf`), one buffer per unit.
fn momentum_step(fsdp: &Fsdp<Gpt>, st: &mut OptimState) {
    let shards = fsdp.shards();
    if st.slots.is_empty() {
        st.slots.push((SLOT.into(), vec![None; shards.len()]));
        st.steps = vec![0; shards.len()];
    }
    with_stream(fsdp.optimizer_stream(), || {
        no_grad(|| {
            for (u, s) in shards.iter().enumerate() {
                let Some(g) = &s.grad else { continue };
                let bufs = &mut st.slots[0].1;
                match &bufs[u] {
                    None => bufs[u] = Some(g.contiguous_copy().unwrap()),
                    Some(b) => {
                        b.scale_(MU).unwrap();
                        b.add_(g).unwrap();
                    }
                }
                s.shard.add_scaled_(bufs[u].as_ref().unwrap(), -LR).unwrap();
                st.steps[u] += 1;
            }
        })
    });
    fsdp.params_updated();
}

fn train_momentum(
    fsdp: &Fsdp<Gpt>,
    st: &mut OptimState,
    dev: &Device,
    rank: usize,
    world: usize,
    steps: Range<usize>,
) {
    for step in steps {
        forward_backward(fsdp, dev, step, rank, world);
        momentum_step(fsdp, st);
        fsdp.zero_grad();
    }
}

/// Local momentum SGD with W-way accumulation, phases as in [`local_sgd`]. Returns the
/// parameters and the momentum buffers (by parameter name) after each phase.
fn local_momentum(phases: &[(usize, Range<usize>)]) -> Vec<(Named, Named)> {
    let dev = Device::cpu(901);
    let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
    let params = named_parameters(&model);
    let mut bufs: Vec<Option<Tensor>> = vec![None; params.len()];
    let mut out = Vec::new();
    for (w, steps) in phases {
        for step in steps.clone() {
            for r in 0..*w {
                let (x, y) = batch(step, r, &dev);
                micro_loss(&model.call(&x).unwrap(), &y, *w)
                    .backward()
                    .unwrap();
            }
            no_grad(|| {
                for ((_, p), b) in params.iter().zip(bufs.iter_mut()) {
                    let t = p.get().unwrap();
                    let g = t.grad().unwrap().contiguous_copy().unwrap();
                    match b {
                        None => *b = Some(g),
                        Some(b) => {
                            b.scale_(MU).unwrap();
                            b.add_(&g).unwrap();
                        }
                    }
                    t.add_scaled_(b.as_ref().unwrap(), -LR).unwrap();
                    t.zero_grad();
                }
            });
        }
        let ps: Named = params
            .iter()
            .map(|(n, p)| (n.clone(), p.get().unwrap().to_vec::<f32>().unwrap()))
            .collect();
        let bs: Named = params
            .iter()
            .zip(&bufs)
            .map(|((n, _), b)| (n.clone(), b.as_ref().unwrap().to_vec::<f32>().unwrap()))
            .collect();
        out.push((sorted(ps), sorted(bs)));
    }
    out
}

// ------------------------------------------------------------------------------- full

#[test]
fn full_state_dict_saved_at_4_loads_at_2_and_3_and_training_continues_like_local() {
    let dir = TempDir::new("full");
    let path = dir.join("model.safetensors");
    let p = path.clone();
    let saved = run_ranks(4, move |rank, pg| {
        let (dev, fsdp) = wrap(rank, pg, SEED, blocks());
        train_sgd(&fsdp, &dev, rank, 4, 0..K);
        let rank0 = state_dict::full_state_dict(&fsdp, true).unwrap();
        let all = state_dict::full_state_dict(&fsdp, false).unwrap();
        state_dict::save_full(&fsdp, &p).unwrap();
        (rank0, all, gathered(&fsdp))
    });
    // rank0_only: rank 0 has every parameter, the others nothing; without it, every rank has
    // the same dict, equal to the gathered parameters, with the original shapes.
    let (rank0, all, params) = &saved[0];
    assert_eq!(rank0, all);
    assert_eq!(all.world_size, 4);
    assert_same("full state dict vs gathered", &named(all), params);
    let model_shapes: Vec<(String, Vec<usize>)> = {
        let dev = Device::cpu(950);
        let m = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
        let mut v: Vec<_> = named_parameters(&m)
            .into_iter()
            .map(|(n, p)| (n, p.shape().to_vec()))
            .collect();
        v.sort();
        v
    };
    let mut dict_shapes: Vec<(String, Vec<usize>)> = all
        .entries
        .iter()
        .map(|e| (e.name.clone(), e.shape.clone()))
        .collect();
    dict_shapes.sort();
    assert_eq!(dict_shapes, model_shapes);
    for (r, (r0, a, _)) in saved.iter().enumerate().skip(1) {
        assert!(r0.is_empty(), "rank {r} got entries with rank0_only");
        assert_eq!(a, all, "rank {r}'s full state dict differs from rank 0's");
    }
    // The file holds exactly the dict.
    assert_eq!(&FullStateDict::load(&path).unwrap(), all);

    for (w2, policy) in [(2, blocks()), (3, WrapPolicy::RootOnly)] {
        let local = local_sgd(&[(4, 0..K), (w2, K..K + M)]);
        assert_same(
            "local reference vs FSDP at the checkpoint",
            &local[0],
            params,
        );
        let p = path.clone();
        let resumed = run_ranks(w2, move |rank, pg| {
            // Another seed: only the load makes the parameters right.
            let (dev, fsdp) = wrap(rank, pg, SEED + 17, policy.clone());
            state_dict::load_full(&fsdp, &p).unwrap();
            let loaded = gathered(&fsdp);
            train_sgd(&fsdp, &dev, rank, w2, K..K + M);
            (loaded, gathered(&fsdp))
        });
        for (r, (loaded, after)) in resumed.iter().enumerate() {
            assert_same(&format!("W={w2} rank {r}: loaded vs saved"), loaded, params);
            assert_same(
                &format!("W={w2} rank {r}: resumed training vs uninterrupted local run"),
                after,
                &local[1],
            );
        }
    }
}

#[test]
fn full_state_dict_round_trips_through_a_plain_local_model() {
    // A locally trained model's parameters load into FSDP, and FSDP's back into a local model.
    let local = local_sgd(&[(2, 0..K)]);
    let dev = Device::cpu(960);
    let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
    train_local(&model, &dev, 2, 2, K, LR, &|s, r, d| batch(s, r, d));
    let dict = FullStateDict::from_module(&model).unwrap();
    assert_same("from_module", &named(&dict), &local[0]);
    let out = run_ranks(3, move |rank, pg| {
        let (_, fsdp) = wrap(rank, pg, SEED + 5, blocks());
        state_dict::load_full_state_dict(&fsdp, &dict).unwrap();
        state_dict::full_state_dict(&fsdp, true).unwrap()
    });
    assert_same(
        "FSDP after loading a local dict",
        &named(&out[0]),
        &local[0],
    );
    let fresh = Gpt::new(&InitContext::eager(&dev, SEED + 6), &cfg()).unwrap();
    out[0].load_into_module(&fresh).unwrap();
    assert_same(
        "local model after load_into_module",
        &named(&FullStateDict::from_module(&fresh).unwrap()),
        &local[0],
    );
}

// ------------------------------------------------------------------------------- sharded

#[test]
fn sharded_state_dict_round_trips_at_the_same_and_other_world_sizes() {
    let dir = TempDir::new("sharded");
    let ckpt = dir.join("ckpt");
    let c = ckpt.clone();
    let saved = run_ranks(4, move |rank, pg| {
        let (dev, fsdp) = wrap(rank, pg, SEED, blocks());
        train_sgd(&fsdp, &dev, rank, 4, 0..K);
        let sd = state_dict::sharded_state_dict(&fsdp).unwrap();
        state_dict::save_sharded(&fsdp, &c).unwrap();
        (sd, gathered(&fsdp))
    });
    let params = saved[0].1.clone();
    let dicts: Vec<ShardedStateDict> = saved.iter().map(|(d, _)| d.clone()).collect();

    // Each rank's pieces are slices of the full parameters at their offsets; together they
    // cover every parameter exactly once.
    let full: std::collections::HashMap<&str, &Vec<f32>> =
        params.iter().map(|(n, v)| (n.as_str(), v)).collect();
    let mut covered: std::collections::HashMap<String, Vec<u32>> = params
        .iter()
        .map(|(n, v)| (n.clone(), vec![0; v.len()]))
        .collect();
    for (r, d) in dicts.iter().enumerate() {
        assert_eq!((d.world_size, d.ranks.clone()), (4, vec![r]));
        assert_eq!(
            d.params.len(),
            params.len(),
            "every rank lists every parameter"
        );
        for p in &d.pieces {
            assert_eq!(p.rank, r);
            let v = full[p.name.as_str()];
            assert_eq!(p.shape.iter().product::<usize>(), v.len());
            assert_eq!(&v[p.offset..p.offset + p.values.len()], &p.values[..]);
            for c in &mut covered.get_mut(&p.name).unwrap()[p.offset..p.offset + p.values.len()] {
                *c += 1;
            }
        }
    }
    for (n, c) in &covered {
        assert!(c.iter().all(|&x| x == 1), "{n} is not covered exactly once");
    }
    let merged = ShardedStateDict::merge(dicts.clone()).unwrap();
    assert_eq!(ShardedStateDict::load_dir(&ckpt).unwrap(), merged);

    // Same world size, in memory: each rank loads its own dict.
    let own = dicts.clone();
    let out = run_ranks(4, move |rank, pg| {
        let (_, fsdp) = wrap(rank, pg, SEED + 1, blocks());
        state_dict::load_sharded_state_dict(&fsdp, &own[rank]).unwrap();
        gathered(&fsdp)
    });
    assert_same("W=4 from own sharded dict", &out[0], &params);

    // Other world size and wrap policy, in memory: every rank gets the merged pieces.
    let m = merged.clone();
    let out = run_ranks(3, move |rank, pg| {
        let (_, fsdp) = wrap(rank, pg, SEED + 2, WrapPolicy::RootOnly);
        state_dict::load_sharded_state_dict(&fsdp, &m).unwrap();
        gathered(&fsdp)
    });
    assert_same(
        "W=3 (root only) from merged sharded dicts",
        &out[0],
        &params,
    );

    // From disk at W=2 and W=3 (and the same W=4), then training continues like local.
    for w2 in [2, 3, 4] {
        let local = local_sgd(&[(4, 0..K), (w2, K..K + M)]);
        let c = ckpt.clone();
        let out = run_ranks(w2, move |rank, pg| {
            let (dev, fsdp) = wrap(rank, pg, SEED + 3, blocks());
            state_dict::load_sharded(&fsdp, &c).unwrap();
            let loaded = gathered(&fsdp);
            train_sgd(&fsdp, &dev, rank, w2, K..K + M);
            (loaded, gathered(&fsdp))
        });
        for (r, (loaded, after)) in out.iter().enumerate() {
            assert_same(
                &format!("W={w2} rank {r}: loaded from disk"),
                loaded,
                &params,
            );
            assert_same(
                &format!("W={w2} rank {r}: resumed vs local"),
                after,
                &local[1],
            );
        }
    }
}

#[test]
fn load_sharded_reads_only_the_files_a_rank_needs() {
    let dir = TempDir::new("selective");
    let ckpt = dir.join("ckpt");
    let c = ckpt.clone();
    run_ranks(4, move |rank, pg| {
        let (_, fsdp) = wrap(rank, pg, SEED, blocks());
        state_dict::save_sharded(&fsdp, &c).unwrap();
    });
    // Corrupt rank 3's data (not its piece index): at the same world size and wrapping only
    // loading rank 3 needs that file, so only rank 3 reads it and names it; ranks 0-2 learn of
    // it through the load's agreement and refuse too (no rank loads a partial checkpoint),
    // naming the file rank 3 refused.
    let bad = ckpt.join("rank-00003-of-00004.safetensors");
    assert!(bad.exists());
    std::fs::write(&bad, b"corrupted").unwrap();
    let c = ckpt.clone();
    let results = run_ranks(4, move |rank, pg| {
        let (_, fsdp) = wrap(rank, pg, SEED + 1, blocks());
        state_dict::load_sharded(&fsdp, &c).map_err(|e| e.to_string())
    });
    for (r, res) in results.iter().enumerate().take(3) {
        let err = res.as_ref().unwrap_err();
        assert!(
            err.contains("rank 3 refused") && err.contains("rank-00003-of-00004.safetensors"),
            "rank {r}: {err}"
        );
    }
    let err = results[3].as_ref().unwrap_err();
    assert!(
        !err.contains("refused") && err.contains("rank-00003-of-00004.safetensors"),
        "error should name the file: {err}"
    );
}

// ------------------------------------------------------------------------------- local

#[test]
fn local_state_dict_round_trips_and_refuses_another_world_size_rank_or_wrapping() {
    let dicts = run_ranks(3, |rank, pg| {
        let (dev, fsdp) = wrap(rank, pg, SEED, blocks());
        train_sgd(&fsdp, &dev, rank, 3, 0..1);
        let local = state_dict::local_state_dict(&fsdp).unwrap();
        assert_eq!((local.world_size, local.rank), (3, rank));
        assert_eq!(local.units.len(), fsdp.num_units());
        assert_eq!(
            local
                .units
                .iter()
                .map(|u| u.values.clone())
                .collect::<Vec<_>>(),
            fsdp.local_shards().unwrap()
        );
        let at_save = gathered(&fsdp);
        train_sgd(&fsdp, &dev, rank, 3, 1..2);
        assert!(first_difference(&gathered(&fsdp), &at_save).is_some());
        state_dict::load_local_state_dict(&fsdp, &local).unwrap();
        assert_same("after loading the local dict", &gathered(&fsdp), &at_save);
        local
    });
    // Another rank's dict.
    let d = dicts.clone();
    run_ranks(3, move |rank, pg| {
        let (_, fsdp) = wrap(rank, pg, SEED, blocks());
        match state_dict::load_local_state_dict(&fsdp, &d[(rank + 1) % 3]) {
            Err(StateDictError::RankMismatch { saved, current }) => {
                assert_eq!((saved, current), ((rank + 1) % 3, rank))
            }
            other => panic!("expected RankMismatch, got {other:?}"),
        }
    });
    // Another world size.
    let d = dicts.clone();
    run_ranks(2, move |rank, pg| {
        let (_, fsdp) = wrap(rank, pg, SEED, blocks());
        let err = state_dict::load_local_state_dict(&fsdp, &d[rank]).unwrap_err();
        assert!(
            matches!(
                err,
                StateDictError::WorldSizeMismatch {
                    saved: 3,
                    current: 2
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("full or sharded"), "{err}");
    });
    // Same world size, another wrap policy.
    let d = dicts;
    run_ranks(3, move |rank, pg| {
        let (_, fsdp) = wrap(rank, pg, SEED, WrapPolicy::RootOnly);
        match state_dict::load_local_state_dict(&fsdp, &d[rank]) {
            Err(StateDictError::LayoutMismatch { .. }) => {}
            other => panic!("expected LayoutMismatch, got {other:?}"),
        }
    });
}

// ------------------------------------------------------------------------------- errors

#[test]
fn invalid_state_dicts_are_refused_naming_the_entry_and_change_nothing() {
    let dir = TempDir::new("errors");
    let d = dir.0.clone();
    run_ranks(2, move |rank, pg| {
        let (_, fsdp) = wrap(rank, pg, SEED, blocks());
        let full = state_dict::full_state_dict(&fsdp, false).unwrap();
        let before = gathered(&fsdp);
        let name0 = full.entries[0].name.clone();

        // A missing parameter.
        let mut bad = full.clone();
        let removed = bad.entries.remove(1);
        match state_dict::load_full_state_dict(&fsdp, &bad) {
            Err(StateDictError::MissingEntry { name, .. }) => assert_eq!(name, removed.name),
            other => panic!("expected MissingEntry, got {other:?}"),
        }
        // An unknown one.
        let mut bad = full.clone();
        bad.entries.push(TensorEntry {
            name: "blocks.7.mlp.fc.weight".into(),
            shape: vec![2],
            values: vec![0.0; 2],
        });
        let err = state_dict::load_full_state_dict(&fsdp, &bad).unwrap_err();
        assert!(
            matches!(&err, StateDictError::UnexpectedEntry { name, .. } if name == "blocks.7.mlp.fc.weight"),
            "{err:?}"
        );
        assert!(err.to_string().contains("blocks.7.mlp.fc.weight"), "{err}");
        // A wrong shape (same number of values).
        let mut bad = full.clone();
        let e = bad.entries.iter_mut().find(|e| e.shape.len() == 2).unwrap();
        let (name, shape) = (e.name.clone(), e.shape.clone());
        e.shape = vec![shape[1], shape[0]];
        match state_dict::load_full_state_dict(&fsdp, &bad) {
            Err(StateDictError::ShapeMismatch {
                name: n,
                expected,
                got,
                ..
            }) => {
                assert_eq!((n, expected), (name.clone(), shape.clone()));
                assert_eq!(got, vec![shape[1], shape[0]]);
            }
            other => panic!("expected ShapeMismatch, got {other:?}"),
        }
        // A repeated entry; too few values.
        let mut bad = full.clone();
        bad.entries.push(bad.entries[0].clone());
        match state_dict::load_full_state_dict(&fsdp, &bad) {
            Err(StateDictError::DuplicateEntry { name, .. }) => assert_eq!(name, name0),
            other => panic!("expected DuplicateEntry, got {other:?}"),
        }
        let mut bad = full.clone();
        bad.entries[0].values.pop();
        match state_dict::load_full_state_dict(&fsdp, &bad) {
            Err(StateDictError::ValueCount { name, .. }) => assert_eq!(name, name0),
            other => panic!("expected ValueCount, got {other:?}"),
        }
        // Through a file: a dict of another model.
        let path = d.join(format!("bad-{rank}.safetensors"));
        let mut bad = full.clone();
        bad.entries.retain(|e| !e.name.starts_with("blocks.1."));
        bad.save(&path).unwrap();
        match state_dict::load_full(&fsdp, &path) {
            Err(StateDictError::MissingEntry { name, .. }) => {
                assert!(name.starts_with("blocks.1."), "{name}")
            }
            other => panic!("expected MissingEntry, got {other:?}"),
        }
        match state_dict::load_full(&fsdp, d.join("absent.safetensors")) {
            Err(StateDictError::Io { path, .. }) => assert!(path.ends_with("absent.safetensors")),
            other => panic!("expected Io, got {other:?}"),
        }

        // Sharded: this rank's own dict lacks the other rank's pieces at another layout; here,
        // drop one of its own pieces.
        let sd = state_dict::sharded_state_dict(&fsdp).unwrap();
        let mut bad = sd.clone();
        let dropped = bad.pieces.remove(0);
        match state_dict::load_sharded_state_dict(&fsdp, &bad) {
            Err(StateDictError::IncompleteShards {
                name,
                rank: r,
                missing,
            }) => {
                assert_eq!((name, r), (dropped.name.clone(), rank));
                assert_eq!(missing.start, dropped.offset);
            }
            other => panic!("expected IncompleteShards, got {other:?}"),
        }
        let mut bad = sd.clone();
        let numel: usize = bad.pieces[0].shape.iter().product();
        bad.pieces[0].offset = numel;
        assert!(matches!(
            state_dict::load_sharded_state_dict(&fsdp, &bad),
            Err(StateDictError::PieceOutOfRange { .. })
        ));
        let mut bad = sd.clone();
        bad.params[0].shape.push(1);
        match state_dict::load_sharded_state_dict(&fsdp, &bad) {
            Err(StateDictError::ShapeMismatch { name, .. }) => assert_eq!(name, bad.params[0].name),
            other => panic!("expected ShapeMismatch, got {other:?}"),
        }
        let mut bad = sd.clone();
        bad.params.remove(0);
        assert!(matches!(
            state_dict::load_sharded_state_dict(&fsdp, &bad),
            Err(StateDictError::MissingEntry { .. })
        ));
        // A missing sharded checkpoint directory.
        assert!(matches!(
            state_dict::load_sharded(&fsdp, d.join("no-such-checkpoint")),
            Err(StateDictError::Io { .. })
        ));

        // None of this changed the parameters.
        assert_same("after failed loads", &gathered(&fsdp), &before);
    });
}

// ------------------------------------------------------------------- other strategies

#[test]
fn no_shard_and_hybrid_shard_checkpoints_load_into_full_shard() {
    for (world, strategy, shard) in [
        (2, ShardingStrategy::NoShard, None),
        (4, ShardingStrategy::HybridShard, Some(2)),
    ] {
        let dir = TempDir::new("strategies");
        let (full_path, ckpt) = (dir.join("model.safetensors"), dir.join("ckpt"));
        let (fp, c) = (full_path.clone(), ckpt.clone());
        let saved = run_ranks(world, move |rank, pg| {
            let comm: Comm = match shard {
                Some(f) => DeviceMesh::new(pg, f).unwrap().into(),
                None => pg.into(),
            };
            let (dev, fsdp) = wrap_with(rank, comm, SEED, strategy, blocks());
            train_sgd(&fsdp, &dev, rank, world, 0..1);
            let r0 = state_dict::full_state_dict(&fsdp, true).unwrap();
            state_dict::save_full(&fsdp, &fp).unwrap();
            state_dict::save_sharded(&fsdp, &c).unwrap();
            (r0.is_empty(), gathered(&fsdp))
        });
        // Only global rank 0 keeps a rank0_only dict.
        let empties: Vec<bool> = saved.iter().map(|(e, _)| *e).collect();
        let mut expected = vec![true; world];
        expected[0] = false;
        assert_eq!(empties, expected, "{strategy:?}");
        // One data file per distinct shard.
        let files = std::fs::read_dir(&ckpt)
            .unwrap()
            .filter(|e| {
                let n = e.as_ref().unwrap().file_name().into_string().unwrap();
                n.starts_with("rank-") && !n.contains(".pieces.")
            })
            .count();
        assert_eq!(files, shard.unwrap_or(1), "{strategy:?}");
        let params = saved[0].1.clone();
        let out = run_ranks(3, move |rank, pg| {
            let (_, fsdp) = wrap(rank, pg, SEED + 9, blocks());
            state_dict::load_full(&fsdp, &full_path).unwrap();
            let from_full = gathered(&fsdp);
            let (_, fsdp) = wrap(rank, Arc::clone(fsdp.shard_group()), SEED + 9, blocks());
            state_dict::load_sharded(&fsdp, &ckpt).unwrap();
            (from_full, gathered(&fsdp))
        });
        for (a, b) in &out {
            assert_same(&format!("{strategy:?} full -> FullShard W=3"), a, &params);
            assert_same(
                &format!("{strategy:?} sharded -> FullShard W=3"),
                b,
                &params,
            );
        }
    }
}

// ------------------------------------------------------------------------------- optimizer

fn steps_of(st: &OptimState) -> Vec<u64> {
    st.steps.clone()
}

#[test]
fn optimizer_state_reshards_from_4_to_3_and_2_and_momentum_training_continues_like_local() {
    let dir = TempDir::new("optim");
    let (model_path, optim_path, optim_dir, model_dir) = (
        dir.join("model.safetensors"),
        dir.join("optim.safetensors"),
        dir.join("optim-sharded"),
        dir.join("model-sharded"),
    );
    let (mp, op, od, md) = (
        model_path.clone(),
        optim_path.clone(),
        optim_dir.clone(),
        model_dir.clone(),
    );
    let saved = run_ranks(4, move |rank, pg| {
        let (dev, fsdp) = wrap(rank, pg, SEED, blocks());
        let mut st = OptimState {
            steps: Vec::new(),
            slots: Vec::new(),
        };
        train_momentum(&fsdp, &mut st, &dev, rank, 4, 0..K);
        let full = state_dict::full_optim_state_dict(&fsdp, &st, false).unwrap();
        let r0 = state_dict::full_optim_state_dict(&fsdp, &st, true).unwrap();
        let sharded = state_dict::sharded_optim_state_dict(&fsdp, &st).unwrap();
        state_dict::save_full(&fsdp, &mp).unwrap();
        state_dict::save_full_optim(&fsdp, &st, &op).unwrap();
        state_dict::save_sharded(&fsdp, &md).unwrap();
        state_dict::save_sharded_optim(&fsdp, &st, &od).unwrap();
        (full, r0, sharded, gathered(&fsdp), steps_of(&st))
    });
    let (full, _, _, params, steps) = &saved[0];
    assert_eq!(steps, &vec![K as u64; 3], "three units, K steps each");
    // The gathered momentum buffers equal the local optimizer's, bitwise.
    let local_at_k = local_momentum(&[(4, 0..K)]);
    assert_same("params at the checkpoint", params, &local_at_k[0].0);
    assert_eq!(full.slots.len(), 1);
    assert_eq!(full.slots[0].0, SLOT);
    let bufs: Named = sorted(
        full.slots[0]
            .1
            .iter()
            .map(|e| (e.name.clone(), e.values.clone()))
            .collect(),
    );
    assert_same("momentum buffers vs local", &bufs, &local_at_k[0].1);
    assert!(full.steps.iter().all(|(_, n)| *n == K as u64));
    assert_eq!(full.steps.len(), params.len());
    for (r, (_, r0, _, _, _)) in saved.iter().enumerate() {
        assert_eq!(r0.slots[0].1.is_empty(), r != 0, "rank {r}");
        assert_eq!(&r0.steps, &full.steps, "step counts on every rank");
    }
    let merged =
        ShardedOptimStateDict::merge(saved.iter().map(|(_, _, s, _, _)| s.clone())).unwrap();
    assert_eq!(ShardedOptimStateDict::load_dir(&optim_dir).unwrap(), merged);
    assert_eq!(
        state_dict::FullOptimStateDict::load(&optim_path).unwrap(),
        *full
    );

    // Resume at W=3 from the full files and at W=2 (root only) from the sharded directories.
    for (w2, policy, sharded) in [(3, blocks(), false), (2, WrapPolicy::RootOnly, true)] {
        let local = local_momentum(&[(4, 0..K), (w2, K..K + M)]);
        let (mp, op, md, od) = (
            model_path.clone(),
            optim_path.clone(),
            model_dir.clone(),
            optim_dir.clone(),
        );
        let out = run_ranks(w2, move |rank, pg| {
            let (dev, fsdp) = wrap(rank, pg, SEED + 11, policy.clone());
            let mut st = if sharded {
                state_dict::load_sharded(&fsdp, &md).unwrap();
                state_dict::load_sharded_optim(&fsdp, &od).unwrap()
            } else {
                state_dict::load_full(&fsdp, &mp).unwrap();
                state_dict::load_full_optim(&fsdp, &op).unwrap()
            };
            assert_eq!(st.steps, vec![K as u64; fsdp.num_units()]);
            assert_eq!(st.slots.len(), 1);
            assert!(st.slots[0].1.iter().all(|t| t.is_some()));
            train_momentum(&fsdp, &mut st, &dev, rank, w2, K..K + M);
            let bufs = state_dict::full_optim_state_dict(&fsdp, &st, false).unwrap();
            (gathered(&fsdp), bufs, st.steps.clone())
        });
        for (r, (after, bufs, steps)) in out.iter().enumerate() {
            assert_same(
                &format!("W={w2} rank {r}: resumed momentum training vs local"),
                after,
                &local[1].0,
            );
            let b: Named = sorted(
                bufs.slots[0]
                    .1
                    .iter()
                    .map(|e| (e.name.clone(), e.values.clone()))
                    .collect(),
            );
            assert_same(
                &format!("W={w2} rank {r}: momentum buffers"),
                &b,
                &local[1].1,
            );
            assert!(steps.iter().all(|&s| s == (K + M) as u64));
        }
    }
}

#[test]
fn optimizer_state_errors() {
    run_ranks(2, |rank, pg| {
        let (dev, fsdp) = wrap(rank, pg, SEED, blocks());
        let n = fsdp.num_units();
        let mut st = OptimState {
            steps: Vec::new(),
            slots: Vec::new(),
        };
        train_momentum(&fsdp, &mut st, &dev, rank, 2, 0..1);
        // Wrong number of per-unit tensors / step counts; a tensor of the wrong size.
        let mut bad = st.clone();
        bad.slots[0].1.pop();
        assert!(matches!(
            state_dict::sharded_optim_state_dict(&fsdp, &bad),
            Err(StateDictError::BadStateTensor { .. })
        ));
        let mut bad = st.clone();
        bad.steps.pop();
        assert!(matches!(
            state_dict::sharded_optim_state_dict(&fsdp, &bad),
            Err(StateDictError::Steps { .. })
        ));
        let mut bad = st.clone();
        bad.slots[0].1[0] = Some(Tensor::zeros(&[3], fsdp_alloc::DType::F32, &dev).unwrap());
        match state_dict::sharded_optim_state_dict(&fsdp, &bad) {
            Err(StateDictError::BadStateTensor { slot, unit, .. }) => {
                assert_eq!((slot.as_str(), unit), (SLOT, 0))
            }
            other => panic!("expected BadStateTensor, got {other:?}"),
        }
        let mut bad = st.clone();
        bad.slots[0].0 = "a/b".into();
        assert!(matches!(
            state_dict::sharded_optim_state_dict(&fsdp, &bad),
            Err(StateDictError::InvalidName { .. })
        ));
        // Units with no state load as None; a unit with state for only some parameters is
        // refused, naming a missing parameter.
        let mut partial = st.clone();
        partial.slots[0].1[1] = None;
        let full = state_dict::full_optim_state_dict(&fsdp, &partial, false).unwrap();
        let loaded = state_dict::load_full_optim_state_dict(&fsdp, &full).unwrap();
        assert!(loaded.slots[0].1[1].is_none() && loaded.slots[0].1[0].is_some());
        assert_eq!(loaded.slots[0].1.len(), n);
        let mut bad = full.clone();
        let unit0 = fsdp.units()[0].names.clone();
        bad.slots[0].1.retain(|e| e.name != unit0[0]);
        match state_dict::load_full_optim_state_dict(&fsdp, &bad) {
            Err(StateDictError::MissingEntry { name, .. }) => assert_eq!(name, unit0[0]),
            other => panic!("expected MissingEntry, got {other:?}"),
        }
        // Step counts that disagree inside one unit (after a change of wrap policy).
        let mut bad = state_dict::full_optim_state_dict(&fsdp, &st, false).unwrap();
        bad.steps[0].1 += 1;
        let (_, root_only) = wrap(
            rank,
            Arc::clone(fsdp.shard_group()),
            SEED,
            WrapPolicy::RootOnly,
        );
        match state_dict::load_full_optim_state_dict(&root_only, &bad) {
            Err(StateDictError::Steps { detail }) => {
                assert!(detail.contains("share unit"), "{detail}")
            }
            other => panic!("expected Steps, got {other:?}"),
        }
    });
}

// ----------------------------------------------------- the crate's optimizers, CPU offload

const ADAM_LR: f32 = 1e-2;

/// Local reference for one of the crate's optimizers: phases of (world size, steps), one model
/// and one optimizer throughout; the parameters after each phase.
fn local_with(
    phases: &[(usize, Range<usize>)],
    make: &dyn Fn(&Gpt) -> Box<dyn LocalOptimizer>,
) -> Vec<Named> {
    let dev = Device::cpu(902);
    let model = Gpt::new(&InitContext::eager(&dev, SEED), &cfg()).unwrap();
    let mut opt = make(&model);
    let mut out = Vec::new();
    for (w, steps) in phases {
        for step in steps.clone() {
            for r in 0..*w {
                let (x, y) = batch(step, r, &dev);
                micro_loss(&model.call(&x).unwrap(), &y, *w)
                    .backward()
                    .unwrap();
            }
            opt.step().unwrap();
            opt.zero_grad();
        }
        out.push(sorted(
            named_parameters(&model)
                .into_iter()
                .map(|(n, p)| (n, p.get().unwrap().to_vec::<f32>().unwrap()))
                .collect(),
        ));
    }
    out
}

fn train_opt(
    fsdp: &Fsdp<Gpt>,
    opt: &mut dyn ShardedOptimizer,
    dev: &Device,
    rank: usize,
    world: usize,
    steps: Range<usize>,
) {
    for step in steps {
        forward_backward(fsdp, dev, step, rank, world);
        opt.step(fsdp).unwrap();
        opt.zero_grad(fsdp);
    }
}

#[test]
fn adamw_checkpoint_at_4_resumes_at_3_and_2_like_an_uninterrupted_local_run() {
    let dir = TempDir::new("adamw");
    let (model_path, optim_path, model_dir, optim_dir) = (
        dir.join("model.safetensors"),
        dir.join("optim.safetensors"),
        dir.join("model-sharded"),
        dir.join("optim-sharded"),
    );
    let (mp, op, md, od) = (
        model_path.clone(),
        optim_path.clone(),
        model_dir.clone(),
        optim_dir.clone(),
    );
    run_ranks(4, move |rank, pg| {
        let (dev, fsdp) = wrap(rank, pg, SEED, blocks());
        let mut opt = AdamW::new(ADAM_LR);
        train_opt(&fsdp, &mut opt, &dev, rank, 4, 0..K);
        let st = OptimState {
            steps: opt.step_counts(),
            slots: opt.state(),
        };
        state_dict::save_full(&fsdp, &mp).unwrap();
        state_dict::save_full_optim(&fsdp, &st, &op).unwrap();
        state_dict::save_sharded(&fsdp, &md).unwrap();
        state_dict::save_sharded_optim(&fsdp, &st, &od).unwrap();
    });
    let full = state_dict::FullOptimStateDict::load(&optim_path).unwrap();
    let slots: Vec<&str> = full.slots.iter().map(|(s, _)| s.as_str()).collect();
    assert_eq!(slots, ["exp_avg", "exp_avg_sq"]);

    let adamw = |m: &Gpt| -> Box<dyn LocalOptimizer> {
        Box::new(LocalAdamW::new(parameters(m), AdamParams::new(ADAM_LR)))
    };
    for (w2, policy, sharded) in [(3, blocks(), false), (2, WrapPolicy::RootOnly, true)] {
        let local = local_with(&[(4, 0..K), (w2, K..K + M)], &adamw);
        let (mp, op, md, od) = (
            model_path.clone(),
            optim_path.clone(),
            model_dir.clone(),
            optim_dir.clone(),
        );
        let out = run_ranks(w2, move |rank, pg| {
            let (dev, fsdp) = wrap(rank, pg, SEED + 21, policy.clone());
            let st = if sharded {
                state_dict::load_sharded(&fsdp, &md).unwrap();
                state_dict::load_sharded_optim(&fsdp, &od).unwrap()
            } else {
                state_dict::load_full(&fsdp, &mp).unwrap();
                state_dict::load_full_optim(&fsdp, &op).unwrap()
            };
            let mut opt = AdamW::new(ADAM_LR);
            opt.load_state(&fsdp, st.slots, st.steps).unwrap();
            assert_eq!(opt.step_counts(), vec![K as u64; fsdp.num_units()]);
            train_opt(&fsdp, &mut opt, &dev, rank, w2, K..K + M);
            gathered(&fsdp)
        });
        for (r, after) in out.iter().enumerate() {
            assert_same(
                &format!("W={w2} rank {r}: AdamW resumed from a checkpoint vs local"),
                after,
                &local[1],
            );
        }
    }
}

fn wrap_offload(rank: usize, pg: Arc<dyn ProcessGroup>, seed: u64) -> (Device, Fsdp<Gpt>) {
    let dev = Device::cpu(rank);
    let model = Gpt::new(&InitContext::eager(&dev, seed), &cfg()).unwrap();
    let config = FsdpConfig {
        wrap_policy: blocks(),
        cpu_offload: Some(Device::cpu(700 + rank)),
        ..FsdpConfig::default()
    };
    let fsdp = Fsdp::wrap(model, &dev, pg, config).unwrap();
    (dev, fsdp)
}

#[test]
fn cpu_offload_checkpoints_load_without_offload_and_back() {
    let dir = TempDir::new("offload");
    let sgd = |m: &Gpt| -> Box<dyn LocalOptimizer> {
        Box::new(LocalSgd::new(parameters(m), LR).with_momentum(MU))
    };
    // Offloaded W=2 saves; plain W=3 resumes from the full files.
    let (mp, op) = (dir.join("m.safetensors"), dir.join("o.safetensors"));
    let (a, b) = (mp.clone(), op.clone());
    run_ranks(2, move |rank, pg| {
        let (dev, fsdp) = wrap_offload(rank, pg, SEED);
        let mut opt = Sgd::new(LR).with_momentum(MU);
        train_opt(&fsdp, &mut opt, &dev, rank, 2, 0..K);
        let st = OptimState {
            steps: opt.step_counts(),
            slots: opt.state(),
        };
        state_dict::save_full(&fsdp, &a).unwrap();
        state_dict::save_full_optim(&fsdp, &st, &b).unwrap();
    });
    let local = local_with(&[(2, 0..K), (3, K..K + M), (2, K + M..K + 2 * M)], &sgd);
    // Plain W=3 resumes from the full files and saves sharded.
    let (md, od) = (dir.join("m-sharded"), dir.join("o-sharded"));
    let (c, d) = (md.clone(), od.clone());
    let out = run_ranks(3, move |rank, pg| {
        let (dev, fsdp) = wrap(rank, pg, SEED + 31, blocks());
        state_dict::load_full(&fsdp, &mp).unwrap();
        let st = state_dict::load_full_optim(&fsdp, &op).unwrap();
        let mut opt = Sgd::new(LR).with_momentum(MU);
        opt.load_state(&fsdp, st.slots, st.steps).unwrap();
        train_opt(&fsdp, &mut opt, &dev, rank, 3, K..K + M);
        let st = OptimState {
            steps: opt.step_counts(),
            slots: opt.state(),
        };
        state_dict::save_sharded(&fsdp, &c).unwrap();
        state_dict::save_sharded_optim(&fsdp, &st, &d).unwrap();
        gathered(&fsdp)
    });
    assert_same(
        "plain W=3 resumed from an offloaded run",
        &out[0],
        &local[1],
    );
    // Offloaded W=2 resumes from the sharded directories.
    let out = run_ranks(2, move |rank, pg| {
        let (dev, fsdp) = wrap_offload(rank, pg, SEED + 32);
        state_dict::load_sharded(&fsdp, &md).unwrap();
        let st = state_dict::load_sharded_optim(&fsdp, &od).unwrap();
        assert!(st
            .slots
            .iter()
            .flat_map(|(_, t)| t.iter().flatten())
            .all(|t| t.device() == fsdp.shard_device()));
        let mut opt = Sgd::new(LR).with_momentum(MU);
        opt.load_state(&fsdp, st.slots, st.steps).unwrap();
        train_opt(&fsdp, &mut opt, &dev, rank, 2, K + M..K + 2 * M);
        gathered(&fsdp)
    });
    assert_same("offloaded W=2 resumed from a plain run", &out[0], &local[2]);
}

#[test]
fn tied_parameters_are_saved_once_and_resume_like_local() {
    // The tied embedding/head weight lives in one unit (the root, their common ancestor); the
    // state dict lists it once, under the name a plain model's named_parameters gives it.
    let tied = cfg().with_tied(true);
    let dir = TempDir::new("tied");
    let path = dir.join("tied.safetensors");
    let p = path.clone();
    let saved = run_ranks(2, move |rank, pg| {
        let dev = Device::cpu(rank);
        let model = Gpt::new(&InitContext::eager(&dev, SEED), &tied).unwrap();
        let config = FsdpConfig {
            wrap_policy: WrapPolicy::Paths(vec!["tok_emb".into(), "head".into()]),
            ..FsdpConfig::default()
        };
        let fsdp = Fsdp::wrap(model, &dev, pg, config).unwrap();
        train_sgd(&fsdp, &dev, rank, 2, 0..K);
        state_dict::save_full(&fsdp, &p).unwrap();
        state_dict::full_state_dict(&fsdp, false).unwrap()
    });
    let dev = Device::cpu(970);
    let plain = Gpt::new(&InitContext::eager(&dev, SEED), &tied).unwrap();
    let mut names: Vec<String> = named_parameters(&plain)
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    names.sort();
    let mut saved_names: Vec<String> = saved[0].entries.iter().map(|e| e.name.clone()).collect();
    saved_names.sort();
    assert_eq!(saved_names, names);

    let local = local_sgd_with(&tied, &[(2, 0..K), (3, K..K + M)]);
    assert_same("tied, at the checkpoint", &named(&saved[0]), &local[0]);
    let out = run_ranks(3, move |rank, pg| {
        let dev = Device::cpu(rank);
        let model = Gpt::new(&InitContext::eager(&dev, SEED + 41), &tied).unwrap();
        let config = FsdpConfig {
            wrap_policy: blocks(),
            ..FsdpConfig::default()
        };
        let fsdp = Fsdp::wrap(model, &dev, pg, config).unwrap();
        state_dict::load_full(&fsdp, &path).unwrap();
        train_sgd(&fsdp, &dev, rank, 3, K..K + M);
        gathered(&fsdp)
    });
    assert_same("tied, resumed at W=3 vs local", &out[0], &local[1]);
}

#[test]
fn a_failed_write_is_reported_on_every_rank() {
    // The checkpoint's parent "directory" is a file: the writers fail, and the ranks that did
    // not write learn it from the closing all-reduce instead of returning success.
    let dir = TempDir::new("peer-failed");
    std::fs::create_dir_all(&dir.0).unwrap();
    let blocker = dir.join("blocker");
    std::fs::write(&blocker, b"not a directory").unwrap();
    let b = blocker.clone();
    let results = run_ranks(3, move |rank, pg| {
        let (_, fsdp) = wrap(rank, pg, SEED, blocks());
        let full = state_dict::save_full(&fsdp, b.join("model.safetensors"));
        let sharded = state_dict::save_sharded(&fsdp, b.join("ckpt"));
        (format!("{full:?}"), format!("{sharded:?}"))
    });
    for (rank, (full, sharded)) in results.iter().enumerate() {
        if rank == 0 {
            assert!(
                full.starts_with("Err(Io"),
                "rank 0 writes the full file: {full}"
            );
        } else {
            assert!(full.starts_with("Err(PeerFailed"), "rank {rank}: {full}");
        }
        // Every rank writes its own sharded file, so every rank fails itself.
        assert!(sharded.starts_with("Err(Io"), "rank {rank}: {sharded}");
    }
}
