//! The training program's part of a checkpoint: what `train_gpt` stores in the user metadata of
//! fsdp-core's [`checkpoint`](fsdp_core::checkpoint) manager, and the check that a resumed run is
//! the run that saved it.
//!
//! The manager (`fsdp_core::checkpoint::CheckpointManager`) writes `ROOT/step_N/` all-or-nothing
//! (staging directory, fsync, one rename after every rank finished; per-tensor checksums and a
//! save id in every file; non-finite values refused; keep the last K) and finds the newest
//! complete one. On top, `train_gpt` stores one metadata entry, `train_gpt`, a JSON object with
//! - `fingerprint`: the settings a resumed run must share (model shape and GELU, optimizer with
//!   every hyper-parameter by name, global batch, data file, seed, and the learning-rate schedule:
//!   `--lr`, `--warmup-steps`, `--min-lr` and, with `--min-lr`, `--steps`; f32 settings stored
//!   as their shortest decimal, compared as f32s) — a mismatch names the flag and both values,
//!   for the optimizer every flag that differs, model and optimizer first; the data position is the step times the global batch, so
//!   equal global batches make a resumed run see the same sequences, and the schedule is
//!   continued, never silently changed (a resume that would change it is refused naming the
//!   flag; without `--min-lr`, `--steps` may grow: the schedule is constant after warm-up);
//! - `world_size`: the rank count that saved it (informational: resuming at another count works);
//! - `history`: `step`, `loss`, `val_loss`, `tokens_per_s` of every step so far (for the plot).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::optim::{OptimHyper, OptimizerArg};

/// The metadata key holding `train_gpt`'s JSON.
pub const META_KEY: &str = "train_gpt";

/// A checkpoint problem of the training program.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The checkpoint lacks or garbles `train_gpt`'s metadata.
    #[error("{path}: {reason}")]
    Format {
        /// The checkpoint.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The checkpoint's optimizer differs from this run's.
    #[error("cannot resume from {path}: the optimizer differs: {diffs}; resume with the checkpoint's optimizer settings or start a new --checkpoint-dir")]
    Optimizer {
        /// The checkpoint.
        path: PathBuf,
        /// Each differing flag with this run's value and the checkpoint's.
        diffs: String,
    },
    /// The checkpoint is of another run than the one asked for.
    #[error("cannot resume from {path}: it was saved with {what} = {saved}, this run has {now}; resume with the same setting or start a new --checkpoint-dir")]
    Mismatch {
        /// The checkpoint.
        path: PathBuf,
        /// Which setting.
        what: &'static str,
        /// Its value in the checkpoint.
        saved: String,
        /// Its value now.
        now: String,
    },
}

/// The metadata map to save with step `step`.
pub fn metadata(world: usize, fingerprint: Value, history: &[Value]) -> BTreeMap<String, String> {
    let v = json!({
        "world_size": world,
        "fingerprint": fingerprint,
        "history": history,
    });
    BTreeMap::from([(META_KEY.to_string(), v.to_string())])
}

/// Reads `train_gpt`'s metadata from checkpoint `dir`'s manifest without loading anything (so a
/// mismatch is reported before any rank changes its model).
pub fn peek(dir: &Path) -> Result<Value, CheckpointError> {
    let m = dir.join("checkpoint.json");
    let bad = |reason: String| CheckpointError::Format {
        path: m.clone(),
        reason,
    };
    let bytes = crate::input::read_regular(&m).map_err(|e| bad(e.to_string()))?;
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
    parse(&m, v["metadata"][META_KEY].as_str())
}

/// Parses the stored JSON string.
pub fn parse(path: &Path, text: Option<&str>) -> Result<Value, CheckpointError> {
    let bad = |reason: String| CheckpointError::Format {
        path: path.to_path_buf(),
        reason,
    };
    let text = text.ok_or_else(|| {
        bad(format!(
            "no `{META_KEY}` metadata: not a train_gpt checkpoint"
        ))
    })?;
    serde_json::from_str(text).map_err(|e| bad(e.to_string()))
}

/// A learning rate (or any f32 setting) as the fingerprint stores it: the f32's shortest
/// decimal (`0.001`, not `0.0010000000474974513`).
pub fn f32_value(x: f32) -> Value {
    x.to_string()
        .parse::<f64>()
        .map_or(Value::Null, |v| json!(v))
}

/// The optimizer as the fingerprint stores it: its `--optimizer` name and every
/// hyper-parameter by its field name (`momentum`, `nesterov`, `beta1`, `beta2`, `eps`,
/// `weight_decay`), so a mismatch names the flags that differ.
pub fn optimizer_value(kind: OptimizerArg, h: &OptimHyper) -> Value {
    use clap::ValueEnum;
    json!({
        "name": kind.to_possible_value().map(|v| v.get_name().to_string()),
        "momentum": f32_value(h.momentum),
        "nesterov": h.nesterov,
        "beta1": f32_value(h.beta1),
        "beta2": f32_value(h.beta2),
        "eps": f32_value(h.eps),
        "weight_decay": f32_value(h.weight_decay),
    })
}

/// The optimizer of a checkpoint written before the fingerprint named its fields: the string
/// `NAME OptimHyper { momentum: M, nesterov: B, … }` (the `Debug` spelling of the time), as
/// [`optimizer_value`] would store it.
fn legacy_optimizer(s: &str) -> Value {
    let name = match s.split_whitespace().next() {
        Some("Sgd") => "sgd",
        Some("AdamW") => "adamw",
        Some("Lamb") => "lamb",
        Some(other) => other,
        None => "",
    };
    let mut v = json!({ "name": name });
    let inner = s
        .split_once('{')
        .map_or("", |(_, r)| r.trim_end_matches('}'));
    for field in inner.split(',') {
        if let Some((k, x)) = field.split_once(':') {
            let x = x.trim();
            v[k.trim()] = match x {
                "true" => json!(true),
                "false" => json!(false),
                _ => x.parse::<f32>().map_or(json!(x), f32_value),
            };
        }
    }
    v
}

/// Whether a saved setting equals the current one: numbers compared as the f32s they are (a
/// checkpoint written before [`f32_value`] stored the f32's exact binary value), anything
/// else exactly.
fn same(saved: &Value, now: &Value) -> bool {
    match (saved.as_f64(), now.as_f64()) {
        (Some(a), Some(b)) => (a as f32) == (b as f32),
        _ => saved == now,
    }
}

/// A setting for a message: numbers as their f32's shortest decimal.
fn shown(v: &Value) -> String {
    match v {
        Value::Number(n) => n
            .as_f64()
            .map_or_else(|| n.to_string(), |x| (x as f32).to_string()),
        Value::String(s) => s.clone(),
        Value::Null => "none".into(),
        other => other.to_string(),
    }
}

/// The `--optimizer` flags whose values differ between the saved and the current optimizer.
fn optimizer_diffs(saved: &Value, now: &Value) -> Vec<String> {
    let saved = match saved {
        Value::String(s) => legacy_optimizer(s),
        v => v.clone(),
    };
    let mut out = Vec::new();
    for (key, flag) in [
        ("name", "--optimizer"),
        ("momentum", "--momentum"),
        ("nesterov", "--nesterov"),
        ("beta1", "--beta1"),
        ("beta2", "--beta2"),
        ("eps", "--eps"),
        ("weight_decay", "--weight-decay"),
    ] {
        let (a, b) = (&saved[key], &now[key]);
        if !same(a, b) {
            out.push(format!(
                "{flag} {} (the checkpoint has {})",
                shown(b),
                shown(a)
            ));
        }
    }
    out
}

/// The fingerprint's settings in the order a mismatch is looked for: what a run *is* (the
/// model, its optimizer, the batch, the data, the seed) before the schedule, so that another
/// `--optimizer` (and with it another default `--lr`) is reported as the optimizer.
const ORDER: [&str; 9] = [
    "model",
    "optimizer",
    "global_batch",
    "data",
    "seed",
    "lr",
    "warmup_steps",
    "min_lr",
    "schedule_steps",
];

/// Compares the settings a resumed run must share with the saved one (`now` is what
/// [`crate::train::fingerprint`] builds).
pub fn check_fingerprint(ckpt: &Path, meta: &Value, now: &Value) -> Result<(), CheckpointError> {
    let saved = meta
        .get("fingerprint")
        .ok_or_else(|| CheckpointError::Format {
            path: ckpt.to_path_buf(),
            reason: "no `fingerprint` field".into(),
        })?;
    let Value::Object(now_map) = now else {
        return Ok(());
    };
    let mut keys: Vec<&String> = now_map.keys().collect();
    keys.sort_by_key(|k| ORDER.iter().position(|o| o == k).unwrap_or(ORDER.len()));
    for k in keys {
        let v = &now_map[k];
        let s = saved.get(k).cloned().unwrap_or(Value::Null);
        if k == "optimizer" {
            let diffs = optimizer_diffs(&s, v);
            if !diffs.is_empty() {
                return Err(CheckpointError::Optimizer {
                    path: ckpt.to_path_buf(),
                    diffs: diffs.join(", "),
                });
            }
            continue;
        }
        if !same(&s, v) {
            let what: &'static str = match k.as_str() {
                "model" => {
                    "the model (--model/--d-model/--layers/--heads/--seq-len/--vocab/--tied/--gelu)"
                }
                "global_batch" => "the global batch (--ranks × --batch × --grad-accum sequences)",
                "data" => "--data",
                "seed" => "--seed",
                "lr" => "--lr (the learning-rate schedule)",
                "warmup_steps" => "--warmup-steps (the learning-rate schedule)",
                "min_lr" => "--min-lr (the learning-rate schedule)",
                "schedule_steps" => "--steps (the cosine schedule of --min-lr decays over --steps)",
                _ => "a setting",
            };
            return Err(CheckpointError::Mismatch {
                path: ckpt.to_path_buf(),
                what,
                saved: shown(&s),
                now: shown(v),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue #37 (10): an optimizer mismatch names the flags that differ (not a Debug struct,
    /// not `--lr`, even when the learning rates differ too); values print as the f32s they are
    /// (`0.001`, never `0.0010000000474974513`); checkpoints written before (optimizer as a
    /// Debug string, lr as the f32's exact binary value) still resume.
    #[test]
    fn mismatches_name_the_flags_and_print_short_numbers() {
        let p = Path::new("ck/step_000000000002");
        let fp = |kind: OptimizerArg, lr: f32, beta2: f32| {
            let mut h = OptimHyper::defaults(kind);
            h.beta2 = beta2;
            json!({
                "lr": f32_value(lr),
                "optimizer": optimizer_value(kind, &h),
                "seed": 0,
            })
        };
        let saved = json!({ "fingerprint": fp(OptimizerArg::AdamW, 1e-3, 0.999) });
        check_fingerprint(p, &saved, &fp(OptimizerArg::AdamW, 1e-3, 0.999)).unwrap();
        let e = check_fingerprint(p, &saved, &fp(OptimizerArg::Sgd, 0.05, 0.999))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--optimizer sgd (the checkpoint has adamw)"),
            "{e}"
        );
        assert!(!e.contains("--lr") && !e.contains("OptimHyper"), "{e}");
        let e = check_fingerprint(p, &saved, &fp(OptimizerArg::AdamW, 1e-3, 0.95))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--beta2 0.95 (the checkpoint has 0.999)"), "{e}");
        let e = check_fingerprint(p, &saved, &fp(OptimizerArg::AdamW, 2e-3, 0.999))
            .unwrap_err()
            .to_string();
        assert!(e.contains("= 0.001, this run has 0.002"), "{e}");
        // A checkpoint of before: the Debug string and the f32's exact value.
        let h = OptimHyper::defaults(OptimizerArg::AdamW);
        let old = json!({ "fingerprint": {
            "lr": 0.001f32 as f64,
            "optimizer": format!("{:?} {:?}", OptimizerArg::AdamW, h),
            "seed": 0,
        }});
        assert_eq!(
            old["fingerprint"]["lr"].to_string(),
            "0.0010000000474974513"
        );
        check_fingerprint(p, &old, &fp(OptimizerArg::AdamW, 1e-3, 0.999)).unwrap();
        let e = check_fingerprint(p, &old, &fp(OptimizerArg::Lamb, 1e-3, 0.999))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--optimizer lamb (the checkpoint has adamw)"),
            "{e}"
        );
        let e = check_fingerprint(p, &old, &fp(OptimizerArg::AdamW, 0.01, 0.999))
            .unwrap_err()
            .to_string();
        assert!(e.contains("= 0.001, this run has 0.01;"), "{e}");
    }
}
