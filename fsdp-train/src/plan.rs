//! `--plan` / `--plan --apply`: the cost-model planner ([`fsdp_core::plan`]) for the chosen
//! model and batch on an assumed cluster — the ranked table without training, or training with
//! the top plan.
//!
//! The cluster comes from `--cluster FILE` (TOML, below), then the `--cluster-*` flags override
//! it field by field. Without either it is this machine as train_gpt emulates it: one node of
//! `--ranks` ranks, each with an even share of the host's memory (`MemTotal` of /proc/meminfo)
//! and of the GEMM probe's rate (all cores, measured at start-up), links of 10 GB/s and 10 µs
//! (in-process copies; an assumption, not a measurement).
//!
//! ```toml
//! nodes = 2
//! ranks_per_node = 8
//! device_memory_gib = 80
//! tflops = 150             # sustained per rank on the model's kernels
//! [intra]
//! bandwidth_gb_per_s = 300 # GB/s per rank
//! latency_us = 5
//! [inter]
//! bandwidth_gb_per_s = 25
//! latency_us = 20
//! ```

use std::path::{Path, PathBuf};

use clap::Args;
use fsdp_core::plan::{Batch, Cluster, Link, ModelDesc, PlanEstimate, Planner};
use fsdp_core::{ShardOver, WrapPolicy};

use crate::cli::{strategy_name, UsageError};
use crate::train::{Optimizer, TrainConfig};

/// Planning (the cost model of `fsdp_core::plan`).
#[derive(Args, Debug, Clone, Default)]
#[command(next_help_heading = "Planning")]
pub struct PlanArgs {
    /// Print the planner's ranked table of FSDP configurations (strategy, shard size, prefetch,
    /// limiter) for this model and batch on the assumed cluster, and exit without training
    #[arg(long)]
    pub plan: bool,
    /// With --plan: train with the top-ranked plan (sets --strategy, --shard-size,
    /// --backward-prefetch, --forward-prefetch, --limit-all-gathers)
    #[arg(long)]
    pub apply: bool,
    /// Cluster description (a TOML subset: nodes, ranks_per_node, device_memory_gib, tflops,
    /// [intra]/[inter] bandwidth_gb_per_s and latency_us); --cluster-* flags override it
    #[arg(long, value_name = "FILE")]
    pub cluster: Option<PathBuf>,
    /// Nodes of the assumed cluster (default 1)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub cluster_nodes: Option<u64>,
    /// Ranks per node (default --ranks)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub cluster_ranks_per_node: Option<u64>,
    /// Device memory per rank, GiB (default: host memory / ranks)
    #[arg(long, value_name = "GIB", value_parser = parse_positive)]
    pub cluster_mem_gib: Option<f64>,
    /// Sustained compute per rank, TFLOP/s (default: the GEMM probe / ranks)
    #[arg(long, value_name = "TF", value_parser = parse_positive)]
    pub cluster_tflops: Option<f64>,
    /// Intra-node bandwidth per rank, GB/s (default 10)
    #[arg(long, value_name = "GB/s", value_parser = parse_positive)]
    pub cluster_intra_gbps: Option<f64>,
    /// Inter-node bandwidth per rank, GB/s (default: the intra-node figure)
    #[arg(long, value_name = "GB/s", value_parser = parse_positive)]
    pub cluster_inter_gbps: Option<f64>,
    /// Intra-node latency per collective, µs (default 10)
    #[arg(long, value_name = "US", value_parser = parse_non_negative)]
    pub cluster_intra_latency_us: Option<f64>,
    /// Inter-node latency per collective, µs (default: the intra-node figure)
    #[arg(long, value_name = "US", value_parser = parse_non_negative)]
    pub cluster_inter_latency_us: Option<f64>,
}

fn parse_number(s: &str) -> Result<f64, String> {
    let x: f64 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if x.is_finite() && x <= 1e15 {
        Ok(x)
    } else {
        Err(format!("`{s}` is not a finite number up to 1e15"))
    }
}

fn parse_positive(s: &str) -> Result<f64, String> {
    let x = parse_number(s)?;
    if x > 0.0 {
        Ok(x)
    } else {
        Err(format!("must be positive, got {s}"))
    }
}

fn parse_non_negative(s: &str) -> Result<f64, String> {
    let x = parse_number(s)?;
    if x >= 0.0 {
        Ok(x)
    } else {
        Err(format!("must be 0 or more, got {s}"))
    }
}

/// Cluster fields read from a TOML file (all optional).
#[derive(Debug, Default, Clone, PartialEq)]
struct FileCluster {
    nodes: Option<u64>,
    ranks_per_node: Option<u64>,
    mem_gib: Option<f64>,
    tflops: Option<f64>,
    intra_gbps: Option<f64>,
    intra_latency_us: Option<f64>,
    inter_gbps: Option<f64>,
    inter_latency_us: Option<f64>,
}

fn read_cluster_file(path: &Path) -> Result<FileCluster, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("--cluster {}: {e}", path.display()))?;
    parse_cluster_toml(&text).map_err(|e| format!("--cluster {}: {e}", path.display()))
}

/// Parses the cluster file: the small TOML subset it needs — `key = number` lines, `[intra]` /
/// `[inter]` tables, `#` comments — and nothing else (an unknown key or a value that is not a
/// number is an error naming it).
fn parse_cluster_toml(text: &str) -> Result<FileCluster, String> {
    let mut f = FileCluster::default();
    let mut table = String::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        let at = |m: String| format!("line {}: {m}", i + 1);
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix('[') {
            let name = rest
                .strip_suffix(']')
                .ok_or_else(|| at(format!("`{line}` is not a table header")))?
                .trim();
            if name != "intra" && name != "inter" {
                return Err(at(format!(
                    "unknown table `[{name}]` (known: [intra], [inter])"
                )));
            }
            table = name.to_string();
            continue;
        }
        let (key, value) = line
            .split_once('=')
            .ok_or_else(|| at(format!("`{line}` is not `key = value`")))?;
        let (key, value) = (key.trim(), value.trim());
        let full = if table.is_empty() {
            key.to_string()
        } else {
            format!("{table}.{key}")
        };
        let number = || -> Result<f64, String> {
            match value.replace('_', "").parse::<f64>() {
                Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
                _ => Err(at(format!(
                    "`{full}` must be a finite number ≥ 0, got `{value}`"
                ))),
            }
        };
        let whole = || -> Result<u64, String> {
            match value.replace('_', "").parse::<u64>() {
                Ok(v) if v >= 1 => Ok(v),
                _ => Err(at(format!(
                    "`{full}` must be a whole number ≥ 1, got `{value}`"
                ))),
            }
        };
        match full.as_str() {
            "nodes" => f.nodes = Some(whole()?),
            "ranks_per_node" => f.ranks_per_node = Some(whole()?),
            "device_memory_gib" => f.mem_gib = Some(number()?),
            "tflops" => f.tflops = Some(number()?),
            "intra.bandwidth_gb_per_s" => f.intra_gbps = Some(number()?),
            "intra.latency_us" => f.intra_latency_us = Some(number()?),
            "inter.bandwidth_gb_per_s" => f.inter_gbps = Some(number()?),
            "inter.latency_us" => f.inter_latency_us = Some(number()?),
            _ => {
                return Err(at(format!(
                    "unknown key `{full}` (known: nodes, ranks_per_node, device_memory_gib, \
                     tflops, and bandwidth_gb_per_s / latency_us in [intra] and [inter])"
                )))
            }
        }
    }
    Ok(f)
}

/// Host memory in bytes (`MemTotal`), if /proc/meminfo says.
fn host_memory() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The assumed cluster: the file, then the flags, then this machine's defaults.
pub fn cluster(a: &PlanArgs, ranks: usize, gemm_rate: f64) -> Result<Cluster, String> {
    let f = match &a.cluster {
        Some(p) => read_cluster_file(p)?,
        None => FileCluster::default(),
    };
    let nodes = a.cluster_nodes.or(f.nodes).unwrap_or(1) as usize;
    let per_node = a
        .cluster_ranks_per_node
        .or(f.ranks_per_node)
        .unwrap_or((ranks / nodes.max(1)).max(1) as u64) as usize;
    let world = nodes * per_node;
    let mem = match a.cluster_mem_gib.or(f.mem_gib) {
        Some(g) => (g * (1u64 << 30) as f64) as u64,
        None => host_memory().unwrap_or(16 << 30) / world.max(1) as u64,
    };
    let flops = match a.cluster_tflops.or(f.tflops) {
        Some(t) => t * 1e12,
        None => gemm_rate / world.max(1) as f64,
    };
    let intra_bw = a.cluster_intra_gbps.or(f.intra_gbps).unwrap_or(10.0) * 1e9;
    let intra_lat = a
        .cluster_intra_latency_us
        .or(f.intra_latency_us)
        .unwrap_or(10.0)
        * 1e-6;
    let inter_bw = a
        .cluster_inter_gbps
        .or(f.inter_gbps)
        .map_or(intra_bw, |g| g * 1e9);
    let inter_lat = a
        .cluster_inter_latency_us
        .or(f.inter_latency_us)
        .map_or(intra_lat, |u| u * 1e-6);
    let c = Cluster {
        nodes,
        ranks_per_node: per_node,
        device_memory_bytes: mem,
        flops_per_s: flops,
        intra: Link {
            latency_s: intra_lat,
            bytes_per_s: intra_bw,
        },
        inter: Link {
            latency_s: inter_lat,
            bytes_per_s: inter_bw,
        },
    };
    c.validate().map_err(|e| e.to_string())?;
    Ok(c)
}

/// The planner for the run's model and batch on `cluster`.
pub fn planner(c: &TrainConfig, cluster: Cluster) -> Result<Planner, String> {
    let policy = WrapPolicy::ModuleTypes(vec!["Block".into()]);
    let mut model = ModelDesc::gpt(&c.gpt, &policy).map_err(|e| e.to_string())?;
    if c.mixed_precision.is_some() {
        model = model.with_compute_bytes(2);
    }
    let batch = Batch {
        seqs_per_rank: c.batch,
        seq_len: c.gpt.seq_len,
    };
    let slots = match c.optimizer {
        Optimizer::Sgd => 0,
        Optimizer::AdamW => 2,
    };
    Ok(Planner::new(model, cluster, batch)
        .map_err(|e| e.to_string())?
        .with_optimizer_slots(slots))
}

/// Prints the ranked table; returns the top plan.
pub fn print_plan(c: &TrainConfig, p: &Planner) -> Result<PlanEstimate, String> {
    let cl = &p.cluster;
    println!(
        "plan: {} ({} parameters, {} units) | batch {} × {} tokens per rank | {} | cluster: {} \
         node(s) × {} ranks, {:.2} GiB/rank, {:.3} TFLOP/s/rank, intra {:.2} GB/s + {:.1} µs, \
         inter {:.2} GB/s + {:.1} µs",
        p.model.name,
        p.model.numel(),
        p.model.units.len(),
        p.batch.seqs_per_rank,
        p.batch.seq_len,
        match c.optimizer {
            Optimizer::Sgd => "SGD",
            Optimizer::AdamW => "AdamW",
        },
        cl.nodes,
        cl.ranks_per_node,
        cl.device_memory_bytes as f64 / (1u64 << 30) as f64,
        cl.flops_per_s / 1e12,
        cl.intra.bytes_per_s / 1e9,
        cl.intra.latency_s * 1e6,
        cl.inter.bytes_per_s / 1e9,
        cl.inter.latency_s * 1e6,
    );
    if c.grad_accum > 1 {
        println!(
            "plan: note: the planner models one micro-batch per step (--grad-accum {} is not \
             modelled)",
            c.grad_accum
        );
    }
    if c.cpu_offload {
        println!(
            "plan: note: CPU offload is not modelled (the planner assumes shards and the \
             optimizer on the compute device)"
        );
    }
    let all = p.evaluate_all();
    print!("{}", Planner::table(&all));
    let fitting = all.iter().filter(|e| e.fits).count();
    println!(
        "plan: {fitting} of {} configurations fit ({}% allocator headroom); ranked by predicted \
         step time",
        all.len(),
        (p.allocator_headroom * 100.0).round()
    );
    let ranked = p.plan().map_err(|e| e.to_string())?;
    Ok(ranked[0])
}

/// `--plan --apply`: the run's configuration with the top plan's settings.
pub fn apply(c: &mut TrainConfig, top: &PlanEstimate) -> Result<(), UsageError> {
    let p = top.config;
    if p.shard_size == 0 || c.ranks % p.shard_size.max(1) != 0 {
        return Err(UsageError(format!(
            "the top plan's shard size {} does not divide --ranks {}",
            p.shard_size, c.ranks
        )));
    }
    if !p.strategy.is_sharded()
        && (c.cpu_offload || c.mixed_precision.is_some() || c.quantize_collectives.is_some())
    {
        return Err(UsageError(
            "the top plan is no-shard, which cannot run with --cpu-offload, --mixed-precision or \
             --quantize-collectives; drop those flags or plan without them"
                .into(),
        ));
    }
    c.strategy = p.strategy;
    c.shard_size = (p.strategy.spec().shard_over == ShardOver::ShardGroup).then_some(p.shard_size);
    c.backward_prefetch = p.backward_prefetch;
    c.forward_prefetch = p.forward_prefetch;
    c.limit_all_gathers = p.limit_all_gathers;
    // The plan decides the limiter outright: an adaptive (`--limit-all-gathers auto`) setting
    // would override it.
    c.adaptive_limiter = None;
    println!(
        "plan: applying the top plan: {} (--strategy {}{})",
        p.label(),
        strategy_name(p.strategy),
        c.shard_size
            .map(|f| format!(" --shard-size {f}"))
            .unwrap_or_default()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_toml_parses_and_rejects_unknown_keys() {
        let f = parse_cluster_toml(
            "nodes = 2\nranks_per_node = 8\ndevice_memory_gib = 80\ntflops = 150.5\n\
             [intra]\nbandwidth_gb_per_s = 300\nlatency_us = 5\n[inter]\nbandwidth_gb_per_s = 25\n",
        )
        .unwrap();
        assert_eq!(f.nodes, Some(2));
        assert_eq!(f.ranks_per_node, Some(8));
        assert_eq!(f.mem_gib, Some(80.0));
        assert_eq!(f.tflops, Some(150.5));
        assert_eq!((f.intra_gbps, f.intra_latency_us), (Some(300.0), Some(5.0)));
        assert_eq!((f.inter_gbps, f.inter_latency_us), (Some(25.0), None));
        assert!(parse_cluster_toml("gpus = 3").unwrap_err().contains("gpus"));
        assert!(parse_cluster_toml("nodes = 0")
            .unwrap_err()
            .contains("nodes"));
        assert!(parse_cluster_toml("[intra]\nspeed = 1")
            .unwrap_err()
            .contains("intra.speed"));
        assert!(parse_cluster_toml("tflops = \"fast\"")
            .unwrap_err()
            .contains("tflops"));
        assert!(parse_cluster_toml("nodes = [").is_err());
        assert!(parse_cluster_toml("[gpu]").unwrap_err().contains("[gpu]"));
        assert!(parse_cluster_toml("nodes").is_err());
        assert_eq!(
            parse_cluster_toml("# a comment\n\nnodes = 3 # three\n")
                .unwrap()
                .nodes,
            Some(3)
        );
    }

    #[test]
    fn flags_override_the_file_and_defaults_follow_the_machine() {
        let a = PlanArgs {
            plan: true,
            cluster_nodes: Some(2),
            cluster_ranks_per_node: Some(4),
            cluster_mem_gib: Some(1.0),
            cluster_tflops: Some(2.0),
            cluster_inter_gbps: Some(1.0),
            ..PlanArgs::default()
        };
        let c = cluster(&a, 4, 1e9).unwrap();
        assert_eq!((c.nodes, c.ranks_per_node), (2, 4));
        assert_eq!(c.device_memory_bytes, 1 << 30);
        assert_eq!(c.flops_per_s, 2e12);
        assert_eq!(c.intra.bytes_per_s, 10e9);
        assert_eq!(c.inter.bytes_per_s, 1e9);
        let d = cluster(&PlanArgs::default(), 4, 8e9).unwrap();
        assert_eq!((d.nodes, d.ranks_per_node), (1, 4));
        assert_eq!(d.flops_per_s, 2e9);
    }
}
