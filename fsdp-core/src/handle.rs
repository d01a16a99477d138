//! `FlatParamHandle`: the runtime state of one FSDP unit.
//!
//! A unit's parameters live as one flat parameter laid out by [`FlatParamLayout`]. Between uses
//! each rank holds only its *shard* (`chunk_numel` elements, f32). To compute, the unit is
//! *unsharded*: the shards are all-gathered into a buffer from the device allocator, the buffer is
//! attached to the unit's flat [`Storage`], and the original parameters become autograd-visible
//! views into it. *Resharding* releases the buffer again (PyTorch's `storage.resize_(0)`), while
//! the views — and the autograd graph that saved them — stay valid for the next unshard.

use fsdp_alloc::{DType, Event};
use fsdp_autograd::{Parameter, Storage, Tensor};
use fsdp_flatparam::FlatParamLayout;

/// One unit's runtime state.
pub(crate) struct FlatParamHandle {
    /// Module path of the unit ("" for the root).
    pub path: String,
    /// Layout of the flat parameter over the shard group.
    pub layout: FlatParamLayout,
    /// The original parameters, in layout order.
    pub params: Vec<Parameter>,
    /// Fully-qualified name of each parameter (first use).
    pub names: Vec<String>,
    /// This rank's shard (f32, `chunk_numel`); for `NoShard`, the whole padded flat parameter.
    pub shard: Tensor,
    /// The reduced gradient of the shard (f32), once a backward has produced one.
    pub shard_grad: Option<Tensor>,
    /// Dtype of the unsharded flat parameter (the mixed-precision param dtype, else f32).
    pub param_dtype: DType,
    /// Storage of the unsharded flat parameter (`padded_numel` of `param_dtype`); allocated only while
    /// unsharded. For `NoShard` it is the shard's own storage and is never released.
    pub storage: Storage,
    /// This iteration's flat leaf (created at the first unshard of an iteration).
    pub flat: Option<Tensor>,
    /// Whether `flat` and the views were created with grad mode on (a forward under `no_grad`
    /// creates views autograd does not track; a later training forward must not reuse them).
    pub flat_tracks_grad: bool,
    /// True while the storage holds the gathered parameters.
    pub unsharded: bool,
    /// Completion of the all-gather the compute stream has not waited on yet.
    pub pending_unshard: Option<Event>,
    /// Unsharded gradient accumulated locally while gradient sync is off (`no_sync`).
    pub unsynced_grad: Option<Tensor>,
    /// The post-backward reduction has run for this iteration.
    pub post_backward_done: bool,
}

impl FlatParamHandle {
    /// Bytes of the unsharded flat parameter.
    pub fn unsharded_bytes(&self) -> usize {
        self.layout.padded_numel() * self.param_dtype.size()
    }
}
