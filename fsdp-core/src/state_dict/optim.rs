//! Optimizer state dicts (full and sharded), generic over any optimizer that keeps per-unit
//! shard tensors.

use super::check::{check_slots, missing, optim_ranks};
use super::error::{Result, StateDictError};
use super::format::{read_sharded_meta, read_sharded_ranks, write_sharded_dir};
use super::reshard::{
    agree_load, all_names, chunks_from_entries, chunks_from_pieces, collective_sharded_save,
    finish_collective_save, gather_entries, ranks_needed, shard_pieces, Ctx,
};
use super::types::{FullOptimStateDict, OptimState, ShardedOptimStateDict, ShardedStateDict};
use super::KIND_SHARDED_OPTIM;
use crate::runtime::fsdp::Fsdp;
use fsdp_autograd::nn::Module;
use std::collections::HashMap;
use std::path::Path;
// ------------------------------------------------------------------------------- optimizer

pub(super) fn slot_what(slot: &str) -> String {
    format!("optimizer state (slot `{slot}`) of parameter")
}

/// Gathers an optimizer's state into full tensors with the parameters' names and shapes, per
/// slot. A **collective** like [`full_state_dict`](crate::state_dict::full_state_dict) (one all-gather per unit and slot with state);
/// every rank must pass state for the same units.
///
/// # Errors
/// [`StateDictError::BadStateTensor`], [`StateDictError::InvalidName`],
/// [`StateDictError::DuplicateEntry`] (a repeated slot), collective and device errors.
pub fn full_optim_state_dict<M: Module + 'static>(
    fsdp: &Fsdp<M>,
    state: &OptimState,
    rank0_only: bool,
) -> Result<FullOptimStateDict> {
    fsdp.synchronize()?;
    let ctx = Ctx::of(fsdp);
    check_slots(state.slots.iter().map(|(s, _)| s.as_str()))?;
    let steps = param_steps(&ctx, &state.steps)?;
    let keep = !rank0_only || ctx.is_primary();
    let mut slots = Vec::with_capacity(state.slots.len());
    for (name, tensors) in &state.slots {
        let tensors = ctx.check_slot(name, tensors)?;
        slots.push((name.clone(), gather_entries(&ctx, &tensors, keep)?));
    }
    Ok(FullOptimStateDict {
        world_size: ctx.factor,
        steps,
        slots,
    })
}

/// Turns a full optimizer state dict into this rank's per-unit shard tensors (new f32 tensors on
/// the shard device, made on the optimizer stream), ready for the optimizer's `load_state`. A
/// unit gets `None` in a slot when none of its parameters has state there. No communication.
///
/// # Errors
/// [`StateDictError::MissingEntry`] (a unit with state for only some of its parameters),
/// [`StateDictError::UnexpectedEntry`], [`StateDictError::ShapeMismatch`],
/// [`StateDictError::ValueCount`], [`StateDictError::DuplicateEntry`], device errors.
pub fn load_full_optim_state_dict<M: Module + 'static>(
    fsdp: &Fsdp<M>,
    dict: &FullOptimStateDict,
) -> Result<OptimState> {
    let ctx = Ctx::of(fsdp);
    check_slots(dict.slots.iter().map(|(s, _)| s.as_str()))?;
    let mut all = Vec::with_capacity(dict.slots.len());
    for (slot, entries) in &dict.slots {
        all.push(chunks_from_entries(&ctx, entries, &slot_what(slot), false)?);
    }
    to_optim_state(&ctx, unit_steps(&ctx, &dict.steps)?, &dict.slots, all)
}

/// Per-parameter step counts from per-unit ones.
pub(super) fn param_steps(ctx: &Ctx, steps: &[u64]) -> Result<Vec<(String, u64)>> {
    if steps.len() != ctx.shards.len() {
        return Err(StateDictError::Steps {
            detail: format!(
                "{} per-unit step counts, the wrapped model has {} units",
                steps.len(),
                ctx.shards.len()
            ),
        });
    }
    Ok(ctx
        .shards
        .iter()
        .zip(steps)
        .flat_map(|(s, &n)| s.names.iter().map(move |name| (name.clone(), n)))
        .collect())
}

/// Per-unit step counts from per-parameter ones (the parameters of a unit must agree).
pub(super) fn unit_steps(ctx: &Ctx, steps: &[(String, u64)]) -> Result<Vec<u64>> {
    const WHAT: &str = "optimizer step count of parameter";
    let mut map: HashMap<&str, u64> = HashMap::with_capacity(steps.len());
    for (name, n) in steps {
        if map.insert(name.as_str(), *n).is_some() {
            return Err(StateDictError::DuplicateEntry {
                what: WHAT.into(),
                name: name.clone(),
            });
        }
    }
    let names = all_names(ctx);
    if let Some((name, _)) = steps.iter().find(|(n, _)| !names.contains(n.as_str())) {
        return Err(StateDictError::UnexpectedEntry {
            what: WHAT.into(),
            name: name.clone(),
        });
    }
    let mut out = Vec::with_capacity(ctx.shards.len());
    for s in &ctx.shards {
        let mut unit: Option<(u64, &str)> = None;
        for name in &s.names {
            let n = *map.get(name.as_str()).ok_or_else(|| missing(WHAT, name))?;
            match unit {
                Some((m, first)) if m != n => {
                    return Err(StateDictError::Steps {
                        detail: format!(
                            "parameters `{first}` ({m} steps) and `{name}` ({n} steps) share \
                             unit `{}` now; one unit has one step count",
                            s.path
                        ),
                    })
                }
                Some(_) => {}
                None => unit = Some((n, name)),
            }
        }
        out.push(unit.map_or(0, |(n, _)| n));
    }
    Ok(out)
}

pub(super) fn to_optim_state<T>(
    ctx: &Ctx,
    steps: Vec<u64>,
    names: &[(String, T)],
    chunks: Vec<Vec<Option<Vec<f32>>>>,
) -> Result<OptimState> {
    let mut slots = Vec::with_capacity(names.len());
    for ((name, _), per_unit) in names.iter().zip(chunks) {
        let mut tensors = Vec::with_capacity(per_unit.len());
        for c in per_unit {
            tensors.push(match c {
                Some(c) => Some(ctx.new_tensor(c)?),
                None => None,
            });
        }
        slots.push((name.clone(), tensors));
    }
    Ok(OptimState { steps, slots })
}

/// This rank's sharded optimizer state dict (per slot, its pieces of every parameter with
/// state). No communication.
///
/// # Errors
/// [`StateDictError::BadStateTensor`], [`StateDictError::InvalidName`],
/// [`StateDictError::DuplicateEntry`], device errors.
pub fn sharded_optim_state_dict<M: Module + 'static>(
    fsdp: &Fsdp<M>,
    state: &OptimState,
) -> Result<ShardedOptimStateDict> {
    fsdp.synchronize()?;
    let ctx = Ctx::of(fsdp);
    check_slots(state.slots.iter().map(|(s, _)| s.as_str()))?;
    let steps = param_steps(&ctx, &state.steps)?;
    let mut slots = Vec::with_capacity(state.slots.len());
    for (name, tensors) in &state.slots {
        let tensors = ctx.check_slot(name, tensors)?;
        slots.push((name.clone(), shard_pieces(&ctx, &tensors)?));
    }
    Ok(ShardedOptimStateDict { steps, slots })
}

/// Turns a sharded optimizer state dict (saved at any world size) into this rank's per-unit
/// shard tensors, like [`load_full_optim_state_dict`]. No communication.
///
/// # Errors
/// As [`load_sharded_state_dict`](crate::state_dict::load_sharded_state_dict), per slot.
pub fn load_sharded_optim_state_dict<M: Module + 'static>(
    fsdp: &Fsdp<M>,
    dict: &ShardedOptimStateDict,
) -> Result<OptimState> {
    let ctx = Ctx::of(fsdp);
    check_slots(dict.slots.iter().map(|(s, _)| s.as_str()))?;
    let mut all = Vec::with_capacity(dict.slots.len());
    for (slot, d) in &dict.slots {
        all.push(chunks_from_pieces(&ctx, d, &slot_what(slot), false)?);
    }
    to_optim_state(&ctx, unit_steps(&ctx, &dict.steps)?, &dict.slots, all)
}

/// Gathers the optimizer state with `rank0_only` and writes it to `path` on the primary rank.
/// A **collective**, like [`save_full`](crate::state_dict::save_full).
///
/// # Errors
/// As [`full_optim_state_dict`] and [`FullOptimStateDict::save`];
/// [`StateDictError::PeerFailed`].
pub fn save_full_optim<M: Module + 'static>(
    fsdp: &Fsdp<M>,
    state: &OptimState,
    path: impl AsRef<Path>,
) -> Result<()> {
    let dict = full_optim_state_dict(fsdp, state, true)?;
    let ctx = Ctx::of(fsdp);
    let local = if ctx.is_primary() {
        dict.save(path)
    } else {
        Ok(())
    };
    finish_collective_save(&ctx, local, "save_full_optim")
}

/// Reads a full optimizer state file and returns this rank's per-unit shard tensors. No
/// communication.
///
/// # Errors
/// As [`FullOptimStateDict::load`] and [`load_full_optim_state_dict`].
pub fn load_full_optim<M: Module + 'static>(
    fsdp: &Fsdp<M>,
    path: impl AsRef<Path>,
) -> Result<OptimState> {
    load_full_optim_state_dict(fsdp, &FullOptimStateDict::load(path)?)
}

/// Saves the sharded optimizer state as the checkpoint directory `dir`, all-or-nothing exactly
/// like [`save_sharded`](crate::state_dict::save_sharded) (staging directory, checksums, one atomic rename; a separate
/// directory from the parameters').
///
/// # Errors
/// As [`sharded_optim_state_dict`] and [`ShardedOptimStateDict::save`];
/// [`StateDictError::PeerFailed`].
pub fn save_sharded_optim<M: Module + 'static>(
    fsdp: &Fsdp<M>,
    state: &OptimState,
    dir: impl AsRef<Path>,
) -> Result<()> {
    let ctx = Ctx::of(fsdp);
    collective_sharded_save(
        &ctx,
        dir.as_ref(),
        "save_sharded_optim",
        |tmp, generation| {
            let d = sharded_optim_state_dict(fsdp, state)?;
            let slots: Vec<(&str, &ShardedStateDict)> =
                d.slots.iter().map(|(s, d)| (s.as_str(), d)).collect();
            let ranks = optim_ranks(&d.slots)?;
            write_sharded_dir(
                tmp,
                KIND_SHARDED_OPTIM,
                Some(&d.steps),
                &slots,
                &ranks,
                generation,
            )
        },
    )
}

/// Reads what this rank needs of a sharded optimizer checkpoint (saved at any world size) and
/// returns its per-unit shard tensors. A **collective** with the same all-or-nothing agreement
/// as [`load_sharded`](crate::state_dict::load_sharded).
///
/// # Errors
/// As [`ShardedOptimStateDict::load_dir`] and [`load_sharded_optim_state_dict`];
/// [`StateDictError::PeerRejected`].
pub fn load_sharded_optim<M: Module + 'static>(
    fsdp: &Fsdp<M>,
    dir: impl AsRef<Path>,
) -> Result<OptimState> {
    let ctx = Ctx::of(fsdp);
    let dir = dir.as_ref();
    let mut world = None;
    let local = (|| {
        let meta = read_sharded_meta(dir, KIND_SHARDED_OPTIM)?;
        world = Some(meta.world_size);
        let ranks = ranks_needed(&ctx, dir, KIND_SHARDED_OPTIM, &meta)?;
        let slots = read_sharded_ranks(dir, KIND_SHARDED_OPTIM, &meta, &ranks)?;
        let dict = ShardedOptimStateDict {
            steps: meta.steps.unwrap_or_default(),
            slots,
        };
        load_sharded_optim_state_dict(fsdp, &dict)
    })();
    agree_load(&ctx, dir, world, "load_sharded_optim", local)
}
