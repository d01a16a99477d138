//! One training step of one rank, replayed as FSDP issues it: the host program (the hooks of
//! `fsdp.rs` in the order autograd fires them, the rate limiter's blocking) drives a compute
//! stream, an unshard stream, a reduce stream and one in-order link per process group (as on one
//! NCCL communicator, and as fsdp-collectives' `LinkModel` emulates it). Every collective takes
//! `latency + ring bytes / bandwidth`. The same walk counts the bytes the caching allocator has
//! allocated, in host order, for the peak.
//!
//! Steady state is modelled (the second step on): the previous iteration's forward order is
//! known (forward prefetch, the last unit kept unsharded), sharded gradients were zeroed, the
//! optimizer state exists.

use std::collections::VecDeque;

use crate::candidate::PlanConfig;
use crate::cluster::{
    ring_all_gather_bytes, ring_all_reduce_bytes, Batch, Cluster, GroupShape, Link,
};
use crate::hardware::{Collective, Hardware};
use crate::model::ModelDesc;
use fsdp_core::config::BackwardPrefetch;
use fsdp_core::strategy::ShardOver;

/// The caching allocator rounds every request up to this many bytes.
const ROUND: u64 = 512;

fn round(bytes: f64) -> u64 {
    let b = bytes.max(0.0).ceil() as u64;
    b.max(1).div_ceil(ROUND) * ROUND
}

/// Per-rank bytes at the moment of the peak, by what holds them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MemoryBreakdown {
    /// Sharded f32 parameters (every unit's chunk; whole units under NoShard).
    pub shards: u64,
    /// Sharded f32 gradients already reduced in this step (whole under NoShard).
    pub shard_grads: u64,
    /// Optimizer state (slots × shard bytes).
    pub optimizer: u64,
    /// Unsharded (gathered) parameters in flight.
    pub unsharded: u64,
    /// Unsharded flat gradients not yet reduced.
    pub flat_grads: u64,
    /// Activations, their gradients, weight-gradient temporaries and the inputs.
    pub activations: u64,
}

impl MemoryBreakdown {
    /// The sum: per-rank allocated bytes.
    pub fn total(&self) -> u64 {
        self.shards
            + self.shard_grads
            + self.optimizer
            + self.unsharded
            + self.flat_grads
            + self.activations
    }
}

/// What one step costs on one rank under one [`PlanConfig`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepEstimate {
    /// Predicted wall time of a step (forward, backward, optimizer, synchronization), seconds.
    pub step_s: f64,
    /// Compute alone (forward + backward + optimizer), seconds.
    pub compute_s: f64,
    /// Link busy time summed over the rank's groups, seconds.
    pub comm_s: f64,
    /// Peak allocated bytes per rank.
    pub peak_bytes: u64,
    /// The peak's breakdown.
    pub peak: MemoryBreakdown,
    /// Bytes this rank moves over inter-node links per step (ring traffic).
    pub cross_node_bytes: f64,
    /// Time the host thread spent blocked in the rate limiter, seconds.
    pub limiter_wait_s: f64,
    /// Busy time of the links of groups inside one node, seconds.
    pub intra_busy_s: f64,
    /// Busy time of the links of groups that span nodes, seconds.
    pub inter_busy_s: f64,
    /// FLOPs the rank executes in forward and backward (activation recomputation included,
    /// the optimizer not): the "hardware FLOPs" of a step.
    pub hardware_flops: f64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Cat {
    Shards,
    ShardGrads,
    Optimizer,
    Unsharded,
    FlatGrads,
    Activations,
}

struct Memory {
    cur: MemoryBreakdown,
    peak: MemoryBreakdown,
}

impl Memory {
    fn slot(&mut self, c: Cat) -> &mut u64 {
        match c {
            Cat::Shards => &mut self.cur.shards,
            Cat::ShardGrads => &mut self.cur.shard_grads,
            Cat::Optimizer => &mut self.cur.optimizer,
            Cat::Unsharded => &mut self.cur.unsharded,
            Cat::FlatGrads => &mut self.cur.flat_grads,
            Cat::Activations => &mut self.cur.activations,
        }
    }
    fn alloc(&mut self, c: Cat, bytes: u64) {
        *self.slot(c) += bytes;
        if self.cur.total() > self.peak.total() {
            self.peak = self.cur;
        }
    }
    fn free(&mut self, c: Cat, bytes: u64) {
        let s = self.slot(c);
        *s = s.saturating_sub(bytes);
    }
}

/// A process group's in-order link.
struct Group<'a> {
    link: Link,
    size: usize,
    free_at: f64,
    busy: f64,
    cross_node: bool,
    /// With hardware: the group's shape and the two links, priced as NCCL does.
    hier: Option<(&'a Hardware, GroupShape, Link, Link)>,
}

impl Group<'_> {
    /// Runs a collective of `bytes` per rank that may start at `ready`; returns its end.
    fn run(&mut self, ready: f64, bytes: f64, kind: Collective, cross: &mut f64) -> f64 {
        if self.size <= 1 {
            return ready;
        }
        let start = ready.max(self.free_at);
        let t = match self.hier {
            Some((hw, shape, intra, inter)) => hw.collective_time(
                kind,
                bytes,
                shape.size,
                shape.nodes,
                shape.per_node,
                intra,
                inter,
            ),
            None => self.link.time(bytes),
        };
        self.free_at = start + t;
        self.busy += t;
        if self.cross_node {
            *cross += bytes;
        }
        self.free_at
    }
}

struct Sim<'a> {
    m: &'a ModelDesc,
    cfg: PlanConfig,
    tokens: f64,
    rate: f64,
    /// Host clock (the issuing thread only waits in the limiter and at the end).
    host: f64,
    compute: f64,
    compute_busy: f64,
    unshard_stream: f64,
    reduce_stream: f64,
    main: Group<'a>,
    replicate: Option<Group<'a>>,
    cross: f64,
    outstanding: VecDeque<f64>,
    limiter_wait: f64,
    unsharded: Vec<bool>,
    pending: Vec<Option<f64>>,
    post_backward_done: Vec<bool>,
    flat_grad: Vec<bool>,
    reductions: Vec<f64>,
    mem: Memory,
    factor: usize,
    hw: Option<&'a Hardware>,
    flops: f64,
}

impl<'a> Sim<'a> {
    fn sharded(&self) -> bool {
        self.cfg.strategy.is_sharded()
    }

    fn padded(&self, u: usize) -> f64 {
        let n = self.m.units[u].numel;
        let f = self.factor.max(1);
        (n.div_ceil(f) * f) as f64
    }

    fn chunk(&self, u: usize) -> f64 {
        self.padded(u) / self.factor.max(1) as f64
    }

    fn gathered_bytes(&self, u: usize) -> f64 {
        self.padded(u) * self.m.compute_bytes as f64
    }

    fn run_compute(&mut self, secs: f64) {
        let start = self.compute.max(self.host);
        self.compute = start + secs;
        self.compute_busy += secs;
    }

    /// Runs `flops` of work touching `hbm_bytes` of device memory: at the cluster's rate, or
    /// with hardware on the roofline of the model's compute dtype.
    fn work(&mut self, flops: f64, hbm_bytes: f64) {
        let secs = match self.hw {
            Some(hw) => hw.compute_time(flops, hbm_bytes, self.m.compute_bytes),
            None => flops / self.rate,
        };
        self.flops += flops;
        self.run_compute(secs);
    }

    fn acquire(&mut self) {
        if !self.cfg.limit_all_gathers {
            return;
        }
        let n = self.cfg.max_inflight_all_gathers.max(1);
        loop {
            while self.outstanding.front().is_some_and(|&t| t <= self.host) {
                self.outstanding.pop_front();
            }
            if self.outstanding.len() < n {
                return;
            }
            let oldest = self.outstanding.pop_front().expect("non-empty");
            self.limiter_wait += oldest - self.host;
            self.host = oldest;
        }
    }

    fn unshard(&mut self, u: usize) {
        if self.unsharded[u] {
            return;
        }
        if self.sharded() {
            self.acquire();
            self.mem
                .alloc(Cat::Unsharded, round(self.gathered_bytes(u)));
            let bytes = ring_all_gather_bytes(self.gathered_bytes(u), self.factor);
            let ready = self.unshard_stream.max(self.host);
            let end = self
                .main
                .run(ready, bytes, Collective::AllGather, &mut self.cross);
            self.unshard_stream = end;
            self.pending[u] = Some(end);
        }
        self.unsharded[u] = true;
    }

    fn wait_unshard(&mut self, u: usize) {
        if let Some(t) = self.pending[u].take() {
            self.compute = self.compute.max(t);
        }
    }

    fn reshard(&mut self, u: usize) {
        if !self.unsharded[u] || !self.sharded() {
            return;
        }
        self.unsharded[u] = false;
        self.pending[u] = None;
        self.mem.free(Cat::Unsharded, round(self.gathered_bytes(u)));
        if self.cfg.limit_all_gathers {
            let consumed = self.compute.max(self.host);
            self.outstanding.push_back(consumed);
        }
    }

    fn reduce(&mut self, u: usize) {
        let grad = self.gathered_bytes(u);
        let ready = self.reduce_stream.max(self.compute).max(self.host);
        let end = if self.sharded() {
            let rs = ring_all_gather_bytes(grad, self.factor);
            let mut end = self
                .main
                .run(ready, rs, Collective::ReduceScatter, &mut self.cross);
            if let Some(rep) = self.replicate.as_mut() {
                let shard = grad / self.factor as f64;
                let bytes = ring_all_reduce_bytes(shard, rep.size);
                end = rep.run(end, bytes, Collective::AllReduce, &mut self.cross);
            }
            // The reduced shard is kept (f32) until zero_grad; the flat gradient is freed.
            self.mem.alloc(Cat::ShardGrads, round(self.chunk(u) * 4.0));
            self.mem.free(Cat::FlatGrads, round(grad));
            end
        } else {
            let ar = ring_all_reduce_bytes(grad, self.main.size);
            let end = self
                .main
                .run(ready, ar, Collective::AllReduce, &mut self.cross);
            // NoShard: the all-reduced flat gradient is the kept gradient.
            self.mem.free(Cat::FlatGrads, round(grad));
            self.mem.alloc(Cat::ShardGrads, round(grad));
            end
        };
        self.reduce_stream = end;
        self.reductions.push(end);
    }

    /// The unit before `u` in forward order whose backward has not run.
    fn next_backward(&self, order: &[usize], u: usize) -> Option<usize> {
        let i = order.iter().position(|&x| x == u)?;
        order[..i]
            .iter()
            .rev()
            .copied()
            .find(|&x| !self.post_backward_done[x])
    }
}

/// What [`simulate`] needs beyond the model, cluster, batch and configuration.
pub(crate) struct SimOptions<'a> {
    /// Optimizer state slots per parameter.
    pub optimizer_slots: usize,
    /// GPU and fabric detail (roofline compute, NCCL's hierarchical collectives).
    pub hardware: Option<&'a Hardware>,
    /// Activation checkpointing of every unit that encloses no other unit (the root excepted):
    /// its forward keeps only its input (its first leaf's saved bytes) and is recomputed at the
    /// start of its backward.
    pub activation_checkpointing: bool,
}

/// Simulates one steady-state step. `order` is the units' forward order (by span start, outer
/// units first).
pub(crate) fn simulate(
    m: &ModelDesc,
    cluster: &Cluster,
    batch: &Batch,
    cfg: &PlanConfig,
    opts: &SimOptions<'_>,
) -> StepEstimate {
    let optimizer_slots = opts.optimizer_slots;
    let hw = opts.hardware;
    let world = cluster.world();
    let n_units = m.units.len();
    let root = m.root();
    let spec = cfg.strategy.spec();
    let factor = spec.factor(world, cfg.shard_size.max(1));
    let main_size = if spec.shard_over == ShardOver::ShardGroup {
        factor
    } else {
        world
    };
    let (main_link, main_cross) = cluster.group_link(true, main_size);
    let hier = |size: usize, stride: usize| {
        hw.map(|h| {
            (
                h,
                cluster.group_shape(size, stride),
                cluster.intra,
                cluster.inter,
            )
        })
    };
    let main_shape = cluster.group_shape(main_size, 1);
    let main = Group {
        link: main_link,
        size: main_size,
        free_at: 0.0,
        busy: 0.0,
        cross_node: if hw.is_some() {
            main_shape.nodes > 1
        } else {
            main_cross
        },
        hier: hier(main_size, 1),
    };
    let replicate = (spec.replicate_all_reduce && world / factor > 1).then(|| {
        // Replicate groups take one rank from every shard group: strided across nodes unless
        // the whole job fits in one node.
        let (link, cross_node) = cluster.group_link(false, world / factor);
        let shape = cluster.group_shape(world / factor, factor);
        Group {
            link,
            size: world / factor,
            free_at: 0.0,
            busy: 0.0,
            cross_node: if hw.is_some() {
                shape.nodes > 1
            } else {
                cross_node
            },
            hier: hier(world / factor, factor),
        }
    });
    let mut sim = Sim {
        m,
        cfg: *cfg,
        tokens: batch.tokens() as f64,
        rate: cluster.flops_per_s,
        host: 0.0,
        compute: 0.0,
        compute_busy: 0.0,
        unshard_stream: 0.0,
        reduce_stream: 0.0,
        main,
        replicate,
        cross: 0.0,
        outstanding: VecDeque::new(),
        limiter_wait: 0.0,
        unsharded: vec![false; n_units],
        pending: vec![None; n_units],
        post_backward_done: vec![false; n_units],
        flat_grad: vec![false; n_units],
        reductions: Vec::new(),
        mem: Memory {
            cur: MemoryBreakdown::default(),
            peak: MemoryBreakdown::default(),
        },
        factor,
        hw,
        flops: 0.0,
    };
    // Checkpointed units: every non-root unit whose span holds no other unit's start.
    let mut checkpointed = vec![false; n_units];
    if opts.activation_checkpointing {
        for u in m.innermost_units() {
            checkpointed[u] = u != root;
        }
    }
    // For each leaf, the checkpointed unit whose span holds it (if any).
    let ckpt_of: Vec<Option<usize>> = (0..m.leaves.len())
        .map(|i| (0..n_units).find(|&u| checkpointed[u] && m.spans[u].0 <= i && i <= m.spans[u].1))
        .collect();

    // Persistent state: shards (whole flat parameters under NoShard, which keeps them as the
    // parameters' storage) and optimizer slots.
    for u in 0..n_units {
        let shard = round(sim.chunk(u) * 4.0);
        sim.mem.alloc(Cat::Shards, shard);
        sim.mem
            .alloc(Cat::Optimizer, shard * optimizer_slots as u64);
    }
    if !sim.sharded() {
        for u in 0..n_units {
            sim.unsharded[u] = true;
        }
    }
    let tokens = sim.tokens;
    sim.mem
        .alloc(Cat::Activations, round(m.input_bytes_per_token * tokens));

    // Forward order: by span start, outer (longer) spans first.
    let mut order: Vec<usize> = (0..n_units).collect();
    order.sort_by_key(|&u| (m.spans[u].0, std::cmp::Reverse(m.spans[u].1)));
    let last_in_order = order.last().copied();

    // ---- forward ----
    for (i, leaf) in m.leaves.iter().enumerate() {
        for &u in order.iter().filter(|&&u| m.spans[u].0 == i) {
            sim.unshard(u);
            sim.wait_unshard(u);
            if cfg.forward_prefetch {
                let k = order.iter().position(|&x| x == u).expect("in order");
                if let Some(&next) = order.get(k + 1) {
                    sim.unshard(next);
                }
            }
        }
        sim.work(
            leaf.fwd_flops_per_token * tokens,
            leaf.hbm_bytes_per_token * tokens,
        );
        // Inside a checkpointed unit only its first leaf's saved bytes (the unit's input) stay.
        let keeps = ckpt_of[i].is_none_or(|u| m.spans[u].0 == i);
        if keeps {
            sim.mem
                .alloc(Cat::Activations, round(leaf.saved_bytes_per_token * tokens));
        }
        if i == m.spans[root].1 {
            sim.mem
                .alloc(Cat::Activations, round(m.output_bytes_per_token * tokens));
        }
        // Post-forward, inner units first.
        for &u in order.iter().rev().filter(|&&u| m.spans[u].1 == i) {
            let keep = u == root || Some(u) == last_in_order;
            if cfg.strategy.reshard_after_forward() && !keep {
                sim.reshard(u);
            }
        }
    }

    // ---- backward ----
    // Post-backward fires after the backward of the unit's first leaf (forward order) with
    // parameters; the flat gradient appears at its last such leaf.
    let has_params = |u: usize| {
        let idx: Vec<usize> = (0..m.leaves.len())
            .filter(|&i| m.leaves[i].unit == u && m.leaves[i].weight_grad_bytes > 0)
            .collect();
        idx
    };
    let first_param_leaf: Vec<Option<usize>> = (0..n_units)
        .map(|u| has_params(u).first().copied())
        .collect();
    for i in (0..m.leaves.len()).rev() {
        let leaf = &m.leaves[i];
        // Pre-backward, outer units first.
        for &u in order.iter().filter(|&&u| m.spans[u].1 == i) {
            if sim.post_backward_done[u] {
                continue;
            }
            sim.unshard(u);
            sim.wait_unshard(u);
            if cfg.backward_prefetch == BackwardPrefetch::BackwardPre {
                if let Some(next) = sim.next_backward(&order, u) {
                    sim.unshard(next);
                }
            }
            if checkpointed[u] {
                // Recompute the unit's forward: its leaves' saved tensors come back.
                let (a, b) = m.spans[u];
                for (j, l) in m.leaves.iter().enumerate().take(b + 1).skip(a) {
                    sim.work(
                        l.fwd_flops_per_token * tokens,
                        l.hbm_bytes_per_token * tokens,
                    );
                    if j != a {
                        sim.mem
                            .alloc(Cat::Activations, round(l.saved_bytes_per_token * tokens));
                    }
                }
            }
        }
        sim.work(
            2.0 * leaf.fwd_flops_per_token * tokens,
            2.0 * leaf.hbm_bytes_per_token * tokens,
        );
        // The op's backward allocates its input and weight gradients while its output's
        // gradient is alive; its saved tensors are released when it returns, before the engine
        // folds the weight gradients into the unit's flat gradient (allocated at the first).
        let u = leaf.unit;
        let transient = round(leaf.bwd_transient_bytes_per_token * tokens)
            + if leaf.weight_grad_bytes > 0 {
                round(leaf.weight_grad_bytes as f64)
            } else {
                0
            };
        sim.mem.alloc(Cat::Activations, transient);
        sim.mem
            .free(Cat::Activations, round(leaf.saved_bytes_per_token * tokens));
        if leaf.weight_grad_bytes > 0 && !sim.flat_grad[u] {
            sim.flat_grad[u] = true;
            let g = round(sim.gathered_bytes(u));
            sim.mem.alloc(Cat::FlatGrads, g);
        }
        sim.mem.free(Cat::Activations, transient);
        // Post-backward, inner units first.
        for &u in order
            .iter()
            .rev()
            .filter(|&&u| first_param_leaf[u] == Some(i))
        {
            sim.reduce(u);
            sim.post_backward_done[u] = true;
            if cfg.backward_prefetch == BackwardPrefetch::BackwardPost {
                if let Some(next) = sim.next_backward(&order, u) {
                    sim.unshard(next);
                }
            }
            sim.reshard(u);
        }
    }
    // End of backward: the compute stream waits for every reduction; everything reshards.
    for t in std::mem::take(&mut sim.reductions) {
        sim.compute = sim.compute.max(t);
    }
    for u in 0..n_units {
        if sim.sharded() {
            sim.reshard(u);
        }
    }
    sim.mem
        .free(Cat::Activations, round(m.input_bytes_per_token * tokens));
    sim.mem
        .free(Cat::Activations, round(m.output_bytes_per_token * tokens));
    // Optimizer: a few passes over the shards and their gradients.
    let shard_numel: f64 = (0..n_units).map(|u| sim.chunk(u)).sum();
    let opt_flops = shard_numel * (2.0 + 8.0 * optimizer_slots as f64);
    match hw {
        // Memory-bound on a GPU: read parameter and gradient, write the parameter, read and
        // write every f32 slot.
        Some(h) => {
            let bytes = shard_numel * 4.0 * (3.0 + 2.0 * optimizer_slots as f64);
            sim.run_compute(h.compute_time(opt_flops, bytes, 4));
        }
        None => sim.run_compute(opt_flops / sim.rate),
    }
    let end = sim
        .compute
        .max(sim.unshard_stream)
        .max(sim.reduce_stream)
        .max(sim.host);
    let comm = sim.main.busy + sim.replicate.as_ref().map_or(0.0, |g| g.busy);
    let (mut intra_busy, mut inter_busy) = (0.0, 0.0);
    for g in std::iter::once(&sim.main).chain(sim.replicate.as_ref()) {
        if g.cross_node {
            inter_busy += g.busy;
        } else {
            intra_busy += g.busy;
        }
    }
    StepEstimate {
        step_s: end,
        compute_s: sim.compute_busy,
        comm_s: comm,
        peak_bytes: sim.mem.peak.total(),
        peak: sim.mem.peak,
        cross_node_bytes: sim.cross,
        limiter_wait_s: sim.limiter_wait,
        intra_busy_s: intra_busy,
        inter_busy_s: inter_busy,
        hardware_flops: sim.flops,
    }
}
