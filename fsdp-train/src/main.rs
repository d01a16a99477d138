//! Trains a GPT with FSDP on CPU thread ranks — fsdp-rs's main job.
//!
//! ```sh
//! cargo run --release --bin train_gpt                       # 4 ranks, FullShard, GPT-mini
//! cargo run --release --bin train_gpt -- --strategy no-shard --steps 10 --json
//! cargo run --release --bin train_gpt -- --data input.txt --steps 300 --eval-every 100 \
//!     --metrics m.jsonl --plot loss.svg
//! cargo run --release --bin train_gpt -- --checkpoint-dir ck --checkpoint-every 50 --resume
//! cargo run --release --bin train_gpt -- --plan --cluster-nodes 2 --cluster-ranks-per-node 2 \
//!     --cluster-inter-gbps 0.05                                 # ranked FSDP plans, no training
//! cargo run --release --bin train_gpt -- --plan --apply --steps 20  # train with the top plan
//! cargo run --release --bin train_gpt -- --help
//! cargo build --release -p fsdp-train --features mpi --bin train_gpt &&
//!     mpirun -n 4 target/release/train_gpt --backend mpi   # one process per rank
//! ```
//!
//! Checkpoints (`--checkpoint-dir`) go through `fsdp_core::checkpoint::CheckpointManager`
//! (all-or-nothing, checksummed, keep the last `--keep-checkpoints` of this run's lineage);
//! `--resume` loads the newest one (refused when damaged; `--resume latest-valid` falls back) at
//! any rank count with the same global batch and schedule (module [`ckpt`]). Output paths are
//! checked against the inputs and each other before anything runs (module [`paths`]).
//!
//! Every rank is a thread with its own `Device` (allocator, streams) and a handle to one
//! in-process `ThreadGroup`. Each rank builds the same model from the same seed, wraps it with
//! `Fsdp::wrap` (one unit per transformer `Block`, the rest in the root unit) and trains it on
//! its own micro-batches (module [`data`]: the embedded synthetic stream, or a file read with
//! positioned reads). Module [`train`] is the loop, [`ckpt`] the checkpoint directory, [`report`] the
//! progress bar, metrics file, plot and GEMM probe, [`cli`] the command line, [`plan`] the
//! cost-model planner (`--plan`, `--plan --apply`).
//!
//! ## What a step line reports
//! `step 10 | loss 3.214 | 5,230 tok/s | peak 41.2 MiB/rank | ag 12.1 MiB rs 12.1 MiB`
//! - `loss`: the global-batch mean cross-entropy of that step — every rank's micro-batch mean
//!   cross-entropy, averaged over ranks with an f32 all-reduce (each rank contributes `loss / W`,
//!   which is also the value it backpropagates).
//! - `tok/s`: tokens of the global batch (`ranks × grad_accum × batch × seq`) over rank 0's wall
//!   time for the step (forward, backward, gradient norm, optimizer step, and a full
//!   synchronization of the rank's streams).
//! - `peak`: the largest per-rank `peak_allocated_bytes` of the step over all ranks (the stats
//!   are reset at the start of every step, so it includes activations, parameters, gradients and
//!   communication buffers; model construction and wrapping are not part of any step).
//! - `ag` / `rs` (`ar` where all-reduces run): bytes rank 0's FSDP collectives moved in the step.
//! - `val loss` (with `--eval-every`): mean cross-entropy over the fixed validation set.
//!
//! The summary and the `--json` line use the median step time of all steps but the first
//! (warm-up); with one step, that step. `all_gather_bytes` / `reduce_scatter_bytes` are rank 0's
//! totals over the run, in the dtype communicated (bf16/f16 under mixed precision). `params` is
//! Ψ: the elements of all flat parameters (padding included), the same under every
//! mixed-precision setting; the banner's parameter count is the model's own (no padding), which
//! the FLOP estimate uses.
//!
//! ## `predicted_peak_param_grad_bytes`
//! With `P` = bytes of all f32 parameters (`4·Ψ`), `m` = bytes of the largest unit (`4·maxᵢ ψᵢ`)
//! and `F` the sharding factor, the parameter(+gradient) bound of the paper's §3.2.1
//! (`O(Σψᵢ/F + maxᵢ ψᵢ)`):
//! - `full-shard` (F = ranks) and `hybrid-shard` (F = `--shard-size`): `P/F + m`, plus one more
//!   `m` when a prefetch can hold a second unit unsharded;
//! - `shard-grad-op`: `P/F + P`; `no-shard`: `P`.
//!
//! It is a model prediction, not a measurement: the measured peak also holds activations.
//!
//! ## Model state per rank
//! The summary's `state` line is measured: the bytes allocated on a rank (compute device plus the
//! offload device) right after the optimizer step, while the sharded gradients are still held —
//! sharded parameters + sharded gradients + optimizer state, plus what FSDP keeps between steps.
//! It is printed next to the unsharded state `S = 4Ψ·(2 + optimizer slots)` and `S/F`.
//!
//! ## Model FLOP/s
//! `6·Ψ` per token for the parameters (forward 2, backward 4) plus `12·L·d·T` per token for the
//! attention score and value products (`L` layers, width `d`, sequence `T`), times the tokens
//! per second; next to the GEMM rate of a ~0.2 s probe at start-up on the device the model trains
//! on, at its precision (module [`probe`]: f32 on all cores for CPU ranks; with `--device cuda`
//! the GPU's matmuls in f32 or the mixed-precision dtype); `--json` names the probe's device
//! (`gemm_probe_device`: `"cpu"` or `"cuda:0"`) and dtype (`gemm_probe_dtype`).
//!
//! ## `--kernel-times`
//! With `--profile PATH`, prints the share of each kernel in the profiled step's device time
//! before the summary (module [`kernel_times`]): GPU kernels timed by CUDA events on
//! `--device cuda`, the CPU streams' kernels otherwise.

mod ckpt;
mod cli;
mod cuda;
mod data;
mod hf;
mod interop;
mod job;
mod kernel_times;
mod optim;
mod paths;
mod plan;
mod probe;
mod report;
mod sample;
mod tokenizer;
mod train;

use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use fsdp_core::checkpoint::CheckpointManager;
use fsdp_core::state_dict::check_save_target;
use fsdp_core::{BackwardPrefetch, ShardOver};
use serde_json::json;

use crate::cli::Cli;
use crate::job::{prefetch_name, strategy_name, StepRecord, TrainConfig};
use crate::optim::Optimizer;
use crate::report::{mib, thousands, Console};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The sharding factor and the parameter(+gradient) peak the paper's formula predicts.
fn predicted_peak(c: &TrainConfig, total: usize, max_unit: usize) -> (usize, u64) {
    let prefetch = c.backward_prefetch != BackwardPrefetch::None || c.forward_prefetch;
    let extra = if prefetch { max_unit } else { 0 };
    // From the strategy table: the sharding factor F; unsharded, a full copy; resharded after
    // forward, the shard plus one gathered unit (two with prefetch); otherwise the shard plus
    // every gathered unit kept from forward to backward.
    let spec = c.strategy.spec();
    let f = spec.factor(c.ranks, c.shard_size.unwrap_or(c.ranks));
    if !spec.is_sharded() {
        (1, total as u64)
    } else if spec.reshard_after_forward {
        (f, (total / f + max_unit + extra) as u64)
    } else {
        (f, (total / f + total) as u64)
    }
}

/// Checks every output location before step 1 (fsdp-core's fail-early checks: the directory
/// exists or can be created, a file can be created in it, the target is not a symlink or device,
/// and for checkpoints there is room for another one the size of the newest).
fn check_outputs(cli: &Cli, c: &TrainConfig) -> Result<(), String> {
    if let Some(d) = &c.checkpoint_dir {
        CheckpointManager::new(d, c.keep_checkpoints)
            .and_then(|m| m.check_target())
            .map_err(|e| format!("--checkpoint-dir: {e}"))?;
    }
    for (flag, p) in [
        ("--save", &c.save),
        ("--plot", &cli.logging.plot),
        ("--metrics", &cli.logging.metrics),
        ("--profile", &c.profile),
    ] {
        if let Some(p) = p {
            check_save_target(p, None).map_err(|e| format!("{flag}: {e}"))?;
        }
    }
    Ok(())
}

fn banner(c: &TrainConfig, data: &str, cores: usize, threads: usize, params: u64) -> String {
    let g = &c.gpt;
    let shard = if c.strategy.spec().shard_over == ShardOver::ShardGroup {
        format!(" (shard groups of {})", c.shard_size.unwrap_or(c.ranks))
    } else {
        String::new()
    };
    let mut extras = String::new();
    if let Some(d) = c.mixed_precision {
        extras.push_str(&format!(" | mixed precision {d}"));
    }
    if c.grad_accum > 1 {
        extras.push_str(&format!(" | grad accum {}", c.grad_accum));
        if c.no_sync {
            extras.push_str(" (no_sync)");
        }
    }
    if let Some(x) = c.clip_grad_norm {
        extras.push_str(&format!(" | clip grad norm {x}"));
    }
    if c.warmup_steps > 0 {
        extras.push_str(&format!(" | warm-up {} steps", c.warmup_steps));
    }
    if let Some(m) = c.min_lr {
        extras.push_str(&format!(" | cosine decay to {m}"));
    }
    if g.tied {
        extras.push_str(" | tied embedding/head");
    }
    if let Some(launch) = c.cuda {
        extras.push_str(match launch {
            job::CudaLaunch::Threads => " | CUDA: a thread per GPU, NCCL",
            job::CudaLaunch::Processes => " | CUDA: a process per GPU, NCCL",
        });
    }
    if c.cpu_offload {
        extras.push_str(" | CPU offload");
    }
    if c.deferred_init {
        extras.push_str(" | deferred init");
    }
    if c.checked {
        extras.push_str(" | checked devices");
    }
    if let Some(fsdp_core::Quantization::Int8 { block }) = c.quantize_collectives {
        extras.push_str(&format!(" | int8 collectives (block {block})"));
    }
    format!(
        "train_gpt: GPT vocab {} d_model {} layers {} heads {} seq {} gelu {} ({} parameters) | data: {data} | \
         {} ranks × batch {} | {}{shard}, Block units, backward prefetch {}, forward prefetch {}, \
         limit all-gathers {} | {} lr {} | {} steps | seed {} | {cores} cores, {threads} matmul \
         thread(s)/rank{extras}",
        g.vocab,
        g.d_model,
        g.n_layers,
        g.n_heads,
        g.seq_len,
        g.gelu.name(),
        thousands(params),
        c.ranks,
        c.batch,
        strategy_name(c.strategy),
        prefetch_name(c.backward_prefetch),
        if c.forward_prefetch { "on" } else { "off" },
        limit_name(c),
        match c.optimizer {
            Optimizer::Sgd => "SGD",
            Optimizer::AdamW => "AdamW",
            Optimizer::Lamb => "LAMB",
        },
        c.lr,
        c.steps,
        c.seed,
    )
}

/// The `--limit-all-gathers` spelling of the configuration.
fn limit_name(c: &TrainConfig) -> &'static str {
    match (c.adaptive_limiter, c.limit_all_gathers) {
        (Some(_), _) => "auto",
        (None, true) => "on",
        (None, false) => "off",
    }
}

/// The `--quantize-collectives` spelling of the configuration.
fn quant_name(c: &TrainConfig) -> &'static str {
    match c.quantize_collectives {
        None => "none",
        Some(fsdp_core::Quantization::Int8 { .. }) => "int8",
    }
}

/// JSON has no NaN or infinity: those become `null`.
fn json_num(x: f64) -> serde_json::Value {
    if x.is_finite() {
        json!(x)
    } else {
        serde_json::Value::Null
    }
}

/// Whether this process prints: always with thread ranks; with `--backend mpi`, rank 0 (from
/// the launcher's environment).
fn primary_process(c: &TrainConfig) -> bool {
    if c.cuda == Some(job::CudaLaunch::Processes) {
        return fsdp_collectives::RendezvousEnv::from_env().is_ok_and(|e| e.rank == 0);
    }
    if !c.mpi {
        return true;
    }
    ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"]
        .iter()
        .find_map(|v| std::env::var(v).ok())
        .is_none_or(|r| r.trim() == "0")
}

fn run(cli: Cli, mut c: TrainConfig) -> Result<(), String> {
    check_outputs(&cli, &c)?;
    fsdp_autograd::kernels::cuda::set_allow_tf32(c.tf32);
    let primary = primary_process(&c);
    // --init-from (the model's shape), --tokenizer gpt2 (the cached token file).
    for note in interop::prepare(&mut c)? {
        if primary {
            println!("{note}");
        }
    }
    let metrics = match cli.logging.metrics.as_ref().filter(|_| primary) {
        Some(p) => Some((
            p.clone(),
            std::fs::File::create(p).map_err(|e| format!("--metrics {}: {e}", p.display()))?,
        )),
        None => None,
    };
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    // Peak GEMM rate of the device the model trains on, at its precision, before training
    // (module `probe`: f32 on all cores for CPU ranks; the GPU with `--device cuda`).
    // On CUDA it runs after training (unless --plan needs it now): the CUDA kernel backend is
    // cached per device id, and its first user's device would otherwise be the probe's.
    let probe_now = c.cuda.is_none() || cli.planning.plan;
    let early_probe = match probe_now {
        true => Some(
            probe::run(&c, cores, Duration::from_millis(200))
                .map_err(|e| format!("GEMM probe: {e}"))?,
        ),
        false => None,
    };
    let gemm_rate = early_probe.as_ref().map_or(f64::NAN, |p| p.flops_per_s);
    if cli.planning.plan {
        // `--plan`: the ranked table (rank 0 prints it); `--apply` trains with the top plan.
        let (cluster, hardware) = plan::cluster(&cli.planning, c.ranks, gemm_rate)?;
        let planner = plan::planner(&c, cluster, hardware)?;
        let top = if primary {
            plan::print_plan(&c, &planner)?
        } else {
            planner.plan().ok().and_then(|p| p.first().copied())
        };
        if !cli.planning.apply {
            return Ok(());
        }
        let top = match top {
            Some(t) => t,
            None => {
                return Err(planner
                    .plan()
                    .err()
                    .map_or("no plan".into(), |e| e.to_string()))
            }
        };
        if c.mpi && cli.planning.cluster_tflops.is_none() && cli.planning.cluster.is_none() {
            return Err(
                "--plan --apply with --backend mpi: give the compute rate (--cluster-tflops or \
                 --cluster FILE) so every process plans alike (each process's GEMM probe differs)"
                    .into(),
            );
        }
        if cluster.world() != c.ranks {
            return Err(format!(
                "--apply: the assumed cluster has {} ranks ({} node(s) × {}), but this run has \
                 --ranks {}; plan for the ranks you train on",
                cluster.world(),
                cluster.nodes,
                cluster.ranks_per_node,
                c.ranks
            ));
        }
        plan::apply(&mut c, &top).map_err(|e| e.0)?;
    }
    // Ranks share the machine's cores: give each rank's matmuls an even share (unless
    // --matmul-threads says otherwise).
    let threads = cli
        .parallel
        .matmul_threads
        .map_or((cores / c.ranks).max(1), |t| t as usize);
    fsdp_autograd::kernels::cpu::set_matmul_threads(threads);
    let params = cli::gpt_params(&c.gpt);
    let data = train::open_data(&c).map_err(|e| e.to_string())?;
    if primary {
        println!("{}", banner(&c, &data.describe(), cores, threads, params));
    }

    let every = cli
        .logging
        .log_every
        .map_or((c.steps / 12).max(1), |n| n as usize);
    let progress = primary && std::io::stdout().is_terminal() && !cli.logging.no_progress;
    let console = Console::new(progress, every, metrics);
    let start = Instant::now();
    let mut rep = train::run_job(&c, Box::new(console), false).map_err(|e| e.to_string())?;
    let wall = start.elapsed().as_secs_f64();
    rep.observer
        .finish()
        .map_err(|e| format!("--metrics: {e}"))?;
    if rep.rank != 0 {
        // Another process of an MPI job: rank 0 reports.
        return Ok(());
    }

    if let Some(p) = &cli.logging.plot {
        report::plot(p, &rep.history)?;
        println!("plot: {}", p.display());
    }
    if rep.steps.is_empty() {
        println!(
            "nothing to do: the checkpoint is at step {} of --steps {}",
            rep.first_step - 1,
            c.steps
        );
        return Ok(());
    }
    let gemm_probe = match early_probe {
        Some(p) => p,
        None => probe::run(&c, cores, Duration::from_millis(200))
            .map_err(|e| format!("GEMM probe: {e}"))?,
    };
    if cli.logging.kernel_times {
        if let Some(p) = &cli.logging.profile {
            kernel_times::print(p)?;
        }
    }
    summary(&c, &rep, wall, &gemm_probe, params, cli.logging.json);
    Ok(())
}

fn summary(
    c: &TrainConfig,
    rep: &job::Report,
    wall: f64,
    gemm_probe: &probe::Probe,
    params: u64,
    json_line: bool,
) {
    let gemm_rate = gemm_probe.flops_per_s;
    let steps = &rep.steps;
    let timed: Vec<f64> = if steps.len() > 1 {
        steps[1..].iter().map(|s| s.secs).collect()
    } else {
        steps.iter().map(|s| s.secs).collect()
    };
    let step_s = median(timed);
    // Host waits per step (first step excluded like the time: it creates optimizer state).
    let syncs: Vec<f64> = steps
        .iter()
        .skip(usize::from(steps.len() > 1))
        .map(|s| s.host_syncs as f64)
        .collect();
    let host_syncs = median(syncs);
    let tokens = c.tokens_per_step() as f64;
    let tokens_per_s = tokens / step_s;
    let first = steps.first().map_or(f32::NAN, |s| s.loss);
    let last = steps.last().map_or(f32::NAN, |s| s.loss);
    let peak = steps.iter().map(|s| s.peak_allocated).max().unwrap_or(0);
    let peak_reserved = steps.iter().map(|s| s.peak_reserved).max().unwrap_or(0);
    let state = steps.iter().map(|s| s.state_bytes).max().unwrap_or(0);
    let retries: u64 = steps.iter().map(|s| s.retries).sum();
    let (factor, predicted) = predicted_peak(c, rep.total_param_bytes, rep.max_unit_bytes);

    println!("summary:");
    println!(
        "  model      {} units, Ψ = {} parameters ({:.1} MiB), largest unit ψmax = {} ({:.1} MiB), sharding factor {factor}",
        rep.units,
        thousands(rep.total_param_bytes as u64 / 4),
        mib(rep.total_param_bytes as u64),
        thousands(rep.max_unit_bytes as u64 / 4),
        mib(rep.max_unit_bytes as u64),
    );
    let k = (steps.len() / 4).clamp(1, 5);
    let mean = |s: &[StepRecord]| s.iter().map(|r| r.loss as f64).sum::<f64>() / s.len() as f64;
    let (head, tail) = (mean(&steps[..k]), mean(&steps[steps.len() - k..]));
    println!(
        "  loss       {first:.3} -> {last:.3} over steps {}..={}; mean of the first {k} {head:.3}, of \
         the last {k} {tail:.3} ({})",
        rep.first_step,
        rep.first_step + steps.len() - 1,
        if tail < head { "falling" } else { "NOT falling" }
    );
    let vals: Vec<(usize, f32)> = steps
        .iter()
        .filter_map(|s| s.val_loss.map(|v| (s.step, v)))
        .collect();
    if !vals.is_empty() {
        let list: Vec<String> = vals
            .iter()
            .map(|(s, v)| format!("step {s}: {v:.3}"))
            .collect();
        println!("  val loss   {}", list.join(", "));
    }
    println!(
        "  speed      median step {:.1} ms (first step excluded), {} tok/s, {:.1} s wall",
        step_s * 1e3,
        thousands(tokens_per_s.round() as u64),
        wall
    );
    let g = &c.gpt;
    let flops_per_token = 6.0 * params as f64 + 12.0 * (g.n_layers * g.d_model * g.seq_len) as f64;
    let model_flops = flops_per_token * tokens_per_s;
    println!(
        "  compute    {:.2} GFLOP/s model FLOPs (6·Ψ + attention per token) vs {:.2} GFLOP/s {} \
         GEMM probe on {} ({:.0}%)",
        model_flops / 1e9,
        gemm_rate / 1e9,
        gemm_probe.dtype,
        if gemm_probe.device == "cpu" {
            "all cores"
        } else {
            &gemm_probe.device
        },
        100.0 * model_flops / gemm_rate
    );
    println!(
        "  memory     peak allocated {:.1} MiB/rank, peak reserved {:.1} MiB/rank (max over ranks \
         and steps); predicted parameter peak {:.1} MiB; {retries} allocation retries",
        mib(peak),
        mib(peak_reserved),
        mib(predicted)
    );
    let slots = rep.optim_slots as u64;
    let unsharded = rep.total_param_bytes as u64 * (2 + slots);
    let unit = rep.max_unit_bytes as u64 * 2;
    println!(
        "  state      params+grads+optimizer state {:.1} MiB/rank (measured after the optimizer \
         step); unsharded S = {:.1} MiB (4Ψ·(2+{slots} slots)), S/F = {:.1} MiB, S/F + one unit \
         (params+grads) = {:.1} MiB",
        mib(state),
        mib(unsharded),
        mib(unsharded / factor as u64),
        mib(unsharded / factor as u64 + unit)
    );
    println!(
        "  comm/rank  all-gather {:.1} MiB, reduce-scatter {:.1} MiB, all-reduce {:.1} MiB (rank 0, this run)",
        mib(rep.total_ag),
        mib(rep.total_rs),
        mib(rep.total_ar)
    );
    if json_line {
        let val = vals.last().map(|v| v.1 as f64).unwrap_or(f64::NAN);
        let j = json!({
            "ranks": c.ranks,
            "strategy": strategy_name(c.strategy),
            "tokens_per_s": json_num((tokens_per_s * 10.0).round() / 10.0),
            "step_ms_median": json_num(step_s * 1e3),
            "host_syncs_per_step": json_num(host_syncs),
            "final_loss": json_num(last as f64),
            "val_loss": json_num(val),
            "peak_allocated_bytes_per_rank": peak,
            "peak_reserved_bytes_per_rank": peak_reserved,
            "predicted_peak_param_grad_bytes": predicted,
            "state_bytes_per_rank": state,
            "all_gather_bytes": rep.total_ag,
            "reduce_scatter_bytes": rep.total_rs,
            "num_alloc_retries": retries,
            "params": rep.total_param_bytes / 4,
            "steps": steps.len(),
            "first_step": rep.first_step,
            "model_flops_per_s": json_num(model_flops),
            "gemm_flops_per_s": json_num(gemm_rate),
            "gemm_probe_device": gemm_probe.device,
            "gemm_probe_dtype": gemm_probe.dtype.to_string(),
            "limit_all_gathers": limit_name(c),
            "quantize_collectives": quant_name(c),
        });
        println!("{j}");
    }
}

/// A command-line parse failure: `--help`/`--version` print and succeed; anything else prints
/// one line (clap's first line names the flag, the value and the allowed range) and exits 2.
fn usage_exit(prog: &str, e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        let _ = e.print();
        return ExitCode::SUCCESS;
    }
    let msg = e.to_string();
    let line = msg
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("usage error");
    eprintln!(
        "{prog}: {} (see --help)",
        line.trim_start_matches("error: ")
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    // `train_gpt sample …`: generation (module `sample`), its own flags.
    if std::env::args().nth(1).as_deref() == Some("sample") {
        let cli = match sample::SampleCli::try_parse_from(std::env::args().skip(1)) {
            Ok(c) => c,
            Err(e) => return usage_exit("train_gpt sample", e),
        };
        return match sample::run(cli) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("train_gpt sample: error: {e}");
                ExitCode::from(1)
            }
        };
    }
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => return usage_exit("train_gpt", e),
    };
    if cli.planning.apply && !cli.planning.plan {
        eprintln!(
            "train_gpt: --apply needs --plan (it trains with the planner's top plan) (see --help)"
        );
        return ExitCode::from(2);
    }
    if let Ok(Some(launch)) = cli::cuda_launch(cli.parallel.device, cli.parallel.backend) {
        // A typed error, never a panic: `Device::cuda` checks for the driver library before
        // touching cudarc.
        if let Err(e) = cuda::preflight(launch) {
            eprintln!("train_gpt: --device cuda: {e}");
            return ExitCode::from(1);
        }
    }
    let config = match cli.clone().into_config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("train_gpt: {e} (see --help)");
            return ExitCode::from(2);
        }
    };
    // Outputs that would destroy inputs or each other, a directory as --save, a non-file as
    // --data, a fresh run into a used checkpoint directory: usage errors before anything runs.
    if let Err(e) = paths::check(
        &config,
        cli.logging.metrics.as_deref(),
        cli.logging.plot.as_deref(),
    ) {
        eprintln!("train_gpt: {e}");
        return ExitCode::from(2);
    }
    match run(cli, config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("train_gpt: error: {e}");
            ExitCode::from(1)
        }
    }
}
