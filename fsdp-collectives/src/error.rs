//! The crate's error type.

use std::time::Duration;

use fsdp_alloc::{AllocError, DType};

use crate::op::OpKind;

/// Everything that can go wrong in a collective, a group, a mesh or the rendezvous store.
///
/// Ranks are *group-local* (position in the group the operation was issued on); `group` names
/// the group (e.g. `threads#3/shard1`) where it matters.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CollectiveError {
    // ----- argument errors (reported identically on every rank of the collective) -----
    /// The lengths break the even-size rule (all-gather: output = world × input; reduce-scatter:
    /// input = world × output).
    #[error(
        "{op} on rank {rank}: input has {input_len} elements and output has {output_len}, but \
         even-sized collectives need {rule} with world size {world_size}; pad the flat buffer to a \
         multiple of the world size (fsdp-flatparam's layout does) and pass whole chunks",
        rule = op.size_rule()
    )]
    SizeMismatch {
        /// The collective.
        op: OpKind,
        /// The rank whose arguments were wrong.
        rank: usize,
        /// Size of the group.
        world_size: usize,
        /// Input length in elements.
        input_len: usize,
        /// Output length in elements.
        output_len: usize,
    },
    /// Ranks issued different collectives at the same position of the group's sequence.
    #[error(
        "collective #{seq} of group {group}: rank {rank_a} issued {op_a} but rank {rank_b} issued \
         {op_b}; every rank must issue the same collectives in the same order"
    )]
    OpMismatch {
        /// Group name.
        group: String,
        /// Position in the group's collective sequence.
        seq: u64,
        /// First rank.
        rank_a: usize,
        /// What it issued.
        op_a: OpKind,
        /// A rank that disagrees.
        rank_b: usize,
        /// What that rank issued.
        op_b: OpKind,
    },
    /// Ranks passed different arguments (lengths, dtype, reduce op, root) to the same collective.
    #[error(
        "{op} (collective #{seq} of group {group}): rank {rank_a} passed {what} = {value_a} but \
         rank {rank_b} passed {what} = {value_b}; all ranks must pass matching arguments"
    )]
    InconsistentArgs {
        /// The collective.
        op: OpKind,
        /// Group name.
        group: String,
        /// Position in the group's collective sequence.
        seq: u64,
        /// Which argument differs.
        what: &'static str,
        /// First rank.
        rank_a: usize,
        /// Its value.
        value_a: String,
        /// A rank that disagrees.
        rank_b: usize,
        /// Its value.
        value_b: String,
    },
    /// Input and output element types differ.
    #[error(
        "{op} on rank {rank}: input is {input} but output is {output}; cast before the collective \
         (or use the *_with variants to choose the accumulation dtype)"
    )]
    DtypeMismatch {
        /// The collective.
        op: OpKind,
        /// The rank whose arguments were wrong.
        rank: usize,
        /// Input dtype.
        input: DType,
        /// Output dtype.
        output: DType,
    },
    /// The reduction is not defined for this buffer/accumulation dtype pair.
    #[error(
        "{op} on rank {rank}: cannot reduce {dtype} buffers with {accum} accumulation: {reason}"
    )]
    UnsupportedDtype {
        /// The collective.
        op: OpKind,
        /// The rank whose arguments were wrong.
        rank: usize,
        /// Buffer dtype.
        dtype: DType,
        /// Requested accumulation dtype.
        accum: DType,
        /// Which combinations are supported.
        reason: String,
    },
    /// A broadcast root outside the group.
    #[error("{op} on rank {rank}: root {root} is not a rank of a group of size {world_size}")]
    InvalidRoot {
        /// The collective.
        op: OpKind,
        /// The rank whose arguments were wrong.
        rank: usize,
        /// The root given.
        root: usize,
        /// Size of the group.
        world_size: usize,
    },
    /// A buffer cannot be used as given (ragged length, disallowed aliasing, device memory the
    /// backend cannot reach).
    #[error("{op} on rank {rank}: {detail}")]
    InvalidBuffer {
        /// The collective (or `DeviceSlice` construction).
        op: OpKind,
        /// The rank whose buffer it was.
        rank: usize,
        /// What is wrong and what to do.
        detail: String,
    },

    /// The backend does not implement this collective.
    #[error("{op} on rank {rank} of group {group}: not supported by this backend: {detail}")]
    Unsupported {
        /// The collective.
        op: OpKind,
        /// The rank that issued it.
        rank: usize,
        /// Group name.
        group: String,
        /// Which backend, and what to use instead.
        detail: String,
    },

    /// A [`crate::DeviceSlice`] that cannot be formed (ragged length, out of range).
    #[error("invalid device slice: {0}")]
    InvalidSlice(String),

    // ----- runtime failures -----
    /// A rank dropped its group handle (or its thread panicked) without issuing this collective.
    #[error(
        "{op} (collective #{seq} of group {group}) on rank {rank}: rank {peer} left the group (its \
         handle was dropped or its thread panicked) before issuing this collective, so it can \
         never complete; check rank {peer}'s thread for a panic"
    )]
    PeerGone {
        /// The collective.
        op: OpKind,
        /// Group name.
        group: String,
        /// Position in the group's collective sequence.
        seq: u64,
        /// The reporting rank.
        rank: usize,
        /// The rank that left.
        peer: usize,
    },
    /// Another rank failed inside this collective (or its stream failed before reaching it).
    #[error(
        "{op} (collective #{seq} of group {group}) on rank {rank}: rank {peer} failed: {message}"
    )]
    PeerFailed {
        /// The collective.
        op: OpKind,
        /// Group name.
        group: String,
        /// Position in the group's collective sequence.
        seq: u64,
        /// The reporting rank.
        rank: usize,
        /// The rank that failed.
        peer: usize,
        /// Its failure.
        message: String,
    },
    /// Some ranks did not reach the collective within the group's timeout.
    #[error(
        "{op} (collective #{seq} of group {group}): rank {rank} waited {waited:?} for {} to \
         reach it; raise GroupConfig::timeout if they are only slow, otherwise a \
         rank is hung or issued collectives in a different order",
        waited_for(missing)
    )]
    Timeout {
        /// The collective.
        op: OpKind,
        /// Group name.
        group: String,
        /// Position in the group's collective sequence.
        seq: u64,
        /// The rank that gave up waiting.
        rank: usize,
        /// How long it waited.
        waited: Duration,
        /// The ranks it was waiting for; empty where the wait cannot tell (an MPI wait only
        /// knows that not every rank arrived).
        missing: Vec<usize>,
    },
    /// The stream the collective was issued on had already failed, so the collective never ran.
    #[error(
        "{op} on rank {rank}: its stream failed before the collective could run ({message}); \
         a failed stream skips all later work, use a fresh stream after handling the failure"
    )]
    StreamFailed {
        /// The collective.
        op: OpKind,
        /// The rank.
        rank: usize,
        /// The stream's failure.
        message: String,
    },
    /// Reading or writing a rank's buffer failed (e.g. an unordered concurrent access).
    #[error("{op} on rank {rank}: buffer access failed: {source}")]
    Buffer {
        /// The collective.
        op: OpKind,
        /// The rank.
        rank: usize,
        /// The device runtime's error.
        #[source]
        source: AllocError,
    },

    // ----- groups and meshes -----
    /// A mesh shape that does not tile the world.
    #[error(
        "cannot build a device mesh of {world_size} ranks with shard groups of {shard_size}: \
         {reason}"
    )]
    InvalidMesh {
        /// World size.
        world_size: usize,
        /// Requested shard group size F.
        shard_size: usize,
        /// Why not.
        reason: String,
    },
    /// A subgroup request that is not a partition of the group, or that differs between ranks.
    #[error("splitting group {group} on rank {rank}: {detail}")]
    InvalidGroup {
        /// Group name.
        group: String,
        /// The rank that asked.
        rank: usize,
        /// What is wrong.
        detail: String,
    },

    // ----- rendezvous store -----
    /// A required environment variable is not set.
    #[error(
        "environment variable {var} is not set; launch with torchrun, mpirun (Open MPI or MPICH) \
         or srun, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT yourself"
    )]
    MissingEnv {
        /// The variable.
        var: &'static str,
    },
    /// An environment variable has an unusable value.
    #[error("environment variable {var}={value:?} is invalid: {reason}")]
    InvalidEnv {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// Why it is unusable.
        reason: String,
    },
    /// Two launchers' variables disagree (e.g. `mpirun` started inside a Slurm batch script).
    #[error(
        "launch environment is contradictory: {var_a}={value_a:?} but {var_b}={value_b:?}; set \
         FSDP_LAUNCHER to torchrun, openmpi, pmi or slurm to say which launcher to believe"
    )]
    EnvConflict {
        /// The variable of the launcher that is believed first.
        var_a: &'static str,
        /// Its value.
        value_a: String,
        /// The variable that contradicts it.
        var_b: &'static str,
        /// Its value.
        value_b: String,
    },
    /// A socket operation of the store failed.
    #[error("rendezvous store at {addr}: {action} failed: {message}")]
    StoreIo {
        /// Store address.
        addr: String,
        /// What was being done.
        action: String,
        /// The I/O error.
        message: String,
    },
    /// A key did not appear in the store in time.
    #[error(
        "rendezvous store at {addr}: key {key:?} did not appear within {waited:?}; are all ranks \
         started and pointing at the same MASTER_ADDR/MASTER_PORT?"
    )]
    StoreTimeout {
        /// Store address.
        addr: String,
        /// The key.
        key: String,
        /// How long we waited.
        waited: Duration,
    },
    /// The store refused this client, or this client refused the store, in the shared-secret
    /// handshake.
    #[error(
        "rendezvous store at {addr}: authentication failed: {detail}; every rank (and the host) \
         needs the same FSDP_STORE_SECRET"
    )]
    StoreAuth {
        /// Store address.
        addr: String,
        /// What went wrong.
        detail: String,
    },
    /// A key, a value or the store's total size is over the store's limit.
    #[error(
        "rendezvous store at {addr}: {what} of {size} bytes exceeds the limit of {limit} bytes; \
         store less (the store is for rendezvous metadata) or raise the limit in StoreLimits on \
         the host"
    )]
    StoreLimit {
        /// Store address.
        addr: String,
        /// `"key"`, `"value"` or `"total stored bytes"`.
        what: &'static str,
        /// The size that was refused (for the total: what it would have become).
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// A barrier was entered with a world size other than the job's (or other callers').
    #[error(
        "rendezvous store at {addr}: barrier {name:?} entered with world size {got}, but the \
         {source_of_expected} is {expected}; pass the job's world size and use a fresh name per \
         barrier"
    )]
    StoreBarrier {
        /// Store address.
        addr: String,
        /// The barrier's name.
        name: String,
        /// The world size this caller passed.
        got: usize,
        /// The world size the store expected.
        expected: usize,
        /// Where `expected` came from: the job's world size or an earlier caller of the barrier.
        source_of_expected: &'static str,
    },
    /// The store peer sent something that is not this crate's protocol.
    #[error("rendezvous store at {addr}: protocol error: {detail}")]
    StoreProtocol {
        /// Store address.
        addr: String,
        /// What was wrong.
        detail: String,
    },

    // ----- MPI -----
    /// An MPI call failed, or MPI could not be (or was already) initialized.
    #[error("MPI {call} on rank {rank} failed: {message}")]
    Mpi {
        /// The MPI function or step.
        call: &'static str,
        /// The rank (group-local; world rank before a group exists).
        rank: usize,
        /// What MPI reported, and what to do.
        message: String,
    },

    // ----- CUDA / NCCL -----
    /// CUDA or NCCL is not available (feature off, libraries missing, no device).
    #[error("CUDA/NCCL unavailable: {0}")]
    CudaUnavailable(String),
    /// An NCCL call failed.
    #[error("NCCL {call} on rank {rank} failed with {code}: {message}")]
    Nccl {
        /// The NCCL function.
        call: &'static str,
        /// The rank.
        rank: usize,
        /// The `ncclResult_t` name.
        code: String,
        /// NCCL's own error string.
        message: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver call {call} on rank {rank} failed: {message}")]
    Cuda {
        /// What was being done.
        call: &'static str,
        /// The rank.
        rank: usize,
        /// The driver's error.
        message: String,
    },
}

/// Shorthand for results of this crate.
pub type Result<T, E = CollectiveError> = std::result::Result<T, E>;

/// The ranks a [`CollectiveError::Timeout`] waited for, in words.
fn waited_for(missing: &[usize]) -> String {
    if missing.is_empty() {
        "every rank of the group (not every one arrived; this wait cannot tell which)".into()
    } else {
        format!("ranks {missing:?}")
    }
}
