//! Reverse-mode automatic differentiation with the three hook points FSDP needs.
//!
//! Operations on tensors that require grad record a graph while grad mode is on
//! ([`crate::no_grad`] turns it off). [`backward`] (or [`Tensor::backward`]) walks it in reverse
//! with dependency counting, in a deterministic order, and accumulates (`+=`) into the `.grad`
//! of leaves until [`Tensor::zero_grad`]. Several forwards may precede one backward; leaves the
//! loss does not depend on are left untouched.
//!
//! The hook points (PyTorch FSDP's interception points):
//! 1. [`Tensor::register_hook`] — on any tensor that requires grad: runs when that tensor's
//!    gradient has been computed (all contributions summed), before it flows further; may replace
//!    the gradient. (FSDP: *pre-backward* — unshard a unit before backward enters it.)
//! 2. [`Tensor::register_post_accumulate_grad_hook`] — on a leaf: runs right after the leaf's
//!    gradient for this backward has been accumulated into `.grad`, i.e. once it is final.
//!    (FSDP: *post-backward* — reduce-scatter the flat gradient.)
//! 3. [`queue_callback`] — from inside a hook: runs when the current backward finishes.
//!    (FSDP: wait for pending reductions before the optimizer step.)
//!
//! Hooks run on the thread that called backward, inside backward's no-grad scope, and launch
//! their kernels on that thread's current stream unless they open their own
//! [`crate::with_stream`] scope.
//!
//! # Execution order (deterministic)
//! A node runs once every node that sends it a gradient has run (its dependency count, the number
//! of graph edges into it, drops to zero). Among ready nodes, leaf accumulators run first (so a
//! leaf's post-accumulate-grad hook fires as soon as its gradient is final), then the node created
//! *latest* in the forward. The order therefore depends only on the graph and the order the
//! forward created it, never on timing, and gradients summed from several paths are always
//! summed in the same order.
//!
//! # What happens at a node
//! 1. Tensor hooks ([`Tensor::register_hook`]) of each output slot that received a gradient run in
//!    registration order; each sees the (summed) gradient and may replace it.
//! 2. Leaf accumulator: the gradient is added to the leaf's `.grad` (adopting the gradient's memory
//!    when nothing else refers to it, otherwise `+=` into the existing `.grad` or a fresh copy),
//!    then the leaf's post-accumulate-grad hooks run, in registration order.
//! 3. Other nodes: the operation's backward runs (it takes, and so frees, its saved tensors) and
//!    its input gradients are delivered along the edges (summed where several meet). A node whose
//!    slots all received no gradient is skipped (its inputs receive none from it).
//!
//! After the last node, callbacks queued with [`queue_callback`] run in order (callbacks may queue
//! more). On error, backward stops, queued callbacks are dropped without running, and the error is
//! returned.
//!
//! # Limitations
//! A graph whose nodes saved tensors can be backpropagated once: its saved tensors are freed as
//! it goes, and a second backward fails with [`crate::AutogradError::GraphConsumed`] (nodes that
//! saved nothing — views, adds, scales — may run again, as in PyTorch). No higher-order gradients
//! (`create_graph`), no `retain_graph`, no autograd through in-place operations (they are refused
//! on tensors that require grad while grad mode is on). Activation checkpointing is
//! non-reentrant and does not nest ([`checkpoint`]).

pub(crate) mod checkpoint;
pub(crate) mod engine;
pub(crate) mod node;

use std::sync::{Arc, Weak};

use crate::context::is_grad_enabled;
use crate::error::{AutogradError, Result};
use crate::tensor::{Tensor, TensorImpl};
use node::{next_hook_id, BackwardFn, Edge, GradMeta, Node, PostHookFn, TensorHookFn};

pub(crate) use checkpoint::SavedTensor;
pub use checkpoint::{checkpoint, checkpoint_arc, CheckpointFn};
pub use engine::{backward, in_backward, queue_callback, queue_callback_fallible};

/// True if an operation on `inputs` must be recorded.
pub(crate) fn needs_grad(inputs: &[&Tensor]) -> bool {
    is_grad_enabled() && inputs.iter().any(|t| t.requires_grad())
}

/// Records an operation: a node whose backward is `f`, with edges to `inputs`' grad edges; the
/// returned tensors are `outputs` as that node's outputs.
pub(crate) fn record(
    name: &'static str,
    inputs: &[&Tensor],
    outputs: &[Tensor],
    f: impl BackwardFn + 'static,
) -> Vec<Tensor> {
    let next = inputs.iter().map(|t| t.grad_edge()).collect();
    let meta = outputs
        .iter()
        .map(|o| GradMeta {
            shape: o.shape().to_vec(),
            dtype: o.dtype(),
        })
        .collect();
    let node = Arc::new(Node::function(name, next, meta, Box::new(f)));
    outputs
        .iter()
        .enumerate()
        .map(|(slot, o)| {
            o.with_grad_fn(Edge {
                node: Arc::clone(&node),
                slot,
            })
        })
        .collect()
}

/// The gradient of a single-output node's output, as its backward receives it (the engine runs
/// a node only after a gradient for it arrived, so it is there).
pub(crate) fn single_grad(op: &'static str, grads: Vec<Option<Tensor>>) -> Tensor {
    grads
        .into_iter()
        .next()
        .flatten()
        .unwrap_or_else(|| panic!("{op}: one gradient"))
}

/// [`record`] for a single output.
pub(crate) fn record1(
    name: &'static str,
    inputs: &[&Tensor],
    output: Tensor,
    f: impl BackwardFn + 'static,
) -> Tensor {
    record(name, inputs, std::slice::from_ref(&output), f)
        .pop()
        .expect("one output")
}

/// Records a user-defined differentiable operation: `outputs` were computed from `inputs`
/// (e.g. under [`crate::no_grad`] or by kernels of your own); in backward, `backward` receives
/// the gradients w.r.t. the outputs (`None` where none arrived) and returns one gradient (or
/// `None`) per input, each with that input's shape and dtype. Returns the outputs as tensors
/// of the graph. If grad mode is off or no input requires grad, returns `outputs` unchanged.
///
/// ```
/// use fsdp_alloc::{DType, Device};
/// use fsdp_autograd::{custom_op, no_grad, Tensor};
///
/// let dev = Device::cpu(0);
/// let x = Tensor::from_vec(vec![1.0f32, 2.0], &[2], &dev)?.requires_grad_(true)?;
/// // y = 3x with a hand-written backward.
/// let y = no_grad(|| x.scale(3.0))?;
/// let y = custom_op("triple", &[&x], vec![y], |g| Ok(vec![Some(g[0].as_ref().unwrap().scale(3.0)?)]))?;
/// y[0].sum()?.backward()?;
/// assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![3.0, 3.0]);
/// # Ok::<(), fsdp_autograd::AutogradError>(())
/// ```
pub fn custom_op<F>(
    name: &'static str,
    inputs: &[&Tensor],
    outputs: Vec<Tensor>,
    backward: F,
) -> Result<Vec<Tensor>>
where
    F: FnOnce(Vec<Option<Tensor>>) -> Result<Vec<Option<Tensor>>> + Send + 'static,
{
    if !needs_grad(inputs) {
        return Ok(outputs);
    }
    if let Some(o) = outputs.iter().find(|o| !o.dtype().is_float()) {
        return Err(AutogradError::RequiresGrad(format!(
            "custom op `{name}`: output of dtype {} cannot carry gradients",
            o.dtype()
        )));
    }
    let raw: Vec<Tensor> = outputs.iter().map(Tensor::detach).collect();
    let mut backward = Some(backward);
    Ok(record(
        name,
        inputs,
        &raw,
        move |g: Vec<Option<Tensor>>| match backward.take() {
            Some(f) => f(g),
            None => Err(AutogradError::GraphConsumed { op: name }),
        },
    ))
}

enum HookTarget {
    Node(Weak<Node>),
    Leaf(Weak<TensorImpl>),
    LeafPost(Weak<TensorImpl>),
}

/// Removes a registered hook ([`HookHandle::remove`]). Dropping the handle keeps the hook.
pub struct HookHandle {
    target: HookTarget,
    id: u64,
}

impl std::fmt::Debug for HookHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HookHandle({})", self.id)
    }
}

impl HookHandle {
    /// Unregisters the hook; `false` if it was already removed or its tensor is gone.
    pub fn remove(&self) -> bool {
        match &self.target {
            HookTarget::Node(w) => w.upgrade().is_some_and(|n| {
                let mut h = n.hooks();
                let before = h.len();
                h.retain(|(_, id, _)| *id != self.id);
                h.len() != before
            }),
            HookTarget::Leaf(w) => Tensor::from_weak(w).is_some_and(|t| {
                let mut m = t.leaf_meta();
                let before = m.hooks.len();
                m.hooks.retain(|(id, _)| *id != self.id);
                m.hooks.len() != before
            }),
            HookTarget::LeafPost(w) => Tensor::from_weak(w).is_some_and(|t| {
                let mut m = t.leaf_meta();
                let before = m.post_hooks.len();
                m.post_hooks.retain(|(id, _)| *id != self.id);
                m.post_hooks.len() != before
            }),
        }
    }
}

impl Tensor {
    /// Registers a hook that runs when this tensor's gradient has been computed (all
    /// contributions summed), before it flows further back; returning `Some(g)` replaces the
    /// gradient (same shape and dtype). Hooks of one tensor run in registration order. On a leaf,
    /// the hooks run before the gradient is accumulated into `.grad`.
    ///
    /// # Errors
    /// [`AutogradError::RequiresGrad`] if the tensor does not require grad.
    ///
    /// ```
    /// use fsdp_alloc::{DType, Device};
    /// use fsdp_autograd::Tensor;
    ///
    /// let dev = Device::cpu(0);
    /// let x = Tensor::ones(&[2], DType::F32, &dev)?.requires_grad_(true)?;
    /// let y = x.scale(2.0)?;
    /// y.register_hook(|g| Some(g.scale(10.0).unwrap()))?; // replace dL/dy
    /// y.sum()?.backward()?;
    /// assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![20.0, 20.0]);
    /// # Ok::<(), fsdp_autograd::AutogradError>(())
    /// ```
    pub fn register_hook<F>(&self, f: F) -> Result<HookHandle>
    where
        F: Fn(&Tensor) -> Option<Tensor> + Send + Sync + 'static,
    {
        self.register_hook_fallible(move |g| Ok(f(g)))
    }

    /// [`Tensor::register_hook`] for a hook that can fail (its error aborts backward).
    pub fn register_hook_fallible<F>(&self, f: F) -> Result<HookHandle>
    where
        F: Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync + 'static,
    {
        if !self.requires_grad() {
            return Err(AutogradError::RequiresGrad(
                "cannot register a hook on a tensor that does not require grad".into(),
            ));
        }
        let id = next_hook_id();
        let hook: TensorHookFn = Arc::new(f);
        let target = match self.grad_fn() {
            Some(e) => {
                e.node.hooks().push((e.slot, id, hook));
                HookTarget::Node(Arc::downgrade(&e.node))
            }
            None => {
                self.leaf_meta().hooks.push((id, hook));
                HookTarget::Leaf(self.weak())
            }
        };
        Ok(HookHandle { target, id })
    }

    /// Registers a hook on a leaf that runs once the leaf's gradient for the current backward
    /// is final (accumulated into `.grad`); it receives the leaf. Hooks run in registration
    /// order.
    ///
    /// # Errors
    /// [`AutogradError::RequiresGrad`] on non-leaves or leaves that do not require grad.
    pub fn register_post_accumulate_grad_hook<F>(&self, f: F) -> Result<HookHandle>
    where
        F: Fn(&Tensor) + Send + Sync + 'static,
    {
        self.register_post_accumulate_grad_hook_fallible(move |t| {
            f(t);
            Ok(())
        })
    }

    /// [`Tensor::register_post_accumulate_grad_hook`] for a hook that can fail.
    pub fn register_post_accumulate_grad_hook_fallible<F>(&self, f: F) -> Result<HookHandle>
    where
        F: Fn(&Tensor) -> Result<()> + Send + Sync + 'static,
    {
        if !self.is_leaf() || !self.requires_grad() {
            return Err(AutogradError::RequiresGrad(
                "post-accumulate-grad hooks can only be registered on leaves that require grad"
                    .into(),
            ));
        }
        let id = next_hook_id();
        let hook: PostHookFn = Arc::new(f);
        self.leaf_meta().post_hooks.push((id, hook));
        Ok(HookHandle {
            target: HookTarget::LeafPost(self.weak()),
            id,
        })
    }
}
