//! The process helpers every xtask command uses: the workspace root, `cargo`, the CUDA test
//! command shape and running a step. A leaf: it imports no other file of xtask.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// Cargo's target directory (`CARGO_TARGET_DIR`, else `target/` in the workspace root).
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) => PathBuf::from(d),
        None => root().join("target"),
    }
}

/// `cargo` (the one running xtask), in the workspace root.
pub fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

/// `cargo test -p <pkg> --features cuda <args…>`: the shape of every CUDA test step (the
/// emulator step of `ci`, the `gpu-test` suites, `nvrtc`).
pub fn cuda_test(pkg: &str, args: &[&str]) -> Command {
    let mut c = cargo();
    c.args(["test", "-p", pkg, "--features", "cuda"]).args(args);
    c
}

/// Runs `cmd` (echoed to stderr as step `step`); its failure is an error naming the step.
pub fn run(step: &str, cmd: &mut Command) -> Result<(), String> {
    eprintln!("xtask: {step}: {cmd:?}");
    let status = cmd
        .status()
        .map_err(|e| format!("{step}: could not start: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{step} failed ({status})"))
    }
}

/// The release `train_gpt` with CUDA, as cargo arguments after `build` or `run` (the GPU
/// bundle, `gpu-peer`, `gpu-test`'s train_gpt steps).
pub const TRAIN_GPT_CUDA: &[&str] = &[
    "--release",
    "-p",
    "fsdp-train",
    "--features",
    "cuda",
    "--bin",
    "train_gpt",
];
