//! The training program's part of a checkpoint: what `train_gpt` stores in the user metadata of
//! fsdp-core's [`checkpoint`](fsdp_core::checkpoint) manager, and the check that a resumed run is
//! the run that saved it.
//!
//! The manager (`fsdp_core::checkpoint::CheckpointManager`) writes `ROOT/step_N/` all-or-nothing
//! (staging directory, fsync, one rename after every rank finished; per-tensor checksums and a
//! save id in every file; non-finite values refused; keep the last K) and finds the newest
//! complete one. On top, `train_gpt` stores one metadata entry, `train_gpt`, a JSON object with
//! - `fingerprint`: the settings a resumed run must share (model shape and GELU, optimizer, global
//!   batch, data file, seed, and the learning-rate schedule: `--lr`, `--warmup-steps`, `--min-lr`
//!   and, with `--min-lr`, `--steps`) — the data position is the step times the global batch, so
//!   equal global batches make a resumed run see the same sequences, and the schedule is
//!   continued, never silently changed (a resume that would change it is refused naming the
//!   flag; without `--min-lr`, `--steps` may grow: the schedule is constant after warm-up);
//! - `world_size`: the rank count that saved it (informational: resuming at another count works);
//! - `history`: `step`, `loss`, `val_loss`, `tokens_per_s` of every step so far (for the plot).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

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
    let bytes = std::fs::read(&m).map_err(|e| bad(e.to_string()))?;
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
    for (k, v) in now_map {
        let s = saved.get(k).cloned().unwrap_or(Value::Null);
        if &s != v {
            let what: &'static str = match k.as_str() {
                "model" => {
                    "the model (--model/--d-model/--layers/--heads/--seq-len/--vocab/--tied/--gelu)"
                }
                "optimizer" => {
                    "--optimizer or its hyper-parameters (--momentum, --nesterov, --beta1, \
                     --beta2, --eps, --weight-decay)"
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
                saved: s.to_string(),
                now: v.to_string(),
            });
        }
    }
    Ok(())
}
