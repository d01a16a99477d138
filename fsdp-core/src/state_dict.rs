//! State dicts: saving and loading a wrapped model's parameters and its optimizer's state, in
//! three forms, in memory and on disk.
//!
//! | form | what each rank holds | communication | load at another world size |
//! |------|----------------------|---------------|----------------------------|
//! | **full** ([`FullStateDict`]) | every parameter, gathered, original names and shapes (or nothing, with `rank0_only`) | one all-gather per unit to build it; none to load | yes |
//! | **sharded** ([`ShardedStateDict`]) | this rank's pieces of the parameters, each with its parameter's full shape and its offset in it | none | yes (every rank takes the saved pieces that overlap its chunk) |
//! | **local** ([`LocalStateDict`]) | this rank's flat shards as they are, with their layout | none | no ([`StateDictError::WorldSizeMismatch`]) |
//!
//! Optimizer state has the full and sharded forms too ([`FullOptimStateDict`],
//! [`ShardedOptimStateDict`]). The functions are generic over any optimizer that keeps, per
//! *slot* (`"momentum"`, `"exp_avg"`, …), one f32 tensor per FSDP unit laid out exactly like the
//! unit's shard ([`OptimState`]) — what the sharded optimizers of [`crate::optim`] keep.
//!
//! # How to use
//! ```
//! use std::sync::Arc;
//! use fsdp_alloc::Device;
//! use fsdp_autograd::{nn::Linear, InitContext};
//! use fsdp_collectives::{ProcessGroup, ThreadGroup};
//! use fsdp_core::{state_dict, Fsdp, FsdpConfig};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // One rank here; with W thread ranks every rank runs the same code.
//! let dev = Device::cpu(0);
//! let group: Arc<dyn ProcessGroup> = Arc::new(ThreadGroup::new(1).remove(0));
//! let model = Linear::new(&InitContext::eager(&dev, 7), 3, 2, true)?;
//! let fsdp = Fsdp::wrap(model, &dev, Arc::clone(&group), FsdpConfig::default())?;
//!
//! // Full state dict: original names and shapes.
//! let full = state_dict::full_state_dict(&fsdp, false)?;
//! assert_eq!(full.get("weight").unwrap().shape, vec![2, 3]);
//!
//! // Through a safetensors file (collective save; every rank loads its chunk from the file).
//! let dir = std::env::temp_dir().join(format!("fsdp-sd-doc-{}", std::process::id()));
//! let path = dir.join("model.safetensors");
//! state_dict::save_full(&fsdp, &path)?;
//!
//! // Another model (another seed) gets the saved values.
//! let other = Linear::new(&InitContext::eager(&dev, 8), 3, 2, true)?;
//! let other = Fsdp::wrap(other, &dev, group, FsdpConfig::default())?;
//! state_dict::load_full(&other, &path)?;
//! assert_eq!(state_dict::full_state_dict(&other, false)?, full);
//! # std::fs::remove_dir_all(&dir)?;
//! # Ok(())
//! # }
//! ```
//!
//! # Memory behaviour
//! - [`full_state_dict`] gathers **one unit at a time**: a buffer of the unit's padded flat size
//!   is allocated on the shard device (the compute device, or the host device under CPU offload),
//!   all-gathered on the shard stream ([`Fsdp::optimizer_stream`]), copied to the host, and freed
//!   before the next unit. The extra device memory is therefore at most the largest unit
//!   (`max ψᵢ`, as one forward unshard). With `rank0_only = false` every rank ends up with a host
//!   copy of the whole model (`Ψ`). With `rank0_only = true` only the *primary* rank (rank 0 of
//!   the shard group and of the replicate group: global rank 0 on a mesh, rank 0 otherwise) keeps
//!   host copies; the other ranks still take part in every all-gather (there is no gather-to-one
//!   collective, so each of them also holds one unit's gathered buffer at a time) but never copy
//!   it to the host.
//! - [`load_full_state_dict`] needs the whole dict on every rank (the caller holds it), builds this
//!   rank's chunks on the host (`Ψ / F` in total, so that a dict that fails validation changes
//!   nothing) and copies them into the shards. [`load_full`] reads the whole file on every rank
//!   (host `Ψ` per rank while loading); use the sharded form when that is too much.
//! - Sharded and local dicts hold `Ψ / F` per rank. [`load_sharded`] reads only the files of the
//!   saving ranks whose pieces overlap this rank's chunks (about `W_saved / W_loading + 1` files).
//!
//! # On disk
//! Files are [safetensors](https://github.com/huggingface/safetensors): an 8-byte header length,
//! a JSON header (dtype, shape and byte range of each tensor, plus a string-to-string
//! `__metadata__` map), then little-endian data. Every file's metadata carries
//! `format = "fsdp-rs"`, `format_version` (= [`FORMAT_VERSION`]), `kind` (`full-params`,
//! `full-optim`, `sharded-params`, `sharded-optim`, each with `-pieces` / `-meta` variants for the
//! sharded index files) and `world_size`.
//!
//! - **Full** (one file): one F32 tensor per parameter with its original name and shape; metadata
//!   `names` (the parameter order, one per line). Optimizer files name tensors `slot/param` and add
//!   `slots`, `names/<slot>` per slot, and `steps` (`name<TAB>count` per parameter).
//! - **Sharded** (one directory):
//!   - `metadata.safetensors` (no tensors; written by saving rank 0): `world_size`, `slots`,
//!     `steps` (optimizer), and per slot `params/<slot>`: every parameter's `name<TAB>d0,d1,…`;
//!   - `rank-RRRRR-of-WWWWW.safetensors` per saving rank: one 1-D F32 tensor per piece (named like
//!     the full form), and `pieces/<slot>`: `name<TAB>offset<TAB>len` per piece (the offset in the
//!     row-major flattened parameter);
//!   - `rank-RRRRR-of-WWWWW.pieces.safetensors`: the same piece list without the data, so a loading
//!     rank can decide which data files it needs by reading only these small files.
//!
//!   Stale files of another world size in the same directory are ignored (the metadata names the
//!   world size, and file names carry it).
//!
//! Parameter and slot names must not contain tabs or newlines; slot names must also be non-empty
//! and contain no `/` ([`StateDictError::InvalidName`]).
//!
//! # Errors
//! Every function returns [`StateDictError`]: validation errors name the offending entry (and
//! say what the model expected), file errors name the file; runtime errors (collectives, devices,
//! tensors) arrive wrapped as [`StateDictError::Fsdp`].
//!
//! # Collective or local
//! [`full_state_dict`] and [`full_optim_state_dict`] are collectives over the shard group (every
//! rank must call them, in the same order as its other collectives). Everything that only loads,
//! and the sharded and local forms, is rank-local. The `save_*` functions that write files end
//! with a one-element all-reduce over the shard and replicate groups, so that every rank returns
//! only after every file is written and every rank reports a failure of any writer
//! ([`StateDictError::PeerFailed`]).
//!
//! # Limitations
//! - Call these between training steps (after the optimizer step, not between a forward and its
//!   backward): they read and write the sharded parameters, not unsharded ones.
//! - Values are f32 (FSDP keeps f32 shards); files with other dtypes are refused.
//! - Loading validates names and shapes against the *current* wrapping, so the sharded form can
//!   change both the world size and the wrap policy, and the full form anything but the model; the
//!   local form needs the same world size, rank, units, names and shapes.
//! - A rank that fails validation *before* a collective (e.g. an optimizer slot tensor of the
//!   wrong size on one rank) leaves its peers waiting in that collective until the process group's
//!   timeout; validate inputs identically on every rank.
//! - Under CPU offload the shards live on the host device, and the full state dict's all-gathers
//!   run there, between host buffers (what the thread backend does; a backend that can only
//!   gather device memory would need a copy first).
//! - With `HybridShard`, sharded files are written once per shard (by replicate-group rank 0); the
//!   recorded world size is the shard-group size.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use fsdp_alloc::{AllocError, DType, Device, Stream};
use fsdp_autograd::nn::{named_parameters, Module};
use fsdp_autograd::{no_grad, with_stream, AutogradError, Tensor};
use fsdp_collectives::{CollectiveError, ProcessGroup, ReduceOp};
use fsdp_flatparam::LayoutError;
use safetensors::tensor::{Dtype as StDtype, SafeTensorError, SafeTensors, View};

use crate::error::FsdpError;
use crate::fsdp::{gather_flat, tensor_slice, Fsdp, UnitShard};

/// Version of the on-disk format written by this module (the `format_version` metadata key).
/// Files of another version are refused with [`StateDictError::UnsupportedVersion`].
pub const FORMAT_VERSION: u32 = 1;

const FORMAT: &str = "fsdp-rs";
const KIND_FULL_PARAMS: &str = "full-params";
const KIND_FULL_OPTIM: &str = "full-optim";
const KIND_SHARDED_PARAMS: &str = "sharded-params";
const KIND_SHARDED_OPTIM: &str = "sharded-optim";
const META_FILE: &str = "metadata.safetensors";

// ------------------------------------------------------------------------------------- errors

/// Everything that can go wrong saving or loading a state dict.
///
/// Validation errors name the offending entry; file errors name the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StateDictError {
    /// The model has an entry the state dict lacks.
    #[error(
        "state dict: missing {what} `{name}` (the wrapped model has it, the state dict does not); \
         load a state dict saved from the same model"
    )]
    MissingEntry {
        /// What kind of entry ("parameter", "optimizer state of slot `m`", …).
        what: String,
        /// Its name.
        name: String,
    },
    /// The state dict has an entry the model lacks.
    #[error(
        "state dict: unexpected {what} `{name}` (the wrapped model has no parameter of that name); \
         load a state dict saved from the same model"
    )]
    UnexpectedEntry {
        /// What kind of entry.
        what: String,
        /// Its name.
        name: String,
    },
    /// The same entry appears twice.
    #[error("state dict: {what} `{name}` appears more than once")]
    DuplicateEntry {
        /// What kind of entry.
        what: String,
        /// Its name.
        name: String,
    },
    /// An entry's shape differs from the model's.
    #[error(
        "state dict: {what} `{name}` has shape {got:?} in the state dict but {expected:?} in the \
         wrapped model"
    )]
    ShapeMismatch {
        /// What kind of entry.
        what: String,
        /// Its name.
        name: String,
        /// The model's shape.
        expected: Vec<usize>,
        /// The state dict's shape.
        got: Vec<usize>,
    },
    /// An entry has a different number of values than its shape needs.
    #[error(
        "state dict: {what} `{name}` of shape {shape:?} needs {expected} values, it has {got}"
    )]
    ValueCount {
        /// What kind of entry.
        what: String,
        /// Its name.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
        /// Values the shape needs (for a piece: its length).
        expected: usize,
        /// Values present.
        got: usize,
    },
    /// A sharded piece reaches past the end of its parameter.
    #[error(
        "sharded state dict: the piece of `{name}` saved by rank {rank} covers elements \
         {offset}..{} but the parameter has {numel}",
        offset + len
    )]
    PieceOutOfRange {
        /// Parameter name.
        name: String,
        /// Saving rank.
        rank: usize,
        /// Offset of the piece in the flattened parameter.
        offset: usize,
        /// Its length.
        len: usize,
        /// The parameter's element count.
        numel: usize,
    },
    /// No saved piece covers some elements this rank needs.
    #[error(
        "sharded state dict: elements {}..{} of `{name}` (needed by rank {rank}) are in no saved \
         piece; pass the pieces of every saving rank (ShardedStateDict::merge) or the complete \
         checkpoint directory",
        missing.start, missing.end
    )]
    IncompleteShards {
        /// Parameter name.
        name: String,
        /// The loading rank.
        rank: usize,
        /// The first uncovered range of elements (in the flattened parameter).
        missing: Range<usize>,
    },
    /// Sharded state dicts of different checkpoints were combined.
    #[error("sharded state dict: cannot combine dicts: {detail}")]
    Incompatible {
        /// What differs.
        detail: String,
    },
    /// A local state dict loaded at another world size (sharding factor).
    #[error(
        "local state dict saved with {saved} shards cannot be loaded with {current}; local state \
         dicts need the same world size and wrapping — save a full or sharded state dict to change \
         the world size"
    )]
    WorldSizeMismatch {
        /// Shards when saved.
        saved: usize,
        /// Shards now.
        current: usize,
    },
    /// A local state dict loaded on another rank.
    #[error("local state dict of rank {saved} loaded on rank {current}; each rank loads its own")]
    RankMismatch {
        /// The rank that saved it.
        saved: usize,
        /// This rank.
        current: usize,
    },
    /// A local state dict whose units differ from the current wrapping.
    #[error("local state dict: {detail}; local state dicts need the same model and wrap policy")]
    LayoutMismatch {
        /// What differs (unit, path, names, shapes or sizes).
        detail: String,
    },
    /// An optimizer-state tensor that does not fit its unit.
    #[error("optimizer state: slot `{slot}`, unit {unit}: {detail}")]
    BadStateTensor {
        /// The slot.
        slot: String,
        /// The unit index.
        unit: usize,
        /// What is wrong (dtype, element count, device).
        detail: String,
    },
    /// Optimizer step counts that do not fit the model.
    #[error("optimizer step counts: {detail}")]
    Steps {
        /// What is wrong.
        detail: String,
    },
    /// A name that cannot be stored.
    #[error("state dict: {what} name `{name}` {reason}")]
    InvalidName {
        /// Parameter or slot.
        what: &'static str,
        /// The name.
        name: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// A file-system operation failed.
    #[error("state dict: {op} `{}`: {source}", path.display())]
    Io {
        /// What was being done ("create directory", "read", …).
        op: &'static str,
        /// The path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The safetensors library refused a file or a buffer.
    #[error("state dict: safetensors {op} `{}`: {source}", path.display())]
    SafeTensors {
        /// "read" or "write".
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The library's error.
        #[source]
        source: SafeTensorError,
    },
    /// A file that is valid safetensors but not what this module wrote.
    #[error("state dict: `{}` is not a valid fsdp-rs checkpoint file: {detail}", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// A file of another format version.
    #[error(
        "state dict: `{}` has format version {found}, this build reads version {supported}",
        path.display()
    )]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// Its version.
        found: String,
        /// [`FORMAT_VERSION`].
        supported: u32,
    },
    /// Another rank failed during a collective save.
    #[error("state dict: {op}: another rank failed to write its part; see that rank's error")]
    PeerFailed {
        /// The operation.
        op: &'static str,
    },
    /// A runtime error (collective, device, tensor, layout).
    #[error(transparent)]
    Fsdp(Box<FsdpError>),
}

impl From<FsdpError> for StateDictError {
    fn from(e: FsdpError) -> Self {
        StateDictError::Fsdp(Box::new(e))
    }
}

impl From<AllocError> for StateDictError {
    fn from(e: AllocError) -> Self {
        FsdpError::from(e).into()
    }
}

impl From<AutogradError> for StateDictError {
    fn from(e: AutogradError) -> Self {
        FsdpError::from(e).into()
    }
}

impl From<CollectiveError> for StateDictError {
    fn from(e: CollectiveError) -> Self {
        FsdpError::from(e).into()
    }
}

impl From<LayoutError> for StateDictError {
    fn from(e: LayoutError) -> Self {
        FsdpError::from(e).into()
    }
}

/// Shorthand for results of this module.
pub type Result<T, E = StateDictError> = std::result::Result<T, E>;

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
/// and, within a unit, in layout order (the order of [`Fsdp::full_parameters`]).
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

    /// Copies the entries into a plain (unwrapped) model's parameters, on the current stream,
    /// validating first (every parameter present with its shape, no unknown or duplicate
    /// entries), so that an invalid dict changes nothing.
    ///
    /// # Errors
    /// [`StateDictError::MissingEntry`], [`StateDictError::UnexpectedEntry`],
    /// [`StateDictError::DuplicateEntry`], [`StateDictError::ShapeMismatch`],
    /// [`StateDictError::ValueCount`], or tensor errors.
    pub fn load_into_module(&self, model: &dyn Module) -> Result<()> {
        let lookup = index_entries(&self.entries, "parameter")?;
        let params = named_parameters(model);
        let mut used = HashSet::new();
        let mut plan = Vec::with_capacity(params.len());
        for (name, p) in &params {
            let e = lookup
                .get(name.as_str())
                .ok_or_else(|| missing("parameter", name))?;
            check_shape("parameter", name, p.shape(), &e.shape)?;
            used.insert(name.as_str());
            plan.push((p.get()?, e));
        }
        check_unused(&self.entries, &used, "parameter")?;
        for (t, e) in plan {
            let src = Tensor::from_slice(&e.values, &e.shape, t.device())?;
            no_grad(|| t.copy_(&src))?;
        }
        Ok(())
    }

    /// Writes the dict to a safetensors file at `path` (parent directories are created; the
    /// file is written to a temporary sibling and renamed, so readers never see half a file).
    ///
    /// # Errors
    /// [`StateDictError::InvalidName`], [`StateDictError::DuplicateEntry`],
    /// [`StateDictError::ValueCount`], I/O and safetensors errors.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        write_full_file(
            path.as_ref(),
            KIND_FULL_PARAMS,
            self.world_size,
            None,
            &[("", &self.entries)],
        )
    }

    /// Reads a dict written by [`FullStateDict::save`] (or [`save_full`]).
    ///
    /// # Errors
    /// I/O, safetensors, [`StateDictError::Format`] and [`StateDictError::UnsupportedVersion`].
    pub fn load(path: impl AsRef<Path>) -> Result<FullStateDict> {
        let f = read_full_file(path.as_ref(), KIND_FULL_PARAMS)?;
        let entries = f
            .slots
            .into_iter()
            .next()
            .map(|(_, e)| e)
            .unwrap_or_default();
        Ok(FullStateDict {
            world_size: f.world_size,
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
/// built by [`sharded_state_dict`]; several, after [`ShardedStateDict::merge`] or
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

    /// Writes one data file (and its piece index) per rank in [`ranks`](Self::ranks) into
    /// `dir`, and `metadata.safetensors` if the dict holds rank 0 (see the module docs for the
    /// layout). Rank-local: in a run, every saving rank calls it with its own dict.
    ///
    /// # Errors
    /// [`StateDictError::InvalidName`], [`StateDictError::PieceOutOfRange`], I/O and safetensors
    /// errors.
    pub fn save(&self, dir: impl AsRef<Path>) -> Result<()> {
        write_sharded_dir(
            dir.as_ref(),
            KIND_SHARDED_PARAMS,
            None,
            &[("", self)],
            &self.ranks,
        )
    }

    /// Reads a whole sharded checkpoint directory (every saving rank's pieces). To load into a
    /// wrapped model, [`load_sharded`] reads only the files a rank needs.
    ///
    /// # Errors
    /// I/O, safetensors, [`StateDictError::Format`] and [`StateDictError::UnsupportedVersion`].
    pub fn load_dir(dir: impl AsRef<Path>) -> Result<ShardedStateDict> {
        let dir = dir.as_ref();
        let meta = read_sharded_meta(dir, KIND_SHARDED_PARAMS)?;
        let ranks: Vec<usize> = (0..meta.world_size).collect();
        let mut slots = read_sharded_ranks(dir, KIND_SHARDED_PARAMS, &meta, &ranks)?;
        Ok(slots.remove(0).1)
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

impl FullOptimStateDict {
    /// Writes it to a safetensors file (tensors named `slot/param`).
    ///
    /// # Errors
    /// As [`FullStateDict::save`].
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let slots: Vec<(&str, &[TensorEntry])> = self
            .slots
            .iter()
            .map(|(s, e)| (s.as_str(), e.as_slice()))
            .collect();
        for (s, _) in &slots {
            check_slot_name(s)?;
        }
        write_full_file(
            path.as_ref(),
            KIND_FULL_OPTIM,
            self.world_size,
            Some(&self.steps),
            &slots,
        )
    }

    /// Reads a file written by [`FullOptimStateDict::save`] (or [`save_full_optim`]).
    ///
    /// # Errors
    /// As [`FullStateDict::load`].
    pub fn load(path: impl AsRef<Path>) -> Result<FullOptimStateDict> {
        let f = read_full_file(path.as_ref(), KIND_FULL_OPTIM)?;
        Ok(FullOptimStateDict {
            world_size: f.world_size,
            steps: f.steps.unwrap_or_default(),
            slots: f.slots,
        })
    }
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

    /// Writes this rank's (or these ranks') files into `dir` (see [`ShardedStateDict::save`]).
    ///
    /// # Errors
    /// As [`ShardedStateDict::save`], and [`StateDictError::Incompatible`] if the slots disagree
    /// on world size or ranks.
    pub fn save(&self, dir: impl AsRef<Path>) -> Result<()> {
        let slots: Vec<(&str, &ShardedStateDict)> =
            self.slots.iter().map(|(s, d)| (s.as_str(), d)).collect();
        let ranks = optim_ranks(&self.slots)?;
        write_sharded_dir(
            dir.as_ref(),
            KIND_SHARDED_OPTIM,
            Some(&self.steps),
            &slots,
            &ranks,
        )
    }

    /// Reads a whole sharded optimizer checkpoint directory.
    ///
    /// # Errors
    /// As [`ShardedStateDict::load_dir`].
    pub fn load_dir(dir: impl AsRef<Path>) -> Result<ShardedOptimStateDict> {
        let dir = dir.as_ref();
        let meta = read_sharded_meta(dir, KIND_SHARDED_OPTIM)?;
        let ranks: Vec<usize> = (0..meta.world_size).collect();
        let slots = read_sharded_ranks(dir, KIND_SHARDED_OPTIM, &meta, &ranks)?;
        Ok(ShardedOptimStateDict {
            steps: meta.steps.unwrap_or_default(),
            slots,
        })
    }
}

// ------------------------------------------------------------------- the wrapped model's view

/// What the state-dict functions need from a wrapped model.
struct Ctx {
    shards: Vec<UnitShard>,
    device: Device,
    /// Where the shards live and are read and written: the shard device's optimizer stream
    /// (the compute stream, or the host stream under CPU offload).
    stream: Stream,
    group: Arc<dyn ProcessGroup>,
    replicate: Option<Arc<dyn ProcessGroup>>,
    /// The sharding factor (1 for NoShard or no units).
    factor: usize,
    /// This rank's chunk index.
    rank: usize,
}

impl Ctx {
    fn of<M: Module + 'static>(fsdp: &Fsdp<M>) -> Ctx {
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
    fn is_primary(&self) -> bool {
        self.group.rank() == 0 && self.replicate.as_ref().is_none_or(|g| g.rank() == 0)
    }

    /// Writes sharded files: one rank per distinct shard (replicate rank 0; for an unsharded
    /// model, only the primary rank).
    fn is_shard_writer(&self) -> bool {
        (self.factor > 1 || self.group.rank() == 0)
            && self.replicate.as_ref().is_none_or(|g| g.rank() == 0)
    }

    fn read(&self, t: &Tensor) -> Result<Vec<f32>> {
        Ok(with_stream(&self.stream, || t.to_vec::<f32>())?)
    }

    fn new_tensor(&self, values: Vec<f32>) -> Result<Tensor> {
        let n = values.len();
        Ok(with_stream(&self.stream, || {
            Tensor::from_vec(values, &[n], &self.device)
        })?)
    }

    fn write(&self, t: &Tensor, values: Vec<f32>) -> Result<()> {
        let src = self.new_tensor(values)?;
        with_stream(&self.stream, || no_grad(|| t.copy_(&src)))?;
        Ok(())
    }

    /// Gathers unit `u`'s flat tensor `t` (a chunk in the unit's layout); the padded flat
    /// values on ranks that `keep`, `None` elsewhere. A collective when the unit is sharded.
    fn gather(&self, u: usize, t: &Tensor, keep: bool) -> Result<Option<Vec<f32>>> {
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
    fn any_failed(&self, failed: bool) -> Result<bool> {
        let flag = self.new_tensor(vec![if failed { 1.0 } else { 0.0 }])?;
        self.group
            .all_reduce(&tensor_slice(&flag)?, ReduceOp::Max, &self.stream)
            .wait()?;
        if let Some(rep) = &self.replicate {
            rep.all_reduce(&tensor_slice(&flag)?, ReduceOp::Max, &self.stream)
                .wait()?;
        }
        Ok(self.read(&flag)?[0] > 0.0)
    }

    /// Checks per-unit optimizer tensors and returns contiguous handles to them.
    fn check_slot(&self, slot: &str, tensors: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
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

fn missing(what: &str, name: &str) -> StateDictError {
    StateDictError::MissingEntry {
        what: what.into(),
        name: name.into(),
    }
}

fn check_shape(what: &str, name: &str, expected: &[usize], got: &[usize]) -> Result<()> {
    if expected != got {
        return Err(StateDictError::ShapeMismatch {
            what: what.into(),
            name: name.into(),
            expected: expected.to_vec(),
            got: got.to_vec(),
        });
    }
    Ok(())
}

/// Indexes entries by name, checking duplicates and value counts.
fn index_entries<'a>(
    entries: &'a [TensorEntry],
    what: &str,
) -> Result<HashMap<&'a str, &'a TensorEntry>> {
    let mut map = HashMap::with_capacity(entries.len());
    for e in entries {
        let n: usize = e.shape.iter().product();
        if e.values.len() != n {
            return Err(StateDictError::ValueCount {
                what: what.into(),
                name: e.name.clone(),
                shape: e.shape.clone(),
                expected: n,
                got: e.values.len(),
            });
        }
        if map.insert(e.name.as_str(), e).is_some() {
            return Err(StateDictError::DuplicateEntry {
                what: what.into(),
                name: e.name.clone(),
            });
        }
    }
    Ok(map)
}

fn check_unused(entries: &[TensorEntry], used: &HashSet<&str>, what: &str) -> Result<()> {
    match entries.iter().find(|e| !used.contains(e.name.as_str())) {
        Some(e) => Err(StateDictError::UnexpectedEntry {
            what: what.into(),
            name: e.name.clone(),
        }),
        None => Ok(()),
    }
}

/// Which units a set of names covers: per unit `true` (all of its parameters), `false` (none);
/// partially covered units are an error naming the first missing parameter. With `require`,
/// every unit must be covered.
fn covered_units(
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

fn all_names(ctx: &Ctx) -> HashSet<&str> {
    ctx.shards
        .iter()
        .flat_map(|s| s.names.iter().map(|n| n.as_str()))
        .collect()
}

// ------------------------------------------------------------------------- full: generic core

/// Full entries of per-unit tensors in the units' layouts (collective for sharded units).
fn gather_entries(ctx: &Ctx, tensors: &[Option<Tensor>], keep: bool) -> Result<Vec<TensorEntry>> {
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
fn chunks_from_entries(
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

fn write_shards<M: Module + 'static>(
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

fn finish_collective_save(ctx: &Ctx, local: Result<()>, op: &'static str) -> Result<()> {
    let any = ctx.any_failed(local.is_err())?;
    local?;
    if any {
        return Err(StateDictError::PeerFailed { op });
    }
    Ok(())
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
fn shard_pieces(ctx: &Ctx, tensors: &[Option<Tensor>]) -> Result<ShardedStateDict> {
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
fn chunks_from_pieces(
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
fn fill_range(
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

/// Writes this rank's sharded state dict into `dir` (one data file per distinct shard; rank 0
/// also writes `metadata.safetensors`). The state dict needs no communication; the function
/// ends with a one-element all-reduce so every rank returns after every file is written.
///
/// # Errors
/// As [`ShardedStateDict::save`]; [`StateDictError::PeerFailed`] if another rank's write failed.
pub fn save_sharded<M: Module + 'static>(fsdp: &Fsdp<M>, dir: impl AsRef<Path>) -> Result<()> {
    let ctx = Ctx::of(fsdp);
    let local = if ctx.is_shard_writer() {
        sharded_state_dict(fsdp).and_then(|d| d.save(dir))
    } else {
        Ok(())
    };
    finish_collective_save(&ctx, local, "save_sharded")
}

/// Loads a sharded checkpoint directory written at any world size: reads the metadata and the
/// small piece indexes, then only the data files whose pieces overlap this rank's chunks. No
/// communication.
///
/// # Errors
/// As [`ShardedStateDict::load_dir`] and [`load_sharded_state_dict`].
pub fn load_sharded<M: Module + 'static>(fsdp: &Fsdp<M>, dir: impl AsRef<Path>) -> Result<()> {
    let ctx = Ctx::of(fsdp);
    let dir = dir.as_ref();
    let meta = read_sharded_meta(dir, KIND_SHARDED_PARAMS)?;
    let ranks = ranks_needed(&ctx, dir, KIND_SHARDED_PARAMS, &meta)?;
    let mut slots = read_sharded_ranks(dir, KIND_SHARDED_PARAMS, &meta, &ranks)?;
    let dict = slots.remove(0).1;
    let chunks = chunks_from_pieces(&ctx, &dict, "parameter", true)?;
    write_shards(fsdp, &ctx, chunks)
}

/// The saving ranks whose pieces overlap what this rank needs.
fn ranks_needed(ctx: &Ctx, dir: &Path, kind: &str, meta: &ShardedMeta) -> Result<Vec<usize>> {
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

// ------------------------------------------------------------------------------- optimizer

fn check_slot_name(s: &str) -> Result<()> {
    let reason = if s.is_empty() {
        Some("is empty")
    } else if s.contains('/') {
        Some("contains `/` (it separates slot and parameter in file keys)")
    } else if s.contains(['\t', '\n']) {
        Some("contains a tab or newline")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(StateDictError::InvalidName {
            what: "optimizer slot",
            name: s.into(),
            reason,
        }),
        None => Ok(()),
    }
}

fn check_slots<'a>(names: impl Iterator<Item = &'a str>) -> Result<()> {
    let mut seen = HashSet::new();
    for s in names {
        check_slot_name(s)?;
        if !seen.insert(s) {
            return Err(StateDictError::DuplicateEntry {
                what: "optimizer slot".into(),
                name: s.into(),
            });
        }
    }
    Ok(())
}

fn slot_what(slot: &str) -> String {
    format!("optimizer state (slot `{slot}`) of parameter")
}

/// Gathers an optimizer's state into full tensors with the parameters' names and shapes, per
/// slot. A **collective** like [`full_state_dict`] (one all-gather per unit and slot with state);
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
fn param_steps(ctx: &Ctx, steps: &[u64]) -> Result<Vec<(String, u64)>> {
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
fn unit_steps(ctx: &Ctx, steps: &[(String, u64)]) -> Result<Vec<u64>> {
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

fn to_optim_state<T>(
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
/// As [`load_sharded_state_dict`], per slot.
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
/// A **collective**, like [`save_full`].
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

/// Writes this rank's sharded optimizer state into `dir` (like [`save_sharded`]; a separate
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
    let local = if ctx.is_shard_writer() {
        sharded_optim_state_dict(fsdp, state).and_then(|d| d.save(dir))
    } else {
        Ok(())
    };
    finish_collective_save(&ctx, local, "save_sharded_optim")
}

/// Reads what this rank needs of a sharded optimizer checkpoint (saved at any world size) and
/// returns its per-unit shard tensors. No communication.
///
/// # Errors
/// As [`ShardedOptimStateDict::load_dir`] and [`load_sharded_optim_state_dict`].
pub fn load_sharded_optim<M: Module + 'static>(
    fsdp: &Fsdp<M>,
    dir: impl AsRef<Path>,
) -> Result<OptimState> {
    let ctx = Ctx::of(fsdp);
    let dir = dir.as_ref();
    let meta = read_sharded_meta(dir, KIND_SHARDED_OPTIM)?;
    let ranks = ranks_needed(&ctx, dir, KIND_SHARDED_OPTIM, &meta)?;
    let slots = read_sharded_ranks(dir, KIND_SHARDED_OPTIM, &meta, &ranks)?;
    let dict = ShardedOptimStateDict {
        steps: meta.steps.unwrap_or_default(),
        slots,
    };
    load_sharded_optim_state_dict(fsdp, &dict)
}

fn optim_ranks(slots: &[(String, ShardedStateDict)]) -> Result<Vec<usize>> {
    let mut ranks: Option<&Vec<usize>> = None;
    let mut world: Option<usize> = None;
    for (s, d) in slots {
        if ranks.is_some_and(|r| *r != d.ranks) || world.is_some_and(|w| w != d.world_size) {
            return Err(StateDictError::Incompatible {
                detail: format!("slot `{s}` has other ranks or another world size"),
            });
        }
        ranks = Some(&d.ranks);
        world = Some(d.world_size);
    }
    Ok(ranks.cloned().unwrap_or_default())
}

// ------------------------------------------------------------------------------- files

/// An f32 slice as a safetensors tensor view (little-endian bytes made on demand).
struct F32View<'a> {
    shape: Vec<usize>,
    values: &'a [f32],
}

impl View for F32View<'_> {
    fn dtype(&self) -> StDtype {
        StDtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Owned(self.values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }

    fn data_len(&self) -> usize {
        self.values.len() * 4
    }
}

fn key(slot: &str, name: &str) -> String {
    if slot.is_empty() {
        name.to_string()
    } else {
        format!("{slot}/{name}")
    }
}

fn check_param_name(name: &str) -> Result<()> {
    let reason = if name.is_empty() {
        Some("is empty")
    } else if name.contains(['\t', '\n']) {
        Some("contains a tab or newline")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(StateDictError::InvalidName {
            what: "parameter",
            name: name.into(),
            reason,
        }),
        None => Ok(()),
    }
}

fn encode_shape(shape: &[usize]) -> String {
    shape
        .iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

type ParamSteps = [(String, u64)];

fn base_meta(kind: &str, world_size: usize, steps: Option<&ParamSteps>) -> HashMap<String, String> {
    let mut m = HashMap::new();
    m.insert("format".into(), FORMAT.into());
    m.insert("format_version".into(), FORMAT_VERSION.to_string());
    m.insert("kind".into(), kind.into());
    m.insert("world_size".into(), world_size.to_string());
    if let Some(steps) = steps {
        let lines: Vec<String> = steps.iter().map(|(n, k)| format!("{n}\t{k}")).collect();
        m.insert("steps".into(), lines.join("\n"));
    }
    m
}

fn create_parent(path: &Path) -> Result<()> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|source| StateDictError::Io {
            op: "create directory",
            path: parent.to_path_buf(),
            source,
        })?;
    }
    Ok(())
}

fn write_file(
    path: &Path,
    tensors: Vec<(String, F32View<'_>)>,
    meta: HashMap<String, String>,
) -> Result<()> {
    create_parent(path)?;
    safetensors::serialize_to_file(tensors, Some(meta), path).map_err(|source| {
        StateDictError::SafeTensors {
            op: "write",
            path: path.to_path_buf(),
            source,
        }
    })
}

fn write_full_file(
    path: &Path,
    kind: &str,
    world_size: usize,
    steps: Option<&ParamSteps>,
    slots: &[(&str, &[TensorEntry])],
) -> Result<()> {
    if let Some(steps) = steps {
        for (n, _) in steps {
            check_param_name(n)?;
        }
    }
    let mut meta = base_meta(kind, world_size, steps);
    let mut tensors = Vec::new();
    if steps.is_some() {
        meta.insert(
            "slots".into(),
            slots.iter().map(|(s, _)| *s).collect::<Vec<_>>().join("\n"),
        );
    }
    for (slot, entries) in slots {
        index_entries(entries, "parameter")?;
        for e in entries.iter() {
            check_param_name(&e.name)?;
            tensors.push((
                key(slot, &e.name),
                F32View {
                    shape: e.shape.clone(),
                    values: &e.values,
                },
            ));
        }
        let names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
        meta.insert(names_key(slot), names.join("\n"));
    }
    write_file(path, tensors, meta)
}

fn names_key(slot: &str) -> String {
    if slot.is_empty() {
        "names".into()
    } else {
        format!("names/{slot}")
    }
}

fn read_bytes(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| StateDictError::Io {
        op: "read",
        path: path.to_path_buf(),
        source,
    })
}

fn format_err(path: &Path, detail: impl Into<String>) -> StateDictError {
    StateDictError::Format {
        path: path.to_path_buf(),
        detail: detail.into(),
    }
}

/// Parses a file's header, checks format, version and kind; returns the metadata and the raw
/// bytes (for tensor access).
fn read_file_meta(path: &Path, kind: &str) -> Result<(HashMap<String, String>, Vec<u8>)> {
    let bytes = read_bytes(path)?;
    let (_, header) =
        SafeTensors::read_metadata(&bytes).map_err(|source| StateDictError::SafeTensors {
            op: "read",
            path: path.to_path_buf(),
            source,
        })?;
    let meta = header
        .metadata()
        .clone()
        .ok_or_else(|| format_err(path, "no __metadata__ (not written by fsdp-rs)"))?;
    match meta.get("format") {
        Some(f) if f == FORMAT => {}
        other => {
            return Err(format_err(
                path,
                format!("metadata `format` is {other:?}, expected `{FORMAT}`"),
            ))
        }
    }
    match meta.get("format_version") {
        Some(v) if *v == FORMAT_VERSION.to_string() => {}
        other => {
            return Err(StateDictError::UnsupportedVersion {
                path: path.to_path_buf(),
                found: other.cloned().unwrap_or_else(|| "(none)".into()),
                supported: FORMAT_VERSION,
            })
        }
    }
    match meta.get("kind") {
        Some(k) if k == kind => {}
        other => {
            return Err(format_err(
                path,
                format!("metadata `kind` is {other:?}, expected `{kind}`"),
            ))
        }
    }
    Ok((meta, bytes))
}

fn meta_str<'a>(meta: &'a HashMap<String, String>, k: &str, path: &Path) -> Result<&'a str> {
    meta.get(k)
        .map(|s| s.as_str())
        .ok_or_else(|| format_err(path, format!("metadata key `{k}` is missing")))
}

fn meta_num<T: std::str::FromStr>(
    meta: &HashMap<String, String>,
    k: &str,
    path: &Path,
) -> Result<T> {
    let s = meta_str(meta, k, path)?;
    s.parse()
        .map_err(|_| format_err(path, format!("metadata `{k}` = `{s}` is not a number")))
}

fn parse_steps(meta: &HashMap<String, String>, path: &Path) -> Result<Vec<(String, u64)>> {
    lines(meta_str(meta, "steps", path)?)
        .map(|line| {
            let bad = || format_err(path, format!("bad step-count line `{line}`"));
            let (name, n) = line.split_once('\t').ok_or_else(bad)?;
            Ok((name.to_string(), n.parse().map_err(|_| bad())?))
        })
        .collect()
}

fn lines(s: &str) -> impl Iterator<Item = &str> {
    s.split('\n').filter(|l| !l.is_empty())
}

fn parse_shape(s: &str, path: &Path) -> Result<Vec<usize>> {
    if s.is_empty() {
        return Ok(Vec::new());
    }
    s.split(',')
        .map(|d| {
            d.parse()
                .map_err(|_| format_err(path, format!("bad shape `{s}`")))
        })
        .collect()
}

fn parse_slots(meta: &HashMap<String, String>, path: &Path, optim: bool) -> Result<Vec<String>> {
    if !optim {
        return Ok(vec![String::new()]);
    }
    let slots: Vec<String> = lines(meta_str(meta, "slots", path)?)
        .map(String::from)
        .collect();
    check_slots(slots.iter().map(|s| s.as_str()))?;
    Ok(slots)
}

fn f32_values(
    view: &safetensors::tensor::TensorView<'_>,
    k: &str,
    path: &Path,
) -> Result<Vec<f32>> {
    if view.dtype() != StDtype::F32 {
        return Err(format_err(
            path,
            format!("tensor `{k}` is {:?}, expected F32", view.dtype()),
        ));
    }
    Ok(view
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

struct FullFile {
    world_size: usize,
    steps: Option<Vec<(String, u64)>>,
    slots: Vec<(String, Vec<TensorEntry>)>,
}

fn read_full_file(path: &Path, kind: &str) -> Result<FullFile> {
    let (meta, bytes) = read_file_meta(path, kind)?;
    let optim = kind == KIND_FULL_OPTIM;
    let st = SafeTensors::deserialize(&bytes).map_err(|source| StateDictError::SafeTensors {
        op: "read",
        path: path.to_path_buf(),
        source,
    })?;
    let world_size = meta_num(&meta, "world_size", path)?;
    let steps = if optim {
        Some(parse_steps(&meta, path)?)
    } else {
        None
    };
    let mut slots = Vec::new();
    let mut used = 0usize;
    for slot in parse_slots(&meta, path, optim)? {
        let mut entries = Vec::new();
        for name in lines(meta_str(&meta, &names_key(&slot), path)?) {
            let k = key(&slot, name);
            let view = st
                .tensor(&k)
                .map_err(|_| format_err(path, format!("tensor `{k}` listed but absent")))?;
            entries.push(TensorEntry {
                name: name.to_string(),
                shape: view.shape().to_vec(),
                values: f32_values(&view, &k, path)?,
            });
            used += 1;
        }
        slots.push((slot, entries));
    }
    if used != st.len() {
        return Err(format_err(
            path,
            format!("{} tensors, the metadata lists {used}", st.len()),
        ));
    }
    Ok(FullFile {
        world_size,
        steps,
        slots,
    })
}

/// Top-level metadata of a sharded checkpoint directory.
struct ShardedMeta {
    world_size: usize,
    steps: Option<Vec<(String, u64)>>,
    /// Per slot, the catalogue.
    slots: Vec<(String, Vec<ParamMeta>)>,
}

impl ShardedMeta {
    fn slot_names(&self) -> Vec<String> {
        self.slots.iter().map(|(s, _)| s.clone()).collect()
    }
}

fn rank_path(dir: &Path, rank: usize, world: usize, index: bool) -> PathBuf {
    let suffix = if index { ".pieces" } else { "" };
    dir.join(format!("rank-{rank:05}-of-{world:05}{suffix}.safetensors"))
}

fn pieces_key(slot: &str) -> String {
    format!("pieces/{slot}")
}

fn params_key(slot: &str) -> String {
    format!("params/{slot}")
}

fn write_sharded_dir(
    dir: &Path,
    kind: &str,
    steps: Option<&ParamSteps>,
    slots: &[(&str, &ShardedStateDict)],
    ranks: &[usize],
) -> Result<()> {
    let world = slots.first().map_or(0, |(_, d)| d.world_size);
    if let Some(steps) = steps {
        for (n, _) in steps {
            check_param_name(n)?;
        }
    }
    let mut base = base_meta(kind, world, None);
    base.insert(
        "slots".into(),
        slots.iter().map(|(s, _)| *s).collect::<Vec<_>>().join("\n"),
    );
    // Validate everything before writing anything.
    for (_, d) in slots {
        let catalogue: HashMap<&str, &ParamMeta> =
            d.params.iter().map(|p| (p.name.as_str(), p)).collect();
        for p in &d.params {
            check_param_name(&p.name)?;
        }
        for p in &d.pieces {
            let meta =
                catalogue
                    .get(p.name.as_str())
                    .ok_or_else(|| StateDictError::UnexpectedEntry {
                        what: "piece of parameter".into(),
                        name: p.name.clone(),
                    })?;
            check_shape("piece of parameter", &p.name, &meta.shape, &p.shape)?;
            if !ranks.contains(&p.rank) {
                return Err(StateDictError::Incompatible {
                    detail: format!(
                        "a piece of `{}` is from rank {}, which is not among the dict's ranks \
                         {ranks:?}",
                        p.name, p.rank
                    ),
                });
            }
            if p.offset + p.values.len() > meta.numel() {
                return Err(StateDictError::PieceOutOfRange {
                    name: p.name.clone(),
                    rank: p.rank,
                    offset: p.offset,
                    len: p.values.len(),
                    numel: meta.numel(),
                });
            }
        }
    }
    for &r in ranks {
        let mut meta = base.clone();
        meta.insert("rank".into(), r.to_string());
        let mut tensors = Vec::new();
        let mut seen = HashSet::new();
        for (slot, d) in slots {
            let mut table = String::new();
            for p in d.pieces.iter().filter(|p| p.rank == r) {
                let k = key(slot, &p.name);
                if !seen.insert(k.clone()) {
                    return Err(StateDictError::DuplicateEntry {
                        what: format!("piece (rank {r}) of parameter"),
                        name: p.name.clone(),
                    });
                }
                table.push_str(&format!("{}\t{}\t{}\n", p.name, p.offset, p.values.len()));
                tensors.push((
                    k,
                    F32View {
                        shape: vec![p.values.len()],
                        values: &p.values,
                    },
                ));
            }
            meta.insert(pieces_key(slot), table);
        }
        write_file(&rank_path(dir, r, world, false), tensors, meta.clone())?;
        meta.insert("kind".into(), format!("{kind}-pieces"));
        write_file(&rank_path(dir, r, world, true), Vec::new(), meta)?;
    }
    if ranks.contains(&0) {
        let mut meta = base_meta(kind, world, steps);
        meta.extend(base);
        meta.insert("kind".into(), format!("{kind}-meta"));
        for (slot, d) in slots {
            let cat: Vec<String> = d
                .params
                .iter()
                .map(|p| format!("{}\t{}", p.name, encode_shape(&p.shape)))
                .collect();
            meta.insert(params_key(slot), cat.join("\n"));
        }
        write_file(&dir.join(META_FILE), Vec::new(), meta)?;
    }
    Ok(())
}

fn read_sharded_meta(dir: &Path, kind: &str) -> Result<ShardedMeta> {
    let path = dir.join(META_FILE);
    let (meta, _) = read_file_meta(&path, &format!("{kind}-meta"))?;
    let optim = kind == KIND_SHARDED_OPTIM;
    let world_size = meta_num(&meta, "world_size", &path)?;
    let steps = if optim {
        Some(parse_steps(&meta, &path)?)
    } else {
        None
    };
    let mut slots = Vec::new();
    for slot in parse_slots(&meta, &path, optim)? {
        let mut cat = Vec::new();
        for line in lines(meta_str(&meta, &params_key(&slot), &path)?) {
            let (name, shape) = line
                .split_once('\t')
                .ok_or_else(|| format_err(&path, format!("bad catalogue line `{line}`")))?;
            cat.push(ParamMeta {
                name: name.into(),
                shape: parse_shape(shape, &path)?,
            });
        }
        slots.push((slot, cat));
    }
    Ok(ShardedMeta {
        world_size,
        steps,
        slots,
    })
}

type PieceTable = Vec<(String, Vec<(String, usize, usize)>)>;

/// Per slot, the `(name, offset, len)` piece list of a rank file's metadata.
fn parse_pieces(
    meta: &HashMap<String, String>,
    path: &Path,
    slots: &[String],
) -> Result<PieceTable> {
    let mut out = Vec::with_capacity(slots.len());
    for slot in slots {
        let mut pieces = Vec::new();
        for line in lines(meta_str(meta, &pieces_key(slot), path)?) {
            let mut it = line.split('\t');
            let (Some(name), Some(off), Some(len), None) =
                (it.next(), it.next(), it.next(), it.next())
            else {
                return Err(format_err(path, format!("bad piece line `{line}`")));
            };
            let num = |s: &str| {
                s.parse::<usize>()
                    .map_err(|_| format_err(path, format!("bad piece line `{line}`")))
            };
            pieces.push((name.to_string(), num(off)?, num(len)?));
        }
        out.push((slot.clone(), pieces));
    }
    Ok(out)
}

/// Reads the data files of `ranks`; per slot, a dict of their pieces with the catalogue.
fn read_sharded_ranks(
    dir: &Path,
    kind: &str,
    meta: &ShardedMeta,
    ranks: &[usize],
) -> Result<Vec<(String, ShardedStateDict)>> {
    let mut slots: Vec<(String, ShardedStateDict)> = meta
        .slots
        .iter()
        .map(|(s, cat)| {
            (
                s.clone(),
                ShardedStateDict {
                    world_size: meta.world_size,
                    ranks: ranks.to_vec(),
                    params: cat.clone(),
                    pieces: Vec::new(),
                },
            )
        })
        .collect();
    for &r in ranks {
        let path = rank_path(dir, r, meta.world_size, false);
        let (m, bytes) = read_file_meta(&path, kind)?;
        let file_rank: usize = meta_num(&m, "rank", &path)?;
        if file_rank != r {
            return Err(format_err(&path, format!("metadata says rank {file_rank}")));
        }
        let st =
            SafeTensors::deserialize(&bytes).map_err(|source| StateDictError::SafeTensors {
                op: "read",
                path: path.clone(),
                source,
            })?;
        let table = parse_pieces(&m, &path, &meta.slot_names())?;
        for ((_, pieces), (slot, dict)) in table.into_iter().zip(slots.iter_mut()) {
            let shapes: HashMap<&str, &[usize]> = dict
                .params
                .iter()
                .map(|p| (p.name.as_str(), p.shape.as_slice()))
                .collect();
            let mut new = Vec::with_capacity(pieces.len());
            for (name, offset, len) in pieces {
                let k = key(slot, &name);
                let view = st
                    .tensor(&k)
                    .map_err(|_| format_err(&path, format!("tensor `{k}` listed but absent")))?;
                let values = f32_values(&view, &k, &path)?;
                if values.len() != len {
                    return Err(format_err(
                        &path,
                        format!("tensor `{k}` has {} values, listed as {len}", values.len()),
                    ));
                }
                let shape = shapes
                    .get(name.as_str())
                    .ok_or_else(|| StateDictError::UnexpectedEntry {
                        what: "piece of parameter".into(),
                        name: name.clone(),
                    })?
                    .to_vec();
                new.push(ShardPiece {
                    rank: r,
                    name,
                    shape,
                    offset,
                    values,
                });
            }
            dict.pieces.extend(new);
        }
    }
    Ok(slots)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(rank: usize, offset: usize, values: Vec<f32>) -> ShardPiece {
        ShardPiece {
            rank,
            name: "w".into(),
            shape: vec![10],
            offset,
            values,
        }
    }

    #[test]
    fn fill_range_uses_overlapping_pieces_and_reports_gaps() {
        let a = piece(0, 0, vec![0., 1., 2., 3.]);
        let b = piece(1, 4, vec![4., 5., 6.]);
        let c = piece(2, 7, vec![7., 8., 9.]);
        let saved = [&a, &b, &c];
        let mut dst = [0f32; 5];
        fill_range(&mut dst, 2..7, &saved, "w", 0).unwrap();
        assert_eq!(dst, [2., 3., 4., 5., 6.]);
        // A replica overlapping exactly is fine.
        let b2 = piece(3, 4, vec![4., 5., 6.]);
        let mut dst = [0f32; 10];
        fill_range(&mut dst, 0..10, &[&a, &b, &b2, &c], "w", 0).unwrap();
        assert_eq!(dst, [0., 1., 2., 3., 4., 5., 6., 7., 8., 9.]);
        // Without b, elements 4..7 are missing.
        let mut dst = [0f32; 10];
        match fill_range(&mut dst, 0..10, &[&a, &c], "w", 3) {
            Err(StateDictError::IncompleteShards {
                name,
                rank: 3,
                missing,
            }) => {
                assert_eq!((name.as_str(), missing), ("w", 4..7));
            }
            other => panic!("expected IncompleteShards, got {other:?}"),
        }
        // A missing tail.
        let mut dst = [0f32; 3];
        match fill_range(&mut dst, 7..10, &[&a, &b], "w", 1) {
            Err(StateDictError::IncompleteShards { missing, .. }) => assert_eq!(missing, 7..10),
            other => panic!("expected IncompleteShards, got {other:?}"),
        }
    }

    #[test]
    fn shapes_and_names_encode() {
        let p = Path::new("x");
        for s in [vec![], vec![0], vec![3], vec![2, 3, 4]] {
            assert_eq!(parse_shape(&encode_shape(&s), p).unwrap(), s);
        }
        assert!(parse_shape("2,x", p).is_err());
        assert!(check_param_name("a.b").is_ok());
        assert!(matches!(
            check_param_name("a\tb"),
            Err(StateDictError::InvalidName { .. })
        ));
        assert!(check_slot_name("exp_avg").is_ok());
        for bad in ["", "a/b", "a\nb"] {
            assert!(matches!(
                check_slot_name(bad),
                Err(StateDictError::InvalidName { .. })
            ));
        }
        assert!(matches!(
            check_slots(["m", "v", "m"].into_iter()),
            Err(StateDictError::DuplicateEntry { .. })
        ));
    }

    fn temp_dir(tag: &str) -> PathBuf {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        std::env::temp_dir().join(format!(
            "fsdp-sd-unit-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ))
    }

    #[test]
    fn full_file_round_trip_keeps_order_shapes_and_bits() {
        let dir = temp_dir("full");
        let dict = FullStateDict {
            world_size: 3,
            entries: vec![
                TensorEntry {
                    name: "z.scalar".into(),
                    shape: vec![],
                    values: vec![f32::from_bits(0x7fc0_0001)],
                },
                TensorEntry {
                    name: "a.empty".into(),
                    shape: vec![0, 4],
                    values: vec![],
                },
                TensorEntry {
                    name: "m.w".into(),
                    shape: vec![2, 3],
                    values: vec![1.0, -0.0, 3.5, f32::MIN_POSITIVE, 1e-45, -7.25],
                },
            ],
        };
        let path = dir.join("sub").join("m.safetensors");
        dict.save(&path).unwrap();
        let back = FullStateDict::load(&path).unwrap();
        assert_eq!(back.world_size, 3);
        assert_eq!(back.entries.len(), 3);
        for (a, b) in dict.entries.iter().zip(&back.entries) {
            assert_eq!((&a.name, &a.shape), (&b.name, &b.shape));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a.values), bits(&b.values));
        }
        // The wrong kind is refused.
        assert!(matches!(
            FullOptimStateDict::load(&path),
            Err(StateDictError::Format { .. })
        ));
        // A missing file names the path.
        match FullStateDict::load(dir.join("nope.safetensors")) {
            Err(StateDictError::Io { path, .. }) => assert!(path.ends_with("nope.safetensors")),
            other => panic!("expected Io, got {other:?}"),
        }
        // Bad value counts are refused before writing.
        let bad = FullStateDict {
            world_size: 1,
            entries: vec![TensorEntry {
                name: "w".into(),
                shape: vec![2],
                values: vec![1.0],
            }],
        };
        assert!(matches!(
            bad.save(dir.join("bad.safetensors")),
            Err(StateDictError::ValueCount { .. })
        ));
        assert!(!dir.join("bad.safetensors").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn other_versions_and_foreign_files_are_refused() {
        let dir = temp_dir("version");
        std::fs::create_dir_all(&dir).unwrap();
        let v = [1.0f32];
        let view = || F32View {
            shape: vec![1],
            values: &v,
        };
        let mut meta = base_meta(KIND_FULL_PARAMS, 1, None);
        meta.insert("format_version".into(), "999".into());
        meta.insert("names".into(), "w".into());
        let p = dir.join("v999.safetensors");
        write_file(&p, vec![("w".into(), view())], meta).unwrap();
        match FullStateDict::load(&p) {
            Err(StateDictError::UnsupportedVersion { found, .. }) => assert_eq!(found, "999"),
            other => panic!("expected UnsupportedVersion, got {other:?}"),
        }
        let p = dir.join("foreign.safetensors");
        safetensors::serialize_to_file(vec![("w".to_string(), view())], None, &p).unwrap();
        assert!(matches!(
            FullStateDict::load(&p),
            Err(StateDictError::Format { .. })
        ));
        let p = dir.join("garbage.safetensors");
        std::fs::write(&p, b"not a safetensors file").unwrap();
        assert!(matches!(
            FullStateDict::load(&p),
            Err(StateDictError::SafeTensors { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn merge_checks_compatibility() {
        let cat = vec![ParamMeta {
            name: "w".into(),
            shape: vec![10],
        }];
        let d = |rank: usize, world: usize| ShardedStateDict {
            world_size: world,
            ranks: vec![rank],
            params: cat.clone(),
            pieces: vec![piece(rank, rank * 5, vec![rank as f32; 5])],
        };
        let m = ShardedStateDict::merge([d(1, 2), d(0, 2)]).unwrap();
        assert_eq!(m.ranks, vec![0, 1]);
        assert_eq!(m.pieces.len(), 2);
        assert!(matches!(
            ShardedStateDict::merge([d(0, 2), d(1, 3)]),
            Err(StateDictError::Incompatible { .. })
        ));
        assert!(matches!(
            ShardedStateDict::merge([d(0, 2), d(0, 2)]),
            Err(StateDictError::Incompatible { .. })
        ));
    }

    #[test]
    fn sharded_dir_round_trip() {
        let dir = temp_dir("sharded");
        let cat = vec![
            ParamMeta {
                name: "w".into(),
                shape: vec![10],
            },
            ParamMeta {
                name: "e".into(),
                shape: vec![0],
            },
        ];
        for r in 0..2 {
            ShardedStateDict {
                world_size: 2,
                ranks: vec![r],
                params: cat.clone(),
                pieces: vec![piece(
                    r,
                    r * 5,
                    (0..5).map(|i| (r * 5 + i) as f32).collect(),
                )],
            }
            .save(&dir)
            .unwrap();
        }
        let all = ShardedStateDict::load_dir(&dir).unwrap();
        assert_eq!((all.world_size, all.ranks.clone()), (2, vec![0, 1]));
        assert_eq!(all.params, cat);
        let mut dst = [0f32; 10];
        let mut saved: Vec<&ShardPiece> = all.pieces.iter().collect();
        saved.sort_by_key(|p| p.offset);
        fill_range(&mut dst, 0..10, &saved, "w", 0).unwrap();
        assert_eq!(dst, [0., 1., 2., 3., 4., 5., 6., 7., 8., 9.]);
        // A piece naming an unknown parameter is refused before writing.
        let bad = ShardedStateDict {
            world_size: 2,
            ranks: vec![0],
            params: cat.clone(),
            pieces: vec![ShardPiece {
                name: "x".into(),
                ..piece(0, 0, vec![1.0])
            }],
        };
        assert!(matches!(
            bad.save(dir.join("bad")),
            Err(StateDictError::UnexpectedEntry { .. })
        ));
        assert!(!dir.join("bad").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
