//! `--plan` / `--plan --apply`: the cost-model planner ([`fsdp_plan`]) for the chosen
//! model and batch on an assumed cluster — the ranked table without training, or training with
//! the top plan.
//!
//! The cluster comes from `--cluster FILE` (TOML, below) or `--cluster PRESET` (a GPU
//! preset of [`fsdp_plan::Hardware`]: `a100-80gb`, `h100-80gb`; a path that exists is
//! always read as a file), then the `--cluster-*` flags override it field by field. Without
//! either it is this machine as train_gpt emulates it: one node of `--ranks` ranks, each with an
//! even share of the host's memory (`MemTotal` of /proc/meminfo) and of the GEMM probe's rate
//! (all cores, measured at start-up), links of 10 GB/s and 10 µs (in-process copies; an
//! assumption, not a measurement).
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
//!
//! A `[gpu]` table (what the presets fill in) describes the GPU instead of a flat `tflops`, and
//! switches the planner to its GPU model (per-leaf roofline compute, NCCL's ring/tree
//! collectives over nodes; `fsdp_plan::Hardware`): `bf16_tflops` and `f32_tflops`
//! (peaks), `gemm_efficiency` (fraction of the peak a large GEMM sustains), `hbm_gb_per_s`, and
//! optionally `base_latency_us` (NCCL's fixed cost per collective, default 8.4). Then `[intra]`
//! is the NVLink bus bandwidth per GPU and the latency of one ring step, `[inter]` the network
//! bandwidth per GPU (its NIC) and the latency of one ring step across nodes. Without `nodes`,
//! a file or preset that gives `ranks_per_node` fills nodes of that many from `--ranks`.
//!
//! ```toml
//! ranks_per_node = 8
//! device_memory_gib = 80
//! [gpu]
//! bf16_tflops = 312
//! f32_tflops = 19.5
//! gemm_efficiency = 0.859
//! hbm_gb_per_s = 2039
//! [intra]
//! bandwidth_gb_per_s = 235
//! latency_us = 3.4
//! [inter]
//! bandwidth_gb_per_s = 31.25
//! latency_us = 9.6
//! ```

use std::path::{Path, PathBuf};

use clap::Args;
use fsdp_core::{ShardOver, WrapPolicy};
use fsdp_plan::{Batch, Cluster, Hardware, Link, PlanError, PlanEstimate, Planner, PRESETS};

use crate::job::{strategy_name, TrainConfig, UsageError};

/// Planning (the cost model of `fsdp_plan`).
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
    /// Cluster description: a TOML file (nodes, ranks_per_node, device_memory_gib, tflops,
    /// `[intra]`/`[inter]` bandwidth_gb_per_s and latency_us, a `[gpu]` table) or a GPU preset:
    /// a100-80gb, h100-80gb (nodes of 8 filled from --ranks); --cluster-* flags override it
    #[arg(long, value_name = "FILE|PRESET")]
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
    gpu_bf16_tflops: Option<f64>,
    gpu_f32_tflops: Option<f64>,
    gpu_gemm_efficiency: Option<f64>,
    gpu_hbm_gbps: Option<f64>,
    gpu_base_latency_us: Option<f64>,
}

impl FileCluster {
    /// A preset's figures as if read from a file.
    fn from_hardware(h: &Hardware) -> FileCluster {
        FileCluster {
            nodes: None,
            ranks_per_node: Some(h.gpus_per_node as u64),
            mem_gib: Some(h.memory_bytes as f64 / (1u64 << 30) as f64),
            tflops: None,
            intra_gbps: Some(h.nvlink.bytes_per_s / 1e9),
            intra_latency_us: Some(h.nvlink.latency_s * 1e6),
            inter_gbps: Some(h.network.bytes_per_s / 1e9),
            inter_latency_us: Some(h.network.latency_s * 1e6),
            gpu_bf16_tflops: Some(h.bf16_flops_per_s / 1e12),
            gpu_f32_tflops: Some(h.f32_flops_per_s / 1e12),
            gpu_gemm_efficiency: Some(h.gemm_efficiency),
            gpu_hbm_gbps: Some(h.hbm_bytes_per_s / 1e9),
            gpu_base_latency_us: Some(h.base_latency_s * 1e6),
        }
    }

    fn has_gpu(&self) -> bool {
        [
            self.gpu_bf16_tflops,
            self.gpu_f32_tflops,
            self.gpu_gemm_efficiency,
            self.gpu_hbm_gbps,
            self.gpu_base_latency_us,
        ]
        .iter()
        .any(Option::is_some)
    }
}

/// `--cluster`'s value: a file when the path exists, else a preset name.
fn read_cluster_arg(path: &Path) -> Result<(FileCluster, Option<String>), String> {
    if !path.exists() {
        if let Some(h) = path.to_str().and_then(Hardware::preset) {
            return Ok((FileCluster::from_hardware(&h), Some(h.name)));
        }
        return Err(format!(
            "--cluster {}: no such file, and not a preset (presets: {})",
            path.display(),
            PRESETS.join(", ")
        ));
    }
    Ok((read_cluster_file(path)?, None))
}

fn read_cluster_file(path: &Path) -> Result<FileCluster, String> {
    // A regular file only (a FIFO would block the read forever).
    let text = crate::input::read_regular(path)
        .and_then(|b| {
            String::from_utf8(b)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
        })
        .map_err(|e| format!("--cluster {}: {e}", path.display()))?;
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
            if !["intra", "inter", "gpu"].contains(&name) {
                return Err(at(format!(
                    "unknown table `[{name}]` (known: [intra], [inter], [gpu])"
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
            "gpu.bf16_tflops" => f.gpu_bf16_tflops = Some(number()?),
            "gpu.f32_tflops" => f.gpu_f32_tflops = Some(number()?),
            "gpu.gemm_efficiency" => f.gpu_gemm_efficiency = Some(number()?),
            "gpu.hbm_gb_per_s" => f.gpu_hbm_gbps = Some(number()?),
            "gpu.base_latency_us" => f.gpu_base_latency_us = Some(number()?),
            _ => {
                return Err(at(format!(
                    "unknown key `{full}` (known: nodes, ranks_per_node, device_memory_gib, \
                     tflops, bandwidth_gb_per_s / latency_us in [intra] and [inter], and \
                     bf16_tflops, f32_tflops, gemm_efficiency, hbm_gb_per_s, base_latency_us in \
                     [gpu])"
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

/// The assumed cluster and, with a `[gpu]` table or a preset, the GPU description: the file or
/// preset, then the flags, then this machine's defaults.
pub fn cluster(
    a: &PlanArgs,
    ranks: usize,
    gemm_rate: f64,
) -> Result<(Cluster, Option<Hardware>), String> {
    let (f, preset) = match &a.cluster {
        Some(p) => read_cluster_arg(p)?,
        None => (FileCluster::default(), None),
    };
    let given_per_node = a.cluster_ranks_per_node.or(f.ranks_per_node);
    let (nodes, per_node) = match (a.cluster_nodes.or(f.nodes), given_per_node) {
        (Some(n), Some(p)) => (n as usize, p as usize),
        (Some(n), None) => (n as usize, (ranks / n.max(1) as usize).max(1)),
        (None, None) => (1, ranks.max(1)),
        // Nodes of `p` filled from --ranks (one smaller node when --ranks is below `p`).
        (None, Some(p)) => {
            let p = p as usize;
            if ranks <= p {
                (1, ranks.max(1))
            } else if ranks % p == 0 {
                (ranks / p, p)
            } else {
                return Err(format!(
                    "--ranks {ranks} does not fill nodes of {p} ranks; give a multiple of {p} \
                     (or --cluster-nodes)"
                ));
            }
        }
    };
    let world = nodes * per_node;
    let mem = match a.cluster_mem_gib.or(f.mem_gib) {
        Some(g) => (g * (1u64 << 30) as f64) as u64,
        None => host_memory().unwrap_or(16 << 30) / world.max(1) as u64,
    };
    let gpu = f.has_gpu();
    if gpu && a.cluster_tflops.or(f.tflops).is_some() {
        return Err(
            "--cluster-tflops / tflops do not combine with a GPU description ([gpu] or a \
             preset): its rate comes from [gpu] bf16_tflops, f32_tflops and gemm_efficiency"
                .into(),
        );
    }
    let flops = match a.cluster_tflops.or(f.tflops) {
        Some(t) => t * 1e12,
        None if gpu => {
            f.gpu_bf16_tflops.unwrap_or(0.0) * 1e12 * f.gpu_gemm_efficiency.unwrap_or(0.0)
        }
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
    if !gpu {
        return Ok((c, None));
    }
    let need = |x: Option<f64>, key: &str| {
        x.ok_or_else(|| format!("--cluster: the [gpu] table needs `{key}`"))
    };
    let hw = Hardware {
        name: preset.unwrap_or_else(|| "gpu".into()),
        bf16_flops_per_s: need(f.gpu_bf16_tflops, "bf16_tflops")? * 1e12,
        f32_flops_per_s: need(f.gpu_f32_tflops, "f32_tflops")? * 1e12,
        gemm_efficiency: need(f.gpu_gemm_efficiency, "gemm_efficiency")?,
        hbm_bytes_per_s: need(f.gpu_hbm_gbps, "hbm_gb_per_s")? * 1e9,
        memory_bytes: mem,
        gpus_per_node: per_node,
        nvlink: c.intra,
        network: c.inter,
        base_latency_s: f
            .gpu_base_latency_us
            .unwrap_or(fsdp_plan::NCCL_RING_BASE_LATENCY_US)
            * 1e-6,
    };
    hw.validate().map_err(|e: PlanError| e.to_string())?;
    Ok((c, Some(hw)))
}

/// The planner for the run's model and batch on `cluster` (with the GPU model when
/// `hardware` is given: then mixed precision also halves the activations, as on a GPU that
/// computes in bf16/f16).
pub fn planner(
    c: &TrainConfig,
    cluster: Cluster,
    hardware: Option<Hardware>,
) -> Result<Planner, String> {
    let policy = WrapPolicy::ModuleTypes(vec![c.model.unit_type().into()]);
    let mut model = c.model.plan_desc(&policy).map_err(|e| e.to_string())?;
    if c.mixed_precision.is_some() {
        model = model.with_compute_bytes(2);
        if hardware.is_some() {
            model = model.with_activation_bytes(2);
        }
    }
    let batch = Batch {
        seqs_per_rank: c.batch,
        seq_len: c.model.seq_len(),
    };
    let slots = c.build_optimizer().state_slots();
    let p = Planner::new(model, cluster, batch)
        .map_err(|e| e.to_string())?
        .with_optimizer_slots(slots)
        .with_activation_checkpointing(c.model.checkpointed());
    match hardware {
        Some(h) => p.with_hardware(h).map_err(|e| e.to_string()),
        None => Ok(p),
    }
}

/// Prints the ranked table (candidates the model cannot tell apart merged into one row) and
/// what bounds the top plan; returns the top plan, or `None` (after saying so) when nothing
/// fits.
pub fn print_plan(c: &TrainConfig, p: &Planner) -> Result<Option<PlanEstimate>, String> {
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
        c.build_optimizer().name(),
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
    if let Some(h) = &p.hardware {
        println!(
            "plan: GPU model `{}`: bf16 {:.0} / f32 {:.1} TFLOPS peak × GEMM efficiency {:.3}, \
             HBM {:.0} GB/s, NCCL ring/tree over nodes (base {:.1} µs); activation \
             checkpointing {}",
            h.name,
            h.bf16_flops_per_s / 1e12,
            h.f32_flops_per_s / 1e12,
            h.gemm_efficiency,
            h.hbm_bytes_per_s / 1e9,
            h.base_latency_s * 1e6,
            if p.activation_checkpointing {
                "on"
            } else {
                "off"
            }
        );
    }
    if c.cpu_offload {
        println!(
            "plan: note: CPU offload is not modelled (the planner assumes shards and the \
             optimizer on the compute device)"
        );
    }
    let all = p.evaluate_all();
    print!("{}", Planner::merged_table(&all));
    let fitting = all.iter().filter(|e| e.fits).count();
    println!(
        "plan: {fitting} of {} configurations fit ({}% allocator headroom); ranked by predicted \
         step time; `alike` rows are candidates whose predictions print the same (`any`: the \
         setting does not change the prediction)",
        all.len(),
        (p.allocator_headroom * 100.0).round()
    );
    match p.plan() {
        Ok(ranked) => {
            let top = ranked[0];
            let (bound, why) = p.bound(&top, &all);
            println!(
                "plan: top plan {} is bound by {}: {why}",
                top.config.label(),
                bound.name()
            );
            Ok(Some(top))
        }
        Err(e @ PlanError::NothingFits { .. }) => {
            println!("plan: {e}");
            Ok(None)
        }
        Err(e) => Err(e.to_string()),
    }
}

/// `--plan --apply`: the run's configuration with the top plan's settings (strategy, shard
/// size, prefetch, limiter; everything else as given).
///
/// # Errors
/// A top plan this run cannot take (a shard size not dividing `--ranks`; no-shard with flags
/// that need sharding).
pub fn apply(c: TrainConfig, top: &PlanEstimate) -> Result<TrainConfig, UsageError> {
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
    let shard_size =
        (p.strategy.spec().shard_over == ShardOver::ShardGroup).then_some(p.shard_size);
    println!(
        "plan: applying the top plan: {} (--strategy {}{})",
        p.label(),
        strategy_name(p.strategy),
        shard_size
            .map(|f| format!(" --shard-size {f}"))
            .unwrap_or_default()
    );
    Ok(TrainConfig {
        strategy: p.strategy,
        shard_size,
        backward_prefetch: p.backward_prefetch,
        forward_prefetch: p.forward_prefetch,
        limit_all_gathers: p.limit_all_gathers,
        // The plan decides the limiter outright: an adaptive (`--limit-all-gathers auto`)
        // setting would override it.
        adaptive_limiter: None,
        ..c
    })
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
        assert!(parse_cluster_toml("[tpu]").unwrap_err().contains("[tpu]"));
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
        let (c, hw) = cluster(&a, 4, 1e9).unwrap();
        assert!(hw.is_none());
        assert_eq!((c.nodes, c.ranks_per_node), (2, 4));
        assert_eq!(c.device_memory_bytes, 1 << 30);
        assert_eq!(c.flops_per_s, 2e12);
        assert_eq!(c.intra.bytes_per_s, 10e9);
        assert_eq!(c.inter.bytes_per_s, 1e9);
        let (d, _) = cluster(&PlanArgs::default(), 4, 8e9).unwrap();
        assert_eq!((d.nodes, d.ranks_per_node), (1, 4));
        assert_eq!(d.flops_per_s, 2e9);
    }

    fn parse(args: &[&str]) -> Result<crate::cli::Cli, String> {
        use clap::Parser;
        crate::cli::Cli::try_parse_from(std::iter::once("train_gpt").chain(args.iter().copied()))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn presets_and_gpu_tables_select_the_gpu_model() {
        let a = PlanArgs {
            plan: true,
            cluster: Some("a100-80gb".into()),
            ..PlanArgs::default()
        };
        let (c, hw) = cluster(&a, 512, 1e9).unwrap();
        let hw = hw.expect("a preset describes a GPU");
        let want = Hardware::a100_80gb();
        assert_eq!(hw.name, want.name);
        assert_eq!(hw.bf16_flops_per_s, want.bf16_flops_per_s);
        assert_eq!(hw.gemm_efficiency, want.gemm_efficiency);
        assert_eq!(hw.nvlink.bytes_per_s, want.nvlink.bytes_per_s);
        for (a, b) in [
            (hw.nvlink.latency_s, want.nvlink.latency_s),
            (hw.network.latency_s, want.network.latency_s),
            (hw.base_latency_s, want.base_latency_s),
        ] {
            assert!((a - b).abs() < 1e-15, "{a} vs {b}");
        }
        assert_eq!((c.nodes, c.ranks_per_node), (64, 8));
        assert_eq!(c.device_memory_bytes, 80_000_000_000);
        // Fewer ranks than a node: one node of them.
        let (c, _) = cluster(&a, 4, 1e9).unwrap();
        assert_eq!((c.nodes, c.ranks_per_node), (1, 4));
        // A flag overrides the preset's network.
        let b = PlanArgs {
            cluster_inter_gbps: Some(31.25),
            ..a.clone()
        };
        let (_, hw) = cluster(&b, 16, 1e9).unwrap();
        assert_eq!(hw.unwrap().network.bytes_per_s, 31.25e9);
        assert!(cluster(&a, 12, 1e9).unwrap_err().contains("multiple of 8"));
        let t = PlanArgs {
            cluster_tflops: Some(100.0),
            ..a.clone()
        };
        assert!(cluster(&t, 8, 1e9).unwrap_err().contains("[gpu]"));
        let unknown = PlanArgs {
            cluster: Some("no-such-gpu".into()),
            ..PlanArgs::default()
        };
        assert!(cluster(&unknown, 8, 1e9).unwrap_err().contains("a100-80gb"));

        let f = parse_cluster_toml(
            "ranks_per_node = 8\ndevice_memory_gib = 80\n[gpu]\nbf16_tflops = 312\n\
             f32_tflops = 19.5\ngemm_efficiency = 0.859\nhbm_gb_per_s = 2039\n[intra]\n\
             bandwidth_gb_per_s = 235\nlatency_us = 3.4\n[inter]\nbandwidth_gb_per_s = 31.25\n",
        )
        .unwrap();
        assert!(f.has_gpu());
        assert_eq!(f.gpu_hbm_gbps, Some(2039.0));
        assert!(parse_cluster_toml("[gpu]\nclock = 3")
            .unwrap_err()
            .contains("gpu.clock"));
    }

    #[test]
    fn plan_alone_takes_any_size() {
        let big = [
            "--plan",
            "--cluster",
            "a100-80gb",
            "--d-model",
            "12288",
            "--layers",
            "96",
            "--heads",
            "96",
            "--seq-len",
            "2048",
            "--vocab",
            "50000",
            "--batch",
            "1",
            "--ranks",
            "512",
        ];
        let c = parse(&big).unwrap().into_config().unwrap();
        assert_eq!(c.ranks, 512);
        // Training (or --apply) keeps the limits.
        let mut apply = big.to_vec();
        apply.push("--apply");
        assert!(parse(&apply).unwrap().into_config().is_err());
        assert!(parse(&["--ranks", "512"]).unwrap().into_config().is_err());
        let ck = parse(&["--activation-checkpointing"])
            .unwrap()
            .into_config()
            .unwrap();
        assert!(ck.model.checkpointed());
        let (cl, hw) = cluster(
            &PlanArgs {
                cluster: Some("a100-80gb".into()),
                ..PlanArgs::default()
            },
            512,
            1e9,
        )
        .unwrap();
        let p = planner(&c, cl, hw).unwrap();
        assert!(p.hardware.is_some());
        assert!(p.model.numel() > 170_000_000_000);
    }
}
