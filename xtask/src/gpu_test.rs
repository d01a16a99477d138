//! `cargo xtask gpu-test [--list]`: the suite a GPU owner runs, and `cargo xtask nvrtc`.
//!
//! Nothing in this suite has ever run on a GPU: it was written on a machine without one. On such
//! a machine `gpu-test` says that no GPU was found and exits non-zero; it never reports a pass.

use std::process::Command;

use crate::{cargo, cuda_test, run};

/// One suite of `gpu-test`: its name, what it checks, and the commands it runs.
struct Suite {
    name: &'static str,
    what: &'static str,
    steps: fn(gpus: usize) -> Vec<(String, Command)>,
}

/// `cargo test -p <pkg> --features cuda <args…>` with the GPU tests switched on.
fn test_cmd(pkg: &str, args: &[&str]) -> Command {
    let mut c = cuda_test(pkg, args);
    c.env("FSDP_GPU_TESTS", "1");
    c
}

fn ops(_gpus: usize) -> Vec<(String, Command)> {
    vec![
        (
            "ops: CUDA kernels vs CPU kernels (kernel level)".into(),
            test_cmd(
                "fsdp-autograd",
                &["--lib", "kernels::cuda", "--", "--include-ignored"],
            ),
        ),
        (
            "ops: every tensor op on CUDA vs CPU, forward + backward, f32/bf16/f16".into(),
            test_cmd(
                "fsdp-autograd",
                &["--test", "gpu_ops", "--", "--include-ignored"],
            ),
        ),
    ]
}

fn nccl(gpus: usize) -> Vec<(String, Command)> {
    let mut steps = vec![(
        "nccl: collectives on every visible GPU, one thread per GPU".to_string(),
        test_cmd(
            "fsdp-tests",
            &["--test", "gpu_nccl", "--", "--include-ignored", "threads"],
        ),
    )];
    if gpus >= 2 {
        // Two processes, torchrun-style environment; each runs the same test as one rank.
        let mut launch = cargo();
        launch.args(["run", "-p", "xtask", "--", "gpu-launch-2"]);
        steps.push((
            "nccl: 2-process launch (RANK/WORLD_SIZE/MASTER_*)".into(),
            launch,
        ));
    }
    steps
}

fn fsdp(_gpus: usize) -> Vec<(String, Command)> {
    vec![(
        "fsdp: GPT-mini on 1 GPU and on all GPUs vs CPU thread ranks (20 AdamW steps, losses \
         within 1e-4 relative) and peak memory within 5% of the CPU memory model"
            .into(),
        test_cmd(
            "fsdp-tests",
            &[
                "--release",
                "--test",
                "gpu_fsdp",
                "--",
                "--include-ignored",
                "--test-threads",
                "1",
            ],
        ),
    )]
}

fn bench(_gpus: usize) -> Vec<(String, Command)> {
    vec![(
        "bench: train_gpt on the GPU(s), last line one JSON object with tokens/s and TFLOP/s"
            .into(),
        {
            let mut c = cargo();
            c.args([
                "run",
                "--release",
                "-p",
                "fsdp-train",
                "--features",
                "cuda",
                "--bin",
                "train_gpt",
                "--",
                "--device",
                "cuda",
                "--steps",
                "20",
                "--json",
            ]);
            c
        },
    )]
}

const SUITES: &[Suite] = &[
    Suite {
        name: "ops",
        what: "every op the GPT uses, CUDA vs CPU, forward and backward, f32/bf16/f16 \
               (tolerances in fsdp-autograd/tests/gpu_ops.rs)",
        steps: ops,
    },
    Suite {
        name: "nccl",
        what: "all-gather, reduce-scatter sum/avg (f32, bf16), all-reduce, broadcast on every \
               visible GPU with asserted results, and a 2-process launch",
        steps: nccl,
    },
    Suite {
        name: "fsdp",
        what: "FSDP GPT-mini on 1 GPU and all GPUs vs CPU thread ranks (CPU offload on both): \
               losses within 1e-4 relative over 20 AdamW steps, peak memory per rank within 5% \
               of the CPU model; deferred-init shards generated for a GPU equal CPU shards bit \
               for bit",
        steps: fsdp,
    },
    Suite {
        name: "bench",
        what: "train_gpt --device cuda: tokens/s and achieved TFLOP/s as one JSON line",
        steps: bench,
    },
];

/// Prints the suite without running anything.
pub fn list() -> Result<(), String> {
    println!(
        "cargo xtask gpu-test runs {} suites (never run on a GPU by the authors):",
        SUITES.len()
    );
    for (i, s) in SUITES.iter().enumerate() {
        println!("{}. {:<6} {}", i + 1, s.name, s.what);
        for (step, cmd) in (s.steps)(2) {
            println!("     - {step}\n       {cmd:?}");
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

/// Runs every suite in order (all of them, reporting each), or fails at once without a GPU.
pub fn gpu_test() -> Result<(), String> {
    let gpus = find_gpu().map_err(|why| {
        format!("no GPU found: gpu-test did not run anything ({why}); `--list` shows the suite")
    })?;
    eprintln!("xtask: found {gpus} CUDA device(s)");
    let mut failed = Vec::new();
    for s in SUITES {
        for (step, mut cmd) in (s.steps)(gpus) {
            if let Err(e) = run(&step, &mut cmd) {
                failed.push(format!("{}: {e}", s.name));
            }
        }
    }
    if failed.is_empty() {
        eprintln!(
            "xtask: gpu-test: all {} suites passed on {gpus} GPU(s)",
            SUITES.len()
        );
        Ok(())
    } else {
        Err(format!("gpu-test failed:\n  {}", failed.join("\n  ")))
    }
}

/// The 2-process NCCL launch: two copies of the `gpu_nccl` test as ranks 0 and 1 of a
/// torchrun-style environment on 127.0.0.1.
pub fn launch_2() -> Result<(), String> {
    let port = std::env::var("MASTER_PORT").unwrap_or_else(|_| "29517".into());
    let mut children = Vec::new();
    for rank in 0..2 {
        let mut c = test_cmd(
            "fsdp-tests",
            &[
                "--test",
                "gpu_nccl",
                "--",
                "--include-ignored",
                "--exact",
                "one_rank_of_a_launched_job",
            ],
        );
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

/// Compiles every CUDA kernel source with NVRTC (no GPU or driver needed): runs the NVRTC test
/// of `kernels::cuda` with the library directory of the `nvidia-cuda-nvrtc-cu12` wheel on
/// `LD_LIBRARY_PATH` (`FSDP_NVRTC_DIR`, else found through `python3`), where a missing library
/// is a failure, not a skip.
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
        .env("LD_LIBRARY_PATH", ld)
        .env("FSDP_NVRTC_REQUIRED", "1"),
    )
}
