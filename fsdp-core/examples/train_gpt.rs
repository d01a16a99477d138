//! Trains a small GPT with FSDP on CPU thread ranks — fsdp-rs's main job.
//!
//! ```sh
//! cargo run --release --example train_gpt                       # 4 ranks, FullShard, GPT-mini
//! cargo run --release --example train_gpt -- --strategy no-shard --steps 10 --json
//! cargo run --release --example train_gpt -- --help
//! ```
//!
//! Every rank is a thread with its own [`Device`] (allocator, streams) and a handle to one
//! in-process [`ThreadGroup`]. Each rank builds the same model from the same seed, wraps it with
//! [`Fsdp::wrap`] (one unit per transformer `Block`, the rest in the root unit) and trains it
//! with SGD (or `--optimizer adamw`) on its own micro-batches of a synthetic, learnable token
//! stream: sequences that count up by a per-sequence stride (mod `vocab`), so the next token
//! follows from the previous two. Flags add mixed precision, gradient accumulation (with or
//! without `no_sync`), clipping, a tied embedding/head, CPU offload, and full-state-dict
//! save/load through a safetensors file.
//!
//! ## What a step line reports
//! `step 10 | loss 3.214 | 5,230 tok/s | peak 41.2 MiB/rank | ag 12.1 MiB rs 12.1 MiB`
//! - `loss`: the global-batch mean cross-entropy of that step — every rank's micro-batch mean
//!   cross-entropy, averaged over ranks with an f32 all-reduce (each rank contributes `loss / W`,
//!   which is also the value it backpropagates).
//! - `tok/s`: tokens of the global batch (`ranks × batch × seq`) over rank 0's wall time for the
//!   step (forward, backward, optimizer step, and a full synchronization of the rank's streams).
//! - `peak`: the largest per-rank `peak_allocated_bytes` of the step over all ranks (the stats are
//!   reset at the start of every step, so it includes activations, parameters, gradients and
//!   communication buffers; model construction and wrapping are not part of any step).
//! - `ag` / `rs` (`ar` where all-reduces run): bytes rank 0's FSDP collectives moved in the step.
//!
//! The summary and the `--json` line use the median step time of all steps but the first (warm-up:
//! the allocator's cache is empty, the forward order is not yet recorded); with one step, that
//! step. `all_gather_bytes` / `reduce_scatter_bytes` are rank 0's totals over the run, in the
//! dtype communicated (bf16/f16 under mixed precision). `params` is Ψ: the elements of all flat
//! parameters (padding included), the same under every mixed-precision setting.
//!
//! ## `predicted_peak_param_grad_bytes`
//! With `P` = bytes of all f32 parameters (`4·Ψ`), `m` = bytes of the largest unit (`4·maxᵢ ψᵢ`,
//! both from [`Fsdp::param_bytes`]) and `F` the sharding factor, the issue's bound for the
//! parameter(+gradient) contribution (the paper's §3.2.1 term, `O(Σψᵢ/F + maxᵢ ψᵢ)`):
//! - `full-shard` (F = ranks) and `hybrid-shard` (F = `--shard-size`): `P/F + m`, plus one more
//!   `m` when a prefetch (backward pre/post or forward) can hold a second unit unsharded;
//! - `shard-grad-op`: `P/F + P` (every unit stays unsharded from its forward to its backward);
//! - `no-shard`: `P`.
//!
//! It is a model prediction, not a measurement: the measured peak also holds activations (which
//! dominate at these sizes), the sharded gradients, the unsharded flat gradient of the unit in
//! backward and the root unit (never resharded after forward).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use fsdp_alloc::{DType, Device, DeviceConfig};
use fsdp_autograd::nn::{Gpt, GptConfig};
use fsdp_autograd::{cross_entropy, InitContext, Tensor};
use fsdp_collectives::{DeviceMesh, DeviceSlice, ProcessGroup, ReduceOp, ThreadGroup};
use fsdp_core::plumbing::tensor_slice;
use fsdp_core::{
    clip_grad_norm, state_dict, AdamW, BackwardPrefetch, Comm, Fsdp, FsdpConfig, FsdpError,
    MixedPrecision, ParamBytes, ShardedOptimizer, ShardingStrategy, WrapPolicy,
};

const USAGE: &str = "\
usage: train_gpt [options]

Trains the GPT-mini (vocab 256, d_model 256, 4 layers, 4 heads, seq 128) with FSDP on CPU thread
ranks, on synthetic counting sequences, and prints per-step lines and a summary.

options:
  --ranks N                  number of thread ranks (default 4)
  --strategy S               full-shard | shard-grad-op | no-shard | hybrid-shard (default full-shard)
  --shard-size F             shard-group size for hybrid-shard (must divide --ranks)
  --backward-prefetch P      none | pre | post (default pre)
  --forward-prefetch         issue the next unit's all-gather before the current forward
  --limit-all-gathers on|off rate-limit in-flight all-gathers (default on)
  --deferred-init            build the model on the fake device and let FSDP materialize it
  --steps N                  optimizer steps (default 60)
  --lr X                     learning rate (default 0.05 for sgd, 0.001 for adamw)
  --optimizer O              sgd | adamw (default sgd; sharded, state sharded like the params)
  --mixed-precision D        bf16 | f16: gather and compute in D, reduce in D, f32 shards
  --grad-accum N             micro-batches per rank per optimizer step (default 1)
  --no-sync                  with --grad-accum: accumulate unsharded gradients locally and
                             reduce once, at the last micro-batch
  --clip-grad-norm X         clip the global gradient norm (across all shards) to X
  --tied                     tie the token embedding and the LM head (one shared parameter)
  --cpu-offload              keep shards and sharded gradients on a separate host device; the
                             optimizer steps there
  --checked                  run on checked (race-detecting) devices: every access made by
                             stream work is verified to be ordered after conflicting ones
                             (slower; a violation stops training with both streams named)
  --load PATH                load a full state dict (safetensors) before training
  --save PATH                save a full state dict (safetensors) after training
  --batch B                  sequences per rank per step (default 4)
  --seed S                   model init and data seed (default 0)
  --json                     print one JSON object as the last line
  --help                     this text";

/// Parsed command line.
#[derive(Debug, Clone)]
struct Args {
    ranks: usize,
    strategy: ShardingStrategy,
    shard_size: Option<usize>,
    backward_prefetch: BackwardPrefetch,
    forward_prefetch: bool,
    limit_all_gathers: bool,
    deferred_init: bool,
    steps: usize,
    lr: f32,
    batch: usize,
    seed: u64,
    json: bool,
    optimizer: Optimizer,
    lr_given: bool,
    mixed_precision: Option<DType>,
    grad_accum: usize,
    no_sync: bool,
    clip_grad_norm: Option<f64>,
    tied: bool,
    cpu_offload: bool,
    checked: bool,
    load: Option<std::path::PathBuf>,
    save: Option<std::path::PathBuf>,
}

/// The optimizer `--optimizer` picks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Optimizer {
    Sgd,
    AdamW,
}

impl Default for Args {
    fn default() -> Self {
        Args {
            ranks: 4,
            strategy: ShardingStrategy::FullShard,
            shard_size: None,
            backward_prefetch: BackwardPrefetch::BackwardPre,
            forward_prefetch: false,
            limit_all_gathers: true,
            deferred_init: false,
            steps: 60,
            lr: 0.05,
            batch: 4,
            seed: 0,
            json: false,
            optimizer: Optimizer::Sgd,
            lr_given: false,
            mixed_precision: None,
            grad_accum: 1,
            no_sync: false,
            clip_grad_norm: None,
            tied: false,
            cpu_offload: false,
            checked: false,
            load: None,
            save: None,
        }
    }
}

/// What the command line asks for.
enum Command {
    Train(Args),
    Help,
}

fn parse_num<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, String> {
    v.parse()
        .map_err(|_| format!("{flag}: `{v}` is not a valid number"))
}

fn parse_args(argv: &[String]) -> Result<Command, String> {
    let mut a = Args::default();
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        let flag = flag.as_str();
        let mut value = || {
            it.next()
                .map(|s| s.as_str())
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        match flag {
            "--help" | "-h" => return Ok(Command::Help),
            "--ranks" => a.ranks = parse_num(flag, value()?)?,
            "--strategy" => {
                let v = value()?;
                a.strategy = v.parse().map_err(|e| format!("--strategy: {e}"))?;
            }
            "--shard-size" => a.shard_size = Some(parse_num(flag, value()?)?),
            "--backward-prefetch" => {
                let v = value()?;
                a.backward_prefetch = v.parse().map_err(|e| format!("--backward-prefetch: {e}"))?;
            }
            "--forward-prefetch" => a.forward_prefetch = true,
            "--limit-all-gathers" => {
                a.limit_all_gathers = match value()? {
                    "on" | "true" | "1" => true,
                    "off" | "false" | "0" => false,
                    v => {
                        return Err(format!(
                            "--limit-all-gathers: expected on or off, got `{v}`"
                        ))
                    }
                }
            }
            "--deferred-init" => a.deferred_init = true,
            "--steps" => a.steps = parse_num(flag, value()?)?,
            "--lr" => {
                a.lr = parse_num(flag, value()?)?;
                a.lr_given = true;
            }
            "--optimizer" => {
                a.optimizer = match value()? {
                    "sgd" => Optimizer::Sgd,
                    "adamw" => Optimizer::AdamW,
                    v => return Err(format!("--optimizer: expected sgd or adamw, got `{v}`")),
                }
            }
            "--mixed-precision" => {
                a.mixed_precision = match value()? {
                    "bf16" => Some(DType::BF16),
                    "f16" => Some(DType::F16),
                    v => {
                        return Err(format!(
                            "--mixed-precision: expected bf16 or f16, got `{v}`"
                        ))
                    }
                }
            }
            "--grad-accum" => a.grad_accum = parse_num(flag, value()?)?,
            "--no-sync" => a.no_sync = true,
            "--clip-grad-norm" => a.clip_grad_norm = Some(parse_num(flag, value()?)?),
            "--tied" => a.tied = true,
            "--cpu-offload" => a.cpu_offload = true,
            "--checked" => a.checked = true,
            "--load" => a.load = Some(value()?.into()),
            "--save" => a.save = Some(value()?.into()),
            "--batch" => a.batch = parse_num(flag, value()?)?,
            "--seed" => a.seed = parse_num(flag, value()?)?,
            "--json" => a.json = true,
            other => return Err(format!("unknown option `{other}`")),
        }
    }
    if a.ranks == 0 || a.ranks > 64 {
        return Err(format!("--ranks must be in 1..=64, got {}", a.ranks));
    }
    if a.steps == 0 {
        return Err("--steps must be at least 1".into());
    }
    if a.batch == 0 || a.batch > 1024 {
        return Err(format!("--batch must be in 1..=1024, got {}", a.batch));
    }
    if a.optimizer == Optimizer::AdamW && !a.lr_given {
        a.lr = 1e-3;
    }
    if a.grad_accum == 0 || a.grad_accum > 1024 {
        return Err(format!(
            "--grad-accum must be in 1..=1024, got {}",
            a.grad_accum
        ));
    }
    if a.no_sync && a.grad_accum < 2 {
        return Err(
            "--no-sync needs --grad-accum N with N >= 2 (it skips the reduction of \
                    all but the last micro-batch)"
                .into(),
        );
    }
    if let Some(c) = a.clip_grad_norm {
        if !c.is_finite() || c <= 0.0 {
            return Err(format!(
                "--clip-grad-norm must be a positive number, got {c}"
            ));
        }
    }
    if a.cpu_offload && a.strategy == ShardingStrategy::NoShard {
        return Err("--cpu-offload needs a sharded strategy (not no-shard)".into());
    }
    if a.mixed_precision.is_some() && a.strategy == ShardingStrategy::NoShard {
        return Err("--mixed-precision needs a sharded strategy (not no-shard)".into());
    }
    if !a.lr.is_finite() || a.lr <= 0.0 {
        return Err(format!("--lr must be a positive number, got {}", a.lr));
    }
    match (a.strategy, a.shard_size) {
        (ShardingStrategy::HybridShard, None) => {
            return Err("--strategy hybrid-shard needs --shard-size F (F dividing --ranks)".into())
        }
        (ShardingStrategy::HybridShard, Some(f)) if f == 0 || a.ranks % f != 0 => {
            return Err(format!(
                "--shard-size {f} does not divide --ranks {}; pick a divisor",
                a.ranks
            ))
        }
        (ShardingStrategy::HybridShard, Some(_)) => {}
        (s, Some(_)) => {
            return Err(format!(
                "--shard-size only applies to --strategy hybrid-shard (got {})",
                strategy_name(s)
            ))
        }
        (_, None) => {}
    }
    Ok(Command::Train(a))
}

fn strategy_name(s: ShardingStrategy) -> &'static str {
    match s {
        ShardingStrategy::FullShard => "full-shard",
        ShardingStrategy::ShardGradOp => "shard-grad-op",
        ShardingStrategy::NoShard => "no-shard",
        ShardingStrategy::HybridShard => "hybrid-shard",
    }
}

fn prefetch_name(p: BackwardPrefetch) -> &'static str {
    match p {
        BackwardPrefetch::None => "none",
        BackwardPrefetch::BackwardPre => "pre",
        BackwardPrefetch::BackwardPost => "post",
    }
}

/// The model this job trains.
fn model_config() -> GptConfig {
    GptConfig::mini()
}

/// A deterministic, learnable token batch (the same generator as the parity tests' helper):
/// sequence `k` starts at `(7k + 3 + seed) mod vocab` and counts up by `1 + k mod 3`, so the next
/// token follows from the previous two. `index` selects the micro-batch (`step × ranks + rank`).
fn token_batch(
    index: usize,
    batch: usize,
    seq: usize,
    vocab: usize,
    seed: u64,
) -> (Vec<i64>, Vec<i64>) {
    let mut ids = Vec::with_capacity(batch * seq);
    let mut targets = Vec::with_capacity(batch * seq);
    let offset = (seed % vocab as u64) as usize;
    for b in 0..batch {
        let k = index * batch + b;
        let start = (k * 7 + 3 + offset) % vocab;
        let stride = 1 + (k % 3);
        for t in 0..seq {
            ids.push(((start + stride * t) % vocab) as i64);
            targets.push(((start + stride * (t + 1)) % vocab) as i64);
        }
    }
    (ids, targets)
}

/// Mean cross-entropy of one micro-batch scaled by `1 / world` (summing the gradients of the
/// `world` micro-batches then gives the gradient of the global-batch mean).
fn micro_loss(logits: &Tensor, targets: &Tensor, world: usize) -> Result<Tensor, FsdpError> {
    let vocab = logits.shape().last().copied().unwrap_or(1);
    let flat = logits.reshape(&[logits.numel() / vocab, vocab])?;
    let t = targets.reshape(&[targets.numel()])?;
    Ok(cross_entropy(&flat, &t)?.scale(1.0 / world as f32)?)
}

fn slice_of(t: &Tensor) -> Result<DeviceSlice, String> {
    tensor_slice(t).map_err(|e| e.to_string())
}

/// One step as rank 0 sees it, with values reduced over all ranks.
#[derive(Debug, Clone, Copy)]
struct StepRecord {
    loss: f32,
    secs: f64,
    /// Largest per-rank peak allocated bytes of the step.
    peak: u64,
    /// Sum over ranks of allocation retries during the step.
    retries: u64,
    ag: u64,
    rs: u64,
    ar: u64,
}

/// What rank 0 reports after training.
#[derive(Debug)]
struct Report {
    steps: Vec<StepRecord>,
    units: usize,
    total_param_bytes: usize,
    max_unit_bytes: usize,
    total_ag: u64,
    total_rs: u64,
    total_ar: u64,
}

/// Cross-rank metrics of one step: (global mean loss, max peak, sum of retries).
fn reduce_metrics(
    pg: &Arc<dyn ProcessGroup>,
    dev: &Device,
    scaled_loss: f32,
    peak: u64,
    retries: u64,
) -> Result<(f32, u64, u64), String> {
    let stream = fsdp_autograd::current_stream(dev);
    let world = pg.size();
    let l = Tensor::from_vec(vec![scaled_loss], &[1], dev).map_err(|e| e.to_string())?;
    pg.all_reduce(&slice_of(&l)?, ReduceOp::Sum, &stream)
        .wait()
        .map_err(|e| e.to_string())?;
    let mine = Tensor::from_vec(vec![peak as i64, retries as i64], &[2], dev)
        .map_err(|e| e.to_string())?;
    let all = Tensor::zeros(&[2 * world], DType::I64, dev).map_err(|e| e.to_string())?;
    pg.all_gather_into(&slice_of(&mine)?, &slice_of(&all)?, &stream)
        .wait()
        .map_err(|e| e.to_string())?;
    let loss = l.item().map_err(|e| e.to_string())?;
    let v = all.to_vec::<i64>().map_err(|e| e.to_string())?;
    let max_peak = v.chunks(2).map(|c| c[0] as u64).max().unwrap_or(0);
    let sum_retries = v.chunks(2).map(|c| c[1] as u64).sum();
    Ok((loss, max_peak, sum_retries))
}

/// Runs one rank's training; rank 0 prints step lines (unless quiet) and returns the report.
fn run_rank(
    rank: usize,
    pg: Arc<dyn ProcessGroup>,
    args: &Args,
    print_steps: bool,
) -> Result<Option<Report>, String> {
    let cfg = model_config().with_tied(args.tied);
    let world = args.ranks;
    let devices = DeviceConfig::default().with_checked(args.checked);
    let dev = Device::cpu_with(rank, devices);
    let ctx = if args.deferred_init {
        InitContext::fake(args.seed)
    } else {
        InitContext::eager(&dev, args.seed)
    };
    let model = Gpt::new(&ctx, &cfg).map_err(|e| format!("building the model: {e}"))?;
    let comm: Comm = match args.strategy {
        ShardingStrategy::HybridShard => {
            let f = args.shard_size.unwrap_or(world);
            DeviceMesh::new(Arc::clone(&pg), f)
                .map_err(|e| format!("building the {world}/{f} device mesh: {e}"))?
                .into()
        }
        _ => Arc::clone(&pg).into(),
    };
    let config = FsdpConfig {
        strategy: args.strategy,
        wrap_policy: WrapPolicy::ModuleTypes(vec!["Block".into()]),
        backward_prefetch: args.backward_prefetch,
        forward_prefetch: args.forward_prefetch,
        limit_all_gathers: args.limit_all_gathers,
        mixed_precision: args.mixed_precision.map(MixedPrecision::uniform),
        // Each rank's own host device for CPU offload (ids apart from the compute devices).
        cpu_offload: args
            .cpu_offload
            .then(|| Device::cpu_with(10_000 + rank, devices)),
        ..FsdpConfig::default()
    };
    // With --deferred-init the parameters live on the fake device (recorded init ops only) and
    // Fsdp::wrap generates just this rank's shards (FsdpConfig::deferred_init, shard-only).
    let fsdp = Fsdp::wrap(model, &dev, comm, config)
        .map_err(|e| format!("rank {rank}: wrapping the model: {e}"))?;
    if let Some(path) = &args.load {
        state_dict::load_full(&fsdp, path)
            .map_err(|e| format!("rank {rank}: loading {}: {e}", path.display()))?;
        if rank == 0 && print_steps {
            println!("loaded the full state dict from {}", path.display());
        }
    }
    let mut adamw = (args.optimizer == Optimizer::AdamW).then(|| AdamW::new(args.lr));
    let ParamBytes {
        max_unit: max_unit_bytes,
        total: total_param_bytes,
    } = fsdp.param_bytes();
    let units = fsdp.num_units();

    let interval = (args.steps / 12).max(1);
    let mut records = Vec::with_capacity(args.steps);
    let mut prev = fsdp.comm_stats();
    for step in 0..args.steps {
        let retries_before = dev.memory_stats().num_alloc_retries;
        dev.reset_peak_stats();
        let t0 = Instant::now();
        let accum = args.grad_accum;
        let mut run = || -> Result<f32, FsdpError> {
            let mut scaled = 0.0f32;
            for micro in 0..accum {
                let (ids, tg) = token_batch(
                    (step * accum + micro) * world + rank,
                    args.batch,
                    cfg.seq_len,
                    cfg.vocab,
                    args.seed,
                );
                let x = Tensor::from_vec(ids, &[args.batch, cfg.seq_len], &dev)?;
                let y = Tensor::from_vec(tg, &[args.batch, cfg.seq_len], &dev)?;
                let mut fwd_bwd = || -> Result<(), FsdpError> {
                    let logits = fsdp.forward(&x)?;
                    let loss = micro_loss(&logits, &y, world * accum)?;
                    loss.backward()?;
                    scaled += loss.item()?;
                    Ok(())
                };
                if args.no_sync && micro + 1 < accum {
                    fsdp.no_sync(fwd_bwd)?;
                } else {
                    fwd_bwd()?;
                }
            }
            if let Some(max) = args.clip_grad_norm {
                clip_grad_norm(&fsdp, max)?;
            }
            match adamw.as_mut() {
                Some(opt) => {
                    opt.step(&fsdp)?;
                    opt.zero_grad(&fsdp);
                }
                None => {
                    fsdp.sgd_step(args.lr)?;
                    fsdp.zero_grad();
                }
            }
            fsdp.synchronize()?;
            Ok(scaled)
        };
        let scaled = run().map_err(|e| format!("rank {rank}, step {}: {e}", step + 1))?;
        let secs = t0.elapsed().as_secs_f64();
        let mem = dev.memory_stats();
        let (loss, peak, retries) = reduce_metrics(
            &pg,
            &dev,
            scaled,
            mem.peak_allocated_bytes as u64,
            mem.num_alloc_retries - retries_before,
        )?;
        let now = fsdp.comm_stats();
        let rec = StepRecord {
            loss,
            secs,
            peak,
            retries,
            ag: now.all_gather_bytes - prev.all_gather_bytes,
            rs: now.reduce_scatter_bytes - prev.reduce_scatter_bytes,
            ar: now.all_reduce_bytes - prev.all_reduce_bytes,
        };
        prev = now;
        if rank == 0
            && print_steps
            && (step == 0 || (step + 1) % interval == 0 || step + 1 == args.steps)
        {
            let tokens = (world * args.grad_accum * args.batch * cfg.seq_len) as f64;
            let mut line = format!(
                "step {:>3} | loss {:.3} | {} tok/s | peak {:.1} MiB/rank | ag {:.1} MiB rs {:.1} MiB",
                step + 1,
                rec.loss,
                thousands((tokens / rec.secs).round() as u64),
                mib(rec.peak),
                mib(rec.ag),
                mib(rec.rs),
            );
            if rec.ar > 0 {
                line.push_str(&format!(" ar {:.1} MiB", mib(rec.ar)));
            }
            println!("{line}");
        }
        records.push(rec);
    }
    if let Some(path) = &args.save {
        state_dict::save_full(&fsdp, path)
            .map_err(|e| format!("rank {rank}: saving {}: {e}", path.display()))?;
        if rank == 0 && print_steps {
            println!("saved the full state dict to {}", path.display());
        }
    }
    let total = fsdp.comm_stats();
    Ok((rank == 0).then_some(Report {
        steps: records,
        units,
        total_param_bytes,
        max_unit_bytes,
        total_ag: total.all_gather_bytes,
        total_rs: total.reduce_scatter_bytes,
        total_ar: total.all_reduce_bytes,
    }))
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

/// `5230` → `5,230`.
fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

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

/// The sharding factor and the parameter(+gradient) peak the issue's formula predicts (see the
/// module docs).
fn predicted_peak(args: &Args, total: usize, max_unit: usize) -> (usize, u64) {
    let prefetch = args.backward_prefetch != BackwardPrefetch::None || args.forward_prefetch;
    let extra = if prefetch { max_unit } else { 0 };
    match args.strategy {
        ShardingStrategy::FullShard => (args.ranks, (total / args.ranks + max_unit + extra) as u64),
        ShardingStrategy::HybridShard => {
            let f = args.shard_size.unwrap_or(args.ranks);
            (f, (total / f + max_unit + extra) as u64)
        }
        ShardingStrategy::ShardGradOp => (args.ranks, (total / args.ranks + total) as u64),
        ShardingStrategy::NoShard => (1, total as u64),
    }
}

fn run(args: &Args) -> Result<(), String> {
    let cfg = model_config();
    // Ranks share the machine's cores: give each rank's matmuls an even share.
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let threads = (cores / args.ranks).max(1);
    fsdp_autograd::kernels::cpu::set_matmul_threads(threads);
    let shard = match args.strategy {
        ShardingStrategy::HybridShard => format!(
            " (shard groups of {})",
            args.shard_size.unwrap_or(args.ranks)
        ),
        _ => String::new(),
    };
    let mut extras = String::new();
    if let Some(d) = args.mixed_precision {
        extras.push_str(&format!(" | mixed precision {d}"));
    }
    if args.grad_accum > 1 {
        extras.push_str(&format!(" | grad accum {}", args.grad_accum));
        if args.no_sync {
            extras.push_str(" (no_sync)");
        }
    }
    if let Some(c) = args.clip_grad_norm {
        extras.push_str(&format!(" | clip grad norm {c}"));
    }
    if args.tied {
        extras.push_str(" | tied embedding/head");
    }
    if args.cpu_offload {
        extras.push_str(" | CPU offload");
    }
    if args.checked {
        extras.push_str(" | checked devices");
    }
    println!(
        "train_gpt: GPT vocab {} d_model {} layers {} heads {} seq {} | {} ranks × batch {} | \
         {}{shard}, Block units, backward prefetch {}, forward prefetch {}, limit all-gathers {} | \
         {} lr {} | {} steps | seed {} | {cores} cores, {threads} matmul thread(s)/rank{extras}",
        cfg.vocab,
        cfg.d_model,
        cfg.n_layers,
        cfg.n_heads,
        cfg.seq_len,
        args.ranks,
        args.batch,
        strategy_name(args.strategy),
        prefetch_name(args.backward_prefetch),
        if args.forward_prefetch { "on" } else { "off" },
        if args.limit_all_gathers { "on" } else { "off" },
        match args.optimizer {
            Optimizer::Sgd => "SGD",
            Optimizer::AdamW => "AdamW",
        },
        args.lr,
        args.steps,
        args.seed,
    );

    let start = Instant::now();
    let handles: Vec<_> = ThreadGroup::new(args.ranks)
        .into_iter()
        .enumerate()
        .map(|(r, g)| {
            let a = args.clone();
            std::thread::Builder::new()
                .name(format!("rank{r}"))
                .spawn(move || run_rank(r, Arc::new(g), &a, true))
                .map_err(|e| format!("spawning rank {r}: {e}"))
        })
        .collect::<Result<_, _>>()?;
    let mut report = None;
    let mut errors = Vec::new();
    for (r, h) in handles.into_iter().enumerate() {
        match h.join() {
            Ok(Ok(Some(rep))) => report = Some(rep),
            Ok(Ok(None)) => {}
            Ok(Err(e)) => errors.push(e),
            Err(_) => errors.push(format!("rank {r} panicked")),
        }
    }
    if !errors.is_empty() {
        // Peers of a failed rank fail too (their collectives see it); the first error is the cause
        // more often than not, but show them all.
        errors.dedup();
        return Err(errors.join("\n"));
    }
    let rep = report.ok_or("rank 0 returned no report")?;
    let wall = start.elapsed().as_secs_f64();

    let timed: Vec<f64> = if rep.steps.len() > 1 {
        rep.steps[1..].iter().map(|s| s.secs).collect()
    } else {
        rep.steps.iter().map(|s| s.secs).collect()
    };
    let step_s = median(timed);
    let tokens = (args.ranks * args.grad_accum * args.batch * cfg.seq_len) as f64;
    let tokens_per_s = tokens / step_s;
    let first = rep.steps.first().map(|s| s.loss).unwrap_or(f32::NAN);
    let last = rep.steps.last().map(|s| s.loss).unwrap_or(f32::NAN);
    let peak = rep.steps.iter().map(|s| s.peak).max().unwrap_or(0);
    let retries: u64 = rep.steps.iter().map(|s| s.retries).sum();
    let (factor, predicted) = predicted_peak(args, rep.total_param_bytes, rep.max_unit_bytes);

    println!("summary:");
    println!(
        "  model      {} units, Ψ = {} parameters ({:.1} MiB), largest unit ψmax = {} ({:.1} MiB), sharding factor {factor}",
        rep.units,
        thousands(rep.total_param_bytes as u64 / 4),
        mib(rep.total_param_bytes as u64),
        thousands(rep.max_unit_bytes as u64 / 4),
        mib(rep.max_unit_bytes as u64),
    );
    let k = (rep.steps.len() / 4).clamp(1, 5);
    let mean = |s: &[StepRecord]| s.iter().map(|r| r.loss as f64).sum::<f64>() / s.len() as f64;
    let (head, tail) = (
        mean(&rep.steps[..k]),
        mean(&rep.steps[rep.steps.len() - k..]),
    );
    println!(
        "  loss       {first:.3} -> {last:.3} over {} steps; mean of the first {k} {head:.3}, of the \
         last {k} {tail:.3} ({})",
        rep.steps.len(),
        if tail < head { "falling" } else { "NOT falling" }
    );
    println!(
        "  speed      median step {:.1} ms (first step excluded), {} tok/s, {:.1} s wall",
        step_s * 1e3,
        thousands(tokens_per_s.round() as u64),
        wall
    );
    println!(
        "  memory     peak allocated {:.1} MiB/rank (max over ranks and steps); predicted \
         parameter peak {:.1} MiB; {retries} allocation retries",
        mib(peak),
        mib(predicted)
    );
    println!(
        "  comm/rank  all-gather {:.1} MiB, reduce-scatter {:.1} MiB, all-reduce {:.1} MiB (rank 0, whole run)",
        mib(rep.total_ag),
        mib(rep.total_rs),
        mib(rep.total_ar)
    );
    if args.json {
        println!(
            "{{\"ranks\":{},\"strategy\":\"{}\",\"params\":{},\"tokens_per_s\":{:.1},\"step_ms_median\":{:.3},\
             \"final_loss\":{},\"peak_allocated_bytes_per_rank\":{},\
             \"predicted_peak_param_grad_bytes\":{},\"all_gather_bytes\":{},\
             \"reduce_scatter_bytes\":{},\"num_alloc_retries\":{}}}",
            args.ranks,
            strategy_name(args.strategy),
            rep.total_param_bytes / 4,
            tokens_per_s,
            step_s * 1e3,
            json_f32(last),
            peak,
            predicted,
            rep.total_ag,
            rep.total_rs,
            retries
        );
    }
    Ok(())
}

/// JSON has no NaN or infinity: those become `null`.
fn json_f32(x: f32) -> String {
    if x.is_finite() {
        format!("{x}")
    } else {
        "null".into()
    }
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    match parse_args(&argv) {
        Ok(Command::Help) => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        Ok(Command::Train(args)) => match run(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("train_gpt: error: {e}");
                ExitCode::from(1)
            }
        },
        Err(e) => {
            eprintln!("train_gpt: {e}\n\n{USAGE}");
            ExitCode::from(2)
        }
    }
}
