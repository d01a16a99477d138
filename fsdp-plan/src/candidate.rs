//! [`PlanConfig`]: one candidate configuration. Its own file so that `simulate.rs` (which costs a
//! candidate) and `search.rs` (which enumerates candidates and calls the simulator) do not import
//! each other.

use fsdp_core::config::{BackwardPrefetch, FsdpConfig, ShardingStrategy};

/// One configuration the planner considers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanConfig {
    /// The sharding strategy.
    pub strategy: ShardingStrategy,
    /// The sharding factor F: W for FullShard and ShardGradOp, 1 for NoShard, the shard-group
    /// size for HybridShard.
    pub shard_size: usize,
    /// Backward prefetch.
    pub backward_prefetch: BackwardPrefetch,
    /// Forward prefetch.
    pub forward_prefetch: bool,
    /// The all-gather rate limiter.
    pub limit_all_gathers: bool,
    /// The limiter's bound (FSDP's default 2).
    pub max_inflight_all_gathers: usize,
}

impl PlanConfig {
    /// A candidate with the limiter bound at FSDP's default.
    pub fn new(
        strategy: ShardingStrategy,
        shard_size: usize,
        backward_prefetch: BackwardPrefetch,
        forward_prefetch: bool,
        limit_all_gathers: bool,
    ) -> PlanConfig {
        PlanConfig {
            strategy,
            shard_size,
            backward_prefetch,
            forward_prefetch,
            limit_all_gathers,
            max_inflight_all_gathers: FsdpConfig::default().max_inflight_all_gathers,
        }
    }

    /// `base` with this plan's strategy, prefetch and limiter settings (the shard size goes to
    /// the `DeviceMesh` for HybridShard).
    pub fn apply(&self, base: FsdpConfig) -> FsdpConfig {
        FsdpConfig {
            strategy: self.strategy,
            backward_prefetch: self.backward_prefetch,
            forward_prefetch: self.forward_prefetch,
            limit_all_gathers: self.limit_all_gathers,
            max_inflight_all_gathers: self.max_inflight_all_gathers,
            ..base
        }
    }

    /// A short label: `full-shard F=4 bwd=pre fwd=off lim=on`.
    pub fn label(&self) -> String {
        let s = self.strategy.name();
        let b = match self.backward_prefetch {
            BackwardPrefetch::None => "none",
            BackwardPrefetch::BackwardPre => "pre",
            BackwardPrefetch::BackwardPost => "post",
        };
        let on = |x: bool| if x { "on" } else { "off" };
        format!(
            "{s} F={} bwd={b} fwd={} lim={}",
            self.shard_size,
            on(self.forward_prefetch),
            on(self.limit_all_gathers)
        )
    }
}
