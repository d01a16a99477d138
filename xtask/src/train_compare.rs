//! `cargo xtask gpu-train-compare shared-gpu|mpi-gpu [--train-gpt BIN] [--out DIR]`: train_gpt
//! on W ranks sharing one GPU against the same job on W CPU thread ranks (the `shared-gpu` and
//! `mpi-gpu` suites of `cargo xtask gpu-test` and of the bundle's `run.sh`).
//!
//! - `shared-gpu`: `train_gpt --device cuda --ranks 4` with one GPU visible (the first one:
//!   `CUDA_VISIBLE_DEVICES` is narrowed to it, so the four thread ranks share it through the
//!   shared-GPU backend) for FullShard, ShardGradOp and HybridShard (`--shard-size 2`), 20 AdamW
//!   steps each, against `train_gpt --ranks 4` on CPU thread ranks: every step's loss within
//!   1e-4 relative; the same under bf16 mixed precision (FullShard) within the CPU run's own
//!   bf16-vs-f32 difference and at least one bf16 ulp (the `fsdp` suite's rule); the peak
//!   allocated bytes per rank ([`memory_bound`]: at most the CPU peak plus what a CUDA device
//!   adds — 1 MiB of segment rounding per unsharded unit alive at the peak and 2 MiB of kernel
//!   scratch — and in f32 at least 0.95× the CPU peak); `--json` naming the backend
//!   `shared-gpu`; and in the `--profile` trace of step 2 every rank's timeline holding an
//!   all-gather and a reduce-scatter interval (category `shared-gpu`) that overlaps one of that
//!   rank's compute kernels.
//! - `mpi-gpu`: `mpirun -n 2 train_gpt --backend mpi --device cuda` with one GPU visible (both
//!   processes on it, collectives staged through host memory) against `train_gpt --ranks 2` on
//!   CPU thread ranks, FullShard and ShardGradOp: losses within 1e-4 relative, `--json` naming
//!   the backend `mpi`. The binary must be built with both `cuda` and `mpi` (`cargo build
//!   --release -p fsdp-train --features cuda,mpi`; without `--train-gpt` this command builds
//!   it), and `mpirun` (OpenMPI) must be installed.
//!
//! Written without a GPU: none of it has run on one yet (see `docs/GPU-STATUS.md`).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::mpi::{capture, mpirun};
use crate::{cargo, run};

/// Optimizer steps of every run.
const STEPS: &str = "20";
/// Relative loss tolerance of the f32 comparisons.
const REL: f64 = 1e-4;
/// Ranks of the shared-GPU comparisons.
const SHARED_RANKS: &str = "4";
/// Processes of the MPI comparison.
const MPI_RANKS: usize = 2;

/// One train_gpt configuration compared on both sides.
struct Case {
    name: &'static str,
    args: &'static [&'static str],
    /// Unsharded units alive at the peak (FSDP wraps each of GPT-mini's 4 blocks): 2 when
    /// resharded after forward (the unit computed and the prefetched one), every block under
    /// ShardGradOp.
    live_units: u64,
    bf16: bool,
}

const SHARED_CASES: &[Case] = &[
    Case {
        name: "full-shard",
        args: &["--strategy", "full-shard"],
        live_units: 2,
        bf16: false,
    },
    Case {
        name: "shard-grad-op",
        args: &["--strategy", "shard-grad-op"],
        live_units: 4,
        bf16: false,
    },
    Case {
        name: "hybrid-shard-f2",
        args: &["--strategy", "hybrid-shard", "--shard-size", "2"],
        live_units: 2,
        bf16: false,
    },
    Case {
        name: "full-shard-bf16",
        args: &["--strategy", "full-shard", "--mixed-precision", "bf16"],
        live_units: 2,
        bf16: true,
    },
];

const MPI_CASES: &[Case] = &[
    Case {
        name: "full-shard",
        args: &["--strategy", "full-shard"],
        live_units: 2,
        bf16: false,
    },
    Case {
        name: "shard-grad-op",
        args: &["--strategy", "shard-grad-op"],
        live_units: 4,
        bf16: false,
    },
];

/// The arguments every run shares (GPT-mini, the default model; `{metrics}` is replaced).
fn common_args(metrics: &Path) -> Vec<String> {
    [
        "--steps",
        STEPS,
        "--optimizer",
        "adamw",
        "--no-progress",
        "--json",
        "--metrics",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain(std::iter::once(metrics.display().to_string()))
    .collect()
}

/// `CUDA_VISIBLE_DEVICES` narrowed to the first visible GPU.
fn first_gpu() -> String {
    std::env::var("CUDA_VISIBLE_DEVICES")
        .ok()
        .and_then(|v| {
            v.split(',')
                .map(str::trim)
                .find(|s| !s.is_empty())
                .map(String::from)
        })
        .unwrap_or_else(|| "0".into())
}

/// Per-step losses from a `--metrics` file.
fn losses(path: &Path) -> Result<Vec<f64>, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: Value =
                serde_json::from_str(l).map_err(|e| format!("{}: {e}: {l}", path.display()))?;
            v["loss"]
                .as_f64()
                .ok_or_else(|| format!("{}: no loss in {l}", path.display()))
        })
        .collect()
}

fn json(line: &str) -> Result<Value, String> {
    serde_json::from_str(line).map_err(|e| format!("not a JSON line ({e}): {line}"))
}

/// One bf16 ulp at `x`'s magnitude (as in `tests/tests/gpu_fsdp.rs`).
pub fn bf16_ulp(x: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return 0.0;
    }
    2f64.powi(x.abs().log2().floor() as i32 - 7)
}

/// Checks every step's GPU loss against the CPU loss: within `rel` relative, and under bf16 at
/// least one bf16 ulp.
pub fn compare_losses(
    what: &str,
    gpu: &[f64],
    cpu: &[f64],
    rel: f64,
    bf16: bool,
) -> Result<(), String> {
    if gpu.len() != cpu.len() || gpu.is_empty() {
        return Err(format!(
            "{what}: {} GPU steps vs {} CPU steps",
            gpu.len(),
            cpu.len()
        ));
    }
    for (step, (g, c)) in gpu.iter().zip(cpu).enumerate() {
        let allowed = if bf16 {
            (rel * c.abs()).max(bf16_ulp(*c))
        } else {
            rel * c.abs()
        };
        if (g - c).abs() > allowed || !g.is_finite() {
            return Err(format!(
                "{what}: step {}: GPU loss {g} vs CPU {c} (allowed {allowed:.3e})",
                step + 1
            ));
        }
    }
    Ok(())
}

/// The largest relative difference between two runs' losses.
fn worst_relative(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs())
        .fold(0.0, f64::max)
}

/// The per-rank peak memory rule: `(lowest, highest)` bytes a GPU run may report against the
/// CPU run's `cpu` bytes. A CUDA device adds at most 1 MiB per large unsharded unit alive at
/// the peak (the allocator rounds a new large segment up to 2 MiB and does not split off a
/// remainder of 1 MiB or less) and 2 MiB of kernel scratch; f32 runs hold at least 0.95× the
/// CPU peak (half precision may hold less: the CUDA kernels take bf16 operands directly where
/// the CPU widens them into f32 temporaries). The `fsdp` suite's model, in its upper-bound form.
pub fn memory_bound(cpu: u64, live_units: u64, bf16: bool) -> (u64, u64) {
    const MIB: u64 = 1 << 20;
    let low = if bf16 { 0 } else { cpu * 95 / 100 };
    (low, cpu + live_units * MIB + 2 * MIB)
}

/// A GPU interval of a Chrome trace.
#[derive(Debug, Clone, PartialEq)]
pub struct Interval {
    /// The timeline (the rank).
    pub pid: u64,
    /// The track.
    pub tid: u64,
    /// Category.
    pub cat: String,
    /// Name.
    pub name: String,
    /// Start, µs.
    pub ts: f64,
    /// Duration, µs.
    pub dur: f64,
}

/// The complete (`"X"`) events of a Chrome trace written by `train_gpt --profile`.
pub fn intervals(trace: &str) -> Result<Vec<Interval>, String> {
    let v: Value = serde_json::from_str(trace).map_err(|e| format!("the trace: {e}"))?;
    let events = v["traceEvents"]
        .as_array()
        .ok_or("the trace has no traceEvents")?;
    Ok(events
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| Interval {
            pid: e["pid"].as_u64().unwrap_or(u64::MAX),
            tid: e["tid"].as_u64().unwrap_or(u64::MAX),
            cat: e["cat"].as_str().unwrap_or("").to_string(),
            name: e["name"].as_str().unwrap_or("").to_string(),
            ts: e["ts"].as_f64().unwrap_or(0.0),
            dur: e["dur"].as_f64().unwrap_or(0.0),
        })
        .collect())
}

/// Checks that each of ranks `0..ranks` has an all-gather and a reduce-scatter interval of the
/// shared-GPU backend that overlaps one of its own compute kernels on another track.
pub fn check_overlap(events: &[Interval], ranks: u64) -> Result<(), String> {
    for rank in 0..ranks {
        let kernels: Vec<&Interval> = events
            .iter()
            .filter(|e| e.pid == rank && e.cat == "kernel")
            .collect();
        if kernels.is_empty() {
            return Err(format!("rank {rank}: no GPU kernel intervals in the trace"));
        }
        for op in ["all_gather", "reduce_scatter"] {
            let colls: Vec<&Interval> = events
                .iter()
                .filter(|e| e.pid == rank && e.cat == "shared-gpu" && e.name == op)
                .collect();
            if colls.is_empty() {
                return Err(format!(
                    "rank {rank}: no shared-gpu {op} interval in the trace"
                ));
            }
            let overlaps = colls.iter().any(|c| {
                kernels.iter().any(|k| {
                    k.tid != c.tid && k.ts < c.ts + c.dur && c.ts < k.ts + k.dur && k.dur > 0.0
                })
            });
            if !overlaps {
                return Err(format!(
                    "rank {rank}: none of its {} {op} intervals overlaps its compute kernels",
                    colls.len()
                ));
            }
        }
    }
    Ok(())
}

/// Runs `cmd` and returns its `--json` line, parsed.
fn summary(step: &str, cmd: &mut Command) -> Result<Value, String> {
    json(&capture(step, cmd)?)
}

/// The train_gpt to run: `given`, else built here (release, `cuda`, plus `mpi` when `mpi`).
fn binary(given: Option<&str>, mpi: bool) -> Result<PathBuf, String> {
    if let Some(b) = given {
        return Ok(PathBuf::from(b));
    }
    let features = if mpi { "cuda,mpi" } else { "cuda" };
    run(
        &format!("build train_gpt ({features})"),
        cargo().args([
            "build",
            "--release",
            "-p",
            "fsdp-train",
            "--features",
            features,
            "--bin",
            "train_gpt",
        ]),
    )?;
    Ok(crate::util::target_dir().join("release/train_gpt"))
}

/// `gpu-train-compare`: runs the comparison `which` (`shared-gpu` or `mpi-gpu`).
pub fn gpu_train_compare(
    which: &str,
    train_gpt: Option<&str>,
    out: Option<&str>,
) -> Result<(), String> {
    let out = out.map_or_else(
        || crate::root().join("target/gpu-test").join(which),
        PathBuf::from,
    );
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    match which {
        "shared-gpu" => shared_gpu(&binary(train_gpt, false)?, &out),
        "mpi-gpu" => mpi_gpu(&binary(train_gpt, true)?, &out),
        other => Err(format!(
            "gpu-train-compare: unknown comparison {other:?}; expected shared-gpu or mpi-gpu"
        )),
    }
}

fn shared_gpu(bin: &Path, out: &Path) -> Result<(), String> {
    let gpu = first_gpu();
    let mut cpu_f32_full: Option<Vec<f64>> = None;
    let mut failures = Vec::new();
    for case in SHARED_CASES {
        let cpu_metrics = out.join(format!("{}-cpu.jsonl", case.name));
        let gpu_metrics = out.join(format!("{}-gpu.jsonl", case.name));
        let trace = out.join(format!("{}-gpu.trace.json", case.name));
        let cpu = summary(
            &format!("shared-gpu {}: CPU thread ranks", case.name),
            Command::new(bin)
                .args(["--ranks", SHARED_RANKS])
                .args(case.args)
                .args(common_args(&cpu_metrics)),
        )?;
        let g = summary(
            &format!(
                "shared-gpu {}: {SHARED_RANKS} ranks on one GPU (CUDA_VISIBLE_DEVICES={gpu})",
                case.name
            ),
            Command::new(bin)
                .env("CUDA_VISIBLE_DEVICES", &gpu)
                .args(["--device", "cuda", "--ranks", SHARED_RANKS])
                .args(case.args)
                .args(common_args(&gpu_metrics))
                .arg("--profile")
                .arg(&trace),
        )?;
        let (cl, gl) = (losses(&cpu_metrics)?, losses(&gpu_metrics)?);
        let check = || -> Result<String, String> {
            if g["backend"] != "shared-gpu" {
                return Err(format!(
                    "--json names backend {} (expected shared-gpu)",
                    g["backend"]
                ));
            }
            let rel = if case.bf16 {
                let f32_run = cpu_f32_full
                    .as_ref()
                    .ok_or("the f32 FullShard CPU run comes first")?;
                let worst = worst_relative(&cl, f32_run);
                if worst == 0.0 {
                    return Err("the CPU bf16 and f32 runs are identical: not a bf16 run".into());
                }
                worst
            } else {
                REL
            };
            compare_losses(case.name, &gl, &cl, rel, case.bf16)?;
            let field = |v: &Value, k: &str| -> Result<u64, String> {
                v[k].as_u64().ok_or_else(|| format!("no {k} in {v}"))
            };
            let (cp, gp) = (
                field(&cpu, "peak_allocated_bytes_per_rank")?,
                field(&g, "peak_allocated_bytes_per_rank")?,
            );
            let (low, high) = memory_bound(cp, case.live_units, case.bf16);
            if gp < low || gp > high {
                return Err(format!(
                    "peak allocated {gp} B per rank on the GPU vs {cp} B on CPU ranks: outside \
                     [{low}, {high}] (ratio {:.3})",
                    gp as f64 / cp as f64
                ));
            }
            let text = std::fs::read_to_string(&trace)
                .map_err(|e| format!("--profile {}: {e}", trace.display()))?;
            check_overlap(&intervals(&text)?, 4)?;
            Ok(format!(
                "losses within {rel:.3e} relative over {} steps, peak {gp} B/rank vs CPU {cp} B \
                 ({:.3}), collectives overlap compute on every rank",
                gl.len(),
                gp as f64 / cp as f64
            ))
        };
        match check() {
            Ok(line) => eprintln!("xtask: shared-gpu {}: PASS: {line}", case.name),
            Err(e) => {
                eprintln!("xtask: shared-gpu {}: FAIL: {e}", case.name);
                failures.push(format!("{}: {e}", case.name));
            }
        }
        if case.name == "full-shard" {
            cpu_f32_full = Some(cl);
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(format!("shared-gpu: {}", failures.join("; ")))
    }
}

fn mpi_gpu(bin: &Path, out: &Path) -> Result<(), String> {
    crate::mpi::check_mpirun()?;
    let gpu = first_gpu();
    let mut failures = Vec::new();
    for case in MPI_CASES {
        let cpu_metrics = out.join(format!("{}-cpu.jsonl", case.name));
        let gpu_metrics = out.join(format!("{}-mpi-gpu.jsonl", case.name));
        let _cpu = summary(
            &format!("mpi-gpu {}: {MPI_RANKS} CPU thread ranks", case.name),
            Command::new(bin)
                .args(["--ranks", &MPI_RANKS.to_string()])
                .args(case.args)
                .args(common_args(&cpu_metrics)),
        )?;
        let g = summary(
            &format!(
                "mpi-gpu {}: mpirun -n {MPI_RANKS} on one GPU (CUDA_VISIBLE_DEVICES={gpu})",
                case.name
            ),
            // In the scratch directory: the bundle runs where the source tree does not exist.
            mpirun(MPI_RANKS)
                .current_dir(out)
                .args(["-x", &format!("CUDA_VISIBLE_DEVICES={gpu}")])
                .arg(bin)
                .args(["--backend", "mpi", "--device", "cuda"])
                .args(case.args)
                .args(common_args(&gpu_metrics)),
        )?;
        let check = || -> Result<(), String> {
            if g["backend"] != "mpi" {
                return Err(format!(
                    "--json names backend {} (expected mpi)",
                    g["backend"]
                ));
            }
            compare_losses(
                case.name,
                &losses(&gpu_metrics)?,
                &losses(&cpu_metrics)?,
                REL,
                false,
            )
        };
        match check() {
            Ok(()) => eprintln!(
                "xtask: mpi-gpu {}: PASS: losses within {REL:e} relative",
                case.name
            ),
            Err(e) => {
                eprintln!("xtask: mpi-gpu {}: FAIL: {e}", case.name);
                failures.push(format!("{}: {e}", case.name));
            }
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(format!("mpi-gpu: {}", failures.join("; ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn losses_compare_within_the_tolerance_and_bf16_ulps() {
        let cpu = [3.0, 2.5, 2.0];
        assert!(compare_losses("x", &[3.0002, 2.5, 2.0], &cpu, 1e-4, false).is_ok());
        let e = compare_losses("x", &[3.0, 2.5, 2.001], &cpu, 1e-4, false).unwrap_err();
        assert!(e.contains("step 3"), "{e}");
        assert!(compare_losses("x", &[3.0], &cpu, 1e-4, false).is_err());
        assert!(compare_losses("x", &[f64::NAN, 2.5, 2.0], &cpu, 1e-4, false).is_err());
        // Under bf16 one ulp is always allowed (2^-6 at 3.9).
        assert_eq!(bf16_ulp(3.90625), 0.015625);
        assert!(compare_losses("x", &[3.890625], &[3.90625], 1e-6, true).is_ok());
        assert!(compare_losses("x", &[3.875], &[3.90625], 1e-6, true).is_err());
        assert!((worst_relative(&[1.1, 2.0], &[1.0, 2.0]) - 0.1).abs() < 1e-12);
    }

    #[test]
    fn the_memory_bound_is_the_fsdp_suites_model() {
        let mib = 1u64 << 20;
        assert_eq!(memory_bound(100 * mib, 2, false), (95 * mib, 104 * mib));
        assert_eq!(memory_bound(100 * mib, 4, true), (0, 106 * mib));
        // The H100 measurement of the fsdp suite (FullShard, W = 1) fits it.
        let (low, high) = memory_bound(52_790_784, 2, false);
        assert!((low..=high).contains(&54_867_456));
    }

    #[test]
    fn overlap_is_found_per_rank_on_its_own_timeline() {
        let x = |pid, tid, cat: &str, name: &str, ts, dur| Interval {
            pid,
            tid,
            cat: cat.into(),
            name: name.into(),
            ts,
            dur,
        };
        let mut ev = vec![
            x(0, 1, "kernel", "sgemm", 0.0, 10.0),
            x(0, 2, "shared-gpu", "all_gather", 5.0, 10.0),
            x(0, 3, "shared-gpu", "reduce_scatter", 8.0, 1.0),
            x(1, 4, "kernel", "sgemm", 100.0, 10.0),
            x(1, 5, "shared-gpu", "all_gather", 105.0, 1.0),
        ];
        // Rank 1's reduce-scatter runs after its kernels only: no overlap.
        ev.push(x(1, 6, "shared-gpu", "reduce_scatter", 200.0, 5.0));
        assert!(check_overlap(&ev, 1).is_ok());
        let e = check_overlap(&ev, 2).unwrap_err();
        assert!(e.contains("rank 1") && e.contains("reduce_scatter"), "{e}");
        // Rank 0's kernels on rank 1's timeline would not count.
        ev.pop();
        ev.push(x(0, 6, "shared-gpu", "reduce_scatter", 105.0, 5.0));
        assert!(check_overlap(&ev, 2).unwrap_err().contains("rank 1"));
        let trace = r#"{"traceEvents":[{"ph":"M","name":"thread_name","pid":0,"tid":1,"args":{"name":"gpu default"}},
            {"ph":"X","name":"sgemm","cat":"kernel","pid":0,"tid":1,"ts":1.5,"dur":2.0}]}"#;
        assert_eq!(
            intervals(trace).unwrap(),
            vec![x(0, 1, "kernel", "sgemm", 1.5, 2.0)]
        );
    }
}
