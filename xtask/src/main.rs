//! `cargo xtask ci | gpu-test | bench [NAME]` — project automation for fsdp-rs.
//!
//! - `ci`: format check, clippy with `-D warnings` (default, `cuda` and `mpi` features), the
//!   `cuda` compile check, the CUDA kernels (fsdp-autograd's and the shared-GPU collectives')
//!   on the host emulator, the workspace tests, the MPI suite (`mpi-test`), NVRTC compilation
//!   of every kernel, the docs with warnings denied and the packaging check. The MPI and NVRTC steps need tools `.ci/run` installs; without them
//!   (and without `CI=true`) they are skipped with a message.
//! - `gpu-test`: looks for a CUDA driver and a GPU without panicking; runs the GPU suite (ops,
//!   attention memory scaling, NCCL, thread ranks sharing one GPU, FSDP parity and memory, clean
//!   teardown, the train_gpt bench, the kernel-time bench; the list is `gpu_test::STEPS`) if
//!   found, otherwise says so and fails; steps that need more GPUs than are visible print
//!   `skipped: needs N GPUs`; one summary line per suite. `--list` prints the suite without
//!   running it.
//! - `gpu-launch-2 [--bin TEST]` / `gpu-launch-2 --train-gpt [--bin TRAIN_GPT] -- ARGS`: two
//!   processes as ranks 0 and 1 of a torchrun-style job (the `gpu_nccl` test, or `train_gpt`).
//! - `gpu-peer`: `train_gpt --device cuda` beside PyTorch FSDP2 on the same GPU (`peer.rs`).
//! - `gpu-train-compare shared-gpu|mpi-gpu [--train-gpt BIN] [--out DIR]`: train_gpt on ranks
//!   sharing one GPU (4 thread ranks; 2 MPI processes) against CPU thread ranks: losses, memory,
//!   the `--profile` overlap (`train_compare.rs`; steps of the `shared-gpu` and `mpi-gpu`
//!   suites).
//! - `gpu-bundle DIR`: builds every binary of the GPU suite (release, `cuda`) here, without a
//!   GPU, strips them into `DIR/bin` and writes `DIR/run.sh`, which runs the same suite as
//!   `gpu-test` on a GPU machine without a Rust toolchain (see `bundle.rs`).
//! - `nvrtc`: compiles every CUDA kernel source with NVRTC from the `nvidia-cuda-nvrtc-cu12`
//!   wheel (compile only; no GPU or driver needed).
//! - `bench [NAME]`: runs the named bench (or all of them) in release mode.
//! - `soak`: runs the slow `#[ignore]`d tests.
//! - `doc`: `cargo doc --workspace --no-deps` with rustdoc warnings denied (broken intra-doc
//!   links, missing docs), without and with the `cuda` feature.
//! - `house`: the import-circle checker (see `house.rs`): fails on any file-level import cycle
//!   inside a crate and on `use super::*;` outside `#[cfg(test)]`; printed with the files on
//!   each cycle and the import lines that close it. `ci` runs it after the format check.
//! - `mpi-test`: the multi-process suite under `mpirun` (W = 1..=4), the kill test and the
//!   group-creation stall test;
//!   `bench mpi`: MPI vs thread collectives and train_gpt tokens/s (see `mpi.rs`).
//! - `mpi-test --nodes 2`: the MPI suite on two nodes emulated with network namespaces (root
//!   only; skipped with a message elsewhere); `bench nodes`: hierarchical vs flat all-gather
//!   and HybridShard vs FullShard on that cluster (see `nodes.rs`).

mod bundle;
mod gpu_test;
mod house;
mod mpi;
mod nodes;
mod peer;
mod train_compare;
mod util;

pub use util::{cargo, cuda_test, root, run};

use std::process::{exit, Command};

/// Benches: (name, crate directory, package name).
const BENCHES: &[(&str, &str, &str)] = &[
    ("flatparam", "fsdp-flatparam", "fsdp-flatparam"),
    ("alloc", "fsdp-alloc", "fsdp-alloc"),
    ("collectives", "fsdp-collectives", "fsdp-collectives"),
    ("autograd", "fsdp-autograd", "fsdp-autograd"),
    ("init", "fsdp-init", "fsdp-init"),
    ("fsdp", "fsdp-core", "fsdp-core"),
    ("scaling", "fsdp-core", "fsdp-core"),
    ("planner", "fsdp-plan", "fsdp-plan"),
    ("paper", "fsdp-plan", "fsdp-plan"),
    ("quantized", "fsdp-train", "fsdp-train"),
];

/// Runs a CI step that needs a tool from outside cargo. Under `CI=true` (and when the tool is
/// there) its failure fails CI; on a machine where the tool is missing and `CI` is not set, the
/// step is skipped with a message naming what to install — never reported as passed.
fn optional_step(name: &str, step: fn() -> Result<(), String>) -> Result<(), String> {
    let in_ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
    let missing = match name {
        "mpi-test" => (!tool_runs("mpirun")).then_some(
            "OpenMPI is not installed (Debian: apt-get install openmpi-bin libopenmpi-dev \
             libclang-dev clang)",
        ),
        "nvrtc" => (!python_has("nvidia.cuda_nvrtc")
            && std::env::var_os("FSDP_NVRTC_DIR").is_none())
        .then_some("NVRTC is not installed (python3 -m pip install nvidia-cuda-nvrtc-cu12)"),
        _ => None,
    };
    match missing {
        Some(why) if !in_ci => {
            eprintln!("xtask: {name}: SKIPPED, not run: {why}; `bash .ci/run` installs it");
            Ok(())
        }
        _ => step(),
    }
}

fn tool_runs(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

fn python_has(module: &str) -> bool {
    Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn ci() -> Result<(), String> {
    run("fmt", cargo().args(["fmt", "--all", "--", "--check"]))?;
    house::house(&root())?;
    run(
        "clippy",
        cargo().args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]),
    )?;
    run(
        "clippy (cuda)",
        cargo().args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--features",
            "fsdp-tests/cuda",
            "--",
            "-D",
            "warnings",
        ]),
    )?;
    run(
        "cuda compile check",
        cargo().args(["check", "--workspace", "--features", "fsdp-tests/cuda"]),
    )?;
    run(
        "cuda kernels on the host emulator",
        cuda_test("fsdp-autograd", &["--lib", "kernels::cuda"]).env("FSDP_EMU_REQUIRED", "1"),
    )?;
    run(
        "shared-GPU collective kernels on the host emulator",
        cuda_test("fsdp-collectives", &["--lib", "shared_gpu::tests"])
            .env("FSDP_EMU_REQUIRED", "1"),
    )?;
    run("tests", cargo().args(["test", "--workspace"]))?;
    // The multi-process suite: FSDP over MPI against the thread backend under `mpirun`, and the
    // kill test. Every CUDA kernel source compiled by NVRTC (no GPU needed). Both need tools from
    // outside cargo (OpenMPI + libclang; NVIDIA's NVRTC wheel): `.ci/run` installs them, and under
    // CI=true a missing tool fails the run; on a developer's machine without them these steps are
    // skipped with a message saying what to install.
    optional_step("mpi-test", mpi::mpi_test)?;
    optional_step("mpi-test", nodes::mpi_test_nodes)?;
    optional_step("nvrtc", gpu_test::nvrtc)?;
    // The docs with warnings denied, and the library crates packaged as they would be published.
    doc()?;
    run(
        "package",
        cargo().args([
            "package",
            "--workspace",
            "--exclude",
            "xtask",
            "--exclude",
            "fsdp-tests",
            "--exclude",
            "fsdp-train",
            "--exclude",
            "fsdp-candle-mlp",
            "--no-verify",
            "--allow-dirty",
        ]),
    )
}

/// `cargo doc --workspace --no-deps` with `-D warnings` added to `RUSTDOCFLAGS`, without and
/// with the optional `cuda` feature.
fn doc() -> Result<(), String> {
    let flags = match std::env::var("RUSTDOCFLAGS") {
        Ok(f) if !f.trim().is_empty() => format!("{f} -D warnings"),
        _ => "-D warnings".to_string(),
    };
    run(
        "doc",
        cargo()
            .env("RUSTDOCFLAGS", &flags)
            .args(["doc", "--workspace", "--no-deps"]),
    )?;
    run(
        "doc (cuda)",
        cargo().env("RUSTDOCFLAGS", &flags).args([
            "doc",
            "--workspace",
            "--no-deps",
            "--features",
            "fsdp-tests/cuda",
        ]),
    )
}

fn bench(name: Option<&str>) -> Result<(), String> {
    let available: Vec<_> = BENCHES
        .iter()
        .filter(|(n, dir, _)| {
            root()
                .join(dir)
                .join("benches")
                .join(format!("{n}.rs"))
                .exists()
        })
        .collect();
    let chosen: Vec<_> = match name {
        None => available,
        Some(n) => match available.iter().find(|(b, _, _)| *b == n) {
            Some(&b) => vec![b],
            None => {
                let names: Vec<_> = available.iter().map(|(n, _, _)| *n).collect();
                return Err(format!(
                    "no bench named `{n}`; available: {}",
                    names.join(", ")
                ));
            }
        },
    };
    for (n, _, pkg) in chosen {
        run(
            &format!("bench {n}"),
            cargo().args(["bench", "--quiet", "-p", pkg, "--bench", n]),
        )?;
    }
    Ok(())
}

fn soak() -> Result<(), String> {
    run(
        "soak tests",
        cargo().args(["test", "--release", "--workspace", "--", "--ignored"]),
    )
}

const USAGE: &str = "usage: cargo xtask <ci | house | gpu-test [--list] | gpu-bundle DIR | \
                     gpu-peer [--train-gpt BIN] [--script PY] | \
                     gpu-train-compare shared-gpu|mpi-gpu [--train-gpt BIN] [--out DIR] | nvrtc | \
                     bench [NAME] | soak | doc | mpi-test [--nodes 2]>";

/// `gpu-peer`'s options: `--train-gpt BIN` and `--script PY`, each at most once.
fn peer_args<'a>(rest: &[&'a str]) -> Result<(Option<&'a str>, Option<&'a str>), String> {
    let [train_gpt, script] = options("gpu-peer", rest, ["--train-gpt", "--script"])?;
    Ok((train_gpt, script))
}

/// The values of `flags` (each `--flag VALUE`, at most once, in any order) in `rest`.
fn options<'a, const N: usize>(
    cmd: &str,
    rest: &[&'a str],
    flags: [&str; N],
) -> Result<[Option<&'a str>; N], String> {
    let mut out = [None; N];
    let mut it = rest.iter();
    while let Some(flag) = it.next() {
        let i = flags
            .iter()
            .position(|f| f == flag)
            .ok_or_else(|| format!("{cmd}: unknown option {flag:?}\n{USAGE}"))?;
        out[i] = Some(
            *it.next()
                .ok_or_else(|| format!("{cmd}: {flag} needs a value\n{USAGE}"))?,
        );
    }
    Ok(out)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["ci"] => ci(),
        ["gpu-test"] => gpu_test::gpu_test(),
        ["gpu-test", "--list"] => gpu_test::list(),
        ["gpu-launch-2"] => gpu_test::launch_2(None),
        ["gpu-launch-2", "--bin", b] => gpu_test::launch_2(Some(b)),
        ["gpu-launch-2", "--train-gpt", "--", args @ ..] => {
            gpu_test::launch_2_train_gpt(None, args)
        }
        ["gpu-launch-2", "--train-gpt", "--bin", b, "--", args @ ..] => {
            gpu_test::launch_2_train_gpt(Some(b), args)
        }
        ["gpu-find"] => gpu_test::find_gpu().map(|n| println!("{n}")),
        ["gpu-bundle", dir] => bundle::gpu_bundle(dir),
        ["gpu-peer", rest @ ..] => peer_args(rest).and_then(|(t, s)| peer::gpu_peer(t, s)),
        ["gpu-train-compare", which, rest @ ..] => {
            options("gpu-train-compare", rest, ["--train-gpt", "--out"])
                .and_then(|[t, o]| train_compare::gpu_train_compare(which, t, o))
        }
        ["nvrtc"] => gpu_test::nvrtc(),
        ["bench"] => bench(None),
        ["bench", "mpi"] => mpi::bench_mpi(),
        ["bench", "nodes"] => nodes::bench_nodes(),
        ["bench", name] => bench(Some(name)),
        ["mpi-test"] => mpi::mpi_test(),
        ["mpi-test", "--nodes", "2"] => nodes::mpi_test_nodes(),
        ["soak"] => soak(),
        ["doc"] => doc(),
        ["house"] => house::house(&root()),
        _ => Err(USAGE.to_string()),
    };
    if let Err(e) = result {
        eprintln!("{e}");
        exit(1);
    }
}
