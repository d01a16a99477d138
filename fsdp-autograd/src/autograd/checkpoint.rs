//! Saved tensors (with the version check) and activation checkpointing.
//!
//! Checkpointing is *non-reentrant*: [`checkpoint`] runs `f` normally, so the autograd graph of
//! the region is complete (the engine's dependency counts, hooks and gradient accumulation are
//! exactly those of the un-checkpointed model), but every tensor an operation inside the region
//! saves for backward is replaced by a placeholder. The first time backward unpacks one of them,
//! `f` is run again (grad mode on, on detached copies of the region's inputs) and the tensors it
//! saves, in the same order, fill the placeholders; the recomputed graph itself is discarded.
//! Kernels are deterministic, so the recomputed values — and therefore the gradients — are
//! bitwise those of a run without checkpointing. Hooks registered during the recompute on
//! tensors of the discarded graph never fire, so tensor hooks, post-accumulate-grad hooks and
//! queued callbacks fire once, as without checkpointing (module forward hooks do run again
//! during the recompute, as in PyTorch).
//!
//! Limitations: checkpoint regions do not nest (an error); `f` must save the same sequence of
//! tensors when re-run (it must not branch on data or on global state that changed).

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::context::{is_grad_enabled, GradModeGuard};
use crate::error::{AutogradError, Result};
use crate::tensor::Tensor;

/// The function a checkpoint region runs (and re-runs in backward).
pub type CheckpointFn = Arc<dyn Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync>;

enum FrameCtx {
    Record(Arc<Frame>),
    Recompute(Rc<RefCell<Vec<(Tensor, u64)>>>),
}

thread_local! {
    static FRAMES: RefCell<Vec<FrameCtx>> = const { RefCell::new(Vec::new()) };
}

struct FramePop;
impl Drop for FramePop {
    fn drop(&mut self) {
        FRAMES.with(|f| {
            f.borrow_mut().pop();
        });
    }
}

enum FrameState {
    Pending,
    Done(Vec<Option<(Tensor, u64)>>),
}

/// One checkpoint region: its function, inputs, and (after recompute) the recomputed saves.
struct Frame {
    f: CheckpointFn,
    inputs: Vec<(Tensor, u64)>,
    recorded: AtomicUsize,
    state: Mutex<FrameState>,
}

impl Frame {
    fn take(&self, index: usize, op: &'static str) -> Result<(Tensor, u64)> {
        let pending = matches!(
            *self.state.lock().unwrap_or_else(|e| e.into_inner()),
            FrameState::Pending
        );
        if pending {
            let values = self.recompute()?;
            *self.state.lock().unwrap_or_else(|e| e.into_inner()) = FrameState::Done(values);
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match &mut *st {
            FrameState::Done(v) => v.get_mut(index).and_then(Option::take).ok_or_else(|| {
                AutogradError::Checkpoint(format!(
                    "saved tensor {index} of `{op}` was already used (backward through a \
                     checkpointed region twice?)"
                ))
            }),
            FrameState::Pending => unreachable!("state set above"),
        }
    }

    fn recompute(&self) -> Result<Vec<Option<(Tensor, u64)>>> {
        let mut inputs = Vec::with_capacity(self.inputs.len());
        for (t, v) in &self.inputs {
            if t.version() != *v {
                return Err(AutogradError::SavedTensorModified {
                    op: "checkpoint (region input)",
                    saved: *v,
                    current: t.version(),
                });
            }
            let d = t.detach();
            if t.requires_grad() {
                d.set_requires_grad(true)?;
            }
            inputs.push(d);
        }
        let store = Rc::new(RefCell::new(Vec::new()));
        {
            FRAMES.with(|f| f.borrow_mut().push(FrameCtx::Recompute(Rc::clone(&store))));
            let _pop = FramePop;
            let _grad = GradModeGuard::new(true);
            let outputs = (self.f)(&inputs)?;
            drop(outputs); // the recomputed graph is discarded; only its saved tensors are used
        }
        let saved = Rc::try_unwrap(store)
            .map(RefCell::into_inner)
            .unwrap_or_else(|rc| rc.borrow().clone());
        let expected = self.recorded.load(Ordering::Acquire);
        if saved.len() != expected {
            return Err(AutogradError::Checkpoint(format!(
                "the recomputed forward saved {} tensors but the original saved {expected}; the \
                 checkpointed function must do the same operations when run again",
                saved.len()
            )));
        }
        Ok(saved.into_iter().map(Some).collect())
    }
}

enum SavedInner {
    Plain { tensor: Tensor, version: u64 },
    Deferred { frame: Arc<Frame>, index: usize },
}

/// A tensor saved for backward, with the version it had when saved (`None` once used).
pub(crate) struct SavedTensor(Option<SavedInner>);

impl SavedTensor {
    /// Saves `t` (inside a checkpoint region: a placeholder filled by recomputation).
    pub(crate) fn new(t: &Tensor) -> SavedTensor {
        FRAMES.with(|f| match f.borrow().last() {
            Some(FrameCtx::Record(frame)) => SavedTensor(Some(SavedInner::Deferred {
                frame: Arc::clone(frame),
                index: frame.recorded.fetch_add(1, Ordering::AcqRel),
            })),
            Some(FrameCtx::Recompute(store)) => {
                store.borrow_mut().push((t.clone(), t.version()));
                SavedTensor(Some(SavedInner::Plain {
                    tensor: t.clone(),
                    version: t.version(),
                }))
            }
            None => SavedTensor(Some(SavedInner::Plain {
                tensor: t.clone(),
                version: t.version(),
            })),
        })
    }

    /// Takes the saved tensor out (it is freed when the caller drops it), checking that it was
    /// not modified in place since it was saved.
    pub(crate) fn unpack(&mut self, op: &'static str) -> Result<Tensor> {
        let (tensor, version) = match self.0.take() {
            Some(SavedInner::Plain { tensor, version }) => (tensor, version),
            Some(SavedInner::Deferred { frame, index }) => frame.take(index, op)?,
            None => return Err(AutogradError::GraphConsumed { op }),
        };
        if tensor.version() != version {
            return Err(AutogradError::SavedTensorModified {
                op,
                saved: version,
                current: tensor.version(),
            });
        }
        Ok(tensor)
    }
}

/// Runs `f(inputs)` without keeping the tensors its operations save for backward; backward
/// recomputes them by running `f` again. Gradients are bitwise equal to running `f` directly.
///
/// Outside grad mode this simply calls `f`.
///
/// # Errors
/// `f`'s errors; [`AutogradError::Checkpoint`] when called inside another checkpoint region.
/// In backward: [`AutogradError::Checkpoint`] if the recompute saved a different number of
/// tensors, [`AutogradError::SavedTensorModified`] if an input was modified in place.
///
/// ```
/// use fsdp_alloc::{DType, Device};
/// use fsdp_autograd::{checkpoint, Tensor};
///
/// let dev = Device::cpu(0);
/// let w = Tensor::from_vec(vec![0.5f32, -1.0, 2.0], &[3], &dev)?.requires_grad_(true)?;
/// let block = |xs: &[Tensor]| -> fsdp_autograd::Result<Vec<Tensor>> {
///     Ok(vec![xs[0].mul(&xs[1])?.gelu()?])
/// };
/// let y = checkpoint(block, &[w.clone(), w.clone()])?;
/// y[0].sum()?.backward()?;
/// let g1 = w.grad().unwrap().to_vec::<f32>()?;
/// w.zero_grad();
/// block(&[w.clone(), w.clone()])?[0].sum()?.backward()?;
/// assert_eq!(g1, w.grad().unwrap().to_vec::<f32>()?); // bitwise
/// # Ok::<(), fsdp_autograd::AutogradError>(())
/// ```
pub fn checkpoint<F>(f: F, inputs: &[Tensor]) -> Result<Vec<Tensor>>
where
    F: Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + 'static,
{
    checkpoint_arc(Arc::new(f), inputs)
}

/// [`checkpoint`] with a shared function object.
pub fn checkpoint_arc(f: CheckpointFn, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
    if !is_grad_enabled() {
        return f(inputs);
    }
    let nested = FRAMES.with(|fr| !fr.borrow().is_empty());
    if nested {
        return Err(AutogradError::Checkpoint(
            "checkpoint regions cannot nest; checkpoint the outer or the inner region only".into(),
        ));
    }
    let frame = Arc::new(Frame {
        f: Arc::clone(&f),
        inputs: inputs.iter().map(|t| (t.clone(), t.version())).collect(),
        recorded: AtomicUsize::new(0),
        state: Mutex::new(FrameState::Pending),
    });
    FRAMES.with(|fr| fr.borrow_mut().push(FrameCtx::Record(frame)));
    let _pop = FramePop;
    f(inputs)
}
