//! The job's vocabulary, below every other module of the main job: the validated
//! configuration ([`TrainConfig`], [`DataSpec`], [`CudaLaunch`], [`Interop`]), what a run
//! reports ([`StepRecord`], [`Report`], [`Observer`]), why it stops ([`TrainError`]), and the
//! spellings and usage error the command line and the planner share. It imports only leaf
//! modules (data, checkpoint errors, optimizer choice, tokenizer, the model families), so `cli`, `train`, `cuda`,
//! `interop`, `plan` and `report` can all use it without importing each other in a circle.

use std::path::PathBuf;

use fsdp_alloc::DType;
use fsdp_collectives::{CollectiveBackend, RendezvousEnv};
use fsdp_core::state_dict::FullStateDict;
use fsdp_core::{BackwardPrefetch, FsdpError, ShardedOptimizer, ShardingStrategy};
use serde_json::Value;

use crate::ckpt::CheckpointError;
use crate::data::{DataError, DataFormat};
use crate::model::ModelSpec;
use crate::optim::{OptimHyper, OptimizerArg};
use crate::tokenizer::Tokenizer;

/// Largest `--steps`, `--warmup-steps`, `--eval-every`, `--checkpoint-every`, `--sample-every`.
pub const MAX_STEPS: u64 = 10_000_000;

/// Where the training data comes from.
#[derive(Debug, Clone)]
pub enum DataSpec {
    /// The embedded counting sequences.
    Synthetic,
    /// A token file (read with positioned reads).
    File {
        /// The file.
        path: PathBuf,
        /// How to read it.
        format: DataFormat,
        /// The held-out tail.
        val_fraction: f64,
    },
}

/// Everything a run needs (the validated command line).
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// The model: its family and shape.
    pub model: ModelSpec,
    /// Data source.
    pub data: DataSpec,
    /// Evaluate every N steps (0: never).
    pub eval_every: usize,
    /// Validation sequences per evaluation.
    pub eval_seqs: usize,
    /// Sequences per rank per micro-batch.
    pub batch: usize,
    /// Init and data seed.
    pub seed: u64,
    /// Ranks (threads, or MPI processes with `mpi`).
    pub ranks: usize,
    /// One MPI process per rank (`--backend mpi`) instead of thread ranks.
    pub mpi: bool,
    /// GPU ranks (`--device cuda`, see [`crate::cuda`]) and how they are laid out; `None`: CPU
    /// devices.
    pub cuda: Option<CudaLaunch>,
    /// Sharding strategy.
    pub strategy: ShardingStrategy,
    /// Hybrid shard-group size.
    pub shard_size: Option<usize>,
    /// Backward prefetch.
    pub backward_prefetch: BackwardPrefetch,
    /// Forward prefetch.
    pub forward_prefetch: bool,
    /// Rate limiter (ignored when `adaptive_limiter` is set).
    pub limit_all_gathers: bool,
    /// `--limit-all-gathers auto`: the adaptive limiter.
    pub adaptive_limiter: Option<fsdp_core::AdaptiveLimiter>,
    /// `--quantize-collectives`.
    pub quantize_collectives: Option<fsdp_core::Quantization>,
    /// Build on the fake device.
    pub deferred_init: bool,
    /// Low-precision dtype.
    pub mixed_precision: Option<DType>,
    /// CPU offload.
    pub cpu_offload: bool,
    /// Checked devices.
    pub checked: bool,
    /// `--tf32`: f32 matrix products on CUDA devices in TF32 (see
    /// [`fsdp_autograd::kernels::cuda::set_allow_tf32`]).
    pub tf32: bool,
    /// Total optimizer steps.
    pub steps: usize,
    /// Optimizer.
    pub optimizer: OptimizerArg,
    /// Its hyper-parameters besides the learning rate.
    pub optim_hyper: OptimHyper,
    /// `--init-from`, `--export-hf`, `--sample-every`, `--tokenizer` (see [`crate::interop`]).
    pub interop: Interop,
    /// Peak learning rate.
    pub lr: f32,
    /// Linear warm-up steps.
    pub warmup_steps: usize,
    /// Cosine floor (None: no decay).
    pub min_lr: Option<f32>,
    /// Micro-batches per step.
    pub grad_accum: usize,
    /// Local accumulation.
    pub no_sync: bool,
    /// Gradient clipping.
    pub clip_grad_norm: Option<f64>,
    /// Checkpoint directory.
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoint period (with a directory but no period: only at the end).
    pub checkpoint_every: Option<usize>,
    /// Checkpoints kept.
    pub keep_checkpoints: usize,
    /// Resume from the newest checkpoint (refused when damaged).
    pub resume: bool,
    /// `--resume latest-valid`: fall back to the newest undamaged checkpoint.
    pub resume_latest_valid: bool,
    /// Full state dict to load.
    pub load: Option<PathBuf>,
    /// Full state dict to save.
    pub save: Option<PathBuf>,
    /// Stop after this step as if the process died there (tests of resume); `None` in real runs.
    pub stop_after: Option<usize>,
    /// `--profile`: write a Chrome trace (Perfetto / chrome://tracing JSON) of one step here.
    pub profile: Option<PathBuf>,
}

impl TrainConfig {
    /// Learning rate of step `s` (0-based): linear warm-up to `lr` over `warmup_steps`, then
    /// constant, or with `min_lr` a cosine decay reaching `min_lr` at the last step.
    pub fn lr_at(&self, s: usize) -> f32 {
        let w = self.warmup_steps;
        if s < w {
            return self.lr * (s + 1) as f32 / w as f32;
        }
        match self.min_lr {
            None => self.lr,
            Some(min) => {
                let span = (self.steps - w).saturating_sub(1).max(1) as f64;
                let progress = ((s - w) as f64 / span).min(1.0);
                let c = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
                (min as f64 + (self.lr - min) as f64 * c) as f32
            }
        }
    }

    /// Tokens of one optimizer step (global batch × sequence length).
    pub fn tokens_per_step(&self) -> usize {
        self.ranks * self.grad_accum * self.batch * self.model.seq_len()
    }

    /// The rank's optimizer at the peak learning rate (see [`crate::optim`]).
    pub fn build_optimizer(&self) -> Box<dyn ShardedOptimizer> {
        self.optimizer.build(self.lr, &self.optim_hyper)
    }

    /// The collective backend the ranks run on: MPI for `--backend mpi` (CPU ranks, or GPU
    /// ranks staged through host memory); for GPU ranks NCCL (a thread or a process per GPU) or
    /// the shared-GPU backend (more thread ranks than GPUs: all on `cuda:0`); else thread ranks.
    pub fn backend(&self) -> CollectiveBackend {
        match (self.cuda, self.mpi) {
            (Some(CudaLaunch::Mpi), _) | (None, true) => CollectiveBackend::Mpi,
            (Some(CudaLaunch::Threads), _) => CollectiveBackend::NcclThreads,
            (Some(CudaLaunch::SharedGpu), _) => CollectiveBackend::SharedGpu {
                ordinal: SHARED_GPU_ORDINAL,
            },
            (Some(CudaLaunch::Processes), _) => CollectiveBackend::Nccl,
            (None, false) => CollectiveBackend::Thread,
        }
    }
}

/// Why a run stopped.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A non-finite value: the run stops there and saves nothing.
    #[error("step {step}: the {what} is {value} (not finite); training stopped, no checkpoint or state dict was written after it — lower --lr, add --warmup-steps or --clip-grad-norm")]
    NonFinite {
        /// 1-based step.
        step: usize,
        /// `loss`, `gradient norm` or `parameter norm`.
        what: &'static str,
        /// The value.
        value: f64,
    },
    /// The data.
    #[error(transparent)]
    Data(#[from] DataError),
    /// The checkpoint directory.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// FSDP, a collective or a device.
    #[error("rank {rank}: {context}: {source}")]
    Fsdp {
        /// Rank.
        rank: usize,
        /// What it was doing.
        context: String,
        /// The cause.
        source: Box<FsdpError>,
    },
    /// The state-dict functions.
    #[error("rank {rank}: {context}: {source}")]
    StateDict {
        /// Rank.
        rank: usize,
        /// What it was doing.
        context: String,
        /// The cause.
        source: Box<fsdp_core::StateDictError>,
    },
    /// Another rank failed (its error is reported by it, and passed on here).
    #[error("rank {rank}: stopped because rank {peer} failed at {what}: {reason}")]
    PeerFailed {
        /// Rank.
        rank: usize,
        /// Where.
        what: &'static str,
        /// The (lowest) failing rank.
        peer: usize,
        /// That rank's error message (at most 1 KiB of it).
        reason: String,
    },
    /// A rank thread could not be started or panicked.
    #[error("{0}")]
    Thread(String),
    /// Writing the `--profile` trace failed.
    #[error("{0}")]
    Profile(String),
    /// `--init-from`, `--export-hf` or `--sample-every` failed.
    #[error("{0}")]
    Interop(String),
}

/// One step as rank 0 reports it (values reduced over all ranks).
#[derive(Debug, Clone)]
pub struct StepRecord {
    /// 1-based step.
    pub step: usize,
    /// Global-batch mean cross-entropy.
    pub loss: f32,
    /// Validation loss when evaluated at this step.
    pub val_loss: Option<f32>,
    /// Learning rate used.
    pub lr: f32,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Rank 0's wall time of the step.
    pub secs: f64,
    /// Host-side waits of rank 0's issuing thread on streams and events
    /// (`fsdp_alloc::stream::host_syncs`) while uploading the step's batches and from the first
    /// forward until the optimizer step was launched (the end-of-step synchronize and the ranks'
    /// agreement on the data are not counted).
    pub host_syncs: u64,
    /// Tokens of the global batch over `secs`.
    pub tokens_per_s: f64,
    /// Max over ranks of the step's peak allocated bytes.
    pub peak_allocated: u64,
    /// Max over ranks of the peak reserved bytes (the allocator's footprint).
    pub peak_reserved: u64,
    /// Sum over ranks of allocation retries.
    pub retries: u64,
    /// Max over ranks of the bytes allocated after the optimizer step (before zero_grad).
    pub state_bytes: u64,
    /// Rank 0's all-gather bytes in the step.
    pub ag: u64,
    /// Rank 0's reduce-scatter bytes.
    pub rs: u64,
    /// Rank 0's all-reduce bytes.
    pub ar: u64,
}

/// Rank 0's view of progress (progress bar, metrics file, plain lines).
pub trait Observer: Send {
    /// Training starts at 1-based step `first` of `total`.
    fn start(&mut self, _first: usize, _total: usize) {}
    /// A step finished.
    fn step(&mut self, _rec: &StepRecord) {}
    /// A line of information (checkpoint written, resumed from ...).
    fn note(&mut self, _line: &str) {}
    /// The run ended: clear the bar, flush files; an output error is returned.
    fn finish(&mut self) -> Result<(), String> {
        Ok(())
    }
}

/// Does nothing (tests).
pub struct Quiet;
impl Observer for Quiet {}

/// What rank 0 returns.
pub struct Report {
    /// The rank that returned it (0 except in the other processes of an MPI job).
    pub rank: usize,
    /// This run's steps.
    pub steps: Vec<StepRecord>,
    /// The metric history since step 1 (resumed runs include the saved part): objects with
    /// `step`, `loss`, `val_loss`, `tokens_per_s`.
    pub history: Vec<Value>,
    /// First step of this run (1-based).
    pub first_step: usize,
    /// Units.
    pub units: usize,
    /// Bytes of all f32 parameters (4Ψ).
    pub total_param_bytes: usize,
    /// Bytes of the largest unit.
    pub max_unit_bytes: usize,
    /// Number of optimizer state slots.
    pub optim_slots: usize,
    /// Rank 0's totals over the run.
    pub total_ag: u64,
    /// Rank 0's totals over the run.
    pub total_rs: u64,
    /// Rank 0's totals over the run.
    pub total_ar: u64,
    /// The observer, handed back.
    pub observer: Box<dyn Observer>,
    /// The final parameters, gathered (only when asked for: the resume tests compare them).
    #[cfg_attr(not(test), allow(dead_code))]
    pub final_params: Option<FullStateDict>,
}

/// The GPU every rank of a shared-GPU run computes on (the first visible one; pick another
/// with `CUDA_VISIBLE_DEVICES`).
pub const SHARED_GPU_ORDINAL: usize = 0;

/// How the ranks of a CUDA run are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaLaunch {
    /// One process, a thread per GPU, NCCL between them (`--device cuda`, at most as many
    /// ranks as visible GPUs).
    Threads,
    /// One process, W thread ranks sharing `cuda:0`, collectives through the GPU's memory
    /// (`--device cuda --ranks W` with fewer than W visible GPUs; fsdp-collectives'
    /// `SharedGpuGroup`).
    SharedGpu,
    /// One process per GPU under a launcher, NCCL (`--device cuda --backend nccl`).
    Processes,
    /// One MPI process per rank, each on its local rank's GPU modulo the visible GPUs (several
    /// on one GPU when there are fewer GPUs than processes), collectives staged through host
    /// memory (`--device cuda --backend mpi`; fsdp-collectives' `HostStaged`).
    Mpi,
}

impl CudaLaunch {
    /// The GPU of `rank` when `visible` GPUs are visible: the rank itself for a thread per GPU;
    /// [`SHARED_GPU_ORDINAL`] for shared-GPU thread ranks; the launcher's local rank (else the
    /// rank) for processes, modulo `visible` under MPI.
    pub fn ordinal(self, rank: usize, visible: usize) -> usize {
        let local = || {
            RendezvousEnv::from_env()
                .ok()
                .and_then(|e| e.local_rank)
                .or_else(|| {
                    fsdp_collectives::store::LaunchEnv::from_env()
                        .ok()?
                        .local_rank
                })
                .unwrap_or(rank)
        };
        match self {
            CudaLaunch::Threads => rank,
            CudaLaunch::SharedGpu => SHARED_GPU_ORDINAL,
            CudaLaunch::Processes => local(),
            CudaLaunch::Mpi => local() % visible.max(1),
        }
    }

    /// One phrase for the banner: where the ranks run and which backend moves their data.
    pub fn describe(self, ranks: usize) -> String {
        match self {
            CudaLaunch::Threads => "CUDA: a thread per GPU, NCCL".into(),
            CudaLaunch::SharedGpu => format!(
                "backend: shared-gpu ({ranks} thread ranks on cuda:{SHARED_GPU_ORDINAL}; \
                 collectives through GPU memory, link speeds not shown)"
            ),
            CudaLaunch::Processes => "CUDA: a process per GPU, NCCL".into(),
            CudaLaunch::Mpi => "CUDA: a process per rank on its local rank's GPU (modulo the \
                                visible GPUs), MPI with host staging (across GPUs --backend \
                                nccl moves the data on the device)"
                .into(),
        }
    }
}

/// The validated flags.
#[derive(Debug, Clone, Default)]
pub struct Interop {
    /// The text tokenizer.
    pub tokenizer: Tokenizer,
    /// `--init-from`.
    pub init_from: Option<PathBuf>,
    /// An explicit `--vocab` (with `--init-from`: at least the checkpoint's).
    pub vocab: Option<usize>,
    /// An explicit `--seq-len` (with `--init-from`: at most `n_positions`).
    pub seq_len: Option<usize>,
    /// `--export-hf`.
    pub export_hf: Option<PathBuf>,
    /// `--sample-every` (0: never).
    pub sample_every: usize,
    /// `--gelu` when given (with `--init-from`: it must be the model's).
    pub gelu: Option<fsdp_autograd::nn::Gelu>,
    /// An explicit `--dropout` (with `--init-from`: replaces config.json's probabilities).
    pub dropout: Option<f32>,
}

/// A command line that parses but does not make sense (exit 2, like clap's own errors).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The `--strategy` spelling of a strategy (its name in fsdp-core's strategy table).
pub fn strategy_name(s: ShardingStrategy) -> &'static str {
    s.name()
}

/// The `--backward-prefetch` spelling.
pub fn prefetch_name(p: BackwardPrefetch) -> &'static str {
    match p {
        BackwardPrefetch::None => "none",
        BackwardPrefetch::BackwardPre => "pre",
        BackwardPrefetch::BackwardPost => "post",
    }
}
