//! Training checkpoints: model + optimizer state + gradient-scaler state + user metadata (step,
//! data position, …) saved together as one all-or-nothing sharded checkpoint
//! `ROOT/step_000123/`, keeping the last K; [`latest_complete`] finds the newest complete one to
//! resume from, at the same or another number of ranks.
//!
//! # How to use
//! ```
//! use std::collections::BTreeMap;
//! use std::sync::Arc;
//! use fsdp_alloc::Device;
//! use fsdp_autograd::{nn::Linear, InitContext};
//! use fsdp_collectives::{ProcessGroup, ThreadGroup};
//! use fsdp_core::checkpoint::{self, CheckpointManager};
//! use fsdp_core::{Fsdp, FsdpConfig, Sgd};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dev = Device::cpu(0);
//! let group: Arc<dyn ProcessGroup> = Arc::new(ThreadGroup::new(1).remove(0));
//! let model = Linear::new(&InitContext::eager(&dev, 7), 3, 2, true)?;
//! let fsdp = Fsdp::wrap(model, &dev, Arc::clone(&group), FsdpConfig::default())?;
//! let mut opt = Sgd::new(0.1).with_momentum(0.9);
//! let root = std::env::temp_dir().join(format!("fsdp-ckpt-doc-{}", std::process::id()));
//!
//! // Before training: fail early if the directory cannot be written.
//! let manager = CheckpointManager::new(&root, 2)?; // keep the last 2
//! manager.check_target()?;
//!
//! // Every N steps (a collective: every rank calls it).
//! let mut meta = BTreeMap::new();
//! meta.insert("data_position".to_string(), "4096".to_string());
//! let saved = manager.save(&fsdp, 10, Some(&opt), None, &meta)?;
//! assert!(saved.ends_with("step_000000000010"));
//!
//! // On resume (possibly with another number of ranks): the newest complete checkpoint.
//! if let Some(dir) = checkpoint::latest_complete(&root)? {
//!     let loaded = checkpoint::load(&fsdp, &dir, Some(&mut opt), None)?;
//!     assert_eq!(loaded.step, 10);
//!     assert_eq!(loaded.metadata["data_position"], "4096");
//! }
//! # std::fs::remove_dir_all(&root)?;
//! # Ok(())
//! # }
//! ```
//!
//! # Guarantees
//! - A checkpoint directory `step_N` appears only complete (staging directory + one atomic
//!   rename after every rank wrote and fsynced its files); a crash at any point leaves the
//!   previous checkpoints loadable, plus at most a hidden staging directory that the next save
//!   removes.
//! - Every file carries the save id, per-tensor CRC-32s and a CRC-32 of its header, the manifest
//!   a CRC-32 of its content; [`load`] refuses a checkpoint with a missing, stale or corrupted
//!   file on every rank, before any rank changes its model, and the refusing rank's reason reaches
//!   every rank ([`StateDictError::PeerRejected`]). [`newest`] refuses a damaged newest
//!   checkpoint; [`latest_valid`] falls back past damaged headers and says what it skipped;
//!   [`load_latest_valid`] loads, falling back past everything a load finds too (a tensor's
//!   CRC-32).
//! - Pruning (`keep_last`) counts and removes only the manager's own lineage's checkpoints,
//!   newest *saves* first (not highest steps), never the one just written, and only directories
//!   named and filled exactly as the manager writes them.
//! - Non-finite parameters or optimizer state are refused at save
//!   ([`StateDictError::NonFinite`]), so a diverged run never replaces a good checkpoint.
//!
//! # Layout
//! `step_N/model/` and `step_N/optim/` are sharded state-dict directories (see
//! [`crate::state_dict`]); `step_N/checkpoint.json` holds the format tag, the save id, the
//! lineage id and save sequence number, the step, the scaler state (scale as f32 bits, growth
//! tracker), the user metadata (string map) and `crc32` (of the rest, serialized compactly with
//! sorted keys).
//!
//! # Limitations
//! Rank 0 removes old checkpoints of its lineage beyond `keep_last` after a successful save;
//! checkpoints of other lineages are left for the user to remove. User metadata is a string map
//! (serialize richer data yourself).

use std::collections::BTreeMap;

use super::check::{format_err, optim_ranks};
use super::durable::{atomic_write, check_save_target, disk_usage, fresh_id};
use super::error::{Result, StateDictError};
use super::format::{
    check_generation, rank_path, read_bytes, read_file_meta, read_sharded_meta, write_sharded_dir,
};
use super::optim::{load_sharded_optim, sharded_optim_state_dict};
use super::reshard::{
    agree_load, collective_sharded_save, load_sharded, sharded_state_dict, share_reason, Ctx,
};
use super::types::{OptimState, ShardedStateDict};
use super::{FORMAT_VERSION, KIND_SHARDED_OPTIM, KIND_SHARDED_PARAMS, META_FILE};
use crate::optim::scaler::ShardedGradScaler;
use crate::optim::{ShardedOptimizer, ShardedParams};
use crate::runtime::fsdp::Fsdp;
use fsdp_autograd::nn::Module;
use std::path::{Path, PathBuf};

const MANIFEST: &str = "checkpoint.json";
const MANIFEST_FORMAT: &str = "fsdp-rs-checkpoint";
const PREFIX: &str = "step_";

/// The directory name of step `step`'s checkpoint (`step_` and 12 digits, so names sort by step).
pub fn step_dir_name(step: u64) -> String {
    format!("{PREFIX}{step:012}")
}

/// Saves checkpoints under one root directory and keeps the last few of its own lineage.
///
/// A *lineage* is the chain of checkpoints of one run and its resumptions: a fresh manager
/// starts a new one (a random id), [`CheckpointManager::with_lineage`] continues the one of a
/// loaded checkpoint ([`LoadedCheckpoint::lineage`]). Every save records its lineage and a
/// sequence number (one more than the lineage's newest), and pruning only ever counts and removes
/// checkpoints of the manager's own lineage, newest saves first, so checkpoints of another run
/// in the same directory (even with higher step numbers) are never touched and never make this
/// run's new checkpoints look old.
#[derive(Debug, Clone)]
pub struct CheckpointManager {
    root: PathBuf,
    keep_last: usize,
    lineage: String,
}

/// What [`load`] restored besides the model and optimizer.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedCheckpoint {
    /// The step given to [`CheckpointManager::save`].
    pub step: u64,
    /// The user metadata given to [`CheckpointManager::save`].
    pub metadata: BTreeMap<String, String>,
    /// The gradient scaler's `(scale, growth_tracker)` if one was saved (also loaded into the
    /// scaler passed to [`load`]).
    pub scaler: Option<(f32, u32)>,
    /// The lineage the checkpoint belongs to: pass it to [`CheckpointManager::with_lineage`] so
    /// that the resumed run's saves continue it (and its pruning sees the old checkpoints).
    pub lineage: String,
}

impl CheckpointManager {
    /// A manager for checkpoints under `root` keeping the newest `keep_last` (at least 1).
    ///
    /// # Errors
    /// [`StateDictError::TargetUnusable`] when `keep_last` is 0.
    pub fn new(root: impl Into<PathBuf>, keep_last: usize) -> Result<CheckpointManager> {
        let root = root.into();
        if keep_last == 0 {
            return Err(StateDictError::TargetUnusable {
                path: root,
                reason: "keep_last must be at least 1 (the newest checkpoint is always kept)"
                    .into(),
            });
        }
        Ok(CheckpointManager {
            root,
            keep_last,
            lineage: format!("{:016x}", fresh_id()),
        })
    }

    /// The same manager continuing lineage `lineage` (from [`LoadedCheckpoint::lineage`] of the
    /// checkpoint a run resumed from). Only the primary rank's lineage is recorded.
    #[must_use]
    pub fn with_lineage(mut self, lineage: impl Into<String>) -> CheckpointManager {
        let l = lineage.into();
        if !l.is_empty() {
            self.lineage = l;
        }
        self
    }

    /// This manager's lineage id.
    pub fn lineage(&self) -> &str {
        &self.lineage
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Fail-early check before training ([`check_save_target`] of the root; the free space
    /// needed is the size of the newest complete checkpoint, when there is one). Rank-local.
    ///
    /// # Errors
    /// [`StateDictError::TargetUnusable`].
    pub fn check_target(&self) -> Result<()> {
        let need = match latest_complete(&self.root) {
            Ok(Some(dir)) => Some(disk_usage(dir)?),
            _ => None,
        };
        check_save_target(self.root.join(step_dir_name(0)), need)
    }

    /// Saves the model's sharded state, `optimizer`'s state (if given), `scaler`'s state (if
    /// given), `step` and `metadata` as `ROOT/step_N/`, all-or-nothing, then removes checkpoints
    /// older than the newest `keep_last`. A **collective** over the model's groups: every rank
    /// calls it with the same `step`. Saving a step that already exists replaces it atomically.
    /// Returns the checkpoint's directory.
    ///
    /// # Errors
    /// [`StateDictError::NonFinite`] (nothing is written; older checkpoints stay), I/O errors,
    /// [`StateDictError::PeerFailed`] when another rank failed.
    pub fn save<M: Module + 'static>(
        &self,
        fsdp: &Fsdp<M>,
        step: u64,
        optimizer: Option<&dyn ShardedOptimizer>,
        scaler: Option<&ShardedGradScaler>,
        metadata: &BTreeMap<String, String>,
    ) -> Result<PathBuf> {
        let ctx = Ctx::of(fsdp);
        let dir = self.root.join(step_dir_name(step));
        let optim = optimizer.map(|o| {
            let mut steps = o.step_counts();
            if steps.is_empty() {
                // Before the optimizer's first step: no unit has taken one.
                steps = vec![0; ctx.shards.len()];
            }
            let slots = o
                .state()
                .into_iter()
                .map(|(name, mut t)| {
                    if t.is_empty() {
                        t = vec![None; ctx.shards.len()];
                    }
                    (name, t)
                })
                .collect();
            OptimState { steps, slots }
        });
        let scaler = scaler.map(|s| (s.get_scale(), s.growth_tracker()));
        let seq = if ctx.is_primary() {
            remove_stale_staging(&self.root);
            // Never `?` here: an error on the primary alone, before the collective, would leave
            // the other ranks waiting in it (a root that cannot be listed fails the save below).
            self.lineage_dirs()
                .ok()
                .and_then(|d| d.first().map(|(seq, _)| seq.saturating_add(1)))
                .unwrap_or(1)
        } else {
            0
        };
        collective_sharded_save(&ctx, &dir, "checkpoint save", |tmp, generation| {
            let d = sharded_state_dict(fsdp)?;
            write_sharded_dir(
                &tmp.join("model"),
                KIND_SHARDED_PARAMS,
                None,
                &[("", &d)],
                &d.ranks,
                generation,
            )?;
            if let Some(state) = &optim {
                let d = sharded_optim_state_dict(fsdp, state)?;
                let slots: Vec<(&str, &ShardedStateDict)> =
                    d.slots.iter().map(|(s, d)| (s.as_str(), d)).collect();
                let ranks = optim_ranks(&d.slots)?;
                write_sharded_dir(
                    &tmp.join("optim"),
                    KIND_SHARDED_OPTIM,
                    Some(&d.steps),
                    &slots,
                    &ranks,
                    generation,
                )?;
            }
            if ctx.is_primary() {
                let manifest = serde_json::json!({
                    "format": MANIFEST_FORMAT,
                    "format_version": FORMAT_VERSION,
                    "generation": generation,
                    "lineage": self.lineage,
                    "save_seq": seq,
                    "step": step,
                    "has_optim": optim.is_some(),
                    "scaler": scaler.map(|(s, g)| vec![s.to_bits(), g]),
                    "metadata": metadata,
                });
                atomic_write(&tmp.join(MANIFEST), &seal_manifest(manifest))?;
            }
            Ok(())
        })?;
        if ctx.is_primary() {
            self.prune(&dir)?;
        }
        Ok(dir)
    }

    /// `(save_seq, dir)` of this lineage's complete checkpoints, newest save first. Only
    /// directories named exactly like the manager's own (`step_` and 12 digits), holding nothing
    /// but a manifest (checksum verified) and the model / optimizer directories.
    fn lineage_dirs(&self) -> Result<Vec<(u64, PathBuf)>> {
        let mut out = Vec::new();
        for (_, dir) in step_dirs(&self.root)? {
            if !only_own_entries(&dir) {
                continue;
            }
            let Ok(m) = read_manifest(&dir) else {
                continue;
            };
            if m.lineage != self.lineage || check_complete(&dir).is_err() {
                continue;
            }
            out.push((m.save_seq, dir));
        }
        out.sort_unstable_by(|a, b| b.0.cmp(&a.0).then_with(|| b.1.cmp(&a.1)));
        Ok(out)
    }

    /// Removes this lineage's checkpoints beyond its newest `keep_last` saves; never `written`
    /// (the checkpoint just saved), never another lineage's, never a damaged or foreign directory.
    fn prune(&self, written: &Path) -> Result<()> {
        let dirs = self.lineage_dirs()?;
        for (_, dir) in dirs.into_iter().skip(self.keep_last) {
            if dir == written {
                continue;
            }
            std::fs::remove_dir_all(&dir).map_err(|source| StateDictError::Io {
                op: "remove an old checkpoint",
                path: dir,
                source,
            })?;
        }
        Ok(())
    }
}

/// Whether `dir` holds only what a checkpoint save writes (`checkpoint.json`, `model/`,
/// `optim/`), so pruning never removes a directory a user put there.
fn only_own_entries(dir: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    let mut has_manifest = false;
    for e in entries {
        let Ok(e) = e else { return false };
        let Ok(t) = e.file_type() else { return false };
        match e.file_name().to_str() {
            Some(MANIFEST) if t.is_file() => has_manifest = true,
            Some("model" | "optim") if t.is_dir() => {}
            _ => return false,
        }
    }
    has_manifest
}

/// The manifest's bytes: the JSON object with a `crc32` entry holding the CRC-32 of the
/// object's compact serialization without that entry (keys sorted, so the check re-serializes
/// what it parsed and compares).
fn seal_manifest(mut manifest: serde_json::Value) -> Vec<u8> {
    let crc = crc32fast::hash(manifest.to_string().as_bytes());
    manifest[MANIFEST_CRC] = serde_json::json!(format!("{crc:08x}"));
    manifest.to_string().into_bytes()
}

const MANIFEST_CRC: &str = "crc32";

/// Removes staging directories that a crashed save left behind (best effort).
fn remove_stale_staging(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(&format!(".{PREFIX}")) && name.contains(".staging-") {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// `(step, dir)` of every directory under `root` named exactly `step_` and 12 digits (none if
/// `root` does not exist; symlinks, files and other names are ignored).
fn step_dirs(root: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(StateDictError::Io {
                op: "list",
                path: root.to_path_buf(),
                source,
            })
        }
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(digits) = name.to_str().and_then(|n| n.strip_prefix(PREFIX)) else {
            continue;
        };
        if digits.len() != 12 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        if !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        if let Ok(step) = digits.parse::<u64>() {
            out.push((step, e.path()));
        }
    }
    Ok(out)
}

struct Manifest {
    generation: String,
    lineage: String,
    save_seq: u64,
    step: u64,
    has_optim: bool,
    scaler: Option<(f32, u32)>,
    metadata: BTreeMap<String, String>,
}

fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST);
    let bytes = read_bytes(&path)?;
    let bad = |d: &str| format_err(&path, d.to_string());
    let mut v: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| bad(&format!("not JSON: {e}")))?;
    if v["format"] != MANIFEST_FORMAT {
        return Err(bad("not an fsdp-rs checkpoint manifest"));
    }
    if v["format_version"] != FORMAT_VERSION {
        return Err(StateDictError::UnsupportedVersion {
            path: path.clone(),
            found: v["format_version"].to_string(),
            supported: FORMAT_VERSION,
        });
    }
    let recorded = v
        .as_object_mut()
        .and_then(|o| o.remove(MANIFEST_CRC))
        .and_then(|c| c.as_str().and_then(|c| u32::from_str_radix(c, 16).ok()))
        .ok_or_else(|| bad("no or a bad `crc32` entry"))?;
    let found = crc32fast::hash(v.to_string().as_bytes());
    if found != recorded {
        return Err(bad(&format!(
            "checksum mismatch (recorded {recorded:08x}, computed {found:08x}): the manifest \
             was changed or damaged"
        )));
    }
    let generation = v["generation"]
        .as_str()
        .ok_or_else(|| bad("no generation"))?
        .to_string();
    let lineage = v["lineage"]
        .as_str()
        .ok_or_else(|| bad("no lineage"))?
        .to_string();
    let save_seq = v["save_seq"].as_u64().ok_or_else(|| bad("no save_seq"))?;
    let step = v["step"].as_u64().ok_or_else(|| bad("no step"))?;
    let has_optim = v["has_optim"]
        .as_bool()
        .ok_or_else(|| bad("no has_optim"))?;
    let scaler = match &v["scaler"] {
        serde_json::Value::Null => None,
        s => {
            let s = s.as_array().ok_or_else(|| bad("bad scaler"))?;
            match (
                s.first().and_then(|x| x.as_u64()),
                s.get(1).and_then(|x| x.as_u64()),
            ) {
                (Some(bits), Some(g)) => Some((
                    f32::from_bits(u32::try_from(bits).map_err(|_| bad("bad scaler"))?),
                    u32::try_from(g).map_err(|_| bad("bad scaler"))?,
                )),
                _ => return Err(bad("bad scaler")),
            }
        }
    };
    let metadata = v["metadata"]
        .as_object()
        .ok_or_else(|| bad("no metadata"))?
        .iter()
        .map(|(k, v)| {
            v.as_str()
                .map(|s| (k.clone(), s.to_string()))
                .ok_or_else(|| bad("metadata values must be strings"))
        })
        .collect::<Result<_>>()?;
    Ok(Manifest {
        generation,
        lineage,
        save_seq,
        step,
        has_optim,
        scaler,
        metadata,
    })
}

/// Checks (rank-locally, reading only headers) that a sharded directory exists with every
/// rank's files from save `generation`.
fn check_sharded_complete(dir: &Path, kind: &str, generation: &str) -> Result<()> {
    let meta = read_sharded_meta(dir, kind)?;
    check_generation(
        &read_file_meta(&dir.join(META_FILE), &format!("{kind}-meta"))?.0,
        &dir.join(META_FILE),
        generation,
    )?;
    for r in 0..meta.world_size {
        for index in [true, false] {
            let path = rank_path(dir, r, meta.world_size, index);
            let k = if index {
                format!("{kind}-pieces")
            } else {
                kind.to_string()
            };
            let (m, _) = read_file_meta(&path, &k)?;
            check_generation(&m, &path, generation)?;
        }
    }
    Ok(())
}

/// Whether `dir` is a complete checkpoint: its manifest (checksum verified), and every file of
/// its model (and optimizer) directories, present, with intact headers (header checksums) and
/// from the same save. Reads headers only (tensor checksums are verified by [`load`]).
///
/// # Errors
/// The first problem found, naming the file.
pub fn check_complete(dir: impl AsRef<Path>) -> Result<()> {
    let dir = dir.as_ref();
    let m = read_manifest(dir)?;
    check_sharded_complete(&dir.join("model"), KIND_SHARDED_PARAMS, &m.generation)?;
    if m.has_optim {
        check_sharded_complete(&dir.join("optim"), KIND_SHARDED_OPTIM, &m.generation)?;
    }
    Ok(())
}

/// The newest complete checkpoint under `root` (by step; incomplete or damaged ones are
/// skipped **silently**), or `None`. Rank-local; every rank sees the same answer on a shared
/// file system. To resume, prefer [`newest`] (refuses a damaged newest checkpoint) or
/// [`latest_valid`] (says what it skipped and why).
///
/// # Errors
/// [`StateDictError::Io`] when `root` exists but cannot be listed.
pub fn latest_complete(root: impl AsRef<Path>) -> Result<Option<PathBuf>> {
    Ok(latest_valid(root)?.0)
}

/// Every `step_N` checkpoint directory under `root`, newest (highest step) first, complete or
/// not (none when `root` does not exist). For a caller that walks them itself (`train_gpt
/// sample`: [`check_complete`], then loading, falling back past damage).
///
/// # Errors
/// [`StateDictError::Io`] when `root` exists but cannot be listed.
pub fn candidates(root: impl AsRef<Path>) -> Result<Vec<PathBuf>> {
    let mut steps = step_dirs(root.as_ref())?;
    steps.sort_unstable_by_key(|s| std::cmp::Reverse(s.0));
    Ok(steps.into_iter().map(|(_, d)| d).collect())
}

/// The newest checkpoint directory under `root` (the highest `step_N`), checked complete
/// (manifest checksum, every file's header checksum and save id; tensor checksums are verified
/// by [`load`]), or `None` when there is no `step_N` directory. Rank-local.
///
/// # Errors
/// The newest checkpoint's problem, naming the file (e.g. [`StateDictError::GenerationMismatch`]
/// for a stale rank file, [`StateDictError::Io`] for a missing one, [`StateDictError::Format`]
/// for a damaged header or manifest): a damaged newest checkpoint is refused, never skipped.
pub fn newest(root: impl AsRef<Path>) -> Result<Option<PathBuf>> {
    let mut steps = step_dirs(root.as_ref())?;
    steps.sort_unstable_by_key(|s| std::cmp::Reverse(s.0));
    match steps.into_iter().next() {
        None => Ok(None),
        Some((_, dir)) => {
            check_complete(&dir)?;
            Ok(Some(dir))
        }
    }
}

/// A checkpoint directory [`latest_valid`] skipped, and why.
#[derive(Debug)]
pub struct Skipped {
    /// The skipped `step_N` directory.
    pub dir: PathBuf,
    /// Its problem (naming the file).
    pub error: StateDictError,
}

/// The newest complete checkpoint under `root` (by step) and every newer one it skipped, with
/// the reason (for an explicit "fall back to the newest valid checkpoint" resume). Rank-local.
///
/// # Errors
/// [`StateDictError::Io`] when `root` exists but cannot be listed.
pub fn latest_valid(root: impl AsRef<Path>) -> Result<(Option<PathBuf>, Vec<Skipped>)> {
    let mut steps = step_dirs(root.as_ref())?;
    steps.sort_unstable_by_key(|s| std::cmp::Reverse(s.0));
    let mut skipped = Vec::new();
    for (_, dir) in steps {
        match check_complete(&dir) {
            Ok(()) => return Ok((Some(dir), skipped)),
            Err(error) => skipped.push(Skipped { dir, error }),
        }
    }
    Ok((None, skipped))
}

/// What [`load_latest_valid`] did.
#[derive(Debug)]
pub struct Resumed {
    /// The checkpoint loaded and what it restored besides the model and optimizer; `None` when
    /// `root` held no loadable checkpoint (nothing was changed then).
    pub loaded: Option<(PathBuf, LoadedCheckpoint)>,
    /// Every newer checkpoint that was skipped, newest first, with its problem.
    pub skipped: Vec<Skipped>,
}

/// How a step of [`load_latest_valid`] went on one rank (all-reduced with max).
const STEP_OK: f32 = 0.0;
const STEP_DAMAGED: f32 = 1.0;
const STEP_STOP: f32 = 2.0;

/// Loads the newest checkpoint under `root` that loads, falling back past every kind of damage
/// the loader detects: besides what [`latest_valid`] sees in the headers (missing or stale
/// files, damaged headers or manifests), the damage only a full load finds — a tensor whose
/// bytes do not match their CRC-32, a non-finite value read back. Each checkpoint, newest
/// first: [`check_complete`], then `accept` (the caller's own check, e.g. that the checkpoint
/// is of the same run; rank-local, before anything is loaded), then [`load`]. A damaged one is
/// skipped (and listed in [`Resumed::skipped`]); anything else — `accept`'s refusal (return
/// [`StateDictError::Refused`]), a model that does not fit, a failed collective — stops the
/// search with that error. A **collective**: the ranks agree after every step (a one-element
/// all-reduce; the failing rank's message is passed to all), so they skip and stop together. A
/// failed load changes nothing ([`load`] agrees before writing), and a later successful one
/// replaces the whole state.
///
/// # Errors
/// The first error that is not damage, on the ranks that met it; [`StateDictError::PeerRejected`]
/// carrying it on the others.
pub fn load_latest_valid<M: Module + 'static>(
    fsdp: &Fsdp<M>,
    root: impl AsRef<Path>,
    mut optimizer: Option<&mut dyn ShardedOptimizer>,
    mut scaler: Option<&mut ShardedGradScaler>,
    accept: &mut dyn FnMut(&Path) -> Result<()>,
) -> Result<Resumed> {
    let ctx = Ctx::of(fsdp);
    let root = root.as_ref();
    let dirs = agree_load(&ctx, root, None, "checkpoint resume", candidates(root))?;
    let mut skipped = Vec::new();
    // Every rank's verdict on `local`: go on, skip the checkpoint, or stop. Returns the error to
    // skip with (this rank's own, or the refusing rank's message) or to stop with.
    let verdict = |dir: &Path, local: Result<()>| -> Result<Option<(bool, StateDictError)>> {
        let code = match &local {
            Ok(()) => STEP_OK,
            // Another rank's refusal: its own verdict decides.
            Err(StateDictError::PeerRejected { .. }) => STEP_DAMAGED,
            Err(e) if e.is_damage() => STEP_DAMAGED,
            Err(_) => STEP_STOP,
        };
        let all = ctx.max_over_ranks(code)?;
        if all == STEP_OK {
            return Ok(None);
        }
        let (reason, rank) = share_reason(&ctx, local.as_ref().err())?;
        let err = local.err().unwrap_or(StateDictError::PeerRejected {
            op: "checkpoint resume",
            rank,
            path: dir.to_path_buf(),
            reason,
        });
        Ok(Some((all == STEP_STOP, err)))
    };
    for dir in dirs {
        let local = check_complete(&dir).and_then(|()| accept(&dir));
        if let Some((stop, error)) = verdict(&dir, local)? {
            if stop {
                return Err(error);
            }
            skipped.push(Skipped { dir, error });
            continue;
        }
        // Reborrowed for this attempt only (a failed one leaves them to the next).
        let opt: Option<&mut dyn ShardedOptimizer> = match &mut optimizer {
            Some(o) => Some(&mut **o),
            None => None,
        };
        let loaded = load(fsdp, &dir, opt, scaler.as_deref_mut());
        let (local, loaded) = match loaded {
            Ok(l) => (Ok(()), Some(l)),
            Err(e) => (Err(e), None),
        };
        match verdict(&dir, local)? {
            None => {
                let l = loaded.expect("a load every rank agreed succeeded");
                return Ok(Resumed {
                    loaded: Some((dir, l)),
                    skipped,
                });
            }
            Some((true, error)) => return Err(error),
            Some((false, error)) => skipped.push(Skipped { dir, error }),
        }
    }
    Ok(Resumed {
        loaded: None,
        skipped,
    })
}

/// Loads checkpoint `dir` (saved at any number of ranks): the model's parameters, `optimizer`'s
/// state (when given; the checkpoint must hold one) and `scaler`'s state (when given and saved).
/// A **collective**: every rank calls it; the ranks agree before any of them changes its model,
/// so a missing, stale or corrupted file is refused on every rank.
///
/// # Errors
/// As [`load_sharded`] / [`load_sharded_optim`]; [`StateDictError::Format`] for a bad manifest
/// or a checkpoint without optimizer state when `optimizer` is given.
pub fn load<M: Module + 'static>(
    fsdp: &Fsdp<M>,
    dir: impl AsRef<Path>,
    optimizer: Option<&mut dyn ShardedOptimizer>,
    scaler: Option<&mut ShardedGradScaler>,
) -> Result<LoadedCheckpoint> {
    let ctx = Ctx::of(fsdp);
    let dir = dir.as_ref();
    // Agreed like the data files, so a bad manifest on one rank's view stops every rank.
    let manifest = read_manifest(dir).and_then(|m| {
        if optimizer.is_some() && !m.has_optim {
            Err(format_err(
                &dir.join(MANIFEST),
                "the checkpoint holds no optimizer state",
            ))
        } else {
            Ok(m)
        }
    });
    let manifest = agree_load(&ctx, dir, None, "checkpoint load", manifest)?;
    let model_dir = dir.join("model");
    for (sub, kind) in [
        (&model_dir, KIND_SHARDED_PARAMS),
        (&dir.join("optim"), KIND_SHARDED_OPTIM),
    ] {
        if kind == KIND_SHARDED_OPTIM && optimizer.is_none() {
            continue;
        }
        let local = read_sharded_meta(sub, kind).and_then(|m| {
            check_generation(
                &read_file_meta(&sub.join(META_FILE), &format!("{kind}-meta"))?.0,
                &sub.join(META_FILE),
                &manifest.generation,
            )
            .map(|_| m.world_size)
        });
        let world = local.as_ref().ok().copied();
        agree_load(&ctx, sub, world, "checkpoint load", local)?;
    }
    let state = match &optimizer {
        Some(_) => Some(load_sharded_optim(fsdp, dir.join("optim"))?),
        None => None,
    };
    load_sharded(fsdp, &model_dir)?;
    if let (Some(opt), Some(st)) = (optimizer, state) {
        opt.load_state(fsdp as &dyn ShardedParams, st.slots, st.steps)?;
    }
    if let (Some(s), Some((scale, tracker))) = (scaler, manifest.scaler) {
        s.load_state(scale, tracker)?;
    }
    Ok(LoadedCheckpoint {
        step: manifest.step,
        metadata: manifest.metadata,
        scaler: manifest.scaler,
        lineage: manifest.lineage,
    })
}
