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
//!   all-gathered on the shard stream ([`Fsdp::optimizer_stream`](crate::Fsdp::optimizer_stream)), copied to the host, and freed
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
//! sharded index files), `world_size`, and `crc32/<tensor>` (the CRC-32 of each tensor's bytes,
//! verified on every load: [`StateDictError::ChecksumMismatch`]) and `crc32/__header__` (the
//! CRC-32 of the whole JSON header with that value read as `00000000`, so every header byte a
//! load reads is covered: a damaged header is a [`StateDictError::Format`]). Sharded files also carry
//! `generation`, the id of the save that wrote them; a file of another save than the directory's
//! metadata is refused ([`StateDictError::GenerationMismatch`]). Files saved with non-finite
//! values under [`allow_non_finite`] carry `non_finite = allowed`.
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
//!   A collective save writes a whole new directory and replaces the old one at once, so no stale
//!   files remain; the rank-local `save` methods write in place (save id `rank-local`).
//!
//! # Crash consistency (all-or-nothing)
//! - Every file is written to a temporary name in its directory (mode from the umask), fsynced,
//!   renamed over the target, and the directory fsynced; the temporary file is removed on every
//!   failure path; a target that is a symlink, device node or directory is refused
//!   ([`StateDictError::NotRegularFile`]).
//! - [`save_sharded`] / [`save_sharded_optim`] stage the whole directory next to the target and
//!   publish it with one atomic rename after every rank finished (see [`save_sharded`]).
//! - [`load_sharded`] / [`load_sharded_optim`] agree across ranks before changing anything: a
//!   missing, stale or corrupted file is refused on every rank
//!   ([`StateDictError::PeerRejected`] names the file on the ranks that did not read it).
//! - Non-finite values are refused at save ([`StateDictError::NonFinite`]) unless inside
//!   [`allow_non_finite`], and reported at load.
//! - [`check_save_target`] checks a target before training (writable, free space).
//! - [`checkpoint`] builds training checkpoints (model + optimizer + scaler + metadata) on this.
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
//! rank must call them, in the same order as its other collectives). [`load_sharded`] and
//! [`load_sharded_optim`] are collectives too (one small all-reduce to agree on the checkpoint's
//! validity). Everything else that only loads, and the in-memory sharded and local forms, is
//! rank-local. The `save_*` functions that write files end
//! with a one-element all-reduce over the shard and replicate groups, so that every rank returns
//! only after every file is written and every rank reports a failure of any writer
//! ([`StateDictError::PeerFailed`], carrying the failing rank and its own message).
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

/// Version of the on-disk format written by this module (the `format_version` metadata key).
/// Files of another version are refused with [`StateDictError::UnsupportedVersion`].
pub const FORMAT_VERSION: u32 = 3;

const FORMAT: &str = "fsdp-rs";
const KIND_FULL_PARAMS: &str = "full-params";
const KIND_FULL_OPTIM: &str = "full-optim";
const KIND_SHARDED_PARAMS: &str = "sharded-params";
const KIND_SHARDED_OPTIM: &str = "sharded-optim";
const META_FILE: &str = "metadata.safetensors";
const GENERATION_KEY: &str = "generation";
const NON_FINITE_KEY: &str = "non_finite";
/// The save id of sharded files written by the rank-local `save` methods (not published
/// atomically; the collective `save_sharded*` functions use a fresh id per save).
const LOCAL_GENERATION: &str = "rank-local";

thread_local! {
    static ALLOW_NON_FINITE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with the non-finite guard off on this thread: saves made inside it write NaN and
/// infinite values instead of refusing them with [`StateDictError::NonFinite`] (for post-mortem
/// inspection of a diverged run). Files written so are marked, and load despite their
/// non-finite values; every other file with non-finite values is refused on load.
pub fn allow_non_finite<R>(f: impl FnOnce() -> R) -> R {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            ALLOW_NON_FINITE.with(|c| c.set(self.0));
        }
    }
    let _reset = Reset(ALLOW_NON_FINITE.with(|c| c.replace(true)));
    f()
}

fn non_finite_allowed() -> bool {
    ALLOW_NON_FINITE.with(|c| c.get())
}

mod check;
pub mod checkpoint;
mod durable;
pub(crate) mod error;
mod format;
mod optim;
mod reshard;
#[cfg(test)]
mod tests;
mod types;
mod types_io;

pub use durable::{check_save_target, disk_usage};
pub use error::{Result, StateDictError};
pub use optim::*;
pub use reshard::*;
pub use types::*;
