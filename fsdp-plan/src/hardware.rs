//! GPUs and their fabrics beyond this machine: a [`Hardware`] description (peak FLOP/s by
//! dtype, GEMM efficiency, HBM bandwidth, memory, GPUs per node, NVLink and network links) and
//! named presets whose every constant cites a public vendor specification or a public
//! GEMM/NCCL measurement. **No constant here is fitted to the FSDP paper's results.**
//!
//! With a [`Hardware`] attached ([`crate::Planner::with_hardware`]) the planner prices
//! compute as a per-leaf roofline (`max(FLOPs / (peak × GEMM efficiency), HBM bytes / HBM
//! bandwidth)`) and collectives as NCCL's ring (and, for all-reduce, tree) over the two-level
//! topology: [`Hardware::collective_time`]. Without one it keeps the flat alpha-beta model of
//! [`crate::Cluster`] (the one this machine's emulated clusters are checked against).

use crate::cluster::{Cluster, Link};
use crate::error::PlanError;

/// NCCL's fixed cost per ring collective with the Simple protocol (µs), from NCCL's own cost
/// model: `baseLat[Ring][Simple] = 8.4` in `src/graph/tuning.cc` (NVIDIA/nccl, 2.x, commit
/// 01afd20a), the model NCCL uses to pick algorithms.
pub const NCCL_RING_BASE_LATENCY_US: f64 = 8.4;
/// NCCL's per-step latency of a ring step over NVLink, Simple protocol (µs):
/// `hwLat[NVLINK][Ring][Simple] = 3.4` in the same file.
pub const NCCL_NVLINK_STEP_LATENCY_US: f64 = 3.4;
/// NCCL's per-step latency of a ring step over the network, Simple protocol (µs):
/// `hwLat[NET][Ring][Simple] = 9.6` in the same file.
pub const NCCL_NET_STEP_LATENCY_US: f64 = 9.6;
/// NCCL's tree bus bandwidth relative to the ring's (`busBw * .9` for trees in the same
/// file): the double binary tree reaches nearly the ring's bandwidth at large sizes.
pub const NCCL_TREE_BANDWIDTH_FRACTION: f64 = 0.9;

/// The names [`Hardware::preset`] knows.
pub const PRESETS: &[&str] = &["a100-80gb", "h100-80gb"];

/// One GPU model and the node it sits in.
#[derive(Debug, Clone, PartialEq)]
pub struct Hardware {
    /// A short name for tables (`a100-80gb`).
    pub name: String,
    /// Dense bf16/f16 tensor-core peak per GPU, FLOP/s.
    pub bf16_flops_per_s: f64,
    /// f32 peak per GPU (without TF32 tensor cores), FLOP/s.
    pub f32_flops_per_s: f64,
    /// Fraction of the peak a large GEMM sustains (a public matmul measurement). Applied to
    /// every leaf's FLOPs; memory-bound leaves are limited by [`Hardware::hbm_bytes_per_s`].
    pub gemm_efficiency: f64,
    /// HBM bandwidth per GPU, bytes/s.
    pub hbm_bytes_per_s: f64,
    /// Device memory per GPU, bytes.
    pub memory_bytes: u64,
    /// GPUs per node.
    pub gpus_per_node: usize,
    /// Inside a node: the bus bandwidth a ring collective reaches per GPU (bytes/s) and the
    /// latency of one ring step (s).
    pub nvlink: Link,
    /// Between nodes: network bandwidth per GPU (its NIC's share, bytes/s) and the latency of
    /// one ring step that crosses nodes (s). A node's bandwidth is this × the GPUs of a group
    /// in that node.
    pub network: Link,
    /// Fixed cost of one collective (s), on top of the per-step latencies.
    pub base_latency_s: f64,
}

/// What a collective does, for its step count and algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    /// All-gather (n − 1 ring steps).
    AllGather,
    /// Reduce-scatter (n − 1 ring steps).
    ReduceScatter,
    /// All-reduce (2(n − 1) ring steps, or NCCL's tree when cheaper).
    AllReduce,
}

impl Hardware {
    /// NVIDIA A100 80GB SXM in an 8-GPU node (DGX A100 layout).
    pub fn a100_80gb() -> Hardware {
        Hardware {
            name: "a100-80gb".into(),
            // NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100, "A100 80GB SXM"):
            // BF16 tensor core 312 TFLOPS dense, FP32 19.5 TFLOPS, 80 GB HBM2e, 2,039 GB/s.
            bf16_flops_per_s: 312e12,
            f32_flops_per_s: 19.5e12,
            // Measured bf16 matmul, A100 SXM: 267.9 of 312 TFLOPS = 85.9% (stas00/ml-engineering,
            // compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison
            // table", CUDA 12.1).
            gemm_efficiency: 0.859,
            hbm_bytes_per_s: 2039e9,
            memory_bytes: 80_000_000_000,
            // DGX A100 datasheet: 8 GPUs per node on NVSwitch.
            gpus_per_node: 8,
            nvlink: Link {
                // NCCL's cost model caps A100 (compute capability 8.0) ring bus bandwidth at
                // 235 GB/s (`if (compCap80) busBw = std::min(busBw, 235.0f)` in NCCL's
                // src/graph/tuning.cc), below NVLink 3's 300 GB/s per direction (A100
                // datasheet: 600 GB/s bidirectional).
                bytes_per_s: 235e9,
                latency_s: NCCL_NVLINK_STEP_LATENCY_US * 1e-6,
            },
            network: Link {
                // DGX A100 datasheet: 8 × 200 Gb/s HDR InfiniBand (ConnectX-6) for the compute
                // fabric, one per GPU: 25 GB/s per GPU, 1.6 Tb/s per node.
                bytes_per_s: 25e9,
                latency_s: NCCL_NET_STEP_LATENCY_US * 1e-6,
            },
            base_latency_s: NCCL_RING_BASE_LATENCY_US * 1e-6,
        }
    }

    /// NVIDIA H100 80GB SXM in an 8-GPU node (DGX H100 layout).
    pub fn h100_80gb() -> Hardware {
        Hardware {
            name: "h100-80gb".into(),
            // NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100, "H100 SXM"): BF16
            // tensor core 989 TFLOPS dense (1,979 with sparsity), FP32 67 TFLOPS, 80 GB HBM3 at
            // 3.35 TB/s.
            bf16_flops_per_s: 989e12,
            f32_flops_per_s: 67e12,
            // Measured bf16 matmul, H100 SXM: 792.1 of 989 TFLOPS = 80.1% (stas00/ml-engineering,
            // same table, CUDA 12.1).
            gemm_efficiency: 0.801,
            hbm_bytes_per_s: 3.35e12,
            memory_bytes: 80_000_000_000,
            // DGX H100 datasheet: 8 GPUs per node on NVSwitch.
            gpus_per_node: 8,
            nvlink: Link {
                // H100 datasheet: NVLink 4 at 900 GB/s bidirectional, 450 GB/s per direction.
                // A vendor peak, not a measurement: no public NCCL cap for this GPU is used, so
                // this is optimistic.
                bytes_per_s: 450e9,
                latency_s: NCCL_NVLINK_STEP_LATENCY_US * 1e-6,
            },
            network: Link {
                // DGX H100 datasheet: 8 × 400 Gb/s (ConnectX-7) for the compute fabric, one per
                // GPU: 50 GB/s per GPU, 3.2 Tb/s per node.
                bytes_per_s: 50e9,
                latency_s: NCCL_NET_STEP_LATENCY_US * 1e-6,
            },
            base_latency_s: NCCL_RING_BASE_LATENCY_US * 1e-6,
        }
    }

    /// A preset by name ([`PRESETS`]); `None` for an unknown name.
    pub fn preset(name: &str) -> Option<Hardware> {
        match name {
            "a100-80gb" => Some(Hardware::a100_80gb()),
            "h100-80gb" => Some(Hardware::h100_80gb()),
            _ => None,
        }
    }

    /// Checks every figure is positive and finite (latencies ≥ 0) and the efficiency is in
    /// (0, 1].
    pub fn validate(&self) -> Result<(), PlanError> {
        let bad = |m: &str| Err(PlanError::Cluster(format!("hardware `{}`: {m}", self.name)));
        let pos = |x: f64| x.is_finite() && x > 0.0;
        if !(pos(self.bf16_flops_per_s) && pos(self.f32_flops_per_s)) {
            return bad("peak FLOP/s must be positive");
        }
        if !(pos(self.gemm_efficiency) && self.gemm_efficiency <= 1.0) {
            return bad("the GEMM efficiency must be in (0, 1]");
        }
        if !pos(self.hbm_bytes_per_s) || self.memory_bytes == 0 || self.gpus_per_node == 0 {
            return bad("HBM bandwidth, memory and GPUs per node must be positive");
        }
        for l in [self.nvlink, self.network] {
            if !(pos(l.bytes_per_s) && l.latency_s.is_finite() && l.latency_s >= 0.0) {
                return bad("link bandwidths must be positive and latencies ≥ 0");
            }
        }
        if !(self.base_latency_s.is_finite() && self.base_latency_s >= 0.0) {
            return bad("the base latency must be ≥ 0");
        }
        Ok(())
    }

    /// The flat [`Cluster`] of `world` GPUs on this hardware: nodes of
    /// [`Hardware::gpus_per_node`] (one node of `world` when it is smaller), the GPU's memory,
    /// the GEMM rate in bf16 as the compute rate, NVLink inside and the network between nodes.
    pub fn cluster(&self, world: usize) -> Result<Cluster, PlanError> {
        self.validate()?;
        if world == 0 {
            return Err(PlanError::Cluster("zero GPUs".into()));
        }
        let (nodes, per_node) = if world <= self.gpus_per_node {
            (1, world)
        } else if world % self.gpus_per_node == 0 {
            (world / self.gpus_per_node, self.gpus_per_node)
        } else {
            return Err(PlanError::Cluster(format!(
                "{world} GPUs do not fill nodes of {}; give a multiple of {}",
                self.gpus_per_node, self.gpus_per_node
            )));
        };
        let c = Cluster {
            nodes,
            ranks_per_node: per_node,
            device_memory_bytes: self.memory_bytes,
            flops_per_s: self.bf16_flops_per_s * self.gemm_efficiency,
            intra: self.nvlink,
            inter: self.network,
        };
        c.validate()?;
        Ok(c)
    }

    /// The sustained GEMM rate for an element size of `bytes` (2: bf16/f16 tensor cores,
    /// otherwise f32), FLOP/s.
    pub fn gemm_rate(&self, bytes: usize) -> f64 {
        let peak = if bytes <= 2 {
            self.bf16_flops_per_s
        } else {
            self.f32_flops_per_s
        };
        peak * self.gemm_efficiency
    }

    /// Time of one leaf's work: the roofline `max(flops / GEMM rate, hbm_bytes / HBM
    /// bandwidth)`.
    pub fn compute_time(&self, flops: f64, hbm_bytes: f64, elem_bytes: usize) -> f64 {
        (flops / self.gemm_rate(elem_bytes)).max(hbm_bytes / self.hbm_bytes_per_s)
    }

    /// Time of one collective moving `ring_bytes` per rank (the ring formula's bytes:
    /// `M(n−1)/n` for all-gather and reduce-scatter, `2M(n−1)/n` for all-reduce) over a group of
    /// `size` ranks that spans `nodes` nodes with `per_node` of its ranks in each, on links
    /// `intra` (inside a node) and `inter` (between nodes, per GPU), as NCCL's cost model
    /// prices it:
    /// - ring: `base + (steps − inter_steps) · intra.latency + inter_steps · inter.latency +
    ///   ring_bytes / bus_bw`, with `steps = n − 1` (all-reduce `2(n − 1)`), `inter_steps =
    ///   nodes − 1` (all-reduce twice that) and `bus_bw = intra.bw` inside one node, else
    ///   `min(intra.bw, per_node × inter.bw)` — NCCL runs one ring per NIC, each crossing a
    ///   node boundary once, so a node's whole network bandwidth carries the ring;
    /// - all-reduce may use the tree instead when cheaper: `base + 2((per_node − 1) ·
    ///   intra.latency + ⌈log2 nodes⌉ · inter.latency) + M / (0.9 · bus_bw / 2)`, with `M` the
    ///   buffer (NCCL's tree: logarithmic latency, 90% of the ring's bus bandwidth, algorithm
    ///   bandwidth half of it).
    #[allow(clippy::too_many_arguments)]
    pub fn collective_time(
        &self,
        kind: Collective,
        ring_bytes: f64,
        size: usize,
        nodes: usize,
        per_node: usize,
        intra: Link,
        inter: Link,
    ) -> f64 {
        if size <= 1 {
            return 0.0;
        }
        let nodes = nodes.max(1);
        let per_node = per_node.max(1);
        let bus_bw = if nodes == 1 {
            intra.bytes_per_s
        } else {
            intra.bytes_per_s.min(per_node as f64 * inter.bytes_per_s)
        };
        let (steps, inter_steps) = match kind {
            Collective::AllReduce => (2 * (size - 1), 2 * (nodes - 1)),
            _ => (size - 1, nodes - 1),
        };
        let ring = self.base_latency_s
            + (steps - inter_steps.min(steps)) as f64 * intra.latency_s
            + inter_steps as f64 * inter.latency_s
            + ring_bytes / bus_bw;
        if kind != Collective::AllReduce || nodes == 1 {
            return ring;
        }
        let m = ring_bytes * size as f64 / (2.0 * (size - 1) as f64);
        let log_nodes = (nodes as f64).log2().ceil();
        let tree = self.base_latency_s
            + 2.0 * ((per_node - 1) as f64 * intra.latency_s + log_nodes * inter.latency_s)
            + m / (NCCL_TREE_BANDWIDTH_FRACTION * bus_bw / 2.0);
        ring.min(tree)
    }
}
