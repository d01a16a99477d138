//! Candidates, the planner, ranking and the printed table.

use crate::candidate::PlanConfig;
use crate::cluster::{Batch, Cluster};
use crate::error::PlanError;
use crate::hardware::Hardware;
use crate::model::ModelDesc;
use crate::simulate::{simulate, SimOptions, StepEstimate};
use fsdp_core::config::{BackwardPrefetch, ShardingStrategy};
use fsdp_core::strategy::ShardOver;

/// A candidate with its prediction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlanEstimate {
    /// The configuration.
    pub config: PlanConfig,
    /// What it costs.
    pub estimate: StepEstimate,
    /// Whether the predicted peak (with the allocator headroom) fits in device memory.
    pub fits: bool,
}

/// Predicts and ranks FSDP configurations for one model, cluster and batch.
#[derive(Debug, Clone)]
pub struct Planner {
    /// The model.
    pub model: ModelDesc,
    /// The cluster.
    pub cluster: Cluster,
    /// The batch.
    pub batch: Batch,
    /// Optimizer state slots per parameter (SGD 0, AdamW 2), f32 like the shards.
    pub optimizer_slots: usize,
    /// Reserved-over-allocated margin for the feasibility test (fragmentation and cached
    /// blocks of the caching allocator): a plan fits when `peak × (1 + headroom) ≤ device
    /// memory`. Default 0.25: train_gpt's GPT-mini on 4 ranks (hybrid shard) peaked at 55.7 MiB
    /// allocated and 66.6 MiB reserved per rank (ratio 1.20).
    pub allocator_headroom: f64,
    /// GPU and fabric detail: with it, compute is a per-leaf roofline and collectives are
    /// priced as NCCL's ring/tree over nodes ([`Hardware::collective_time`]); without it, the
    /// cluster's flat alpha-beta links and compute rate.
    pub hardware: Option<Hardware>,
    /// Activation checkpointing of every innermost unit ([`ModelDesc::innermost_units`]): only
    /// its input is kept through forward; its forward is recomputed at its backward.
    pub activation_checkpointing: bool,
}

impl Planner {
    /// A planner for `model` on `cluster` with `batch`, SGD (no optimizer state), 25% headroom.
    pub fn new(model: ModelDesc, cluster: Cluster, batch: Batch) -> Result<Planner, PlanError> {
        model.validate()?;
        cluster.validate()?;
        if batch.tokens() == 0 {
            return Err(PlanError::Batch(
                "the batch has no tokens; give at least one sequence of at least one token".into(),
            ));
        }
        if batch.seq_len > model.seq_len {
            return Err(PlanError::Batch(format!(
                "sequences of {} tokens are longer than the model's {}",
                batch.seq_len, model.seq_len
            )));
        }
        Ok(Planner {
            model,
            cluster,
            batch,
            optimizer_slots: 0,
            allocator_headroom: 0.25,
            hardware: None,
            activation_checkpointing: false,
        })
    }

    /// With GPU and fabric detail (see [`Planner::hardware`]); checked for sane figures.
    pub fn with_hardware(mut self, hardware: Hardware) -> Result<Planner, PlanError> {
        hardware.validate()?;
        self.hardware = Some(hardware);
        Ok(self)
    }

    /// With activation checkpointing per innermost unit (per transformer block under the
    /// block policy), as `GptConfig::checkpoint` does.
    pub fn with_activation_checkpointing(mut self, on: bool) -> Planner {
        self.activation_checkpointing = on;
        self
    }

    /// With `slots` optimizer state slots per parameter (AdamW: 2).
    pub fn with_optimizer_slots(mut self, slots: usize) -> Planner {
        self.optimizer_slots = slots;
        self
    }

    /// With a different allocator headroom (a fraction, e.g. 0.1).
    pub fn with_allocator_headroom(mut self, headroom: f64) -> Planner {
        self.allocator_headroom = if headroom.is_finite() {
            headroom.max(0.0)
        } else {
            0.0
        };
        self
    }

    /// Every configuration the planner considers on this cluster: FullShard, ShardGradOp,
    /// NoShard, HybridShard for every F dividing W with 1 < F < W (F = 1 and F = W are NoShard
    /// and FullShard with a second group), each with backward prefetch none/pre/post, forward
    /// prefetch off/on and the limiter on/off (NoShard gathers nothing: prefetch and limiter
    /// do not apply, one candidate).
    pub fn candidates(&self) -> Vec<PlanConfig> {
        let w = self.cluster.world();
        // From the strategy table: each sharded strategy with its sharding factor(s) (W, or every
        // shard-group size F dividing W with 1 < F < W), in table order.
        let mut strategies = vec![];
        for s in ShardingStrategy::all() {
            match s.spec().shard_over {
                ShardOver::Nothing => {}
                ShardOver::World => strategies.push((s, w)),
                ShardOver::ShardGroup => {
                    for f in 2..w {
                        if w % f == 0 {
                            strategies.push((s, f));
                        }
                    }
                }
            }
        }
        let mut out: Vec<PlanConfig> = ShardingStrategy::all()
            .filter(|s| !s.is_sharded())
            .map(|s| PlanConfig::new(s, 1, BackwardPrefetch::None, false, false))
            .collect();
        if w == 1 {
            return out;
        }
        for (s, f) in strategies {
            for b in [
                BackwardPrefetch::BackwardPre,
                BackwardPrefetch::BackwardPost,
                BackwardPrefetch::None,
            ] {
                for fwd in [false, true] {
                    for lim in [true, false] {
                        out.push(PlanConfig::new(s, f, b, fwd, lim));
                    }
                }
            }
        }
        out
    }

    /// Checks a configuration can run on this cluster.
    pub fn check(&self, c: &PlanConfig) -> Result<(), PlanError> {
        let w = self.cluster.world();
        let expected = match c.strategy.spec().shard_over {
            ShardOver::Nothing => Some(1),
            ShardOver::World => Some(w),
            ShardOver::ShardGroup => None,
        };
        match expected {
            Some(f) if c.shard_size != f => Err(PlanError::Config(format!(
                "{} shards over {f} rank(s) on {w} ranks, not {}",
                c.label(),
                c.shard_size
            ))),
            None if c.shard_size == 0 || w % c.shard_size != 0 => Err(PlanError::Config(format!(
                "hybrid shard size {} does not divide the world size {w}",
                c.shard_size
            ))),
            _ => Ok(()),
        }
    }

    /// The prediction for one configuration.
    pub fn estimate(&self, c: &PlanConfig) -> Result<PlanEstimate, PlanError> {
        self.check(c)?;
        let estimate = simulate(
            &self.model,
            &self.cluster,
            &self.batch,
            c,
            &SimOptions {
                optimizer_slots: self.optimizer_slots,
                hardware: self.hardware.as_ref(),
                activation_checkpointing: self.activation_checkpointing,
            },
        );
        let need = estimate.peak_bytes as f64 * (1.0 + self.allocator_headroom);
        Ok(PlanEstimate {
            config: *c,
            estimate,
            fits: need <= self.cluster.device_memory_bytes as f64,
        })
    }

    /// Every candidate's prediction, feasible ones first, each part ordered by predicted step
    /// time (ties: lower peak memory first, then the candidate order).
    pub fn evaluate_all(&self) -> Vec<PlanEstimate> {
        let mut all: Vec<PlanEstimate> = self
            .candidates()
            .iter()
            .filter_map(|c| self.estimate(c).ok())
            .collect();
        all.sort_by(|a, b| {
            b.fits
                .cmp(&a.fits)
                .then(a.estimate.step_s.total_cmp(&b.estimate.step_s))
                .then(a.estimate.peak_bytes.cmp(&b.estimate.peak_bytes))
        });
        all
    }

    /// The feasible plans ranked by predicted step time (best first);
    /// [`PlanError::NothingFits`] when none fits.
    pub fn plan(&self) -> Result<Vec<PlanEstimate>, PlanError> {
        let all = self.evaluate_all();
        let fitting: Vec<PlanEstimate> = all.iter().copied().filter(|p| p.fits).collect();
        if fitting.is_empty() {
            let smallest = all.iter().map(|p| p.estimate.peak_bytes).min().unwrap_or(0);
            return Err(PlanError::NothingFits {
                smallest_peak: (smallest as f64 * (1.0 + self.allocator_headroom)) as u64,
                device_bytes: self.cluster.device_memory_bytes,
                headroom_percent: (self.allocator_headroom * 100.0).round() as u32,
            });
        }
        Ok(fitting)
    }

    /// A printable table of `plans` (rank, configuration, step time, compute, communication,
    /// peak memory, cross-node bytes, fits).
    pub fn table(plans: &[PlanEstimate]) -> String {
        let mut s = format!(
            "{:>4}  {:<44} {:>10} {:>10} {:>10} {:>11} {:>12} {:>4}\n",
            "rank", "plan", "step ms", "compute", "comm busy", "peak MiB", "x-node MiB", "fits"
        );
        for (i, p) in plans.iter().enumerate() {
            let e = &p.estimate;
            s.push_str(&format!(
                "{:>4}  {:<44} {:>10.2} {:>10.2} {:>10.2} {:>11.2} {:>12.2} {:>4}\n",
                i + 1,
                p.config.label(),
                e.step_s * 1e3,
                e.compute_s * 1e3,
                e.comm_s * 1e3,
                e.peak_bytes as f64 / 1048576.0,
                e.cross_node_bytes / 1048576.0,
                if p.fits { "yes" } else { "no" }
            ));
        }
        s
    }
}
