//! `cargo xtask gpu-peer`: `train_gpt --device cuda` beside PyTorch FSDP2 on the same GPU, in
//! one run, shape by shape.
//!
//! For each configuration it runs `train_gpt` (one process, one GPU, `--json`) and the PyTorch
//! peer `fsdp-train/benches/torch_fsdp2_peer.py` (one process for all configurations: the same
//! GPT, `fully_shard` per block and on the root, SGD, timed the same way: median step after the
//! first), prints a table and, as its last line, one JSON object with a row per configuration
//! (`ours_step_ms`, `torch_step_ms`, `ours_over_torch_tokens`, peak allocated bytes of both,
//! `ours_host_syncs_per_step`). It needs a GPU and Python with PyTorch built for CUDA; without
//! them it fails with one line saying which is missing (it never reports a comparison it did not
//! make). The GPU bundle (`cargo xtask gpu-bundle`) carries the script and runs this as its
//! `peer` suite.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

/// One compared configuration: a name the peer script understands and `train_gpt`'s flags.
struct Config {
    /// `MODEL[:bf16][:tf32][:offload][:bBATCH]`, as `torch_fsdp2_peer.py --config` reads it.
    name: &'static str,
    /// `train_gpt` arguments after `--device cuda --json --no-progress`.
    args: &'static [&'static str],
}

/// The configurations, smallest first (the GPT-2 ones are the issue #24 / #25 targets).
const CONFIGS: &[Config] = &[
    Config {
        name: "mini",
        args: &["--steps", "20"],
    },
    Config {
        name: "small",
        args: &["--model", "small", "--batch", "16", "--steps", "12"],
    },
    Config {
        name: "gpt2",
        args: &["--model", "gpt2", "--batch", "4", "--steps", "8"],
    },
    Config {
        name: "gpt2:tf32",
        args: &["--model", "gpt2", "--batch", "4", "--steps", "8", "--tf32"],
    },
    Config {
        name: "gpt2:bf16",
        args: &[
            "--model",
            "gpt2",
            "--batch",
            "4",
            "--steps",
            "8",
            "--mixed-precision",
            "bf16",
        ],
    },
    Config {
        name: "gpt2:offload",
        args: &[
            "--model",
            "gpt2",
            "--batch",
            "4",
            "--steps",
            "6",
            "--cpu-offload",
        ],
    },
];

/// The last line of `out` that parses as a JSON object.
fn last_json(out: &str) -> Option<Value> {
    out.lines()
        .rev()
        .filter(|l| l.trim_start().starts_with('{'))
        .find_map(|l| serde_json::from_str::<Value>(l).ok())
}

/// All lines of `out` that parse as JSON objects.
fn json_lines(out: &str) -> Vec<Value> {
    out.lines()
        .filter(|l| l.trim_start().starts_with('{'))
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .collect()
}

fn num(v: &Value, key: &str) -> Option<f64> {
    v.get(key).and_then(Value::as_f64)
}

/// The bundle's `bin/` when this binary runs from a GPU bundle (its `train_gpt` beside it and
/// the peer script one level up), else `None` (a checkout: cargo builds what is needed).
fn bundle_bin_dir() -> Option<PathBuf> {
    let dir = std::env::current_exe().ok()?.parent()?.to_path_buf();
    let bundled = dir.join("train_gpt").is_file()
        && dir.join("..").join(crate::bundle::PEER_SCRIPT).is_file();
    bundled.then_some(dir)
}

/// `train_gpt`: the argument, or `bin/train_gpt` beside this binary (the bundle), or a release
/// build through cargo (a checkout).
fn train_gpt(given: Option<&str>) -> Result<PathBuf, String> {
    if let Some(p) = given {
        return Ok(PathBuf::from(p));
    }
    if let Some(dir) = bundle_bin_dir() {
        return Ok(dir.join("train_gpt"));
    }
    crate::run(
        "gpu-peer: build train_gpt (cuda)",
        crate::cargo()
            .arg("build")
            .args(crate::util::TRAIN_GPT_CUDA),
    )?;
    Ok(crate::root().join("target/release/train_gpt"))
}

/// The peer script: the argument, `torch_fsdp2_peer.py` beside the bundle's `bin/`, or the
/// checkout's copy.
fn script(given: Option<&str>) -> PathBuf {
    if let Some(p) = given {
        return PathBuf::from(p);
    }
    if let Some(dir) = bundle_bin_dir() {
        return dir.join("..").join(crate::bundle::PEER_SCRIPT);
    }
    crate::root().join("fsdp-train/benches/torch_fsdp2_peer.py")
}

/// `cargo xtask gpu-peer [--train-gpt BIN] [--script PY]`.
pub fn gpu_peer(train_gpt_bin: Option<&str>, script_path: Option<&str>) -> Result<(), String> {
    let gpus = crate::gpu_test::find_gpu()?;
    let python = std::env::var("FSDP_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = Command::new(&python)
        .args([
            "-c",
            "import torch; assert torch.cuda.is_available(); print(torch.__version__)",
        ])
        .output()
        .map_err(|e| {
            format!("gpu-peer: cannot run {python} ({e}): PyTorch is needed for the peer")
        })?;
    if !probe.status.success() {
        return Err(format!(
            "gpu-peer: PyTorch with CUDA not found ({python} -c 'import torch' failed or sees no \
             GPU; set FSDP_PYTHON to a Python that has it): no comparison was made"
        ));
    }
    let script = script(script_path);
    if !script.is_file() {
        return Err(format!(
            "gpu-peer: peer script {} not found",
            script.display()
        ));
    }
    let tg = train_gpt(train_gpt_bin)?;
    println!(
        "gpu-peer: {gpus} GPU(s); train_gpt {}; PyTorch {} ({})",
        tg.display(),
        String::from_utf8_lossy(&probe.stdout).trim(),
        script.display()
    );

    // Ours, one process per configuration.
    let mut ours: Vec<Result<Value, String>> = Vec::new();
    for c in CONFIGS {
        let out = Command::new(&tg)
            .args(["--device", "cuda", "--json", "--no-progress"])
            .args(c.args)
            .output()
            .map_err(|e| format!("gpu-peer: running {}: {e}", tg.display()))?;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let row = match (out.status.success(), last_json(&text)) {
            (true, Some(v)) => Ok(v),
            _ => Err(format!(
                "train_gpt {} exited {:?}: {}",
                c.args.join(" "),
                out.status.code(),
                String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
            )),
        };
        ours.push(row);
    }

    // The peer, one process for all configurations.
    let mut cmd = Command::new(&python);
    cmd.arg(&script);
    for c in CONFIGS {
        cmd.args(["--config", c.name]);
    }
    let out = cmd
        .output()
        .map_err(|e| format!("gpu-peer: running {}: {e}", script.display()))?;
    let peer = json_lines(&String::from_utf8_lossy(&out.stdout));
    if !out.status.success() || peer.len() != CONFIGS.len() {
        return Err(format!(
            "gpu-peer: the PyTorch peer exited {:?} with {} of {} results: {}",
            out.status.code(),
            peer.len(),
            CONFIGS.len(),
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .rev()
                .take(3)
                .collect::<Vec<_>>()
                .join(" | ")
        ));
    }

    println!(
        "{:<14} {:>12} {:>12} {:>10} {:>14} {:>14} {:>7}",
        "config", "ours ms", "torch ms", "ours/torch", "ours peak MB", "torch peak MB", "syncs"
    );
    let mut rows = Vec::new();
    let mut failed = Vec::new();
    for ((c, o), p) in CONFIGS.iter().zip(&ours).zip(&peer) {
        let t_ms = num(p, "step_ms_median");
        let t_peak = num(p, "peak_allocated_bytes");
        match o {
            Ok(o) => {
                let o_ms = num(o, "step_ms_median");
                let ratio = match (o_ms, t_ms) {
                    (Some(a), Some(b)) if a > 0.0 => Some(b / a),
                    _ => None,
                };
                let o_peak = num(o, "peak_allocated_bytes_per_rank");
                let syncs = num(o, "host_syncs_per_step");
                let mb = |b: Option<f64>| b.map_or("-".into(), |b| format!("{:.1}", b / 1e6));
                let f = |x: Option<f64>, p: usize| x.map_or("-".into(), |x| format!("{x:.p$}"));
                println!(
                    "{:<14} {:>12} {:>12} {:>10} {:>14} {:>14} {:>7}",
                    c.name,
                    f(o_ms, 2),
                    f(t_ms, 2),
                    f(ratio, 3),
                    mb(o_peak),
                    mb(t_peak),
                    f(syncs, 1)
                );
                rows.push(serde_json::json!({
                    "config": c.name,
                    "ours_step_ms": o_ms,
                    "torch_step_ms": t_ms,
                    "ours_over_torch_tokens": ratio,
                    "ours_peak_allocated_bytes": o_peak,
                    "torch_peak_allocated_bytes": t_peak,
                    "ours_host_syncs_per_step": syncs,
                }));
            }
            Err(e) => {
                println!("{:<14} FAILED: {e}", c.name);
                failed.push(c.name);
                rows.push(serde_json::json!({ "config": c.name, "error": e }));
            }
        }
    }
    let gpu = peer.first().and_then(|p| p.get("device").cloned());
    let torch = peer.first().and_then(|p| p.get("torch").cloned());
    println!(
        "{}",
        serde_json::json!({ "gpu": gpu, "torch": torch, "rows": rows })
    );
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("gpu-peer: train_gpt failed for {failed:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_json_skips_text_and_broken_lines() {
        let out = "step 1 | loss 3\n{\"a\": 1}\n{not json\nsummary\n";
        assert_eq!(last_json(out).and_then(|v| num(&v, "a")), Some(1.0));
        assert!(last_json("no json here").is_none());
        assert_eq!(json_lines("{\"a\":1}\nx\n{\"b\":2}\n").len(), 2);
    }

    #[test]
    fn every_config_names_a_model_the_peer_knows() {
        let script =
            std::fs::read_to_string(crate::root().join("fsdp-train/benches/torch_fsdp2_peer.py"))
                .unwrap();
        for c in CONFIGS {
            let model = c.name.split(':').next().unwrap();
            assert!(
                script.contains(&format!("\"{model}\": (")),
                "{model} not in the peer"
            );
            for flag in c.name.split(':').skip(1) {
                assert!(
                    script.contains(&format!("\"{flag}\" in parts")),
                    "{flag} not parsed"
                );
            }
        }
    }
}
