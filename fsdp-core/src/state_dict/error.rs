//! State-dict errors. A runtime error met during a state-dict call (a collective, device, tensor
//! or layout error) is wrapped whole as [`StateDictError::Fsdp`]; the crate's error module
//! ([`crate::error`]) is below this one and knows nothing of state dicts.

use std::ops::Range;
use std::path::{Path, PathBuf};

use fsdp_alloc::AllocError;
use fsdp_autograd::AutogradError;
use fsdp_collectives::CollectiveError;
use fsdp_flatparam::LayoutError;
use safetensors::tensor::SafeTensorError;

use crate::error::FsdpError;

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
        /// [`FORMAT_VERSION`](super::FORMAT_VERSION).
        supported: u32,
    },
    /// A tensor's bytes do not match the checksum recorded when it was saved (the file was
    /// corrupted after it was written).
    #[error(
        "state dict: `{}`: tensor `{tensor}` is corrupted (CRC-32 {found:08x}, saved as \
         {expected:08x}); restore the file or load an older checkpoint",
        path.display()
    )]
    ChecksumMismatch {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The recorded checksum.
        expected: u32,
        /// The checksum of the bytes read.
        found: u32,
    },
    /// A file of a sharded checkpoint belongs to another save than the directory's metadata (a
    /// stale rank file left by an interrupted overwrite, or files mixed by hand).
    #[error(
        "state dict: `{}` is from save {found}, the checkpoint's metadata is from save {expected}: \
         the directory mixes two saves; load another checkpoint",
        path.display()
    )]
    GenerationMismatch {
        /// The offending file.
        path: PathBuf,
        /// The metadata's save id.
        expected: String,
        /// The file's save id.
        found: String,
    },
    /// Non-finite values (NaN or infinity) in a tensor being saved or loaded.
    #[error(
        "state dict: {count} non-finite value(s) in `{tensor}`{}; a diverged state is never \
         saved (use `state_dict::allow_non_finite` to save it on purpose)",
        path.as_ref().map(|p| format!(" of `{}`", p.display())).unwrap_or_default()
    )]
    NonFinite {
        /// The file (when loading or writing one).
        path: Option<PathBuf>,
        /// The tensor.
        tensor: String,
        /// How many values are not finite.
        count: usize,
    },
    /// A save target that exists and is not a regular file (symlink, device node, …) for a file
    /// save, or not a directory for a sharded save.
    #[error(
        "state dict: `{}` exists and is not a regular file or directory of the right kind; \
         refusing to replace it (choose another path)",
        path.display()
    )]
    NotRegularFile {
        /// The target.
        path: PathBuf,
    },
    /// A save target that cannot be used ([`crate::state_dict::check_save_target`]).
    #[error("state dict: cannot save to `{}`: {reason}", path.display())]
    TargetUnusable {
        /// The target.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// Another rank refused a sharded checkpoint (a missing, stale or corrupted file it read).
    #[error(
        "state dict: {op}: rank {rank} refused the checkpoint because of `{}`: {reason}",
        path.display()
    )]
    PeerRejected {
        /// The operation.
        op: &'static str,
        /// The (lowest) rank that refused it, in the shard group.
        rank: usize,
        /// The offending file (the directory when the error named no file of it).
        path: PathBuf,
        /// The refusing rank's own error message (at most 1 KiB of it).
        reason: String,
    },
    /// Another rank failed during a collective save (a full disk, a non-finite value, …): its
    /// own error is passed to every rank, so the rank that reports the run names it.
    #[error("state dict: {op}: rank {rank} failed to write its part: {reason}")]
    PeerFailed {
        /// The operation.
        op: &'static str,
        /// The (lowest) failing rank, in the shard group.
        rank: usize,
        /// That rank's own error message (at most 1 KiB of it).
        reason: String,
    },
    /// A checkpoint the caller's own check refused before loading it (see
    /// [`crate::checkpoint::load_latest_valid`]): not damage, so nothing older is tried.
    #[error("{reason}")]
    Refused {
        /// The checkpoint directory.
        path: PathBuf,
        /// The caller's message.
        reason: String,
    },
    /// A runtime error (collective, device, tensor, layout) met during a state-dict call.
    #[error(transparent)]
    Fsdp(Box<FsdpError>),
}

/// Shorthand for results of this module.
pub type Result<T, E = StateDictError> = std::result::Result<T, E>;

impl StateDictError {
    /// The file this error names, if any.
    pub fn path(&self) -> Option<&Path> {
        match self {
            StateDictError::Io { path, .. }
            | StateDictError::SafeTensors { path, .. }
            | StateDictError::Format { path, .. }
            | StateDictError::UnsupportedVersion { path, .. }
            | StateDictError::ChecksumMismatch { path, .. }
            | StateDictError::GenerationMismatch { path, .. }
            | StateDictError::NotRegularFile { path }
            | StateDictError::TargetUnusable { path, .. }
            | StateDictError::Refused { path, .. }
            | StateDictError::PeerRejected { path, .. } => Some(path),
            StateDictError::NonFinite { path, .. } => path.as_deref(),
            _ => None,
        }
    }
}

impl StateDictError {
    /// Whether this error says that a saved file is damaged, missing, unreadable or from
    /// another save — what a fallback to an older checkpoint can get past — rather than that
    /// the model, the call or a collective is at fault (a shape or name mismatch, a failed
    /// all-reduce, the caller's refusal). A [`StateDictError::PeerRejected`] counts as damage
    /// here; [`crate::checkpoint::load_latest_valid`] lets the refusing rank's own verdict decide.
    pub fn is_damage(&self) -> bool {
        matches!(
            self,
            StateDictError::Io { .. }
                | StateDictError::SafeTensors { .. }
                | StateDictError::Format { .. }
                | StateDictError::UnsupportedVersion { .. }
                | StateDictError::ChecksumMismatch { .. }
                | StateDictError::GenerationMismatch { .. }
                | StateDictError::NonFinite { path: Some(_), .. }
                | StateDictError::PieceOutOfRange { .. }
                | StateDictError::IncompleteShards { .. }
                | StateDictError::DuplicateEntry { .. }
                | StateDictError::ValueCount { .. }
                | StateDictError::Incompatible { .. }
                | StateDictError::PeerRejected { .. }
        )
    }

    /// The runtime error behind [`StateDictError::Fsdp`] (a collective, device, tensor or layout
    /// error raised during a state-dict call).
    pub fn fsdp_error(&self) -> Option<&FsdpError> {
        match self {
            StateDictError::Fsdp(inner) => Some(inner),
            _ => None,
        }
    }
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
