//! `cargo xtask bench cpu-peer`: fsdp-rs against PyTorch FSDP2 on this machine's CPU, the same
//! GPT-mini job, interleaved.
//!
//! Each of [`REPS`] repetitions runs `train_gpt --ranks 4 --optimizer adamw --batch 4` (FullShard,
//! 4 thread ranks, each with max(1, cores / 4) matmul threads) and then the PyTorch peer
//! (`fsdp-train/benches/torch_fsdp2_peer.py --device cpu --world 4 --optimizer adamw --batch 4`:
//! 4 gloo processes with max(1, cores / 4) intra-op threads each, `fully_shard` per block and on
//! the root), reading each one's `step_ms_median` (median step of rank 0 after the first
//! [`WARMUP`] steps for the peer and after the first step for train_gpt) and the 1-minute load
//! average just before it. Prints a table and, as its last line, one JSON object:
//! `ours_step_ms` / `torch_step_ms` (per repetition), their medians,
//! `torch_over_ours_step_time` (the median of PyTorch's step time over ours; the target is
//! ≥ 2.0), `load_average`, and `cpu_isa` (`FSDP_CPU_ISA` as passed to train_gpt, or `detected`).
//! `FSDP_CPU_ISA=avx2 cargo xtask bench cpu-peer` runs fsdp-rs capped at AVX2 (PyTorch picks its
//! own kernels). It needs Python with PyTorch; without it the command fails with one line saying
//! so (it never reports a comparison it did not make).

use std::process::Command;

use serde_json::Value;

/// Repetitions (each: ours, then PyTorch).
const REPS: usize = 3;
/// Steps per run.
const STEPS: usize = 15;
/// Steps the peer leaves out of its median.
const WARMUP: usize = 2;

/// The last line of `out` that parses as a JSON object.
fn last_json(out: &str) -> Option<Value> {
    out.lines()
        .rev()
        .filter(|l| l.trim_start().starts_with('{'))
        .find_map(|l| serde_json::from_str::<Value>(l).ok())
}

/// Runs `cmd`, returns `step_ms_median` of its last JSON line.
fn step_ms(what: &str, cmd: &mut Command) -> Result<f64, String> {
    eprintln!("xtask: cpu-peer: {what}: {cmd:?}");
    let out = cmd
        .output()
        .map_err(|e| format!("cpu-peer: {what}: could not start: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(15).collect();
        return Err(format!(
            "cpu-peer: {what} failed ({}):\n{}",
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        ));
    }
    last_json(&stdout)
        .and_then(|v| v.get("step_ms_median").and_then(Value::as_f64))
        .ok_or_else(|| format!("cpu-peer: {what} printed no JSON line with step_ms_median"))
}

/// The 1-minute load average (Linux), or NaN.
fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// `cargo xtask bench cpu-peer` (see the module docs).
pub fn bench_cpu_peer() -> Result<(), String> {
    let torch = Command::new("python3")
        .args(["-c", "import torch, torch.distributed"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !torch {
        return Err(
            "cpu-peer: python3 cannot import torch (install PyTorch: python3 -m pip install \
             torch); no comparison made"
                .into(),
        );
    }
    crate::run(
        "cpu-peer: build train_gpt",
        crate::cargo().args([
            "build",
            "--release",
            "-p",
            "fsdp-train",
            "--bin",
            "train_gpt",
        ]),
    )?;
    let root = crate::root();
    let bin = root.join("target/release/train_gpt");
    let script = root.join("fsdp-train/benches/torch_fsdp2_peer.py");
    let steps = STEPS.to_string();
    let warmup = WARMUP.to_string();
    let (mut ours, mut theirs, mut loads) = (Vec::new(), Vec::new(), Vec::new());
    for rep in 1..=REPS {
        loads.push(load_average());
        ours.push(step_ms(
            &format!("train_gpt (repetition {rep})"),
            Command::new(&bin).current_dir(&root).args([
                "--ranks",
                "4",
                "--optimizer",
                "adamw",
                "--batch",
                "4",
                "--steps",
                &steps,
                "--json",
                "--no-progress",
            ]),
        )?);
        loads.push(load_average());
        theirs.push(step_ms(
            &format!("PyTorch FSDP2 (repetition {rep})"),
            Command::new("python3")
                .current_dir(&root)
                .arg(&script)
                .args([
                    "--device",
                    "cpu",
                    "--world",
                    "4",
                    "--optimizer",
                    "adamw",
                    "--batch",
                    "4",
                    "--config",
                    "mini",
                    "--steps",
                    &steps,
                    "--warmup",
                    &warmup,
                ]),
        )?);
    }
    let isa = std::env::var("FSDP_CPU_ISA").unwrap_or_else(|_| "detected".into());
    println!("GPT-mini, 4 ranks x 4 sequences, AdamW, f32, FullShard; fsdp-rs CPU level: {isa}");
    println!(
        "{:>3} | {:>15} | {:>15} | {:>12}",
        "rep", "fsdp-rs ms/step", "PyTorch ms/step", "torch / ours"
    );
    for i in 0..REPS {
        println!(
            "{:>3} | {:>15.1} | {:>15.1} | {:>12.2}",
            i + 1,
            ours[i],
            theirs[i],
            theirs[i] / ours[i]
        );
    }
    let (mo, mt) = (median(ours.clone()), median(theirs.clone()));
    println!(
        "median: fsdp-rs {mo:.1} ms, PyTorch FSDP2 {mt:.1} ms, ratio {:.2} (target >= 2.0)",
        mt / mo
    );
    let j = serde_json::json!({
        "bench": "cpu-peer",
        "model": "mini",
        "ranks": 4,
        "batch_per_rank": 4,
        "optimizer": "adamw",
        "cpu_isa": isa,
        "ours_step_ms": ours,
        "torch_step_ms": theirs,
        "ours_step_ms_median": mo,
        "torch_step_ms_median": mt,
        "torch_over_ours_step_time": mt / mo,
        "load_average": loads,
    });
    println!("{j}");
    Ok(())
}
