//! The command line (`clap` derive) and its validation into a [`TrainConfig`].
//!
//! Every numeric flag is bounded at parse time, so a huge value is a usage error (exit 2, one
//! line), never an allocation failure or an abort later on.

use std::path::PathBuf;

use clap::{Args, Parser, ValueEnum};
use fsdp_alloc::DType;
use fsdp_autograd::nn::{Gelu, GptConfig, Llama3Scaling, LlamaConfig};
use fsdp_core::{BackwardPrefetch, LimitAllGathers, Quantization, ShardingStrategy};
use fsdp_core::{ShardOver, STRATEGIES};

use crate::data::DataFormat;
use crate::job::UsageError;
use crate::job::{CudaLaunch, DataSpec, TrainConfig, MAX_STEPS};
use crate::model::{ModelSpec, ShapeFlags};
use crate::optim::{OptimHyper, OptimizerArg};

/// Largest model `--model`/overrides may build (parameters); `--plan` alone (no training)
/// describes models of any size without building them.
pub const MAX_PARAMS: u64 = 4_000_000_000;
/// Most thread ranks a training run may start; `--plan` alone accepts up to 65,536.
pub const MAX_RANKS: u64 = 64;

/// Trains a GPT with FSDP on CPU thread ranks (fsdp-rs's main job).
///
/// Without flags: GPT-mini (vocab 256, d_model 256, 4 layers, 4 heads, seq 128) on 4 thread
/// ranks, FullShard, SGD, 60 steps on an embedded synthetic stream (sequences that count up by a
/// per-sequence stride, so the next token follows from the previous two).
#[derive(Parser, Debug, Clone)]
#[command(
    name = "train_gpt",
    version,
    about = "Trains a GPT with FSDP on CPU thread ranks (default: GPT-mini, 4 ranks, FullShard, 60 SGD steps on a synthetic stream)",
    max_term_width = 100
)]
pub struct Cli {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub data: DataArgs,
    #[command(flatten)]
    pub parallel: ParallelArgs,
    #[command(flatten)]
    pub comm: CommArgs,
    #[command(flatten)]
    pub optim: OptimArgs,
    #[command(flatten)]
    pub checkpoint: CheckpointArgs,
    #[command(flatten)]
    pub logging: LoggingArgs,
    #[command(flatten)]
    pub planning: crate::plan::PlanArgs,
    #[command(flatten)]
    pub interop: crate::interop::InteropArgs,
}

/// Model shape.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Model")]
pub struct ModelArgs {
    /// Model preset: GPTs mini (vocab 256, d 256, 4 layers, 4 heads, seq 128), small (~25M:
    /// vocab 256, d 512, 8 layers, 8 heads, seq 256), gpt2 (124M: vocab 50257, d 768, 12 layers,
    /// 12 heads, seq 1024, embedding tied to the head as in GPT-2); Llamas (RMSNorm, RoPE,
    /// grouped-query attention, SwiGLU, no biases) llama-tiny (0.8M: vocab 256, d 128, 4 layers,
    /// 4 heads over 2 key/value heads, ffn 352, seq 128), llama-small (~24M: vocab 256, d 512,
    /// 8 layers, 8/4 heads, ffn 1408, seq 256), llama-1b (Llama 3.2 1B's shape, 1.24B: vocab
    /// 128256, d 2048, 16 layers, 32/8 heads, ffn 8192, seq 2048, θ 500000 with llama3 scaling,
    /// tied), llama-8b (Llama 3.1 8B's shape, 8.0B, untied: for --plan)
    #[arg(long, value_enum, default_value_t = ModelPreset::Mini)]
    pub model: ModelPreset,
    /// Override the preset's model width (divisible by --heads)
    #[arg(long, value_name = "D", value_parser = clap::value_parser!(u64).range(1..=16_384))]
    pub d_model: Option<u64>,
    /// Override the preset's number of transformer blocks
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=512))]
    pub layers: Option<u64>,
    /// Override the preset's attention heads per block (a Llama's key/value heads follow unless
    /// --kv-heads is given)
    #[arg(long, value_name = "H", value_parser = clap::value_parser!(u64).range(1..=512))]
    pub heads: Option<u64>,
    /// Key/value heads of a Llama's grouped-query attention (dividing --heads; = --heads is
    /// multi-head attention, 1 multi-query)
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u64).range(1..=512))]
    pub kv_heads: Option<u64>,
    /// Feed-forward (SwiGLU) width of a Llama
    #[arg(long, value_name = "F", value_parser = clap::value_parser!(u64).range(1..=262_144))]
    pub ffn_dim: Option<u64>,
    /// Override the preset's sequence length (tokens per sequence)
    #[arg(long, value_name = "T", value_parser = clap::value_parser!(u64).range(1..=65_536))]
    pub seq_len: Option<u64>,
    /// Override the preset's vocabulary size (a text --data needs >= 256; a .bin needs more than
    /// its largest token id)
    #[arg(long, value_name = "V", value_parser = clap::value_parser!(u64).range(2..=1_048_576))]
    pub vocab: Option<u64>,
    /// GELU of the feed-forward blocks: exact (erf, PyTorch's default) or tanh (approximation)
    /// [default: exact; with --init-from: the model's, and a --gelu that differs is refused]
    #[arg(long, value_enum)]
    pub gelu: Option<GeluArg>,
    /// Tie the token embedding and the LM head (one shared parameter; always so for gpt2 and
    /// llama-1b)
    #[arg(long)]
    pub tied: bool,
    /// Activation checkpointing of every transformer block (recomputed in backward; the
    /// planner models it too)
    #[arg(long)]
    pub activation_checkpointing: bool,
    /// Dropout probability P in training, at GPT-2's three places (embeddings, attention
    /// probabilities, residual branches); off in evaluation and sampling. With --init-from it
    /// replaces config.json's resid_pdrop/embd_pdrop/attn_pdrop (used otherwise) [default: 0]
    #[arg(long, value_name = "P", value_parser = parse_dropout)]
    pub dropout: Option<f32>,
}

/// Training data.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Data")]
pub struct DataArgs {
    /// Train on this file (each rank reads only its own sequences, with positioned reads): text
    /// read as bytes (vocab 256), or a nanoGPT-style .bin of little-endian u16 token ids.
    /// Without it, the embedded synthetic stream is used
    #[arg(long, value_name = "PATH")]
    pub data: Option<PathBuf>,
    /// How to read --data: auto (.bin = u16 tokens, anything else = text bytes), text, u16
    #[arg(long, value_enum, default_value_t = DataFormatArg::Auto)]
    pub data_format: DataFormatArg,
    /// Fraction of --data held out (at its end) as the validation split
    #[arg(long, value_name = "F", default_value_t = 0.1, value_parser = parse_fraction)]
    pub val_fraction: f64,
    /// Evaluate the validation loss every N steps and at the last step (0: never)
    #[arg(long, value_name = "N", default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(0..=MAX_STEPS))]
    pub eval_every: u64,
    /// Validation sequences per evaluation (a fixed set: the same on every rank count)
    #[arg(long, value_name = "N", default_value_t = 32,
          value_parser = clap::value_parser!(u64).range(1..=65_536))]
    pub eval_seqs: u64,
    /// Sequences per rank per micro-batch
    #[arg(long, value_name = "B", default_value_t = 4,
          value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub batch: u64,
    /// Seed of the model init and of the data order
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
}

/// Ranks and FSDP.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Parallelism")]
pub struct ParallelArgs {
    /// Number of thread ranks [default: 4; with --device cuda: every visible GPU; more ranks than
    /// GPUs share cuda:0] (with --backend mpi or nccl: the launcher's process count instead); at
    /// most 64 to train, up to 65,536 with --plan alone
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=65_536))]
    pub ranks: Option<u64>,
    /// Collectives backend: thread (W thread ranks in this process; with --device cuda NCCL
    /// between them, a GPU each, or with more ranks than GPUs all sharing cuda:0 through GPU
    /// memory), mpi (one process per rank under mpirun/srun; with --device cuda each on its
    /// local rank's GPU modulo the visible ones, collectives staged through host memory; needs a
    /// build with `cargo build --release -p fsdp-train --features mpi`) or nccl (one process per
    /// GPU under torchrun/mpirun/srun; needs --device cuda)
    #[arg(long, value_enum, default_value_t = BackendArg::Thread)]
    pub backend: BackendArg,
    /// Compute device of every rank: cpu (each rank its own CPU device) or cuda (GPU ranks, see
    /// --backend; shards, sharded gradients and optimizer state stay on the GPU and the
    /// optimizer runs there unless --cpu-offload; needs a build with --features
    /// fsdp-train/cuda). Without a CUDA driver, cuda exits with one line naming what is missing
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// Sharding strategy
    #[arg(long, default_value = "full-shard", value_parser = strategy_parser())]
    pub strategy: ShardingStrategy,
    /// Shard-group size for hybrid-shard (must divide --ranks)
    #[arg(long, value_name = "F", value_parser = clap::value_parser!(u64).range(1..=64))]
    pub shard_size: Option<u64>,
    /// Backward prefetch
    #[arg(long, value_enum, default_value_t = PrefetchArg::Pre)]
    pub backward_prefetch: PrefetchArg,
    /// Issue the next unit's all-gather before the current forward
    #[arg(long)]
    pub forward_prefetch: bool,
    /// Rate-limit in-flight all-gathers: auto (the default: off until the allocator has to free
    /// its cache and retry, then on; off again after 10 clean iterations), on (always; the
    /// issuing thread waits on the host for an older all-gather, so each step has more host
    /// waits), or off
    #[arg(long, value_name = "on|off|auto", default_value = "auto", value_parser = parse_limit,
          action = clap::ArgAction::Set)]
    pub limit_all_gathers: LimitAllGathers,
    /// Build the model on the fake device and let FSDP materialize only each rank's shards
    #[arg(long)]
    pub deferred_init: bool,
    /// Gather and compute in D (bf16 | f16), reduce in D, keep f32 shards
    #[arg(long, value_enum, value_name = "D")]
    pub mixed_precision: Option<MixedPrecisionArg>,
    /// CPU offload, only when asked: keep shards, sharded gradients and optimizer state on a
    /// separate host device; the optimizer steps there
    /// and shards and gradients are copied to and from the compute device around each unit.
    /// Off by default, also with --device cuda (everything stays on the GPU)
    #[arg(long)]
    pub cpu_offload: bool,
    /// Run on checked (race-detecting) devices (slower; a violation stops training with both
    /// streams named)
    #[arg(long)]
    pub checked: bool,
    /// Let f32 matrix products run on the tensor cores in TF32 (10-bit mantissa inputs, f32
    /// accumulation; like PyTorch's allow_tf32). Needs --device cuda; off by default
    #[arg(long)]
    pub tf32: bool,
    /// Matmul threads per rank on CPU devices [default: this machine's cores / --ranks, at
    /// least 1]. A rank alone with 1 thread measures what each of N ranks sharing the cores
    /// gets (the compute calibration of `cargo xtask bench nodes`)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub matmul_threads: Option<u64>,
}

/// How collectives move bytes.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Communication")]
pub struct CommArgs {
    /// Quantize parameter all-gathers and gradient reduce-scatters: none (f32), or int8
    /// (ZeRO++-style block quantization with an f32 scale per block; about a quarter of the
    /// bytes; results close to f32, not bit-identical). Sharded strategies, no
    /// --mixed-precision
    #[arg(long, value_enum, value_name = "none|int8", default_value_t = QuantArg::None)]
    pub quantize_collectives: QuantArg,
    /// Values per f32 scale with --quantize-collectives int8 (default 64)
    #[arg(long, value_name = "B", value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    pub quantize_block: Option<u64>,
}

/// `--quantize-collectives`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantArg {
    /// communicate in f32 (or the --mixed-precision dtype)
    None,
    /// int8 codes plus one f32 scale per block
    Int8,
}

/// Optimizer and schedule.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Optimizer")]
pub struct OptimArgs {
    /// Optimizer steps: the total of the run (with --resume, training continues up to it).
    /// 0 converts without training: with --init-from, --resume or --load, and --export-hf or
    /// --save, it writes the model and exits
    #[arg(long, value_name = "N", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(0..=MAX_STEPS))]
    pub steps: u64,
    /// Sharded optimizer (state sharded like the parameters)
    #[arg(long, value_enum, default_value_t = OptimizerArg::Sgd)]
    pub optimizer: OptimizerArg,
    /// Peak learning rate (default 0.05 for sgd, 0.001 for adamw and lamb)
    #[arg(long, value_name = "X", value_parser = parse_lr)]
    pub lr: Option<f32>,
    /// Linear warm-up from lr/N to lr over the first N steps
    #[arg(long, value_name = "N", default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(0..=MAX_STEPS))]
    pub warmup_steps: u64,
    /// Cosine decay from --lr after the warm-up to this value at --steps (default: no decay)
    #[arg(long, value_name = "X", value_parser = parse_min_lr)]
    pub min_lr: Option<f32>,
    /// Micro-batches per rank per optimizer step
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub grad_accum: u64,
    /// With --grad-accum: accumulate unsharded gradients locally and reduce once, at the last
    /// micro-batch
    #[arg(long)]
    pub no_sync: bool,
    /// Clip the global gradient norm (across all shards) to X
    #[arg(long, value_name = "X", value_parser = parse_positive)]
    pub clip_grad_norm: Option<f64>,
    /// SGD momentum μ (default 0: plain SGD)
    #[arg(long, value_name = "M", value_parser = parse_unit)]
    pub momentum: Option<f32>,
    /// SGD with Nesterov momentum (PyTorch's nesterov=True; needs --momentum > 0)
    #[arg(long)]
    pub nesterov: bool,
    /// Adam/LAMB β1, the first moment's decay (default 0.9)
    #[arg(long, value_name = "B", value_parser = parse_unit)]
    pub beta1: Option<f32>,
    /// Adam/LAMB β2, the second moment's decay (default 0.999)
    #[arg(long, value_name = "B", value_parser = parse_unit)]
    pub beta2: Option<f32>,
    /// Adam/LAMB ε added to the denominator (default 1e-8)
    #[arg(long, value_name = "E", value_parser = parse_eps)]
    pub eps: Option<f32>,
    /// Weight decay λ: SGD adds λ·p to the gradient, AdamW decays decoupled, LAMB adds λ·p to
    /// the direction (default 0 for sgd, 0.01 for adamw and lamb)
    #[arg(long, value_name = "L", value_parser = parse_weight_decay)]
    pub weight_decay: Option<f32>,
}

/// Checkpoints and state dicts.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Checkpointing")]
pub struct CheckpointArgs {
    /// Directory of sharded checkpoints (model, optimizer state, step, data position)
    #[arg(long, value_name = "DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Write a checkpoint every N steps (and at the last step); needs --checkpoint-dir
    #[arg(long, value_name = "N",
          value_parser = clap::value_parser!(u64).range(1..=MAX_STEPS))]
    pub checkpoint_every: Option<u64>,
    /// Keep the last K checkpoints
    #[arg(long, value_name = "K", default_value_t = 3,
          value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub keep_checkpoints: u64,
    /// Continue from the newest checkpoint in --checkpoint-dir (from scratch if there is none); a
    /// damaged newest checkpoint is refused (exit 1). `--resume latest-valid` falls back to the
    /// newest undamaged one and prints which it skipped and why
    #[arg(long, value_name = "WHICH", num_args = 0..=1, default_missing_value = "newest")]
    pub resume: Option<ResumeArg>,
    /// Load a full state dict (safetensors) before training
    #[arg(long, value_name = "PATH")]
    pub load: Option<PathBuf>,
    /// Save a full state dict (safetensors) after training
    #[arg(long, value_name = "PATH")]
    pub save: Option<PathBuf>,
}

/// Output.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Logging")]
pub struct LoggingArgs {
    /// Print one JSON object as the last line
    #[arg(long)]
    pub json: bool,
    /// Write a Chrome trace (Perfetto / chrome://tracing JSON) of one step to PATH: every
    /// launched kernel and collective per stream, FSDP's phases on the issuing threads
    #[arg(long, value_name = "PATH")]
    pub profile: Option<PathBuf>,
    /// With --profile: print each kernel's share of the profiled step's device time (GPU
    /// kernels from CUDA events on --device cuda, CPU stream kernels otherwise)
    #[arg(long)]
    pub kernel_times: bool,
    /// Write one JSON object per step to PATH (JSON lines)
    #[arg(long, value_name = "PATH")]
    pub metrics: Option<PathBuf>,
    /// Draw train/validation loss and tokens/s against step into PATH (.svg, or .png without
    /// text)
    #[arg(long, value_name = "PATH")]
    pub plot: Option<PathBuf>,
    /// Replace an existing --metrics file or --export-hf model (both are refused otherwise;
    /// with --resume, --metrics lines are appended)
    #[arg(long)]
    pub overwrite: bool,
    /// Print a step line every N steps (default: about 12 lines per run)
    #[arg(long, value_name = "N",
          value_parser = clap::value_parser!(u64).range(1..=MAX_STEPS))]
    pub log_every: Option<u64>,
    /// No progress bar even on a terminal (plain step lines). Without a terminal on stdout and
    /// stderr, or under a launcher (--backend mpi or nccl), there is never one
    #[arg(long)]
    pub no_progress: bool,
    /// Write TensorBoard event files into DIR (created if missing; open with `tensorboard
    /// --logdir DIR`): per step train/loss, train/lr, train/grad_norm, perf/tokens_per_s,
    /// perf/mfu (when the GEMM rate is known before training: CPU ranks), the peak memory, and
    /// val/loss at evaluations
    #[arg(long, value_name = "DIR")]
    pub tensorboard: Option<PathBuf>,
}

/// `--model`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelPreset {
    /// vocab 256, d 256, 4 layers, 4 heads, seq 128 (3.3M parameters)
    Mini,
    /// vocab 256, d 512, 8 layers, 8 heads, seq 256 (25M parameters)
    Small,
    /// GPT-2 small: vocab 50257, d 768, 12 layers, 12 heads, seq 1024, tied head (124M)
    Gpt2,
    /// Llama, vocab 256, d 128, 4 layers, 4 heads / 2 kv heads, ffn 352, seq 128 (0.8M)
    LlamaTiny,
    /// Llama, vocab 256, d 512, 8 layers, 8 heads / 4 kv heads, ffn 1408, seq 256 (24M)
    LlamaSmall,
    /// Llama 3.2 1B's shape: vocab 128256, d 2048, 16 layers, 32/8 heads, ffn 8192, seq 2048,
    /// θ 500000 + llama3 scaling, tied (1.24B)
    #[value(name = "llama-1b")]
    Llama1b,
    /// Llama 3.1 8B's shape: vocab 128256, d 4096, 32 layers, 32/8 heads, ffn 14336, seq 8192,
    /// θ 500000 + llama3 scaling, untied (8.0B; more than train_gpt trains: --plan)
    #[value(name = "llama-8b")]
    Llama8b,
}

/// `--gelu`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum GeluArg {
    /// 0.5·x·(1 + erf(x/√2)), PyTorch's default
    Exact,
    /// 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))
    Tanh,
}

/// `--data-format`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataFormatArg {
    /// .u32.bin: u32 token ids; .bin: u16 token ids; any other file: text bytes
    Auto,
    /// every byte is a token (vocab 256)
    Text,
    /// little-endian u16 token ids (nanoGPT's train.bin/val.bin)
    U16,
    /// little-endian u32 token ids (vocabularies over 65,536 ids, e.g. Llama 3's)
    U32,
}

/// `--backend`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendArg {
    /// in-process thread ranks
    Thread,
    /// one MPI process per rank (GPU ranks staged through host memory)
    Mpi,
    /// one process per GPU over NCCL (with --device cuda)
    Nccl,
}

/// `--strategy`: the names and help lines of fsdp-core's strategy table ([`STRATEGIES`]).
fn strategy_parser() -> impl clap::builder::TypedValueParser<Value = ShardingStrategy> {
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
    PossibleValuesParser::new(
        STRATEGIES
            .iter()
            .map(|s| PossibleValue::new(s.name).help(s.summary)),
    )
    .try_map(|s| s.parse::<ShardingStrategy>())
}

/// `--backward-prefetch`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefetchArg {
    /// no prefetch
    None,
    /// all-gather the next unit before the current unit's gradient computation
    Pre,
    /// all-gather the next unit after the current unit's gradient computation
    Post,
}

/// A value in `[0, 1)` (momentum, betas).
fn parse_unit(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(x) if (0.0..1.0).contains(&x) => Ok(x),
        _ => Err(format!("`{s}` is not a number in [0, 1)")),
    }
}

/// A dropout probability in `[0, 1)`.
fn parse_dropout(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(x) if (0.0..1.0).contains(&x) => Ok(x),
        _ => Err(format!("`{s}` is not a probability in [0, 1)")),
    }
}

/// A positive, finite ε up to 1.
fn parse_eps(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(x) if x > 0.0 && x <= 1.0 => Ok(x),
        _ => Err(format!("`{s}` is not a number in (0, 1]")),
    }
}

/// A weight decay in `[0, 10]`.
fn parse_weight_decay(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(x) if (0.0..=10.0).contains(&x) => Ok(x),
        _ => Err(format!("`{s}` is not a number in [0, 10]")),
    }
}

/// `--mixed-precision`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum MixedPrecisionArg {
    /// bfloat16
    Bf16,
    /// float16
    F16,
}

fn parse_limit(s: &str) -> Result<LimitAllGathers, String> {
    match s {
        "on" | "true" | "1" | "off" | "false" | "0" | "auto" => s.parse(),
        v => Err(format!("expected on, off or auto, got `{v}`")),
    }
}

fn parse_finite(s: &str) -> Result<f64, String> {
    let x: f64 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if x.is_finite() {
        Ok(x)
    } else {
        Err(format!("`{s}` is not a finite number"))
    }
}

fn parse_positive(s: &str) -> Result<f64, String> {
    let x = parse_finite(s)?;
    if x > 0.0 && x <= 1e12 {
        Ok(x)
    } else {
        Err(format!("must be in (0, 1e12], got {s}"))
    }
}

fn parse_lr(s: &str) -> Result<f32, String> {
    let x = parse_finite(s)?;
    if x > 0.0 && x <= 1e9 {
        Ok(x as f32)
    } else {
        Err(format!("must be in (0, 1e9], got {s}"))
    }
}

fn parse_min_lr(s: &str) -> Result<f32, String> {
    let x = parse_finite(s)?;
    if (0.0..=1e9).contains(&x) {
        Ok(x as f32)
    } else {
        Err(format!("must be in [0, 1e9], got {s}"))
    }
}

fn parse_fraction(s: &str) -> Result<f64, String> {
    let x = parse_finite(s)?;
    if x > 0.0 && x <= 0.5 {
        Ok(x)
    } else {
        Err(format!("must be in (0, 0.5], got {s}"))
    }
}

/// The layout `--device` and `--backend` ask for; `None` for CPU ranks.
///
/// # Errors
/// A usage message for `--backend nccl` without `--device cuda`.
pub fn cuda_launch(device: DeviceArg, backend: BackendArg) -> Result<Option<CudaLaunch>, String> {
    match (device, backend) {
        (DeviceArg::Cpu, BackendArg::Thread | BackendArg::Mpi) => Ok(None),
        (DeviceArg::Cpu, BackendArg::Nccl) => Err(
            "--backend nccl runs one process per GPU; add --device cuda (CPU ranks use \
             --backend thread or mpi)"
                .into(),
        ),
        (DeviceArg::Cuda, BackendArg::Thread) => Ok(Some(CudaLaunch::Threads)),
        (DeviceArg::Cuda, BackendArg::Nccl) => Ok(Some(CudaLaunch::Processes)),
        (DeviceArg::Cuda, BackendArg::Mpi) => Ok(Some(CudaLaunch::Mpi)),
    }
}

fn usage<T>(msg: impl Into<String>) -> Result<T, UsageError> {
    Err(UsageError(msg.into()))
}

/// Llama 3's `llama3` rotary scaling with `factor` (8 for 3.1, 32 for 3.2).
fn llama3_scaling(factor: f64) -> Llama3Scaling {
    Llama3Scaling {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position: 8192,
    }
}

impl ModelPreset {
    /// The preset's model.
    pub fn config(self) -> ModelSpec {
        match self {
            ModelPreset::Mini => GptConfig::mini().into(),
            ModelPreset::Small => GptConfig::new(256, 512, 8, 8, 256).into(),
            // GPT-2 ties its token embedding and LM head (124M parameters).
            ModelPreset::Gpt2 => GptConfig::new(50_257, 768, 12, 12, 1024)
                .with_tied(true)
                .into(),
            ModelPreset::LlamaTiny => LlamaConfig::new(256, 128, 4, 4, 2, 352, 128).into(),
            ModelPreset::LlamaSmall => LlamaConfig::new(256, 512, 8, 8, 4, 1408, 256).into(),
            // Llama 3.2 1B and Llama 3.1 8B (their config.json): θ 500000, rms eps 1e-5,
            // rope_type llama3 with low/high frequency factors 1/4 over 8192 positions.
            ModelPreset::Llama1b => LlamaConfig::new(128_256, 2048, 16, 32, 8, 8192, 2048)
                .with_rope_theta(500_000.0)
                .with_rope_scaling(Some(llama3_scaling(32.0)))
                .with_tied(true)
                .into(),
            ModelPreset::Llama8b => LlamaConfig::new(128_256, 4096, 32, 32, 8, 14_336, 8192)
                .with_rope_theta(500_000.0)
                .with_rope_scaling(Some(llama3_scaling(8.0)))
                .into(),
        }
    }
}

impl Cli {
    /// Checks the combination of flags and resolves presets and defaults.
    pub fn into_config(self) -> Result<TrainConfig, UsageError> {
        let m = &self.model;
        let mut model = m.model.config();
        let gelu = m.gelu.map(|g| match g {
            GeluArg::Exact => Gelu::Exact,
            GeluArg::Tanh => Gelu::Tanh,
        });
        model
            .apply_flags(&ShapeFlags {
                d_model: m.d_model.map(|d| d as usize),
                layers: m.layers.map(|l| l as usize),
                heads: m.heads.map(|h| h as usize),
                kv_heads: m.kv_heads.map(|k| k as usize),
                ffn_dim: m.ffn_dim.map(|f| f as usize),
                gelu,
                dropout: m.dropout,
                tied: m.tied,
                checkpoint: m.activation_checkpointing,
            })
            .map_err(UsageError)?;
        if let Some(t) = m.seq_len {
            model.set_seq_len(t as usize);
        }
        if let Some(v) = m.vocab {
            model.set_vocab(v as usize);
        }
        // `--plan` without `--apply` builds nothing: any model size and rank count may be planned.
        let plan_only = self.planning.plan && !self.planning.apply;
        let shaped = m.d_model.is_some()
            || m.layers.is_some()
            || m.heads.is_some()
            || m.kv_heads.is_some()
            || m.ffn_dim.is_some()
            || m.tied;
        let mut interop = self
            .interop
            .resolve(&mut model, m.vocab, m.seq_len, shaped)
            .map_err(UsageError)?;
        // With --init-from the model's own GELU is used; a --gelu given is checked against it.
        interop.gelu = gelu;
        interop.dropout = m.dropout;
        model.validate().map_err(UsageError)?;
        let params = model.params();
        if params > MAX_PARAMS && !plan_only {
            return usage(format!(
                "the model would have {params} parameters (more than {MAX_PARAMS}); pick a smaller \
                 --model or smaller --d-model/--layers/--vocab"
            ));
        }

        let d = &self.data;
        let data = match &d.data {
            None => DataSpec::Synthetic,
            Some(path) => {
                let format = match d.data_format {
                    DataFormatArg::Text => DataFormat::Text,
                    DataFormatArg::U16 => DataFormat::U16,
                    DataFormatArg::U32 => DataFormat::U32,
                    DataFormatArg::Auto => {
                        if path.to_string_lossy().ends_with(".u32.bin") {
                            DataFormat::U32
                        } else if path.extension().is_some_and(|e| e == "bin") {
                            DataFormat::U16
                        } else {
                            DataFormat::Text
                        }
                    }
                };
                if format == DataFormat::Text && model.vocab() < interop.tokenizer.vocab() {
                    return usage(format!(
                        "--data {} is read as bytes (ids 0..=255) but --vocab is {}; use --vocab 256 \
                         or more",
                        path.display(),
                        model.vocab()
                    ));
                }
                DataSpec::File {
                    path: path.clone(),
                    format,
                    val_fraction: d.val_fraction,
                }
            }
        };

        let p = &self.parallel;
        if p.tf32 && p.device != DeviceArg::Cuda {
            return usage(
                "--tf32 needs --device cuda (TF32 is a tensor-core mode of CUDA matrix products; \
                 CPU products are always full f32)",
            );
        }
        let mut cuda = cuda_launch(p.device, p.backend).map_err(UsageError)?;
        let mpi = p.backend == BackendArg::Mpi;
        if mpi && !cfg!(feature = "mpi") {
            return usage(
                "--backend mpi: this binary was built without MPI; build it with `cargo build \
                 --release -p fsdp-train --features mpi --bin train_gpt` and launch it with mpirun",
            );
        }
        let ranks = if mpi {
            mpi_world_size()?
        } else if let Some(launch) = cuda {
            // More thread ranks than GPUs: the layout becomes shared-GPU ranks on cuda:0.
            let (launch, ranks) = crate::cuda::world_size(launch, p.ranks).map_err(UsageError)?;
            cuda = Some(launch);
            ranks
        } else {
            p.ranks.unwrap_or(4) as usize
        };
        if let Some(r) = p.ranks.filter(|&r| r > MAX_RANKS && !plan_only) {
            return usage(format!(
                "--ranks {r}: at most {MAX_RANKS} ranks train in one process (--plan alone plans \
                 for up to 65536)"
            ));
        }
        let strategy = p.strategy;
        let shard_size = p.shard_size.map(|f| f as usize);
        // Strategies that shard over a shard group (the table's `ShardOver::ShardGroup`) take
        // their group size from --shard-size; no other strategy takes one.
        let grouped = strategy.spec().shard_over == ShardOver::ShardGroup;
        match (grouped, shard_size) {
            (true, None) => {
                return usage(format!(
                    "--strategy {strategy} needs --shard-size F (F dividing --ranks)"
                ))
            }
            (true, Some(f)) if ranks % f != 0 => {
                return usage(format!(
                    "--shard-size {f} does not divide --ranks {ranks}; pick a divisor"
                ))
            }
            (true, Some(_)) | (false, None) => {}
            (false, Some(_)) => {
                let grouped: Vec<_> = STRATEGIES
                    .iter()
                    .filter(|s| s.shard_over == ShardOver::ShardGroup)
                    .map(|s| s.name)
                    .collect();
                return usage(format!(
                    "--shard-size only applies to --strategy {} (got {strategy})",
                    grouped.join(" or ")
                ));
            }
        }
        if p.cpu_offload && !strategy.is_sharded() {
            return usage("--cpu-offload needs a sharded strategy (not no-shard)");
        }
        if p.mixed_precision.is_some() && !strategy.is_sharded() {
            return usage("--mixed-precision needs a sharded strategy (not no-shard)");
        }
        let quantize_collectives = match (self.comm.quantize_collectives, self.comm.quantize_block)
        {
            (QuantArg::None, None) => None,
            (QuantArg::None, Some(_)) => {
                return usage("--quantize-block only applies with --quantize-collectives int8")
            }
            (QuantArg::Int8, block) => Some(Quantization::Int8 {
                block: block.map_or(Quantization::DEFAULT_BLOCK, |b| b as usize),
            }),
        };
        if quantize_collectives.is_some() {
            if !strategy.is_sharded() {
                return usage(
                    "--quantize-collectives int8 quantizes all-gathers and reduce-scatters: it \
                     needs a sharded strategy (not no-shard)",
                );
            }
            if p.mixed_precision.is_some() {
                return usage(
                    "--quantize-collectives int8 and --mixed-precision do not combine yet; pick one",
                );
            }
        }

        let o = &self.optim;
        let optimizer = o.optimizer;
        let lr = o.lr.unwrap_or(optimizer.default_lr());
        let mut optim_hyper = OptimHyper::defaults(optimizer);
        let adam_only = o.beta1.is_some() || o.beta2.is_some() || o.eps.is_some();
        if optimizer == OptimizerArg::Sgd && adam_only {
            return usage("--beta1, --beta2 and --eps apply to --optimizer adamw or lamb");
        }
        if optimizer != OptimizerArg::Sgd && o.momentum.is_some() {
            return usage("--momentum applies to --optimizer sgd (Adam's is --beta1)");
        }
        optim_hyper.momentum = o.momentum.unwrap_or(optim_hyper.momentum);
        if o.nesterov && (optimizer != OptimizerArg::Sgd || optim_hyper.momentum == 0.0) {
            return usage("--nesterov needs --optimizer sgd with --momentum above 0");
        }
        optim_hyper.nesterov = o.nesterov;
        optim_hyper.beta1 = o.beta1.unwrap_or(optim_hyper.beta1);
        optim_hyper.beta2 = o.beta2.unwrap_or(optim_hyper.beta2);
        optim_hyper.eps = o.eps.unwrap_or(optim_hyper.eps);
        optim_hyper.weight_decay = o.weight_decay.unwrap_or(optim_hyper.weight_decay);
        if let Some(min) = o.min_lr {
            if min > lr {
                return usage(format!("--min-lr {min} is above --lr {lr}"));
            }
        }
        if o.warmup_steps >= o.steps && o.warmup_steps > 0 {
            return usage(format!(
                "--warmup-steps {} must be below --steps {}",
                o.warmup_steps, o.steps
            ));
        }
        if o.no_sync && o.grad_accum < 2 {
            return usage(
                "--no-sync needs --grad-accum N with N >= 2 (it skips the reduction of all but the \
                 last micro-batch)",
            );
        }

        let c = &self.checkpoint;
        if c.checkpoint_every.is_some() && c.checkpoint_dir.is_none() {
            return usage("--checkpoint-every needs --checkpoint-dir DIR");
        }
        if c.resume.is_some() && c.checkpoint_dir.is_none() {
            return usage("--resume needs --checkpoint-dir DIR (the directory to resume from)");
        }
        if c.resume.is_some() && c.load.is_some() {
            return usage("--resume and --load both set the starting state; pick one");
        }
        if c.load.is_some() && self.interop.init_from.is_some() {
            return usage("--load and --init-from both set the starting state; pick one");
        }
        if o.steps == 0 {
            let start = self.interop.init_from.is_some() || c.resume.is_some() || c.load.is_some();
            let out = self.interop.export_hf.is_some() || c.save.is_some();
            if !(start && out) {
                return usage(
                    "--steps 0 converts without training: it needs a starting state (--init-from, \
                     --resume or --load) and an output (--export-hf or --save)",
                );
            }
        }
        let l = &self.logging;
        if l.kernel_times && l.profile.is_none() {
            return usage(
                "--kernel-times needs --profile PATH (the kernel times are read from the profiled \
                 step's trace)",
            );
        }
        if let Some(plot) = &l.plot {
            crate::report::plot_kind(plot).map_err(UsageError)?;
        }
        Ok(TrainConfig {
            model,
            data,
            eval_every: d.eval_every as usize,
            eval_seqs: d.eval_seqs as usize,
            batch: d.batch as usize,
            seed: d.seed,
            ranks,
            mpi,
            cuda,
            strategy,
            shard_size,
            backward_prefetch: match p.backward_prefetch {
                PrefetchArg::None => BackwardPrefetch::None,
                PrefetchArg::Pre => BackwardPrefetch::BackwardPre,
                PrefetchArg::Post => BackwardPrefetch::BackwardPost,
            },
            forward_prefetch: p.forward_prefetch,
            limit_all_gathers: p.limit_all_gathers != LimitAllGathers::Off,
            adaptive_limiter: match p.limit_all_gathers {
                LimitAllGathers::Auto(a) => Some(a),
                _ => None,
            },
            quantize_collectives,
            deferred_init: p.deferred_init,
            mixed_precision: p.mixed_precision.map(|m| match m {
                MixedPrecisionArg::Bf16 => DType::BF16,
                MixedPrecisionArg::F16 => DType::F16,
            }),
            // Only when asked: CUDA ranks keep everything on the GPU by default.
            cpu_offload: p.cpu_offload,
            checked: p.checked,
            tf32: p.tf32,
            steps: o.steps as usize,
            optimizer,
            optim_hyper,
            interop,
            lr,
            warmup_steps: o.warmup_steps as usize,
            min_lr: o.min_lr,
            grad_accum: o.grad_accum as usize,
            no_sync: o.no_sync,
            clip_grad_norm: o.clip_grad_norm,
            checkpoint_dir: c.checkpoint_dir.clone(),
            checkpoint_every: c.checkpoint_every.map(|n| n as usize),
            keep_checkpoints: c.keep_checkpoints as usize,
            resume: c.resume.is_some(),
            resume_latest_valid: c.resume == Some(ResumeArg::LatestValid),
            load: c.load.clone(),
            save: c.save.clone(),
            stop_after: None,
            profile: self.logging.profile.clone(),
        })
    }
}

/// The MPI job's size, from the launcher's environment (OpenMPI, MPICH/PMI, Slurm), so every
/// size-dependent check runs before MPI starts.
fn mpi_world_size() -> Result<usize, UsageError> {
    for var in ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"] {
        if let Ok(v) = std::env::var(var) {
            return match v.trim().parse::<usize>() {
                Ok(n) if (1..=64).contains(&n) => Ok(n),
                _ => usage(format!(
                    "--backend mpi: {var}={v} is not a rank count in 1..=64"
                )),
            };
        }
    }
    usage(
        "--backend mpi: not launched by an MPI launcher (no OMPI_COMM_WORLD_SIZE, PMI_SIZE or \
           SLURM_NTASKS); run it under mpirun -n W",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_and_backend_pick_the_layout() {
        use BackendArg::*;
        use DeviceArg::*;
        assert_eq!(cuda_launch(Cpu, Thread), Ok(None));
        assert_eq!(cuda_launch(Cpu, Mpi), Ok(None));
        assert_eq!(cuda_launch(Cuda, Thread), Ok(Some(CudaLaunch::Threads)));
        assert_eq!(cuda_launch(Cuda, Nccl), Ok(Some(CudaLaunch::Processes)));
        assert!(cuda_launch(Cpu, Nccl)
            .unwrap_err()
            .contains("--device cuda"));
        assert_eq!(cuda_launch(Cuda, Mpi), Ok(Some(CudaLaunch::Mpi)));
        assert_eq!(CudaLaunch::Threads.ordinal(3, 4), 3);
    }

    fn parse(args: &[&str]) -> Result<TrainConfig, String> {
        let cli = Cli::try_parse_from(std::iter::once("train_gpt").chain(args.iter().copied()))
            .map_err(|e| e.to_string())?;
        cli.into_config().map_err(|e| e.0)
    }

    /// `--dropout P` sets GPT-2's three dropouts (P in [0, 1)) and is remembered for
    /// `--init-from`; `--steps 0` needs a starting state and an output.
    #[test]
    fn dropout_and_steps_zero_flags() {
        let c = parse(&["--dropout", "0.1"]).unwrap();
        assert_eq!(
            c.model.as_gpt().unwrap().dropout,
            fsdp_autograd::nn::GptDropout::all(0.1)
        );
        assert_eq!(c.interop.dropout, Some(0.1));
        assert!(parse(&[]).unwrap().model.as_gpt().unwrap().dropout.is_off());
        for bad in ["1", "1.5", "-0.1", "x", "NaN"] {
            let e = parse(&[&format!("--dropout={bad}")]).unwrap_err();
            assert!(e.contains("--dropout"), "{e}");
        }
        for args in [
            &["--steps", "0"][..],
            &["--steps", "0", "--save", "x.safetensors"],
            &["--steps", "0", "--init-from", "m"],
        ] {
            let e = parse(args).unwrap_err();
            assert!(e.contains("--steps 0 converts without training"), "{e}");
        }
        let c = parse(&["--steps", "0", "--init-from", "m", "--export-hf", "out"]).unwrap();
        assert_eq!(c.steps, 0);
        let c = parse(&[
            "--steps",
            "0",
            "--checkpoint-dir",
            "ck",
            "--resume",
            "--save",
            "s.safetensors",
        ])
        .unwrap();
        assert!(c.resume);
    }

    #[test]
    fn matmul_threads_flag_is_optional_and_positive() {
        let cli = |args: &[&str]| {
            Cli::try_parse_from(std::iter::once("train_gpt").chain(args.iter().copied()))
                .map(|c| c.parallel.matmul_threads)
                .map_err(|e| e.to_string())
        };
        assert_eq!(cli(&[]).unwrap(), None);
        assert_eq!(cli(&["--matmul-threads", "3"]).unwrap(), Some(3));
        assert!(cli(&["--matmul-threads", "0"])
            .unwrap_err()
            .contains("matmul-threads"));
    }

    #[test]
    fn defaults_are_the_main_job() {
        let c = parse(&[]).unwrap();
        assert_eq!(c.ranks, 4);
        assert_eq!(c.steps, 60);
        assert_eq!(c.batch, 4);
        assert_eq!(c.lr, 0.05);
        let g = *c.model.as_gpt().unwrap();
        assert_eq!(g.d_model, GptConfig::mini().d_model);
        assert_eq!(g.gelu, Gelu::Exact);
        let tanh = parse(&["--gelu", "tanh"]).unwrap().model;
        assert_eq!(tanh.as_gpt().unwrap().gelu, Gelu::Tanh);
        assert_eq!(c.strategy, ShardingStrategy::FullShard);
        // The adaptive limiter: off until the allocator has to free and retry (no host waits
        // for the limiter in a step that has memory to spare).
        assert!(c.limit_all_gathers && c.adaptive_limiter.is_some());
        assert!(matches!(c.data, DataSpec::Synthetic));
    }

    #[test]
    fn tf32_needs_a_cuda_device() {
        assert!(!parse(&[]).unwrap().tf32);
        let e = parse(&["--tf32"]).unwrap_err();
        assert!(e.contains("--tf32 needs --device cuda"), "{e}");
        assert!(!e.contains("  "), "one line, no runs of spaces: {e}");
        assert!(!e.contains('\n'), "one line: {e}");
        let e = parse(&["--tf32", "--device", "cpu"]).unwrap_err();
        assert!(e.contains("--tf32 needs --device cuda"), "{e}");
    }

    #[test]
    fn huge_numbers_are_usage_errors() {
        for v in ["18446744073709551615", "1000000000000", "0", "x"] {
            let e = parse(&["--steps", v]).unwrap_err();
            assert!(e.contains("--steps"), "{e}");
        }
        assert!(parse(&["--steps", "-1"]).is_err());
        assert!(parse(&["--ranks", "100000"]).is_err());
        assert!(parse(&["--batch", "99999999"]).is_err());
        assert!(parse(&["--lr", "inf"]).is_err());
        assert!(parse(&["--lr", "NaN"]).is_err());
        assert!(parse(&["--d-model", "100000", "--layers", "512"]).is_err());
        assert!(
            parse(&["--model", "gpt2", "--layers", "512", "--d-model", "1536"])
                .unwrap_err()
                .contains("parameters")
        );
    }

    #[test]
    fn every_old_flag_keeps_its_meaning() {
        let c = parse(&[
            "--ranks",
            "2",
            "--strategy",
            "hybrid-shard",
            "--shard-size",
            "2",
            "--backward-prefetch",
            "post",
            "--forward-prefetch",
            "--limit-all-gathers",
            "off",
            "--deferred-init",
            "--steps",
            "7",
            "--lr",
            "0.5",
            "--optimizer",
            "adamw",
            "--mixed-precision",
            "bf16",
            "--grad-accum",
            "2",
            "--no-sync",
            "--clip-grad-norm",
            "1.5",
            "--tied",
            "--cpu-offload",
            "--checked",
            "--load",
            "a.st",
            "--save",
            "b.st",
            "--batch",
            "3",
            "--seed",
            "9",
            "--json",
        ])
        .unwrap();
        assert_eq!(c.ranks, 2);
        assert_eq!(c.strategy, ShardingStrategy::HybridShard);
        assert_eq!(c.shard_size, Some(2));
        assert_eq!(c.backward_prefetch, BackwardPrefetch::BackwardPost);
        assert!(c.forward_prefetch && !c.limit_all_gathers && c.deferred_init);
        assert_eq!((c.steps, c.lr, c.optimizer), (7, 0.5, OptimizerArg::AdamW));
        assert_eq!(c.mixed_precision, Some(DType::BF16));
        assert_eq!((c.grad_accum, c.no_sync), (2, true));
        assert_eq!(c.clip_grad_norm, Some(1.5));
        assert!(c.model.tied() && c.cpu_offload && c.checked);
        assert_eq!((c.batch, c.seed), (3, 9));
        assert_eq!(parse(&["--optimizer", "adamw"]).unwrap().lr, 1e-3);
    }

    #[test]
    fn limiter_and_quantization_flags() {
        let c = parse(&["--limit-all-gathers", "auto"]).unwrap();
        assert!(c.adaptive_limiter.is_some());
        let c = parse(&["--limit-all-gathers", "on"]).unwrap();
        assert!(c.limit_all_gathers && c.adaptive_limiter.is_none());
        let c = parse(&["--limit-all-gathers", "false"]).unwrap();
        assert!(!c.limit_all_gathers && c.adaptive_limiter.is_none());
        assert!(parse(&["--limit-all-gathers", "maybe"]).is_err());
        assert_eq!(parse(&[]).unwrap().quantize_collectives, None);
        assert_eq!(
            parse(&["--quantize-collectives", "int8"])
                .unwrap()
                .quantize_collectives,
            Some(Quantization::int8())
        );
        assert_eq!(
            parse(&["--quantize-collectives", "int8", "--quantize-block", "64"])
                .unwrap()
                .quantize_collectives,
            Some(Quantization::Int8 { block: 64 })
        );
        assert!(parse(&["--quantize-collectives", "int4"]).is_err());
        assert!(parse(&["--quantize-collectives", "int8", "--strategy", "no-shard"]).is_err());
        assert!(parse(&[
            "--quantize-collectives",
            "int8",
            "--mixed-precision",
            "bf16"
        ])
        .is_err());
        assert!(parse(&["--quantize-block", "0"]).is_err());
        assert!(parse(&["--quantize-block", "64"]).is_err());
    }

    #[test]
    fn presets_and_overrides() {
        let g = *parse(&["--model", "gpt2"]).unwrap().model.as_gpt().unwrap();
        assert_eq!(
            (g.vocab, g.d_model, g.n_layers, g.n_heads, g.seq_len),
            (50257, 768, 12, 12, 1024)
        );
        // GPT-2 small: 124,439,808 parameters (tied head).
        assert!(g.tied);
        assert_eq!(crate::model::ModelSpec::Gpt(g).params(), 124_439_808);
        let p = parse(&["--model", "small"]).unwrap().model.params();
        assert!((20_000_000..30_000_000).contains(&p), "{p}");
        let o = parse(&["--model", "gpt2", "--seq-len", "256", "--vocab", "1000"])
            .unwrap()
            .model;
        assert_eq!((o.seq_len(), o.vocab()), (256, 1000));
        assert!(parse(&["--d-model", "100", "--heads", "3"]).is_err());
    }

    #[test]
    fn inconsistent_combinations_are_refused() {
        assert!(parse(&["--strategy", "hybrid-shard"]).is_err());
        assert!(parse(&["--strategy", "hybrid-shard", "--shard-size", "3"]).is_err());
        assert!(parse(&["--shard-size", "2"]).is_err());
        assert!(parse(&["--no-sync"]).is_err());
        assert!(parse(&["--resume"]).is_err());
        assert!(parse(&["--resume", "latest-valid"]).is_err());
        let r = parse(&["--checkpoint-dir", "ck", "--resume", "latest-valid"]).unwrap();
        assert!(r.resume && r.resume_latest_valid);
        let r = parse(&["--checkpoint-dir", "ck", "--resume", "--steps", "3"]).unwrap();
        assert!(r.resume && !r.resume_latest_valid);
        assert!(parse(&["--checkpoint-dir", "ck", "--resume", "oldest"]).is_err());
        assert!(parse(&["--checkpoint-every", "5"]).is_err());
        assert!(parse(&["--min-lr", "1", "--lr", "0.1"]).is_err());
        assert!(parse(&["--warmup-steps", "60"]).is_err());
        assert!(parse(&["--plot", "x.pdf"]).is_err());
        assert!(parse(&["--data", "x.txt", "--vocab", "100"]).is_err());
        // Not under an MPI launcher (or built without MPI): a usage error, not a hang.
        if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_none() {
            assert!(parse(&["--backend", "mpi"])
                .unwrap_err()
                .contains("--backend mpi"));
        }
    }

    #[test]
    fn kernel_times_without_profile_names_the_missing_flag() {
        // Regression (#41): clap's `requires` printed "required arguments were not provided:"
        // and the one-line usage error dropped the names that followed.
        let e = parse(&["--kernel-times"]).unwrap_err();
        assert!(e.contains("--kernel-times needs --profile PATH"), "{e}");
        assert!(!e.contains('\n'), "one line: {e}");
        assert!(parse(&["--kernel-times", "--profile", "t.json"]).is_ok());
    }

    #[test]
    fn built_without_mpi_names_the_build_that_works() {
        // Regression (#41): `--features fsdp-core/mpi` builds a binary that still refuses.
        if cfg!(feature = "mpi") || std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
            return;
        }
        let e = parse(&["--backend", "mpi"]).unwrap_err();
        assert!(e.contains("-p fsdp-train --features mpi"), "{e}");
        assert!(!e.contains("fsdp-core/mpi"), "{e}");
        assert!(!e.contains("  ") && !e.contains('\n'), "one line: {e}");
    }

    #[test]
    fn optimizer_flags_reach_the_config() {
        let c = parse(&["--optimizer", "lamb"]).unwrap();
        assert_eq!((c.optimizer, c.lr), (OptimizerArg::Lamb, 1e-3));
        assert_eq!(c.optim_hyper, OptimHyper::defaults(OptimizerArg::Lamb));
        assert_eq!(c.optim_hyper.weight_decay, 0.01);
        let c = parse(&[
            "--optimizer",
            "adamw",
            "--beta1",
            "0.8",
            "--beta2",
            "0.95",
            "--eps",
            "1e-6",
            "--weight-decay",
            "0.1",
        ])
        .unwrap();
        let h = c.optim_hyper;
        assert_eq!(
            (h.beta1, h.beta2, h.eps, h.weight_decay),
            (0.8, 0.95, 1e-6, 0.1)
        );
        let c = parse(&["--momentum", "0.9", "--weight-decay", "1e-4"]).unwrap();
        assert_eq!(
            (c.optim_hyper.momentum, c.optim_hyper.weight_decay),
            (0.9, 1e-4)
        );
        assert_eq!(parse(&[]).unwrap().optim_hyper.weight_decay, 0.0);
        // Flags of another optimizer, and out-of-range values, are usage errors.
        assert!(parse(&["--beta1", "0.8"]).unwrap_err().contains("--beta1"));
        assert!(parse(&["--optimizer", "lamb", "--momentum", "0.9"]).is_err());
        assert!(parse(&["--nesterov"]).is_err());
        assert!(
            parse(&["--momentum", "0.9", "--nesterov"])
                .unwrap()
                .optim_hyper
                .nesterov
        );
        for bad in [
            ["--momentum", "1"],
            ["--beta2", "-0.1"],
            ["--eps", "0"],
            ["--weight-decay", "nan"],
        ] {
            assert!(
                Cli::try_parse_from(std::iter::once("train_gpt").chain(bad)).is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn tokenizer_and_init_from_flags() {
        let c = parse(&["--tokenizer", "gpt2", "--data", "x.txt"]).unwrap();
        assert_eq!(c.model.vocab(), 50257, "vocab set automatically");
        assert_eq!(c.interop.tokenizer, crate::tokenizer::Tokenizer::Gpt2);
        let c = parse(&["--tokenizer", "gpt2", "--data", "x.txt", "--vocab", "50304"]).unwrap();
        assert_eq!(c.model.vocab(), 50304);
        assert!(
            parse(&["--tokenizer", "gpt2", "--data", "x.txt", "--vocab", "50000"])
                .unwrap_err()
                .contains("--vocab 50257 or more")
        );
        assert!(parse(&["--init-from", "m", "--d-model", "64"]).is_err());
        assert!(parse(&["--init-from", "m", "--load", "s.safetensors"]).is_err());
        let c = parse(&["--init-from", "m", "--seq-len", "32", "--sample-every", "5"]).unwrap();
        assert_eq!((c.interop.seq_len, c.interop.sample_every), (Some(32), 5));
    }
}

/// `--resume [WHICH]`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResumeArg {
    /// The newest checkpoint; refused when it is damaged.
    Newest,
    /// The newest undamaged checkpoint (the damaged newer ones are named and skipped).
    LatestValid,
}

/// `--device`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceArg {
    /// Each rank computes on its own CPU device (allocator, streams).
    Cpu,
    /// One CUDA device per rank.
    Cuda,
}
