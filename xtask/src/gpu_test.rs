//! `cargo xtask gpu-test [--list]`: the suite a GPU owner runs, and `cargo xtask nvrtc`.
//!
//! The suite was written on machines without a GPU; parts of it ran on one H100 once (issue
//! #24). The `shared-gpu` and `mpi-gpu` suites run W ranks on one GPU (issue #36); the steps
//! that need more GPUs (NCCL at W = 2..8, the 2-process launches) print `skipped: needs N GPUs`
//! below that. Without a GPU `gpu-test` says that no GPU was found and exits non-zero; it never
//! reports a pass. [`STEPS`] is the one list: `gpu-test` runs it through cargo, and
//! `gpu-bundle` (module `bundle`) builds its binaries and writes a `run.sh` that runs it.

use std::process::Command;

use crate::{cargo, cuda_test, run};

/// What one step of the GPU suite runs. The one list ([`STEPS`]) drives both `cargo xtask
/// gpu-test` (through cargo) and the bundle of `cargo xtask gpu-bundle` (prebuilt binaries run
/// by `run.sh`), so the two cannot drift apart.
#[derive(Clone, Copy, Debug)]
pub enum Exec {
    /// A test binary of package `pkg` (`test == None`: its library's unit tests; otherwise
    /// `tests/<test>.rs`), run with `args` after `--` and `FSDP_GPU_TESTS=1`.
    Test {
        pkg: &'static str,
        test: Option<&'static str>,
        args: &'static [&'static str],
    },
    /// `train_gpt` (package fsdp-train, feature `cuda`) with `args`; `{out}` in an argument is
    /// replaced by a scratch directory.
    TrainGpt { args: &'static [&'static str] },
    /// Two processes of the `gpu_nccl` test binary as ranks 0 and 1 of a torchrun-style job.
    Launch2,
    /// Two `train_gpt` processes (package fsdp-train, feature `cuda`) with `args`, as ranks 0
    /// and 1 of a torchrun-style job (`xtask gpu-launch-2 --train-gpt`).
    TrainGptLaunch2 { args: &'static [&'static str] },
    /// `xtask gpu-peer`: train_gpt beside the PyTorch FSDP2 peer (needs PyTorch with CUDA).
    Peer,
    /// `xtask gpu-train-compare WHICH`: train_gpt on ranks sharing one GPU against CPU thread
    /// ranks (`train_compare.rs`); `mpi` needs a train_gpt built with `cuda,mpi` and `mpirun`.
    TrainCompare { which: &'static str, mpi: bool },
}

/// One step of the GPU suite.
#[derive(Clone, Copy, Debug)]
pub struct Step {
    /// The suite it belongs to (one summary line per suite).
    pub suite: &'static str,
    /// What it checks.
    pub what: &'static str,
    /// Fewest visible GPUs it needs (skipped, and said so, below that).
    pub min_gpus: usize,
    /// How it runs.
    pub exec: Exec,
}

/// The test of the 2-process launch, run by each rank.
const LAUNCHED_TEST: &[&str] = &["--include-ignored", "--exact", "one_rank_of_a_launched_job"];

/// The GPU suite, in order.
pub const STEPS: &[Step] = &[
    Step {
        suite: "ops",
        what: "CUDA kernels vs CPU kernels, kernel level (emulator cases are not part of it: \
               they run in `ci`)",
        min_gpus: 1,
        exec: Exec::Test {
            pkg: "fsdp-autograd",
            test: None,
            args: &["kernels::cuda", "--include-ignored", "--skip", "emulated"],
        },
    },
    Step {
        suite: "ops",
        what: "every tensor op on CUDA vs CPU, forward + backward, f32/bf16/f16 (tolerances in \
               fsdp-autograd/tests/gpu_ops.rs; the CPU reference on one CPU device)",
        min_gpus: 1,
        exec: Exec::Test {
            pkg: "fsdp-autograd",
            test: Some("gpu_ops"),
            args: &["--include-ignored"],
        },
    },
    Step {
        suite: "ops",
        what: "train_gpt --device cuda with --dropout 0.1 (the dropout kernel at GPT-2's three \
               places, the composite attention with probability dropout, issue #38) for 3 steps \
               with --tensorboard, a checkpoint and --export-hf (resumes the previous run's \
               checkpoint if there is one)",
        min_gpus: 1,
        exec: Exec::TrainGpt {
            args: &[
                "--device",
                "cuda",
                "--d-model",
                "64",
                "--layers",
                "2",
                "--heads",
                "4",
                "--seq-len",
                "64",
                "--steps",
                "3",
                "--dropout",
                "0.1",
                "--eval-every",
                "3",
                "--tensorboard",
                "{out}/ecosystem-tb",
                "--checkpoint-dir",
                "{out}/ecosystem-ck",
                "--resume",
                "--export-hf",
                "{out}/ecosystem-hf",
            ],
        },
    },
    Step {
        suite: "ops",
        what: "train_gpt sample --device cuda from that checkpoint, greedy (the model's layers on \
               the GPU, the KV-cache attention on the host)",
        min_gpus: 1,
        exec: Exec::TrainGpt {
            args: &[
                "sample",
                "--checkpoint-dir",
                "{out}/ecosystem-ck",
                "--device",
                "cuda",
                "--max-new-tokens",
                "32",
                "--temperature",
                "0",
            ],
        },
    },
    Step {
        suite: "ops",
        what: "train_gpt sample --device cuda from that run's Hugging Face export (--init-from)",
        min_gpus: 1,
        exec: Exec::TrainGpt {
            args: &[
                "sample",
                "--init-from",
                "{out}/ecosystem-hf",
                "--device",
                "cuda",
                "--max-new-tokens",
                "32",
                "--temperature",
                "0",
            ],
        },
    },
    Step {
        suite: "attention",
        what: "tensor-core flash attention forward (mma.sync, flash_mma.cu) vs the CPU kernels: \
               bf16/f16, d 64/128, GQA, scale, packed == head-split bit for bit, outputs \
               poisoned before the run, the backward from its out/lse; needs compute \
               capability 8.0+ (kernels::cuda::tests::on_gpu::flash_attention_mma)",
        min_gpus: 1,
        exec: Exec::Test {
            pkg: "fsdp-autograd",
            test: None,
            args: &[
                "kernels::cuda::tests::on_gpu::flash_attention_mma",
                "--include-ignored",
            ],
        },
    },
    Step {
        suite: "attention",
        what: "attention memory scaling: peak memory of attention forward+backward at t = \
               1024, 2048, 4096 grows linearly in t (fsdp-autograd/tests/gpu_attention.rs, \
               attention_memory_linear_in_t)",
        min_gpus: 1,
        exec: Exec::Test {
            pkg: "fsdp-autograd",
            test: Some("gpu_attention"),
            args: &["--include-ignored", "attention_memory_linear_in_t"],
        },
    },
    Step {
        suite: "attention",
        what: "fused attention kernel times: forward and backward at batch 4, 12 heads, t = 1024, \
               d = 64 in f32 and bf16 (register-tiled kernels), bf16 with the tensor-core \
               forward and without it (`_cuda_cores`), bf16 at d = 128 (6 heads), and at d = 63 \
               (the generic kernels, the same run's baseline), CUDA events, one JSON line \
               (fwd_kernel, fwd_ms, bwd_ms, tflops, fwd_tflops) per case \
               (fsdp-autograd/tests/gpu_attention.rs, attention_kernel_times)",
        min_gpus: 1,
        exec: Exec::Test {
            pkg: "fsdp-autograd",
            test: Some("gpu_attention"),
            args: &["--include-ignored", "attention_kernel_times", "--nocapture"],
        },
    },
    Step {
        suite: "nccl",
        what: "all-gather, reduce-scatter sum/avg (f32, bf16), all-reduce, broadcast on every \
               visible GPU, one thread per GPU, with asserted results",
        min_gpus: 1,
        exec: Exec::Test {
            pkg: "fsdp-tests",
            test: Some("gpu_nccl"),
            args: &["--include-ignored", "threads"],
        },
    },
    Step {
        suite: "nccl",
        what: "one-rank NCCL group on host buffers (the communicator thread's host path), \
               creation errors; the group is dropped at the end (the drop joins its communicator \
               thread)",
        min_gpus: 1,
        exec: Exec::Test {
            pkg: "fsdp-collectives",
            test: Some("nccl"),
            args: &["--include-ignored"],
        },
    },
    Step {
        suite: "nccl",
        what: "2-process launch (RANK/WORLD_SIZE/MASTER_*), one rank per GPU",
        min_gpus: 2,
        exec: Exec::Launch2,
    },
    Step {
        suite: "nccl",
        what: "train_gpt --device cuda --backend nccl as a 2-process torchrun-style job \
               (RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT), one GPU per process, 20 \
               steps, exit code 0 on both ranks",
        min_gpus: 2,
        exec: Exec::TrainGptLaunch2 {
            args: &[
                "--device",
                "cuda",
                "--backend",
                "nccl",
                "--steps",
                "20",
                "--json",
            ],
        },
    },
    Step {
        suite: "shared-gpu",
        what: "thread ranks sharing one GPU (SharedGpuGroup): W = 2..4 ranks on cuda:0, each \
               with its own Device, vs the thread backend on CPU ranks from the same bytes: \
               every collective in f32/f16/bf16 (both accumulations)/i32/i64/u8, in-place \
               forms, misaligned offsets, bit for bit; collectives on two streams and a \
               consumer stream ordered by events, no host wait while issuing, per-rank \
               allocator statistics; misuse as the same typed error on every rank; one \
               --profile interval per rank and collective (fsdp-collectives \
               src/shared_gpu/gpu_tests.rs)",
        min_gpus: 1,
        exec: Exec::Test {
            pkg: "fsdp-collectives",
            test: None,
            args: &[
                "shared_gpu::gpu_tests",
                "--include-ignored",
                "--test-threads",
                "1",
            ],
        },
    },
    Step {
        suite: "shared-gpu",
        what: "train_gpt --device cuda --ranks 4 with one GPU visible (4 thread ranks sharing \
               it) vs train_gpt --ranks 4 on CPU thread ranks: FullShard, ShardGradOp and \
               HybridShard(F=2), f32 losses within 1e-4 relative over 20 AdamW steps, FullShard \
               bf16 within the CPU bf16-vs-f32 difference (at least one bf16 ulp); peak \
               allocated bytes per rank within the CPU peak + 1 MiB per live unsharded unit + \
               2 MiB (f32: at least 0.95x); --json backend shared-gpu; in the --profile trace \
               every rank's all-gather and reduce-scatter intervals overlap its compute kernels \
               (xtask gpu-train-compare shared-gpu)",
        min_gpus: 1,
        exec: Exec::TrainCompare {
            which: "shared-gpu",
            mpi: false,
        },
    },
    Step {
        suite: "mpi-gpu",
        what: "host staging on a GPU (HostStaged, the path of MPI processes sharing a GPU, over \
               the thread backend): 2 thread ranks on cuda:0 with page-locked staging, every \
               collective and in-place form up to 4 MiB from device buffers on CUDA streams, \
               bit for bit vs the thread backend on CPU ranks; one counted host wait per \
               collective; a consumer stream ordered by the work's event (fsdp-collectives \
               src/staged/gpu_tests.rs)",
        min_gpus: 1,
        exec: Exec::Test {
            pkg: "fsdp-collectives",
            test: None,
            args: &[
                "staged::gpu_tests",
                "--include-ignored",
                "--test-threads",
                "1",
            ],
        },
    },
    Step {
        suite: "mpi-gpu",
        what: "mpirun -n 2 train_gpt --backend mpi --device cuda with one GPU visible (both \
               processes on it, collectives staged through host memory) vs train_gpt --ranks 2 \
               on CPU thread ranks: FullShard and ShardGradOp, losses within 1e-4 relative over \
               20 AdamW steps, --json backend mpi (needs OpenMPI's mpirun and a train_gpt built \
               with cuda,mpi; xtask gpu-train-compare mpi-gpu)",
        min_gpus: 1,
        exec: Exec::TrainCompare {
            which: "mpi-gpu",
            mpi: true,
        },
    },
    Step {
        suite: "fsdp",
        what: "FSDP GPT-mini on 1 GPU and all GPUs vs CPU thread ranks: losses within 1e-4 \
               relative over 20 AdamW steps in f32, bf16 within the CPU run's own bf16-vs-f32 \
               difference (at least one bf16 ulp); peak memory per rank at most the CPU \
               allocator's peak plus the CUDA segment rounding and kernel scratch (f32: at least \
               0.95x the CPU peak); deferred-init shards on a GPU equal CPU shards bit for bit",
        min_gpus: 1,
        exec: Exec::Test {
            pkg: "fsdp-tests",
            test: Some("gpu_fsdp"),
            args: &[
                "--include-ignored",
                "--test-threads",
                "1",
                "--skip",
                "nccl_world_sizes_2_to_8",
            ],
        },
    },
    Step {
        suite: "fsdp",
        what: "FSDP GPT-mini over NCCL (a thread per GPU) at every W from 2 to min(visible \
               GPUs, 8) vs W CPU thread ranks: FullShard, and HybridShard(F=2) at even W >= 4; \
               f32 losses within 1e-4 relative over 20 AdamW steps, per-rank peak memory as in \
               the step above (tests/tests/gpu_fsdp.rs, nccl_world_sizes_2_to_8_match_cpu_threads)",
        min_gpus: 2,
        exec: Exec::Test {
            pkg: "fsdp-tests",
            test: Some("gpu_fsdp"),
            args: &[
                "--include-ignored",
                "--test-threads",
                "1",
                "nccl_world_sizes_2_to_8",
            ],
        },
    },
    Step {
        suite: "teardown",
        what: "clean shutdown: create-train-drop (device, NCCL group, FSDP GPT, AdamW) 20 \
               times in one process, then 20 short processes doing it once, every exit code 0",
        min_gpus: 1,
        exec: Exec::Test {
            pkg: "fsdp-tests",
            test: Some("gpu_teardown"),
            args: &["--include-ignored", "--test-threads", "1"],
        },
    },
    Step {
        suite: "bench",
        what: "train_gpt --device cuda: tokens/s and achieved TFLOP/s as one JSON line",
        min_gpus: 1,
        exec: Exec::TrainGpt {
            args: &["--device", "cuda", "--steps", "20", "--json"],
        },
    },
    Step {
        suite: "bench",
        what: "train_gpt --device cuda --model llama-1b under bf16 mixed precision (Llama 3.2 \
               1B's shape: 1.24B parameters, GQA 32/8 through the fused attention kernels, \
               RoPE, SiLU·mul, RMSNorm; seq 2048, batch 1, deferred init): tokens/s, achieved \
               TFLOP/s and peak memory as one JSON line",
        min_gpus: 1,
        exec: Exec::TrainGpt {
            args: &[
                "--device",
                "cuda",
                "--model",
                "llama-1b",
                "--batch",
                "1",
                "--steps",
                "5",
                "--mixed-precision",
                "bf16",
                "--deferred-init",
                "--json",
            ],
        },
    },
    Step {
        suite: "kernels",
        what: "kernel-time bench: one GPT-2 (124M, batch 4, seq 1024) step profiled with CUDA \
               events; per-kernel GPU time shares and the model FLOP rate against the GPU GEMM \
               probe at the same precision",
        min_gpus: 1,
        exec: Exec::TrainGpt {
            args: &[
                "--device",
                "cuda",
                "--model",
                "gpt2",
                "--batch",
                "4",
                "--steps",
                "3",
                "--profile",
                "{out}/gpt2-step.trace.json",
                "--kernel-times",
                "--json",
            ],
        },
    },
    Step {
        suite: "kernels",
        what: "kernel-time bench under bf16 mixed precision: the same GPT-2 step, kernel shares, \
               model FLOP rate against the GPU GEMM probe in bf16",
        min_gpus: 1,
        exec: Exec::TrainGpt {
            args: &[
                "--device",
                "cuda",
                "--model",
                "gpt2",
                "--batch",
                "4",
                "--steps",
                "3",
                "--mixed-precision",
                "bf16",
                "--profile",
                "{out}/gpt2-step-bf16.trace.json",
                "--kernel-times",
                "--json",
            ],
        },
    },
    Step {
        suite: "peer",
        what: "train_gpt --device cuda beside PyTorch FSDP2 on the same GPU (GPT-mini, the 25.6M \
               shape, GPT-2 f32 / TF32 / bf16 / CPU offload): step times, their ratio, peak \
               memory, as a table and one JSON line (needs Python with PyTorch for CUDA)",
        min_gpus: 1,
        exec: Exec::Peer,
    },
];

/// The names of the suites, in order of first appearance.
pub fn suites() -> Vec<&'static str> {
    let mut names: Vec<&'static str> = Vec::new();
    for s in STEPS {
        if !names.contains(&s.suite) {
            names.push(s.suite);
        }
    }
    names
}

/// Where the source of a test target lives (package directory, test file).
pub fn test_source(pkg: &str, test: Option<&str>) -> std::path::PathBuf {
    let dir = match pkg {
        "fsdp-tests" => "tests",
        other => other,
    };
    let root = crate::root().join(dir);
    match test {
        None => root.join("src/lib.rs"),
        Some(t) => root.join("tests").join(format!("{t}.rs")),
    }
}

/// The scratch directory of `gpu-test` (`{out}` in train_gpt arguments).
fn scratch() -> std::path::PathBuf {
    crate::root().join("target/gpu-test")
}

/// The cargo command of one step.
fn command(exec: &Exec) -> Command {
    match *exec {
        Exec::Test { pkg, test, args } => {
            let mut c = cargo();
            c.args(["test", "--release", "-p", pkg, "--features", "cuda"]);
            match test {
                None => c.arg("--lib"),
                Some(t) => c.args(["--test", t]),
            };
            c.arg("--").args(args).env("FSDP_GPU_TESTS", "1");
            c
        }
        Exec::TrainGpt { args } => {
            let out = scratch();
            let mut c = cargo();
            c.arg("run").args(crate::util::TRAIN_GPT_CUDA).arg("--");
            for a in args {
                c.arg(a.replace("{out}", &out.display().to_string()));
            }
            c
        }
        Exec::Launch2 => {
            let mut c = cargo();
            c.args(["run", "-p", "xtask", "--", "gpu-launch-2"]);
            c
        }
        Exec::TrainGptLaunch2 { args } => {
            let mut c = cargo();
            c.args([
                "run",
                "-p",
                "xtask",
                "--",
                "gpu-launch-2",
                "--train-gpt",
                "--",
            ])
            .args(args);
            c
        }
        Exec::Peer => {
            let mut c = cargo();
            c.args(["run", "-p", "xtask", "--", "gpu-peer"]);
            c
        }
        Exec::TrainCompare { which, .. } => {
            let mut c = cargo();
            c.args(["run", "-p", "xtask", "--", "gpu-train-compare", which]);
            c
        }
    }
}

/// Prints the suite without running anything.
pub fn list() -> Result<(), String> {
    let names = suites();
    println!(
        "cargo xtask gpu-test runs {} suites ({} steps; the same list as the bundle of `cargo \
         xtask gpu-bundle DIR`):",
        names.len(),
        STEPS.len()
    );
    for (i, name) in names.iter().enumerate() {
        println!("{}. {name}", i + 1);
        for s in STEPS.iter().filter(|s| s.suite == *name) {
            let need = if s.min_gpus > 1 {
                format!(" [needs {} GPUs]", s.min_gpus)
            } else {
                String::new()
            };
            println!("   - {}{need}\n     {:?}", s.what, command(&s.exec));
            if let Exec::Test { pkg, test, .. } = s.exec {
                if !test_source(pkg, test).exists() {
                    println!(
                        "     (not in this tree yet: {} is missing; the step fails until it \
                         exists)",
                        test_source(pkg, test).display()
                    );
                }
            }
        }
    }
    Ok(())
}

/// Looks for a CUDA driver and at least one device, without letting cudarc panic.
pub fn find_gpu() -> Result<usize, String> {
    // SAFETY: `is_culib_present` only tries to dlopen the driver library and reports whether
    // that worked; it has no preconditions.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("libcuda (the CUDA driver library) was not found".into());
    }
    // SAFETY: the driver library is present (checked above); cuInit and cuDeviceGetCount take
    // plain integer arguments and an out-pointer to a local.
    unsafe {
        let r = cudarc::driver::sys::cuInit(0);
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuInit failed: {r:?}"));
        }
        let mut n: std::os::raw::c_int = 0;
        let r = cudarc::driver::sys::cuDeviceGetCount(&mut n);
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuDeviceGetCount failed: {r:?}"));
        }
        if n < 1 {
            return Err("the CUDA driver reports no device".into());
        }
        Ok(n as usize)
    }
}

/// Runs every step in order (all of them, reporting each), or fails at once without a GPU.
/// Prints one summary line per suite.
pub fn gpu_test() -> Result<(), String> {
    let gpus = find_gpu().map_err(|why| {
        format!("no GPU found: gpu-test did not run anything ({why}); `--list` shows the suite")
    })?;
    eprintln!("xtask: found {gpus} CUDA device(s)");
    std::fs::create_dir_all(scratch()).map_err(|e| format!("creating the scratch dir: {e}"))?;
    let mut results: Vec<(&str, Result<(), String>)> = Vec::new();
    for s in STEPS {
        if gpus < s.min_gpus {
            eprintln!(
                "xtask: {}: skipped: needs {} GPUs ({gpus} visible): {}",
                s.suite, s.min_gpus, s.what
            );
            continue;
        }
        results.push((s.suite, run(s.what, &mut command(&s.exec))));
    }
    let mut failed = 0;
    for name in suites() {
        let mine: Vec<_> = results.iter().filter(|(n, _)| *n == name).collect();
        let bad: Vec<_> = mine.iter().filter_map(|(_, r)| r.as_ref().err()).collect();
        if bad.is_empty() {
            println!("gpu-test: {name}: PASS ({} step(s))", mine.len());
        } else {
            failed += 1;
            println!(
                "gpu-test: {name}: FAIL ({} of {} step(s)): {bad:?}",
                bad.len(),
                mine.len()
            );
        }
    }
    if failed == 0 {
        Ok(())
    } else {
        Err(format!(
            "gpu-test: {failed} suite(s) failed on {gpus} GPU(s)"
        ))
    }
}

/// The 2-process NCCL launch: two copies of the `gpu_nccl` test as ranks 0 and 1 of a
/// torchrun-style environment on 127.0.0.1.
/// `binary`: the prebuilt `gpu_nccl` test binary (the bundle); `None` builds it with cargo.
pub fn launch_2(binary: Option<&str>) -> Result<(), String> {
    launch_two(|| {
        let mut c = match binary {
            Some(b) => Command::new(b),
            None => {
                let mut c = cargo();
                c.args([
                    "test",
                    "--release",
                    "-p",
                    "fsdp-tests",
                    "--features",
                    "cuda",
                    "--test",
                    "gpu_nccl",
                    "--",
                ]);
                c
            }
        };
        c.args(LAUNCHED_TEST).env("FSDP_GPU_TESTS", "1");
        c
    })
}

/// `train_gpt ARGS` as ranks 0 and 1 of a torchrun-style job on 127.0.0.1 (`--backend nccl`).
/// `binary`: a prebuilt `train_gpt` (the bundle); `None` builds it first (release, `cuda`).
pub fn launch_2_train_gpt(binary: Option<&str>, args: &[&str]) -> Result<(), String> {
    let bin = match binary {
        Some(b) => std::path::PathBuf::from(b),
        None => {
            run(
                "build train_gpt (cuda)",
                cargo().arg("build").args(crate::util::TRAIN_GPT_CUDA),
            )?;
            crate::util::target_dir().join("release/train_gpt")
        }
    };
    launch_two(|| {
        let mut c = Command::new(&bin);
        c.args(args);
        c
    })
}

/// Runs two copies of the command `make` builds as ranks 0 and 1 (`RANK`, `LOCAL_RANK`,
/// `WORLD_SIZE=2`, `MASTER_ADDR=127.0.0.1`, `MASTER_PORT`: `$MASTER_PORT` or 29517); fails
/// unless both exit successfully.
fn launch_two(make: impl Fn() -> Command) -> Result<(), String> {
    let port = std::env::var("MASTER_PORT").unwrap_or_else(|_| "29517".into());
    let mut children = Vec::new();
    for rank in 0..2 {
        let mut c = make();
        c.env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", "2")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port);
        eprintln!("xtask: launching rank {rank}: {c:?}");
        children.push(c.spawn().map_err(|e| format!("rank {rank}: {e}"))?);
    }
    let mut bad = Vec::new();
    for (rank, mut ch) in children.into_iter().enumerate() {
        match ch.wait() {
            Ok(s) if s.success() => {}
            Ok(s) => bad.push(format!("rank {rank}: {s}")),
            Err(e) => bad.push(format!("rank {rank}: {e}")),
        }
    }
    if bad.is_empty() {
        Ok(())
    } else {
        Err(format!("2-process launch failed: {}", bad.join(", ")))
    }
}

/// Compiles every CUDA kernel source with NVRTC (no GPU or driver needed): runs the NVRTC tests
/// of fsdp-autograd's `kernels::cuda` and fsdp-collectives' `shared_gpu` with the library
/// directory of the `nvidia-cuda-nvrtc-cu12` wheel on `LD_LIBRARY_PATH` (`FSDP_NVRTC_DIR`, else
/// found through `python3`), where a missing library is a failure, not a skip.
pub fn nvrtc() -> Result<(), String> {
    let dir = match std::env::var("FSDP_NVRTC_DIR") {
        Ok(d) => d,
        Err(_) => {
            let out = Command::new("python3")
                .args([
                    "-c",
                    "import nvidia.cuda_nvrtc, os; \
                     print(os.path.join(list(nvidia.cuda_nvrtc.__path__)[0], 'lib'))",
                ])
                .output()
                .map_err(|e| format!("nvrtc: running python3: {e}"))?;
            if !out.status.success() {
                return Err(
                    "nvrtc: the nvidia-cuda-nvrtc-cu12 wheel is not installed (`pip install \
                     nvidia-cuda-nvrtc-cu12`, or set FSDP_NVRTC_DIR to a directory holding \
                     libnvrtc.so)"
                        .into(),
                );
            }
            String::from_utf8_lossy(&out.stdout).trim().to_string()
        }
    };
    let ld = match std::env::var("LD_LIBRARY_PATH") {
        Ok(p) if !p.is_empty() => format!("{dir}:{p}"),
        _ => dir.clone(),
    };
    eprintln!("xtask: nvrtc: libnvrtc from {dir}");
    run(
        "nvrtc: compile every kernel source",
        cuda_test(
            "fsdp-autograd",
            &["--lib", "kernels::cuda::tests::nvrtc_compiles_the_kernels"],
        )
        .env("LD_LIBRARY_PATH", &ld)
        .env("FSDP_NVRTC_REQUIRED", "1"),
    )?;
    run(
        "nvrtc: compile the shared-GPU collective kernels",
        cuda_test(
            "fsdp-collectives",
            &[
                "--lib",
                "shared_gpu::tests::nvrtc_compiles_the_shared_gpu_kernels",
            ],
        )
        .env("LD_LIBRARY_PATH", &ld)
        .env("FSDP_NVRTC_REQUIRED", "1"),
    )
}
