//! `cargo xtask gpu-test` suite 3 of 4 (**fsdp**): FSDP GPT-mini on one GPU and on every visible
//! GPU (NCCL, a thread per GPU) against the same run on CPU thread ranks — per-step losses within
//! 1e-4 relative over 20 AdamW steps in f32; in bf16 within the largest relative difference
//! between the CPU bf16 and CPU f32 runs — and each GPU rank's peak allocated memory between
//! 0.95× the CPU run's allocator peak for the same rank and that peak plus the CUDA kernels'
//! scratch (see `gpu_extra_bytes`). FullShard, ShardGradOp, HybridShard (with ≥ 4 GPUs) and
//! bf16 parameters.
//!
//! **Never run on a GPU** (written where none exists): `#[ignore]`d and gated on
//! `FSDP_GPU_TESTS=1`. The model is created on the fake device and materialized by FSDP on the
//! rank's offload host (CPU offload: fsdp-core's optimizer kernels run on host memory), so every
//! rank generates its own shards.
#![cfg(feature = "cuda")]

use std::sync::Arc;
use std::time::Duration;

use fsdp_alloc::{DType, Device, DeviceConfig, DeviceId};
use fsdp_autograd::nn::{Gpt, GptConfig};
use fsdp_autograd::InitContext;
use fsdp_collectives::{DeviceMesh, NcclConfig, NcclGroup, ProcessGroup, TcpStore};
use fsdp_core::optim::{AdamParams, AdamW, ShardedOptimizer};
use fsdp_core::{Comm, Fsdp, FsdpConfig, MixedPrecision, ShardingStrategy, WrapPolicy};
use fsdp_tests::{micro_loss, run_ranks, token_tensors};

const SEED: u64 = 77;
const STEPS: usize = 20;
const BATCH: usize = 4;

fn gpu_tests() -> bool {
    if std::env::var("FSDP_GPU_TESTS").as_deref() == Ok("1") {
        return true;
    }
    eprintln!("skipped: set FSDP_GPU_TESTS=1 on a machine with a GPU (cargo xtask gpu-test)");
    false
}

fn visible_gpus() -> usize {
    (0..64).take_while(|&i| Device::cuda(i).is_ok()).count()
}

fn cfg() -> GptConfig {
    GptConfig::mini()
}

fn adam() -> AdamParams {
    AdamParams {
        lr: 1e-3,
        betas: (0.9, 0.95),
        eps: 1e-8,
        weight_decay: 0.1,
    }
}

/// (per-step losses, peak allocated bytes) of one rank.
type RankRun = (Vec<f32>, usize);

fn train(rank: usize, world: usize, dev: &Device, comm: Comm, config: FsdpConfig) -> RankRun {
    // fsdp-core's optimizer kernels are host code, so GPU ranks keep shards, sharded gradients
    // and optimizer state on a CPU host device (CPU offload); the CPU reference runs the same
    // way, so losses and the compute device's peak memory compare like for like.
    // On a GPU the host is page-locked, as with `train_gpt --cpu-offload`: the shard uploads and
    // gradient downloads are asynchronous copies on the offload copy stream.
    let host = match dev.id() {
        DeviceId::Cuda(_) => {
            Device::cpu_pinned(10_000 + rank, DeviceConfig::default(), dev).unwrap()
        }
        _ => Device::cpu(10_000 + rank),
    };
    let config = FsdpConfig {
        cpu_offload: Some(host),
        ..config
    };
    let c = cfg();
    let model = Gpt::new(&InitContext::fake(SEED), &c).unwrap();
    let fsdp = Fsdp::wrap(model, dev, comm, config).unwrap();
    let mut opt = AdamW::with_params(adam());
    let mut losses = Vec::new();
    for step in 0..STEPS {
        if step == 1 {
            fsdp.synchronize().unwrap();
            dev.reset_peak_stats();
        }
        let (x, y) = token_tensors(step * world + rank, BATCH, c.seq_len, c.vocab, dev);
        let loss = micro_loss(&fsdp.forward(&x).unwrap(), &y, world);
        losses.push(loss.item().unwrap());
        loss.backward().unwrap();
        opt.step(&fsdp).unwrap();
        opt.zero_grad(&fsdp);
    }
    fsdp.synchronize().unwrap();
    (losses, dev.memory_stats().peak_allocated_bytes)
}

fn comm(pg: Arc<dyn ProcessGroup>, shard: Option<usize>) -> Comm {
    match shard {
        Some(f) => DeviceMesh::new(pg, f).unwrap().into(),
        None => pg.into(),
    }
}

fn on_cpu(world: usize, shard: Option<usize>, config: FsdpConfig) -> Vec<RankRun> {
    run_ranks(world, move |rank, pg| {
        let dev = Device::cpu(rank);
        train(rank, world, &dev, comm(pg, shard), config.clone())
    })
}

fn on_gpus(world: usize, shard: Option<usize>, config: FsdpConfig) -> Vec<RankRun> {
    let store = Arc::new(TcpStore::host("127.0.0.1:0", Duration::from_secs(120)).unwrap());
    let addr = store.addr().to_string();
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (store, addr, config) = (Arc::clone(&store), addr.clone(), config.clone());
            std::thread::spawn(move || {
                let own;
                let st: &TcpStore = if rank == 0 {
                    &store
                } else {
                    own = TcpStore::connect(&addr, Duration::from_secs(120)).unwrap();
                    &own
                };
                let dev = Device::cuda(rank).unwrap();
                let g: Arc<dyn ProcessGroup> =
                    Arc::new(NcclGroup::new(st, rank, world, NcclConfig::new(rank)).unwrap());
                train(rank, world, &dev, comm(g, shard), config)
            })
        })
        .collect();
    handles
        .into_iter()
        .enumerate()
        .map(|(r, h)| h.join().unwrap_or_else(|_| panic!("GPU rank {r} failed")))
        .collect()
}

/// Bytes a CUDA rank may hold beyond the CPU run's allocator peak, stated as a model rather than
/// a ratio (issue #24 measured 1.078× for FullShard and 1.105× for ShardGradOp against a 1.05×
/// bound). Both devices use the same caching allocator, so its 512-byte rounding and segment
/// sizes are in both peaks already; cuBLAS's workspace is allocated by cuBLAS/cudarc from the
/// driver, not through our allocator, so it is not in `peak_allocated_bytes` at all. What the
/// GPU adds is the CUDA kernels' scratch taken from the device allocator, which the CPU kernels
/// do not need:
/// - attention backward's score-gradient buffer, `batch · heads · t · t` f32 (the largest; the
///   fused attention of issue #25 removes it, and the bound still holds then);
/// - small per-launch scratch (partial sums of reductions, the embedding's error slot), each
///   rounded to 512 B: at most 2 MiB alive at once is allowed for them.
fn gpu_extra_bytes() -> usize {
    let c = cfg();
    let attention_scratch = BATCH * c.n_heads * c.seq_len * c.seq_len * 4;
    attention_scratch + (2 << 20)
}

/// The loss tolerance of one comparison, relative to the CPU loss.
#[derive(Clone, Copy, Debug)]
enum LossTol {
    /// A fixed relative tolerance (f32 runs: 1e-4).
    Rel(f32),
    /// Derived from the run itself: the largest relative difference between the CPU run in the
    /// configured (bf16) precision and the same CPU run in f32. A GPU bf16 run may differ from
    /// the CPU bf16 run by as much as bf16 itself moves the losses, not more: bf16 rounds
    /// differently on different hardware (issue #24 measured 0.47% at one step), so 1e-4 is not
    /// a meaningful bound for it.
    FromF32Difference,
}

fn check(world: usize, shard: Option<usize>, config: FsdpConfig, tol: LossTol) {
    let want = on_cpu(world, shard, config.clone());
    let rel = match tol {
        LossTol::Rel(r) => r,
        LossTol::FromF32Difference => {
            let f32_run = on_cpu(
                world,
                shard,
                FsdpConfig {
                    mixed_precision: None,
                    ..config.clone()
                },
            );
            let mut worst = 0f32;
            for ((lo, _), (hi, _)) in want.iter().zip(&f32_run) {
                for (l, h) in lo.iter().zip(hi) {
                    worst = worst.max((l - h).abs() / h.abs());
                }
            }
            eprintln!(
                "W={world}: CPU bf16 vs CPU f32 differ by up to {worst:.3e} relative; \
                 the GPU bf16 run is held to that"
            );
            assert!(
                worst > 0.0,
                "bf16 and f32 CPU runs are identical: the config is not bf16"
            );
            worst
        }
    };
    let got = on_gpus(world, shard, config.clone());
    let extra = gpu_extra_bytes();
    for (rank, ((gl, gpeak), (cl, cpeak))) in got.iter().zip(&want).enumerate() {
        for (step, (g, c)) in gl.iter().zip(cl).enumerate() {
            assert!(
                (g - c).abs() <= rel * c.abs(),
                "W={world} {config:?} rank {rank} step {step}: GPU loss {g} vs CPU {c} \
                 (allowed {rel:.3e} relative)"
            );
        }
        let ratio = *gpeak as f64 / *cpeak as f64;
        eprintln!(
            "W={world} rank {rank}: GPU peak {gpeak} B, CPU peak {cpeak} B (ratio {ratio:.3}), \
             modelled GPU extra up to {extra} B"
        );
        assert!(
            *gpeak as f64 >= 0.95 * *cpeak as f64 && *gpeak <= *cpeak + extra,
            "W={world} {config:?} rank {rank}: GPU peak {gpeak} B vs CPU model {cpeak} B + \
             GPU kernel scratch {extra} B (ratio {ratio:.3})"
        );
    }
}

fn blocks(strategy: ShardingStrategy) -> FsdpConfig {
    FsdpConfig {
        strategy,
        wrap_policy: WrapPolicy::ModuleTypes(vec!["Block".into()]),
        ..FsdpConfig::default()
    }
}

#[test]
#[ignore = "needs CUDA GPUs and NCCL: run `cargo xtask gpu-test` (FSDP_GPU_TESTS=1)"]
fn gpt_mini_on_one_gpu_and_on_all_gpus_matches_cpu_threads() {
    if !gpu_tests() {
        return;
    }
    let n = visible_gpus();
    assert!(
        n >= 1,
        "FSDP_GPU_TESTS=1 but no CUDA device could be opened"
    );
    let mut worlds = vec![1];
    if n > 1 {
        worlds.push(n);
    }
    for &w in &worlds {
        check(
            w,
            None,
            blocks(ShardingStrategy::FullShard),
            LossTol::Rel(1e-4),
        );
        check(
            w,
            None,
            blocks(ShardingStrategy::ShardGradOp),
            LossTol::Rel(1e-4),
        );
        check(
            w,
            None,
            FsdpConfig {
                mixed_precision: Some(MixedPrecision {
                    param_dtype: DType::BF16,
                    reduce_dtype: DType::F32,
                }),
                ..blocks(ShardingStrategy::FullShard)
            },
            LossTol::FromF32Difference,
        );
    }
    if n >= 4 {
        check(
            n,
            Some(2),
            blocks(ShardingStrategy::HybridShard),
            LossTol::Rel(1e-4),
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run `cargo xtask gpu-test` (FSDP_GPU_TESTS=1)"]
fn deferred_init_shards_on_a_gpu_equal_cpu_shards_bit_for_bit() {
    if !gpu_tests() {
        return;
    }
    let gpu = Device::cuda(0).expect("FSDP_GPU_TESTS=1 but cuda:0 could not be opened");
    let cpu = Device::cpu(0);
    let fake = Gpt::new(&InitContext::fake(SEED), &cfg()).unwrap();
    let unit = fsdp_autograd::nn::parameters(&fake);
    let shapes: Vec<Vec<usize>> = unit.iter().map(|p| p.shape().to_vec()).collect();
    let layout = fsdp_flatparam::FlatParamLayout::new(&shapes, 3).unwrap();
    let plan = fsdp_init::InitPlan::new(unit.clone()).unwrap();
    let bits = |t: &fsdp_autograd::Tensor| -> Vec<u32> {
        t.to_vec_f32()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    };
    for rank in 0..3 {
        let want = plan.materialize_shard(&unit, &layout, rank, &cpu).unwrap();
        let got = plan.materialize_shard(&unit, &layout, rank, &gpu).unwrap();
        assert_eq!(got.device().id(), gpu.id());
        assert_eq!(bits(&got), bits(&want), "rank {rank} (shard only)");
        let got = plan
            .materialize_unit_sharded(&unit, &layout, rank, &gpu)
            .unwrap();
        assert_eq!(bits(&got), bits(&want), "rank {rank} (unit by unit)");
    }
    // Whole parameters: the GPU model equals the eager CPU model.
    fsdp_init::materialize(&fake, &gpu).unwrap();
    let eager = Gpt::new(&InitContext::eager(&cpu, SEED), &cfg()).unwrap();
    for (a, b) in unit.iter().zip(fsdp_autograd::nn::parameters(&eager)) {
        let (ta, tb) = (a.get().unwrap(), b.get().unwrap());
        assert_eq!(ta.device().id(), gpu.id());
        assert_eq!(bits(&ta), bits(&tb), "{}", a.name());
    }
}
