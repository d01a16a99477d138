//! Graph nodes and edges.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use fsdp_alloc::DType;

use crate::error::Result;
use crate::tensor::Tensor;

static NEXT_SEQ: AtomicU64 = AtomicU64::new(1);
static NEXT_HOOK: AtomicU64 = AtomicU64::new(1);

pub(crate) fn next_hook_id() -> u64 {
    NEXT_HOOK.fetch_add(1, Ordering::Relaxed)
}

/// A tensor hook: sees a gradient, may replace it.
pub(crate) type TensorHookFn = Arc<dyn Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync>;
/// A post-accumulate-grad hook: sees the leaf whose `.grad()` is final for this backward.
pub(crate) type PostHookFn = Arc<dyn Fn(&Tensor) -> Result<()> + Send + Sync>;

/// What a gradient flowing into one slot of a node must look like.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct GradMeta {
    pub shape: Vec<usize>,
    pub dtype: DType,
}

/// The backward computation of one operation: gradients w.r.t. its outputs (`None` where no
/// gradient arrived) in, gradients w.r.t. its inputs (`None` where not needed) out. Saved tensors
/// are taken out (freed) when used, so running a node with saved tensors a second time fails
/// with `GraphConsumed`; nodes without saved tensors (views, adds, …) can run again.
pub(crate) trait BackwardFn: Send {
    fn run(&mut self, grads: Vec<Option<Tensor>>) -> Result<Vec<Option<Tensor>>>;

    /// Offered each incoming gradient of output `slot` as soon as it arrives (when no tensor
    /// hook watches that slot). A node that can fold it into its result right away returns
    /// `Ok(None)` (the engine then does not buffer it, so it is freed at once); `Ok(Some(g))`
    /// hands it back to be buffered and passed to `run` as usual.
    fn accept(&mut self, _slot: usize, g: Tensor) -> Result<Option<Tensor>> {
        Ok(Some(g))
    }
}

impl<F> BackwardFn for F
where
    F: FnMut(Vec<Option<Tensor>>) -> Result<Vec<Option<Tensor>>> + Send,
{
    fn run(&mut self, grads: Vec<Option<Tensor>>) -> Result<Vec<Option<Tensor>>> {
        self(grads)
    }
}

pub(crate) enum NodeKind {
    /// An operation's backward.
    Function(Mutex<Box<dyn BackwardFn>>),
    /// Accumulates into a leaf's `.grad` (holds the leaf; the leaf holds this node weakly).
    Accumulate(Tensor),
}

/// One node of the backward graph.
pub(crate) struct Node {
    /// Creation order; later nodes run first among ready ones (deterministic order).
    pub seq: u64,
    pub name: &'static str,
    pub kind: NodeKind,
    /// Per forward input: where its gradient goes (`None`: input does not require grad).
    pub next: Vec<Option<Edge>>,
    /// Per forward output (gradient slot): expected gradient shape and dtype.
    pub meta: Vec<GradMeta>,
    /// Tensor hooks of this node's outputs: (slot, hook id, hook), in registration order.
    pub hooks: Mutex<Vec<(usize, u64, TensorHookFn)>>,
}

impl Node {
    pub(crate) fn function(
        name: &'static str,
        next: Vec<Option<Edge>>,
        meta: Vec<GradMeta>,
        f: Box<dyn BackwardFn>,
    ) -> Node {
        Node {
            seq: NEXT_SEQ.fetch_add(1, Ordering::Relaxed),
            name,
            kind: NodeKind::Function(Mutex::new(f)),
            next,
            meta,
            hooks: Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn accumulate(leaf: Tensor) -> Node {
        let meta = vec![GradMeta {
            shape: leaf.shape().to_vec(),
            dtype: leaf.dtype(),
        }];
        Node {
            seq: NEXT_SEQ.fetch_add(1, Ordering::Relaxed),
            name: "accumulate_grad",
            kind: NodeKind::Accumulate(leaf),
            next: Vec::new(),
            meta,
            hooks: Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn hooks(&self) -> MutexGuard<'_, Vec<(usize, u64, TensorHookFn)>> {
        self.hooks.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn is_accumulate(&self) -> bool {
        matches!(self.kind, NodeKind::Accumulate(_))
    }
}

/// Where a gradient goes: slot `slot` of `node`.
#[derive(Clone)]
pub(crate) struct Edge {
    pub node: Arc<Node>,
    pub slot: usize,
}

impl std::fmt::Debug for Edge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Edge({}#{}, slot {})",
            self.node.name, self.node.seq, self.slot
        )
    }
}
