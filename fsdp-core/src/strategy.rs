//! The sharding strategies and their one table of properties.
//!
//! Every question about a strategy (does it shard parameters? over which ranks? does it free
//! unsharded parameters after forward? does it all-reduce across a replicate group? which
//! collectives move a unit's data? what is it called on the command line?) is answered by
//! [`STRATEGIES`], through [`ShardingStrategy::spec`]. The runtime (`runtime/fsdp.rs`,
//! `runtime/handle.rs`), the planner (the `fsdp-plan` crate), the state dicts and `train_gpt`'s CLI ask it instead of matching on variants.
//!
//! Adding a strategy: a variant here, its row in [`STRATEGIES`], and, only if it needs a
//! mechanism none of the existing rows describe, the runtime code that implements it
//! (`runtime/fsdp.rs` / `runtime/handle.rs`); plus its tests.

use std::str::FromStr;

use fsdp_collectives::OpKind;

/// How parameters, gradients and optimizer state are sharded (the paper's §3.2). The
/// properties of each are in [`STRATEGIES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ShardingStrategy {
    /// Shard parameters, gradients and optimizer state over all ranks; free unsharded
    /// parameters after forward and after backward (ZeRO-3).
    #[default]
    FullShard,
    /// Like `FullShard` but keep unsharded parameters between forward and backward (no second
    /// all-gather in backward; more memory).
    ShardGradOp,
    /// No sharding: every rank keeps the full parameters and all-reduces gradients (DDP).
    NoShard,
    /// Shard within groups of `F` ranks, replicate across the `W/F` groups: reduce-scatter inside
    /// the shard group, then all-reduce across the replicate group. `F` comes from the
    /// [`fsdp_collectives::DeviceMesh`] passed to [`crate::Fsdp::wrap`].
    HybridShard,
}

/// Over which ranks a strategy shards a unit's flat parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShardOver {
    /// Not sharded: every rank holds the whole flat parameter (sharding factor 1).
    Nothing,
    /// Every rank of the process group (sharding factor W).
    World,
    /// The shard group of a [`fsdp_collectives::DeviceMesh`] (sharding factor F, `1 < F < W`
    /// in the planner); the mesh's replicate groups hold copies.
    ShardGroup,
}

/// One strategy's row: every property the runtime, planner, state dicts and CLI ask about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StrategySpec {
    /// The strategy.
    pub strategy: ShardingStrategy,
    /// Its name on the command line and in labels and reports (`full-shard`).
    pub name: &'static str,
    /// Other accepted spellings, compared after lower-casing and removing `-` and `_`.
    pub aliases: &'static [&'static str],
    /// One line for `--help`.
    pub summary: &'static str,
    /// Over which ranks the flat parameter is sharded.
    pub shard_over: ShardOver,
    /// Unsharded parameters are freed right after a unit's forward (except the root's) and
    /// gathered again for backward.
    pub reshard_after_forward: bool,
    /// Gradients are also all-reduced across a replicate group (needs a
    /// [`fsdp_collectives::DeviceMesh`]).
    pub replicate_all_reduce: bool,
}

/// The table: one row per [`ShardingStrategy`], in the order the planner enumerates them.
pub const STRATEGIES: &[StrategySpec] = &[
    StrategySpec {
        strategy: ShardingStrategy::FullShard,
        name: "full-shard",
        aliases: &["full"],
        summary: "shard parameters, gradients and optimizer state; reshard after forward",
        shard_over: ShardOver::World,
        reshard_after_forward: true,
        replicate_all_reduce: false,
    },
    StrategySpec {
        strategy: ShardingStrategy::ShardGradOp,
        name: "shard-grad-op",
        aliases: &["grad"],
        summary: "shard gradients and optimizer state; keep parameters unsharded forward to \
                  backward",
        shard_over: ShardOver::World,
        reshard_after_forward: false,
        replicate_all_reduce: false,
    },
    StrategySpec {
        strategy: ShardingStrategy::NoShard,
        name: "no-shard",
        aliases: &["ddp", "none"],
        summary: "replicate everything (DDP-like all-reduce)",
        shard_over: ShardOver::Nothing,
        reshard_after_forward: false,
        replicate_all_reduce: false,
    },
    StrategySpec {
        strategy: ShardingStrategy::HybridShard,
        name: "hybrid-shard",
        aliases: &["hybrid"],
        summary: "shard within groups of --shard-size, replicate across them",
        shard_over: ShardOver::ShardGroup,
        reshard_after_forward: true,
        replicate_all_reduce: true,
    },
];

impl StrategySpec {
    /// True if the flat parameter is sharded at all.
    pub const fn is_sharded(&self) -> bool {
        !matches!(self.shard_over, ShardOver::Nothing)
    }

    /// The collective that unshards a unit's parameters before its forward (and, with
    /// [`reshard_after_forward`](Self::reshard_after_forward), before its backward); `None` when
    /// nothing is sharded.
    pub const fn unshard_collective(&self) -> Option<OpKind> {
        if self.is_sharded() {
            Some(OpKind::AllGather)
        } else {
            None
        }
    }

    /// The collectives that reduce a unit's gradient, in order: reduce-scatter over the shard
    /// group (then all-reduce over the replicate group) when sharded, all-reduce otherwise.
    pub fn grad_collectives(&self) -> Vec<OpKind> {
        match (self.is_sharded(), self.replicate_all_reduce) {
            (true, true) => vec![OpKind::ReduceScatter, OpKind::AllReduce],
            (true, false) => vec![OpKind::ReduceScatter],
            (false, _) => vec![OpKind::AllReduce],
        }
    }

    /// The sharding factor on `world` ranks whose shard group (from the mesh, or the planner's
    /// candidate) has `shard_group` ranks.
    pub const fn factor(&self, world: usize, shard_group: usize) -> usize {
        match self.shard_over {
            ShardOver::Nothing => 1,
            ShardOver::World => world,
            ShardOver::ShardGroup => shard_group,
        }
    }
}

impl ShardingStrategy {
    /// Every strategy, in table order.
    pub fn all() -> impl Iterator<Item = ShardingStrategy> {
        STRATEGIES.iter().map(|s| s.strategy)
    }

    /// This strategy's row of [`STRATEGIES`].
    pub fn spec(self) -> &'static StrategySpec {
        // Every variant has a row (checked by the unit test `every_variant_has_one_row`); the
        // fallback is never taken.
        STRATEGIES
            .iter()
            .find(|s| s.strategy == self)
            .unwrap_or(&STRATEGIES[0])
    }

    /// Its name on the command line and in labels (`full-shard`).
    pub fn name(self) -> &'static str {
        self.spec().name
    }

    /// True if unsharded parameters are freed right after a unit's forward (except the root's).
    pub fn reshard_after_forward(self) -> bool {
        self.spec().reshard_after_forward
    }

    /// True if parameters are sharded at all.
    pub fn is_sharded(self) -> bool {
        self.spec().is_sharded()
    }

    /// True if gradients are also all-reduced across a replicate group (the strategy needs a
    /// [`fsdp_collectives::DeviceMesh`]).
    pub fn replicates(self) -> bool {
        self.spec().replicate_all_reduce
    }

    /// The accepted names, for error messages and `--help`: `full-shard, shard-grad-op, …`.
    pub fn names() -> Vec<&'static str> {
        STRATEGIES.iter().map(|s| s.name).collect()
    }
}

impl std::fmt::Display for ShardingStrategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ShardingStrategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let key = |n: &str| n.to_ascii_lowercase().replace(['-', '_'], "");
        let k = key(s);
        STRATEGIES
            .iter()
            .find(|row| key(row.name) == k || row.aliases.iter().any(|a| key(a) == k))
            .map(|row| row.strategy)
            .ok_or_else(|| {
                let names = ShardingStrategy::names();
                let (last, rest) = names.split_last().unwrap_or((&"", &[]));
                format!(
                    "unknown sharding strategy `{s}` (expected {} or {last})",
                    rest.join(", ")
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::{OpKind, ShardOver, ShardingStrategy, STRATEGIES};

    #[test]
    fn every_variant_has_one_row() {
        for s in [
            ShardingStrategy::FullShard,
            ShardingStrategy::ShardGradOp,
            ShardingStrategy::NoShard,
            ShardingStrategy::HybridShard,
        ] {
            assert_eq!(STRATEGIES.iter().filter(|r| r.strategy == s).count(), 1);
            assert_eq!(s.spec().strategy, s);
        }
        assert_eq!(ShardingStrategy::all().count(), STRATEGIES.len());
    }

    #[test]
    fn names_and_aliases_parse_back_and_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for row in STRATEGIES {
            assert_eq!(row.name.parse::<ShardingStrategy>(), Ok(row.strategy));
            assert_eq!(row.strategy.to_string(), row.name);
            for a in row.aliases {
                assert_eq!(a.parse::<ShardingStrategy>(), Ok(row.strategy));
            }
            for k in std::iter::once(&row.name).chain(row.aliases) {
                assert!(
                    seen.insert(k.replace('-', "")),
                    "`{k}` names two strategies"
                );
            }
        }
        assert_eq!("SHARD_GRAD_OP".parse(), Ok(ShardingStrategy::ShardGradOp));
        let e = "zero4".parse::<ShardingStrategy>().unwrap_err();
        assert_eq!(
            e,
            "unknown sharding strategy `zero4` (expected full-shard, shard-grad-op, no-shard or \
             hybrid-shard)"
        );
    }

    #[test]
    fn the_table_says_what_the_paper_says() {
        use ShardingStrategy::*;
        // (sharded, reshard after forward, replicate all-reduce)
        let props =
            |s: ShardingStrategy| (s.is_sharded(), s.reshard_after_forward(), s.replicates());
        assert_eq!(props(FullShard), (true, true, false));
        assert_eq!(props(ShardGradOp), (true, false, false));
        assert_eq!(props(NoShard), (false, false, false));
        assert_eq!(props(HybridShard), (true, true, true));
        assert_eq!(NoShard.spec().unshard_collective(), None);
        assert_eq!(
            FullShard.spec().unshard_collective(),
            Some(OpKind::AllGather)
        );
        assert_eq!(NoShard.spec().grad_collectives(), [OpKind::AllReduce]);
        assert_eq!(
            HybridShard.spec().grad_collectives(),
            [OpKind::ReduceScatter, OpKind::AllReduce]
        );
        assert_eq!(FullShard.spec().factor(8, 2), 8);
        assert_eq!(HybridShard.spec().factor(8, 2), 2);
        assert_eq!(NoShard.spec().factor(8, 2), 1);
        assert_eq!(HybridShard.spec().shard_over, ShardOver::ShardGroup);
    }
}
