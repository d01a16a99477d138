//! The cluster and the batch: nodes of ranks with a device memory and a compute rate, links
//! under the alpha-beta model, and the ring traffic formulas of the collectives FSDP issues.

use crate::error::PlanError;

/// An alpha-beta link: a collective moving `n` bytes per rank takes `latency + n / bytes_per_s`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Fixed cost per collective (alpha), seconds.
    pub latency_s: f64,
    /// Bandwidth per rank (1/beta), bytes per second.
    pub bytes_per_s: f64,
}

impl Link {
    /// Time to move `bytes` per rank.
    pub fn time(&self, bytes: f64) -> f64 {
        self.latency_s + bytes / self.bytes_per_s
    }
}

/// The machines a job runs on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cluster {
    /// Number of nodes (hosts).
    pub nodes: usize,
    /// Ranks (devices) per node; W = nodes × ranks_per_node.
    pub ranks_per_node: usize,
    /// Device memory per rank, bytes.
    pub device_memory_bytes: u64,
    /// Sustained compute rate per rank on the model's kernels, FLOP/s.
    pub flops_per_s: f64,
    /// Link between ranks of one node.
    pub intra: Link,
    /// Link between nodes (a collective whose group spans nodes runs at this link's speed: the
    /// ring's slowest hop).
    pub inter: Link,
}

impl Cluster {
    /// World size W.
    pub fn world(&self) -> usize {
        self.nodes * self.ranks_per_node
    }

    /// Checks every figure is positive and finite.
    pub fn validate(&self) -> Result<(), PlanError> {
        let bad = |m: &str| Err(PlanError::Cluster(m.to_string()));
        if self.nodes == 0 || self.ranks_per_node == 0 {
            return bad("nodes and ranks per node must be at least 1");
        }
        if self.device_memory_bytes == 0 {
            return bad("device memory must be positive");
        }
        if !(self.flops_per_s.is_finite() && self.flops_per_s > 0.0) {
            return bad("the compute rate must be a positive number of FLOP/s");
        }
        for (name, l) in [("intra-node", self.intra), ("inter-node", self.inter)] {
            if !(l.bytes_per_s.is_finite() && l.bytes_per_s > 0.0) {
                return Err(PlanError::Cluster(format!(
                    "the {name} bandwidth must be a positive number of bytes/s"
                )));
            }
            if !(l.latency_s.is_finite() && l.latency_s >= 0.0) {
                return Err(PlanError::Cluster(format!(
                    "the {name} latency must be a non-negative number of seconds"
                )));
            }
        }
        Ok(())
    }

    /// The link a group of `size` ranks runs at, and whether it crosses nodes: a group of
    /// consecutive ranks that fits in one node (a shard group of F dividing ranks_per_node) uses
    /// the intra-node link; any other group spans nodes (when there is more than one) and runs
    /// at the inter-node link, the ring's slowest hop.
    pub fn group_link(&self, consecutive: bool, size: usize) -> (Link, bool) {
        let within = self.nodes == 1
            || (consecutive
                && size <= self.ranks_per_node
                && self.ranks_per_node % size.max(1) == 0);
        if within {
            (self.intra, false)
        } else {
            (self.inter, true)
        }
    }
}

/// Where a process group's ranks sit: how many nodes it spans and how many of its ranks each
/// of those nodes holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupShape {
    /// Ranks in the group.
    pub size: usize,
    /// Nodes the group spans.
    pub nodes: usize,
    /// The group's ranks in each of those nodes.
    pub per_node: usize,
}

impl Cluster {
    /// The shape of a group of `size` ranks: `stride` 1 for consecutive ranks (a shard group,
    /// the world group), `stride` F for HybridShard's replicate groups (one rank from each shard
    /// group of F consecutive ranks). Ranks are numbered node by node.
    pub fn group_shape(&self, size: usize, stride: usize) -> GroupShape {
        let size = size.max(1);
        let stride = stride.max(1);
        let rpn = self.ranks_per_node.max(1);
        let span = (size - 1) * stride + 1;
        let per_node = if self.nodes <= 1 || span <= rpn {
            size
        } else if stride >= rpn {
            1
        } else {
            (rpn / stride).clamp(1, size)
        };
        GroupShape {
            size,
            nodes: size.div_ceil(per_node),
            per_node,
        }
    }
}

/// The work of one step on one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batch {
    /// Sequences per rank per step.
    pub seqs_per_rank: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
}

impl Batch {
    /// Tokens per rank per step.
    pub fn tokens(&self) -> usize {
        self.seqs_per_rank * self.seq_len
    }
}

/// Bytes one rank receives in a ring all-gather of an `m`-byte result over `n` ranks (and sends
/// in a ring reduce-scatter of an `m`-byte input): `m (n−1)/n`.
pub fn ring_all_gather_bytes(m: f64, n: usize) -> f64 {
    m * (n.saturating_sub(1)) as f64 / n.max(1) as f64
}

/// Bytes per rank of a ring all-reduce of `m` bytes over `n` ranks: `2 m (n−1)/n`.
pub fn ring_all_reduce_bytes(m: f64, n: usize) -> f64 {
    2.0 * ring_all_gather_bytes(m, n)
}

/// Cross-node bytes per rank per step for an `m`-byte model, by strategy (the paper's §3.2.2),
/// with W ranks in nodes of `ranks_per_node`:
/// - full replication (NoShard, DDP): one all-reduce, `2m(W−1)/W`;
/// - full sharding: all-gather in forward and in backward plus a reduce-scatter, `3m(W−1)/W`;
/// - hybrid sharding with shard groups of F = ranks_per_node (each within a node): only the
///   all-reduce of each rank's `m/F` gradient shard across the `R = W/F` replicas crosses
///   nodes, `2(m/F)(R−1)/R = 2m(W−F)/(FW)` — at most the paper's `2m(W−1)/(GW)` with G = F
///   ranks per host, and equal to it as W grows.
pub fn cross_node_bytes(m: f64, world: usize, hybrid_factor: Option<usize>) -> f64 {
    match hybrid_factor {
        None => 3.0 * ring_all_gather_bytes(m, world),
        Some(f) if f <= 1 => ring_all_reduce_bytes(m, world),
        Some(f) => ring_all_reduce_bytes(m / f as f64, world / f),
    }
}
