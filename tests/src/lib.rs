//! Shared helpers for fsdp-rs's cross-crate tests (the tests themselves live in `tests/tests`):
//! running W ranks on a backend ([`Ranks`]: thread ranks here, or this process's rank of a
//! multi-process group such as MPI), deterministic synthetic batches, and the plain local
//! reference that FSDP must match bit for bit.
#![deny(missing_docs)]

use std::sync::Arc;

use fsdp_alloc::Device;
use fsdp_autograd::nn::{named_parameters, Module};
use fsdp_autograd::{cross_entropy, no_grad, Tensor};
use fsdp_collectives::{ProcessGroup, ThreadGroup};

/// The group factory the laws take: where a run's ranks come from.
#[derive(Debug, Clone)]
pub enum Ranks {
    /// `W` ranks as threads of this process, over a fresh [`ThreadGroup`].
    Threads(usize),
    /// This process is one rank of a multi-process group (MPI, later NCCL): only that rank runs
    /// here; the other processes run theirs.
    Process(Arc<dyn ProcessGroup>),
}

impl Ranks {
    /// Number of ranks of the run.
    pub fn world(&self) -> usize {
        match self {
            Ranks::Threads(w) => *w,
            Ranks::Process(g) => g.size(),
        }
    }
}

/// Runs `f(rank, group)` for every rank of `ranks` that lives in this process, returning
/// `(rank, result)` pairs in rank order: all of them for [`Ranks::Threads`], this process's own
/// for [`Ranks::Process`]. The same law body therefore runs on every backend.
pub fn run_on<T, F>(ranks: &Ranks, f: F) -> Vec<(usize, T)>
where
    T: Send + 'static,
    F: Fn(usize, Arc<dyn ProcessGroup>) -> T + Send + Sync + 'static,
{
    match ranks {
        Ranks::Threads(w) => run_ranks(*w, f).into_iter().enumerate().collect(),
        Ranks::Process(g) => vec![(g.rank(), f(g.rank(), Arc::clone(g)))],
    }
}

/// Runs `f(rank, group)` on `world` threads, one per rank, and returns the results in rank order.
/// A panic on any rank is re-raised with its rank.
pub fn run_ranks<T, F>(world: usize, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(usize, Arc<dyn ProcessGroup>) -> T + Send + Sync + 'static,
{
    let f = Arc::new(f);
    let handles: Vec<_> = ThreadGroup::new(world)
        .into_iter()
        .enumerate()
        .map(|(r, g)| {
            let f = Arc::clone(&f);
            std::thread::Builder::new()
                .name(format!("rank{r}"))
                .spawn(move || f(r, Arc::new(g) as Arc<dyn ProcessGroup>))
                .expect("spawn rank thread")
        })
        .collect();
    handles
        .into_iter()
        .enumerate()
        .map(|(r, h)| match h.join() {
            Ok(v) => v,
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                panic!("rank {r} panicked: {msg}")
            }
        })
        .collect()
}

/// A deterministic, learnable token batch: sequences that count up by a per-sequence stride
/// (mod `vocab`), so the next token is predictable from the previous two. Returns (ids, targets),
/// each `batch × seq` i64 values; `index` selects the micro-batch (step × world + rank).
pub fn token_batch(index: usize, batch: usize, seq: usize, vocab: usize) -> (Vec<i64>, Vec<i64>) {
    let mut ids = Vec::with_capacity(batch * seq);
    let mut targets = Vec::with_capacity(batch * seq);
    for b in 0..batch {
        let k = index * batch + b;
        let start = (k * 7 + 3) % vocab;
        let stride = 1 + (k % 3);
        for t in 0..seq {
            ids.push(((start + stride * t) % vocab) as i64);
            targets.push(((start + stride * (t + 1)) % vocab) as i64);
        }
    }
    (ids, targets)
}

/// Loss of one micro-batch: mean cross-entropy scaled by `1 / world` (so that summing the
/// gradients of `world` micro-batches gives the gradient of the mean over the global batch).
pub fn micro_loss(logits: &Tensor, targets: &Tensor, world: usize) -> Tensor {
    let vocab = *logits
        .shape()
        .last()
        .expect("logits have a vocab dimension");
    let flat = logits
        .reshape(&[logits.numel() / vocab, vocab])
        .expect("reshape logits");
    let t = targets
        .reshape(&[targets.numel()])
        .expect("reshape targets");
    cross_entropy(&flat, &t)
        .and_then(|l| l.scale(1.0 / world as f32))
        .expect("loss")
}

/// Trains `model` locally the way `world` FSDP ranks would, for `steps` SGD steps: each step runs
/// the `world` micro-batches `batch(step, r)` one after another, accumulating gradients, in groups
/// of `group` consecutive micro-batches (`group == world` for plain accumulation; the shard-group
/// size for hybrid sharding, whose reduction adds group sums), then `p -= lr * grad`.
///
/// Returns the per-step, per-micro-batch losses and the final parameters by name.
#[allow(clippy::type_complexity)]
pub fn train_local<M: Module>(
    model: &M,
    device: &Device,
    world: usize,
    group: usize,
    steps: usize,
    lr: f32,
    batch: &dyn Fn(usize, usize, &Device) -> (Tensor, Tensor),
) -> (Vec<Vec<f32>>, Vec<(String, Vec<f32>)>) {
    assert!(group >= 1 && world % group == 0, "group must divide world");
    let params = named_parameters(model);
    let mut losses = Vec::new();
    for step in 0..steps {
        let mut step_losses = Vec::new();
        let mut total: Vec<Option<Tensor>> = vec![None; params.len()];
        for g in 0..world / group {
            for r in g * group..(g + 1) * group {
                let (x, y) = batch(step, r, device);
                let logits = model.call(&x).expect("forward");
                let loss = micro_loss(&logits, &y, world);
                step_losses.push(loss.item().expect("loss value"));
                loss.backward().expect("backward");
            }
            // Add this group's accumulated gradient into the running total (in group order).
            for ((_, p), acc) in params.iter().zip(total.iter_mut()) {
                let t = p.get().expect("parameter");
                let Some(gr) = t.grad() else { continue };
                let gr = gr.contiguous_copy().expect("copy grad");
                match acc {
                    None => *acc = Some(gr),
                    Some(a) => no_grad(|| a.add_(&gr)).expect("accumulate"),
                }
                t.zero_grad();
            }
        }
        for ((_, p), acc) in params.iter().zip(&total) {
            if let Some(g) = acc {
                let t = p.get().expect("parameter");
                no_grad(|| t.add_scaled_(g, -lr)).expect("sgd");
            }
        }
        losses.push(step_losses);
    }
    let finals = params
        .iter()
        .map(|(n, p)| {
            (
                n.clone(),
                p.get().expect("parameter").to_vec::<f32>().expect("read"),
            )
        })
        .collect();
    (losses, finals)
}

/// `Tensor` pair for [`token_batch`] on `device`: ids and targets of shape `[batch, seq]`.
pub fn token_tensors(
    index: usize,
    batch: usize,
    seq: usize,
    vocab: usize,
    device: &Device,
) -> (Tensor, Tensor) {
    let (ids, targets) = token_batch(index, batch, seq, vocab);
    (
        Tensor::from_vec(ids, &[batch, seq], device).expect("ids"),
        Tensor::from_vec(targets, &[batch, seq], device).expect("targets"),
    )
}

/// Parameters by fully-qualified name, with their values on the host.
pub type Named = Vec<(String, Vec<f32>)>;

/// FSDP's full (unsharded) parameters by name, as [`Named`] (gathers every unit; collective).
pub fn full_named<M: Module + 'static>(fsdp: &fsdp_core::Fsdp<M>) -> Named {
    fsdp.full_parameters()
        .expect("gather the full parameters")
        .into_iter()
        .map(|(n, _, v)| (n, v))
        .collect()
}

/// One plain FSDP training step on `(x, y)`: forward, [`micro_loss`] over `world` ranks,
/// backward, SGD on the shards with `lr`, zero the gradients, synchronize. Returns the loss.
pub fn fsdp_sgd_step<M: Module + 'static>(
    fsdp: &fsdp_core::Fsdp<M>,
    x: &Tensor,
    y: &Tensor,
    world: usize,
    lr: f32,
) -> f32 {
    let loss = micro_loss(&fsdp.forward(x).expect("forward"), y, world);
    let value = loss.item().expect("loss value");
    loss.backward().expect("backward");
    fsdp.sgd_step(lr).expect("sgd step");
    fsdp.zero_grad();
    fsdp.synchronize().expect("synchronize");
    value
}

/// `v` sorted by name (FSDP lists parameters unit by unit, a local model module by module).
pub fn sorted_by_name<T>(mut v: Vec<(String, T)>) -> Vec<(String, T)> {
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Bitwise comparison of two named parameter lists; returns a description of the first
/// difference.
pub fn first_difference(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> Option<String> {
    if a.len() != b.len() {
        return Some(format!("{} parameters vs {}", a.len(), b.len()));
    }
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        if na != nb {
            return Some(format!("name {na} vs {nb}"));
        }
        if va.len() != vb.len() {
            return Some(format!("{na}: {} elements vs {}", va.len(), vb.len()));
        }
        if let Some(i) = va
            .iter()
            .zip(vb)
            .position(|(x, y)| x.to_bits() != y.to_bits())
        {
            return Some(format!("{na}[{i}]: {} vs {}", va[i], vb[i]));
        }
    }
    None
}
