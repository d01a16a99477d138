//! The wrapped model's view and the resharding core: full (gather / chunk), sharded (pieces /
//! overlap fill) and local state dicts of the parameters.

use super::check::{check_shape, index_entries, missing};
use super::durable::{fresh_id, publish_dir, staging_dir};
use super::error::{Result, StateDictError};
use super::format::{
    check_generation, parse_pieces, rank_path, read_file_meta, read_sharded_meta,
    read_sharded_ranks, write_sharded_dir, ShardedMeta,
};
use super::types::{
    FullStateDict, LocalStateDict, LocalUnit, ParamMeta, ShardPiece, ShardedStateDict, TensorEntry,
};
use super::{KIND_SHARDED_PARAMS, META_FILE};
use crate::runtime::fsdp::{gather_flat, tensor_slice, Fsdp, UnitShard};
use fsdp_alloc::{DType, Device, Stream};
use fsdp_autograd::nn::Module;
use fsdp_autograd::{no_grad, with_stream, Tensor};
use fsdp_collectives::{ProcessGroup, ReduceOp};
use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
// ------------------------------------------------------------------- the wrapped model's view

/// What the state-dict functions need from a wrapped model.
pub(super) struct Ctx {
    pub(super) shards: Vec<UnitShard>,
    pub(super) device: Device,
    /// Where the shards live and are read and written: the shard device's optimizer stream
    /// (the compute stream, or the host stream under CPU offload).
    pub(super) stream: Stream,
    pub(super) group: Arc<dyn ProcessGroup>,
    pub(super) replicate: Option<Arc<dyn ProcessGroup>>,
    /// The sharding factor (1 for NoShard or no units).
    pub(super) factor: usize,
    /// This rank's chunk index.
    pub(super) rank: usize,
}

impl Ctx {
    pub(super) fn of<M: Module + 'static>(fsdp: &Fsdp<M>) -> Ctx {
        let shards = fsdp.shards();
        let factor = shards.first().map_or(1, |s| s.layout.sharding_factor());
        let rank = shards.first().map_or(0, |s| s.rank);
        Ctx {
            shards,
            device: fsdp.shard_device().clone(),
            stream: fsdp.optimizer_stream().clone(),
            group: Arc::clone(fsdp.shard_group()),
            replicate: fsdp.replicate_group().cloned(),
            factor,
            rank,
        }
    }

    /// Rank 0 of the shard group and of the replicate group (global rank 0 of a mesh).
    pub(super) fn is_primary(&self) -> bool {
        self.group.rank() == 0 && self.replicate.as_ref().is_none_or(|g| g.rank() == 0)
    }

    /// Writes sharded files: one rank per distinct shard (replicate rank 0; for an unsharded
    /// model, only the primary rank).
    pub(super) fn is_shard_writer(&self) -> bool {
        (self.factor > 1 || self.group.rank() == 0)
            && self.replicate.as_ref().is_none_or(|g| g.rank() == 0)
    }

    pub(super) fn read(&self, t: &Tensor) -> Result<Vec<f32>> {
        Ok(with_stream(&self.stream, || t.to_vec::<f32>())?)
    }

    pub(super) fn new_tensor(&self, values: Vec<f32>) -> Result<Tensor> {
        let n = values.len();
        Ok(with_stream(&self.stream, || {
            Tensor::from_vec(values, &[n], &self.device)
        })?)
    }

    pub(super) fn write(&self, t: &Tensor, values: Vec<f32>) -> Result<()> {
        let src = self.new_tensor(values)?;
        with_stream(&self.stream, || no_grad(|| t.copy_(&src)))?;
        Ok(())
    }

    /// Gathers unit `u`'s flat tensor `t` (a chunk in the unit's layout); the padded flat
    /// values on ranks that `keep`, `None` elsewhere. A collective when the unit is sharded.
    pub(super) fn gather(&self, u: usize, t: &Tensor, keep: bool) -> Result<Option<Vec<f32>>> {
        let layout = &self.shards[u].layout;
        if layout.sharding_factor() == 1 {
            return if keep {
                self.read(t).map(Some)
            } else {
                Ok(None)
            };
        }
        let full = gather_flat(&self.group, t, &self.stream, &self.device)?;
        if keep {
            self.read(&full).map(Some)
        } else {
            // Nothing reads `full` on the host; its memory returns to the allocator in stream
            // order once the gather ran.
            Ok(None)
        }
    }

    /// One-element all-reduce (max) of a failure flag over the shard and replicate groups:
    /// true if any rank failed.
    pub(super) fn any_failed(&self, failed: bool) -> Result<bool> {
        Ok(self.max_over_ranks(if failed { 1.0 } else { 0.0 })? > 0.0)
    }

    /// One-element all-reduce (max) over the shard and replicate groups.
    pub(super) fn max_over_ranks(&self, value: f32) -> Result<f32> {
        let flag = self.new_tensor(vec![value])?;
        self.group
            .all_reduce(&tensor_slice(&flag)?, ReduceOp::Max, &self.stream)
            .wait()?;
        if let Some(rep) = &self.replicate {
            rep.all_reduce(&tensor_slice(&flag)?, ReduceOp::Max, &self.stream)
                .wait()?;
        }
        Ok(self.read(&flag)?[0])
    }

    /// Checks per-unit optimizer tensors and returns contiguous handles to them.
    pub(super) fn check_slot(
        &self,
        slot: &str,
        tensors: &[Option<Tensor>],
    ) -> Result<Vec<Option<Tensor>>> {
        if tensors.len() != self.shards.len() {
            return Err(StateDictError::BadStateTensor {
                slot: slot.into(),
                unit: tensors.len().min(self.shards.len()),
                detail: format!(
                    "the slot has {} per-unit tensors, the wrapped model has {} units",
                    tensors.len(),
                    self.shards.len()
                ),
            });
        }
        let mut out = Vec::with_capacity(tensors.len());
        for (u, (t, s)) in tensors.iter().zip(&self.shards).enumerate() {
            let Some(t) = t else {
                out.push(None);
                continue;
            };
            let bad = |detail: String| StateDictError::BadStateTensor {
                slot: slot.into(),
                unit: u,
                detail,
            };
            if t.dtype() != DType::F32 {
                return Err(bad(format!("dtype {}, expected f32", t.dtype())));
            }
            if t.numel() != s.layout.chunk_numel() {
                return Err(bad(format!(
                    "{} elements, the unit's shard has {}",
                    t.numel(),
                    s.layout.chunk_numel()
                )));
            }
            if t.device() != &self.device {
                return Err(bad(format!(
                    "on device {:?}, the shards are on {:?}",
                    t.device().id(),
                    self.device.id()
                )));
            }
            let t = if t.is_contiguous() {
                t.clone()
            } else {
                with_stream(&self.stream, || t.contiguous_copy())?
            };
            out.push(Some(t));
        }
        Ok(out)
    }
}

// ---------------------------------------------------------------------------- validation

/// Which units a set of names covers: per unit `true` (all of its parameters), `false` (none);
/// partially covered units are an error naming the first missing parameter. With `require`,
/// every unit must be covered.
pub(super) fn covered_units(
    ctx: &Ctx,
    has: &dyn Fn(&str) -> bool,
    what: &str,
    require: bool,
) -> Result<Vec<bool>> {
    let mut out = Vec::with_capacity(ctx.shards.len());
    for s in &ctx.shards {
        let present = s.names.iter().filter(|n| has(n)).count();
        if s.names.is_empty() {
            // Nothing to load; an optimizer has no state for an empty unit.
            out.push(require);
        } else if present == s.names.len() {
            out.push(true);
        } else if present == 0 && !require {
            out.push(false);
        } else {
            let n = s.names.iter().find(|n| !has(n)).map_or("", |n| n.as_str());
            return Err(missing(what, n));
        }
    }
    Ok(out)
}

pub(super) fn all_names(ctx: &Ctx) -> HashSet<&str> {
    ctx.shards
        .iter()
        .flat_map(|s| s.names.iter().map(|n| n.as_str()))
        .collect()
}

// ------------------------------------------------------------------------- full: generic core

/// Full entries of per-unit tensors in the units' layouts (collective for sharded units).
pub(super) fn gather_entries(
    ctx: &Ctx,
    tensors: &[Option<Tensor>],
    keep: bool,
) -> Result<Vec<TensorEntry>> {
    let mut out = Vec::new();
    for (u, t) in tensors.iter().enumerate() {
        let Some(t) = t else { continue };
        let Some(flat) = ctx.gather(u, t, keep)? else {
            continue;
        };
        let s = &ctx.shards[u];
        for ((v, info), name) in s
            .layout
            .unflatten(&flat)?
            .into_iter()
            .zip(s.layout.params())
            .zip(&s.names)
        {
            out.push(TensorEntry {
                name: name.clone(),
                shape: info.shape().to_vec(),
                values: v.to_vec(),
            });
        }
    }
    Ok(out)
}

/// This rank's chunk of every unit from full entries: `Some(chunk)` for covered units.
pub(super) fn chunks_from_entries(
    ctx: &Ctx,
    entries: &[TensorEntry],
    what: &str,
    require: bool,
) -> Result<Vec<Option<Vec<f32>>>> {
    let lookup = index_entries(entries, what)?;
    let covered = covered_units(ctx, &|n| lookup.contains_key(n), what, require)?;
    let names = all_names(ctx);
    if let Some(e) = entries.iter().find(|e| !names.contains(e.name.as_str())) {
        return Err(StateDictError::UnexpectedEntry {
            what: what.into(),
            name: e.name.clone(),
        });
    }
    let mut out = Vec::with_capacity(ctx.shards.len());
    for (s, cov) in ctx.shards.iter().zip(covered) {
        if !cov {
            out.push(None);
            continue;
        }
        let mut slices: Vec<&[f32]> = Vec::with_capacity(s.names.len());
        for (name, info) in s.names.iter().zip(s.layout.params()) {
            let e = lookup[name.as_str()];
            check_shape(what, name, info.shape(), &e.shape)?;
            slices.push(&e.values);
        }
        let mut chunk = vec![0f32; s.layout.chunk_numel()];
        s.layout.flatten_shard_into(&slices, s.rank, &mut chunk)?;
        out.push(Some(chunk));
    }
    Ok(out)
}

// ---------------------------------------------------------------------- full: the public API

/// Gathers the full state dict: every parameter with its original name and shape. A
/// **collective** over the shard group (one all-gather per sharded unit, one unit at a time):
/// every rank must call it. With `rank0_only`, only the primary rank (rank 0 of the shard and
/// replicate groups) gets the entries; the others get an empty dict (see the module docs for the
/// memory this takes).
///
/// # Errors
/// Collective, device and tensor errors.
pub fn full_state_dict<M: Module + 'static>(
    fsdp: &Fsdp<M>,
    rank0_only: bool,
) -> Result<FullStateDict> {
    fsdp.synchronize()?;
    let ctx = Ctx::of(fsdp);
    let keep = !rank0_only || ctx.is_primary();
    let tensors: Vec<Option<Tensor>> = ctx.shards.iter().map(|s| Some(s.shard.clone())).collect();
    Ok(FullStateDict {
        world_size: ctx.factor,
        entries: gather_entries(&ctx, &tensors, keep)?,
    })
}

/// Loads a full state dict into the wrapped model: each rank copies its chunk of every unit into
/// its shards (no communication), then tells FSDP the parameters changed. Everything is
/// validated before anything is written: every parameter must be present with its shape, and no
/// entry may be unknown or repeated.
///
/// # Errors
/// [`StateDictError::MissingEntry`], [`StateDictError::UnexpectedEntry`],
/// [`StateDictError::DuplicateEntry`], [`StateDictError::ShapeMismatch`],
/// [`StateDictError::ValueCount`], or device/tensor errors.
pub fn load_full_state_dict<M: Module + 'static>(
    fsdp: &Fsdp<M>,
    dict: &FullStateDict,
) -> Result<()> {
    let ctx = Ctx::of(fsdp);
    let chunks = chunks_from_entries(&ctx, &dict.entries, "parameter", true)?;
    write_shards(fsdp, &ctx, chunks)
}

pub(super) fn write_shards<M: Module + 'static>(
    fsdp: &Fsdp<M>,
    ctx: &Ctx,
    chunks: Vec<Option<Vec<f32>>>,
) -> Result<()> {
    for (s, c) in ctx.shards.iter().zip(chunks) {
        if let Some(c) = c {
            ctx.write(&s.shard, c)?;
        }
    }
    fsdp.params_updated();
    Ok(())
}

/// Gathers the full state dict with `rank0_only` and writes it to `path` on the primary rank. A
/// **collective** (the gather, then a one-element all-reduce so every rank returns after the file
/// exists, or with an error if the write failed).
///
/// # Errors
/// As [`full_state_dict`] and [`FullStateDict::save`]; [`StateDictError::PeerFailed`] on the
/// ranks that did not write when the primary's write failed.
pub fn save_full<M: Module + 'static>(fsdp: &Fsdp<M>, path: impl AsRef<Path>) -> Result<()> {
    let dict = full_state_dict(fsdp, true)?;
    let ctx = Ctx::of(fsdp);
    let local = if ctx.is_primary() {
        dict.save(path)
    } else {
        Ok(())
    };
    finish_collective_save(&ctx, local, "save_full")
}

pub(super) fn finish_collective_save(ctx: &Ctx, local: Result<()>, op: &'static str) -> Result<()> {
    let any = ctx.any_failed(local.is_err())?;
    if any {
        return Err(peer_failed(ctx, local, op)?);
    }
    Ok(())
}

/// Every rank of a collective save of which one or more failed: the failing ranks return their
/// own error, the others [`StateDictError::PeerFailed`] with the lowest failing rank's message
/// (a collective: every rank calls it). `Ok` holds the error to return.
fn peer_failed(ctx: &Ctx, local: Result<impl Sized>, op: &'static str) -> Result<StateDictError> {
    let (reason, rank) = share_reason(ctx, local.as_ref().err())?;
    Ok(match local {
        Err(own) => own,
        Ok(_) => StateDictError::PeerFailed { op, rank, reason },
    })
}

/// Reads a full state dict file (every rank reads the whole file) and loads it
/// ([`load_full_state_dict`]). No communication.
///
/// # Errors
/// As [`FullStateDict::load`] and [`load_full_state_dict`].
pub fn load_full<M: Module + 'static>(fsdp: &Fsdp<M>, path: impl AsRef<Path>) -> Result<()> {
    let dict = FullStateDict::load(path)?;
    load_full_state_dict(fsdp, &dict)
}

// ------------------------------------------------------------------------------- sharded

/// Pieces and catalogue of per-unit tensors on this rank (no communication).
pub(super) fn shard_pieces(ctx: &Ctx, tensors: &[Option<Tensor>]) -> Result<ShardedStateDict> {
    let mut params = Vec::new();
    let mut pieces = Vec::new();
    for (u, t) in tensors.iter().enumerate() {
        let Some(t) = t else { continue };
        let s = &ctx.shards[u];
        for (name, info) in s.names.iter().zip(s.layout.params()) {
            params.push(ParamMeta {
                name: name.clone(),
                shape: info.shape().to_vec(),
            });
        }
        let values = ctx.read(t)?;
        for p in s.layout.rank_pieces(s.rank)? {
            pieces.push(ShardPiece {
                rank: s.rank,
                name: s.names[p.param_index].clone(),
                shape: s.layout.params()[p.param_index].shape().to_vec(),
                offset: p.offset_in_param,
                values: values[p.shard_range()].to_vec(),
            });
        }
    }
    Ok(ShardedStateDict {
        world_size: ctx.factor,
        ranks: vec![ctx.rank],
        params,
        pieces,
    })
}

/// This rank's chunk of every unit from a sharded dict: `Some(chunk)` for covered units.
pub(super) fn chunks_from_pieces(
    ctx: &Ctx,
    dict: &ShardedStateDict,
    what: &str,
    require: bool,
) -> Result<Vec<Option<Vec<f32>>>> {
    // The catalogue against the model.
    let mut catalogue: HashMap<&str, &ParamMeta> = HashMap::with_capacity(dict.params.len());
    for p in &dict.params {
        if catalogue.insert(p.name.as_str(), p).is_some() {
            return Err(StateDictError::DuplicateEntry {
                what: what.into(),
                name: p.name.clone(),
            });
        }
    }
    let names = all_names(ctx);
    if let Some(p) = dict
        .params
        .iter()
        .find(|p| !names.contains(p.name.as_str()))
    {
        return Err(StateDictError::UnexpectedEntry {
            what: what.into(),
            name: p.name.clone(),
        });
    }
    let covered = covered_units(ctx, &|n| catalogue.contains_key(n), what, require)?;
    // The pieces against the catalogue, grouped by parameter and sorted by offset.
    let mut by_name: HashMap<&str, Vec<&ShardPiece>> = HashMap::new();
    for p in &dict.pieces {
        let meta =
            catalogue
                .get(p.name.as_str())
                .ok_or_else(|| StateDictError::UnexpectedEntry {
                    what: format!("{what} piece"),
                    name: p.name.clone(),
                })?;
        check_shape(what, &p.name, &meta.shape, &p.shape)?;
        let numel = meta.numel();
        if p.offset
            .checked_add(p.values.len())
            .is_none_or(|end| end > numel)
        {
            return Err(StateDictError::PieceOutOfRange {
                name: p.name.clone(),
                rank: p.rank,
                offset: p.offset,
                len: p.values.len(),
                numel,
            });
        }
        by_name.entry(p.name.as_str()).or_default().push(p);
    }
    for v in by_name.values_mut() {
        v.sort_by_key(|p| (p.offset, p.rank));
    }
    let mut out = Vec::with_capacity(ctx.shards.len());
    for (s, cov) in ctx.shards.iter().zip(covered) {
        if !cov {
            out.push(None);
            continue;
        }
        for (name, info) in s.names.iter().zip(s.layout.params()) {
            check_shape(what, name, info.shape(), &catalogue[name.as_str()].shape)?;
        }
        let mut chunk = vec![0f32; s.layout.chunk_numel()];
        for piece in s.layout.rank_pieces(s.rank)? {
            let name = &s.names[piece.param_index];
            let saved = by_name.get(name.as_str()).map_or(&[][..], |v| v.as_slice());
            fill_range(
                &mut chunk[piece.shard_range()],
                piece.param_range(),
                saved,
                name,
                ctx.rank,
            )?;
        }
        out.push(Some(chunk));
    }
    Ok(out)
}

/// Fills `dst` (elements `want` of a parameter) from saved pieces sorted by offset; every
/// element must be covered (overlaps, e.g. replicas, are fine: later pieces overwrite).
pub(super) fn fill_range(
    dst: &mut [f32],
    want: Range<usize>,
    saved: &[&ShardPiece],
    name: &str,
    rank: usize,
) -> Result<()> {
    let mut cursor = want.start;
    for p in saved {
        if cursor >= want.end {
            break;
        }
        let (lo, hi) = (p.offset, p.offset + p.values.len());
        if hi <= cursor {
            continue;
        }
        if lo > cursor {
            return Err(StateDictError::IncompleteShards {
                name: name.into(),
                rank,
                missing: cursor..lo.min(want.end),
            });
        }
        let end = hi.min(want.end);
        dst[cursor - want.start..end - want.start]
            .copy_from_slice(&p.values[cursor - lo..end - lo]);
        cursor = end;
    }
    if cursor < want.end {
        return Err(StateDictError::IncompleteShards {
            name: name.into(),
            rank,
            missing: cursor..want.end,
        });
    }
    Ok(())
}

/// This rank's sharded state dict: its pieces of every parameter, each with the parameter's full
/// shape and its offset in it, plus the catalogue of all parameters. No communication.
///
/// # Errors
/// Device and tensor errors.
pub fn sharded_state_dict<M: Module + 'static>(fsdp: &Fsdp<M>) -> Result<ShardedStateDict> {
    fsdp.synchronize()?;
    let ctx = Ctx::of(fsdp);
    let tensors: Vec<Option<Tensor>> = ctx.shards.iter().map(|s| Some(s.shard.clone())).collect();
    shard_pieces(&ctx, &tensors)
}

/// Loads a sharded state dict: each rank takes, for each of its pieces, the values from the
/// saved pieces that overlap it — so the saving and loading world sizes (and wrap policies) may
/// differ, as long as `dict` holds the pieces this rank needs (e.g. all ranks' dicts merged with
/// [`ShardedStateDict::merge`], or what [`load_sharded`] reads). No communication; validation
/// comes before any write.
///
/// # Errors
/// [`StateDictError::MissingEntry`], [`StateDictError::UnexpectedEntry`],
/// [`StateDictError::DuplicateEntry`], [`StateDictError::ShapeMismatch`],
/// [`StateDictError::PieceOutOfRange`], [`StateDictError::IncompleteShards`], or device errors.
pub fn load_sharded_state_dict<M: Module + 'static>(
    fsdp: &Fsdp<M>,
    dict: &ShardedStateDict,
) -> Result<()> {
    let ctx = Ctx::of(fsdp);
    let chunks = chunks_from_pieces(&ctx, dict, "parameter", true)?;
    write_shards(fsdp, &ctx, chunks)
}

/// Saves the model's sharded state dict as the checkpoint directory `dir`, all-or-nothing: the
/// writing ranks (one per distinct shard) write their files into a fresh staging directory next
/// to `dir` (`.NAME.staging-ID`), each file written to a temporary name, fsynced and renamed;
/// after an all-reduce shows every rank finished, the primary rank publishes the staging
/// directory as `dir` with one atomic rename (an atomic exchange on Linux when `dir` already
/// exists; the previous contents are then removed) and fsyncs the parent. A crash at any point
/// leaves `dir` as it was (the old checkpoint or nothing) plus at most a staging directory.
/// Every file records the save id (generation) and a CRC-32 of every tensor, verified on load.
/// A **collective** over the shard and replicate groups (every rank must call it).
///
/// # Errors
/// [`StateDictError::NonFinite`] (non-finite parameters are never saved unless inside
/// [`allow_non_finite`](crate::state_dict::allow_non_finite)), [`StateDictError::NotRegularFile`] when `dir` exists and is not a
/// directory, I/O errors; [`StateDictError::PeerFailed`] on the ranks whose own part succeeded
/// when another rank's failed. On error `dir` is unchanged and the staging directory removed.
pub fn save_sharded<M: Module + 'static>(fsdp: &Fsdp<M>, dir: impl AsRef<Path>) -> Result<()> {
    let ctx = Ctx::of(fsdp);
    collective_sharded_save(&ctx, dir.as_ref(), "save_sharded", |tmp, generation| {
        let d = sharded_state_dict(fsdp)?;
        write_sharded_dir(
            tmp,
            KIND_SHARDED_PARAMS,
            None,
            &[("", &d)],
            &d.ranks,
            generation,
        )
    })
}

/// Agrees on a fresh save id: the primary rank draws it and it is broadcast over the shard
/// group, then the replicate group (in four exact 16-bit parts).
pub(super) fn agree_generation(ctx: &Ctx) -> Result<u64> {
    let id = if ctx.is_primary() { fresh_id() } else { 0 };
    let parts: Vec<f32> = (0..4).map(|i| ((id >> (16 * i)) & 0xffff) as f32).collect();
    let t = ctx.new_tensor(parts)?;
    ctx.group
        .broadcast(&tensor_slice(&t)?, 0, &ctx.stream)
        .wait()?;
    if let Some(rep) = &ctx.replicate {
        rep.broadcast(&tensor_slice(&t)?, 0, &ctx.stream).wait()?;
    }
    let v = ctx.read(&t)?;
    Ok(v.iter()
        .enumerate()
        .fold(0u64, |acc, (i, x)| acc | ((*x as u64) << (16 * i))))
}

/// The all-or-nothing protocol of sharded saves: agree on a save id, let the shard writers
/// `write(staging_dir, generation)`, agree everyone succeeded, publish by one rename on the
/// primary rank, agree that succeeded.
pub(super) fn collective_sharded_save(
    ctx: &Ctx,
    dir: &Path,
    op: &'static str,
    write: impl FnOnce(&Path, &str) -> Result<()>,
) -> Result<()> {
    let generation = agree_generation(ctx)?;
    let local = (|| {
        let tmp = staging_dir(dir, generation)?;
        if let Ok(m) = std::fs::symlink_metadata(dir) {
            if !m.file_type().is_dir() {
                return Err(StateDictError::NotRegularFile {
                    path: dir.to_path_buf(),
                });
            }
        }
        if ctx.is_shard_writer() {
            std::fs::create_dir_all(&tmp).map_err(|source| StateDictError::Io {
                op: "create staging directory",
                path: tmp.clone(),
                source,
            })?;
            write(&tmp, &format!("{generation:016x}"))?;
        }
        Ok(tmp)
    })();
    let any = ctx.any_failed(local.is_err())?;
    let cleanup = |tmp: &Path| {
        if ctx.is_primary() {
            let _ = std::fs::remove_dir_all(tmp);
        }
    };
    if any {
        if let Ok(tmp) = &local {
            cleanup(tmp);
        } else if let Ok(tmp) = staging_dir(dir, generation) {
            cleanup(&tmp);
        }
        return Err(peer_failed(ctx, local, op)?);
    }
    let tmp = local?;
    let published = if ctx.is_primary() {
        let r = publish_dir(&tmp, dir);
        if r.is_err() {
            cleanup(&tmp);
        }
        r
    } else {
        Ok(())
    };
    finish_collective_save(ctx, published, op)
}

/// Code of a checkpoint file for [`agree_load`]: 0 for the metadata, `1 + 2r` for rank `r`'s
/// data file, `2 + 2r` for its piece index.
fn file_code(p: &Path) -> Option<u32> {
    let name = p.file_name()?.to_str()?;
    if name == META_FILE {
        return Some(0);
    }
    let r: u32 = name.strip_prefix("rank-")?.get(..5)?.parse().ok()?;
    Some(if name.ends_with(".pieces.safetensors") {
        2 + 2 * r
    } else {
        1 + 2 * r
    })
}

/// Ranks agree on a load: every rank reports whether its part failed (and the file it blames);
/// if any rank failed, every rank returns an error — its own, or [`StateDictError::PeerRejected`]
/// naming the file another rank refused. Nothing may be written into the model before this.
pub(super) fn agree_load<T>(
    ctx: &Ctx,
    dir: &Path,
    world: Option<usize>,
    op: &'static str,
    local: Result<T>,
) -> Result<T> {
    const NONE: f32 = 16_777_215.0; // 2^24 - 1: exact in f32
    const OTHER: f32 = 16_777_214.0;
    let (code, rank) = match &local {
        Ok(_) => (NONE, NONE),
        Err(e) => (
            e.path()
                .filter(|p| p.parent() == Some(dir))
                .and_then(file_code)
                .map_or(OTHER, |c| c.min(16_777_213) as f32),
            ctx.group.rank() as f32,
        ),
    };
    let t = ctx.new_tensor(vec![code, rank])?;
    ctx.group
        .all_reduce(&tensor_slice(&t)?, ReduceOp::Min, &ctx.stream)
        .wait()?;
    if let Some(rep) = &ctx.replicate {
        rep.all_reduce(&tensor_slice(&t)?, ReduceOp::Min, &ctx.stream)
            .wait()?;
    }
    let v = ctx.read(&t)?;
    if v[0] == NONE {
        return local;
    }
    // Someone refused: every rank takes part in passing one refusing rank's message around.
    let (reason, rank) = share_reason(ctx, local.as_ref().err())?;
    local?;
    let code = v[0] as usize;
    let path = match (code, world) {
        (0, _) => dir.join(META_FILE),
        (c, Some(w)) if v[0] < OTHER => rank_path(dir, (c - 1) / 2, w, c % 2 == 0),
        _ => dir.to_path_buf(),
    };
    Err(StateDictError::PeerRejected {
        op,
        rank,
        path,
        reason,
    })
}

/// The longest error message [`share_reason`] passes on (bytes).
const REASON_BYTES: usize = 1024;

/// A collective among ranks of which at least one has an error: the failing rank with the
/// lowest (shard rank, replica rank) sends its message to every rank (two small all-reduces:
/// a min for the sender, a sum of the message bytes). Returns the message and the sender's rank
/// in the shard group.
pub(super) fn share_reason(ctx: &Ctx, err: Option<&StateDictError>) -> Result<(String, usize)> {
    const NONE: f32 = 16_777_215.0;
    let size = ctx.group.size();
    let replica = ctx.replicate.as_ref().map_or(0, |r| r.rank());
    let mine = (ctx.group.rank() + size * replica) as f32;
    let t = ctx.new_tensor(vec![if err.is_some() { mine } else { NONE }])?;
    ctx.group
        .all_reduce(&tensor_slice(&t)?, ReduceOp::Min, &ctx.stream)
        .wait()?;
    if let Some(rep) = &ctx.replicate {
        rep.all_reduce(&tensor_slice(&t)?, ReduceOp::Min, &ctx.stream)
            .wait()?;
    }
    let ticket = ctx.read(&t)?[0];
    let mut buf = vec![0f32; REASON_BYTES];
    if let Some(e) = err.filter(|_| ticket == mine) {
        let text = e.to_string();
        let mut end = text.len().min(REASON_BYTES);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        for (d, b) in buf.iter_mut().zip(text[..end].bytes()) {
            *d = f32::from(b);
        }
    }
    let t = ctx.new_tensor(buf)?;
    ctx.group
        .all_reduce(&tensor_slice(&t)?, ReduceOp::Sum, &ctx.stream)
        .wait()?;
    if let Some(rep) = &ctx.replicate {
        rep.all_reduce(&tensor_slice(&t)?, ReduceOp::Sum, &ctx.stream)
            .wait()?;
    }
    let bytes: Vec<u8> = ctx
        .read(&t)?
        .into_iter()
        .take_while(|&b| b != 0.0)
        .map(|b| b.clamp(0.0, 255.0) as u8)
        .collect();
    let rank = if ticket == NONE {
        0
    } else {
        ticket as usize % size
    };
    Ok((String::from_utf8_lossy(&bytes).into_owned(), rank))
}

/// Loads a sharded checkpoint directory written at any world size: reads the metadata and the
/// small piece indexes (checking every rank's files exist and belong to the same save), then only
/// the data files whose pieces overlap this rank's chunks (checking their checksums and that no
/// value is non-finite). A **collective**: the ranks agree (one small all-reduce) before any of
/// them changes its parameters, so a missing, stale or corrupted file is refused on every rank
/// and never half-loaded.
///
/// # Errors
/// As [`ShardedStateDict::load_dir`] and [`load_sharded_state_dict`] on the ranks that found the
/// problem; [`StateDictError::PeerRejected`] naming the file on the others.
pub fn load_sharded<M: Module + 'static>(fsdp: &Fsdp<M>, dir: impl AsRef<Path>) -> Result<()> {
    let ctx = Ctx::of(fsdp);
    let dir = dir.as_ref();
    let mut world = None;
    let local = (|| {
        let meta = read_sharded_meta(dir, KIND_SHARDED_PARAMS)?;
        world = Some(meta.world_size);
        let ranks = ranks_needed(&ctx, dir, KIND_SHARDED_PARAMS, &meta)?;
        let mut slots = read_sharded_ranks(dir, KIND_SHARDED_PARAMS, &meta, &ranks)?;
        let dict = slots.remove(0).1;
        chunks_from_pieces(&ctx, &dict, "parameter", true)
    })();
    let chunks = agree_load(&ctx, dir, world, "load_sharded", local)?;
    write_shards(fsdp, &ctx, chunks)
}

/// The saving ranks whose pieces overlap what this rank needs.
pub(super) fn ranks_needed(
    ctx: &Ctx,
    dir: &Path,
    kind: &str,
    meta: &ShardedMeta,
) -> Result<Vec<usize>> {
    let mut need: HashMap<&str, Vec<Range<usize>>> = HashMap::new();
    for s in &ctx.shards {
        for p in s.layout.rank_pieces(s.rank)? {
            need.entry(s.names[p.param_index].as_str())
                .or_default()
                .push(p.param_range());
        }
    }
    let mut ranks = Vec::new();
    for r in 0..meta.world_size {
        let path = rank_path(dir, r, meta.world_size, true);
        let (m, _) = read_file_meta(&path, &format!("{kind}-pieces"))?;
        check_generation(&m, &path, &meta.generation)?;
        let data = rank_path(dir, r, meta.world_size, false);
        std::fs::metadata(&data).map_err(|source| StateDictError::Io {
            op: "find the data file",
            path: data.clone(),
            source,
        })?;
        let table = parse_pieces(&m, &path, &meta.slot_names())?;
        let overlaps = table.iter().any(|(_, pieces)| {
            pieces.iter().any(|(name, off, len)| {
                need.get(name.as_str())
                    .is_some_and(|rs| rs.iter().any(|w| *off < w.end && w.start < off + len))
            })
        });
        if overlaps {
            ranks.push(r);
        }
    }
    Ok(ranks)
}

// ------------------------------------------------------------------------------- local

/// This rank's local state dict: its flat shards as they are (padding included) with the
/// layout they belong to. No communication.
///
/// # Errors
/// Device and tensor errors.
pub fn local_state_dict<M: Module + 'static>(fsdp: &Fsdp<M>) -> Result<LocalStateDict> {
    fsdp.synchronize()?;
    let ctx = Ctx::of(fsdp);
    let mut units = Vec::with_capacity(ctx.shards.len());
    for s in &ctx.shards {
        units.push(LocalUnit {
            path: s.path.clone(),
            names: s.names.clone(),
            shapes: s
                .layout
                .params()
                .iter()
                .map(|p| p.shape().to_vec())
                .collect(),
            values: ctx.read(&s.shard)?,
        });
    }
    Ok(LocalStateDict {
        world_size: ctx.factor,
        rank: ctx.rank,
        units,
    })
}

/// Loads a local state dict saved by the same rank of a run with the same world size and
/// wrapping (units, names, shapes). No communication.
///
/// # Errors
/// [`StateDictError::WorldSizeMismatch`], [`StateDictError::RankMismatch`],
/// [`StateDictError::LayoutMismatch`], or device errors.
pub fn load_local_state_dict<M: Module + 'static>(
    fsdp: &Fsdp<M>,
    dict: &LocalStateDict,
) -> Result<()> {
    let ctx = Ctx::of(fsdp);
    if dict.world_size != ctx.factor {
        return Err(StateDictError::WorldSizeMismatch {
            saved: dict.world_size,
            current: ctx.factor,
        });
    }
    if dict.rank != ctx.rank {
        return Err(StateDictError::RankMismatch {
            saved: dict.rank,
            current: ctx.rank,
        });
    }
    if dict.units.len() != ctx.shards.len() {
        return Err(StateDictError::LayoutMismatch {
            detail: format!(
                "{} units saved, the wrapped model has {}",
                dict.units.len(),
                ctx.shards.len()
            ),
        });
    }
    for (u, (d, s)) in dict.units.iter().zip(&ctx.shards).enumerate() {
        let shapes: Vec<&[usize]> = s.layout.params().iter().map(|p| p.shape()).collect();
        let saved: Vec<&[usize]> = d.shapes.iter().map(|v| v.as_slice()).collect();
        let detail = if d.path != s.path {
            Some(format!(
                "unit {u} is `{}` in the dict, `{}` now",
                d.path, s.path
            ))
        } else if d.names != s.names {
            Some(format!(
                "unit {u} (`{}`) has parameters {:?} in the dict, {:?} now",
                s.path, d.names, s.names
            ))
        } else if saved != shapes {
            Some(format!(
                "unit {u} (`{}`) has shapes {saved:?} in the dict, {shapes:?} now",
                s.path
            ))
        } else if d.values.len() != s.layout.chunk_numel() {
            Some(format!(
                "unit {u} (`{}`) has a shard of {} values in the dict, {} now",
                s.path,
                d.values.len(),
                s.layout.chunk_numel()
            ))
        } else {
            None
        };
        if let Some(detail) = detail {
            return Err(StateDictError::LayoutMismatch { detail });
        }
    }
    let chunks = dict.units.iter().map(|d| Some(d.values.clone())).collect();
    write_shards(fsdp, &ctx, chunks)
}
