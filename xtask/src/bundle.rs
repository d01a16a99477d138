//! `cargo xtask gpu-bundle DIR`: the GPU suite as prebuilt binaries plus `DIR/run.sh`, for a GPU
//! machine that has an NVIDIA driver but no Rust toolchain.
//!
//! Built here, on a machine without a GPU: every test binary of [`gpu_test::STEPS`](crate::gpu_test::STEPS)
//! (release, feature `cuda`), `train_gpt` (package fsdp-train, feature `cuda`) and this xtask
//! binary (it finds the GPUs with the driver API, is the 2-process launcher and runs the
//! train_gpt comparisons), stripped, under `DIR/bin`; and, where this machine has OpenMPI's
//! development files and the bundle stays under its size limit, `train_gpt-mpi` (features
//! `cuda,mpi`, for the `mpi-gpu` suite; it needs OpenMPI's `mpirun` and `libmpi` on the GPU
//! machine too). Without it the `mpi-gpu` train_gpt step fails in `run.sh` as missing, saying
//! why. `run.sh` is generated from the same list as `cargo xtask gpu-test`.
//!
//! The binaries load CUDA libraries at run time (cudarc's dynamic loading, built against the
//! CUDA 12.8 API). cudarc looks for `libcublas.so`, `libnvrtc.so`, `libnccl.so` and `.so.12`,
//! `.so.11`, `.so.1`… names (`cudarc::get_lib_name_candidates`), never `.so.13`; `run.sh` therefore
//! finds cuBLAS, NVRTC and NCCL of CUDA 12 or 13 (toolkit directories, the system library path,
//! or NVIDIA's pip wheels: `nvidia/cu13/lib`, `nvidia/cublas/lib`, `nvidia/cuda_nvrtc/lib`,
//! `nvidia/nccl/lib`, found through `python3 -c 'import nvidia'`) and links each under its
//! unversioned name (`libcublas.so` …) in a temporary directory put first on `LD_LIBRARY_PATH`,
//! with the libraries' own directories after it (cuBLASLt, NVRTC's builtins).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::gpu_test::{test_source, Exec, STEPS};
use crate::{cargo, run};

/// The bundle must stay under this many bytes (issue #24).
const LIMIT: u64 = 40 << 20;

/// A bundled binary's file name for a test target.
fn test_bin_name(pkg: &str, test: Option<&str>) -> String {
    match test {
        None => format!("{pkg}-lib"),
        Some(t) => format!("{pkg}-{t}"),
    }
}

/// (target name, executable) of each artifact with an executable in cargo's JSON messages.
fn executables(json: &str) -> Vec<(String, String)> {
    let field = |l: &str, key: &str| -> Option<String> {
        let i = l.find(key)? + key.len();
        let rest = &l[i..];
        Some(rest[..rest.find('"')?].replace("\\\\", "\\"))
    };
    json.lines()
        .filter(|l| l.contains("\"reason\":\"compiler-artifact\""))
        .filter_map(|l| {
            let exe = field(l, "\"executable\":\"")?;
            let target = l.find("\"target\":{").map(|i| &l[i..])?;
            Some((field(target, "\"name\":\"")?, exe))
        })
        .collect()
}

/// The cargo target name of a test step's binary (a library's unit tests: the crate name).
fn target_name(pkg: &str, test: Option<&str>) -> String {
    match test {
        Some(t) => t.to_string(),
        None => pkg.replace('-', "_"),
    }
}

/// Builds the test targets (release, `cuda`) in one cargo call, so that every binary shares
/// one build of the workspace, and returns each one's executable.
fn build_tests(targets: &[(&str, Option<&str>)]) -> Result<Vec<PathBuf>, String> {
    let mut c = bundle_cargo();
    c.args([
        "test",
        "--release",
        "--no-run",
        "--message-format=json-render-diagnostics",
    ]);
    let mut pkgs: Vec<&str> = Vec::new();
    for (pkg, test) in targets {
        if !pkgs.contains(pkg) {
            pkgs.push(pkg);
            c.args(["-p", pkg, "--features", &format!("{pkg}/cuda")]);
        }
        if let Some(t) = test {
            c.args(["--test", t]);
        }
    }
    // `--lib` may be given once: it selects the library tests of every package named (cargo
    // refuses a repeated `--lib`, which two suites' library steps produced).
    if targets.iter().any(|(_, t)| t.is_none()) {
        c.arg("--lib");
    }
    eprintln!("xtask: gpu-bundle: building the test binaries: {c:?}");
    let out = c
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("cargo: {e}"))?;
    if !out.status.success() {
        return Err("gpu-bundle: building the test binaries failed".into());
    }
    let exes = executables(&String::from_utf8_lossy(&out.stdout));
    targets
        .iter()
        .map(|(pkg, test)| {
            let name = target_name(pkg, *test);
            exes.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, e)| PathBuf::from(e))
                .ok_or_else(|| format!("gpu-bundle: cargo built no executable for {name}"))
        })
        .collect()
}

/// Cargo for the bundle's builds: release without debug info (the binaries are stripped
/// anyway; this only saves compile time and disk).
fn bundle_cargo() -> Command {
    let mut c = cargo();
    c.env("CARGO_PROFILE_RELEASE_DEBUG", "0");
    c
}

fn copy_stripped(from: &Path, to: &Path) -> Result<u64, String> {
    std::fs::copy(from, to).map_err(|e| format!("copying {}: {e}", from.display()))?;
    run(
        &format!("strip {}", to.display()),
        Command::new("strip").arg("--strip-all").arg(to),
    )?;
    Ok(std::fs::metadata(to).map_err(|e| e.to_string())?.len())
}

/// Single-quotes `s` for the shell.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// `cargo xtask gpu-bundle DIR`.
pub fn gpu_bundle(dir: &str) -> Result<(), String> {
    let dir = PathBuf::from(dir);
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).map_err(|e| format!("creating {}: {e}", bin.display()))?;
    let mut total = 0u64;
    let mut missing: Vec<String> = Vec::new();

    // Test binaries, each once, in one cargo call.
    let mut wanted: Vec<(&str, Option<&str>)> = Vec::new();
    for s in STEPS {
        let (pkg, test) = match s.exec {
            Exec::Test { pkg, test, .. } => (pkg, test),
            Exec::Launch2 => ("fsdp-tests", Some("gpu_nccl")),
            Exec::TrainGpt { .. }
            | Exec::TrainGptLaunch2 { .. }
            | Exec::Peer
            | Exec::TrainCompare { .. } => continue,
        };
        if wanted.contains(&(pkg, test)) || missing.contains(&test_bin_name(pkg, test)) {
            continue;
        }
        if !test_source(pkg, test).exists() {
            eprintln!(
                "xtask: gpu-bundle: {} does not exist in this tree: its step is in run.sh and \
                 fails there as missing",
                test_source(pkg, test).display()
            );
            missing.push(test_bin_name(pkg, test));
            continue;
        }
        wanted.push((pkg, test));
    }
    for ((pkg, test), exe) in wanted.iter().zip(build_tests(&wanted)?) {
        total += copy_stripped(&exe, &bin.join(test_bin_name(pkg, *test)))?;
    }

    // train_gpt and this xtask binary.
    run(
        "gpu-bundle: build train_gpt (cuda) and xtask",
        bundle_cargo()
            .arg("build")
            .args(crate::util::TRAIN_GPT_CUDA)
            .args(["-p", "xtask", "--bin", "xtask"]),
    )?;
    let release = crate::util::target_dir().join("release");
    total += copy_stripped(&release.join("train_gpt"), &bin.join("train_gpt"))?;
    total += copy_stripped(&release.join("xtask"), &bin.join("xtask"))?;

    // train_gpt with MPI for the mpi-gpu suite, when this machine can build it and it fits.
    if STEPS
        .iter()
        .any(|s| matches!(s.exec, Exec::TrainCompare { mpi: true, .. }))
    {
        match train_gpt_mpi(&bin, LIMIT.saturating_sub(total)) {
            Ok(size) => total += size,
            Err(why) => {
                eprintln!("xtask: gpu-bundle: {TRAIN_GPT_MPI} not bundled: {why}");
                missing.push(format!("{TRAIN_GPT_MPI}: {why}"));
            }
        }
    }

    // The PyTorch peer of the `peer` suite (a Python script: run by the GPU machine's Python).
    let peer = crate::root().join("fsdp-train/benches").join(PEER_SCRIPT);
    total += std::fs::copy(&peer, dir.join(PEER_SCRIPT))
        .map_err(|e| format!("copying {}: {e}", peer.display()))?;

    let script = run_sh(&missing);
    let run_path = dir.join("run.sh");
    std::fs::write(&run_path, &script).map_err(|e| format!("writing run.sh: {e}"))?;
    total += script.len() as u64;
    set_executable(&run_path)?;
    eprintln!(
        "xtask: gpu-bundle: {} ({:.1} MB in all, limit {} MB): run `bash {}/run.sh` on a GPU \
         machine",
        dir.display(),
        total as f64 / 1e6,
        LIMIT >> 20,
        dir.display()
    );
    if total > LIMIT {
        return Err(format!(
            "gpu-bundle: {total} bytes, over the {LIMIT}-byte limit"
        ));
    }
    Ok(())
}

/// The bundle's train_gpt built with `cuda,mpi` (the `mpi-gpu` suite).
const TRAIN_GPT_MPI: &str = "train_gpt-mpi";

/// Builds `train_gpt` with `cuda,mpi` and strips it into `bin/train_gpt-mpi` if it fits in
/// `room` bytes; its size, or why it is not there.
fn train_gpt_mpi(bin: &Path, room: u64) -> Result<u64, String> {
    if !Command::new("mpicc")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return Err(
            "this machine has no OpenMPI development files (mpicc; Debian: \
                    libopenmpi-dev, and libclang-dev for the bindings)"
                .into(),
        );
    }
    run(
        "gpu-bundle: build train_gpt (cuda,mpi)",
        bundle_cargo().args([
            "build",
            "--release",
            "-p",
            "fsdp-train",
            "--features",
            "cuda,mpi",
            "--bin",
            "train_gpt",
        ]),
    )?;
    let to = bin.join(TRAIN_GPT_MPI);
    let size = copy_stripped(&crate::util::target_dir().join("release/train_gpt"), &to)?;
    if size > room {
        let _ = std::fs::remove_file(&to);
        return Err(format!(
            "{size} bytes would take the bundle over its {LIMIT}-byte limit"
        ));
    }
    Ok(size)
}

fn set_executable(p: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let mut perm = std::fs::metadata(p)
        .map_err(|e| e.to_string())?
        .permissions();
    perm.set_mode(0o755);
    std::fs::set_permissions(p, perm).map_err(|e| e.to_string())
}

/// The PyTorch FSDP2 peer script (`fsdp-train/benches/`), copied to the bundle's top directory.
pub(crate) const PEER_SCRIPT: &str = "torch_fsdp2_peer.py";

/// The shell line of one step, run from the bundle directory.
fn step_line(exec: &Exec) -> String {
    match *exec {
        Exec::Test { pkg, test, args } => {
            let mut line = format!(
                "env FSDP_GPU_TESTS=1 \"$B/bin/{}\"",
                test_bin_name(pkg, test)
            );
            for a in args {
                line.push(' ');
                line.push_str(&sh_quote(a));
            }
            line
        }
        Exec::TrainGpt { args } => {
            let mut line = "\"$B/bin/train_gpt\"".to_string();
            for a in args {
                line.push(' ');
                // `{out}` becomes the run's scratch directory.
                line.push_str(&format!(
                    "\"{}\"",
                    a.replace("{out}", "$OUT").replace('"', "")
                ));
            }
            line
        }
        Exec::Launch2 => format!(
            "\"$B/bin/xtask\" gpu-launch-2 --bin \"$B/bin/{}\"",
            test_bin_name("fsdp-tests", Some("gpu_nccl"))
        ),
        Exec::TrainGptLaunch2 { args } => {
            let mut line =
                "\"$B/bin/xtask\" gpu-launch-2 --train-gpt --bin \"$B/bin/train_gpt\" --".to_string();
            for a in args {
                line.push(' ');
                line.push_str(&sh_quote(a));
            }
            line
        }
        Exec::Peer => format!(
            "\"$B/bin/xtask\" gpu-peer --train-gpt \"$B/bin/train_gpt\" --script \"$B/{PEER_SCRIPT}\""
        ),
        Exec::TrainCompare { which, mpi } => format!(
            "\"$B/bin/xtask\" gpu-train-compare {which} --train-gpt \"$B/bin/{}\" --out \"$OUT/{which}\"",
            if mpi { TRAIN_GPT_MPI } else { "train_gpt" }
        ),
    }
}

/// `run.sh`, generated from [`STEPS`]; `missing` names binaries whose sources are not in the
/// tree the bundle was built from (their steps fail as missing), or `train_gpt-mpi: WHY` when
/// that binary was not bundled.
fn run_sh(missing: &[String]) -> String {
    let mut s = String::from(RUN_SH_HEAD);
    let mut suites: Vec<&str> = Vec::new();
    for (i, st) in STEPS.iter().enumerate() {
        if !suites.contains(&st.suite) {
            suites.push(st.suite);
        }
        let missing_bin = match st.exec {
            Exec::Test { pkg, test, .. } => {
                let n = test_bin_name(pkg, test);
                missing
                    .contains(&n)
                    .then(|| format!("bin/{n} was not built: its source was not in the tree"))
            }
            Exec::TrainCompare { mpi: true, .. } => missing
                .iter()
                .find(|m| m.starts_with(TRAIN_GPT_MPI))
                .map(|why| format!("bin/{why}")),
            _ => None,
        };
        s.push_str(&format!("\n# {}\n", st.what));
        match missing_bin {
            Some(why) => s.push_str(&format!(
                "missing {} {} {}\n",
                st.suite,
                i + 1,
                sh_quote(&why)
            )),
            None => s.push_str(&format!(
                "step {} {} {} {} -- {}\n",
                st.suite,
                i + 1,
                st.min_gpus,
                sh_quote(st.what),
                step_line(&st.exec)
            )),
        }
    }
    s.push_str(&format!("\nsummary {}\n", suites.join(" ")));
    s
}

const RUN_SH_HEAD: &str = r#"#!/usr/bin/env bash
# The fsdp-rs GPU suite, prebuilt by `cargo xtask gpu-bundle` (the same steps as
# `cargo xtask gpu-test`). Needs an NVIDIA driver and CUDA 12 or 13 libraries (cuBLAS, NVRTC,
# NCCL) from a CUDA toolkit, the system library path or NVIDIA's pip wheels; no Rust toolchain.
# Prints one summary line per suite; exits non-zero if any step fails or no GPU is found.
# Logs go to $OUT (default: a new temporary directory).
set -u
B="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$(mktemp -d /tmp/fsdp-gpu-suite.XXXXXX)}"
mkdir -p "$OUT"
LIBDIR="$OUT/lib"
mkdir -p "$LIBDIR"

# --- the GPU -------------------------------------------------------------------------------
# `xtask gpu-find` loads libcuda through the driver API (cuInit, cuDeviceGetCount) and prints
# the number of devices, or why there is none.
if ! GPUS="$("$B/bin/xtask" gpu-find 2>"$OUT/gpu-find.err")"; then
  echo "run.sh: no GPU found: $(cat "$OUT/gpu-find.err"); nothing was run" >&2
  exit 2
fi
echo "run.sh: $GPUS CUDA device(s); logs in $OUT"

# --- CUDA libraries ------------------------------------------------------------------------
# Directories to search, most specific first: $FSDP_CUDA_LIBS, NVIDIA's pip wheels, a CUDA
# toolkit, the system library path.
dirs=()
[ -n "${FSDP_CUDA_LIBS:-}" ] && IFS=: read -r -a dirs <<< "$FSDP_CUDA_LIBS"
for py in python3 python; do
  if command -v "$py" >/dev/null 2>&1; then
    while IFS= read -r d; do
      for sub in cu13/lib cu12/lib nccl/lib cublas/lib cuda_nvrtc/lib cuda_runtime/lib; do
        [ -d "$d/$sub" ] && dirs+=("$d/$sub")
      done
    done < <("$py" -c 'import nvidia, sys; print("\n".join(list(nvidia.__path__)))' 2>/dev/null)
    break
  fi
done
for d in ${CUDA_HOME:-} ${CUDA_PATH:-} /usr/local/cuda /usr/local/cuda-13* /usr/local/cuda-12* /opt/cuda; do
  for sub in lib64 lib targets/x86_64-linux/lib targets/sbsa-linux/lib; do
    [ -d "$d/$sub" ] && dirs+=("$d/$sub")
  done
done
dirs+=(/usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 /usr/lib)

# find_lib NAME: the newest lib$NAME.so.12* or .so.13* (NCCL: .so.2*), linked as lib$NAME.so.
found_dirs=""
find_lib() {
  local name="$1" pat="$2" d f best=""
  for d in "${dirs[@]}"; do
    for f in "$d"/lib"$name".so.$pat; do
      [ -e "$f" ] || continue
      best="$f"
    done
    [ -n "$best" ] && break
  done
  if [ -z "$best" ]; then
    echo "run.sh: lib$name (CUDA 12 or 13) not found in: ${dirs[*]}" >&2
    echo "run.sh: install it (e.g. pip install nvidia-cublas nvidia-cuda-nvrtc nvidia-nccl-cu13, or the -cu12 wheels) or set FSDP_CUDA_LIBS" >&2
    return 1
  fi
  ln -sf "$best" "$LIBDIR/lib$name.so"
  case ":$found_dirs:" in *":$(dirname "$best"):"*) ;; *) found_dirs="$found_dirs:$(dirname "$best")";; esac
  echo "run.sh: lib$name.so -> $best"
}
libs_ok=1
find_lib cublas "1[23]*" || libs_ok=0
find_lib cublasLt "1[23]*" || libs_ok=0
find_lib nvrtc "1[23]*" || libs_ok=0
find_lib nccl "2*" || libs_ok=0
if [ "$libs_ok" != 1 ]; then
  echo "run.sh: CUDA libraries missing; nothing was run" >&2
  exit 3
fi
export LD_LIBRARY_PATH="$LIBDIR${found_dirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# --- the steps -----------------------------------------------------------------------------
declare -A pass fail
step() { # step SUITE N MIN_GPUS WHAT -- COMMAND...
  local suite="$1" n="$2" min="$3" what="$4"; shift 5
  if [ "$GPUS" -lt "$min" ]; then
    echo "run.sh: step $n ($suite) skipped: needs $min GPUs (found $GPUS): $what"
    return
  fi
  echo "run.sh: step $n ($suite): $what"
  if (cd "$OUT" && "$@") >"$OUT/step$n.log" 2>&1; then
    pass[$suite]=$(( ${pass[$suite]:-0} + 1 ))
  else
    local rc=$?
    fail[$suite]="${fail[$suite]:-} step$n(rc=$rc)"
    echo "run.sh: step $n ($suite) FAILED (rc $rc); last lines of $OUT/step$n.log:"
    tail -n 15 "$OUT/step$n.log" | sed 's/^/    /'
  fi
}
missing() { # missing SUITE N WHY
  fail[$1]="${fail[$1]:-} step$2(missing: $3)"
  echo "run.sh: step $2 ($1) FAILED: $3"
}
summary() {
  local bad=0 s
  for s in "$@"; do
    if [ -n "${fail[$s]:-}" ]; then
      echo "gpu-suite: $s: FAIL:${fail[$s]}"; bad=1
    else
      echo "gpu-suite: $s: PASS (${pass[$s]:-0} step(s))"
    fi
  done
  exit $bad
}
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn executables_are_read_from_cargo_json() {
        let json = concat!(
            r#"{"reason":"compiler-artifact","executable":null}"#,
            "\n",
            r#"{"reason":"compiler-artifact","target":{"kind":["test"],"name":"gpu_ops","test":true},"profile":{"test":true},"executable":"/t/release/deps/gpu_ops-1"}"#,
            "\n",
            r#"{"reason":"build-finished","success":true}"#
        );
        assert_eq!(
            executables(json),
            vec![(
                "gpu_ops".to_string(),
                "/t/release/deps/gpu_ops-1".to_string()
            )]
        );
        assert_eq!(target_name("fsdp-autograd", None), "fsdp_autograd");
    }

    #[test]
    fn run_sh_has_every_step_and_one_summary() {
        let s = run_sh(&["fsdp-autograd-gpu_attention".to_string()]);
        for st in STEPS {
            assert!(s.contains(&format!("# {}", st.what)), "{}", st.what);
        }
        assert!(s.contains("missing attention"));
        assert!(s.contains(
            "\nsummary ops attention nccl shared-gpu mpi-gpu fsdp teardown bench kernels peer\n"
        ));
        assert!(s.contains(
            "gpu-train-compare shared-gpu --train-gpt \"$B/bin/train_gpt\" --out \"$OUT/shared-gpu\""
        ));
        assert!(s.contains(
            "gpu-train-compare mpi-gpu --train-gpt \"$B/bin/train_gpt-mpi\" --out \"$OUT/mpi-gpu\""
        ));
        assert!(s.contains("'staged::gpu_tests'"));
        // Without the MPI train_gpt the step fails as missing, saying why.
        let without = run_sh(&["train_gpt-mpi: no OpenMPI here".to_string()]);
        assert!(without.contains("missing mpi-gpu"), "{without}");
        assert!(without.contains("bin/train_gpt-mpi: no OpenMPI here"));
        assert!(s.contains("gpu-launch-2 --bin \"$B/bin/fsdp-tests-gpu_nccl\""));
        assert!(s.contains(
            "gpu-launch-2 --train-gpt --bin \"$B/bin/train_gpt\" -- '--device' 'cuda' \
             '--backend' 'nccl'"
        ));
        assert!(s.contains(
            "env FSDP_GPU_TESTS=1 \"$B/bin/fsdp-collectives-lib\" 'shared_gpu::gpu_tests'"
        ));
        // Steps that need more GPUs than the machine has say so.
        assert!(s.contains("skipped: needs $min GPUs"));
        assert!(s.contains(
            "gpu-peer --train-gpt \"$B/bin/train_gpt\" --script \"$B/torch_fsdp2_peer.py\""
        ));
    }

    #[test]
    fn shell_quoting_survives_quotes() {
        assert_eq!(sh_quote("a'b"), r#"'a'\''b'"#);
    }
}
