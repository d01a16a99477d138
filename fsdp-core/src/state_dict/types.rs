//! The state-dict value types (full, sharded, local; parameters and optimizer state) and their
//! plain methods. A leaf among the state-dict files; the methods that read or write files are in
//! `types_io.rs`.

use super::error::{Result, StateDictError};
use fsdp_autograd::nn::{named_parameters, Module};
use fsdp_autograd::Tensor;

// -------------------------------------------------------------------------------------- types

/// One full tensor: a parameter (or one optimizer slot of it) with its original name and shape.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorEntry {
    /// Fully-qualified parameter name.
    pub name: String,
    /// Original shape.
    pub shape: Vec<usize>,
    /// Row-major values (`shape.iter().product()` of them).
    pub values: Vec<f32>,
}

/// A full (gathered) state dict: every parameter with its original name and shape, in unit order
/// and, within a unit, in layout order (the order of [`Fsdp::full_parameters`](crate::Fsdp::full_parameters)).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FullStateDict {
    /// The number of shards of the run that produced it (informational: a full state dict loads
    /// at any world size; 1 for [`FullStateDict::from_module`]).
    pub world_size: usize,
    /// The parameters (empty on non-primary ranks of a `rank0_only` gather).
    pub entries: Vec<TensorEntry>,
}

impl FullStateDict {
    /// The entry named `name`.
    pub fn get(&self, name: &str) -> Option<&TensorEntry> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True if there are no entries (e.g. a non-primary rank of a `rank0_only` gather).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The parameters of a plain (unwrapped) model, by [`named_parameters`] (shared parameters
    /// once, under their first name — the name FSDP uses too).
    ///
    /// # Errors
    /// A parameter that is not materialized or not f32.
    pub fn from_module(model: &dyn Module) -> Result<FullStateDict> {
        let mut entries = Vec::new();
        for (name, p) in named_parameters(model) {
            let t = p.get()?;
            entries.push(TensorEntry {
                name,
                shape: t.shape().to_vec(),
                values: t.to_vec::<f32>()?,
            });
        }
        Ok(FullStateDict {
            world_size: 1,
            entries,
        })
    }
}

/// A parameter's name and full shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamMeta {
    /// Fully-qualified name.
    pub name: String,
    /// Full (original) shape.
    pub shape: Vec<usize>,
}

impl ParamMeta {
    /// Number of elements of the full parameter.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The part of one parameter that one rank holds: its elements
/// `offset..offset + values.len()` of the row-major flattened parameter.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardPiece {
    /// The rank that saved it.
    pub rank: usize,
    /// Fully-qualified parameter name.
    pub name: String,
    /// The parameter's full shape.
    pub shape: Vec<usize>,
    /// Offset of the first value in the flattened parameter.
    pub offset: usize,
    /// The values.
    pub values: Vec<f32>,
}

/// A sharded state dict: the pieces of the parameters held by one or more ranks (one rank's, as
/// built by [`sharded_state_dict`](crate::state_dict::sharded_state_dict); several, after [`ShardedStateDict::merge`] or
/// [`ShardedStateDict::load_dir`]), with the catalogue of every parameter.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ShardedStateDict {
    /// The number of shards (ranks) of the run that saved it.
    pub world_size: usize,
    /// The saving ranks whose pieces this dict holds (sorted).
    pub ranks: Vec<usize>,
    /// Every parameter of the model, in unit and layout order (also those of which these ranks
    /// hold nothing, and zero-sized ones).
    pub params: Vec<ParamMeta>,
    /// The pieces.
    pub pieces: Vec<ShardPiece>,
}

impl ShardedStateDict {
    /// Combines the dicts of several saving ranks of one checkpoint (same world size and
    /// catalogue; each rank at most once).
    ///
    /// # Errors
    /// [`StateDictError::Incompatible`] if world sizes or catalogues differ or a rank repeats.
    pub fn merge(dicts: impl IntoIterator<Item = ShardedStateDict>) -> Result<ShardedStateDict> {
        let mut out: Option<ShardedStateDict> = None;
        for d in dicts {
            match &mut out {
                None => out = Some(d),
                Some(acc) => {
                    if acc.world_size != d.world_size {
                        return Err(StateDictError::Incompatible {
                            detail: format!("world sizes {} and {}", acc.world_size, d.world_size),
                        });
                    }
                    if acc.params != d.params {
                        return Err(StateDictError::Incompatible {
                            detail: "the parameter catalogues (names or shapes) differ".into(),
                        });
                    }
                    if let Some(r) = d.ranks.iter().find(|r| acc.ranks.contains(r)) {
                        return Err(StateDictError::Incompatible {
                            detail: format!("rank {r} appears in two dicts"),
                        });
                    }
                    acc.ranks.extend(d.ranks);
                    acc.ranks.sort_unstable();
                    acc.pieces.extend(d.pieces);
                }
            }
        }
        Ok(out.unwrap_or_default())
    }
}

/// One unit's shard in a [`LocalStateDict`].
#[derive(Debug, Clone, PartialEq)]
pub struct LocalUnit {
    /// Module path of the unit.
    pub path: String,
    /// Parameter names, in layout order.
    pub names: Vec<String>,
    /// Their shapes.
    pub shapes: Vec<Vec<usize>>,
    /// The rank's shard of the unit's flat parameter, padding included.
    pub values: Vec<f32>,
}

/// A local state dict: this rank's flat shards as they are, with the layout they belong to.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalStateDict {
    /// The number of shards (ranks the units were sharded over).
    pub world_size: usize,
    /// The rank that saved it.
    pub rank: usize,
    /// Every unit's shard, in unit order.
    pub units: Vec<LocalUnit>,
}

/// An optimizer's state in FSDP's sharded layout: a step count per unit and, per slot, one f32
/// tensor per unit laid out like the unit's shard (`layout.chunk_numel()` elements), or `None`
/// for units the slot has no state for (e.g. frozen units, or before the first step).
///
/// This is the shape [`crate::optim`]'s sharded optimizers expose: build it as
/// `OptimState { steps: opt.step_counts(), slots: opt.state() }` and give a loaded one back with
/// `opt.load_state(&fsdp, st.slots, st.steps)`. Any optimizer keeping per-unit shard tensors
/// fits.
///
/// In state dicts, step counts are stored **per parameter** (each parameter gets its unit's
/// count), so they survive a change of wrap policy; on load, each unit takes the count its
/// parameters agree on.
#[derive(Debug, Clone)]
pub struct OptimState {
    /// Steps taken, per unit.
    pub steps: Vec<u64>,
    /// `(slot name, per-unit shard tensors)`, one entry per slot.
    pub slots: Vec<(String, Vec<Option<Tensor>>)>,
}

/// A full (gathered) optimizer state dict: per slot, the state of every parameter with its
/// original name and shape.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FullOptimStateDict {
    /// The number of shards of the run that produced it (informational).
    pub world_size: usize,
    /// Steps taken, per parameter (every parameter of the model; its unit's count). Present on
    /// every rank, also with `rank0_only`.
    pub steps: Vec<(String, u64)>,
    /// `(slot name, state of each parameter)`; the entries are empty on non-primary ranks of a
    /// `rank0_only` gather.
    pub slots: Vec<(String, Vec<TensorEntry>)>,
}

/// A sharded optimizer state dict: per slot, a [`ShardedStateDict`] of that slot's state (whose
/// catalogue lists the parameters that have state in that slot).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ShardedOptimStateDict {
    /// Steps taken, per parameter (every parameter of the model; its unit's count).
    pub steps: Vec<(String, u64)>,
    /// `(slot name, the slot's pieces)`.
    pub slots: Vec<(String, ShardedStateDict)>,
}

impl ShardedOptimStateDict {
    /// Combines the dicts of several saving ranks (same slots, see [`ShardedStateDict::merge`]).
    ///
    /// # Errors
    /// [`StateDictError::Incompatible`] if steps, slots, world sizes or catalogues differ.
    pub fn merge(
        dicts: impl IntoIterator<Item = ShardedOptimStateDict>,
    ) -> Result<ShardedOptimStateDict> {
        let dicts: Vec<ShardedOptimStateDict> = dicts.into_iter().collect();
        let Some(first) = dicts.first() else {
            return Ok(ShardedOptimStateDict::default());
        };
        let steps = first.steps.clone();
        let names: Vec<String> = first.slots.iter().map(|(s, _)| s.clone()).collect();
        let mut per_slot: Vec<Vec<ShardedStateDict>> = vec![Vec::new(); names.len()];
        for d in dicts {
            if d.steps != steps {
                return Err(StateDictError::Incompatible {
                    detail: "the per-parameter step counts differ".into(),
                });
            }
            let these: Vec<&String> = d.slots.iter().map(|(s, _)| s).collect();
            if these.len() != names.len() || these.iter().zip(&names).any(|(a, b)| *a != b) {
                return Err(StateDictError::Incompatible {
                    detail: format!("optimizer slots {names:?} and {these:?}"),
                });
            }
            for (i, (_, s)) in d.slots.into_iter().enumerate() {
                per_slot[i].push(s);
            }
        }
        let mut slots = Vec::with_capacity(names.len());
        for (name, dicts) in names.into_iter().zip(per_slot) {
            slots.push((name, ShardedStateDict::merge(dicts)?));
        }
        Ok(ShardedOptimStateDict { steps, slots })
    }
}
