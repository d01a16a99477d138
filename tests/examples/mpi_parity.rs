//! The parity suite across processes: FSDP over MPI equals FSDP over the thread backend bit for
//! bit. Run under an MPI launcher (`cargo xtask mpi-test` does it for W = 1…4):
//!
//! ```text
//! cargo build -p fsdp-tests --features mpi --example mpi_parity
//! mpirun -n 4 --oversubscribe target/debug/examples/mpi_parity
//! ```
//!
//! Every process is one FSDP rank over [`MpiGroup`]; it also runs the same configuration on a
//! W-thread [`fsdp_collectives::ThreadGroup`] in-process and compares its own rank's per-step
//! losses and final (gathered) parameters bit for bit. Configurations: FullShard, ShardGradOp,
//! NoShard, HybridShard (F = 2 at W = 4), bf16 mixed precision, gradient accumulation with
//! `no_sync`, int8 quantized collectives (all-to-all on the wire); and at W = 4 a sharded state dict saved by the MPI run loads in a W = 3 thread run
//! with identical parameters. FullShard, bf16 and HybridShard also run over MPI through
//! [`HostStaged`] (the host staging GPU ranks on MPI use, here with CPU devices): bit-equal too.
//!
//! `--kill-test DIR`: write `DIR/rank<r>.pid` and train until killed (for the fault test of
//! `cargo xtask mpi-test`, which `kill -9`s one rank and expects the whole job to end).

use std::path::PathBuf;
use std::sync::Arc;

use fsdp_alloc::{DType, Device};
use fsdp_autograd::nn::{Gpt, GptConfig};
use fsdp_autograd::InitContext;
use fsdp_collectives::{DeviceMesh, HostStaged, MpiGroup, ProcessGroup};
use fsdp_core::{
    state_dict, Comm, Fsdp, FsdpConfig, MixedPrecision, Quantization, ShardingStrategy, WrapPolicy,
};
use fsdp_tests::{first_difference, full_named, micro_loss, run_on, token_tensors, Named, Ranks};

const SEED: u64 = 2024;
const STEPS: usize = 3;
const MICRO: usize = 2;
const LR: f32 = 0.05;

fn cfg() -> GptConfig {
    GptConfig::new(19, 12, 2, 2, 6)
}

#[derive(Clone, Debug)]
struct Case {
    name: &'static str,
    strategy: ShardingStrategy,
    shard: Option<usize>,
    mixed: Option<MixedPrecision>,
    no_sync: bool,
    quant: Option<Quantization>,
}

fn config(case: &Case) -> FsdpConfig {
    FsdpConfig {
        strategy: case.strategy,
        wrap_policy: WrapPolicy::ModuleTypes(vec!["Block".into()]),
        mixed_precision: case.mixed,
        quantize_collectives: case.quant,
        ..FsdpConfig::default()
    }
}

fn wrap(dev: &Device, pg: Arc<dyn ProcessGroup>, case: &Case, seed: u64) -> Fsdp<Gpt> {
    let model = Gpt::new(&InitContext::eager(dev, seed), &cfg()).unwrap();
    let comm: Comm = match case.shard {
        Some(f) => DeviceMesh::new(pg, f).unwrap().into(),
        None => pg.into(),
    };
    Fsdp::wrap(model, dev, comm, config(case)).unwrap()
}

/// Trains `case` on `ranks`; per local rank: (every micro-batch's loss, final full parameters).
fn train(ranks: &Ranks, case: &Case) -> Vec<(usize, (Vec<f32>, Named))> {
    let world = ranks.world();
    let case = case.clone();
    run_on(ranks, move |rank, pg| {
        let dev = Device::cpu(rank);
        let fsdp = wrap(&dev, pg, &case, SEED);
        let c = cfg();
        let micros = if case.no_sync { MICRO } else { 1 };
        let mut losses = Vec::new();
        for step in 0..STEPS {
            for m in 0..micros {
                let (x, y) = token_tensors(
                    (step * world + rank) * micros + m,
                    2,
                    c.seq_len,
                    c.vocab,
                    &dev,
                );
                let run = || {
                    let loss = micro_loss(&fsdp.forward(&x).unwrap(), &y, world * micros);
                    loss.backward().unwrap();
                    loss.item().unwrap()
                };
                // All micro-batches but the last accumulate locally without communication.
                let l = if m + 1 < micros {
                    fsdp.no_sync(run)
                } else {
                    run()
                };
                losses.push(l);
            }
            fsdp.sgd_step(LR).unwrap();
            fsdp.zero_grad();
        }
        fsdp.synchronize().unwrap();
        (losses, full_named(&fsdp))
    })
}

fn cases(world: usize) -> Vec<Case> {
    let base = Case {
        name: "FullShard",
        strategy: ShardingStrategy::FullShard,
        shard: None,
        mixed: None,
        no_sync: false,
        quant: None,
    };
    let mut v = vec![
        base.clone(),
        Case {
            name: "ShardGradOp",
            strategy: ShardingStrategy::ShardGradOp,
            ..base.clone()
        },
        Case {
            name: "NoShard",
            strategy: ShardingStrategy::NoShard,
            ..base.clone()
        },
        Case {
            name: "FullShard bf16 mixed precision",
            mixed: Some(MixedPrecision::uniform(DType::BF16)),
            ..base.clone()
        },
        Case {
            name: "FullShard gradient accumulation with no_sync",
            no_sync: true,
            ..base.clone()
        },
        // Not equal to local training, but the same on both backends (the codec and the
        // rank-ordered sum run in fsdp-core; MPI moves the int8 packets with all-to-all).
        Case {
            name: "FullShard int8 quantized collectives (block 8)",
            quant: Some(Quantization::Int8 { block: 8 }),
            ..base.clone()
        },
    ];
    if world % 2 == 0 {
        v.push(Case {
            name: "HybridShard F=2",
            strategy: ShardingStrategy::HybridShard,
            shard: Some(2),
            ..base
        });
    }
    v
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn scratch_dir(tag: &str) -> PathBuf {
    // One directory per job, the same on every rank (also on the emulated two-node cluster,
    // whose nodes share this machine's file system but not a launcher daemon): OpenMPI's job
    // id, else the parent (the launcher's daemon, shared by the processes of one local job).
    let job = std::env::var("OMPI_MCA_ess_base_jobid")
        .unwrap_or_else(|_| std::os::unix::process::parent_id().to_string());
    std::env::temp_dir().join(format!("fsdp-mpi-parity-{tag}-{job}"))
}

fn state_dict_across_world_sizes(mpi: &Arc<dyn ProcessGroup>) {
    let case = cases(4).remove(0);
    let dir = scratch_dir("sharded");
    let rank = mpi.rank();
    if rank == 0 {
        let _ = std::fs::remove_dir_all(&dir);
    }
    mpi.barrier().unwrap();
    let saved: Named = {
        let dev = Device::cpu(rank);
        let fsdp = wrap(&dev, Arc::clone(mpi), &case, SEED);
        let c = cfg();
        let (x, y) = token_tensors(rank, 2, c.seq_len, c.vocab, &dev);
        let loss = micro_loss(&fsdp.forward(&x).unwrap(), &y, 4);
        loss.backward().unwrap();
        fsdp.sgd_step(LR).unwrap();
        fsdp.synchronize().unwrap();
        state_dict::save_sharded(&fsdp, &dir).unwrap();
        full_named(&fsdp)
    };
    mpi.barrier().unwrap();
    if rank == 0 {
        let dir2 = dir.clone();
        let loaded = run_on(&Ranks::Threads(3), move |r, pg| {
            // Another seed: the values must come from the checkpoint.
            let fsdp = wrap(&Device::cpu(r), pg, &case, SEED + 1);
            state_dict::load_sharded(&fsdp, &dir2).unwrap();
            full_named(&fsdp)
        });
        for (r, p) in loaded {
            if let Some(d) = first_difference(&saved, &p) {
                panic!(
                    "sharded state dict saved by MPI W=4, loaded by thread rank {r} of W=3: {d}"
                );
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        println!(
            "mpi_parity: sharded state dict saved at W=4 (MPI) loads at W=3 (threads): identical"
        );
    }
    mpi.barrier().unwrap();
}

fn kill_test(mpi: Arc<dyn ProcessGroup>, dir: PathBuf) {
    let rank = mpi.rank();
    let world = mpi.size();
    let case = cases(world).remove(0);
    let dev = Device::cpu(rank);
    let fsdp = wrap(&dev, mpi, &case, SEED);
    let c = cfg();
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join(format!("rank{rank}.pid")),
        std::process::id().to_string(),
    )
    .unwrap();
    for step in 0.. {
        let (x, y) = token_tensors(step * world + rank, 2, c.seq_len, c.vocab, &dev);
        let loss = micro_loss(&fsdp.forward(&x).unwrap(), &y, world);
        loss.backward().unwrap();
        fsdp.sgd_step(LR).unwrap();
        fsdp.zero_grad();
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mpi = MpiGroup::world().unwrap_or_else(|e| panic!("MPI world: {e}"));
    let shm = mpi.uses_shared_memory();
    let hier = mpi.uses_hierarchical();
    if std::env::var("FSDP_EXPECT_LAYOUT").as_deref() == Ok("hierarchical") {
        assert!(hier, "expected the hierarchical (two-node) path: {mpi:?}");
    }
    let mpi: Arc<dyn ProcessGroup> = Arc::new(mpi);
    if let [flag, dir] = args.as_slice() {
        if flag == "--kill-test" {
            return kill_test(mpi, PathBuf::from(dir));
        }
    }
    let (rank, world) = (mpi.rank(), mpi.size());
    for case in cases(world) {
        let over_mpi = train(&Ranks::Process(Arc::clone(&mpi)), &case);
        let (_, (mpi_losses, mpi_params)) = &over_mpi[0];
        let threads = train(&Ranks::Threads(world), &case);
        let (_, (t_losses, t_params)) = &threads[rank];
        assert_eq!(
            bits(mpi_losses),
            bits(t_losses),
            "{}: W={world} rank {rank}: losses over MPI {mpi_losses:?} vs threads {t_losses:?}",
            case.name
        );
        if let Some(d) = first_difference(mpi_params, t_params) {
            panic!(
                "{}: W={world} rank {rank}: parameters differ: {d}",
                case.name
            );
        }
        // Host staging over MPI (what GPU ranks on MPI use), for a subset of the cases.
        if case.name == "FullShard" || case.name.starts_with("HybridShard") || case.mixed.is_some()
        {
            let staging = Device::cpu(20_000 + rank);
            let staged: Arc<dyn ProcessGroup> =
                Arc::new(HostStaged::new(Arc::clone(&mpi), staging).unwrap());
            let over_staged = train(&Ranks::Process(staged), &case);
            let (_, (s_losses, s_params)) = &over_staged[0];
            assert_eq!(
                bits(s_losses),
                bits(t_losses),
                "{} (host-staged): W={world} rank {rank}: losses {s_losses:?} vs threads \
                 {t_losses:?}",
                case.name
            );
            if let Some(d) = first_difference(s_params, t_params) {
                panic!(
                    "{} (host-staged): W={world} rank {rank}: parameters differ: {d}",
                    case.name
                );
            }
            if rank == 0 {
                println!(
                    "mpi_parity: W={world} {} over MPI with host staging: bit-equal",
                    case.name
                );
            }
        }
        mpi.barrier().unwrap();
        if rank == 0 {
            println!(
                "mpi_parity: W={world} ({}) {}: {} losses and every parameter bit-equal",
                if shm {
                    "shared memory"
                } else if hier {
                    "hierarchical, 2 nodes"
                } else {
                    "MPI collectives"
                },
                case.name,
                mpi_losses.len()
            );
        }
    }
    if world == 4 {
        state_dict_across_world_sizes(&mpi);
    }
}
