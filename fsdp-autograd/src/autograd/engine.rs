//! The backward engine (documented on the public [`crate::autograd`] module).

use std::cell::RefCell;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;

use crate::autograd::node::{Edge, GradMeta, Node, NodeKind};
use crate::context::GradModeGuard;
use crate::error::{AutogradError, Result};
use crate::tensor::Tensor;

type Callback = Box<dyn FnOnce() -> Result<()>>;

thread_local! {
    static CALLBACKS: RefCell<Vec<VecDeque<Callback>>> = const { RefCell::new(Vec::new()) };
}

struct CallbackFrame;
impl Drop for CallbackFrame {
    fn drop(&mut self) {
        CALLBACKS.with(|c| {
            c.borrow_mut().pop();
        });
    }
}

/// Queues `f` to run when the backward currently running on this thread finishes (after every
/// node and hook). Call it from inside a backward hook.
///
/// # Errors
/// [`AutogradError::NotInBackward`] if no backward is running on this thread.
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use fsdp_alloc::{DType, Device};
/// use fsdp_autograd::{queue_callback, Tensor};
///
/// let dev = Device::cpu(0);
/// let w = Tensor::ones(&[3], DType::F32, &dev)?.requires_grad_(true)?;
/// let log = Arc::new(Mutex::new(Vec::new()));
/// let l = log.clone();
/// w.register_post_accumulate_grad_hook(move |_| {
///     l.lock().unwrap().push("post-accumulate");
///     let l2 = l.clone();
///     queue_callback(move || l2.lock().unwrap().push("end of backward")).unwrap();
/// })?;
/// w.sum()?.backward()?;
/// assert_eq!(*log.lock().unwrap(), ["post-accumulate", "end of backward"]);
/// assert!(queue_callback(|| {}).is_err()); // not inside backward
/// # Ok::<(), fsdp_autograd::AutogradError>(())
/// ```
pub fn queue_callback(f: impl FnOnce() + 'static) -> Result<()> {
    queue_callback_fallible(move || {
        f();
        Ok(())
    })
}

/// [`queue_callback`] for a callback that can fail (its error becomes backward's error).
pub fn queue_callback_fallible(f: impl FnOnce() -> Result<()> + 'static) -> Result<()> {
    CALLBACKS.with(|c| match c.borrow_mut().last_mut() {
        Some(q) => {
            q.push_back(Box::new(f));
            Ok(())
        }
        None => Err(AutogradError::NotInBackward),
    })
}

/// True while a backward is running on this thread (e.g. inside a hook).
pub fn in_backward() -> bool {
    CALLBACKS.with(|c| !c.borrow().is_empty())
}

struct NodeState {
    node: Arc<Node>,
    deps: usize,
    buf: Vec<Option<Tensor>>,
    /// Some gradient was folded in by `BackwardFn::accept` (so the node must run).
    eager: bool,
}

#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Ready {
    accumulate: bool,
    seq: u64,
    key: usize,
}

fn key(n: &Arc<Node>) -> usize {
    Arc::as_ptr(n) as usize
}

/// The state of `node`, created on first sight (the node is then pushed on `stack` so that its
/// inputs are discovered too).
fn discover<'a>(
    states: &'a mut HashMap<usize, NodeState>,
    stack: &mut Vec<Arc<Node>>,
    node: &Arc<Node>,
) -> &'a mut NodeState {
    states.entry(key(node)).or_insert_with(|| {
        stack.push(Arc::clone(node));
        NodeState {
            node: Arc::clone(node),
            deps: 0,
            buf: vec![None; node.meta.len()],
            eager: false,
        }
    })
}

fn check_meta(g: &Tensor, meta: &GradMeta, what: impl Fn() -> String) -> Result<()> {
    if g.shape() != meta.shape.as_slice() || g.dtype() != meta.dtype {
        return Err(AutogradError::Backward(format!(
            "{}: got a gradient of shape {:?} and dtype {}, expected shape {:?} and dtype {}",
            what(),
            g.shape(),
            g.dtype(),
            meta.shape,
            meta.dtype
        )));
    }
    Ok(())
}

/// Sums `g` into a gradient slot.
fn add_into(slot: &mut Option<Tensor>, g: Tensor) -> Result<()> {
    *slot = Some(match slot.take() {
        None => g,
        Some(existing) => {
            if existing.is_exclusive() {
                existing.add_(&g)?;
                existing
            } else {
                existing.add(&g)?
            }
        }
    });
    Ok(())
}

/// Computes the gradients of `roots` w.r.t. the leaves of their graph, accumulating them into
/// the leaves' `.grad`. `grads[i]` is the gradient of `roots[i]` (`None`: ones, which requires a
/// one-element root). See the [`crate::autograd`] docs for the order and the hooks.
///
/// # Errors
/// [`AutogradError::Backward`] if a root does not require grad or a seed gradient does not fit;
/// [`AutogradError::GraphConsumed`] when backpropagating through a graph a second time;
/// [`AutogradError::SavedTensorModified`] when a saved tensor was modified in place; errors of
/// hooks and callbacks; launch errors of the backward kernels.
pub fn backward(roots: &[Tensor], grads: &[Option<Tensor>]) -> Result<()> {
    if roots.len() != grads.len() {
        return Err(AutogradError::Backward(format!(
            "{} roots but {} seed gradients",
            roots.len(),
            grads.len()
        )));
    }
    let _no_grad = GradModeGuard::new(false);
    CALLBACKS.with(|c| c.borrow_mut().push(VecDeque::new()));
    let _frame = CallbackFrame;

    // Seeds.
    let mut seeds: Vec<(Edge, Tensor)> = Vec::with_capacity(roots.len());
    for (root, g) in roots.iter().zip(grads) {
        let edge = root.grad_edge().ok_or_else(|| {
            AutogradError::Backward(
                "the tensor does not require grad and has no grad function; mark a leaf with \
                 `set_requires_grad(true)` before the forward"
                    .into(),
            )
        })?;
        let g = match g {
            Some(g) => g.clone(),
            None => {
                if root.numel() != 1 {
                    return Err(AutogradError::Backward(format!(
                        "a seed gradient is needed for a non-scalar root (shape {:?}); use \
                         `backward_with_grad`",
                        root.shape()
                    )));
                }
                Tensor::ones(root.shape(), root.dtype(), root.device())?
            }
        };
        check_meta(&g, &edge.node.meta[edge.slot], || "seed gradient".into())?;
        seeds.push((edge, g));
    }

    // Discover the graph and count dependencies.
    let mut states: HashMap<usize, NodeState> = HashMap::new();
    let mut stack: Vec<Arc<Node>> = Vec::new();
    for (e, _) in &seeds {
        discover(&mut states, &mut stack, &e.node);
    }
    while let Some(n) = stack.pop() {
        for e in n.next.iter().flatten() {
            discover(&mut states, &mut stack, &e.node).deps += 1;
        }
    }

    let mut ready = BinaryHeap::new();
    for (e, g) in seeds {
        let k = key(&e.node);
        let st = states.get_mut(&k).expect("seed node discovered");
        add_into(&mut st.buf[e.slot], g)?;
        if st.deps == 0 && !ready.iter().any(|r: &Ready| r.key == k) {
            ready.push(Ready {
                accumulate: e.node.is_accumulate(),
                seq: e.node.seq,
                key: k,
            });
        }
    }

    while let Some(r) = ready.pop() {
        let st = states.get_mut(&r.key).expect("ready node has state");
        let node = Arc::clone(&st.node);
        let grads = std::mem::take(&mut st.buf);
        let eager = st.eager;
        let grads = run_tensor_hooks(&node, grads)?;
        match &node.kind {
            NodeKind::Accumulate(leaf) => {
                if let Some(Some(g)) = grads.into_iter().next() {
                    accumulate_leaf(leaf, g)?;
                    let hooks: Vec<_> = leaf
                        .leaf_meta()
                        .post_hooks
                        .iter()
                        .map(|(_, h)| Arc::clone(h))
                        .collect();
                    for h in hooks {
                        h(leaf)?;
                    }
                }
            }
            NodeKind::Function(f) => {
                let outputs = if grads.iter().all(Option::is_none) && !eager {
                    vec![None; node.next.len()]
                } else {
                    let out = f.lock().unwrap_or_else(|e| e.into_inner()).run(grads)?;
                    if out.len() != node.next.len() {
                        return Err(AutogradError::Backward(format!(
                            "internal: `{}` returned {} gradients for {} inputs",
                            node.name,
                            out.len(),
                            node.next.len()
                        )));
                    }
                    out
                };
                for (edge, g) in node.next.iter().zip(outputs) {
                    let Some(edge) = edge else { continue };
                    let k = key(&edge.node);
                    let target = states.get_mut(&k).expect("edge target discovered");
                    if let Some(g) = g {
                        check_meta(&g, &edge.node.meta[edge.slot], || {
                            format!(
                                "internal: gradient from `{}` to `{}`",
                                node.name, edge.node.name
                            )
                        })?;
                        // Nodes that can fold a gradient in on arrival (split) take it now, so
                        // it is freed at once instead of waiting for the node's other inputs.
                        let hooked = edge.node.hooks().iter().any(|(s, _, _)| *s == edge.slot);
                        let rest = match (&edge.node.kind, hooked) {
                            (NodeKind::Function(f), false) => f
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .accept(edge.slot, g)?,
                            _ => Some(g),
                        };
                        match rest {
                            Some(g) => add_into(&mut target.buf[edge.slot], g)?,
                            None => target.eager = true,
                        }
                    }
                    target.deps -= 1;
                    if target.deps == 0 {
                        ready.push(Ready {
                            accumulate: edge.node.is_accumulate(),
                            seq: edge.node.seq,
                            key: k,
                        });
                    }
                }
            }
        }
    }

    // End-of-backward callbacks (they may queue more).
    loop {
        let next = CALLBACKS.with(|c| c.borrow_mut().last_mut().and_then(VecDeque::pop_front));
        match next {
            Some(cb) => cb()?,
            None => break,
        }
    }
    Ok(())
}

fn run_tensor_hooks(node: &Node, mut grads: Vec<Option<Tensor>>) -> Result<Vec<Option<Tensor>>> {
    let hooks: Vec<(usize, crate::autograd::node::TensorHookFn)> = match &node.kind {
        NodeKind::Accumulate(leaf) => leaf
            .leaf_meta()
            .hooks
            .iter()
            .map(|(_, h)| (0, Arc::clone(h)))
            .collect(),
        NodeKind::Function(_) => node
            .hooks()
            .iter()
            .map(|(s, _, h)| (*s, Arc::clone(h)))
            .collect(),
    };
    for (slot, h) in hooks {
        let Some(g) = grads.get(slot).and_then(Option::as_ref) else {
            continue;
        };
        if let Some(new) = h(g)? {
            check_meta(&new, &node.meta[slot], || {
                format!(
                    "a tensor hook's replacement gradient (output of `{}`)",
                    node.name
                )
            })?;
            grads[slot] = Some(new);
        }
    }
    Ok(grads)
}

fn accumulate_leaf(leaf: &Tensor, g: Tensor) -> Result<()> {
    let existing = leaf.leaf_meta().grad.clone();
    let new = match existing {
        None => {
            if g.is_exclusive() {
                g
            } else {
                g.contiguous_copy()?
            }
        }
        Some(e) => {
            e.add_(&g)?;
            return Ok(());
        }
    };
    leaf.leaf_meta().grad = Some(new);
    Ok(())
}

impl Tensor {
    /// Backward from this one-element tensor (seed gradient 1). See [`backward`].
    pub fn backward(&self) -> Result<()> {
        backward(std::slice::from_ref(self), &[None])
    }

    /// Backward from this tensor with the seed gradient `grad` (same shape and dtype).
    pub fn backward_with_grad(&self, grad: &Tensor) -> Result<()> {
        backward(std::slice::from_ref(self), &[Some(grad.clone())])
    }
}
