//! `cargo xtask ci | gpu-test | bench [NAME]` — project automation for fsdp-rs.
//!
//! - `ci`: format check, clippy with `-D warnings` (default and `cuda` features), the `cuda`
//!   compile check, and the workspace tests.
//! - `gpu-test`: looks for a CUDA driver and a GPU without panicking; runs the workspace tests with
//!   `--features cuda` (GPU-only tests included) if found, otherwise says so and fails.
//! - `bench [NAME]`: runs the named bench (or all of them) in release mode.
//! - `soak`: runs the slow `#[ignore]`d tests.

use std::path::{Path, PathBuf};
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
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

fn run(step: &str, cmd: &mut Command) -> Result<(), String> {
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

fn ci() -> Result<(), String> {
    run("fmt", cargo().args(["fmt", "--all", "--", "--check"]))?;
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
    run("tests", cargo().args(["test", "--workspace"]))
}

/// Looks for a CUDA driver and at least one device, without letting cudarc panic.
fn find_gpu() -> Result<usize, String> {
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

fn gpu_test() -> Result<(), String> {
    match find_gpu() {
        Err(why) => Err(format!(
            "no CUDA driver/GPU found: GPU tests not run ({why})"
        )),
        Ok(n) => {
            eprintln!("xtask: found {n} CUDA device(s); running the suite with --features cuda");
            run(
                "gpu tests",
                cargo().env("FSDP_GPU_TESTS", "1").args([
                    "test",
                    "--workspace",
                    "--features",
                    "fsdp-tests/cuda",
                    "--",
                    "--include-ignored",
                ]),
            )
        }
    }
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
        Some(n) => {
            let b: Vec<_> = available.into_iter().filter(|(b, _, _)| *b == n).collect();
            if b.is_empty() {
                let names: Vec<_> = BENCHES
                    .iter()
                    .filter(|(n, dir, _)| {
                        root()
                            .join(dir)
                            .join("benches")
                            .join(format!("{n}.rs"))
                            .exists()
                    })
                    .map(|(n, _, _)| *n)
                    .collect();
                return Err(format!(
                    "no bench named `{n}`; available: {}",
                    names.join(", ")
                ));
            }
            b
        }
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

const USAGE: &str = "usage: cargo xtask <ci | gpu-test | bench [NAME] | soak>";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["ci"] => ci(),
        ["gpu-test"] => gpu_test(),
        ["bench"] => bench(None),
        ["bench", name] => bench(Some(name)),
        ["soak"] => soak(),
        _ => Err(USAGE.to_string()),
    };
    if let Err(e) = result {
        eprintln!("{e}");
        exit(1);
    }
}
