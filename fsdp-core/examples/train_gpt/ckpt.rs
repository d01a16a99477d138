//! Checkpoint directory of the training program: `D/step-XXXXXXXX/` per saved step, holding
//! `model/` (fsdp-core's sharded state dict), `optim/` (the sharded optimizer state, when the
//! optimizer has state) and `train.json` (step, data position, configuration fingerprint and
//! the metric history).
//!
//! A save is written into `D/.step-XXXXXXXX.tmp/` by every rank; rank 0 writes `train.json`
//! last, after every rank has finished (the state-dict saves end with a cross-rank agreement),
//! fsyncs it and publishes the directory with one rename. So a directory named `step-*` without a
//! `.tmp` suffix and with a `train.json` is complete; a crash mid-save leaves only a `.tmp`
//! directory, which the next save of that step replaces and `--resume` ignores. The last
//! `--keep-checkpoints` complete directories are kept; older ones are removed after a new one is
//! published.
//!
//! This is the example's own, small manager on top of `fsdp_core::state_dict`; the tensor files
//! inside carry what those functions write (no checksums of their own).

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

/// A checkpoint directory problem.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A path that cannot be written (checked before step 1).
    #[error("{path} is not writable: {reason}; pick another location")]
    NotWritable {
        /// The path.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A file system operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// The operation.
        op: &'static str,
        /// The path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// `train.json` unreadable.
    #[error("{path}: {reason}")]
    Format {
        /// The file.
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

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> CheckpointError + 'a {
    move |source| CheckpointError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// `D/step-00000010`.
pub fn step_dir(dir: &Path, step: usize) -> PathBuf {
    dir.join(format!("step-{step:08}"))
}

/// `D/.step-00000010.tmp`.
pub fn tmp_dir(dir: &Path, step: usize) -> PathBuf {
    dir.join(format!(".step-{step:08}.tmp"))
}

/// The metadata file of a checkpoint directory.
pub fn meta_path(dir: &Path) -> PathBuf {
    dir.join("train.json")
}

/// Checks that a directory exists or can be created and that a file can be created in it.
pub fn check_writable_dir(dir: &Path) -> Result<(), CheckpointError> {
    let not = |reason: String| CheckpointError::NotWritable {
        path: dir.to_path_buf(),
        reason,
    };
    fs::create_dir_all(dir).map_err(|e| not(format!("cannot create the directory ({e})")))?;
    let probe = dir.join(format!(".train_gpt-probe-{}", std::process::id()));
    fs::write(&probe, b"probe").map_err(|e| not(format!("cannot create a file in it ({e})")))?;
    fs::remove_file(&probe).map_err(|e| not(format!("cannot remove a file from it ({e})")))?;
    Ok(())
}

/// Checks that a full-state-dict target can be written: its directory exists (or can be
/// created) and is writable, and the target, if it exists, is a regular file.
pub fn check_writable_file(path: &Path) -> Result<(), CheckpointError> {
    let not = |reason: String| CheckpointError::NotWritable {
        path: path.to_path_buf(),
        reason,
    };
    if path.file_name().is_none() {
        return Err(not("it names no file".into()));
    }
    if let Ok(m) = fs::symlink_metadata(path) {
        if !m.file_type().is_file() {
            return Err(not("it exists and is not a regular file".into()));
        }
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    check_writable_dir(&parent).map_err(|e| match e {
        CheckpointError::NotWritable { path, reason } => {
            not(format!("its directory {} fails: {reason}", path.display()))
        }
        other => not(other.to_string()),
    })
}

/// The newest complete checkpoint in `dir` (`None` if there is none or `dir` does not exist).
pub fn latest(dir: &Path) -> Result<Option<(usize, PathBuf)>, CheckpointError> {
    Ok(complete(dir)?.pop())
}

/// Complete checkpoints in `dir`, oldest first.
fn complete(dir: &Path) -> Result<Vec<(usize, PathBuf)>, CheckpointError> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io("read directory", dir)(e)),
    };
    let mut out = Vec::new();
    for e in entries {
        let e = e.map_err(io("read directory", dir))?;
        let name = e.file_name();
        let Some(step) = name
            .to_str()
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|s| s.parse::<usize>().ok())
        else {
            continue;
        };
        if meta_path(&e.path()).is_file() {
            out.push((step, e.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// Rank 0, before the ranks write: removes a stale `.tmp` of this step.
pub fn prepare(dir: &Path, step: usize) -> Result<PathBuf, CheckpointError> {
    let tmp = tmp_dir(dir, step);
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(io("remove stale", &tmp))?;
    }
    fs::create_dir_all(&tmp).map_err(io("create directory", &tmp))?;
    Ok(tmp)
}

fn fsync_dir(dir: &Path) -> Result<(), CheckpointError> {
    fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io("fsync", dir))
}

fn fsync_tree(dir: &Path) -> Result<(), CheckpointError> {
    for e in fs::read_dir(dir).map_err(io("read directory", dir))? {
        let p = e.map_err(io("read directory", dir))?.path();
        if p.is_dir() {
            fsync_tree(&p)?;
        } else {
            fs::File::open(&p)
                .and_then(|f| f.sync_all())
                .map_err(io("fsync", &p))?;
        }
    }
    fsync_dir(dir)
}

/// Rank 0, after every rank wrote its files into the `.tmp` directory: writes `train.json`,
/// fsyncs everything, publishes the directory with one rename and removes all but the newest
/// `keep` complete checkpoints.
pub fn publish(
    dir: &Path,
    step: usize,
    meta: &Value,
    keep: usize,
) -> Result<PathBuf, CheckpointError> {
    let tmp = tmp_dir(dir, step);
    let m = meta_path(&tmp);
    let text = serde_json::to_vec_pretty(meta).map_err(|e| CheckpointError::Format {
        path: m.clone(),
        reason: e.to_string(),
    })?;
    fs::write(&m, text).map_err(io("write", &m))?;
    fsync_tree(&tmp)?;
    let fin = step_dir(dir, step);
    if fin.exists() {
        // The same step saved again (e.g. a run restarted from an older checkpoint).
        fs::remove_dir_all(&fin).map_err(io("replace", &fin))?;
    }
    fs::rename(&tmp, &fin).map_err(io("publish (rename)", &fin))?;
    fsync_dir(dir)?;
    let all = complete(dir)?;
    if all.len() > keep {
        for (_, old) in &all[..all.len() - keep] {
            fs::remove_dir_all(old).map_err(io("remove old checkpoint", old))?;
        }
    }
    Ok(fin)
}

/// Reads a checkpoint's `train.json`.
pub fn read_meta(ckpt: &Path) -> Result<Value, CheckpointError> {
    let m = meta_path(ckpt);
    let text = fs::read(&m).map_err(io("read", &m))?;
    serde_json::from_slice(&text).map_err(|e| CheckpointError::Format {
        path: m,
        reason: e.to_string(),
    })
}

/// Compares the settings a resumed run must share with the saved one (`fingerprint` is what
/// [`crate::train::fingerprint`] builds).
pub fn check_fingerprint(ckpt: &Path, meta: &Value, now: &Value) -> Result<(), CheckpointError> {
    let saved = meta
        .get("fingerprint")
        .ok_or_else(|| CheckpointError::Format {
            path: meta_path(ckpt),
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
                    "the model shape (--model/--d-model/--layers/--heads/--seq-len/--vocab/--tied)"
                }
                "optimizer" => "--optimizer",
                "global_batch" => "the global batch (--ranks × --batch × --grad-accum sequences)",
                "data" => "--data",
                "seed" => "--seed",
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

/// The `train.json` content.
pub fn meta(step: usize, world: usize, fingerprint: Value, history: Value) -> Value {
    json!({
        "format": "fsdp-rs train_gpt checkpoint 1",
        "step": step,
        "world_size": world,
        "fingerprint": fingerprint,
        "history": history,
    })
}
