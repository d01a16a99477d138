//! The rank-local methods of the state-dict value types that read and write files or copy into
//! a plain model (`save`, `load`, `load_dir`, `load_into_module`). Kept apart from the type
//! definitions (`types.rs`, a leaf) so that the files these methods call (format, check) can
//! import the types without an import cycle.

use super::check::{
    check_shape, check_slot_name, check_unused, index_entries, missing, optim_ranks,
};
use super::error::Result;
#[cfg(doc)]
use super::error::StateDictError;
use super::format::{
    read_full_file, read_sharded_meta, read_sharded_ranks, write_full_file, write_sharded_dir,
};
use super::types::{
    FullOptimStateDict, FullStateDict, ShardedOptimStateDict, ShardedStateDict, TensorEntry,
};
use super::{
    KIND_FULL_OPTIM, KIND_FULL_PARAMS, KIND_SHARDED_OPTIM, KIND_SHARDED_PARAMS, LOCAL_GENERATION,
};
use fsdp_autograd::nn::{named_parameters, Module};
use fsdp_autograd::{no_grad, Tensor};
use std::collections::HashSet;
use std::path::Path;

impl FullStateDict {
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

    /// Reads a dict written by [`FullStateDict::save`] (or [`save_full`](crate::state_dict::save_full)).
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

impl ShardedStateDict {
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
            LOCAL_GENERATION,
        )
    }

    /// Reads a whole sharded checkpoint directory (every saving rank's pieces). To load into a
    /// wrapped model, [`load_sharded`](crate::state_dict::load_sharded) reads only the files a rank needs.
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

    /// Reads a file written by [`FullOptimStateDict::save`] (or [`save_full_optim`](crate::state_dict::save_full_optim)).
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

impl ShardedOptimStateDict {
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
            LOCAL_GENERATION,
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
